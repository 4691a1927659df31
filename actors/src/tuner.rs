//! The tuner actor: owns the node's policy state (the versioned policy file, its decision
//! journal), runs tuning cycles, puts reloaded policies in force, and keeps the live policy
//! every request reads.
//!
//! ```text
//!  Tick (every interval_s) ─┐
//!  Tune (operator)         ─┼─▶ TunerActor ──spawns──▶ cycle: probe pass, rules, A/B trial (TunerHost::probe)
//!                           │        ▲                          │
//!                           │        └──── CycleDone ◀──────────┘  judge → record (file) → LivePolicy
//!  Replace / ReloadFile    ─┤  check → start engines → record → swap → retire engines
//!  Show                    ─┘  the policy, knobs, decisions, engines
//! ```
//!
//! **Live policy.** [`LivePolicy`] holds an `Arc<Snapshot>` behind a `RwLock` held only to
//! copy or swap the pointer. A request takes the snapshot once when it starts and keeps it
//! to its end, so an accepted change applies to the next request and never to half of one.
//!
//! **A cycle** (one at a time: a second `Tune`, or a `Replace`, while one runs is refused
//! with [`TuneError::InProgress`]): the proposal is the operator's (checked against the
//! knob's bounds, grid and one step) or the rules' ([`mesh_control::tuner::propose`]) over
//! the window since the last cycle (the node's typed counters, [`TunerHost::totals`], plus
//! the probe accuracy of one observation pass); the trial runs each probe task under the
//! current policy (window A) and under the proposed one (window B), alternating which goes
//! first, through the node's own request path ([`TunerHost::probe`]); the gate judges; an
//! accepted change is written to the state file and then swapped into the live snapshot.
//! The cycle runs as a task the actor owns, so `Show` answers while it runs.
//!
//! **Restarts.** The live policy and this run's decisions live outside the actor; a new
//! incarnation reads the policy state back from the live snapshot (which the file mirrors).
//! A cycle in flight dies with its incarnation: its trial is lost and nothing is recorded.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use mesh_control::gate::{Better, GateConfig, Metric, Samples, Verdict};
use mesh_control::policy::{self, Decision, Policy, PolicyState};
use mesh_control::tuner::{self, Counters, Proposal, TunerConfig};
use mesh_tiers::eval::{self, Task};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use serde::Serialize;
use tracing::info;

use crate::engines::{EngineRow, Engines};
use crate::supervisor::ActorSlot;

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
    /// The snapshot of a policy state.
    pub fn of(s: &PolicyState) -> Self {
        Self {
            version: s.version,
            policy: Arc::new(s.policy.clone()),
            history: s.history.clone(),
        }
    }

    fn state(&self) -> PolicyState {
        PolicyState {
            format: 1,
            version: self.version,
            policy: (*self.policy).clone(),
            history: self.history.clone(),
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

/// Checks a policy as a state file or a reload must be: cascade, router top-k,
/// quantization entries.
pub fn check_policy(p: &Policy) -> Result<(), String> {
    p.cascade.validate()?;
    if p.router_top_k == 0 {
        return Err("router_top_k must be at least 1".into());
    }
    p.quantization.validate().map_err(|(msg, _)| msg)
}

/// The policy a node runs: from `state_file` when it exists (an unreadable or invalid one is
/// an error naming the file), else `start` at version 0 (written to `state_file` now, so the
/// file shows the policy in force from the start).
pub fn open_state(
    state_file: Option<&std::path::Path>,
    start: Policy,
) -> Result<PolicyState, String> {
    let Some(path) = state_file else {
        return Ok(PolicyState::new(start));
    };
    match PolicyState::load(path).map_err(|e| e.to_string())? {
        Some(s) => {
            check_policy(&s.policy)
                .map_err(|e| format!("tuner.state_file {}: {e}", path.display()))?;
            info!(file = %path.display(), version = s.version, "policy from the state file");
            Ok(s)
        }
        None => {
            let s = PolicyState::new(start);
            s.save(path).map_err(|e| e.to_string())?;
            Ok(s)
        }
    }
}

/// One probe request's outcome.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProbeResult {
    /// Latency in milliseconds.
    pub ms: f64,
    /// The answer was exactly right.
    pub exact: bool,
    /// The request failed.
    pub failed: bool,
}

/// What the tuner needs of its node.
pub trait TunerHost: Send + Sync + 'static {
    /// Runs `task` once as a chat request for `model` under `policy` through the node's
    /// own request path.
    fn probe(
        &self,
        task: Task,
        model: String,
        max_tokens: usize,
        policy: Arc<Policy>,
    ) -> BoxFuture<'static, ProbeResult>;
    /// Counter totals since the node started (cascade steps counted at `first_tier`).
    fn totals(&self, first_tier: &str) -> Counters;
    /// Why `model` cannot serve probe requests now, if it cannot.
    fn check_model(&self, model: &str) -> Result<(), String>;
}

/// Settings of the tuner actor.
#[derive(Debug, Clone)]
pub struct TunerOptions {
    /// Whether tuning cycles run at all (the live policy is read either way).
    pub enabled: bool,
    /// Seconds between rule-driven cycles; 0 = only on demand.
    pub interval_s: u64,
    /// The versioned policy file.
    pub state_file: Option<PathBuf>,
    /// Probe tasks (JSON lines).
    pub probe_tasks: PathBuf,
    /// Task kinds of the probe; empty = all.
    pub probe_kinds: Vec<String>,
    /// Tasks per trial window.
    pub probe_n: usize,
    /// Model the probe requests name; default the cascade's model id.
    pub probe_model: Option<String>,
    /// Completion budget of a probe request.
    pub probe_max_tokens: usize,
    /// The rules' targets and the gate.
    pub config: TunerConfig,
}

/// What an operator asks of a cycle (all optional: the rules decide).
#[derive(Debug, Clone, Default)]
pub struct TuneRequest {
    /// Knob to try.
    pub knob: Option<String>,
    /// Value to try (one step from the current).
    pub value: Option<f64>,
    /// `latency_ms` (default), `accuracy` or `error`.
    pub objective: Option<String>,
}

/// Why a cycle or a reload did not run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum TuneError {
    /// The tuner is off (`[tuner] enabled = false`).
    Disabled,
    /// A cycle or a reload is running.
    InProgress,
    /// The request is wrong; `param` names the field.
    Invalid {
        /// Why.
        message: String,
        /// The field.
        param: Option<String>,
    },
    /// The probe cannot run here (no tasks, the probe model not served).
    NotReady(String),
    /// An engine the policy needs did not start.
    EngineStart(String),
    /// Writing the state file failed.
    Internal(String),
}

impl std::fmt::Display for TuneError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Disabled => {
                f.write_str("the tuner is off on this node ([tuner] enabled = false)")
            }
            Self::InProgress => f.write_str(
                "a tuning cycle or a policy reload is running on this node; retry when it ends",
            ),
            Self::Invalid { message, .. }
            | Self::NotReady(message)
            | Self::EngineStart(message)
            | Self::Internal(message) => f.write_str(message),
        }
    }
}

/// The trial behind a decision.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TrialInfo {
    /// Probe tasks per window.
    pub tasks: usize,
    /// The model the probes named.
    pub model: String,
    /// Wall time of the trial.
    pub seconds: f64,
}

/// What a cycle did.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub enum TuneOutcome {
    /// The rules proposed nothing on this window.
    NoRuleFired {
        /// The window.
        counters: Counters,
        /// Policy version in force.
        version: u64,
    },
    /// A trial ran and the gate decided.
    Decided {
        /// The decision (accepted ones are in force).
        decision: Decision,
        /// The window the rules read (none for an operator's proposal).
        counters: Option<Counters>,
        /// The trial.
        trial: TrialInfo,
    },
}

/// Tally of the cycles the node ran by itself.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Periodic {
    /// Periods that ran a cycle.
    pub ran: u64,
    /// Periods skipped: fewer than `min_requests` requests in the window.
    pub idle: u64,
    /// Periods skipped: a cycle or a reload was running.
    pub busy: u64,
    /// The last periodic cycle's outcome.
    pub last: Option<Result<TuneOutcome, TuneError>>,
}

/// A knob as `Show` lists it.
#[derive(Debug, Clone, Serialize)]
pub struct KnobView {
    /// Id.
    pub id: String,
    /// Value in force.
    pub value: Option<f64>,
    /// Lower bound.
    pub min: f64,
    /// Upper bound.
    pub max: f64,
    /// Step.
    pub step: f64,
    /// What moving it does.
    pub effect: String,
}

/// The tuner's state as an operator sees it (`GET /v1/control/policy`).
#[derive(Debug, Clone, Serialize)]
pub struct TunerView {
    /// Policy version in force.
    pub version: u64,
    /// The policy.
    pub policy: Policy,
    /// Every knob with its bounds.
    pub knobs: Vec<KnobView>,
    /// Accepted changes.
    pub history: Vec<Decision>,
    /// The last decisions (the journal's, or this run's), oldest first.
    pub decisions: Vec<Decision>,
    /// The state file.
    pub state_file: Option<PathBuf>,
    /// The decision journal.
    pub journal: Option<PathBuf>,
    /// Whether cycles run.
    pub enabled: bool,
    /// Seconds between the node's own cycles (0: none).
    pub interval_s: u64,
    /// What those cycles did.
    pub cycles: Periodic,
    /// The node's engines.
    pub engines: Vec<EngineRow>,
}

/// An edit of the policy in force (a reload's sections merged onto it).
pub type PolicyEdit = Box<dyn FnOnce(&Policy) -> Result<Policy, String> + Send>;

/// What a reload did.
#[derive(Debug, Clone, Serialize)]
pub struct Replaced {
    /// Version now in force.
    pub version: u64,
    /// The policy.
    pub policy: Policy,
    /// The recorded decision.
    pub decision: Decision,
    /// The node's engines after the swap.
    pub engines: Vec<EngineRow>,
}

/// Messages of [`TunerActor`].
pub enum TunerMsg {
    /// Run one cycle.
    Tune {
        /// What the operator asks (empty: the rules decide).
        request: TuneRequest,
        /// The outcome.
        reply: RpcReplyPort<Result<TuneOutcome, TuneError>>,
    },
    /// A period of `[tuner] interval_s` passed.
    Tick,
    /// A cycle task finished (sent by the task).
    CycleDone(Box<CycleResult>),
    /// Put an edited policy in force (a `PUT /v1/control/policy`, named by `via`).
    Replace {
        /// The edit of the policy in force.
        edit: PolicyEdit,
        /// Who asks (journaled).
        via: String,
        /// The outcome.
        reply: RpcReplyPort<Result<Replaced, TuneError>>,
    },
    /// Read the state file again and put its policy in force (SIGHUP); answers the version
    /// in force.
    ReloadFile(RpcReplyPort<Result<u64, String>>),
    /// The tuner's state.
    Show(RpcReplyPort<TunerView>),
    /// Fault injection: the actor panics.
    Crash,
}

impl std::fmt::Debug for TunerMsg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Tune { .. } => "Tune",
            Self::Tick => "Tick",
            Self::CycleDone(_) => "CycleDone",
            Self::Replace { .. } => "Replace",
            Self::ReloadFile(_) => "ReloadFile",
            Self::Show(_) => "Show",
            Self::Crash => "Crash",
        })
    }
}

/// What a cycle task hands back to the actor.
pub struct CycleResult {
    reply: Option<RpcReplyPort<Result<TuneOutcome, TuneError>>>,
    /// Counter totals after the cycle (the next window starts there).
    baseline: Counters,
    outcome: CycleOutcome,
}

enum CycleOutcome {
    NoRule(Counters),
    Judged {
        decision: Decision,
        window: Option<Counters>,
        trial: TrialInfo,
    },
    Failed(TuneError),
}

/// Arguments of [`TunerActor`] (shared by its incarnations).
#[derive(Clone)]
pub struct TunerArgs {
    /// Settings.
    pub options: TunerOptions,
    /// The live policy requests read.
    pub live: Arc<LivePolicy>,
    /// The node.
    pub host: Arc<dyn TunerHost>,
    /// The node's engines (for the quantization policy).
    pub engines: Engines,
    /// This run's decisions and periodic tally (kept across restarts).
    pub memory: Arc<Mutex<Memory>>,
    /// The running incarnation, for callers.
    pub slot: Arc<ActorSlot<TunerMsg>>,
}

impl std::fmt::Debug for TunerArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TunerArgs")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

/// This run's decisions (newest last) and what the periodic cycles did.
#[derive(Debug, Default)]
pub struct Memory {
    decisions: Vec<Decision>,
    periodic: Periodic,
}

/// Decisions `Show` lists.
const SHOWN_DECISIONS: usize = 50;

/// The tuner (see the module docs).
#[derive(Debug, Default, Clone, Copy)]
pub struct TunerActor;

/// State of [`TunerActor`].
pub struct TunerState {
    args: TunerArgs,
    state: PolicyState,
    baseline: Counters,
    tasks: Option<Arc<Vec<Task>>>,
    cycle: Option<tokio::task::JoinHandle<()>>,
    timer: Option<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for TunerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TunerState")
            .field("version", &self.state.version)
            .field("cycle", &self.cycle.is_some())
            .finish()
    }
}

/// The objective metric by name, with the tolerance the gate's guard of that name has.
fn objective(name: &str, gate: &GateConfig) -> Result<Metric, String> {
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
pub fn manual_proposal(
    req: &TuneRequest,
    current: &Policy,
    gate: &GateConfig,
) -> Result<Option<Proposal>, (String, &'static str)> {
    let Some(knob) = &req.knob else {
        if req.value.is_some() || req.objective.is_some() {
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
    let value = req
        .value
        .ok_or_else(|| (format!("`value` is required with knob `{knob}`"), "value"))?;
    current
        .clone()
        .set(knob, value)
        .map_err(|e| (e.to_string(), "value"))?;
    let metric = objective(req.objective.as_deref().unwrap_or("latency_ms"), gate)
        .map_err(|e| (e, "objective"))?;
    tuner::manual(current, knob, value, metric)
        .map(Some)
        .map_err(|e| (e.to_string(), "value"))
}

/// Each task once under each policy, rotating which goes first task by task.
async fn probe_windows<const K: usize>(
    host: &Arc<dyn TunerHost>,
    model: &str,
    max_tokens: usize,
    tasks: &[Task],
    policies: [Arc<Policy>; K],
) -> [Samples; K] {
    let mut windows: [Samples; K] = std::array::from_fn(|_| Samples::new());
    for (i, task) in tasks.iter().enumerate() {
        for k in 0..K {
            let w = (k + i) % K;
            let r = host
                .probe(
                    task.clone(),
                    model.to_owned(),
                    max_tokens,
                    policies[w].clone(),
                )
                .await;
            let s = &mut windows[w];
            s.entry("latency_ms".into()).or_default().push(r.ms);
            s.entry("accuracy".into())
                .or_default()
                .push(f64::from(u8::from(r.exact)));
            s.entry("error".into())
                .or_default()
                .push(f64::from(u8::from(r.failed)));
        }
    }
    windows
}

impl TunerState {
    fn memory(&self) -> std::sync::MutexGuard<'_, Memory> {
        self.args
            .memory
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn load_tasks(&mut self) -> Result<Arc<Vec<Task>>, String> {
        if let Some(t) = &self.tasks {
            return Ok(t.clone());
        }
        let o = &self.args.options;
        let all = eval::load_tasks(&o.probe_tasks)?;
        let t: Vec<Task> = all
            .into_iter()
            .filter(|t| o.probe_kinds.is_empty() || o.probe_kinds.contains(&t.kind))
            .take(o.probe_n)
            .collect();
        if t.is_empty() {
            return Err(format!(
                "{}: no task of kinds {:?}",
                o.probe_tasks.display(),
                o.probe_kinds
            ));
        }
        let t = Arc::new(t);
        self.tasks = Some(t.clone());
        Ok(t)
    }

    fn remember(&self, d: &Decision) {
        let mut m = self.memory();
        m.decisions.push(d.clone());
        let skip = m.decisions.len().saturating_sub(SHOWN_DECISIONS);
        m.decisions.drain(..skip);
    }

    fn journal(&self) -> Vec<Decision> {
        let from_file = self
            .args
            .options
            .state_file
            .as_deref()
            .map(policy::journal_path)
            .and_then(|p| std::fs::read_to_string(p).ok());
        let mut all: Vec<Decision> = match from_file {
            Some(text) => text
                .lines()
                .filter_map(|l| serde_json::from_str(l).ok())
                .collect(),
            None => self.memory().decisions.clone(),
        };
        let skip = all.len().saturating_sub(SHOWN_DECISIONS);
        all.drain(..skip);
        all
    }

    /// Starts a cycle task; the reply (if any) is answered when it ends.
    fn start_cycle(
        &mut self,
        myself: &ActorRef<TunerMsg>,
        request: TuneRequest,
        reply: Option<RpcReplyPort<Result<TuneOutcome, TuneError>>>,
    ) {
        let fail = |reply: Option<RpcReplyPort<_>>, e: TuneError| {
            if let Some(r) = reply {
                let _ = r.send(Err(e));
            }
        };
        if !self.args.options.enabled {
            return fail(reply, TuneError::Disabled);
        }
        if self.cycle.is_some() {
            return fail(reply, TuneError::InProgress);
        }
        let cfg = self.args.options.config.clone();
        let current = self.args.live.load().policy.clone();
        let manual = match manual_proposal(&request, &current, &cfg.gate) {
            Ok(m) => m,
            Err((message, param)) => {
                return fail(
                    reply,
                    TuneError::Invalid {
                        message,
                        param: Some(param.into()),
                    },
                )
            }
        };
        let tasks = match self.load_tasks() {
            Ok(t) => t,
            Err(e) => return fail(reply, TuneError::NotReady(format!("probe tasks: {e}"))),
        };
        let o = &self.args.options;
        let model = o
            .probe_model
            .clone()
            .unwrap_or_else(|| current.cascade.model.clone());
        let needed = if model == current.cascade.model {
            current.cascade.tiers.clone()
        } else {
            vec![model.clone()]
        };
        for m in &needed {
            if let Err(e) = self.args.host.check_model(m) {
                return fail(
                    reply,
                    TuneError::NotReady(format!("the probe model `{model}` cannot run here: {e}")),
                );
            }
        }
        let first_tier = current.cascade.tiers.first().cloned().unwrap_or_default();
        let (host, baseline, max_tokens) = (
            self.args.host.clone(),
            self.baseline.clone(),
            o.probe_max_tokens,
        );
        let me = myself.clone();
        self.cycle = Some(tokio::spawn(async move {
            let mut window = None;
            let mut baseline = baseline;
            let proposal = match manual {
                Some(p) => Some(p),
                None => {
                    let [obs] =
                        probe_windows(&host, &model, max_tokens, &tasks, [current.clone()]).await;
                    let now = host.totals(&first_tier);
                    let mut c = now.since(&baseline);
                    let acc = obs.get("accuracy").cloned().unwrap_or_default();
                    c.requests += acc.len() as u64;
                    c.scored += acc.len() as u64;
                    c.correct += acc.iter().filter(|&&x| x > 0.5).count() as u64;
                    baseline = now;
                    window = Some(c.clone());
                    tuner::propose(&tuner::rules(), &c, &current, &cfg)
                }
            };
            let outcome = match proposal {
                None => CycleOutcome::NoRule(window.unwrap_or_default()),
                Some(p) => match p.apply_to(&current) {
                    Err(e) => CycleOutcome::Failed(TuneError::Invalid {
                        message: e.to_string(),
                        param: Some("value".into()),
                    }),
                    Ok(candidate) => {
                        let t0 = Instant::now();
                        let [a, b] = probe_windows(
                            &host,
                            &model,
                            max_tokens,
                            &tasks,
                            [current.clone(), Arc::new(candidate)],
                        )
                        .await;
                        let seconds = t0.elapsed().as_secs_f64();
                        baseline = host.totals(&first_tier);
                        CycleOutcome::Judged {
                            decision: tuner::judge(&p, &a, &b, &cfg.gate),
                            window,
                            trial: TrialInfo {
                                tasks: tasks.len(),
                                model,
                                seconds,
                            },
                        }
                    }
                },
            };
            let _ = me.send_message(TunerMsg::CycleDone(Box::new(CycleResult {
                reply,
                baseline,
                outcome,
            })));
        }));
    }

    /// Records a finished cycle; its outcome.
    fn finish_cycle(
        &mut self,
        r: CycleResult,
    ) -> (
        Option<RpcReplyPort<Result<TuneOutcome, TuneError>>>,
        Result<TuneOutcome, TuneError>,
    ) {
        self.cycle = None;
        self.baseline = r.baseline;
        let out = match r.outcome {
            CycleOutcome::Failed(e) => Err(e),
            CycleOutcome::NoRule(counters) => Ok(TuneOutcome::NoRuleFired {
                counters,
                version: self.state.version,
            }),
            CycleOutcome::Judged {
                mut decision,
                window,
                trial,
            } => {
                let mut next = self.state.clone();
                match next.record(decision.clone(), self.args.options.state_file.as_deref()) {
                    Err(e) => Err(TuneError::Internal(format!("recording the decision: {e}"))),
                    Ok(()) => {
                        decision.version = next.version;
                        self.state = next;
                        if decision.verdict == Verdict::Accept {
                            self.args.live.store(Snapshot::of(&self.state));
                        }
                        info!(rule = %decision.rule, knob = %decision.knob, before = decision.before,
                            after = decision.after, verdict = ?decision.verdict, reason = %decision.reason,
                            version = decision.version, "tuner decision");
                        self.remember(&decision);
                        Ok(TuneOutcome::Decided {
                            decision,
                            counters: window,
                            trial,
                        })
                    }
                }
            }
        };
        (r.reply, out)
    }

    /// Puts `next` in force (see [`TunerMsg::Replace`]): checks it, starts the engines its
    /// quantization names before the swap, journals the decision, writes the state file,
    /// swaps the live policy (requests in flight keep the one they read) and drains engines
    /// no longer named. Nothing changes when it is refused.
    async fn replace(&mut self, next: Policy, via: &str) -> Result<Replaced, TuneError> {
        let before = self.state.policy.clone();
        check_policy(&next).map_err(|message| TuneError::Invalid {
            message,
            param: None,
        })?;
        let engines = &self.args.engines;
        let wanted = engines
            .resolve(&next.quantization)
            .map_err(|(message, param)| TuneError::Invalid {
                message,
                param: Some(param),
            })?;
        if let Err(e) = engines.start(&wanted).await {
            return Err(TuneError::EngineStart(format!(
                "the policy needs an engine that could not start: {e}"
            )));
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
        let version = self.state.version;
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
        if let Err(e) = self
            .state
            .replace(next, d.clone(), self.args.options.state_file.as_deref())
        {
            // The policy stays; engines started for the refused one go again.
            if let Ok(old) = engines.resolve(&before.quantization) {
                engines.retire_unused(&old).await;
            }
            return Err(TuneError::Internal(format!(
                "writing the policy state file: {e}"
            )));
        }
        self.args.live.store(Snapshot::of(&self.state));
        engines.retire_unused(&wanted).await;
        let d = self.state.history.last().cloned().unwrap_or(d);
        info!(version = self.state.version, changed = %d.knob, rationale = %d.rationale, via, "policy reloaded");
        self.remember(&d);
        Ok(Replaced {
            version: self.state.version,
            policy: self.state.policy.clone(),
            decision: d,
            engines: engines.list(),
        })
    }

    fn view(&self) -> TunerView {
        let snap = self.args.live.load();
        let knobs = policy::knobs()
            .into_iter()
            .map(|k| KnobView {
                value: snap.policy.get(&k.id).ok(),
                id: k.id,
                min: k.min,
                max: k.max,
                step: k.step,
                effect: k.effect.to_string(),
            })
            .collect();
        let o = &self.args.options;
        TunerView {
            version: snap.version,
            policy: (*snap.policy).clone(),
            knobs,
            history: snap.history.clone(),
            decisions: self.journal(),
            state_file: o.state_file.clone(),
            journal: o.state_file.as_deref().map(policy::journal_path),
            enabled: o.enabled,
            interval_s: o.interval_s,
            cycles: self.memory().periodic.clone(),
            engines: self.args.engines.list(),
        }
    }
}

impl Actor for TunerActor {
    type Msg = TunerMsg;
    type State = TunerState;
    type Arguments = TunerArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<TunerMsg>,
        args: TunerArgs,
    ) -> Result<TunerState, ActorProcessingErr> {
        // The live snapshot mirrors the state file (or is the state, without one).
        let state = args.live.load().state();
        let first = state
            .policy
            .cascade
            .tiers
            .first()
            .cloned()
            .unwrap_or_default();
        let baseline = args.host.totals(&first);
        Ok(TunerState {
            args,
            state,
            baseline,
            tasks: None,
            cycle: None,
            timer: None,
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<TunerMsg>,
        state: &mut TunerState,
    ) -> Result<(), ActorProcessingErr> {
        let o = &state.args.options;
        if o.enabled && o.interval_s > 0 {
            info!(
                interval_s = o.interval_s,
                "tuner: a rule-driven cycle every period"
            );
            state.timer =
                Some(myself.send_interval(Duration::from_secs(o.interval_s), || TunerMsg::Tick));
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<TunerMsg>,
        state: &mut TunerState,
    ) -> Result<(), ActorProcessingErr> {
        for h in [state.cycle.take(), state.timer.take()]
            .into_iter()
            .flatten()
        {
            h.abort();
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<TunerMsg>,
        msg: TunerMsg,
        state: &mut TunerState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            TunerMsg::Tune { request, reply } => state.start_cycle(&myself, request, Some(reply)),
            TunerMsg::Tick => {
                if state.cycle.is_some() {
                    state.memory().periodic.busy += 1;
                    return Ok(());
                }
                let first = state
                    .args
                    .live
                    .load()
                    .policy
                    .cascade
                    .tiers
                    .first()
                    .cloned()
                    .unwrap_or_default();
                let live = state
                    .args
                    .host
                    .totals(&first)
                    .since(&state.baseline)
                    .requests;
                if live < state.args.options.config.min_requests {
                    state.memory().periodic.idle += 1;
                    return Ok(());
                }
                info!(live_requests = live, "tuner: periodic cycle");
                state.start_cycle(&myself, TuneRequest::default(), None);
            }
            TunerMsg::CycleDone(r) => {
                let (reply, out) = state.finish_cycle(*r);
                match reply {
                    Some(reply) => {
                        let _ = reply.send(out);
                    }
                    None => {
                        let mut m = state.memory();
                        m.periodic.ran += 1;
                        m.periodic.last = Some(out);
                    }
                }
            }
            TunerMsg::Replace { edit, via, reply } => {
                if state.cycle.is_some() {
                    let _ = reply.send(Err(TuneError::InProgress));
                    return Ok(());
                }
                let out = match edit(&state.state.policy) {
                    Err(message) => Err(TuneError::Invalid {
                        message,
                        param: None,
                    }),
                    Ok(next) => state.replace(next, &via).await,
                };
                let _ = reply.send(out);
            }
            TunerMsg::ReloadFile(reply) => {
                if state.cycle.is_some() {
                    // After the running cycle, as an operator editing the file expects.
                    myself.send_after(Duration::from_millis(200), || TunerMsg::ReloadFile(reply));
                    return Ok(());
                }
                let out = reload_file(state).await;
                let _ = reply.send(out);
            }
            TunerMsg::Show(reply) => {
                let _ = reply.send(state.view());
            }
            TunerMsg::Crash => panic!("tuner: crash injected"),
        }
        Ok(())
    }
}

async fn reload_file(state: &mut TunerState) -> Result<u64, String> {
    let Some(path) = state.args.options.state_file.clone() else {
        return Err("no tuner.state_file is configured; nothing to reload".into());
    };
    let read = PolicyState::load(&path)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("{} does not exist", path.display()))?;
    if read.policy == state.state.policy {
        return Ok(state.state.version);
    }
    state
        .replace(read.policy, "SIGHUP")
        .await
        .map(|r| r.version)
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// `current` with the top-level sections of the JSON object `patch` in place of its own.
pub fn merged_policy(current: &Policy, patch: &serde_json::Value) -> Result<Policy, String> {
    let serde_json::Value::Object(patch) = patch else {
        return Err("the body must be a JSON object of policy sections".into());
    };
    let mut v = serde_json::to_value(current).map_err(|e| e.to_string())?;
    let obj = v.as_object_mut().expect("a policy serializes to an object");
    for (k, x) in patch {
        obj.insert(k.clone(), x.clone());
    }
    serde_json::from_value(v).map_err(|e| format!("invalid policy: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_proposals_are_checked_before_any_work() {
        let mut p = Policy::default();
        p.set("reasoning.default_budget", 32.0).unwrap();
        let gate = GateConfig::default();
        let body = |knob: Option<&str>, value: Option<f64>, obj: Option<&str>| TuneRequest {
            knob: knob.map(Into::into),
            value,
            objective: obj.map(Into::into),
        };
        let err = |b: TuneRequest| manual_proposal(&b, &p, &gate).unwrap_err();
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
        let patch = serde_json::json!({"quantization": {"tool_calls": {"t1": {"gguf": "q4_0", "kv": "q8_0"}}}});
        let next = merged_policy(&cur, &patch).unwrap();
        assert_eq!(next.router_top_k, 7, "a section left out stays");
        assert_eq!(next.cascade, cur.cascade);
        let q = next
            .quantization
            .get(mesh_control::policy::Role::ToolCalls, "t1")
            .unwrap();
        assert_eq!(q.gguf.as_deref(), Some("q4_0"));
        let back = merged_policy(&next, &serde_json::json!({"quantization": {}})).unwrap();
        assert!(back.quantization.is_default(), "an empty section clears it");
        assert!(merged_policy(&cur, &serde_json::json!([1]))
            .unwrap_err()
            .contains("JSON object"));
        assert!(
            merged_policy(&cur, &serde_json::json!({"quantisation": {}}))
                .unwrap_err()
                .contains("unknown field")
        );
        assert!(merged_policy(
            &cur,
            &serde_json::json!({"quantization": {"tool_calls": {"t1": {"kv": "q2"}}}})
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
