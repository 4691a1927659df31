//! Property tests of the output parser on the bundled tiers' format
//! (`mesh_tiers::chat::parse_output`) against its public API: calls rendered by
//! `render_call` parse back, and no text panics it.

use mesh_tiers::chat::{parse_output, render_call, ToolCall, CALL, END_CALL, END_THINK, THINK};
use proptest::prelude::*;
use serde_json::{Map, Value};

/// Text a model might write: marker pieces, JSON punctuation, whitespace and non-ASCII.
fn noisy_text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        Just(THINK.to_owned()),
        Just(END_THINK.to_owned()),
        Just(CALL.to_owned()),
        Just(END_CALL.to_owned()),
        Just("<tool_".to_owned()),
        Just("{\"name\": \"f\", \"arguments\": {}}".to_owned()),
        Just("{\"name\": ".to_owned()),
        "[{}\\[\\]\":, 0-9a-z\\\\]{1,6}",
        "[ \t\n]{1,3}",
        "\\PC{1,3}",
    ];
    prop_oneof![
        prop::collection::vec(piece, 0..24).prop_map(|p| p.concat()),
        any::<String>(),
    ]
}

/// JSON values with numbers that survive text exactly (integers and short binary
/// fractions: serde_json's default float parsing is not always correctly rounded).
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<i16>().prop_map(|x| Value::from(f64::from(x) / 256.0)),
        any::<String>().prop_map(Value::String),
        // Strings holding the markers: the JSON value, not the first `</tool_call>`,
        // decides where a call ends.
        prop_oneof![Just(END_CALL), Just(CALL), Just(END_THINK), Just("\"}")]
            .prop_map(|s| Value::String(format!("a{s}b"))),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            object(inner),
        ]
    })
}

fn object(value: impl Strategy<Value = Value>) -> impl Strategy<Value = Value> {
    prop::collection::vec(("\\PC{0,8}", value), 0..4)
        .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>()))
}

fn tool_call() -> impl Strategy<Value = ToolCall> {
    (
        prop_oneof!["[a-z_]{1,16}", any::<String>()],
        object(json_value()),
    )
        .prop_map(|(name, arguments)| ToolCall::new(name, arguments))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    /// Any text parses without panicking; every call found names its tool in the text,
    /// every malformed one began at a `<tool_call>`, and reasoning is there exactly when
    /// the text opens with `<think>`.
    #[test]
    fn arbitrary_text_parses_without_panic(text in noisy_text()) {
        let p = parse_output(&text);
        prop_assert!(p.malformed_calls <= text.matches(CALL).count());
        prop_assert!(p.tool_calls.len() <= text.matches("\"name\"").count());
        prop_assert_eq!(p.reasoning.is_some(), text.trim_start().starts_with(THINK));
        prop_assert_eq!(p.content.trim(), p.content.as_str());
    }

    /// Text with no markers at all is all content.
    #[test]
    fn text_without_markers_is_content(text in "\\PC{0,40}") {
        prop_assume!(!text.contains(CALL) && !text.trim_start().starts_with(THINK));
        let p = parse_output(&text);
        prop_assert_eq!(p.content, text.trim());
        prop_assert!(p.reasoning.is_none() && p.tool_calls.is_empty());
        prop_assert_eq!(p.malformed_calls, 0);
    }

    /// Calls rendered with `render_call`, back to back or apart, parse back to the same
    /// calls in order, with nothing malformed and no content left over.
    #[test]
    fn rendered_calls_parse_back(
        calls in prop::collection::vec(tool_call(), 1..4),
        sep in prop_oneof![Just(""), Just("\n"), Just(" \n\t")],
    ) {
        let text: Vec<String> = calls.iter().map(render_call).collect();
        let p = parse_output(&text.join(sep));
        prop_assert_eq!(p.malformed_calls, 0);
        prop_assert_eq!(p.content, "");
        prop_assert_eq!(p.tool_calls, calls);
    }

    /// A whole turn (reasoning, then an answer, then calls) splits into those parts.
    #[test]
    fn rendered_turn_splits_into_its_parts(
        reasoning in "\\PC{0,40}",
        content in "\\PC{0,40}",
        calls in prop::collection::vec(tool_call(), 0..3),
    ) {
        prop_assume!(!reasoning.contains(END_THINK) && !content.contains(CALL));
        let mut text = format!("{THINK}{reasoning}{END_THINK}{content}");
        for c in &calls {
            text.push_str(&render_call(c));
        }
        let p = parse_output(&text);
        prop_assert_eq!(p.reasoning, Some(reasoning.trim().to_owned()));
        prop_assert_eq!(p.content, content.trim());
        prop_assert_eq!(p.tool_calls, calls);
        prop_assert_eq!(p.malformed_calls, 0);
    }
}
