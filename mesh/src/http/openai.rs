//! OpenAI-compatible wire types (the subset mesh serves, plus `mesh` extensions), and
//! their translation to and from the service layer's typed calls.
//!
//! Unknown request fields are ignored, as OpenAI clients send many optional
//! ones; fields mesh cannot honour (`n > 1`, unsupported content parts) are
//! refused with a 400 naming the field.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use utoipa::ToSchema;

use super::error::ApiError;
use crate::service::{
    self, ChatCall, ChatMessage, Completion, FinishReason, LogprobEntry, MeshInfo, ResponseFormat,
    Role, Sampling, TokenLogprobs, ToolCall, ToolChoice, ToolSpec, Usage,
};

/// `POST /v1/chat/completions` body.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[schema(example = json!({"model": "t1", "max_tokens": 8, "temperature": 0,
    "messages": [{"role": "user", "content": "What is the forecast in Lima on 2026-03-02?"}]}))]
pub struct ChatRequest {
    /// Model id (a tier name, see `GET /v1/models`).
    pub model: String,
    /// Conversation so far.
    pub messages: Vec<InMessage>,
    /// Tools the model may call.
    #[serde(default)]
    pub tools: Vec<InTool>,
    /// `none`, `auto`, `required` or `{"type": "function", "function": {"name": ..}}`.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    /// Stream with server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Completion budget (legacy name).
    pub max_tokens: Option<usize>,
    /// Completion budget.
    pub max_completion_tokens: Option<usize>,
    /// Sampling temperature (default 1.0 as in OpenAI's API; 0 = greedy).
    pub temperature: Option<f32>,
    /// Nucleus mass.
    pub top_p: Option<f32>,
    /// Top-k (extension, as in vLLM and llama.cpp's server).
    pub top_k: Option<i32>,
    /// Sampling seed.
    pub seed: Option<u64>,
    /// Stop strings.
    pub stop: Option<StopField>,
    /// Number of choices; only 1 is supported.
    pub n: Option<u32>,
    /// Ban end-of-generation tokens (extension, as in llama.cpp's server; for benchmarks).
    #[serde(default)]
    pub ignore_eos: bool,
    /// Cap on reasoning tokens inside `<think>` (extension); when spent the think block
    /// is closed and the model answers. Default: the node's reasoning policy.
    pub reasoning_budget: Option<usize>,
    /// `{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema",
    /// "json_schema": {"name": .., "schema": {..}}}`: the answer is held to it by a grammar.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub response_format: Option<Value>,
    /// Return the log-probability of each generated token.
    #[serde(default)]
    pub logprobs: bool,
    /// With `logprobs`: this many most likely alternatives per token (0-20).
    pub top_logprobs: Option<usize>,
    /// Extra variables for the model's chat template (as vLLM and llama.cpp's server take
    /// them), e.g. `{"enable_thinking": false}`.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// Return the prompt's token ids (`prompt_token_ids`) and the answer's (`token_ids` of
    /// the choice), as vLLM does (extension; not with `stream`).
    #[serde(default)]
    pub return_token_ids: bool,
}

/// `stream_options`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct StreamOptions {
    /// Send a final chunk with usage.
    #[serde(default)]
    pub include_usage: bool,
}

/// `stop`: one string or several.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum StopField {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

impl StopField {
    /// As a list.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopField::One(s) => vec![s],
            StopField::Many(v) => v,
        }
    }
}

/// A message as sent by a client.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct InMessage {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// Text, or an array of content parts, or null.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub content: Option<Value>,
    /// Calls in an assistant message.
    #[serde(default)]
    pub tool_calls: Vec<InToolCall>,
    /// Which call a tool message answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    /// The tool a tool message comes from, or the author's name.
    #[serde(default)]
    pub name: Option<String>,
    /// An assistant turn's reasoning, sent back as it was received.
    #[serde(default)]
    pub reasoning_content: Option<String>,
}

/// A tool call inside a client message.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct InToolCall {
    /// Call id.
    #[serde(default)]
    pub id: Option<String>,
    /// The function.
    pub function: InFunctionCall,
}

/// Function part of a tool call.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct InFunctionCall {
    /// Name.
    pub name: String,
    /// Arguments as a JSON string (OpenAI) or object.
    #[schema(value_type = Object)]
    pub arguments: Value,
}

/// A tool offered by the client.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct InTool {
    /// Must be `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The function.
    pub function: InFunction,
}

/// Function definition.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct InFunction {
    /// Name.
    pub name: String,
    /// Description.
    #[serde(default)]
    pub description: Option<String>,
    /// JSON schema of the arguments.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub parameters: Option<Value>,
}

/// `POST /v1/completions` body.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[schema(example = json!({"model": "t1", "prompt": "Once upon a time", "max_tokens": 8}))]
pub struct CompletionRequest {
    /// Model id.
    pub model: String,
    /// Prompt text, a one-element list of text, or token ids.
    #[schema(value_type = Object)]
    pub prompt: Value,
    /// Completion budget.
    pub max_tokens: Option<usize>,
    /// Sampling temperature (default 1.0; 0 = greedy).
    pub temperature: Option<f32>,
    /// Nucleus mass.
    pub top_p: Option<f32>,
    /// Top-k (extension).
    pub top_k: Option<i32>,
    /// Seed.
    pub seed: Option<u64>,
    /// Stop strings.
    pub stop: Option<StopField>,
    /// Stream with server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Number of choices; only 1 is supported.
    pub n: Option<u32>,
    /// Ban end-of-generation tokens (extension).
    #[serde(default)]
    pub ignore_eos: bool,
    /// Log-probabilities of each token with this many alternatives (0-5).
    pub logprobs: Option<usize>,
}

/// Token counts in responses.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, Default, PartialEq, Eq, ToSchema)]
pub struct OutUsage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Completion tokens.
    pub completion_tokens: usize,
    /// Sum.
    pub total_tokens: usize,
    /// Breakdown of the completion tokens (OpenAI's shape).
    #[serde(default)]
    pub completion_tokens_details: CompletionDetails,
    /// Breakdown of the prompt tokens (OpenAI's shape).
    #[serde(default)]
    pub prompt_tokens_details: PromptDetails,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, Default, PartialEq, Eq, ToSchema)]
pub struct PromptDetails {
    /// Prompt tokens not computed for this request: reused from a slot's kept KV or
    /// restored from KV pages.
    pub cached_tokens: usize,
}

/// `usage.completion_tokens_details`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, Default, PartialEq, Eq, ToSchema)]
pub struct CompletionDetails {
    /// Tokens inside the think block.
    pub reasoning_tokens: usize,
}

impl From<Usage> for OutUsage {
    fn from(u: Usage) -> Self {
        Self {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.prompt_tokens + u.completion_tokens,
            completion_tokens_details: CompletionDetails {
                reasoning_tokens: u.reasoning_tokens,
            },
            prompt_tokens_details: PromptDetails {
                cached_tokens: u.cached_tokens.min(u.prompt_tokens),
            },
        }
    }
}

/// A tool call in a response.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct OutToolCall {
    /// Stream position (only in streamed deltas).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
    /// Call id.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Name and JSON-string arguments.
    pub function: OutFunctionCall,
}

/// Function part of a response tool call.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct OutFunctionCall {
    /// Name.
    pub name: String,
    /// Arguments, a JSON document as a string (OpenAI's convention).
    pub arguments: String,
}

/// Error body, OpenAI's shape.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// Error details.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorDetail {
    /// Human-readable reason.
    pub message: String,
    /// Class: `invalid_request_error`, `not_found_error`, `rate_limit_error`, `server_error`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Offending parameter, if any.
    pub param: Option<String>,
    /// Stable code, e.g. `model_not_found`, `context_length_exceeded`.
    pub code: Option<String>,
}

// ---------------------------------------------------------------------------
// Requests into typed calls

/// The conversation of a chat request: roles checked, content parts joined, call
/// arguments parsed; each message keeps the ids clients match tool results by.
pub fn to_messages(input: &[InMessage]) -> Result<Vec<service::agent::AgentMessage>, ApiError> {
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
                    id: c.id.clone(),
                })
                .collect();
            Ok(service::agent::AgentMessage {
                message: ChatMessage {
                    role,
                    content,
                    tool_calls,
                    reasoning: m.reasoning_content.clone().filter(|r| !r.is_empty()),
                    tool_call_id: m.tool_call_id.clone(),
                    name: m.name.clone().filter(|_| role == Role::Tool),
                },
                call_ids: m
                    .tool_calls
                    .iter()
                    .map(|c| c.id.clone().unwrap_or_default())
                    .collect(),
                tool_call_id: m.tool_call_id.clone(),
            })
        })
        .collect()
}

/// The tools of a chat request, checked.
pub fn to_tools(input: &[InTool]) -> Result<Vec<ToolSpec>, ApiError> {
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

/// `response_format`: `text`, `json_object`, or `json_schema` with its schema.
pub fn to_response_format(v: Option<&Value>) -> Result<ResponseFormat, ApiError> {
    let err = |m: &str| ApiError::bad_request(m, Some("response_format"));
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(ResponseFormat::Text);
    };
    match v.get("type").and_then(Value::as_str) {
        Some("text") => Ok(ResponseFormat::Text),
        Some("json_object") => Ok(ResponseFormat::JsonObject),
        Some("json_schema") => {
            let schema = v
                .pointer("/json_schema/schema")
                .ok_or_else(|| err("response_format json_schema needs json_schema.schema"))?;
            if !schema.is_object() {
                return Err(err("json_schema.schema must be a JSON schema object"));
            }
            Ok(ResponseFormat::JsonSchema(schema.clone()))
        }
        Some(other) => Err(ApiError::bad_request(
            format!("unsupported response_format type `{other}` (text, json_object, json_schema)"),
            Some("response_format"),
        )),
        None => Err(err("response_format needs a type")),
    }
}

/// `logprobs` and `top_logprobs`: how many alternatives per token, when asked at all.
pub fn to_logprobs(logprobs: bool, top: Option<usize>) -> Result<Option<usize>, ApiError> {
    match (logprobs, top) {
        (_, Some(n)) if n > 20 => Err(ApiError::bad_request(
            "top_logprobs must be between 0 and 20",
            Some("top_logprobs"),
        )),
        (false, Some(_)) => Err(ApiError::bad_request(
            "top_logprobs needs logprobs: true",
            Some("top_logprobs"),
        )),
        (true, n) => Ok(Some(n.unwrap_or(0))),
        (false, None) => Ok(None),
    }
}

/// `tool_choice`: a string or `{"type": "function", "function": {"name": ...}}`.
pub fn to_tool_choice(v: Option<&Value>) -> Result<ToolChoice, ApiError> {
    let err = |m: String| ApiError::bad_request(m, Some("tool_choice"));
    match v {
        None | Some(Value::Null) => Ok(ToolChoice::Unset),
        Some(Value::String(s)) => match s.as_str() {
            "auto" => Ok(ToolChoice::Auto),
            "none" => Ok(ToolChoice::None),
            "required" => Ok(ToolChoice::Required),
            other => Err(err(format!("unsupported tool_choice `{other}`"))),
        },
        Some(obj) => obj
            .pointer("/function/name")
            .and_then(Value::as_str)
            .map(|n| ToolChoice::Named(n.to_owned()))
            .ok_or_else(|| {
                err("tool_choice object must be {\"type\": \"function\", \"function\": {\"name\": ...}}".into())
            }),
    }
}

impl ChatRequest {
    /// The typed call.
    pub fn into_call(self) -> Result<ChatCall, ApiError> {
        if self.n.unwrap_or(1) != 1 {
            return Err(ApiError::bad_request("only n = 1 is supported", Some("n")));
        }
        if self.messages.is_empty() {
            return Err(ApiError::bad_request(
                "messages must not be empty",
                Some("messages"),
            ));
        }
        Ok(ChatCall {
            messages: to_messages(&self.messages)?
                .into_iter()
                .map(|m| m.message)
                .collect(),
            tools: to_tools(&self.tools)?,
            tool_choice: to_tool_choice(self.tool_choice.as_ref())?,
            max_tokens: self.max_completion_tokens.or(self.max_tokens),
            sampling: Sampling {
                temperature: self.temperature,
                top_p: self.top_p,
                top_k: self.top_k,
                seed: self.seed,
            },
            stop: self.stop.map(StopField::into_vec).unwrap_or_default(),
            reasoning_budget: self.reasoning_budget,
            ignore_eos: self.ignore_eos,
            response_format: to_response_format(self.response_format.as_ref())?,
            logprobs: to_logprobs(self.logprobs, self.top_logprobs)?,
            template_kwargs: self.chat_template_kwargs.unwrap_or_default(),
            return_token_ids: self.return_token_ids,
            model: self.model,
            ..ChatCall::default()
        })
    }
}

// ---------------------------------------------------------------------------
// Responses

/// OpenAI's `finish_reason` of a finished generation.
pub fn finish_str(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop => "stop",
        FinishReason::Length | FinishReason::ContextFull => "length",
    }
}

/// Response tool calls (`index` in streamed deltas); each keeps the id the service gave it.
pub fn out_calls(calls: &[ToolCall], start: usize, with_index: bool) -> Vec<OutToolCall> {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| OutToolCall {
            index: with_index.then_some(start + i),
            id: c.id.clone().unwrap_or_else(|| service::call_id(None)),
            kind: "function".into(),
            function: OutFunctionCall {
                name: c.name.clone(),
                arguments: c.arguments.to_string(),
            },
        })
        .collect()
}

/// Seconds since the Unix epoch.
pub fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A response id.
pub fn new_id(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

/// A non-streamed chat completion (`POST /v1/chat/completions`).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatCompletion {
    /// Response id.
    pub id: String,
    /// `chat.completion`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// The tier that answered (the cascade's model id for a cascade request).
    pub model: String,
    /// One choice.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: OutUsage,
    /// The prompt's token ids (with `return_token_ids`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<i32>>,
    /// mesh's own details: tier, seed, cascade steps, routing.
    #[schema(value_type = Object)]
    pub mesh: Value,
}

/// A choice of a chat completion.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatChoice {
    /// Always 0.
    pub index: u32,
    /// The answer.
    pub message: OutMessage,
    /// `stop`, `length` or `tool_calls`.
    pub finish_reason: String,
    /// The answer's token ids (with `return_token_ids`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<i32>>,
    /// Always null.
    #[schema(value_type = Option<Object>)]
    pub logprobs: Option<Value>,
}

/// The assistant message of a choice.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct OutMessage {
    /// `assistant`.
    pub role: String,
    /// The answer text; null when the answer is only tool calls.
    pub content: Option<String>,
    /// The `<think>` span, when the model reasoned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// Calls the model made.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<OutToolCall>,
}

/// A non-streamed text completion (`POST /v1/completions`).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TextCompletion {
    /// Response id.
    pub id: String,
    /// `text_completion`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// The tier that answered.
    pub model: String,
    /// One choice.
    pub choices: Vec<TextChoice>,
    /// Token counts.
    pub usage: OutUsage,
    /// mesh's own details.
    #[schema(value_type = Object)]
    pub mesh: Value,
}

/// A choice of a text completion.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TextChoice {
    /// Always 0.
    pub index: u32,
    /// The generated text.
    pub text: String,
    /// `stop` or `length`.
    pub finish_reason: String,
    /// Always null.
    #[schema(value_type = Option<Object>)]
    pub logprobs: Option<Value>,
}

/// `logprobs` of a chat choice: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
pub fn logprobs_json(lp: &[TokenLogprobs]) -> Value {
    let entry = |e: &LogprobEntry| json!({"token": String::from_utf8_lossy(&e.bytes), "logprob": e.logprob, "bytes": e.bytes});
    let content: Vec<Value> = lp
        .iter()
        .map(|t| {
            let mut v = entry(&t.token);
            v["top_logprobs"] = Value::Array(t.top.iter().map(entry).collect());
            v
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// `logprobs` of a text completion choice (the legacy shape): tokens, their
/// log-probabilities, each position's alternatives, and text offsets.
pub fn completion_logprobs_json(lp: &[TokenLogprobs]) -> Value {
    let text = |e: &LogprobEntry| String::from_utf8_lossy(&e.bytes).into_owned();
    let mut offset = 0usize;
    let mut offsets = vec![];
    for t in lp {
        offsets.push(offset);
        offset += text(&t.token).len();
    }
    json!({
        "tokens": lp.iter().map(|t| text(&t.token)).collect::<Vec<_>>(),
        "token_logprobs": lp.iter().map(|t| t.token.logprob).collect::<Vec<_>>(),
        "top_logprobs": lp.iter().map(|t| {
            t.top.iter().map(|e| (text(e), json!(e.logprob))).collect::<serde_json::Map<_, _>>()
        }).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

/// A non-streamed chat completion body (`logprobs` when the request asked for them).
pub fn chat_body(c: &Completion, logprobs: bool) -> ChatCompletion {
    let parsed = &c.output;
    let finish = if !parsed.tool_calls.is_empty() {
        "tool_calls"
    } else {
        finish_str(c.finish)
    };
    let content = if parsed.content.is_empty() && !parsed.tool_calls.is_empty() {
        None
    } else {
        Some(parsed.content.clone())
    };
    ChatCompletion {
        id: new_id("chatcmpl"),
        object: "chat.completion".into(),
        created: now_s(),
        model: c.model.clone(),
        choices: vec![ChatChoice {
            index: 0,
            message: OutMessage {
                role: "assistant".into(),
                content,
                reasoning_content: parsed.reasoning.clone(),
                tool_calls: out_calls(&parsed.tool_calls, 0, false),
            },
            finish_reason: finish.into(),
            token_ids: c.prompt_token_ids.as_ref().map(|_| c.token_ids.clone()),
            logprobs: logprobs.then(|| logprobs_json(&c.logprobs)),
        }],
        usage: OutUsage::from(c.usage),
        prompt_token_ids: c.prompt_token_ids.clone(),
        mesh: mesh_json(&c.mesh),
    }
}

/// The `mesh` block of a response.
pub fn mesh_json(m: &MeshInfo) -> Value {
    serde_json::to_value(m).expect("serializable")
}

// ---------------------------------------------------------------------------
// Held-out tasks as requests (tests, examples)

/// A held-out task as the chat completion body that renders to exactly its prompt (see
/// [`crate::service::tuner::task_call`]).
pub fn task_request(
    task: &service::tuner::Task,
    model: &str,
    max_tokens: usize,
) -> Result<Value, String> {
    let call = service::tuner::task_call(task, model, max_tokens)?;
    let mut messages = vec![];
    let mut last_call_ids: Vec<String> = vec![];
    let mut answered = 0;
    for m in &call.messages {
        match m.role {
            Role::Assistant => {
                last_call_ids.clear();
                answered = 0;
                let calls: Vec<Value> = m
                    .tool_calls
                    .iter()
                    .enumerate()
                    .map(|(i, c)| {
                        let id = format!("call_{}_{i}", messages.len());
                        last_call_ids.push(id.clone());
                        json!({"id": id, "type": "function", "function": {
                            "name": c.name, "arguments": c.arguments.to_string()}})
                    })
                    .collect();
                let text = (!m.content.is_empty()).then_some(m.content.clone());
                messages.push(json!({"role": "assistant", "content": text, "tool_calls": calls}));
            }
            Role::Tool => {
                let id = last_call_ids.get(answered).cloned();
                answered += 1;
                messages.push(json!({"role": "tool", "content": m.content, "tool_call_id": id}));
            }
            r => messages.push(json!({"role": r, "content": m.content})),
        }
    }
    let tools: Vec<Value> = call
        .tools
        .iter()
        .map(|t| json!({"type": "function", "function": t}))
        .collect();
    Ok(json!({
        "model": model,
        "messages": messages,
        "tools": tools,
        "temperature": 0,
        "max_tokens": max_tokens,
    }))
}

/// The model's text as the held-out scorer reads it, rebuilt from a chat completion body:
/// reasoning in a think block, the content, then each call.
pub fn response_text(body: &Value) -> String {
    let m = &body["choices"][0]["message"];
    let calls: Vec<ToolCall> = m["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| ToolCall {
            name: c["function"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            arguments: c["function"]["arguments"]
                .as_str()
                .and_then(|a| serde_json::from_str::<Value>(a).ok())
                .unwrap_or(Value::Null),
            id: None,
        })
        .collect();
    service::tuner::scored_text(
        m["reasoning_content"].as_str(),
        m["content"].as_str().unwrap_or_default(),
        &calls,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_heldout_task_renders_back_to_its_prompt_through_the_json_body() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let tasks =
            mesh_tiers::eval::load_tasks(&root.join("models/fixtures/eval-heldout.jsonl")).unwrap();
        for t in &tasks {
            let body = task_request(t, "t1", 64).unwrap();
            let r: ChatRequest = serde_json::from_value(body).unwrap();
            let call = r.into_call().unwrap();
            let p = crate::service::chat::prepare(&call, None).unwrap();
            let text = mesh_tiers::chat::mesh_tiers_format()
                .render_text(&p.input)
                .unwrap();
            assert_eq!(text, t.prompt, "{} task", t.kind);
        }
    }

    #[test]
    fn response_bodies_score_like_raw_text() {
        let t = mesh_tiers::eval::Task {
            kind: "hard".into(),
            sub: "plan".into(),
            split: "s".into(),
            prompt: String::new(),
            completion: r#"<think>two</think><tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call><|end|>"#.into(),
        };
        let body = json!({"choices": [{"message": {"role": "assistant", "content": null,
            "reasoning_content": "two",
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "a", "arguments": "{\"x\":1}"}},
                {"id": "2", "type": "function", "function": {"name": "b", "arguments": "{}"}}]}}]});
        assert!(mesh_tiers::eval::exact(&t, &response_text(&body)));
        let wrong = json!({"choices": [{"message": {"content": null, "tool_calls": [
            {"function": {"name": "a", "arguments": "{\"x\":2}"}}]}}]});
        assert!(!mesh_tiers::eval::exact(&t, &response_text(&wrong)));
    }

    #[test]
    fn a_bad_role_names_its_message() {
        let m: Vec<InMessage> = serde_json::from_value(
            json!([{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]),
        )
        .unwrap();
        let e = to_messages(&m).unwrap_err();
        assert_eq!(e.0.param.as_deref(), Some("messages[1].role"));
    }

    #[test]
    fn an_unknown_tool_choice_is_refused_on_its_field() {
        let e = to_tool_choice(Some(&json!("sometimes"))).unwrap_err();
        assert_eq!(e.0.param.as_deref(), Some("tool_choice"));
        assert_eq!(
            to_tool_choice(Some(
                &json!({"type": "function", "function": {"name": "f"}})
            ))
            .unwrap(),
            ToolChoice::Named("f".into())
        );
    }
}
