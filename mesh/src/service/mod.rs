//! The service layer: what the node does for a request, with typed values in and out and
//! no HTTP in sight. The HTTP layer (`crate::http`) translates OpenAI's JSON to these calls;
//! the agent loop and the tuner's probes call them directly.
//!
//! ```text
//! http ──ChatCall──▶ Service::chat ─▶ router actor (tools) ─▶ governor actor (thinking budget)
//!                                  ─▶ dispatch: node by load and prefix pages ─▶ tier actor (local or peer)
//!                                       └─ the engine restores prefix pages from the page-store actor
//!      ◀──Reply (token events, MeshInfo)──┘
//! ```
//!
//! - [`chat`]: chat and raw completions: tool routing, prompt rendering, grammar,
//!   tokenization, the context check, the governor's budget, the engine for the request's
//!   role (quantization policy).
//! - [`cascade`]: the tier cascade (`model: "cascade"`).
//! - [`dispatch`]: which node runs a request; failover; prefix pages pulled from peers.
//! - [`embeddings`]: `/v1/embeddings`, through the embeddings actor.
//! - [`agent`]: the server-side agent loop over the node's MCP tools.
//! - [`policy`]: the live policy every request reads.
//! - [`tuner`]: what the tuner actor needs of the node (probe requests, typed counters).
//! - [`control`]: the node's control calls: a tuning cycle, the policy, tier scaling, the
//!   supervisor's actors and the page stores' counters.

pub mod agent;
pub mod cascade;
pub mod chat;
pub mod control;
pub mod dispatch;
pub mod embeddings;
mod error;
pub mod policy;
mod stream;
pub mod tuner;
pub mod types;

use std::sync::Arc;
use std::time::Duration;

use mesh_actors::embeddings::EmbeddingsMsg;
use mesh_actors::engines::Engines;
use mesh_actors::governor::GovernorMsg;
use mesh_actors::node::NodeMsg;
use mesh_actors::pagestore::PageStores;
use mesh_actors::planner::{PlannerMsg, PlannerView};
use mesh_actors::router::RouterMsg;
use mesh_actors::supervisor::ActorSlot;
use mesh_actors::tuner::TunerMsg;
use mesh_actors::Cluster;
use mesh_control::placement::PlacementPlan;
use mesh_tiers::cascade::CascadePolicy;
use ractor::ActorRef;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

pub use error::{Error, Kind};
pub use types::*;

use crate::config::ToolRouting;
use crate::metrics::Metrics;

/// Settings of the service layer.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Requests in flight before 429.
    pub max_concurrent: usize,
    /// Seconds in `Retry-After`.
    pub retry_after_s: u64,
    /// Completion budget when a request sets none.
    pub default_max_tokens: usize,
    /// Longest a request may run, restarts and failovers included.
    pub request_timeout: Duration,
    /// Longest a request waits for this node's restarting engine.
    pub restart_wait: Duration,
    /// Tool routing for requests with many tools.
    pub tool_routing: ToolRouting,
    /// This node's part in the prefill/decode split.
    pub split: dispatch::Split,
}

/// The actors the service talks to, through their supervisors' slots (each call reaches
/// the running incarnation), and the node supervisor itself.
#[derive(Debug, Clone, Default)]
pub struct Actors {
    /// The tool router (`None`: routing is off on this node).
    pub router: Option<Arc<ActorSlot<RouterMsg>>>,
    /// The reasoning governor.
    pub governor: Arc<ActorSlot<GovernorMsg>>,
    /// The tuner (tuning cycles, the policy in force and its reloads).
    pub tuner: Arc<ActorSlot<TunerMsg>>,
    /// The planner and its view (cluster nodes).
    pub planner: Option<(Arc<ActorSlot<PlannerMsg>>, Arc<PlannerView>)>,
    /// The node supervisor (its children and their restarts).
    pub supervisor: Option<ActorRef<NodeMsg>>,
    /// The embeddings actor and the names of the models it serves (`None`: the node
    /// serves no embedding model).
    pub embeddings: Option<(Arc<ActorSlot<EmbeddingsMsg>>, Vec<String>)>,
}

/// Held until a response ends: the concurrency permit, a variant engine's lease.
#[derive(Debug, Default)]
pub(crate) struct Hold {
    pub(crate) _permit: Option<OwnedSemaphorePermit>,
    pub(crate) _lease: Option<Arc<()>>,
}

struct Inner {
    settings: Settings,
    dispatcher: Arc<dispatch::Dispatcher>,
    metrics: Arc<Metrics>,
    permits: Arc<Semaphore>,
    policy: Arc<policy::LivePolicy>,
    actors: Actors,
    agent: Option<Arc<agent::Agent>>,
    placement: Option<PlacementPlan>,
}

/// The node's service layer (cheap to clone).
#[derive(Clone)]
pub struct Service {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service").finish_non_exhaustive()
    }
}

impl Service {
    /// The service over a node's engines, page stores, cluster and actors.
    pub fn new(
        settings: Settings,
        engines: Engines,
        pages: PageStores,
        cluster: Option<Cluster>,
        metrics: Arc<Metrics>,
        policy: Arc<policy::LivePolicy>,
        actors: Actors,
    ) -> Self {
        let dispatcher = Arc::new(
            dispatch::Dispatcher::new(engines, pages, cluster, settings.restart_wait)
                .with_split(settings.split.clone()),
        );
        metrics.watch_dispatcher(dispatcher.clone());
        Self {
            inner: Arc::new(Inner {
                permits: Arc::new(Semaphore::new(settings.max_concurrent)),
                settings,
                dispatcher,
                metrics,
                policy,
                actors,
                agent: None,
                placement: None,
            }),
        }
    }

    /// With the agent layer (MCP servers, catalog tools).
    pub fn with_agent(mut self, agent: Arc<agent::Agent>) -> Self {
        self.inner.metrics.watch_tools(agent.runner.clone());
        let inner = Arc::get_mut(&mut self.inner).expect("set before the service is shared");
        inner.agent = Some(agent);
        self
    }

    /// With this node's tier placement (shown by `GET /v1/cluster`).
    pub fn with_placement(mut self, placement: Option<PlacementPlan>) -> Self {
        let inner = Arc::get_mut(&mut self.inner).expect("set before the service is shared");
        inner.placement = placement;
        self
    }

    /// The agent layer, when configured.
    pub fn agent(&self) -> Option<&Arc<agent::Agent>> {
        self.inner.agent.as_ref()
    }

    /// The node's metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.metrics
    }

    /// The node's engines.
    pub fn engines(&self) -> &Engines {
        &self.inner.dispatcher.engines
    }

    /// The node's page stores.
    pub fn pages(&self) -> &PageStores {
        &self.inner.dispatcher.pages
    }

    /// The cluster, when the node is in one.
    pub fn cluster(&self) -> Option<&Cluster> {
        self.inner.dispatcher.cluster.as_ref()
    }

    /// The policy in force now; a request reads it once and keeps it to the end.
    pub fn policy(&self) -> Arc<mesh_control::policy::Policy> {
        self.inner.policy.load().policy.clone()
    }

    /// The live policy cell.
    pub fn live_policy(&self) -> &Arc<policy::LivePolicy> {
        &self.inner.policy
    }

    /// The cascade as requests see it now.
    pub fn cascade_policy(&self) -> CascadePolicy {
        self.policy().cascade.clone()
    }

    /// Every model id this node can route to: its tiers, its peers' tiers.
    pub fn tier_names(&self) -> Vec<String> {
        self.inner.dispatcher.tier_names()
    }

    /// Whether a chat request for `model` could be routed now (404 / 503 as a request
    /// would get them).
    pub fn find_model(&self, model: &str) -> Result<(), Error> {
        self.find_tier(model).map(|_| ())
    }

    fn settings(&self) -> &Settings {
        &self.inner.settings
    }

    fn permit(&self) -> Result<OwnedSemaphorePermit, Error> {
        self.inner.permits.clone().try_acquire_owned().map_err(|_| {
            Error::busy(
                format!(
                    "Too many concurrent requests (limit {}); retry later.",
                    self.settings().max_concurrent
                ),
                self.settings().retry_after_s,
            )
        })
    }
}
