//! Tier placement at node start: plan one core set per tier from this host's topology
//! (`mesh_control::placement`), cap each tier's llama.cpp threads to it, and in `bind`
//! mode bind the node's own threads to the cores no tier got and make each engine thread
//! bind itself to its tier's cores before it creates its llama.cpp context.

use mesh_control::placement::{self, PlacementConfig, PlacementMode, PlacementPlan, TierDemand};
use mesh_control::topology::Topology;
use mesh_tiers::{EngineConfig, ThreadSetup};
use tracing::{info, warn};

/// The plan for these tiers' configured thread counts.
pub fn plan_for(topo: &Topology, tiers: &[EngineConfig]) -> PlacementPlan {
    let demands: Vec<TierDemand> = tiers
        .iter()
        .map(|t| TierDemand {
            tier: t.name.clone(),
            threads: usize::try_from(t.threads.max(1)).unwrap_or(1),
        })
        .collect();
    placement::plan(topo, &demands)
}

/// Plans, logs, and applies the plan to the tier configs (threads; in `bind` mode a
/// thread setup step). `None` when placement is off.
pub fn apply(cfg: &PlacementConfig, tiers: &mut [EngineConfig]) -> Option<PlacementPlan> {
    if cfg.mode == PlacementMode::Off || tiers.is_empty() {
        return None;
    }
    let topo = Topology::detect();
    let plan = plan_for(&topo, tiers);
    for line in plan.render().lines() {
        info!(target: "mesh::placement", "{line}");
    }
    // The node's own threads (tokio workers, transport; every thread that exists now, and
    // those started later from them) go to the cores no tier got, so they never preempt a
    // tier's llama.cpp threads. The engine threads start after this and bind themselves to
    // their tier's cores; what an engine thread starts (llama.cpp workers, its KV page
    // writer) inherits the tier's cores.
    if cfg.mode == PlacementMode::Bind && plan.bound && !plan.node_pus.is_empty() {
        match placement::bind_process(&plan.node_pus) {
            Ok(()) => info!(pus = ?plan.node_pus, "node threads bound"),
            Err(e) => warn!(error = %e, "node threads left unbound"),
        }
    }
    for t in tiers.iter_mut() {
        let Some(p) = plan.tiers.iter().find(|p| p.tier == t.name) else {
            continue;
        };
        t.threads = i32::try_from(p.threads).unwrap_or(i32::MAX).max(1);
        if cfg.mode == PlacementMode::Bind && plan.bound {
            let p = p.clone();
            t.thread_setup = ThreadSetup::new(move || match placement::bind_current_thread(&p) {
                Ok(o) => {
                    info!(tier = %p.tier, pus = ?p.pus, memory = ?o.memory, notes = ?o.notes, "engine thread bound")
                }
                Err(e) => warn!(tier = %p.tier, error = %e, "engine thread left unbound"),
            });
        }
    }
    if cfg.mode == PlacementMode::Bind && !plan.bound {
        warn!("placement mode is bind but the plan could not bind: tiers run unbound");
    }
    Some(plan)
}
