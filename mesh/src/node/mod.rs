//! The node: assembly of its actors, service layer and HTTP layer, its supervision tree, its
//! placement on the host, and what it serves to peers.
//!
//! ```text
//! start(cfg)
//!  ├─ policy state (tuner.state_file) ─▶ LivePolicy
//!  ├─ placement, far memory ─▶ tier configs
//!  ├─ NodeSupervisor ──▶ kv-store ─▶ engines ─▶ router ─▶ embeddings ─▶ governor    (started in order)
//!  ├─ cluster (mesh join): QUIC endpoint, exported actors (tier, kv-store, router), peers
//!  │    └─ NodeSupervisor ──▶ membership
//!  ├─ service layer ─▶ NodeSupervisor ──▶ tuner
//!  ├─ the quantization policy's engines
//!  └─ HTTP: axum over the service layer; SIGHUP reloads the policy file (tracked tasks)
//! ```
//!
//! What a node runs is its roles (`[roles]`, `mesh join --roles`): `tiers` hosts engines
//! and the tool router, `gateway` serves clients and routes to whichever node hosts a
//! tier (a gateway without tiers routes tools through a peer's router), `store` keeps the
//! pages peers demote to it, `prefill` and `decode` split `tiers` in two: a decode node
//! hands long prompts to a prefill node and decodes from the pages it pulls from it
//! (`service::dispatch`). Every node has a page-store actor.

pub mod exports;
pub mod farmem;
pub mod placement;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use mesh_actors::embeddings::{EmbeddingsActor, EmbeddingsArgs, EmbeddingsMsg};
use mesh_actors::engines::{Engines, EnginesActor, EnginesArgs, EnginesMsg};
use mesh_actors::governor::{GovernorActor, GovernorMsg, GovernorStats};
use mesh_actors::node::{ChildSpec, NodeMsg, NodeSupervisor};
use mesh_actors::pagestore::{PageStoreActor, PageStores, StoreMsg};
use mesh_actors::planner::{PlannerActor, PlannerArgs, PlannerMsg, PlannerView};
use mesh_actors::router::{RouterActor, RouterArgs, RouterMsg};
use mesh_actors::supervisor::ActorSlot;
use mesh_actors::tasks::{Life, Tasks};
use mesh_actors::tuner::{
    self, LivePolicy, Snapshot, TunerActor, TunerArgs, TunerMsg, TunerOptions,
};
use mesh_kvstore::StoreConfig;
use mesh_tiers::PageStoreRef;
use ractor::{Actor, ActorRef};

use crate::config::{NodeConfig, Role};
use crate::http::{self, FaultInjector, Faults, HttpState};
use crate::metrics::{Metrics, NodeParts};
use crate::service::{self, Actors, Service};

/// A node whose actors run and whose gateway is listening.
#[derive(Debug)]
pub struct Running {
    /// Address the gateway is bound to.
    pub addr: SocketAddr,
    /// The cluster, when the node joined one.
    pub cluster: Option<mesh_actors::Cluster>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
    supervisor: ActorRef<NodeMsg>,
    supervised: tokio::task::JoinHandle<()>,
    tasks: Tasks,
}

impl Running {
    /// Waits for the gateway to stop (after the shutdown signal) or the supervision tree to
    /// give up (a child failing past its restart intensity: an error), leaves the cluster
    /// gracefully, then stops the actors.
    pub async fn wait(self) -> anyhow::Result<()> {
        let Running {
            cluster,
            mut server,
            supervisor,
            mut supervised,
            tasks,
            ..
        } = self;
        let outcome = tokio::select! {
            r = &mut server => r.map_err(anyhow::Error::from).and_then(|r| r.map_err(anyhow::Error::from)),
            _ = &mut supervised => Err(anyhow::anyhow!(
                "the node's supervision tree stopped (an actor kept failing past its restart intensity; see the log)"
            )),
        };
        if let Some(c) = &cluster {
            c.leave().await;
        }
        tasks.close();
        server.abort();
        supervisor.stop(None);
        let _ = tokio::time::timeout(Duration::from_secs(5), supervised).await;
        outcome
    }
}

/// The start-up policy from the config's sections.
fn start_policy(cfg: &NodeConfig) -> mesh_control::policy::Policy {
    mesh_control::policy::Policy {
        cascade: cfg.cascade.clone(),
        reasoning: cfg.reasoning.clone(),
        router_top_k: cfg.tool_routing.router.top_k,
        ..mesh_control::policy::Policy::default()
    }
}

/// Crashes the node's actors on request (`POST /v1/debug/crash`).
struct Injector {
    membership: Option<Arc<ActorSlot<mesh_actors::cluster::MembershipMsg>>>,
    store: Arc<ActorSlot<StoreMsg>>,
    router: Option<Arc<ActorSlot<RouterMsg>>>,
    embeddings: Option<Arc<ActorSlot<EmbeddingsMsg>>>,
    governor: Arc<ActorSlot<GovernorMsg>>,
    tuner: Arc<ActorSlot<TunerMsg>>,
    planner: Option<Arc<ActorSlot<PlannerMsg>>>,
    engines: Engines,
}

impl FaultInjector for Injector {
    fn targets(&self) -> Vec<String> {
        let mut t: Vec<String> = ["kv-store", "governor", "tuner"]
            .into_iter()
            .map(str::to_owned)
            .collect();
        if self.router.is_some() {
            t.push("router".into());
        }
        if self.embeddings.is_some() {
            t.push("embeddings".into());
        }
        if self.membership.is_some() {
            t.push("membership".into());
        }
        if self.planner.is_some() {
            t.push("planner".into());
        }
        t.extend(self.engines.configured().map(|n| format!("tier:{n}")));
        t
    }

    fn inject(&self, target: &str) -> BoxFuture<'static, Result<(), String>> {
        fn crash<M: ractor::Message>(slot: &ActorSlot<M>, msg: M) -> Result<(), String> {
            let a = slot.get().ok_or("that actor is not running now")?;
            a.send_message(msg).map_err(|e| e.to_string())
        }
        let r = match target {
            "kv-store" => crash(&self.store, StoreMsg::Crash),
            "governor" => crash(&self.governor, GovernorMsg::Crash),
            "tuner" => crash(&self.tuner, TunerMsg::Crash),
            "membership" => match &self.membership {
                Some(s) => crash(s, mesh_actors::cluster::MembershipMsg::Crash),
                None => Err("this node is not in a cluster".into()),
            },
            "planner" => match &self.planner {
                Some(s) => crash(s, PlannerMsg::Crash),
                None => Err("this node is not in a cluster".into()),
            },
            "router" => match &self.router {
                Some(s) => crash(s, RouterMsg::Crash),
                None => Err("tool routing is off on this node".into()),
            },
            "embeddings" => match &self.embeddings {
                Some(s) => crash(s, EmbeddingsMsg::Crash),
                None => Err("this node serves no embedding model".into()),
            },
            t => match t.strip_prefix("tier:") {
                Some(tier) => {
                    let (engines, tier) = (self.engines.clone(), tier.to_owned());
                    return Box::pin(async move {
                        let a = engines
                            .actor()
                            .get()
                            .ok_or("the engines actor is not running")?;
                        let hit = ractor::call!(a, |reply| EnginesMsg::CrashTier { tier, reply })
                            .map_err(|e| e.to_string())?;
                        hit.then_some(())
                            .ok_or_else(|| "that tier is not running here".into())
                    });
                }
                None => Err(format!(
                    "unknown actor `{t}`; one of {}",
                    self.targets().join(", ")
                )),
            },
        };
        Box::pin(async move { r })
    }
}

/// Starts the node's actors, joins the cluster when configured, and binds the gateway;
/// serves until `shutdown` completes.
pub async fn start(
    cfg: NodeConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<Running> {
    // The body is not generic, so it and the serving loop it spawns (hyper's and axum's) are
    // compiled once, here, not again in every binary and test that starts a node.
    start_node(cfg, Box::pin(shutdown)).await
}

async fn start_node(
    mut cfg: NodeConfig,
    shutdown: BoxFuture<'static, ()>,
) -> anyhow::Result<Running> {
    cfg.resolve_drafts()?;
    cfg.resolve_embedding_models()?;
    cfg.validate()?;
    let keys = load_keys(&cfg)?;
    let state = tuner::open_state(cfg.tuner.state_file.as_deref(), start_policy(&cfg))
        .map_err(anyhow::Error::msg)?;
    let live = Arc::new(LivePolicy::new(Snapshot::of(&state)));
    let runtime = tokio::runtime::Handle::current();

    // Placement and far memory shape the tier configs; each tier keeps its pages in the
    // page-store actor under its own name.
    let mut tiers = if cfg.hosts_tiers() {
        cfg.tiers.clone()
    } else {
        vec![]
    };
    let placement = placement::apply(&cfg.placement, &mut tiers);
    placement::apply_gpus(&mut tiers);
    farmem::apply(&mesh_control::topology::Topology::detect(), &mut tiers);
    // Namespaces peers create here (pages demoted to a store node) get the store settings.
    let pages = PageStores::new(StoreConfig {
        ram_bytes: cfg.store.ram_bytes,
        disk_dir: cfg.store.dir.clone(),
        disk_bytes: if cfg.store.dir.is_some() {
            cfg.store.disk_bytes
        } else {
            0
        },
        far: None,
        far_bytes: 0,
    });
    let opener = pages.opener(runtime.clone());
    for t in &mut tiers {
        t.page_store = Some(PageStoreRef {
            opener: opener.clone(),
            namespace: t.name.clone(),
        });
    }
    let engines = Engines::new(&tiers).with_standby(cfg.scaling.standby.iter().map(String::as_str));
    let metrics = Arc::new(Metrics::new());
    metrics.watch_engines(engines.clone());
    let tasks = Tasks::default();

    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|e| anyhow::anyhow!("binding {}: {e}", cfg.listen))?;
    let addr = listener.local_addr()?;

    // The actors, under the node supervisor, started in order: pages before the engines
    // that open them.
    let governor_stats = Arc::new(GovernorStats::default());
    let governor: Arc<ActorSlot<GovernorMsg>> = Arc::default();
    let tuner_slot: Arc<ActorSlot<TunerMsg>> = Arc::default();
    // The router runs where tiers run; a gateway without tiers routes through a peer's.
    let router = (cfg.tool_routing.route_above > 0 && cfg.hosts_tiers())
        .then(Arc::<ActorSlot<RouterMsg>>::default);
    let mut children = vec![
        ChildSpec::new(
            "kv-store",
            PageStoreActor,
            pages.clone(),
            pages.slot().clone(),
        ),
        ChildSpec::new(
            "engines",
            EnginesActor,
            EnginesArgs {
                engines: engines.clone(),
                policy: Default::default(),
            },
            engines.actor().clone(),
        ),
    ];
    if let Some(slot) = &router {
        children.push(ChildSpec::new(
            "router",
            RouterActor,
            RouterArgs {
                embedder: cfg.tool_routing.embedder.clone(),
                router: cfg.tool_routing.router.clone(),
                slot: slot.clone(),
            },
            slot.clone(),
        ));
    }
    let embeddings = (!cfg.embeddings.is_empty()).then(|| {
        let slot = Arc::<ActorSlot<EmbeddingsMsg>>::default();
        children.push(ChildSpec::new(
            "embeddings",
            EmbeddingsActor,
            EmbeddingsArgs {
                models: cfg
                    .embeddings
                    .iter()
                    .map(|e| (e.name.clone(), e.embedder()))
                    .collect(),
                slot: slot.clone(),
            },
            slot.clone(),
        ));
        let names = cfg.embeddings.iter().map(|e| e.name.clone()).collect();
        (slot, names)
    });
    children.push(ChildSpec::new(
        "governor",
        GovernorActor,
        governor_stats.clone(),
        governor.clone(),
    ));

    // The cluster: peers reach this node's tiers and pages through its NodeService.
    let cluster = match &cfg.cluster {
        None => None,
        Some(cs) => {
            // Rolling-upgrade tests: speak only the older wire version, as the previous build.
            if let Ok(v) = std::env::var("MESH_WIRE_VERSION") {
                let parsed = v.parse::<u16>().ok();
                parsed
                    .and_then(|v| mesh_transport::frame::limit_wire_version(v).ok())
                    .ok_or_else(|| {
                        anyhow::anyhow!(
                            "MESH_WIRE_VERSION={v}: this build speaks wire versions {} to {}",
                            mesh_transport::frame::OLDEST_WIRE_VERSION,
                            mesh_transport::WIRE_VERSION
                        )
                    })?;
            }
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
            Some((identity, cs.clone()))
        }
    };

    let mut agent_settings = cfg.agent.clone();
    if agent_settings.draft_model.is_none() {
        // The cascade's first tier, when this node hosts it.
        agent_settings.draft_model = cfg
            .cascade
            .tiers
            .first()
            .filter(|t| engines.hosts(t))
            .cloned();
    }
    let hub = mesh_control::mcp::McpHub::connect(&cfg.mcp.servers).await;
    let catalog = service::agent::load_catalog_files(&agent_settings.catalog_files)
        .map_err(anyhow::Error::msg)?;
    let agent = Arc::new(service::agent::Agent::new(hub, agent_settings).with_catalog(catalog));

    // The supervision tree comes up before the cluster: peers may call at once.
    let mut specs_for_metrics = children.clone();
    let (supervisor, supervised) = Actor::spawn(None, NodeSupervisor, children)
        .await
        .map_err(|e| anyhow::anyhow!("starting the node's actors: {e}"))?;
    // Prefill/decode split: one hand-off count for the gateway's and the peers' dispatchers.
    let split = service::dispatch::Split {
        handoff: cfg
            .cluster
            .as_ref()
            .filter(|_| cfg.has_role(Role::Decode))
            .map(|c| c.handoff()),
        prefill_only: cfg.has_role(Role::Prefill),
        counts: Arc::default(),
    };
    let dispatcher_for_peers: Arc<std::sync::OnceLock<service::dispatch::Dispatcher>> =
        Arc::default();
    let planner_slot: Arc<ActorSlot<PlannerMsg>> = Arc::default();
    let planner_view: Arc<PlannerView> = Arc::default();
    let cluster = match cluster {
        None => None,
        Some((identity, cs)) => {
            let ccfg = cs.to_cluster_config(addr);
            let endpoint = mesh_transport::Endpoint::bind(&identity, cs.listen, &ccfg.transport)?;
            let exported = mesh_actors::remote::Exports::default();
            exports::export_store(&exported, pages.clone());
            exports::export_page_log(&exported, pages.clone());
            exports::export_planner(&exported, planner_slot.clone());
            if !tiers.is_empty() {
                exports::export_tiers(
                    &exported,
                    engines.clone(),
                    live.clone(),
                    dispatcher_for_peers.clone(),
                );
                exports::export_engines(&exported, engines.clone());
            }
            if let Some(slot) = &router {
                exports::export_router(&exported, slot.clone());
            }
            let roles = cfg.roles.iter().map(|r| r.as_str().to_owned()).collect();
            let c = mesh_actors::Cluster::start(
                endpoint,
                ccfg,
                roles,
                exported,
                exports::advert_source(
                    engines.clone(),
                    pages.clone(),
                    exports::TierNeeds::read(&tiers, cfg.scaling.cores()),
                ),
                tasks.clone(),
            )
            .await
            .map_err(|e| anyhow::anyhow!("joining the cluster: {e}"))?;
            let membership = c.membership_spec();
            specs_for_metrics.push(membership.clone());
            ractor::call!(supervisor, |reply| NodeMsg::Adopt(membership, reply))
                .map_err(|e| anyhow::anyhow!("starting membership: {e}"))?
                .map_err(|e| anyhow::anyhow!("starting membership: {e}"))?;
            let planner = ChildSpec::new(
                "planner",
                PlannerActor,
                PlannerArgs {
                    cluster: c.clone(),
                    engines: engines.clone(),
                    policies: cfg.scaling.tiers.clone(),
                    interval: Duration::from_millis(cfg.scaling.interval_ms),
                    window: Duration::from_secs(cfg.scaling.window_s),
                    view: planner_view.clone(),
                },
                planner_slot.clone(),
            );
            specs_for_metrics.push(planner.clone());
            ractor::call!(supervisor, |reply| NodeMsg::Adopt(planner, reply))
                .map_err(|e| anyhow::anyhow!("starting the planner: {e}"))?
                .map_err(|e| anyhow::anyhow!("starting the planner: {e}"))?;
            let _ = dispatcher_for_peers.set(
                service::dispatch::Dispatcher::new(
                    engines.clone(),
                    pages.clone(),
                    Some(c.clone()),
                    Duration::ZERO,
                )
                .with_split(split.clone()),
            );
            let hook = c.clone();
            engines.on_change(move || hook.advertise_now());
            if !tiers.is_empty() {
                exports::start_demotion(&tasks, &pages, engines.clone(), c.clone());
            }
            tracing::info!(node = %c.name(), quic = %c.quic_addr(), roles = ?cfg.roles, "in the cluster");
            Some(c)
        }
    };
    let service = Service::new(
        service::Settings {
            max_concurrent: cfg.max_concurrent,
            retry_after_s: cfg.retry_after_s,
            default_max_tokens: cfg.default_max_tokens,
            request_timeout: Duration::from_secs(cfg.request_timeout_s),
            restart_wait: Duration::from_secs(cfg.restart_wait_s),
            tool_routing: cfg.tool_routing.clone(),
            split: split.clone(),
        },
        engines.clone(),
        pages.clone(),
        cluster.clone(),
        metrics.clone(),
        live.clone(),
        Actors {
            router: router.clone(),
            governor: governor.clone(),
            tuner: tuner_slot.clone(),
            planner: cluster
                .as_ref()
                .map(|_| (planner_slot.clone(), planner_view.clone())),
            supervisor: Some(supervisor.clone()),
            embeddings: embeddings.clone(),
        },
    )
    .with_agent(agent)
    .with_placement(placement);

    // The tuner drives probes through the service, so it starts last.
    let tuner_spec = ChildSpec::new(
        "tuner",
        TunerActor,
        TunerArgs {
            options: TunerOptions {
                enabled: cfg.tuner.enabled,
                interval_s: cfg.tuner.interval_s,
                state_file: cfg.tuner.state_file.clone(),
                probe_tasks: cfg.tuner.probe_tasks.clone(),
                probe_kinds: cfg.tuner.probe_kinds.clone(),
                probe_n: cfg.tuner.probe_n,
                probe_model: cfg.tuner.probe_model.clone(),
                probe_max_tokens: cfg.tuner.probe_max_tokens,
                config: cfg.tuner.tuner_config(),
            },
            live: live.clone(),
            host: Arc::new(service::tuner::Host::new(service.clone())),
            engines: engines.clone(),
            memory: Arc::default(),
            slot: tuner_slot.clone(),
        },
        tuner_slot.clone(),
    );
    specs_for_metrics.push(tuner_spec.clone());
    ractor::call!(supervisor, |reply| NodeMsg::Adopt(tuner_spec, reply))
        .map_err(|e| anyhow::anyhow!("starting the tuner: {e}"))?
        .map_err(|e| anyhow::anyhow!("starting the tuner: {e}"))?;
    metrics.watch_node(NodeParts {
        actors: specs_for_metrics,
        governor: governor_stats,
        tasks: tasks.clone(),
        planner: cluster
            .as_ref()
            .map(|c| (c.name().to_owned(), planner_view.clone())),
    });

    // The engines the policy file's quantization names start before the gateway serves.
    let from = cfg
        .tuner
        .state_file
        .as_ref()
        .map_or("the policy".to_owned(), |f| f.display().to_string());
    let wanted = engines
        .resolve(&live.load().policy.quantization)
        .map_err(|(e, _)| anyhow::anyhow!("{from}: {e}"))?;
    engines
        .start(&wanted)
        .await
        .map_err(|e| anyhow::anyhow!("{from}: {e}"))?;

    let faults = cfg.fault_token.clone().map(|token| {
        tracing::warn!("fault injection is on: POST /v1/debug/crash crashes this node's actors");
        Faults {
            token,
            injector: Arc::new(Injector {
                membership: cluster.as_ref().map(|c| c.membership().clone()),
                store: pages.slot().clone(),
                router: router.clone(),
                embeddings: embeddings.as_ref().map(|(slot, _)| slot.clone()),
                governor,
                tuner: tuner_slot.clone(),
                planner: cluster.as_ref().map(|_| planner_slot.clone()),
                engines: engines.clone(),
            }),
        }
    });
    let app = http::router(HttpState {
        service,
        expected_tiers: engines.autostart(),
        faults,
        keys,
        limiter: Arc::new(crate::limits::Limiter::new(cfg.limits.clone())),
    });
    if cfg.tuner.state_file.is_some() {
        spawn_sighup_reload(&tasks, tuner_slot);
    }
    let conn_limits = http::serve::ConnLimits {
        max_connections: cfg.limits.max_connections,
        header_read_timeout: Duration::from_secs(cfg.limits.header_read_timeout_s),
    };
    let server = tokio::spawn(http::serve::serve(
        listener,
        app,
        conn_limits,
        metrics.clone(),
        shutdown,
    ));
    Ok(Running {
        addr,
        cluster,
        server,
        supervisor,
        supervised,
        tasks,
    })
}

/// The node's API keys; `Err` when the file is unreadable or empty, or when the gateway
/// would serve a non-loopback address without keys and `insecure_no_auth` is not set.
fn load_keys(cfg: &NodeConfig) -> anyhow::Result<Option<Arc<crate::keys::Keys>>> {
    let keys = match &cfg.auth.keys_file {
        Some(path) => {
            let keys = crate::keys::Keys::load(path).map_err(anyhow::Error::msg)?;
            anyhow::ensure!(
                !keys.is_empty(),
                "{} holds no keys: make one with `mesh keys create --file {} --scope inference`",
                path.display(),
                path.display()
            );
            tracing::info!(keys = keys.len(), file = %path.display(), "API keys required on /v1");
            Some(Arc::new(keys))
        }
        None => None,
    };
    if crate::keys::refuse_open_listen(cfg.listen.ip(), keys.is_some(), cfg.auth.insecure_no_auth) {
        anyhow::bail!(
            "refusing to serve {} without API keys: anyone who reaches it could change the policy and run tools. \
             Make a key (`mesh keys create --scope inference`) and start with `--keys {}`, \
             listen on 127.0.0.1, or pass --insecure-no-auth",
            cfg.listen,
            crate::keys::default_keys_file().display()
        );
    }
    if keys.is_none() && !cfg.listen.ip().is_loopback() {
        tracing::warn!(listen = %cfg.listen, "serving without API keys (--insecure-no-auth)");
    }
    Ok(keys)
}

/// On SIGHUP the tuner reads its policy state file again and puts the policy in force, as
/// `PUT /v1/control/policy` would.
fn spawn_sighup_reload(tasks: &Tasks, tuner: Arc<ActorSlot<TunerMsg>>) {
    #[cfg(unix)]
    {
        let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "no SIGHUP handler; reload the policy with PUT /v1/control/policy");
                return;
            }
        };
        tracing::info!("SIGHUP reloads the policy state file");
        tasks.spawn("sighup-reload", Life::Long, async move {
            while hup.recv().await.is_some() {
                let r = mesh_actors::supervisor::call(
                    &tuner,
                    "tuner",
                    Duration::from_secs(1),
                    Duration::from_secs(600),
                    TunerMsg::ReloadFile,
                )
                .await;
                match r {
                    Ok(Ok(v)) => tracing::info!(version = v, "SIGHUP: policy state file read; version in force"),
                    Ok(Err(e)) => tracing::warn!(error = %e, "SIGHUP: policy not reloaded; the one in force stays"),
                    Err(e) => tracing::warn!(error = %e, "SIGHUP: the tuner did not answer; the policy in force stays"),
                }
            }
        });
    }
    #[cfg(not(unix))]
    {
        let _ = (tasks, tuner);
    }
}

/// [`start`], then wait.
pub async fn serve(
    cfg: NodeConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    start(cfg, shutdown).await?.wait().await
}
