//! A tier's engine: one model on one llama.cpp context, driven by a continuous-batching loop
//! on its own thread. This file is the handle the rest of the node holds; `setup` loads the
//! model and builds contexts, `batch` is the loop, `residency` the KV a slot keeps on the
//! device between requests, and `drafting` the speculative steps.

mod batch;
mod drafting;
mod residency;
mod setup;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;
use tokio::sync::mpsc;
use tracing::info;

use self::batch::{Loop, Think};
use self::drafting::Draft;
use self::setup::{
    chat_format, draft_threads, embedding_only, load_draft, model_params, new_context, start_pages,
    vocab_markers,
};
use crate::chat;
use crate::format::{ChatFormat, ChatInput, FormatError, Rendered};
use crate::kvcache::ReuseStats;
use crate::markers::Markers;
use crate::plan;
use crate::{EngineConfig, GenerateRequest, TierError, TokenEvent};

/// Prefix-page handles of an engine (metrics, tests).
#[derive(Debug, Clone)]
pub struct PageHandles {
    /// The engine's pages (its own store, or its namespace in the node's page-store actor).
    pub store: Arc<dyn mesh_kvstore::PageBackend>,
    /// Reuse counters.
    pub reuse: Arc<ReuseStats>,
    /// Tokens per page.
    pub block: usize,
    /// Salt base of this engine's pages.
    pub base: mesh_kvstore::SaltBase,
}

impl PageHandles {
    /// Page ids of the full blocks of `tokens` in `scope`.
    pub fn chain(
        &self,
        tokens: &[i32],
        scope: &str,
    ) -> (mesh_kvstore::Salt, Vec<mesh_kvstore::PageId>) {
        let salt = self.base.salt(scope);
        (salt, mesh_kvstore::chain(&salt, tokens, self.block))
    }
}

/// The process-wide llama.cpp backend (initialised on first use, logs silenced unless
/// `MESH_LLAMA_LOGS=1`). Logs once which CPU kernels this build of llama.cpp has.
pub fn backend() -> &'static LlamaBackend {
    static BACKEND: OnceLock<LlamaBackend> = OnceLock::new();
    BACKEND.get_or_init(|| {
        let mut b = LlamaBackend::init().expect("llama.cpp backend initialises once per process");
        if std::env::var("MESH_LLAMA_LOGS").as_deref() != Ok("1") {
            b.void_logs();
        }
        let loaded = crate::gpu::load_modules()
            .iter()
            .filter(|m| m.outcome.is_ok())
            .count();
        let gpus: Vec<String> = llama_cpp_2::list_llama_ggml_backend_devices()
            .into_iter()
            .filter(|d| {
                matches!(
                    d.device_type,
                    llama_cpp_2::LlamaBackendDeviceType::Gpu
                        | llama_cpp_2::LlamaBackendDeviceType::IntegratedGpu
                )
            })
            .map(|d| format!("{} ({})", d.name, d.description))
            .collect();
        info!(features = %system_info(), modules = loaded, gpus = ?gpus, "llama.cpp backend");
        b
    })
}

/// llama.cpp's feature line (`CPU : NEON = 1 | DOTPROD = 1 | MATMUL_INT8 = 1 | SVE = 1 | ...`
/// on arm64, `SSE3 = 1 | AVX2 = 1 | ...` on x86): the kernels this binary was compiled with.
fn system_info() -> String {
    // SAFETY: llama_print_system_info returns a pointer to a static, NUL-terminated buffer
    // that stays valid until the next call; it is copied out at once.
    let text = unsafe { std::ffi::CStr::from_ptr(llama_cpp_sys_2::llama_print_system_info()) };
    text.to_string_lossy().trim().to_owned()
}

/// Counters an engine keeps; read by metrics and the router.
#[derive(Debug, Default)]
pub struct EngineStats {
    /// Sequences holding a slot.
    pub active: AtomicUsize,
    /// Requests waiting for a slot.
    pub queued: AtomicUsize,
    /// Requests that got a slot.
    pub started: AtomicU64,
    /// Milliseconds those requests waited for it, summed.
    pub queued_ms_total: AtomicU64,
    /// KV cells reserved by active sequences.
    pub reserved_cells: AtomicUsize,
    /// Prompt tokens prefilled.
    pub prompt_tokens: AtomicU64,
    /// Tokens generated.
    pub generated_tokens: AtomicU64,
    /// llama_decode calls.
    pub steps: AtomicU64,
    /// Requests dropped because their receiver went away.
    pub cancelled: AtomicU64,
    /// Tokens generated inside `<think>`.
    pub reasoning_tokens: AtomicU64,
    /// Think blocks the reasoning governor closed.
    pub reasoning_capped: AtomicU64,
    /// Tokens the draft model proposed (speculative decoding).
    pub draft_tokens: AtomicU64,
    /// Drafted tokens the target accepted.
    pub draft_accepted: AtomicU64,
    /// Greedy tokens whose free choice the request's grammar refused (the vocabulary was
    /// then masked and the token chosen again).
    pub grammar_refusals: AtomicU64,
    /// Requests that reused KV kept in their slot by the previous sequence there.
    pub resident_hits: AtomicU64,
    /// Prompt tokens reused in place from a slot's kept KV instead of prefilled.
    pub resident_tokens: AtomicU64,
    /// Tokens of KV kept in a slot that left the device when the slot took another prompt
    /// (the least recently used slot goes first) or the keep budget was exceeded
    /// (`EngineConfig::keep_resident_mib`); their prompt pages stay in host RAM.
    pub resident_dropped_tokens: AtomicU64,
    /// Requests whose prompt prefix was copied from another running sequence's KV on the
    /// engine's own device (`llama_memory_seq_cp`), the nearest level of the page hierarchy.
    pub device_copies: AtomicU64,
    /// Prompt tokens copied that way instead of restored from pages or prefilled.
    pub device_copy_tokens: AtomicU64,
    /// Tokens the draft model decoded to catch up with its sequences (prompts, and the
    /// tokens accepted each round), drafts not included.
    pub draft_prefill_tokens: AtomicU64,
    /// Prompt tokens the draft reused in place from a slot's kept draft KV.
    pub draft_resident_tokens: AtomicU64,
    /// Hardware counters of the engine's threads (absent where the kernel gives none).
    pub hw: crate::hwcount::HwStats,
    /// Nanoseconds the engine thread spent in each phase of its steps, by [`STEP_PHASES`].
    pub step_ns: [AtomicU64; STEP_PHASES.len()],
    /// Steps by kind ([`STEP_KINDS`]) and duration bucket ([`STEP_BUCKET_BOUNDS_S`], then
    /// one bucket for longer ones): a running sequence's gap between two tokens is the step
    /// between them, so this tells which steps make the inter-token tail.
    pub step_hist: [[AtomicU64; STEP_BUCKETS]; STEP_KINDS.len()],
    /// Nanoseconds of the steps counted in `step_hist`, by kind.
    pub step_hist_ns: [AtomicU64; STEP_KINDS.len()],
}

impl EngineStats {
    /// Counts a step of kind `kind` (index into [`STEP_KINDS`]) that took `d`.
    pub fn time_step(&self, kind: usize, d: Duration) {
        self.step_hist[kind][step_bucket(d.as_secs_f64())].fetch_add(1, Ordering::Relaxed);
        self.step_hist_ns[kind].fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }
}

/// The kinds of engine steps timed apart: only decodes (and drafts); with a prompt chunk;
/// ending a prompt whose new pages it published (a read of the sequence's whole KV state
/// on the engine thread).
pub const STEP_KINDS: [&str; 3] = ["decode", "prefill", "publish"];

/// Upper bounds, in seconds, of the step-duration buckets: 0.25 ms doubling to about 4 s.
pub const STEP_BUCKET_BOUNDS_S: [f64; 15] = [
    0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024,
    2.048, 4.096,
];

/// Buckets per step kind: one per bound and one for longer steps.
pub const STEP_BUCKETS: usize = STEP_BUCKET_BOUNDS_S.len() + 1;

/// The bucket of a step of `secs` seconds: the first whose bound is at least `secs`, or the
/// last one past every bound.
pub fn step_bucket(secs: f64) -> usize {
    STEP_BUCKET_BOUNDS_S
        .iter()
        .position(|b| secs <= *b)
        .unwrap_or(STEP_BUCKET_BOUNDS_S.len())
}

/// The kind (index into [`STEP_KINDS`]) of a step that prefilled `prompt_tokens` and read a
/// sequence's state to publish pages (`published`) or not.
pub fn step_kind(prompt_tokens: u64, published: bool) -> usize {
    if published {
        2
    } else if prompt_tokens > 0 {
        1
    } else {
        0
    }
}

/// The phases of an engine step, in order: building the batch (planning, prompt chunks),
/// the draft model's decodes (speculative tiers), the model's decode (until its results are
/// on the host: on a GPU the whole computation), choosing tokens (sampling, verifying
/// drafts), emitting them (text, stop strings, events), publishing new KV pages, and
/// admitting requests between steps (prefixes restored from pages or copied on the device,
/// waits for pages another sequence is publishing).
pub const STEP_PHASES: [&str; 7] = [
    "schedule", "draft", "decode", "sample", "emit", "publish", "admit",
];

/// Indices into [`EngineStats::step_ns`].
mod phase {
    pub(super) const SCHEDULE: usize = 0;
    pub(super) const DRAFT: usize = 1;
    pub(super) const DECODE: usize = 2;
    pub(super) const SAMPLE: usize = 3;
    pub(super) const EMIT: usize = 4;
    pub(super) const PUBLISH: usize = 5;
    pub(super) const ADMIT: usize = 6;
}

/// What a loaded model is.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// Model id (config name).
    pub name: String,
    /// Parameter count.
    pub n_params: u64,
    /// Training context.
    pub n_ctx_train: u32,
    /// Per-sequence limit in effect.
    pub max_seq_len: usize,
    /// Total KV cells.
    pub n_ctx: usize,
    /// Concurrent sequences.
    pub n_seq_max: usize,
    /// File size in bytes.
    pub size_bytes: u64,
    /// GGUF of the draft model, when requests are decoded speculatively.
    pub draft: Option<String>,
}

enum Command {
    Submit(Box<Pending>),
    Shutdown,
    /// Fault injection: the loop panics, as a crash inside llama.cpp would end the thread.
    Crash,
}

/// Fires when the engine thread ends, however it ends (dropped with the thread's closure,
/// also while a panic unwinds).
struct ExitGuard(Option<tokio::sync::oneshot::Sender<()>>);

impl Drop for ExitGuard {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

struct Pending {
    req: GenerateRequest,
    reserve: usize,
    events: mpsc::UnboundedSender<TokenEvent>,
    queued_at: Instant,
}

/// One model on one llama.cpp context, driven by a continuous-batching loop on its own thread.
///
/// Dropping the engine stops the loop after the current step; requests still running get an
/// error event.
pub struct Engine {
    cfg: EngineConfig,
    model: Arc<LlamaModel>,
    info: ModelInfo,
    stats: Arc<EngineStats>,
    tx: std_mpsc::Sender<Command>,
    thread: Option<JoinHandle<()>>,
    pages: Option<PageHandles>,
    exited: Option<tokio::sync::oneshot::Receiver<()>>,
    markers: Arc<Markers>,
    format: Arc<ChatFormat>,
}

impl Engine {
    /// Loads the model and starts the engine thread. Blocks until the context exists.
    pub fn start(cfg: EngineConfig) -> Result<Self, TierError> {
        cfg.validate()?;
        let path = cfg.model.display().to_string();
        if !cfg.model.exists() {
            return Err(TierError::ModelLoad {
                path,
                reason: "file not found".into(),
            });
        }
        let params = model_params(&cfg)?;
        let model = LlamaModel::load_from_file(backend(), &cfg.model, &params).map_err(|e| {
            TierError::ModelLoad {
                path: path.clone(),
                reason: e.to_string(),
            }
        })?;
        if let Some(kind) = embedding_only(|k| model.meta_val_str(k).ok()) {
            return Err(TierError::ModelLoad {
                path,
                reason: format!(
                    "an embedding model ({kind}); a tier needs a model that generates text"
                ),
            });
        }
        let format = Arc::new(chat_format(&model, &cfg)?);
        let model = Arc::new(model);
        let draft = match &cfg.draft {
            Some(d) => Some(Arc::new(load_draft(&model, d, &params)?)),
            None => None,
        };
        let n_ctx_train = model.n_ctx_train();
        let per_seq = if cfg.kv_unified {
            cfg.n_ctx
        } else {
            cfg.n_ctx / cfg.n_seq_max
        };
        let max_seq_len = match cfg.max_seq_len {
            0 => n_ctx_train.min(per_seq),
            n => n.min(per_seq),
        } as usize;
        let info = ModelInfo {
            name: cfg.name.clone(),
            n_params: model.n_params(),
            n_ctx_train,
            max_seq_len,
            n_ctx: cfg.n_ctx as usize,
            n_seq_max: cfg.n_seq_max as usize,
            size_bytes: std::fs::metadata(&cfg.model).map(|m| m.len()).unwrap_or(0),
            draft: cfg.draft.as_ref().map(|d| d.model.display().to_string()),
        };
        let stats = Arc::new(EngineStats::default());
        let (tx, rx) = std_mpsc::channel();
        let (ready_tx, ready_rx) = std_mpsc::channel();
        let (exit_tx, exited) = tokio::sync::oneshot::channel();
        let thread = {
            let (model, draft_model, cfg, stats, info, think) = (
                model.clone(),
                draft.clone(),
                cfg.clone(),
                stats.clone(),
                info.clone(),
                format.spec().think.clone(),
            );
            std::thread::Builder::new()
                .name(format!("engine-{}", cfg.name))
                .spawn(move || {
                    let _exit = ExitGuard(Some(exit_tx));
                    // Started before this thread binds itself to the tier's cores, so the
                    // pages are cut where the node's other threads run.
                    let worker = (cfg.kv_pages.block > 0)
                        .then(|| crate::kvcache::Worker::start("kv-publish"))
                        .flatten();
                    cfg.thread_setup.run();
                    // Before llama.cpp starts its compute threads, so that they are counted.
                    let hw = crate::hwcount::HwCounters::open(&stats.hw);
                    let mut ctx = match new_context(&model, &cfg, (cfg.threads, cfg.threads)) {
                        Ok(c) => c,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    let draft = match (&draft_model, &cfg.draft) {
                        (Some(m), Some(d)) => match new_context(m, &cfg, draft_threads(&cfg, d)) {
                            Ok(ctx) => Some(Draft::new(ctx, d, &cfg)),
                            Err(e) => {
                                let _ = ready_tx.send(Err(e));
                                return;
                            }
                        },
                        _ => None,
                    };
                    let kv = start_pages(&model, &mut ctx, &cfg, worker);
                    let handles = kv.as_ref().map(|k| PageHandles {
                        store: k.store().clone(),
                        reuse: k.stats().clone(),
                        block: k.block(),
                        base: k.base(),
                    });
                    let _ = ready_tx.send(Ok(handles));
                    let mut l = Loop::new(&model, ctx, &cfg, &info, stats, kv, draft);
                    l.think = think.as_ref().map(|t| Think::new(&model, t));
                    l.hw = hw;
                    l.run(rx);
                })
                .map_err(|e| TierError::Context(e.to_string()))?
        };
        let pages = ready_rx.recv().map_err(|_| TierError::EngineStopped)??;
        let markers = Arc::new(vocab_markers(&model));
        Ok(Self {
            pages,
            markers,
            format,
            cfg,
            model,
            info,
            stats,
            tx,
            thread: Some(thread),
            exited: Some(exited),
        })
    }

    /// Resolves when the engine thread has ended, however it ended (taken once; `None`
    /// after the first call).
    pub fn exit_signal(&mut self) -> Option<tokio::sync::oneshot::Receiver<()>> {
        self.exited.take()
    }

    /// Fault injection: makes the engine thread panic at its next loop turn, as a crash
    /// inside llama.cpp would end it. Requests on it see their token streams end.
    pub fn crash(&self) {
        let _ = self.tx.send(Command::Crash);
    }

    /// Prefix-page store and counters, when paging is on.
    pub fn pages(&self) -> Option<&PageHandles> {
        self.pages.as_ref()
    }

    /// Queues a request; tokens arrive on the returned receiver. Dropping the receiver cancels
    /// the request and frees its sequence at the next step.
    pub fn submit(
        &self,
        req: GenerateRequest,
    ) -> Result<mpsc::UnboundedReceiver<TokenEvent>, TierError> {
        if req.prompt.is_empty() {
            return Err(TierError::InvalidRequest("empty prompt".into()));
        }
        let n_vocab = self.model.n_vocab();
        if let Some(bad) = req.prompt.iter().find(|&&t| t < 0 || t >= n_vocab) {
            return Err(TierError::InvalidRequest(format!(
                "token id {bad} outside the vocabulary"
            )));
        }
        if req.prompt.len() >= self.info.max_seq_len {
            return Err(TierError::ContextExceeded {
                prompt: req.prompt.len(),
                max_tokens: req.max_tokens,
                limit: self.info.max_seq_len,
            });
        }
        let s = &req.sampling;
        if !(0.0..=100.0).contains(&s.temperature) || !(0.0..=1.0).contains(&s.top_p) || s.top_k < 0
        {
            return Err(TierError::InvalidRequest(
                "temperature, top_p or top_k out of range".into(),
            ));
        }
        let queued = self.stats.queued.load(Ordering::Relaxed);
        if queued >= self.cfg.max_queue {
            return Err(TierError::Overloaded(queued));
        }
        let reserve = plan::reservation(
            req.prompt.len(),
            req.max_tokens.max(1),
            self.info.max_seq_len,
        );
        let (events, rx) = mpsc::unbounded_channel();
        self.stats.queued.fetch_add(1, Ordering::Relaxed);
        let pending = Pending {
            req,
            reserve,
            events,
            queued_at: Instant::now(),
        };
        if self.tx.send(Command::Submit(Box::new(pending))).is_err() {
            self.stats.queued.fetch_sub(1, Ordering::Relaxed);
            return Err(TierError::EngineStopped);
        }
        Ok(rx)
    }

    /// Tokenizes text, parsing special tokens (chat markers) and adding BOS when the model wants it.
    pub fn tokenize(&self, text: &str) -> Vec<i32> {
        self.model
            .vocab()
            .tokenize(text.as_bytes(), true, true)
            .iter()
            .map(|t| t.0)
            .collect()
    }

    /// Tokenizes a rendered chat prompt: template parts with their control tokens, content
    /// parts as plain text only (marker spellings in them never become control tokens; see
    /// [`crate::markers`]); BOS first when the model wants it.
    pub fn tokenize_parts(&self, parts: &[chat::PromptPart]) -> Vec<i32> {
        let vocab = self.model.vocab();
        let mut out: Vec<i32> = Vec::new();
        if vocab.should_add_bos() {
            out.push(vocab.bos().0);
        }
        for part in parts {
            let pieces = if part.special {
                vec![part.text.as_str()]
            } else {
                self.markers.split(&part.text)
            };
            for piece in pieces {
                out.extend(
                    vocab
                        .tokenize(piece.as_bytes(), false, part.special)
                        .iter()
                        .map(|t| t.0),
                );
            }
        }
        out
    }

    /// The tier's chat format.
    pub fn format(&self) -> &Arc<ChatFormat> {
        &self.format
    }

    /// Renders a conversation with the tier's chat template and tokenizes it (content never
    /// as control tokens); the tokens and the rendered prompt.
    pub fn render(&self, input: &ChatInput) -> Result<(Vec<i32>, Rendered), FormatError> {
        let r = self.format.render(input, &self.markers)?;
        Ok((self.tokenize_parts(&r.parts), r))
    }

    /// Token ids of this model's chat markers (control and user-defined tokens).
    pub fn marker_ids(&self) -> &[i32] {
        self.markers.ids()
    }

    /// Text of tokens, special tokens rendered.
    pub fn detokenize(&self, tokens: &[i32]) -> String {
        let toks: Vec<LlamaToken> = tokens.iter().map(|&t| LlamaToken(t)).collect();
        String::from_utf8_lossy(&self.model.vocab().detokenize(&toks, false, true)).into_owned()
    }

    /// Whether the token ends generation.
    pub fn is_eog(&self, token: i32) -> bool {
        self.model.vocab().is_eog(LlamaToken(token))
    }

    /// Model facts.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// Live counters.
    pub fn stats(&self) -> &Arc<EngineStats> {
        &self.stats
    }

    /// The configuration this engine runs with.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Whether the engine thread is still running.
    pub fn is_running(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.tx.send(Command::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_falls_in_the_first_bucket_whose_bound_holds_it() {
        assert_eq!(step_bucket(0.0), 0);
        assert_eq!(step_bucket(0.00025), 0);
        assert_eq!(step_bucket(0.0003), 1);
        assert_eq!(step_bucket(0.003), 4);
        assert_eq!(step_bucket(4.096), STEP_BUCKETS - 2);
        assert_eq!(step_bucket(10.0), STEP_BUCKETS - 1);
    }

    #[test]
    fn a_step_that_published_counts_as_a_publish_whatever_it_prefilled() {
        assert_eq!(STEP_KINDS[step_kind(0, false)], "decode");
        assert_eq!(STEP_KINDS[step_kind(12, false)], "prefill");
        assert_eq!(STEP_KINDS[step_kind(12, true)], "publish");
    }

    #[test]
    fn a_timed_step_counts_once_under_its_kind_with_its_time() {
        let s = EngineStats::default();
        s.time_step(1, Duration::from_millis(3));
        let counts: Vec<Vec<u64>> = s
            .step_hist
            .iter()
            .map(|k| k.iter().map(|c| c.load(Ordering::Relaxed)).collect())
            .collect();
        let mut want = vec![vec![0u64; STEP_BUCKETS]; STEP_KINDS.len()];
        want[1][4] = 1;
        assert_eq!(counts, want);
        assert_eq!(s.step_hist_ns[1].load(Ordering::Relaxed), 3_000_000);
    }
}
