//! The node supervisor: the root of a node's supervision tree.
//!
//! ```text
//! NodeSupervisor ──linked──▶ membership  (cluster nodes)
//!                ──linked──▶ kv-store
//!                ──linked──▶ engines ──linked──▶ tier actors
//!                ──linked──▶ router, governor, tuner
//! ```
//!
//! Each child is described by a [`ChildSpec`]: how to start it (linked to the supervisor)
//! and how to tell the rest of the node it is gone (its [`ActorSlot`] is emptied). A child
//! that fails is started again after its [`RestartPolicy`]'s back-off (one for one: its
//! siblings keep running); one that fails more often than the policy's intensity allows
//! makes the supervisor fail, which stops the node (there is no parent to escalate to), so
//! whatever runs the process starts it again. Children start in the order given and stop
//! with the supervisor.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use tracing::{error, info, warn};

use crate::supervisor::{ActorSlot, Decision, RestartLog, RestartPolicy};

type StartFn = dyn Fn(ActorCell) -> Pin<Box<dyn Future<Output = Result<ActorCell, ActorProcessingErr>> + Send>>
    + Send
    + Sync;

/// One child of the node supervisor.
#[derive(Clone)]
pub struct ChildSpec {
    /// Its name in logs and metrics (`router`, `kv-store`, ...).
    pub name: &'static str,
    /// How failures are handled.
    pub policy: RestartPolicy,
    start: Arc<StartFn>,
    gone: Arc<dyn Fn() + Send + Sync>,
    /// Restarts so far (kept across the child's incarnations).
    pub restarts: Arc<AtomicU64>,
}

impl std::fmt::Debug for ChildSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChildSpec")
            .field("name", &self.name)
            .field("policy", &self.policy)
            .finish()
    }
}

impl ChildSpec {
    /// A child running `actor` with `args` (cloned for every start), reachable through
    /// `slot`.
    pub fn new<A>(
        name: &'static str,
        actor: A,
        args: A::Arguments,
        slot: Arc<ActorSlot<A::Msg>>,
    ) -> Self
    where
        A: Actor + Clone,
        A::Arguments: Clone + Sync,
    {
        let gone_slot = slot.clone();
        Self {
            name,
            policy: RestartPolicy::default(),
            start: Arc::new(move |sup: ActorCell| {
                let (actor, args, slot) = (actor.clone(), args.clone(), slot.clone());
                Box::pin(async move {
                    let (r, _) = Actor::spawn_linked(None, actor, args, sup).await?;
                    slot.set(Some(r.clone()));
                    Ok(r.get_cell())
                })
            }),
            gone: Arc::new(move || gone_slot.set(None)),
            restarts: Arc::default(),
        }
    }

    /// With another restart policy.
    pub fn with_policy(mut self, policy: RestartPolicy) -> Self {
        self.policy = policy;
        self
    }
}

/// A child as `GET /v1/cluster` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ChildView {
    /// Name.
    pub name: &'static str,
    /// Whether an incarnation runs.
    pub running: bool,
    /// Restarts since the node started.
    pub restarts: u64,
    /// How long the last restart took, from the failure to the new incarnation running.
    pub last_restart_ms: Option<u64>,
}

/// Messages of [`NodeSupervisor`].
#[derive(Debug)]
pub enum NodeMsg {
    /// Start a child again (sent to itself after the back-off).
    Restart(&'static str),
    /// The children and their restarts.
    Children(RpcReplyPort<Vec<ChildView>>),
    /// Start one more child (one that needs what the first children provide).
    Adopt(ChildSpec, RpcReplyPort<Result<(), String>>),
}

/// The root supervisor of a node (see the module docs).
#[derive(Debug, Default, Clone, Copy)]
pub struct NodeSupervisor;

/// State of [`NodeSupervisor`].
#[derive(Debug)]
pub struct NodeState {
    specs: Vec<ChildSpec>,
    running: HashMap<ractor::ActorId, &'static str>,
    logs: HashMap<&'static str, RestartLog>,
    /// When each child that is down failed.
    down_since: HashMap<&'static str, Instant>,
    /// How long each child's last restart took.
    last_restart: HashMap<&'static str, std::time::Duration>,
}

impl NodeState {
    fn spec(&self, name: &str) -> Option<&ChildSpec> {
        self.specs.iter().find(|s| s.name == name)
    }

    async fn start(
        &mut self,
        myself: &ActorRef<NodeMsg>,
        name: &'static str,
    ) -> Result<(), ActorProcessingErr> {
        let spec = self.spec(name).cloned().ok_or("unknown child")?;
        let cell = (spec.start)(myself.get_cell()).await?;
        self.running.insert(cell.get_id(), name);
        if let Some(t) = self.down_since.remove(name) {
            self.last_restart.insert(name, t.elapsed());
        }
        Ok(())
    }

    fn failed(
        &mut self,
        myself: &ActorRef<NodeMsg>,
        name: &'static str,
        why: &str,
    ) -> Result<(), ActorProcessingErr> {
        let Some(spec) = self.spec(name).cloned() else {
            return Ok(());
        };
        (spec.gone)();
        self.down_since.entry(name).or_insert_with(Instant::now);
        let log = self.logs.entry(name).or_default();
        match log.decide(&spec.policy, Instant::now()) {
            Decision::Restart { after, attempt } => {
                spec.restarts.fetch_add(1, Relaxed);
                warn!(actor = name, reason = %why, attempt, backoff_ms = after.as_millis() as u64, "actor exited; restarting");
                myself.send_after(after, move || NodeMsg::Restart(name));
                Ok(())
            }
            Decision::Escalate { restarts } => {
                error!(actor = name, reason = %why, restarts, window_s = spec.policy.window.as_secs(), "actor keeps failing; stopping the node");
                Err(format!(
                    "{name} failed {restarts} times within {} s: {why}",
                    spec.policy.window.as_secs()
                )
                .into())
            }
        }
    }
}

impl Actor for NodeSupervisor {
    type Msg = NodeMsg;
    type State = NodeState;
    type Arguments = Vec<ChildSpec>;

    async fn pre_start(
        &self,
        myself: ActorRef<NodeMsg>,
        specs: Vec<ChildSpec>,
    ) -> Result<NodeState, ActorProcessingErr> {
        let mut state = NodeState {
            specs,
            running: HashMap::new(),
            logs: HashMap::new(),
            down_since: HashMap::new(),
            last_restart: HashMap::new(),
        };
        let names: Vec<&'static str> = state.specs.iter().map(|s| s.name).collect();
        for name in names {
            state
                .start(&myself, name)
                .await
                .map_err(|e| format!("starting {name}: {e}"))?;
            info!(actor = name, "started");
        }
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<NodeMsg>,
        msg: NodeMsg,
        state: &mut NodeState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            NodeMsg::Restart(name) => match state.start(&myself, name).await {
                Ok(()) => info!(actor = name, "restarted"),
                Err(e) => state.failed(&myself, name, &format!("start failed: {e}"))?,
            },
            NodeMsg::Adopt(spec, reply) => {
                let name = spec.name;
                state.specs.push(spec);
                let r = state.start(&myself, name).await;
                if r.is_err() {
                    state.specs.retain(|s| s.name != name);
                }
                let _ = reply.send(r.map_err(|e| e.to_string()));
            }
            NodeMsg::Children(reply) => {
                let running: Vec<&str> = state.running.values().copied().collect();
                let _ = reply.send(
                    state
                        .specs
                        .iter()
                        .map(|s| ChildView {
                            name: s.name,
                            running: running.contains(&s.name),
                            restarts: s.restarts.load(Relaxed),
                            last_restart_ms: state
                                .last_restart
                                .get(s.name)
                                .map(|d| d.as_millis() as u64),
                        })
                        .collect(),
                );
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<NodeMsg>,
        evt: SupervisionEvent,
        state: &mut NodeState,
    ) -> Result<(), ActorProcessingErr> {
        let Some((cell, why)) = crate::supervisor::exited(evt) else {
            return Ok(());
        };
        let Some(name) = state.running.remove(&cell.get_id()) else {
            return Ok(());
        };
        state.failed(&myself, name, &why)
    }
}
