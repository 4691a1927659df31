//! Prefix KV reuse for one engine: find the longest stored prefix of a prompt,
//! restore it into a sequence, and publish the full blocks of a prompt once it
//! is prefilled.
//!
//! ```text
//! admit:   prompt ─▶ chain(salt, prompt[..len-1], B) ─▶ store.prefix ─▶ assemble ─▶ state_seq_set
//!          (≥ 1 prompt token is always prefilled, for the logits of the first output token;
//!          skipped when the slot already holds as much of the prompt in place, kept from
//!          its previous request: see `EngineConfig::keep_resident`)
//! publish: after the last prompt chunk: state_seq_get ─▶ parse ─▶ page i for each new full block ─▶ store.put
//! ```
//! A restore that llama.cpp rejects clears the sequence and the prompt is prefilled from
//! scratch; pages whose checksum fails are refused by the store (recomputed, never used).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use bytes::Bytes;
use llama_cpp_2::context::session::LlamaStateSeqFlags;
use llama_cpp_2::context::LlamaContext;
use mesh_kvstore::{
    chain, codec, FarMemory, Layout, ModelFingerprint, PageBackend, PageId, PageMeta, PageStore,
    PageStoreOpener, Salt, SaltBase, StoreConfig,
};
use tracing::{debug, warn};

use crate::KvPagesConfig;

/// Counters of prefix reuse (per engine).
#[derive(Debug, Default)]
pub struct ReuseStats {
    /// Requests that looked for a cached prefix.
    pub lookups: AtomicU64,
    /// Requests that restored at least one page.
    pub hits: AtomicU64,
    /// Prompt tokens restored instead of prefilled.
    pub tokens_reused: AtomicU64,
    /// Restores llama.cpp refused (prompt recomputed).
    pub restore_failures: AtomicU64,
    /// Pages published.
    pub published: AtomicU64,
}

/// Paging state of one engine.
pub struct KvCache {
    block: usize,
    layout: Layout,
    base: SaltBase,
    salts: HashMap<String, Salt>,
    store: Arc<dyn PageBackend>,
    stats: Arc<ReuseStats>,
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("block", &self.block)
            .finish()
    }
}

fn seq_state(ctx: &LlamaContext<'_>, seq: i32) -> Vec<u8> {
    let flags = LlamaStateSeqFlags::empty();
    let size = ctx.state_seq_get_size_ext(seq, flags);
    let mut buf = vec![0u8; size];
    // SAFETY: `buf` has exactly the size llama.cpp reported for this sequence.
    let n = unsafe { ctx.state_seq_get_data_ext(buf.as_mut_ptr(), seq, flags) };
    buf.truncate(n);
    buf
}

/// What a request's prompt maps to in the page space.
#[derive(Debug, Default)]
pub struct PromptPages {
    /// Ids of every full block of the prompt.
    pub ids: Vec<PageId>,
    /// Leading pages that were restored (already stored).
    pub restored: usize,
    salt: Option<Salt>,
    published: bool,
}

impl PromptPages {
    /// Pages this sequence will publish once its prompt is prefilled.
    pub fn pending(&self) -> &[PageId] {
        if self.published {
            &[]
        } else {
            &self.ids[self.restored.min(self.ids.len())..]
        }
    }

    /// Marks the pending pages as published (or abandoned).
    pub fn clear_pending(&mut self) {
        self.published = true;
    }
}

impl KvCache {
    /// Sets up paging for a context of `layout`: opens the store of `namespace` through
    /// `opener` (the node's page-store actor), or a store of its own without one, with a
    /// far-memory tier when `far` is given and `cfg.far_bytes` is set and not 0.
    pub fn new(
        cfg: &KvPagesConfig,
        model_path: &std::path::Path,
        layout: Layout,
        far: Option<Arc<dyn FarMemory>>,
        opener: Option<(&dyn PageStoreOpener, &str)>,
    ) -> std::io::Result<Self> {
        let model = ModelFingerprint::of_file(model_path)?;
        let scfg = StoreConfig {
            ram_bytes: cfg.ram_bytes,
            disk_dir: cfg.disk_dir.clone(),
            disk_bytes: cfg.disk_bytes,
            far,
            far_bytes: cfg.far_bytes.unwrap_or(0),
        };
        let store: Arc<dyn PageBackend> = match opener {
            Some((o, namespace)) => o.open(namespace, scfg),
            None => Arc::new(PageStore::open(scfg)),
        };
        Ok(Self {
            block: cfg.block,
            base: SaltBase::new(&model, &layout.descriptor()),
            layout,
            salts: HashMap::new(),
            store,
            stats: Arc::new(ReuseStats::default()),
        })
    }

    /// Reads the layout of a sequence holding at least one token.
    pub fn probe_layout(ctx: &LlamaContext<'_>, seq: i32) -> Option<Layout> {
        codec::parse(&seq_state(ctx, seq)).ok().map(|kv| kv.layout)
    }

    /// The store (metrics, tests).
    pub fn store(&self) -> &Arc<dyn PageBackend> {
        &self.store
    }

    /// Reuse counters.
    pub fn stats(&self) -> &Arc<ReuseStats> {
        &self.stats
    }

    fn salt(&mut self, scope: &str) -> Salt {
        if let Some(s) = self.salts.get(scope) {
            return *s;
        }
        let s = self.base.salt(scope);
        if self.salts.len() > 4096 {
            self.salts.clear();
        }
        self.salts.insert(scope.to_owned(), s);
        s
    }

    /// Restores the longest stored prefix of `prompt` into `seq`, unless the sequence
    /// already holds at least as much of it in place (`in_place` leading tokens, kept from
    /// the slot's previous request). Returns the page plan and how many prompt tokens the
    /// sequence now holds (`restored * block` after a restore, else `in_place`).
    pub fn restore(
        &mut self,
        ctx: &mut LlamaContext<'_>,
        seq: i32,
        prompt: &[i32],
        scope: &str,
        in_place: usize,
    ) -> (PromptPages, usize) {
        let salt = self.salt(scope);
        let ids = chain(&salt, prompt, self.block);
        self.stats.lookups.fetch_add(1, Relaxed);
        // Leave at least one prompt token to prefill: its logits give the first output token.
        let usable = ((prompt.len().saturating_sub(1)) / self.block).min(ids.len());
        let mut plan = PromptPages {
            ids,
            restored: 0,
            salt: Some(salt),
            published: false,
        };
        // Pages the sequence holds in place need no restore (nor publishing when stored):
        // the store answers how many pages it has and sends them only when they cover more.
        let (stored, pages) = self
            .store
            .prefix(&plan.ids[..usable], &salt, in_place / self.block);
        if stored * self.block <= in_place {
            plan.restored = stored;
            return (plan, in_place);
        }
        if pages.len() * self.block <= in_place {
            plan.restored = pages.len();
            return (plan, in_place);
        }
        // The restore replaces whatever the sequence held.
        let _ = ctx.clear_kv_cache_seq(Some(seq as u32), None, None);
        let refs: Vec<&[u8]> = pages.iter().map(|p| p.as_ref()).collect();
        let blob = match codec::assemble(&self.layout, &refs, self.block, self.layout.n_stream) {
            Ok(b) => b,
            Err(e) => {
                warn!(error = %e, "assembling cached pages failed; recomputing the prefix");
                return (plan, 0);
            }
        };
        // SAFETY: `seq` < n_seq_max (it is a slot index) and the blob was built for this
        // context's layout; llama.cpp validates the rest and returns failure on mismatch.
        let ok = unsafe { ctx.state_seq_set_data_ext(&blob, seq, LlamaStateSeqFlags::empty()) };
        if ok {
            plan.restored = pages.len();
            self.stats.hits.fetch_add(1, Relaxed);
            self.stats
                .tokens_reused
                .fetch_add((pages.len() * self.block) as u64, Relaxed);
            debug!(
                seq,
                pages = pages.len(),
                tokens = pages.len() * self.block,
                "restored cached prefix"
            );
        } else {
            self.stats.restore_failures.fetch_add(1, Relaxed);
            warn!(
                seq,
                pages = pages.len(),
                "llama.cpp refused a cached prefix; recomputing"
            );
            let _ = ctx.clear_kv_cache_seq(Some(seq as u32), None, None);
        }
        let held = plan.restored * self.block;
        (plan, held)
    }

    /// Whether the request should wait for pages a running sequence is about to publish
    /// (`pending`) rather than compute them itself: see [`worth_waiting`].
    pub fn waits_for(
        &mut self,
        prompt: &[i32],
        scope: &str,
        pending: &HashMap<PageId, usize>,
    ) -> bool {
        if pending.is_empty() {
            return false;
        }
        let salt = self.salt(scope);
        let usable = prompt.len().saturating_sub(1) / self.block * self.block;
        let ids = chain(&salt, &prompt[..usable], self.block);
        // Only a prompt whose chain reaches pages being published can wait for them; the
        // store is asked only then (this runs for every queued request at every step).
        if !ids.iter().any(|id| pending.contains_key(id)) {
            return false;
        }
        let stored = self.store.stored_run(&ids);
        let coming = ids[stored..]
            .iter()
            .take_while(|id| pending.contains_key(*id))
            .count();
        worth_waiting(prompt.len(), stored * self.block, coming * self.block)
    }

    /// Publishes the prompt's full blocks not stored yet (call once the prompt is prefilled).
    /// Blocks another sequence already stored are counted as deduplicated.
    pub fn publish(&self, ctx: &LlamaContext<'_>, seq: i32, plan: &PromptPages) {
        let Some(salt) = plan.salt else { return };
        let from = plan.restored.min(plan.ids.len());
        if from == plan.ids.len() {
            return;
        }
        let held = self.store.held(&plan.ids[from..]);
        let dup = held.iter().filter(|h| **h).count();
        if dup > 0 {
            self.store
                .note_dedup(dup, self.layout.page_bytes(self.block));
        }
        if dup == held.len() {
            return;
        }
        let kv = match codec::parse(&seq_state(ctx, seq)) {
            Ok(parsed) => parsed,
            Err(e) => {
                debug!(seq, error = %e, "sequence state not pageable; nothing published");
                return;
            }
        };
        let mut new = vec![];
        for (i, held) in (from..plan.ids.len()).zip(held) {
            if held {
                continue;
            }
            let meta = PageMeta {
                id: plan.ids[i],
                salt,
                block: self.block as u32,
                index: i as u32,
            };
            if let Some(payload) = kv.page(i, self.block) {
                new.push((meta, Bytes::from(payload)));
            }
        }
        self.stats.published.fetch_add(new.len() as u64, Relaxed);
        self.store.put(new);
    }

    /// The salt base (advertised so routers can compute page ids).
    pub fn base(&self) -> SaltBase {
        self.base
    }

    /// Tokens per page.
    pub fn block(&self) -> usize {
        self.block
    }
}

/// Whether a request whose prompt has `prompt_len` tokens, `stored` of them restorable now,
/// should wait for the next `coming` tokens' pages that a running sequence is prefilling.
/// Waiting saves computing `coming` tokens and costs the time until that sequence's prompt
/// is done, while the request could have started now. It waits only when the pages cover at
/// least half of what it would otherwise prefill: agents sharing a long system prompt and
/// tool schemas wait (the prefix is computed once); prompts that share a short head (a
/// system line, the start of a template) start at once, as on a server without pages.
pub fn worth_waiting(prompt_len: usize, stored: usize, coming: usize) -> bool {
    let remaining = prompt_len.saturating_sub(stored);
    coming > 0 && 2 * coming >= remaining
}

#[cfg(test)]
mod tests {
    use super::worth_waiting;

    #[test]
    fn waits_only_for_a_substantial_share_of_the_prompt() {
        // 16 agents: 1,536 shared tokens being prefilled, 64 of their own.
        assert!(worth_waiting(1600, 0, 1536));
        // A short shared head (one 32-token page of a 448-token prompt): start now.
        assert!(!worth_waiting(448, 0, 32));
        // Half of what is left is exactly worth it.
        assert!(worth_waiting(512, 256, 128));
        assert!(!worth_waiting(512, 256, 96));
        // Nothing coming: never wait.
        assert!(!worth_waiting(100, 0, 0));
    }
}
