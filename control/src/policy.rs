//! The policy the tuner turns and the state file that keeps it.
//!
//! A [`Policy`] holds the knobs other actors read per request: the cascade thresholds,
//! the reasoning budget, the tool router's top-k, and the quantization policy
//! ([`QuantPolicy`]: which GGUF variant and KV cache type each tier runs per request
//! [`Role`]). Each knob the tuner may touch is
//! declared in [`knobs`] with bounds and a step; [`Policy::set`] refuses values outside
//! them.
//!
//! [`PolicyState`] is the versioned file: the current policy, its version (bumped on every
//! accepted change) and the history of accepted changes with their test statistics. It is
//! written atomically (temp file in the same folder, fsync, rename), so a reader sees the
//! old file or the new one, never half of one. Rejected and reverted trials leave the file
//! byte for byte as it was; they are appended to a journal next to it
//! (`<file>.decisions.jsonl`) so that every decision is kept.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use mesh_tiers::cascade::{CascadePolicy, ReasoningPolicy};
use mesh_tiers::KvType;
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
    /// Most drafts per speculative round of a request served by a local drafted tier
    /// (capped by the tier's own `draft.k_max`).
    pub draft_k_max: usize,
    /// Weights and KV cache type per role and tier; empty (the default) runs every tier
    /// as configured. Left out of the file while empty, so older files read the same.
    #[serde(skip_serializing_if = "QuantPolicy::is_default")]
    pub quantization: QuantPolicy,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            cascade: CascadePolicy::default(),
            reasoning: ReasoningPolicy::default(),
            router_top_k: crate::RouterConfig::default().top_k,
            draft_k_max: mesh_tiers::DraftConfig::default().k_max,
            quantization: QuantPolicy::default(),
        }
    }
}

/// What a chat request is for, as the quantization policy tells requests apart.
///
/// [`Role::classify`]: a request that shows the model tools (tools offered and
/// `tool_choice` not `none`) is `tool_calls`, whatever else it asks; otherwise one that
/// asks for thinking (`reasoning_budget` above 0) is `reasoning`; everything else
/// (answers, summaries, raw completions) is `summaries`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The prompt shows tools: the answer is likely a call.
    ToolCalls,
    /// The client asked for a thinking budget.
    Reasoning,
    /// Everything else.
    Summaries,
}

impl Role {
    /// Every role.
    pub const ALL: [Role; 3] = [Role::ToolCalls, Role::Reasoning, Role::Summaries];

    /// The role of a request: `tools_shown` is whether its prompt shows tools,
    /// `reasoning_budget` the thinking budget the client set (not the node's default).
    pub fn classify(tools_shown: bool, reasoning_budget: Option<usize>) -> Self {
        if tools_shown {
            Role::ToolCalls
        } else if reasoning_budget.is_some_and(|b| b > 0) {
            Role::Reasoning
        } else {
            Role::Summaries
        }
    }

    /// The role named `name` (as [`Role::as_str`] writes it).
    pub fn from_name(name: &str) -> Option<Self> {
        Role::ALL.into_iter().find(|r| r.as_str() == name)
    }

    /// The name in the policy file and in metrics (`tool_calls`).
    pub fn as_str(self) -> &'static str {
        match self {
            Role::ToolCalls => "tool_calls",
            Role::Reasoning => "reasoning",
            Role::Summaries => "summaries",
        }
    }
}

/// Which engine serves each role on each tier: per role, a map from tier name to
/// [`TierQuant`]. A tier a role does not name runs as configured.
///
/// ```json
/// "quantization": {"tool_calls": {"t1": {"gguf": "q4_0", "kv": "q8_0"}},
///                  "summaries":  {"t3": {"kv": "q4_0"}}}
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QuantPolicy {
    /// Requests whose prompt shows tools.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub tool_calls: BTreeMap<String, TierQuant>,
    /// Requests with a thinking budget.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub reasoning: BTreeMap<String, TierQuant>,
    /// Everything else.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub summaries: BTreeMap<String, TierQuant>,
}

/// The engine of one tier for one role.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TierQuant {
    /// GGUF variant: a type name (`q4_0`: the file `<tier>-q4_0.gguf` next to the tier's
    /// configured model, made by `mesh quantize`) or a path ending in `.gguf`. None: the
    /// configured model.
    pub gguf: Option<String>,
    /// KV cache type (`f16`, `q8_0`, `q4_0`). None: the tier's configured `kv_type`.
    pub kv: Option<KvType>,
}

impl TierQuant {
    /// Whether `gguf` names a file path rather than a variant.
    pub fn gguf_is_path(gguf: &str) -> bool {
        gguf.ends_with(".gguf") || gguf.contains('/')
    }
}

impl QuantPolicy {
    /// No entry: every tier as configured.
    pub fn is_default(&self) -> bool {
        Role::ALL.iter().all(|r| self.role(*r).is_empty())
    }

    /// The tier map of one role.
    pub fn role(&self, role: Role) -> &BTreeMap<String, TierQuant> {
        match role {
            Role::ToolCalls => &self.tool_calls,
            Role::Reasoning => &self.reasoning,
            Role::Summaries => &self.summaries,
        }
    }

    /// The entry for `tier` serving `role`, if the policy sets one.
    pub fn get(&self, role: Role, tier: &str) -> Option<&TierQuant> {
        let m = self.role(role);
        if m.is_empty() {
            return None;
        }
        m.get(tier)
    }

    /// Every `(role, tier, entry)`.
    pub fn entries(&self) -> impl Iterator<Item = (Role, &String, &TierQuant)> {
        Role::ALL
            .into_iter()
            .flat_map(move |r| self.role(r).iter().map(move |(t, q)| (r, t, q)))
    }

    /// Checks what needs no file system: each entry sets something, and a variant name is
    /// a plain name (`q4_0`, letters, digits, `_`) when it is not a `.gguf` path. Whether
    /// the tier and the file exist is the node's check. The error names the entry
    /// (`quantization.tool_calls.t1.gguf`).
    pub fn validate(&self) -> Result<(), (String, String)> {
        for (role, tier, q) in self.entries() {
            let at = format!("quantization.{}.{tier}", role.as_str());
            if q.gguf.is_none() && q.kv.is_none() {
                return Err((format!("{at}: set `gguf`, `kv` or both"), at));
            }
            if let Some(g) = &q.gguf {
                let plain = !g.is_empty()
                    && g.chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
                if !TierQuant::gguf_is_path(g) && !plain {
                    return Err((
                        format!(
                            "{at}.gguf: `{g}` is neither a variant name (q4_0) nor a .gguf path"
                        ),
                        format!("{at}.gguf"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// `role.tier: before -> after` for every entry that differs between the two.
    pub fn diff(&self, next: &QuantPolicy) -> Vec<String> {
        let show = |q: Option<&TierQuant>| match q {
            None => "as configured".to_owned(),
            Some(q) => format!(
                "gguf {} kv {}",
                q.gguf.as_deref().unwrap_or("configured"),
                q.kv.map_or("configured", |k| kv_name(k))
            ),
        };
        let mut out = vec![];
        for role in Role::ALL {
            let (a, b) = (self.role(role), next.role(role));
            let tiers: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for t in tiers {
                if a.get(t) != b.get(t) {
                    out.push(format!(
                        "{}.{t}: {} -> {}",
                        role.as_str(),
                        show(a.get(t)),
                        show(b.get(t))
                    ));
                }
            }
        }
        out
    }
}

/// The name of a KV cache type as the config writes it.
pub fn kv_name(k: KvType) -> &'static str {
    match k {
        KvType::F16 => "f16",
        KvType::Q8_0 => "q8_0",
        KvType::Q4_0 => "q4_0",
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
        k("speculative.k_max", 1.0, 16.0, 1.0,
          "most drafts per speculative round: more pays off when drafts are accepted, costs target rows and draft steps when they are not"),
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
            "speculative.k_max" => self.draft_k_max as f64,
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
            "speculative.k_max" => self.draft_k_max = v.round() as usize,
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

impl PolicyState {
    /// Puts an operator's whole `policy` in force: bumps the version, adds `d` (its
    /// verdict set to accept, its version to the new one) to the history and the journal,
    /// and writes the file when there is one. On a write error `self` is unchanged.
    pub fn replace(
        &mut self,
        policy: Policy,
        mut d: Decision,
        path: Option<&Path>,
    ) -> Result<(), ControlError> {
        let mut next = self.clone();
        next.policy = policy;
        next.version += 1;
        d.verdict = Verdict::Accept;
        d.version = next.version;
        next.history.push(d.clone());
        if let Some(p) = path {
            next.save(p)?;
            append_journal(&journal_path(p), &d)?;
        }
        *self = next;
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
        assert_eq!(
            p.cascade.margin_for(0),
            CascadePolicy::default().margin_for(0),
            "the other tier untouched"
        );
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
    fn roles_classify_tools_first_then_a_thinking_budget() {
        assert_eq!(Role::classify(true, None), Role::ToolCalls);
        assert_eq!(Role::classify(true, Some(256)), Role::ToolCalls);
        assert_eq!(Role::classify(false, Some(256)), Role::Reasoning);
        assert_eq!(Role::classify(false, Some(0)), Role::Summaries);
        assert_eq!(Role::classify(false, None), Role::Summaries);
    }

    #[test]
    fn quantization_policy_parses_validates_and_defaults_to_nothing() {
        let p: Policy = serde_json::from_value(serde_json::json!({"quantization": {
            "tool_calls": {"t1": {"gguf": "q4_0", "kv": "q8_0"}},
            "summaries": {"t3": {"kv": "q4_0"}}}}))
        .unwrap();
        let q = &p.quantization;
        assert_eq!(q.validate(), Ok(()));
        let t1 = q.get(Role::ToolCalls, "t1").unwrap();
        assert_eq!(
            (t1.gguf.as_deref(), t1.kv),
            (Some("q4_0"), Some(KvType::Q8_0))
        );
        assert_eq!(q.get(Role::Reasoning, "t1"), None);
        assert_eq!(q.get(Role::Summaries, "t3").unwrap().gguf, None);
        assert_eq!(q.entries().count(), 2);
        assert_eq!(
            Policy::default().quantization.diff(q),
            vec![
                "tool_calls.t1: as configured -> gguf q4_0 kv q8_0",
                "summaries.t3: as configured -> gguf configured kv q4_0"
            ]
        );

        // The default policy writes no quantization section: older files stay the same.
        let text = serde_json::to_string(&Policy::default()).unwrap();
        assert!(!text.contains("quantization"), "{text}");
        assert!(Policy::default().quantization.is_default());

        let bad = |v: serde_json::Value| {
            serde_json::from_value::<Policy>(serde_json::json!({ "quantization": v }))
        };
        assert!(
            bad(serde_json::json!({"coding": {}})).is_err(),
            "unknown role"
        );
        assert!(bad(serde_json::json!({"tool_calls": {"t1": {"kv": "q2"}}})).is_err());
        assert!(bad(serde_json::json!({"tool_calls": {"t1": {"bits": 4}}})).is_err());
        let (msg, at) = bad(serde_json::json!({"reasoning": {"t2": {}}}))
            .unwrap()
            .quantization
            .validate()
            .unwrap_err();
        assert_eq!(at, "quantization.reasoning.t2");
        assert!(msg.contains("set `gguf`"), "{msg}");
        let (_, at) = bad(serde_json::json!({"tool_calls": {"t1": {"gguf": "q4 0"}}}))
            .unwrap()
            .quantization
            .validate()
            .unwrap_err();
        assert_eq!(at, "quantization.tool_calls.t1.gguf");
        assert_eq!(
            bad(serde_json::json!({"tool_calls": {"t1": {"gguf": "/x/t1-q4_0.gguf"}}}))
                .unwrap()
                .quantization
                .validate(),
            Ok(())
        );
    }

    #[test]
    fn a_replaced_policy_is_a_new_version_with_history() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policy.json");
        let mut s = PolicyState::new(Policy::default());
        s.save(&path).unwrap();
        let mut p = Policy::default();
        p.quantization.tool_calls.insert(
            "t1".into(),
            TierQuant {
                gguf: Some("q4_0".into()),
                kv: None,
            },
        );
        s.replace(
            p.clone(),
            decision(Verdict::Reject, "quantization", 0.0, 1.0),
            Some(&path),
        )
        .unwrap();
        let back = PolicyState::load(&path).unwrap().unwrap();
        assert_eq!(back, s);
        assert_eq!((back.version, back.policy), (1, p));
        assert_eq!(back.history[0].verdict, Verdict::Accept);
        assert_eq!(back.history[0].version, 1);
        let journal = std::fs::read_to_string(journal_path(&path)).unwrap();
        assert_eq!(journal.lines().count(), 1);
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
