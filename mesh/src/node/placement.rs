//! Tier placement at node start: plan one core set per tier from this host's topology
//! (`mesh_control::placement`), cap each tier's llama.cpp threads to it, and in `bind`
//! mode bind the node's own threads to the cores no tier got and make each engine thread
//! bind itself to its tier's cores before it creates its llama.cpp context.
//!
//! On a host with GPUs, [`apply_gpus`] also plans which GPU each tier's offloaded layers go
//! to (`mesh_control::placement::plan_gpus`, by the device memory each tier takes) and
//! writes the choice into the tier configs.

use mesh_control::placement::{
    self, GpuChoice, GpuDemand, GpuPlan, GpuSpace, PlacementConfig, PlacementMode, PlacementPlan,
    TierDemand,
};
use mesh_control::topology::Topology;
use mesh_tiers::{EngineConfig, GpuLayers, ModelShape, ThreadSetup};
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
    // their tier's cores; what an engine thread starts after that (llama.cpp workers, its
    // KV page writer) inherits the tier's cores. Its `kv-publish` thread, which cuts pages,
    // starts before the binding and runs with the node's threads.
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

/// What each tier asks of the GPUs: the device bytes of its offloaded layers
/// (`mesh_tiers::tier_device_bytes`) and the GPU its config names. A tier whose model cannot
/// be read asks for nothing here; it fails with its own error when it starts.
pub fn gpu_demands(tiers: &[EngineConfig]) -> Vec<GpuDemand> {
    tiers
        .iter()
        .map(|t| {
            let bytes = if t.gpu_layers == GpuLayers::Count(0) {
                0
            } else {
                match ModelShape::read(&t.model) {
                    Ok(shape) => {
                        let draft = t
                            .draft
                            .as_ref()
                            .and_then(|d| ModelShape::read(&d.model).ok());
                        mesh_tiers::tier_device_bytes(
                            t,
                            &shape,
                            draft.as_ref(),
                            mesh_tiers::host_kept_bytes(t),
                        )
                    }
                    Err(e) => {
                        warn!(tier = %t.name, error = %e, "model shape unread: no gpu plan for it");
                        0
                    }
                }
            };
            GpuDemand {
                tier: t.name.clone(),
                bytes,
                pinned: t.gpu,
            }
        })
        .collect()
}

/// Writes a GPU plan into the tier configs: a tier planned on one GPU of several runs on it
/// (`gpu`); a tier that fits in no GPU memory keeps its layers on the CPU
/// (`gpu_layers = 0`); a split tier and a single GPU's tiers are left to llama.cpp, whose
/// default is the same.
pub fn apply_gpu_plan(plan: &GpuPlan, gpu_count: usize, tiers: &mut [EngineConfig]) {
    for t in tiers.iter_mut() {
        let Some(a) = plan.tiers.iter().find(|a| a.tier == t.name) else {
            continue;
        };
        match a.choice {
            GpuChoice::Gpu(i) if gpu_count > 1 && t.gpu.is_none() => t.gpu = Some(i),
            GpuChoice::Cpu if a.bytes > 0 => t.gpu_layers = GpuLayers::Count(0),
            _ => {}
        }
    }
}

/// The GPU plan of these tiers over `gpus` (this host's, [`mesh_tiers::gpu::gpus`]); `None`
/// without a GPU or when every tier stays on the CPU by its config.
pub fn gpu_plan_for(tiers: &[EngineConfig], gpus: &[mesh_tiers::gpu::Device]) -> Option<GpuPlan> {
    if gpus.is_empty() || tiers.iter().all(|t| t.gpu_layers == GpuLayers::Count(0)) {
        return None;
    }
    let spaces: Vec<GpuSpace> = gpus
        .iter()
        .enumerate()
        .map(|(index, g)| GpuSpace {
            index,
            free: g.memory_free,
        })
        .collect();
    Some(placement::plan_gpus(&spaces, &gpu_demands(tiers)))
}

/// Plans, logs and applies the GPU plan on a host with GPUs; `None` (the tier configs
/// untouched) when [`gpu_plan_for`] has none.
pub fn apply_gpus(tiers: &mut [EngineConfig]) -> Option<GpuPlan> {
    if tiers.iter().all(|t| t.gpu_layers == GpuLayers::Count(0)) {
        return None;
    }
    let gpus = mesh_tiers::gpu::gpus();
    let plan = gpu_plan_for(tiers, &gpus)?;
    info!(target: "mesh::placement", "gpu plan over {} gpus", gpus.len());
    for line in plan.render().lines() {
        info!(target: "mesh::placement", "{line}");
    }
    apply_gpu_plan(&plan, gpus.len(), tiers);
    Some(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mesh_control::placement::GpuAssignment;

    fn plan(choices: &[(&str, u64, GpuChoice)]) -> GpuPlan {
        GpuPlan {
            tiers: choices
                .iter()
                .map(|&(tier, bytes, choice)| GpuAssignment {
                    tier: tier.into(),
                    bytes,
                    choice,
                })
                .collect(),
            ..GpuPlan::default()
        }
    }

    fn tier(name: &str) -> EngineConfig {
        EngineConfig {
            name: name.into(),
            ..EngineConfig::default()
        }
    }

    #[test]
    fn a_tier_planned_on_one_of_several_gpus_is_set_to_it() {
        let mut tiers = [tier("t1"), tier("t2")];
        apply_gpu_plan(
            &plan(&[("t1", 1, GpuChoice::Gpu(1)), ("t2", 1, GpuChoice::Split)]),
            2,
            &mut tiers,
        );
        assert_eq!((tiers[0].gpu, tiers[1].gpu), (Some(1), None));
    }

    #[test]
    fn a_tier_that_fits_no_gpu_keeps_its_layers_on_the_cpu() {
        let mut tiers = [tier("big")];
        apply_gpu_plan(&plan(&[("big", 1, GpuChoice::Cpu)]), 1, &mut tiers);
        assert_eq!(tiers[0].gpu_layers, GpuLayers::Count(0));
    }

    #[test]
    fn a_single_gpus_tiers_are_left_to_llama_cpp() {
        let mut tiers = [tier("t1")];
        apply_gpu_plan(&plan(&[("t1", 1, GpuChoice::Gpu(0))]), 1, &mut tiers);
        assert_eq!((tiers[0].gpu, tiers[0].gpu_layers), (None, GpuLayers::All));
    }
}
