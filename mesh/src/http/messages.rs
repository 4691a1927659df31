//! Anthropic's Messages API over HTTP: `POST /v1/messages` and
//! `POST /v1/messages/count_tokens`. Translates the JSON into the service's typed chat
//! call ([`super::anthropic`]) and the reply back into a message or Anthropic's event
//! stream; errors go out in Anthropic's shape.

use std::convert::Infallible;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::{info_span, Instrument};

use super::anthropic::{message_body, message_id, MessageEvents, MessagesRequest, TokenCount};
use super::error::{parse_body, ApiError, Dialect};
use super::openai::mesh_json;
use super::HttpState;
use crate::service::{Reply, ReplyEvent, SpecInfo};

/// `POST /v1/messages`.
#[utoipa::path(post, path = "/v1/messages", tag = "inference",
    request_body = MessagesRequest,
    responses(
        (status = 200, description = "The message, or with `stream` Anthropic's server-sent events (`message_start` ... `message_stop`)",
            content((super::anthropic::Message = "application/json"), (String = "text/event-stream"))),
        super::openapi::MessagesErrors,
    ))]
pub(crate) async fn messages(State(state): State<HttpState>, body: Bytes) -> Response {
    const EP: &str = "/v1/messages";
    let resp = match messages_inner(&state, &body).await {
        Ok(r) => r,
        Err(e) => e.respond(Dialect::Anthropic),
    };
    state.count(EP, resp.status());
    resp
}

async fn messages_inner(state: &HttpState, body: &[u8]) -> Result<Response, ApiError> {
    let r: MessagesRequest = parse_body(body)?;
    let stream = r.stream;
    let stops = r.stop_sequences.clone();
    let call = r.into_call(true)?;
    let reply = state.service.chat(call).await?;
    if stream {
        return Ok(stream_message(reply, stops));
    }
    let c = reply
        .collect()
        .instrument(info_span!("tier.generate"))
        .await?;
    Ok(Json(message_body(&c, &stops)).into_response())
}

/// `POST /v1/messages/count_tokens`.
#[utoipa::path(post, path = "/v1/messages/count_tokens", tag = "inference",
    request_body = MessagesRequest,
    responses(
        (status = 200, description = "The prompt tokens the request would be answered from", body = TokenCount),
        super::openapi::MessagesErrors,
    ))]
pub(crate) async fn count_tokens(State(state): State<HttpState>, body: Bytes) -> Response {
    const EP: &str = "/v1/messages/count_tokens";
    let resp = match count_inner(&state, &body).await {
        Ok(r) => r,
        Err(e) => e.respond(Dialect::Anthropic),
    };
    state.count(EP, resp.status());
    resp
}

async fn count_inner(state: &HttpState, body: &[u8]) -> Result<Response, ApiError> {
    let r: MessagesRequest = parse_body(body)?;
    let n = state.service.count_tokens(r.into_call(false)?).await?;
    Ok(Json(TokenCount { input_tokens: n }).into_response())
}

fn sse(name: &'static str, data: &Value) -> Result<Event, Infallible> {
    Ok(Event::default().event(name).data(data.to_string()))
}

fn stream_message(mut reply: Reply, stops: Vec<String>) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Event, Infallible>>(64);
    let id = message_id();
    let model = reply.model.clone();
    tokio::spawn(
        async move {
            let (mut events, first) = MessageEvents::start(&id, &model);
            if tx.send(sse(first.0, &first.1)).await.is_err() {
                return;
            }
            let _ = tx.send(sse("ping", &json!({"type": "ping"}))).await;
            while let Some(ev) = reply.next_output().await {
                match ev {
                    ReplyEvent::Started { queued_ms } => reply.mesh.queued_ms = queued_ms,
                    ReplyEvent::Output { deltas, .. } => {
                        for d in deltas {
                            for (name, data) in events.piece(d) {
                                if tx.send(sse(name, &data)).await.is_err() {
                                    return; // client went away: dropping `reply` cancels the sequence
                                }
                            }
                        }
                    }
                    ReplyEvent::Done { finish, usage } => {
                        let mut mesh = reply.mesh.clone();
                        mesh.reasoning_capped = usage.reasoning_capped;
                        mesh.speculative = SpecInfo::of(&usage);
                        for (name, mut data) in events.finish(finish, usage, &stops) {
                            if name == "message_delta" {
                                // mesh's own details ride on the last delta (clients ignore it).
                                data["mesh"] = mesh_json(&mesh);
                            }
                            let _ = tx.send(sse(name, &data)).await;
                        }
                        return;
                    }
                    ReplyEvent::Error(e) => {
                        let _ = tx
                            .send(sse(
                                "error",
                                &json!({"type": "error", "error": {"type": "api_error", "message": e}}),
                            ))
                            .await;
                        return;
                    }
                }
            }
        }
        .instrument(info_span!("tier.generate")),
    );
    Sse::new(ReceiverStream::new(rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}
