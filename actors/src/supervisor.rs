//! Restart decisions of the node's supervisors (pure) and the slots through which the rest of
//! the node reaches a supervised actor across its restarts.
//!
//! A supervisor restarts a failed child after a back-off that doubles with each restart in
//! the current window (`backoff_min`, `2 × backoff_min`, … up to `backoff_max`). When a
//! child has failed more than `max_restarts` times within `window`, the supervisor stops
//! restarting it and escalates: it fails itself, and its own supervisor decides (as OTP's
//! restart intensity does). The node supervisor has no parent: its escalation stops the
//! node, so the process exits and whatever runs it (systemd, Kubernetes) starts it again.
//!
//! ```text
//!  child fails ─▶ RestartLog::decide(now) ─┬─ Restart { after } ─▶ start the child again after `after`
//!                                          └─ Escalate           ─▶ the supervisor fails
//! ```

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use ractor::{ActorRef, Message};
use tokio::sync::watch;

/// How a supervisor restarts one child.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestartPolicy {
    /// Restarts tolerated within `window`; one more escalates.
    pub max_restarts: u32,
    /// The window restarts are counted in.
    pub window: Duration,
    /// Delay before the first restart in a window.
    pub backoff_min: Duration,
    /// Longest delay before a restart.
    pub backoff_max: Duration,
}

impl Default for RestartPolicy {
    /// 5 restarts within 30 s, back-off 100 ms doubling up to 5 s. A crash loop of a
    /// child that dies at once on every start escalates after about 3 s of back-off.
    fn default() -> Self {
        Self {
            max_restarts: 5,
            window: Duration::from_secs(30),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
        }
    }
}

/// What a supervisor does about a failed child.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Start it again after this delay.
    Restart {
        /// Back-off before the start.
        after: Duration,
        /// Restarts within the window, this one included.
        attempt: u32,
    },
    /// Too many restarts within the window: fail the supervisor.
    Escalate {
        /// Restarts counted within the window.
        restarts: u32,
    },
}

/// The restarts of one child, for [`RestartLog::decide`].
#[derive(Debug, Clone, Default)]
pub struct RestartLog {
    at: VecDeque<Instant>,
}

impl RestartLog {
    /// Records a failure at `now` and decides what to do under `policy`.
    pub fn decide(&mut self, policy: &RestartPolicy, now: Instant) -> Decision {
        while self
            .at
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) > policy.window)
        {
            self.at.pop_front();
        }
        if self.at.len() as u32 >= policy.max_restarts {
            return Decision::Escalate {
                restarts: self.at.len() as u32,
            };
        }
        self.at.push_back(now);
        let attempt = self.at.len() as u32;
        let factor = 1u32 << (attempt - 1).min(16);
        let after = policy
            .backoff_min
            .saturating_mul(factor)
            .min(policy.backoff_max);
        Decision::Restart { after, attempt }
    }

    /// Restarts within the window as of the last decision.
    pub fn recent(&self) -> usize {
        self.at.len()
    }
}

/// The child a supervision event says has exited, and why; `None` for other events.
pub fn exited(evt: ractor::SupervisionEvent) -> Option<(ractor::ActorCell, String)> {
    match evt {
        ractor::SupervisionEvent::ActorFailed(cell, err) => Some((cell, err.to_string())),
        ractor::SupervisionEvent::ActorTerminated(cell, _, reason) => {
            Some((cell, reason.unwrap_or_else(|| "stopped".into())))
        }
        _ => None,
    }
}

/// The current incarnation of a supervised actor, for everything that talks to it.
///
/// The supervisor sets it when the actor starts and clears it when the actor exits; callers
/// read it per call, so a restarted actor is reached without anyone holding a stale
/// reference, and [`ActorSlot::wait`] lets a caller wait (bounded) for a restart.
#[derive(Debug)]
pub struct ActorSlot<M: Message> {
    tx: watch::Sender<Option<ActorRef<M>>>,
}

impl<M: Message> Default for ActorSlot<M> {
    fn default() -> Self {
        Self {
            tx: watch::Sender::new(None),
        }
    }
}

impl<M: Message> ActorSlot<M> {
    /// The running incarnation, if any.
    pub fn get(&self) -> Option<ActorRef<M>> {
        self.tx.borrow().clone()
    }

    /// Puts a new incarnation in (or `None` when it exited).
    pub fn set(&self, actor: Option<ActorRef<M>>) {
        self.tx.send_replace(actor);
    }

    /// The running incarnation, waiting up to `timeout` for one to start.
    ///
    /// Cancel safety: cancel-safe.
    pub async fn wait(&self, timeout: Duration) -> Option<ActorRef<M>> {
        let mut rx = self.tx.subscribe();
        let r = tokio::time::timeout(timeout, rx.wait_for(Option::is_some)).await;
        match r {
            Ok(Ok(a)) => a.clone(),
            _ => None,
        }
    }

    /// An incarnation other than `old` (the one a failed call went to), waiting up to
    /// `timeout` for the supervisor to start it.
    ///
    /// Cancel safety: cancel-safe.
    pub async fn wait_replaced(&self, old: &ActorRef<M>, timeout: Duration) -> Option<ActorRef<M>> {
        let id = old.get_id();
        let mut rx = self.tx.subscribe();
        let r = tokio::time::timeout(
            timeout,
            rx.wait_for(|a| a.as_ref().is_some_and(|a| a.get_id() != id)),
        )
        .await;
        match r {
            Ok(Ok(a)) => a.clone(),
            _ => None,
        }
    }
}

/// Why a call to a supervised actor got no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ActorCallError {
    /// No incarnation ran, or none started again, within the wait.
    #[error("the {0} actor is not running")]
    Down(&'static str),
    /// The actor took longer than the call's timeout.
    #[error("the {0} actor did not answer in time")]
    Timeout(&'static str),
}

/// Calls the actor in `slot`; when the incarnation dies before answering, waits up to
/// `restart_wait` for its supervisor to start the next one and asks that one once more.
/// `make` builds the message around the reply port (it is called once per attempt).
///
/// Cancel safety: cancel-safe (an abandoned call's answer is dropped).
pub async fn call<M, R>(
    slot: &ActorSlot<M>,
    what: &'static str,
    restart_wait: Duration,
    timeout: Duration,
    make: impl Fn(ractor::RpcReplyPort<R>) -> M,
) -> Result<R, ActorCallError>
where
    M: Message,
    R: Send + 'static,
{
    let mut actor = match slot.get() {
        Some(a) => a,
        None => slot
            .wait(restart_wait)
            .await
            .ok_or(ActorCallError::Down(what))?,
    };
    for attempt in 0..2 {
        match actor.call(&make, Some(timeout)).await {
            Ok(ractor::rpc::CallResult::Success(r)) => return Ok(r),
            Ok(ractor::rpc::CallResult::Timeout) => return Err(ActorCallError::Timeout(what)),
            // The incarnation died with the message in its mailbox or before replying.
            Ok(ractor::rpc::CallResult::SenderError) | Err(_) if attempt == 0 => {
                actor = slot
                    .wait_replaced(&actor, restart_wait)
                    .await
                    .ok_or(ActorCallError::Down(what))?;
            }
            _ => break,
        }
    }
    Err(ActorCallError::Down(what))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> RestartPolicy {
        RestartPolicy {
            max_restarts: 3,
            window: Duration::from_secs(10),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_millis(350),
        }
    }

    #[test]
    fn back_off_doubles_within_the_window_up_to_its_cap() {
        let (p, t0) = (policy(), Instant::now());
        let mut log = RestartLog::default();
        let afters: Vec<Duration> = (0..3)
            .map(|i| match log.decide(&p, t0 + Duration::from_secs(i)) {
                Decision::Restart { after, .. } => after,
                d => panic!("{d:?}"),
            })
            .collect();
        assert_eq!(
            afters,
            [100, 200, 350].map(Duration::from_millis).to_vec(),
            "100 ms, doubled, then capped at 350 ms"
        );
    }

    #[test]
    fn one_failure_past_the_intensity_escalates() {
        let (p, t0) = (policy(), Instant::now());
        let mut log = RestartLog::default();
        for i in 0..3 {
            assert!(matches!(
                log.decide(&p, t0 + Duration::from_millis(i)),
                Decision::Restart { .. }
            ));
        }
        assert_eq!(
            log.decide(&p, t0 + Duration::from_millis(5)),
            Decision::Escalate { restarts: 3 }
        );
    }

    #[test]
    fn restarts_older_than_the_window_are_forgotten() {
        let (p, t0) = (policy(), Instant::now());
        let mut log = RestartLog::default();
        for i in 0..3 {
            log.decide(&p, t0 + Duration::from_millis(i));
        }
        // Eleven seconds later the three restarts are out of the window: a fresh start.
        assert_eq!(
            log.decide(&p, t0 + Duration::from_secs(11)),
            Decision::Restart {
                after: Duration::from_millis(100),
                attempt: 1
            }
        );
        assert_eq!(log.recent(), 1);
    }
}
