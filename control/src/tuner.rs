//! The tuner's decisions, as pure functions.
//!
//! Each cycle: read a window of counters ([`Counters`]), let the rules propose at most one
//! change ([`propose`]: the first rule, in declared order, that fires and whose one step
//! stays inside the knob's bounds), run it as a trial (the caller serves window A with
//! the current policy and window B with the proposed one, over the same probe workload),
//! and let the gate judge the samples ([`judge`], see [`crate::gate`]). [`judge`] returns
//! a [`Decision`] that [`PolicyState::record`](crate::policy::PolicyState::record) applies
//! (accepted) or only journals (rejected, reverted).
//!
//! Rules are explicit and small: an id, a rationale, a knob, a direction and a condition
//! on the counters. They never see each other's state, so a decision is explained by one
//! rule and one window.

use serde::{Deserialize, Serialize};

use crate::gate::{self, Better, GateConfig, Metric, Samples};
use crate::policy::{self, Decision, Policy};
use crate::ControlError;

/// Counters of one window, from the node's own metrics.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Counters {
    /// Requests finished in the window.
    pub requests: u64,
    /// Requests that failed.
    pub errors: u64,
    /// Answers of the probe workload that were right, and those scored, when a probe ran.
    pub correct: u64,
    /// Probe answers scored.
    pub scored: u64,
    /// Cascade steps at the first tier.
    pub first_tier_steps: u64,
    /// First-tier answers escalated for a low logit margin alone.
    pub first_tier_low_margin: u64,
    /// Cascade requests that skipped the first tier on a low router score.
    pub low_router_score_skips: u64,
    /// Requests with a thinking budget.
    pub reasoning_requests: u64,
    /// Of those, how many hit it.
    pub reasoning_capped: u64,
    /// Tokens drafted for speculative decoding.
    pub draft_tokens: u64,
    /// Of those, how many the target accepted.
    pub draft_accepted: u64,
    /// Tokens the node's tiers generated.
    pub generated_tokens: u64,
    /// Instructions of the tiers' engine threads (user space; 0 where the kernel gives no
    /// hardware counters).
    pub instructions: u64,
    /// Cycles of the tiers' engine threads (as `instructions`).
    pub cycles: u64,
    /// Cache misses of the tiers' engine threads (as `instructions`).
    pub cache_misses: u64,
}

impl Counters {
    /// The window between `before` and these totals (a counter that went backwards, as
    /// after a restart, counts from zero).
    pub fn since(&self, before: &Counters) -> Counters {
        let d = |now: u64, then: u64| now.saturating_sub(then);
        Counters {
            requests: d(self.requests, before.requests),
            errors: d(self.errors, before.errors),
            correct: d(self.correct, before.correct),
            scored: d(self.scored, before.scored),
            first_tier_steps: d(self.first_tier_steps, before.first_tier_steps),
            first_tier_low_margin: d(self.first_tier_low_margin, before.first_tier_low_margin),
            low_router_score_skips: d(self.low_router_score_skips, before.low_router_score_skips),
            reasoning_requests: d(self.reasoning_requests, before.reasoning_requests),
            reasoning_capped: d(self.reasoning_capped, before.reasoning_capped),
            draft_tokens: d(self.draft_tokens, before.draft_tokens),
            draft_accepted: d(self.draft_accepted, before.draft_accepted),
            generated_tokens: d(self.generated_tokens, before.generated_tokens),
            instructions: d(self.instructions, before.instructions),
            cycles: d(self.cycles, before.cycles),
            cache_misses: d(self.cache_misses, before.cache_misses),
        }
    }

    /// Instructions per generated token, when the hardware counters ran in the window.
    pub fn instructions_per_token(&self) -> Option<f64> {
        Self::share(self.instructions, self.generated_tokens).filter(|_| self.instructions > 0)
    }

    /// Cache misses per thousand instructions, when the hardware counters ran.
    pub fn cache_misses_per_kilo_instruction(&self) -> Option<f64> {
        Self::share(self.cache_misses * 1000, self.instructions)
    }

    /// Share of probe answers that were right, when any were scored.
    pub fn accuracy(&self) -> Option<f64> {
        (self.scored > 0).then(|| self.correct as f64 / self.scored as f64)
    }

    fn share(num: u64, den: u64) -> Option<f64> {
        (den > 0).then(|| num as f64 / den as f64)
    }
}

/// Targets the rules compare counters with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TunerConfig {
    /// Accuracy of the probe workload the policy should hold. Default 0.8.
    pub accuracy_target: f64,
    /// Fewest requests in a window before any rule fires. Default 20.
    pub min_requests: u64,
    /// The gate's thresholds.
    pub gate: GateConfig,
}

impl Default for TunerConfig {
    fn default() -> Self {
        Self {
            accuracy_target: 0.8,
            min_requests: 20,
            gate: GateConfig::default(),
        }
    }
}

/// Which way a rule moves its knob.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// One step up.
    Up,
    /// One step down.
    Down,
}

/// An explicit tuning rule.
#[derive(Debug, Clone)]
pub struct Rule {
    /// Stable id, logged with every decision.
    pub id: &'static str,
    /// Why the change should help, in one sentence.
    pub rationale: &'static str,
    /// Knob it moves.
    pub knob: &'static str,
    /// Which way.
    pub direction: Direction,
    /// What the change must improve for the gate to keep it.
    pub objective: fn() -> Metric,
    /// Whether the rule fires on a window.
    pub fires: fn(&Counters, &Policy, &TunerConfig) -> bool,
}

fn latency() -> Metric {
    Metric::continuous("latency_ms", Better::Lower, 0.10)
}

fn accuracy() -> Metric {
    Metric::rate("accuracy", Better::Higher, 0.05)
}

/// The rules, in priority order: accuracy first, then cost.
pub fn rules() -> Vec<Rule> {
    vec![
        Rule {
            id: "cascade-first-tier-wrong",
            rationale: "probe accuracy is under target while the first tier keeps answers: a higher margin threshold sends doubtful answers to a larger tier",
            knob: "cascade.min_margin[0]",
            direction: Direction::Up,
            objective: accuracy,
            fires: |c, _, t| {
                c.accuracy().is_some_and(|a| a < t.accuracy_target)
                    && c.first_tier_steps > c.first_tier_low_margin
            },
        },
        Rule {
            id: "reasoning-capped-inaccurate",
            rationale: "probe accuracy is under target and most budgeted requests hit their thinking cap: a larger default budget lets them finish reasoning",
            knob: "reasoning.default_budget",
            direction: Direction::Up,
            objective: accuracy,
            fires: |c, _, t| {
                c.accuracy().is_some_and(|a| a < t.accuracy_target)
                    && Counters::share(c.reasoning_capped, c.reasoning_requests)
                        .is_some_and(|s| s >= 0.5)
            },
        },
        Rule {
            id: "cascade-margin-escalations",
            rationale: "accuracy is on target but most first-tier answers escalate on the logit margin alone: a lower threshold keeps more cheap answers and cuts latency",
            knob: "cascade.min_margin[0]",
            direction: Direction::Down,
            objective: latency,
            fires: |c, _, t| {
                c.accuracy().is_none_or(|a| a >= t.accuracy_target)
                    && Counters::share(c.first_tier_low_margin, c.first_tier_steps)
                        .is_some_and(|s| s >= 0.5)
            },
        },
        Rule {
            id: "router-score-skips",
            rationale: "accuracy is on target but many cascade requests skip the first tier on a low router score: a lower floor lets the cheap tier try them",
            knob: "cascade.min_router_score",
            direction: Direction::Down,
            objective: latency,
            fires: |c, _, t| {
                c.accuracy().is_none_or(|a| a >= t.accuracy_target)
                    && Counters::share(c.low_router_score_skips, c.requests)
                        .is_some_and(|s| s >= 0.3)
            },
        },
        Rule {
            id: "drafts-mostly-rejected",
            rationale: "fewer than half of the drafted tokens are accepted: shorter drafts waste fewer draft steps and target rows on tokens that are thrown away",
            knob: "speculative.k_max",
            direction: Direction::Down,
            objective: latency,
            fires: |c, _, t| {
                c.draft_tokens >= 10 * t.min_requests
                    && Counters::share(c.draft_accepted, c.draft_tokens).is_some_and(|s| s < 0.5)
            },
        },
        Rule {
            id: "reasoning-budget-unused",
            rationale: "accuracy is on target and no request reached its thinking cap: a lower default budget bounds the worst-case latency without touching today's answers",
            knob: "reasoning.default_budget",
            direction: Direction::Down,
            objective: latency,
            fires: |c, _, t| {
                c.accuracy().is_some_and(|a| a >= t.accuracy_target)
                    && c.reasoning_requests >= t.min_requests
                    && c.reasoning_capped == 0
            },
        },
    ]
}

/// A proposed change of one knob by one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Proposal {
    /// Rule id (`manual` for an operator's request).
    pub rule: String,
    /// Why.
    pub rationale: String,
    /// Knob id.
    pub knob: String,
    /// Current value.
    pub before: f64,
    /// Proposed value, one step away.
    pub after: f64,
    /// What the gate must see improve.
    pub objective: Metric,
}

impl Proposal {
    /// The policy with the change applied.
    pub fn apply_to(&self, p: &Policy) -> Result<Policy, ControlError> {
        let mut next = p.clone();
        next.set(&self.knob, self.after)?;
        Ok(next)
    }
}

/// The first rule that fires and can take one step within its knob's bounds.
pub fn propose(
    rules: &[Rule],
    counters: &Counters,
    current: &Policy,
    cfg: &TunerConfig,
) -> Option<Proposal> {
    if counters.requests < cfg.min_requests {
        return None;
    }
    rules.iter().find_map(|r| {
        if !(r.fires)(counters, current, cfg) {
            return None;
        }
        let k = policy::knob(r.knob)?;
        let before = current.get(r.knob).ok()?;
        let after = match r.direction {
            Direction::Up => before + k.step,
            Direction::Down => before - k.step,
        };
        (after >= k.min - 1e-9 && after <= k.max + 1e-9).then(|| Proposal {
            rule: r.id.into(),
            rationale: r.rationale.into(),
            knob: r.knob.into(),
            before,
            after: snap(after, &k),
            objective: (r.objective)(),
        })
    })
}

/// An operator's proposal (`POST /v1/control/tune` with a knob): one step at most, inside
/// the knob's bounds, judged by the same gate.
pub fn manual(
    current: &Policy,
    knob_id: &str,
    to: f64,
    objective: Metric,
) -> Result<Proposal, ControlError> {
    let k = policy::knob(knob_id)
        .ok_or_else(|| ControlError::Config(format!("unknown knob `{knob_id}`")))?;
    let before = current.get(knob_id)?;
    if (to - before).abs() < 1e-9 {
        return Err(ControlError::Config(format!(
            "{knob_id} is already {before}: nothing to try"
        )));
    }
    if (to - before).abs() > k.step + 1e-9 {
        return Err(ControlError::Config(format!(
            "{knob_id}: {before} -> {to} is more than one step ({})",
            k.step
        )));
    }
    current.clone().set(knob_id, to)?;
    Ok(Proposal {
        rule: "manual".into(),
        rationale: "requested through /v1/control/tune".into(),
        knob: knob_id.into(),
        before,
        after: to,
        objective,
    })
}

fn snap(v: f64, k: &policy::Knob) -> f64 {
    k.min + ((v - k.min) / k.step).round() * k.step
}

/// The gate's decision on a trial, ready for [`crate::policy::PolicyState::record`].
pub fn judge(proposal: &Proposal, a: &Samples, b: &Samples, cfg: &GateConfig) -> Decision {
    let g = gate::evaluate(cfg, &proposal.objective, a, b);
    let (at_ms, at) = policy::now();
    Decision {
        at_ms,
        at,
        rule: proposal.rule.clone(),
        rationale: proposal.rationale.clone(),
        knob: proposal.knob.clone(),
        before: proposal.before,
        after: proposal.after,
        objective: proposal.objective.name.clone(),
        verdict: g.verdict,
        reason: g.reason,
        version: 0,
        tests: g.tests,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_is_the_difference_of_two_totals() {
        let now = Counters {
            requests: 37,
            errors: 2,
            first_tier_steps: 24,
            instructions: 9_000,
            generated_tokens: 30,
            ..Counters::default()
        };
        let before = Counters {
            requests: 30,
            first_tier_steps: 20,
            instructions: 6_000,
            generated_tokens: 20,
            ..Counters::default()
        };
        let w = now.since(&before);
        assert_eq!((w.requests, w.first_tier_steps, w.errors), (7, 4, 2));
        assert_eq!(w.instructions_per_token(), Some(300.0));
    }

    #[test]
    fn a_counter_that_went_backwards_never_goes_negative() {
        let low = Counters {
            requests: 3,
            ..Counters::default()
        };
        let high = Counters {
            requests: 30,
            ..Counters::default()
        };
        assert_eq!(low.since(&high).requests, 0);
    }

    #[test]
    fn per_token_hardware_figures_need_the_counters() {
        let c = Counters {
            generated_tokens: 10,
            ..Counters::default()
        };
        assert_eq!(c.instructions_per_token(), None);
        assert_eq!(c.cache_misses_per_kilo_instruction(), None);
    }
    use crate::gate::Verdict;
    use crate::policy::PolicyState;

    /// The policy the tests start from: first-tier margin 1.0, so a step either way
    /// stays inside the knob's bounds (independent of the shipped default).
    fn start() -> Policy {
        let mut p = Policy::default();
        p.cascade.min_margin = vec![1.0, 1.0];
        p
    }

    fn counters(acc: Option<(u64, u64)>, steps: u64, low_margin: u64) -> Counters {
        Counters {
            requests: 50,
            correct: acc.map_or(0, |a| a.0),
            scored: acc.map_or(0, |a| a.1),
            first_tier_steps: steps,
            first_tier_low_margin: low_margin,
            ..Counters::default()
        }
    }

    #[test]
    fn rules_fire_on_their_condition_only() {
        let cfg = TunerConfig::default();
        let p = start();
        let r = rules();
        // Accurate, most first-tier answers escalate on margin: lower the margin.
        let prop = propose(&r, &counters(Some((45, 50)), 40, 30), &p, &cfg).unwrap();
        assert_eq!(prop.rule, "cascade-margin-escalations");
        assert_eq!((prop.before, prop.after), (1.0, 0.75));
        assert_eq!(prop.objective.name, "latency_ms");
        // Inaccurate with kept first-tier answers: raise it.
        let prop = propose(&r, &counters(Some((30, 50)), 40, 10), &p, &cfg).unwrap();
        assert_eq!(prop.rule, "cascade-first-tier-wrong");
        assert_eq!((prop.before, prop.after), (1.0, 1.25));
        // Quiet window: nothing.
        assert_eq!(
            propose(&r, &counters(Some((45, 50)), 40, 5), &p, &cfg),
            None
        );
        // Too few requests: nothing, whatever the counters say.
        let mut c = counters(Some((30, 50)), 40, 10);
        c.requests = 5;
        assert_eq!(propose(&r, &c, &p, &cfg), None);
    }

    #[test]
    fn mostly_rejected_drafts_shorten_the_draft_cap() {
        let cfg = TunerConfig::default();
        let p = start();
        let mut c = counters(None, 0, 0);
        (c.draft_tokens, c.draft_accepted) = (400, 150);
        let prop = propose(&rules(), &c, &p, &cfg).unwrap();
        assert_eq!(prop.rule, "drafts-mostly-rejected");
        assert_eq!(prop.knob, "speculative.k_max");
        assert_eq!((prop.before, prop.after), (12.0, 11.0));
        // Mostly accepted, or too few drafts to tell: nothing.
        c.draft_accepted = 300;
        assert_eq!(propose(&rules(), &c, &p, &cfg), None);
        (c.draft_tokens, c.draft_accepted) = (100, 10);
        assert_eq!(propose(&rules(), &c, &p, &cfg), None);
        // At the knob's floor the rule yields.
        let mut low = start();
        low.set("speculative.k_max", 1.0).unwrap();
        (c.draft_tokens, c.draft_accepted) = (400, 150);
        assert_eq!(propose(&rules(), &c, &low, &cfg), None);
    }

    #[test]
    fn a_rule_at_its_bound_yields_to_the_next() {
        let cfg = TunerConfig::default();
        let mut p = Policy::default();
        p.set("cascade.min_margin[0]", 0.0).unwrap();
        let mut c = counters(Some((45, 50)), 40, 30);
        c.low_router_score_skips = 20;
        p.set("cascade.min_router_score", 0.5).unwrap();
        let prop = propose(&rules(), &c, &p, &cfg).unwrap();
        assert_eq!(prop.rule, "router-score-skips");
        assert!((prop.after - 0.45).abs() < 1e-9, "{prop:?}");
    }

    #[test]
    fn manual_proposals_are_one_bounded_step() {
        let p = start();
        let m = manual(&p, "router_top_k", 6.0, latency()).unwrap();
        assert_eq!((m.before, m.after), (5.0, 6.0));
        assert!(manual(&p, "router_top_k", 9.0, latency())
            .unwrap_err()
            .to_string()
            .contains("more than one step"));
        assert!(manual(&p, "cascade.min_margin[0]", 1.1, latency()).is_err());
        assert!(manual(&p, "router_top_k", 5.0, latency())
            .unwrap_err()
            .to_string()
            .contains("nothing to try"));
    }

    /// End to end over deterministic samples: proposal, trial, gate, state file.
    #[test]
    fn cycles_accept_improvements_and_leave_the_policy_on_noise_or_regression() {
        use crate::gate::tests::window;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policy.json");
        let cfg = TunerConfig::default();
        let mut state = PolicyState::new(start());
        state.save(&path).unwrap();
        let c = counters(Some((45, 50)), 40, 30);

        // 1. The margin cut makes answers faster at equal accuracy: accepted.
        let prop = propose(&rules(), &c, &state.policy, &cfg).unwrap();
        let d = judge(
            &prop,
            &window(11, 60, 120.0, 0.9, 0.0),
            &window(12, 60, 80.0, 0.9, 0.0),
            &cfg.gate,
        );
        assert_eq!(d.verdict, Verdict::Accept, "{}", d.reason);
        state.record(d, Some(&path)).unwrap();
        assert_eq!(state.version, 1);
        assert_eq!(state.policy.cascade.margin_for(0), 0.75);

        // 2. The next cut changes nothing measurable: rejected, file unchanged.
        let saved = std::fs::read(&path).unwrap();
        let prop = propose(&rules(), &c, &state.policy, &cfg).unwrap();
        assert_eq!(prop.after, 0.5);
        let d = judge(
            &prop,
            &window(13, 60, 80.0, 0.9, 0.0),
            &window(14, 60, 80.0, 0.9, 0.0),
            &cfg.gate,
        );
        assert_eq!(d.verdict, Verdict::Reject, "{}", d.reason);
        state.record(d, Some(&path)).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), saved);
        assert_eq!(state.policy.cascade.margin_for(0), 0.75);

        // 3. It is faster but loses accuracy: reverted, file unchanged.
        let d = judge(
            &prop,
            &window(15, 60, 80.0, 0.9, 0.0),
            &window(16, 60, 50.0, 0.6, 0.0),
            &cfg.gate,
        );
        assert_eq!(d.verdict, Verdict::Revert, "{}", d.reason);
        state.record(d, Some(&path)).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), saved);
        assert_eq!(state.version, 1);

        let back = PolicyState::load(&path).unwrap().unwrap();
        assert_eq!(back.history.len(), 1);
        let h = &back.history[0];
        assert_eq!(h.rule, "cascade-margin-escalations");
        assert_eq!((h.before, h.after), (1.0, 0.75));
        assert!(h
            .tests
            .iter()
            .any(|t| t.metric == "accuracy" && t.role == "guard"));
        let journal = std::fs::read_to_string(policy::journal_path(&path)).unwrap();
        assert_eq!(journal.lines().count(), 3, "every decision journaled");
    }
}
