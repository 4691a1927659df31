//! The Rust client SDK (feature `client`; no llama.cpp build).
//!
//! Typed chat calls, token streaming and a tool-calling agent loop against any
//! list of mesh gateways. A call that cannot reach a gateway, or gets a 429/5xx,
//! is retried on the next address with exponential backoff; a stream is retried
//! only until its first chunk arrives (after that the mesh itself re-runs the
//! request on another node if the serving node dies).
//!
//! ```no_run
//! # async fn demo() -> Result<(), mesh::client::ClientError> {
//! use mesh::client::{ChatRequest, Client, Message};
//! let client = Client::new(["http://127.0.0.1:8080", "http://127.0.0.1:8081"])?;
//! let reply = client
//!     .chat(&ChatRequest::new("t1", vec![Message::user("What is the weather in Oslo?")]))
//!     .await?;
//! println!("{:?}", reply.choices[0].message);
//! # Ok(()) }
//! ```

use std::time::Duration;

use futures::{Stream, StreamExt};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Errors of the client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No gateway address was given, or one is not a URL.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The gateway refused the request (4xx other than 429): retrying will not help.
    #[error("request refused ({status}): {message}")]
    Refused {
        /// HTTP status.
        status: u16,
        /// OpenAI-style error message.
        message: String,
    },
    /// Every attempt failed; the last reason is kept.
    #[error("all {attempts} attempts failed; last: {last}")]
    Exhausted {
        /// Attempts made.
        attempts: usize,
        /// Last failure.
        last: String,
    },
    /// The stream broke or carried an error after it had started.
    #[error("stream failed: {0}")]
    Stream(String),
    /// A response body was not what the API promises.
    #[error("unexpected response: {0}")]
    Decode(String),
    /// The agent loop hit its step limit.
    #[error("agent gave no final answer within {0} steps")]
    TooManySteps(usize),
}

/// A chat message.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// Text (may be null for an assistant turn that only calls tools).
    #[serde(default)]
    pub content: Option<String>,
    /// Tool calls of an assistant turn.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// For `tool` messages: the call answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Reasoning text (`reasoning_content`), when the model thought first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl Message {
    fn text(role: &str, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: Some(content.into()),
            tool_calls: vec![],
            tool_call_id: None,
            reasoning_content: None,
        }
    }
    /// A system message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::text("system", content)
    }
    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::text("user", content)
    }
    /// A tool result answering `call_id`.
    pub fn tool(call_id: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            tool_call_id: Some(call_id.into()),
            ..Self::text("tool", content)
        }
    }
}

/// A function the model called.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FunctionCall {
    /// Tool name.
    pub name: String,
    /// Arguments as a JSON string (OpenAI's convention).
    pub arguments: String,
}

/// A tool call.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ToolCall {
    /// Call id, echoed in the tool result.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The call.
    pub function: FunctionCall,
}

impl ToolCall {
    /// Parsed arguments.
    pub fn arguments(&self) -> Result<Value, ClientError> {
        serde_json::from_str(&self.function.arguments)
            .map_err(|e| ClientError::Decode(e.to_string()))
    }
}

/// A chat request (the subset of OpenAI's fields mesh serves).
#[derive(Debug, Clone, Serialize, Default)]
pub struct ChatRequest {
    /// Tier name.
    pub model: String,
    /// Conversation.
    pub messages: Vec<Message>,
    /// Tool schemas (`{"type": "function", "function": {...}}`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<Value>,
    /// Completion budget.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<usize>,
    /// Sampling temperature (mesh default 0 = greedy).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// Sampling seed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Stop strings.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stop: Vec<String>,
    stream: bool,
}

impl ChatRequest {
    /// A request for `model` with these messages.
    pub fn new(model: impl Into<String>, messages: Vec<Message>) -> Self {
        Self {
            model: model.into(),
            messages,
            ..Default::default()
        }
    }
}

/// One choice of a response.
#[derive(Debug, Clone, Deserialize)]
pub struct Choice {
    /// The assistant turn.
    pub message: Message,
    /// `stop`, `length` or `tool_calls`.
    pub finish_reason: Option<String>,
}

/// Token counts.
#[derive(Debug, Clone, Copy, Deserialize, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Completion tokens.
    pub completion_tokens: u64,
}

/// A chat response.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatResponse {
    /// Response id.
    pub id: String,
    /// Tier that answered.
    pub model: String,
    /// Choices (one).
    pub choices: Vec<Choice>,
    /// Token counts.
    #[serde(default)]
    pub usage: Usage,
}

/// An agent task for the node to run with its MCP tools (`POST /v1/agent/tasks`).
#[derive(Debug, Clone, Serialize, Default)]
pub struct AgentTaskRequest {
    /// Tier id or the cascade's model id.
    pub model: String,
    /// A single user message (appended to `messages`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input: Option<String>,
    /// Earlier conversation.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub messages: Vec<Message>,
    /// Tool names the task may use (default: all of the node's MCP tools).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<String>>,
    /// `tool_choice` of the first turn.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<Value>,
    /// Turn limit (node default 6).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_turns: Option<usize>,
    /// Time limit in seconds (node default 120).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<f64>,
    /// Completion budget per turn.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<usize>,
    /// Speculative tool calls (node default on).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculate: Option<bool>,
}

impl AgentTaskRequest {
    /// A task for `model` with one user message.
    pub fn new(model: impl Into<String>, input: impl Into<String>) -> Self {
        Self {
            model: model.into(),
            input: Some(input.into()),
            ..Self::default()
        }
    }
}

/// A finished agent task.
#[derive(Debug, Clone, Deserialize)]
pub struct AgentTask {
    /// Task id.
    pub id: String,
    /// `completed`, `max_turns`, `timed_out` or `failed`.
    pub status: String,
    /// The model's last text.
    pub output: String,
    /// Every turn: the model's text, its tool calls with their results and where each
    /// result came from (`fresh`, `speculative`, `cached`).
    pub turns: Vec<Value>,
    /// Token counts over all turns.
    #[serde(default)]
    pub usage: Usage,
    /// Why a `failed` task failed.
    #[serde(default)]
    pub error: Option<String>,
}

/// One streamed piece.
#[derive(Debug, Clone, PartialEq)]
pub enum ChatDelta {
    /// Answer text.
    Content(String),
    /// Reasoning text.
    Reasoning(String),
    /// A complete tool call.
    ToolCall(ToolCall),
    /// The end, with why and (if the server sent it) usage.
    Finished {
        /// Finish reason.
        reason: String,
    },
}

/// Retry policy.
#[derive(Debug, Clone)]
pub struct Retry {
    /// Attempts in all (across addresses).
    pub attempts: usize,
    /// First backoff; doubles per attempt.
    pub backoff: Duration,
    /// Backoff cap.
    pub max_backoff: Duration,
    /// Per-request timeout.
    pub timeout: Duration,
}

impl Default for Retry {
    fn default() -> Self {
        Self {
            attempts: 6,
            backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(2),
            timeout: Duration::from_secs(300),
        }
    }
}

/// A client over a list of gateways.
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    bases: Vec<String>,
    retry: Retry,
    next: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    api_key: Option<String>,
}

enum Attempt<T> {
    Done(T),
    Retry(String),
    Fatal(ClientError),
}

fn api_message(body: &str) -> String {
    serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
        .unwrap_or_else(|| body.chars().take(300).collect())
}

impl Client {
    /// A client for these gateway base URLs (`http://host:port`), tried in order.
    pub fn new<I, S>(gateways: I) -> Result<Self, ClientError>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let bases: Vec<String> = gateways
            .into_iter()
            .map(|s| s.into().trim_end_matches('/').to_owned())
            .collect();
        if bases.is_empty() {
            return Err(ClientError::Config("no gateway address".into()));
        }
        if let Some(bad) = bases
            .iter()
            .find(|b| !b.starts_with("http://") && !b.starts_with("https://"))
        {
            return Err(ClientError::Config(format!(
                "`{bad}` is not an http(s) URL"
            )));
        }
        Ok(Self {
            http: reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(2))
                .build()
                .map_err(|e| ClientError::Config(e.to_string()))?,
            bases,
            retry: Retry::default(),
            next: Default::default(),
            api_key: None,
        })
    }

    /// Sends `key` as `Authorization: Bearer` on every request (nodes started with
    /// `--keys`; see `mesh keys create`).
    pub fn with_api_key(mut self, key: impl Into<String>) -> Self {
        self.api_key = Some(key.into());
        self
    }

    /// Replaces the retry policy.
    pub fn with_retry(mut self, retry: Retry) -> Self {
        self.retry = retry;
        self
    }

    /// Runs `f` against gateways in turn until it succeeds or attempts run out.
    /// A gateway that failed is left for the next one (sticky round robin).
    async fn with_failover<T, F, Fut>(&self, mut f: F) -> Result<T, ClientError>
    where
        F: FnMut(String) -> Fut,
        Fut: std::future::Future<Output = Attempt<T>>,
    {
        use std::sync::atomic::Ordering::Relaxed;
        let mut last = String::new();
        let mut backoff = self.retry.backoff;
        for attempt in 0..self.retry.attempts.max(1) {
            let i = self.next.load(Relaxed) % self.bases.len();
            match f(self.bases[i].clone()).await {
                Attempt::Done(v) => return Ok(v),
                Attempt::Fatal(e) => return Err(e),
                Attempt::Retry(why) => {
                    tracing::warn!(gateway = %self.bases[i], attempt, reason = %why, "gateway failed; trying the next");
                    last = format!("{}: {why}", self.bases[i]);
                    let _ =
                        self.next
                            .compare_exchange(i, (i + 1) % self.bases.len(), Relaxed, Relaxed);
                    // Each address is tried once before backing off.
                    if (attempt + 1) % self.bases.len() == 0 {
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(self.retry.max_backoff);
                    }
                }
            }
        }
        Err(ClientError::Exhausted {
            attempts: self.retry.attempts.max(1),
            last,
        })
    }

    async fn send(
        &self,
        base: &str,
        path: &str,
        body: &impl Serialize,
    ) -> Attempt<reqwest::Response> {
        self.send_within(base, path, body, self.retry.timeout).await
    }

    async fn send_within(
        &self,
        base: &str,
        path: &str,
        body: &impl Serialize,
        timeout: Duration,
    ) -> Attempt<reqwest::Response> {
        let mut req = self
            .http
            .post(format!("{base}{path}"))
            .timeout(timeout)
            .json(body);
        if let Some(k) = &self.api_key {
            req = req.bearer_auth(k);
        }
        let r = req.send().await;
        match r {
            Err(e) => Attempt::Retry(e.to_string()),
            Ok(r) if r.status().is_success() => Attempt::Done(r),
            Ok(r) => {
                let status = r.status().as_u16();
                let msg = api_message(&r.text().await.unwrap_or_default());
                if status == 429 || status >= 500 {
                    Attempt::Retry(format!("{status}: {msg}"))
                } else {
                    Attempt::Fatal(ClientError::Refused {
                        status,
                        message: msg,
                    })
                }
            }
        }
    }

    /// One chat completion.
    pub async fn chat(&self, req: &ChatRequest) -> Result<ChatResponse, ClientError> {
        let mut req = req.clone();
        req.stream = false;
        self.with_failover(|base| {
            let req = &req;
            async move {
                match self.send(&base, "/v1/chat/completions", req).await {
                    Attempt::Done(r) => match r.json::<ChatResponse>().await {
                        Ok(v) => Attempt::Done(v),
                        // A body cut short (gateway died mid-answer) is worth another try.
                        Err(e) => Attempt::Retry(e.to_string()),
                    },
                    Attempt::Retry(w) => Attempt::Retry(w),
                    Attempt::Fatal(e) => Attempt::Fatal(e),
                }
            }
        })
        .await
    }

    /// A streamed chat completion: content, reasoning and complete tool calls as they come.
    pub async fn chat_stream(
        &self,
        req: &ChatRequest,
    ) -> Result<impl Stream<Item = Result<ChatDelta, ClientError>> + use<>, ClientError> {
        let mut req = req.clone();
        req.stream = true;
        let resp = self
            .with_failover(|base| {
                let req = &req;
                async move { self.send(&base, "/v1/chat/completions", req).await }
            })
            .await?;
        let bytes = resp.bytes_stream();
        Ok(sse_deltas(bytes))
    }

    /// Runs an agent task on the node (`POST /v1/agent/tasks`): the node calls its MCP
    /// tools itself, turn after turn, within the task's limits. A gateway that refuses
    /// with 429 or 5xx before the task starts is retried on the next one; the task's own
    /// outcome (`completed`, `max_turns`, `timed_out`, `failed`) is in
    /// [`AgentTask::status`].
    pub async fn agent_task(&self, req: &AgentTaskRequest) -> Result<AgentTask, ClientError> {
        // The task may take its whole timeout; the HTTP wait is that plus a margin.
        let limit = Duration::from_secs_f64(req.timeout_s.unwrap_or(120.0) + 10.0);
        self.with_failover(|base| async move {
            match self.send_within(&base, "/v1/agent/tasks", req, limit).await {
                Attempt::Done(r) => match r.json::<AgentTask>().await {
                    Ok(v) => Attempt::Done(v),
                    Err(e) => Attempt::Fatal(ClientError::Decode(e.to_string())),
                },
                Attempt::Retry(w) => Attempt::Retry(w),
                Attempt::Fatal(e) => Attempt::Fatal(e),
            }
        })
        .await
    }

    /// Runs an agent task: asks `model`, executes each tool call with `run_tool`, feeds the
    /// results back, until the model answers without calling a tool. Returns the answer and
    /// the conversation.
    pub async fn run_agent<F>(
        &self,
        model: &str,
        mut messages: Vec<Message>,
        tools: Vec<Value>,
        max_steps: usize,
        mut run_tool: F,
    ) -> Result<(String, Vec<Message>), ClientError>
    where
        F: FnMut(&ToolCall) -> String,
    {
        for _ in 0..max_steps {
            let mut req = ChatRequest::new(model, messages.clone());
            req.tools = tools.clone();
            let resp = self.chat(&req).await?;
            let choice = resp
                .choices
                .into_iter()
                .next()
                .ok_or_else(|| ClientError::Decode("response without choices".into()))?;
            let msg = choice.message;
            messages.push(msg.clone());
            if msg.tool_calls.is_empty() {
                return Ok((msg.content.unwrap_or_default(), messages));
            }
            for call in &msg.tool_calls {
                let result = run_tool(call);
                messages.push(Message::tool(call.id.clone(), result));
            }
        }
        Err(ClientError::TooManySteps(max_steps))
    }
}

fn sse_deltas(
    bytes: impl Stream<Item = reqwest::Result<bytes::Bytes>> + Send + 'static,
) -> impl Stream<Item = Result<ChatDelta, ClientError>> {
    let bytes = Box::pin(bytes);
    futures::stream::unfold(
        (
            bytes,
            String::new(),
            std::collections::VecDeque::new(),
            false,
        ),
        |(mut bytes, mut buf, mut ready, mut done)| async move {
            loop {
                if let Some(d) = ready.pop_front() {
                    return Some((d, (bytes, buf, ready, done)));
                }
                if done {
                    return None;
                }
                match bytes.next().await {
                    None => {
                        done = true;
                        ready.push_back(Err(ClientError::Stream(
                            "stream ended before it finished".into(),
                        )));
                    }
                    Some(Err(e)) => {
                        done = true;
                        ready.push_back(Err(ClientError::Stream(e.to_string())));
                    }
                    Some(Ok(chunk)) => {
                        buf.push_str(&String::from_utf8_lossy(&chunk));
                        while let Some(pos) = buf.find('\n') {
                            let line: String = buf.drain(..=pos).collect();
                            let Some(data) = line.trim_end().strip_prefix("data: ") else {
                                continue;
                            };
                            if data == "[DONE]" {
                                done = true;
                                break;
                            }
                            match parse_chunk(data) {
                                Ok(ds) => ready.extend(ds.into_iter().map(Ok)),
                                Err(e) => {
                                    done = true;
                                    ready.push_back(Err(e));
                                    break;
                                }
                            }
                        }
                    }
                }
            }
        },
    )
}

fn parse_chunk(data: &str) -> Result<Vec<ChatDelta>, ClientError> {
    let v: Value =
        serde_json::from_str(data).map_err(|e| ClientError::Decode(format!("{e}: {data}")))?;
    if let Some(err) = v.get("error") {
        return Err(ClientError::Stream(
            err["message"].as_str().unwrap_or("server error").to_owned(),
        ));
    }
    let mut out = vec![];
    let Some(choice) = v["choices"].get(0) else {
        return Ok(out);
    };
    let delta = &choice["delta"];
    if let Some(t) = delta["reasoning_content"].as_str() {
        out.push(ChatDelta::Reasoning(t.to_owned()));
    }
    if let Some(t) = delta["content"].as_str().filter(|t| !t.is_empty()) {
        out.push(ChatDelta::Content(t.to_owned()));
    }
    for c in delta["tool_calls"].as_array().into_iter().flatten() {
        let call: ToolCall =
            serde_json::from_value(c.clone()).map_err(|e| ClientError::Decode(e.to_string()))?;
        out.push(ChatDelta::ToolCall(call));
    }
    if let Some(r) = choice["finish_reason"].as_str() {
        out.push(ChatDelta::Finished {
            reason: r.to_owned(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stream_chunks() {
        let d = parse_chunk(
            r#"{"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}"#,
        )
        .unwrap();
        assert_eq!(d, vec![ChatDelta::Content("hi".into())]);
        let d = parse_chunk(r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]},"finish_reason":null}]}"#).unwrap();
        assert!(matches!(&d[0], ChatDelta::ToolCall(c) if c.function.name == "f" && c.id == "c1"));
        let d =
            parse_chunk(r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#).unwrap();
        assert_eq!(
            d,
            vec![ChatDelta::Finished {
                reason: "stop".into()
            }]
        );
        assert!(
            matches!(parse_chunk(r#"{"error":{"message":"boom"}}"#), Err(ClientError::Stream(m)) if m == "boom")
        );
    }

    #[test]
    fn config_errors_are_clear() {
        assert!(matches!(
            Client::new(Vec::<String>::new()),
            Err(ClientError::Config(_))
        ));
        assert!(
            matches!(Client::new(["localhost:8080"]), Err(ClientError::Config(m)) if m.contains("not an http"))
        );
    }
}
