//! The tuner on a live node: the policy snapshot every request reads, one tuning cycle on
//! demand (`POST /v1/control/tune`), the policy with its decisions
//! (`GET /v1/control/policy`), and an operator's policy reload (`PUT /v1/control/policy`).
//!
//! **Live policy.** [`LivePolicy`] holds an `Arc<Snapshot>` behind a `RwLock` that is
//! only held to copy or swap the pointer. A request takes the snapshot once when it
//! starts and keeps it to its end, so an accepted change applies to the next request and
//! never to half of one; nothing restarts and no request is dropped.
//!
//! **A cycle** (one at a time; a second gets 409):
//! 1. the proposal: the body's `{"knob", "value", "objective"}` (checked against the
//!    knob's bounds, grid and one step: 400 with the reason otherwise), or else the rules
//!    ([`mesh_control::tuner::propose`]) on the window since the last cycle: the node's
//!    counters read from its own `/metrics` exposition, plus the probe accuracy of one
//!    observation pass under the current policy;
//! 2. the trial: each probe task (held-out tasks, `[tuner] probe_tasks`) runs once under the
//!    current policy (window A) and once under the proposed one (window B), alternating
//!    which goes first, as real chat requests through the gateway's own request path
//!    ([`crate::gateway::chat_with`]) with the trial's policy in place of the live one, so
//!    every knob a request reads is exercised;
//! 3. the gate ([`mesh_control::tuner::judge`]): accepted changes are written to the state
//!    file (atomically) and then swapped into the live snapshot: 200; rejected or reverted
//!    ones leave the policy and the file as they were: 422 with the gate's reason and
//!    statistics. Every decision is journaled (`<state_file>.decisions.jsonl`).
//!
//! **A reload** (`PUT /v1/control/policy`, [`put_policy`]): the body's sections replace the
//! current ones (sections left out stay); the result is checked like a state file at start
//! (cascade, top-k, and every quantization entry: tier hosted here, GGUF present), 400 with
//! the reason and the entry otherwise; the engines it needs are started (an engine that
//! fails to load: 422, nothing changed); the file is written as the next version with the
//! change in its history; then the snapshot is swapped and engines no longer named drain
//! and stop ([`crate::engines`]). A reload waits for no tuning cycle: while one runs it
//! is 409.
//!
//! Probe requests are real: they use engine slots next to live traffic and show in the
//! token and cascade metrics (not in `mesh_http_requests_total`).

use std::sync::{Arc, PoisonError, RwLock};
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use mesh_control::gate::{Better, Metric, Samples, Verdict};
use mesh_control::policy::{self, Decision, Policy, PolicyState};
use mesh_control::tuner::{self, Counters, Proposal};
use mesh_tiers::chat::{self, CALL, END, END_CALL, END_THINK, THINK};
use mesh_tiers::eval::{self, Task};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::config::TunerSettings;
use crate::gateway::{self, AppState, GatewaySettings};

/// The policy requests read, with its version and accepted history.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Bumped by every accepted change.
    pub version: u64,
    /// The knobs.
    pub policy: Arc<Policy>,
    /// Accepted changes, oldest first.
    pub history: Vec<Decision>,
}

impl Snapshot {
    fn of(s: &PolicyState) -> Self {
        Self {
            version: s.version,
            policy: Arc::new(s.policy.clone()),
            history: s.history.clone(),
        }
    }
}

/// A swappable policy snapshot: readers copy an `Arc`, the tuner swaps it.
#[derive(Debug)]
pub struct LivePolicy {
    cell: RwLock<Arc<Snapshot>>,
}

impl LivePolicy {
    /// A cell holding `s`.
    pub fn new(s: Snapshot) -> Self {
        Self {
            cell: RwLock::new(Arc::new(s)),
        }
    }

    /// The snapshot in force now; later swaps do not change it.
    pub fn load(&self) -> Arc<Snapshot> {
        self.cell
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Puts `s` in force for every later [`load`](Self::load).
    pub fn store(&self, s: Snapshot) {
        *self.cell.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(s);
    }
}

/// What a cycle keeps between runs.
struct CycleState {
    state: PolicyState,
    /// Counter totals at the end of the last cycle (the next window starts there).
    baseline: Counters,
    tasks: Option<Arc<Vec<Task>>>,
}

/// The node's tuner: settings, the live policy, and the cycle lock.
pub struct Tuner {
    settings: TunerSettings,
    /// The policy every request reads.
    pub live: LivePolicy,
    cycle: tokio::sync::Mutex<CycleState>,
    /// This run's decisions (all verdicts), newest last, for `GET /v1/control/policy`
    /// when there is no journal file.
    decisions: std::sync::Mutex<Vec<Decision>>,
    /// What the periodic cycles did (`[tuner] interval_s`).
    periodic: std::sync::Mutex<Periodic>,
}

/// Tally of the cycles the node ran by itself.
#[derive(Debug, Default, Clone, serde::Serialize)]
struct Periodic {
    /// Periods that ran a cycle (a probe pass, and a trial when a rule fired).
    ran: u64,
    /// Periods skipped: fewer than `min_requests` requests in the window.
    idle: u64,
    /// Periods skipped: a cycle or a reload was running.
    busy: u64,
    /// The last cycle's HTTP status and body, as `POST /v1/control/tune` would answer.
    last: Option<Value>,
}

impl std::fmt::Debug for Tuner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tuner")
            .field("version", &self.live.load().version)
            .finish()
    }
}

/// Decisions `GET /v1/control/policy` lists.
const SHOWN_DECISIONS: usize = 50;

impl Tuner {
    /// The policy from the state file when it exists (an unreadable or invalid one is an
    /// error naming the file), else `start` at version 0.
    pub fn open(settings: TunerSettings, start: Policy) -> anyhow::Result<Self> {
        let state = match &settings.state_file {
            Some(path) => match PolicyState::load(path)? {
                Some(s) => {
                    check_policy(&s.policy)
                        .map_err(|e| anyhow::anyhow!("tuner.state_file {}: {e}", path.display()))?;
                    tracing::info!(file = %path.display(), version = s.version, "policy from the state file");
                    s
                }
                None => {
                    // Written now, so the file shows the policy in force from the start.
                    let s = PolicyState::new(start);
                    s.save(path)?;
                    s
                }
            },
            None => PolicyState::new(start),
        };
        Ok(Self {
            settings,
            live: LivePolicy::new(Snapshot::of(&state)),
            cycle: tokio::sync::Mutex::new(CycleState {
                state,
                baseline: Counters::default(),
                tasks: None,
            }),
            decisions: std::sync::Mutex::default(),
            periodic: std::sync::Mutex::default(),
        })
    }

    /// A tuner over the gateway's start-up policy, default settings, no state file.
    pub fn from_settings(g: &GatewaySettings) -> Self {
        Self::open(TunerSettings::default(), start_policy(g))
            .expect("no state file to read, nothing can fail")
    }

    fn tasks(&self, cy: &mut CycleState) -> Result<Arc<Vec<Task>>, String> {
        if let Some(t) = &cy.tasks {
            return Ok(t.clone());
        }
        let s = &self.settings;
        let all = eval::load_tasks(&s.probe_tasks)?;
        let t: Vec<Task> = all
            .into_iter()
            .filter(|t| s.probe_kinds.is_empty() || s.probe_kinds.contains(&t.kind))
            .take(s.probe_n)
            .collect();
        if t.is_empty() {
            return Err(format!(
                "{}: no task of kinds {:?}",
                s.probe_tasks.display(),
                s.probe_kinds
            ));
        }
        let t = Arc::new(t);
        cy.tasks = Some(t.clone());
        Ok(t)
    }

    /// Keeps `d` in this run's list of decisions (the last [`SHOWN_DECISIONS`]).
    fn remember(&self, d: &Decision) {
        let mut all = self
            .decisions
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        all.push(d.clone());
        let skip = all.len().saturating_sub(SHOWN_DECISIONS);
        all.drain(..skip);
    }

    fn journal(&self) -> Vec<Decision> {
        let from_file = self
            .settings
            .state_file
            .as_deref()
            .map(policy::journal_path)
            .and_then(|p| std::fs::read_to_string(p).ok());
        let mut all: Vec<Decision> = match from_file {
            Some(text) => text
                .lines()
                .filter_map(|l| serde_json::from_str(l).ok())
                .collect(),
            None => self
                .decisions
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        };
        let skip = all.len().saturating_sub(SHOWN_DECISIONS);
        all.drain(..skip);
        all
    }
}

/// The policy a node starts from when no state file exists.
pub fn start_policy(g: &GatewaySettings) -> Policy {
    Policy {
        cascade: g.cascade.clone(),
        reasoning: g.reasoning.clone(),
        router_top_k: g.tool_routing.router.top_k,
        ..Policy::default()
    }
}

fn check_policy(p: &Policy) -> Result<(), String> {
    p.cascade.validate()?;
    if p.router_top_k == 0 {
        return Err("router_top_k must be at least 1".into());
    }
    p.quantization.validate().map_err(|(msg, _)| msg)
}

/// The tuner's routes (merged into [`gateway::router`]).
pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/control/tune", post(tune))
        .route("/v1/control/policy", get(show_policy).put(put_policy))
}

// ---------------------------------------------------------------------------
// Handlers

fn error(status: StatusCode, kind: &str, message: String, param: Option<&str>) -> Response {
    (
        status,
        Json(json!({"error": {"message": message, "type": kind, "param": param, "code": null}})),
    )
        .into_response()
}

fn bad_request(message: String, param: Option<&str>) -> Response {
    error(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        message,
        param,
    )
}

/// `POST /v1/control/tune` body; all optional (empty body: the rules decide).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct TuneBody {
    knob: Option<String>,
    value: Option<f64>,
    /// `latency_ms` (default), `accuracy` or `error`.
    objective: Option<String>,
}

/// The objective metric by name, with the tolerance the gate's guard of that name has.
fn objective(name: &str, gate: &mesh_control::gate::GateConfig) -> Result<Metric, String> {
    let guard = gate.guards.iter().find(|g| g.name == name).cloned();
    let m = match name {
        "latency_ms" => Metric::continuous("latency_ms", Better::Lower, 0.10),
        "accuracy" => Metric::rate("accuracy", Better::Higher, 0.05),
        "error" => Metric::rate("error", Better::Lower, 0.02),
        other => {
            return Err(format!(
                "unknown objective `{other}` (latency_ms, accuracy, error)"
            ))
        }
    };
    Ok(guard.unwrap_or(m))
}

/// An operator's proposal, checked in the order a caller can act on: the knob exists, the
/// value is inside its bounds and on its grid, it is one step from the current value.
fn manual_proposal(
    body: &TuneBody,
    current: &Policy,
    gate: &mesh_control::gate::GateConfig,
) -> Result<Option<Proposal>, (String, &'static str)> {
    let Some(knob) = &body.knob else {
        if body.value.is_some() || body.objective.is_some() {
            return Err(("`value` and `objective` need a `knob`".into(), "knob"));
        }
        return Ok(None);
    };
    let known: Vec<String> = policy::knobs().into_iter().map(|k| k.id).collect();
    if !known.contains(knob) {
        return Err((
            format!("unknown knob `{knob}` (known: {})", known.join(", ")),
            "knob",
        ));
    }
    let value = body
        .value
        .ok_or_else(|| (format!("`value` is required with knob `{knob}`"), "value"))?;
    current
        .clone()
        .set(knob, value)
        .map_err(|e| (e.to_string(), "value"))?;
    let metric = objective(body.objective.as_deref().unwrap_or("latency_ms"), gate)
        .map_err(|e| (e, "objective"))?;
    tuner::manual(current, knob, value, metric)
        .map(Some)
        .map_err(|e| (e.to_string(), "value"))
}

async fn tune(State(state): State<AppState>, body: Bytes) -> Response {
    let body: TuneBody = if body.iter().all(u8::is_ascii_whitespace) {
        TuneBody::default()
    } else {
        match serde_json::from_slice(&body) {
            Ok(b) => b,
            Err(e) => return bad_request(format!("invalid request body: {e}"), None),
        }
    };
    let tuner = state.tuner().clone();
    if !tuner.settings.enabled {
        return error(
            StatusCode::CONFLICT,
            "tuner_disabled",
            "the tuner is off on this node ([tuner] enabled = false)".into(),
            None,
        );
    }
    let Ok(mut cy) = tuner.cycle.try_lock() else {
        return error(
            StatusCode::CONFLICT,
            "tuning_in_progress",
            "a tuning cycle is already running on this node; retry when it ends".into(),
            None,
        );
    };
    let cfg = tuner.settings.tuner_config();
    let snap = tuner.live.load();
    let current = snap.policy.clone();
    let manual = match manual_proposal(&body, &current, &cfg.gate) {
        Ok(m) => m,
        Err((msg, param)) => return bad_request(msg, Some(param)),
    };
    let tasks = match tuner.tasks(&mut cy) {
        Ok(t) => t,
        Err(e) => {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                format!("probe tasks: {e}"),
                None,
            )
        }
    };
    let s = &tuner.settings;
    let model = s
        .probe_model
        .clone()
        .unwrap_or_else(|| current.cascade.model.clone());
    let needed = if model == current.cascade.model {
        current.cascade.tiers.clone()
    } else {
        vec![model.clone()]
    };
    for m in &needed {
        if let Err(e) = state.find_model(m) {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                format!("the probe model `{model}` cannot run here: {}", e.message()),
                None,
            );
        }
    }
    let first_tier = current.cascade.tiers.first().cloned().unwrap_or_default();
    let probe = Probe {
        model,
        max_tokens: s.probe_max_tokens,
    };

    let mut window = None;
    let proposal = match manual {
        Some(p) => p,
        None => {
            let [obs] = probe.run(&state, &tasks, [current.clone()]).await;
            let now = totals(&state.render_metrics(), &first_tier);
            let mut c = since(&now, &cy.baseline);
            let acc = obs.get("accuracy").cloned().unwrap_or_default();
            c.requests += acc.len() as u64;
            c.scored += acc.len() as u64;
            c.correct += acc.iter().filter(|&&x| x > 0.5).count() as u64;
            cy.baseline = now;
            window = Some(c.clone());
            match tuner::propose(&tuner::rules(), &c, &current, &cfg) {
                Some(p) => p,
                None => {
                    return Json(json!({
                        "applied": null,
                        "reason": "no rule fired on this window",
                        "counters": c,
                        "version": snap.version,
                    }))
                    .into_response()
                }
            }
        }
    };
    let candidate = match proposal.apply_to(&current) {
        Ok(p) => Arc::new(p),
        Err(e) => return bad_request(e.to_string(), Some("value")),
    };
    let t0 = Instant::now();
    let [a, b] = probe
        .run(&state, &tasks, [current.clone(), candidate])
        .await;
    let trial_s = t0.elapsed().as_secs_f64();
    cy.baseline = totals(&state.render_metrics(), &first_tier);
    let mut d = tuner::judge(&proposal, &a, &b, &cfg.gate);
    let mut next = cy.state.clone();
    if let Err(e) = next.record(d.clone(), s.state_file.as_deref()) {
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            format!("recording the decision: {e}"),
            None,
        );
    }
    d.version = next.version;
    cy.state = next;
    if d.verdict == Verdict::Accept {
        tuner.live.store(Snapshot::of(&cy.state));
    }
    tracing::info!(rule = %d.rule, knob = %d.knob, before = d.before, after = d.after,
        verdict = ?d.verdict, reason = %d.reason, version = d.version, "tuner decision");
    tuner.remember(&d);
    let trial = json!({"tasks": tasks.len(), "model": probe.model, "seconds": trial_s});
    if d.verdict == Verdict::Accept {
        Json(json!({
            "applied": {"knob": d.knob, "before": d.before, "after": d.after},
            "version": d.version,
            "decision": d,
            "counters": window,
            "trial": trial,
        }))
        .into_response()
    } else {
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(json!({
                "error": {
                    "message": format!("{} -> {} rejected ({}): {}", d.knob, d.after,
                        verdict_str(d.verdict), d.reason),
                    "type": "tuning_rejected",
                    "param": null,
                    "code": verdict_str(d.verdict),
                },
                "version": d.version,
                "decision": d,
                "counters": window,
                "trial": trial,
            })),
        )
            .into_response()
    }
}

/// Starts the node's own rule-driven cycles, every `[tuner] interval_s` seconds (none when
/// 0 or the tuner is off). Each period first reads the window's live request count from the
/// node's metrics; below `min_requests` it is skipped without probing. Otherwise it runs the
/// same cycle as an empty `POST /v1/control/tune` (probe pass, rules, trial, gate, state
/// file), so a periodic decision is journaled and applied exactly like an operator's.
pub(crate) fn spawn_periodic(state: AppState) -> Option<tokio::task::JoinHandle<()>> {
    let tuner = state.tuner().clone();
    let every = tuner.settings.interval_s;
    if every == 0 || !tuner.settings.enabled {
        return None;
    }
    tracing::info!(
        interval_s = every,
        "tuner: a rule-driven cycle every period"
    );
    Some(tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(every));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let live = {
                let Ok(cy) = tuner.cycle.try_lock() else {
                    tuner.tally(|p| p.busy += 1);
                    continue;
                };
                let first = tuner.live.load().policy.cascade.tiers.first().cloned();
                let now = totals(&state.render_metrics(), &first.unwrap_or_default());
                since(&now, &cy.baseline).requests
            };
            if live < tuner.settings.min_requests {
                tuner.tally(|p| p.idle += 1);
                continue;
            }
            let r = tune(State(state.clone()), Bytes::new()).await;
            let status = r.status();
            let body = axum::body::to_bytes(r.into_body(), 1 << 20)
                .await
                .ok()
                .and_then(|b| serde_json::from_slice::<Value>(&b).ok());
            if status == StatusCode::CONFLICT {
                tuner.tally(|p| p.busy += 1);
                continue;
            }
            tracing::info!(
                status = status.as_u16(),
                live_requests = live,
                "tuner: periodic cycle"
            );
            tuner.tally(|p| {
                p.ran += 1;
                p.last = Some(json!({"status": status.as_u16(), "body": body}));
            });
        }
    }))
}

impl Tuner {
    fn tally(&self, f: impl FnOnce(&mut Periodic)) {
        f(&mut self.periodic.lock().unwrap_or_else(PoisonError::into_inner));
    }
}

fn verdict_str(v: Verdict) -> &'static str {
    match v {
        Verdict::Accept => "accept",
        Verdict::Reject => "reject",
        Verdict::Revert => "revert",
    }
}

async fn show_policy(State(state): State<AppState>) -> Json<Value> {
    let tuner = state.tuner();
    let snap = tuner.live.load();
    let knobs: Vec<Value> = policy::knobs()
        .into_iter()
        .map(|k| {
            json!({"id": k.id, "value": snap.policy.get(&k.id).ok(), "min": k.min, "max": k.max,
                   "step": k.step, "effect": k.effect})
        })
        .collect();
    let file = tuner.settings.state_file.as_deref();
    Json(json!({
        "version": snap.version,
        "policy": *snap.policy,
        "knobs": knobs,
        "history": snap.history,
        "decisions": tuner.journal(),
        "state_file": file,
        "journal": file.map(policy::journal_path),
        "enabled": tuner.settings.enabled,
        "periodic": {
            "interval_s": tuner.settings.interval_s,
            "cycles": tuner.periodic.lock().unwrap_or_else(PoisonError::into_inner).clone(),
        },
        "engines": state.engines().list(state.registry()),
    }))
}

/// `PUT /v1/control/policy`: the body's top-level sections (`cascade`, `reasoning`,
/// `router_top_k`, `quantization`) replace the current ones; see the module docs.
async fn put_policy(State(state): State<AppState>, body: Bytes) -> Response {
    let tuner = state.tuner().clone();
    let Ok(mut cy) = tuner.cycle.try_lock() else {
        return error(
            StatusCode::CONFLICT,
            "tuning_in_progress",
            "a tuning cycle or another reload is running on this node; retry when it ends".into(),
            None,
        );
    };
    let next = match merged_policy(&cy.state.policy, &body) {
        Ok(p) => p,
        Err(msg) => return bad_request(msg, None),
    };
    match replace_policy(&state, &tuner, &mut cy, next, "PUT /v1/control/policy").await {
        Ok(v) => Json(v).into_response(),
        Err(e) => error(e.status, e.kind, e.message, e.param.as_deref()),
    }
}

/// Why a policy was not put in force.
#[derive(Debug)]
pub struct PolicyRefused {
    status: StatusCode,
    kind: &'static str,
    /// What was wrong.
    pub message: String,
    param: Option<String>,
}

impl PolicyRefused {
    fn bad(message: String, param: Option<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message,
            param,
        }
    }
}

/// Puts `next` in force (a `PUT /v1/control/policy` or a SIGHUP, named by `via`): checks
/// it, starts the engines its quantization names before the swap, journals the decision,
/// writes the state file, swaps the live policy (requests in flight keep the one they
/// read) and drains engines no longer named. Nothing changes when it is refused.
async fn replace_policy(
    state: &AppState,
    tuner: &Tuner,
    cy: &mut CycleState,
    next: Policy,
    via: &str,
) -> Result<Value, PolicyRefused> {
    let before = cy.state.policy.clone();
    check_policy(&next).map_err(|e| PolicyRefused::bad(e, None))?;
    let engines = state.engines().clone();
    let wanted = engines
        .resolve(&next.quantization)
        .map_err(|(msg, param)| PolicyRefused::bad(msg, Some(param)))?;
    if let Err(e) = engines.start(&wanted).await {
        return Err(PolicyRefused {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            kind: "engine_start_failed",
            message: format!("the policy needs an engine that could not start: {e}"),
            param: Some("quantization".into()),
        });
    }
    let mut changed: Vec<&str> = vec![];
    if next.cascade != before.cascade {
        changed.push("cascade");
    }
    if next.reasoning != before.reasoning {
        changed.push("reasoning");
    }
    if next.router_top_k != before.router_top_k {
        changed.push("router_top_k");
    }
    if next.quantization != before.quantization {
        changed.push("quantization");
    }
    let (at_ms, at) = policy::now();
    let version = cy.state.version;
    let d = Decision {
        at_ms,
        at,
        rule: "operator".into(),
        rationale: match before.quantization.diff(&next.quantization) {
            q if q.is_empty() => format!("policy replaced through {via}"),
            q => format!("quantization: {}", q.join("; ")),
        },
        knob: if changed.is_empty() {
            "none".into()
        } else {
            changed.join(",")
        },
        before: version as f64,
        after: (version + 1) as f64,
        objective: "none".into(),
        verdict: Verdict::Accept,
        reason: format!("{via} (no trial)"),
        version,
        tests: vec![],
    };
    if let Err(e) = cy
        .state
        .replace(next, d.clone(), tuner.settings.state_file.as_deref())
    {
        // The policy stays; engines started for the refused one go again.
        if let Ok(old) = engines.resolve(&before.quantization) {
            engines.retire_unused(&old);
        }
        return Err(PolicyRefused {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            message: format!("writing the policy state file: {e}"),
            param: None,
        });
    }
    tuner.live.store(Snapshot::of(&cy.state));
    engines.retire_unused(&wanted);
    let d = cy.state.history.last().cloned().unwrap_or(d);
    tracing::info!(version = cy.state.version, changed = %d.knob, rationale = %d.rationale, via, "policy reloaded");
    tuner.remember(&d);
    Ok(json!({
        "version": cy.state.version,
        "policy": cy.state.policy,
        "decision": d,
        "engines": engines.list(state.registry()),
    }))
}

/// SIGHUP: reads the policy section of the tuner's state file again (as an operator left
/// it) and puts it in force as `PUT /v1/control/policy` would, after any running cycle.
/// Returns the version in force; an unreadable file or a refused policy changes nothing.
pub async fn reload_state_file(state: &AppState) -> Result<u64, String> {
    let tuner = state.tuner().clone();
    let Some(path) = tuner.settings.state_file.clone() else {
        return Err("no tuner.state_file is configured; nothing to reload".into());
    };
    let mut cy = tuner.cycle.lock().await;
    let read = PolicyState::load(&path)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("{} does not exist", path.display()))?;
    if read.policy == cy.state.policy {
        return Ok(cy.state.version);
    }
    replace_policy(state, &tuner, &mut cy, read.policy, "SIGHUP")
        .await
        .map(|_| cy.state.version)
        .map_err(|e| format!("{}: {}", path.display(), e.message))
}

/// `current` with the top-level sections of the JSON object `body` in place of its own.
fn merged_policy(current: &Policy, body: &[u8]) -> Result<Policy, String> {
    let patch: Value =
        serde_json::from_slice(body).map_err(|e| format!("invalid request body: {e}"))?;
    let Value::Object(patch) = patch else {
        return Err("the body must be a JSON object of policy sections".into());
    };
    let mut v = serde_json::to_value(current).map_err(|e| e.to_string())?;
    let obj = v.as_object_mut().expect("a policy serializes to an object");
    for (k, x) in patch {
        obj.insert(k, x);
    }
    serde_json::from_value(v).map_err(|e| format!("invalid policy: {e}"))
}

// ---------------------------------------------------------------------------
// The probe workload through the gateway

struct Probe {
    model: String,
    max_tokens: usize,
}

impl Probe {
    /// Each task once under each policy, rotating which goes first task by task.
    async fn run<const K: usize>(
        &self,
        state: &AppState,
        tasks: &[Task],
        policies: [Arc<Policy>; K],
    ) -> [Samples; K] {
        let mut windows: [Samples; K] = std::array::from_fn(|_| Samples::new());
        for (i, task) in tasks.iter().enumerate() {
            let body = match task_request(task, &self.model, self.max_tokens) {
                Ok(b) => serde_json::to_vec(&b).expect("a Value serializes"),
                Err(e) => {
                    tracing::warn!(error = %e, "probe task skipped: its prompt is not in the chat format");
                    continue;
                }
            };
            for k in 0..K {
                let w = (k + i) % K;
                let (ms, exact, failed) = self.one(state, task, &body, policies[w].clone()).await;
                let s = &mut windows[w];
                s.entry("latency_ms".into()).or_default().push(ms);
                s.entry("accuracy".into())
                    .or_default()
                    .push(f64::from(u8::from(exact)));
                s.entry("error".into())
                    .or_default()
                    .push(f64::from(u8::from(failed)));
            }
        }
        windows
    }

    /// `(latency ms, exact, failed)` of one probe request.
    async fn one(
        &self,
        state: &AppState,
        task: &Task,
        body: &[u8],
        policy: Arc<Policy>,
    ) -> (f64, bool, bool) {
        let t0 = Instant::now();
        let out = match gateway::chat_with(state, body, policy).await {
            Ok(resp) if resp.status().is_success() => {
                axum::body::to_bytes(resp.into_body(), 16 << 20)
                    .await
                    .ok()
                    .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            }
            _ => None,
        };
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        match out {
            Some(v) => (ms, eval::exact(task, &response_text(&v)), false),
            None => (ms, false, true),
        }
    }
}

/// A held-out task (a prompt rendered in the bundled chat format) as the chat request that
/// renders to exactly that prompt: system text, tools, and every earlier turn.
pub fn task_request(task: &Task, model: &str, max_tokens: usize) -> Result<Value, String> {
    let p = task.prompt.as_str();
    let rest = p
        .strip_prefix("<|system|>")
        .ok_or("prompt does not start with <|system|>")?;
    let (head, mut rest) = rest.split_once(END).ok_or("system turn not closed")?;
    let (system, tools) = match head.split_once("\n<tools>\n") {
        Some((sys, block)) => {
            let block = block
                .strip_suffix("\n</tools>")
                .ok_or("tools block not closed")?;
            let tools = block
                .lines()
                .map(|l| {
                    let v: Value =
                        serde_json::from_str(l).map_err(|e| format!("tool schema: {e}"))?;
                    Ok(json!({"type": "function", "function": v}))
                })
                .collect::<Result<Vec<Value>, String>>()?;
            (sys, tools)
        }
        None => (head, vec![]),
    };
    let mut messages = vec![json!({"role": "system", "content": system})];
    let mut last_call_ids: Vec<String> = vec![];
    let mut answered = 0;
    loop {
        if rest == "<|assistant|>" {
            break;
        }
        let (role, after) = ["user", "assistant", "tool", "system"]
            .iter()
            .find_map(|r| rest.strip_prefix(&format!("<|{r}|>")).map(|a| (*r, a)))
            .ok_or_else(|| format!("unexpected text at `{}`", &rest[..rest.len().min(20)]))?;
        let (content, next) = after
            .split_once(END)
            .ok_or_else(|| format!("{role} turn not closed"))?;
        rest = next;
        match role {
            "assistant" => {
                let parsed = chat::parse_output(content);
                if parsed.reasoning.is_some() || parsed.malformed_calls > 0 {
                    return Err(
                        "an earlier assistant turn has reasoning or a malformed call".into(),
                    );
                }
                last_call_ids.clear();
                answered = 0;
                let calls: Vec<Value> = parsed
                    .tool_calls
                    .iter()
                    .enumerate()
                    .map(|(i, c)| {
                        let id = format!("call_{}_{i}", messages.len());
                        last_call_ids.push(id.clone());
                        json!({"id": id, "type": "function", "function": {
                            "name": c.name, "arguments": c.arguments.to_string()}})
                    })
                    .collect();
                let text = (!parsed.content.is_empty()).then_some(parsed.content);
                messages.push(json!({"role": "assistant", "content": text, "tool_calls": calls}));
            }
            "tool" => {
                let id = last_call_ids.get(answered).cloned();
                answered += 1;
                messages.push(json!({"role": "tool", "content": content, "tool_call_id": id}));
            }
            r => messages.push(json!({"role": r, "content": content})),
        }
    }
    Ok(json!({
        "model": model,
        "messages": messages,
        "tools": tools,
        "temperature": 0,
        "max_tokens": max_tokens,
    }))
}

/// The model's text as the held-out scorer reads it, rebuilt from a chat completion body:
/// reasoning in a think block, the content, then each call.
pub fn response_text(body: &Value) -> String {
    let m = &body["choices"][0]["message"];
    let mut text = String::new();
    if let Some(r) = m["reasoning_content"].as_str() {
        text.push_str(&format!("{THINK}{r}{END_THINK}"));
    }
    if let Some(c) = m["content"].as_str() {
        text.push_str(c);
    }
    for c in m["tool_calls"].as_array().into_iter().flatten() {
        let f = &c["function"];
        let args = f["arguments"]
            .as_str()
            .and_then(|a| serde_json::from_str::<Value>(a).ok())
            .unwrap_or(Value::Null);
        let call = json!({"name": f["name"], "arguments": args});
        text.push_str(&format!("{CALL}{}{END_CALL}", chat::py_json(&call)));
    }
    text
}

// ---------------------------------------------------------------------------
// Counters from the node's own metrics

/// One sample line of the Prometheus text exposition: name, labels, value.
fn sample_line(line: &str) -> Option<(&str, Vec<(&str, &str)>, f64)> {
    if line.starts_with('#') || line.trim().is_empty() {
        return None;
    }
    let (series, value) = line.rsplit_once(' ')?;
    let value: f64 = value.parse().ok()?;
    let (name, labels) = match series.split_once('{') {
        Some((n, l)) => (n, l.strip_suffix('}')?),
        None => (series, ""),
    };
    let mut out = vec![];
    let mut rest = labels;
    while !rest.is_empty() {
        let (k, after) = rest.split_once("=\"")?;
        let end = after.find('"')?;
        out.push((k.trim_start_matches(','), &after[..end]));
        rest = after[end + 1..].trim_start_matches(',');
    }
    Some((name, out, value))
}

/// Counter totals since the node started, from its `/metrics` text: chat and completion
/// requests (errors: status 5xx), cascade steps at `first_tier` (low-margin escalations,
/// low-router-score skips), generations with a thinking budget and those it capped.
pub fn totals(text: &str, first_tier: &str) -> Counters {
    let mut c = Counters::default();
    for (name, labels, v) in text.lines().filter_map(sample_line) {
        let label = |k: &str| labels.iter().find(|l| l.0 == k).map_or("", |l| l.1);
        let v = v as u64;
        match name {
            "mesh_http_requests_total"
                if matches!(
                    label("endpoint"),
                    "/v1/chat/completions" | "/v1/completions"
                ) =>
            {
                c.requests += v;
                if label("status").starts_with('5') {
                    c.errors += v;
                }
            }
            "mesh_cascade_steps_total" if label("tier") == first_tier => match label("verdict") {
                "low_router_score" => c.low_router_score_skips += v,
                "low_margin" => {
                    c.first_tier_steps += v;
                    c.first_tier_low_margin += v;
                }
                _ => c.first_tier_steps += v,
            },
            "mesh_reasoning_budgeted_total" => c.reasoning_requests += v,
            "mesh_reasoning_capped_total" => c.reasoning_capped += v,
            "mesh_spec_draft_tokens_total" => c.draft_tokens += v,
            "mesh_spec_accepted_tokens_total" => c.draft_accepted += v,
            _ => {}
        }
    }
    c
}

/// The window between two totals.
pub fn since(now: &Counters, before: &Counters) -> Counters {
    Counters {
        requests: now.requests.saturating_sub(before.requests),
        errors: now.errors.saturating_sub(before.errors),
        correct: now.correct.saturating_sub(before.correct),
        scored: now.scored.saturating_sub(before.scored),
        first_tier_steps: now.first_tier_steps.saturating_sub(before.first_tier_steps),
        first_tier_low_margin: now
            .first_tier_low_margin
            .saturating_sub(before.first_tier_low_margin),
        low_router_score_skips: now
            .low_router_score_skips
            .saturating_sub(before.low_router_score_skips),
        reasoning_requests: now
            .reasoning_requests
            .saturating_sub(before.reasoning_requests),
        reasoning_capped: now.reasoning_capped.saturating_sub(before.reasoning_capped),
        draft_tokens: now.draft_tokens.saturating_sub(before.draft_tokens),
        draft_accepted: now.draft_accepted.saturating_sub(before.draft_accepted),
    }
}

/// On SIGHUP the node reads its policy state file again and puts the policy in force
/// (`control_api::reload_state_file`); only with a `tuner.state_file`.
pub(crate) fn spawn_sighup_reload(state: AppState) -> Option<tokio::task::JoinHandle<()>> {
    #[cfg(unix)]
    {
        state.tuner().settings.state_file.as_ref()?;
        let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "no SIGHUP handler; reload the policy with PUT /v1/control/policy");
                return None;
            }
        };
        tracing::info!("SIGHUP reloads the policy state file");
        Some(tokio::spawn(async move {
            while hup.recv().await.is_some() {
                match reload_state_file(&state).await {
                    Ok(v) => tracing::info!(
                        version = v,
                        "SIGHUP: policy state file read; version in force"
                    ),
                    Err(e) => {
                        tracing::warn!(error = %e, "SIGHUP: policy not reloaded; the one in force stays")
                    }
                }
            }
        }))
    }
    #[cfg(not(unix))]
    {
        let _ = state;
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn root() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
    }

    #[test]
    fn every_heldout_task_renders_back_to_its_prompt_through_the_gateway() {
        let tasks = eval::load_tasks(&root().join("models/fixtures/eval-heldout.jsonl")).unwrap();
        assert_eq!(tasks.len(), 200);
        for t in &tasks {
            let body = task_request(t, "t1", 64).unwrap();
            let r: crate::openai::ChatRequest = serde_json::from_value(body).unwrap();
            let p = gateway::prepare(&r, None).unwrap_or_else(|e| panic!("{}", e.message()));
            assert_eq!(p.prompt_text, t.prompt, "{} task", t.kind);
        }
        assert!(task_request(
            &Task {
                prompt: "<|user|>hi<|end|>".into(),
                ..tasks[0].clone()
            },
            "t1",
            8
        )
        .is_err());
    }

    #[test]
    fn response_bodies_score_like_raw_text() {
        let t = Task {
            kind: "hard".into(),
            sub: "plan".into(),
            split: "s".into(),
            prompt: String::new(),
            completion: r#"<think>two</think><tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call><|end|>"#.into(),
        };
        let body = json!({"choices": [{"message": {"role": "assistant", "content": null,
            "reasoning_content": "two",
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "a", "arguments": "{\"x\":1}"}},
                {"id": "2", "type": "function", "function": {"name": "b", "arguments": "{}"}}]}}]});
        assert!(eval::exact(&t, &response_text(&body)));
        let wrong = json!({"choices": [{"message": {"content": null, "tool_calls": [
            {"function": {"name": "a", "arguments": "{\"x\":2}"}}]}}]});
        assert!(!eval::exact(&t, &response_text(&wrong)));
        let answer = Task {
            completion: "No tool fits.<|end|>".into(),
            ..t
        };
        let body = json!({"choices": [{"message": {"content": "No tool fits.", "reasoning_content": "none"}}]});
        assert!(eval::exact(&answer, &response_text(&body)));
    }

    const METRICS: &str = r#"# HELP mesh_http_requests_total HTTP requests by endpoint and status.
# TYPE mesh_http_requests_total counter
mesh_http_requests_total{endpoint="/v1/chat/completions",status="200"} 30
mesh_http_requests_total{endpoint="/v1/chat/completions",status="503"} 2
mesh_http_requests_total{endpoint="/v1/completions",status="200"} 5
mesh_http_requests_total{endpoint="/v1/models",status="200"} 9
mesh_cascade_steps_total{tier="t1",verdict="accept"} 10
mesh_cascade_steps_total{tier="t1",verdict="low_margin"} 14
mesh_cascade_steps_total{tier="t1",verdict="low_router_score"} 3
mesh_cascade_steps_total{tier="t2",verdict="low_margin"} 7
mesh_reasoning_budgeted_total{model="t1"} 20
mesh_reasoning_budgeted_total{model="t2"} 4
mesh_reasoning_capped_total{model="t1"} 6
mesh_reasoning_tokens_total{model="t1"} 900
mesh_spec_draft_tokens_total{model="t3"} 120
mesh_spec_accepted_tokens_total{model="t3"} 100
"#;

    #[test]
    fn counters_come_from_the_metrics_exposition() {
        let c = totals(METRICS, "t1");
        assert_eq!(
            c,
            Counters {
                requests: 37,
                errors: 2,
                first_tier_steps: 24,
                first_tier_low_margin: 14,
                low_router_score_skips: 3,
                reasoning_requests: 24,
                reasoning_capped: 6,
                draft_tokens: 120,
                draft_accepted: 100,
                ..Counters::default()
            }
        );
        let before = Counters {
            requests: 30,
            first_tier_steps: 20,
            ..Counters::default()
        };
        let w = since(&c, &before);
        assert_eq!((w.requests, w.first_tier_steps, w.errors), (7, 4, 2));
        assert_eq!(
            since(&before, &c).requests,
            0,
            "a reset never goes negative"
        );
    }

    #[test]
    fn manual_proposals_are_checked_before_any_work() {
        let mut p = Policy::default();
        p.set("reasoning.default_budget", 32.0).unwrap();
        let gate = mesh_control::gate::GateConfig::default();
        let body = |knob: Option<&str>, value: Option<f64>, obj: Option<&str>| TuneBody {
            knob: knob.map(Into::into),
            value,
            objective: obj.map(Into::into),
        };
        let err = |b: TuneBody| manual_proposal(&b, &p, &gate).unwrap_err();
        assert!(err(body(Some("no.such"), Some(1.0), None))
            .0
            .contains("unknown knob"));
        let (m, param) = err(body(Some("reasoning.default_budget"), Some(5000.0), None));
        assert!(m.contains("outside [0, 4096]"), "{m}");
        assert_eq!(param, "value");
        assert!(
            err(body(Some("reasoning.default_budget"), Some(40.0), None))
                .0
                .contains("step grid")
        );
        assert!(
            err(body(Some("reasoning.default_budget"), Some(96.0), None))
                .0
                .contains("more than one step")
        );
        assert!(err(body(Some("reasoning.default_budget"), None, None))
            .0
            .contains("`value` is required"));
        assert!(err(body(
            Some("reasoning.default_budget"),
            Some(0.0),
            Some("speed")
        ))
        .0
        .contains("unknown objective"));
        assert!(err(body(None, Some(1.0), None)).0.contains("need a `knob`"));
        assert_eq!(
            manual_proposal(&body(None, None, None), &p, &gate),
            Ok(None)
        );
        let ok = manual_proposal(
            &body(
                Some("reasoning.default_budget"),
                Some(0.0),
                Some("accuracy"),
            ),
            &p,
            &gate,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            (ok.before, ok.after, ok.rule.as_str()),
            (32.0, 0.0, "manual")
        );
        assert_eq!(ok.objective.name, "accuracy");
    }

    #[test]
    fn a_reload_body_replaces_the_sections_it_names() {
        let mut cur = Policy::default();
        cur.set("router_top_k", 7.0).unwrap();
        let next = merged_policy(
            &cur,
            br#"{"quantization": {"tool_calls": {"t1": {"gguf": "q4_0", "kv": "q8_0"}}}}"#,
        )
        .unwrap();
        assert_eq!(next.router_top_k, 7, "a section left out stays");
        assert_eq!(next.cascade, cur.cascade);
        let q = next
            .quantization
            .get(mesh_control::policy::Role::ToolCalls, "t1")
            .unwrap();
        assert_eq!(q.gguf.as_deref(), Some("q4_0"));
        let back = merged_policy(&next, br#"{"quantization": {}}"#).unwrap();
        assert!(back.quantization.is_default(), "an empty section clears it");
        assert!(merged_policy(&cur, b"[1]")
            .unwrap_err()
            .contains("JSON object"));
        assert!(merged_policy(&cur, br#"{"quantisation": {}}"#)
            .unwrap_err()
            .contains("unknown field"));
        assert!(merged_policy(
            &cur,
            br#"{"quantization": {"tool_calls": {"t1": {"kv": "q2"}}}}"#
        )
        .is_err());
    }

    #[test]
    fn a_swap_reaches_new_readers_and_spares_old_ones() {
        let live = LivePolicy::new(Snapshot::of(&PolicyState::new(Policy::default())));
        let held = live.load();
        let mut s = PolicyState::new(Policy::default());
        s.policy.set("router_top_k", 6.0).unwrap();
        s.version = 1;
        live.store(Snapshot::of(&s));
        assert_eq!((held.version, held.policy.router_top_k), (0, 5));
        let now = live.load();
        assert_eq!((now.version, now.policy.router_top_k), (1, 6));
    }
}
