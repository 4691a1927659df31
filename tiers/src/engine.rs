use std::collections::VecDeque;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use llama_cpp_2::context::params::{KvCacheType, LlamaContextParams};
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::chat;
use crate::format::{ChatFormat, ChatInput, FormatError, Rendered, SpecialTokens, ThinkMarkers};
use crate::kvcache::{KvCache, PromptPages, ReuseStats};
use crate::markers::Markers;
use crate::plan::{self, SlotView, Work};
use crate::reasoning::{self, SpanState};
use crate::sampler::{allowed_argmax, top2, DraftSampler, RequestSampler};
use crate::speculative;
use crate::stop::StopMatcher;
use crate::{
    DraftAcceptance, DraftConfig, EngineConfig, FinishReason, GenerateRequest, KvType,
    LogprobEntry, TierError, TokenEvent, TokenLogprobs, Usage,
};

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
}

/// The phases of an engine step, in order: building the batch (planning, prompt chunks),
/// the draft model's decodes (speculative tiers), the model's decode (until its results are
/// on the host: on a GPU the whole computation), choosing tokens (sampling, verifying
/// drafts), emitting them (text, stop strings, events), and publishing new KV pages.
pub const STEP_PHASES: [&str; 6] = ["schedule", "draft", "decode", "sample", "emit", "publish"];

/// Indices into [`EngineStats::step_ns`].
mod phase {
    pub(super) const SCHEDULE: usize = 0;
    pub(super) const DRAFT: usize = 1;
    pub(super) const DECODE: usize = 2;
    pub(super) const SAMPLE: usize = 3;
    pub(super) const EMIT: usize = 4;
    pub(super) const PUBLISH: usize = 5;
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

/// Loads a draft model and checks that it shares the target's vocabulary.
/// The control and user-defined tokens of `model`'s vocabulary, as markers.
fn vocab_markers(model: &LlamaModel) -> Markers {
    use llama_cpp_2::token_type::LlamaTokenAttr;
    let vocab = model.vocab();
    Markers::new(vocab.tokens().filter_map(|t| {
        let attr = vocab.attr(t);
        if !(attr.contains(LlamaTokenAttr::Control) || attr.contains(LlamaTokenAttr::UserDefined)) {
            return None;
        }
        let text = vocab.text(t)?.to_str().ok()?.to_owned();
        Some((text, t.0))
    }))
}

/// Where the tier's layers go: `gpu_layers` of them to the GPUs llama.cpp has (all of them,
/// or the one `gpu` names). Without a GPU llama.cpp keeps everything on the CPU.
fn model_params(cfg: &EngineConfig) -> Result<LlamaModelParams, TierError> {
    let mut p = LlamaModelParams::default();
    if let crate::GpuLayers::Count(n) = cfg.gpu_layers {
        p = p.with_n_gpu_layers(n);
    }
    if let Some(gpu) = cfg.gpu {
        let index = crate::gpu::gpu_device_index(&crate::gpu::devices(), gpu)
            .map_err(|e| TierError::Config(format!("{}: {e}", cfg.name)))?;
        p = p
            .with_split_mode(llama_cpp_2::model::params::LlamaSplitMode::None)
            .with_main_gpu(0)
            .with_devices(&[index])
            .map_err(|e| TierError::Config(format!("{}: gpu {gpu}: {e}", cfg.name)))?;
    }
    Ok(p)
}

/// Loads the draft model with the target's placement (`params`).
fn load_draft(
    target: &LlamaModel,
    d: &DraftConfig,
    params: &LlamaModelParams,
) -> Result<LlamaModel, TierError> {
    let path = d.model.display().to_string();
    if !d.model.exists() {
        return Err(TierError::ModelLoad {
            path,
            reason: "draft model file not found".into(),
        });
    }
    let m = LlamaModel::load_from_file(backend(), &d.model, params).map_err(|e| {
        TierError::ModelLoad {
            path: path.clone(),
            reason: e.to_string(),
        }
    })?;
    if m.n_vocab() != target.n_vocab() {
        return Err(TierError::Config(format!(
            "draft {path}: vocabulary of {} tokens, the target has {}",
            m.n_vocab(),
            target.n_vocab()
        )));
    }
    Ok(m)
}

/// A context for `model` with the tier's settings and `(threads, threads_batch)`:
/// llama.cpp runs one-token decodes on the first, larger batches on the second.
fn new_context<'m>(
    model: &'m LlamaModel,
    cfg: &EngineConfig,
    (threads, threads_batch): (i32, i32),
) -> Result<LlamaContext<'m>, TierError> {
    let kv = match cfg.kv_type {
        KvType::F16 => KvCacheType::F16,
        KvType::Q8_0 => KvCacheType::Q8_0,
        KvType::Q4_0 => KvCacheType::Q4_0,
    };
    let params = LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(cfg.n_ctx))
        .with_n_batch(cfg.n_batch)
        .with_n_ubatch(cfg.n_batch)
        .with_n_seq_max(cfg.n_seq_max)
        .with_kv_unified(cfg.kv_unified)
        .with_n_threads(threads)
        .with_n_threads_batch(threads_batch)
        .with_type_k(kv)
        .with_type_v(kv);
    model
        .new_context(backend(), params)
        .map_err(|e| TierError::Context(e.to_string()))
}

/// Threads of the draft context: llama.cpp's `n_threads` (one-token decodes) and
/// `n_threads_batch` (larger ones). 0 in the config: one-token decodes on one thread when
/// the tier has at most two, else the tier's count; batches on the tier's count.
fn draft_threads(cfg: &EngineConfig, d: &DraftConfig) -> (i32, i32) {
    let one = match d.threads {
        0 if cfg.threads <= 2 => 1,
        0 => cfg.threads,
        n => n,
    };
    let batch = if d.threads_batch > 0 {
        d.threads_batch
    } else {
        cfg.threads
    };
    (one, batch)
}

/// Learns the KV layout (one probe token in sequence 0, then cleared) and opens the page
/// store. Paging is switched off, with a warning, if any of it fails.
fn start_pages(
    model: &LlamaModel,
    ctx: &mut LlamaContext<'_>,
    cfg: &EngineConfig,
    worker: Option<crate::kvcache::Worker>,
) -> Option<KvCache> {
    if cfg.kv_pages.block == 0 {
        return None;
    }
    let mut batch = LlamaBatch::new(1, 1);
    let tok = model.vocab().bos();
    let layout = batch
        .add(tok, 0, &[0], true)
        .ok()
        .and_then(|_| ctx.decode(&mut batch).ok())
        .and_then(|_| KvCache::probe_layout(ctx, 0));
    let _ = ctx.clear_kv_cache_seq(Some(0), None, None);
    let Some(layout) = layout else {
        warn!(tier = %cfg.name, "could not read the KV layout; prefix pages off");
        return None;
    };
    let opener = cfg
        .page_store
        .as_ref()
        .map(|p| (p.opener.as_ref(), p.namespace.as_str()));
    match KvCache::new(
        &cfg.kv_pages,
        &cfg.model,
        layout,
        cfg.kv_far_memory.clone(),
        opener,
        worker,
    ) {
        Ok(k) => Some(k),
        Err(e) => {
            warn!(tier = %cfg.name, error = %e, "prefix pages off");
            None
        }
    }
}

struct Slot {
    pages: PromptPages,
    req: GenerateRequest,
    events: mpsc::UnboundedSender<TokenEvent>,
    sampler: RequestSampler,
    stop: StopMatcher,
    age: u64,
    reserve: usize,
    prefilled: usize,
    /// Prompt tokens that were not computed (kept in place or restored from pages).
    cached: usize,
    pending: Option<LlamaToken>,
    generated: usize,
    utf8: Vec<u8>,
    /// Where the sequence stands relative to its think span (reasoning governor state).
    span: SpanState,
    reasoning_capped: bool,
    /// Draft state when this sequence is decoded speculatively.
    spec: Option<SpecSeq>,
    /// Tokens emitted so far (the sequence's KV holds the prompt, then these).
    out: Vec<i32>,
    /// Its prompt was prefilled in this step and its new pages are not published yet: they
    /// are, once the step's first tokens went out (or before the slot is freed).
    publish_due: bool,
    /// Log-probabilities of the token being emitted, when the request asks for them.
    logprobs: Option<Box<TokenLogprobs>>,
}

/// KV a finished sequence left in its slot: its tokens (prompt, then answer) at positions
/// `0..tokens.len()`, reusable by a request of the same cache scope.
struct Resident {
    tokens: Vec<i32>,
    /// Leading tokens of `tokens` the slot's draft KV holds too (0 without a draft).
    draft: usize,
    scope: String,
    /// Age stamp of its last use (lower = older, handed out first).
    used: u64,
}

/// Drops sequence `seq`'s KV cells from position `from` on and returns the positions kept:
/// `from`, or 0 when the memory cannot drop a suffix (recurrent models), which then loses
/// them all.
fn cut_seq(ctx: &mut LlamaContext<'_>, seq: usize, from: usize) -> usize {
    let cut = ctx
        .clear_kv_cache_seq(Some(seq as u32), Some(from as u32), None)
        .unwrap_or(false);
    if cut {
        from
    } else {
        let _ = ctx.clear_kv_cache_seq(Some(seq as u32), None, None);
        0
    }
}

/// Fewest more tokens a copy of another sequence's KV must give over what the slot holds
/// in place: with one KV stream per sequence the copy moves the whole stream (on a GPU a
/// device-to-device copy of microseconds, on a CPU a memcpy), so a few tokens are cheaper
/// to prefill.
const MIN_COPY_GAIN: usize = 16;

/// Whether copying `shared` prompt tokens from another sequence beats the `in_place`
/// tokens the slot already holds.
fn worth_copying(shared: usize, in_place: usize) -> bool {
    shared >= in_place + MIN_COPY_GAIN
}

/// Makes sequence `dst` hold the first `n` positions of sequence `src`. With one KV stream
/// per sequence (the only layout that keeps KV on the device between requests) llama.cpp
/// copies `src`'s whole stream at the start of the next decode, before that decode writes
/// anything, and `dst` is cut to `n`; `src`'s positions below `n` are prompt tokens it has
/// already decoded, so the copy sees them as they are now.
fn copy_prefix(ctx: &mut LlamaContext<'_>, src: usize, dst: usize, n: usize) {
    let _ = ctx.clear_kv_cache_seq(Some(dst as u32), None, None);
    let _ = ctx.copy_kv_cache_seq(src as i32, dst as i32, None, None);
    let _ = ctx.clear_kv_cache_seq(Some(dst as u32), Some(n as u32), None);
}

/// Length of the common leading run of `a` and `b`.
fn common_prefix(a: &[i32], b: &[i32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Tokens a slot's KV holds that are known to be its prompt followed by its output:
/// the prefilled prompt, and once generating, every emitted token but the last (which
/// is either not fed yet or, in a speculative round, may sit over a rejected draft).
fn kept_tokens(prefilled: usize, prompt_len: usize, generated: usize) -> usize {
    if generated == 0 {
        prefilled
    } else {
        prompt_len + generated - 1
    }
}

/// The draft model's context, on the engine thread next to the target's.
struct Draft<'m> {
    ctx: LlamaContext<'m>,
    batch: LlamaBatch<'static>,
    cfg: DraftConfig,
}

impl<'m> Draft<'m> {
    fn new(ctx: LlamaContext<'m>, cfg: &DraftConfig, engine: &EngineConfig) -> Self {
        Self {
            ctx,
            batch: LlamaBatch::new(engine.n_batch as usize, 1),
            cfg: cfg.clone(),
        }
    }
}

/// Speculative state of one sequence.
///
/// The sequence's tokens are its prompt followed by `out`; the last of them is the
/// pending token (not yet in the target's KV). The draft's KV holds the first `dpos`.
struct SpecSeq {
    out: Vec<i32>,
    dpos: usize,
    /// Leading positions of the draft's KV known to hold the sequence's own tokens (the
    /// rest, up to `dpos`, are this round's drafts).
    fed: usize,
    /// Draft length of the next round (adapts, `speculative::next_k`).
    k: usize,
    /// Drafts this step may propose (planned before the step).
    k_step: usize,
    /// Drafts proposed this step, verified in the same step.
    drafts: Vec<i32>,
    /// The draft's distribution at each of `drafts` (sampled requests under rejection
    /// sampling; empty otherwise).
    dists: Vec<Vec<(i32, f32)>>,
    /// Draws the drafts of a sampled request under rejection sampling.
    sampled: Option<DraftSampler>,
    /// This round's copy of a greedy request's grammar, advanced over its drafts, so the
    /// draft proposes only tokens the grammar allows.
    grammar: Option<llama_cpp_2::sampling::LlamaSampler>,
    drafted: usize,
    accepted: usize,
}

impl SpecSeq {
    fn token(&self, prompt: &[i32], i: usize) -> i32 {
        if i < prompt.len() {
            prompt[i]
        } else {
            self.out[i - prompt.len()]
        }
    }
}

struct Loop<'m> {
    model: &'m LlamaModel,
    ctx: LlamaContext<'m>,
    cfg: EngineConfig,
    max_seq_len: usize,
    n_ctx: usize,
    stats: Arc<EngineStats>,
    slots: Vec<Option<Slot>>,
    waiting: VecDeque<Pending>,
    reserved: usize,
    next_age: u64,
    batch: LlamaBatch<'static>,
    kv: Option<KvCache>,
    /// Pages some running sequence will publish when its prompt is prefilled (refcounts).
    pending: std::collections::HashMap<mesh_kvstore::PageId, usize>,
    /// The reasoning markers, when the tier's format has them (the governor's).
    think: Option<Think>,
    /// The draft model, when sequences are decoded speculatively.
    draft: Option<Draft<'m>>,
    /// Hardware counters of this thread and llama.cpp's, when the kernel gives them.
    hw: Option<crate::hwcount::HwCounters>,
    /// KV kept in each free slot by its last sequence (`EngineConfig::keep_resident`).
    resident: Vec<Option<Resident>>,
    keep_resident: bool,
    /// Most tokens of kept KV on the device (`EngineConfig::keep_resident_mib`).
    keep_budget: Option<usize>,
    /// The model's memory cannot drop a suffix (recurrent or hybrid): no prefix copies.
    recurrent: bool,
}

impl<'m> Loop<'m> {
    fn new(
        model: &'m LlamaModel,
        ctx: LlamaContext<'m>,
        cfg: &EngineConfig,
        info: &ModelInfo,
        stats: Arc<EngineStats>,
        kv: Option<KvCache>,
        draft: Option<Draft<'m>>,
    ) -> Self {
        Self {
            model,
            ctx,
            cfg: cfg.clone(),
            max_seq_len: info.max_seq_len,
            n_ctx: info.n_ctx,
            stats,
            slots: (0..cfg.n_seq_max).map(|_| None).collect(),
            waiting: VecDeque::new(),
            reserved: 0,
            next_age: 0,
            batch: LlamaBatch::new(cfg.n_batch as usize, 1),
            kv,
            pending: std::collections::HashMap::new(),
            think: None,
            draft,
            hw: None,
            resident: (0..cfg.n_seq_max).map(|_| None).collect(),
            keep_resident: cfg.keep_resident && !cfg.kv_unified,
            keep_budget: cfg.keep_resident_mib.map(|mib| {
                let shape = crate::shape::ModelShape {
                    file_bytes: 0,
                    n_layer: model.n_layer(),
                    n_embd: model.n_embd().max(0) as u32,
                    n_head: model.n_head(),
                    n_head_kv: model.n_head_kv(),
                };
                ((mib << 20) / shape.kv_bytes_per_cell(cfg.kv_type).max(1)) as usize
            }),
            recurrent: model.is_recurrent() || model.is_hybrid(),
        }
    }

    fn run(mut self, rx: std_mpsc::Receiver<Command>) {
        loop {
            let idle = self.waiting.is_empty() && self.slots.iter().all(Option::is_none);
            if idle {
                match rx.recv() {
                    Ok(Command::Submit(p)) => self.waiting.push_back(*p),
                    Ok(Command::Shutdown) | Err(_) => break,
                    Ok(Command::Crash) => panic!("engine {}: crash injected", self.cfg.name),
                }
            }
            let mut shutdown = false;
            while let Ok(cmd) = rx.try_recv() {
                match cmd {
                    Command::Submit(p) => self.waiting.push_back(*p),
                    Command::Shutdown => shutdown = true,
                    Command::Crash => panic!("engine {}: crash injected", self.cfg.name),
                }
            }
            if shutdown {
                break;
            }
            self.drop_cancelled();
            self.admit();
            self.step();
        }
        for i in 0..self.slots.len() {
            if let Some(s) = self.slots[i].take() {
                let _ = s.events.send(TokenEvent::Error("engine stopped".into()));
            }
        }
        for p in self.waiting.drain(..) {
            let _ = p.events.send(TokenEvent::Error("engine stopped".into()));
        }
    }

    fn drop_cancelled(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|p| !p.events.is_closed());
        let gone = before - self.waiting.len();
        if gone > 0 {
            self.stats.queued.fetch_sub(gone, Ordering::Relaxed);
            self.stats
                .cancelled
                .fetch_add(gone as u64, Ordering::Relaxed);
        }
        for i in 0..self.slots.len() {
            if self.slots[i].as_ref().is_some_and(|s| s.events.is_closed()) {
                debug!(slot = i, "client went away; freeing sequence");
                self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
                let _ = self.free(i);
            }
        }
    }

    fn admit(&mut self) {
        let mut i = 0;
        while i < self.waiting.len() {
            if self.slots.iter().all(Option::is_some) {
                break;
            }
            let p = &self.waiting[i];
            if self.reserved + p.reserve > self.n_ctx {
                break;
            }
            // A request whose next uncached pages are being prefilled by a running sequence
            // waits for them to be published instead of computing the same prefix again,
            // when they are at least half of its remaining prompt (`worth_waiting`);
            // requests behind it may go first.
            if let Some(kv) = &mut self.kv {
                if kv.waits_for(&p.req.prompt, &p.req.cache_scope, &self.pending) {
                    i += 1;
                    continue;
                }
            }
            let p = self.waiting.remove(i).expect("index in range");
            self.stats.queued.fetch_sub(1, Ordering::Relaxed);
            let sampler = match RequestSampler::new(self.model, &p.req) {
                Ok(s) => s,
                Err(e) => {
                    let _ = p.events.send(TokenEvent::Error(e.to_string()));
                    continue;
                }
            };
            let queued_ms = p.queued_at.elapsed().as_millis() as u64;
            self.stats.started.fetch_add(1, Ordering::Relaxed);
            self.stats
                .queued_ms_total
                .fetch_add(queued_ms, Ordering::Relaxed);
            let _ = p.events.send(TokenEvent::Started { queued_ms });
            self.reserved += p.reserve;
            self.stats
                .reserved_cells
                .fetch_add(p.reserve, Ordering::Relaxed);
            self.stats.active.fetch_add(1, Ordering::Relaxed);
            let stop = StopMatcher::new(&p.req.stop);
            let (seq, in_place, draft_in_place) = self.take_slot(&p.req.prompt, &p.req.cache_scope);
            self.stats
                .draft_resident_tokens
                .fetch_add(draft_in_place as u64, Ordering::Relaxed);
            // The nearest level first: the slot's own kept KV, then a copy of another running
            // sequence's KV on the same device, then pages (host RAM, far memory, disk, peer),
            // which are restored only when they cover more than either.
            let copy = self.copy_source(seq, &p.req.prompt, &p.req.cache_scope, in_place);
            let device = copy.map_or(in_place, |(_, n)| n);
            let (pages, prefilled) = match &mut self.kv {
                Some(kv) => kv.restore(
                    &mut self.ctx,
                    seq as i32,
                    &p.req.prompt,
                    &p.req.cache_scope,
                    device,
                ),
                None => (PromptPages::default(), device),
            };
            let copied = match copy {
                Some((src, n)) if prefilled == n => {
                    copy_prefix(&mut self.ctx, src, seq, n);
                    self.stats.device_copies.fetch_add(1, Ordering::Relaxed);
                    self.stats
                        .device_copy_tokens
                        .fetch_add(n as u64, Ordering::Relaxed);
                    debug!(
                        src,
                        dst = seq,
                        tokens = n,
                        "copied a prompt prefix on the device"
                    );
                    true
                }
                _ => false,
            };
            if !copied && in_place > 0 && prefilled == in_place {
                self.stats.resident_hits.fetch_add(1, Ordering::Relaxed);
                self.stats
                    .resident_tokens
                    .fetch_add(in_place as u64, Ordering::Relaxed);
            }
            for id in pages.pending() {
                *self.pending.entry(*id).or_default() += 1;
            }
            // Every request is decoded speculatively when the tier has a draft. Verification
            // runs the request's own sampler chain (grammar, sampling) row by row: greedy and
            // `exact` sampled requests keep a draft only when the chain picks that very token,
            // so the chain sees exactly the calls plain decoding would make, in the same
            // order (greedy output is identical, a seeded sampled request draws the same
            // random numbers for the same positions); under `rejection` a sampled request's
            // drafts are drawn from the draft's distribution and kept by speculative
            // sampling against the chain's distribution. A grammar is enforced on every
            // emitted token either way.
            let spec = self.draft.as_ref().map(|d| SpecSeq {
                out: Vec::new(),
                dpos: draft_in_place,
                fed: draft_in_place,
                k: d.cfg.k_init,
                k_step: 0,
                drafts: Vec::new(),
                dists: Vec::new(),
                sampled: match d.cfg.acceptance {
                    DraftAcceptance::Rejection => DraftSampler::new(self.model, &p.req),
                    DraftAcceptance::Exact => None,
                },
                grammar: None,
                drafted: 0,
                accepted: 0,
            });
            let span = SpanState::new(self.think.is_some() && p.req.thinking_open);
            self.slots[seq] = Some(Slot {
                pages,
                req: p.req,
                events: p.events,
                sampler,
                stop,
                age: self.next_age,
                reserve: p.reserve,
                prefilled,
                cached: prefilled,
                pending: None,
                generated: 0,
                utf8: Vec::new(),
                span,
                reasoning_capped: false,
                spec,
                out: Vec::new(),
                publish_due: false,
                logprobs: None,
            });
            self.next_age += 1;
        }
    }

    /// Picks a free slot for a prompt (there is one): the one whose kept KV shares the
    /// longest prefix with it, else the one kept longest unused (empty ones first). Cuts
    /// the slot's KV (the target's and the draft's) to the shared part; returns the slot,
    /// the tokens kept in place (at most `prompt.len() - 1`: the last prompt token is
    /// always prefilled for its logits) and how many of them the draft's KV holds.
    fn take_slot(&mut self, prompt: &[i32], scope: &str) -> (usize, usize, usize) {
        let limit = prompt.len().saturating_sub(1);
        let mut best: Option<(usize, usize, u64)> = None;
        for (i, slot) in self.slots.iter().enumerate() {
            if slot.is_some() {
                continue;
            }
            let (shared, used) = match &self.resident[i] {
                Some(r) if r.scope == scope => {
                    (common_prefix(&r.tokens, prompt).min(limit), r.used + 1)
                }
                Some(r) => (0, r.used + 1),
                None => (0, 0),
            };
            if best.is_none_or(|(_, m, u)| shared > m || (shared == m && used < u)) {
                best = Some((i, shared, used));
            }
        }
        let (slot, mut shared, _) = best.expect("admit checked for a free slot");
        let mut draft_shared = 0;
        if let Some(r) = self.resident[slot].take() {
            shared = cut_seq(&mut self.ctx, slot, shared);
            let dropped = r.tokens.len().saturating_sub(shared);
            self.stats
                .resident_dropped_tokens
                .fetch_add(dropped as u64, Ordering::Relaxed);
            if let Some(d) = &mut self.draft {
                draft_shared = cut_seq(&mut d.ctx, slot, shared.min(r.draft));
            }
        }
        (slot, shared, draft_shared)
    }

    /// The running sequence whose KV holds the longest prefix of `prompt` (same cache scope,
    /// prompt positions already decoded) and how many tokens of it, when copying them into
    /// slot `dst` beats what `dst` holds in place ([`worth_copying`]). None when KV is not
    /// kept on the device between sequences (`keep_resident` off, or a unified KV cache) and
    /// for models whose memory cannot be cut after a copy (recurrent, hybrid).
    fn copy_source(
        &self,
        dst: usize,
        prompt: &[i32],
        scope: &str,
        in_place: usize,
    ) -> Option<(usize, usize)> {
        if !self.keep_resident || self.recurrent {
            return None;
        }
        let limit = prompt.len().saturating_sub(1);
        let (src, n) = self
            .slots
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != dst)
            .filter_map(|(i, s)| {
                let s = s.as_ref()?;
                if s.req.cache_scope != scope {
                    return None;
                }
                let held = &s.req.prompt[..s.prefilled.min(s.req.prompt.len())];
                Some((i, common_prefix(held, prompt).min(limit)))
            })
            .max_by_key(|&(i, n)| (n, std::cmp::Reverse(i)))?;
        worth_copying(n, in_place).then_some((src, n))
    }

    /// Drops kept KV from the device, least recently used first, until what stays fits the
    /// keep budget (`EngineConfig::keep_resident_mib`); its prompt pages, published when it
    /// was prefilled, bring it back from host RAM.
    fn keep_within_budget(&mut self) {
        let Some(budget) = self.keep_budget else {
            return;
        };
        let kept: Vec<plan::Kept> = self
            .resident
            .iter()
            .enumerate()
            .filter_map(|(slot, r)| {
                r.as_ref().map(|r| plan::Kept {
                    slot,
                    tokens: r.tokens.len(),
                    used: r.used,
                })
            })
            .collect();
        for slot in plan::over_keep_budget(&kept, budget) {
            let tokens = self.resident[slot].as_ref().map_or(0, |r| r.tokens.len());
            self.forget(slot);
            self.stats
                .resident_dropped_tokens
                .fetch_add(tokens as u64, Ordering::Relaxed);
            debug!(
                slot,
                tokens, "kept KV left the device (over the keep budget)"
            );
        }
    }

    /// Forgets what a slot keeps (its KV state is not known to match its tokens).
    fn forget(&mut self, slot: usize) {
        self.resident[slot] = None;
        let _ = self.ctx.clear_kv_cache_seq(Some(slot as u32), None, None);
        if let Some(d) = &mut self.draft {
            let _ = d.ctx.clear_kv_cache_seq(Some(slot as u32), None, None);
        }
    }

    /// Drops a slot's claim on the pages it was going to publish.
    fn unpend(&mut self, slot: &Slot) {
        for id in slot.pages.pending() {
            if let Some(n) = self.pending.get_mut(id) {
                *n -= 1;
                if *n == 0 {
                    self.pending.remove(id);
                }
            }
        }
    }

    /// Removes a slot and releases its KV cells (or keeps them in the slot for the next
    /// request, `keep_resident`); returns it so the caller can still report.
    fn free(&mut self, i: usize) -> Option<Slot> {
        let mut s = self.slots[i].take()?;
        // A sequence that ends at its first token publishes before its KV goes; its end is
        // reported once its pages are stored.
        self.publish(i, &mut s);
        self.unpend(&s);
        s.pages.clear_pending();
        if let Some(kv) = &self.kv {
            kv.wait(&s.pages);
        }
        let prompt_len = s.req.prompt.len();
        let keep = kept_tokens(s.prefilled, prompt_len, s.generated);
        let kept = self.keep_resident
            && keep > 0
            && self
                .ctx
                .clear_kv_cache_seq(Some(i as u32), Some(keep as u32), None)
                .unwrap_or(false);
        if kept {
            let mut tokens = s.req.prompt[..keep.min(prompt_len)].to_vec();
            tokens.extend_from_slice(&s.out[..keep.saturating_sub(prompt_len)]);
            // The draft keeps what it holds of those tokens for the slot's next request
            // (a conversation's next turn), past it only drafts, which go.
            let draft = match (&mut self.draft, &s.spec) {
                (Some(d), Some(sp)) => cut_seq(&mut d.ctx, i, sp.fed.min(keep)),
                _ => 0,
            };
            self.resident[i] = Some(Resident {
                tokens,
                draft,
                scope: s.req.cache_scope.clone(),
                used: self.next_age,
            });
            self.next_age += 1;
            self.keep_within_budget();
        } else {
            self.forget(i);
        }
        self.reserved -= s.reserve;
        self.stats
            .reserved_cells
            .fetch_sub(s.reserve, Ordering::Relaxed);
        self.stats.active.fetch_sub(1, Ordering::Relaxed);
        Some(s)
    }

    fn step(&mut self) {
        let start = Instant::now();
        let views: Vec<SlotView> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                s.as_ref().map(|s| SlotView {
                    slot: i,
                    age: s.age,
                    prefilled: s.prefilled,
                    prompt_len: s.req.prompt.len(),
                    decoding: s.pending.is_some(),
                })
            })
            .collect();
        // The drafts of speculative sequences take target rows before any prompt chunk.
        let draft_rows = self.plan_drafts();
        let work = plan::plan_step(
            &views,
            (self.cfg.n_batch as usize).saturating_sub(draft_rows),
            self.cfg.prefill_chunk as usize,
        );
        if work.is_empty() {
            return;
        }
        let drafting = Instant::now();
        self.draft(&work);
        let drafted = Instant::now();
        self.batch.clear();
        let mut rows: Vec<(usize, i32)> = Vec::new();
        let mut prompt_done: Vec<usize> = Vec::new();
        let mut prompt_tokens = 0u64;
        for w in &work {
            match *w {
                Work::Decode { slot } => {
                    let s = self.slots[slot].as_mut().expect("planned slot exists");
                    let pos = (s.req.prompt.len() + s.generated - 1) as i32;
                    let tok = s.pending.take().expect("decoding slot has a token");
                    let row = self.batch.n_tokens();
                    self.batch
                        .add(tok, pos, &[slot as i32], true)
                        .expect("batch sized for plan");
                    // Drafts follow the pending token, each with logits, so one decode
                    // scores all of them.
                    for (j, &d) in s.spec.iter().flat_map(|sp| &sp.drafts).enumerate() {
                        self.batch
                            .add(LlamaToken(d), pos + 1 + j as i32, &[slot as i32], true)
                            .expect("batch sized for plan and drafts");
                    }
                    rows.push((slot, row));
                }
                Work::Prefill {
                    slot,
                    start,
                    len,
                    last,
                } => {
                    let s = self.slots[slot].as_mut().expect("planned slot exists");
                    for p in start..start + len {
                        let logits = last && p + 1 == start + len;
                        let row = self.batch.n_tokens();
                        self.batch
                            .add(
                                LlamaToken(s.req.prompt[p]),
                                p as i32,
                                &[slot as i32],
                                logits,
                            )
                            .expect("batch sized for plan");
                        if logits {
                            rows.push((slot, row));
                        }
                    }
                    s.prefilled += len;
                    prompt_tokens += len as u64;
                    if last {
                        prompt_done.push(slot);
                    }
                }
            }
        }
        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        if let Some(hw) = &mut self.hw {
            hw.publish(&self.stats.hw);
        }
        self.stats
            .prompt_tokens
            .fetch_add(prompt_tokens, Ordering::Relaxed);
        let decoding = Instant::now();
        self.add_time(phase::SCHEDULE, decoding - start - (drafted - drafting));
        self.add_time(phase::DRAFT, drafted - drafting);
        let decoded = self.ctx.decode(&mut self.batch);
        // Waits here for a device's results, so that the time is the decode's.
        self.ctx.synchronize();
        let sampling = Instant::now();
        self.add_time(phase::DECODE, sampling - decoding);
        if let Err(e) = decoded {
            warn!(error = %e, "decode failed; failing the sequences of this batch");
            let mut failed: Vec<usize> = work
                .iter()
                .map(|w| match *w {
                    Work::Decode { slot } | Work::Prefill { slot, .. } => slot,
                })
                .collect();
            failed.dedup();
            for slot in failed {
                let freed = self.free(slot);
                self.forget(slot);
                if let Some(s) = freed {
                    let _ = s
                        .events
                        .send(TokenEvent::Error(format!("decode failed: {e}")));
                }
            }
            return;
        }
        // Prompts prefilled in this step publish their new pages after their first token
        // went out: a publish reads the sequence's whole KV state (on a GPU, a copy to host
        // memory of every layer's cells), which the first token need not wait for.
        if self.kv.is_some() {
            for &slot in &prompt_done {
                if let Some(s) = self.slots[slot].as_mut() {
                    s.publish_due = true;
                }
            }
        }
        let emitted = self.stats.step_ns[phase::EMIT].load(Ordering::Relaxed);
        for (slot, row) in rows {
            let (drafts, dists) = self.slots[slot]
                .as_mut()
                .and_then(|s| s.spec.as_mut())
                .map(|sp| {
                    (
                        std::mem::take(&mut sp.drafts),
                        std::mem::take(&mut sp.dists),
                    )
                })
                .unwrap_or_default();
            if drafts.is_empty() {
                let (tok, margin) = self.choose(slot, row);
                self.emit(slot, tok, margin);
            } else {
                self.verify(slot, row, &drafts, &dists);
            }
        }
        let publishing = Instant::now();
        let emit_ns = self.stats.step_ns[phase::EMIT].load(Ordering::Relaxed) - emitted;
        self.add_time(
            phase::SAMPLE,
            (publishing - sampling).saturating_sub(Duration::from_nanos(emit_ns)),
        );
        for slot in prompt_done {
            if let Some(mut s) = self.slots[slot].take() {
                self.publish(slot, &mut s);
                self.slots[slot] = Some(s);
            }
        }
        self.add_time(phase::PUBLISH, publishing.elapsed());
    }

    /// Adds `d` to the time of step phase `i`.
    fn add_time(&self, i: usize, d: Duration) {
        self.stats.step_ns[i].fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Publishes the new pages of `s` (in slot `slot`) when they are due, and releases its
    /// claim on them, so that requests waiting for them go on.
    fn publish(&mut self, slot: usize, s: &mut Slot) {
        if !std::mem::take(&mut s.publish_due) {
            return;
        }
        if let Some(kv) = &mut self.kv {
            kv.publish(&self.ctx, slot as i32, &mut s.pages);
        }
        self.unpend(s);
        s.pages.clear_pending();
    }

    /// Sets each decoding speculative sequence's draft length for this step; returns the
    /// target rows they add.
    fn plan_drafts(&mut self) -> usize {
        let max_seq_len = self.max_seq_len;
        let mut rows = 0;
        for s in self.slots.iter_mut().flatten() {
            let Some(sp) = &mut s.spec else { continue };
            sp.k_step = 0;
            if s.pending.is_some() {
                let n = s.req.prompt.len() + s.generated;
                let k = s.req.draft_max.map_or(sp.k, |m| sp.k.min(m.max(1)));
                sp.k_step = speculative::draft_len(
                    k,
                    s.req.max_tokens.saturating_sub(s.generated),
                    max_seq_len.saturating_sub(n),
                );
                rows += sp.k_step;
            }
        }
        rows
    }

    /// Draft phase of a step. The first draft decode feeds every speculative sequence the
    /// tokens its draft KV lacks (prompt chunks alongside the target's, up to
    /// `prefill_chunk` per sequence, then the tokens accepted since its last round);
    /// a decoding sequence that is caught up then proposes `k_step` tokens greedily, one
    /// draft decode per token with all drafting sequences in each.
    fn draft(&mut self, work: &[Work]) {
        let Some(d) = self.draft.as_mut() else {
            return;
        };
        let cap = self.cfg.n_batch as usize;
        let chunk = self.cfg.prefill_chunk as usize;
        d.batch.clear();
        let mut rows: Vec<(usize, i32)> = Vec::new();
        for w in work {
            let (slot, decoding) = match *w {
                Work::Decode { slot } => (slot, true),
                Work::Prefill { slot, .. } => (slot, false),
            };
            let Some(s) = self.slots[slot].as_mut() else {
                continue;
            };
            let Some(sp) = s.spec.as_mut() else {
                continue;
            };
            // Tokens the target holds after this step (a decoding sequence: with its pending one).
            let goal = match *w {
                Work::Prefill { start, len, .. } => start + len,
                Work::Decode { .. } => s.req.prompt.len() + s.generated,
            };
            let from = sp.dpos;
            let to = goal.min(from + chunk);
            if from >= to || d.batch.n_tokens() as usize + (to - from) > cap {
                continue;
            }
            let drafting = decoding && sp.k_step > 0 && to == goal;
            for i in from..to {
                let logits = drafting && i + 1 == to;
                d.batch
                    .add(
                        LlamaToken(sp.token(&s.req.prompt, i)),
                        i as i32,
                        &[slot as i32],
                        logits,
                    )
                    .expect("checked against the batch capacity");
            }
            self.stats
                .draft_prefill_tokens
                .fetch_add((to - from) as u64, Ordering::Relaxed);
            sp.dpos = to;
            sp.fed = to;
            if drafting {
                // The grammar as the target will check the first draft's position (it has
                // accepted every emitted token, the pending one included).
                sp.grammar = s.sampler.grammar_copy();
                rows.push((slot, d.batch.n_tokens() - 1));
            }
        }
        if d.batch.n_tokens() == 0 {
            return;
        }
        loop {
            if let Err(e) = d.ctx.decode(&mut d.batch) {
                warn!(error = %e, "draft decode failed; sequences decode without drafts until their draft KV is rebuilt");
                for (i, s) in self.slots.iter_mut().enumerate() {
                    if let Some(sp) = s.as_mut().and_then(|s| s.spec.as_mut()) {
                        sp.drafts.clear();
                        sp.dists.clear();
                        sp.dpos = 0;
                        sp.fed = 0;
                        let _ = d.ctx.clear_kv_cache_seq(Some(i as u32), None, None);
                    }
                }
                return;
            }
            d.batch.clear();
            let mut next = Vec::new();
            for (slot, row) in rows {
                let sp = self.slots[slot]
                    .as_mut()
                    .and_then(|s| s.spec.as_mut())
                    .expect("drafting slot is speculative");
                let t = match (&mut sp.sampled, &mut sp.grammar) {
                    (Some(ds), _) => {
                        let (t, q) = ds.draw(&d.ctx, row);
                        sp.dists.push(q);
                        t
                    }
                    (None, Some(g)) => match allowed_argmax(&d.ctx, row, g) {
                        Some(t) => t.0,
                        // The grammar allows nothing more: the round's drafts end here.
                        None => continue,
                    },
                    (None, None) => speculative::argmax(d.ctx.get_logits_ith(row)),
                };
                sp.drafts.push(t);
                if sp.drafts.len() < sp.k_step {
                    d.batch
                        .add(LlamaToken(t), sp.dpos as i32, &[slot as i32], true)
                        .expect("one row per drafting sequence");
                    sp.dpos += 1;
                    next.push((slot, d.batch.n_tokens() - 1));
                }
            }
            if next.is_empty() {
                return;
            }
            rows = next;
        }
    }

    /// Verifies a speculative sequence's drafts. Rows `row..=row + drafts.len()` hold the
    /// target's logits after its pending token and after each draft; tokens are chosen
    /// row by row exactly as in plain decoding and emitted while they equal the drafts,
    /// or, when `dists` holds the draft's distributions (rejection sampling), kept or
    /// replaced by [`speculative::accept_sampled`]. The first token that is not the draft,
    /// or the one after the last draft, ends the round (so a round emits 1..=k+1 tokens,
    /// fewer when the sequence finishes inside it). KV cells past the accepted tokens are
    /// then removed from both contexts.
    fn verify(&mut self, slot: usize, row: i32, drafts: &[i32], dists: &[Vec<(i32, f32)>]) {
        let n = {
            let s = self.slots[slot].as_mut().expect("verified slot exists");
            s.spec.as_mut().expect("speculative slot").drafted += drafts.len();
            s.req.prompt.len() + s.generated
        };
        self.stats
            .draft_tokens
            .fetch_add(drafts.len() as u64, Ordering::Relaxed);
        let mut accepted = 0;
        for j in 0..=drafts.len() {
            let (tok, margin) = match (drafts.get(j), dists.get(j)) {
                (Some(&x), Some(q)) => self.choose_sampled(slot, row + j as i32, x, q),
                _ => self.choose(slot, row + j as i32),
            };
            let hit = drafts.get(j) == Some(&tok.0);
            if hit {
                accepted += 1;
                self.stats.draft_accepted.fetch_add(1, Ordering::Relaxed);
                if let Some(sp) = self.slots[slot].as_mut().and_then(|s| s.spec.as_mut()) {
                    sp.accepted += 1;
                }
            }
            let finished = self.emit(slot, tok, margin);
            if finished || !hit {
                break;
            }
        }
        // A finished sequence was freed, cells and all.
        let Some(sp) = self.slots[slot].as_mut().and_then(|s| s.spec.as_mut()) else {
            return;
        };
        let d = self
            .draft
            .as_mut()
            .expect("speculative slots imply a draft");
        sp.k = speculative::next_k(sp.k, drafts.len(), accepted, d.cfg.k_min, d.cfg.k_max);
        // The target holds the pending token and the accepted drafts; the new pending
        // token is the next position.
        let keep = n + accepted;
        let _ = self
            .ctx
            .clear_kv_cache_seq(Some(slot as u32), Some(keep as u32), None);
        // What the draft KV keeps now is the sequence's: the caught-up tokens and the
        // accepted drafts.
        sp.dpos = sp.dpos.min(keep);
        sp.fed = sp.dpos;
        let _ = d
            .ctx
            .clear_kv_cache_seq(Some(slot as u32), Some(sp.dpos as u32), None);
    }

    /// The token plain decoding would choose from logits row `row`: the request's sampler
    /// chain, or `</think>` when the reasoning budget is spent. Returns it with its margin.
    fn choose(&mut self, slot: usize, row: i32) -> (LlamaToken, f32) {
        let (argmax, first, second) = top2(self.ctx.get_logits_ith(row));
        let margin = margin_of(first, second);
        let spent = self.budget_spent(slot);
        let s = self.slots[slot].as_mut().expect("sampled slot exists");
        let tok = match &self.think {
            // Reasoning governor: the budget is spent, so close the think block in place
            // of whatever the model would have said next (one token of the close marker
            // per step when the vocabulary spells it in several).
            Some(t) if spent => {
                let close = LlamaToken(reasoning::next_close_token(&s.out, &t.close_tokens));
                s.sampler.accept(close);
                s.reasoning_capped = true;
                self.stats.reasoning_capped.fetch_add(1, Ordering::Relaxed);
                close
            }
            _ => {
                let (tok, refused) = s.sampler.sample(&self.ctx, row, argmax as i32);
                if refused {
                    self.stats.grammar_refusals.fetch_add(1, Ordering::Relaxed);
                }
                tok
            }
        };
        self.note_logprobs(slot, row, tok);
        (tok, margin)
    }

    /// Keeps the log-probabilities of `tok` at logits row `row` for its event, when the
    /// request asks for them.
    fn note_logprobs(&mut self, slot: usize, row: i32, tok: LlamaToken) {
        let s = self.slots[slot].as_mut().expect("sampled slot exists");
        if let Some(n) = s.req.logprobs {
            let lp = token_logprobs(self.model, self.ctx.get_logits_ith(row), tok, n);
            s.logprobs = Some(Box::new(lp));
        }
    }

    /// The token for logits row `row` of a sampled sequence whose draft `x` was drawn from
    /// `q`: speculative sampling against the distribution the request's chain draws from
    /// (its draws then follow that distribution exactly, as plain decoding's do). The
    /// reasoning governor's `</think>` overrides, as in [`Self::choose`].
    fn choose_sampled(
        &mut self,
        slot: usize,
        row: i32,
        x: i32,
        q: &[(i32, f32)],
    ) -> (LlamaToken, f32) {
        if self.budget_spent(slot) {
            return self.choose(slot, row);
        }
        let (_, first, second) = top2(self.ctx.get_logits_ith(row));
        let margin = margin_of(first, second);
        let s = self.slots[slot].as_mut().expect("sampled slot exists");
        let p = s.sampler.distribution(&self.ctx, row);
        let ds = s
            .spec
            .as_mut()
            .and_then(|sp| sp.sampled.as_mut())
            .expect("drafts with distributions come from a draft sampler");
        let (u, v) = (ds.uniform(), ds.uniform());
        let tok = LlamaToken(speculative::accept_sampled(&p, q, x, u, v).0);
        s.sampler.accept(tok);
        self.note_logprobs(slot, row, tok);
        (tok, margin)
    }

    /// Whether the reasoning governor closes the think block of `slot` at its next token.
    fn budget_spent(&self, slot: usize) -> bool {
        let s = self.slots[slot].as_ref().expect("slot exists");
        self.think.as_ref().is_some_and(|t| {
            reasoning::budget_spent(&s.span, s.req.reasoning_budget, t.close_tokens.len())
        })
    }

    /// Appends a chosen token to its sequence: reasoning state, text, stop strings, the
    /// event, and the end of the sequence. Returns whether the sequence finished (its slot
    /// is then free).
    fn emit(&mut self, slot: usize, tok: LlamaToken, margin: f32) -> bool {
        let start = Instant::now();
        let finished = self.emit_token(slot, tok, margin);
        self.add_time(phase::EMIT, start.elapsed());
        finished
    }

    /// [`Self::emit`]'s work, untimed.
    fn emit_token(&mut self, slot: usize, tok: LlamaToken, margin: f32) -> bool {
        let model = self.model;
        let s = self.slots[slot].as_mut().expect("emitting slot exists");
        s.out.push(tok.0);
        if let Some(sp) = &mut s.spec {
            sp.out.push(tok.0);
        }
        let eog = model.vocab().is_eog(tok);
        // The token's text, looked up once for the reasoning span and the reply.
        let piece = (!eog || self.think.is_some())
            .then(|| model.vocab().token_to_piece(tok, true, None))
            .unwrap_or_default();
        if let Some(t) = &self.think {
            let before = s.span.tokens;
            s.span
                .push(&String::from_utf8_lossy(&piece), &t.open, &t.close);
            if s.span.tokens > before {
                self.stats.reasoning_tokens.fetch_add(1, Ordering::Relaxed);
            }
        }
        s.generated += 1;
        self.stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
        let mut text = String::new();
        let mut stopped = false;
        if !eog {
            s.utf8.extend(piece);
            let valid = match std::str::from_utf8(&s.utf8) {
                Ok(t) => t.len(),
                Err(e) if e.error_len().is_none() => e.valid_up_to(),
                Err(_) => s.utf8.len(), // invalid bytes: release them lossily
            };
            let piece: Vec<u8> = s.utf8.drain(..valid).collect();
            let fed = s.stop.feed(&String::from_utf8_lossy(&piece));
            text = fed.release;
            stopped = fed.stopped;
        }
        let _ = s.events.send(TokenEvent::Token {
            id: tok.0,
            text,
            margin,
            logprobs: s.logprobs.take(),
        });
        let total = s.req.prompt.len() + s.generated;
        let finish = if eog || stopped {
            Some(FinishReason::Stop)
        } else if s.generated >= s.req.max_tokens {
            Some(FinishReason::Length)
        } else if total >= self.max_seq_len {
            Some(FinishReason::ContextFull)
        } else {
            None
        };
        match finish {
            Some(finish) => {
                let tail = if stopped {
                    String::new()
                } else {
                    s.stop.flush() + &String::from_utf8_lossy(&std::mem::take(&mut s.utf8))
                };
                let usage = Usage {
                    prompt_tokens: s.req.prompt.len(),
                    completion_tokens: s.generated,
                    reasoning_tokens: s.span.tokens,
                    reasoning_capped: s.reasoning_capped,
                    draft_tokens: s.spec.as_ref().map_or(0, |sp| sp.drafted),
                    draft_accepted: s.spec.as_ref().map_or(0, |sp| sp.accepted),
                    cached_tokens: s.cached,
                    stop_index: s.stop.matched(),
                };
                // Free before reporting, so a caller that sees Done also sees the slot free.
                let s = self.free(slot).expect("slot exists");
                let _ = s.events.send(TokenEvent::Done {
                    finish,
                    usage,
                    tail,
                });
                true
            }
            None => {
                s.pending = Some(tok);
                false
            }
        }
    }
}

/// The reasoning markers as the governor uses them: their text, found in what a sequence
/// writes however the model split it into tokens, and the close marker's tokenization,
/// which the governor writes when a budget is spent.
struct Think {
    open: String,
    close: String,
    close_tokens: Vec<i32>,
}

impl Think {
    fn new(model: &LlamaModel, t: &ThinkMarkers) -> Self {
        let close_tokens = model
            .vocab()
            .tokenize(t.close.as_bytes(), false, true)
            .iter()
            .map(|t| t.0)
            .collect();
        Self {
            open: t.open.clone(),
            close: t.close.clone(),
            close_tokens,
        }
    }
}

/// Whether a GGUF's metadata (`meta`: key → value as text) describes an embedding model,
/// which pools its outputs instead of predicting tokens: its architecture and pooling, else
/// `None`. llama.cpp writes `{arch}.pooling_type` for BERT-style encoders (nomic-bert,
/// MiniLM) and embedding variants of decoders; 0 is "none".
fn embedding_only(meta: impl Fn(&str) -> Option<String>) -> Option<String> {
    let arch = meta("general.architecture")?;
    let pooling = meta(&format!("{arch}.pooling_type"))?;
    let causal = meta(&format!("{arch}.attention.causal"));
    (pooling.trim() != "0" || causal.as_deref() == Some("false"))
        .then(|| format!("{arch}, pooling type {pooling}"))
}

/// The tier's chat format: its `chat_template` (a file or a built-in name), else the
/// GGUF's template, else ChatML. A GGUF template minijinja cannot compile falls back to
/// ChatML with a warning (the tier still chats); a configured one that fails is an error.
fn chat_format(model: &LlamaModel, cfg: &EngineConfig) -> Result<ChatFormat, TierError> {
    let vocab = model.vocab();
    let piece =
        |t: LlamaToken| String::from_utf8_lossy(&vocab.token_to_piece(t, true, None)).into_owned();
    let single = |s: &str| matches!(vocab.tokenize(s.as_bytes(), false, true)[..], [_]);
    let tokens = SpecialTokens {
        bos: piece(vocab.bos()),
        eos: piece(vocab.eos()),
        add_bos: vocab.should_add_bos(),
        think_tokens: single("<think>") && single("</think>"),
    };
    let fail = |e: FormatError| TierError::Config(format!("{}: {e}", cfg.name));
    let f = match &cfg.chat_template {
        Some(t) => {
            let (source, origin) = match crate::format::builtin_template(t) {
                Some(src) => (src.to_owned(), t.clone()),
                None => (
                    std::fs::read_to_string(t).map_err(|e| {
                        TierError::Config(format!("{}: chat_template {t}: {e}", cfg.name))
                    })?,
                    t.clone(),
                ),
            };
            ChatFormat::new(&source, &origin, tokens).map_err(fail)?
        }
        None => match model.chat_template(None).ok().and_then(|t| t.to_string().ok()) {
            Some(src) => ChatFormat::new(&src, "gguf", tokens.clone()).or_else(|e| {
                warn!(tier = %cfg.name, error = %e, "the GGUF's chat template does not compile here; using ChatML (set chat_template to a file to override)");
                ChatFormat::new(crate::format::CHATML_TEMPLATE, "chatml", tokens)
            }).map_err(fail)?,
            None => {
                info!(tier = %cfg.name, "the GGUF has no chat template; using ChatML");
                ChatFormat::new(crate::format::CHATML_TEMPLATE, "chatml", tokens).map_err(fail)?
            }
        },
    };
    let (spec, shows) = (f.spec(), f.shows());
    info!(tier = %cfg.name, template = %spec.template, tool_syntax = spec.syntax.as_str(),
        reasoning = spec.think.is_some(), template_shows_tools = spec.template_tools,
        template_shows_calls = shows.calls, template_shows_results = shows.results,
        template_shows_system = shows.system, "chat format");
    Ok(f)
}

/// The log-probability of `tok` and the `n` most likely tokens of logits row `logits`.
fn token_logprobs(model: &LlamaModel, logits: &[f32], tok: LlamaToken, n: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let lse = max + sum.ln() as f32;
    let entry = |id: i32| LogprobEntry {
        id,
        bytes: model.vocab().token_to_piece(LlamaToken(id), true, None),
        logprob: logits[id as usize] - lse,
    };
    let mut top: Vec<(f32, i32)> = Vec::with_capacity(n + 1);
    if n > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if top.len() < n || l > top[top.len() - 1].0 {
                let at = top.partition_point(|(x, _)| *x >= l);
                top.insert(at, (l, i as i32));
                top.truncate(n);
            }
        }
    }
    TokenLogprobs {
        token: entry(tok.0),
        top: top.into_iter().map(|(_, id)| entry(id)).collect(),
    }
}

/// Difference between the two largest logits (= their log-probability gap), from
/// [`top2`]'s largest and second largest.
fn margin_of(first: f32, second: f32) -> f32 {
    if second.is_finite() {
        first - second
    } else {
        f32::INFINITY
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(key, _)| *key == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn a_pooling_encoder_is_an_embedding_model() {
        let m = meta(&[
            ("general.architecture", "nomic-bert"),
            ("nomic-bert.pooling_type", "1"),
        ]);
        assert_eq!(
            embedding_only(m).as_deref(),
            Some("nomic-bert, pooling type 1")
        );
    }

    #[test]
    fn a_decoder_without_pooling_generates_text() {
        let m = meta(&[("general.architecture", "qwen2")]);
        assert_eq!(embedding_only(m), None);
    }

    #[test]
    fn pooling_none_generates_text() {
        let m = meta(&[
            ("general.architecture", "llama"),
            ("llama.pooling_type", "0"),
        ]);
        assert_eq!(embedding_only(m), None);
    }

    #[test]
    fn draft_threads_default_to_one_for_small_tiers_and_follow_the_config() {
        let tier = |threads| EngineConfig {
            threads,
            ..EngineConfig::default()
        };
        let auto = DraftConfig::default();
        assert_eq!(draft_threads(&tier(1), &auto), (1, 1));
        assert_eq!(draft_threads(&tier(2), &auto), (1, 2));
        assert_eq!(draft_threads(&tier(8), &auto), (8, 8));
        let set = DraftConfig {
            threads: 3,
            threads_batch: 5,
            ..DraftConfig::default()
        };
        assert_eq!(draft_threads(&tier(8), &set), (3, 5));
        assert_eq!(draft_threads(&tier(2), &set), (3, 5));
    }

    #[test]
    fn a_device_copy_must_beat_the_tokens_held_in_place_by_a_margin() {
        assert!(worth_copying(MIN_COPY_GAIN, 0));
        assert!(!worth_copying(MIN_COPY_GAIN - 1, 0));
        assert!(worth_copying(500, 100));
        assert!(!worth_copying(100 + MIN_COPY_GAIN - 1, 100));
        assert!(!worth_copying(0, 0));
    }
}
