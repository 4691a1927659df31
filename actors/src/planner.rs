//! The planner: starts and drains tier replicas across the cluster to keep each tier's
//! queue time at its target (`mesh_control::scaling` decides; this actor observes and
//! acts).
//!
//! ```text
//! every node: PlannerActor ── Tick (interval) ──▶ leader = first live node running a planner
//!                                                   │ not me: idle (answers Scale/Show by
//!                                                   │          forwarding to the leader)
//!                                                   ▼ me
//!   members' adverts ─▶ replicas, hosts, queue-time counters ─▶ scaling::decide per tier
//!                                                   │ Start{node} / Drain{node}
//!                                                   ▼
//!   Engines::load / drain (this node)  or  Cluster::ask::<EnginesProtocol>(node, Load|Drain)
//! ```
//!
//! One planner acts per cluster: the live node with the first name among those running
//! one. When it dies, membership marks it dead and the next name plans from its next
//! tick; the counters it reads live in the adverts, so nothing is handed over but the
//! pins (`mesh scale`), which stay with the node that held them. Decisions go to the log,
//! the shared [`PlannerView`] (`/metrics`, `GET /v1/control/scale`, `mesh status`).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use mesh_control::scaling::{self, Action, Counters, Host, Inputs, Replica, TierScaling};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use serde::Serialize;
use tracing::{info, warn};

use crate::engines::Engines;
use crate::wire::{EnginesCall, EnginesItem, PlannerCall, PlannerItem};
use crate::Cluster;

/// The engines actor of a node as peers call it: a planner starts and drains tiers there.
#[derive(Debug, Clone, Copy)]
pub struct EnginesProtocol;

impl crate::remote::Protocol for EnginesProtocol {
    const ACTOR: &'static str = "engines";
    type Call = EnginesCall;
    type Item = EnginesItem;
}

/// The planner as peers call it (`mesh scale` on any node reaches the one planning).
#[derive(Debug, Clone, Copy)]
pub struct PlannerProtocol;

impl crate::remote::Protocol for PlannerProtocol {
    const ACTOR: &'static str = "planner";
    type Call = PlannerCall;
    type Item = PlannerItem;
}

/// Decisions kept for `GET /v1/control/scale`.
const KEPT_DECISIONS: usize = 64;
/// After an action the tier is left alone this long, so the adverts show its result.
const SETTLE: Duration = Duration::from_millis(1500);
/// Longest a start or drain may take (a big GGUF loads slowly).
const ACTION_TIMEOUT: Duration = Duration::from_secs(300);

/// One start or drain the planner carried out.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Decision {
    /// When it finished (ms since the Unix epoch).
    pub at_ms: u64,
    /// Tier.
    pub tier: String,
    /// `start` or `drain`.
    pub action: &'static str,
    /// Node it acted on.
    pub node: String,
    /// Why.
    pub reason: String,
    /// `ok`, or the error.
    pub outcome: String,
    /// The node that planned it.
    pub by: String,
}

/// A tier as the planner saw it at its last tick.
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct TierView {
    /// Nodes running it.
    pub replicas: Vec<String>,
    /// Nodes that could start it.
    pub hosts: Vec<String>,
    /// A count set by hand.
    pub pinned: Option<u32>,
    /// Its policy.
    pub policy: Option<TierScaling>,
    /// Mean queue time over the window (ms).
    pub queue_ms: Option<f64>,
    /// Requests waiting now.
    pub waiting: u32,
    /// The last decision's reason when it changed nothing.
    pub holding: String,
}

/// What `GET /v1/control/scale` answers.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PlannerStatus {
    /// The node answering.
    pub node: String,
    /// The node planning (first live name among nodes running a planner).
    pub leader: Option<String>,
    /// Whether the answering node plans.
    pub planning: bool,
    /// Tiers with a policy or a pin.
    pub tiers: BTreeMap<String, TierView>,
    /// Recent starts and drains, oldest first.
    pub decisions: Vec<Decision>,
}

#[derive(Debug, Default)]
struct ViewInner {
    leader: Option<String>,
    pins: BTreeMap<String, u32>,
    tiers: BTreeMap<String, TierView>,
    decisions: VecDeque<Decision>,
    counts: BTreeMap<(String, &'static str, bool), u64>,
}

/// The planner's state others read (metrics, HTTP); kept across the actor's restarts.
#[derive(Debug, Default)]
pub struct PlannerView {
    inner: Mutex<ViewInner>,
}

impl PlannerView {
    fn lock(&self) -> std::sync::MutexGuard<'_, ViewInner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The status as this node sees it.
    pub fn status(&self, me: &str) -> PlannerStatus {
        let v = self.lock();
        PlannerStatus {
            node: me.to_owned(),
            leader: v.leader.clone(),
            planning: v.leader.as_deref() == Some(me),
            tiers: v.tiers.clone(),
            decisions: v.decisions.iter().cloned().collect(),
        }
    }

    /// Whether `me` plans now.
    pub fn planning(&self, me: &str) -> bool {
        self.lock().leader.as_deref() == Some(me)
    }

    /// Starts and drains carried out here: (tier, action, succeeded, count).
    pub fn counts(&self) -> Vec<(String, &'static str, bool, u64)> {
        self.lock()
            .counts
            .iter()
            .map(|((t, a, ok), n)| (t.clone(), *a, *ok, *n))
            .collect()
    }

    /// Replicas per tier at the last tick (planning node only).
    pub fn replicas(&self) -> Vec<(String, usize)> {
        self.lock()
            .tiers
            .iter()
            .map(|(t, v)| (t.clone(), v.replicas.len()))
            .collect()
    }
}

/// Why a pin or a status call got no answer from the node that plans.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The planner refused it (an unknown tier, more replicas than nodes can hold).
    #[error("{0}")]
    Refused(String),
    /// No planning node answered within [`FORWARD_WINDOW`]: the one that plans is gone and
    /// membership has not yet named the next, or none is reachable. Worth a retry.
    #[error("{0}")]
    Unavailable(String),
}

/// How long a node keeps forwarding a call whose planning node did not answer, following
/// membership to the next one (a dead planner's connection closes before membership marks
/// it dead, so the first retry usually reaches its successor).
pub const FORWARD_WINDOW: Duration = Duration::from_secs(8);

/// The wait between forwards to a planning node that did not answer.
const FORWARD_RETRY: Duration = Duration::from_millis(250);

/// Messages of [`PlannerActor`].
#[derive(Debug)]
pub enum PlannerMsg {
    /// Observe and decide (sent to itself every interval).
    Tick,
    /// Pin a tier's replicas (`None`: back to its policy); answered with the status as
    /// JSON text, from the node that plans.
    Scale {
        /// Tier.
        tier: String,
        /// Replicas.
        replicas: Option<u32>,
        /// The status, or why not.
        reply: RpcReplyPort<Result<String, PlanError>>,
    },
    /// The status as JSON text, from the node that plans.
    Show {
        /// The status.
        reply: RpcReplyPort<Result<String, PlanError>>,
    },
    /// An action finished.
    Done {
        /// What was done.
        decision: Decision,
        /// Whether it succeeded.
        ok: bool,
    },
    /// Fault injection: fail the actor.
    Crash,
}

/// Arguments of [`PlannerActor`].
#[derive(Clone)]
pub struct PlannerArgs {
    /// The cluster it reads and acts on.
    pub cluster: Cluster,
    /// This node's engines (started and drained directly).
    pub engines: Engines,
    /// Scaling policies by tier.
    pub policies: BTreeMap<String, TierScaling>,
    /// Time between ticks.
    pub interval: Duration,
    /// Window of the queue time.
    pub window: Duration,
    /// The shared view.
    pub view: Arc<PlannerView>,
}

impl std::fmt::Debug for PlannerArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlannerArgs")
            .field("policies", &self.policies)
            .field("interval", &self.interval)
            .finish()
    }
}

/// State of [`PlannerActor`].
#[derive(Debug)]
pub struct PlannerState {
    args: PlannerArgs,
    history: BTreeMap<String, VecDeque<(Instant, Counters)>>,
    last_change: BTreeMap<String, Instant>,
    /// Tiers with an action in flight or settling, until when.
    busy: BTreeMap<String, Option<Instant>>,
}

/// Plans the cluster's tier replicas (see the module docs).
#[derive(Debug, Default, Clone, Copy)]
pub struct PlannerActor;

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl PlannerState {
    fn me(&self) -> &str {
        self.args.cluster.name()
    }

    fn leader(&self) -> Option<String> {
        leader_of(&self.args.cluster)
    }

    fn status_json(&self) -> String {
        serde_json::to_string(&self.args.view.status(self.me())).unwrap_or_default()
    }

    /// Whether any live member could run `tier` (runs it, or has its config).
    fn known_tier(&self, tier: &str) -> usize {
        self.args
            .cluster
            .members()
            .iter()
            .filter(|m| m.state == "alive")
            .filter(|m| {
                m.tiers.iter().any(|t| t.name == tier)
                    || m.capacity.loadable.iter().any(|l| l.name == tier)
            })
            .count()
    }

    fn tick(&mut self, myself: &ActorRef<PlannerMsg>) {
        let leader = self.leader();
        let me = self.me().to_owned();
        self.args.view.lock().leader = leader.clone();
        if leader.as_deref() != Some(me.as_str()) {
            self.history.clear();
            return;
        }
        let members: Vec<_> = self
            .args
            .cluster
            .members()
            .into_iter()
            .filter(|m| m.state == "alive")
            .collect();
        let pins = self.args.view.lock().pins.clone();
        let tiers: BTreeSet<String> = self
            .args
            .policies
            .keys()
            .chain(pins.keys())
            .cloned()
            .collect();
        // A tier that lost its pin and has no policy is no longer scaled: no stale view.
        self.args.view.lock().tiers.retain(|t, _| tiers.contains(t));
        let now = Instant::now();
        for tier in tiers {
            let replicas: Vec<Replica> = members
                .iter()
                .filter_map(|m| {
                    let t = m.tiers.iter().find(|t| t.name == tier)?;
                    Some(Replica {
                        node: m.node.clone(),
                        active: t.active,
                        queued: t.queued,
                        slots: t.n_seq_max,
                        on_request: m.capacity.on_request.contains(&tier),
                    })
                })
                .collect();
            let counters: Counters = members
                .iter()
                .filter_map(|m| {
                    let t = m.tiers.iter().find(|t| t.name == tier)?;
                    Some((m.node.clone(), (t.started, t.queued_ms_total)))
                })
                .collect();
            let hosts: Vec<Host> = members
                .iter()
                .filter(|m| !m.tiers.iter().any(|t| t.name == tier))
                .filter_map(|m| {
                    let l = m.capacity.loadable.iter().find(|l| l.name == tier)?;
                    Some(Host {
                        node: m.node.clone(),
                        free_cores: m.capacity.cores.saturating_sub(m.capacity.cores_used),
                        free_bytes: m.capacity.free_bytes,
                        need_cores: l.threads,
                        need_bytes: l.bytes,
                        gpu_free: m.capacity.gpus.iter().map(|g| g.memory_free).collect(),
                        need_gpu_bytes: l.gpu_bytes,
                    })
                })
                .collect();
            let hist = self.history.entry(tier.clone()).or_default();
            hist.push_back((now, counters.clone()));
            while hist.len() > 1
                && hist
                    .get(1)
                    .is_some_and(|(t, _)| now.duration_since(*t) >= self.args.window)
            {
                hist.pop_front();
            }
            let queue_ms = hist
                .front()
                .and_then(|(_, before)| scaling::queue_ms(before, &counters));
            let full_window = hist
                .front()
                .is_some_and(|(t, _)| now.duration_since(*t) >= self.args.window);
            let policy = self.args.policies.get(&tier);
            let cooldown = Duration::from_secs(policy.map_or(0, |p| p.cooldown_s));
            let cooled = self
                .last_change
                .get(&tier)
                .is_none_or(|t| now.duration_since(*t) >= cooldown);
            let pinned = pins.get(&tier).copied();
            let waiting = replicas.iter().map(|r| r.queued).sum();
            let mut view = TierView {
                replicas: replicas.iter().map(|r| r.node.clone()).collect(),
                hosts: hosts.iter().map(|h| h.node.clone()).collect(),
                pinned,
                policy: policy.cloned(),
                queue_ms,
                waiting,
                holding: String::new(),
            };
            let busy = match self.busy.get(&tier) {
                Some(None) => true,
                Some(Some(until)) => now < *until,
                None => false,
            };
            let action = if busy {
                Action::Hold("a start or drain is in flight".into())
            } else {
                scaling::decide(&Inputs {
                    policy,
                    pinned,
                    replicas: &replicas,
                    hosts: &hosts,
                    queue_ms,
                    cooled,
                    full_window,
                })
            };
            let (start, node, reason) = match action {
                Action::Hold(why) => {
                    view.holding = why;
                    self.args.view.lock().tiers.insert(tier.clone(), view);
                    continue;
                }
                Action::Start { node, reason } => (true, node, reason),
                Action::Drain { node, reason } => (false, node, reason),
            };
            self.args.view.lock().tiers.insert(tier.clone(), view);
            let verb = if start { "start" } else { "drain" };
            info!(%tier, %node, action = verb, %reason, "planner: scaling");
            self.busy.insert(tier.clone(), None);
            let (cluster, engines, me2) = (
                self.args.cluster.clone(),
                self.args.engines.clone(),
                me.clone(),
            );
            let reply = myself.clone();
            tokio::spawn(async move {
                let r = tokio::time::timeout(
                    ACTION_TIMEOUT,
                    act(&cluster, &engines, &me2, &node, &tier, start),
                )
                .await
                .unwrap_or_else(|_| Err("timed out".into()));
                let decision = Decision {
                    at_ms: now_ms(),
                    tier,
                    action: verb,
                    node,
                    reason,
                    outcome: match &r {
                        Ok(()) => "ok".into(),
                        Err(e) => e.clone(),
                    },
                    by: me2,
                };
                let _ = reply.send_message(PlannerMsg::Done {
                    decision,
                    ok: r.is_ok(),
                });
            });
        }
    }

    fn done(&mut self, decision: Decision, ok: bool) {
        let now = Instant::now();
        if ok {
            info!(tier = %decision.tier, node = %decision.node, action = decision.action, "planner: done");
            self.last_change.insert(decision.tier.clone(), now);
        } else {
            warn!(tier = %decision.tier, node = %decision.node, action = decision.action, error = %decision.outcome, "planner: failed");
        }
        self.busy.insert(decision.tier.clone(), Some(now + SETTLE));
        let mut v = self.args.view.lock();
        *v.counts
            .entry((decision.tier.clone(), decision.action, ok))
            .or_default() += 1;
        v.decisions.push_back(decision);
        while v.decisions.len() > KEPT_DECISIONS {
            v.decisions.pop_front();
        }
    }
}

/// Starts or drains `tier` on `node` (this node directly, a peer through its engines actor).
async fn act(
    cluster: &Cluster,
    engines: &Engines,
    me: &str,
    node: &str,
    tier: &str,
    start: bool,
) -> Result<(), String> {
    if node == me {
        return if start {
            engines.load(tier).await
        } else {
            engines.drain(tier).await
        };
    }
    let tier = tier.to_owned();
    let call = if start {
        EnginesCall::Load { tier }
    } else {
        EnginesCall::Drain { tier }
    };
    match cluster
        .ask::<EnginesProtocol>(node, &call, ACTION_TIMEOUT)
        .await
    {
        Ok(EnginesItem::Done) => Ok(()),
        Ok(EnginesItem::Refused(why)) => Err(why),
        Err(e) => Err(e.to_string()),
    }
}

/// The node that plans, as this node's membership sees it now.
fn leader_of(cluster: &Cluster) -> Option<String> {
    let members = cluster.members();
    let names = members
        .iter()
        .filter(|m| m.state == "alive" && m.actors.iter().any(|a| a == "planner"))
        .map(|m| m.node.as_str());
    scaling::leader(names).map(str::to_owned)
}

/// Sends `call` to the planning node's planner and returns its status text.
async fn forward(cluster: &Cluster, leader: &str, call: &PlannerCall) -> Result<String, PlanError> {
    match cluster
        .ask::<PlannerProtocol>(leader, call, Duration::from_secs(10))
        .await
    {
        Ok(PlannerItem::Status(s)) => Ok(s),
        Ok(PlannerItem::Refused(why)) => Err(PlanError::Refused(why)),
        Err(e) if e.retryable() => Err(PlanError::Unavailable(format!(
            "the planning node {leader}: {e}"
        ))),
        Err(e) => Err(PlanError::Refused(format!(
            "the planning node {leader}: {e}"
        ))),
    }
}

/// What [`forward_until_answered`] settled on.
enum Forwarded {
    /// The answer (or the last refusal) for the caller.
    Answer(Result<String, PlanError>),
    /// Membership now names this node as the one that plans: handle the call here.
    Here,
}

/// Forwards `call` to `leader`; while the planning node does not answer, waits and
/// forwards to whichever node membership names then, for up to [`FORWARD_WINDOW`].
async fn forward_until_answered(
    cluster: &Cluster,
    mut leader: String,
    call: &PlannerCall,
) -> Forwarded {
    let give_up = Instant::now() + FORWARD_WINDOW;
    loop {
        let r = forward(cluster, &leader, call).await;
        if !matches!(r, Err(PlanError::Unavailable(_))) || Instant::now() >= give_up {
            return Forwarded::Answer(r);
        }
        tokio::time::sleep(FORWARD_RETRY).await;
        match leader_of(cluster) {
            Some(l) if l == cluster.name() => return Forwarded::Here,
            Some(l) => leader = l,
            None => return Forwarded::Answer(r),
        }
    }
}

impl Actor for PlannerActor {
    type Msg = PlannerMsg;
    type State = PlannerState;
    type Arguments = PlannerArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<PlannerMsg>,
        args: PlannerArgs,
    ) -> Result<PlannerState, ActorProcessingErr> {
        myself.send_interval(args.interval, || PlannerMsg::Tick);
        Ok(PlannerState {
            args,
            history: BTreeMap::new(),
            last_change: BTreeMap::new(),
            busy: BTreeMap::new(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<PlannerMsg>,
        msg: PlannerMsg,
        state: &mut PlannerState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            PlannerMsg::Tick => state.tick(&myself),
            PlannerMsg::Done { decision, ok } => state.done(decision, ok),
            PlannerMsg::Crash => panic!("planner: crash injected"),
            PlannerMsg::Show { reply } => {
                let leader = state.leader();
                let me = state.me().to_owned();
                // Fresh, not as of the last tick: a node just started has not ticked yet.
                state.args.view.lock().leader = leader.clone();
                match leader {
                    Some(l) if l != me => {
                        let cluster = state.args.cluster.clone();
                        let myself = myself.clone();
                        tokio::spawn(async move {
                            match forward_until_answered(&cluster, l, &PlannerCall::Show).await {
                                Forwarded::Answer(r) => {
                                    let _ = reply.send(r);
                                }
                                Forwarded::Here => {
                                    let _ = myself.send_message(PlannerMsg::Show { reply });
                                }
                            }
                        });
                    }
                    _ => {
                        let _ = reply.send(Ok(state.status_json()));
                    }
                }
            }
            PlannerMsg::Scale {
                tier,
                replicas,
                reply,
            } => {
                let leader = state.leader();
                let me = state.me().to_owned();
                if let Some(l) = leader.filter(|l| *l != me) {
                    let cluster = state.args.cluster.clone();
                    let myself = myself.clone();
                    tokio::spawn(async move {
                        let call = PlannerCall::Scale {
                            tier: tier.clone(),
                            replicas,
                        };
                        match forward_until_answered(&cluster, l, &call).await {
                            Forwarded::Answer(r) => {
                                let _ = reply.send(r);
                            }
                            Forwarded::Here => {
                                let _ = myself.send_message(PlannerMsg::Scale {
                                    tier,
                                    replicas,
                                    reply,
                                });
                            }
                        }
                    });
                    return Ok(());
                }
                let nodes = state.known_tier(&tier);
                let r = match replicas {
                    _ if nodes == 0 => Err(format!(
                        "no live node runs tier `{tier}` or has a config for it"
                    )),
                    Some(n) if n as usize > nodes => Err(format!(
                        "tier `{tier}` can run on {nodes} live node(s) (those with its config); {n} replicas cannot be placed"
                    )),
                    _ => {
                        let mut v = state.args.view.lock();
                        match replicas {
                            Some(n) => {
                                info!(%tier, replicas = n, "planner: pinned by hand");
                                v.pins.insert(tier.clone(), n);
                            }
                            None => {
                                info!(%tier, "planner: pin removed; the policy decides");
                                v.pins.remove(&tier);
                            }
                        }
                        Ok(())
                    }
                };
                match r {
                    Ok(()) => {
                        // The next tick acts on it; answer with the status after it.
                        state.tick(&myself);
                        let _ = reply.send(Ok(state.status_json()));
                    }
                    Err(e) => {
                        let _ = reply.send(Err(PlanError::Refused(e)));
                    }
                }
            }
        }
        Ok(())
    }
}
