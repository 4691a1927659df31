//! Tier cascade policy: answer at the cheapest tier whose output is confident.
//!
//! A request addressed to the cascade runs on the first tier of
//! [`CascadePolicy::tiers`]; [`assess`] reads that tier's output and the per-token
//! logit margins the engine streams ([`crate::TokenEvent::Token::margin`]) and
//! decides whether to keep the answer or escalate to the next tier. The last tier's
//! answer is always kept. Thresholds live in the policy (a file the operator and
//! the tuner edit), not in code.
//!
//! Signals, in order:
//! 1. the output must be well formed: every `<tool_call>` body parses as a call,
//!    the think block is closed, and no call names a tool the prompt did not offer;
//! 2. the router's confidence (top-1 score of the tool router) when the agent
//!    layer supplies one: below `min_router_score` the first tier is skipped;
//! 3. the smallest top-1/top-2 logit margin over the generated tokens: a tier that was
//!    close to saying something else at any token of its answer is not trusted with it.
//!    Over every token (`margin_over = "all"`, the default, what the bundled tiers'
//!    thresholds were chosen with) or over the content tokens only (`"content"`: not
//!    format tokens such as punctuation, quotes, braces, fences and chat markers, whose
//!    close calls, a bare JSON call or a fenced one, say nothing about the answer; on the
//!    Qwen2.5-Coder pair this is what made the cascade cheaper than its large tier,
//!    docs/cascade.md).

use serde::{Deserialize, Serialize};

use crate::chat;

/// Cascade thresholds and tier order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CascadePolicy {
    /// Model id clients use to address the cascade.
    pub model: String,
    /// Tiers from cheapest to largest.
    pub tiers: Vec<String>,
    /// Accept a tier's answer only when every generated token won by at least this
    /// logit margin over the runner-up (per tier; a missing entry uses the last one).
    pub min_margin: Vec<f32>,
    /// Escalate on a malformed or unterminated call, an unclosed think block or a call
    /// naming a tool that was not offered.
    pub require_valid_calls: bool,
    /// With a router confidence below this, start at the second tier.
    pub min_router_score: f32,
    /// Which tokens' margins count.
    pub margin_over: MarginOver,
}

/// Which generated tokens the margin signal reads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MarginOver {
    /// Every generated token, the end token included.
    #[default]
    All,
    /// Tokens that are not format ([`is_format_token`]).
    Content,
}

/// A token that only shapes the answer: whitespace and JSON/fence punctuation only
/// (`{"`, `"}}`, `":`, a code fence), or a chat marker (`<|im_end|>`, `<tool_call>`).
pub fn is_format_token(text: &str) -> bool {
    let t = text.trim();
    t.chars()
        .all(|c| matches!(c, '{' | '}' | '[' | ']' | '"' | '\'' | ':' | ',' | '`'))
        || (t.starts_with('<') && t.ends_with('>') && !t.contains(' '))
}

impl Default for CascadePolicy {
    fn default() -> Self {
        Self {
            model: "cascade".into(),
            tiers: vec!["t1".into(), "t2".into(), "t3".into()],
            // Measured on the bundled family with the gateway's tool-call grammar
            // (docs/cascade.md): t3's accuracy at about 5.5x less compute, on the
            // 200 held-out tasks the thresholds were chosen on and on 100 fresh ones.
            min_margin: vec![0.25, 0.25],
            require_valid_calls: true,
            min_router_score: 0.0,
            margin_over: MarginOver::All,
        }
    }
}

impl CascadePolicy {
    /// Margin threshold for the tier at `index`.
    pub fn margin_for(&self, index: usize) -> f32 {
        self.min_margin
            .get(index)
            .or(self.min_margin.last())
            .copied()
            .unwrap_or(0.0)
    }

    /// Checks the policy makes sense.
    pub fn validate(&self) -> Result<(), String> {
        if self.tiers.is_empty() {
            return Err("cascade.tiers must name at least one tier".into());
        }
        if self.model.is_empty() {
            return Err("cascade.model must not be empty".into());
        }
        if self.tiers.iter().any(|t| t == &self.model) {
            return Err(format!(
                "cascade.model `{}` must differ from the tier names",
                self.model
            ));
        }
        if self.min_margin.iter().any(|m| !m.is_finite() || *m < 0.0) {
            return Err("cascade.min_margin values must be finite and >= 0".into());
        }
        Ok(())
    }
}

/// Why a tier's answer was kept or passed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Confident: keep it.
    Accept,
    /// The last tier answers whatever it says.
    LastTier,
    /// A call did not parse or was never closed.
    MalformedCall,
    /// A call named a tool the prompt did not offer.
    UnknownTool,
    /// The think block was never closed.
    UnclosedThink,
    /// Some token won by less than the tier's margin threshold.
    LowMargin,
    /// The router was not confident enough to let the first tier try.
    LowRouterScore,
    /// The generation hit its token limit.
    Truncated,
}

impl Verdict {
    /// Whether the answer is kept.
    pub fn kept(self) -> bool {
        matches!(self, Verdict::Accept | Verdict::LastTier)
    }

    /// Label for metrics and responses.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Accept => "accept",
            Verdict::LastTier => "last_tier",
            Verdict::MalformedCall => "malformed_call",
            Verdict::UnknownTool => "unknown_tool",
            Verdict::UnclosedThink => "unclosed_think",
            Verdict::LowMargin => "low_margin",
            Verdict::LowRouterScore => "low_router_score",
            Verdict::Truncated => "truncated",
        }
    }
}

/// The assessment of one tier's output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Assessment {
    /// Keep or escalate, and why.
    pub verdict: Verdict,
    /// Smallest margin over the generated tokens (`inf` when nothing was generated).
    pub min_margin: f32,
}

/// One tier's output as the cascade sees it.
#[derive(Debug, Clone, Copy)]
pub struct Output<'a> {
    /// The output parsed in the tier's chat format.
    pub parsed: &'a chat::ParsedOutput,
    /// Margin of each generated token, the end token included as the last entry when
    /// the generation stopped on it.
    pub margins: &'a [f32],
    /// Text of each generated token, as `margins` (for `MarginOver::Content`; empty reads
    /// every margin).
    pub texts: &'a [&'a str],
    /// The generation ended on its token limit.
    pub truncated: bool,
}

/// Decides whether the tier at `index` keeps its answer.
pub fn assess(
    policy: &CascadePolicy,
    index: usize,
    out: Output<'_>,
    offered: &[&str],
) -> Assessment {
    let content = policy.margin_over == MarginOver::Content && out.texts.len() == out.margins.len();
    let min_margin = out
        .margins
        .iter()
        .enumerate()
        .filter(|&(i, _)| !content || !is_format_token(out.texts[i]))
        .map(|(_, &m)| m)
        .fold(f32::INFINITY, f32::min);
    let last = index + 1 >= policy.tiers.len();
    let verdict = if last {
        Verdict::LastTier
    } else if out.truncated {
        Verdict::Truncated
    } else if let Some(bad) = policy
        .require_valid_calls
        .then(|| structure(out.parsed, offered))
        .flatten()
    {
        bad
    } else if min_margin < policy.margin_for(index) {
        Verdict::LowMargin
    } else {
        Verdict::Accept
    };
    Assessment {
        verdict,
        min_margin,
    }
}

/// The first structural problem of an output, if any.
fn structure(parsed: &chat::ParsedOutput, offered: &[&str]) -> Option<Verdict> {
    if parsed.unclosed_reasoning {
        return Some(Verdict::UnclosedThink);
    }
    if parsed.malformed_calls > 0 {
        return Some(Verdict::MalformedCall);
    }
    if parsed
        .tool_calls
        .iter()
        .any(|c| !offered.contains(&c.name.as_str()))
    {
        return Some(Verdict::UnknownTool);
    }
    None
}

/// Where the cascade starts for a request, given the router's confidence (if any).
pub fn first_tier(policy: &CascadePolicy, router_score: Option<f32>) -> (usize, Option<Verdict>) {
    match router_score {
        Some(s) if s < policy.min_router_score && policy.tiers.len() > 1 => {
            (1, Some(Verdict::LowRouterScore))
        }
        _ => (0, None),
    }
}

/// Reasoning-token budget policy: `min(max, base + per_confidence * confidence)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReasoningPolicy {
    /// Budget floor (confidence 0).
    pub base: usize,
    /// Added per unit of confidence.
    pub per_confidence: usize,
    /// Hard cap.
    pub max: usize,
    /// Budget when no confidence is known (`None` = no cap).
    pub default_budget: Option<usize>,
}

impl Default for ReasoningPolicy {
    fn default() -> Self {
        Self {
            base: 256,
            per_confidence: 4 * 1024,
            max: 4096,
            default_budget: None,
        }
    }
}

impl ReasoningPolicy {
    /// Budget for a request: its own override first, then the confidence formula,
    /// then the default.
    pub fn budget(&self, requested: Option<usize>, confidence: Option<f32>) -> Option<usize> {
        if requested.is_some() {
            return requested;
        }
        match confidence {
            Some(c) => {
                let c = c.clamp(0.0, 1.0);
                Some(
                    self.max
                        .min(self.base + (self.per_confidence as f32 * c) as usize),
                )
            }
            None => self.default_budget,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(
        p: &CascadePolicy,
        i: usize,
        text: &str,
        margins: &[f32],
        offered: &[&str],
    ) -> Assessment {
        let parsed = chat::parse_output(text);
        let out = Output {
            parsed: &parsed,
            margins,
            texts: &[],
            truncated: false,
        };
        assess(p, i, out, offered)
    }

    #[test]
    fn format_tokens_are_punctuation_fences_and_markers() {
        for t in [
            "{\"",
            "\"}}",
            "\":",
            " \"",
            "```",
            "\n",
            "<|im_end|>",
            "<tool_call>",
            "\"}}\n",
        ] {
            assert!(is_format_token(t), "{t:?}");
        }
        for t in ["get", "_weather", "Paris", " 42", "name", "< 3 >"] {
            assert!(!is_format_token(t), "{t:?}");
        }
    }

    #[test]
    fn content_margins_skip_close_format_choices() {
        let parsed = chat::parse_output(CALL);
        let texts = ["{\"", "name", "Oslo", "\"}}", "<|im_end|>"];
        let margins = [0.2, 9.0, 3.0, 0.4, 8.0];
        let all = CascadePolicy {
            min_margin: vec![1.0],
            ..CascadePolicy::default()
        };
        let content = CascadePolicy {
            margin_over: MarginOver::Content,
            ..all.clone()
        };
        let out = |p: &CascadePolicy| {
            assess(
                p,
                0,
                Output {
                    parsed: &parsed,
                    margins: &margins,
                    texts: &texts,
                    truncated: false,
                },
                &["get_weather"],
            )
        };
        assert_eq!(out(&all).verdict, Verdict::LowMargin);
        let a = out(&content);
        assert_eq!((a.verdict, a.min_margin), (Verdict::Accept, 3.0));
    }

    const CALL: &str =
        r#"<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>"#;

    #[test]
    fn confident_wellformed_answer_is_kept() {
        let p = CascadePolicy::default();
        let a = run(&p, 0, CALL, &[9.0, 7.5, 12.0], &["get_weather"]);
        assert_eq!(a.verdict, Verdict::Accept);
        assert_eq!(a.min_margin, 7.5);
    }

    #[test]
    fn one_close_token_escalates() {
        let p = CascadePolicy {
            min_margin: vec![1.0, 0.25],
            ..CascadePolicy::default()
        };
        let a = run(&p, 0, CALL, &[9.0, 0.5, 12.0], &["get_weather"]);
        assert_eq!(a.verdict, Verdict::LowMargin);
        // The second tier has its own (lower) threshold.
        let a = run(&p, 1, CALL, &[9.0, 0.5, 12.0], &["get_weather"]);
        assert_eq!(a.verdict, Verdict::Accept);
        // The shipped default keeps t1 answers whose every token won by 0.25.
        let d = CascadePolicy::default();
        assert_eq!(
            run(&d, 0, CALL, &[9.0, 0.3, 12.0], &["get_weather"]).verdict,
            Verdict::Accept
        );
        assert_eq!(
            run(&d, 0, CALL, &[9.0, 0.2, 12.0], &["get_weather"]).verdict,
            Verdict::LowMargin
        );
    }

    #[test]
    fn structure_problems_escalate_whatever_the_margin() {
        let p = CascadePolicy::default();
        let m = [50.0];
        let unknown = run(&p, 0, CALL, &m, &["get_time"]);
        assert_eq!(unknown.verdict, Verdict::UnknownTool);
        let broken = run(
            &p,
            0,
            r#"<tool_call>{"name": "get_weather""#,
            &m,
            &["get_weather"],
        );
        assert_eq!(broken.verdict, Verdict::MalformedCall);
        let think = run(&p, 0, "<think>12 * 4 = 48", &m, &[]);
        assert_eq!(think.verdict, Verdict::UnclosedThink);
        let truncated = assess(
            &p,
            0,
            Output {
                parsed: &chat::parse_output("ok"),
                margins: &m,
                texts: &[],
                truncated: true,
            },
            &[],
        );
        assert_eq!(truncated.verdict, Verdict::Truncated);
    }

    #[test]
    fn last_tier_always_answers() {
        let p = CascadePolicy::default();
        let a = run(&p, 2, "<tool_call>{", &[0.0], &[]);
        assert_eq!(a.verdict, Verdict::LastTier);
        assert!(a.verdict.kept());
    }

    #[test]
    fn plain_answers_need_no_calls() {
        let p = CascadePolicy::default();
        let a = run(
            &p,
            0,
            "None of the available tools can do that.",
            &[8.0],
            &[],
        );
        assert_eq!(a.verdict, Verdict::Accept);
    }

    #[test]
    fn router_confidence_can_skip_the_first_tier() {
        let p = CascadePolicy {
            min_router_score: 0.5,
            ..Default::default()
        };
        assert_eq!(
            first_tier(&p, Some(0.3)),
            (1, Some(Verdict::LowRouterScore))
        );
        assert_eq!(first_tier(&p, Some(0.7)), (0, None));
        assert_eq!(first_tier(&p, None), (0, None));
    }

    #[test]
    fn policy_validation() {
        assert!(CascadePolicy::default().validate().is_ok());
        let bad = CascadePolicy {
            model: "t1".into(),
            ..Default::default()
        };
        assert!(bad.validate().is_err());
        let bad = CascadePolicy {
            min_margin: vec![f32::NAN],
            ..Default::default()
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn reasoning_budget_formula() {
        let r = ReasoningPolicy::default();
        assert_eq!(r.budget(Some(7), Some(0.9)), Some(7));
        assert_eq!(r.budget(None, Some(0.0)), Some(256));
        assert_eq!(r.budget(None, Some(0.5)), Some(256 + 2048));
        assert_eq!(r.budget(None, Some(1.0)), Some(4096));
        assert_eq!(r.budget(None, None), None);
    }
}
