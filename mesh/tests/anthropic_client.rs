//! End to end: a `mesh up` process driven by the official `anthropic` Python client
//! (`tests/python/anthropic_e2e.py`), one behaviour per test, each against its own node.
//!
//! Needs Python with the `anthropic` package: `MESH_PYTHON` (set by `./dev.sh test` to the
//! project's virtualenv), else `python3`.

use crate::common;
use common::mesh_up;

/// Runs one check of the script against `base` (`http://ADDR`).
fn run_check(base: &str, check: &str) {
    mesh_tests::run_python("anthropic_e2e.py", &["--base-url", base, "--check", check]);
}

fn check_on_t1(check: &str) {
    let mesh = mesh_up(&[]);
    run_check(&mesh.http, check);
    drop(mesh);
}

#[test]
fn a_plain_message_has_text_a_stop_reason_and_usage() {
    check_on_t1("plain");
}

#[test]
fn a_streamed_message_has_anthropics_events_and_the_same_text() {
    check_on_t1("streaming");
}

#[test]
fn a_stop_sequence_ends_the_message_and_is_named() {
    check_on_t1("stop_sequence");
}

#[test]
fn a_tool_call_parses_into_tool_use_with_a_dict_input() {
    check_on_t1("tool_call");
}

#[test]
fn a_streamed_tool_call_sends_its_input_as_json_deltas() {
    check_on_t1("streamed_tool_call");
}

#[test]
fn a_tool_result_turn_is_answered_in_text() {
    check_on_t1("tool_result");
}

#[test]
fn a_forced_tool_is_called() {
    check_on_t1("forced_tool");
}

#[test]
fn a_thinking_budget_caps_the_thinking_block() {
    check_on_t1("thinking");
}

#[test]
fn an_unknown_model_is_a_not_found_error() {
    check_on_t1("unknown_model");
}

#[test]
fn an_unsupported_block_is_a_bad_request_naming_it() {
    check_on_t1("bad_request");
}

#[test]
fn count_tokens_equals_the_prompt_of_the_reply() {
    check_on_t1("count_tokens");
}

#[test]
fn a_repeated_prompt_reports_its_reused_tokens() {
    check_on_t1("cached_tokens");
}

#[test]
fn the_cascade_answers_through_the_messages_api() {
    let mesh = mesh_tests::Node::up(
        &std::env::temp_dir(),
        &[
            "--only",
            "t1,t2,t3",
            "--threads",
            "2",
            "--ctx",
            "4096",
            "--parallel",
            "2",
        ],
    )
    .unwrap_or_else(|log| panic!("mesh up exited before listening:\n{log}"));
    run_check(&mesh.http, "cascade");
    drop(mesh);
}
