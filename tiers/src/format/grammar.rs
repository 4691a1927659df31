//! GBNF grammars for a family's tool calls and for structured output.
//!
//! With `tool_choice` `auto` the grammar is lazy: free text and reasoning are unconstrained
//! and from the first trigger on (the family's call marker as a token, a ```` ```json ````
//! fence opening a call, a reply that starts as a JSON call) every call must be one of the
//! offered tools with arguments matching its schema. With `required` or a named tool it
//! applies from the first token (after an optional reasoning span). The JSON of a call comes
//! from llama.cpp's own JSON-schema converter.
//!
//! A trigger pattern and the grammar must agree on the text the pattern matched: llama.cpp
//! feeds that text to the grammar when it fires. The patterns below allow exactly the
//! whitespace the grammar allows (the converter's `space` rule between `{` and `"name"`).

use serde_json::{json, Value};

use super::{FormatSpec, ThinkMarkers, ToolSyntax};
use crate::chat::ToolSpec;

/// A grammar and when it applies.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GrammarPlan {
    /// GBNF text, root rule `root`.
    pub grammar: String,
    /// Words whose appearance switches the grammar on (lazy); none: from the first token.
    pub trigger_words: Vec<String>,
    /// Regular expressions (ECMAScript) over the output that switch it on; the grammar
    /// takes the text from the first capture group on.
    pub trigger_patterns: Vec<String>,
}

impl GrammarPlan {
    /// Whether the grammar waits for a trigger.
    pub fn is_lazy(&self) -> bool {
        !self.trigger_words.is_empty() || !self.trigger_patterns.is_empty()
    }
}

/// The converter's whitespace (`space ::= | " " | "\n"{1,2} [ \t]{0,20}`) as a regex.
const SPACE_RE: &str = r"(?: |\n{1,2}[ \t]{0,20})?";
/// Whitespace around calls inside markers and fences.
const WS_RULE: &str = "mesh-ws ::= [ \\t\\n]{0,3}";
const WS_RE: &str = r"[ \t\n]{0,3}";

/// The grammar for calls to `tools` in `spec`'s syntax: lazy (`auto`), or from the first
/// token when `forced` (`required`, a named tool). `thinking_open`: the reply starts inside a
/// reasoning span.
pub fn tools(
    spec: &FormatSpec,
    tools: &[ToolSpec],
    forced: bool,
    thinking_open: bool,
) -> Result<GrammarPlan, String> {
    if tools.is_empty() {
        return Err("no tools to build a grammar for".into());
    }
    let think = spec.think.as_ref();
    let prefix = reasoning_prefix(think, thinking_open);
    if spec.syntax == ToolSyntax::DeepSeekR1 {
        return deepseek(tools, forced, &prefix, think, thinking_open);
    }
    let args_key = if spec.syntax == ToolSyntax::Llama3 {
        "parameters"
    } else {
        "arguments"
    };
    let call = call_rules(tools, args_key, spec.syntax == ToolSyntax::Mistral)?;
    let (native, word) = match spec.syntax {
        ToolSyntax::Hermes => (
            "mesh-native ::= mesh-tc (mesh-ws mesh-tc)*\nmesh-tc ::= \"<tool_call>\" mesh-ws call mesh-ws \"</tool_call>\"",
            Some("<tool_call>"),
        ),
        ToolSyntax::Phi4 => (
            "mesh-native ::= mesh-tc (mesh-ws mesh-tc)*\nmesh-tc ::= \"<|tool_call|>\" mesh-ws (call | \"[\" call (\",\" mesh-ws call)* \"]\") mesh-ws \"<|/tool_call|>\"",
            Some("<|tool_call|>"),
        ),
        ToolSyntax::Mistral => (
            "mesh-native ::= \"[TOOL_CALLS]\" \"[\" call (\",\" mesh-ws call)* \"]\"",
            Some("[TOOL_CALLS]"),
        ),
        ToolSyntax::Llama3 => (
            "mesh-native ::= \"<|python_tag|>\"? call",
            Some("<|python_tag|>"),
        ),
        ToolSyntax::Json | ToolSyntax::DeepSeekR1 => ("mesh-native ::= call", None),
    };
    let fenced = "mesh-fenced ::= \"```\" \"json\"? mesh-ws call mesh-ws \"```\"";
    if forced {
        return Ok(GrammarPlan {
            grammar: format!(
                "root ::= {prefix}mesh-native\n{native}\n{fenced}\n{WS_RULE}\n{}{call}",
                think_rule(think)
            ),
            ..GrammarPlan::default()
        });
    }
    let mut words = vec![];
    if let Some(w) = word {
        words.push(w.to_owned());
    }
    let start = reply_start_re(think, thinking_open);
    let call_start = format!(r#"\{{{SPACE_RE}"name"{SPACE_RE}:"#);
    Ok(GrammarPlan {
        grammar: format!(
            "root ::= mesh-native | mesh-fenced | call\n{native}\n{fenced}\n{WS_RULE}\n{call}"
        ),
        trigger_words: words,
        trigger_patterns: vec![
            format!("{start}({call_start})"),
            format!("(```(?:json)?{WS_RE}{call_start})"),
        ],
    })
}

/// The grammar for a JSON answer matching `schema` (`response_format`), from the first
/// token on (after a reasoning span, for a model that reasons).
pub fn json_answer(
    spec: &FormatSpec,
    schema: &Value,
    thinking_open: bool,
) -> Result<GrammarPlan, String> {
    let think = spec.think.as_ref();
    let g = llama_cpp_2::json_schema_to_grammar(&schema.to_string())
        .map_err(|e| format!("the schema cannot be turned into a grammar: {e}"))?;
    let body = rename_root(&g, "mesh-json");
    let prefix = reasoning_prefix(think, thinking_open);
    Ok(GrammarPlan {
        grammar: format!(
            "root ::= {prefix}mesh-json\n{WS_RULE}\n{}{body}",
            think_rule(think)
        ),
        ..GrammarPlan::default()
    })
}

/// The grammar of an answer in words: its first character (after any reasoning) is a
/// letter or a digit, so it cannot open a call (`{`, `[`, `<`, a fence, punctuation before
/// one). Asked for when a model repeats a call that its conversation has just answered.
pub fn text_answer(spec: &FormatSpec, thinking_open: bool) -> GrammarPlan {
    let think = spec.think.as_ref();
    let prefix = reasoning_prefix(think, thinking_open);
    GrammarPlan {
        grammar: format!(
            "root ::= {prefix}mesh-first mesh-any*\nmesh-first ::= [^\\x00-\\x2f\\x3a-\\x40\\x5b-\\x60\\x7b-\\x7f]\nmesh-any ::= [^\\x00]\n{WS_RULE}\n{}",
            think_rule(think)
        ),
        ..GrammarPlan::default()
    }
}

/// What may come before the constrained part: a reasoning span (optional), or the rest of
/// one the prompt opened.
fn reasoning_prefix(think: Option<&ThinkMarkers>, thinking_open: bool) -> String {
    match think {
        Some(_) if thinking_open => "mesh-reasoning ".into(),
        Some(_) => "mesh-think? ".into(),
        None => String::new(),
    }
}

fn think_rule(think: Option<&ThinkMarkers>) -> String {
    match think {
        Some(t) => format!(
            "mesh-think ::= {} mesh-reasoning\nmesh-reasoning ::= [^<]* {} mesh-ws\n",
            gbnf_str(&t.open),
            gbnf_str(&t.close)
        ),
        None => String::new(),
    }
}

/// A regex for the start of a reply, up to where a call may begin.
fn reply_start_re(think: Option<&ThinkMarkers>, thinking_open: bool) -> String {
    match think {
        Some(t) if thinking_open => format!(r"^[\s\S]*?{}\s*", regex_escape(&t.close)),
        Some(t) => format!(
            r"^\s*(?:{}[\s\S]*?{}\s*)?",
            regex_escape(&t.open),
            regex_escape(&t.close)
        ),
        None => r"^\s*".into(),
    }
}

/// `call ::= {"name": <tool>, "<args_key>": <its schema>}` and the converter's rules.
fn call_rules(tools: &[ToolSpec], args_key: &str, with_id: bool) -> Result<String, String> {
    let variants: Vec<Value> = tools
        .iter()
        .map(|t| {
            let args = if t.parameters.is_object() {
                t.parameters.clone()
            } else {
                json!({"type": "object"})
            };
            let mut props = serde_json::Map::new();
            props.insert("name".into(), json!({"const": t.name}));
            props.insert(args_key.into(), args);
            if with_id {
                props.insert(
                    "id".into(),
                    json!({"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}),
                );
            }
            json!({"type": "object", "properties": props,
                   "required": ["name", args_key], "additionalProperties": false})
        })
        .collect();
    let schema = if variants.len() == 1 {
        variants[0].clone()
    } else {
        json!({"oneOf": variants})
    };
    let g = llama_cpp_2::json_schema_to_grammar(&schema.to_string())
        .map_err(|e| format!("tool schema cannot be turned into a grammar: {e}"))?;
    Ok(rename_root(&g, "call"))
}

fn deepseek(
    tools: &[ToolSpec],
    forced: bool,
    prefix: &str,
    think: Option<&ThinkMarkers>,
    _thinking_open: bool,
) -> Result<GrammarPlan, String> {
    let names: Vec<String> = tools.iter().map(|t| gbnf_str(&t.name)).collect();
    let params: Vec<Value> = tools
        .iter()
        .map(|t| {
            if t.parameters.is_object() {
                t.parameters.clone()
            } else {
                json!({"type": "object"})
            }
        })
        .collect();
    let schema = if params.len() == 1 {
        params[0].clone()
    } else {
        json!({"oneOf": params})
    };
    let g = llama_cpp_2::json_schema_to_grammar(&schema.to_string())
        .map_err(|e| format!("tool schema cannot be turned into a grammar: {e}"))?;
    let args = rename_root(&g, "mesh-args");
    let native = format!(
        "mesh-native ::= \"<｜tool▁calls▁begin｜>\" mesh-dscall+ \"<｜tool▁calls▁end｜>\"\nmesh-dscall ::= \"<｜tool▁call▁begin｜>function<｜tool▁sep｜>\" mesh-name \"\\n```json\\n\" mesh-args \"\\n```<｜tool▁call▁end｜>\"\nmesh-name ::= {}",
        names.join(" | ")
    );
    if forced {
        return Ok(GrammarPlan {
            grammar: format!(
                "root ::= {prefix}mesh-native\n{native}\n{WS_RULE}\n{}{args}",
                think_rule(think)
            ),
            ..GrammarPlan::default()
        });
    }
    Ok(GrammarPlan {
        grammar: format!("root ::= mesh-native\n{native}\n{WS_RULE}\n{args}"),
        trigger_words: vec!["<｜tool▁calls▁begin｜>".into()],
        trigger_patterns: vec![],
    })
}

/// The converter's output with its root rule renamed.
fn rename_root(grammar: &str, to: &str) -> String {
    grammar
        .lines()
        .map(|l| match l.strip_prefix("root ::=") {
            Some(rest) => format!("{to} ::={rest}"),
            None => l.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A GBNF string literal.
fn gbnf_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// `s` as a regular expression that matches it literally.
pub(crate) fn regex_escape(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if "\\^$.|?*+()[]{}/".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str) -> ToolSpec {
        ToolSpec {
            name: name.into(),
            description: String::new(),
            parameters: json!({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}),
        }
    }

    fn spec(syntax: ToolSyntax) -> FormatSpec {
        FormatSpec {
            syntax,
            think: None,
            template_tools: true,
            template: "t".into(),
        }
    }

    #[test]
    fn auto_is_lazy_on_the_family_marker_fences_and_a_leading_call() {
        let g = tools(
            &spec(ToolSyntax::Hermes),
            &[tool("a"), tool("b")],
            false,
            false,
        )
        .unwrap();
        assert!(g.is_lazy());
        assert_eq!(g.trigger_words, ["<tool_call>"]);
        assert!(g
            .grammar
            .starts_with("root ::= mesh-native | mesh-fenced | call\n"));
        assert!(g.grammar.contains("\"<tool_call>\" mesh-ws call"));
        assert!(g.grammar.contains("call ::="));
        assert!(!g
            .grammar
            .lines()
            .any(|l| l.starts_with("root ::=") && l.contains("space")));
    }

    #[test]
    fn forced_calls_start_at_once_after_optional_reasoning() {
        let mut s = spec(ToolSyntax::Hermes);
        s.think = Some(ThinkMarkers::default());
        let g = tools(&s, &[tool("a")], true, false).unwrap();
        assert!(!g.is_lazy());
        assert!(g.grammar.starts_with("root ::= mesh-think? mesh-native\n"));
        assert!(g
            .grammar
            .contains("mesh-think ::= \"<think>\" mesh-reasoning"));
    }

    #[test]
    fn llama3_calls_use_parameters() {
        let g = tools(&spec(ToolSyntax::Llama3), &[tool("a")], true, false).unwrap();
        assert!(g.grammar.contains("parameters"), "{}", g.grammar);
    }

    #[test]
    fn mistral_calls_are_a_list_after_the_marker() {
        let g = tools(&spec(ToolSyntax::Mistral), &[tool("a")], false, false).unwrap();
        assert_eq!(g.trigger_words, ["[TOOL_CALLS]"]);
        assert!(g.grammar.contains("\"[TOOL_CALLS]\" \"[\" call"));
    }

    #[test]
    fn deepseek_names_the_tool_outside_the_json() {
        let g = tools(
            &spec(ToolSyntax::DeepSeekR1),
            &[tool("a"), tool("b")],
            false,
            false,
        )
        .unwrap();
        assert!(g.grammar.contains("mesh-name ::= \"a\" | \"b\""));
        assert_eq!(g.trigger_words, ["<｜tool▁calls▁begin｜>"]);
    }

    #[test]
    fn no_tools_is_an_error() {
        assert!(tools(&spec(ToolSyntax::Hermes), &[], false, false).is_err());
    }

    #[test]
    fn the_call_trigger_allows_the_converters_whitespace_only() {
        let g = tools(&spec(ToolSyntax::Json), &[tool("a")], false, false).unwrap();
        let re = regex::Regex::new(&g.trigger_patterns[0]).unwrap();
        assert!(re.is_match("{\"name\": \"a\""));
        assert!(re.is_match("  { \"name\":"));
        assert!(!re.is_match("{   \"name\":"));
        assert!(!re.is_match("Sure {\"name\":"));
    }

    #[test]
    fn a_text_answer_cannot_start_with_a_call() {
        let g = text_answer(&spec(ToolSyntax::Hermes), false);
        assert!(!g.is_lazy());
        assert!(
            g.grammar
                .contains("mesh-first ::= [^\\x00-\\x2f\\x3a-\\x40\\x5b-\\x60\\x7b-\\x7f]"),
            "{}",
            g.grammar
        );
    }

    #[test]
    fn json_answers_follow_the_schema_from_the_first_token() {
        let g = json_answer(&spec(ToolSyntax::Hermes), &json!({"type": "object"}), false).unwrap();
        assert!(!g.is_lazy());
        assert!(g.grammar.starts_with("root ::= mesh-json\n"));
    }
}
