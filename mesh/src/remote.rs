//! The node's side of the cluster: serving local tiers to peers
//! ([`NodeService`]) and sending requests to whichever node should run them,
//! re-running them elsewhere when that node is lost ([`dispatch`]).
//!
//! Failover keeps what the client already has: the re-run on another node
//! produces the same tokens (same model, same sampling parameters and seed),
//! and the first `delivered` tokens of the re-run are skipped, so the client
//! sees one uninterrupted stream.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures::future::BoxFuture;
use mesh_actors::routing::{self, Candidate};
use mesh_actors::wire::{self, ErrorClass, Event, GenerateCall, Header, RemoteError, TierAdvert};
use mesh_actors::{CallError, Cluster, InflightGuard};
use mesh_control::policy::Role;
use mesh_tiers::actor::TierMsg;
use mesh_tiers::{FinishReason, GenerateRequest, SamplingParams, TierError, TokenEvent, Usage};
use std::sync::atomic::Ordering::Relaxed;
use tokio::sync::mpsc;
use tracing::{info_span, warn, Instrument};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::node::{Registry, TierEntry};

/// Most nodes one request is tried on before the client gets an error.
pub const MAX_ATTEMPTS: usize = 4;

/// Serves this node's tiers to peers.
#[derive(Debug, Clone)]
pub struct NodeService {
    registry: Registry,
    cluster: Arc<OnceLock<Cluster>>,
    quant: Option<QuantRoute>,
}

/// This node's quantization policy and engines: a peer's call runs on the engine the
/// policy gives its role (`GenerateCall.role`) on the tier, as a local request would.
#[derive(Clone)]
struct QuantRoute {
    engines: Arc<crate::engines::Engines>,
    tuner: Arc<crate::control_api::Tuner>,
}

impl std::fmt::Debug for QuantRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("QuantRoute")
    }
}

impl NodeService {
    /// Over the node's tier registry.
    pub fn new(registry: Registry) -> Self {
        Self {
            registry,
            cluster: Arc::new(OnceLock::new()),
            quant: None,
        }
    }

    /// Picks the engine of each call by its role under the live policy of `tuner`.
    pub fn with_quantization(
        mut self,
        engines: Arc<crate::engines::Engines>,
        tuner: Arc<crate::control_api::Tuner>,
    ) -> Self {
        self.quant = Some(QuantRoute { engines, tuner });
        self
    }

    /// Gives the service its cluster (for pulling pages from peers); set once after joining.
    pub fn set_cluster(&self, cluster: Cluster) {
        let _ = self.cluster.set(cluster);
    }
}

/// Adverts carry at most this many page ids per tier (most recently used first).
const ADVERTISED_PAGES: usize = 1024;

/// Pulls the leading prefix pages of `prompt` that this node lacks from the live peer
/// advertising the longest run of them; returns how many pages were stored. Fetched pages are
/// checked against their ids and salt before they are stored. Traced as `kv.lookup`: pages
/// of the prompt, how many are local, how many were pulled and from which peer.
#[tracing::instrument(name = "kv.lookup", skip_all, fields(gen_ai.request.model = %model,
    mesh.kv.pages = tracing::field::Empty, mesh.kv.pages_local = tracing::field::Empty,
    mesh.kv.pages_pulled = tracing::field::Empty, mesh.kv.peer = tracing::field::Empty))]
pub async fn prefetch(
    registry: &Registry,
    cluster: Option<&Cluster>,
    model: &str,
    prompt: &[i32],
    scope: &str,
) -> usize {
    let Some(cluster) = cluster else { return 0 };
    let Some(pages) = registry.get(model).and_then(|e| e.desc.pages.clone()) else {
        return 0;
    };
    let usable = prompt.len().saturating_sub(1);
    let (salt, ids) = pages.chain(&prompt[..usable], scope);
    let local = ids.iter().take_while(|id| pages.store.contains(id)).count();
    let span = tracing::Span::current();
    span.record("mesh.kv.pages", ids.len());
    span.record("mesh.kv.pages_local", local);
    if local == ids.len() {
        return 0;
    }
    let base = pages.base.0.to_vec();
    let best = cluster
        .tier_adverts(model)
        .into_iter()
        .filter(|(_, t)| t.page_base == base && t.page_block as usize == pages.block)
        .map(|(n, t)| {
            let held: HashSet<u64> = t.pages.iter().copied().collect();
            let run = ids
                .iter()
                .take_while(|id| held.contains(&id.short()))
                .count();
            (n, run)
        })
        .filter(|(_, run)| *run > local)
        .max_by_key(|(_, run)| *run);
    let Some((node, run)) = best else { return 0 };
    span.record("mesh.kv.peer", node.as_str());
    let want: Vec<[u8; 32]> = ids[local..run].iter().map(|i| i.0).collect();
    let t0 = std::time::Instant::now();
    match cluster.fetch_pages(&node, model, salt.0, want).await {
        Ok(got) => {
            let mut n = 0;
            for (i, (id, stored)) in got.into_iter().enumerate() {
                let expect = ids[local + i];
                if id != expect.0
                    || !pages
                        .store
                        .put_fetched(&expect, &salt, bytes::Bytes::from(stored))
                {
                    break;
                }
                n += 1;
            }
            span.record("mesh.kv.pages_pulled", n);
            tracing::debug!(%node, tier = %model, pages = n, ms = t0.elapsed().as_millis() as u64, "pulled prefix pages from a peer");
            n
        }
        Err(e) => {
            warn!(%node, tier = %model, error = %e, "pulling prefix pages failed; prefilling instead");
            0
        }
    }
}

fn remote_error(e: TierError) -> RemoteError {
    let class = match &e {
        TierError::ContextExceeded { .. } => ErrorClass::ContextExceeded,
        TierError::Overloaded(_) => ErrorClass::Overloaded,
        TierError::InvalidRequest(_) => ErrorClass::InvalidRequest,
        _ => ErrorClass::Unavailable,
    };
    RemoteError {
        class,
        message: e.to_string(),
    }
}

fn unavailable(message: String) -> RemoteError {
    RemoteError {
        class: ErrorClass::Unavailable,
        message,
    }
}

/// Describes local tiers for adverts.
pub fn tier_adverts(registry: &Registry) -> Vec<TierAdvert> {
    let mut v: Vec<TierAdvert> = registry
        .iter()
        .map(|e| {
            let (i, s) = (&e.value().desc.info, &e.value().desc.stats);
            TierAdvert {
                name: e.key().clone(),
                max_seq_len: i.max_seq_len as u32,
                n_seq_max: i.n_seq_max as u32,
                active: s.active.load(Relaxed) as u32,
                queued: s.queued.load(Relaxed) as u32,
                kv_cells: i.n_ctx as u32,
                kv_reserved: s.reserved_cells.load(Relaxed) as u32,
                page_base: e
                    .value()
                    .desc
                    .pages
                    .as_ref()
                    .map(|p| p.base.0.to_vec())
                    .unwrap_or_default(),
                page_block: e
                    .value()
                    .desc
                    .pages
                    .as_ref()
                    .map(|p| p.block as u32)
                    .unwrap_or(0),
                pages: e
                    .value()
                    .desc
                    .pages
                    .as_ref()
                    .map(|p| {
                        p.store
                            .recent_ids(ADVERTISED_PAGES)
                            .iter()
                            .map(|i| i.short())
                            .collect()
                    })
                    .unwrap_or_default(),
            }
        })
        .collect();
    v.sort_by(|a, b| a.name.cmp(&b.name));
    v
}

fn extract_context(headers: &[Header]) -> opentelemetry::Context {
    let map: HashMap<String, String> = headers
        .iter()
        .map(|h| (h.key.clone(), h.value.clone()))
        .collect();
    opentelemetry::global::get_text_map_propagator(|p| p.extract(&map))
}

/// Trace context of the current span, as wire headers.
pub fn inject_context() -> Vec<Header> {
    let cx = tracing::Span::current().context();
    let mut map: HashMap<String, String> = HashMap::new();
    opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&cx, &mut map));
    map.into_iter()
        .map(|(key, value)| Header { key, value })
        .collect()
}

impl mesh_actors::Service for NodeService {
    fn tiers(&self) -> Vec<TierAdvert> {
        tier_adverts(&self.registry)
    }

    fn generate(
        &self,
        call: GenerateCall,
    ) -> BoxFuture<'static, Result<mpsc::UnboundedReceiver<Event>, RemoteError>> {
        let entry = self.registry.get(&call.model).map(|e| e.value().clone());
        // The engine this node's quantization policy gives the call's role (the tier's own
        // when the policy names none, or the caller sent no role).
        let (entry, lease, engine) = match (&self.quant, entry, Role::from_name(&call.role)) {
            (Some(q), Some(e), Some(role)) => {
                let policy = q.tuner.live.load().policy.clone();
                let p = q.engines.pick(&policy.quantization, role, &call.model, e);
                (Some(p.entry), p.lease, Some(p.info.gguf))
            }
            (_, e, _) => (e, None, None),
        };
        let (registry, cluster) = (self.registry.clone(), self.cluster.clone());
        Box::pin(async move {
            let span = info_span!("tier.generate", gen_ai.request.model = %call.model,
                gen_ai.operation.name = "chat", mesh.remote = true, mesh.request_id = %call.request_id,
                mesh.role = %call.role, mesh.engine = engine.as_deref().unwrap_or(""),
                gen_ai.usage.input_tokens = call.prompt.len(), gen_ai.usage.output_tokens = tracing::field::Empty);
            let _ = span.set_parent(extract_context(&call.trace));
            prefetch(
                &registry,
                cluster.get(),
                &call.model,
                &call.prompt,
                &call.cache_scope,
            )
            .instrument(span.clone())
            .await;
            let Some(entry) = entry else {
                return Err(RemoteError {
                    class: ErrorClass::NotFound,
                    message: format!("tier `{}` is not running on this node", call.model),
                });
            };
            let req = from_call(call);
            let mut rx = match ractor::call!(entry.actor, |reply| TierMsg::Generate { req, reply })
            {
                Ok(Ok(rx)) => rx,
                Ok(Err(e)) => return Err(remote_error(e)),
                Err(e) => return Err(unavailable(format!("tier actor unavailable: {e}"))),
            };
            let (tx, out) = mpsc::unbounded_channel();
            tokio::spawn(
                async move {
                    // A variant engine stays up until this stream ends.
                    let _lease = lease;
                    while let Some(ev) = rx.recv().await {
                        if let TokenEvent::Done { usage, .. } = &ev {
                            tracing::Span::current()
                                .record("gen_ai.usage.output_tokens", usage.completion_tokens);
                        }
                        if tx.send(to_wire(ev)).is_err() {
                            return; // caller gone: dropping rx cancels the sequence
                        }
                    }
                }
                .instrument(span),
            );
            Ok(out)
        })
    }

    fn fetch_pages(
        &self,
        model: String,
        salt: Vec<u8>,
        ids: Vec<Vec<u8>>,
    ) -> BoxFuture<'static, Vec<(Vec<u8>, Vec<u8>)>> {
        let pages = self
            .registry
            .get(&model)
            .and_then(|e| e.value().desc.pages.clone());
        Box::pin(async move {
            let (Some(pages), Ok(salt)) = (pages, <[u8; 32]>::try_from(salt)) else {
                return vec![];
            };
            let salt = mesh_kvstore::Salt(salt);
            tokio::task::spawn_blocking(move || {
                let mut out = vec![];
                for id in ids {
                    let Ok(raw) = <[u8; 32]>::try_from(id.as_slice()) else {
                        break;
                    };
                    match pages.store.get_stored(&mesh_kvstore::PageId(raw), &salt) {
                        Some(b) => out.push((id, b.to_vec())),
                        None => break,
                    }
                }
                out
            })
            .await
            .unwrap_or_default()
        })
    }

    fn tokenize(
        &self,
        model: String,
        text: String,
    ) -> BoxFuture<'static, Result<Vec<i32>, RemoteError>> {
        let entry = self.registry.get(&model).map(|e| e.value().clone());
        Box::pin(async move {
            let entry = entry.ok_or_else(|| RemoteError {
                class: ErrorClass::NotFound,
                message: format!("tier `{model}` is not running on this node"),
            })?;
            ractor::call!(entry.actor, |reply| TierMsg::Tokenize { text, reply })
                .map_err(|e| unavailable(format!("tier actor unavailable: {e}")))
        })
    }
}

/// A request as it crosses the wire.
pub fn to_call(model: &str, req: &GenerateRequest, deadline: Duration, role: Role) -> GenerateCall {
    GenerateCall {
        role: role.as_str().to_owned(),
        model: model.to_owned(),
        prompt: req.prompt.clone(),
        max_tokens: req.max_tokens as u32,
        temperature: req.sampling.temperature,
        top_p: req.sampling.top_p,
        top_k: req.sampling.top_k,
        seed: req.sampling.seed,
        stop: req.stop.clone(),
        grammar: req.grammar.clone(),
        grammar_trigger: req.grammar_trigger.clone(),
        ignore_eos: req.ignore_eos,
        request_id: req.request_id.clone(),
        deadline_ms: deadline.as_millis() as u64,
        trace: inject_context(),
        cache_scope: req.cache_scope.clone(),
        reasoning_budget: req
            .reasoning_budget
            .map(|b| b.min(u32::MAX as usize) as u32),
    }
}

fn from_call(c: GenerateCall) -> GenerateRequest {
    GenerateRequest {
        prompt: c.prompt,
        max_tokens: c.max_tokens as usize,
        sampling: SamplingParams {
            temperature: c.temperature,
            top_p: c.top_p,
            top_k: c.top_k,
            seed: c.seed,
        },
        stop: c.stop,
        grammar: c.grammar,
        grammar_trigger: c.grammar_trigger,
        ignore_eos: c.ignore_eos,
        request_id: c.request_id,
        cache_scope: c.cache_scope,
        reasoning_budget: c.reasoning_budget.map(|b| b as usize),
        // Not on the wire: a forwarded request drafts as the serving tier is configured.
        draft_max: None,
    }
}

fn to_wire(ev: TokenEvent) -> Event {
    match ev {
        TokenEvent::Started { queued_ms } => Event::Started { queued_ms },
        TokenEvent::Token { id, text, margin } => Event::Token { id, text, margin },
        TokenEvent::Done {
            finish,
            usage,
            tail,
        } => Event::Done {
            finish: match finish {
                FinishReason::Stop => wire::Finish::Stop,
                FinishReason::Length => wire::Finish::Length,
                FinishReason::ContextFull => wire::Finish::ContextFull,
            },
            prompt_tokens: usage.prompt_tokens as u32,
            completion_tokens: usage.completion_tokens as u32,
            reasoning_tokens: usage.reasoning_tokens as u32,
            reasoning_capped: usage.reasoning_capped,
            draft_tokens: usage.draft_tokens as u32,
            draft_accepted: usage.draft_accepted as u32,
            tail,
        },
        TokenEvent::Error(e) => Event::Error(e),
    }
}

fn from_wire(ev: Event) -> TokenEvent {
    match ev {
        Event::Started { queued_ms } => TokenEvent::Started { queued_ms },
        Event::Token { id, text, margin } => TokenEvent::Token { id, text, margin },
        Event::Done {
            finish,
            prompt_tokens,
            completion_tokens,
            reasoning_tokens,
            reasoning_capped,
            draft_tokens,
            draft_accepted,
            tail,
        } => TokenEvent::Done {
            finish: match finish {
                wire::Finish::Stop => FinishReason::Stop,
                wire::Finish::Length => FinishReason::Length,
                wire::Finish::ContextFull => FinishReason::ContextFull,
            },
            usage: Usage {
                prompt_tokens: prompt_tokens as usize,
                completion_tokens: completion_tokens as usize,
                reasoning_tokens: reasoning_tokens as usize,
                reasoning_capped,
                draft_tokens: draft_tokens as usize,
                draft_accepted: draft_accepted as usize,
            },
            tail,
        },
        Event::Error(e) => TokenEvent::Error(e),
    }
}

/// Where a request runs.
#[derive(Debug, Clone)]
pub enum Target {
    /// A tier actor of this node.
    Local(TierEntry),
    /// A tier on a peer.
    Remote {
        /// Peer name.
        node: String,
        /// Per-sequence context of that tier.
        max_seq_len: usize,
    },
}

impl Target {
    /// Per-sequence context limit.
    pub fn max_seq_len(&self) -> usize {
        match self {
            Target::Local(e) => e.desc.info.max_seq_len,
            Target::Remote { max_seq_len, .. } => *max_seq_len,
        }
    }
}

/// Routing over this node's registry and the cluster.
#[derive(Debug, Clone)]
pub struct Dispatcher {
    /// This node's tiers.
    pub registry: Registry,
    /// The cluster, when this node is in one.
    pub cluster: Option<Cluster>,
}

/// Why no target could be chosen.
#[derive(Debug, Clone)]
pub enum RouteError {
    /// No node (local or remote) knows this tier name.
    Unknown(Vec<String>),
    /// The tier exists (configured here or seen in the cluster) but no live node can take it now.
    NoneAvailable,
}

/// Why a start failed.
#[derive(Debug)]
pub enum StartError {
    /// A local tier refused.
    Tier(TierError),
    /// A remote call failed.
    Call(CallError),
}

impl StartError {
    fn retryable(&self) -> bool {
        match self {
            StartError::Tier(e) => matches!(e, TierError::EngineStopped),
            StartError::Call(e) => {
                e.retryable()
                    && !matches!(e, CallError::Remote(r) if r.class == ErrorClass::Overloaded)
            }
        }
    }
}

enum Source {
    Local(mpsc::UnboundedReceiver<TokenEvent>),
    Remote(mpsc::UnboundedReceiver<Result<Event, CallError>>),
}

impl Source {
    /// Next event; `Err` when the run broke (engine stopped, node lost).
    async fn next(&mut self) -> Result<TokenEvent, String> {
        match self {
            Source::Local(rx) => match rx.recv().await {
                Some(TokenEvent::Error(e)) => Err(e),
                Some(ev) => Ok(ev),
                None => Err("the tier stopped before finishing".into()),
            },
            Source::Remote(rx) => match rx.recv().await {
                Some(Ok(Event::Error(e))) => Err(e),
                Some(Ok(ev)) => Ok(from_wire(ev)),
                Some(Err(e)) => Err(e.to_string()),
                None => Err("the remote stream ended before finishing".into()),
            },
        }
    }
}

impl Dispatcher {
    fn me(&self) -> &str {
        self.cluster.as_ref().map(|c| c.name()).unwrap_or("local")
    }

    /// Every tier name this node can route to.
    pub fn tier_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.registry.iter().map(|e| e.key().clone()).collect();
        if let Some(c) = &self.cluster {
            names.extend(c.remote_tier_names());
        }
        names.sort();
        names.dedup();
        names
    }

    fn candidates(&self, model: &str) -> (Vec<Candidate>, Option<TierEntry>) {
        let mut cands = vec![];
        let local = self.registry.get(model).map(|e| e.value().clone());
        if let Some(e) = &local {
            let s = &e.desc.stats;
            cands.push(Candidate {
                node: self.me().to_owned(),
                local: true,
                active: s.active.load(Relaxed) as u32,
                queued: s.queued.load(Relaxed) as u32,
                n_seq_max: e.desc.info.n_seq_max as u32,
                inflight: 0,
                cached_tokens: 0,
                prompt_tokens: 0,
            });
        }
        if let Some(c) = &self.cluster {
            cands.extend(c.candidates(model));
        }
        (cands, local)
    }

    fn resolve(
        &self,
        model: &str,
        cands: &[Candidate],
        local: Option<TierEntry>,
        exclude: &[String],
        configured: bool,
    ) -> Result<Target, RouteError> {
        match routing::pick(cands, exclude) {
            Some(c) if c.local => Ok(Target::Local(local.expect("local candidate has an entry"))),
            Some(c) => {
                let cluster = self
                    .cluster
                    .as_ref()
                    .expect("remote candidate has a cluster");
                let adv = cluster
                    .remote_tier(&c.node, model)
                    .ok_or(RouteError::NoneAvailable)?;
                Ok(Target::Remote {
                    node: c.node.clone(),
                    max_seq_len: adv.max_seq_len as usize,
                })
            }
            None if configured
                || !cands.is_empty()
                || !exclude.is_empty()
                || self.cluster.as_ref().is_some_and(|c| c.ever_hosted(model)) =>
            {
                Err(RouteError::NoneAvailable)
            }
            None => Err(RouteError::Unknown(self.tier_names())),
        }
    }

    /// Picks the node for `model` by load, skipping `exclude`.
    pub fn route(
        &self,
        model: &str,
        exclude: &[String],
        configured: bool,
    ) -> Result<Target, RouteError> {
        let (cands, local) = self.candidates(model);
        self.resolve(model, &cands, local, exclude, configured)
    }

    /// Picks the node for a tokenized prompt by load and by how much of its prefix each node
    /// holds as KV pages (`routing::score`).
    pub fn route_prompt(
        &self,
        model: &str,
        prompt: &[i32],
        scope: &str,
        configured: bool,
    ) -> Result<Target, RouteError> {
        let (mut cands, local) = self.candidates(model);
        let usable = &prompt[..prompt.len().saturating_sub(1)];
        // Page ids from the local tier, else from a peer's advertised salt base.
        let adverts = self
            .cluster
            .as_ref()
            .map(|c| c.tier_adverts(model))
            .unwrap_or_default();
        let params = local
            .as_ref()
            .and_then(|e| e.desc.pages.as_ref().map(|p| (p.base, p.block)))
            .or_else(|| {
                adverts.iter().find_map(|(_, t)| {
                    let base: [u8; 32] = t.page_base.as_slice().try_into().ok()?;
                    (t.page_block > 0)
                        .then_some((mesh_kvstore::SaltBase(base), t.page_block as usize))
                })
            });
        if let Some((base, block)) = params {
            let ids = mesh_kvstore::chain(&base.salt(scope), usable, block);
            for c in &mut cands {
                c.prompt_tokens = prompt.len() as u32;
                let run = if c.local {
                    let store = local
                        .as_ref()
                        .and_then(|e| e.desc.pages.as_ref())
                        .map(|p| p.store.clone());
                    store
                        .map(|s| ids.iter().take_while(|id| s.contains(id)).count())
                        .unwrap_or(0)
                } else {
                    adverts
                        .iter()
                        .find(|(n, t)| {
                            n == &c.node && t.page_base == base.0 && t.page_block as usize == block
                        })
                        .map(|(_, t)| {
                            let held: HashSet<u64> = t.pages.iter().copied().collect();
                            ids.iter()
                                .take_while(|id| held.contains(&id.short()))
                                .count()
                        })
                        .unwrap_or(0)
                };
                c.cached_tokens = (run * block) as u32;
            }
        }
        self.resolve(model, &cands, local, &[], configured)
    }

    /// Tokenizes with the target's tokenizer.
    pub async fn tokenize(
        &self,
        target: &Target,
        model: &str,
        text: String,
    ) -> Result<Vec<i32>, String> {
        match target {
            Target::Local(e) => ractor::call!(e.actor, |reply| TierMsg::Tokenize { text, reply })
                .map_err(|e| format!("tier unavailable: {e}")),
            Target::Remote { node, .. } => self
                .cluster
                .as_ref()
                .expect("remote target has a cluster")
                .tokenize(node, model, &text)
                .await
                .map_err(|e| e.to_string()),
        }
    }

    async fn start(
        &self,
        target: &Target,
        model: &str,
        req: &GenerateRequest,
        role: Role,
    ) -> Result<(Source, Option<InflightGuard>), StartError> {
        match target {
            Target::Local(e) => {
                prefetch(
                    &self.registry,
                    self.cluster.as_ref(),
                    model,
                    &req.prompt,
                    &req.cache_scope,
                )
                .await;
                let req = req.clone();
                match ractor::call!(e.actor, |reply| TierMsg::Generate { req, reply }) {
                    Ok(Ok(rx)) => Ok((Source::Local(rx), None)),
                    Ok(Err(e)) => Err(StartError::Tier(e)),
                    Err(_) => Err(StartError::Tier(TierError::EngineStopped)),
                }
            }
            Target::Remote { node, .. } => {
                let cluster = self.cluster.as_ref().expect("remote target has a cluster");
                let guard = cluster.track(node, model);
                let call = to_call(model, req, Duration::from_secs(600), role);
                let rx = cluster
                    .generate(node, call)
                    .await
                    .map_err(StartError::Call)?;
                Ok((Source::Remote(rx), Some(guard)))
            }
        }
    }

    fn node_of(&self, t: &Target) -> String {
        match t {
            Target::Local(_) => self.me().to_owned(),
            Target::Remote { node, .. } => node.clone(),
        }
    }

    /// Starts `req` on `first` (or, if it refuses with a retryable error, on the next best
    /// node) and returns the token stream. If the serving node is lost mid-stream the request
    /// is re-run on another node hosting the tier and the stream continues where it was.
    pub async fn dispatch(
        self: Arc<Self>,
        first: Target,
        model: String,
        req: GenerateRequest,
        role: Role,
    ) -> Result<mpsc::UnboundedReceiver<TokenEvent>, StartError> {
        let mut exclude: Vec<String> = vec![];
        let mut target = first;
        let (mut src, mut guard) = loop {
            match self.start(&target, &model, &req, role).await {
                Ok(s) => break s,
                Err(e) if e.retryable() && exclude.len() + 1 < MAX_ATTEMPTS => {
                    let node = self.node_of(&target);
                    warn!(%node, tier = %model, error = ?e, "start failed; trying another node");
                    exclude.push(node);
                    if matches!(target, Target::Local(_)) {
                        // A restarting local tier may be back by now; give it a moment.
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    target = match self.route(&model, &exclude, true) {
                        Ok(t) => t,
                        Err(_) => return Err(e),
                    };
                }
                Err(e) => return Err(e),
            }
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let me = self.clone();
        tokio::spawn(async move {
            let mut delivered = 0usize;
            let mut skip = 0usize;
            let mut rerun = false;
            loop {
                match src.next().await {
                    Ok(ev) => {
                        match &ev {
                            TokenEvent::Started { .. } if rerun => continue,
                            TokenEvent::Token { .. } if skip > 0 => {
                                skip -= 1;
                                continue;
                            }
                            TokenEvent::Token { .. } => delivered += 1,
                            _ => {}
                        }
                        let last = matches!(ev, TokenEvent::Done { .. });
                        if tx.send(ev).is_err() || last {
                            return;
                        }
                    }
                    Err(why) => {
                        let node = me.node_of(&target);
                        warn!(%node, tier = %model, delivered, reason = %why, "serving node failed; re-running elsewhere");
                        exclude.push(node);
                        drop(guard.take());
                        let mut restarted = false;
                        while exclude.len() < MAX_ATTEMPTS {
                            let Ok(t) = me.route(&model, &exclude, true) else {
                                break;
                            };
                            match me.start(&t, &model, &req, role).await {
                                Ok((s, g)) => {
                                    target = t;
                                    src = s;
                                    guard = g;
                                    restarted = true;
                                    break;
                                }
                                Err(e) => {
                                    warn!(node = %me.node_of(&t), error = ?e, "re-run refused");
                                    exclude.push(me.node_of(&t));
                                }
                            }
                        }
                        if !restarted {
                            let _ = tx.send(TokenEvent::Error(format!(
                                "the node serving this request failed ({why}) and no other node hosting `{model}` could take it"
                            )));
                            return;
                        }
                        skip = delivered;
                        rerun = true;
                    }
                }
            }
        });
        Ok(rx)
    }
}

/// Maps a remote refusal onto a local tier error (same HTTP mapping).
pub fn remote_to_tier(e: &RemoteError) -> TierError {
    match e.class {
        ErrorClass::InvalidRequest | ErrorClass::ContextExceeded => {
            TierError::InvalidRequest(e.message.clone())
        }
        ErrorClass::Overloaded => TierError::Overloaded(0),
        _ => TierError::EngineStopped,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mesh_transport::frame::{self, HEADER_LEN};

    /// A peer's `Done` reaches the gateway with its usage whole: the reasoning and the draft
    /// counts survive the frame (encoded, validated, decoded).
    #[test]
    fn done_carries_usage_and_draft_counts_across_the_wire() {
        let usage = Usage {
            prompt_tokens: 700,
            completion_tokens: 41,
            reasoning_tokens: 9,
            reasoning_capped: true,
            draft_tokens: 37,
            draft_accepted: 33,
        };
        let ev = TokenEvent::Done {
            finish: FinishReason::Length,
            usage,
            tail: "tail".into(),
        };
        let bytes = frame::encode(&to_wire(ev)).unwrap();
        let back: Event = frame::decode(&bytes[HEADER_LEN..]).unwrap();
        match from_wire(back) {
            TokenEvent::Done {
                finish,
                usage: got,
                tail,
            } => {
                assert_eq!(finish, FinishReason::Length);
                assert_eq!(got, usage);
                assert_eq!(tail, "tail");
            }
            other => panic!("not a Done: {other:?}"),
        }
    }
}
