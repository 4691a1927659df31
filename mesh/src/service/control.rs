//! The node's control calls: a tuning cycle and the policy in force (the tuner actor), tier
//! scaling (the planner actor), the node supervisor's children and the page stores'
//! counters. Each call reaches its actor's running incarnation and waits a second for one
//! that is restarting; an actor that stays down is [`Kind::Unavailable`](super::Kind),
//! retry shortly.

use std::time::Duration;

use mesh_actors::node::{ChildView, NodeMsg};
use mesh_actors::pagestore::{NamespaceStats, StoreMsg};
use mesh_actors::planner::{PlanError, PlannerMsg, PlannerStatus};
use mesh_actors::supervisor::{self, ActorCallError, ActorSlot};
use mesh_actors::tuner::{self, TunerMsg};
use mesh_control::placement::PlacementPlan;
use ractor::RpcReplyPort;
use serde_json::Value;

pub use mesh_actors::tuner::{Replaced, TuneOutcome, TuneRequest, TunerView};
pub use mesh_control::gate::Verdict;

use super::{Error, Service};

/// How long a call waits for a restarting tuner or planner.
const RESTART_WAIT: Duration = Duration::from_secs(1);
/// Longest a cycle may take (two probe windows over up to a few hundred tasks).
const CYCLE_TIMEOUT: Duration = Duration::from_secs(3600);
/// Longest the tuner may take to show its state.
const SHOW_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest a policy reload may take (the engines the new policy needs start first).
const REPLACE_TIMEOUT: Duration = Duration::from_secs(600);
/// Longest the planner (or the one it forwards to) may take to answer.
const PLANNER_TIMEOUT: Duration = Duration::from_secs(20);

fn unavailable(e: ActorCallError) -> Error {
    Error::unavailable(format!("{e}; retry shortly"))
}

impl Service {
    /// Runs one tuning cycle: the operator's proposal in `request`, or the rules' on the
    /// last window when it names no knob. A trial the gate rejects is an `Ok` outcome with
    /// its decision; `Err` when no trial ran (the tuner off or busy, a bad proposal, no
    /// probe tasks, an engine that did not start).
    ///
    /// Cancel safety: cancel-safe; a cycle that started runs to its end.
    pub async fn tune(&self, request: TuneRequest) -> Result<TuneOutcome, Error> {
        supervisor::call(
            &self.inner.actors.tuner,
            "tuner",
            RESTART_WAIT,
            CYCLE_TIMEOUT,
            |reply| TunerMsg::Tune {
                request: request.clone(),
                reply,
            },
        )
        .await
        .map_err(unavailable)?
        .map_err(Error::from)
    }

    /// The tuner's state: the policy in force, its knobs, decisions, periodic cycles and
    /// engines.
    ///
    /// Cancel safety: cancel-safe.
    pub async fn tuner_view(&self) -> Result<TunerView, Error> {
        supervisor::call(
            &self.inner.actors.tuner,
            "tuner",
            RESTART_WAIT,
            SHOW_TIMEOUT,
            TunerMsg::Show,
        )
        .await
        .map_err(unavailable)
    }

    /// Puts a new policy in force: `patch`'s top-level sections (`cascade`, `reasoning`,
    /// `router_top_k`, `draft_k_max`, `quantization`) replace the current ones, sections left
    /// out stay. `via` names who asks in the decision journal. Checked like a state file
    /// at start; an engine the new policy needs that does not start leaves the old one in
    /// force.
    ///
    /// Cancel safety: cancel-safe; a reload that started runs to its end.
    pub async fn replace_policy(&self, patch: Value, via: &str) -> Result<Replaced, Error> {
        supervisor::call(
            &self.inner.actors.tuner,
            "tuner",
            RESTART_WAIT,
            REPLACE_TIMEOUT,
            |reply| TunerMsg::Replace {
                edit: {
                    let patch = patch.clone();
                    Box::new(move |p| tuner::merged_policy(p, &patch))
                },
                via: via.to_owned(),
                reply,
            },
        )
        .await
        .map_err(unavailable)?
        .map_err(Error::from)
    }

    /// Tier scaling through the planner; `InvalidRequest` on a node outside a cluster.
    pub fn scaling(&self) -> Result<Scaling<'_>, Error> {
        match &self.inner.actors.planner {
            Some((planner, _)) => Ok(Scaling { planner }),
            None => Err(Error::invalid(
                "this node is not in a cluster: tiers scale across the nodes of one (`mesh join`)",
                None,
            )),
        }
    }

    /// The planner's status as this node sees it (cluster nodes).
    pub fn planner_status(&self) -> Option<PlannerStatus> {
        let (_, view) = self.inner.actors.planner.as_ref()?;
        Some(view.status(self.cluster()?.name()))
    }

    /// The node supervisor's children: each actor, whether it runs and its restarts
    /// (`None` when the supervisor does not answer in 2 s).
    ///
    /// Cancel safety: cancel-safe.
    pub async fn node_actors(&self) -> Option<Vec<ChildView>> {
        let supervisor = self.inner.actors.supervisor.as_ref()?;
        ractor::call_t!(supervisor, NodeMsg::Children, 2000).ok()
    }

    /// The page stores' counters per namespace, as the store actor has them now (none while
    /// it restarts).
    ///
    /// Cancel safety: cancel-safe.
    pub async fn store_stats(&self) -> Vec<NamespaceStats> {
        self.pages().call(StoreMsg::Stats).await.unwrap_or_default()
    }

    /// This node's tier placement, when planned.
    pub fn placement(&self) -> Option<&PlacementPlan> {
        self.inner.placement.as_ref()
    }
}

/// Tier scaling through the planner of a cluster node ([`Service::scaling`]). Any node
/// answers: its planner forwards to the one planning.
#[derive(Debug, Clone, Copy)]
pub struct Scaling<'a> {
    planner: &'a ActorSlot<PlannerMsg>,
}

impl Scaling<'_> {
    /// The planner's status as JSON text, from the node that plans: who plans, each scaled
    /// tier's replicas, queue time and pin, recent starts and drains.
    ///
    /// Cancel safety: cancel-safe.
    pub async fn status(&self) -> Result<String, Error> {
        self.call(|reply| PlannerMsg::Show { reply }).await
    }

    /// Pins `tier`'s replicas (`None`: back to its `[scaling.tiers]` policy); answers the
    /// planner's status once the first start or drain toward the pin is decided.
    /// `InvalidRequest` when no live node can run the tier or too few can for the count.
    ///
    /// Cancel safety: cancel-safe; a pin the planner took stays.
    pub async fn pin(&self, tier: &str, replicas: Option<u32>) -> Result<String, Error> {
        if tier.is_empty() {
            return Err(Error::invalid("tier must not be empty", Some("tier")));
        }
        self.call(|reply| PlannerMsg::Scale {
            tier: tier.to_owned(),
            replicas,
            reply,
        })
        .await
    }

    async fn call(
        &self,
        make: impl Fn(RpcReplyPort<Result<String, PlanError>>) -> PlannerMsg,
    ) -> Result<String, Error> {
        supervisor::call(self.planner, "planner", RESTART_WAIT, PLANNER_TIMEOUT, make)
            .await
            .map_err(unavailable)?
            .map_err(|e| match e {
                PlanError::Refused(why) => refused(why),
                PlanError::Unavailable(why) => Error::unavailable(format!("{why}; retry shortly")),
            })
    }
}

/// The planner's refusal as a bad request naming the field at fault: the replica count
/// when too few nodes can run the tier, the tier otherwise.
fn refused(why: String) -> Error {
    let param = if why.contains("replicas cannot") {
        "replicas"
    } else {
        "tier"
    };
    Error::invalid(why, Some(param))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::Kind;

    #[test]
    fn planner_refusals_name_the_field_at_fault() {
        let e = refused("no live node runs tier `t9` or has a config for it".into());
        assert_eq!(e.kind, Kind::InvalidRequest);
        assert_eq!(e.param.as_deref(), Some("tier"));
        let e = refused(
            "tier `t3` can run on 1 live node(s) (those with its config); 2 replicas cannot be placed"
                .into(),
        );
        assert_eq!(e.kind, Kind::InvalidRequest);
        assert_eq!(e.param.as_deref(), Some("replicas"));
        assert!(e.message.contains("2 replicas"));
    }
}
