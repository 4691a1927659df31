//! Far memory for the KV page store: page buffers placed on this host's CPU-less NUMA
//! nodes (CXL-attached DRAM, memory-only HBM, persistent memory exposed as a node)
//! through hwloc. [`HwlocFarMemory`] is the node's [`mesh_kvstore::FarMemory`].
//!
//! Each page is one `hwloc_alloc_membind` allocation (policy `Bind`, flag `STRICT`, so an
//! allocation the OS cannot place on the far nodes fails instead of quietly landing in
//! local RAM), freed when the last clone of its [`Bytes`] is dropped. Allocations are
//! whole OS pages: a 33 KiB page occupies 36 KiB of the node.
//!
//! [`HwlocFarMemory::detect`] looks for CPU-less nodes in the [`Topology`] snapshot and
//! probes one bound allocation; without such a node it returns
//! [`ControlError::NoFarMemory`] and the node runs its page stores without the tier. The
//! development VM has no CPU-less node, so there only that path runs in production; its
//! tests also bind page memory to the ordinary node 0, which runs the same allocation code.

use std::sync::OnceLock;

use bytes::Bytes;
use hwlocality::memory::binding::{MemoryBindingFlags, MemoryBindingPolicy};
use hwlocality::memory::nodeset::NodeSet;
use mesh_kvstore::{FarMemory, FarMemoryError};

use crate::topology::Topology;
use crate::ControlError;

/// Share of the far nodes' memory the page stores take when `kv_pages.far_bytes` is unset.
pub const AUTO_FAR_FRACTION: u64 = 4;

/// The far budget of each paged tier that leaves `kv_pages.far_bytes` unset: a quarter
/// (1 / [`AUTO_FAR_FRACTION`]) of the far nodes' memory, split evenly among those tiers;
/// 0 (no tier) when the nodes' size is unknown or no tier asks.
pub fn auto_far_bytes(far_memory_bytes: Option<u64>, auto_tiers: usize) -> u64 {
    match (far_memory_bytes, auto_tiers) {
        (Some(b), n) if n > 0 => b / AUTO_FAR_FRACTION / n as u64,
        _ => 0,
    }
}

/// The hwloc topology the allocations are made from. Allocations borrow it, and pages
/// live as long as the store, so there is one for the whole process.
fn hwloc() -> Result<&'static hwlocality::Topology, ControlError> {
    static TOPOLOGY: OnceLock<Result<hwlocality::Topology, String>> = OnceLock::new();
    TOPOLOGY
        .get_or_init(|| hwlocality::Topology::new().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| ControlError::Bind(format!("page memory: hwloc unavailable: {e}")))
}

/// Page memory bound to far NUMA nodes.
pub struct HwlocFarMemory {
    topo: &'static hwlocality::Topology,
    set: NodeSet,
    nodes: Vec<u32>,
    memory_bytes: Option<u64>,
}

impl std::fmt::Debug for HwlocFarMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HwlocFarMemory")
            .field("nodes", &self.nodes)
            .field("memory_bytes", &self.memory_bytes)
            .finish()
    }
}

impl HwlocFarMemory {
    /// Far memory on every CPU-less NUMA node of `topo`; [`ControlError::NoFarMemory`]
    /// when there is none, [`ControlError::Bind`] when memory cannot be bound to them.
    pub fn detect(topo: &Topology) -> Result<Self, ControlError> {
        let far: Vec<_> = topo.far_memory().collect();
        if far.is_empty() {
            return Err(ControlError::NoFarMemory);
        }
        let nodes: Vec<u32> = far.iter().map(|n| n.os_index).collect();
        let sizes: Option<Vec<u64>> = far.iter().map(|n| n.memory_bytes).collect();
        Self::on_nodes(&nodes, sizes.map(|s| s.iter().sum()))
    }

    /// Page memory on the NUMA nodes `nodes` (OS indices) holding `memory_bytes` in all,
    /// when known. Any node works (tests use an ordinary one); one bound allocation is
    /// made to check that the OS accepts the binding.
    pub fn on_nodes(nodes: &[u32], memory_bytes: Option<u64>) -> Result<Self, ControlError> {
        let mut set = NodeSet::new();
        for &n in nodes {
            set.set(n as usize);
        }
        let me = Self {
            topo: hwloc()?,
            set,
            nodes: nodes.to_vec(),
            memory_bytes,
        };
        me.copy_in(&[0]).map_err(|e| {
            ControlError::Bind(format!("page memory to NUMA node(s) {nodes:?}: {e}"))
        })?;
        Ok(me)
    }

    /// Memory of the nodes in bytes, when hwloc reports it.
    pub fn memory_bytes(&self) -> Option<u64> {
        self.memory_bytes
    }

    /// NUMA nodes (OS indices) where the OS placed the memory of `bytes`.
    pub fn location(&self, bytes: &[u8]) -> Result<Vec<u32>, ControlError> {
        let set: NodeSet = self
            .topo
            .area_memory_location(bytes, MemoryBindingFlags::empty())
            .map_err(|e| ControlError::Bind(format!("page memory location: {e}")))?;
        Ok(set.iter_set().map(|i| usize::from(i) as u32).collect())
    }
}

/// One page in bound memory; every byte was written before it was wrapped.
struct FarPage(hwlocality::memory::binding::Bytes<'static>);

impl AsRef<[u8]> for FarPage {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `copy_in` initialized all `len()` bytes, and `u8` has the layout of
        // `MaybeUninit<u8>`.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr().cast::<u8>(), self.0.len()) }
    }
}

impl FarMemory for HwlocFarMemory {
    fn copy_in(&self, page: &[u8]) -> Result<Bytes, FarMemoryError> {
        if page.is_empty() {
            return Ok(Bytes::new());
        }
        let mut buf = self
            .topo
            .allocate_bound_memory(
                page.len(),
                &self.set,
                MemoryBindingPolicy::Bind,
                MemoryBindingFlags::STRICT,
            )
            .map_err(|e| FarMemoryError::Allocation {
                bytes: page.len(),
                reason: e.to_string(),
            })?;
        assert_eq!(buf.len(), page.len(), "hwloc allocated what was asked");
        // SAFETY: `buf` is a fresh allocation of exactly `page.len()` bytes that does not
        // overlap `page`.
        unsafe {
            std::ptr::copy_nonoverlapping(page.as_ptr(), buf.as_mut_ptr().cast::<u8>(), page.len())
        };
        Ok(Bytes::from_owner(FarPage(buf)))
    }

    fn nodes(&self) -> Vec<u32> {
        self.nodes.clone()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use mesh_kvstore::{PageMeta, PageStore, StoreConfig};

    use super::*;

    #[test]
    fn auto_budget_is_a_quarter_split_among_tiers() {
        assert_eq!(auto_far_bytes(Some(64 << 30), 2), 8 << 30);
        assert_eq!(auto_far_bytes(Some(64 << 30), 1), 16 << 30);
        assert_eq!(auto_far_bytes(None, 2), 0, "size unknown: no tier");
        assert_eq!(auto_far_bytes(Some(64 << 30), 0), 0);
    }

    /// This VM has no far memory: detection says so and a store opened as the node opens
    /// it (no allocator) runs on RAM alone.
    #[test]
    fn this_host_has_no_far_memory_and_the_store_runs_without_the_tier() {
        let topo = Topology::detect();
        assert_eq!(
            topo.far_memory().count(),
            0,
            "a CPU-less NUMA node appeared on the test host: {:?}",
            topo.numa_nodes
        );
        let err = HwlocFarMemory::detect(&topo).unwrap_err();
        assert!(matches!(err, ControlError::NoFarMemory), "{err}");
        let far: Option<Arc<dyn FarMemory>> = HwlocFarMemory::detect(&topo)
            .ok()
            .map(|m| Arc::new(m) as Arc<dyn FarMemory>);
        let s = PageStore::open(StoreConfig {
            ram_bytes: 1 << 20,
            disk_dir: None,
            disk_bytes: 0,
            far,
            far_bytes: 1 << 20,
        });
        assert_eq!(s.far_nodes(), None);
        let meta = PageMeta {
            id: mesh_kvstore::PageId([1; 32]),
            salt: mesh_kvstore::Salt([2; 32]),
            block: 4,
            index: 0,
        };
        assert!(s.put(&meta, &[7; 64]));
        assert_eq!(s.get(&meta.id, &meta.salt).unwrap()[..], [7u8; 64][..]);
    }

    /// The allocation path, bound to an ordinary node since there is no far one here.
    #[test]
    fn pages_bound_to_a_node_round_trip_and_stay_there() {
        let topo = Topology::detect();
        let Some(node) = topo.numa_nodes.first().map(|n| n.os_index) else {
            // hwloc unavailable: the fallback topology knows no nodes.
            assert!(!topo.source.starts_with("hwloc"), "{topo:?}");
            return;
        };
        let mem = HwlocFarMemory::on_nodes(&[node], None).expect("binding to node 0 works here");
        assert_eq!(mem.nodes(), vec![node]);
        let page: Vec<u8> = (0..40_000u32).map(|i| (i % 251) as u8).collect();
        let b = mem.copy_in(&page).unwrap();
        assert_eq!(b[..], page[..]);
        assert_eq!(mem.location(&b).unwrap(), vec![node]);
        let clone = b.clone();
        drop(b);
        assert_eq!(clone[..], page[..], "freed only with the last clone");
        // A node that does not exist is refused at start, not at the first page.
        let err = HwlocFarMemory::on_nodes(&[1000], None).unwrap_err();
        assert!(matches!(err, ControlError::Bind(_)), "{err}");
    }
}
