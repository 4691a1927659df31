use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::TierError;

/// Data type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum KvType {
    /// 16-bit floats (llama.cpp's default).
    #[default]
    F16,
    /// 8-bit blocks: half the memory of f16, forces flash attention.
    Q8_0,
    /// 4-bit blocks: a quarter of the memory of f16, forces flash attention.
    Q4_0,
}

/// Configuration of one engine (one model, one context).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// Model id reported by the API (e.g. `t1`).
    pub name: String,
    /// GGUF file.
    pub model: PathBuf,
    /// Total KV cells. Without `kv_unified` each sequence gets `n_ctx / n_seq_max` of them.
    /// Memory: cells x bytes per token
    /// (at f16: 1.5 KiB per token for the bundled t1, 3.5 KiB for t2, 4.5 KiB for t3).
    pub n_ctx: u32,
    /// Longest sequence (prompt + completion); 0 = the model's training context, capped by `n_ctx`.
    pub max_seq_len: u32,
    /// Sequences decoded together. Each costs a sampler and a little bookkeeping; KV is shared.
    pub n_seq_max: u32,
    /// Most tokens submitted to llama.cpp in one step (decode tokens + prompt chunks).
    pub n_batch: u32,
    /// Prompt tokens prefilled per sequence per step. Smaller keeps inter-token latency of running
    /// sequences low while a long prompt is prefilled; larger prefills faster.
    pub prefill_chunk: u32,
    /// Threads for llama.cpp; on a busy machine fewer threads are often faster.
    pub threads: i32,
    /// Requests waiting for a slot before new ones are refused with `Overloaded`.
    pub max_queue: usize,
    /// KV cache data type.
    pub kv_type: KvType,
    /// One KV pool shared by all sequences instead of one stream per sequence. Shared cells
    /// allow long and short sequences to mix, but every decode then attends over the cells of
    /// all sequences, which costs several times more at high concurrency.
    pub kv_unified: bool,
    /// A finished sequence's KV stays in its slot (prompt and answer) and the next request
    /// whose prompt starts with the same tokens reuses it in place, as llama-server's
    /// prompt cache does: the next turn of a conversation prefills only what is new. Free
    /// slots are handed out by longest match, then least recently used. A request whose
    /// prompt starts like one a running sequence has already prefilled copies that KV on the
    /// device (`llama_memory_seq_cp`) instead. Pages are still restored when they cover more
    /// of the prompt. Needs one KV stream per sequence (ignored with `kv_unified`, where
    /// kept cells would crowd out other sequences).
    pub keep_resident: bool,
    /// Most KV kept on the device for finished sequences (`keep_resident`), in MiB: past
    /// it the least recently used kept prefix leaves the device first (its prompt pages stay
    /// in host RAM and bring it back when asked for). Unset: only the slots bound it
    /// (`n_ctx` cells in all); a kept prefix then leaves when its slot takes another prompt.
    pub keep_resident_mib: Option<u64>,
    /// Prefix KV pages: reuse the KV of prompt prefixes seen before.
    pub kv_pages: KvPagesConfig,
    /// Layers (and their KV) offloaded to a GPU when llama.cpp has one (a backend module was
    /// loaded, see [`crate::gpu`]): `"all"` (the default, as llama-server's) or a count; 0
    /// keeps the tier on the CPU. Without a GPU the tier runs on the CPU whatever this says.
    pub gpu_layers: GpuLayers,
    /// The GPU the tier runs on (0 = the first GPU). Unset: llama.cpp splits the layers over
    /// every GPU. A number past the last GPU is refused when the tier starts.
    pub gpu: Option<usize>,
    /// Mixture-of-experts weights kept in host memory while the rest of the offloaded layers
    /// go to the GPU (llama-server's `--cpu-moe` and `--n-cpu-moe N`): `"all"`, a count of
    /// layers (the first N), or `"none"` (the default). The experts are most of such a
    /// model's bytes but only a few of them run per token, so a model several times the
    /// GPU's memory decodes with its attention and shared weights on the device and its
    /// experts computed by the CPU. No effect on a dense model or without a GPU.
    pub cpu_moe: CpuMoe,
    /// Tensors kept in host memory whatever `gpu_layers` says (llama-server's
    /// `-ot PATTERN=CPU`): regular expressions searched in each tensor's name
    /// (`blk\.[0-9]+\.ffn_up_exps`), as llama.cpp reads them (ECMAScript syntax; mesh checks
    /// them with Rust's, which shares the usual subset but not look-around).
    pub cpu_tensors: Vec<String>,
    /// Speculative decoding: a draft model proposes tokens that this engine verifies in one
    /// batch (every request: greedy, sampled and grammar-constrained). `draft = "PATH"` is short for
    /// `[draft] model = "PATH"`; a node config also takes another tier's name.
    #[serde(deserialize_with = "draft_or_path")]
    pub draft: Option<DraftConfig>,
    /// The chat template: a Jinja file, or a built-in name (`mesh-tiers`, `chatml`). Unset:
    /// the GGUF's own `tokenizer.chat_template` (ChatML when it has none).
    pub chat_template: Option<String>,
    /// Runs on the engine thread before the llama.cpp context exists; the node sets it to
    /// bind the thread to the tier's planned cores. Not part of the file config.
    #[serde(skip)]
    pub thread_setup: ThreadSetup,
    /// Far memory for the page store's far tier (`kv_pages.far_bytes`); the node sets it
    /// when the host has a CPU-less NUMA node. Not part of the file config.
    #[serde(skip)]
    pub kv_far_memory: Option<Arc<dyn mesh_kvstore::FarMemory>>,
    /// Where the engine's pages live: the node's page-store actor, under a namespace of
    /// the engine's own. `None`: the engine opens a store of its own. Not part of the file
    /// config.
    #[serde(skip)]
    pub page_store: Option<PageStoreRef>,
}

/// A page store an engine opens its pages in (see [`EngineConfig::page_store`]).
#[derive(Debug, Clone)]
pub struct PageStoreRef {
    /// Opens the namespace.
    pub opener: Arc<dyn mesh_kvstore::PageStoreOpener>,
    /// The engine's namespace (the tier name; the engine id for a variant).
    pub namespace: String,
}

/// Code run first on an engine's own thread. Threads llama.cpp starts later (its compute
/// workers) inherit that thread's CPU mask and memory policy, so a binding applied here
/// covers the whole tier.
#[derive(Clone, Default)]
pub struct ThreadSetup(Option<Arc<dyn Fn() + Send + Sync>>);

impl ThreadSetup {
    /// A setup step.
    pub fn new(f: impl Fn() + Send + Sync + 'static) -> Self {
        Self(Some(Arc::new(f)))
    }

    /// Runs it, if set.
    pub fn run(&self) {
        if let Some(f) = &self.0 {
            f();
        }
    }

    /// Whether a step is set.
    pub fn is_set(&self) -> bool {
        self.0.is_some()
    }
}

impl std::fmt::Debug for ThreadSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_set() {
            "ThreadSetup(set)"
        } else {
            "ThreadSetup(none)"
        })
    }
}

/// Prefix KV pages of one tier (see `mesh-kvstore`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct KvPagesConfig {
    /// Tokens per page; 0 turns paging off. Smaller pages match more of a shared prefix
    /// and cost more hashing and per-page overhead (120-byte header each).
    pub block: usize,
    /// RAM budget of the page store in bytes (t1 pages are ~1 KiB per token).
    pub ram_bytes: u64,
    /// Folder of the disk tier (pages survive restarts); none = RAM only.
    pub disk_dir: Option<PathBuf>,
    /// Disk budget in bytes; 0 turns the disk tier off.
    pub disk_bytes: u64,
    /// Far-memory budget in bytes (pages evicted from RAM go there before they are only
    /// on disk); 0 turns the far tier off. Unset: the node picks it (a quarter of the
    /// host's CPU-less NUMA memory, split among the paged tiers; no tier when the host
    /// has none). Costs memory on the far node only, and a copy per page moved there
    /// or back.
    pub far_bytes: Option<u64>,
}

impl Default for KvPagesConfig {
    fn default() -> Self {
        Self {
            block: 32,
            ram_bytes: 256 << 20,
            disk_dir: None,
            disk_bytes: 4 << 30,
            far_bytes: None,
        }
    }
}

/// The draft model of an engine and its draft-length control (see [`crate::speculative`]).
///
/// Costs: the draft model's weights and a second KV cache of the same cells
/// (`n_ctx`, at the draft's bytes per token: 1.5 KiB for t1 at f16), one draft decode per
/// drafted token per step, and `k` extra target rows per greedy sequence per step.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct DraftConfig {
    /// GGUF of the draft model; its vocabulary must be the engine's.
    pub model: PathBuf,
    /// Draft length of a sequence's first round.
    pub k_init: usize,
    /// Shortest draft (after rounds that accepted less than half).
    pub k_min: usize,
    /// Longest draft (reached by rounds that accept every draft).
    pub k_max: usize,
    /// llama.cpp threads of the draft's one-token decodes (a single drafting sequence;
    /// llama-server's `--threads-draft`). Default 0 = automatic: 1 when the tier runs on
    /// at most 2 threads (a small draft's one-token decode is mostly per-op overhead, and a
    /// second thread adds a barrier per op: t1 drafting for t3 on 2 threads drafted faster
    /// this way on both measured hosts), else the tier's threads (at 8 threads one draft
    /// thread was slower).
    pub threads: i32,
    /// Threads of larger draft decodes (prompt catch-up, several drafting sequences;
    /// llama-server's `--threads-batch-draft`). Default 0 = the tier's threads.
    pub threads_batch: i32,
    /// How a sampled request (temperature > 0) keeps drafts; greedy requests keep a draft
    /// when it is the target's argmax either way.
    pub acceptance: DraftAcceptance,
}

/// Acceptance rule for drafts of sampled requests.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DraftAcceptance {
    /// Speculative sampling (vLLM's rejection sampler): the draft samples with the
    /// request's settings and a draft is kept with probability `min(1, p / q)`, else the
    /// token comes from the residual `max(0, p - q)`. Emitted tokens follow the target's
    /// distribution exactly, and more drafts are kept than by `exact`; a seeded request's
    /// tokens are reproducible, but not the ones the tier gives without a draft.
    #[default]
    Rejection,
    /// The target samples each row as plain decoding would and a draft is kept when it is
    /// that token (llama.cpp's server): a seeded request gives the same tokens as without
    /// a draft, at a lower acceptance.
    Exact,
}

impl Default for DraftConfig {
    fn default() -> Self {
        Self {
            model: PathBuf::new(),
            k_init: 4,
            k_min: 1,
            k_max: 12,
            threads: 0,
            threads_batch: 0,
            acceptance: DraftAcceptance::Rejection,
        }
    }
}

/// The expert tensors a tier keeps in host memory (see [`EngineConfig::cpu_moe`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CpuMoe {
    /// Every expert tensor follows `gpu_layers`.
    #[default]
    None,
    /// Every layer's experts stay in host memory.
    All,
    /// The experts of the first `n` layers stay in host memory.
    First(u32),
}

/// llama.cpp's pattern for a layer's stacked expert tensors (common.h `LLM_FFN_EXPS_REGEX`:
/// gate, up, down and fused gate-up, plain or channel-wise).
pub const EXPERT_TENSORS: &str = "\\.ffn_(up|down|gate|gate_up)_(ch|)exps";

impl CpuMoe {
    /// `all`, `none` or a count.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim() {
            "all" => Ok(Self::All),
            "none" => Ok(Self::None),
            n => n
                .parse()
                .map(Self::First)
                .map_err(|_| format!("cpu moe: `{s}` is neither `all`, `none` nor a count")),
        }
    }

    /// The tensor-name patterns it keeps in host memory, as llama-server writes them for
    /// `--cpu-moe` (one pattern) and `--n-cpu-moe N` (one per layer, `blk\.I` first).
    pub fn patterns(self) -> Vec<String> {
        match self {
            Self::None => Vec::new(),
            Self::All => vec![EXPERT_TENSORS.to_owned()],
            Self::First(n) => (0..n)
                .map(|i| format!("blk\\.{i}{EXPERT_TENSORS}"))
                .collect(),
        }
    }
}

impl Serialize for CpuMoe {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::None => s.serialize_str("none"),
            Self::All => s.serialize_str("all"),
            Self::First(n) => s.serialize_u32(*n),
        }
    }
}

impl<'de> Deserialize<'de> for CpuMoe {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        count_or_word(d, Self::First, Self::parse)
    }
}

/// A config value written as a count or a word (`4`, `"all"`): `count` makes it from a
/// number, `parse` from text (a count in quotes included).
fn count_or_word<'de, D: serde::Deserializer<'de>, T>(
    d: D,
    count: impl Fn(u32) -> T,
    parse: impl Fn(&str) -> Result<T, String>,
) -> Result<T, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Form {
        Count(u32),
        Text(String),
    }
    match Form::deserialize(d)? {
        Form::Count(n) => Ok(count(n)),
        Form::Text(t) => parse(&t).map_err(serde::de::Error::custom),
    }
}

/// How many of a model's layers go to the GPU: `"all"` or a count in a config file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuLayers {
    /// Every layer and the output layer (llama.cpp's default).
    #[default]
    All,
    /// The last `n` repeating layers (llama.cpp's `-ngl n`; more than the model has also takes
    /// the output layer); 0 keeps the model on the CPU.
    Count(u32),
}

impl GpuLayers {
    /// `all` or a count.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim() {
            "all" => Ok(Self::All),
            n => n
                .parse()
                .map(Self::Count)
                .map_err(|_| format!("gpu layers: `{s}` is neither `all` nor a count")),
        }
    }
}

impl Serialize for GpuLayers {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::All => s.serialize_str("all"),
            Self::Count(n) => s.serialize_u32(*n),
        }
    }
}

impl<'de> Deserialize<'de> for GpuLayers {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        count_or_word(d, Self::Count, Self::parse)
    }
}

fn draft_or_path<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<DraftConfig>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Form {
        Path(PathBuf),
        Table(DraftConfig),
    }
    Ok(Option::<Form>::deserialize(d)?.map(|f| match f {
        Form::Path(model) => DraftConfig {
            model,
            ..DraftConfig::default()
        },
        Form::Table(t) => t,
    }))
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            name: "t1".into(),
            model: PathBuf::from("models/t1-q8_0.gguf"),
            n_ctx: 16384,
            max_seq_len: 0,
            n_seq_max: 8,
            n_batch: 1024,
            prefill_chunk: 512,
            threads: 1,
            max_queue: 64,
            kv_type: KvType::F16,
            kv_unified: false,
            keep_resident: true,
            keep_resident_mib: None,
            kv_pages: KvPagesConfig::default(),
            gpu_layers: GpuLayers::All,
            gpu: None,
            cpu_moe: CpuMoe::None,
            cpu_tensors: Vec::new(),
            draft: None,
            chat_template: None,
            thread_setup: ThreadSetup::default(),
            kv_far_memory: None,
            page_store: None,
        }
    }
}

/// Checks one `cpu_tensors` pattern: not empty, no NUL byte (it goes to llama.cpp as a C
/// string), and a regular expression Rust's `regex` compiles (llama.cpp would throw on a
/// malformed one while loading, and the load would fail without saying why).
fn cpu_tensor_pattern(p: &str) -> Result<(), String> {
    if p.is_empty() {
        return Err("cpu_tensors: an empty pattern would match every tensor".into());
    }
    if p.contains('\0') {
        return Err(format!(
            "cpu_tensors: `{}` holds a NUL byte",
            p.escape_debug()
        ));
    }
    regex::Regex::new(p)
        .map(|_| ())
        .map_err(|e| format!("cpu_tensors: `{p}` is not a regular expression: {e}"))
}

impl EngineConfig {
    /// Tensor-name patterns whose tensors stay in host memory: `cpu_moe`'s, then
    /// `cpu_tensors`.
    pub fn cpu_patterns(&self) -> Vec<String> {
        let mut out = self.cpu_moe.patterns();
        out.extend(self.cpu_tensors.iter().cloned());
        out
    }

    /// Checks values that llama.cpp would otherwise reject late or abort on.
    pub fn validate(&self) -> Result<(), TierError> {
        let bad = |m: &str| Err(TierError::Config(format!("{}: {m}", self.name)));
        if self.name.is_empty() {
            return bad("name must not be empty");
        }
        if self.n_seq_max == 0 || self.n_seq_max > 256 {
            return bad("n_seq_max must be in 1..=256");
        }
        if self.prefill_chunk == 0 {
            return bad("prefill_chunk must be at least 1");
        }
        if self.n_batch < self.n_seq_max + self.prefill_chunk {
            return bad("n_batch must be at least n_seq_max + prefill_chunk (every running sequence decodes and one prompt chunk fits each step)");
        }
        if self.n_ctx < 64 {
            return bad("n_ctx must be at least 64");
        }
        if self.kv_pages.block > 0
            && self.kv_pages.block > self.n_ctx as usize / self.n_seq_max as usize
        {
            return bad("kv_pages.block must not exceed one sequence's context");
        }
        if self.threads < 1 {
            return bad("threads must be at least 1");
        }
        for p in &self.cpu_tensors {
            if let Err(e) = cpu_tensor_pattern(p) {
                return bad(&e);
            }
        }
        if let Some(d) = &self.draft {
            if d.k_min == 0 || d.k_min > d.k_init || d.k_init > d.k_max {
                return bad("draft: need 1 <= k_min <= k_init <= k_max");
            }
            if d.threads < 0 || d.threads_batch < 0 {
                return bad("draft.threads and draft.threads_batch must be 0 (automatic) or more");
            }
            // Every greedy sequence may verify k_max drafts plus its own token in one step.
            let rows = self.n_seq_max as usize * (d.k_max + 1) + self.prefill_chunk as usize;
            if (self.n_batch as usize) < rows {
                return bad("with a draft, n_batch must be at least n_seq_max x (draft.k_max + 1) + prefill_chunk");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_moe_all_keeps_every_layers_experts_with_llama_servers_pattern() {
        assert_eq!(
            CpuMoe::parse("all").unwrap().patterns(),
            vec!["\\.ffn_(up|down|gate|gate_up)_(ch|)exps".to_owned()]
        );
    }

    #[test]
    fn cpu_moe_of_n_layers_names_each_layer_from_the_first() {
        assert_eq!(
            CpuMoe::parse("2").unwrap().patterns(),
            vec![
                "blk\\.0\\.ffn_(up|down|gate|gate_up)_(ch|)exps".to_owned(),
                "blk\\.1\\.ffn_(up|down|gate|gate_up)_(ch|)exps".to_owned(),
            ]
        );
    }

    #[test]
    fn cpu_moe_none_keeps_nothing() {
        assert!(CpuMoe::parse("none").unwrap().patterns().is_empty());
        assert!(CpuMoe::default().patterns().is_empty());
    }

    #[test]
    fn cpu_moe_refuses_other_words() {
        let e = CpuMoe::parse("experts").unwrap_err();
        assert!(e.contains("`experts`"), "{e}");
    }

    #[test]
    fn a_tier_file_takes_cpu_moe_as_a_word_or_a_count() {
        let all: EngineConfig = serde_json::from_str(r#"{"cpu_moe": "all"}"#).unwrap();
        assert_eq!(all.cpu_moe, CpuMoe::All);
        let four: EngineConfig = serde_json::from_str(r#"{"cpu_moe": 4}"#).unwrap();
        assert_eq!(four.cpu_moe, CpuMoe::First(4));
        let back = serde_json::to_value(&four).unwrap();
        assert_eq!(back["cpu_moe"], 4);
    }

    #[test]
    fn cpu_patterns_put_cpu_moe_before_cpu_tensors() {
        let cfg = EngineConfig {
            cpu_moe: CpuMoe::First(1),
            cpu_tensors: vec!["output\\.weight".into()],
            ..EngineConfig::default()
        };
        assert_eq!(
            cfg.cpu_patterns(),
            vec![
                "blk\\.0\\.ffn_(up|down|gate|gate_up)_(ch|)exps".to_owned(),
                "output\\.weight".to_owned(),
            ]
        );
    }

    #[test]
    fn a_malformed_cpu_tensor_pattern_is_refused_with_the_pattern() {
        let cfg = EngineConfig {
            cpu_tensors: vec!["ffn_(up".into()],
            ..EngineConfig::default()
        };
        let e = cfg.validate().unwrap_err().to_string();
        assert!(
            e.contains("cpu_tensors: `ffn_(up` is not a regular expression"),
            "{e}"
        );
    }

    #[test]
    fn an_empty_cpu_tensor_pattern_is_refused() {
        let cfg = EngineConfig {
            cpu_tensors: vec![String::new()],
            ..EngineConfig::default()
        };
        assert!(cfg.validate().is_err());
    }
}
