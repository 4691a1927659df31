//! The policy the tuner turns and the state file that keeps it.
//!
//! A [`Policy`] holds the knobs other actors read per request: the cascade thresholds,
//! the reasoning budget and the tool router's top-k. Each knob the tuner may touch is
//! declared in [`knobs`] with bounds and a step; [`Policy::set`] refuses values outside
//! them.
//!
//! [`PolicyState`] is the versioned file: the current policy, its version (bumped on every
//! accepted change) and the history of accepted changes with their test statistics. It is
//! written atomically (temp file in the same folder, fsync, rename), so a reader sees the
//! old file or the new one, never half of one. Rejected and reverted trials leave the file
//! byte for byte as it was; they are appended to a journal next to it
//! (`<file>.decisions.jsonl`) so that every decision is kept.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use mesh_tiers::cascade::{CascadePolicy, ReasoningPolicy};
use serde::{Deserialize, Serialize};

use crate::gate::{TestResult, Verdict};
use crate::ControlError;

/// Knobs read per request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Policy {
    /// Cascade thresholds and tier order.
    pub cascade: CascadePolicy,
    /// Reasoning-token budgets.
    pub reasoning: ReasoningPolicy,
    /// Tools the router keeps in a routed prompt.
    pub router_top_k: usize,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            cascade: CascadePolicy::default(),
            reasoning: ReasoningPolicy::default(),
            router_top_k: crate::RouterConfig::default().top_k,
        }
    }
}

/// A knob the tuner may change: its id, bounds and step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Knob {
    /// Id as in the config (`cascade.min_margin[0]`).
    pub id: String,
    /// Smallest value.
    pub min: f64,
    /// Largest value.
    pub max: f64,
    /// One step; a trial moves a knob by exactly one.
    pub step: f64,
    /// What it trades.
    pub effect: String,
}

/// The declared knobs.
pub fn knobs() -> Vec<Knob> {
    let k = |id: &str, min: f64, max: f64, step: f64, effect: &str| Knob {
        id: id.into(),
        min,
        max,
        step,
        effect: effect.into(),
    };
    vec![
        k("cascade.min_margin[0]", 0.0, 4.0, 0.25,
          "logit margin the first tier needs to keep its answer: higher escalates more (slower, fewer wrong cheap answers)"),
        k("cascade.min_margin[1]", 0.0, 4.0, 0.25,
          "the same for the second tier"),
        k("cascade.min_router_score", 0.0, 1.0, 0.05,
          "router top-1 score below which the cascade starts at the second tier"),
        k("reasoning.default_budget", 0.0, 4096.0, 32.0,
          "thinking tokens allowed when a request sets none and no confidence is known"),
        k("reasoning.base", 0.0, 4096.0, 64.0,
          "thinking-budget floor for a routed request (confidence 0)"),
        k("router_top_k", 1.0, 20.0, 1.0,
          "tools the router keeps in a routed prompt: more costs prompt tokens, fewer can drop the right tool"),
    ]
}

/// The knob declared with this id.
pub fn knob(id: &str) -> Option<Knob> {
    knobs().into_iter().find(|k| k.id == id)
}

impl Policy {
    /// Current value of a knob (`reasoning.default_budget` unset reads as its maximum).
    pub fn get(&self, id: &str) -> Result<f64, ControlError> {
        Ok(match id {
            "cascade.min_margin[0]" => f64::from(self.cascade.margin_for(0)),
            "cascade.min_margin[1]" => f64::from(self.cascade.margin_for(1)),
            "cascade.min_router_score" => f64::from(self.cascade.min_router_score),
            "reasoning.default_budget" => {
                self.reasoning.default_budget.map_or(4096.0, |b| b as f64)
            }
            "reasoning.base" => self.reasoning.base as f64,
            "router_top_k" => self.router_top_k as f64,
            _ => return Err(ControlError::Config(format!("unknown knob `{id}`"))),
        })
    }

    /// Sets a knob, refusing values outside its declared bounds or off its step grid.
    pub fn set(&mut self, id: &str, v: f64) -> Result<(), ControlError> {
        let k = knob(id).ok_or_else(|| ControlError::Config(format!("unknown knob `{id}`")))?;
        if !v.is_finite() || v < k.min - 1e-9 || v > k.max + 1e-9 {
            return Err(ControlError::Config(format!(
                "{id} = {v} is outside [{}, {}]",
                k.min, k.max
            )));
        }
        let steps = (v - k.min) / k.step;
        if (steps - steps.round()).abs() > 1e-6 {
            return Err(ControlError::Config(format!(
                "{id} = {v} is not on its step grid ({} + n x {})",
                k.min, k.step
            )));
        }
        match id {
            "cascade.min_margin[0]" | "cascade.min_margin[1]" => {
                let i = usize::from(id.ends_with("[1]"));
                let m = &mut self.cascade.min_margin;
                let fill = m.last().copied().unwrap_or(0.0);
                while m.len() <= i {
                    m.push(fill);
                }
                m[i] = v as f32;
            }
            "cascade.min_router_score" => self.cascade.min_router_score = v as f32,
            "reasoning.default_budget" => self.reasoning.default_budget = Some(v.round() as usize),
            "reasoning.base" => self.reasoning.base = v.round() as usize,
            "router_top_k" => self.router_top_k = v.round() as usize,
            _ => unreachable!("knob() knows only the ids above"),
        }
        Ok(())
    }
}

/// One tuner decision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// Unix time in milliseconds.
    pub at_ms: u64,
    /// The same as an RFC 3339 UTC timestamp.
    pub at: String,
    /// Rule that proposed the change (`manual` for an operator's request).
    pub rule: String,
    /// Why the rule proposed it.
    pub rationale: String,
    /// Knob id.
    pub knob: String,
    /// Value before.
    pub before: f64,
    /// Value proposed.
    pub after: f64,
    /// Metric the change was meant to improve.
    pub objective: String,
    /// Gate verdict.
    pub verdict: Verdict,
    /// The gate's reason.
    pub reason: String,
    /// Policy version after the decision (unchanged unless accepted).
    pub version: u64,
    /// The statistics behind the verdict.
    pub tests: Vec<TestResult>,
}

/// The versioned policy file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyState {
    /// File format (1).
    pub format: u32,
    /// Bumped on every accepted change.
    pub version: u64,
    /// The policy in force.
    pub policy: Policy,
    /// Accepted changes, oldest first.
    pub history: Vec<Decision>,
}

impl PolicyState {
    /// Version 0 of a policy.
    pub fn new(policy: Policy) -> Self {
        Self {
            format: 1,
            version: 0,
            policy,
            history: vec![],
        }
    }

    /// Reads the file, or `None` when it does not exist.
    pub fn load(path: &Path) -> Result<Option<Self>, ControlError> {
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(state_err(path, e)),
        };
        let s: Self = serde_json::from_slice(&bytes).map_err(|e| state_err(path, e))?;
        if s.format != 1 {
            return Err(state_err(path, format!("unknown format {}", s.format)));
        }
        Ok(Some(s))
    }

    /// Writes the file atomically: a temp file in the same folder, fsync, rename, fsync of
    /// the folder.
    pub fn save(&self, path: &Path) -> Result<(), ControlError> {
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(|e| state_err(dir, e))?;
        let tmp = temp_path(path);
        let body = serde_json::to_vec_pretty(self).map_err(|e| state_err(path, e))?;
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&body)?;
            f.write_all(b"\n")?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)?;
            if let Ok(d) = std::fs::File::open(dir) {
                let _ = d.sync_all();
            }
            Ok(())
        };
        write().map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            state_err(path, e)
        })
    }

    /// Records a decision: an accepted one changes the policy, bumps the version and joins
    /// the history (the caller saves the file); every decision goes to the journal.
    pub fn record(&mut self, mut d: Decision, path: Option<&Path>) -> Result<(), ControlError> {
        if d.verdict == Verdict::Accept {
            let mut next = self.policy.clone();
            next.set(&d.knob, d.after)?;
            self.policy = next;
            self.version += 1;
            d.version = self.version;
            self.history.push(d.clone());
            if let Some(p) = path {
                self.save(p)?;
            }
        } else {
            d.version = self.version;
        }
        if let Some(p) = path {
            append_journal(&journal_path(p), &d)?;
        }
        Ok(())
    }
}

fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp.{}", std::process::id()));
    path.with_file_name(name)
}

/// `<file>.decisions.jsonl`, where every decision is appended.
pub fn journal_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".decisions.jsonl");
    path.with_file_name(name)
}

fn append_journal(path: &Path, d: &Decision) -> Result<(), ControlError> {
    let mut line = serde_json::to_vec(d).map_err(|e| state_err(path, e))?;
    line.push(b'\n');
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(&line))
        .map_err(|e| state_err(path, e))
}

fn state_err(path: &Path, e: impl std::fmt::Display) -> ControlError {
    ControlError::PolicyState(format!("{}: {e}", path.display()))
}

/// Unix milliseconds and their RFC 3339 UTC form.
pub fn now() -> (u64, String) {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    (ms, rfc3339(ms))
}

/// `2026-03-02T10:04:05.123Z` for Unix milliseconds.
pub fn rfc3339(ms: u64) -> String {
    let secs = ms / 1000;
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(rfc3339(1_772_445_845_123), "2026-03-02T10:04:05.123Z");
    }

    #[test]
    fn knobs_read_and_write_the_real_config() {
        let mut p = Policy::default();
        for k in knobs() {
            let v = p.get(&k.id).unwrap();
            assert!(v >= k.min && v <= k.max, "{} default {v} in bounds", k.id);
        }
        p.set("cascade.min_margin[1]", 0.5).unwrap();
        assert_eq!(p.cascade.margin_for(1), 0.5);
        assert_eq!(p.cascade.margin_for(0), 1.0, "the other tier untouched");
        p.set("reasoning.default_budget", 64.0).unwrap();
        assert_eq!(p.reasoning.budget(None, None), Some(64));
        p.set("router_top_k", 7.0).unwrap();
        assert_eq!(p.router_top_k, 7);
        let e = p.set("router_top_k", 40.0).unwrap_err().to_string();
        assert!(e.contains("outside [1, 20]"), "{e}");
        let e = p.set("cascade.min_margin[0]", 0.3).unwrap_err().to_string();
        assert!(e.contains("step grid"), "{e}");
        assert!(p.set("no.such", 1.0).is_err());
        assert_eq!(p.router_top_k, 7, "a refused set changes nothing");
    }

    fn decision(verdict: Verdict, knob: &str, before: f64, after: f64) -> Decision {
        let (at_ms, at) = now();
        Decision {
            at_ms,
            at,
            rule: "test".into(),
            rationale: "because".into(),
            knob: knob.into(),
            before,
            after,
            objective: "latency_ms".into(),
            verdict,
            reason: "r".into(),
            version: 0,
            tests: vec![],
        }
    }

    #[test]
    fn state_file_round_trips_and_only_accepts_change_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policy.json");
        assert_eq!(PolicyState::load(&path).unwrap(), None);
        let mut s = PolicyState::new(Policy::default());
        s.save(&path).unwrap();
        let before = std::fs::read(&path).unwrap();

        s.record(
            decision(Verdict::Reject, "router_top_k", 5.0, 6.0),
            Some(&path),
        )
        .unwrap();
        s.record(
            decision(Verdict::Revert, "router_top_k", 5.0, 4.0),
            Some(&path),
        )
        .unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), before, "file untouched");
        assert_eq!(s.version, 0);

        s.record(
            decision(Verdict::Accept, "router_top_k", 5.0, 6.0),
            Some(&path),
        )
        .unwrap();
        let back = PolicyState::load(&path).unwrap().unwrap();
        assert_eq!(back, s);
        assert_eq!(back.version, 1);
        assert_eq!(back.policy.router_top_k, 6);
        assert_eq!(back.history.len(), 1);
        assert_eq!(back.history[0].version, 1);
        let journal = std::fs::read_to_string(journal_path(&path)).unwrap();
        let verdicts: Vec<Verdict> = journal
            .lines()
            .map(|l| serde_json::from_str::<Decision>(l).unwrap().verdict)
            .collect();
        assert_eq!(
            verdicts,
            vec![Verdict::Reject, Verdict::Revert, Verdict::Accept]
        );
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().contains(".tmp."))
            .collect();
        assert!(leftovers.is_empty(), "no temp file left behind");
    }

    #[test]
    fn corrupt_state_file_is_an_error_naming_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policy.json");
        std::fs::write(&path, b"{ not json").unwrap();
        let e = PolicyState::load(&path).unwrap_err().to_string();
        assert!(e.contains("policy.json"), "{e}");
    }
}
