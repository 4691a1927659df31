//! The KV page stores' far-memory tier at node start: find this host's CPU-less NUMA
//! nodes (`mesh_control::farmem`), give each paged tier its far budget
//! (`kv_pages.far_bytes`, or a share of the far nodes' memory when unset) and the
//! allocator, and say in one log line what came of it. Without far memory the tiers keep
//! RAM and disk only.

use std::sync::Arc;

use mesh_control::farmem::{self, HwlocFarMemory};
use mesh_control::topology::{human_bytes, Topology};
use mesh_control::ControlError;
use mesh_tiers::EngineConfig;
use tracing::{info, warn};

/// Whether the far tier is on, and for which tiers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FarTier {
    /// No paged tier asks for one (paging off, or `kv_pages.far_bytes = 0`).
    NotWanted,
    /// Wanted but unavailable: the reason (no CPU-less node, or the binding error).
    Disabled(String),
    /// On: the far nodes and each tier's budget.
    On {
        /// OS indices of the far NUMA nodes.
        nodes: Vec<u32>,
        /// Tier name and its far budget in bytes.
        budgets: Vec<(String, u64)>,
    },
}

impl FarTier {
    /// One line for `mesh topology`.
    pub fn render(&self) -> String {
        match self {
            FarTier::NotWanted => "off (no paged tier asks for it)".into(),
            FarTier::Disabled(why) => format!("disabled: {why}"),
            FarTier::On { nodes, budgets } => {
                let list: Vec<String> = budgets
                    .iter()
                    .map(|(n, b)| format!("{n} {}", human_bytes(*b)))
                    .collect();
                format!("NUMA node(s) {nodes:?}: {}", list.join(", "))
            }
        }
    }
}

/// Sets up the far tier for `tiers` on the host `topo`, logging the outcome once.
pub fn apply(topo: &Topology, tiers: &mut [EngineConfig]) -> FarTier {
    let wants = |t: &EngineConfig| t.kv_pages.block > 0 && t.kv_pages.far_bytes != Some(0);
    if !tiers.iter().any(wants) {
        return FarTier::NotWanted;
    }
    let mem = match HwlocFarMemory::detect(topo) {
        Ok(m) => Arc::new(m),
        Err(ControlError::NoFarMemory) => {
            info!("far memory: none found, KV page far tier disabled");
            return FarTier::Disabled("none found".into());
        }
        Err(e) => {
            warn!(error = %e, "far memory: KV page far tier disabled");
            return FarTier::Disabled(e.to_string());
        }
    };
    let auto_tiers = tiers
        .iter()
        .filter(|t| wants(t) && t.kv_pages.far_bytes.is_none())
        .count();
    let auto = farmem::auto_far_bytes(mem.memory_bytes(), auto_tiers);
    let mut budgets = vec![];
    for t in tiers.iter_mut().filter(|t| wants(t)) {
        let b = t.kv_pages.far_bytes.unwrap_or(auto);
        t.kv_pages.far_bytes = Some(b);
        if b > 0 {
            t.kv_far_memory = Some(mem.clone());
        }
        budgets.push((t.name.clone(), b));
    }
    let on = FarTier::On {
        nodes: mesh_kvstore::FarMemory::nodes(mem.as_ref()),
        budgets,
    };
    info!(
        "far memory: {}; KV page far tier: {}",
        mem.memory_bytes()
            .map_or("size unknown".into(), human_bytes),
        on.render()
    );
    on
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tier(name: &str, block: usize, far_bytes: Option<u64>) -> EngineConfig {
        let mut t = EngineConfig {
            name: name.into(),
            ..EngineConfig::default()
        };
        t.kv_pages.block = block;
        t.kv_pages.far_bytes = far_bytes;
        t
    }

    /// This VM has no CPU-less NUMA node: the tier is disabled and no engine gets an
    /// allocator, so its page store opens without the far tier.
    #[test]
    fn without_far_memory_no_tier_gets_one() {
        let topo = Topology::detect();
        assert_eq!(topo.far_memory().count(), 0, "{:?}", topo.numa_nodes);
        let mut tiers = vec![tier("t1", 32, None), tier("t3", 32, Some(1 << 30))];
        assert_eq!(
            apply(&topo, &mut tiers),
            FarTier::Disabled("none found".into())
        );
        assert!(tiers.iter().all(|t| t.kv_far_memory.is_none()));
        assert_eq!(apply(&topo, &mut tiers).render(), "disabled: none found");
        // Nobody asks: no detection at all.
        let mut off = vec![tier("t1", 32, Some(0)), tier("t2", 0, None)];
        assert_eq!(apply(&topo, &mut off), FarTier::NotWanted);
    }

    /// A synthetic host whose CPU-less node is made of this VM's node 0 would bind
    /// pages there; what matters here is the budgets: explicit ones are kept, unset
    /// ones split a quarter of the node.
    #[test]
    fn budgets_on_a_host_with_far_memory() {
        let real = Topology::detect();
        let Some(node) = real.numa_nodes.first().cloned() else {
            return; // no hwloc: nothing to bind to
        };
        let mut topo = real.clone();
        topo.numa_nodes = vec![mesh_control::topology::NumaNode {
            pus: vec![],
            memory_bytes: Some(8 << 30),
            ..node
        }];
        let mut tiers = vec![
            tier("t1", 32, None),
            tier("t2", 32, Some(1 << 20)),
            tier("t3", 32, None),
            tier("t4", 0, None),
        ];
        let FarTier::On { nodes, budgets } = apply(&topo, &mut tiers) else {
            panic!("far tier not on");
        };
        assert_eq!(nodes, vec![topo.numa_nodes[0].os_index]);
        assert_eq!(
            budgets,
            vec![
                ("t1".into(), 1 << 30),
                ("t2".into(), 1 << 20),
                ("t3".into(), 1 << 30)
            ]
        );
        assert!(tiers[..3].iter().all(|t| t.kv_far_memory.is_some()));
        assert!(tiers[3].kv_far_memory.is_none());
    }
}
