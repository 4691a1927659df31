//! Node configuration: defaults, then a TOML file, then `MESH_*` environment
//! variables, then command-line flags (each layer overrides the one before).
//!
//! ```toml
//! listen = "127.0.0.1:8080"
//! max_concurrent = 64      # requests in flight at the gateway; more get 429
//! [[tiers]]
//! name = "t1"
//! model = "models/t1-q8_0.gguf"  # or a pulled pack model: "qwen2.5-coder-0.5b-instruct"
//! n_ctx = 8192             # KV cells shared by all sequences of this tier
//! n_seq_max = 8
//! threads = 1
//! [[tiers]]
//! name = "t3"
//! model = "models/t3-q8_0.gguf"
//! draft = "t1"             # t1 drafts, t3 verifies (a tier name or a GGUF path)
//! # or: draft = { model = "t1", k_init = 4, k_min = 1, k_max = 12, acceptance = "rejection" }
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use mesh_control::mcp::McpServerConfig;
use mesh_control::{EmbedderConfig, RouterConfig};
use mesh_tiers::cascade::{CascadePolicy, ReasoningPolicy};
use mesh_tiers::EngineConfig;
use serde::{Deserialize, Serialize};

use crate::env;

/// Configuration of one node.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeConfig {
    /// Gateway address.
    pub listen: SocketAddr,
    /// Requests in flight at the gateway before new ones get 429.
    pub max_concurrent: usize,
    /// Seconds a client is told to wait after a 429.
    pub retry_after_s: u64,
    /// Default completion budget when a request sets none.
    pub default_max_tokens: usize,
    /// Tiers this node hosts (may be empty for a gateway-only cluster node).
    pub tiers: Vec<EngineConfig>,
    /// Cluster membership; absent for a standalone node (`mesh up`).
    pub cluster: Option<ClusterSettings>,
    /// The tier cascade (`[cascade]`): model id, tier order, confidence thresholds.
    pub cascade: CascadePolicy,
    /// Reasoning-token budgets (`[reasoning]`).
    pub reasoning: ReasoningPolicy,
    /// Tool routing (`[tool_routing]`): which of a request's tools the prompt shows.
    pub tool_routing: ToolRouting,
    /// Embedding models served at `/v1/embeddings` (`[[embeddings]]`), loaded when the
    /// node starts; default none.
    pub embeddings: Vec<EmbeddingModel>,
    /// Tier placement on this host's cores (`[placement]`).
    pub placement: mesh_control::placement::PlacementConfig,
    /// MCP tool servers (`[[mcp.servers]]`) for agent tasks.
    pub mcp: McpSettings,
    /// The server-side agent loop (`[agent]`).
    pub agent: AgentSettings,
    /// The policy tuner (`[tuner]`): state file, probe workload, gate.
    pub tuner: TunerSettings,
    /// What this node runs (`gateway`, `tiers`, `store`, `prefill`, `decode`); default
    /// `["gateway", "tiers"]`.
    pub roles: Vec<Role>,
    /// The page store peers demote pages to (the `store` role).
    pub store: StoreSettings,
    /// Longest a request may take, restarts and failovers included (seconds).
    pub request_timeout_s: u64,
    /// Longest a request waits for this node's restarting engine when no other node
    /// hosts its tier (seconds, within `request_timeout_s`).
    pub restart_wait_s: u64,
    /// Token that `POST /v1/debug/crash` requests must carry (`x-mesh-fault-token`); set
    /// only by `mesh up --fault-injection` with `MESH_FAULT_TOKEN`. None: the route answers
    /// 404. Not part of the file config.
    #[serde(skip)]
    pub fault_token: Option<String>,
    /// API keys (`[auth]`).
    pub auth: AuthSettings,
    /// Client limits (`[limits]`): per-key rate and concurrency, body size, connections.
    pub limits: LimitSettings,
    /// Tier scaling (`[scaling]`): tiers this node starts only on request, the cores it
    /// offers, and the per-tier policies the cluster's planner follows.
    pub scaling: ScalingSettings,
}

/// Tier scaling (`[scaling]`, `docs/fleet.md`). Every cluster node runs a planner; the live
/// node with the first name plans for the cluster, with its own `[scaling.tiers]`.
///
/// ```toml
/// [scaling]
/// standby = ["t3"]        # configured tiers this node starts only when the planner asks
/// cores = 8               # cores it offers to tiers (default: the host's, cgroup quota included)
/// interval_ms = 1000      # the planner's tick
/// window_s = 10           # queue time is averaged over this window
///
/// [scaling.tiers.t3]
/// min_replicas = 1
/// max_replicas = 3
/// target_queue_ms = 500   # mean wait for a sequence that adds a replica
/// cooldown_s = 60         # no automatic change within this long of the last one
/// scale_in_below = 0.5    # drain one when the rest would be at most this busy
/// ```
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScalingSettings {
    /// Configured tiers not started with the node; a planner starts them here on request.
    pub standby: Vec<String>,
    /// Cores this node offers to tiers; default: what the process may use.
    pub cores: Option<u32>,
    /// Time between the planner's decisions (ms).
    pub interval_ms: u64,
    /// Window of the queue time (s).
    pub window_s: u64,
    /// Scaling policy per tier.
    pub tiers: std::collections::BTreeMap<String, mesh_control::scaling::TierScaling>,
}

impl Default for ScalingSettings {
    fn default() -> Self {
        Self {
            standby: vec![],
            cores: None,
            interval_ms: 1000,
            window_s: 10,
            tiers: Default::default(),
        }
    }
}

impl ScalingSettings {
    fn validate(&self, tiers: &[EngineConfig]) -> anyhow::Result<()> {
        for s in &self.standby {
            anyhow::ensure!(
                tiers.iter().any(|t| &t.name == s),
                "scaling.standby names `{s}`, which has no [[tiers]] entry on this node"
            );
        }
        anyhow::ensure!(
            self.interval_ms >= 50,
            "scaling.interval_ms must be at least 50"
        );
        anyhow::ensure!(self.window_s >= 1, "scaling.window_s must be at least 1");
        anyhow::ensure!(self.cores != Some(0), "scaling.cores must be at least 1");
        for (name, p) in &self.tiers {
            p.validate()
                .map_err(|e| anyhow::anyhow!("scaling.tiers.{name}: {e}"))?;
        }
        Ok(())
    }

    /// Cores offered to tiers.
    pub fn cores(&self) -> u32 {
        self.cores
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get() as u32))
    }
}

/// Client limits (`[limits]`). A key's own `--rpm`/`--concurrency` (`mesh keys create`)
/// replace the per-key defaults; on a node without keys, "per key" means per client
/// address.
///
/// ```toml
/// [limits]
/// requests_per_minute = 600   # per key; 0 = no rate limit (default)
/// burst = 20                  # requests a key may make at once before the rate applies
/// concurrent_per_key = 16     # requests in flight per key; 0 = no limit (default)
/// max_body_bytes = 2097152    # larger request bodies get 413
/// header_read_timeout_s = 10  # a connection that has not sent its headers by then is closed
/// max_connections = 1024      # open client connections; more wait to be accepted
/// ```
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitSettings {
    /// Requests per minute per key (0: unlimited).
    pub requests_per_minute: u32,
    /// Requests a key may make back to back before the rate applies (0: one second's worth,
    /// at least 1).
    pub burst: u32,
    /// Requests in flight per key (0: unlimited; `max_concurrent` still caps the node).
    pub concurrent_per_key: u32,
    /// Largest request body in bytes.
    pub max_body_bytes: usize,
    /// Seconds a client connection has to send a request's headers.
    pub header_read_timeout_s: u64,
    /// Client connections open at once; further ones wait in the listen backlog.
    pub max_connections: usize,
}

impl Default for LimitSettings {
    fn default() -> Self {
        Self {
            requests_per_minute: 0,
            burst: 0,
            concurrent_per_key: 0,
            max_body_bytes: 2 << 20,
            header_read_timeout_s: 10,
            max_connections: 1024,
        }
    }
}

/// API keys (`[auth]`): with a key file, every `/v1` route asks for a key
/// (`Authorization: Bearer`) with the scope it needs; see `mesh keys`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthSettings {
    /// Key file written by `mesh keys create` (`--keys`); none: no key is asked for.
    pub keys_file: Option<PathBuf>,
    /// Serve a non-loopback address without keys (`--insecure-no-auth`); without it such a
    /// node refuses to start.
    pub insecure_no_auth: bool,
}

/// A part a node plays in the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Serves clients (HTTP) and routes each request to whichever node hosts its tier; a
    /// gateway without tiers routes tools through a peer's router.
    Gateway,
    /// Hosts the configured tiers (engines) and the tool router.
    Tiers,
    /// Keeps the KV pages peers demote to it (RAM, and disk with `store.dir`).
    Store,
    /// Hosts the configured tiers for prompts only: decode nodes hand it long prompts to
    /// prefill and pull the pages it computed. Requests are routed to it for decoding only
    /// when no other node hosts their tier.
    Prefill,
    /// Hosts the configured tiers and hands the prefill of long prompts to a `prefill`
    /// node (`[cluster] handoff_tokens`, `handoff_max_queue`), then decodes from the pages it
    /// pulls from it.
    Decode,
}

impl Role {
    /// As adverts and flags write it.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Gateway => "gateway",
            Role::Tiers => "tiers",
            Role::Store => "store",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    /// The role named `s`.
    pub fn parse(s: &str) -> anyhow::Result<Self> {
        match s {
            "gateway" => Ok(Role::Gateway),
            "tiers" => Ok(Role::Tiers),
            "store" => Ok(Role::Store),
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            other => {
                anyhow::bail!("unknown role `{other}` (gateway, tiers, store, prefill, decode)")
            }
        }
    }
}

/// The page store of a `store` node (`[store]`): the pages compute nodes demote to it and
/// fetch back.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StoreSettings {
    /// Folder of the disk tier (one subfolder per namespace; pages survive restarts);
    /// none = RAM only. `mesh join --roles store --kv-dir DIR` sets it.
    pub dir: Option<PathBuf>,
    /// RAM budget per namespace in bytes.
    pub ram_bytes: u64,
    /// Disk budget per namespace in bytes.
    pub disk_bytes: u64,
}

impl Default for StoreSettings {
    fn default() -> Self {
        let k = mesh_tiers::KvPagesConfig::default();
        Self {
            dir: None,
            ram_bytes: k.ram_bytes,
            disk_bytes: k.disk_bytes,
        }
    }
}

/// The policy tuner on this node (`[tuner]`, `POST /v1/control/tune`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TunerSettings {
    /// Whether `POST /v1/control/tune` runs cycles (the live policy is read either way).
    pub enabled: bool,
    /// Seconds between rule-driven cycles the node runs by itself; 0 = only on demand
    /// (`POST /v1/control/tune`). A period whose window saw fewer than `min_requests`
    /// requests is skipped without probing (an idle node spends nothing on tuning).
    pub interval_s: u64,
    /// Versioned policy file: loaded at start when present (the node refuses to start on a
    /// corrupt one), else written at start from the config; rewritten (atomically) on every
    /// accepted change only; decisions go to
    /// `<file>.decisions.jsonl`. None: the policy starts from `[cascade]`, `[reasoning]` and
    /// `tool_routing.router.top_k` and lives in memory.
    pub state_file: Option<PathBuf>,
    /// Probe tasks (JSON lines as `models/fixtures/eval-heldout.jsonl`).
    pub probe_tasks: PathBuf,
    /// Task kinds of the probe (`call`, `hard`, `none`, `result`); empty = all.
    pub probe_kinds: Vec<String>,
    /// Tasks per trial window (each runs once per window, so a trial costs 2 x this many
    /// requests, and a rule-driven cycle 3 x).
    pub probe_n: usize,
    /// Model the probe requests name; default the cascade's model id.
    pub probe_model: Option<String>,
    /// Completion budget of a probe request.
    pub probe_max_tokens: usize,
    /// Probe accuracy the rules hold the policy to.
    pub accuracy_target: f64,
    /// Fewest requests in a window before a rule may fire.
    pub min_requests: u64,
    /// The statistical gate's thresholds.
    pub gate: mesh_control::gate::GateConfig,
}

impl Default for TunerSettings {
    fn default() -> Self {
        let t = mesh_control::tuner::TunerConfig::default();
        Self {
            enabled: true,
            interval_s: 0,
            state_file: None,
            probe_tasks: models_dir().join("fixtures/eval-heldout.jsonl"),
            probe_kinds: vec![],
            probe_n: 40,
            probe_model: None,
            probe_max_tokens: 160,
            accuracy_target: t.accuracy_target,
            min_requests: t.min_requests,
            gate: t.gate,
        }
    }
}

impl TunerSettings {
    /// The rules' targets and the gate.
    pub fn tuner_config(&self) -> mesh_control::tuner::TunerConfig {
        mesh_control::tuner::TunerConfig {
            accuracy_target: self.accuracy_target,
            min_requests: self.min_requests,
            gate: self.gate.clone(),
        }
    }

    fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.probe_n > 0, "tuner.probe_n must be at least 1");
        anyhow::ensure!(
            self.probe_max_tokens > 0,
            "tuner.probe_max_tokens must be at least 1"
        );
        anyhow::ensure!(
            (0.0..=1.0).contains(&self.accuracy_target),
            "tuner.accuracy_target must be in [0, 1]"
        );
        self.gate
            .validate()
            .map_err(|e| anyhow::anyhow!("tuner.{e}"))
    }
}

/// MCP servers whose tools agent tasks may call (`POST /v1/agent/tasks`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct McpSettings {
    /// Servers started (stdio) or connected (streamable HTTP) at node start.
    pub servers: Vec<McpServerConfig>,
}

/// The agent loop and speculative tool calls (`[agent]`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentSettings {
    /// Turns (model calls) a task may take when it sets none.
    pub max_turns: usize,
    /// The most turns a task may ask for.
    pub max_turns_limit: usize,
    /// Seconds a task may take when it sets none.
    pub timeout_s: f64,
    /// The longest a task may ask for.
    pub timeout_limit_s: f64,
    /// Completion budget of each turn.
    pub max_tokens: usize,
    /// Tool results are cut to this many characters before the model sees them.
    pub max_result_chars: usize,
    /// Speculative tool calls by default.
    pub speculate: bool,
    /// The model that drafts each turn to predict its tool call; default the cascade's
    /// first tier. Tasks on this model do not speculate (the draft would be the answer).
    pub draft_model: Option<String>,
    /// Completion budget of a draft.
    pub draft_max_tokens: usize,
    /// Seconds a read-only tool result serves identical calls (0: only its own turn).
    pub cache_ttl_s: f64,
    /// Files of tool definitions (JSON array or JSON lines) the model may call and the
    /// client executes: a task that calls one stops with `requires_action`.
    pub catalog_files: Vec<PathBuf>,
}

impl Default for AgentSettings {
    fn default() -> Self {
        Self {
            max_turns: 6,
            max_turns_limit: 32,
            timeout_s: 120.0,
            timeout_limit_s: 1800.0,
            max_tokens: 256,
            max_result_chars: 2000,
            speculate: true,
            draft_model: None,
            draft_max_tokens: 96,
            cache_ttl_s: 60.0,
            catalog_files: vec![],
        }
    }
}

impl AgentSettings {
    fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            (1..=self.max_turns_limit).contains(&self.max_turns),
            "agent.max_turns must be between 1 and agent.max_turns_limit"
        );
        anyhow::ensure!(
            self.timeout_s > 0.0 && self.timeout_s <= self.timeout_limit_s,
            "agent.timeout_s must be in (0, agent.timeout_limit_s]"
        );
        anyhow::ensure!(self.max_tokens > 0, "agent.max_tokens must be at least 1");
        anyhow::ensure!(
            self.draft_max_tokens > 0,
            "agent.draft_max_tokens must be at least 1"
        );
        anyhow::ensure!(
            self.cache_ttl_s >= 0.0 && self.cache_ttl_s.is_finite(),
            "agent.cache_ttl_s must be >= 0"
        );
        Ok(())
    }
}

/// One embedding model served at `/v1/embeddings` (OpenAI's embeddings API).
///
/// ```toml
/// [[embeddings]]
/// name = "nomic-embed-text-v1.5"   # the `model` clients send
/// model = "nomic-embed-text-v1.5"  # a GGUF path or a pulled embedding model of the pack
/// threads = 1
/// max_text_tokens = 512
/// ```
///
/// Memory: the model's weights (nomic-embed-text v1.5 f16: 262 MiB) and a context of
/// `max(512, max_text_tokens)` tokens. Inputs are embedded as given: a model trained with
/// task prefixes (nomic's `search_query: ` / `search_document: `) needs the caller to add
/// them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EmbeddingModel {
    /// The model id clients send.
    pub name: String,
    /// The embedding GGUF, or a pulled embedding model of the pack by name.
    pub model: PathBuf,
    /// llama.cpp threads (0 = all cores). Default 1: embedding shares the host with tiers.
    pub threads: u32,
    /// Longest input in tokens, special tokens included (capped by the model's training
    /// context); a longer input is refused with 400, never cut. Default 512.
    pub max_text_tokens: u32,
}

impl Default for EmbeddingModel {
    fn default() -> Self {
        Self {
            name: String::new(),
            model: PathBuf::new(),
            threads: 1,
            max_text_tokens: 512,
        }
    }
}

impl EmbeddingModel {
    /// The embedder's settings: one context of `max(512, max_text_tokens)` tokens.
    pub fn embedder(&self) -> EmbedderConfig {
        EmbedderConfig {
            model: self.model.clone(),
            threads: self.threads,
            batch_tokens: self.max_text_tokens.max(512),
            max_text_tokens: self.max_text_tokens,
            ..EmbedderConfig::default()
        }
    }
}

/// When and how the gateway routes a request's tools before rendering the prompt.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ToolRouting {
    /// Route when a request offers more tools than this; 0 = never. The prompt then shows
    /// the router's top `router.top_k` (plus a `tool_choice` tool). The bundled tiers were
    /// trained with 3-7 tools per prompt.
    pub route_above: usize,
    /// The embedding model (loaded on the first request that needs it).
    pub embedder: EmbedderConfig,
    /// Scoring, top-k, re-rank.
    pub router: RouterConfig,
}

impl Default for ToolRouting {
    fn default() -> Self {
        Self {
            route_above: 8,
            embedder: EmbedderConfig {
                model: models_dir().join("embed/minilm-l6-tools-f16.gguf"),
                threads: 1,
                ..EmbedderConfig::default()
            },
            router: RouterConfig::default(),
        }
    }
}

/// How this node joins a cluster (`[cluster]` in the TOML file, or `mesh join` flags).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterSettings {
    /// Node name; the certificate `<cert_dir>/<name>.pem` must carry it as CN.
    pub name: String,
    /// QUIC (UDP) address for peers.
    pub listen: SocketAddr,
    /// The QUIC address peers dial when it is not `listen` (required when `listen` is
    /// `0.0.0.0`, e.g. the pod IP in Kubernetes). The gateway address shown to peers
    /// takes its host too when the gateway listens on `0.0.0.0`.
    pub advertise: Option<SocketAddr>,
    /// `HOST:PORT` of nodes to join through; empty starts a new cluster.
    pub seeds: Vec<String>,
    /// Folder with `ca.pem`, `<name>.pem`, `<name>.key` (`mesh cert`).
    pub cert_dir: PathBuf,
    /// Heartbeat interval. Each heartbeat is one small frame per peer.
    pub heartbeat_ms: u64,
    /// Silence after which a peer is declared dead and its requests re-run elsewhere.
    /// Lower detects loss sooner; too low declares a busy peer dead.
    pub failure_timeout_ms: u64,
    /// Largest control/call frame accepted from a peer.
    pub max_frame_bytes: usize,
    /// A `decode` node hands a prompt to a `prefill` node when at least this many of its
    /// tokens are not pages here or on a peer.
    pub handoff_tokens: usize,
    /// A `prefill` node with this many requests waiting for a slot (or more) takes no
    /// hand-off; the decode node prefills itself.
    pub handoff_max_queue: u32,
}

impl Default for ClusterSettings {
    fn default() -> Self {
        Self {
            name: String::new(),
            listen: "127.0.0.1:7070".parse().expect("valid literal"),
            advertise: None,
            seeds: vec![],
            cert_dir: default_cert_dir(),
            heartbeat_ms: 250,
            failure_timeout_ms: 2000,
            max_frame_bytes: mesh_transport::DEFAULT_MAX_FRAME,
            handoff_tokens: mesh_actors::routing::Handoff::default().min_tokens,
            handoff_max_queue: mesh_actors::routing::Handoff::default().max_queue,
        }
    }
}

/// `MESH_CERT_DIR`, else `~/.mesh/certs`.
pub fn default_cert_dir() -> PathBuf {
    if let Ok(d) = std::env::var(env::CERT_DIR) {
        return PathBuf::from(d);
    }
    std::env::var("HOME")
        .map(|h| PathBuf::from(h).join(".mesh").join("certs"))
        .unwrap_or_else(|_| PathBuf::from(".mesh/certs"))
}

impl ClusterSettings {
    /// A decode node's hand-off rule (`handoff_tokens`, `handoff_max_queue`).
    pub fn handoff(&self) -> mesh_actors::routing::Handoff {
        mesh_actors::routing::Handoff {
            min_tokens: self.handoff_tokens,
            max_queue: self.handoff_max_queue,
        }
    }

    /// The cluster layer's config; `http` is the gateway's bound address.
    pub fn to_cluster_config(&self, http: SocketAddr) -> mesh_actors::ClusterConfig {
        let http_addr = match self.advertise {
            Some(a) if http.ip().is_unspecified() => SocketAddr::new(a.ip(), http.port()),
            _ => http,
        };
        mesh_actors::ClusterConfig {
            listen: self.listen,
            advertise: self.advertise,
            http_addr: http_addr.to_string(),
            seeds: self.seeds.clone(),
            heartbeat: std::time::Duration::from_millis(self.heartbeat_ms),
            failure_timeout: std::time::Duration::from_millis(self.failure_timeout_ms),
            max_frame: self.max_frame_bytes,
            ..mesh_actors::ClusterConfig::default()
        }
    }
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".parse().expect("valid literal"),
            max_concurrent: 64,
            retry_after_s: 1,
            default_max_tokens: 256,
            tiers: bundled_tiers(&models_dir()),
            cluster: None,
            cascade: CascadePolicy::default(),
            reasoning: ReasoningPolicy::default(),
            tool_routing: ToolRouting::default(),
            embeddings: Vec::new(),
            placement: mesh_control::placement::PlacementConfig::default(),
            mcp: McpSettings::default(),
            agent: AgentSettings::default(),
            tuner: TunerSettings::default(),
            roles: vec![Role::Gateway, Role::Tiers],
            store: StoreSettings::default(),
            request_timeout_s: 600,
            restart_wait_s: 30,
            fault_token: None,
            auth: AuthSettings::default(),
            limits: LimitSettings::default(),
            scaling: ScalingSettings::default(),
        }
    }
}

/// Folder of the bundled models (`MESH_MODELS_DIR`, else `./models`).
pub fn models_dir() -> PathBuf {
    std::env::var(env::MODELS_DIR)
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from("models"))
}

/// The three bundled tiers, one thread each.
pub fn bundled_tiers(dir: &Path) -> Vec<EngineConfig> {
    ["t1", "t2", "t3"]
        .iter()
        .map(|t| EngineConfig {
            name: (*t).to_owned(),
            model: dir.join(format!("{t}-q8_0.gguf")),
            ..EngineConfig::default()
        })
        .collect()
}

impl NodeConfig {
    /// Defaults overlaid with a TOML file and the environment.
    pub fn load(file: Option<&Path>) -> anyhow::Result<Self> {
        let mut cfg = match file {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
                toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?
            }
            None => Self::default(),
        };
        if let Ok(v) = std::env::var(env::LISTEN) {
            cfg.listen = v
                .parse()
                .map_err(|e| anyhow::anyhow!("{}={v}: {e}", env::LISTEN))?;
        }
        if let Ok(v) = std::env::var(env::THREADS) {
            let n: i32 = v
                .parse()
                .map_err(|e| anyhow::anyhow!("{}={v}: {e}", env::THREADS))?;
            cfg.tiers.iter_mut().for_each(|t| t.threads = n);
        }
        // A tier's `model` may name a pulled model of the pack instead of a file.
        let cache = crate::models::cache_dir();
        for t in &mut cfg.tiers {
            t.model =
                crate::models::resolve_model(&t.name, &t.model, crate::models::pack(), &cache)?;
        }
        cfg.resolve_drafts()?;
        cfg.resolve_embedding_models()?;
        Ok(cfg)
    }

    /// Resolves each tier's `draft`: a name of another tier of this config becomes that
    /// tier's GGUF (done at load, so the draft tier need not be served: `--only t3` keeps
    /// t1 as t3's draft), a pulled model of the pack its cached file; paths stay as given.
    /// Idempotent. Fails when the draft names a pack model that is not downloaded or is
    /// not a chat model.
    pub fn resolve_drafts(&mut self) -> Result<(), crate::models::ModelsError> {
        let models: Vec<(String, PathBuf)> = self
            .tiers
            .iter()
            .map(|t| (t.name.clone(), t.model.clone()))
            .collect();
        let cache = crate::models::cache_dir();
        for t in &mut self.tiers {
            let Some(d) = &mut t.draft else { continue };
            if let Some((_, path)) = models.iter().find(|(n, _)| Path::new(n) == d.model) {
                d.model = path.clone();
            } else {
                d.model = crate::models::resolve_model(
                    &format!("{} (its draft)", t.name),
                    &d.model,
                    crate::models::pack(),
                    &cache,
                )?;
            }
        }
        Ok(())
    }

    /// Resolves pack names among the embedding models (`[[embeddings]]` and the router's
    /// embedder) to their cached files. Idempotent.
    pub fn resolve_embedding_models(&mut self) -> Result<(), crate::models::ModelsError> {
        let cache = crate::models::cache_dir();
        let pack = crate::models::pack();
        for e in &mut self.embeddings {
            e.model = crate::models::resolve_embedding_model(&e.name, &e.model, pack, &cache)?;
        }
        let r = &mut self.tool_routing.embedder;
        r.model = crate::models::resolve_embedding_model("tool_routing", &r.model, pack, &cache)?;
        Ok(())
    }

    /// Makes `model` (a GGUF path, a pulled pack model or another tier's name) the draft
    /// of tier `tier`, with the default draft settings; an existing draft keeps its
    /// settings and takes the new model. Call [`Self::resolve_drafts`] after.
    pub fn set_draft(&mut self, tier: &str, model: &Path) -> anyhow::Result<()> {
        let names: Vec<String> = self.tiers.iter().map(|t| t.name.clone()).collect();
        let Some(t) = self.tiers.iter_mut().find(|t| t.name == tier) else {
            anyhow::bail!("--draft: no tier named {tier} (tiers: {names:?})");
        };
        t.draft
            .get_or_insert_with(mesh_tiers::DraftConfig::default)
            .model = model.to_owned();
        Ok(())
    }

    /// Whether this node plays `role`.
    pub fn has_role(&self, role: Role) -> bool {
        self.roles.contains(&role)
    }

    /// Whether this node runs engines: role `tiers`, `prefill` or `decode`.
    pub fn hosts_tiers(&self) -> bool {
        [Role::Tiers, Role::Prefill, Role::Decode]
            .iter()
            .any(|r| self.has_role(*r))
    }

    /// Checks the whole config before anything starts.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(!self.roles.is_empty(), "roles must name at least one role");
        let engine_roles = [Role::Tiers, Role::Prefill, Role::Decode]
            .iter()
            .filter(|r| self.has_role(**r))
            .count();
        anyhow::ensure!(
            engine_roles <= 1,
            "roles tiers, prefill and decode exclude each other (tiers both prefills and decodes)"
        );
        anyhow::ensure!(
            !(self.has_role(Role::Prefill) || self.has_role(Role::Decode))
                || self.cluster.is_some(),
            "roles prefill and decode need a cluster (`mesh join`)"
        );
        anyhow::ensure!(
            (self.hosts_tiers() && !self.tiers.is_empty()) || self.cluster.is_some(),
            "no tiers configured (only a cluster node may host none and forward everything)"
        );
        if let Some(c) = &self.cluster {
            mesh_transport::tls::check_name(&c.name)?;
            anyhow::ensure!(c.heartbeat_ms > 0, "cluster.heartbeat_ms must be positive");
            anyhow::ensure!(
                c.failure_timeout_ms >= 2 * c.heartbeat_ms,
                "cluster.failure_timeout_ms must be at least two heartbeats"
            );
            anyhow::ensure!(
                c.max_frame_bytes >= 4096,
                "cluster.max_frame_bytes must be at least 4096"
            );
        }
        anyhow::ensure!(self.max_concurrent > 0, "max_concurrent must be at least 1");
        anyhow::ensure!(
            self.limits.max_body_bytes >= 1024,
            "limits.max_body_bytes must be at least 1024"
        );
        anyhow::ensure!(
            self.limits.header_read_timeout_s > 0,
            "limits.header_read_timeout_s must be at least 1"
        );
        anyhow::ensure!(
            self.limits.max_connections > 0,
            "limits.max_connections must be at least 1"
        );
        anyhow::ensure!(
            self.request_timeout_s > 0,
            "request_timeout_s must be at least 1"
        );
        if let Some(t) = &self.fault_token {
            anyhow::ensure!(
                t.len() >= 16,
                "the fault-injection token must be at least 16 characters"
            );
        }
        self.cascade.validate().map_err(anyhow::Error::msg)?;
        self.agent.validate()?;
        self.tuner.validate()?;
        self.scaling.validate(&self.tiers)?;
        let mut servers = std::collections::HashSet::new();
        for m in &self.mcp.servers {
            m.validate().map_err(anyhow::Error::msg)?;
            anyhow::ensure!(
                servers.insert(&m.name),
                "mcp.servers: `{}` configured twice",
                m.name
            );
        }
        if self.tool_routing.route_above > 0 {
            self.tool_routing.router.validate()?;
            self.tool_routing.embedder.validate()?;
        }
        anyhow::ensure!(
            self.tiers.iter().all(|t| t.name != self.cascade.model),
            "tier name `{}` is the cascade's model id; rename the tier or set cascade.model",
            self.cascade.model
        );
        let mut names = std::collections::HashSet::new();
        for e in &self.embeddings {
            anyhow::ensure!(!e.name.is_empty(), "embeddings: every model needs a name");
            anyhow::ensure!(
                names.insert(&e.name),
                "embedding model {} configured twice",
                e.name
            );
            anyhow::ensure!(
                e.max_text_tokens >= 2,
                "embedding model {}: max_text_tokens must be at least 2",
                e.name
            );
            anyhow::ensure!(
                e.model.exists(),
                "embedding model {}: model file {} not found",
                e.name,
                e.model.display()
            );
        }
        for t in &self.tiers {
            t.validate()?;
            anyhow::ensure!(
                names.insert(&t.name),
                "tier {} configured twice, or also an embedding model's name",
                t.name
            );
            anyhow::ensure!(
                t.model.exists(),
                "tier {}: model file {} not found",
                t.name,
                t.model.display()
            );
            if let Some(d) = &t.draft {
                anyhow::ensure!(
                    d.model != t.model && d.model != Path::new(&t.name),
                    "tier {}: a tier cannot draft for itself",
                    t.name
                );
                anyhow::ensure!(
                    d.model.exists(),
                    "tier {}: draft {} is neither a tier of this node nor a GGUF file",
                    t.name,
                    d.model.display()
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_overrides_defaults() {
        let cfg: NodeConfig = toml::from_str(
            "listen = \"0.0.0.0:9000\"\n[[tiers]]\nname = \"x\"\nmodel = \"m.gguf\"\nthreads = 3\n",
        )
        .unwrap();
        assert_eq!(cfg.listen.port(), 9000);
        assert_eq!(cfg.tiers.len(), 1);
        assert_eq!(cfg.tiers[0].threads, 3);
        assert_eq!(cfg.tiers[0].n_seq_max, EngineConfig::default().n_seq_max);
        assert_eq!(cfg.max_concurrent, 64);
    }

    #[test]
    fn draft_names_a_tier_or_a_file() {
        let mut cfg: NodeConfig = toml::from_str(
            "[[tiers]]\nname = \"t1\"\nmodel = \"a/t1.gguf\"\n\
             [[tiers]]\nname = \"t3\"\nmodel = \"a/t3.gguf\"\ndraft = \"t1\"\n\
             [[tiers]]\nname = \"t2\"\nmodel = \"a/t2.gguf\"\n\
             draft = { model = \"b/d.gguf\", k_max = 6, acceptance = \"exact\" }\n",
        )
        .unwrap();
        cfg.resolve_drafts().unwrap();
        let d3 = cfg.tiers[1].draft.as_ref().unwrap();
        assert_eq!(d3.model, Path::new("a/t1.gguf"));
        assert_eq!((d3.k_init, d3.k_min, d3.k_max), (4, 1, 12));
        let d2 = cfg.tiers[2].draft.as_ref().unwrap();
        assert_eq!(d2.model, Path::new("b/d.gguf"));
        assert_eq!(d2.k_max, 6);
        assert_eq!(d2.acceptance, mesh_tiers::DraftAcceptance::Exact);
        assert_eq!(d3.acceptance, mesh_tiers::DraftAcceptance::Rejection);
        assert!(cfg.tiers[0].draft.is_none());
        cfg.tiers[2].draft.as_mut().unwrap().k_init = 9;
        assert!(cfg.tiers[2].validate().is_err(), "k_init above k_max");
        let bad = "[[tiers]]\nname = \"t3\"\nmodel = \"a/t3.gguf\"\n\
                   draft = { model = \"t1\", acceptance = \"greedy\" }\n";
        assert!(
            toml::from_str::<NodeConfig>(bad).is_err(),
            "unknown acceptance rule"
        );
    }

    #[test]
    fn set_draft_names_another_tier_and_keeps_draft_settings() {
        let mut cfg: NodeConfig = toml::from_str(
            "[[tiers]]\nname = \"t1\"\nmodel = \"a/t1.gguf\"\n\
             [[tiers]]\nname = \"t3\"\nmodel = \"a/t3.gguf\"\n\
             draft = { model = \"b/d.gguf\", k_max = 6 }\n",
        )
        .unwrap();
        cfg.set_draft("t3", Path::new("t1")).unwrap();
        cfg.resolve_drafts().unwrap();
        let d = cfg.tiers[1].draft.as_ref().unwrap();
        assert_eq!((d.model.as_path(), d.k_max), (Path::new("a/t1.gguf"), 6));
    }

    #[test]
    fn set_draft_on_an_unknown_tier_is_refused() {
        let mut cfg: NodeConfig =
            toml::from_str("[[tiers]]\nname = \"t1\"\nmodel = \"a/t1.gguf\"\n").unwrap();
        let e = cfg.set_draft("t9", Path::new("d.gguf")).unwrap_err();
        assert!(e.to_string().contains("no tier named t9"), "{e}");
        assert!(cfg.tiers[0].draft.is_none());
    }

    #[test]
    fn a_standby_tier_without_a_config_is_refused() {
        let mut cfg = NodeConfig::default();
        cfg.tiers.retain(|t| t.name == "t1");
        cfg.scaling.standby = vec!["t3".into()];
        let e = cfg.scaling.validate(&cfg.tiers).unwrap_err().to_string();
        assert!(e.contains("scaling.standby names `t3`"), "{e}");
    }

    #[test]
    fn a_scaling_policy_with_min_above_max_is_refused() {
        let cfg: NodeConfig =
            toml::from_str("[scaling.tiers.t3]\nmin_replicas = 3\nmax_replicas = 1\n").unwrap();
        let e = cfg.scaling.validate(&cfg.tiers).unwrap_err().to_string();
        assert!(e.contains("scaling.tiers.t3: min_replicas"), "{e}");
    }

    #[test]
    fn unknown_keys_are_rejected() {
        assert!(toml::from_str::<NodeConfig>("lisen = \"x\"").is_err());
    }

    #[test]
    fn validate_catches_missing_model_and_duplicates() {
        let mut cfg = NodeConfig {
            tiers: bundled_tiers(Path::new("/nonexistent")),
            ..NodeConfig::default()
        };
        assert!(cfg
            .validate()
            .unwrap_err()
            .to_string()
            .contains("not found"));
        cfg.tiers = vec![];
        assert!(cfg.validate().is_err());
    }

    #[test]
    fn prefill_and_decode_roles_exclude_tiers_and_need_a_cluster() {
        let cfg = |roles: Vec<Role>, cluster: bool| NodeConfig {
            roles,
            cluster: cluster.then(ClusterSettings::default),
            ..NodeConfig::default()
        };
        let err = |c: NodeConfig| c.validate().unwrap_err().to_string();
        assert!(err(cfg(vec![Role::Tiers, Role::Prefill], true)).contains("exclude each other"));
        assert!(err(cfg(vec![Role::Decode, Role::Prefill], true)).contains("exclude each other"));
        assert!(err(cfg(vec![Role::Gateway, Role::Decode], false)).contains("need a cluster"));
        assert!(cfg(vec![Role::Gateway, Role::Decode], true).hosts_tiers());
    }
}
