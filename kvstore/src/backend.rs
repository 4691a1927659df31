//! What an engine needs of a page store, as a trait: the engine's paging code
//! (`mesh_tiers::kvcache`) calls it from the engine thread, and either the engine owns a
//! [`PageStore`] (tests, evaluation programs) or the node's page-store actor serves the
//! calls (`mesh_actors::pagestore`), where a store restart loses RAM pages but never gives
//! an engine a wrong one: every failed call reads as "not stored".

use std::sync::Arc;

use bytes::Bytes;

use crate::id::{PageId, Salt};
use crate::page::PageMeta;
use crate::store::{PageStore, StoreConfig, StoreStats};

/// The pages of one engine (one namespace of a store).
pub trait PageBackend: Send + Sync + std::fmt::Debug {
    /// Which of `ids` are stored (any tier; no checksum check).
    fn held(&self, ids: &[PageId]) -> Vec<bool>;
    /// How many leading pages of `ids` are stored.
    fn stored_run(&self, ids: &[PageId]) -> usize {
        self.held(ids).iter().take_while(|h| **h).count()
    }
    /// How many leading pages of `ids` are stored, and, when that is more than `beyond`,
    /// the payloads of those that pass their checks against `salt` (stopping at the first
    /// that does not): one question for a restore, whose sequence may already hold
    /// `beyond` pages in place.
    fn prefix(&self, ids: &[PageId], salt: &Salt, beyond: usize) -> (usize, Vec<Bytes>);
    /// Stores new pages (payloads without headers); pages already held are counted as
    /// deduplicated. May return before the pages are stored.
    fn put(&self, pages: Vec<(PageMeta, Bytes)>);
    /// Counts `pages` pages (`payload_bytes` each, without headers) that were not stored
    /// again because identical ones are.
    fn note_dedup(&self, pages: usize, payload_bytes: usize);
    /// The store's counters.
    fn stats(&self) -> Arc<StoreStats>;
}

/// Opens the pages of one engine: `namespace` names its store (the tier, or the engine id
/// of a variant), `cfg` its budgets and folders.
pub trait PageStoreOpener: Send + Sync + std::fmt::Debug {
    /// The backend of `namespace`, opened with `cfg` if it is not open yet.
    fn open(&self, namespace: &str, cfg: StoreConfig) -> Arc<dyn PageBackend>;
}

impl PageBackend for PageStore {
    fn held(&self, ids: &[PageId]) -> Vec<bool> {
        ids.iter().map(|id| self.contains(id)).collect()
    }

    fn stored_run(&self, ids: &[PageId]) -> usize {
        ids.iter().take_while(|id| self.contains(id)).count()
    }

    fn prefix(&self, ids: &[PageId], salt: &Salt, beyond: usize) -> (usize, Vec<Bytes>) {
        let stored = self.stored_run(ids);
        if stored <= beyond {
            return (stored, vec![]);
        }
        (
            stored,
            PageStore::longest_prefix(self, &ids[..stored], salt),
        )
    }

    fn put(&self, pages: Vec<(PageMeta, Bytes)>) {
        for (meta, payload) in pages {
            PageStore::put(self, &meta, &payload);
        }
    }

    fn note_dedup(&self, pages: usize, payload_bytes: usize) {
        for _ in 0..pages {
            PageStore::note_dedup(self, payload_bytes);
        }
    }

    fn stats(&self) -> Arc<StoreStats> {
        PageStore::stats(self).clone()
    }
}
