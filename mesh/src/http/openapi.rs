//! The gateway's OpenAPI 3.1 document (`GET /openapi.json`), generated from the handlers'
//! `#[utoipa::path]` attributes and the wire types they read and write. Fault injection
//! (`POST /v1/debug/crash`) is left out: it exists only on nodes started for fault tests.

use std::sync::OnceLock;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi};

use super::anthropic::{
    AnthropicErrorBody, AnthropicErrorDetail, AnthropicMessage, AnthropicTool, Message,
    MessageUsage, MessagesRequest, TokenCount,
};
use super::openai::{
    ChatChoice, ChatCompletion, ChatRequest, CompletionDetails, CompletionRequest, ErrorBody,
    ErrorDetail, InFunction, InFunctionCall, InMessage, InTool, InToolCall, OutFunctionCall,
    OutMessage, OutToolCall, OutUsage, PromptDetails, StopField, StreamOptions, TextChoice,
    TextCompletion,
};

/// The document.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "mesh gateway",
        description = "OpenAI- and Anthropic-compatible inference, server-side agent tasks and the live policy of a mesh node. \
            On a node with API keys every /v1 route needs `Authorization: Bearer <key>` (or `x-api-key: <key>`) with the route's scope \
            (inference, agent, control)."
    ),
    paths(
        super::chat::chat_completions,
        super::chat::completions,
        super::messages::messages,
        super::messages::count_tokens,
        super::embeddings::embeddings,
        super::node::models,
        super::node::cluster,
        super::agent::create_task,
        super::agent::list_tools,
        super::control::tune,
        super::control::show_policy,
        super::control::put_policy,
        super::scale::show,
        super::scale::scale,
        super::node::health,
        super::node::ready,
        super::node::metrics,
    ),
    components(schemas(
        ChatRequest, StreamOptions, StopField, InMessage, InToolCall, InFunctionCall, InTool,
        InFunction, CompletionRequest, ChatCompletion, ChatChoice, OutMessage, TextCompletion,
        TextChoice, OutUsage, CompletionDetails, OutToolCall, OutFunctionCall, ErrorBody, ErrorDetail,
        PromptDetails, AnyObject, super::node::ModelList,
        MessagesRequest, AnthropicMessage, AnthropicTool, Message, MessageUsage, TokenCount,
        AnthropicErrorBody, AnthropicErrorDetail, super::node::ModelCard, super::agent::TaskRequest,
        super::embeddings::EmbeddingsRequest, super::embeddings::EmbeddingList,
        super::embeddings::EmbeddingItem, super::embeddings::EmbeddingUsage,
    )),
    modifiers(&BearerKeys),
    tags(
        (name = "inference", description = "Completions, embeddings, models, the cluster view (scope `inference`)"),
        (name = "agent", description = "Agent tasks and the tool list (scope `agent`)"),
        (name = "control", description = "The live policy and the tuner (scope `control`)"),
        (name = "node", description = "Health, readiness and metrics (no key)"),
    )
)]
pub struct ApiDoc;

/// What an inference or agent route may answer besides its success (OpenAI's error shape;
/// `Retry-After` with 429 and 503). A description for the document, never built.
#[allow(dead_code)]
#[derive(utoipa::IntoResponses)]
pub(crate) enum RouteErrors {
    /// Malformed or unsupported request.
    #[response(status = 400)]
    BadRequest(ErrorBody),
    /// No API key, or not one of this node's.
    #[response(status = 401)]
    Unauthenticated(ErrorBody),
    /// The key lacks the route's scope or a tool.
    #[response(status = 403)]
    Forbidden(ErrorBody),
    /// Unknown model.
    #[response(status = 404)]
    NotFound(ErrorBody),
    /// Body over `limits.max_body_bytes`.
    #[response(status = 413)]
    TooLarge(ErrorBody),
    /// Over a rate or concurrency limit; see `Retry-After`.
    #[response(status = 429)]
    RateLimited(ErrorBody),
    /// A fault on this node.
    #[response(status = 500)]
    Internal(ErrorBody),
    /// No node can serve the model now; see `Retry-After`.
    #[response(status = 503)]
    Unavailable(ErrorBody),
}

/// What a Messages API route may answer besides its success (Anthropic's error shape;
/// `Retry-After` with 429 and 503). Never built.
#[allow(dead_code)]
#[derive(utoipa::IntoResponses)]
pub(crate) enum MessagesErrors {
    /// Malformed or unsupported request.
    #[response(status = 400)]
    BadRequest(AnthropicErrorBody),
    /// No API key, or not one of this node's.
    #[response(status = 401)]
    Unauthenticated(AnthropicErrorBody),
    /// The key lacks the inference scope.
    #[response(status = 403)]
    Forbidden(AnthropicErrorBody),
    /// Unknown model.
    #[response(status = 404)]
    NotFound(AnthropicErrorBody),
    /// Body over `limits.max_body_bytes`.
    #[response(status = 413)]
    TooLarge(AnthropicErrorBody),
    /// Over a rate or concurrency limit; see `Retry-After`.
    #[response(status = 429)]
    RateLimited(AnthropicErrorBody),
    /// A fault on this node.
    #[response(status = 500)]
    Internal(AnthropicErrorBody),
    /// No node can serve the model now; see `Retry-After`.
    #[response(status = 503)]
    Unavailable(AnthropicErrorBody),
}

/// What a control route may answer besides its success. Never built.
#[allow(dead_code)]
#[derive(utoipa::IntoResponses)]
pub(crate) enum ControlErrors {
    /// Malformed body or a value out of bounds.
    #[response(status = 400)]
    BadRequest(ErrorBody),
    /// No API key, or not one of this node's.
    #[response(status = 401)]
    Unauthenticated(ErrorBody),
    /// The key lacks the control scope.
    #[response(status = 403)]
    Forbidden(ErrorBody),
    /// The tuner is off, or a cycle is running.
    #[response(status = 409)]
    Conflict(ErrorBody),
    /// Body over `limits.max_body_bytes`.
    #[response(status = 413)]
    TooLarge(ErrorBody),
    /// An engine the policy needs did not start; nothing changed.
    #[response(status = 422)]
    EngineStartFailed(AnyObject),
    /// Over a rate or concurrency limit.
    #[response(status = 429)]
    RateLimited(ErrorBody),
    /// A fault on this node.
    #[response(status = 500)]
    Internal(ErrorBody),
    /// The tuner is restarting or not ready.
    #[response(status = 503)]
    Unavailable(ErrorBody),
}

/// Any JSON object (the gate's verdict, or an error body).
pub(crate) struct AnyObject;

impl utoipa::PartialSchema for AnyObject {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::schema::Object::new().into()
    }
}

impl utoipa::ToSchema for AnyObject {
    fn name() -> std::borrow::Cow<'static, str> {
        "AnyObject".into()
    }
}

/// What a read-only `/v1` route may answer besides its success. Never built.
#[allow(dead_code)]
#[derive(utoipa::IntoResponses)]
pub(crate) enum KeyErrors {
    /// No API key, or not one of this node's.
    #[response(status = 401)]
    Unauthenticated(ErrorBody),
    /// The key lacks the route's scope.
    #[response(status = 403)]
    Forbidden(ErrorBody),
    /// Over a rate or concurrency limit.
    #[response(status = 429)]
    RateLimited(ErrorBody),
}

/// The bearer-key security scheme.
struct BearerKeys;

impl Modify for BearerKeys {
    fn modify(&self, api: &mut utoipa::openapi::OpenApi) {
        let components = api.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "api_key",
            SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)),
        );
    }
}

/// The document as JSON (made once).
pub fn document() -> &'static str {
    static DOC: OnceLock<String> = OnceLock::new();
    DOC.get_or_init(|| {
        ApiDoc::openapi()
            .to_pretty_json()
            .expect("the document serializes")
    })
}

/// `GET /openapi.json`.
pub(crate) async fn serve_document() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], document()).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_routed_path_but_fault_injection_is_documented() {
        let doc: serde_json::Value = serde_json::from_str(document()).unwrap();
        for path in [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/messages",
            "/v1/messages/count_tokens",
            "/v1/models",
            "/v1/cluster",
            "/v1/agent/tasks",
            "/v1/tools",
            "/v1/control/tune",
            "/v1/control/policy",
            "/health",
            "/ready",
            "/metrics",
        ] {
            assert!(doc["paths"][path].is_object(), "{path} is not documented");
        }
    }
}
