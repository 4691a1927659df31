//! mesh: an actor-based inference mesh for AI agents.
//!
//! This crate is the `mesh` binary's library: node configuration
//! ([`config`]), node assembly with the tier supervisor ([`node`]), the
//! OpenAI-compatible HTTP gateway ([`gateway`]), metrics and tracing. With only
//! the `client` feature it is the Rust client SDK and does not build llama.cpp.
//!
//! Start a node in-process with [`serve`]; the binary does the same behind
//! `mesh up`.

#[cfg(feature = "node")]
pub mod agent;
#[cfg(feature = "client")]
pub mod client;
#[cfg(feature = "node")]
pub mod config;
#[cfg(feature = "node")]
pub mod control_api;
#[cfg(feature = "node")]
pub mod engines;
pub mod env;
#[cfg(feature = "node")]
pub mod farmem;
#[cfg(feature = "node")]
pub mod gateway;
#[cfg(feature = "node")]
pub mod metrics;
#[cfg(feature = "node")]
pub mod node;
#[cfg(feature = "node")]
pub mod openai;
#[cfg(feature = "node")]
pub mod placement;
#[cfg(feature = "node")]
pub mod remote;
#[cfg(feature = "node")]
pub mod telemetry;

#[cfg(feature = "node")]
pub use node_run::*;

#[cfg(feature = "node")]
mod node_run {
    use std::future::Future;
    use std::net::SocketAddr;

    use crate::config::NodeConfig;
    use crate::gateway::{self, AppState, GatewaySettings};

    /// A node whose tiers are loaded and whose gateway is listening.
    #[derive(Debug)]
    pub struct Running {
        /// Address the gateway is bound to.
        pub addr: SocketAddr,
        /// The cluster, when the node joined one.
        pub cluster: Option<mesh_actors::Cluster>,
        server: tokio::task::JoinHandle<std::io::Result<()>>,
        supervisor: ractor::ActorRef<crate::node::SupervisorMsg>,
    }

    impl Running {
        /// Waits for the gateway to stop (after the shutdown signal), leaves the cluster
        /// gracefully, then stops the tiers.
        pub async fn wait(self) -> anyhow::Result<()> {
            let r = self.server.await;
            if let Some(c) = &self.cluster {
                c.leave().await;
            }
            self.supervisor.stop(None);
            r??;
            Ok(())
        }
    }

    /// Loads the tiers and binds the gateway; serves until `shutdown` completes.
    pub async fn start(
        mut cfg: NodeConfig,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<Running> {
        cfg.resolve_drafts();
        cfg.validate()?;
        let start_policy = mesh_control::policy::Policy {
            cascade: cfg.cascade.clone(),
            reasoning: cfg.reasoning.clone(),
            router_top_k: cfg.tool_routing.router.top_k,
            ..mesh_control::policy::Policy::default()
        };
        let tuner = std::sync::Arc::new(crate::control_api::Tuner::open(
            cfg.tuner.clone(),
            start_policy,
        )?);
        let mut tiers = cfg.tiers.clone();
        let placement = crate::placement::apply(&cfg.placement, &mut tiers);
        crate::farmem::apply(&mesh_control::topology::Topology::detect(), &mut tiers);
        let (supervisor, registry, variants) = crate::node::start(tiers.clone()).await?;
        // The engines the policy file's quantization names start before the gateway serves.
        let engines = std::sync::Arc::new(crate::engines::Engines::new(
            &tiers,
            Some(supervisor.clone()),
            variants,
        ));
        let quant = tuner.live.load().policy.quantization.clone();
        let from = cfg
            .tuner
            .state_file
            .as_ref()
            .map_or("the policy".to_owned(), |f| f.display().to_string());
        let wanted = engines
            .resolve(&quant)
            .map_err(|(e, _)| anyhow::anyhow!("{from}: {e}"))?;
        engines
            .start(&wanted)
            .await
            .map_err(|e| anyhow::anyhow!("{from}: {e}"))?;
        let settings = GatewaySettings {
            max_concurrent: cfg.max_concurrent,
            retry_after_s: cfg.retry_after_s,
            default_max_tokens: cfg.default_max_tokens,
            expected_tiers: cfg.tiers.iter().map(|t| t.name.clone()).collect(),
            cascade: cfg.cascade.clone(),
            reasoning: cfg.reasoning.clone(),
            tool_routing: cfg.tool_routing.clone(),
            placement,
        };
        let listener = tokio::net::TcpListener::bind(cfg.listen)
            .await
            .map_err(|e| anyhow::anyhow!("binding {}: {e}", cfg.listen))?;
        let addr = listener.local_addr()?;
        let cluster = match &cfg.cluster {
            None => None,
            Some(cs) => {
                let paths = mesh_transport::IdentityPaths::in_dir(&cs.cert_dir, &cs.name);
                let identity = mesh_transport::Identity::load(&paths).map_err(|e| {
                    anyhow::anyhow!("{e} (create one with `mesh cert issue {}`)", cs.name)
                })?;
                anyhow::ensure!(
                    identity.name == cs.name,
                    "certificate {} is for `{}`, not `{}`",
                    paths.cert.display(),
                    identity.name,
                    cs.name
                );
                let ccfg = cs.to_cluster_config(addr.to_string());
                let endpoint =
                    mesh_transport::Endpoint::bind(&identity, cs.listen, &ccfg.transport)?;
                let service = std::sync::Arc::new(
                    crate::remote::NodeService::new(registry.clone())
                        .with_quantization(engines.clone(), tuner.clone()),
                );
                let c = mesh_actors::Cluster::start(endpoint, ccfg, service)
                    .await
                    .map_err(|e| anyhow::anyhow!("joining the cluster: {e}"))?;
                tracing::info!(node = %c.name(), quic = %c.quic_addr(), "in the cluster");
                Some(c)
            }
        };
        let mut agent_settings = cfg.agent.clone();
        if agent_settings.draft_model.is_none() {
            // The cascade's first tier, when this node hosts it.
            agent_settings.draft_model = cfg
                .cascade
                .tiers
                .first()
                .filter(|t| cfg.tiers.iter().any(|c| &c.name == *t))
                .cloned();
        }
        let hub = mesh_control::mcp::McpHub::connect(&cfg.mcp.servers).await;
        let catalog = crate::agent::load_catalog_files(&agent_settings.catalog_files)
            .map_err(anyhow::Error::msg)?;
        let agent = std::sync::Arc::new(
            crate::agent::Agent::new(hub, agent_settings).with_catalog(catalog),
        );
        let state = AppState::new(registry, cluster.clone(), settings)
            .with_agent(agent)
            .with_tuner(tuner)
            .with_engines(engines);
        let periodic = crate::control_api::spawn_periodic(state.clone());
        let hup = crate::control_api::spawn_sighup_reload(state.clone());
        let app = gateway::router(state);
        let server = tokio::spawn(async move {
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await;
            for t in [periodic, hup].into_iter().flatten() {
                t.abort();
            }
            served
        });
        Ok(Running {
            addr,
            cluster,
            server,
            supervisor,
        })
    }

    /// [`start`], then wait.
    pub async fn serve(
        cfg: NodeConfig,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        start(cfg, shutdown).await?.wait().await
    }
}
