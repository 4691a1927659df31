//! The embeddings actor: owns the embedding models a node serves at `/v1/embeddings`
//! (`[[embeddings]]` in the node config), each with its llama.cpp worker thread.
//!
//! ```text
//! service ──Embed{model, texts}──▶ EmbeddingsActor ──job──▶ Embedder worker (one per model)
//!    ▲                               (tokenizes, queues)          │
//!    └──────────── vectors, straight from the worker ─────────────┘
//! ```
//!
//! The models load in `pre_start`, on the blocking pool, so a node with a bad model fails
//! to start with the model's error. The handler only tokenizes and queues a job: the worker
//! answers the caller's reply port itself, so the mailbox never waits on a model. A restart
//! loads the models again; calls queued in the old incarnation's workers are answered
//! before those workers stop.

use std::collections::BTreeMap;
use std::sync::Arc;

use mesh_control::{ControlError, Embedded, Embedder, EmbedderConfig};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use crate::supervisor::ActorSlot;

/// Why an embedding call failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EmbedFailure {
    /// No served embedding model has that name.
    #[error("embedding model `{model}` is not served here; served: {served:?}")]
    UnknownModel {
        /// The name asked for.
        model: String,
        /// The names served.
        served: Vec<String>,
    },
    /// An input the model cannot take (too long, no tokens).
    #[error("{0}")]
    BadInput(String),
    /// The model failed or its worker stopped.
    #[error("{0}")]
    Failed(String),
}

/// Messages of [`EmbeddingsActor`].
#[derive(Debug)]
pub enum EmbeddingsMsg {
    /// Embed `texts` with `model`.
    Embed {
        /// A served model's name.
        model: String,
        /// The inputs, as given.
        texts: Vec<String>,
        /// One vector per input, or why not.
        reply: RpcReplyPort<Result<Embedded, EmbedFailure>>,
    },
    /// Fault injection: the actor panics.
    Crash,
}

/// The models to serve, by name.
#[derive(Debug, Clone, Default)]
pub struct EmbeddingsArgs {
    /// Name clients send as `model` → the embedder's settings.
    pub models: BTreeMap<String, EmbedderConfig>,
    /// The running incarnation, for callers.
    pub slot: Arc<ActorSlot<EmbeddingsMsg>>,
}

/// The embeddings actor (see the module docs).
#[derive(Debug, Default, Clone, Copy)]
pub struct EmbeddingsActor;

/// State of [`EmbeddingsActor`]: the loaded models.
pub struct EmbeddingsState {
    models: BTreeMap<String, Embedder>,
}

impl std::fmt::Debug for EmbeddingsState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddingsState")
            .field("models", &self.models.keys().collect::<Vec<_>>())
            .finish()
    }
}

fn failure(e: ControlError) -> EmbedFailure {
    match e {
        ControlError::TextTooLong { .. } | ControlError::Embed(_) => {
            EmbedFailure::BadInput(e.to_string())
        }
        e => EmbedFailure::Failed(e.to_string()),
    }
}

impl Actor for EmbeddingsActor {
    type Msg = EmbeddingsMsg;
    type State = EmbeddingsState;
    type Arguments = EmbeddingsArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<EmbeddingsMsg>,
        args: EmbeddingsArgs,
    ) -> Result<EmbeddingsState, ActorProcessingErr> {
        let models = tokio::task::spawn_blocking(move || {
            args.models
                .into_iter()
                .map(|(name, cfg)| {
                    let path = cfg.model.display().to_string();
                    Embedder::new(cfg)
                        .map(|e| (name.clone(), e))
                        .map_err(|e| format!("embedding model {name} ({path}): {e}"))
                })
                .collect::<Result<BTreeMap<_, _>, _>>()
        })
        .await??;
        Ok(EmbeddingsState { models })
    }

    async fn handle(
        &self,
        _myself: ActorRef<EmbeddingsMsg>,
        msg: EmbeddingsMsg,
        state: &mut EmbeddingsState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            EmbeddingsMsg::Embed {
                model,
                texts,
                reply,
            } => {
                let Some(e) = state.models.get(&model) else {
                    let served = state.models.keys().cloned().collect();
                    let _ = reply.send(Err(EmbedFailure::UnknownModel { model, served }));
                    return Ok(());
                };
                e.submit_exact(&texts, move |r| {
                    let _ = reply.send(r.map_err(failure));
                });
            }
            EmbeddingsMsg::Crash => panic!("embeddings: crash injected"),
        }
        Ok(())
    }
}
