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
            SseSplitter::default(),
            std::collections::VecDeque::new(),
            false,
        ),
        |(mut bytes, mut sse, mut ready, mut done)| async move {
            loop {
                if let Some(d) = ready.pop_front() {
                    return Some((d, (bytes, sse, ready, done)));
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
                        sse.push(&chunk);
                        while let Some(data) = sse.next_data() {
                            if data == "[DONE]" {
                                done = true;
                                break;
                            }
                            match parse_chunk(&data) {
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

/// Splits a server-sent-events byte stream into the payloads of its `data: ` lines, however
/// the stream is cut into chunks. Bytes are kept until their line ends at `\n`, so a
/// character cut between two chunks is decoded whole (invalid UTF-8 becomes U+FFFD);
/// trailing whitespace (a `\r` included) is dropped; lines other than `data: ` ones
/// (comments, `event:`, the blank line between events) are skipped. Pure:
/// [`Client::chat_stream`] feeds it the response body.
#[doc(hidden)]
#[derive(Debug, Default)]
pub struct SseSplitter {
    buf: Vec<u8>,
    /// Leading bytes of `buf` known to hold no `\n` (a long line is scanned once).
    scanned: usize,
}

impl SseSplitter {
    /// Appends the next chunk of the stream.
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The payload of the next complete `data: ` line, or `None` until another line ends.
    pub fn next_data(&mut self) -> Option<String> {
        loop {
            let Some(end) = self.buf[self.scanned..].iter().position(|&b| b == b'\n') else {
                self.scanned = self.buf.len();
                return None;
            };
            let rest = self.buf.split_off(self.scanned + end + 1);
            let line = std::mem::replace(&mut self.buf, rest);
            self.scanned = 0;
            let line = String::from_utf8_lossy(&line);
            if let Some(data) = line.trim_end().strip_prefix("data: ") {
                return Some(data.to_owned());
            }
        }
    }
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

    /// Found by `chunking_does_not_change_the_payloads`: each chunk used to be decoded on
    /// its own, so a character cut between two chunks became two U+FFFD.
    #[test]
    fn character_cut_between_chunks_is_kept() {
        let line = "data: {\"choices\":[{\"delta\":{\"content\":\"¡ü😀\"}}]}\n".as_bytes();
        for cut in 0..line.len() {
            let mut sse = SseSplitter::default();
            sse.push(&line[..cut]);
            assert_eq!(sse.next_data(), None);
            sse.push(&line[cut..]);
            let d = sse.next_data().unwrap();
            assert!(d.contains("¡ü😀"), "cut at {cut}: {d}");
        }
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

#[cfg(test)]
mod sse_props {
    use super::*;
    use proptest::prelude::*;
    use proptest::sample::Index;

    /// `stream` cut at `cuts` (positions taken modulo its length).
    fn chunks(stream: &[u8], cuts: &[Index]) -> Vec<Vec<u8>> {
        let mut at: Vec<usize> = cuts.iter().map(|c| c.index(stream.len() + 1)).collect();
        at.push(0);
        at.push(stream.len());
        at.sort_unstable();
        at.dedup();
        at.windows(2).map(|w| stream[w[0]..w[1]].to_vec()).collect()
    }

    fn split(chunks: &[Vec<u8>]) -> Vec<String> {
        let mut sse = SseSplitter::default();
        let mut out = vec![];
        for c in chunks {
            sse.push(c);
            while let Some(d) = sse.next_data() {
                out.push(d);
            }
        }
        out
    }

    /// Text in the shape of an SSE stream: data, comment and event lines, blank lines,
    /// `\n` and `\r\n` endings, non-ASCII text; or any bytes at all.
    fn stream() -> impl Strategy<Value = Vec<u8>> {
        let piece = prop_oneof![
            Just("data: ".to_owned()),
            Just("data:".to_owned()),
            Just(": ping".to_owned()),
            Just("event: x".to_owned()),
            Just("\n".to_owned()),
            Just("\r\n".to_owned()),
            Just("[DONE]".to_owned()),
            "[a-z{}\":, ]{1,8}",
            "\\PC{1,4}",
        ];
        prop_oneof![
            prop::collection::vec(piece, 0..40).prop_map(|p| p.concat().into_bytes()),
            prop::collection::vec(any::<u8>(), 0..200),
        ]
    }

    /// A payload as a server writes one: one line, not empty, no trailing whitespace (an
    /// empty `data: ` line is skipped, as the gateway never sends one).
    fn payload() -> impl Strategy<Value = String> {
        "[^\n\r]{1,30}"
            .prop_map(|s| s.trim_end().to_owned())
            .prop_filter("not blank", |s| !s.is_empty())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        /// The same stream cut into chunks anywhere (inside a line, a `\r\n`, a UTF-8
        /// character) gives the same payloads as in one chunk.
        #[test]
        fn chunking_does_not_change_the_payloads(s in stream(), cuts in prop::collection::vec(any::<Index>(), 0..12)) {
            prop_assert_eq!(split(&chunks(&s, &cuts)), split(std::slice::from_ref(&s)));
        }

        /// The payloads of `data: ` lines come back as written, in order, with comments,
        /// other fields and blank lines skipped, whichever line ending the server uses.
        #[test]
        fn data_lines_come_back_as_written(
            events in prop::collection::vec((payload(), any::<bool>(), any::<bool>()), 0..12),
            cuts in prop::collection::vec(any::<Index>(), 0..12),
        ) {
            let mut s = String::new();
            for (data, crlf, noise) in &events {
                let nl = if *crlf { "\r\n" } else { "\n" };
                if *noise {
                    s.push_str(&format!(": keep-alive{nl}event: message{nl}"));
                }
                s.push_str(&format!("data: {data}{nl}{nl}"));
            }
            let want: Vec<String> = events.into_iter().map(|(d, _, _)| d).collect();
            prop_assert_eq!(split(&chunks(s.as_bytes(), &cuts)), want);
        }

        /// A streamed completion read through [`sse_deltas`] gives the deltas the server
        /// sent, however the body was cut into chunks.
        #[test]
        fn deltas_survive_any_chunking(
            pieces in prop::collection::vec((any::<bool>(), "\\PC{1,12}"), 0..8),
            cuts in prop::collection::vec(any::<Index>(), 0..16),
        ) {
            let mut body = String::new();
            let mut want = vec![];
            for (reasoning, text) in pieces {
                let delta = if reasoning {
                    serde_json::json!({"reasoning_content": text})
                } else {
                    serde_json::json!({"content": text})
                };
                let chunk = serde_json::json!({"choices": [{"index": 0, "delta": delta, "finish_reason": null}]});
                body.push_str(&format!("data: {chunk}\n\n"));
                want.push(if reasoning { ChatDelta::Reasoning(text) } else { ChatDelta::Content(text) });
            }
            body.push_str("data: {\"choices\": [{\"index\": 0, \"delta\": {}, \"finish_reason\": \"stop\"}]}\n\ndata: [DONE]\n\n");
            want.push(ChatDelta::Finished { reason: "stop".into() });
            let parts = chunks(body.as_bytes(), &cuts)
                .into_iter()
                .map(|c| Ok::<_, reqwest::Error>(bytes::Bytes::from(c)));
            let got: Vec<ChatDelta> = futures::executor::block_on(
                sse_deltas(futures::stream::iter(parts)).collect::<Vec<_>>(),
            )
            .into_iter()
            .collect::<Result<_, _>>()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(got, want);
        }
    }
}
