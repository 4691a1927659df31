//! The cluster: one long-lived QUIC connection per peer, heartbeats with
//! adverts and gossip over them, failure detection, and remote calls.
//!
//! ```text
//!  accept loop ─▶ adopt(conn) ─┬─▶ uni acceptor  ─▶ Control (heartbeat, leave) ─▶ Membership
//!  dial(seed)  ─▶ adopt(conn) ─┘   bidi acceptor ─▶ Request ─▶ Service (tier actors) ─▶ Reply…
//!  ticker: every `heartbeat`: send adverts, sweep (dead ⇒ close its connection), re-dial seeds
//! ```
//!
//! A peer is declared dead when no heartbeat came for `failure_timeout` or its
//! connection closed; its connection is then closed, which fails every call
//! streaming from it at once, so callers can re-run them elsewhere.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dashmap::DashMap;
use futures::future::{BoxFuture, FutureExt, Shared};
use mesh_transport::frame::{read_frame, write_frame, FrameError};
use mesh_transport::{Endpoint, PeerConnection, TransportConfig, DEFAULT_MAX_FRAME};
use tokio::sync::mpsc;
use tracing::{debug, info, warn, Instrument};

use crate::membership::{Change, Membership, PeerState};
use crate::routing::Candidate;
use crate::wire::{
    Control, ErrorClass, Event, GenerateCall, NodeAdvert, RemoteError, Reply, Request, TierAdvert,
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

/// What this node serves to peers (implemented by the node over its tier actors).
pub trait Service: Send + Sync + 'static {
    /// Tiers hosted here with live load.
    fn tiers(&self) -> Vec<TierAdvert>;
    /// Starts a generation on a local tier.
    fn generate(
        &self,
        call: GenerateCall,
    ) -> BoxFuture<'static, Result<mpsc::UnboundedReceiver<Event>, RemoteError>>;
    /// Tokenizes with a local tier.
    fn tokenize(
        &self,
        model: String,
        text: String,
    ) -> BoxFuture<'static, Result<Vec<i32>, RemoteError>>;
    /// Stored forms of the leading pages of `ids` held by a local tier (stops at the first
    /// missing one).
    fn fetch_pages(
        &self,
        model: String,
        salt: Vec<u8>,
        ids: Vec<Vec<u8>>,
    ) -> BoxFuture<'static, Vec<(Vec<u8>, Vec<u8>)>>;
}

/// Largest page frame accepted from a peer (pages of big models are MiB-sized).
pub const MAX_PAGE_FRAME: usize = 256 << 20;

/// Pages a peer sent for one pull: `(page id, stored bytes)` in prefix order.
pub type PulledPages = Vec<([u8; 32], Vec<u8>)>;

/// One page pull in flight, shared by every caller that wants the same pages.
type PagePull = Shared<BoxFuture<'static, Result<Arc<PulledPages>, CallError>>>;

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
    /// Seconds since the node's process started.
    pub uptime_s: u64,
    /// Milliseconds since its last heartbeat (0 for this node).
    pub last_seen_ms: u64,
}

struct Inner {
    me: String,
    endpoint: Endpoint,
    quic_addr: String,
    cfg: ClusterConfig,
    service: Arc<dyn Service>,
    started_ms: u64,
    members: Mutex<Membership>,
    conns: DashMap<String, quinn::Connection>,
    dialing: Mutex<HashSet<String>>,
    inflight: DashMap<String, Arc<AtomicU32>>,
    /// Page pulls in flight, by a hash of (peer, tier, salt, page ids).
    pulls: DashMap<[u8; 32], PagePull>,
    stopping: AtomicBool,
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

impl Cluster {
    /// Binds the QUIC endpoint, starts the accept and heartbeat loops, and dials the seeds.
    /// Fails if seeds were given and none could be reached (e.g. a certificate from another
    /// cluster: the handshake is refused).
    pub async fn start(
        endpoint: Endpoint,
        cfg: ClusterConfig,
        service: Arc<dyn Service>,
    ) -> Result<Self, String> {
        let me = endpoint.name().to_owned();
        let quic_addr = endpoint
            .local_addr()
            .map_err(|e| e.to_string())?
            .to_string();
        let inner = Arc::new(Inner {
            members: Mutex::new(Membership::new(me.clone())),
            me,
            endpoint,
            quic_addr,
            cfg,
            service,
            started_ms: now_ms(),
            conns: DashMap::new(),
            dialing: Mutex::new(HashSet::new()),
            inflight: DashMap::new(),
            pulls: DashMap::new(),
            stopping: AtomicBool::new(false),
        });
        let c = Cluster { inner };
        let acc = c.clone();
        tokio::spawn(async move {
            while let Some(pc) = acc.inner.endpoint.accept().await {
                acc.adopt(pc);
            }
        });
        let mut errors = vec![];
        let mut joined = c.inner.cfg.seeds.is_empty();
        for seed in c.inner.cfg.seeds.clone() {
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
            return Err(format!("no seed could be reached: {}", errors.join("; ")));
        }
        let tick = c.clone();
        tokio::spawn(async move { tick.ticker().await });
        Ok(c)
    }

    /// This node's name.
    pub fn name(&self) -> &str {
        &self.inner.me
    }

    /// The QUIC address peers dial.
    pub fn quic_addr(&self) -> &str {
        &self.inner.quic_addr
    }

    async fn dial_seed(&self, seed: &str) -> Result<String, String> {
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host(seed)
            .await
            .map_err(|e| format!("resolving: {e}"))?
            .collect();
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
        tokio::spawn(async move {
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
        debug!(%peer, remote = %conn.remote_address(), "connection up");
        self.inner.conns.insert(peer.clone(), conn.clone());
        // Introduce ourselves at once rather than at the next tick.
        self.send_heartbeat(conn.clone());
        let c = self.clone();
        let (p, cn) = (peer.clone(), conn.clone());
        tokio::spawn(async move {
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
                        c.on_conn_closed(&p, &cn, &e.to_string(), leaving);
                        return;
                    }
                }
            }
        });
        let c = self.clone();
        tokio::spawn(async move {
            while let Ok((send, recv)) = conn.accept_bi().await {
                let c = c.clone();
                let p = peer.clone();
                tokio::spawn(async move { c.serve(p, send, recv).await });
            }
        });
    }

    fn on_conn_closed(&self, peer: &str, conn: &quinn::Connection, why: &str, leaving: bool) {
        let current = self
            .inner
            .conns
            .remove_if(peer, |_, c| c.stable_id() == conn.stable_id())
            .is_some();
        if leaving {
            if self.inner.members.lock().expect("members").leave(peer) {
                info!(%peer, "peer left (connection closed by a leaving node)");
            }
            return;
        }
        if current && !self.inner.stopping.load(Ordering::Relaxed) {
            let was_alive = self.inner.members.lock().expect("members").fail(peer);
            if was_alive {
                warn!(%peer, reason = %why, "peer connection lost; peer marked dead");
            }
        }
    }

    async fn on_control(&self, peer: String, conn: quinn::Connection, mut recv: quinn::RecvStream) {
        let msg = match read_frame::<Control, _>(&mut recv, self.inner.cfg.max_frame).await {
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
                // A heartbeat on a connection we no longer hold (after a failure verdict) re-adopts it.
                self.inner
                    .conns
                    .entry(peer.clone())
                    .or_insert_with(|| conn.clone());
                let (change, unknown) = {
                    let mut m = self.inner.members.lock().expect("members");
                    let unknown = m.unknown(&advert);
                    (m.heartbeat(advert.clone(), Instant::now()), unknown)
                };
                let tiers: Vec<&str> = advert.tiers.iter().map(|t| t.name.as_str()).collect();
                match change {
                    Change::Joined => info!(%peer, addr = %advert.quic_addr, ?tiers, "peer joined"),
                    Change::Rejoined => {
                        info!(%peer, addr = %advert.quic_addr, ?tiers, "peer rejoined")
                    }
                    Change::Updated => {}
                }
                for p in unknown {
                    self.dial_peer(p.node, p.quic_addr);
                }
            }
            Control::Leave { node } => {
                if node == peer && self.inner.members.lock().expect("members").leave(&node) {
                    info!(%peer, "peer left");
                    self.inner
                        .conns
                        .remove_if(&peer, |_, c| c.stable_id() == conn.stable_id());
                }
            }
        }
    }

    fn advert(&self) -> NodeAdvert {
        NodeAdvert {
            node: self.inner.me.clone(),
            quic_addr: self.inner.quic_addr.clone(),
            http_addr: self.inner.cfg.http_addr.clone(),
            started_ms: self.inner.started_ms,
            tiers: self.inner.service.tiers(),
            peers: self.inner.members.lock().expect("members").gossip(),
        }
    }

    fn send_heartbeat(&self, conn: quinn::Connection) {
        let msg = Control::Heartbeat(self.advert());
        tokio::spawn(async move { send_control(&conn, &msg).await });
    }

    async fn ticker(&self) {
        let mut tick = tokio::time::interval(self.inner.cfg.heartbeat);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut n: u64 = 0;
        while !self.inner.stopping.load(Ordering::Relaxed) {
            tick.tick().await;
            n += 1;
            let msg = Control::Heartbeat(self.advert());
            for e in self.inner.conns.iter() {
                let (conn, msg) = (e.value().clone(), msg.clone());
                tokio::spawn(async move { send_control(&conn, &msg).await });
            }
            let dead = self
                .inner
                .members
                .lock()
                .expect("members")
                .sweep(Instant::now(), self.inner.cfg.failure_timeout);
            for peer in dead {
                warn!(%peer, timeout_ms = self.inner.cfg.failure_timeout.as_millis() as u64,
                    "no heartbeat; peer declared dead");
                if let Some((_, conn)) = self.inner.conns.remove(&peer) {
                    conn.close(CLOSE_DEAD.into(), b"declared dead: no heartbeat");
                }
            }
            // Seeds that restarted (or were down when we started) are dialed again.
            if n % 8 == 0 {
                let known: HashSet<String> = self
                    .inner
                    .members
                    .lock()
                    .expect("members")
                    .alive()
                    .map(|p| p.advert.quic_addr.clone())
                    .collect();
                for seed in &self.inner.cfg.seeds {
                    let seed_known = tokio::net::lookup_host(seed.as_str())
                        .await
                        .map(|mut a| a.any(|a| known.contains(&a.to_string())))
                        .unwrap_or(false);
                    if !seed_known {
                        let c = self.clone();
                        let seed = seed.clone();
                        tokio::spawn(async move {
                            if let Ok(peer) = c.dial_seed(&seed).await {
                                debug!(%seed, %peer, "re-dialed seed");
                            }
                        });
                    }
                }
            }
        }
    }

    /// Serves one call stream from `peer`.
    async fn serve(&self, peer: String, mut send: quinn::SendStream, mut recv: quinn::RecvStream) {
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
                let _ = write_frame(&mut send, &Reply::Pong { nonce, payload }).await;
            }
            Request::FetchPages { model, salt, ids } => {
                for (id, stored) in self.inner.service.fetch_pages(model, salt, ids).await {
                    if write_frame(&mut send, &Reply::Page { id, stored })
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            }
            Request::Tokenize { model, text } => {
                let reply = match self.inner.service.tokenize(model, text).await {
                    Ok(t) => Reply::Tokens(t),
                    Err(e) => Reply::Error(e),
                };
                let _ = write_frame(&mut send, &reply).await;
            }
            Request::Generate(call) => {
                let span = tracing::info_span!("cluster.serve_generate", mesh.peer = %peer,
                    gen_ai.request.model = %call.model, mesh.request_id = %call.request_id);
                let deadline = (call.deadline_ms > 0)
                    .then(|| tokio::time::Instant::now() + Duration::from_millis(call.deadline_ms));
                let started = self.inner.service.generate(call).instrument(span).await;
                let mut rx = match started {
                    Ok(rx) => rx,
                    Err(e) => {
                        let _ = write_frame(&mut send, &Reply::Error(e)).await;
                        let _ = send.finish();
                        return;
                    }
                };
                loop {
                    let ev = match deadline {
                        Some(d) => match tokio::time::timeout_at(d, rx.recv()).await {
                            Ok(ev) => ev,
                            Err(_) => {
                                let _ = write_frame(
                                    &mut send,
                                    &Reply::Error(RemoteError {
                                        class: ErrorClass::Deadline,
                                        message: "deadline passed".into(),
                                    }),
                                )
                                .await;
                                break;
                            }
                        },
                        None => rx.recv().await,
                    };
                    let Some(ev) = ev else { break };
                    let last = matches!(ev, Event::Done { .. } | Event::Error(_));
                    // A failed write means the caller went away: dropping `rx` cancels the sequence.
                    if write_frame(&mut send, &Reply::Event(ev)).await.is_err() || last {
                        break;
                    }
                }
            }
        }
        let _ = send.finish();
    }

    async fn open_call(
        &self,
        node: &str,
        req: &Request,
    ) -> Result<(quinn::SendStream, quinn::RecvStream), CallError> {
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
        let (mut send, recv) = conn.open_bi().await.map_err(|e| lost(&e))?;
        write_frame(&mut send, req).await.map_err(|e| lost(&e))?;
        Ok((send, recv))
    }

    async fn first_reply(
        &self,
        node: &str,
        recv: &mut quinn::RecvStream,
    ) -> Result<Reply, CallError> {
        match tokio::time::timeout(
            self.inner.cfg.call_timeout,
            read_frame::<Reply, _>(recv, self.inner.cfg.max_frame),
        )
        .await
        {
            Err(_) => Err(CallError::Timeout(node.to_owned())),
            Ok(Ok(Some(Reply::Error(e)))) => Err(CallError::Remote(e)),
            Ok(Ok(Some(r))) => Ok(r),
            Ok(Ok(None)) => Err(CallError::Lost {
                node: node.to_owned(),
                reason: "stream ended without a reply".into(),
            }),
            Ok(Err(e)) => Err(CallError::Lost {
                node: node.to_owned(),
                reason: e.to_string(),
            }),
        }
    }

    /// Tokenizes `text` with tier `model` on `node`.
    ///
    /// Cancel safety: cancel-safe (the stream is dropped).
    pub async fn tokenize(
        &self,
        node: &str,
        model: &str,
        text: &str,
    ) -> Result<Vec<i32>, CallError> {
        let (_send, mut recv) = self
            .open_call(
                node,
                &Request::Tokenize {
                    model: model.to_owned(),
                    text: text.to_owned(),
                },
            )
            .await?;
        match self.first_reply(node, &mut recv).await? {
            Reply::Tokens(t) => Ok(t),
            other => Err(unexpected(node, &other)),
        }
    }

    /// Fetches the leading pages of `ids` that `node` holds for tier `model`, in their stored
    /// form, on a stream of their own. The caller checks each page against its id and salt.
    ///
    /// Cancel safety: cancel-safe.
    ///
    /// Concurrent calls for the same pages of the same peer share one pull: when several
    /// requests with one prefix arrive together (agents started at once), the pages cross
    /// the wire once and every caller gets them.
    pub async fn fetch_pages(
        &self,
        node: &str,
        model: &str,
        salt: [u8; 32],
        ids: Vec<[u8; 32]>,
    ) -> Result<PulledPages, CallError> {
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
                    let got = this.pull_pages(&node, &model, salt, ids).await;
                    // Later calls start a fresh pull (the pages are stored by then, or the
                    // pull failed and deserves another try).
                    this.inner.pulls.remove(&key);
                    got.map(Arc::new)
                }
                .boxed()
                .shared();
                v.insert(pull.clone());
                pull
            }
        };
        pull.await.map(|pages| pages.as_ref().clone())
    }

    /// One page pull over its own stream.
    async fn pull_pages(
        &self,
        node: &str,
        model: &str,
        salt: [u8; 32],
        ids: Vec<[u8; 32]>,
    ) -> Result<PulledPages, CallError> {
        let req = Request::FetchPages {
            model: model.to_owned(),
            salt: salt.to_vec(),
            ids: ids.iter().map(|i| i.to_vec()).collect(),
        };
        let (_send, mut recv) = self.open_call(node, &req).await?;
        let mut out = vec![];
        loop {
            let frame = tokio::time::timeout(
                self.inner.cfg.call_timeout,
                read_frame::<Reply, _>(&mut recv, MAX_PAGE_FRAME),
            )
            .await
            .map_err(|_| CallError::Timeout(node.to_owned()))?;
            match frame {
                Ok(Some(Reply::Page { id, stored })) => {
                    let id: [u8; 32] = id.try_into().map_err(|_| CallError::Lost {
                        node: node.to_owned(),
                        reason: "page id of wrong length".into(),
                    })?;
                    out.push((id, stored));
                }
                Ok(Some(Reply::Error(e))) => return Err(CallError::Remote(e)),
                Ok(Some(other)) => return Err(unexpected(node, &other)),
                Ok(None) => return Ok(out),
                Err(e) => {
                    return Err(CallError::Lost {
                        node: node.to_owned(),
                        reason: e.to_string(),
                    })
                }
            }
        }
    }

    /// Live peers hosting `tier`, with their adverts for it.
    pub fn tier_adverts(&self, tier: &str) -> Vec<(String, TierAdvert)> {
        let m = self.inner.members.lock().expect("members");
        let out = m
            .alive()
            .filter(|p| self.inner.conns.contains_key(&p.advert.node))
            .filter_map(|p| {
                p.advert
                    .tiers
                    .iter()
                    .find(|t| t.name == tier)
                    .map(|t| (p.advert.node.clone(), t.clone()))
            })
            .collect();
        out
    }

    /// Round trip with a payload echoed back.
    ///
    /// Cancel safety: cancel-safe.
    pub async fn ping(&self, node: &str, payload: Vec<u8>) -> Result<Vec<u8>, CallError> {
        let (_send, mut recv) = self
            .open_call(node, &Request::Ping { nonce: 1, payload })
            .await?;
        match self.first_reply(node, &mut recv).await? {
            Reply::Pong { payload, .. } => Ok(payload),
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
    ) -> Result<mpsc::UnboundedReceiver<Result<Event, CallError>>, CallError> {
        let (send, mut recv) = self.open_call(node, &Request::Generate(call)).await?;
        let first = match self.first_reply(node, &mut recv).await? {
            Reply::Event(ev) => ev,
            other => return Err(unexpected(node, &other)),
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let _ = tx.send(Ok(first.clone()));
        let node = node.to_owned();
        let max = self.inner.cfg.max_frame;
        tokio::spawn(async move {
            let _send = send; // keep our half open until the call ends
            if matches!(first, Event::Done { .. } | Event::Error(_)) {
                return;
            }
            loop {
                let r = read_frame::<Reply, _>(&mut recv, max).await;
                let (item, last) = match r {
                    Ok(Some(Reply::Event(ev))) => {
                        let last = matches!(ev, Event::Done { .. } | Event::Error(_));
                        (Ok(ev), last)
                    }
                    Ok(Some(Reply::Error(e))) => (Err(CallError::Remote(e)), true),
                    Ok(Some(other)) => (Err(unexpected(&node, &other)), true),
                    Ok(None) => (
                        Err(CallError::Lost {
                            node: node.clone(),
                            reason: "stream ended before the generation finished".into(),
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

    /// Whether any peer, live or not, has advertised `tier` (a request for it is then "none
    /// available", not "unknown model").
    pub fn ever_hosted(&self, tier: &str) -> bool {
        let m = self.inner.members.lock().expect("members");
        let found = m
            .all()
            .any(|p| p.advert.tiers.iter().any(|t| t.name == tier));
        found
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
        let me = MemberView {
            node: self.inner.me.clone(),
            local: true,
            quic_addr: self.inner.quic_addr.clone(),
            http_addr: self.inner.cfg.http_addr.clone(),
            state: "alive",
            tiers: self.inner.service.tiers(),
            uptime_s: now.saturating_sub(self.inner.started_ms) / 1000,
            last_seen_ms: 0,
        };
        let m = self.inner.members.lock().expect("members");
        std::iter::once(me)
            .chain(m.all().map(|p| MemberView {
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
                uptime_s: now.saturating_sub(p.advert.started_ms) / 1000,
                last_seen_ms: p.last_seen.elapsed().as_millis() as u64,
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
        info!("left the cluster");
    }
}

fn unexpected(node: &str, r: &Reply) -> CallError {
    CallError::Lost {
        node: node.to_owned(),
        reason: format!("unexpected reply {r:?}"),
    }
}

fn refuse(peer: &str, e: &FrameError) {
    warn!(%peer, code = e.code(), error = %e, "refused frame; stream closed");
}

async fn send_control(conn: &quinn::Connection, msg: &Control) {
    let Ok(mut s) = conn.open_uni().await else {
        return;
    };
    if write_frame(&mut s, msg).await.is_ok() {
        let _ = s.finish();
        if matches!(msg, Control::Leave { .. }) {
            // Wait until the peer has read it: the connection closes right after.
            let _ = s.stopped().await;
        }
    }
}
