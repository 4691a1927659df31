//! The tool router actor: owns the embedding model (and so its worker thread), the
//! embedding cache and the indexes of the tool catalogs it has seen; answers which of a
//! request's tools its prompt should show.
//!
//! ```text
//! service ──Route{tools, intent, k, forced}──▶ RouterActor ──blocking pool──▶ Embedder (worker thread)
//!                                                   │ catalog index cache (by blake3 of the tool set)
//!        ◀── Routed{shown, top1, margin, reranked} ─┘
//! ```
//!
//! The embedding model loads on the first request that needs it (a node whose requests
//! never offer many tools never loads it). Routing runs on the blocking pool so the mailbox
//! keeps moving; the embedder serves one batch at a time. A catalog seen before (an agent's
//! tools, turn after turn) reuses its index; new catalogs are indexed through the
//! embedding cache, so only tool texts never seen are embedded.
//!
//! A restart drops the model, the cache and the indexes; the next request loads them again.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use mesh_control::{Embedder, EmbedderConfig, RouterConfig, Tool, ToolRouter};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use serde::{Deserialize, Serialize};

use crate::supervisor::{self, ActorSlot};

/// Catalog indexes kept (least recently used dropped first).
const KEPT_CATALOGS: usize = 32;

/// What the router kept for a request.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Routed {
    /// Tools the request offered.
    pub offered: usize,
    /// Tools the prompt shows, best first.
    pub shown: Vec<String>,
    /// The same tools in the order the prompt lists them (set by the gateway, which orders
    /// them: [`mesh_control::router::listing_order`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub listed: Vec<String>,
    /// Cosine of the best tool.
    pub top1: f32,
    /// Top-1 minus top-2 cosine.
    pub margin: f32,
    /// The lexical re-rank ran (the embedding was unsure).
    pub reranked: bool,
}

/// One routing question.
#[derive(Debug, Clone)]
pub struct RouteQuery {
    /// The request's tools.
    pub tools: Vec<Tool>,
    /// What the request asks for (the last user message).
    pub intent: String,
    /// Tools to keep.
    pub top_k: usize,
    /// A tool that must stay (the request's `tool_choice`).
    pub forced: Option<String>,
}

/// Messages of [`RouterActor`].
#[derive(Debug)]
pub enum RouterMsg {
    /// Route one request's tools.
    Route {
        /// The question.
        query: RouteQuery,
        /// The tools to show, or why routing failed (the request then shows every tool).
        reply: RpcReplyPort<Result<Routed, String>>,
    },
    /// Fault injection: the actor panics.
    Crash,
}

/// Settings of the router actor.
#[derive(Debug, Clone)]
pub struct RouterArgs {
    /// The embedding model.
    pub embedder: EmbedderConfig,
    /// Scoring and index settings.
    pub router: RouterConfig,
    /// The running incarnation, for callers.
    pub slot: Arc<ActorSlot<RouterMsg>>,
}

/// The tool router (see the module docs).
#[derive(Debug, Default, Clone, Copy)]
pub struct RouterActor;

type Loaded = Arc<OnceLock<Result<Arc<Embedder>, String>>>;

/// State of [`RouterActor`].
pub struct RouterState {
    args: RouterArgs,
    embedder: Loaded,
    catalogs: Arc<std::sync::Mutex<Catalogs>>,
}

impl std::fmt::Debug for RouterState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterState")
            .field("loaded", &self.embedder.get().is_some())
            .finish()
    }
}

/// Indexed catalogs by the blake3 of their tools, least recently used first.
#[derive(Default)]
struct Catalogs {
    by_key: HashMap<[u8; 32], Arc<ToolRouter>>,
    order: VecDeque<[u8; 32]>,
}

impl Catalogs {
    fn get(&mut self, key: &[u8; 32]) -> Option<Arc<ToolRouter>> {
        let r = self.by_key.get(key).cloned()?;
        self.order.retain(|k| k != key);
        self.order.push_back(*key);
        Some(r)
    }

    fn insert(&mut self, key: [u8; 32], r: Arc<ToolRouter>) {
        if self.by_key.insert(key, r).is_none() {
            self.order.push_back(key);
        }
        while self.order.len() > KEPT_CATALOGS {
            if let Some(old) = self.order.pop_front() {
                self.by_key.remove(&old);
            }
        }
    }
}

/// The identity of a tool set (names, descriptions and schemas, in order).
fn catalog_key(tools: &[Tool]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    for t in tools {
        for part in [
            t.name.as_str(),
            t.description.as_str(),
            &t.parameters.to_string(),
        ] {
            h.update(&(part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
    }
    *h.finalize().as_bytes()
}

fn route(
    args: &RouterArgs,
    embedder: &Loaded,
    catalogs: &std::sync::Mutex<Catalogs>,
    q: RouteQuery,
) -> Result<Routed, String> {
    let embedder = embedder
        .get_or_init(|| {
            Embedder::new(args.embedder.clone())
                .map(Arc::new)
                .map_err(|e| format!("embedding model {}: {e}", args.embedder.model.display()))
        })
        .clone()?;
    let key = catalog_key(&q.tools);
    let cached = catalogs.lock().expect("catalogs").get(&key);
    let router = match cached {
        Some(r) => r,
        None => {
            let r = Arc::new(
                ToolRouter::build(&embedder, q.tools.clone(), args.router.clone())
                    .map_err(|e| e.to_string())?,
            );
            catalogs.lock().expect("catalogs").insert(key, r.clone());
            r
        }
    };
    let forced: Vec<&str> = q.forced.iter().map(String::as_str).collect();
    let routing = router
        .route_with(&embedder, &q.intent, q.top_k, &forced)
        .map_err(|e| e.to_string())?;
    Ok(Routed {
        offered: q.tools.len(),
        shown: routing.names().into_iter().map(str::to_owned).collect(),
        top1: routing.confidence.top1,
        margin: routing.confidence.margin,
        reranked: routing.reranked,
        listed: Vec::new(),
    })
}

impl Actor for RouterActor {
    type Msg = RouterMsg;
    type State = RouterState;
    type Arguments = RouterArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<RouterMsg>,
        args: RouterArgs,
    ) -> Result<RouterState, ActorProcessingErr> {
        Ok(RouterState {
            args,
            embedder: Arc::default(),
            catalogs: Arc::default(),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<RouterMsg>,
        msg: RouterMsg,
        state: &mut RouterState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            RouterMsg::Route { query, reply } => {
                let (args, embedder, catalogs) = (
                    state.args.clone(),
                    state.embedder.clone(),
                    state.catalogs.clone(),
                );
                tokio::task::spawn_blocking(move || {
                    let _ = reply.send(route(&args, &embedder, &catalogs, query));
                });
            }
            RouterMsg::Crash => panic!("router: crash injected"),
        }
        Ok(())
    }
}

/// The remote protocol of the tool router: a gateway without a router of its own routes
/// through a peer's.
#[derive(Debug, Clone, Copy)]
pub struct RouterProtocol;

impl crate::remote::Protocol for RouterProtocol {
    const ACTOR: &'static str = "router";
    type Call = crate::wire::RouterCall;
    type Item = crate::wire::RouterItem;
}

/// The wire form of a routing question.
pub fn to_wire(q: &RouteQuery) -> crate::wire::RouterCall {
    crate::wire::RouterCall::Route {
        tools: q
            .tools
            .iter()
            .map(|t| crate::wire::WireTool {
                name: t.name.clone(),
                description: t.description.clone(),
                parameters: t.parameters.to_string(),
            })
            .collect(),
        intent: q.intent.clone(),
        top_k: q.top_k.min(u32::MAX as usize) as u32,
        forced: q.forced.clone(),
    }
}

/// A routing question from the wire.
pub fn from_wire(c: crate::wire::RouterCall) -> RouteQuery {
    let crate::wire::RouterCall::Route {
        tools,
        intent,
        top_k,
        forced,
    } = c;
    RouteQuery {
        tools: tools
            .into_iter()
            .map(|t| Tool {
                name: t.name,
                description: t.description,
                parameters: serde_json::from_str(&t.parameters).unwrap_or(serde_json::Value::Null),
            })
            .collect(),
        intent,
        top_k: top_k as usize,
        forced,
    }
}

/// An answer from the wire.
pub fn routed_from_wire(i: crate::wire::RouterItem) -> Result<Routed, String> {
    match i {
        crate::wire::RouterItem::Routed {
            offered,
            shown,
            top1,
            margin,
            reranked,
        } => Ok(Routed {
            offered: offered as usize,
            shown,
            top1,
            margin,
            reranked,
            listed: Vec::new(),
        }),
        crate::wire::RouterItem::Failed(e) => Err(e),
    }
}

/// The wire form of an answer.
pub fn routed_to_wire(r: Result<Routed, String>) -> crate::wire::RouterItem {
    match r {
        Ok(r) => crate::wire::RouterItem::Routed {
            offered: r.offered as u32,
            shown: r.shown,
            top1: r.top1,
            margin: r.margin,
            reranked: r.reranked,
        },
        Err(e) => crate::wire::RouterItem::Failed(e),
    }
}

/// How long a routing call waits for a restarting router.
pub const RESTART_WAIT: Duration = Duration::from_secs(1);
/// Longest a routing call may take (the first one loads the model).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Routes `query` on the router in `slot`, waiting out one restart.
///
/// Cancel safety: cancel-safe.
pub async fn ask(slot: &ActorSlot<RouterMsg>, query: RouteQuery) -> Result<Routed, String> {
    supervisor::call(slot, "router", RESTART_WAIT, CALL_TIMEOUT, |reply| {
        RouterMsg::Route {
            query: query.clone(),
            reply,
        }
    })
    .await
    .map_err(|e| e.to_string())?
}
