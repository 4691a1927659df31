//! The agent layer over HTTP: `POST /v1/agent/tasks` (JSON, or progress as server-sent
//! events `turn`, `tool`, then `done` with the whole task with `stream: true`) and
//! `GET /v1/tools`. The loop itself is `crate::service::agent`.

use std::convert::Infallible;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::error::{parse_body, ApiError};
use super::openai::{to_messages, to_tool_choice, InMessage, OutUsage};
use super::HttpState;
use crate::keys::Principal;
use crate::service::agent::{AgentMessage, TaskEvent, TaskOutcome, TaskSpec};
use crate::service::Role;

/// Body of `POST /v1/agent/tasks`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct TaskRequest {
    /// A tier id or the cascade's model id.
    model: String,
    /// The conversation so far (OpenAI chat messages); or use `input`.
    #[serde(default)]
    messages: Vec<InMessage>,
    /// A single user message.
    #[serde(default)]
    input: Option<String>,
    /// Names of catalog tools the task may use (default: all).
    #[serde(default)]
    tools: Option<Vec<String>>,
    /// `tool_choice` for the first turn (later turns use `auto`).
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    tool_choice: Option<Value>,
    #[serde(default)]
    max_turns: Option<usize>,
    #[serde(default)]
    timeout_s: Option<f64>,
    /// Completion budget of each turn.
    #[serde(default)]
    max_tokens: Option<usize>,
    #[serde(default)]
    reasoning_budget: Option<usize>,
    /// Speculative tool calls for this task (default: `[agent] speculate`).
    #[serde(default)]
    speculate: Option<bool>,
    #[serde(default)]
    stream: bool,
}

/// A conversation message in OpenAI's shape (to continue after `requires_action`).
fn message_json(m: &AgentMessage) -> Value {
    let msg = &m.message;
    match msg.role {
        Role::Assistant => {
            let calls: Vec<Value> = msg
                .tool_calls
                .iter()
                .zip(m.call_ids.iter().map(Some).chain(std::iter::repeat(None)))
                .map(|(c, id)| {
                    json!({"id": id, "type": "function", "function": {
                        "name": c.name, "arguments": c.arguments.to_string()}})
                })
                .collect();
            let content =
                (!msg.content.is_empty() || calls.is_empty()).then(|| msg.content.clone());
            let mut v = json!({"role": "assistant", "content": content});
            if !calls.is_empty() {
                v["tool_calls"] = Value::Array(calls);
            }
            v
        }
        Role::Tool => {
            json!({"role": "tool", "tool_call_id": m.tool_call_id, "content": msg.content})
        }
        r => json!({"role": r, "content": msg.content}),
    }
}

/// The task as the API answers it.
fn task_json(t: &TaskOutcome) -> Value {
    let mut v = json!({"id": t.id, "object": "agent.task", "model": t.model, "status": t.status.as_str(),
    "output": t.output, "turns": t.turns, "usage": OutUsage::from(t.usage)});
    if let Some(e) = &t.error {
        v["error"] = json!(e);
    }
    if let Some(messages) = &t.messages {
        // The client answers these calls with `tool` messages appended to `messages` and
        // sends the task again.
        v["required_action"] = json!({"tool_calls": t.required.iter().map(|(id, name, args)| json!({
            "id": id, "type": "function", "function": {"name": name, "arguments": args.to_string()}})).collect::<Vec<_>>()});
        v["messages"] = Value::Array(messages.iter().map(message_json).collect());
    }
    v
}

fn event_json(e: &TaskEvent) -> (&'static str, Value) {
    match e {
        TaskEvent::Turn {
            turn,
            content,
            calls,
        } => (
            "turn",
            json!({"type": "turn", "turn": turn, "content": content,
                "tool_calls": calls.iter().map(|(n, a)| json!({"name": n, "arguments": a})).collect::<Vec<_>>()}),
        ),
        TaskEvent::Tool { turn, record } => (
            "tool",
            json!({"type": "tool", "turn": turn, "call": record}),
        ),
    }
}

/// `POST /v1/agent/tasks`.
#[utoipa::path(post, path = "/v1/agent/tasks", tag = "agent",
    request_body = TaskRequest,
    responses(
        (status = 200, description = "The finished task (`agent.task`), or with `stream` its progress as server-sent events",
            content((Object = "application/json"), (String = "text/event-stream"))),
        super::openapi::RouteErrors,
    ))]
pub(crate) async fn create_task(
    State(state): State<HttpState>,
    key: Option<Extension<Principal>>,
    body: Bytes,
) -> Response {
    const EP: &str = "/v1/agent/tasks";
    let key = key.map(|Extension(k)| k);
    let resp = match task_inner(&state, key, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    };
    state.count(EP, resp.status());
    resp
}

async fn task_inner(
    state: &HttpState,
    key: Option<Principal>,
    body: &[u8],
) -> Result<Response, ApiError> {
    if state.service.agent().is_none() {
        return Err(ApiError::bad_request(
            "this node has no agent layer configured",
            None,
        ));
    }
    let r: TaskRequest = parse_body(body)?;
    let spec = TaskSpec {
        model: r.model,
        messages: to_messages(&r.messages)?,
        input: r.input,
        tools: r.tools,
        tool_choice: to_tool_choice(r.tool_choice.as_ref())?,
        max_turns: r.max_turns,
        timeout_s: r.timeout_s,
        max_tokens: r.max_tokens,
        reasoning_budget: r.reasoning_budget,
        speculate: r.speculate,
        key,
    };
    if !r.stream {
        let t = state.service.agent_task(spec, None)?.await;
        return Ok(Json(task_json(&t)).into_response());
    }
    // Progress and the final task travel one stream, so `done` comes last.
    let (tx, mut rx) = mpsc::channel::<TaskEvent>(64);
    let run = state.service.agent_task(spec, Some(tx))?;
    let (ev_tx, ev_rx) = mpsc::channel::<Result<Event, Infallible>>(64);
    tokio::spawn(async move {
        let forward = async {
            while let Some(e) = rx.recv().await {
                let (kind, data) = event_json(&e);
                if ev_tx
                    .send(Ok(Event::default().event(kind).data(data.to_string())))
                    .await
                    .is_err()
                {
                    break;
                }
            }
        };
        let (_, t) = tokio::join!(forward, run);
        let _ = ev_tx
            .send(Ok(Event::default()
                .event("done")
                .data(task_json(&t).to_string())))
            .await;
    });
    Ok(Sse::new(ReceiverStream::new(ev_rx))
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// `GET /v1/tools`: MCP servers and their tools.
#[utoipa::path(get, path = "/v1/tools", tag = "agent",
    responses(
        (status = 200, description = "MCP servers, their tools, the client-executed catalog and speculation counts", body = Object),
        super::openapi::KeyErrors,
    ))]
pub(crate) async fn list_tools(State(state): State<HttpState>) -> Response {
    let Some(agent) = state.service.agent() else {
        return Json(json!({"servers": [], "tools": []})).into_response();
    };
    let tools: Vec<Value> = agent
        .hub
        .tools()
        .iter()
        .map(|t| {
            json!({"name": t.name, "server": t.server, "description": t.description,
                "read_only": t.read_only, "parameters": t.parameters})
        })
        .collect();
    let catalog: Vec<Value> = agent
        .catalog
        .iter()
        .map(|t| {
            json!({"name": t.name, "file": t.file, "description": t.description,
                "executor": "client", "parameters": t.parameters})
        })
        .collect();
    Json(
        json!({"servers": agent.hub.servers(), "tools": tools, "catalog": catalog,
        "speculation": agent.runner.counts()}),
    )
    .into_response()
}
