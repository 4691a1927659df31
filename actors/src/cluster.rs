//! The cluster: one long-lived QUIC connection per peer, heartbeats with adverts and
//! gossip over them, failure detection, and calls to named actors on peers.
//!
//! ```text
//!  accept loop ─▶ adopt(conn) ─┬─▶ uni acceptor  ─▶ Control (heartbeat, leave) ─▶ MembershipActor
//!  dial(seed)  ─▶ adopt(conn) ─┘   bidi acceptor ─▶ Request::Call(envelope) ─▶ Exports ─▶ actor …
//!  MembershipActor, every `heartbeat`: send adverts, sweep (dead ⇒ close its connection), re-dial seeds
//! ```
//!
//! A peer is declared dead when no heartbeat came for `failure_timeout` or its connection
//! closed; its connection is then closed, which fails every call streaming from it at once,
//! so callers can re-run them elsewhere. The accept loop and the per-connection acceptors
//! are tracked tasks ([`crate::tasks`]); heartbeats, sweeps and the membership table's
//! updates belong to the membership actor ([`MembershipActor`]), a child of the node
//! supervisor: while it restarts, incoming heartbeats are applied here directly and the
//! table (kept outside the actor) stays, so a crash of it does not make the node look dead.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dashmap::DashMap;
use futures::future::{BoxFuture, FutureExt, Shared};
use mesh_transport::frame::{self, read_frame, write_frame_as, FrameError};
use mesh_transport::wire_version;
use mesh_transport::{Endpoint, PeerConnection, TransportConfig, DEFAULT_MAX_FRAME};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::membership::{DeathCause, Effect, Input, Membership, PeerState, PAGE_LOG};
use crate::remote::{self, CallContext, Exports, Protocol, Wire};
use crate::routing::Candidate;
use crate::supervisor::ActorSlot;
use crate::tasks::{Life, Tasks};
use crate::wire::{
    Answer, CallStatus, Capacity, Control, Envelope, ErrorClass, Event, GenerateCall, Header,
    NamespacePages, NodeAdvert, PageBlob, PageLogCall, PageLogEntry, PageLogItem, PeerAddr,
    RemoteError, Reply, Request, RouterCall, RouterItem, StoreCall, StoreItem, TierAdvert,
    TierCall, TierItem,
};

/// Connection close code when a peer is declared dead.
const CLOSE_DEAD: u32 = 0x20;
/// Connection close code when a peer's identity and advert disagree.
const CLOSE_IMPOSTOR: u32 = 0x21;
/// Connection close code of a node leaving gracefully.
const CLOSE_LEAVING: u32 = 0x22;

/// Cluster settings.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// QUIC listen address.
    pub listen: SocketAddr,
    /// The QUIC address peers dial, when it is not the bound one (a node listening on
    /// `0.0.0.0` advertises its pod or host address).
    pub advertise: Option<SocketAddr>,
    /// HTTP gateway address advertised to peers (for `mesh status`).
    pub http_addr: String,
    /// Peers to join through (`HOST:PORT`); empty to start a new cluster.
    pub seeds: Vec<String>,
    /// Heartbeat interval (default 250 ms).
    pub heartbeat: Duration,
    /// Silence after which a peer is declared dead (default 2 s). Lower detects loss
    /// sooner; too low declares busy peers dead.
    pub failure_timeout: Duration,
    /// Time a call may wait for its first reply frame (default 30 s).
    pub call_timeout: Duration,
    /// Largest frame accepted on a control or call stream.
    pub max_frame: usize,
    /// QUIC settings.
    pub transport: TransportConfig,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 7070)),
            advertise: None,
            http_addr: String::new(),
            seeds: vec![],
            heartbeat: Duration::from_millis(250),
            failure_timeout: Duration::from_secs(2),
            call_timeout: Duration::from_secs(30),
            max_frame: DEFAULT_MAX_FRAME,
            transport: TransportConfig::default(),
        }
    }
}

/// What this node says about itself in heartbeats, besides who it is.
#[derive(Debug, Clone, Default)]
pub struct LocalAdvert {
    /// Tiers hosted, with live load and page sets.
    pub tiers: Vec<TierAdvert>,
    /// Pages held outside the tiers' own namespaces (a store node's).
    pub pages: Vec<NamespacePages>,
    /// Room for more tiers, and the tiers this node would start.
    pub capacity: Capacity,
    /// Page events since the previous advert (sent once, to peers that follow them).
    pub page_events: Option<PageLogEntry>,
    /// The seq of this node's page events.
    pub page_seq: u64,
    /// Pages held, over every namespace (what a snapshot of the events lists).
    pub pages_held: usize,
}

/// Periods without page events after which a node sends its seq anyway (an empty entry),
/// so a peer that missed the last events notices.
const PAGE_KEEPALIVE_PERIODS: u32 = 8;

/// Builds this node's advert (the node reads its engines and asks its page store).
pub type AdvertSource = Arc<dyn Fn() -> BoxFuture<'static, LocalAdvert> + Send + Sync>;

/// Largest page frame accepted from a peer (pages of big models are MiB-sized).
pub const MAX_PAGE_FRAME: usize = 256 << 20;

/// How long a page pull that succeeded stays joinable after it ends
/// ([`Cluster::fetch_pages`]).
pub const PULL_GRACE: Duration = Duration::from_secs(2);

/// Pages a peer sent for one pull: `(page id, stored bytes)` in prefix order.
pub type PulledPages = Vec<([u8; 32], Vec<u8>)>;

/// One page pull in flight, shared by every caller that wants the same pages: its result is
/// how many pages the first caller's `keep` kept.
type PagePull = Shared<BoxFuture<'static, Result<usize, CallError>>>;

/// Process-wide counters of page pulls (exported as metrics by the node).
#[derive(Debug, Default)]
pub struct PullStats {
    /// Pulls that opened a stream to a peer.
    pub started: AtomicU64,
    /// Calls that wanted exactly the pages of a pull already in flight and waited for it
    /// instead of opening their own stream.
    pub joined: AtomicU64,
}

/// The page-pull counters of this process.
pub static PULL_STATS: PullStats = PullStats {
    started: AtomicU64::new(0),
    joined: AtomicU64::new(0),
};

/// Why a remote call failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CallError {
    /// No live connection to that node.
    #[error("node {0} is not connected")]
    NotConnected(String),
    /// The connection or stream broke during the call.
    #[error("connection to {node} lost: {reason}")]
    Lost {
        /// Node.
        node: String,
        /// Why.
        reason: String,
    },
    /// The callee answered with an error.
    #[error("{0}")]
    Remote(RemoteError),
    /// No first reply within the call timeout.
    #[error("call to {0} timed out")]
    Timeout(String),
}

impl CallError {
    /// Whether another node could succeed where this one failed.
    pub fn retryable(&self) -> bool {
        match self {
            Self::NotConnected(_) | Self::Lost { .. } | Self::Timeout(_) => true,
            Self::Remote(e) => matches!(
                e.class,
                ErrorClass::Unavailable | ErrorClass::Overloaded | ErrorClass::NotFound
            ),
        }
    }
}

/// A member as `mesh status` shows it.
#[derive(Debug, Clone)]
pub struct MemberView {
    /// Node name.
    pub node: String,
    /// This node.
    pub local: bool,
    /// QUIC address.
    pub quic_addr: String,
    /// Gateway address.
    pub http_addr: String,
    /// `alive`, `dead` or `left`.
    pub state: &'static str,
    /// Tiers with load.
    pub tiers: Vec<TierAdvert>,
    /// What it runs (`gateway`, `tiers`, `store`).
    pub roles: Vec<String>,
    /// Actors peers may call on it.
    pub actors: Vec<String>,
    /// Pages its store keeps for peers (a store node), by namespace (capped as adverts are).
    pub stored_pages: Vec<(String, usize)>,
    /// Seconds since the node's process started.
    pub uptime_s: u64,
    /// Milliseconds since its last heartbeat (0 for this node).
    pub last_seen_ms: u64,
    /// Room for more tiers, and the tiers it would start.
    pub capacity: Capacity,
    /// Its build (`mesh <version>`; empty for a node older than wire 10).
    pub build: String,
    /// Cross-node behaviours it offers ([`crate::wire::CAPABILITIES`]).
    pub capabilities: Vec<String>,
    /// Its pages in this node's page index (for this node: the pages it holds).
    pub pages_indexed: usize,
    /// The seq of its page events this node has applied (for this node: its own seq);
    /// `None` while this node does not follow them (an older peer, or no snapshot yet).
    pub page_seq: Option<u64>,
    /// The wire version of this node's connection to it (for this node: the newest it
    /// speaks); `None` while not connected.
    pub wire: Option<u16>,
    /// UDP bytes this node sent and received on its current connection to it (heartbeats,
    /// page events, calls and page pulls; 0 for this node and while not connected).
    pub udp_bytes: (u64, u64),
}

struct Inner {
    me: String,
    endpoint: Endpoint,
    quic_addr: String,
    cfg: ClusterConfig,
    roles: Vec<String>,
    exports: Exports,
    source: AdvertSource,
    /// The advert parts last built (heartbeats sent on a new connection use them).
    local: Mutex<LocalAdvert>,
    started_ms: u64,
    members: Mutex<Membership>,
    conns: DashMap<String, quinn::Connection>,
    dialing: Mutex<HashSet<String>>,
    inflight: DashMap<String, Arc<AtomicU32>>,
    /// Page pulls in flight, by a hash of (peer, tier, salt, page ids).
    pulls: DashMap<[u8; 32], PagePull>,
    stopping: AtomicBool,
    /// Periods since page events were last sent.
    quiet: AtomicU32,
    tasks: Tasks,
    membership: Arc<ActorSlot<MembershipMsg>>,
}

/// Handle to this node's cluster membership (cheap to clone).
#[derive(Clone)]
pub struct Cluster {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("me", &self.inner.me)
            .finish()
    }
}

/// Identity of a page pull: the same pages of the same peer's tier.
fn pull_key(node: &str, model: &str, salt: &[u8; 32], ids: &[[u8; 32]]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    for part in [node.as_bytes(), model.as_bytes()] {
        h.update(&(part.len() as u64).to_le_bytes());
        h.update(part);
    }
    h.update(salt);
    for id in ids {
        h.update(id);
    }
    *h.finalize().as_bytes()
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Decrements the in-flight count of a (node, tier) pair when dropped.
#[derive(Debug)]
pub struct InflightGuard(Arc<AtomicU32>);

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Items of a call as they arrive; the stream ends after the last (or an error).
pub type CallStream<T> = mpsc::UnboundedReceiver<Result<T, CallError>>;

impl Cluster {
    /// Binds the accept loop (a tracked task of `tasks`) and dials the seeds; the
    /// heartbeats start with the membership actor ([`Cluster::membership_spec`]). Fails if
    /// seeds were given and none could be reached (e.g. a certificate from another
    /// cluster: the handshake is refused).
    pub async fn start(
        endpoint: Endpoint,
        cfg: ClusterConfig,
        roles: Vec<String>,
        exports: Exports,
        source: AdvertSource,
        tasks: Tasks,
    ) -> Result<Self, String> {
        let me = endpoint.name().to_owned();
        let bound = endpoint.local_addr().map_err(|e| e.to_string())?;
        let advertised = match crate::seeds::advertised_addr(bound, cfg.advertise) {
            Ok(a) => a,
            Err(e) => {
                endpoint.close(CLOSE_LEAVING);
                tasks.close();
                return Err(e);
            }
        };
        let quic_addr = advertised.to_string();
        let local = source().await;
        let inner = Arc::new(Inner {
            members: Mutex::new(Membership::new(me.clone(), cfg.failure_timeout)),
            me,
            endpoint,
            quic_addr,
            cfg,
            roles,
            exports,
            source,
            local: Mutex::new(local),
            started_ms: now_ms(),
            conns: DashMap::new(),
            dialing: Mutex::new(HashSet::new()),
            inflight: DashMap::new(),
            pulls: DashMap::new(),
            stopping: AtomicBool::new(false),
            quiet: AtomicU32::new(0),
            tasks,
            membership: Arc::default(),
        });
        let c = Cluster { inner };
        let acc = c.clone();
        c.inner.tasks.spawn("quic-accept", Life::Long, async move {
            while let Some(pc) = acc.inner.endpoint.accept().await {
                acc.adopt(pc);
            }
        });
        let mut errors = vec![];
        let mut joined = c.inner.cfg.seeds.is_empty();
        for seed in c.inner.cfg.seeds.clone() {
            if c.seed_is_self(&seed) {
                info!(%seed, "seed is this node; it starts the cluster if no other seed answers");
                joined = true;
                continue;
            }
            match c.dial_seed(&seed).await {
                Ok(peer) => {
                    info!(%seed, %peer, "joined through seed");
                    joined = true;
                }
                Err(e) => {
                    warn!(%seed, error = %e, "seed unreachable");
                    errors.push(format!("{seed}: {e}"));
                }
            }
        }
        if !joined {
            c.inner.endpoint.close(CLOSE_LEAVING);
            c.inner.tasks.close();
            return Err(format!("no seed could be reached: {}", errors.join("; ")));
        }
        Ok(c)
    }

    /// The membership actor of this cluster, for the node supervisor.
    pub fn membership_spec(&self) -> crate::node::ChildSpec {
        crate::node::ChildSpec::new(
            "membership",
            MembershipActor,
            self.clone(),
            self.inner.membership.clone(),
        )
    }

    /// The membership actor's slot (fault injection).
    pub fn membership(&self) -> &Arc<ActorSlot<MembershipMsg>> {
        &self.inner.membership
    }

    /// This node's name.
    pub fn name(&self) -> &str {
        &self.inner.me
    }

    /// The QUIC address peers dial.
    pub fn quic_addr(&self) -> &str {
        &self.inner.quic_addr
    }

    /// Whether `seed` names this node (see [`crate::seeds::names_self`]).
    fn seed_is_self(&self, seed: &str) -> bool {
        self.inner
            .quic_addr
            .parse()
            .is_ok_and(|a| crate::seeds::names_self(seed, &self.inner.me, a))
    }

    async fn dial_seed(&self, seed: &str) -> Result<String, String> {
        let resolved = tokio::net::lookup_host(seed)
            .await
            .map_err(|e| format!("resolving: {e}"))?;
        let addrs: Vec<SocketAddr> = match self.inner.quic_addr.parse() {
            Ok(me) => crate::seeds::others(resolved, me),
            Err(_) => resolved.collect(),
        };
        let mut last = String::from("no address");
        for addr in addrs {
            match self.inner.endpoint.connect(addr).await {
                Ok(pc) => {
                    let peer = pc.peer.clone();
                    self.adopt(pc);
                    return Ok(peer);
                }
                Err(e) => last = e.to_string(),
            }
        }
        Err(last)
    }

    fn dial_peer(&self, node: String, addr: String) {
        {
            let mut d = self.inner.dialing.lock().expect("dialing lock");
            if self.inner.conns.contains_key(&node) || !d.insert(node.clone()) {
                return;
            }
        }
        let c = self.clone();
        self.inner.tasks.spawn("quic-dial", Life::Short, async move {
            let res = match addr.parse::<SocketAddr>() {
                Ok(a) => c.inner.endpoint.connect(a).await.map_err(|e| e.to_string()),
                Err(e) => Err(format!("bad address {addr}: {e}")),
            };
            match res {
                Ok(pc) if pc.peer == node => c.adopt(pc),
                Ok(pc) => {
                    warn!(expected = %node, got = %pc.peer, "peer at gossiped address has another name");
                    pc.conn.close(CLOSE_IMPOSTOR.into(), b"unexpected identity");
                }
                Err(e) => debug!(%node, error = %e, "dial failed"),
            }
            c.inner.dialing.lock().expect("dialing lock").remove(&node);
        });
    }

    /// Takes ownership of an authenticated connection (dialed or accepted).
    fn adopt(&self, pc: PeerConnection) {
        let PeerConnection { conn, peer } = pc;
        if peer == self.inner.me {
            conn.close(CLOSE_IMPOSTOR.into(), b"connected to self");
            return;
        }
        debug!(%peer, remote = %conn.remote_address(), wire = wire_version(&conn), "connection up");
        self.inner.conns.insert(peer.clone(), conn.clone());
        // Introduce ourselves at once rather than at the next tick.
        self.send_heartbeat(conn.clone());
        let c = self.clone();
        let (p, cn) = (peer.clone(), conn.clone());
        self.inner
            .tasks
            .spawn("peer-control", Life::Short, async move {
                loop {
                    match cn.accept_uni().await {
                        Ok(recv) => {
                            let c = c.clone();
                            let (p, cn) = (p.clone(), cn.clone());
                            tokio::spawn(async move { c.on_control(p, cn, recv).await });
                        }
                        Err(e) => {
                            let leaving = matches!(&e, quinn::ConnectionError::ApplicationClosed(a)
                            if a.error_code == quinn::VarInt::from_u32(CLOSE_LEAVING));
                            c.membership_event(MembershipMsg::Closed {
                                peer: p.clone(),
                                conn: cn.clone(),
                                why: e.to_string(),
                                leaving,
                            });
                            return;
                        }
                    }
                }
            });
        let c = self.clone();
        let wire = wire_version(&conn);
        self.inner
            .tasks
            .spawn("peer-calls", Life::Short, async move {
                while let Ok((send, recv)) = conn.accept_bi().await {
                    let c = c.clone();
                    let p = peer.clone();
                    tokio::spawn(async move { c.serve(p, wire, send, recv).await });
                }
            });
    }

    /// Hands a membership event to the membership actor, or applies it here while the
    /// actor restarts (no heartbeat or closed connection is lost to a restart).
    fn membership_event(&self, msg: MembershipMsg) {
        let msg = match self.inner.membership.get() {
            Some(a) => match a.send_message(msg) {
                Ok(()) => return,
                Err(e) => match e {
                    ractor::MessagingErr::SendErr(m) => m,
                    _ => return,
                },
            },
            None => msg,
        };
        self.apply(msg);
    }

    /// Applies a membership event (the membership actor's work): the connection it came
    /// on is kept or dropped here, the table decides the rest ([`Membership::step`]).
    fn apply(&self, msg: MembershipMsg) {
        let input = match msg {
            MembershipMsg::Heartbeat { peer, advert, conn } => {
                // A heartbeat on a connection we no longer hold (after a failure verdict)
                // re-adopts it.
                self.inner.conns.entry(peer).or_insert_with(|| conn.clone());
                Input::Heartbeat(advert)
            }
            MembershipMsg::Leave { peer, conn } => {
                self.inner
                    .conns
                    .remove_if(&peer, |_, c| c.stable_id() == conn.stable_id());
                Input::Leave(peer)
            }
            MembershipMsg::Closed {
                peer,
                conn,
                why,
                leaving,
            } => {
                let current = self
                    .inner
                    .conns
                    .remove_if(&peer, |_, c| c.stable_id() == conn.stable_id())
                    .is_some();
                if current && !leaving {
                    debug!(%peer, reason = %why, "peer connection closed");
                }
                Input::Closed {
                    node: peer,
                    current: current && !self.inner.stopping.load(Ordering::Relaxed),
                    leaving,
                }
            }
            MembershipMsg::Pages {
                peer,
                started_ms,
                entry,
            } => Input::Pages {
                node: peer,
                started_ms,
                entry,
            },
            MembershipMsg::PageLog {
                node,
                started_ms,
                entry,
            } => Input::PageLog {
                node,
                started_ms,
                entry,
            },
            MembershipMsg::Tick | MembershipMsg::AdvertiseNow | MembershipMsg::Crash => return,
        };
        let effects = self
            .inner
            .members
            .lock()
            .expect("members")
            .step(input, Instant::now());
        self.perform(effects);
    }

    /// Does what the membership table decided.
    fn perform(&self, effects: Vec<Effect>) {
        for e in effects {
            match &e {
                Effect::Dial { node, addr } => self.dial_peer(node.clone(), addr.clone()),
                Effect::Close(peer) => {
                    if let Some((_, conn)) = self.inner.conns.remove(peer) {
                        conn.close(CLOSE_DEAD.into(), b"declared dead: no heartbeat");
                    }
                }
                Effect::RedialSeeds { known } => self.redial_seeds(known.clone()),
                Effect::Joined(peer) | Effect::Rejoined(peer) => {
                    let what = if matches!(e, Effect::Joined(_)) {
                        "joined"
                    } else {
                        "rejoined"
                    };
                    let m = self.inner.members.lock().expect("members");
                    let found = m.all().find(|p| p.advert.node == *peer);
                    if let Some(p) = found {
                        let tiers: Vec<&str> =
                            p.advert.tiers.iter().map(|t| t.name.as_str()).collect();
                        info!(%peer, addr = %p.advert.quic_addr, ?tiers, roles = ?p.advert.roles,
                            "peer {what}");
                    }
                }
                Effect::Left(peer) => info!(%peer, "peer left"),
                Effect::FetchPages {
                    node,
                    started_ms,
                    since,
                } => self.fetch_page_log(node.clone(), *started_ms, *since),
                Effect::Died(peer, DeathCause::Silent) => {
                    warn!(%peer, timeout_ms = self.inner.cfg.failure_timeout.as_millis() as u64,
                        "no heartbeat; peer declared dead");
                }
                Effect::Died(peer, DeathCause::ConnectionLost) => {
                    warn!(%peer, "peer connection lost; peer marked dead");
                }
            }
        }
    }

    /// Dials again, in the background, every seed that is not a live peer's address.
    fn redial_seeds(&self, known: Vec<String>) {
        let known: HashSet<String> = known.into_iter().collect();
        for seed in &self.inner.cfg.seeds {
            if self.seed_is_self(seed) {
                continue;
            }
            let (c, seed, known) = (self.clone(), seed.clone(), known.clone());
            self.inner
                .tasks
                .spawn("quic-dial", Life::Short, async move {
                    let seed_known = tokio::net::lookup_host(seed.as_str())
                        .await
                        .map(|mut a| a.any(|a| known.contains(&a.to_string())))
                        .unwrap_or(false);
                    if !seed_known {
                        if let Ok(peer) = c.dial_seed(&seed).await {
                            debug!(%seed, %peer, "re-dialed seed");
                        }
                    }
                });
        }
    }

    async fn on_control(&self, peer: String, conn: quinn::Connection, mut recv: quinn::RecvStream) {
        let read = frame::read_payload(&mut recv, self.inner.cfg.max_frame).await;
        // A version-9 frame has the advert without the build and capabilities.
        let msg = read.and_then(|f| match f {
            Some((9, p)) => frame::decode::<crate::wire::v9::Control>(&p).map(|c| Some(c.into())),
            Some((_, p)) => frame::decode::<Control>(&p).map(Some),
            None => Ok(None),
        });
        let msg = match msg {
            Ok(Some(m)) => m,
            Ok(None) => return,
            Err(e) => {
                refuse(&peer, &e);
                let _ = recv.stop(e.code().into());
                return;
            }
        };
        match msg {
            Control::Heartbeat(advert) => {
                if advert.node != peer {
                    warn!(%peer, claimed = %advert.node, "heartbeat names another node; closing");
                    conn.close(CLOSE_IMPOSTOR.into(), b"advert does not match certificate");
                    return;
                }
                self.membership_event(MembershipMsg::Heartbeat { peer, advert, conn });
            }
            Control::Leave { node } => {
                if node == peer {
                    self.membership_event(MembershipMsg::Leave { peer, conn });
                }
            }
            Control::Pages {
                node,
                started_ms,
                entry,
            } => {
                if node == peer {
                    self.membership_event(MembershipMsg::Pages {
                        peer,
                        started_ms,
                        entry,
                    });
                }
            }
        }
    }

    /// This node's advert, with `peers` as its gossip list.
    fn advert(&self, peers: Vec<PeerAddr>) -> NodeAdvert {
        let local = self.inner.local.lock().expect("local advert").clone();
        NodeAdvert {
            node: self.inner.me.clone(),
            quic_addr: self.inner.quic_addr.clone(),
            http_addr: self.inner.cfg.http_addr.clone(),
            started_ms: self.inner.started_ms,
            tiers: local.tiers,
            peers,
            roles: self.inner.roles.clone(),
            actors: self.inner.exports.names(),
            pages: local.pages,
            capacity: local.capacity,
            build: BUILD.to_owned(),
            capabilities: capabilities(),
        }
    }

    /// Sends this node's advert to every peer now (a tier started or stopped), rather than
    /// at the next heartbeat.
    pub fn advertise_now(&self) {
        match self.inner.membership.get() {
            Some(a) => {
                let _ = a.send_message(MembershipMsg::AdvertiseNow);
            }
            None => {
                let c = self.clone();
                tokio::spawn(async move { c.heartbeat_all(true).await });
            }
        }
    }

    fn send_heartbeat(&self, conn: quinn::Connection) {
        let peers = self.inner.members.lock().expect("members").gossip();
        let msg = Control::Heartbeat(self.advert(peers));
        tokio::spawn(async move { send_control(&conn, &msg).await });
    }

    /// Rebuilds this node's advert when `refresh`, and sends it to every peer.
    async fn heartbeat_all(&self, refresh: bool) {
        let mut events = None;
        if refresh {
            let mut local = (self.inner.source)().await;
            events = Some((local.page_events.take(), local.page_seq));
            *self.inner.local.lock().expect("local advert") = local;
        }
        let peers = self
            .inner
            .members
            .lock()
            .expect("members")
            .gossip_for_period();
        let msg = Control::Heartbeat(self.advert(peers));
        for e in self.inner.conns.iter() {
            let (conn, msg) = (e.value().clone(), msg.clone());
            tokio::spawn(async move { send_control(&conn, &msg).await });
        }
        if let Some((entry, seq)) = events {
            self.push_pages(entry, seq);
        }
    }

    /// Sends this node's new page events to the live peers that follow them; when there
    /// are none for [`PAGE_KEEPALIVE_PERIODS`], its seq alone.
    fn push_pages(&self, entry: Option<PageLogEntry>, seq: u64) {
        let entry = match entry {
            Some(e) => e,
            None if self.inner.quiet.fetch_add(1, Ordering::Relaxed) + 1
                < PAGE_KEEPALIVE_PERIODS =>
            {
                return
            }
            None => PageLogEntry {
                snapshot: false,
                from: seq,
                seq,
                changes: vec![],
            },
        };
        self.inner.quiet.store(0, Ordering::Relaxed);
        let followers: Vec<String> = self
            .inner
            .members
            .lock()
            .expect("members")
            .alive()
            .filter(|p| p.advert.capabilities.iter().any(|c| c == PAGE_LOG))
            .map(|p| p.advert.node.clone())
            .collect();
        let msg = Control::Pages {
            node: self.inner.me.clone(),
            started_ms: self.inner.started_ms,
            entry,
        };
        for f in followers {
            if let Some(conn) = self.inner.conns.get(&f).map(|c| c.clone()) {
                let msg = msg.clone();
                tokio::spawn(async move { send_control(&conn, &msg).await });
            }
        }
    }

    /// Asks `node` for its page events after `since` (a snapshot for `None`) and hands
    /// the answer to the membership table.
    fn fetch_page_log(&self, node: String, started_ms: u64, since: Option<u64>) {
        let c = self.clone();
        self.inner
            .tasks
            .spawn("page-log-fetch", Life::Short, async move {
                let call = PageLogCall::Since { seq: since };
                let got = c
                    .ask::<crate::pagestore::PageLogProtocol>(
                        &node,
                        &call,
                        c.inner.cfg.call_timeout,
                    )
                    .await;
                let entry = match got {
                    Ok(PageLogItem::Entry(e)) => Some(e),
                    Err(e) => {
                        debug!(peer = %node, error = %e, "fetching page events failed");
                        None
                    }
                };
                c.membership_event(MembershipMsg::PageLog {
                    node,
                    started_ms,
                    entry,
                });
            });
    }

    /// One heartbeat period: adverts out, then the table's verdicts (peers gone quiet,
    /// seeds to re-dial).
    async fn tick(&self) {
        self.heartbeat_all(true).await;
        let effects = self
            .inner
            .members
            .lock()
            .expect("members")
            .step(Input::Tick, Instant::now());
        self.perform(effects);
    }

    /// Serves one call stream from `peer`.
    async fn serve(
        &self,
        peer: String,
        wire: u16,
        mut send: quinn::SendStream,
        mut recv: quinn::RecvStream,
    ) {
        let req = match read_frame::<Request, _>(&mut recv, self.inner.cfg.max_frame).await {
            Ok(Some(r)) => r,
            Ok(None) => return,
            Err(e) => {
                refuse(&peer, &e);
                let _ = recv.stop(e.code().into());
                let _ = send.reset(e.code().into());
                return;
            }
        };
        match req {
            Request::Ping { nonce, payload } => {
                let _ = write_frame_as(&mut send, &Reply::Pong { nonce, payload }, wire).await;
                let _ = send.finish();
            }
            Request::Call(envelope) => {
                let ctx = CallContext {
                    peer,
                    envelope,
                    wire,
                };
                self.inner
                    .exports
                    .serve(ctx, send, recv, self.inner.cfg.max_frame)
                    .await;
            }
        }
    }

    async fn open_call(
        &self,
        node: &str,
        req: &Request,
    ) -> Result<(quinn::SendStream, quinn::RecvStream, u16), CallError> {
        let conn = self
            .inner
            .conns
            .get(node)
            .map(|c| c.value().clone())
            .ok_or_else(|| CallError::NotConnected(node.to_owned()))?;
        let lost = |e: &dyn std::fmt::Display| CallError::Lost {
            node: node.to_owned(),
            reason: e.to_string(),
        };
        let wire = wire_version(&conn);
        let (mut send, recv) = conn.open_bi().await.map_err(|e| lost(&e))?;
        write_frame_as(&mut send, req, wire)
            .await
            .map_err(|e| lost(&e))?;
        Ok((send, recv, wire))
    }

    /// Calls actor `P` on `node`: resolves when the callee accepted the call or refused
    /// it; the items then stream on the receiver, ending after the last or with an error
    /// (`CallError::Lost` when the connection broke). Dropping the receiver cancels the
    /// call. `deadline` (zero: none) bounds the call on the callee.
    ///
    /// Cancel safety: cancel-safe.
    pub async fn call<P: Protocol>(
        &self,
        node: &str,
        call: &P::Call,
        deadline: Duration,
        trace: Vec<Header>,
    ) -> Result<CallStream<P::Item>, CallError> {
        let envelope = Envelope {
            actor: P::ACTOR.to_owned(),
            deadline_ms: deadline.as_millis() as u64,
            trace,
        };
        let (mut send, mut recv, wire) = self.open_call(node, &Request::Call(envelope)).await?;
        let lost = |reason: String| CallError::Lost {
            node: node.to_owned(),
            reason,
        };
        call.write(&mut send, wire)
            .await
            .map_err(|e| lost(e.to_string()))?;
        let status = tokio::time::timeout(
            self.inner.cfg.call_timeout,
            CallStatus::read(&mut recv, self.inner.cfg.max_frame),
        )
        .await;
        match status {
            Err(_) => return Err(CallError::Timeout(node.to_owned())),
            Ok(Ok(Some(CallStatus::Accepted))) => {}
            Ok(Ok(Some(CallStatus::Refused(e)))) => return Err(CallError::Remote(e)),
            Ok(Ok(None)) => return Err(lost("stream ended without an answer".into())),
            Ok(Err(e)) => return Err(lost(e.to_string())),
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let node = node.to_owned();
        tokio::spawn(async move {
            let _send = send; // keep our half open until the call ends
            loop {
                let r = <P::Item as remote::Item>::Answer::read(&mut recv, P::MAX_ITEM).await;
                let (item, last) = match r.map(|a| a.map(Into::into)) {
                    Ok(Some(Answer::Item(i))) => (Ok(i), false),
                    Ok(Some(Answer::End)) => return,
                    Ok(Some(Answer::Error(e))) => (Err(CallError::Remote(e)), true),
                    Ok(None) => (
                        Err(CallError::Lost {
                            node: node.clone(),
                            reason: "stream ended before the call finished".into(),
                        }),
                        true,
                    ),
                    Err(e) => (
                        Err(CallError::Lost {
                            node: node.clone(),
                            reason: e.to_string(),
                        }),
                        true,
                    ),
                };
                if tx.send(item).is_err() || last {
                    return;
                }
            }
        });
        Ok(rx)
    }

    /// [`call`](Self::call) for a call answered by one item.
    ///
    /// Cancel safety: cancel-safe.
    pub async fn ask<P: Protocol>(
        &self,
        node: &str,
        call: &P::Call,
        deadline: Duration,
    ) -> Result<P::Item, CallError> {
        let mut rx = self.call::<P>(node, call, deadline, vec![]).await?;
        rx.recv().await.unwrap_or_else(|| {
            Err(CallError::Lost {
                node: node.to_owned(),
                reason: "the call ended without an answer".into(),
            })
        })
    }

    /// Tokenizes the prompt `parts` with tier `model` on `node`.
    ///
    /// Cancel safety: cancel-safe.
    pub async fn tokenize(
        &self,
        node: &str,
        model: &str,
        parts: &[mesh_tiers::chat::PromptPart],
    ) -> Result<Vec<i32>, CallError> {
        let call = TierCall::Tokenize {
            model: model.to_owned(),
            parts: parts.iter().map(Into::into).collect(),
        };
        match self
            .ask::<crate::tier::TierProtocol>(node, &call, self.inner.cfg.call_timeout)
            .await?
        {
            TierItem::Tokens(t) => Ok(t),
            other => Err(unexpected(node, &other)),
        }
    }

    /// Renders and tokenizes a conversation with tier `model`'s chat template on `node`.
    ///
    /// Cancel safety: cancel-safe.
    pub async fn render(
        &self,
        node: &str,
        model: &str,
        input: &mesh_tiers::format::ChatInput,
    ) -> Result<crate::tier::Rendered, CallError> {
        let call = TierCall::Render {
            model: model.to_owned(),
            input: serde_json::to_string(input).expect("a chat input serializes"),
        };
        match self
            .ask::<crate::tier::TierProtocol>(node, &call, self.inner.cfg.call_timeout)
            .await?
        {
            TierItem::Rendered {
                tokens,
                spec,
                thinking_open,
            } => Ok(crate::tier::Rendered {
                tokens,
                spec: serde_json::from_str(&spec).map_err(|e| CallError::Lost {
                    node: node.to_owned(),
                    reason: format!("unreadable chat format: {e}"),
                })?,
                thinking_open,
            }),
            other => Err(unexpected(node, &other)),
        }
    }

    /// Starts a generation on `node`. Resolves when the callee accepted it (its first event
    /// arrived) or refused it; events then stream on the receiver. A broken connection ends
    /// the stream with `Err(CallError::Lost)`. Dropping the receiver cancels the call.
    ///
    /// Cancel safety: cancel-safe.
    pub async fn generate(
        &self,
        node: &str,
        call: GenerateCall,
    ) -> Result<CallStream<Event>, CallError> {
        let deadline = Duration::from_millis(call.deadline_ms);
        let trace = call.trace.clone();
        let mut items = self
            .call::<crate::tier::TierProtocol>(node, &TierCall::Generate(call), deadline, trace)
            .await?;
        let (tx, rx) = mpsc::unbounded_channel();
        let node = node.to_owned();
        tokio::spawn(async move {
            while let Some(item) = items.recv().await {
                let ev = match item {
                    Ok(TierItem::Event(ev)) => Ok(ev),
                    Ok(other) => Err(unexpected(&node, &other)),
                    Err(e) => Err(e),
                };
                if tx.send(ev).is_err() {
                    return;
                }
            }
        });
        Ok(rx)
    }

    /// Fetches the leading pages of `ids` that `node` holds for tier `model`, in their stored
    /// form, on a stream of their own. The caller checks each page against its id and salt.
    ///
    /// Cancel safety: cancel-safe.
    ///
    /// Concurrent calls for the same pages of the same peer share one pull: when several
    /// requests with one prefix arrive together (agents started at once), the pages cross
    /// the wire once. The pulled pages go to the starting caller's `keep` (which stores
    /// them) before the pull ends; every caller gets what `keep` returned. A call that
    /// looked its pages up before they were stored may come after the pull ended: a pull
    /// that succeeded stays joinable for [`PULL_GRACE`], so such a call takes its result
    /// instead of pulling the pages again. A failed pull is forgotten at once.
    pub async fn fetch_pages<K>(
        &self,
        node: &str,
        model: &str,
        salt: [u8; 32],
        ids: Vec<[u8; 32]>,
        keep: K,
    ) -> Result<usize, CallError>
    where
        K: FnOnce(PulledPages) -> BoxFuture<'static, usize> + Send + 'static,
    {
        let key = pull_key(node, model, &salt, &ids);
        let pull = match self.inner.pulls.entry(key) {
            dashmap::Entry::Occupied(e) => {
                PULL_STATS.joined.fetch_add(1, Ordering::Relaxed);
                e.get().clone()
            }
            dashmap::Entry::Vacant(v) => {
                PULL_STATS.started.fetch_add(1, Ordering::Relaxed);
                let (this, node, model) = (self.clone(), node.to_owned(), model.to_owned());
                let pull = async move {
                    let kept = match this.pull_pages(&node, &model, salt, ids).await {
                        Ok(pages) => Ok(keep(pages).await),
                        Err(e) => Err(e),
                    };
                    if kept.is_ok() {
                        // The pages are stored: calls a moment late join this result, later
                        // ones find the pages stored (or, if evicted since, pull afresh).
                        tokio::spawn(async move {
                            tokio::time::sleep(PULL_GRACE).await;
                            this.inner.pulls.remove(&key);
                        });
                    } else {
                        // Failed: the next call deserves another try.
                        this.inner.pulls.remove(&key);
                    }
                    kept
                }
                .boxed()
                .shared();
                v.insert(pull.clone());
                pull
            }
        };
        pull.await
    }

    /// One page pull over its own stream.
    async fn pull_pages(
        &self,
        node: &str,
        model: &str,
        salt: [u8; 32],
        ids: Vec<[u8; 32]>,
    ) -> Result<PulledPages, CallError> {
        let call = StoreCall::Fetch {
            ns: model.to_owned(),
            salt: salt.to_vec(),
            ids: ids.iter().map(|i| i.to_vec()).collect(),
        };
        let mut items = self
            .call::<crate::pagestore::StoreProtocol>(
                node,
                &call,
                self.inner.cfg.call_timeout,
                vec![],
            )
            .await?;
        let mut out = vec![];
        while let Some(item) = items.recv().await {
            match item? {
                StoreItem::Page(PageBlob { id, stored }) => {
                    let id: [u8; 32] = id.try_into().map_err(|_| CallError::Lost {
                        node: node.to_owned(),
                        reason: "page id of wrong length".into(),
                    })?;
                    out.push((id, stored));
                }
                other => return Err(unexpected(node, &other)),
            }
        }
        Ok(out)
    }

    /// Hands pages (stored forms) of namespace `ns` to the page store of `node` (demotion to
    /// a store node); how many it kept.
    ///
    /// Cancel safety: cancel-safe (pages sent before the cancel may be kept).
    pub async fn put_pages(
        &self,
        node: &str,
        ns: &str,
        base: [u8; 32],
        block: u32,
        pages: Vec<PageBlob>,
    ) -> Result<u32, CallError> {
        let call = StoreCall::Put {
            ns: ns.to_owned(),
            base: base.to_vec(),
            block,
            pages,
        };
        match self
            .ask::<crate::pagestore::StoreProtocol>(node, &call, self.inner.cfg.call_timeout)
            .await?
        {
            StoreItem::Stored { pages } => Ok(pages),
            other => Err(unexpected(node, &other)),
        }
    }

    /// Asks the tool router on `node` which tools to show.
    ///
    /// Cancel safety: cancel-safe.
    pub async fn route_tools(&self, node: &str, call: RouterCall) -> Result<RouterItem, CallError> {
        self.ask::<crate::router::RouterProtocol>(node, &call, self.inner.cfg.call_timeout)
            .await
    }

    /// For each live, connected peer, what `f` finds in its advert.
    fn from_live<T>(&self, f: impl Fn(&NodeAdvert) -> Option<T>) -> Vec<(String, T)> {
        let m = self.inner.members.lock().expect("members");
        let out = m
            .alive()
            .filter(|p| self.inner.conns.contains_key(&p.advert.node))
            .filter_map(|p| f(&p.advert).map(|t| (p.advert.node.clone(), t)))
            .collect();
        out
    }

    /// The salt base and block size a live peer advertises for `tier`'s pages (a node
    /// without the tier computes page ids with them).
    pub fn page_params(&self, tier: &str) -> Option<(Vec<u8>, u32)> {
        let m = self.inner.members.lock().expect("members");
        let found = m.alive().find_map(|p| {
            let t = p
                .advert
                .tiers
                .iter()
                .find(|t| t.name == tier && t.page_block > 0)?;
            Some((t.page_base.clone(), t.page_block))
        });
        found
    }

    /// Connected live peers holding the first of `ids` (short page ids of namespace `ns`
    /// with salt base `base` and `block` tokens a page, as their tiers or stores
    /// advertised them), each with how many leading pages of `ids` it holds. Read in place
    /// from the membership table's page index.
    pub fn prefix_runs(
        &self,
        ns: &str,
        base: &[u8],
        block: u32,
        ids: &[u64],
    ) -> Vec<(String, usize)> {
        let space = mesh_kvstore::PageSpace {
            ns: ns.to_owned(),
            base: base.to_vec(),
            block,
        };
        let m = self.inner.members.lock().expect("members");
        m.prefix_runs(&space, ids)
            .into_iter()
            .filter(|(n, _)| self.inner.conns.contains_key(*n))
            .map(|(n, run)| (n.to_owned(), run))
            .collect()
    }

    /// Live peers that export actor `actor`, best first (fewest in flight from here).
    pub fn peers_with(&self, actor: &str) -> Vec<String> {
        let mut out: Vec<String> = self
            .from_live(|a| a.actors.iter().any(|x| x == actor).then_some(()))
            .into_iter()
            .map(|(n, ())| n)
            .collect();
        out.sort_by_key(|n| self.inflight_count(n, actor));
        out
    }

    /// Live peers running role `role` (`store`, `tiers`, `gateway`).
    pub fn peers_in_role(&self, role: &str) -> Vec<String> {
        self.from_live(|a| a.roles.iter().any(|r| r == role).then_some(()))
            .into_iter()
            .map(|(n, ())| n)
            .collect()
    }

    /// Round trip with a payload echoed back.
    ///
    /// Cancel safety: cancel-safe.
    pub async fn ping(&self, node: &str, payload: Vec<u8>) -> Result<Vec<u8>, CallError> {
        let (_send, mut recv, _) = self
            .open_call(node, &Request::Ping { nonce: 1, payload })
            .await?;
        let r = tokio::time::timeout(
            self.inner.cfg.call_timeout,
            read_frame::<Reply, _>(&mut recv, self.inner.cfg.max_frame),
        )
        .await
        .map_err(|_| CallError::Timeout(node.to_owned()))?;
        match r {
            Ok(Some(Reply::Pong { payload, .. })) => Ok(payload),
            Ok(None) => Err(CallError::Lost {
                node: node.to_owned(),
                reason: "stream ended without a reply".into(),
            }),
            Err(e) => Err(CallError::Lost {
                node: node.to_owned(),
                reason: e.to_string(),
            }),
        }
    }

    /// Remote nodes hosting `tier`, with their load, for [`crate::routing::pick`].
    pub fn candidates(&self, tier: &str) -> Vec<Candidate> {
        let m = self.inner.members.lock().expect("members");
        m.alive()
            .filter(|p| self.inner.conns.contains_key(&p.advert.node))
            .filter_map(|p| {
                let t = p.advert.tiers.iter().find(|t| t.name == tier)?;
                Some(Candidate {
                    node: p.advert.node.clone(),
                    local: false,
                    active: t.active,
                    queued: t.queued,
                    n_seq_max: t.n_seq_max,
                    inflight: self.inflight_count(&p.advert.node, tier),
                    cached_tokens: 0,
                    prompt_tokens: 0,
                })
            })
            .collect()
    }

    /// The advert of a remote tier (context limits), if some live node hosts it.
    pub fn remote_tier(&self, node: &str, tier: &str) -> Option<TierAdvert> {
        let m = self.inner.members.lock().expect("members");
        let found = m
            .alive()
            .find(|p| p.advert.node == node)
            .and_then(|p| p.advert.tiers.iter().find(|t| t.name == tier).cloned());
        found
    }

    /// Whether any peer, live or not, has ever advertised `tier`, also when no advert lists
    /// it now (its engine restarting): a request for it is then "none available", not
    /// "unknown model".
    pub fn ever_hosted(&self, tier: &str) -> bool {
        self.inner
            .members
            .lock()
            .expect("members")
            .ever_hosted(tier)
    }

    /// Tier names hosted by live peers.
    pub fn remote_tier_names(&self) -> Vec<String> {
        let m = self.inner.members.lock().expect("members");
        let mut names: Vec<String> = m
            .alive()
            .flat_map(|p| p.advert.tiers.iter().map(|t| t.name.clone()))
            .collect();
        names.sort();
        names.dedup();
        names
    }

    fn inflight_counter(&self, node: &str, tier: &str) -> Arc<AtomicU32> {
        self.inner
            .inflight
            .entry(format!("{node}/{tier}"))
            .or_default()
            .clone()
    }

    fn inflight_count(&self, node: &str, tier: &str) -> u32 {
        self.inner
            .inflight
            .get(&format!("{node}/{tier}"))
            .map(|c| c.load(Ordering::Relaxed))
            .unwrap_or(0)
    }

    /// Counts a request this gateway sends to (`node`, `tier`) until the guard drops.
    pub fn track(&self, node: &str, tier: &str) -> InflightGuard {
        let c = self.inflight_counter(node, tier);
        c.fetch_add(1, Ordering::Relaxed);
        InflightGuard(c)
    }

    /// Every member, this node first.
    pub fn members(&self) -> Vec<MemberView> {
        let now = now_ms();
        let local = self.inner.local.lock().expect("local advert").clone();
        let me = MemberView {
            node: self.inner.me.clone(),
            local: true,
            quic_addr: self.inner.quic_addr.clone(),
            http_addr: self.inner.cfg.http_addr.clone(),
            state: "alive",
            stored_pages: local
                .pages
                .iter()
                .map(|p| (p.ns.clone(), p.ids.len()))
                .collect(),
            tiers: local.tiers,
            roles: self.inner.roles.clone(),
            actors: self.inner.exports.names(),
            uptime_s: now.saturating_sub(self.inner.started_ms) / 1000,
            last_seen_ms: 0,
            capacity: local.capacity,
            build: BUILD.to_owned(),
            capabilities: capabilities(),
            pages_indexed: local.pages_held,
            page_seq: Some(local.page_seq),
            wire: Some(frame::newest_spoken()),
            udp_bytes: (0, 0),
        };
        let m = self.inner.members.lock().expect("members");
        std::iter::once(me)
            .chain(m.all().map(|p| {
                MemberView {
                    node: p.advert.node.clone(),
                    local: false,
                    quic_addr: p.advert.quic_addr.clone(),
                    http_addr: p.advert.http_addr.clone(),
                    state: match p.state {
                        PeerState::Alive => "alive",
                        PeerState::Dead => "dead",
                        PeerState::Left => "left",
                    },
                    tiers: p.advert.tiers.clone(),
                    roles: p.advert.roles.clone(),
                    actors: p.advert.actors.clone(),
                    stored_pages: p
                        .advert
                        .pages
                        .iter()
                        .map(|n| (n.ns.clone(), n.ids.len()))
                        .collect(),
                    uptime_s: now.saturating_sub(p.advert.started_ms) / 1000,
                    last_seen_ms: p.last_seen.elapsed().as_millis() as u64,
                    capacity: p.advert.capacity.clone(),
                    build: p.advert.build.clone(),
                    capabilities: p.advert.capabilities.clone(),
                    pages_indexed: m.pages_indexed(&p.advert.node),
                    page_seq: m.page_seq(&p.advert.node),
                    wire: self
                        .inner
                        .conns
                        .get(&p.advert.node)
                        .map(|c| wire_version(&c)),
                    udp_bytes: self.inner.conns.get(&p.advert.node).map_or((0, 0), |c| {
                        let s = c.stats();
                        (s.udp_tx.bytes, s.udp_rx.bytes)
                    }),
                }
            }))
            .collect()
    }

    /// Graceful leave: tells every peer, then closes all connections.
    pub async fn leave(&self) {
        self.inner.stopping.store(true, Ordering::Relaxed);
        let msg = Control::Leave {
            node: self.inner.me.clone(),
        };
        let conns: Vec<quinn::Connection> =
            self.inner.conns.iter().map(|e| e.value().clone()).collect();
        let sends = conns.iter().map(|c| send_control(c, &msg));
        let _ =
            tokio::time::timeout(Duration::from_secs(1), futures::future::join_all(sends)).await;
        self.inner.endpoint.close(CLOSE_LEAVING);
        self.inner.endpoint.wait_idle(Duration::from_secs(1)).await;
        self.inner.tasks.close();
        info!("left the cluster");
    }
}

fn unexpected(node: &str, r: &dyn std::fmt::Debug) -> CallError {
    CallError::Lost {
        node: node.to_owned(),
        reason: format!("unexpected answer {r:?}"),
    }
}

/// What this build says it is in adverts.
const BUILD: &str = concat!("mesh ", env!("CARGO_PKG_VERSION"));

/// This build's capabilities as advertised.
fn capabilities() -> Vec<String> {
    crate::wire::CAPABILITIES
        .iter()
        .map(|c| (*c).to_owned())
        .collect()
}

fn refuse(peer: &str, e: &FrameError) {
    warn!(%peer, code = e.code(), error = %e, "refused frame; stream closed");
}

async fn send_control(conn: &quinn::Connection, msg: &Control) {
    // A version-9 peer reads the advert without the build and capabilities, and gets no
    // page events.
    let version = wire_version(conn);
    let old = match version {
        9 => match crate::wire::v9::Control::try_from(msg.clone()) {
            Ok(old) => Some(old),
            Err(_) => return,
        },
        _ => None,
    };
    let Ok(mut s) = conn.open_uni().await else {
        return;
    };
    let written = match &old {
        Some(old) => write_frame_as(&mut s, old, 9).await,
        None => write_frame_as(&mut s, msg, version).await,
    };
    if written.is_ok() {
        let _ = s.finish();
        if matches!(msg, Control::Leave { .. }) {
            // Wait until the peer has read it: the connection closes right after.
            let _ = s.stopped().await;
        }
    }
}

/// Messages of [`MembershipActor`].
#[derive(Debug)]
pub enum MembershipMsg {
    /// A heartbeat period passed.
    Tick,
    /// A peer's heartbeat arrived on `conn`.
    Heartbeat {
        /// The peer (its certificate's name).
        peer: String,
        /// Its advert.
        advert: NodeAdvert,
        /// The connection it came on.
        conn: quinn::Connection,
    },
    /// A peer said goodbye.
    Leave {
        /// The peer.
        peer: String,
        /// Its connection.
        conn: quinn::Connection,
    },
    /// A peer's connection closed.
    Closed {
        /// The peer.
        peer: String,
        /// The connection.
        conn: quinn::Connection,
        /// Why.
        why: String,
        /// The peer closed it while leaving.
        leaving: bool,
    },
    /// A peer's page events arrived.
    Pages {
        /// The peer.
        peer: String,
        /// Its process start time.
        started_ms: u64,
        /// The events.
        entry: PageLogEntry,
    },
    /// The answer to a fetch of a peer's page events (`None`: the call failed).
    PageLog {
        /// The peer.
        node: String,
        /// Its process start time when asked.
        started_ms: u64,
        /// The events or snapshot.
        entry: Option<PageLogEntry>,
    },
    /// Send this node's advert now (a tier started or stopped).
    AdvertiseNow,
    /// Fault injection: the actor panics.
    Crash,
}

/// The membership actor: sends this node's heartbeats, applies its peers', sweeps peers
/// gone quiet and re-dials seeds. Its table and connections live in the [`Cluster`], so a
/// restart loses neither.
#[derive(Debug, Default, Clone, Copy)]
pub struct MembershipActor;

/// State of [`MembershipActor`].
#[derive(Debug)]
pub struct MembershipState {
    cluster: Cluster,
    timer: Option<tokio::task::JoinHandle<()>>,
}

impl Actor for MembershipActor {
    type Msg = MembershipMsg;
    type State = MembershipState;
    type Arguments = Cluster;

    async fn pre_start(
        &self,
        _myself: ActorRef<MembershipMsg>,
        cluster: Cluster,
    ) -> Result<MembershipState, ActorProcessingErr> {
        Ok(MembershipState {
            cluster,
            timer: None,
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<MembershipMsg>,
        state: &mut MembershipState,
    ) -> Result<(), ActorProcessingErr> {
        let every = state.cluster.inner.cfg.heartbeat;
        state.timer = Some(myself.send_interval(every, || MembershipMsg::Tick));
        // Say at once that this incarnation is here.
        state.cluster.heartbeat_all(true).await;
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<MembershipMsg>,
        state: &mut MembershipState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(t) = state.timer.take() {
            t.abort();
        }
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<MembershipMsg>,
        msg: MembershipMsg,
        state: &mut MembershipState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            MembershipMsg::Tick => {
                if state.cluster.inner.stopping.load(Ordering::Relaxed) {
                    return Ok(());
                }
                state.cluster.tick().await;
            }
            MembershipMsg::AdvertiseNow => state.cluster.heartbeat_all(true).await,
            MembershipMsg::Crash => panic!("membership: crash injected"),
            other => state.cluster.apply(other),
        }
        Ok(())
    }
}
