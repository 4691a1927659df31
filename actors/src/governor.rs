//! The reasoning governor actor: decides a request's thinking budget from its role, the
//! router's confidence and the live policy; the engine enforces it (it closes the think
//! block when the budget is spent).
//!
//! The decision is the pure [`budget`]; the actor counts its decisions by role and by
//! outcome, so an operator sees what the governor did (`mesh_governor_decisions_total`).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use mesh_control::policy::Role;
use mesh_tiers::cascade::ReasoningPolicy;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use crate::supervisor::{self, ActorSlot};

/// A request's thinking budget under `policy`: the request's own budget when it set one,
/// else `policy`'s confidence formula when the router's confidence is known, else its
/// default (`None`: no cap). Every role gets the same rule today; the role is an input so
/// that a policy per role needs no new message.
pub fn budget(
    policy: &ReasoningPolicy,
    _role: Role,
    requested: Option<usize>,
    confidence: Option<f32>,
) -> Option<usize> {
    policy.budget(requested, confidence)
}

/// One budget question.
#[derive(Debug, Clone)]
pub struct BudgetQuery {
    /// What the request is for.
    pub role: Role,
    /// The request's own `reasoning_budget`.
    pub requested: Option<usize>,
    /// The router's top-1 score, when it routed the request.
    pub confidence: Option<f32>,
    /// The reasoning section of the policy the request runs under.
    pub policy: ReasoningPolicy,
}

/// Messages of [`GovernorActor`].
#[derive(Debug)]
pub enum GovernorMsg {
    /// Decide a budget.
    Budget {
        /// The question.
        query: BudgetQuery,
        /// The budget (`None`: no cap).
        reply: RpcReplyPort<Option<usize>>,
    },
    /// Fault injection: the actor panics.
    Crash,
}

/// Decisions so far (shared with the metrics; kept across restarts).
#[derive(Debug, Default)]
pub struct GovernorStats {
    /// Budgets decided, by role (`tool_calls`, `reasoning`, `summaries`).
    pub capped: [AtomicU64; 3],
    /// Requests left without a cap, by role.
    pub uncapped: [AtomicU64; 3],
}

fn role_index(r: Role) -> usize {
    match r {
        Role::ToolCalls => 0,
        Role::Reasoning => 1,
        Role::Summaries => 2,
    }
}

impl GovernorStats {
    /// `(role, capped, uncapped)` rows.
    pub fn rows(&self) -> Vec<(&'static str, u64, u64)> {
        [Role::ToolCalls, Role::Reasoning, Role::Summaries]
            .into_iter()
            .map(|r| {
                let i = role_index(r);
                (
                    r.as_str(),
                    self.capped[i].load(Relaxed),
                    self.uncapped[i].load(Relaxed),
                )
            })
            .collect()
    }
}

/// The reasoning governor (see the module docs).
#[derive(Debug, Default, Clone, Copy)]
pub struct GovernorActor;

impl Actor for GovernorActor {
    type Msg = GovernorMsg;
    type State = Arc<GovernorStats>;
    type Arguments = Arc<GovernorStats>;

    async fn pre_start(
        &self,
        _myself: ActorRef<GovernorMsg>,
        stats: Arc<GovernorStats>,
    ) -> Result<Arc<GovernorStats>, ActorProcessingErr> {
        Ok(stats)
    }

    async fn handle(
        &self,
        _myself: ActorRef<GovernorMsg>,
        msg: GovernorMsg,
        stats: &mut Arc<GovernorStats>,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            GovernorMsg::Budget { query, reply } => {
                let b = budget(&query.policy, query.role, query.requested, query.confidence);
                let i = role_index(query.role);
                match b {
                    Some(_) => stats.capped[i].fetch_add(1, Relaxed),
                    None => stats.uncapped[i].fetch_add(1, Relaxed),
                };
                let _ = reply.send(b);
            }
            GovernorMsg::Crash => panic!("governor: crash injected"),
        }
        Ok(())
    }
}

/// How long a budget call waits for a restarting governor.
pub const RESTART_WAIT: Duration = Duration::from_secs(1);

/// Asks the governor in `slot`, waiting out one restart; `None` when it could not answer
/// (the caller then decides with [`budget`] itself).
///
/// Cancel safety: cancel-safe.
pub async fn ask(slot: &ActorSlot<GovernorMsg>, query: BudgetQuery) -> Option<Option<usize>> {
    supervisor::call(
        slot,
        "governor",
        RESTART_WAIT,
        Duration::from_secs(5),
        |reply| GovernorMsg::Budget {
            query: query.clone(),
            reply,
        },
    )
    .await
    .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> ReasoningPolicy {
        ReasoningPolicy {
            default_budget: Some(64),
            base: 256,
            per_confidence: 1024,
            max: 1000,
        }
    }

    #[test]
    fn a_requested_budget_wins() {
        assert_eq!(
            budget(&policy(), Role::Reasoning, Some(7), Some(0.9)),
            Some(7)
        );
    }

    #[test]
    fn confidence_scales_the_budget_up_to_the_max() {
        assert_eq!(
            budget(&policy(), Role::ToolCalls, None, Some(0.5)),
            Some(256 + 512)
        );
        assert_eq!(
            budget(&policy(), Role::ToolCalls, None, Some(1.0)),
            Some(1000)
        );
    }

    #[test]
    fn without_confidence_the_default_applies() {
        assert_eq!(budget(&policy(), Role::Summaries, None, None), Some(64));
        let none = ReasoningPolicy {
            default_budget: None,
            ..policy()
        };
        assert_eq!(budget(&none, Role::Summaries, None, None), None);
    }
}
