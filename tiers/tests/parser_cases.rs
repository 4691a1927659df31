//! The output parser on the model outputs llama.cpp's own tests use
//! (`tests/test-chat.cpp`, copied with what each test asserts into
//! `tiers/tests/templates/parser-cases.json`): the same answer text, reasoning and calls,
//! parsed whole and streamed a few bytes at a time.
//!
//! llama.cpp's reasoning formats map to mesh's as: `none` (reasoning left in the text) is a
//! format without reasoning markers; `deepseek` and `auto` extract it. Its
//! `reasoning_in_content` option has no counterpart in mesh (reasoning always goes to
//! `reasoning_content`), so those cases are not run.

use std::path::Path;

use mesh_tiers::chat::ParsedOutput;
use mesh_tiers::format::parse::{parse_all, parse_streamed, ParseOptions, ToolNames};
use mesh_tiers::format::{ThinkMarkers, ToolSyntax};
use serde_json::Value;

fn options(case: &Value) -> Option<ParseOptions> {
    let p = &case["llama_cpp_params"];
    if p["reasoning_in_content"].as_bool() == Some(true) {
        return None;
    }
    let family = case["family"].as_str().unwrap();
    let syntax = match family {
        "hermes_2_pro" => ToolSyntax::Hermes,
        "llama_3_x" => ToolSyntax::Llama3,
        "mistral_nemo" | "magistral" => ToolSyntax::Mistral,
        "deepseek_r1" => ToolSyntax::DeepSeekR1,
        "generic" => ToolSyntax::Json,
        f => panic!("unknown family {f}"),
    };
    let think = match p["reasoning_format"].as_str().unwrap() {
        "NONE" => None,
        _ if family == "magistral" => Some(ThinkMarkers {
            open: "[THINK]".into(),
            close: "[/THINK]".into(),
        }),
        _ => Some(ThinkMarkers::default()),
    };
    Some(ParseOptions {
        syntax: Some(syntax),
        thinking_open: p["thinking_forced_open"].as_bool() == Some(true) && think.is_some(),
        think,
        tools: if p["parse_tool_calls"].as_bool() == Some(false) {
            ToolNames::None
        } else {
            ToolNames::Any
        },
    })
}

fn check(case: &Value, got: &ParsedOutput) -> Result<(), String> {
    let want = &case["expected"];
    let content = want["content"].as_str().unwrap_or_default().trim();
    if got.content != content {
        return Err(format!("content {:?}, want {content:?}", got.content));
    }
    let reasoning = want["reasoning_content"].as_str().map(str::trim);
    if got.reasoning.as_deref().filter(|r| !r.is_empty()) != reasoning {
        return Err(format!("reasoning {:?}, want {reasoning:?}", got.reasoning));
    }
    let calls = want["tool_calls"].as_array().cloned().unwrap_or_default();
    if got.tool_calls.len() != calls.len() {
        return Err(format!("calls {:?}, want {calls:?}", got.tool_calls));
    }
    for (g, w) in got.tool_calls.iter().zip(&calls) {
        if g.name != w["name"] || g.arguments != w["arguments"] {
            return Err(format!("call {g:?}, want {w}"));
        }
        if let Some(id) = w["id"].as_str() {
            if g.id.as_deref() != Some(id) {
                return Err(format!("call id {:?}, want {id}", g.id));
            }
        }
    }
    Ok(())
}

#[test]
fn llama_cpps_test_outputs_parse_as_its_tests_assert() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/templates/parser-cases.json");
    let cases: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut failures = vec![];
    let mut run = 0;
    for (i, case) in cases.iter().enumerate() {
        let Some(o) = options(case) else { continue };
        run += 1;
        let input = case["input"].as_str().unwrap();
        let whole = parse_all(input, o.clone());
        if let Err(e) = check(case, &whole) {
            failures.push(format!(
                "case {i} ({}, {}): {e}",
                case["family"], case["notes"]
            ));
            continue;
        }
        for n in [1, 3, 7] {
            if let Err(e) = check(case, &parse_streamed(input, n, o.clone())) {
                failures.push(format!("case {i} streamed by {n}: {e}"));
            }
        }
    }
    assert!(run >= 40, "only {run} cases ran");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
