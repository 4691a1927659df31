//! Prometheus metrics (`GET /metrics`, text format).
//!
//! Names follow Prometheus conventions (`mesh_` prefix, base units, `_total`
//! counters); label sets are bounded (model id, endpoint, status class).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use std::sync::atomic::AtomicU64;

use mesh_actors::pagestore::NamespaceStats;
use mesh_control::tuner::Counters;
use mesh_tiers::EngineStats;

/// Label: model id.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabel {
    /// Model (tier) id.
    pub model: String,
}

/// Label: endpoint and HTTP status.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabel {
    /// Route, e.g. `/v1/chat/completions`.
    pub endpoint: String,
    /// HTTP status code.
    pub status: u16,
}

/// Label: a cascade step (tier and verdict).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CascadeLabel {
    /// Tier that produced the output.
    pub tier: String,
    /// `accept`, `last_tier`, or why it escalated (`low_margin`, `malformed_call`, ...).
    pub verdict: String,
}

/// Label: the engine that served a generation (quantization policy). Bounded: a tier runs
/// one engine per distinct (GGUF, KV type) its policy names.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EngineLabel {
    /// Tier id.
    pub model: String,
    /// GGUF file name (`t1-q4_0.gguf`).
    pub gguf: String,
    /// KV cache type (`f16`, `q8_0`, `q4_0`).
    pub kv_type: String,
    /// Request role (`tool_calls`, `reasoning`, `summaries`).
    pub role: String,
}

/// Label: what the tool router did with a request.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RoutingLabel {
    /// `routed` (the prompt showed the router's top-k) or `failed` (every tool shown).
    pub outcome: String,
}

/// Label: which limit a request or connection hit.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LimitLabel {
    /// `rate`, `concurrency`, `body_size`, `header_timeout`.
    pub limit: String,
}

/// Label: how an agent task ended.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabel {
    /// `completed`, `max_turns`, `timed_out` or `failed`.
    pub status: String,
}

/// Label: what happened to a tool call with respect to speculation.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

/// Scrape-time collector of the agent layer's tool runner (set once the node has one).
#[derive(Debug, Default, Clone)]
struct ToolCollector {
    runner: Arc<std::sync::OnceLock<Arc<mesh_control::spec_tools::ToolRunner>>>,
}

impl Collector for ToolCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(r) = self.runner.get() else {
            return Ok(());
        };
        let c = r.counts();
        let o = |outcome| OutcomeLabel { outcome };
        family(
            &mut enc,
            "spec_tool_calls",
            "Tool calls by speculation outcome: started early, hit (a speculative result served the model's call), cache_hit, miss (ran when asked), cancelled (no call matched), refused_side_effect (predicted tool not read-only, not run)",
            true,
            &[
                (o("started"), c.started),
                (o("hit"), c.hits),
                (o("cache_hit"), c.cache_hits),
                (o("miss"), c.misses),
                (o("cancelled"), c.cancelled),
                (o("refused_side_effect"), c.refused),
            ],
        )?;
        let mut m = enc.encode_descriptor(
            "spec_tool_saved_seconds",
            "Tool time agent tasks did not wait for thanks to speculation and the result cache",
            None,
            MetricType::Counter,
        )?;
        ConstCounter::new(c.saved_ms as f64 / 1000.0).encode(m.encode_family(&NoLabels {})?)?;
        family(
            &mut enc,
            "mcp_tool_executions",
            "Tool calls that reached an MCP server (speculative ones included)",
            true,
            &[(NoLabels {}, c.executed)],
        )
    }
}

/// All metrics of a node.
pub struct Metrics {
    registry: Registry,
    /// Finished HTTP requests.
    requests: Family<RequestLabel, Counter>,
    /// Prompt tokens processed.
    pub prompt_tokens: Family<ModelLabel, Counter>,
    /// Tokens generated.
    pub generation_tokens: Family<ModelLabel, Counter>,
    /// Time to first token.
    pub ttft: Family<ModelLabel, Histogram>,
    /// Time between consecutive tokens of one request.
    pub itl: Family<ModelLabel, Histogram>,
    /// Whole request latency.
    pub e2e: Family<ModelLabel, Histogram>,
    /// Cascade steps by tier and verdict (kept answers have verdict `accept` or `last_tier`).
    cascade_steps: Family<CascadeLabel, Counter>,
    /// Reasoning tokens generated, by model.
    pub reasoning_tokens: Family<ModelLabel, Counter>,
    /// Think blocks the reasoning governor closed, by model.
    reasoning_capped: Family<ModelLabel, Counter>,
    /// Generations submitted with a thinking budget, by model.
    reasoning_budgeted: Family<ModelLabel, Counter>,
    /// Requests whose tools went through the router, by outcome.
    pub tool_routing: Family<RoutingLabel, Counter>,
    /// Tool schemas the router kept out of prompts.
    pub tools_removed: Counter,
    /// Replies asked again because the model repeated a call its last turn had answered.
    pub repeated_calls: Family<ModelLabel, Counter>,
    /// Agent tasks by how they ended.
    pub agent_tasks: Family<StatusLabel, Counter>,
    /// Requests refused by API-key checks (`status`: `unauthenticated` or `forbidden`).
    auth_refused: Family<StatusLabel, Counter>,
    limits_hit: Family<LimitLabel, Counter>,
    connections_open: Gauge,
    connections: Counter,
    /// Generations by the local engine that ran them (quantization policy).
    pub engine_requests: Family<EngineLabel, Counter>,
    tool_collector: ToolCollector,
    node: NodeCollector,
    totals: Totals,
    active: Family<ModelLabel, Gauge>,
    queued: Family<ModelLabel, Gauge>,
    kv_reserved: Family<ModelLabel, Gauge>,
    cancelled: Family<ModelLabel, Gauge>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

fn latency_family() -> Family<ModelLabel, Histogram> {
    Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.001, 2.0, 16)))
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("mesh");
        let m = Self {
            requests: Family::default(),
            prompt_tokens: Family::default(),
            generation_tokens: Family::default(),
            ttft: latency_family(),
            itl: latency_family(),
            e2e: latency_family(),
            cascade_steps: Family::default(),
            reasoning_tokens: Family::default(),
            reasoning_capped: Family::default(),
            reasoning_budgeted: Family::default(),
            tool_routing: Family::default(),
            tools_removed: Counter::default(),
            repeated_calls: Family::default(),
            agent_tasks: Family::default(),
            auth_refused: Family::default(),
            limits_hit: Family::default(),
            connections_open: Gauge::default(),
            connections: Counter::default(),
            engine_requests: Family::default(),
            tool_collector: ToolCollector::default(),
            node: NodeCollector::default(),
            totals: Totals::default(),
            active: Family::default(),
            queued: Family::default(),
            kv_reserved: Family::default(),
            cancelled: Family::default(),
            registry: Registry::default(),
        };
        registry.register(
            "http_requests",
            "HTTP requests by endpoint and status",
            m.requests.clone(),
        );
        registry.register(
            "prompt_tokens",
            "Prompt tokens processed",
            m.prompt_tokens.clone(),
        );
        registry.register(
            "generation_tokens",
            "Tokens generated",
            m.generation_tokens.clone(),
        );
        registry.register(
            "time_to_first_token_seconds",
            "Time to first token",
            m.ttft.clone(),
        );
        registry.register(
            "inter_token_latency_seconds",
            "Time between tokens of one request",
            m.itl.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "End-to-end request latency",
            m.e2e.clone(),
        );
        registry.register(
            "cascade_steps",
            "Tier attempts of cascade requests by tier and verdict",
            m.cascade_steps.clone(),
        );
        registry.register(
            "reasoning_tokens",
            "Tokens generated inside think blocks",
            m.reasoning_tokens.clone(),
        );
        registry.register(
            "reasoning_capped",
            "Think blocks closed by the reasoning governor",
            m.reasoning_capped.clone(),
        );
        registry.register(
            "reasoning_budgeted",
            "Generations submitted with a thinking budget",
            m.reasoning_budgeted.clone(),
        );
        registry.register(
            "tool_routing",
            "Chat requests whose tools went through the tool router, by outcome",
            m.tool_routing.clone(),
        );
        registry.register(
            "repeated_tool_calls",
            "Replies generated again without calls because the model repeated a call the conversation had just answered",
            m.repeated_calls.clone(),
        );
        registry.register(
            "tool_schemas_removed",
            "Tool schemas the router kept out of prompts",
            m.tools_removed.clone(),
        );
        registry.register(
            "auth_refused",
            "Requests refused for their API key: unauthenticated (none, or not this node's) or forbidden (a scope or tool the key lacks)",
            m.auth_refused.clone(),
        );
        registry.register(
            "limits_hit",
            "Requests refused or connections closed by a limit: rate (429), concurrency (429), body_size (413), header_timeout (connection closed)",
            m.limits_hit.clone(),
        );
        registry.register(
            "http_connections_open",
            "Client connections open now",
            m.connections_open.clone(),
        );
        registry.register(
            "http_connections",
            "Client connections accepted",
            m.connections.clone(),
        );
        registry.register(
            "agent_tasks",
            "Agent tasks (POST /v1/agent/tasks) by how they ended",
            m.agent_tasks.clone(),
        );
        registry.register(
            "engine_requests",
            "Generations started on a local engine, by tier, GGUF file, KV cache type and request role (quantization policy)",
            m.engine_requests.clone(),
        );
        registry.register(
            "active_sequences",
            "Sequences holding an engine slot",
            m.active.clone(),
        );
        registry.register(
            "queued_requests",
            "Requests waiting for an engine slot",
            m.queued.clone(),
        );
        registry.register(
            "kv_reserved_cells",
            "KV cells reserved by running sequences",
            m.kv_reserved.clone(),
        );
        registry.register(
            "cancelled_requests",
            "Requests dropped because the client went away",
            m.cancelled.clone(),
        );
        Self { registry, ..m }
    }
}

/// Label: a tier and a phase of its engine steps.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StepLabel {
    model: String,
    phase: &'static str,
}

/// Label: model and step kind (`mesh_tiers::STEP_KINDS`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StepKindLabel {
    model: String,
    kind: &'static str,
}

/// Label: model and storage tier.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierLabel {
    model: String,
    tier: &'static str,
}

/// What the node collector reads at scrape time: the engines, the service's dispatcher, and
/// what the page-store actor reported just before the scrape (`Metrics::render`).
#[derive(Debug, Clone, Default)]
struct NodeCollector {
    engines: Arc<std::sync::OnceLock<mesh_actors::engines::Engines>>,
    dispatcher: Arc<std::sync::OnceLock<Arc<crate::service::dispatch::Dispatcher>>>,
    store: Arc<std::sync::Mutex<Vec<NamespaceStats>>>,
    parts: Arc<std::sync::OnceLock<NodeParts>>,
}

/// The node's supervision tree and tracked tasks, for their metrics.
#[derive(Debug, Clone)]
pub struct NodeParts {
    /// The children of the node supervisor with their restart counters.
    pub actors: Vec<mesh_actors::node::ChildSpec>,
    /// The governor's decisions.
    pub governor: Arc<mesh_actors::governor::GovernorStats>,
    /// Tracked tasks.
    pub tasks: mesh_actors::tasks::Tasks,
    /// The planner's view and this node's name (cluster nodes).
    pub planner: Option<(String, Arc<mesh_actors::planner::PlannerView>)>,
}

/// Label: a planner action on a tier and how it ended.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PlannerLabel {
    tier: String,
    action: &'static str,
    outcome: &'static str,
}

/// Label: a tier.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierNameLabel {
    tier: String,
}

/// Label: a child of the node supervisor.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ActorLabel {
    actor: &'static str,
}

/// Label: a governor decision by role.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GovernorLabel {
    role: &'static str,
    budget: &'static str,
}

/// Label: a tracked task kind and how tasks of it ended.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TaskLabel {
    kind: &'static str,
    outcome: &'static str,
}

/// Label: a tracked task kind.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

/// Typed totals the tuner reads (kept beside the Prometheus families they mirror).
#[derive(Debug, Default)]
struct Totals {
    requests: AtomicU64,
    errors: AtomicU64,
    reasoning_budgeted: AtomicU64,
    reasoning_capped: AtomicU64,
    cascade: std::sync::Mutex<std::collections::HashMap<(String, String), u64>>,
}

fn family<L: EncodeLabelSet>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    counter: bool,
    rows: &[(L, u64)],
) -> Result<(), std::fmt::Error> {
    if rows.is_empty() {
        return Ok(());
    }
    let ty = if counter {
        MetricType::Counter
    } else {
        MetricType::Gauge
    };
    let mut m = enc.encode_descriptor(name, help, None, ty)?;
    for (labels, v) in rows {
        let fam = m.encode_family(labels)?;
        if counter {
            ConstCounter::new(*v).encode(fam)?;
        } else {
            ConstGauge::new(*v as i64).encode(fam)?;
        }
    }
    Ok(())
}

impl Collector for NodeCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use Ordering::Relaxed;
        let Some(engines) = self.engines.get() else {
            return Ok(());
        };
        let table = engines.table();
        let mut reuse: Vec<(String, Arc<mesh_tiers::kvcache::ReuseStats>)> = table
            .running
            .iter()
            .filter_map(|(name, e)| {
                e.desc
                    .pages
                    .as_ref()
                    .map(|p| (name.clone(), p.reuse.clone()))
            })
            .collect();
        reuse.sort_by(|a, b| a.0.cmp(&b.0));
        let store = self
            .store
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let m = |model: &str| ModelLabel {
            model: model.to_owned(),
        };
        let t = |model: &str, tier: &'static str| TierLabel {
            model: model.to_owned(),
            tier,
        };
        type Reuse = fn(&mesh_tiers::kvcache::ReuseStats) -> u64;
        let reuse_counters: [(&str, &str, Reuse); 4] = [
            (
                "kv_prefix_lookups",
                "Requests that looked for a cached prompt prefix",
                |r| r.lookups.load(Relaxed),
            ),
            (
                "kv_prefix_hits",
                "Requests that restored at least one cached page",
                |r| r.hits.load(Relaxed),
            ),
            (
                "kv_recompute_avoided_tokens",
                "Prompt tokens restored from pages instead of prefilled",
                |r| r.tokens_reused.load(Relaxed),
            ),
            (
                "kv_pages_published",
                "New pages stored after a prefill",
                |r| r.published.load(Relaxed),
            ),
        ];
        for (name, help, get) in reuse_counters {
            let rows: Vec<_> = reuse.iter().map(|(n, r)| (m(n), get(r))).collect();
            family(&mut enc, name, help, true, &rows)?;
        }
        type Get = fn(&mesh_kvstore::StoreStats) -> u64;
        let store_counters: [(&str, &str, Get); 7] = [
            (
                "kv_pages_fetched_from_peers",
                "Pages pulled from peers instead of prefilled",
                |s| s.fetched_from_peers.load(Relaxed),
            ),
            (
                "kv_peer_fetch_bytes",
                "Bytes of pages pulled from peers",
                |s| s.fetched_bytes.load(Relaxed),
            ),
            ("kv_page_misses", "Pages looked up and not found", |s| {
                s.misses.load(Relaxed)
            }),
            (
                "kv_pages_deduplicated",
                "Pages not stored again because an identical prefix was stored",
                |s| s.dedup_pages.load(Relaxed),
            ),
            (
                "kv_dedup_saved_bytes",
                "Bytes not stored thanks to deduplication",
                |s| s.dedup_bytes.load(Relaxed),
            ),
            (
                "kv_corrupt_pages",
                "Pages refused because their checksum or header was wrong",
                |s| s.corrupt.load(Relaxed),
            ),
            (
                "kv_disk_errors",
                "Page disk reads or writes that failed",
                |s| s.disk_errors.load(Relaxed),
            ),
        ];
        for (name, help, get) in store_counters {
            let rows: Vec<_> = store.iter().map(|n| (m(&n.ns), get(&n.stats))).collect();
            family(&mut enc, name, help, true, &rows)?;
        }
        type ByTier = fn(&mesh_kvstore::StoreStats) -> [&std::sync::atomic::AtomicU64; 3];
        let by_tier: [(&str, &str, bool, ByTier); 4] = [
            ("kv_page_hits", "Pages found, by storage tier", true, |s| {
                [&s.hits_ram, &s.hits_far, &s.hits_disk]
            }),
            (
                "kv_pages_evicted",
                "Pages evicted for the tier's budget",
                true,
                |s| [&s.evicted_ram, &s.evicted_far, &s.evicted_disk],
            ),
            ("kv_pages", "Pages held, by storage tier", false, |s| {
                [&s.pages_ram, &s.pages_far, &s.pages_disk]
            }),
            (
                "kv_page_bytes",
                "Bytes of pages held, by storage tier",
                false,
                |s| [&s.bytes_ram, &s.bytes_far, &s.bytes_disk],
            ),
        ];
        for (name, help, counter, get) in by_tier {
            // A store without a far tier has no `far` rows (absent, not zero).
            let rows: Vec<_> = store
                .iter()
                .flat_map(|n| {
                    let [ram, far, disk] = get(&n.stats).map(|a| a.load(Relaxed));
                    [
                        Some((t(&n.ns, "ram"), ram)),
                        n.far_nodes.is_some().then(|| (t(&n.ns, "far"), far)),
                        Some((t(&n.ns, "disk"), disk)),
                    ]
                    .into_iter()
                    .flatten()
                })
                .collect();
            family(&mut enc, name, help, counter, &rows)?;
        }
        let degraded: Vec<_> = store
            .iter()
            .map(|n| (m(&n.ns), n.stats.disk_degraded.load(Relaxed)))
            .collect();
        family(
            &mut enc,
            "kv_disk_degraded",
            "1 when the page disk tier was switched off after an error",
            false,
            &degraded,
        )?;
        // The far tier: rows only for stores that have one, and the node count (0: none).
        let mut far_nodes: Vec<u32> = store
            .iter()
            .filter_map(|n| n.far_nodes.clone())
            .flatten()
            .collect();
        far_nodes.sort_unstable();
        far_nodes.dedup();
        family(
            &mut enc,
            "kv_far_memory_nodes",
            "CPU-less NUMA nodes holding KV pages (0: no far-memory tier)",
            false,
            &[(NoLabels {}, far_nodes.len() as u64)],
        )?;
        let far_errors: Vec<_> = store
            .iter()
            .filter(|n| n.far_nodes.is_some())
            .map(|n| (m(&n.ns), n.stats.far_errors.load(Relaxed)))
            .collect();
        family(
            &mut enc,
            "kv_far_errors",
            "Pages far memory could not take (kept only on disk)",
            true,
            &far_errors,
        )?;
        // Speculative decoding, for the tiers that have a draft model.
        let mut spec: Vec<(String, Arc<EngineStats>)> = table
            .running
            .iter()
            .filter(|(_, e)| e.desc.info.draft.is_some())
            .map(|(name, e)| (name.clone(), e.desc.stats.clone()))
            .collect();
        spec.sort_by(|a, b| a.0.cmp(&b.0));
        type Stat = fn(&EngineStats) -> u64;
        let spec_counters: [(&str, &str, Stat); 4] = [
            (
                "spec_draft_tokens",
                "Tokens the draft model proposed (speculative decoding)",
                |s| s.draft_tokens.load(Relaxed),
            ),
            (
                "spec_accepted_tokens",
                "Drafted tokens the target accepted",
                |s| s.draft_accepted.load(Relaxed),
            ),
            (
                "spec_draft_prefill_tokens",
                "Tokens the draft model decoded to catch up with its sequences (prompts, accepted tokens)",
                |s| s.draft_prefill_tokens.load(Relaxed),
            ),
            (
                "spec_draft_resident_tokens",
                "Prompt tokens the draft model reused in place from a slot's kept draft KV",
                |s| s.draft_resident_tokens.load(Relaxed),
            ),
        ];
        for (name, help, get) in spec_counters {
            let rows: Vec<_> = spec.iter().map(|(n, s)| (m(n), get(s))).collect();
            family(&mut enc, name, help, true, &rows)?;
        }
        let mut hw: Vec<(String, Arc<EngineStats>)> = table
            .running
            .iter()
            .map(|(name, e)| (name.clone(), e.desc.stats.clone()))
            .collect();
        hw.sort_by(|a, b| a.0.cmp(&b.0));
        // Requests served and prompt tokens prefilled, KV kept in slots between requests, and
        // grammar refusals (every tier).
        let resident_counters: [(&str, &str, Stat); 8] = [
            (
                "tier_sequences",
                "Requests that got a slot on the tier's engine: those of this node's gateway and those peers sent to it",
                |s| s.started.load(Relaxed),
            ),
            (
                "tier_prompt_tokens",
                "Prompt tokens the tier's engine prefilled (not restored, kept or copied)",
                |s| s.prompt_tokens.load(Relaxed),
            ),
            (
                "grammar_refusals",
                "Greedy tokens whose free choice the request's grammar refused (chosen again from the masked vocabulary)",
                |s| s.grammar_refusals.load(Relaxed),
            ),
            (
                "kv_resident_hits",
                "Requests that reused KV kept in their slot by the previous request",
                |s| s.resident_hits.load(Relaxed),
            ),
            (
                "kv_resident_tokens",
                "Prompt tokens reused in place from a slot's kept KV instead of prefilled",
                |s| s.resident_tokens.load(Relaxed),
            ),
            (
                "kv_resident_dropped_tokens",
                "Tokens of KV kept in a slot that left the tier's device when the slot took another prompt or the keep budget was exceeded (their prompt pages stay in host RAM)",
                |s| s.resident_dropped_tokens.load(Relaxed),
            ),
            (
                "kv_device_copies",
                "Requests whose prompt prefix was copied from another running sequence's KV on the tier's device",
                |s| s.device_copies.load(Relaxed),
            ),
            (
                "kv_device_copy_tokens",
                "Prompt tokens copied from another running sequence's KV on the tier's device instead of restored or prefilled",
                |s| s.device_copy_tokens.load(Relaxed),
            ),
        ];
        for (name, help, get) in resident_counters {
            let rows: Vec<_> = hw.iter().map(|(n, s)| (m(n), get(s))).collect();
            family(&mut enc, name, help, true, &rows)?;
        }
        // Where each tier's engine thread spends its steps.
        let steps: Vec<_> = hw
            .iter()
            .map(|(n, s)| (m(n), s.steps.load(Relaxed)))
            .collect();
        family(
            &mut enc,
            "tier_steps",
            "Engine steps (llama_decode calls) of the tier",
            true,
            &steps,
        )?;
        if !hw.is_empty() {
            let mut f = enc.encode_descriptor(
                "tier_step_seconds",
                "Time the tier's engine thread spent in each phase of its steps: schedule (batch building), draft (draft-model decodes), decode (the model's decode until its results are on the host), sample (choosing tokens), emit (text, stop strings, events), publish (new KV pages), admit (restores, device copies and waits for pages between steps)",
                None,
                MetricType::Counter,
            )?;
            for (n, s) in &hw {
                for (i, phase) in mesh_tiers::STEP_PHASES.iter().enumerate() {
                    let secs = s.step_ns[i].load(Relaxed) as f64 / 1e9;
                    let labels = StepLabel {
                        model: n.clone(),
                        phase,
                    };
                    ConstCounter::new(secs).encode(f.encode_family(&labels)?)?;
                }
            }
        }
        if !hw.is_empty() {
            let mut f = enc.encode_descriptor(
                "tier_step_duration_seconds",
                "Engine steps by duration and kind: decode (only decodes), prefill (with a prompt chunk), publish (ended a prompt and read its KV state to publish new pages). A running sequence's gap between two tokens is the step between them",
                None,
                MetricType::Histogram,
            )?;
            for (n, s) in &hw {
                for (k, kind) in mesh_tiers::STEP_KINDS.iter().enumerate() {
                    let counts: Vec<u64> = s.step_hist[k].iter().map(|c| c.load(Relaxed)).collect();
                    let buckets: Vec<(f64, u64)> = mesh_tiers::STEP_BUCKET_BOUNDS_S
                        .iter()
                        .copied()
                        .chain([f64::MAX])
                        .zip(counts.iter().copied())
                        .collect();
                    let labels = StepKindLabel {
                        model: n.clone(),
                        kind,
                    };
                    f.encode_family(&labels)?.encode_histogram::<NoLabels>(
                        s.step_hist_ns[k].load(Relaxed) as f64 / 1e9,
                        counts.iter().sum(),
                        &buckets,
                        None,
                    )?;
                }
            }
        }
        // Hardware counters per tier: whether they run, always; the totals only where they
        // do (absent, not zero, where the kernel gives no perf events).
        let avail: Vec<_> = hw
            .iter()
            .filter_map(|(n, s)| s.hw.available().map(|a| (m(n), u64::from(a.is_ok()))))
            .collect();
        family(
            &mut enc,
            "hw_counters_available",
            "1 when the tier's hardware counters (perf events) run, 0 when the kernel gives none",
            false,
            &avail,
        )?;
        for (i, (event, _)) in mesh_tiers::hwcount::EVENTS.iter().enumerate() {
            let rows: Vec<_> = hw
                .iter()
                .filter_map(|(n, s)| s.hw.values().map(|v| (m(n), v[i])))
                .collect();
            let help = format!(
                "Hardware {} of the tier's engine and llama.cpp threads (user space)",
                event.replace('_', " ")
            );
            family(&mut enc, &format!("hw_{event}"), &help, true, &rows)?;
        }
        let f = &mesh_transport::frame::STATS;
        let none: [(NoLabels, u64); 1] = [(NoLabels {}, f.refused.load(Relaxed))];
        family(
            &mut enc,
            "transport_frames_refused",
            "Wire frames refused (malformed, truncated, oversized, wrong version)",
            true,
            &none,
        )?;
        family(
            &mut enc,
            "transport_frames_received",
            "Wire frames decoded",
            true,
            &[(NoLabels {}, f.frames_in.load(Relaxed))],
        )?;
        family(
            &mut enc,
            "transport_frames_sent",
            "Wire frames encoded",
            true,
            &[(NoLabels {}, f.frames_out.load(Relaxed))],
        )?;
        let pulls = &mesh_actors::cluster::PULL_STATS;
        family(
            &mut enc,
            "kv_peer_pulls",
            "Page pulls from peers: `started` opened a stream, `joined` waited for an identical pull already in flight",
            true,
            &[
                (OutcomeLabel { outcome: "started" }, pulls.started.load(Relaxed)),
                (OutcomeLabel { outcome: "joined" }, pulls.joined.load(Relaxed)),
            ],
        )?;
        family(
            &mut enc,
            "request_reruns",
            "Requests re-run (on a peer, or on this node's restarted engine) after the engine or node serving them failed",
            true,
            &[(
                NoLabels {},
                self.dispatcher.get().map_or(0, |d| d.reruns()),
            )],
        )?;
        let handoffs =
            |f: fn(&crate::service::dispatch::HandoffCounts) -> &std::sync::atomic::AtomicU64| {
                self.dispatcher
                    .get()
                    .map_or(0, |d| f(&d.split.counts).load(Ordering::Relaxed))
            };
        family(
            &mut enc,
            "prefill_handoffs",
            "Prompts this decode node handed to a prefill node: done (it then pulled their pages) or failed (it prefilled them itself)",
            true,
            &[
                (OutcomeLabel { outcome: "done" }, handoffs(|c| &c.done)),
                (OutcomeLabel { outcome: "failed" }, handoffs(|c| &c.failed)),
            ],
        )?;
        if let Some(parts) = self.parts.get() {
            let restarts: Vec<_> = parts
                .actors
                .iter()
                .map(|c| (ActorLabel { actor: c.name }, c.restarts.load(Relaxed)))
                .collect();
            family(
                &mut enc,
                "actor_restarts",
                "Restarts of the node supervisor's children (router, governor, kv-store, engines, tuner, membership)",
                true,
                &restarts,
            )?;
            let decisions: Vec<_> = parts
                .governor
                .rows()
                .into_iter()
                .flat_map(|(role, capped, free)| {
                    [
                        (
                            GovernorLabel {
                                role,
                                budget: "capped",
                            },
                            capped,
                        ),
                        (
                            GovernorLabel {
                                role,
                                budget: "none",
                            },
                            free,
                        ),
                    ]
                })
                .collect();
            family(
                &mut enc,
                "governor_decisions",
                "Thinking budgets the reasoning governor decided, by request role (`capped`: a budget, `none`: no cap)",
                true,
                &decisions,
            )?;
            let running: Vec<_> = parts
                .tasks
                .running()
                .into_iter()
                .map(|(kind, n)| (KindLabel { kind }, n.max(0) as u64))
                .collect();
            family(
                &mut enc,
                "tasks_running",
                "Tracked long-lived tasks running (accept loops, connection handlers), by kind",
                false,
                &running,
            )?;
            let ended: Vec<_> = parts
                .tasks
                .ended()
                .into_iter()
                .map(|(kind, outcome, n)| (TaskLabel { kind, outcome }, n))
                .collect();
            family(
                &mut enc,
                "task_exits",
                "Tracked tasks that ended, by kind and outcome (`ok`, `panic`)",
                true,
                &ended,
            )?;
            if let Some((me, view)) = &parts.planner {
                family(
                    &mut enc,
                    "planner_leader",
                    "1 when this node's planner plans for the cluster",
                    false,
                    &[(NoLabels {}, u64::from(view.planning(me)))],
                )?;
                let actions: Vec<_> = view
                    .counts()
                    .into_iter()
                    .map(|(tier, action, ok, n)| {
                        let outcome = if ok { "ok" } else { "failed" };
                        (
                            PlannerLabel {
                                tier,
                                action,
                                outcome,
                            },
                            n,
                        )
                    })
                    .collect();
                family(
                    &mut enc,
                    "planner_actions",
                    "Tier replicas this node's planner started or drained, by tier, action (`start`, `drain`) and outcome",
                    true,
                    &actions,
                )?;
                let replicas: Vec<_> = if view.planning(me) {
                    view.replicas()
                        .into_iter()
                        .map(|(tier, n)| (TierNameLabel { tier }, n as u64))
                        .collect()
                } else {
                    vec![]
                };
                family(
                    &mut enc,
                    "planner_replicas",
                    "Replicas of each scaled tier in the cluster, as the planning node saw them at its last tick",
                    false,
                    &replicas,
                )?;
            }
        }
        Ok(())
    }
}

/// Empty label set.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NoLabels {}

impl Metrics {
    /// Metrics of a node; its engines, dispatcher and supervision tree are attached with
    /// [`Metrics::watch_engines`], [`Metrics::watch_dispatcher`] (by the service) and
    /// [`Metrics::watch_node`].
    pub fn new() -> Self {
        let mut m = Self::default();
        m.registry.register_collector(Box::new(m.node.clone()));
        m.registry
            .register_collector(Box::new(m.tool_collector.clone()));
        m
    }

    /// Exports the counters of the agent layer's tool runner (first call wins).
    pub fn watch_tools(&self, runner: Arc<mesh_control::spec_tools::ToolRunner>) {
        let _ = self.tool_collector.runner.set(runner);
    }

    /// Exports the counters of the node's engines (first call wins).
    pub fn watch_engines(&self, engines: mesh_actors::engines::Engines) {
        let _ = self.node.engines.set(engines);
    }

    /// Exports the re-runs of the service's dispatcher (first call wins).
    pub fn watch_dispatcher(&self, dispatcher: Arc<crate::service::dispatch::Dispatcher>) {
        let _ = self.node.dispatcher.set(dispatcher);
    }

    /// Exports the restarts of the node's actors, the governor's decisions and the tracked
    /// tasks (first call wins).
    pub fn watch_node(&self, parts: NodeParts) {
        let _ = self.node.parts.set(parts);
    }

    /// Counts a request refused for its key: no valid key (`unauthenticated`) or a key
    /// that may not do this (`forbidden`).
    pub fn auth_refused(&self, unauthenticated: bool) {
        let status = if unauthenticated {
            "unauthenticated"
        } else {
            "forbidden"
        };
        self.auth_refused
            .get_or_create(&StatusLabel {
                status: status.into(),
            })
            .inc();
    }

    /// Counts a request refused, or a connection closed, by `limit`.
    pub fn limit_hit(&self, limit: &str) {
        self.limits_hit
            .get_or_create(&LimitLabel {
                limit: limit.into(),
            })
            .inc();
    }

    /// Counts an accepted client connection.
    pub fn connection_opened(&self) {
        self.connections.inc();
        self.connections_open.inc();
    }

    /// Counts a client connection closed.
    pub fn connection_closed(&self) {
        self.connections_open.dec();
    }

    /// Counts a finished HTTP request.
    pub fn count(&self, endpoint: &str, status: u16) {
        self.requests
            .get_or_create(&RequestLabel {
                endpoint: endpoint.into(),
                status,
            })
            .inc();
        if matches!(endpoint, "/v1/chat/completions" | "/v1/completions") {
            self.totals.requests.fetch_add(1, Ordering::Relaxed);
            if status >= 500 {
                self.totals.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Counts a cascade step of `tier` with `verdict`.
    pub fn cascade_step(&self, tier: &str, verdict: &str) {
        self.cascade_steps
            .get_or_create(&CascadeLabel {
                tier: tier.to_owned(),
                verdict: verdict.to_owned(),
            })
            .inc();
        *self
            .totals
            .cascade
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry((tier.to_owned(), verdict.to_owned()))
            .or_default() += 1;
    }

    /// Counts a generation submitted with a thinking budget.
    pub fn reasoning_budgeted(&self, model: &str) {
        self.reasoning_budgeted
            .get_or_create(&Self::model(model))
            .inc();
        self.totals
            .reasoning_budgeted
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a think block the governor's budget closed.
    pub fn reasoning_capped(&self, model: &str) {
        self.reasoning_capped
            .get_or_create(&Self::model(model))
            .inc();
        self.totals.reasoning_capped.fetch_add(1, Ordering::Relaxed);
    }

    /// The tuner's counters since the node started, read from typed totals and the
    /// engines' own counters (never from the exposition text): chat and completion
    /// requests (errors: status 5xx), cascade steps at `first_tier` (low-margin
    /// escalations, low-router-score skips), generations with a thinking budget and those
    /// it capped, drafted and accepted tokens, generated tokens, and the engines' hardware
    /// counters where the kernel gives them.
    pub fn totals(&self, first_tier: &str, engines: &mesh_actors::engines::Engines) -> Counters {
        use Ordering::Relaxed;
        let t = &self.totals;
        let mut c = Counters {
            requests: t.requests.load(Relaxed),
            errors: t.errors.load(Relaxed),
            reasoning_requests: t.reasoning_budgeted.load(Relaxed),
            reasoning_capped: t.reasoning_capped.load(Relaxed),
            ..Counters::default()
        };
        for ((tier, verdict), n) in t
            .cascade
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
        {
            if tier != first_tier {
                continue;
            }
            match verdict.as_str() {
                "low_router_score" => c.low_router_score_skips += n,
                "low_margin" => {
                    c.first_tier_steps += n;
                    c.first_tier_low_margin += n;
                }
                _ => c.first_tier_steps += n,
            }
        }
        for e in engines.table().running.values() {
            let s = &e.desc.stats;
            c.draft_tokens += s.draft_tokens.load(Relaxed);
            c.draft_accepted += s.draft_accepted.load(Relaxed);
            c.generated_tokens += s.generated_tokens.load(Relaxed);
            if let Some([ins, cyc, miss]) = s.hw.values() {
                c.instructions += ins;
                c.cycles += cyc;
                c.cache_misses += miss;
            }
        }
        c
    }

    /// Text exposition, after refreshing gauges from the engines; `store` is what the
    /// page-store actor reported for this scrape.
    pub fn render(&self, store: Vec<NamespaceStats>) -> String {
        *self
            .node
            .store
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = store;
        if let Some(engines) = self.node.engines.get() {
            for (name, e) in engines.table().running.iter() {
                let s = &e.desc.stats;
                let l = Self::model(name);
                self.active
                    .get_or_create(&l)
                    .set(s.active.load(Ordering::Relaxed) as i64);
                self.queued
                    .get_or_create(&l)
                    .set(s.queued.load(Ordering::Relaxed) as i64);
                self.kv_reserved
                    .get_or_create(&l)
                    .set(s.reserved_cells.load(Ordering::Relaxed) as i64);
                self.cancelled
                    .get_or_create(&l)
                    .set(s.cancelled.load(Ordering::Relaxed) as i64);
            }
        }
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }

    /// Label helper.
    pub fn model(model: &str) -> ModelLabel {
        ModelLabel {
            model: model.to_owned(),
        }
    }
}
