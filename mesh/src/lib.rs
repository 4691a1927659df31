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
pub mod config;
pub mod env;
#[cfg(feature = "node")]
pub mod gateway;
#[cfg(feature = "node")]
pub mod metrics;
#[cfg(feature = "node")]
pub mod node;
#[cfg(feature = "node")]
pub mod openai;
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
        server: tokio::task::JoinHandle<std::io::Result<()>>,
        supervisor: ractor::ActorRef<crate::node::SupervisorMsg>,
    }

    impl Running {
        /// Waits for the gateway to stop (after the shutdown signal), then stops the tiers.
        pub async fn wait(self) -> anyhow::Result<()> {
            let r = self.server.await;
            self.supervisor.stop(None);
            r??;
            Ok(())
        }
    }

    /// Loads the tiers and binds the gateway; serves until `shutdown` completes.
    pub async fn start(
        cfg: NodeConfig,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<Running> {
        cfg.validate()?;
        let (supervisor, registry) = crate::node::start(cfg.tiers.clone()).await?;
        let settings = GatewaySettings {
            max_concurrent: cfg.max_concurrent,
            retry_after_s: cfg.retry_after_s,
            default_max_tokens: cfg.default_max_tokens,
            expected_tiers: cfg.tiers.iter().map(|t| t.name.clone()).collect(),
        };
        let app = gateway::router(AppState::new(registry, settings));
        let listener = tokio::net::TcpListener::bind(cfg.listen)
            .await
            .map_err(|e| anyhow::anyhow!("binding {}: {e}", cfg.listen))?;
        let addr = listener.local_addr()?;
        let server = tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await
        });
        Ok(Running {
            addr,
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
