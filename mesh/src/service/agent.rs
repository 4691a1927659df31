//! The server-side agent loop over the node's MCP tools (`POST /v1/agent/tasks`).
//!
//! A task is a conversation and a set of tools from the node's MCP servers (and catalog
//! files, whose tools the client runs). The loop runs model → tools → model turns through
//! [`Service::chat`] (tool routing, cascade, grammar, metrics), executes the model's tool
//! calls on the MCP servers and feeds the results back, until the model answers without a
//! tool call, `max_turns` turns have run, or the task's time is up. Progress can be
//! followed turn by turn ([`TaskEvent`]).
//!
//! Speculative tool calls: when the task's model is not the draft model (`[agent]
//! draft_model`, default the cascade's first tier), the draft model generates the same
//! turn alongside; its first tool call, if the tool is read-only, starts on the server
//! before the task's model has finished ([`mesh_control::spec_tools`]). Results of
//! read-only calls are cached for `cache_ttl_s`; calls of tools with side effects never
//! run early and clear their server's cached results.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mesh_control::mcp::McpHub;
use mesh_control::spec_tools::{CallKey, Speculation, ToolRunner};
use mesh_tiers::chat::{ChatMessage, Role, ToolCall, ToolSpec};
use mesh_tiers::Usage;
use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tracing::{info_span, Instrument};

use super::{CascadeStep, ChatCall, Error, Kind, Service, ToolChoice};
use crate::config::AgentSettings;
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

/// One message of a task's conversation, with the call ids clients match tool results by.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentMessage {
    /// The message.
    pub message: ChatMessage,
    /// Ids of `message.tool_calls`, in order.
    pub call_ids: Vec<String>,
    /// For a tool message: the call it answers.
    pub tool_call_id: Option<String>,
}

impl AgentMessage {
    /// A message without ids.
    pub fn plain(message: ChatMessage) -> Self {
        Self {
            message,
            call_ids: vec![],
            tool_call_id: None,
        }
    }
}

/// What a caller asks of a task.
#[derive(Debug, Clone, Default)]
pub struct TaskSpec {
    /// A tier id or the cascade's model id.
    pub model: String,
    /// The conversation so far.
    pub messages: Vec<AgentMessage>,
    /// A single user message appended to `messages`.
    pub input: Option<String>,
    /// Names of the tools the task may use (default: all).
    pub tools: Option<Vec<String>>,
    /// `tool_choice` of the first turn (later turns: auto).
    pub tool_choice: ToolChoice,
    /// Most model turns.
    pub max_turns: Option<usize>,
    /// Time limit in seconds.
    pub timeout_s: Option<f64>,
    /// Completion budget of each turn.
    pub max_tokens: Option<usize>,
    /// Thinking budget of each turn.
    pub reasoning_budget: Option<usize>,
    /// Speculative tool calls for this task (default: `[agent] speculate`).
    pub speculate: Option<bool>,
    /// The API key the task came with, on a node with keys: only tools it may run are
    /// offered (see [`crate::keys::Principal::may_run`]).
    pub key: Option<crate::keys::Principal>,
}

/// A validated task.
struct Task {
    model: String,
    messages: Vec<AgentMessage>,
    tools: Vec<ToolSpec>,
    first_choice: ToolChoice,
    max_turns: usize,
    deadline: Instant,
    max_tokens: usize,
    reasoning_budget: Option<usize>,
    draft: Option<String>,
    /// Tools the client runs (from catalog files).
    client_tools: HashSet<String>,
}

/// How a task ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// The model answered without a tool call.
    Completed,
    /// `max_turns` turns ran.
    MaxTurns,
    /// The task's time ran out.
    TimedOut,
    /// A turn failed.
    Failed,
    /// The model called a client-executed tool: the client runs it and continues.
    RequiresAction,
}

impl Status {
    /// As the API writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Completed => "completed",
            Status::MaxTurns => "max_turns",
            Status::TimedOut => "timed_out",
            Status::Failed => "failed",
            Status::RequiresAction => "requires_action",
        }
    }
}

/// One tool call the loop executed.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ToolRecord {
    /// Call id.
    pub id: String,
    /// Tool.
    pub name: String,
    /// Arguments.
    pub arguments: Value,
    /// The tool's output text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    /// The tool reported an error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub is_error: Option<bool>,
    /// Where the result came from (`fresh`, `speculative`, `cache`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source: Option<Value>,
    /// Milliseconds the tool ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ms: Option<u64>,
    /// Milliseconds speculation or the cache saved.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub saved_ms: Option<u64>,
    /// Why the call failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One model turn of a task.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TurnRecord {
    /// 1-based.
    pub turn: usize,
    /// The model the turn named.
    pub model: String,
    /// The turn's text.
    pub content: String,
    /// Milliseconds the model took.
    pub ms: u64,
    /// Calls executed after the turn.
    pub tool_calls: Vec<ToolRecord>,
    /// The cascade's steps, for a cascade turn.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cascade: Option<Vec<CascadeStep>>,
    /// The tools the turn's prompt showed, in the prompt's order, when the router chose them
    /// for this step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tools_shown: Option<Vec<String>>,
}

/// A finished task.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskOutcome {
    /// Task id.
    pub id: String,
    /// The model it ran on.
    pub model: String,
    /// How it ended.
    pub status: Status,
    /// The last turn's text.
    pub output: String,
    /// Every turn.
    pub turns: Vec<TurnRecord>,
    /// Tokens of every turn.
    pub usage: Usage,
    /// Why it failed.
    pub error: Option<String>,
    /// Calls the client must run (`requires_action`): `(id, name, arguments)`.
    pub required: Vec<(String, String, Value)>,
    /// The conversation so far, to continue after `requires_action`.
    pub messages: Option<Vec<AgentMessage>>,
}

/// Progress of a streamed task.
#[derive(Debug, Clone)]
pub enum TaskEvent {
    /// A model turn ended: its text and calls.
    Turn {
        /// 1-based turn.
        turn: usize,
        /// Text.
        content: String,
        /// Calls `(name, arguments)`.
        calls: Vec<(String, Value)>,
    },
    /// A tool call ended.
    Tool {
        /// Turn.
        turn: usize,
        /// The call.
        record: ToolRecord,
    },
}

fn bad(msg: impl Into<String>, param: &str) -> Error {
    Error::invalid(msg, Some(param))
}

fn call_id() -> String {
    format!("call_{}", &uuid::Uuid::new_v4().simple().to_string()[..24])
}

impl TaskSpec {
    fn validate(self, agent: &Agent) -> Result<Task, Error> {
        let s = &agent.settings;
        let mut messages = self.messages;
        if let Some(input) = self.input {
            messages.push(AgentMessage::plain(ChatMessage::text(Role::User, input)));
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
        // Tools the node runs (MCP) may have side effects; catalog tools are run by the
        // client, so a key may always offer them.
        let read_only = |n: &str| agent.hub.tool(n).is_none_or(|t| t.read_only);
        let may_run = |n: &str| match (agent.hub.tool(n), &self.key) {
            (Some(t), Some(k)) => k.may_run(n, t.read_only),
            _ => true,
        };
        let names: Vec<String> = match self.tools {
            None => {
                let all: Vec<String> = agent
                    .hub
                    .tools()
                    .iter()
                    .map(|t| t.name.clone())
                    .chain(agent.catalog.iter().map(|t| t.name.clone()))
                    .collect();
                let allowed: Vec<String> = all.into_iter().filter(|n| may_run(n)).collect();
                if allowed.is_empty() {
                    return Err(Error::new(
                        Kind::PermissionDenied,
                        "this API key may run none of this node's tools (a tool with side effects needs `mesh keys create --tools NAME`)",
                    )
                    .with_param("tools"));
                }
                allowed
            }
            Some(v) if v.is_empty() => return Err(bad("`tools` must not be empty", "tools")),
            Some(v) => {
                if let Some(n) = v.iter().find(|n| !may_run(n)) {
                    let why = if read_only(n) {
                        "it is not in the key's tool list"
                    } else {
                        "it has side effects and is not in the key's tool list"
                    };
                    return Err(Error::new(
                        Kind::PermissionDenied,
                        format!("this API key may not run tool `{n}`: {why}"),
                    )
                    .with_param("tools"));
                }
                v
            }
        };
        let mut tools = Vec::with_capacity(names.len());
        let mut client_tools = HashSet::new();
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
            tools.push(ToolSpec {
                name: name.clone(),
                description: description.clone(),
                parameters: parameters.clone(),
            });
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
        Ok(Task {
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
        })
    }
}

fn add_usage(total: &mut Usage, u: &Usage) {
    total.prompt_tokens += u.prompt_tokens;
    total.completion_tokens += u.completion_tokens;
    total.cached_tokens += u.cached_tokens;
}

impl Service {
    /// Checks a task before it runs: the agent layer exists, its tools are known, its
    /// limits are within the node's, its model can be routed to (404 / 503 first).
    fn task(&self, spec: TaskSpec) -> Result<(Arc<Agent>, Task), Error> {
        let agent = self
            .agent()
            .cloned()
            .ok_or_else(|| Error::invalid("this node has no agent layer configured", None))?;
        let task = spec.validate(&agent)?;
        if task.model != self.cascade_policy().model {
            self.find_model(&task.model)?;
        }
        Ok((agent, task))
    }

    /// Checks `spec` and runs it; `events` (when given) gets each turn and tool call as it
    /// ends. The returned future runs the whole task.
    pub fn agent_task(
        &self,
        spec: TaskSpec,
        events: Option<mpsc::Sender<TaskEvent>>,
    ) -> Result<impl std::future::Future<Output = TaskOutcome> + Send + 'static, Error> {
        let (agent, task) = self.task(spec)?;
        let span =
            info_span!("agent.task", gen_ai.request.model = %task.model, tools = task.tools.len());
        let service = self.clone();
        Ok(async move { service.run_task(agent, task, events).await }.instrument(span))
    }

    async fn run_task(
        self,
        agent: Arc<Agent>,
        mut t: Task,
        events: Option<mpsc::Sender<TaskEvent>>,
    ) -> TaskOutcome {
        let id = format!("task-{}", uuid::Uuid::new_v4().simple());
        let emit = |e: TaskEvent| {
            let events = events.clone();
            async move {
                if let Some(tx) = events {
                    let _ = tx.send(e).await;
                }
            }
        };
        let mut turns: Vec<TurnRecord> = vec![];
        let mut usage = Usage::default();
        let mut output = String::new();
        let mut error: Option<String> = None;
        let mut required = vec![];
        let mut status = Status::MaxTurns;
        // The tools the last routed turn listed, in its order: the next turn lists them first.
        let mut listed: Vec<String> = vec![];
        for turn in 1..=t.max_turns {
            let remaining = t.deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                status = Status::TimedOut;
                break;
            }
            let call = ChatCall {
                model: t.model.clone(),
                messages: t.messages.iter().map(|m| m.message.clone()).collect(),
                tools: t.tools.clone(),
                tool_choice: if turn == 1 {
                    std::mem::take(&mut t.first_choice)
                } else {
                    ToolChoice::Unset
                },
                max_tokens: Some(t.max_tokens),
                reasoning_budget: t.reasoning_budget,
                keep_tools: listed.clone(),
                ..ChatCall::default()
            };
            // The draft model predicts the turn's tool call; read-only predictions start now.
            let speculated: Arc<Mutex<Vec<CallKey>>> = Arc::default();
            let draft_task = t.draft.as_ref().map(|draft| {
                let d = ChatCall {
                    model: draft.clone(),
                    max_tokens: Some(agent.settings.draft_max_tokens.min(t.max_tokens)),
                    ..call.clone()
                };
                let (service, agent, speculated) =
                    (self.clone(), agent.clone(), speculated.clone());
                let offered: HashSet<String> = t.tools.iter().map(|s| s.name.clone()).collect();
                tokio::spawn(
                    async move {
                        let Ok(c) = service.chat_turn(d).await else {
                            return;
                        };
                        // Only tools the task offers (the key may run) are started early.
                        for c in c.output.tool_calls.iter().take(1) {
                            if !offered.contains(&c.name) {
                                continue;
                            }
                            let (what, key) = agent.runner.speculate(&c.name, &c.arguments);
                            if what == Speculation::Started {
                                speculated.lock().expect("not poisoned").push(key);
                            }
                        }
                    }
                    .instrument(info_span!("agent.speculate")),
                )
            });
            let started = Instant::now();
            let res = tokio::time::timeout(remaining, self.chat_turn(call))
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
                    error = Some(e.message);
                    break;
                }
                Ok(Ok(c)) => c,
            };
            add_usage(&mut usage, &completion.usage);
            let content = completion.output.content.clone();
            let calls: Vec<(String, ToolCall)> = completion
                .output
                .tool_calls
                .iter()
                .map(|c| (c.id.clone().unwrap_or_else(call_id), c.clone()))
                .collect();
            if let Some(r) = &completion.mesh.router {
                listed = r.listed.clone();
            }
            let mut record = TurnRecord {
                turn,
                model: completion.model.clone(),
                content: content.clone(),
                ms: started.elapsed().as_millis() as u64,
                tool_calls: vec![],
                cascade: (!completion.mesh.cascade.is_empty())
                    .then(|| completion.mesh.cascade.clone()),
                tools_shown: completion.mesh.router.as_ref().map(|r| {
                    if r.listed.is_empty() {
                        r.shown.clone()
                    } else {
                        r.listed.clone()
                    }
                }),
            };
            emit(TaskEvent::Turn {
                turn,
                content: content.clone(),
                calls: calls
                    .iter()
                    .map(|(_, c)| (c.name.clone(), c.arguments.clone()))
                    .collect(),
            })
            .await;
            if calls.is_empty() {
                output = content;
                status = Status::Completed;
                turns.push(record);
                break;
            }
            t.messages.push(AgentMessage {
                message: ChatMessage {
                    role: Role::Assistant,
                    content: content.clone(),
                    tool_calls: calls
                        .iter()
                        .map(|(id, c)| ToolCall {
                            id: Some(id.clone()),
                            ..c.clone()
                        })
                        .collect(),
                    ..ChatMessage::default()
                },
                call_ids: calls.iter().map(|(id, _)| id.clone()).collect(),
                tool_call_id: None,
            });
            let (pending, calls): (Vec<_>, Vec<_>) = calls
                .into_iter()
                .partition(|(_, c)| t.client_tools.contains(&c.name));
            let mut executed = vec![];
            for (cid, c) in calls {
                let remaining = t.deadline.saturating_duration_since(Instant::now());
                // A call of a tool the task does not offer (not the key's to run) never runs.
                let offered = t.tools.iter().any(|s| s.name == c.name);
                let res = if offered {
                    tokio::time::timeout(remaining, agent.runner.execute(&c.name, &c.arguments))
                        .instrument(info_span!("agent.tool", tool = %c.name))
                        .await
                        .map(|r| r.map_err(|e| e.to_string()))
                } else {
                    Ok(Err(format!(
                        "tool `{}` is not offered to this task; it did not run",
                        c.name
                    )))
                };
                let mut rec = ToolRecord {
                    id: cid.clone(),
                    name: c.name.clone(),
                    arguments: c.arguments.clone(),
                    result: None,
                    is_error: None,
                    source: None,
                    ms: None,
                    saved_ms: None,
                    error: None,
                };
                let text = match res {
                    Err(_) => {
                        rec.error = Some("the task's time ran out during this call".into());
                        status = Status::TimedOut;
                        executed.push(rec);
                        break;
                    }
                    Ok(Ok(e)) => {
                        rec.result = Some(e.output.text.clone());
                        rec.is_error = Some(e.output.is_error);
                        rec.source = serde_json::to_value(e.source).ok();
                        rec.ms = Some(e.output.ms);
                        rec.saved_ms = Some(e.saved_ms);
                        e.output.text
                    }
                    Ok(Err(e)) => {
                        rec.error = Some(e.clone());
                        rec.is_error = Some(true);
                        format!("error: {e}")
                    }
                };
                emit(TaskEvent::Tool {
                    turn,
                    record: rec.clone(),
                })
                .await;
                let tool_name = rec.name.clone();
                executed.push(rec);
                let shown: String = text.chars().take(agent.settings.max_result_chars).collect();
                t.messages.push(AgentMessage {
                    message: ChatMessage {
                        tool_call_id: Some(cid.clone()),
                        name: Some(tool_name),
                        ..ChatMessage::text(Role::Tool, shown)
                    },
                    call_ids: vec![],
                    tool_call_id: Some(cid),
                });
            }
            let keys = std::mem::take(&mut *speculated.lock().expect("not poisoned"));
            agent.runner.cancel(&keys);
            record.tool_calls = executed;
            output = content;
            turns.push(record);
            if status == Status::TimedOut {
                break;
            }
            if !pending.is_empty() {
                status = Status::RequiresAction;
                required = pending
                    .into_iter()
                    .map(|(id, c)| (id, c.name, c.arguments))
                    .collect();
                break;
            }
        }
        self.metrics()
            .agent_tasks
            .get_or_create(&StatusLabel {
                status: status.as_str().into(),
            })
            .inc();
        let messages = (status == Status::RequiresAction).then_some(t.messages);
        TaskOutcome {
            id,
            model: t.model,
            status,
            output,
            turns,
            usage,
            error,
            required,
            messages,
        }
    }

    /// One model turn, read whole.
    async fn chat_turn(&self, call: ChatCall) -> Result<super::Completion, Error> {
        self.chat(call).await?.collect().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_adds_up() {
        let mut total = Usage::default();
        for (p, c) in [(10, 2), (5, 1)] {
            add_usage(
                &mut total,
                &Usage {
                    prompt_tokens: p,
                    completion_tokens: c,
                    ..Usage::default()
                },
            );
        }
        assert_eq!((total.prompt_tokens, total.completion_tokens), (15, 3));
    }

    #[test]
    fn call_ids_look_like_openais() {
        let id = call_id();
        assert!(id.starts_with("call_") && id.len() == 29, "{id}");
    }
}
