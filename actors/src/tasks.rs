//! Tracked tasks: the long-lived tokio tasks of a node that are not actors (accept loops,
//! per-connection stream acceptors). Each has a kind; its exit is logged (a panic as an
//! error, an exit while the set is open as a warning) and counted; dropping the last
//! handle of the set aborts them all.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};

use dashmap::DashMap;
use futures::FutureExt;
use tokio::task::AbortHandle;
use tracing::{debug, error, warn};

/// How a tracked task is expected to live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Life {
    /// Runs as long as the set (an accept loop): its end is worth a warning.
    Long,
    /// Ends on its own (a stream, a connection): its end is logged at debug level.
    Short,
}

#[derive(Default)]
struct Inner {
    handles: Mutex<Vec<AbortHandle>>,
    /// Tasks running, by kind.
    running: DashMap<&'static str, i64>,
    /// Tasks that ended, by kind and outcome (`ok`, `panic`).
    ended: DashMap<(&'static str, &'static str), u64>,
    closed: AtomicBool,
}

/// A set of tracked tasks (cheap to clone; the tasks are aborted when the last clone drops
/// or on [`Tasks::close`]).
#[derive(Clone, Default)]
pub struct Tasks {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Tasks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tasks")
            .field("running", &self.running())
            .finish()
    }
}

impl Tasks {
    /// Spawns `fut` as a task of `kind`.
    pub fn spawn(
        &self,
        kind: &'static str,
        life: Life,
        fut: impl Future<Output = ()> + Send + 'static,
    ) {
        if self.inner.closed.load(Relaxed) {
            return;
        }
        *self.inner.running.entry(kind).or_default() += 1;
        let inner = Arc::downgrade(&self.inner);
        let h = tokio::spawn(async move {
            let r = AssertUnwindSafe(fut).catch_unwind().await;
            let outcome = if r.is_ok() { "ok" } else { "panic" };
            let closed = match inner.upgrade() {
                Some(i) => {
                    *i.running.entry(kind).or_default() -= 1;
                    *i.ended.entry((kind, outcome)).or_default() += 1;
                    i.closed.load(Relaxed)
                }
                None => true,
            };
            match (r, life) {
                (Err(p), _) => {
                    let why = p
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| p.downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    error!(task = kind, panic = %why, "task panicked");
                }
                (Ok(()), Life::Long) if !closed => warn!(task = kind, "long-lived task ended"),
                (Ok(()), _) => debug!(task = kind, "task ended"),
            }
        });
        let mut hs = self
            .inner
            .handles
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        hs.retain(|h| !h.is_finished());
        hs.push(h.abort_handle());
    }

    /// Tasks running, by kind.
    pub fn running(&self) -> Vec<(&'static str, i64)> {
        let mut v: Vec<_> = self
            .inner
            .running
            .iter()
            .map(|e| (*e.key(), *e.value()))
            .collect();
        v.sort();
        v
    }

    /// Tasks ended, by kind and outcome.
    pub fn ended(&self) -> Vec<(&'static str, &'static str, u64)> {
        let mut v: Vec<_> = self
            .inner
            .ended
            .iter()
            .map(|e| (e.key().0, e.key().1, *e.value()))
            .collect();
        v.sort();
        v
    }

    /// Aborts every task; later spawns are refused.
    pub fn close(&self) {
        self.inner.closed.store(true, Relaxed);
        for h in self
            .inner
            .handles
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain(..)
        {
            h.abort();
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        for h in self
            .handles
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .drain(..)
        {
            h.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panicking_task_is_counted_as_such() {
        let t = Tasks::default();
        t.spawn("boom", Life::Long, async { panic!("injected") });
        t.spawn("fine", Life::Short, async {});
        for _ in 0..100 {
            if t.ended().len() == 2 {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(t.ended(), vec![("boom", "panic", 1), ("fine", "ok", 1)]);
        assert_eq!(t.running(), vec![("boom", 0), ("fine", 0)]);
    }

    #[tokio::test]
    async fn closing_the_set_aborts_its_tasks() {
        let t = Tasks::default();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        t.spawn("wait", Life::Long, async move {
            let _tx = tx;
            std::future::pending::<()>().await;
        });
        t.close();
        // The task's end drops the sender.
        assert!(rx.await.is_err());
    }
}
