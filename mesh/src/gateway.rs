//! The OpenAI-compatible HTTP gateway (axum).
//!
//! Routes: `POST /v1/chat/completions`, `POST /v1/completions`,
//! `GET /v1/models`, `GET /v1/cluster`, `GET /health`, `GET /ready`, `GET /metrics`,
//! and the agent layer's `POST /v1/agent/tasks` and `GET /v1/tools` ([`crate::agent`]), and
//! the tuner's `POST /v1/control/tune` and `GET /v1/control/policy` ([`crate::control_api`]).
//! Every request reads the live policy (cascade, reasoning budget, router top-k,
//! quantization) once, when it starts. On a local tier the quantization policy picks the
//! engine for the request's role ([`crate::engines`]).
//!
//! Request path: parse and validate the body (400 with a reason) → pick the
//! node hosting the tier, local or a peer (404 `model_not_found`, 503 if none is up) → take a concurrency permit (429 with
//! `Retry-After`) → render the chat prompt and tokenize → check the context
//! (400 `context_length_exceeded`) → submit to the tier actor → stream tokens
//! out as SSE or collect them. A client that disconnects drops the token
//! receiver, which frees its sequence in the engine.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use mesh_control::policy::Role as RequestRole;
use mesh_control::{Embedder, Tool, ToolRouter};
use mesh_tiers::cascade::{self, CascadePolicy, ReasoningPolicy, Verdict};
use mesh_tiers::chat::{self, ChatMessage, Role, ToolCall, ToolSpec};
use mesh_tiers::grammar;
use mesh_tiers::{FinishReason, GenerateRequest, SamplingParams, TierError, TokenEvent};
use serde_json::{json, Value};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio_stream::wrappers::ReceiverStream;
use tracing::{info_span, warn, Instrument};

use crate::config::ToolRouting;
use crate::metrics::{CascadeLabel, EngineLabel, Metrics, RequestLabel, RoutingLabel};
use crate::node::Registry;
use crate::openai::*;
use crate::remote::{Dispatcher, RouteError, StartError, Target};

/// Gateway settings.
#[derive(Debug, Clone)]
pub struct GatewaySettings {
    /// Requests in flight before 429.
    pub max_concurrent: usize,
    /// Seconds in `Retry-After`.
    pub retry_after_s: u64,
    /// Completion budget when a request sets none.
    pub default_max_tokens: usize,
    /// Tier names this node is configured with (for `/ready`).
    pub expected_tiers: Vec<String>,
    /// The tier cascade clients reach as model [`CascadePolicy::model`] (the start-up
    /// policy; requests read the live one, see [`crate::control_api::LivePolicy`]).
    pub cascade: CascadePolicy,
    /// Reasoning-token budgets (start-up policy, as `cascade`).
    pub reasoning: ReasoningPolicy,
    /// Tool routing for requests with many tools.
    pub tool_routing: ToolRouting,
    /// This node's tier placement (`GET /v1/cluster`, `mesh status`), when planned.
    pub placement: Option<mesh_control::placement::PlacementPlan>,
}

/// The tool router's embedder, loaded by the first request that needs it.
#[derive(Default)]
struct ToolGate {
    embedder: std::sync::OnceLock<Result<Arc<Embedder>, String>>,
}

/// Shared state of the handlers.
#[derive(Clone)]
pub struct AppState {
    registry: Registry,
    dispatcher: Arc<Dispatcher>,
    metrics: Arc<Metrics>,
    permits: Arc<Semaphore>,
    settings: Arc<GatewaySettings>,
    tool_gate: Arc<ToolGate>,
    agent: Option<Arc<crate::agent::Agent>>,
    tuner: Arc<crate::control_api::Tuner>,
    engines: Arc<crate::engines::Engines>,
}

impl AppState {
    /// State over a node's tier registry and, when the node is in a cluster, its peers.
    pub fn new(
        registry: Registry,
        cluster: Option<mesh_actors::Cluster>,
        settings: GatewaySettings,
    ) -> Self {
        Self {
            dispatcher: Arc::new(Dispatcher {
                registry: registry.clone(),
                cluster,
            }),
            metrics: Arc::new(Metrics::new(registry.clone())),
            registry,
            permits: Arc::new(Semaphore::new(settings.max_concurrent)),
            tuner: Arc::new(crate::control_api::Tuner::from_settings(&settings)),
            settings: Arc::new(settings),
            tool_gate: Arc::default(),
            agent: None,
            engines: Arc::new(crate::engines::Engines::none()),
        }
    }

    /// Picks local engines per request role through `engines` (quantization policy).
    pub fn with_engines(mut self, engines: Arc<crate::engines::Engines>) -> Self {
        self.engines = engines;
        self
    }

    pub(crate) fn engines(&self) -> &Arc<crate::engines::Engines> {
        &self.engines
    }

    pub(crate) fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The engine a request of `role` runs on: for a local tier, the one the quantization
    /// policy names (or the tier's own); a peer's tier as it is.
    fn engine_for(
        &self,
        target: Target,
        tier: &str,
        role: RequestRole,
        q: &mesh_control::policy::QuantPolicy,
    ) -> (Target, Option<EngineInfo>, Option<Arc<()>>) {
        match target {
            Target::Local(entry) => {
                let p = self.engines.pick(q, role, tier, entry);
                (Target::Local(p.entry), Some(p.info), p.lease)
            }
            remote => (remote, None, None),
        }
    }

    /// Reads (and tunes) its policy through this tuner.
    pub fn with_tuner(mut self, tuner: Arc<crate::control_api::Tuner>) -> Self {
        self.tuner = tuner;
        self
    }

    pub(crate) fn tuner(&self) -> &Arc<crate::control_api::Tuner> {
        &self.tuner
    }

    /// The policy in force now; a request reads it once and keeps it to the end.
    pub(crate) fn policy(&self) -> Arc<mesh_control::policy::Policy> {
        self.tuner.live.load().policy.clone()
    }

    pub(crate) fn render_metrics(&self) -> String {
        let engines: Vec<(String, Arc<mesh_tiers::EngineStats>)> = self
            .registry
            .iter()
            .map(|e| (e.key().clone(), e.value().desc.stats.clone()))
            .collect();
        self.metrics.render(&engines)
    }

    /// Serves agent tasks (`POST /v1/agent/tasks`) with this agent layer.
    pub fn with_agent(mut self, agent: Arc<crate::agent::Agent>) -> Self {
        self.metrics.watch_tools(agent.runner.clone());
        self.agent = Some(agent);
        self
    }

    pub(crate) fn agent(&self) -> Option<Arc<crate::agent::Agent>> {
        self.agent.clone()
    }

    pub(crate) fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub(crate) fn cascade_model(&self) -> String {
        self.policy().cascade.model.clone()
    }

    /// 404 / 503 as a chat request for `model` would get them.
    pub(crate) fn find_model(&self, model: &str) -> Result<(), ApiError> {
        self.find_tier(model).map(|_| ())
    }
}

/// The router with every route.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/agent/tasks", post(crate::agent::create_task))
        .route("/v1/tools", get(crate::agent::list_tools))
        .route("/v1/models", get(models))
        .route("/v1/cluster", get(cluster))
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .merge(crate::control_api::routes())
        .with_state(state)
}

// ---------------------------------------------------------------------------
// Errors

/// An API error rendered as OpenAI's error JSON.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    kind: &'static str,
    code: Option<&'static str>,
    param: Option<String>,
    message: String,
    retry_after: Option<u64>,
}

impl ApiError {
    pub(crate) fn bad_request(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            code: None,
            param: param.map(str::to_owned),
            message: message.into(),
            retry_after: None,
        }
    }

    /// A 500 with this message.
    pub(crate) fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            code: None,
            param: None,
            message: message.into(),
            retry_after: None,
        }
    }

    /// The message shown to the client.
    pub(crate) fn message(&self) -> &str {
        &self.message
    }

    fn model_not_found(model: &str, available: Vec<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            code: Some("model_not_found"),
            param: Some("model".into()),
            message: format!(
                "The model `{model}` does not exist on this node. Available: {}",
                available.join(", ")
            ),
            retry_after: None,
        }
    }

    fn busy(message: impl Into<String>, retry_after: u64) -> Self {
        Self {
            status: StatusCode::TOO_MANY_REQUESTS,
            kind: "rate_limit_error",
            code: Some("rate_limit_exceeded"),
            param: None,
            message: message.into(),
            retry_after: Some(retry_after),
        }
    }

    fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_error",
            code: Some("tier_unavailable"),
            param: None,
            message: message.into(),
            retry_after: Some(1),
        }
    }

    fn from_tier(e: TierError, retry_after: u64) -> Self {
        match e {
            TierError::ContextExceeded { prompt, max_tokens, limit } => Self {
                status: StatusCode::BAD_REQUEST,
                kind: "invalid_request_error",
                code: Some("context_length_exceeded"),
                param: Some("messages".into()),
                message: format!(
                    "This model's maximum context length is {limit} tokens. However, you requested {} tokens ({prompt} in the messages, {max_tokens} in the completion).",
                    prompt + max_tokens
                ),
                retry_after: None,
            },
            TierError::Overloaded(n) => Self::busy(format!("The tier is busy ({n} requests queued); retry later."), retry_after),
            TierError::InvalidRequest(m) => Self::bad_request(m, None),
            TierError::EngineStopped => Self::unavailable("The tier is restarting; retry shortly."),
            other => Self {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                kind: "server_error",
                code: None,
                param: None,
                message: other.to_string(),
                retry_after: None,
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                message: self.message,
                kind: self.kind.into(),
                param: self.param,
                code: self.code.map(str::to_owned),
            },
        };
        let mut resp = (self.status, Json(body)).into_response();
        if let Some(s) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}

pub(crate) fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.is_empty() {
        return Err(ApiError::bad_request(
            "request body is empty; expected a JSON object",
            None,
        ));
    }
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}"), None))
}

// ---------------------------------------------------------------------------
// Shared request plumbing

/// A validated generation job, ready for a tier.
struct Job {
    model: String,
    req: GenerateRequest,
    /// The concurrency permit, held until the response ends (a cascade holds one for
    /// all its steps).
    _permit: Option<OwnedSemaphorePermit>,
    /// The local engine that runs it, when local.
    engine: Option<EngineInfo>,
    /// Keeps a variant engine from being stopped until the response ends.
    _lease: Option<Arc<()>>,
    /// What the request is for (quantization policy); a peer serving it picks its engine by it.
    role: RequestRole,
}

impl AppState {
    fn find_tier(&self, model: &str) -> Result<Target, ApiError> {
        let configured = self.settings.expected_tiers.iter().any(|t| t == model);
        self.dispatcher.route(model, &[], configured).map_err(|e| match e {
            RouteError::Unknown(names) => ApiError::model_not_found(model, names),
            RouteError::NoneAvailable => ApiError::unavailable(format!(
                "No node hosting `{model}` is available right now (restarting or lost); retry shortly."
            )),
        })
    }

    /// Tokenizes on `target`; if that node fails, moves `target` to the next node hosting
    /// the tier and tries there.
    async fn tokenize(
        &self,
        target: &mut Target,
        model: &str,
        text: String,
    ) -> Result<Vec<i32>, ApiError> {
        let mut failed: Vec<String> = vec![];
        loop {
            match self.dispatcher.tokenize(target, model, text.clone()).await {
                Ok(t) => return Ok(t),
                Err(why) => {
                    if let Target::Remote { node, .. } = &*target {
                        failed.push(node.clone());
                    }
                    let next = match &*target {
                        Target::Remote { .. } if failed.len() < crate::remote::MAX_ATTEMPTS => {
                            self.dispatcher.route(model, &failed, true).ok()
                        }
                        _ => None,
                    };
                    match next {
                        Some(t) => *target = t,
                        None => {
                            return Err(ApiError::unavailable(format!(
                                "No node hosting `{model}` is available right now ({why}); retry shortly."
                            )))
                        }
                    }
                }
            }
        }
    }

    /// With more tools than `route_above`, keeps only the router's top-k for the user's
    /// last message (a `tool_choice` tool always stays). Routing problems (no embedding
    /// model, duplicate names) are logged and the request keeps every tool.
    async fn route_tools(&self, r: &mut ChatRequest, top_k: usize) -> Option<RouterInfo> {
        let cfg = &self.settings.tool_routing;
        if cfg.route_above == 0 || r.tools.len() <= cfg.route_above {
            return None;
        }
        if matches!(&r.tool_choice, Some(Value::String(s)) if s == "none") {
            return None;
        }
        let intent = last_user_text(&r.messages)?;
        let tools: Vec<Tool> = r
            .tools
            .iter()
            .map(|t| Tool {
                name: t.function.name.clone(),
                description: t.function.description.clone().unwrap_or_default(),
                parameters: t.function.parameters.clone().unwrap_or(Value::Null),
            })
            .collect();
        let forced: Option<String> = r
            .tool_choice
            .as_ref()
            .and_then(mesh_control::router::forced_tool)
            .map(str::to_owned);
        let (gate, cfg) = (self.tool_gate.clone(), cfg.clone());
        let offered = r.tools.len();
        let routed = tokio::task::spawn_blocking(move || -> Result<RouterInfo, String> {
            let embedder = gate
                .embedder
                .get_or_init(|| {
                    Embedder::new(cfg.embedder.clone())
                        .map(Arc::new)
                        .map_err(|e| {
                            format!("embedding model {}: {e}", cfg.embedder.model.display())
                        })
                })
                .clone()?;
            let router = ToolRouter::build(&embedder, tools, cfg.router.clone())
                .map_err(|e| e.to_string())?;
            let forced: Vec<&str> = forced.iter().map(String::as_str).collect();
            let routing = router
                .route_with(&embedder, &intent, top_k, &forced)
                .map_err(|e| e.to_string())?;
            Ok(RouterInfo {
                offered,
                shown: routing.names().into_iter().map(str::to_owned).collect(),
                top1: routing.confidence.top1,
                margin: routing.confidence.margin,
                reranked: routing.reranked,
            })
        })
        .instrument(info_span!("router.route", mesh.router.offered = offered))
        .await;
        let outcome = |o: &str| {
            self.metrics
                .tool_routing
                .get_or_create(&RoutingLabel { outcome: o.into() })
                .inc();
        };
        match routed {
            Ok(Ok(info)) => {
                outcome("routed");
                // The request's own order, so requests that route to the same tools share
                // one prompt prefix (and its KV pages).
                r.tools.retain(|t| info.shown.contains(&t.function.name));
                self.metrics
                    .tools_removed
                    .inc_by((offered - r.tools.len()) as u64);
                Some(info)
            }
            Ok(Err(e)) => {
                outcome("failed");
                warn!(error = %e, "tool routing failed; the prompt shows every tool");
                None
            }
            Err(e) => {
                outcome("failed");
                warn!(error = %e, "tool routing task failed; the prompt shows every tool");
                None
            }
        }
    }

    fn permit(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        self.permits.clone().try_acquire_owned().map_err(|_| {
            ApiError::busy(
                format!(
                    "Too many concurrent requests (limit {}); retry later.",
                    self.settings.max_concurrent
                ),
                self.settings.retry_after_s,
            )
        })
    }

    pub(crate) fn count(&self, endpoint: &str, status: StatusCode) {
        self.metrics
            .requests
            .get_or_create(&RequestLabel {
                endpoint: endpoint.into(),
                status: status.as_u16(),
            })
            .inc();
    }
}

fn budget(
    state: &AppState,
    limit: usize,
    prompt_len: usize,
    asked: Option<usize>,
) -> Result<usize, ApiError> {
    match asked {
        Some(0) => Err(ApiError::bad_request(
            "max_tokens must be at least 1",
            Some("max_tokens"),
        )),
        Some(n) if prompt_len + n > limit => Err(ApiError::from_tier(
            TierError::ContextExceeded {
                prompt: prompt_len,
                max_tokens: n,
                limit,
            },
            0,
        )),
        Some(n) => Ok(n),
        None if prompt_len >= limit => Err(ApiError::from_tier(
            TierError::ContextExceeded {
                prompt: prompt_len,
                max_tokens: 0,
                limit,
            },
            0,
        )),
        None => Ok(state.settings.default_max_tokens.min(limit - prompt_len)),
    }
}

fn sampling(
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i32>,
    seed: Option<u64>,
) -> Result<SamplingParams, ApiError> {
    let t = temperature.unwrap_or(0.0);
    if !(0.0..=2.0).contains(&t) {
        return Err(ApiError::bad_request(
            "temperature must be between 0 and 2",
            Some("temperature"),
        ));
    }
    let p = top_p.unwrap_or(1.0);
    if !(p > 0.0 && p <= 1.0) {
        return Err(ApiError::bad_request(
            "top_p must be in (0, 1]",
            Some("top_p"),
        ));
    }
    let k = top_k.unwrap_or(0);
    if k < 0 {
        return Err(ApiError::bad_request("top_k must be >= 0", Some("top_k")));
    }
    Ok(SamplingParams {
        temperature: t,
        top_p: p,
        top_k: k,
        seed: seed.unwrap_or(0) as u32,
    })
}

async fn submit(
    state: &AppState,
    target: Target,
    job: &Job,
) -> Result<mpsc::UnboundedReceiver<TokenEvent>, ApiError> {
    let retry = state.settings.retry_after_s;
    if job.req.reasoning_budget.is_some() {
        state
            .metrics
            .reasoning_budgeted
            .get_or_create(&Metrics::model(&job.model))
            .inc();
    }
    if let Some(e) = &job.engine {
        state
            .metrics
            .engine_requests
            .get_or_create(&EngineLabel {
                model: job.model.clone(),
                gguf: e.gguf.clone(),
                kv_type: e.kv_type.clone(),
                role: e.role.clone(),
            })
            .inc();
    }
    state
        .dispatcher
        .clone()
        .dispatch(target, job.model.clone(), job.req.clone(), job.role)
        .await
        .map_err(|e| match e {
            StartError::Tier(e) => ApiError::from_tier(e, retry),
            StartError::Call(mesh_actors::CallError::Remote(r)) => {
                ApiError::from_tier(crate::remote::remote_to_tier(&r), retry)
            }
            StartError::Call(e) => {
                ApiError::unavailable(format!("no node could take the request: {e}"))
            }
        })
}

/// Token stream with latency metrics recorded as it is read.
struct Timed {
    rx: mpsc::UnboundedReceiver<TokenEvent>,
    model: String,
    metrics: Arc<Metrics>,
    arrived: Instant,
    last: Option<Instant>,
    queued_ms: u64,
}

impl Timed {
    async fn next(&mut self) -> Option<TokenEvent> {
        let ev = self.rx.recv().await?;
        let l = Metrics::model(&self.model);
        match &ev {
            TokenEvent::Started { queued_ms } => self.queued_ms = *queued_ms,
            TokenEvent::Token { .. } => {
                let now = Instant::now();
                match self.last {
                    None => self
                        .metrics
                        .ttft
                        .get_or_create(&l)
                        .observe((now - self.arrived).as_secs_f64()),
                    Some(prev) => self
                        .metrics
                        .itl
                        .get_or_create(&l)
                        .observe((now - prev).as_secs_f64()),
                }
                self.last = Some(now);
            }
            TokenEvent::Done { usage, .. } => {
                self.metrics
                    .reasoning_tokens
                    .get_or_create(&l)
                    .inc_by(usage.reasoning_tokens as u64);
                if usage.reasoning_capped {
                    self.metrics.reasoning_capped.get_or_create(&l).inc();
                }
                self.metrics
                    .prompt_tokens
                    .get_or_create(&l)
                    .inc_by(usage.prompt_tokens as u64);
                self.metrics
                    .generation_tokens
                    .get_or_create(&l)
                    .inc_by(usage.completion_tokens as u64);
                self.metrics
                    .e2e
                    .get_or_create(&l)
                    .observe(self.arrived.elapsed().as_secs_f64());
            }
            TokenEvent::Error(_) => {}
        }
        Some(ev)
    }
}

struct Collected {
    text: String,
    finish: FinishReason,
    usage: OutUsage,
    queued_ms: u64,
    /// Every event in order (the cascade replays the kept answer to streaming clients).
    events: Vec<TokenEvent>,
    /// Per-token logit margins.
    margins: Vec<f32>,
    reasoning_capped: bool,
    /// Draft counts when the tier decoded it speculatively.
    speculative: Option<SpecInfo>,
}

async fn collect(mut t: Timed) -> Result<Collected, ApiError> {
    let mut text = String::new();
    let mut margins = Vec::new();
    let mut events = Vec::new();
    while let Some(ev) = t.next().await {
        events.push(ev.clone());
        match ev {
            TokenEvent::Started { .. } => {}
            TokenEvent::Token {
                text: piece,
                margin,
                ..
            } => {
                text.push_str(&piece);
                margins.push(margin);
            }
            TokenEvent::Done {
                finish,
                usage,
                tail,
            } => {
                text.push_str(&tail);
                return Ok(Collected {
                    text,
                    finish,
                    usage: usage.into(),
                    queued_ms: t.queued_ms,
                    events,
                    margins,
                    reasoning_capped: usage.reasoning_capped,
                    speculative: SpecInfo::of(&usage),
                });
            }
            TokenEvent::Error(e) => {
                return Err(ApiError::unavailable(format!("generation failed: {e}")))
            }
        }
    }
    Err(ApiError::unavailable("the tier stopped before finishing"))
}

fn cache_scope(tools: &[ToolSpec]) -> String {
    let mut names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    format!("tools:{}", names.join(","))
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn new_id(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

fn finish_str(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop => "stop",
        FinishReason::Length | FinishReason::ContextFull => "length",
    }
}

/// Ends an SSE stream: the usage chunk (an empty-choices copy of `template`) when asked for,
/// then `[DONE]`.
async fn end_stream(
    tx: &mpsc::Sender<Result<Event, Infallible>>,
    template: Option<Value>,
    usage: mesh_tiers::Usage,
) {
    if let Some(mut last) = template {
        last["choices"] = json!([]);
        last["usage"] = serde_json::to_value(OutUsage::from(usage)).expect("serializable");
        let _ = tx.send(sse_data(&last)).await;
    }
    let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
}

fn sse_data(v: &Value) -> Result<Event, Infallible> {
    Ok(Event::default().data(v.to_string()))
}

// ---------------------------------------------------------------------------
// /v1/chat/completions

fn to_messages(input: &[InMessage]) -> Result<Vec<ChatMessage>, ApiError> {
    if input.is_empty() {
        return Err(ApiError::bad_request(
            "messages must not be empty",
            Some("messages"),
        ));
    }
    input
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = match m.role.as_str() {
                "system" | "developer" => Role::System,
                "user" => Role::User,
                "assistant" => Role::Assistant,
                "tool" => Role::Tool,
                other => {
                    return Err(ApiError::bad_request(
                        format!("unsupported role `{other}`"),
                        Some(&format!("messages[{i}].role")),
                    ))
                }
            };
            let content = match &m.content {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    let mut text = String::new();
                    for p in parts {
                        match (
                            p.get("type").and_then(Value::as_str),
                            p.get("text").and_then(Value::as_str),
                        ) {
                            (Some("text"), Some(t)) => text.push_str(t),
                            (kind, _) => {
                                return Err(ApiError::bad_request(
                                    format!(
                                        "unsupported content part type `{}`",
                                        kind.unwrap_or("?")
                                    ),
                                    Some(&format!("messages[{i}].content")),
                                ))
                            }
                        }
                    }
                    text
                }
                Some(_) => {
                    return Err(ApiError::bad_request(
                        "content must be a string, an array of text parts, or null",
                        Some(&format!("messages[{i}].content")),
                    ))
                }
            };
            let tool_calls = m
                .tool_calls
                .iter()
                .map(|c| ToolCall {
                    name: c.function.name.clone(),
                    arguments: match &c.function.arguments {
                        Value::String(s) => {
                            serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.clone()))
                        }
                        v => v.clone(),
                    },
                })
                .collect();
            Ok(ChatMessage {
                role,
                content,
                tool_calls,
            })
        })
        .collect()
}

fn to_tools(input: &[InTool]) -> Result<Vec<ToolSpec>, ApiError> {
    input
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if t.kind != "function" {
                return Err(ApiError::bad_request(
                    format!(
                        "unsupported tool type `{}`; only `function` is supported",
                        t.kind
                    ),
                    Some(&format!("tools[{i}].type")),
                ));
            }
            if t.function.name.is_empty() {
                return Err(ApiError::bad_request(
                    "tool name must not be empty",
                    Some(&format!("tools[{i}].function.name")),
                ));
            }
            let parameters = t
                .function
                .parameters
                .clone()
                .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
            if !parameters.is_object() {
                return Err(ApiError::bad_request(
                    "parameters must be a JSON schema object",
                    Some(&format!("tools[{i}].function.parameters")),
                ));
            }
            Ok(ToolSpec {
                name: t.function.name.clone(),
                description: t.function.description.clone().unwrap_or_default(),
                parameters,
            })
        })
        .collect()
}

/// Tools to show in the prompt and the grammar to apply, from `tool_choice`.
fn tool_plan(
    tools: Vec<ToolSpec>,
    choice: Option<&Value>,
) -> Result<(Vec<ToolSpec>, Option<(String, bool)>), ApiError> {
    let err = |m: String| ApiError::bad_request(m, Some("tool_choice"));
    let g = |r: Result<String, TierError>| {
        r.map_err(|e| ApiError::bad_request(e.to_string(), Some("tools")))
    };
    match choice {
        None | Some(Value::Null) => {
            if tools.is_empty() {
                Ok((tools, None))
            } else {
                let gr = g(grammar::tool_call_grammar(&tools))?;
                Ok((tools, Some((gr, true))))
            }
        }
        Some(Value::String(s)) => match s.as_str() {
            "auto" if tools.is_empty() => Ok((tools, None)),
            "auto" => {
                let gr = g(grammar::tool_call_grammar(&tools))?;
                Ok((tools, Some((gr, true))))
            }
            "none" => Ok((Vec::new(), None)),
            "required" if tools.is_empty() => {
                Err(err("tool_choice `required` needs at least one tool".into()))
            }
            "required" => {
                let gr = g(grammar::required_tool_call_grammar(&tools))?;
                Ok((tools, Some((gr, false))))
            }
            other => Err(err(format!("unsupported tool_choice `{other}`"))),
        },
        Some(obj) => {
            let name = obj
                .pointer("/function/name")
                .and_then(Value::as_str)
                .ok_or_else(|| err("tool_choice object must be {\"type\": \"function\", \"function\": {\"name\": ...}}".into()))?;
            let chosen: Vec<ToolSpec> = tools.iter().filter(|t| t.name == name).cloned().collect();
            if chosen.is_empty() {
                return Err(err(format!(
                    "tool_choice names `{name}`, which is not in tools"
                )));
            }
            let gr = g(grammar::required_tool_call_grammar(&chosen))?;
            Ok((tools, Some((gr, false))))
        }
    }
}

fn out_calls(calls: &[ToolCall], start: usize, with_index: bool) -> Vec<OutToolCall> {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| OutToolCall {
            index: with_index.then_some(start + i),
            id: format!("call_{}", &uuid::Uuid::new_v4().simple().to_string()[..24]),
            kind: "function".into(),
            function: OutFunctionCall {
                name: c.name.clone(),
                arguments: c.arguments.to_string(),
            },
        })
        .collect()
}

async fn chat_completions(State(state): State<AppState>, body: Bytes) -> Response {
    const EP: &str = "/v1/chat/completions";
    let resp = match chat_inner(&state, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    };
    state.count(EP, resp.status());
    resp
}

/// A chat completion through the full request path (routing, cascade, metrics), for
/// callers inside the node such as the agent loop.
pub(crate) async fn chat_response(state: &AppState, body: &[u8]) -> Result<Response, ApiError> {
    chat_inner(state, body).await
}

async fn chat_inner(state: &AppState, body: &[u8]) -> Result<Response, ApiError> {
    chat_with(state, body, state.policy()).await
}

/// A chat completion under `policy` (the live one, or a tuner trial's).
pub(crate) async fn chat_with(
    state: &AppState,
    body: &[u8],
    policy: Arc<mesh_control::policy::Policy>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let mut r: ChatRequest = parse_body(body)?;
    if r.n.unwrap_or(1) != 1 {
        return Err(ApiError::bad_request("only n = 1 is supported", Some("n")));
    }
    let span = info_span!("gateway.chat", gen_ai.request.model = %r.model, gen_ai.operation.name = "chat",
        gen_ai.usage.input_tokens = tracing::field::Empty, mesh.tier = %r.model, stream = r.stream);
    async move {
        let routed = state.route_tools(&mut r, policy.router_top_k).await;
        if r.model == policy.cascade.model {
            return cascade_chat(state, &r, arrived, routed, &policy).await;
        }
        let mut tier = state.find_tier(&r.model)?;
        let p = prepare(&r, routed.as_ref())?;
        let permit = state.permit()?;
        let prompt = state
            .tokenize(&mut tier, &r.model, p.prompt_text.clone())
            .instrument(info_span!("tokenize"))
            .await?;
        // With the prompt known, prefer a node that holds its prefix pages.
        let tier = state
            .dispatcher
            .route_prompt(&r.model, &prompt, &p.scope, true)
            .unwrap_or(tier);
        tracing::Span::current().record("gen_ai.usage.input_tokens", prompt.len());
        let role = RequestRole::classify(!p.shown.is_empty(), r.reasoning_budget);
        let (tier, engine, lease) = state.engine_for(tier, &r.model, role, &policy.quantization);
        let req = build_request(state, &r, &p, prompt, tier.max_seq_len(), &policy)?;
        let job = Job {
            model: r.model.clone(),
            req,
            _permit: Some(permit),
            engine,
            _lease: lease,
            role,
        };
        let rx = submit(state, tier, &job)
            .instrument(info_span!("tier.submit"))
            .await?;
        let timed = Timed {
            rx,
            model: job.model.clone(),
            metrics: state.metrics.clone(),
            arrived,
            last: None,
            queued_ms: 0,
        };
        if r.stream {
            let include_usage = r.stream_options.as_ref().is_some_and(|o| o.include_usage);
            Ok(stream_chat(job, timed, include_usage))
        } else {
            let c = collect(timed)
                .instrument(info_span!("tier.generate"))
                .await?;
            let mesh = MeshInfo {
                tier: job.model.clone(),
                queued_ms: c.queued_ms,
                reasoning_capped: c.reasoning_capped,
                cascade: vec![],
                router: routed,
                speculative: c.speculative,
                engine: job.engine.clone(),
            };
            Ok(Json(chat_body(&job.model, &c.text, c.finish, c.usage, &mesh)).into_response())
        }
    }
    .instrument(span)
    .await
}

/// Text of the last user message (the intent the tool router matches).
fn last_user_text(messages: &[InMessage]) -> Option<String> {
    let m = messages.iter().rev().find(|m| m.role == "user")?;
    match m.content.as_ref()? {
        Value::String(s) => Some(s.clone()),
        Value::Array(parts) => {
            let text: Vec<&str> = parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect();
            (!text.is_empty()).then(|| text.join("\n"))
        }
        _ => None,
    }
}

/// A chat request rendered for the tiers.
pub(crate) struct Prepared {
    pub(crate) prompt_text: String,
    /// Tools shown in the prompt.
    shown: Vec<ToolSpec>,
    grammar: Option<String>,
    trigger: Option<String>,
    scope: String,
    /// The tool router's top-1 score, when it routed this request (cascade entry tier,
    /// reasoning budget).
    confidence: Option<f32>,
}

pub(crate) fn prepare(r: &ChatRequest, routed: Option<&RouterInfo>) -> Result<Prepared, ApiError> {
    let messages = to_messages(&r.messages)?;
    let (shown, grammar) = tool_plan(to_tools(&r.tools)?, r.tool_choice.as_ref())?;
    let prompt_text = chat::render_prompt(&messages, &shown);
    let (grammar, trigger) = match grammar {
        Some((g, true)) => (Some(g), Some(chat::CALL.to_owned())),
        Some((g, false)) => (Some(g), None),
        None => (None, None),
    };
    // Prefix pages are shared only between requests offered the same tools.
    let scope = cache_scope(&shown);
    Ok(Prepared {
        prompt_text,
        shown,
        grammar,
        trigger,
        scope,
        confidence: routed.map(|i| i.top1),
    })
}

fn build_request(
    state: &AppState,
    r: &ChatRequest,
    p: &Prepared,
    prompt: Vec<i32>,
    max_seq_len: usize,
    policy: &mesh_control::policy::Policy,
) -> Result<GenerateRequest, ApiError> {
    let max_tokens = budget(
        state,
        max_seq_len,
        prompt.len(),
        r.max_completion_tokens.or(r.max_tokens),
    )?;
    Ok(GenerateRequest {
        prompt,
        max_tokens,
        sampling: sampling(r.temperature, r.top_p, r.top_k, r.seed)?,
        stop: r.stop.clone().map(StopField::into_vec).unwrap_or_default(),
        grammar: p.grammar.clone(),
        grammar_trigger: p.trigger.clone(),
        ignore_eos: r.ignore_eos,
        request_id: String::new(),
        cache_scope: p.scope.clone(),
        reasoning_budget: policy.reasoning.budget(r.reasoning_budget, p.confidence),
        draft_max: Some(policy.draft_k_max),
    })
}

/// A non-streamed chat completion body.
fn chat_body(
    model: &str,
    text: &str,
    finish: FinishReason,
    usage: OutUsage,
    mesh: &MeshInfo,
) -> Value {
    let parsed = chat::parse_output(text);
    let finish = if !parsed.tool_calls.is_empty() {
        "tool_calls"
    } else {
        finish_str(finish)
    };
    let mut message = json!({"role": "assistant", "content": if parsed.content.is_empty() && !parsed.tool_calls.is_empty() { Value::Null } else { Value::String(parsed.content.clone()) }});
    if let Some(reasoning) = &parsed.reasoning {
        message["reasoning_content"] = Value::String(reasoning.clone());
    }
    if !parsed.tool_calls.is_empty() {
        message["tool_calls"] =
            serde_json::to_value(out_calls(&parsed.tool_calls, 0, false)).expect("serializable");
    }
    json!({
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": now_s(),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": null}],
        "usage": usage,
        "mesh": mesh,
    })
}

/// Runs a request through the tier cascade: each tier in policy order generates the
/// whole answer; the first whose answer [`cascade::assess`] keeps answers the client.
/// Streaming clients get the kept answer replayed as chunks once it is decided.
async fn cascade_chat(
    state: &AppState,
    r: &ChatRequest,
    arrived: Instant,
    routed: Option<RouterInfo>,
    live: &mesh_control::policy::Policy,
) -> Result<Response, ApiError> {
    let policy = &live.cascade;
    let p = prepare(r, routed.as_ref())?;
    let mut first = state.find_tier(&policy.tiers[0])?;
    let permit = state.permit()?;
    // The tiers share one tokenizer (a cascade requirement), so one tokenization serves all.
    let prompt = state
        .tokenize(&mut first, &policy.tiers[0], p.prompt_text.clone())
        .instrument(info_span!("tokenize"))
        .await?;
    tracing::Span::current().record("gen_ai.usage.input_tokens", prompt.len());
    let offered: Vec<&str> = p.shown.iter().map(|t| t.name.as_str()).collect();
    let role = RequestRole::classify(!p.shown.is_empty(), r.reasoning_budget);
    let (start, skipped) = cascade::first_tier(policy, p.confidence);
    let mut steps: Vec<CascadeStep> = Vec::new();
    if let Some(v) = skipped {
        state
            .metrics
            .cascade_steps
            .get_or_create(&CascadeLabel {
                tier: policy.tiers[0].clone(),
                verdict: v.as_str().into(),
            })
            .inc();
        steps.push(CascadeStep {
            tier: policy.tiers[0].clone(),
            verdict: v.as_str().into(),
            min_margin: None,
            completion_tokens: 0,
        });
    }
    let mut total = OutUsage::default();
    let mut kept = None;
    for (i, tier) in policy.tiers.iter().enumerate().skip(start) {
        let target = match state
            .dispatcher
            .route_prompt(tier, &prompt, &p.scope, true)
            .ok()
            .map_or_else(|| state.find_tier(tier), Ok)
        {
            Ok(t) => t,
            // A missing middle tier is skipped; the last one must answer.
            Err(e) if i + 1 == policy.tiers.len() => return Err(e),
            Err(_) => {
                steps.push(CascadeStep {
                    tier: tier.clone(),
                    verdict: "unavailable".into(),
                    min_margin: None,
                    completion_tokens: 0,
                });
                continue;
            }
        };
        let (target, engine, lease) = state.engine_for(target, tier, role, &live.quantization);
        let req = build_request(state, r, &p, prompt.clone(), target.max_seq_len(), &live)?;
        let job = Job {
            model: tier.clone(),
            req,
            _permit: None,
            engine,
            _lease: lease,
            role,
        };
        let c = async {
            let rx = submit(state, target, &job).await?;
            let timed = Timed {
                rx,
                model: tier.clone(),
                metrics: state.metrics.clone(),
                arrived,
                last: None,
                queued_ms: 0,
            };
            collect(timed).await.map(|c| (c, job.engine.clone()))
        }
        .instrument(
            info_span!("cascade.tier", mesh.tier = %tier, mesh.verdict = tracing::field::Empty),
        )
        .await?;
        let (c, engine) = c;
        let out = cascade::Output {
            text: &c.text,
            margins: &c.margins,
            truncated: c.finish != FinishReason::Stop,
        };
        let a = cascade::assess(policy, i, out, &offered);
        state
            .metrics
            .cascade_steps
            .get_or_create(&CascadeLabel {
                tier: tier.clone(),
                verdict: a.verdict.as_str().into(),
            })
            .inc();
        steps.push(CascadeStep {
            tier: tier.clone(),
            verdict: a.verdict.as_str().into(),
            min_margin: a.min_margin.is_finite().then_some(a.min_margin),
            completion_tokens: c.usage.completion_tokens,
        });
        total.prompt_tokens += c.usage.prompt_tokens;
        total.completion_tokens += c.usage.completion_tokens;
        total.total_tokens += c.usage.total_tokens;
        total.completion_tokens_details.reasoning_tokens +=
            c.usage.completion_tokens_details.reasoning_tokens;
        if a.verdict.kept() {
            kept = Some((tier.clone(), c, engine));
            break;
        }
        debug_assert!(a.verdict != Verdict::Accept);
    }
    let (tier, c, engine) =
        kept.ok_or_else(|| ApiError::unavailable("no cascade tier answered"))?;
    if r.stream {
        // Replay the kept answer; the final usage chunk reports the whole cascade's tokens.
        let (tx, rx) = mpsc::unbounded_channel();
        for ev in c.events {
            let ev = match ev {
                TokenEvent::Done {
                    finish,
                    mut usage,
                    tail,
                } => {
                    usage.prompt_tokens = total.prompt_tokens;
                    usage.completion_tokens = total.completion_tokens;
                    usage.reasoning_tokens = total.completion_tokens_details.reasoning_tokens;
                    TokenEvent::Done {
                        finish,
                        usage,
                        tail,
                    }
                }
                other => other,
            };
            let _ = tx.send(ev);
        }
        let job = Job {
            model: policy.model.clone(),
            req: GenerateRequest::default(),
            _permit: Some(permit),
            engine: None,
            _lease: None,
            role: RequestRole::Summaries,
        };
        let timed = Timed {
            rx,
            model: policy.model.clone(),
            metrics: state.metrics.clone(),
            arrived,
            last: None,
            queued_ms: 0,
        };
        let include_usage = r.stream_options.as_ref().is_some_and(|o| o.include_usage);
        Ok(stream_chat(job, timed, include_usage))
    } else {
        drop(permit);
        let mesh = MeshInfo {
            tier,
            queued_ms: c.queued_ms,
            reasoning_capped: c.reasoning_capped,
            cascade: steps,
            router: routed,
            speculative: c.speculative,
            engine,
        };
        Ok(Json(chat_body(&policy.model, &c.text, c.finish, total, &mesh)).into_response())
    }
}

/// Splits streamed chat text into content, reasoning and complete tool-call bodies.
#[derive(Debug, Default)]
pub struct StreamSplitter {
    buf: String,
    state: SplitState,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum SplitState {
    #[default]
    Content,
    Think,
    Call,
}

/// A piece of streamed output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Answer text.
    Content(String),
    /// Reasoning text.
    Reasoning(String),
    /// A complete tool-call body (JSON text between the markers).
    Call(String),
}

fn held_suffix(buf: &str, markers: &[&str]) -> usize {
    markers
        .iter()
        .map(|m| {
            (1..m.len().min(buf.len() + 1))
                .rev()
                .find(|&n| {
                    buf.is_char_boundary(buf.len() - n) && m.starts_with(&buf[buf.len() - n..])
                })
                .unwrap_or(0)
        })
        .max()
        .unwrap_or(0)
}

impl StreamSplitter {
    /// Feeds text; returns the pieces that are complete.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.state {
                SplitState::Content => {
                    let next = [
                        (chat::THINK, SplitState::Think),
                        (chat::CALL, SplitState::Call),
                    ]
                    .iter()
                    .filter_map(|(m, s)| self.buf.find(m).map(|i| (i, m.len(), *s)))
                    .min_by_key(|x| x.0);
                    if let Some((i, len, s)) = next {
                        if i > 0 {
                            out.push(Piece::Content(self.buf[..i].to_owned()));
                        }
                        self.buf.drain(..i + len);
                        self.state = s;
                        continue;
                    }
                    let keep = held_suffix(&self.buf, &[chat::THINK, chat::CALL]);
                    let cut = self.buf.len() - keep;
                    if cut > 0 {
                        out.push(Piece::Content(self.buf[..cut].to_owned()));
                        self.buf.drain(..cut);
                    }
                    break;
                }
                SplitState::Think => {
                    if let Some(i) = self.buf.find(chat::END_THINK) {
                        if i > 0 {
                            out.push(Piece::Reasoning(self.buf[..i].to_owned()));
                        }
                        self.buf.drain(..i + chat::END_THINK.len());
                        self.state = SplitState::Content;
                        continue;
                    }
                    let keep = held_suffix(&self.buf, &[chat::END_THINK]);
                    let cut = self.buf.len() - keep;
                    if cut > 0 {
                        out.push(Piece::Reasoning(self.buf[..cut].to_owned()));
                        self.buf.drain(..cut);
                    }
                    break;
                }
                SplitState::Call => {
                    if let Some(i) = self.buf.find(chat::END_CALL) {
                        out.push(Piece::Call(self.buf[..i].to_owned()));
                        self.buf.drain(..i + chat::END_CALL.len());
                        self.state = SplitState::Content;
                        continue;
                    }
                    break;
                }
            }
        }
        out
    }

    /// End of stream: whatever is held.
    pub fn finish(&mut self) -> Vec<Piece> {
        let rest = std::mem::take(&mut self.buf);
        match std::mem::take(&mut self.state) {
            _ if rest.is_empty() => vec![],
            SplitState::Content => vec![Piece::Content(rest)],
            SplitState::Think => vec![Piece::Reasoning(rest)],
            SplitState::Call => vec![Piece::Content(format!("{}{rest}", chat::CALL))],
        }
    }
}

fn stream_chat(job: Job, mut timed: Timed, include_usage: bool) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Event, Infallible>>(64);
    let id = new_id("chatcmpl");
    let created = now_s();
    let model = job.model.clone();
    let chunk = move |delta: Value, finish: Option<&str>| {
        json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null}]})
    };
    tokio::spawn(
        async move {
            let _job = job; // holds the concurrency permit until the stream ends
            if tx.send(sse_data(&chunk(json!({"role": "assistant", "content": ""}), None))).await.is_err() {
                return;
            }
            let mut split = StreamSplitter::default();
            let mut n_calls = 0usize;
            let send_pieces = |pieces: Vec<Piece>, n_calls: &mut usize| -> Vec<Value> {
                pieces
                    .into_iter()
                    .map(|p| match p {
                        Piece::Content(t) => chunk(json!({"content": t}), None),
                        Piece::Reasoning(t) => chunk(json!({"reasoning_content": t}), None),
                        Piece::Call(body) => match chat::parse_output(&format!("{}{body}{}", chat::CALL, chat::END_CALL)).tool_calls.first() {
                            Some(c) => {
                                let calls = out_calls(std::slice::from_ref(c), *n_calls, true);
                                *n_calls += 1;
                                chunk(json!({"tool_calls": calls}), None)
                            }
                            None => chunk(json!({"content": format!("{}{body}{}", chat::CALL, chat::END_CALL)}), None),
                        },
                    })
                    .collect()
            };
            while let Some(ev) = timed.next().await {
                let (pieces, done) = match ev {
                    TokenEvent::Started { .. } => continue,
                    TokenEvent::Token { text, .. } => (split.push(&text), None),
                    TokenEvent::Done { finish, usage, tail } => {
                        let mut p = split.push(&tail);
                        p.extend(split.finish());
                        (p, Some((finish, usage)))
                    }
                    TokenEvent::Error(e) => {
                        let _ = tx.send(sse_data(&json!({"error": {"message": e, "type": "server_error"}}))).await;
                        return;
                    }
                };
                for v in send_pieces(pieces, &mut n_calls) {
                    if tx.send(sse_data(&v)).await.is_err() {
                        return; // client went away: dropping `timed` cancels the sequence
                    }
                }
                if let Some((finish, usage)) = done {
                    let f = if n_calls > 0 { "tool_calls" } else { finish_str(finish) };
                    let _ = tx.send(sse_data(&chunk(json!({}), Some(f)))).await;
                    end_stream(&tx, include_usage.then(|| chunk(json!({}), None)), usage).await;
                    return;
                }
            }
        }
        .instrument(info_span!("tier.generate")),
    );
    Sse::new(ReceiverStream::new(rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}

// ---------------------------------------------------------------------------
// /v1/completions

async fn completions(State(state): State<AppState>, body: Bytes) -> Response {
    const EP: &str = "/v1/completions";
    let resp = match completions_inner(&state, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    };
    state.count(EP, resp.status());
    resp
}

async fn completions_inner(state: &AppState, body: &[u8]) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let r: CompletionRequest = parse_body(body)?;
    if r.n.unwrap_or(1) != 1 {
        return Err(ApiError::bad_request("only n = 1 is supported", Some("n")));
    }
    let span = info_span!("gateway.completions", gen_ai.request.model = %r.model, gen_ai.operation.name = "text_completion");
    async move {
        let mut tier = state.find_tier(&r.model)?;
        let permit = state.permit()?;
        let prompt = match &r.prompt {
            Value::String(s) => state.tokenize(&mut tier, &r.model, s.clone()).await?,
            Value::Array(a) if a.len() == 1 && a[0].is_string() => state.tokenize(&mut tier, &r.model, a[0].as_str().unwrap_or("").to_owned()).await?,
            Value::Array(a) if !a.is_empty() && a.iter().all(Value::is_i64) => a.iter().filter_map(Value::as_i64).map(|t| t as i32).collect(),
            _ => return Err(ApiError::bad_request("prompt must be a string, a one-element list of strings, or a list of token ids", Some("prompt"))),
        };
        let tier = state.dispatcher.route_prompt(&r.model, &prompt, "", true).unwrap_or(tier);
        let (tier, engine, lease) = state.engine_for(tier, &r.model, RequestRole::Summaries, &state.policy().quantization);
        let max_tokens = budget(state, tier.max_seq_len(), prompt.len(), r.max_tokens)?;
        let req = GenerateRequest {
            prompt,
            max_tokens,
            sampling: sampling(r.temperature, r.top_p, r.top_k, r.seed)?,
            stop: r.stop.clone().map(StopField::into_vec).unwrap_or_default(),
            ignore_eos: r.ignore_eos,
            ..Default::default()
        };
        let job = Job { model: r.model.clone(), req, _permit: Some(permit), engine, _lease: lease, role: RequestRole::Summaries };
        let rx = submit(state, tier, &job).await?;
        let mut timed = Timed { rx, model: job.model.clone(), metrics: state.metrics.clone(), arrived, last: None, queued_ms: 0 };
        if !r.stream {
            let c = collect(timed).await?;
            return Ok(Json(json!({
                "id": new_id("cmpl"), "object": "text_completion", "created": now_s(), "model": job.model,
                "choices": [{"index": 0, "text": c.text, "finish_reason": finish_str(c.finish), "logprobs": null}],
                "usage": c.usage,
                "mesh": MeshInfo { tier: job.model.clone(), queued_ms: c.queued_ms, reasoning_capped: c.reasoning_capped, cascade: vec![], router: None, speculative: c.speculative, engine: job.engine.clone() },
            }))
            .into_response());
        }
        let include_usage = r.stream_options.as_ref().is_some_and(|o| o.include_usage);
        let (tx, rx) = mpsc::channel::<Result<Event, Infallible>>(64);
        let (id, created, model) = (new_id("cmpl"), now_s(), job.model.clone());
        tokio::spawn(async move {
            let _job = job;
            let chunk = |text: &str, finish: Option<&str>| {
                json!({"id": id, "object": "text_completion", "created": created, "model": model,
                       "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": null}]})
            };
            while let Some(ev) = timed.next().await {
                match ev {
                    TokenEvent::Started { .. } => {}
                    TokenEvent::Token { text, .. } => {
                        if tx.send(sse_data(&chunk(&text, None))).await.is_err() {
                            return;
                        }
                    }
                    TokenEvent::Done { finish, usage, tail } => {
                        let _ = tx.send(sse_data(&chunk(&tail, Some(finish_str(finish))))).await;
                        end_stream(&tx, include_usage.then(|| chunk("", None)), usage).await;
                        return;
                    }
                    TokenEvent::Error(e) => {
                        let _ = tx.send(sse_data(&json!({"error": {"message": e, "type": "server_error"}}))).await;
                        return;
                    }
                }
            }
        });
        Ok(Sse::new(ReceiverStream::new(rx)).keep_alive(KeepAlive::default()).into_response())
    }
    .instrument(span)
    .await
}

// ---------------------------------------------------------------------------
// Models, health, metrics

async fn models(State(state): State<AppState>) -> Json<Value> {
    let mut data: Vec<Value> = state
        .registry
        .iter()
        .map(|e| {
            let i = &e.value().desc.info;
            json!({"id": i.name, "object": "model", "created": 0, "owned_by": "mesh",
                   "meta": {"n_params": i.n_params, "n_ctx_train": i.n_ctx_train, "max_seq_len": i.max_seq_len,
                            "n_seq_max": i.n_seq_max, "size_bytes": i.size_bytes}})
        })
        .collect();
    for name in state.dispatcher.tier_names() {
        if !state.registry.contains_key(&name) {
            data.push(json!({"id": name, "object": "model", "created": 0, "owned_by": "mesh", "meta": {"remote": true}}));
        }
    }
    let live = state.policy();
    let c = &live.cascade;
    let hosted: Vec<String> = data
        .iter()
        .filter_map(|m| m["id"].as_str().map(str::to_owned))
        .collect();
    if c.tiers.iter().all(|t| hosted.contains(t)) {
        data.push(
            json!({"id": c.model, "object": "model", "created": 0, "owned_by": "mesh",
                         "meta": {"cascade": c.tiers}}),
        );
    }
    data.sort_by(|a, b| a["id"].as_str().cmp(&b["id"].as_str()));
    Json(json!({"object": "list", "data": data}))
}

/// `GET /v1/cluster`: the members this node knows, for `mesh status`.
async fn cluster(State(state): State<AppState>) -> Json<Value> {
    let members: Vec<Value> = match &state.dispatcher.cluster {
        Some(c) => c.members().into_iter().map(|m| json!({
            "node": m.node, "local": m.local, "quic_addr": m.quic_addr, "http_addr": m.http_addr,
            "state": m.state, "uptime_s": m.uptime_s, "last_seen_ms": m.last_seen_ms,
            "tiers": m.tiers.iter().map(|t| json!({"name": t.name, "active": t.active, "queued": t.queued,
                "n_seq_max": t.n_seq_max, "max_seq_len": t.max_seq_len, "kv_cells": t.kv_cells, "kv_reserved": t.kv_reserved})).collect::<Vec<_>>(),
        })).collect(),
        None => {
            let tiers = crate::remote::tier_adverts(&state.registry);
            vec![json!({"node": "local", "local": true, "state": "alive", "quic_addr": null, "http_addr": null, "uptime_s": null, "last_seen_ms": 0,
                "tiers": tiers.iter().map(|t| json!({"name": t.name, "active": t.active, "queued": t.queued,
                "n_seq_max": t.n_seq_max, "max_seq_len": t.max_seq_len, "kv_cells": t.kv_cells, "kv_reserved": t.kv_reserved})).collect::<Vec<_>>()})]
        }
    };
    Json(
        json!({"clustered": state.dispatcher.cluster.is_some(), "members": members, "placement": state.settings.placement}),
    )
}

async fn ready(State(state): State<AppState>) -> Response {
    let missing: Vec<&String> = state
        .settings
        .expected_tiers
        .iter()
        .filter(|t| !state.registry.contains_key(*t))
        .collect();
    if missing.is_empty() {
        Json(json!({"status": "ready"})).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "starting", "missing_tiers": missing})),
        )
            .into_response()
    }
}

async fn metrics(State(state): State<AppState>) -> Response {
    let engines: Vec<(String, Arc<mesh_tiers::EngineStats>)> = state
        .registry
        .iter()
        .map(|e| (e.key().clone(), e.value().desc.stats.clone()))
        .collect();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(&engines),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(parts: &[&str]) -> Vec<Piece> {
        let mut s = StreamSplitter::default();
        let mut out: Vec<Piece> = parts.iter().flat_map(|p| s.push(p)).collect();
        out.extend(s.finish());
        // merge adjacent pieces of the same kind for stable comparisons
        let mut merged: Vec<Piece> = Vec::new();
        for p in out {
            match (merged.last_mut(), p) {
                (Some(Piece::Content(a)), Piece::Content(b)) => a.push_str(&b),
                (Some(Piece::Reasoning(a)), Piece::Reasoning(b)) => a.push_str(&b),
                (_, p) => merged.push(p),
            }
        }
        merged
    }

    #[test]
    fn splitter_separates_reasoning_calls_and_content() {
        let got = run(&[
            "<thi",
            "nk>a + b",
            "</think><tool_call>{\"name\"",
            ": \"f\"}</tool_call>",
            "done",
        ]);
        assert_eq!(
            got,
            vec![
                Piece::Reasoning("a + b".into()),
                Piece::Call("{\"name\": \"f\"}".into()),
                Piece::Content("done".into())
            ]
        );
    }

    #[test]
    fn splitter_holds_partial_markers_only() {
        let mut s = StreamSplitter::default();
        assert_eq!(s.push("hello <"), vec![Piece::Content("hello ".into())]);
        assert_eq!(s.push("b"), vec![Piece::Content("<b".into())]);
    }

    #[test]
    fn unterminated_call_becomes_content() {
        assert_eq!(
            run(&["<tool_call>{\"na"]),
            vec![Piece::Content("<tool_call>{\"na".into())]
        );
    }

    #[test]
    fn tool_choice_none_hides_tools() {
        let tools = vec![ToolSpec {
            name: "f".into(),
            description: String::new(),
            parameters: json!({"type": "object"}),
        }];
        let (shown, g) = tool_plan(tools.clone(), Some(&json!("none"))).unwrap();
        assert!(shown.is_empty() && g.is_none());
        let (shown, g) = tool_plan(tools.clone(), None).unwrap();
        assert_eq!(shown.len(), 1);
        assert!(g.unwrap().1, "auto uses a lazy grammar");
        let (_, g) = tool_plan(
            tools.clone(),
            Some(&json!({"type": "function", "function": {"name": "f"}})),
        )
        .unwrap();
        assert!(!g.unwrap().1, "a named tool is forced");
        assert!(tool_plan(
            tools,
            Some(&json!({"type": "function", "function": {"name": "zzz"}}))
        )
        .is_err());
    }
}
