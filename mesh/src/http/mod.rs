//! The HTTP layer: axum handlers, OpenAI's wire types and SSE, and one error type with its
//! code table. It translates and nothing more: every handler turns a request into a call
//! on the service layer (`crate::service`), and the answer back into JSON.
//!
//! Routes: `POST /v1/chat/completions`, `POST /v1/completions` ([`chat`]); `POST /v1/embeddings` ([`embeddings`]);
//! `POST /v1/messages`, `POST /v1/messages/count_tokens` (Anthropic's API, [`messages`]);
//! `POST /v1/agent/tasks`, `GET /v1/tools` ([`agent`]); `POST /v1/control/tune`,
//! `GET`/`PUT /v1/control/policy` ([`control`]); `GET`/`POST /v1/control/scale` ([`scale`]); `GET /v1/models`, `GET /v1/cluster`,
//! `GET /health`, `GET /ready`, `GET /metrics`, and `POST /v1/debug/crash` on a node started
//! with fault injection ([`node`]); `GET /openapi.json`, the document of all of them but
//! fault injection and the console ([`openapi`]); the web console at `/` and its files under
//! `/console/` (`console`).
//!
//! A node with API keys asks every `/v1` route but fault injection for one
//! (`Authorization: Bearer`), with the scope the route needs ([`crate::keys`]); then the
//! client's limits apply (`[limits]`, [`crate::limits`]). The accept loop ([`serve`]) caps
//! open connections and closes those that do not send their headers in time.

pub mod agent;
pub mod anthropic;
mod auth;
pub mod chat;
mod console;
pub mod control;
pub mod embeddings;
pub mod error;
mod limits;
pub mod messages;
pub mod node;
pub mod openai;
pub mod openapi;
pub mod scale;
pub mod serve;

use std::sync::Arc;

use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::Router;
use futures::future::BoxFuture;

use crate::service::Service;

/// Injects faults into a node's actors (the node implements it; see `crate::node`).
pub trait FaultInjector: Send + Sync + 'static {
    /// Names that [`inject`](Self::inject) takes.
    fn targets(&self) -> Vec<String>;
    /// Crashes the actor named `target`; `Err` says why not.
    fn inject(&self, target: &str) -> BoxFuture<'static, Result<(), String>>;
}

/// Fault injection as the HTTP layer sees it: the injector and the token a request must
/// carry (`x-mesh-fault-token`).
#[derive(Clone)]
pub struct Faults {
    /// The token.
    pub token: String,
    /// The injector.
    pub injector: Arc<dyn FaultInjector>,
}

/// What the handlers share.
#[derive(Clone)]
pub struct HttpState {
    /// The service layer.
    pub service: Service,
    /// Tier names this node starts with (for `/ready`; standby tiers are not waited for).
    pub expected_tiers: Vec<String>,
    /// Fault injection, when the node was started with it.
    pub faults: Option<Faults>,
    /// API keys; `None`: no key is asked for.
    pub keys: Option<Arc<crate::keys::Keys>>,
    /// Per-client limits and the node's `[limits]`.
    pub limiter: Arc<crate::limits::Limiter>,
}

impl HttpState {
    /// Counts a finished request.
    pub(crate) fn count(&self, endpoint: &str, status: StatusCode) {
        self.service.metrics().count(endpoint, status.as_u16());
    }
}

/// The router with every route.
pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(chat::completions))
        .route("/v1/embeddings", post(embeddings::embeddings))
        .route("/v1/messages", post(messages::messages))
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route("/v1/agent/tasks", post(agent::create_task))
        .route("/v1/tools", get(agent::list_tools))
        .route("/v1/control/tune", post(control::tune))
        .route("/v1/control/scale", get(scale::show).post(scale::scale))
        .route(
            "/v1/control/policy",
            get(control::show_policy).put(control::put_policy),
        )
        .route("/v1/models", get(node::models))
        .route("/v1/cluster", get(node::cluster))
        .route("/v1/debug/crash", post(node::crash))
        .route("/health", get(node::health))
        .route("/openapi.json", get(openapi::serve_document))
        .route("/ready", get(node::ready))
        .route("/metrics", get(node::metrics))
        .route("/", get(console::index))
        .route("/console/console.js", get(console::script))
        .route("/console/console.css", get(console::style))
        // Outermost first: the key, then its limits.
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            limits::enforce,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_key,
        ))
        .layer(axum::extract::DefaultBodyLimit::max(
            state.limiter.settings().max_body_bytes,
        ))
        .with_state(state)
}
