//! Node assembly: the supervisor that owns this node's tier actors, and the
//! registry the gateway reads to find them.
//!
//! ```text
//! NodeSupervisor ──linked──▶ TierActor(t1) ─▶ engine thread
//!                ──linked──▶ TierActor(t2) ─▶ engine thread
//!                ...
//! ```
//! A tier actor that fails (its engine thread died, or it panicked) is
//! removed from the registry and started again from the same config after a
//! short back-off; the gateway retries requests that were on it.
//!
//! Engines the quantization policy adds (another GGUF variant or KV cache type of a
//! tier, [`crate::engines`]) are linked to the same supervisor and kept in [`Variants`],
//! not in the registry, so peers, `/v1/models` and the default request path see one
//! engine per tier. A failed variant is restarted like a tier while the policy still
//! wants it; [`SupervisorMsg::StopVariant`] retires one.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use mesh_tiers::actor::{TierActor, TierDescription, TierMsg};
use mesh_tiers::EngineConfig;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use tracing::{error, info, warn};

/// A running tier as the gateway sees it.
#[derive(Debug, Clone)]
pub struct TierEntry {
    /// The actor.
    pub actor: ActorRef<TierMsg>,
    /// Model facts and counters.
    pub desc: TierDescription,
}

/// Tiers of this node by name.
pub type Registry = Arc<DashMap<String, TierEntry>>;

/// An engine the quantization policy runs besides a tier's default one.
#[derive(Debug, Clone)]
pub struct VariantEntry {
    /// The tier it serves.
    pub tier: String,
    /// Its GGUF file name.
    pub gguf: String,
    /// Its KV cache type.
    pub kv_type: mesh_tiers::KvType,
    /// The actor and its counters.
    pub entry: TierEntry,
    /// Held by every request picked for this engine until its response ends; the engine is
    /// stopped only when nobody else holds it and its queue is empty.
    pub lease: Arc<()>,
}

/// Variant engines by engine id ([`crate::engines::engine_id`]).
pub type Variants = Arc<DashMap<String, VariantEntry>>;

/// Messages of the node supervisor.
#[derive(Debug)]
pub enum SupervisorMsg {
    /// Start (or restart) one tier.
    StartTier(EngineConfig),
    /// Start a variant engine of a tier and put it in [`Variants`] under `id`. With a
    /// reply the outcome is reported and a failure is final; without one (a restart) a
    /// failure is retried with back-off.
    StartVariant {
        /// Engine id.
        id: String,
        /// Its config (the tier's, with another model file or KV cache type).
        cfg: EngineConfig,
        /// Where the outcome goes.
        reply: Option<RpcReplyPort<Result<(), String>>>,
    },
    /// Forget a variant (no more restarts) and stop its actor.
    StopVariant {
        /// Engine id.
        id: String,
        /// Its actor.
        actor: ActorRef<TierMsg>,
    },
}

/// Supervises this node's tier actors.
#[derive(Debug, Default, Clone, Copy)]
pub struct NodeSupervisor;

/// Supervisor state.
#[derive(Debug)]
pub struct SupervisorState {
    registry: Registry,
    configs: HashMap<String, EngineConfig>,
    restarts: HashMap<String, u32>,
    variants: Variants,
    variant_configs: HashMap<String, EngineConfig>,
}

async fn start_tier(
    myself: &ActorRef<SupervisorMsg>,
    cfg: EngineConfig,
    registry: &Registry,
) -> Result<(), ActorProcessingErr> {
    let name = cfg.name.clone();
    let (actor, _) = Actor::spawn_linked(None, TierActor, cfg, myself.get_cell()).await?;
    let desc = ractor::call!(actor, TierMsg::Describe)?;
    info!(tier = %name, params = desc.info.n_params, n_ctx = desc.info.n_ctx, seqs = desc.info.n_seq_max, "tier ready");
    registry.insert(name, TierEntry { actor, desc });
    Ok(())
}

async fn start_variant(
    myself: &ActorRef<SupervisorMsg>,
    id: &str,
    cfg: EngineConfig,
    variants: &Variants,
) -> Result<(), ActorProcessingErr> {
    let tier = cfg.name.clone();
    let gguf = cfg.model.file_name().map_or_else(
        || cfg.model.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let kv_type = cfg.kv_type;
    let (actor, _) = Actor::spawn_linked(None, TierActor, cfg, myself.get_cell()).await?;
    let desc = ractor::call!(actor, TierMsg::Describe)?;
    info!(%tier, engine = %id, "variant engine ready");
    variants.insert(
        id.to_owned(),
        VariantEntry {
            tier,
            gguf,
            kv_type,
            entry: TierEntry { actor, desc },
            lease: Arc::new(()),
        },
    );
    Ok(())
}

impl Actor for NodeSupervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = (Vec<EngineConfig>, Registry, Variants);

    async fn pre_start(
        &self,
        myself: ActorRef<SupervisorMsg>,
        (tiers, registry, variants): (Vec<EngineConfig>, Registry, Variants),
    ) -> Result<SupervisorState, ActorProcessingErr> {
        let mut configs = HashMap::new();
        for cfg in tiers {
            configs.insert(cfg.name.clone(), cfg.clone());
            start_tier(&myself, cfg, &registry).await?;
        }
        Ok(SupervisorState {
            registry,
            configs,
            restarts: HashMap::new(),
            variants,
            variant_configs: HashMap::new(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<SupervisorMsg>,
        msg: SupervisorMsg,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SupervisorMsg::StartTier(cfg) => {
                let name = cfg.name.clone();
                if let Err(e) = start_tier(&myself, cfg.clone(), &state.registry).await {
                    let n = state.restarts.entry(name.clone()).or_default();
                    *n += 1;
                    error!(tier = %name, error = %e, attempt = *n, "tier failed to start; retrying");
                    let delay = Duration::from_millis(500 * u64::from((*n).min(20)));
                    myself.send_after(delay, move || SupervisorMsg::StartTier(cfg));
                }
            }
            SupervisorMsg::StartVariant { id, cfg, reply } => {
                let restart = reply.is_none();
                if restart && !state.variant_configs.contains_key(&id) {
                    return Ok(()); // retired while it was down
                }
                state.variant_configs.insert(id.clone(), cfg.clone());
                let r = start_variant(&myself, &id, cfg.clone(), &state.variants).await;
                match (r, reply) {
                    (Ok(()), Some(reply)) => {
                        let _ = reply.send(Ok(()));
                    }
                    (Ok(()), None) => {}
                    (Err(e), Some(reply)) => {
                        state.variant_configs.remove(&id);
                        let _ = reply.send(Err(e.to_string()));
                    }
                    (Err(e), None) => {
                        let n = state.restarts.entry(id.clone()).or_default();
                        *n += 1;
                        error!(engine = %id, error = %e, attempt = *n, "variant engine failed to start; retrying");
                        let delay = Duration::from_millis(500 * u64::from((*n).min(20)));
                        myself.send_after(delay, move || SupervisorMsg::StartVariant {
                            id,
                            cfg,
                            reply: None,
                        });
                    }
                }
            }
            SupervisorMsg::StopVariant { id, actor } => {
                state.variant_configs.remove(&id);
                state.restarts.remove(&id);
                info!(engine = %id, "variant engine stopped");
                actor.stop(Some("retired by the quantization policy".into()));
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<SupervisorMsg>,
        evt: SupervisionEvent,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, why) = match evt {
            SupervisionEvent::ActorFailed(cell, err) => (cell, err.to_string()),
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                (cell, reason.unwrap_or_else(|| "stopped".into()))
            }
            _ => return Ok(()),
        };
        let Some(name) = state
            .registry
            .iter()
            .find(|e| e.value().actor.get_id() == cell.get_id())
            .map(|e| e.key().clone())
        else {
            // A variant engine that the policy still wants (a retired one is already out
            // of the map) is started again.
            let id = state
                .variants
                .iter()
                .find(|e| e.value().entry.actor.get_id() == cell.get_id())
                .map(|e| e.key().clone());
            if let Some(id) = id {
                state.variants.remove(&id);
                warn!(engine = %id, reason = %why, "variant engine exited; restarting");
                if let Some(cfg) = state.variant_configs.get(&id).cloned() {
                    myself.send_after(Duration::from_millis(200), move || {
                        SupervisorMsg::StartVariant {
                            id,
                            cfg,
                            reply: None,
                        }
                    });
                }
            }
            return Ok(());
        };
        state.registry.remove(&name);
        warn!(tier = %name, reason = %why, "tier actor exited; restarting");
        if let Some(cfg) = state.configs.get(&name).cloned() {
            myself.send_after(Duration::from_millis(200), move || {
                SupervisorMsg::StartTier(cfg)
            });
        }
        Ok(())
    }
}

/// Starts the supervisor and all tiers; returns once every tier is ready.
pub async fn start(
    tiers: Vec<EngineConfig>,
) -> anyhow::Result<(ActorRef<SupervisorMsg>, Registry, Variants)> {
    let registry: Registry = Arc::new(DashMap::new());
    let variants: Variants = Arc::new(DashMap::new());
    let (sup, _) = Actor::spawn(
        None,
        NodeSupervisor,
        (tiers, registry.clone(), variants.clone()),
    )
    .await
    .map_err(|e| anyhow::anyhow!("starting tiers: {e}"))?;
    Ok((sup, registry, variants))
}
