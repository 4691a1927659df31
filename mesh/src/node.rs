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

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use mesh_tiers::actor::{TierActor, TierDescription, TierMsg};
use mesh_tiers::EngineConfig;
use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
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

/// Messages of the node supervisor.
#[derive(Debug)]
pub enum SupervisorMsg {
    /// Start (or restart) one tier.
    StartTier(EngineConfig),
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

impl Actor for NodeSupervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = (Vec<EngineConfig>, Registry);

    async fn pre_start(
        &self,
        myself: ActorRef<SupervisorMsg>,
        (tiers, registry): (Vec<EngineConfig>, Registry),
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
) -> anyhow::Result<(ActorRef<SupervisorMsg>, Registry)> {
    let registry: Registry = Arc::new(DashMap::new());
    let (sup, _) = Actor::spawn(None, NodeSupervisor, (tiers, registry.clone()))
        .await
        .map_err(|e| anyhow::anyhow!("starting tiers: {e}"))?;
    Ok((sup, registry))
}
