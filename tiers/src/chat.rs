//! Messages, tools and calls: what a conversation is, whatever the model's chat format
//! ([`crate::format`]). Also the bundled tiers' own markers and helpers for their
//! evaluations, which read and write that format directly:
//!
//! ```text
//! <|system|>{system}\n<tools>\n{tool json}\n...\n</tools><|end|>
//! <|user|>{text}<|end|>
//! <|assistant|><think>{reasoning}</think><tool_call>{"name": .., "arguments": {..}}</tool_call><|end|>
//! <|tool|>{result}<|end|>
//! <|assistant|>
//! ```

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// System text used when the caller sends none (the one the bundled models were trained with).
pub const DEFAULT_SYSTEM: &str =
    "You are a helpful agent. Call a tool when one fits the request, otherwise answer directly.";
/// Begins a reasoning span.
pub const THINK: &str = "<think>";
/// Ends a reasoning span.
pub const END_THINK: &str = "</think>";
/// Begins a tool call.
pub const CALL: &str = "<tool_call>";
/// Ends a tool call.
pub const END_CALL: &str = "</tool_call>";
/// Ends every turn; the models' end-of-generation token.
pub const END: &str = "<|end|>";

/// A tool the model may call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    /// Function name.
    pub name: String,
    /// What it does.
    #[serde(default)]
    pub description: String,
    /// JSON schema of the arguments object.
    #[serde(default = "empty_object_schema")]
    pub parameters: Value,
}

fn empty_object_schema() -> Value {
    serde_json::json!({"type": "object", "properties": {}})
}

/// Who wrote a message.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions.
    System,
    /// The end user.
    #[default]
    User,
    /// The model.
    Assistant,
    /// A tool result.
    Tool,
}

/// A call the model made.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// Tool name.
    pub name: String,
    /// Arguments object.
    pub arguments: Value,
    /// The call's id, when the model or the client gave one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
}

impl ToolCall {
    /// A call without an id.
    pub fn new(name: impl Into<String>, arguments: Value) -> Self {
        Self {
            name: name.into(),
            arguments,
            id: None,
        }
    }
}

/// One chat message.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// Author.
    pub role: Role,
    /// Text (may be empty for an assistant turn that only calls tools).
    #[serde(default)]
    pub content: String,
    /// Calls made in an assistant turn.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// An assistant turn's reasoning, when the client sends it back (`reasoning_content`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    /// The call a tool result answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The tool a tool result comes from, when the client names it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    /// A plain text message.
    pub fn text(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
            ..Self::default()
        }
    }
}

/// One piece of a rendered prompt: template text, whose marker spellings are the model's
/// control tokens, or content (a message's text, a tool result), which is always tokenized
/// as plain text so that a user cannot open a turn or forge a tool result by typing
/// `<|system|>` or `<tool_call>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptPart {
    /// The text.
    pub text: String,
    /// Whether control-token spellings in `text` become control tokens.
    pub special: bool,
}

impl PromptPart {
    /// Template text: control tokens parsed.
    pub fn template(text: impl Into<String>) -> Self {
        Self {
            text: text.into(),
            special: true,
        }
    }

    /// Content: tokenized as plain text.
    pub fn content(text: impl Into<String>) -> Self {
        Self {
            text: text.into(),
            special: false,
        }
    }
}

/// The whole text of `parts` (what the model reads, control and content alike).
pub fn prompt_text(parts: &[PromptPart]) -> String {
    parts.iter().map(|p| p.text.as_str()).collect()
}

/// The bundled tiers' prompt for the next assistant turn (their chat template,
/// [`crate::format::MESH_TIERS_TEMPLATE`], rendered as text).
pub fn render_prompt(messages: &[ChatMessage], tools: &[ToolSpec]) -> String {
    let input = crate::format::ChatInput {
        messages: messages.to_vec(),
        tools: tools.to_vec(),
        ..Default::default()
    };
    mesh_tiers_format()
        .render_text(&input)
        .expect("the bundled template renders every conversation")
}

/// The bundled tiers' format, compiled once.
pub fn mesh_tiers_format() -> &'static crate::format::ChatFormat {
    static F: std::sync::OnceLock<crate::format::ChatFormat> = std::sync::OnceLock::new();
    F.get_or_init(crate::format::ChatFormat::mesh_tiers)
}

/// The bundled tiers' lazy tool-call grammar over `tools`: every call must be one of them
/// once [`CALL`] (its trigger word) appears.
pub fn tool_call_grammar(tools: &[ToolSpec]) -> Result<String, String> {
    crate::format::grammar::tools(
        &crate::format::FormatSpec::mesh_tiers(),
        tools,
        false,
        false,
    )
    .map(|g| g.grammar)
}

/// `<tool_call>{"name": .., "arguments": ..}</tool_call>`.
pub fn render_call(c: &ToolCall) -> String {
    let v = serde_json::json!({"name": c.name, "arguments": c.arguments});
    format!("{CALL}{}{END_CALL}", py_json(&v))
}

/// Compact JSON the way Python's `json.dumps(v, separators=(", ", ": "))` writes it
/// (non-ASCII escaped): how the bundled tiers' corpus shows tool calls.
pub fn py_json(v: &Value) -> String {
    crate::format::pyjson::Dumps {
        ensure_ascii: true,
        ..Default::default()
    }
    .dumps(v)
}

/// A model turn split into its parts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ParsedOutput {
    /// Text inside `<think>`..`</think>`.
    pub reasoning: Option<String>,
    /// Text outside reasoning and tool calls.
    pub content: String,
    /// Calls that parsed as `{"name": string, "arguments": object}`.
    pub tool_calls: Vec<ToolCall>,
    /// Call spans that did not parse (their text stays in `content`).
    pub malformed_calls: usize,
    /// The reply ended inside its reasoning span.
    pub unclosed_reasoning: bool,
}

/// Splits a bundled tier's generated text (special tokens rendered as text, end token
/// excluded): reasoning, answer and calls to any tool name.
pub fn parse_output(text: &str) -> ParsedOutput {
    use crate::format::parse::{parse_all, ParseOptions, ToolNames};
    parse_all(
        text,
        ParseOptions {
            syntax: Some(crate::format::ToolSyntax::Hermes),
            think: Some(crate::format::ThinkMarkers::default()),
            thinking_open: false,
            tools: ToolNames::Any,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tool() -> ToolSpec {
        ToolSpec {
            name: "weather_get_forecast".into(),
            description: "Get the forecast by city and date.".into(),
            parameters: json!({"type": "object", "properties": {"city": {"type": "string", "description": "City name"}}, "required": ["city"]}),
        }
    }

    #[test]
    fn python_json_escapes_non_ascii() {
        assert_eq!(
            py_json(&json!({"a": "Zürich 😀"})),
            r#"{"a": "Z\u00fcrich \ud83d\ude00"}"#
        );
    }

    #[test]
    fn renders_training_format() {
        let msgs = vec![ChatMessage::text(Role::User, "Forecast for Oslo?")];
        let p = render_prompt(&msgs, &[tool()]);
        assert!(p.starts_with(&format!(
            "<|system|>{DEFAULT_SYSTEM}\n<tools>\n{{\"name\": \"weather_get_forecast\""
        )));
        assert!(p.ends_with("\n</tools><|end|><|user|>Forecast for Oslo?<|end|><|assistant|>"));
    }

    #[test]
    fn renders_tool_turns() {
        let call = ToolCall::new("f", json!({"x": 1}));
        let msgs = vec![
            ChatMessage::text(Role::System, "sys"),
            ChatMessage::text(Role::User, "q"),
            ChatMessage {
                role: Role::Assistant,
                tool_calls: vec![call],
                ..ChatMessage::default()
            },
            ChatMessage::text(Role::Tool, r#"{"status": "ok"}"#),
        ];
        assert_eq!(
            render_prompt(&msgs, &[]),
            r#"<|system|>sys<|end|><|user|>q<|end|><|assistant|><tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call><|end|><|tool|>{"status": "ok"}<|end|><|assistant|>"#
        );
    }

    #[test]
    fn parses_reasoning_and_calls() {
        let p = parse_output(
            r#"<think>2 * 3 = 6</think><tool_call>{"name": "a", "arguments": {"n": 6}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>"#,
        );
        assert_eq!(p.reasoning.as_deref(), Some("2 * 3 = 6"));
        assert_eq!(p.tool_calls.len(), 2);
        assert_eq!(p.tool_calls[0].arguments, json!({"n": 6}));
        assert_eq!(p.content, "");
        assert_eq!(p.malformed_calls, 0);
    }

    #[test]
    fn call_ends_where_its_json_ends() {
        // A string argument holding the closing tag does not end the call.
        let p = parse_output(
            r#"<tool_call>{"name": "a", "arguments": {"q": "x</tool_call> y"}}</tool_call> done"#,
        );
        assert_eq!(p.malformed_calls, 0);
        assert_eq!(p.tool_calls[0].arguments, json!({"q": "x</tool_call> y"}));
        assert_eq!(p.content, "done");
    }

    #[test]
    fn malformed_call_stays_in_content() {
        let p = parse_output(r#"<tool_call>{"name": "a", "argu</tool_call> ok"#);
        assert!(p.tool_calls.is_empty());
        assert_eq!(p.malformed_calls, 1);
        assert!(p.content.starts_with("<tool_call>"));
    }

    #[test]
    fn plain_answer() {
        let p = parse_output("None of the available tools can do that.");
        assert_eq!(p.content, "None of the available tools can do that.");
        assert!(p.reasoning.is_none() && p.tool_calls.is_empty());
    }

    #[test]
    fn unterminated_think_is_all_reasoning() {
        let p = parse_output("<think>still thinking");
        assert_eq!(p.reasoning.as_deref(), Some("still thinking"));
        assert_eq!(p.content, "");
    }
}
