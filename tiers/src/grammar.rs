//! GBNF grammars that make emitted tool calls parse.
//!
//! The grammar is applied lazily: free text and reasoning are unconstrained,
//! and from the first `<tool_call>` token on every call must be
//! `{"name": <one of the offered tools>, "arguments": <that tool's schema>}`
//! followed by `</tool_call>`. The JSON part comes from llama.cpp's own
//! JSON-schema converter.

use serde_json::{json, Value};

use crate::chat::{ToolSpec, CALL, END_CALL, END_THINK, THINK};
use crate::TierError;

/// Grammar text (root rule `root`) for calls to any of `tools`.
pub fn tool_call_grammar(tools: &[ToolSpec]) -> Result<String, TierError> {
    if tools.is_empty() {
        return Err(TierError::InvalidRequest(
            "no tools to build a grammar for".into(),
        ));
    }
    let variants: Vec<Value> = tools
        .iter()
        .map(|t| {
            let mut args = t.parameters.clone();
            if !args.is_object() {
                args = json!({"type": "object"});
            }
            json!({
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": args},
                "required": ["name", "arguments"],
                "additionalProperties": false
            })
        })
        .collect();
    let schema = if variants.len() == 1 {
        variants[0].clone()
    } else {
        json!({"oneOf": variants})
    };
    let json_grammar = llama_cpp_2::json_schema_to_grammar(&schema.to_string()).map_err(|e| {
        TierError::InvalidRequest(format!("tool schema cannot be turned into a grammar: {e}"))
    })?;
    let renamed = rename_root(&json_grammar);
    Ok(format!(
        "root ::= call+\ncall ::= \"{CALL}\" tool-json \"{END_CALL}\"\n{renamed}"
    ))
}

/// Grammar that forces at least one call right away (an optional reasoning span first): for
/// `tool_choice: "required"` or a named function.
pub fn required_tool_call_grammar(tools: &[ToolSpec]) -> Result<String, TierError> {
    let lazy = tool_call_grammar(tools)?;
    let rest = lazy
        .strip_prefix("root ::= call+\n")
        .expect("tool_call_grammar starts with its root");
    Ok(format!(
        "root ::= think? call+\nthink ::= \"{THINK}\" [^<]* \"{END_THINK}\"\n{rest}"
    ))
}

fn rename_root(grammar: &str) -> String {
    grammar
        .lines()
        .map(|l| match l.strip_prefix("root ::=") {
            Some(rest) => format!("tool-json ::={rest}"),
            None => l.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grammar_has_call_wrapper_and_names() {
        let tools = vec![
            ToolSpec {
                name: "a_tool".into(),
                description: String::new(),
                parameters: json!({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}),
            },
            ToolSpec {
                name: "b_tool".into(),
                description: String::new(),
                parameters: json!({"type": "object", "properties": {}}),
            },
        ];
        let g = tool_call_grammar(&tools).unwrap();
        assert!(
            g.starts_with("root ::= call+\ncall ::= \"<tool_call>\" tool-json \"</tool_call>\"")
        );
        assert!(g.contains("tool-json ::="));
        assert!(!g
            .lines()
            .any(|l| l.starts_with("root ::=") && !l.contains("call+")));
        assert!(g.contains("a_tool") && g.contains("b_tool"));
    }

    #[test]
    fn no_tools_is_an_error() {
        assert!(tool_call_grammar(&[]).is_err());
    }
}
