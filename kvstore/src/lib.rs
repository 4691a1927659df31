//! mesh KV pages: prefix KV cache cut into content-addressed pages.
//!
//! - [`id`]: page identity, a salted blake3 chain over full token blocks.
//! - [`codec`]: cut llama.cpp's per-sequence state into per-block pages and
//!   reassemble any prefix into a restorable state (format in `shared/KV-STATE-NOTES.md`).
//! - [`page`]: the stored form of a page (header with id, salt and checksum).
//! - [`store`]: RAM and disk tiers with budgets, LRU eviction, dedup, corruption refusal.
//!
//! I/O-free except the disk tier of [`store`]. Not built yet: the far-memory (CXL) tier,
//! peer fetch over QUIC and prefix-aware routing (KV fabric issue).

pub mod codec;
pub mod id;
pub mod page;
pub mod store;

pub use codec::{assemble, parse, CodecError, Layout};
pub use id::{chain, ModelFingerprint, PageId, Salt, SaltBase};
pub use page::PageMeta;
pub use store::{PageStore, StoreConfig, StoreStats};
