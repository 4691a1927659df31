//! Anthropic's Messages API wire types (the subset mesh serves), their translation to and
//! from the service layer's typed calls, and the event sequence of a streamed message.
//!
//! A request becomes the same [`ChatCall`] an OpenAI chat request becomes: `system` the
//! first message, `tool_use` blocks an assistant turn's calls, `tool_result` blocks tool
//! messages, `tool_choice` `any` the OpenAI `required`, `thinking.budget_tokens` the
//! reasoning governor's cap. Unknown request fields (`metadata`, `cache_control`) are
//! ignored; content mesh cannot honour (images, documents, server tools) is refused with
//! a 400 naming the field.
//!
//! Usage follows Anthropic's convention: `input_tokens` counts the prompt tokens that
//! were computed, `cache_read_input_tokens` those reused from a slot or restored from KV
//! pages; their sum is the prompt.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use utoipa::ToSchema;

use super::error::ApiError;
use super::openai::mesh_json;
use crate::service::{
    ChatCall, ChatMessage, Completion, Delta, FinishReason, Role, Sampling, ToolCall, ToolChoice,
    ToolSpec, Usage,
};

/// `POST /v1/messages` (and `/v1/messages/count_tokens`) body.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[schema(example = json!({"model": "t1", "max_tokens": 16,
    "messages": [{"role": "user", "content": "What is the forecast in Lima on 2026-03-02?"}]}))]
pub struct MessagesRequest {
    /// Model id (a tier name or the cascade's, see `GET /v1/models`).
    pub model: String,
    /// The conversation: alternating `user` and `assistant` turns.
    pub messages: Vec<AnthropicMessage>,
    /// System prompt: text or an array of text blocks.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub system: Option<Value>,
    /// Completion budget; required by `/v1/messages`.
    pub max_tokens: Option<usize>,
    /// Tools the model may call.
    #[serde(default)]
    pub tools: Vec<AnthropicTool>,
    /// `{"type": "auto" | "any" | "none"}` or `{"type": "tool", "name": ...}`.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    /// Strings that end generation.
    #[serde(default)]
    pub stop_sequences: Vec<String>,
    /// Sampling temperature (unset or 0: greedy). Current Anthropic clients no longer send
    /// sampling fields; older ones and raw requests may.
    pub temperature: Option<f32>,
    /// Nucleus mass.
    pub top_p: Option<f32>,
    /// Top-k.
    pub top_k: Option<i32>,
    /// Stream with server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// `{"type": "enabled", "budget_tokens": N}` caps reasoning at N tokens;
    /// `{"type": "disabled"}` closes the think block at once. Unset: the node's governor.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub thinking: Option<Value>,
    /// Sampling seed (extension).
    pub seed: Option<u64>,
}

/// A turn of the conversation.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct AnthropicMessage {
    /// `user` or `assistant`.
    pub role: String,
    /// Text, or an array of `text`, `tool_use`, `tool_result` (and `thinking`) blocks.
    #[schema(value_type = Object)]
    pub content: Value,
}

/// A tool offered by the client.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct AnthropicTool {
    /// Name.
    pub name: String,
    /// Description.
    #[serde(default)]
    pub description: Option<String>,
    /// JSON schema of the input.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub input_schema: Option<Value>,
    /// `custom` or absent; server tools (`web_search_...`) are not served.
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
}

/// `usage` of a message.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, Default, PartialEq, Eq, ToSchema)]
pub struct MessageUsage {
    /// Prompt tokens computed for this request.
    pub input_tokens: usize,
    /// Generated tokens.
    pub output_tokens: usize,
    /// Prompt tokens reused from a slot's kept KV or restored from KV pages.
    pub cache_read_input_tokens: usize,
    /// Always 0: mesh keeps prefixes without being asked to.
    pub cache_creation_input_tokens: usize,
}

impl From<Usage> for MessageUsage {
    fn from(u: Usage) -> Self {
        let cached = u.cached_tokens.min(u.prompt_tokens);
        Self {
            input_tokens: u.prompt_tokens - cached,
            output_tokens: u.completion_tokens,
            cache_read_input_tokens: cached,
            cache_creation_input_tokens: 0,
        }
    }
}

/// A non-streamed message (`POST /v1/messages`).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Message {
    /// `msg_...`.
    pub id: String,
    /// `message`.
    #[serde(rename = "type")]
    pub kind: String,
    /// `assistant`.
    pub role: String,
    /// The tier that answered (the cascade's model id for a cascade request).
    pub model: String,
    /// `thinking`, `text` and `tool_use` blocks, in that order.
    #[schema(value_type = Vec<Object>)]
    pub content: Vec<Value>,
    /// `end_turn`, `max_tokens`, `stop_sequence` or `tool_use`.
    pub stop_reason: String,
    /// The stop sequence that ended the message, when one did.
    pub stop_sequence: Option<String>,
    /// Token counts.
    pub usage: MessageUsage,
    /// mesh's own details: tier, seed, cascade steps, routing.
    #[schema(value_type = Object)]
    pub mesh: Value,
}

/// `POST /v1/messages/count_tokens` answer.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TokenCount {
    /// Prompt tokens of the request as it would be rendered.
    pub input_tokens: usize,
}

/// Error body, Anthropic's shape.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AnthropicErrorBody {
    /// `error`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The error.
    pub error: AnthropicErrorDetail,
}

/// Error details.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AnthropicErrorDetail {
    /// `invalid_request_error`, `authentication_error`, `permission_error`,
    /// `not_found_error`, `request_too_large`, `rate_limit_error`, `api_error`,
    /// `overloaded_error`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Human-readable reason.
    pub message: String,
}

/// Anthropic's error `type` for a status.
pub fn error_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

// ---------------------------------------------------------------------------
// Requests into typed calls

fn bad(message: impl Into<String>, param: &str) -> ApiError {
    ApiError::bad_request(message, Some(param))
}

/// Text of a `system` field or a `tool_result`'s `content`: a string or text blocks.
fn text_of(v: &Value, param: &str) -> Result<String, ApiError> {
    match v {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut text = String::new();
            for (i, b) in blocks.iter().enumerate() {
                match (
                    b.get("type").and_then(Value::as_str),
                    b.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (kind, _) => {
                        return Err(bad(
                            format!(
                                "unsupported block type `{}`; only `text` is served here",
                                kind.unwrap_or("?")
                            ),
                            &format!("{param}[{i}]"),
                        ))
                    }
                }
            }
            Ok(text)
        }
        _ => Err(bad("expected a string or an array of text blocks", param)),
    }
}

/// The conversation of a request: `system` first, then each turn. A user turn's
/// `tool_result` blocks become tool messages (in block order) ahead of its text; an
/// assistant turn's `tool_use` blocks become its calls; `thinking` blocks of earlier
/// turns are dropped, as chat templates drop earlier reasoning.
pub fn to_messages(
    system: Option<&Value>,
    input: &[AnthropicMessage],
) -> Result<Vec<ChatMessage>, ApiError> {
    let mut out = Vec::new();
    if let Some(s) = system {
        let text = text_of(s, "system")?;
        if !text.is_empty() {
            out.push(ChatMessage::text(Role::System, text));
        }
    }
    for (i, m) in input.iter().enumerate() {
        let at = |f: &str| format!("messages[{i}].{f}");
        let assistant = match m.role.as_str() {
            "user" => false,
            "assistant" => true,
            other => {
                return Err(bad(
                    format!("unsupported role `{other}`; turns are `user` or `assistant` (the system prompt is the top-level `system`)"),
                    &at("role"),
                ))
            }
        };
        let blocks = match &m.content {
            Value::String(s) => vec![json!({"type": "text", "text": s})],
            Value::Array(b) => b.clone(),
            _ => {
                return Err(bad(
                    "content must be a string or an array of content blocks",
                    &at("content"),
                ))
            }
        };
        let mut text = String::new();
        let mut calls = Vec::new();
        let mut results = Vec::new();
        for (j, b) in blocks.iter().enumerate() {
            let param = at(&format!("content[{j}]"));
            let kind = b.get("type").and_then(Value::as_str).unwrap_or("?");
            match (kind, assistant) {
                ("text", _) => match b.get("text").and_then(Value::as_str) {
                    Some(t) => text.push_str(t),
                    None => return Err(bad("a text block needs `text`", &param)),
                },
                ("tool_use", true) => {
                    let name = b.get("name").and_then(Value::as_str).unwrap_or_default();
                    if name.is_empty() {
                        return Err(bad("a tool_use block needs `name`", &param));
                    }
                    let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
                    if !input.is_object() {
                        return Err(bad("a tool_use block's `input` must be an object", &param));
                    }
                    calls.push(ToolCall {
                        name: name.to_owned(),
                        arguments: input,
                        id: b.get("id").and_then(Value::as_str).map(from_tool_use_id),
                    });
                }
                ("tool_result", false) => {
                    let content = text_of(
                        b.get("content").unwrap_or(&Value::Null),
                        &format!("{param}.content"),
                    )?;
                    let is_error = b.get("is_error").and_then(Value::as_bool) == Some(true);
                    let id = b
                        .get("tool_use_id")
                        .and_then(Value::as_str)
                        .map(from_tool_use_id);
                    results.push((
                        if is_error {
                            format!("Error: {content}")
                        } else {
                            content
                        },
                        id,
                    ));
                }
                ("thinking" | "redacted_thinking", true) => {}
                (k, _) => {
                    return Err(bad(
                        format!("unsupported content block `{k}` in a {} turn", m.role),
                        &param,
                    ))
                }
            }
        }
        if assistant {
            out.push(ChatMessage {
                role: Role::Assistant,
                content: text,
                tool_calls: calls,
                ..ChatMessage::default()
            });
        } else {
            out.extend(results.into_iter().map(|(r, id)| ChatMessage {
                tool_call_id: id,
                ..ChatMessage::text(Role::Tool, r)
            }));
            if !text.is_empty() {
                out.push(ChatMessage::text(Role::User, text));
            }
        }
    }
    Ok(out)
}

/// The tools of a request, checked.
pub fn to_tools(input: &[AnthropicTool]) -> Result<Vec<ToolSpec>, ApiError> {
    input
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if let Some(k) = t.kind.as_deref().filter(|k| *k != "custom") {
                return Err(bad(
                    format!("unsupported tool type `{k}`; only client tools (`custom`) are served"),
                    &format!("tools[{i}].type"),
                ));
            }
            if t.name.is_empty() {
                return Err(bad(
                    "tool name must not be empty",
                    &format!("tools[{i}].name"),
                ));
            }
            let parameters = t
                .input_schema
                .clone()
                .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
            if !parameters.is_object() {
                return Err(bad(
                    "input_schema must be a JSON schema object",
                    &format!("tools[{i}].input_schema"),
                ));
            }
            Ok(ToolSpec {
                name: t.name.clone(),
                description: t.description.clone().unwrap_or_default(),
                parameters,
            })
        })
        .collect()
}

/// `tool_choice`: `auto`, `any` (some tool must be called), `tool` (this one), `none`.
pub fn to_tool_choice(v: Option<&Value>) -> Result<ToolChoice, ApiError> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(ToolChoice::Unset);
    };
    match v.get("type").and_then(Value::as_str) {
        Some("auto") => Ok(ToolChoice::Auto),
        Some("any") => Ok(ToolChoice::Required),
        Some("none") => Ok(ToolChoice::None),
        Some("tool") => v
            .get("name")
            .and_then(Value::as_str)
            .map(|n| ToolChoice::Named(n.to_owned()))
            .ok_or_else(|| {
                bad(
                    "tool_choice of type `tool` needs `name`",
                    "tool_choice.name",
                )
            }),
        Some(other) => Err(bad(
            format!("unsupported tool_choice type `{other}`; expected auto, any, tool or none"),
            "tool_choice.type",
        )),
        None => Err(bad(
            "tool_choice must be an object with a `type`",
            "tool_choice",
        )),
    }
}

/// `thinking` as the reasoning governor's cap: `enabled` with `budget_tokens`, `disabled`
/// (0), or unset, `adaptive` or `between_tools` (the node's governor).
pub fn to_reasoning_budget(v: Option<&Value>) -> Result<Option<usize>, ApiError> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    match v.get("type").and_then(Value::as_str) {
        Some("enabled") => v
            .get("budget_tokens")
            .and_then(Value::as_u64)
            .map(|n| Some(n as usize))
            .ok_or_else(|| {
                bad(
                    "thinking of type `enabled` needs a non-negative integer `budget_tokens`",
                    "thinking.budget_tokens",
                )
            }),
        Some("disabled") => Ok(Some(0)),
        Some("adaptive" | "between_tools") => Ok(None),
        _ => Err(bad(
            "thinking must be {\"type\": \"enabled\", \"budget_tokens\": N} or {\"type\": \"disabled\"}",
            "thinking",
        )),
    }
}

impl MessagesRequest {
    /// The typed call. `need_max_tokens`: `/v1/messages` requires `max_tokens`,
    /// `count_tokens` does not.
    pub fn into_call(self, need_max_tokens: bool) -> Result<ChatCall, ApiError> {
        if need_max_tokens && self.max_tokens.is_none() {
            return Err(bad("max_tokens: field required", "max_tokens"));
        }
        if self.messages.is_empty() {
            return Err(bad("messages must not be empty", "messages"));
        }
        Ok(ChatCall {
            messages: to_messages(self.system.as_ref(), &self.messages)?,
            tools: to_tools(&self.tools)?,
            tool_choice: to_tool_choice(self.tool_choice.as_ref())?,
            max_tokens: self.max_tokens,
            sampling: Sampling {
                temperature: self.temperature,
                top_p: self.top_p,
                top_k: self.top_k,
                seed: self.seed,
            },
            stop: self.stop_sequences,
            reasoning_budget: to_reasoning_budget(self.thinking.as_ref())?,
            ignore_eos: false,
            model: self.model,
            ..ChatCall::default()
        })
    }
}

// ---------------------------------------------------------------------------
// Responses

/// `stop_reason` and `stop_sequence` of a finished message.
pub fn stop_reason(
    finish: FinishReason,
    stop_index: Option<usize>,
    stops: &[String],
    called: bool,
) -> (&'static str, Option<String>) {
    if called {
        return ("tool_use", None);
    }
    match (finish, stop_index.and_then(|i| stops.get(i))) {
        (FinishReason::Stop, Some(s)) => ("stop_sequence", Some(s.clone())),
        (FinishReason::Stop, None) => ("end_turn", None),
        (FinishReason::Length | FinishReason::ContextFull, _) => ("max_tokens", None),
    }
}

/// A `tool_use` block's id.
pub fn tool_use_id() -> String {
    format!("toolu_{}", &uuid::Uuid::new_v4().simple().to_string()[..24])
}

fn tool_use_block(c: &ToolCall) -> Value {
    let input = if c.arguments.is_object() {
        c.arguments.clone()
    } else {
        json!({})
    };
    let id = c.id.as_deref().map_or_else(tool_use_id, to_tool_use_id);
    json!({"type": "tool_use", "id": id, "name": c.name, "input": input})
}

/// A call id as Anthropic's clients know them: `call_X` becomes `toolu_X` (ids a model's
/// format requires in another shape, Mistral's nine characters, stay as they are).
fn to_tool_use_id(id: &str) -> String {
    match id.strip_prefix("call_") {
        Some(rest) => format!("toolu_{rest}"),
        None => id.to_owned(),
    }
}

/// The call id a `tool_use` / `tool_result` block's id stands for ([`to_tool_use_id`] back).
fn from_tool_use_id(id: &str) -> String {
    match id.strip_prefix("toolu_") {
        Some(rest) => format!("call_{rest}"),
        None => id.to_owned(),
    }
}

/// A message id.
pub fn message_id() -> String {
    format!("msg_{}", uuid::Uuid::new_v4().simple())
}

/// A non-streamed message body.
pub fn message_body(c: &Completion, stops: &[String]) -> Message {
    let parsed = &c.output;
    let mut content = Vec::new();
    if let Some(r) = &parsed.reasoning {
        content.push(json!({"type": "thinking", "thinking": r, "signature": ""}));
    }
    if !parsed.content.is_empty() || parsed.tool_calls.is_empty() {
        content.push(json!({"type": "text", "text": parsed.content}));
    }
    content.extend(parsed.tool_calls.iter().map(tool_use_block));
    let (reason, seq) = stop_reason(
        c.finish,
        c.usage.stop_index,
        stops,
        !parsed.tool_calls.is_empty(),
    );
    Message {
        id: message_id(),
        kind: "message".into(),
        role: "assistant".into(),
        model: c.model.clone(),
        content,
        stop_reason: reason.into(),
        stop_sequence: seq,
        usage: MessageUsage::from(c.usage),
        mesh: mesh_json(&c.mesh),
    }
}

// ---------------------------------------------------------------------------
// The event sequence of a streamed message

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    Text,
    Thinking,
}

/// Turns the pieces of a streamed answer into Anthropic's events, `(event name, data)`:
/// `message_start`; per block `content_block_start`, its deltas (`text_delta`,
/// `thinking_delta`, one `input_json_delta` with a tool call's whole input),
/// `content_block_stop`; then `message_delta` with the stop reason and usage, and
/// `message_stop`. Pure: the handler feeds it and sends what it returns.
#[derive(Debug)]
pub struct MessageEvents {
    open: Option<Block>,
    next_index: usize,
    calls: usize,
}

impl MessageEvents {
    /// The stream's first event and the state that continues it.
    pub fn start(id: &str, model: &str) -> (Self, (&'static str, Value)) {
        let start = json!({"type": "message_start", "message": {
            "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 0, "output_tokens": 0,
                      "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}}});
        (
            Self {
                open: None,
                next_index: 0,
                calls: 0,
            },
            ("message_start", start),
        )
    }

    fn close(&mut self, out: &mut Vec<(&'static str, Value)>) {
        if let Some(b) = self.open.take() {
            let index = self.next_index - 1;
            if b == Block::Thinking {
                out.push((
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": index,
                           "delta": {"type": "signature_delta", "signature": ""}}),
                ));
            }
            out.push((
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            ));
        }
    }

    fn open(&mut self, block: Value, out: &mut Vec<(&'static str, Value)>) -> usize {
        let index = self.next_index;
        self.next_index += 1;
        out.push((
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": block}),
        ));
        index
    }

    fn text(&mut self, kind: Block, t: &str, out: &mut Vec<(&'static str, Value)>) {
        if t.is_empty() {
            return;
        }
        if self.open != Some(kind) {
            self.close(out);
            let block = match kind {
                Block::Text => json!({"type": "text", "text": ""}),
                Block::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
            };
            self.open(block, out);
            self.open = Some(kind);
        }
        let delta = match kind {
            Block::Text => json!({"type": "text_delta", "text": t}),
            Block::Thinking => json!({"type": "thinking_delta", "thinking": t}),
        };
        out.push((
            "content_block_delta",
            json!({"type": "content_block_delta", "index": self.next_index - 1, "delta": delta}),
        ));
    }

    /// The events for one piece of output.
    pub fn piece(&mut self, d: Delta) -> Vec<(&'static str, Value)> {
        let mut out = Vec::new();
        match d {
            Delta::Content(t) => self.text(Block::Text, &t, &mut out),
            Delta::Reasoning(t) => self.text(Block::Thinking, &t, &mut out),
            Delta::Call(c) => {
                self.close(&mut out);
                let mut block = tool_use_block(&c);
                let input = std::mem::replace(&mut block["input"], json!({}));
                let index = self.open(block, &mut out);
                out.push((
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": index,
                           "delta": {"type": "input_json_delta", "partial_json": input.to_string()}}),
                ));
                out.push((
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": index}),
                ));
                self.calls += 1;
            }
        }
        out
    }

    /// The closing events: the open block's stop (an empty text block when the answer
    /// had none), `message_delta` and `message_stop`.
    pub fn finish(
        &mut self,
        finish: FinishReason,
        usage: Usage,
        stops: &[String],
    ) -> Vec<(&'static str, Value)> {
        let mut out = Vec::new();
        if self.next_index == 0 {
            self.open(json!({"type": "text", "text": ""}), &mut out);
            self.open = Some(Block::Text);
        }
        self.close(&mut out);
        let (reason, seq) = stop_reason(finish, usage.stop_index, stops, self.calls > 0);
        let u = MessageUsage::from(usage);
        out.push((
            "message_delta",
            json!({"type": "message_delta",
                   "delta": {"stop_reason": reason, "stop_sequence": seq},
                   "usage": u}),
        ));
        out.push(("message_stop", json!({"type": "message_stop"})));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(v: Value) -> Vec<AnthropicMessage> {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn tool_results_become_tool_messages_ahead_of_the_turns_text() {
        let m = msgs(json!([
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "x"},
                {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Lima"}}]},
            {"role": "user", "content": [
                {"type": "text", "text": "and then?"},
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]}]}
        ]));
        let out = to_messages(Some(&json!("be brief")), &m).unwrap();
        let roles: Vec<Role> = out.iter().map(|m| m.role).collect();
        assert_eq!(
            roles,
            vec![
                Role::System,
                Role::User,
                Role::Assistant,
                Role::Tool,
                Role::User
            ]
        );
        assert_eq!(out[2].tool_calls[0].arguments, json!({"city": "Lima"}));
        assert_eq!(out[2].content, "");
        assert_eq!(out[3].content, "sunny");
    }

    #[test]
    fn call_ids_go_out_as_tool_use_ids_and_come_back() {
        assert_eq!(to_tool_use_id("call_abc"), "toolu_abc");
        assert_eq!(from_tool_use_id("toolu_abc"), "call_abc");
        // Mistral's nine-character ids are kept as they are.
        assert_eq!(to_tool_use_id("a1b2c3d4e"), "a1b2c3d4e");
        assert_eq!(from_tool_use_id("a1b2c3d4e"), "a1b2c3d4e");
    }

    #[test]
    fn an_image_block_is_refused_on_its_field() {
        let m = msgs(json!([{"role": "user", "content": [
            {"type": "text", "text": "look"}, {"type": "image", "source": {}}]}]));
        let e = to_messages(None, &m).unwrap_err();
        assert_eq!(e.0.param.as_deref(), Some("messages[0].content[1]"));
    }

    #[test]
    fn a_system_role_inside_messages_is_refused() {
        let m = msgs(json!([{"role": "system", "content": "x"}]));
        let e = to_messages(None, &m).unwrap_err();
        assert_eq!(e.0.param.as_deref(), Some("messages[0].role"));
    }

    #[test]
    fn tool_choice_any_means_some_tool_must_be_called() {
        assert_eq!(
            to_tool_choice(Some(&json!({"type": "any"}))).unwrap(),
            ToolChoice::Required
        );
        assert_eq!(
            to_tool_choice(Some(&json!({"type": "tool", "name": "f"}))).unwrap(),
            ToolChoice::Named("f".into())
        );
        assert!(to_tool_choice(Some(&json!({"type": "tool"}))).is_err());
    }

    #[test]
    fn thinking_maps_to_the_governors_cap() {
        let b = |v: Value| to_reasoning_budget(Some(&v));
        assert_eq!(
            b(json!({"type": "enabled", "budget_tokens": 64})).unwrap(),
            Some(64)
        );
        assert_eq!(b(json!({"type": "disabled"})).unwrap(), Some(0));
        assert_eq!(to_reasoning_budget(None).unwrap(), None);
        assert!(b(json!({"type": "enabled"})).is_err());
    }

    #[test]
    fn a_request_without_max_tokens_is_refused_but_counted() {
        let r: MessagesRequest = serde_json::from_value(
            json!({"model": "t1", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .unwrap();
        let e = r.clone().into_call(true).unwrap_err();
        assert_eq!(e.0.param.as_deref(), Some("max_tokens"));
        assert!(r.into_call(false).is_ok());
    }

    #[test]
    fn a_server_tool_is_refused() {
        let t: Vec<AnthropicTool> =
            serde_json::from_value(json!([{"type": "web_search_20250305", "name": "web_search"}]))
                .unwrap();
        assert_eq!(
            to_tools(&t).unwrap_err().0.param.as_deref(),
            Some("tools[0].type")
        );
    }

    #[test]
    fn the_matched_stop_sequence_is_named() {
        let stops = vec!["END".to_string(), "###".to_string()];
        assert_eq!(
            stop_reason(FinishReason::Stop, Some(1), &stops, false),
            ("stop_sequence", Some("###".into()))
        );
        assert_eq!(
            stop_reason(FinishReason::Stop, None, &stops, false),
            ("end_turn", None)
        );
        assert_eq!(
            stop_reason(FinishReason::Length, None, &stops, false),
            ("max_tokens", None)
        );
        assert_eq!(
            stop_reason(FinishReason::Stop, None, &stops, true),
            ("tool_use", None)
        );
    }

    #[test]
    fn cached_prompt_tokens_are_not_counted_as_input() {
        let u = MessageUsage::from(Usage {
            prompt_tokens: 700,
            completion_tokens: 5,
            cached_tokens: 640,
            ..Usage::default()
        });
        assert_eq!((u.input_tokens, u.cache_read_input_tokens), (60, 640));
    }

    fn names(evs: &[(&'static str, Value)]) -> Vec<String> {
        evs.iter()
            .map(|(n, v)| match v["delta"]["type"].as_str() {
                Some(d) => format!("{n}:{d}"),
                None => n.to_string(),
            })
            .collect()
    }

    #[test]
    fn a_streamed_answer_opens_and_closes_one_block_per_kind_change() {
        let (mut s, first) = MessageEvents::start("msg_1", "t1");
        let mut evs = vec![first];
        for p in [
            Delta::Reasoning("a".into()),
            Delta::Reasoning("b".into()),
            Delta::Content("x".into()),
            Delta::Call(ToolCall::new("f", json!({"k": 1}))),
        ] {
            evs.extend(s.piece(p));
        }
        evs.extend(s.finish(FinishReason::Stop, Usage::default(), &[]));
        assert_eq!(
            names(&evs),
            vec![
                "message_start",
                "content_block_start",
                "content_block_delta:thinking_delta",
                "content_block_delta:thinking_delta",
                "content_block_delta:signature_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta:text_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta:input_json_delta",
                "content_block_stop",
                "message_delta",
                "message_stop",
            ]
        );
        let starts: Vec<u64> = evs
            .iter()
            .filter(|(n, _)| *n == "content_block_start")
            .map(|(_, v)| v["index"].as_u64().unwrap())
            .collect();
        assert_eq!(starts, vec![0, 1, 2]);
        assert_eq!(evs[12].1["delta"]["stop_reason"], "tool_use");
        let json: Value =
            serde_json::from_str(evs[10].1["delta"]["partial_json"].as_str().unwrap()).unwrap();
        assert_eq!(json, json!({"k": 1}));
    }

    #[test]
    fn an_empty_answer_still_has_one_text_block() {
        let (mut s, _) = MessageEvents::start("msg_1", "t1");
        let evs = s.finish(FinishReason::Length, Usage::default(), &[]);
        assert_eq!(
            names(&evs),
            vec![
                "content_block_start",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        assert_eq!(evs[2].1["delta"]["stop_reason"], "max_tokens");
    }
}
