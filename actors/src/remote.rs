//! Remote actors: one generic way to call a named actor on another node.
//!
//! ```text
//! caller                                                          callee
//!  Cluster::call::<P>(node, P::Call, deadline)
//!   ── bidi stream ──▶ Request::Call(Envelope{actor: P::ACTOR, deadline_ms, trace})
//!                      P::Call frame                            ──▶ Exports[P::ACTOR] ─▶ the actor
//!   ◀──────────────── CallStatus::Accepted | CallStatus::Refused(RemoteError)
//!   ◀──────────────── Answer::Item(P::Item) frames, then Answer::End or Answer::Error
//! ```
//!
//! A [`Protocol`] names an actor and the wire types of its calls and of the items it
//! streams back. The callee registers a [`Handler`] per protocol in its [`Exports`]; the
//! handler turns a call into a message to the actor and the actor's answers into items.
//! Errors are values ([`CallStatus::Refused`] before any item, [`Answer::Error`] after,
//! with a closed [`ErrorClass`]); a call past its deadline is answered with `Deadline` and
//! its stream closed. Every call has a stream of its own, so a long generation never holds
//! up a page fetch or a heartbeat. Adding a remote call to an actor is one variant in its
//! protocol's `Call` type and one arm in its handler.

use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use futures::future::BoxFuture;
use mesh_transport::frame::{read_frame, write_frame_as, FrameError};
use tokio::sync::mpsc;
use tracing::warn;

use crate::wire::{
    Answer, CallStatus, EnginesCall, EnginesItem, Envelope, ErrorClass, PageLogCall, PageLogItem,
    PlannerCall, PlannerItem, RemoteError, RouterCall, RouterItem, StoreCall, StoreItem, TierCall,
    TierItem,
};

/// A wire type that travels in its own frame (rkyv, validated on receipt).
pub trait Wire: Sized + Send + Sync + Clone + std::fmt::Debug + 'static {
    /// Reads one frame; `Ok(None)` when the stream ended between frames.
    ///
    /// Cancel safety: not cancel-safe.
    fn read(
        r: &mut quinn::RecvStream,
        max: usize,
    ) -> BoxFuture<'_, Result<Option<Self>, FrameError>>;
    /// Writes one frame of wire version `version` (the connection's).
    fn write<'a>(
        &'a self,
        w: &'a mut quinn::SendStream,
        version: u16,
    ) -> BoxFuture<'a, Result<(), FrameError>>;
}

macro_rules! wire {
    ($($t:ty),* $(,)?) => {$(
        impl Wire for $t {
            fn read(r: &mut quinn::RecvStream, max: usize) -> BoxFuture<'_, Result<Option<Self>, FrameError>> {
                Box::pin(read_frame::<$t, _>(r, max))
            }
            fn write<'a>(&'a self, w: &'a mut quinn::SendStream, version: u16) -> BoxFuture<'a, Result<(), FrameError>> {
                Box::pin(write_frame_as(w, self, version))
            }
        }
    )*};
}

wire!(
    CallStatus,
    TierCall,
    TierItem,
    Answer<TierItem>,
    StoreCall,
    StoreItem,
    Answer<StoreItem>,
    RouterCall,
    RouterItem,
    Answer<RouterItem>,
    EnginesCall,
    EnginesItem,
    Answer<EnginesItem>,
    PlannerCall,
    PlannerItem,
    Answer<PlannerItem>,
    PageLogCall,
    PageLogItem,
    Answer<PageLogItem>,
);

/// An item type with its answer frame.
pub trait Item: Wire {
    /// The answer frame carrying items of this type.
    type Answer: Wire + Into<Answer<Self>> + From<Answer<Self>>;
}

impl Item for TierItem {
    type Answer = Answer<TierItem>;
}
impl Item for StoreItem {
    type Answer = Answer<StoreItem>;
}
impl Item for RouterItem {
    type Answer = Answer<RouterItem>;
}
impl Item for EnginesItem {
    type Answer = Answer<EnginesItem>;
}
impl Item for PlannerItem {
    type Answer = Answer<PlannerItem>;
}
impl Item for PageLogItem {
    type Answer = Answer<PageLogItem>;
}

/// The wire types of a remote actor.
pub trait Protocol: Send + Sync + 'static {
    /// The actor's name in envelopes and adverts (`tier`, `kv-store`, `router`).
    const ACTOR: &'static str;
    /// Largest item frame a caller accepts.
    const MAX_ITEM: usize = mesh_transport::DEFAULT_MAX_FRAME;
    /// Largest call frame a callee accepts (at least the cluster's frame limit).
    const MAX_CALL: usize = mesh_transport::DEFAULT_MAX_FRAME;
    /// A call.
    type Call: Wire;
    /// One streamed answer.
    type Item: Item;
}

/// What a callee does with a call: starts it and returns the stream of its items, or
/// refuses it.
pub type Started<I> = Result<mpsc::UnboundedReceiver<Result<I, RemoteError>>, RemoteError>;

/// Context of a call on the callee.
#[derive(Debug, Clone)]
pub struct CallContext {
    /// The calling node.
    pub peer: String,
    /// The envelope.
    pub envelope: Envelope,
    /// The wire version of the connection the call came on (answers are written in it).
    pub wire: u16,
}

/// Serves the calls of one protocol on the callee.
pub trait Handler<P: Protocol>: Send + Sync + 'static {
    /// Starts `call`.
    fn call(&self, call: P::Call, ctx: CallContext) -> BoxFuture<'static, Started<P::Item>>;
}

impl<P, F> Handler<P> for F
where
    P: Protocol,
    F: Fn(P::Call, CallContext) -> BoxFuture<'static, Started<P::Item>> + Send + Sync + 'static,
{
    fn call(&self, call: P::Call, ctx: CallContext) -> BoxFuture<'static, Started<P::Item>> {
        self(call, ctx)
    }
}

/// An exported actor, type-erased: serves one call stream after its envelope.
trait Served: Send + Sync {
    fn serve(
        &self,
        ctx: CallContext,
        send: quinn::SendStream,
        recv: quinn::RecvStream,
        max_frame: usize,
    ) -> BoxFuture<'static, ()>;
}

struct Typed<P: Protocol> {
    handler: Arc<dyn Handler<P>>,
}

fn refused(class: ErrorClass, message: impl Into<String>) -> RemoteError {
    RemoteError {
        class,
        message: message.into(),
    }
}

impl<P: Protocol> Served for Typed<P> {
    fn serve(
        &self,
        ctx: CallContext,
        mut send: quinn::SendStream,
        mut recv: quinn::RecvStream,
        max_frame: usize,
    ) -> BoxFuture<'static, ()> {
        let handler = self.handler.clone();
        Box::pin(async move {
            let call = match P::Call::read(&mut recv, max_frame.max(P::MAX_CALL)).await {
                Ok(Some(c)) => c,
                Ok(None) => return,
                Err(e) => {
                    warn!(peer = %ctx.peer, actor = P::ACTOR, code = e.code(), error = %e, "refused call frame; stream closed");
                    let _ = recv.stop(e.code().into());
                    let _ = send.reset(e.code().into());
                    return;
                }
            };
            let wire = ctx.wire;
            let deadline = (ctx.envelope.deadline_ms > 0).then(|| {
                tokio::time::Instant::now() + Duration::from_millis(ctx.envelope.deadline_ms)
            });
            let mut rx = match handler.call(call, ctx).await {
                Ok(rx) => rx,
                Err(e) => {
                    let _ = CallStatus::Refused(e).write(&mut send, wire).await;
                    let _ = send.finish();
                    return;
                }
            };
            if CallStatus::Accepted.write(&mut send, wire).await.is_err() {
                return;
            }
            loop {
                let next = match deadline {
                    Some(d) => match tokio::time::timeout_at(d, rx.recv()).await {
                        Ok(n) => n,
                        Err(_) => Some(Err(refused(ErrorClass::Deadline, "deadline passed"))),
                    },
                    None => rx.recv().await,
                };
                let (frame, last) = match next {
                    None => (Answer::End, true),
                    Some(Ok(item)) => (Answer::Item(item), false),
                    Some(Err(e)) => (Answer::Error(e), true),
                };
                let frame: <P::Item as Item>::Answer = frame.into();
                // A failed write means the caller went away: dropping `rx` cancels the work.
                if frame.write(&mut send, wire).await.is_err() || last {
                    break;
                }
            }
            let _ = send.finish();
        })
    }
}

/// The actors this node serves to peers, by name.
#[derive(Clone, Default)]
pub struct Exports {
    by_name: Arc<DashMap<&'static str, Arc<dyn Served>>>,
}

impl std::fmt::Debug for Exports {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.names()).finish()
    }
}

impl Exports {
    /// Serves protocol `P` with `handler` (replacing an earlier one).
    pub fn export<P: Protocol>(&self, handler: impl Handler<P>) {
        self.by_name.insert(
            P::ACTOR,
            Arc::new(Typed::<P> {
                handler: Arc::new(handler),
            }),
        );
    }

    /// Names of the exported actors (adverts carry them).
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.by_name.iter().map(|e| (*e.key()).to_owned()).collect();
        v.sort();
        v
    }

    /// Serves one call stream whose envelope was read.
    pub(crate) async fn serve(
        &self,
        ctx: CallContext,
        mut send: quinn::SendStream,
        recv: quinn::RecvStream,
        max_frame: usize,
    ) {
        let served = self
            .by_name
            .get(ctx.envelope.actor.as_str())
            .map(|e| e.value().clone());
        match served {
            Some(s) => s.serve(ctx, send, recv, max_frame).await,
            None => {
                let e = refused(
                    ErrorClass::NotFound,
                    format!("no actor `{}` on this node", ctx.envelope.actor),
                );
                let _ = CallStatus::Refused(e).write(&mut send, ctx.wire).await;
                let _ = send.finish();
            }
        }
    }
}
