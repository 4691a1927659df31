//! The tier actor: an [`Engine`] behind a ractor mailbox.
//!
//! The actor is the unit the node supervisor restarts: if the engine thread
//! dies, the next message makes the actor fail, the supervisor sees
//! `ActorFailed` and starts a fresh one from the same config. Requests that
//! were running on the dead engine receive an error event and are retried by
//! the gateway.

use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::{Engine, EngineConfig, EngineStats, GenerateRequest, ModelInfo, TierError, TokenEvent};

/// Messages of [`TierActor`].
#[derive(Debug)]
pub enum TierMsg {
    /// Start a generation; the reply carries the token stream.
    Generate {
        /// The request.
        req: GenerateRequest,
        /// Where the stream (or the refusal) goes.
        reply: RpcReplyPort<Result<UnboundedReceiver<TokenEvent>, TierError>>,
    },
    /// Report model facts and live counters.
    Describe(RpcReplyPort<TierDescription>),
    /// Tokenize text (special tokens parsed, BOS added when the model wants it).
    Tokenize {
        /// Text.
        text: String,
        /// Token ids.
        reply: RpcReplyPort<Vec<i32>>,
    },
}

/// What a tier actor reports about itself.
#[derive(Debug, Clone)]
pub struct TierDescription {
    /// Model facts.
    pub info: ModelInfo,
    /// Live counters of the engine.
    pub stats: Arc<EngineStats>,
    /// Prefix-page store and counters, when paging is on.
    pub pages: Option<crate::PageHandles>,
}

/// A supervised actor owning one engine.
#[derive(Debug, Default, Clone, Copy)]
pub struct TierActor;

impl Actor for TierActor {
    type Msg = TierMsg;
    type State = Engine;
    type Arguments = EngineConfig;

    async fn pre_start(
        &self,
        _myself: ActorRef<TierMsg>,
        cfg: EngineConfig,
    ) -> Result<Engine, ActorProcessingErr> {
        let engine = tokio::task::spawn_blocking(move || Engine::start(cfg)).await??;
        Ok(engine)
    }

    async fn handle(
        &self,
        _myself: ActorRef<TierMsg>,
        msg: TierMsg,
        engine: &mut Engine,
    ) -> Result<(), ActorProcessingErr> {
        if !engine.is_running() {
            if let TierMsg::Generate { reply, .. } = msg {
                let _ = reply.send(Err(TierError::EngineStopped));
            }
            return Err(format!("engine {} stopped", engine.info().name).into());
        }
        match msg {
            TierMsg::Generate { req, reply } => {
                let _ = reply.send(engine.submit(req));
            }
            TierMsg::Describe(reply) => {
                let _ = reply.send(TierDescription {
                    info: engine.info().clone(),
                    stats: engine.stats().clone(),
                    pages: engine.pages().cloned(),
                });
            }
            TierMsg::Tokenize { text, reply } => {
                let _ = reply.send(engine.tokenize(&text));
            }
        }
        Ok(())
    }
}
