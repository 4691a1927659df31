//! OpenAI-compatible wire types (the subset mesh serves, plus `mesh` extensions).
//!
//! Unknown request fields are ignored, as OpenAI clients send many optional
//! ones; fields mesh cannot honour (`n > 1`, unsupported content parts) are
//! refused with a 400 naming the field.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `POST /v1/chat/completions` body.
#[derive(Debug, Clone, Deserialize)]
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
}

/// `stream_options`.
#[derive(Debug, Clone, Deserialize)]
pub struct StreamOptions {
    /// Send a final chunk with usage.
    #[serde(default)]
    pub include_usage: bool,
}

/// `stop`: one string or several.
#[derive(Debug, Clone, Deserialize)]
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
#[derive(Debug, Clone, Deserialize)]
pub struct InMessage {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// Text, or an array of content parts, or null.
    #[serde(default)]
    pub content: Option<Value>,
    /// Calls in an assistant message.
    #[serde(default)]
    pub tool_calls: Vec<InToolCall>,
    /// Which call a tool message answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
}

/// A tool call inside a client message.
#[derive(Debug, Clone, Deserialize)]
pub struct InToolCall {
    /// Call id.
    #[serde(default)]
    pub id: Option<String>,
    /// The function.
    pub function: InFunctionCall,
}

/// Function part of a tool call.
#[derive(Debug, Clone, Deserialize)]
pub struct InFunctionCall {
    /// Name.
    pub name: String,
    /// Arguments as a JSON string (OpenAI) or object.
    pub arguments: Value,
}

/// A tool offered by the client.
#[derive(Debug, Clone, Deserialize)]
pub struct InTool {
    /// Must be `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The function.
    pub function: InFunction,
}

/// Function definition.
#[derive(Debug, Clone, Deserialize)]
pub struct InFunction {
    /// Name.
    pub name: String,
    /// Description.
    #[serde(default)]
    pub description: Option<String>,
    /// JSON schema of the arguments.
    #[serde(default)]
    pub parameters: Option<Value>,
}

/// `POST /v1/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// Model id.
    pub model: String,
    /// Prompt text, a one-element list of text, or token ids.
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
}

/// Token counts in responses.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, Default, PartialEq, Eq)]
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
}

/// `usage.completion_tokens_details`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct CompletionDetails {
    /// Tokens inside the think block.
    pub reasoning_tokens: usize,
}

impl From<mesh_tiers::Usage> for OutUsage {
    fn from(u: mesh_tiers::Usage) -> Self {
        Self {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.prompt_tokens + u.completion_tokens,
            completion_tokens_details: CompletionDetails {
                reasoning_tokens: u.reasoning_tokens,
            },
        }
    }
}

/// A tool call in a response.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
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
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct OutFunctionCall {
    /// Name.
    pub name: String,
    /// Arguments, a JSON document as a string (OpenAI's convention).
    pub arguments: String,
}

/// mesh's extension block on responses.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct MeshInfo {
    /// Tier that produced the answer.
    pub tier: String,
    /// Milliseconds waiting for an engine slot.
    pub queued_ms: u64,
    /// The reasoning governor closed the think block.
    #[serde(default)]
    pub reasoning_capped: bool,
    /// Cascade requests: every tier tried, in order, and its verdict.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cascade: Vec<CascadeStep>,
    /// Requests whose tools were routed: what the router kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router: Option<RouterInfo>,
    /// Requests decoded speculatively on this node: drafted and accepted tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speculative: Option<SpecInfo>,
    /// The local engine that produced the answer (quantization policy); absent when a
    /// peer served it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<EngineInfo>,
}

/// Which engine of a tier served a request.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct EngineInfo {
    /// GGUF file name (`t1-q4_0.gguf`).
    pub gguf: String,
    /// KV cache type (`f16`, `q8_0`, `q4_0`).
    pub kv_type: String,
    /// The request's role (`tool_calls`, `reasoning`, `summaries`).
    pub role: String,
}

/// Speculative decoding of one response (a draft model proposed, the tier verified).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Default)]
pub struct SpecInfo {
    /// Tokens the draft model proposed.
    pub draft_tokens: usize,
    /// Proposed tokens the tier accepted.
    pub accepted_tokens: usize,
}

impl SpecInfo {
    /// The draft counts of a finished generation; none when nothing was drafted.
    pub fn of(u: &mesh_tiers::Usage) -> Option<Self> {
        (u.draft_tokens > 0).then_some(Self {
            draft_tokens: u.draft_tokens,
            accepted_tokens: u.draft_accepted,
        })
    }
}

/// What the tool router did to a request.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct RouterInfo {
    /// Tools the request offered.
    pub offered: usize,
    /// Tools the prompt showed, best first.
    pub shown: Vec<String>,
    /// Cosine of the best tool.
    pub top1: f32,
    /// Top-1 minus top-2 cosine.
    pub margin: f32,
    /// The lexical re-rank ran (the embedding was unsure).
    pub reranked: bool,
}

/// One tier attempt of a cascade request.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct CascadeStep {
    /// Tier.
    pub tier: String,
    /// `accept`, `last_tier`, or why the answer was passed on.
    pub verdict: String,
    /// Smallest logit margin over the tier's tokens.
    pub min_margin: Option<f32>,
    /// Tokens the tier generated.
    pub completion_tokens: usize,
}

/// Error body, OpenAI's shape.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// Error details.
#[derive(Debug, Clone, Serialize, Deserialize)]
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
