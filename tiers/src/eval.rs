//! Scoring of the bundled held-out tasks (`models/fixtures/eval-heldout.jsonl`),
//! shared by the model card and the cascade evaluation.
//!
//! Follows `score()` in `models/recipe/train.py`: tool calls are the bodies between
//! `<tool_call>` and `</tool_call>` (an unclosed one runs to the end), each parsed as
//! JSON; a turn is exact when the parsed calls equal the expected ones, in order (JSON
//! object equality, key order ignored); a turn whose expected answer has no call is
//! exact when the output has no call either and its text after `</think>` equals the
//! expected text (both trimmed).

use std::path::Path;

use serde_json::Value;

use crate::chat::{ToolSpec, CALL, END, END_CALL, END_THINK, THINK};

/// One held-out task.
#[derive(Debug, Clone)]
pub struct Task {
    /// `call`, `hard`, `none` or `result`.
    pub kind: String,
    /// Sub-kind (`arith`, `convert`, `choose`, `plan` for hard tasks).
    pub sub: String,
    /// `heldout_requests` or `heldout_tools`.
    pub split: String,
    /// Prompt text (ends with the assistant marker).
    pub prompt: String,
    /// Expected completion.
    pub completion: String,
}

/// Reads a task file (JSON lines with `kind`, `sub`, `split`, `prompt`, `completion`).
pub fn load_tasks(path: &Path) -> Result<Vec<Task>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        format!(
            "{}: {e} (write it with models/recipe/evalset.py)",
            path.display()
        )
    })?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            let v: Value = serde_json::from_str(l).map_err(|e| format!("line {}: {e}", i + 1))?;
            let s = |k: &str| {
                v[k].as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| format!("line {}: no `{k}`", i + 1))
            };
            Ok(Task {
                kind: s("kind")?,
                sub: s("sub")?,
                split: s("split")?,
                prompt: s("prompt")?,
                completion: s("completion")?,
            })
        })
        .collect()
}

/// One entry per `<tool_call>`, `None` when its body is not JSON.
pub fn parse_calls(text: &str) -> Vec<Option<Value>> {
    text.split(CALL)
        .skip(1)
        .map(|part| {
            let body = part.split(END_CALL).next().unwrap_or("");
            serde_json::from_str::<Value>(body).ok()
        })
        .collect()
}

/// Text after the last `</think>` (the whole text when there is none).
pub fn answer_text(text: &str) -> &str {
    text.rsplit(END_THINK).next().unwrap_or(text)
}

/// Text between the first `<think>` and the following `</think>` (to the end when unclosed).
pub fn reasoning(text: &str) -> Option<&str> {
    let start = text.find(THINK)? + THINK.len();
    let rest = &text[start..];
    Some(rest.find(END_THINK).map_or(rest, |e| &rest[..e]))
}

/// The `name` of a parsed call.
pub fn call_name(c: &Option<Value>) -> Option<&str> {
    c.as_ref()?.get("name")?.as_str()
}

/// Whether `text` is exactly the task's expected answer.
pub fn exact(task: &Task, text: &str) -> bool {
    let want = parse_calls(&task.completion);
    let got = parse_calls(text);
    let expected_answer = answer_text(&task.completion).replace(END, "");
    want == got && (!want.is_empty() || answer_text(text).trim() == expected_answer.trim())
}

/// The tools a prompt offers (its `<tools>` block, one JSON schema per line).
pub fn offered_tools(prompt: &str) -> Vec<ToolSpec> {
    let block = prompt
        .split_once("<tools>\n")
        .and_then(|(_, rest)| rest.split_once("\n</tools>"))
        .map_or("", |(b, _)| b);
    block
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(completion: &str) -> Task {
        Task {
            kind: "call".into(),
            sub: "single".into(),
            split: "s".into(),
            prompt: String::new(),
            completion: completion.into(),
        }
    }

    #[test]
    fn calls_compare_as_json() {
        let t =
            task(r#"<tool_call>{"name": "a", "arguments": {"x": 1, "y": 2}}</tool_call><|end|>"#);
        assert!(exact(
            &t,
            r#"<tool_call>{"arguments": {"y": 2, "x": 1}, "name": "a"}</tool_call>"#
        ));
        assert!(!exact(
            &t,
            r#"<tool_call>{"name": "a", "arguments": {"x": 1, "y": 3}}</tool_call>"#
        ));
        assert!(!exact(&t, "I cannot."));
    }

    #[test]
    fn answers_compare_after_think() {
        let t = task("None of the available tools can do that.<|end|>");
        assert!(exact(&t, "None of the available tools can do that."));
        assert!(exact(
            &t,
            "<think>no tool</think>None of the available tools can do that."
        ));
        assert!(!exact(&t, r#"<tool_call>{"name": "a"}</tool_call>"#));
        assert_eq!(reasoning("<think>a b</think>c"), Some("a b"));
    }
}
