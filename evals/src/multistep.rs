//! Tool routing over the steps of multi-step agent tasks: which tools each step needs against
//! which tools a routing strategy offers at that step. Pure functions; the program is
//! `examples/multistep_router.rs`.
//!
//! Strategies, each offering `k` routed tools:
//! - [`Strategy::FirstMessage`]: route once on the task's first user message and offer those
//!   tools at every step (what routing once per conversation gives an agent loop);
//! - [`Strategy::PerStep`]: route on the current step's user message;
//! - [`Strategy::PerStepKeepUsed`]: route on the current step and also keep offering every
//!   tool an earlier step used (so the offer can exceed `k`).

use std::collections::{HashMap, HashSet};

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// One step of a task: the user's message and the functions its answer calls.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// The user's message(s) of the step.
    pub query: String,
    /// The distinct functions the step's answer calls.
    pub truth: Vec<String>,
}

/// A multi-step task.
#[derive(Debug, Clone, PartialEq)]
pub struct Task {
    /// The benchmark's id.
    pub id: String,
    /// Steps in order.
    pub steps: Vec<Step>,
}

/// The function name of a ground-truth call such as `cd(folder='document')`.
pub fn call_name(call: &str) -> Option<&str> {
    let name = call.split('(').next()?.trim();
    (!name.is_empty() && call.contains('(')).then_some(name)
}

/// BFCL multi-turn tasks from a question file's records and its `possible_answer` records:
/// step n = the user messages of turn n, joined, and the distinct functions of ground-truth
/// turn n. Turns whose answer calls nothing (or that have no user message) are left out.
pub fn bfcl_multi_turn(questions: &[Value], answers: &[Value]) -> Result<Vec<Task>> {
    let truth: HashMap<&str, &Vec<Value>> = answers
        .iter()
        .filter_map(|a| Some((a["id"].as_str()?, a["ground_truth"].as_array()?)))
        .collect();
    let mut out = Vec::new();
    for q in questions {
        let id = q["id"].as_str().context("a question without id")?;
        let Some(turns_truth) = truth.get(id) else {
            bail!("{id}: no ground truth");
        };
        let turns = q["question"]
            .as_array()
            .with_context(|| format!("{id}: no question turns"))?;
        let mut steps = Vec::new();
        for (turn, calls) in turns.iter().zip(turns_truth.iter()) {
            let query = turn
                .as_array()
                .into_iter()
                .flatten()
                .filter(|m| m["role"] == "user")
                .filter_map(|m| m["content"].as_str())
                .collect::<Vec<_>>()
                .join("\n");
            let mut seen = HashSet::new();
            let names: Vec<String> = calls
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .filter_map(call_name)
                .filter(|n| seen.insert(*n))
                .map(str::to_owned)
                .collect();
            if !query.is_empty() && !names.is_empty() {
                steps.push(Step {
                    query,
                    truth: names,
                });
            }
        }
        if !steps.is_empty() {
            out.push(Task {
                id: id.to_owned(),
                steps,
            });
        }
    }
    Ok(out)
}

/// Whether a task is in the held-out part (every fifth task by its trailing number, or by
/// the id's bytes when it has none), kept out of every tuning decision.
pub fn held_out(id: &str) -> bool {
    let digits: String = id
        .chars()
        .rev()
        .take_while(char::is_ascii_digit)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    match digits.parse::<u64>() {
        Ok(n) => n % 5 == 0,
        Err(_) => id.bytes().map(u64::from).sum::<u64>() % 5 == 0,
    }
}

/// How the offered tools of a step are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Strategy {
    /// Route once, on the task's first user message.
    FirstMessage,
    /// Route on each step's user message.
    PerStep,
    /// Route on each step and keep offering the tools earlier steps used.
    PerStepKeepUsed,
}

impl Strategy {
    /// Every strategy, in report order.
    pub const ALL: [Strategy; 3] = [
        Strategy::FirstMessage,
        Strategy::PerStep,
        Strategy::PerStepKeepUsed,
    ];

    /// The strategy's name in reports.
    pub fn label(self) -> &'static str {
        match self {
            Strategy::FirstMessage => "first message only",
            Strategy::PerStep => "per step",
            Strategy::PerStepKeepUsed => "per step + tools already used",
        }
    }
}

/// The tools offered at a step: the first `k` of the ranking the strategy routes on, plus,
/// for [`Strategy::PerStepKeepUsed`], the tools earlier steps used (in order, no repeats).
pub fn offered(
    strategy: Strategy,
    ranked_first: &[String],
    ranked_step: &[String],
    used_before: &[String],
    k: usize,
) -> Vec<String> {
    let ranked = match strategy {
        Strategy::FirstMessage => ranked_first,
        _ => ranked_step,
    };
    let mut out: Vec<String> = ranked.iter().take(k).cloned().collect();
    if strategy == Strategy::PerStepKeepUsed {
        for u in used_before {
            if !out.contains(u) {
                out.push(u.clone());
            }
        }
    }
    out
}

/// Share of `truth` found in `offered`.
pub fn recall(offered: &[String], truth: &[String]) -> f64 {
    if truth.is_empty() {
        return 1.0;
    }
    let hit = truth.iter().filter(|t| offered.contains(t)).count();
    hit as f64 / truth.len() as f64
}

/// A running mean.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Mean {
    sum: f64,
    n: usize,
}

impl Mean {
    /// Adds a value.
    pub fn add(&mut self, x: f64) {
        self.sum += x;
        self.n += 1;
    }

    /// The mean, `None` before any value.
    pub fn get(&self) -> Option<f64> {
        (self.n > 0).then(|| self.sum / self.n as f64)
    }

    /// Values added.
    pub fn count(&self) -> usize {
        self.n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn call_names_are_what_precedes_the_parenthesis() {
        assert_eq!(call_name("cd(folder='document')"), Some("cd"));
        assert_eq!(call_name("sort('final_report.pdf')"), Some("sort"));
        assert_eq!(call_name("not a call"), None);
    }

    #[test]
    fn tasks_pair_each_turns_user_text_with_its_calls() {
        let q = [json!({"id": "multi_turn_base_3", "question": [
            [{"role": "user", "content": "Move the file."}],
            [],
            [{"role": "user", "content": "Now grep it."}, {"role": "user", "content": "Twice."}],
        ]})];
        let a = [json!({"id": "multi_turn_base_3", "ground_truth": [
            ["cd(folder='a')", "mv(source='x', destination='y')", "cd(folder='..')"],
            ["ls()"],
            ["grep(file_name='x', pattern='p')"],
        ]})];
        let t = bfcl_multi_turn(&q, &a).unwrap();
        assert_eq!(t.len(), 1);
        // The turn without a user message is left out.
        assert_eq!(t[0].steps.len(), 2);
        assert_eq!(t[0].steps[0].truth, s(&["cd", "mv"]));
        assert_eq!(t[0].steps[1].query, "Now grep it.\nTwice.");
    }

    #[test]
    fn a_question_without_ground_truth_is_an_error() {
        let q = [json!({"id": "x_1", "question": [[{"role": "user", "content": "hi"}]]})];
        let e = bfcl_multi_turn(&q, &[]).unwrap_err();
        assert!(e.to_string().contains("x_1: no ground truth"));
    }

    #[test]
    fn every_fifth_task_is_held_out() {
        assert!(held_out("multi_turn_base_0") && held_out("multi_turn_base_15"));
        assert!(!held_out("multi_turn_base_7"));
        let n = (0..100).filter(|i| held_out(&format!("t_{i}"))).count();
        assert_eq!(n, 20);
    }

    #[test]
    fn first_message_strategy_ignores_the_step() {
        let o = offered(
            Strategy::FirstMessage,
            &s(&["a", "b", "c"]),
            &s(&["x", "y"]),
            &s(&["u"]),
            2,
        );
        assert_eq!(o, s(&["a", "b"]));
    }

    #[test]
    fn keep_used_adds_earlier_tools_once() {
        let o = offered(
            Strategy::PerStepKeepUsed,
            &s(&["a"]),
            &s(&["x", "y", "z"]),
            &s(&["y", "u", "u"]),
            2,
        );
        assert_eq!(o, s(&["x", "y", "u"]));
    }

    #[test]
    fn recall_is_the_share_of_needed_tools_offered() {
        assert_eq!(recall(&s(&["a", "b"]), &s(&["b", "c"])), 0.5);
        assert_eq!(recall(&s(&["a"]), &[]), 1.0);
        let mut m = Mean::default();
        assert_eq!(m.get(), None);
        m.add(1.0);
        m.add(0.0);
        assert_eq!((m.get(), m.count()), (Some(0.5), 2));
    }
}
