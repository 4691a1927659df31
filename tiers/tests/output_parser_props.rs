//! Property tests of the streaming output parser of every family
//! (`mesh_tiers::format::parse::OutputParser`), the decoder of model text: no text panics
//! it, a reply streamed in pieces reads as the whole reply does, and nothing is a call
//! when no tools were offered.

use mesh_tiers::format::parse::{parse_all, parse_streamed, ParseOptions, ToolNames};
use mesh_tiers::format::{ThinkMarkers, ToolSyntax};
use proptest::prelude::*;

const SYNTAXES: [ToolSyntax; 6] = [
    ToolSyntax::Hermes,
    ToolSyntax::Llama3,
    ToolSyntax::Mistral,
    ToolSyntax::DeepSeekR1,
    ToolSyntax::Phi4,
    ToolSyntax::Json,
];

/// Text a model of any family might write: the families' markers and pieces of them,
/// fences, JSON calls whole and cut, whitespace and non-ASCII.
fn noisy_text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        prop_oneof![
            Just("<think>"),
            Just("</think>"),
            Just("[THINK]"),
            Just("[/THINK]"),
            Just("<tool_call>"),
            Just("</tool_call>"),
            Just("<|python_tag|>"),
            Just("[TOOL_CALLS]"),
            Just("[ARGS]"),
            Just("<|tool_call|>"),
            Just("<|/tool_call|>"),
            Just("<｜tool▁calls▁begin｜>"),
            Just("<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n"),
            Just("<｜tool▁call▁end｜>"),
            Just("<｜tool▁calls▁end｜>"),
            Just("```json\n"),
            Just("```"),
            Just("<function=f>"),
            Just("</function>"),
            Just("<tool>"),
            Just("</tool>"),
            Just("{\"name\": \"f\", \"arguments\": {\"a\": 1}}"),
            Just("{\"name\": \"f\", \"parameters\": {}}"),
            Just("[{\"name\": \"g\", \"arguments\": {}}]"),
            Just("{\"response\": \"hi\"}"),
            Just("{\"name\": "),
            Just("f.call(a=1)"),
        ]
        .prop_map(str::to_owned),
        "[{}\\[\\]\":, 0-9a-z\\\\<>|/]{1,6}",
        "[ \t\n]{1,3}",
        "\\PC{1,3}",
    ];
    prop_oneof![
        3 => prop::collection::vec(piece, 0..24).prop_map(|p| p.concat()),
        1 => any::<String>(),
    ]
}

fn options(syntax: ToolSyntax, tools: ToolNames, magistral: bool) -> ParseOptions {
    ParseOptions {
        syntax: Some(syntax),
        think: Some(if magistral {
            ThinkMarkers {
                open: "[THINK]".into(),
                close: "[/THINK]".into(),
            }
        } else {
            ThinkMarkers::default()
        }),
        thinking_open: false,
        tools,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn no_text_panics_any_family(text in noisy_text(), s in 0..SYNTAXES.len(), magistral in any::<bool>()) {
        let _ = parse_all(&text, options(SYNTAXES[s], ToolNames::Any, magistral));
    }

    #[test]
    fn nothing_is_a_call_without_tools(text in noisy_text(), s in 0..SYNTAXES.len()) {
        let p = parse_all(&text, options(SYNTAXES[s], ToolNames::None, false));
        prop_assert!(p.tool_calls.is_empty(), "{:?}", p.tool_calls);
    }

    #[test]
    fn a_streamed_reply_reads_as_the_whole_reply(
        text in noisy_text(),
        s in 0..SYNTAXES.len(),
        piece in 1usize..9,
    ) {
        let o = options(SYNTAXES[s], ToolNames::Any, false);
        let whole = parse_all(&text, o.clone());
        let got = parse_streamed(&text, piece, o);
        prop_assert_eq!(&got.tool_calls, &whole.tool_calls);
        prop_assert_eq!(&got.content, &whole.content);
        prop_assert_eq!(&got.reasoning, &whole.reasoning);
    }
}
