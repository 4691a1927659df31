//! Tool routing over the steps of multi-step agent tasks: which tools each step needs against
//! which tools a routing strategy offers at that step. Pure functions; the program is
//! `examples/multistep_router.rs`.
//!
//! Strategies, each offering `k` routed tools:
//! - [`Strategy::FirstMessage`]: route once on the task's first user message and offer those
//!   tools at every step (what routing once per conversation gives an agent loop);
//! - [`Strategy::PerStep`]: route on the current step's user message;
//! - [`Strategy::PerStepKeepUsed`]: route on the current step and also keep offering every
//!   tool an earlier step used (so the offer can exceed `k`);
//! - [`Strategy::PerStepSplit`]: route on the current step and on each of its sub-queries
//!   ([`split_intents`]) and interleave the rankings ([`merge_rankings`]);
//! - [`Strategy::PerStepTwoLevel`]: route on the current step, first to the servers whose
//!   descriptions match it best, then to their tools ([`two_level`]).

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
    /// Route on each step and on each of its sub-queries, rankings interleaved.
    PerStepSplit,
    /// Route on each step to the best servers, then to their tools.
    PerStepTwoLevel,
}

impl Strategy {
    /// Every strategy, in report order.
    pub const ALL: [Strategy; 5] = [
        Strategy::FirstMessage,
        Strategy::PerStep,
        Strategy::PerStepKeepUsed,
        Strategy::PerStepSplit,
        Strategy::PerStepTwoLevel,
    ];

    /// The strategy's name in reports.
    pub fn label(self) -> &'static str {
        match self {
            Strategy::FirstMessage => "first message only",
            Strategy::PerStep => "per step",
            Strategy::PerStepKeepUsed => "per step + tools already used",
            Strategy::PerStepSplit => "per step, split into sub-queries",
            Strategy::PerStepTwoLevel => "per step, two-level (servers, then tools)",
        }
    }
}

/// The rankings a step's offer is made from, each best first.
#[derive(Debug, Clone, Copy)]
pub struct Ranked<'a> {
    /// For the task's first user message.
    pub first: &'a [String],
    /// For the step's user message.
    pub step: &'a [String],
    /// The step's ranking interleaved with its sub-queries' ([`merge_rankings`]); equal to
    /// `step` when the message does not split.
    pub split: &'a [String],
    /// The step's two-level ranking ([`two_level`]).
    pub two_level: &'a [String],
}

/// The tools offered at a step: the first `k` of the ranking the strategy routes on, plus,
/// for [`Strategy::PerStepKeepUsed`], the tools earlier steps used (in order, no repeats).
pub fn offered(
    strategy: Strategy,
    ranked: Ranked,
    used_before: &[String],
    k: usize,
) -> Vec<String> {
    let list = match strategy {
        Strategy::FirstMessage => ranked.first,
        Strategy::PerStepSplit => ranked.split,
        Strategy::PerStepTwoLevel => ranked.two_level,
        _ => ranked.step,
    };
    let mut out: Vec<String> = list.iter().take(k).cloned().collect();
    if strategy == Strategy::PerStepKeepUsed {
        for u in used_before {
            if !out.contains(u) {
                out.push(u.clone());
            }
        }
    }
    out
}

/// A two-level ranking: the tools of the `servers` chosen first (each tool's server in
/// `server_of`), in the order of the flat ranking `flat`, then the other tools in that order;
/// the first `k`.
pub fn two_level(
    flat: &[String],
    server_of: &HashMap<String, usize>,
    servers: &[usize],
    k: usize,
) -> Vec<String> {
    let chosen = |n: &String| server_of.get(n).is_some_and(|s| servers.contains(s));
    flat.iter()
        .filter(|n| chosen(n))
        .chain(flat.iter().filter(|n| !chosen(n)))
        .take(k)
        .cloned()
        .collect()
}

/// Words that start another request inside a sentence.
const JOINERS: [&str; 7] = [
    " and then ",
    ", then ",
    " then ",
    " and also ",
    " after that ",
    " additionally ",
    " also ",
];

/// The sub-queries of a message that asks for several things: its sentences (cut at `.`, `?`,
/// `!` or `;` before a space, and at line breaks), each cut again before "then", "and
/// then", "also", "after that" and "additionally". Pieces under three words are dropped
/// (they name no request). A message with fewer than two pieces is one query.
pub fn split_intents(text: &str) -> Vec<String> {
    let mut sentences = vec![];
    let mut start = 0;
    let bytes = text.as_bytes();
    for (i, c) in text.char_indices() {
        let end_mark = matches!(c, '.' | '?' | '!' | ';')
            && bytes.get(i + 1).is_none_or(|b| b.is_ascii_whitespace());
        if end_mark || c == '\n' {
            sentences.push(&text[start..i]);
            start = i + 1;
        }
    }
    sentences.push(&text[start..]);
    let mut pieces = vec![];
    for s in sentences {
        let lower = s.to_ascii_lowercase();
        let mut cut = 0;
        let mut i = 0;
        while i < s.len() {
            match JOINERS.iter().find(|j| lower[i..].starts_with(*j)) {
                Some(j) => {
                    pieces.push(&s[cut..i]);
                    i += j.len();
                    cut = i;
                }
                None => i += s[i..].chars().next().map_or(1, char::len_utf8),
            }
        }
        pieces.push(&s[cut..]);
    }
    let kept: Vec<String> = pieces
        .into_iter()
        .map(|p| p.trim().trim_end_matches(',').trim_end())
        .filter(|p| p.split_whitespace().count() >= 3)
        .map(str::to_owned)
        .collect();
    if kept.len() < 2 {
        vec![text.trim().to_owned()]
    } else {
        kept
    }
}

/// Rankings interleaved by rank (every list's first, then every list's second, ...), each
/// name once, the first `k`.
pub fn merge_rankings(lists: &[Vec<String>], k: usize) -> Vec<String> {
    let mut out: Vec<String> = vec![];
    let depth = lists.iter().map(Vec::len).max().unwrap_or(0);
    for r in 0..depth {
        for l in lists {
            if out.len() == k {
                return out;
            }
            if let Some(n) = l.get(r) {
                if !out.contains(n) {
                    out.push(n.clone());
                }
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
        let (first, step) = (s(&["a", "b", "c"]), s(&["x", "y"]));
        let ranked = Ranked {
            first: &first,
            step: &step,
            split: &step,
            two_level: &step,
        };
        let o = offered(Strategy::FirstMessage, ranked, &s(&["u"]), 2);
        assert_eq!(o, s(&["a", "b"]));
    }

    #[test]
    fn keep_used_adds_earlier_tools_once() {
        let (first, step) = (s(&["a"]), s(&["x", "y", "z"]));
        let ranked = Ranked {
            first: &first,
            step: &step,
            split: &step,
            two_level: &step,
        };
        let o = offered(Strategy::PerStepKeepUsed, ranked, &s(&["y", "u", "u"]), 2);
        assert_eq!(o, s(&["x", "y", "u"]));
    }

    #[test]
    fn a_message_splits_at_sentences_and_joiners() {
        assert_eq!(
            split_intents("Move report.txt to the archive folder. Then email the summary to Bob, and also book a taxi for 5 pm!"),
            s(&[
                "Move report.txt to the archive folder",
                "email the summary to Bob",
                "book a taxi for 5 pm",
            ])
        );
    }

    #[test]
    fn a_single_request_stays_whole() {
        assert_eq!(
            split_intents("What is the weather in Oslo? Thanks."),
            s(&["What is the weather in Oslo? Thanks."])
        );
    }

    #[test]
    fn two_level_puts_the_chosen_servers_tools_first_in_flat_order() {
        let flat = s(&["a1", "b1", "c1", "a2", "b2"]);
        let server_of: HashMap<String, usize> =
            [("a1", 0), ("a2", 0), ("b1", 1), ("b2", 1), ("c1", 2)]
                .into_iter()
                .map(|(n, i)| (n.to_owned(), i))
                .collect();
        assert_eq!(
            two_level(&flat, &server_of, &[0], 3),
            s(&["a1", "a2", "b1"])
        );
        assert_eq!(
            two_level(&flat, &server_of, &[2, 1], 4),
            s(&["b1", "c1", "b2", "a1"])
        );
    }

    #[test]
    fn rankings_interleave_by_rank_without_repeats() {
        let lists = [s(&["a", "b", "c"]), s(&["x", "a", "y"]), s(&["z"])];
        assert_eq!(merge_rankings(&lists, 5), s(&["a", "x", "z", "b", "c"]));
        assert_eq!(merge_rankings(&lists, 2), s(&["a", "x"]));
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
