//! Prefix KV reuse for one engine: find the longest stored prefix of a prompt,
//! restore it into a sequence, and publish the full blocks of a prompt once it
//! is prefilled.
//!
//! ```text
//! admit:   prompt ─▶ chain(salt, prompt[..len-1], B) ─▶ store.prefix ─▶ assemble ─▶ state_seq_set
//!          (≥ 1 prompt token is always prefilled, for the logits of the first output token;
//!          skipped when the slot already holds as much of the prompt in place, kept from
//!          its previous request: see `EngineConfig::keep_resident`)
//! publish: after the first token:  state_seq_get ─▶ (publisher thread) parse ─▶ page i for each new full block ─▶ store.put
//! ```
//! The engine thread only copies the sequence's state out of the context (into a reused
//! buffer); parsing it and cutting the pages (two more passes over the state, about 58 MB
//! for a 447-token prompt on a Llama-3.1-8B shape) run on the cache's publisher thread while
//! the engine goes on decoding. A restore that needs pages still being cut waits for them,
//! and a finished sequence's pages are stored before its end is reported.
//! A restore that llama.cpp rejects clears the sequence and the prompt is prefilled from
//! scratch; pages whose checksum fails are refused by the store (recomputed, never used).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

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
    publisher: Publisher,
}

/// Jobs the engine hands the publisher thread before it blocks (each holds a sequence's
/// whole state: the bound keeps memory to a few states when prompts finish in a burst).
const PUBLISH_QUEUE: usize = 2;
/// State buffers kept for reuse (a new one is written page fault by page fault).
const SPARE_BUFFERS: usize = 2;

/// What to cut from a sequence's state.
struct PublishJob {
    seq: i32,
    salt: Salt,
    /// Page ids of the new pages and their block index in the prompt.
    pages: Vec<(usize, PageId)>,
}

/// What the engine and the publisher thread share.
#[derive(Debug, Default)]
struct PublishState {
    /// The last job finished.
    done: Mutex<u64>,
    finished: Condvar,
    /// Pages being published, with the job that publishes each.
    inflight: Mutex<HashMap<PageId, u64>>,
    spare: Mutex<Vec<Vec<u8>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl PublishState {
    /// Blocks until job `n` has ended: run, or dropped unrun when its thread died (its
    /// [`Finish`] records the end either way).
    fn wait(&self, n: u64) {
        let mut done = lock(&self.done);
        while *done < n {
            done = self
                .finished
                .wait(done)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    /// Records job `n` as finished: its pages leave the in-flight set, its buffer is kept
    /// for reuse.
    fn finish(&self, n: u64, pages: &[(usize, PageId)], blob: Vec<u8>) {
        {
            let mut inflight = lock(&self.inflight);
            for (_, id) in pages {
                if inflight.get(id) == Some(&n) {
                    inflight.remove(id);
                }
            }
        }
        let mut spare = lock(&self.spare);
        if blob.capacity() > 0 && spare.len() < SPARE_BUFFERS {
            spare.push(blob);
        }
        drop(spare);
        let mut done = lock(&self.done);
        *done = (*done).max(n);
        self.finished.notify_all();
    }

    /// The last job that publishes any of `ids`, if one is in flight.
    fn last_job_of(&self, ids: &[PageId]) -> Option<u64> {
        let inflight = lock(&self.inflight);
        if inflight.is_empty() {
            return None;
        }
        ids.iter().filter_map(|id| inflight.get(id)).copied().max()
    }
}

/// A job's end, recorded when it is dropped: after the job, or while a panic unwinds out of
/// it, so no one waits for a job that died.
struct Finish {
    state: Arc<PublishState>,
    n: u64,
    pages: Vec<(usize, PageId)>,
    blob: Vec<u8>,
}

impl Drop for Finish {
    fn drop(&mut self) {
        self.state
            .finish(self.n, &self.pages, std::mem::take(&mut self.blob));
    }
}

type Task = Box<dyn FnOnce() + Send>;

/// A thread that runs an engine's background tasks (cutting and storing pages) in order.
/// The engine thread starts it before binding itself to its tier's cores, so it runs
/// where the node's other threads run, not on the cores of llama.cpp's compute threads.
pub struct Worker {
    tx: Option<std_mpsc::SyncSender<Task>>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    /// Starts the thread (`None`, with a warning, when the OS refuses one).
    pub fn start(name: &str) -> Option<Self> {
        let (tx, rx) = std_mpsc::sync_channel::<Task>(PUBLISH_QUEUE);
        match std::thread::Builder::new()
            .name(name.into())
            .spawn(move || rx.into_iter().for_each(|task| task()))
        {
            Ok(thread) => Some(Self {
                tx: Some(tx),
                thread: Some(thread),
            }),
            Err(e) => {
                warn!(error = %e, "could not start the KV publisher thread; pages are cut on the engine thread");
                None
            }
        }
    }

    /// Queues `task` (blocks while the queue is full); gives it back when the thread is gone.
    fn run(&self, task: Task) -> Result<(), Task> {
        match &self.tx {
            Some(tx) => tx.send(task).map_err(|std_mpsc::SendError(t)| t),
            None => Err(task),
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Closing the queue ends the thread once it has run what it holds.
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The publishing side of one cache.
struct Publisher {
    worker: Option<Worker>,
    state: Arc<PublishState>,
    next: u64,
}

/// Cuts `job`'s state into its new pages and stores them; returns how many were stored.
fn cut(block: usize, job: &PublishJob, blob: &[u8], store: &dyn PageBackend) -> usize {
    let kv = match codec::parse(blob) {
        Ok(parsed) => parsed,
        Err(e) => {
            debug!(seq = job.seq, error = %e, "sequence state not pageable; nothing published");
            return 0;
        }
    };
    let new: Vec<(PageMeta, Bytes)> = job
        .pages
        .iter()
        .filter_map(|&(i, id)| {
            let meta = PageMeta {
                id,
                salt: job.salt,
                block: block as u32,
                index: i as u32,
            };
            kv.page(i, block)
                .map(|payload| (meta, Bytes::from(payload)))
        })
        .collect();
    let n = new.len();
    store.put(new);
    n
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("block", &self.block)
            .finish()
    }
}

fn seq_state(ctx: &LlamaContext<'_>, seq: i32) -> Vec<u8> {
    let mut buf = Vec::new();
    seq_state_into(ctx, seq, &mut buf);
    buf
}

/// Writes the state of `seq` into `buf` (its allocation reused when large enough).
fn seq_state_into(ctx: &LlamaContext<'_>, seq: i32, buf: &mut Vec<u8>) {
    let flags = LlamaStateSeqFlags::empty();
    let size = ctx.state_seq_get_size_ext(seq, flags);
    buf.clear();
    buf.reserve(size);
    // SAFETY: `buf` has room for the size llama.cpp reported for this sequence, and
    // llama.cpp writes the `n` bytes it returns (at most that size) before `set_len`.
    unsafe {
        let n = ctx.state_seq_get_data_ext(buf.as_mut_ptr(), seq, flags);
        buf.set_len(n.min(size));
    }
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
    /// The publisher job storing this prompt's pages (0: none).
    job: u64,
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
        worker: Option<Worker>,
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
        let stats = Arc::new(ReuseStats::default());
        Ok(Self {
            block: cfg.block,
            base: SaltBase::new(&model, &layout.descriptor()),
            publisher: Publisher {
                worker,
                state: Arc::default(),
                next: 0,
            },
            layout,
            salts: HashMap::new(),
            store,
            stats,
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
            job: 0,
        };
        // Pages another sequence is still publishing are waited for (the engine released
        // their claim when it handed them to the publisher thread).
        if let Some(n) = self.publisher.state.last_job_of(&plan.ids[..usable]) {
            self.publisher.state.wait(n);
        }
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
    /// Blocks another sequence already stored are counted as deduplicated. The state is
    /// read here; the pages are cut and stored on the publisher thread ([`Self::wait`]
    /// waits for them). Returns whether it read the state (false: nothing new to store).
    pub fn publish(&mut self, ctx: &LlamaContext<'_>, seq: i32, plan: &mut PromptPages) -> bool {
        let Some(salt) = plan.salt else { return false };
        let from = plan.restored.min(plan.ids.len());
        if from == plan.ids.len() {
            return false;
        }
        let held = self.store.held(&plan.ids[from..]);
        let dup = held.iter().filter(|h| **h).count();
        if dup > 0 {
            self.store
                .note_dedup(dup, self.layout.page_bytes(self.block));
        }
        if dup == held.len() {
            return false;
        }
        let pages: Vec<(usize, PageId)> = (from..plan.ids.len())
            .zip(held)
            .filter(|(_, held)| !held)
            .map(|(i, _)| (i, plan.ids[i]))
            .collect();
        let state = self.publisher.state.clone();
        let mut blob = lock(&state.spare).pop().unwrap_or_default();
        seq_state_into(ctx, seq, &mut blob);
        self.publisher.next += 1;
        let n = self.publisher.next;
        {
            let mut inflight = lock(&state.inflight);
            for (_, id) in &pages {
                inflight.insert(*id, n);
            }
        }
        plan.job = n;
        let job = PublishJob { seq, salt, pages };
        let (block, store, stats) = (self.block, self.store.clone(), self.stats.clone());
        // The task owns its `Finish`: run or dropped unrun, the job is recorded as ended.
        let done = Finish {
            state,
            n,
            pages: job.pages.clone(),
            blob,
        };
        let task: Task = Box::new(move || {
            let published = cut(block, &job, &done.blob, store.as_ref());
            stats.published.fetch_add(published as u64, Relaxed);
            drop(done);
        });
        // Without the thread (it could not start, or a task panicked): here.
        let task = match &self.publisher.worker {
            Some(w) => match w.run(task) {
                Ok(()) => return true,
                Err(task) => task,
            },
            None => task,
        };
        task();
        true
    }

    /// Waits until the pages `plan` handed to the publisher thread are stored.
    pub fn wait(&self, plan: &PromptPages) {
        if plan.job > 0 {
            self.publisher.state.wait(plan.job);
        }
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
    use super::*;

    #[test]
    fn a_wait_returns_once_its_job_and_the_jobs_before_it_finished() {
        let state = Arc::new(PublishState::default());
        let id = PageId([7; 32]);
        lock(&state.inflight).insert(id, 2);
        assert_eq!(state.last_job_of(&[id]), Some(2));
        let waiter = {
            let state = state.clone();
            std::thread::spawn(move || state.wait(2))
        };
        state.finish(1, &[], Vec::new());
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!waiter.is_finished(), "job 2 is not done yet");
        state.finish(2, &[(0, id)], vec![0; 4]);
        waiter.join().unwrap();
        assert_eq!(state.last_job_of(&[id]), None);
        assert_eq!(lock(&state.spare).len(), 1, "the buffer is kept for reuse");
    }

    #[test]
    fn a_wait_returns_when_its_job_panics() {
        let state = Arc::new(PublishState::default());
        let waiter = {
            let state = state.clone();
            std::thread::spawn(move || state.wait(5))
        };
        let dying = {
            let state = state.clone();
            std::thread::spawn(move || {
                let _done = Finish {
                    state,
                    n: 5,
                    pages: vec![],
                    blob: vec![],
                };
                panic!("a publish job dies");
            })
        };
        assert!(dying.join().is_err());
        waiter.join().unwrap();
    }

    #[test]
    fn tasks_run_on_the_worker_in_order_and_come_back_once_it_is_gone() {
        let w = Worker::start("kv-publish-test").unwrap();
        let seen = Arc::new(Mutex::new(vec![]));
        for i in 0..5 {
            let seen = seen.clone();
            assert!(w.run(Box::new(move || lock(&seen).push(i))).is_ok());
        }
        drop(w);
        assert_eq!(
            *lock(&seen),
            vec![0, 1, 2, 3, 4],
            "dropping runs what was queued"
        );
        let dead = Worker {
            tx: None,
            thread: None,
        };
        assert!(dead.run(Box::new(|| {})).is_err());
    }

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
