//! Far memory: where the page store keeps pages it demotes from RAM before they are
//! only on disk.
//!
//! Far memory is a NUMA node without CPUs (CXL-attached DRAM, memory-only HBM or
//! persistent memory): larger and slower than local RAM, much faster than disk. The
//! store does not know how such memory is obtained; it asks a [`FarMemory`] to copy a
//! page in and gets back [`Bytes`] that live there until dropped. The node implements
//! the trait with hwloc (`mesh_control::farmem`), so this crate stays free of it.

use bytes::Bytes;

/// Why far memory could not take a page.
#[derive(Debug, thiserror::Error)]
pub enum FarMemoryError {
    /// The far node had no room, or binding the allocation to it failed; the page
    /// is then held only by the disk tier (or dropped without one).
    #[error("far memory allocation of {bytes} bytes failed: {reason}")]
    Allocation {
        /// Bytes asked for.
        bytes: usize,
        /// What the allocator said.
        reason: String,
    },
}

/// An allocator of memory on far NUMA nodes.
pub trait FarMemory: Send + Sync + std::fmt::Debug {
    /// Copies `page` into newly allocated far memory; the memory is freed when the
    /// returned bytes (and all their clones) are dropped.
    fn copy_in(&self, page: &[u8]) -> Result<Bytes, FarMemoryError>;

    /// OS indices of the NUMA nodes the memory comes from (what `numactl` calls them).
    fn nodes(&self) -> Vec<u32>;
}
