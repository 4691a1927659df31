//! mesh KV pages: prefix KV cache cut into content-addressed pages.
//!
//! - [`id`]: page identity, a salted blake3 chain over full token blocks.
//! - [`codec`]: cut llama.cpp's per-sequence state into per-block pages and
//!   reassemble any prefix into a restorable state (format in `shared/KV-STATE-NOTES.md`).
//! - [`page`]: the stored form of a page (header with id, salt and checksum).
//! - [`index`]: which peers hold which pages, one index over all of them for routing.
//! - [`log`]: a node's page events (numbered stored/removed changes, snapshots) that
//!   keep its peers' indexes in step.
//! - [`store`]: RAM, far-memory and disk tiers with budgets, LRU eviction, dedup,
//!   corruption refusal.
//! - [`far`]: the allocator interface of the far-memory tier (a CPU-less NUMA node such
//!   as CXL-attached DRAM); the node implements it with hwloc (`mesh_control::farmem`),
//!   so this crate does not depend on hwloc.
//!
//! I/O-free except the disk tier of [`store`]. The far tier exists only on hosts with
//! far memory; on a host without one (the development VM included) the store runs with
//! RAM and disk only, and the far tier's logic is covered by unit tests with a heap
//! allocator standing in. Engines reach a store through [`PageBackend`]; on a node
//! the page-store actor (`mesh-actors`) owns the stores and serves engines and peers.

pub mod backend;
pub mod codec;
pub mod far;
pub mod id;
pub mod index;
pub mod log;
pub mod page;
pub mod store;

pub use backend::{PageBackend, PageStoreOpener};
pub use codec::{assemble, parse, CodecError, Layout};
pub use far::{FarMemory, FarMemoryError};
pub use id::{chain, ModelFingerprint, PageId, Salt, SaltBase};
pub use index::{PageSpace, PrefixIndex};
pub use log::{LogEntry, NsChange, Observed, PageLog};
pub use page::PageMeta;
pub use store::{Changes, EvictSink, PageStore, StoreConfig, StoreStats};
