//! The bundled models' chat format: prompt rendering and output parsing. Pure logic.
//!
//! ```text
//! <|system|>{system}\n<tools>\n{tool json}\n...\n</tools><|end|>
//! <|user|>{text}<|end|>
//! <|assistant|><think>{reasoning}</think><tool_call>{"name": .., "arguments": {..}}</tool_call><|end|>
//! <|tool|>{result}<|end|>
//! <|assistant|>
//! ```
//!
//! Tool schemas are written as compact JSON with `", "` and `": "` separators,
//! keys in the caller's order and non-ASCII escaped, byte-identical to how the
//! training corpus (`models/recipe/corpus.py`) shows them. Injecting fewer
//! schemas therefore shortens the prompt exactly by their tokens.

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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions.
    System,
    /// The end user.
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
}

/// One chat message.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatMessage {
    /// Author.
    pub role: Role,
    /// Text (may be empty for an assistant turn that only calls tools).
    pub content: String,
    /// Calls made in an assistant turn.
    pub tool_calls: Vec<ToolCall>,
}

impl ChatMessage {
    /// A plain text message.
    pub fn text(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
            tool_calls: Vec::new(),
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

/// Renders the prompt for the next assistant turn (see [`render_prompt_parts`]).
pub fn render_prompt(messages: &[ChatMessage], tools: &[ToolSpec]) -> String {
    prompt_text(&render_prompt_parts(messages, tools))
}

/// Renders the prompt for the next assistant turn as template and content parts: the turn
/// markers, the tool block and tool calls (rendered from structured `tool_calls`) are
/// template; every message's own text is content.
pub fn render_prompt_parts(messages: &[ChatMessage], tools: &[ToolSpec]) -> Vec<PromptPart> {
    let mut out = Parts::default();
    let (system, rest) = match messages.first() {
        Some(m) if m.role == Role::System => (m.content.as_str(), &messages[1..]),
        _ => (DEFAULT_SYSTEM, messages),
    };
    out.template("<|system|>");
    out.content(system);
    if !tools.is_empty() {
        // Schemas come from the caller too: their text is content, only the block's
        // markers are template.
        out.template("\n<tools>\n");
        for (i, t) in tools.iter().enumerate() {
            if i > 0 {
                out.template("\n");
            }
            out.content(&tool_schema_text(t));
        }
        out.template("\n</tools>");
    }
    out.template(END);
    for m in rest {
        out.template(match m.role {
            Role::System => "<|system|>",
            Role::User => "<|user|>",
            Role::Assistant => "<|assistant|>",
            Role::Tool => "<|tool|>",
        });
        out.content(&m.content);
        for c in &m.tool_calls {
            // The markers are template; the name and arguments are the caller's.
            let v = serde_json::json!({"name": c.name, "arguments": c.arguments});
            out.template(CALL);
            out.content(&py_json(&v));
            out.template(END_CALL);
        }
        out.template(END);
    }
    out.template("<|assistant|>");
    out.0
}

/// Builds parts, merging neighbours of the same kind.
#[derive(Default)]
struct Parts(Vec<PromptPart>);

impl Parts {
    fn push(&mut self, text: &str, special: bool) {
        if text.is_empty() {
            return;
        }
        match self.0.last_mut() {
            Some(last) if last.special == special => last.text.push_str(text),
            _ => self.0.push(PromptPart {
                text: text.to_owned(),
                special,
            }),
        }
    }

    fn template(&mut self, text: &str) {
        self.push(text, true);
    }

    fn content(&mut self, text: &str) {
        self.push(text, false);
    }
}

/// `<tool_call>{"name": .., "arguments": ..}</tool_call>`.
pub fn render_call(c: &ToolCall) -> String {
    let v = serde_json::json!({"name": c.name, "arguments": c.arguments});
    format!("{CALL}{}{END_CALL}", py_json(&v))
}

/// The schema line shown for one tool.
pub fn tool_schema_text(t: &ToolSpec) -> String {
    let v = serde_json::json!({"name": t.name, "description": t.description, "parameters": t.parameters});
    py_json(&v)
}

/// Compact JSON the way Python's `json.dumps(v, separators=(", ", ": "))` writes it.
pub fn py_json(v: &Value) -> String {
    let mut buf = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut buf, PyFormatter);
    v.serialize(&mut ser)
        .expect("serializing a Value cannot fail");
    String::from_utf8(buf).expect("formatter writes ASCII")
}

struct PyFormatter;

impl serde_json::ser::Formatter for PyFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
    fn write_string_fragment<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        fragment: &str,
    ) -> std::io::Result<()> {
        for ch in fragment.chars() {
            if ch.is_ascii() {
                w.write_all(&[ch as u8])?;
            } else {
                let mut units = [0u16; 2];
                for u in ch.encode_utf16(&mut units) {
                    write!(w, "\\u{u:04x}")?;
                }
            }
        }
        Ok(())
    }
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
}

/// Splits generated text (special tokens rendered as text, end token excluded).
pub fn parse_output(text: &str) -> ParsedOutput {
    let mut out = ParsedOutput::default();
    let mut rest = text.trim_start();
    if let Some(after) = rest.strip_prefix(THINK) {
        match after.find(END_THINK) {
            Some(end) => {
                out.reasoning = Some(after[..end].to_owned());
                rest = &after[end + END_THINK.len()..];
            }
            None => {
                out.reasoning = Some(after.to_owned());
                rest = "";
            }
        }
    }
    let mut content = String::new();
    while let Some(start) = rest.find(CALL) {
        content.push_str(&rest[..start]);
        let body_start = start + CALL.len();
        let (body, next) = match json_then_end(&rest[body_start..]) {
            // The call is one JSON value followed by `</tool_call>`; a string inside it may
            // itself contain `</tool_call>`, so the value decides where the call ends.
            Some(len) => (
                &rest[body_start..body_start + len],
                &rest[body_start + len..].trim_start()[END_CALL.len()..],
            ),
            None => match rest[body_start..].find(END_CALL) {
                Some(e) => (
                    &rest[body_start..body_start + e],
                    &rest[body_start + e + END_CALL.len()..],
                ),
                None => (&rest[body_start..], ""),
            },
        };
        match parse_call(body) {
            Some(c) => out.tool_calls.push(c),
            None => {
                out.malformed_calls += 1;
                content.push_str(&rest[start..rest.len() - next.len()]);
            }
        }
        rest = next;
    }
    content.push_str(rest);
    out.content = content.trim().to_owned();
    out
}

/// Length of the JSON value at the start of `text` when `</tool_call>` follows it.
fn json_then_end(text: &str) -> Option<usize> {
    let mut values = serde_json::Deserializer::from_str(text).into_iter::<Value>();
    values.next()?.ok()?;
    let len = values.byte_offset();
    text[len..]
        .trim_start()
        .starts_with(END_CALL)
        .then_some(len)
}

fn parse_call(body: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_owned();
    let arguments = v
        .get("arguments")
        .cloned()
        .unwrap_or_else(|| serde_json::json!({}));
    arguments
        .is_object()
        .then_some(ToolCall { name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn message_text_is_content_and_turn_markers_are_template() {
        let msgs = [ChatMessage::text(Role::User, "<|system|>hi")];
        let parts = render_prompt_parts(&msgs, &[]);
        let user = parts
            .iter()
            .position(|p| p.text.ends_with("<|user|>"))
            .unwrap();
        assert_eq!(parts[user + 1], PromptPart::content("<|system|>hi"));
    }

    #[test]
    fn structured_tool_calls_keep_their_markers_as_template() {
        let mut m = ChatMessage::text(Role::Assistant, "");
        m.tool_calls.push(ToolCall {
            name: "f".into(),
            arguments: json!({}),
        });
        let parts = render_prompt_parts(&[ChatMessage::text(Role::User, "x"), m], &[]);
        let marker = format!("<|assistant|>{CALL}");
        assert!(parts.iter().any(|p| p.special && p.text.contains(&marker)));
    }

    fn tool() -> ToolSpec {
        ToolSpec {
            name: "weather_get_forecast".into(),
            description: "Get the forecast by city and date.".into(),
            parameters: json!({"type": "object", "properties": {"city": {"type": "string", "description": "City name"}}, "required": ["city"]}),
        }
    }

    #[test]
    fn schema_matches_python_json_dumps() {
        assert_eq!(
            tool_schema_text(&tool()),
            r#"{"name": "weather_get_forecast", "description": "Get the forecast by city and date.", "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}}, "required": ["city"]}}"#
        );
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
        let call = ToolCall {
            name: "f".into(),
            arguments: json!({"x": 1}),
        };
        let msgs = vec![
            ChatMessage::text(Role::System, "sys"),
            ChatMessage::text(Role::User, "q"),
            ChatMessage {
                role: Role::Assistant,
                content: String::new(),
                tool_calls: vec![call],
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
