//! Server-side agent loop over the node's MCP tools: `POST /v1/agent/tasks`.
//!
//! A task is a conversation and a set of tools from the node's MCP servers. The loop
//! runs model → tools → model turns through the same path as `/v1/chat/completions`
//! (tool routing, cascade, grammar, metrics), executes the model's tool calls on the
//! MCP servers and feeds the results back, until the model answers without a tool
//! call, `max_turns` turns have run, or `timeout_s` has passed. With `stream: true`
//! progress arrives as server-sent events (`turn`, `tool`, then `done` with the whole
//! task).
//!
//! Speculative tool calls: when the task's model is not the draft model
//! (`[agent] draft_model`, default the cascade's first tier), the draft model
//! generates the same turn alongside; its first tool call, if the tool is read-only,
//! starts on the server before the task's model has finished
//! ([`mesh_control::spec_tools`]). Results of read-only calls are cached for
//! `cache_ttl_s`; calls of tools with side effects never run early and clear their
//! server's cached results.
//!
//! `GET /v1/tools` lists the MCP servers and their tools.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use mesh_control::mcp::McpHub;
use mesh_control::spec_tools::{CallKey, Speculation, ToolRunner};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::{info_span, Instrument};

use crate::config::AgentSettings;
use crate::gateway::{ApiError, AppState};
use crate::metrics::StatusLabel;

/// A tool from a catalog file: offered to the model, executed by the client.
#[derive(Debug, Clone, PartialEq)]
pub struct CatalogTool {
    /// Name.
    pub name: String,
    /// Description shown to the model.
    pub description: String,
    /// JSON schema of the arguments.
    pub parameters: Value,
    /// The file it came from.
    pub file: String,
}

/// Reads catalog files: JSON arrays or JSON lines of tool definitions, either OpenAI's
/// `{"type": "function", "function": {...}}` or `{"name", "description", "parameters"}`.
pub fn load_catalog_files(paths: &[std::path::PathBuf]) -> Result<Vec<CatalogTool>, String> {
    let mut out: Vec<CatalogTool> = vec![];
    for p in paths {
        let file = p.display().to_string();
        let text =
            std::fs::read_to_string(p).map_err(|e| format!("agent.catalog_files: {file}: {e}"))?;
        let entries: Vec<Value> = match serde_json::from_str::<Value>(&text) {
            Ok(Value::Array(a)) => a,
            _ => text
                .lines()
                .enumerate()
                .filter(|(_, l)| !l.trim().is_empty())
                .map(|(i, l)| {
                    serde_json::from_str(l)
                        .map_err(|e| format!("agent.catalog_files: {file}:{}: {e}", i + 1))
                })
                .collect::<Result<_, _>>()?,
        };
        for (i, e) in entries.iter().enumerate() {
            let f = e.get("function").unwrap_or(e);
            let name = f["name"]
                .as_str()
                .filter(|n| !n.is_empty())
                .ok_or_else(|| {
                    format!("agent.catalog_files: {file}: entry {} has no `name`", i + 1)
                })?;
            if out.iter().any(|t| t.name == name) {
                return Err(format!(
                    "agent.catalog_files: tool `{name}` is defined twice"
                ));
            }
            out.push(CatalogTool {
                name: name.to_owned(),
                description: f["description"].as_str().unwrap_or_default().to_owned(),
                parameters: f
                    .get("parameters")
                    .cloned()
                    .unwrap_or_else(|| json!({"type": "object", "properties": {}})),
                file: file.clone(),
            });
        }
    }
    Ok(out)
}

/// The agent layer of a node: its MCP servers, catalog-file tools and the tool runner.
#[derive(Debug)]
pub struct Agent {
    /// MCP servers and their tool catalog.
    pub hub: Arc<McpHub>,
    /// Tools from `[agent] catalog_files`: the model may call them, the client runs them
    /// (the task stops with `requires_action`).
    pub catalog: Vec<CatalogTool>,
    /// Executes tool calls (speculation, read-only cache).
    pub runner: Arc<ToolRunner>,
    /// `[agent]` settings.
    pub settings: AgentSettings,
}

impl Agent {
    /// The agent layer over a connected hub.
    pub fn new(hub: McpHub, settings: AgentSettings) -> Self {
        let hub = Arc::new(hub);
        let runner = Arc::new(ToolRunner::new(
            hub.clone(),
            Duration::from_secs_f64(settings.cache_ttl_s.max(0.0)),
        ));
        Self {
            hub,
            catalog: vec![],
            runner,
            settings,
        }
    }

    /// Adds the client-executed tools of catalog files.
    pub fn with_catalog(mut self, catalog: Vec<CatalogTool>) -> Self {
        self.catalog = catalog;
        self
    }
}

/// Body of `POST /v1/agent/tasks`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TaskRequest {
    /// A tier id or the cascade's model id.
    model: String,
    /// The conversation so far (OpenAI chat messages); or use `input`.
    #[serde(default)]
    messages: Vec<Value>,
    /// A single user message.
    #[serde(default)]
    input: Option<String>,
    /// Names of catalog tools the task may use (default: all).
    #[serde(default)]
    tools: Option<Vec<String>>,
    /// `tool_choice` for the first turn (later turns use `auto`).
    #[serde(default)]
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

/// A validated task.
struct Task {
    model: String,
    messages: Vec<Value>,
    tools: Vec<Value>,
    first_choice: Option<Value>,
    max_turns: usize,
    deadline: Instant,
    max_tokens: usize,
    reasoning_budget: Option<usize>,
    draft: Option<String>,
    /// Tools the client runs (from catalog files).
    client_tools: std::collections::HashSet<String>,
}

fn bad(msg: impl Into<String>, param: &str) -> ApiError {
    ApiError::bad_request(msg, Some(param))
}

impl TaskRequest {
    fn validate(self, agent: &Agent) -> Result<(Task, bool), ApiError> {
        let s = &agent.settings;
        let mut messages = self.messages;
        if let Some(input) = self.input {
            messages.push(json!({"role": "user", "content": input}));
        }
        if messages.is_empty() {
            return Err(bad("give `input` or a non-empty `messages`", "messages"));
        }
        if agent.hub.tools().is_empty() && agent.catalog.is_empty() {
            return Err(bad(
                "this node has no tools: register MCP servers under [[mcp.servers]] or [agent] catalog_files (see GET /v1/tools)",
                "tools",
            ));
        }
        let names: Vec<String> = match self.tools {
            None => agent
                .hub
                .tools()
                .iter()
                .map(|t| t.name.clone())
                .chain(agent.catalog.iter().map(|t| t.name.clone()))
                .collect(),
            Some(v) if v.is_empty() => return Err(bad("`tools` must not be empty", "tools")),
            Some(v) => v,
        };
        let mut tools = Vec::with_capacity(names.len());
        let mut client_tools = std::collections::HashSet::new();
        for n in &names {
            let (name, description, parameters) = if let Some(t) = agent.hub.tool(n) {
                (&t.name, &t.description, &t.parameters)
            } else if let Some(t) = agent.catalog.iter().find(|t| &t.name == n) {
                client_tools.insert(t.name.clone());
                (&t.name, &t.description, &t.parameters)
            } else {
                let known: Vec<&str> = agent
                    .hub
                    .tools()
                    .iter()
                    .map(|t| t.name.as_str())
                    .chain(agent.catalog.iter().map(|t| t.name.as_str()))
                    .collect();
                return Err(bad(
                    format!(
                        "unknown tool `{n}`; this node's tools are: {}",
                        known.join(", ")
                    ),
                    "tools",
                ));
            };
            tools.push(json!({"type": "function", "function": {
                "name": name, "description": description, "parameters": parameters}}));
        }
        let max_turns = self.max_turns.unwrap_or(s.max_turns);
        if max_turns == 0 || max_turns > s.max_turns_limit {
            return Err(bad(
                format!("max_turns must be between 1 and {}", s.max_turns_limit),
                "max_turns",
            ));
        }
        let timeout = self.timeout_s.unwrap_or(s.timeout_s);
        if !(timeout > 0.0 && timeout <= s.timeout_limit_s) {
            return Err(bad(
                format!("timeout_s must be in (0, {}]", s.timeout_limit_s),
                "timeout_s",
            ));
        }
        let speculate = self.speculate.unwrap_or(s.speculate);
        let draft = s
            .draft_model
            .clone()
            .filter(|d| speculate && *d != self.model);
        Ok((
            Task {
                model: self.model,
                messages,
                tools,
                first_choice: self.tool_choice,
                max_turns,
                deadline: Instant::now() + Duration::from_secs_f64(timeout),
                max_tokens: self.max_tokens.unwrap_or(s.max_tokens),
                client_tools,
                reasoning_budget: self.reasoning_budget,
                draft,
            },
            self.stream,
        ))
    }
}

/// How a task ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Completed,
    MaxTurns,
    TimedOut,
    Failed,
    /// The model called a client-executed tool: the client runs it and continues.
    RequiresAction,
}

impl Status {
    fn as_str(self) -> &'static str {
        match self {
            Status::Completed => "completed",
            Status::MaxTurns => "max_turns",
            Status::TimedOut => "timed_out",
            Status::Failed => "failed",
            Status::RequiresAction => "requires_action",
        }
    }
}

/// One chat turn through the gateway's own path; the parsed completion.
async fn chat_turn(state: &AppState, body: &Value) -> Result<Value, ApiError> {
    let bytes = serde_json::to_vec(body).expect("serializable");
    let resp = crate::gateway::chat_response(state, &bytes).await?;
    let status = resp.status();
    let raw = axum::body::to_bytes(resp.into_body(), 64 << 20)
        .await
        .map_err(|e| ApiError::internal(format!("reading a turn's response: {e}")))?;
    let v: Value = serde_json::from_slice(&raw)
        .map_err(|e| ApiError::internal(format!("a turn's response is not JSON: {e}")))?;
    if !status.is_success() {
        return Err(ApiError::internal(format!("turn failed ({status}): {v}")));
    }
    Ok(v)
}

/// `(name, arguments)` of each tool call in a chat completion, with the call ids.
fn tool_calls(completion: &Value) -> Vec<(String, String, Value)> {
    completion
        .pointer("/choices/0/message/tool_calls")
        .and_then(Value::as_array)
        .map(|calls| {
            calls
                .iter()
                .filter_map(|c| {
                    let name = c.pointer("/function/name")?.as_str()?.to_owned();
                    let raw = c.pointer("/function/arguments")?.as_str()?;
                    let args = serde_json::from_str(raw).unwrap_or(Value::Null);
                    let id = c
                        .get("id")
                        .and_then(Value::as_str)
                        .unwrap_or("call")
                        .to_owned();
                    Some((id, name, args))
                })
                .collect()
        })
        .unwrap_or_default()
}

fn add_usage(total: &mut Value, usage: Option<&Value>) {
    let Some(u) = usage else { return };
    for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        let v = total[k].as_u64().unwrap_or(0) + u[k].as_u64().unwrap_or(0);
        total[k] = json!(v);
    }
}

/// Runs the loop; `events` (streaming) gets a value per turn and per tool call.
async fn run_task(
    state: AppState,
    agent: Arc<Agent>,
    mut t: Task,
    events: Option<mpsc::Sender<Value>>,
) -> Value {
    let id = format!("task-{}", uuid::Uuid::new_v4().simple());
    let emit = |v: Value| {
        let events = events.clone();
        async move {
            if let Some(tx) = events {
                let _ = tx.send(v).await;
            }
        }
    };
    let mut turns: Vec<Value> = vec![];
    let mut usage = json!({"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0});
    let mut output = String::new();
    let mut error: Option<String> = None;
    let mut required: Option<Value> = None;
    let mut status = Status::MaxTurns;
    for turn in 1..=t.max_turns {
        let remaining = t.deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            status = Status::TimedOut;
            break;
        }
        let mut body = json!({"model": t.model, "messages": t.messages, "tools": t.tools,
            "max_tokens": t.max_tokens});
        let choice = if turn == 1 {
            t.first_choice.take()
        } else {
            None
        };
        if let Some(c) = choice {
            body["tool_choice"] = c;
        }
        if let Some(b) = t.reasoning_budget {
            body["reasoning_budget"] = json!(b);
        }
        // The draft model predicts the turn's tool call; read-only predictions start now.
        let speculated: Arc<Mutex<Vec<CallKey>>> = Arc::default();
        let draft_task = t.draft.as_ref().map(|draft| {
            let mut d = body.clone();
            d["model"] = json!(draft);
            d["max_tokens"] = json!(agent.settings.draft_max_tokens.min(t.max_tokens));
            let (state, agent, speculated) = (state.clone(), agent.clone(), speculated.clone());
            tokio::spawn(
                async move {
                    let Ok(v) = chat_turn(&state, &d).await else {
                        return;
                    };
                    for (_, name, args) in tool_calls(&v).into_iter().take(1) {
                        let (what, key) = agent.runner.speculate(&name, &args);
                        if what == Speculation::Started {
                            speculated.lock().expect("not poisoned").push(key);
                        }
                    }
                }
                .instrument(info_span!("agent.speculate")),
            )
        });
        let started = Instant::now();
        let res = tokio::time::timeout(remaining, chat_turn(&state, &body))
            .instrument(info_span!("agent.turn", turn))
            .await;
        if let Some(d) = &draft_task {
            d.abort();
        }
        let completion = match res {
            Err(_) => {
                status = Status::TimedOut;
                break;
            }
            Ok(Err(e)) => {
                status = Status::Failed;
                error = Some(e.message().to_owned());
                break;
            }
            Ok(Ok(v)) => v,
        };
        add_usage(&mut usage, completion.get("usage"));
        let content = completion
            .pointer("/choices/0/message/content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let calls = tool_calls(&completion);
        let mut record = json!({"turn": turn, "model": completion["model"], "content": content,
            "ms": started.elapsed().as_millis() as u64, "tool_calls": []});
        if let Some(c) = completion.pointer("/mesh/cascade") {
            record["cascade"] = c.clone();
        }
        emit(json!({"type": "turn", "turn": turn, "content": content,
            "tool_calls": calls.iter().map(|(_, n, a)| json!({"name": n, "arguments": a})).collect::<Vec<_>>()}))
        .await;
        if calls.is_empty() {
            output = content;
            status = Status::Completed;
            turns.push(record);
            break;
        }
        t.messages.push(completion["choices"][0]["message"].clone());
        let (pending, calls): (Vec<_>, Vec<_>) = calls
            .into_iter()
            .partition(|(_, name, _)| t.client_tools.contains(name));
        let mut executed = vec![];
        for (call_id, name, args) in calls {
            let remaining = t.deadline.saturating_duration_since(Instant::now());
            let res = tokio::time::timeout(remaining, agent.runner.execute(&name, &args))
                .instrument(info_span!("agent.tool", tool = %name))
                .await;
            let mut rec = json!({"id": call_id, "name": name, "arguments": args});
            let text = match res {
                Err(_) => {
                    rec["error"] = json!("the task's time ran out during this call");
                    status = Status::TimedOut;
                    executed.push(rec);
                    break;
                }
                Ok(Ok(e)) => {
                    rec["result"] = json!(e.output.text);
                    rec["is_error"] = json!(e.output.is_error);
                    rec["source"] = serde_json::to_value(e.source).expect("serializable");
                    rec["ms"] = json!(e.output.ms);
                    rec["saved_ms"] = json!(e.saved_ms);
                    e.output.text
                }
                Ok(Err(e)) => {
                    rec["error"] = json!(e.to_string());
                    rec["is_error"] = json!(true);
                    format!("error: {e}")
                }
            };
            emit(json!({"type": "tool", "turn": turn, "call": rec})).await;
            executed.push(rec);
            let shown: String = text.chars().take(agent.settings.max_result_chars).collect();
            t.messages
                .push(json!({"role": "tool", "tool_call_id": call_id, "content": shown}));
        }
        let keys = std::mem::take(&mut *speculated.lock().expect("not poisoned"));
        agent.runner.cancel(&keys);
        record["tool_calls"] = Value::Array(executed);
        output = content;
        turns.push(record);
        if status == Status::TimedOut {
            break;
        }
        if !pending.is_empty() {
            status = Status::RequiresAction;
            required = Some(
                json!({"tool_calls": pending.iter().map(|(id, name, args)| json!({
                "id": id, "type": "function", "function": {"name": name, "arguments": args.to_string()}})).collect::<Vec<_>>()}),
            );
            break;
        }
    }
    state
        .metrics()
        .agent_tasks
        .get_or_create(&StatusLabel {
            status: status.as_str().into(),
        })
        .inc();
    let mut v = json!({"id": id, "object": "agent.task", "model": t.model, "status": status.as_str(),
        "output": output, "turns": turns, "usage": usage});
    if let Some(e) = error {
        v["error"] = json!(e);
    }
    if let Some(r) = required {
        // The client answers these calls with `tool` messages appended to `messages` and
        // sends the task again.
        v["required_action"] = r;
        v["messages"] = Value::Array(t.messages);
    }
    v
}

/// `POST /v1/agent/tasks`.
pub(crate) async fn create_task(State(state): State<AppState>, body: Bytes) -> Response {
    const EP: &str = "/v1/agent/tasks";
    let resp = match task_inner(&state, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    };
    state.count(EP, resp.status());
    resp
}

async fn task_inner(state: &AppState, body: &[u8]) -> Result<Response, ApiError> {
    let agent = state
        .agent()
        .ok_or_else(|| ApiError::bad_request("this node has no agent layer configured", None))?;
    let req: TaskRequest = crate::gateway::parse_body(body)?;
    let (task, stream) = req.validate(&agent)?;
    // Unknown models fail here with the gateway's own 404, before any turn runs.
    if task.model != state.cascade_model() {
        state.find_model(&task.model)?;
    }
    let span =
        info_span!("agent.task", gen_ai.request.model = %task.model, tools = task.tools.len());
    if !stream {
        let v = run_task(state.clone(), agent, task, None)
            .instrument(span)
            .await;
        return Ok(Json(v).into_response());
    }
    // Progress and the final task travel one channel, so `done` comes last.
    let (tx, mut rx) = mpsc::channel::<Value>(64);
    let (ev_tx, ev_rx) = mpsc::channel::<Result<Event, Infallible>>(64);
    let state = state.clone();
    tokio::spawn(
        async move {
            let forward = async {
                while let Some(v) = rx.recv().await {
                    let (kind, data) = match v["type"].as_str() {
                        Some("done") => ("done".to_owned(), v["task"].clone()),
                        Some(k) => (k.to_owned(), v),
                        None => ("event".to_owned(), v),
                    };
                    let ev = Event::default().event(kind).data(data.to_string());
                    if ev_tx.send(Ok(ev)).await.is_err() {
                        break;
                    }
                }
            };
            let run = async move {
                let v = run_task(state, agent, task, Some(tx.clone())).await;
                let _ = tx.send(json!({"type": "done", "task": v})).await;
            };
            tokio::join!(forward, run);
        }
        .instrument(span),
    );
    Ok(Sse::new(ReceiverStream::new(ev_rx))
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// `GET /v1/tools`: MCP servers and their tools.
pub(crate) async fn list_tools(State(state): State<AppState>) -> Response {
    let Some(agent) = state.agent() else {
        return (StatusCode::OK, Json(json!({"servers": [], "tools": []}))).into_response();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_calls_are_read_from_a_completion() {
        let c = json!({"choices": [{"message": {"content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "read_text_file", "arguments": "{\"path\": \"/a\"}"}},
            {"id": "call_2", "type": "function", "function": {"name": "list_directory", "arguments": "not json"}}
        ]}}]});
        let calls = tool_calls(&c);
        assert_eq!(calls.len(), 2);
        assert_eq!(
            calls[0],
            (
                "call_1".into(),
                "read_text_file".into(),
                json!({"path": "/a"})
            )
        );
        assert_eq!(calls[1].2, Value::Null);
        assert!(tool_calls(&json!({"choices": [{"message": {"content": "hi"}}]})).is_empty());
    }

    #[test]
    fn usage_adds_up() {
        let mut total = json!({"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0});
        add_usage(
            &mut total,
            Some(&json!({"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12})),
        );
        add_usage(
            &mut total,
            Some(&json!({"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6})),
        );
        assert_eq!(
            total,
            json!({"prompt_tokens": 15, "completion_tokens": 3, "total_tokens": 18})
        );
    }
}
