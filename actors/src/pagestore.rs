//! The KV page store actor: owns a node's page stores (RAM, far memory and disk tiers, the
//! disk writer, eviction) and the page set the node advertises, and serves the node's
//! engines and its peers.
//!
//! ```text
//! engine thread ─PageClient (PageBackend)─▶ StoreMsg::{Held, Prefix, Put, Dedup} ─┐
//! dispatcher (pull from a peer)          ─▶ StoreMsg::{Held, PutStored}          ─┤
//! peer (remote call "kv-store")          ─▶ StoreMsg::{GetStored, PutStored}     ─┼─▶ PageStoreActor
//! membership (every heartbeat)           ─▶ StoreMsg::Advert                     ─┘    ns ─▶ PageStore
//! ```
//!
//! Every advert also takes what each store changed (stored or removed, at any level) and
//! records it in the node's [`PageLog`]: numbered page events that the membership sends to
//! peers, which keep their page index in step with them; a peer that is new or missed
//! some asks for them (remote call `page-log`, answered from the log without the actor).
//!
//! One store per *namespace*: a tier's pages (namespace = tier name), a variant engine's
//! (its engine id), or, on a `store` node, the pages peers demote to it (namespace = the
//! tier they came from). Page reads that may touch the disk run on the blocking pool, so the
//! mailbox keeps moving while a page is read.
//!
//! **Restarts.** The namespaces and their configs live outside the actor (in
//! [`PageStores`]), so the next incarnation opens them again: pages on disk come back,
//! pages only in RAM are lost. An engine calling during the restart waits for it (bounded)
//! and otherwise reads "not stored", so it prefills instead: a restart costs recomputation,
//! never a wrong page.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use mesh_kvstore::{
    Changes, EvictSink, LogEntry, Observed, PageBackend, PageId, PageLog, PageMeta, PageStore,
    PageStoreOpener, Salt, StoreConfig, StoreStats,
};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tracing::{debug, warn};

use crate::supervisor::{self, ActorSlot};

/// Messages of [`PageStoreActor`].
#[derive(Debug)]
pub enum StoreMsg {
    /// Open `ns` with `cfg` unless it is open.
    Open {
        /// Namespace.
        ns: String,
        /// Budgets and folders.
        cfg: StoreConfig,
        /// Answered once open.
        reply: RpcReplyPort<()>,
    },
    /// Which of `ids` are stored in `ns`.
    Held {
        /// Namespace.
        ns: String,
        /// Page ids.
        ids: Vec<PageId>,
        /// One flag per id.
        reply: RpcReplyPort<Vec<bool>>,
    },
    /// How many leading pages of `ids` `ns` holds, and when more than `beyond`, the
    /// payloads of those that pass their checks (see [`PageBackend::prefix`]).
    Prefix {
        /// Namespace.
        ns: String,
        /// Page ids, in prefix order.
        ids: Vec<PageId>,
        /// The pages' salt.
        salt: Salt,
        /// Pages the asking sequence holds in place already.
        beyond: usize,
        /// `(stored run, payloads)`.
        reply: RpcReplyPort<(usize, Vec<Bytes>)>,
    },
    /// Store new pages (payloads) in `ns`.
    Put {
        /// Namespace.
        ns: String,
        /// Pages.
        pages: Vec<(PageMeta, Bytes)>,
    },
    /// Count pages not stored again (dedup).
    Dedup {
        /// Namespace.
        ns: String,
        /// How many.
        pages: usize,
        /// Payload bytes of each.
        payload_bytes: usize,
    },
    /// Stored forms (header + payload, checked) of the leading pages of `ids` in `ns`, for a
    /// peer; stops at the first page not held.
    GetStored {
        /// Namespace.
        ns: String,
        /// The pages' salt.
        salt: Salt,
        /// Page ids, in prefix order.
        ids: Vec<PageId>,
        /// `(id, stored form)` in order.
        reply: RpcReplyPort<Vec<(PageId, Bytes)>>,
    },
    /// Store pages a peer demoted here (stored forms, each checked against its own header)
    /// in `ns`, whose pages have salt base `base` and `block` tokens (advertised with them).
    /// Answers how many were taken.
    PutDemoted {
        /// Namespace (the tier they came from).
        ns: String,
        /// Salt base of the namespace.
        base: [u8; 32],
        /// Tokens per page.
        block: u32,
        /// `(id, stored form)`.
        pages: Vec<(PageId, Bytes)>,
        /// Pages stored.
        reply: RpcReplyPort<usize>,
    },
    /// Store pages a peer sent in stored form in `ns` (opened with the default config when
    /// new); each is checked against its id and `salt`. Answers how many were taken.
    PutStored {
        /// Namespace.
        ns: String,
        /// The pages' salt.
        salt: Salt,
        /// `(id, stored form)`.
        pages: Vec<(PageId, Bytes)>,
        /// Pages stored (refused ones are counted as corrupt).
        reply: RpcReplyPort<usize>,
    },
    /// Short ids (first 8 bytes) of up to `limit` pages per namespace, most recently used
    /// first: the page set this node advertises; and the page events since the last
    /// `Advert` (recorded in the node's [`PageLog`]).
    Advert {
        /// Ids per namespace.
        limit: usize,
        /// The ids and the new events.
        reply: RpcReplyPort<AdvertPages>,
    },
    /// The counters of every namespace.
    Stats(RpcReplyPort<Vec<NamespaceStats>>),
    /// Fault injection: the actor panics.
    Crash,
}

/// What a heartbeat says about this node's pages.
#[derive(Debug, Clone, Default)]
pub struct AdvertPages {
    /// `(namespace, short ids)`: up to the advert's limit each, most recently used first
    /// (what peers without the `page-log` capability index).
    pub ids: Vec<(String, Vec<u64>)>,
    /// The page events since the previous advert, when anything changed.
    pub entry: Option<LogEntry>,
    /// The log's seq after them.
    pub seq: u64,
    /// Pages held, over every namespace.
    pub held: usize,
}

/// Page events a node keeps for peers that fall behind (about a minute of heartbeat
/// periods in which pages changed).
const LOG_KEEP: usize = 256;

/// Counters of one namespace (metrics).
#[derive(Debug, Clone)]
pub struct NamespaceStats {
    /// Namespace.
    pub ns: String,
    /// Its store's counters.
    pub stats: Arc<StoreStats>,
    /// Far-memory NUMA nodes, when the store has a far tier.
    pub far_nodes: Option<Vec<u32>>,
}

/// A page this node's store let go of, on its way to a store peer.
#[derive(Debug, Clone)]
pub struct Demoted {
    /// Namespace.
    pub ns: String,
    /// Page id.
    pub id: PageId,
    /// Stored form.
    pub stored: Bytes,
}

/// The namespaces of a node and their configs: what survives a restart of the actor.
#[derive(Debug, Clone)]
pub struct PageStores {
    configs: Arc<Mutex<BTreeMap<String, StoreConfig>>>,
    /// Page parameters of namespaces peers demoted pages into: `(salt base, block)`.
    foreign: Arc<Mutex<BTreeMap<String, ([u8; 32], u32)>>>,
    /// Where pages evicted with no other copy go (set once the node has a store peer).
    demote: Arc<Mutex<Option<tokio::sync::mpsc::UnboundedSender<Demoted>>>>,
    /// Config of namespaces peers create (pages demoted to a store node).
    default: Arc<StoreConfig>,
    /// The node's page events (kept across restarts of the actor: peers follow its seq).
    log: Arc<Mutex<PageLog>>,
    /// Namespaces opened since the last advert: their next events compare everything
    /// they hold (a restart lost the pages only in RAM).
    fresh: Arc<Mutex<BTreeSet<String>>>,
    slot: Arc<ActorSlot<StoreMsg>>,
}

impl PageStores {
    /// Namespaces opened on demand get `default` (a store node's `--kv-dir` and budgets;
    /// its disk folder gets one subfolder per namespace).
    pub fn new(default: StoreConfig) -> Self {
        Self {
            configs: Arc::default(),
            foreign: Arc::default(),
            demote: Arc::default(),
            default: Arc::new(default),
            log: Arc::new(Mutex::new(PageLog::new(LOG_KEEP))),
            fresh: Arc::default(),
            slot: Arc::default(),
        }
    }

    /// What a peer at page-event seq `seq` lacks (`None`: everything): the events after it,
    /// or a snapshot.
    pub fn log_since(&self, seq: Option<u64>) -> LogEntry {
        self.log
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .since(seq)
    }

    /// Sends the pages engines' stores let go of (evicted with no far or disk copy) to `tx`
    /// (the node forwards them to a store peer).
    pub fn demote_to(&self, tx: tokio::sync::mpsc::UnboundedSender<Demoted>) {
        *self.demote.lock().unwrap_or_else(PoisonError::into_inner) = Some(tx);
    }

    /// Namespaces whose pages peers demoted here, with their `(salt base, block)`.
    pub fn foreign(&self) -> BTreeMap<String, ([u8; 32], u32)> {
        self.foreign
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The running incarnation (for its supervisor and callers).
    pub fn slot(&self) -> &Arc<ActorSlot<StoreMsg>> {
        &self.slot
    }

    fn configs(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, StoreConfig>> {
        self.configs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn default_for(&self, ns: &str) -> StoreConfig {
        let mut c = (*self.default).clone();
        c.disk_dir = c.disk_dir.map(|d| d.join(ns));
        c
    }

    /// A client of namespace `ns`, which engines use from their own thread. Its calls
    /// block that thread; they need `runtime` to run on.
    pub fn client(&self, ns: &str, runtime: tokio::runtime::Handle) -> PageClient {
        PageClient {
            stores: self.clone(),
            ns: ns.to_owned(),
            runtime,
        }
    }

    /// An opener for engine configs ([`mesh_tiers::EngineConfig::page_store`]).
    pub fn opener(&self, runtime: tokio::runtime::Handle) -> Arc<dyn PageStoreOpener> {
        Arc::new(Opener {
            stores: self.clone(),
            runtime,
        })
    }

    /// Calls the actor; waits out a restart once (see [`supervisor::call`]).
    ///
    /// Cancel safety: cancel-safe.
    pub async fn call<R: Send + 'static>(
        &self,
        make: impl Fn(RpcReplyPort<R>) -> StoreMsg,
    ) -> Result<R, supervisor::ActorCallError> {
        supervisor::call(&self.slot, "kv-store", RESTART_WAIT, CALL_TIMEOUT, make).await
    }

    /// Sends without waiting for an answer (dropped while the actor is down).
    pub fn cast(&self, msg: StoreMsg) {
        if let Some(a) = self.slot.get() {
            let _ = a.send_message(msg);
        }
    }
}

/// The remote protocol of page stores: peers fetch prefix pages, and compute nodes demote
/// pages to a store node.
#[derive(Debug, Clone, Copy)]
pub struct StoreProtocol;

/// The remote protocol of a node's page events: a peer that is new or missed events asks
/// for them ([`crate::wire::PageLogCall`]).
#[derive(Debug, Clone, Copy)]
pub struct PageLogProtocol;

impl crate::remote::Protocol for PageLogProtocol {
    const ACTOR: &'static str = "page-log";
    /// A snapshot of a million pages is 8 MiB of ids.
    const MAX_ITEM: usize = 64 << 20;
    type Call = crate::wire::PageLogCall;
    type Item = crate::wire::PageLogItem;
}

impl crate::remote::Protocol for StoreProtocol {
    const ACTOR: &'static str = "kv-store";
    const MAX_ITEM: usize = crate::cluster::MAX_PAGE_FRAME;
    const MAX_CALL: usize = crate::cluster::MAX_PAGE_FRAME;
    type Call = crate::wire::StoreCall;
    type Item = crate::wire::StoreItem;
}

/// Hands a namespace's lost pages to the node's demotion channel.
#[derive(Debug)]
struct NsSink {
    ns: String,
    demote: Arc<Mutex<Option<tokio::sync::mpsc::UnboundedSender<Demoted>>>>,
}

impl EvictSink for NsSink {
    fn evicted(&self, id: PageId, stored: Bytes) {
        if let Some(tx) = self
            .demote
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
        {
            let _ = tx.send(Demoted {
                ns: self.ns.clone(),
                id,
                stored,
            });
        }
    }
}

/// How long a call waits for a restarting store.
const RESTART_WAIT: Duration = Duration::from_secs(1);
/// Longest a store call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct Opener {
    stores: PageStores,
    runtime: tokio::runtime::Handle,
}

impl PageStoreOpener for Opener {
    fn open(&self, namespace: &str, cfg: StoreConfig) -> Arc<dyn PageBackend> {
        self.stores
            .configs()
            .insert(namespace.to_owned(), cfg.clone());
        let ns = namespace.to_owned();
        let r = self
            .runtime
            .block_on(self.stores.call(|reply| StoreMsg::Open {
                ns: ns.clone(),
                cfg: cfg.clone(),
                reply,
            }));
        if let Err(e) = r {
            warn!(namespace, error = %e, "opening KV pages; the engine starts without them until the store is back");
        }
        Arc::new(self.stores.client(namespace, self.runtime.clone()))
    }
}

/// The pages of one namespace, reached through the page-store actor. Every call blocks
/// the calling thread (an engine's); a failed call reads as "nothing stored".
#[derive(Debug, Clone)]
pub struct PageClient {
    stores: PageStores,
    ns: String,
    runtime: tokio::runtime::Handle,
}

impl PageClient {
    fn ask<R: Send + 'static>(&self, make: impl Fn(RpcReplyPort<R>) -> StoreMsg, fallback: R) -> R {
        match self.runtime.block_on(self.stores.call(make)) {
            Ok(r) => r,
            Err(e) => {
                debug!(namespace = %self.ns, error = %e, "KV page store call failed; treated as not stored");
                fallback
            }
        }
    }
}

impl PageBackend for PageClient {
    fn held(&self, ids: &[PageId]) -> Vec<bool> {
        if ids.is_empty() {
            return vec![];
        }
        let fallback = vec![false; ids.len()];
        self.ask(
            |reply| StoreMsg::Held {
                ns: self.ns.clone(),
                ids: ids.to_vec(),
                reply,
            },
            fallback,
        )
    }

    fn prefix(&self, ids: &[PageId], salt: &Salt, beyond: usize) -> (usize, Vec<Bytes>) {
        if ids.is_empty() {
            return (0, vec![]);
        }
        self.ask(
            |reply| StoreMsg::Prefix {
                ns: self.ns.clone(),
                ids: ids.to_vec(),
                salt: *salt,
                beyond,
                reply,
            },
            (0, vec![]),
        )
    }

    fn put(&self, pages: Vec<(PageMeta, Bytes)>) {
        if pages.is_empty() {
            return;
        }
        self.stores.cast(StoreMsg::Put {
            ns: self.ns.clone(),
            pages,
        });
    }

    fn note_dedup(&self, pages: usize, payload_bytes: usize) {
        self.stores.cast(StoreMsg::Dedup {
            ns: self.ns.clone(),
            pages,
            payload_bytes,
        });
    }

    fn stats(&self) -> Arc<StoreStats> {
        let all = self.ask(StoreMsg::Stats, vec![]);
        all.into_iter()
            .find(|s| s.ns == self.ns)
            .map(|s| s.stats)
            .unwrap_or_default()
    }
}

/// The page-store actor (see the module docs).
#[derive(Debug, Default, Clone, Copy)]
pub struct PageStoreActor;

/// State of [`PageStoreActor`]: the open stores.
#[derive(Debug)]
pub struct StoreState {
    stores: PageStores,
    open: BTreeMap<String, Arc<PageStore>>,
}

impl StoreState {
    fn get(&mut self, ns: &str) -> Option<Arc<PageStore>> {
        if let Some(s) = self.open.get(ns) {
            return Some(s.clone());
        }
        // Opened by an earlier incarnation (its config is kept): open again.
        let cfg = self.stores.configs().get(ns).cloned()?;
        Some(self.open_ns(ns, cfg))
    }

    fn get_or_default(&mut self, ns: &str) -> Arc<PageStore> {
        match self.get(ns) {
            Some(s) => s,
            None => {
                let cfg = self.stores.default_for(ns);
                self.stores.configs().insert(ns.to_owned(), cfg.clone());
                self.open_ns(ns, cfg)
            }
        }
    }

    fn open_ns(&mut self, ns: &str, cfg: StoreConfig) -> Arc<PageStore> {
        let s = Arc::new(PageStore::open(cfg));
        self.stores
            .fresh
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(ns.to_owned());
        // Pages an engine's store lets go of may go to a store peer; a store node's own
        // namespaces keep theirs.
        if !self.stores.foreign().contains_key(ns) {
            s.set_evict_sink(Arc::new(NsSink {
                ns: ns.to_owned(),
                demote: self.stores.demote.clone(),
            }));
        }
        self.open.insert(ns.to_owned(), s.clone());
        s
    }
}

/// What `store` changed since the last advert, in short ids; everything it holds when
/// `fresh` (just opened).
fn observed(store: &PageStore, fresh: bool) -> Observed {
    let changes = store.take_changes();
    let short = |ids: Vec<PageId>| ids.iter().map(PageId::short).collect();
    match changes {
        Changes::All(ids) => Observed::All(short(ids)),
        Changes::Touched(_) if fresh => Observed::All(short(store.held_ids())),
        Changes::Touched(ids) => Observed::Touched(
            ids.into_iter()
                .map(|(id, held)| (id.short(), held))
                .collect(),
        ),
    }
}

/// Runs `f` on the blocking pool and answers with its result (the mailbox moves on).
fn off_thread<R: Send + 'static>(reply: RpcReplyPort<R>, f: impl FnOnce() -> R + Send + 'static) {
    tokio::task::spawn_blocking(move || {
        let _ = reply.send(f());
    });
}

impl Actor for PageStoreActor {
    type Msg = StoreMsg;
    type State = StoreState;
    type Arguments = PageStores;

    async fn pre_start(
        &self,
        _myself: ActorRef<StoreMsg>,
        stores: PageStores,
    ) -> Result<StoreState, ActorProcessingErr> {
        let configs = stores.configs().clone();
        let mut state = StoreState {
            stores,
            open: BTreeMap::new(),
        };
        // Opening indexes each disk folder; an earlier incarnation's namespaces come back.
        for (ns, cfg) in configs {
            state.open_ns(&ns, cfg);
        }
        Ok(state)
    }

    async fn handle(
        &self,
        _myself: ActorRef<StoreMsg>,
        msg: StoreMsg,
        state: &mut StoreState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            StoreMsg::Open { ns, cfg, reply } => {
                if !state.open.contains_key(&ns) {
                    state.stores.configs().insert(ns.clone(), cfg.clone());
                    state.open_ns(&ns, cfg);
                }
                let _ = reply.send(());
            }
            StoreMsg::Held { ns, ids, reply } => {
                let held = match state.get(&ns) {
                    Some(s) => ids.iter().map(|id| s.contains(id)).collect(),
                    None => vec![false; ids.len()],
                };
                let _ = reply.send(held);
            }
            StoreMsg::Prefix {
                ns,
                ids,
                salt,
                beyond,
                reply,
            } => match state.get(&ns) {
                Some(s) => {
                    let stored = ids.iter().take_while(|id| s.contains(id)).count();
                    if stored <= beyond {
                        let _ = reply.send((stored, vec![]));
                    } else if ids[..stored].iter().all(|id| s.in_ram(id)) {
                        // RAM only: no file to read, answered here.
                        let _ = reply.send((stored, s.longest_prefix(&ids[..stored], &salt)));
                    } else {
                        off_thread(reply, move || {
                            let pages = s.longest_prefix(&ids[..stored], &salt);
                            (stored, pages)
                        });
                    }
                }
                None => {
                    let _ = reply.send((0, vec![]));
                }
            },
            StoreMsg::Put { ns, pages } => {
                let s = state.get_or_default(&ns);
                for (meta, payload) in pages {
                    s.put(&meta, &payload);
                }
            }
            StoreMsg::Dedup {
                ns,
                pages,
                payload_bytes,
            } => {
                if let Some(s) = state.get(&ns) {
                    PageBackend::note_dedup(s.as_ref(), pages, payload_bytes);
                }
            }
            StoreMsg::GetStored {
                ns,
                salt,
                ids,
                reply,
            } => match state.get(&ns) {
                Some(s) => off_thread(reply, move || {
                    let mut out = vec![];
                    for id in ids {
                        match s.get_stored(&id, &salt) {
                            Some(b) => out.push((id, b)),
                            None => break,
                        }
                    }
                    out
                }),
                None => {
                    let _ = reply.send(vec![]);
                }
            },
            StoreMsg::PutDemoted {
                ns,
                base,
                block,
                pages,
                reply,
            } => {
                state
                    .stores
                    .foreign
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(ns.clone(), (base, block));
                let s = state.get_or_default(&ns);
                off_thread(reply, move || {
                    pages
                        .into_iter()
                        .filter(|(id, stored)| s.put_demoted(id, stored.clone()))
                        .count()
                });
            }
            StoreMsg::PutStored {
                ns,
                salt,
                pages,
                reply,
            } => {
                let s = state.get_or_default(&ns);
                off_thread(reply, move || {
                    pages
                        .into_iter()
                        .filter(|(id, stored)| s.put_fetched(id, &salt, stored.clone()))
                        .count()
                });
            }
            StoreMsg::Advert { limit, reply } => {
                let ids = state
                    .open
                    .iter()
                    .map(|(ns, s)| {
                        let ids = s.recent_ids(limit).iter().map(PageId::short).collect();
                        (ns.clone(), ids)
                    })
                    .collect();
                let fresh = std::mem::take(
                    &mut *state
                        .stores
                        .fresh
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner),
                );
                let seen = state
                    .open
                    .iter()
                    .map(|(ns, s)| (ns.clone(), observed(s, fresh.contains(ns))))
                    .collect();
                let mut log = state
                    .stores
                    .log
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                let entry = log.record(seen);
                let _ = reply.send(AdvertPages {
                    ids,
                    entry,
                    seq: log.seq(),
                    held: log.len(),
                });
            }
            StoreMsg::Stats(reply) => {
                let out = state
                    .open
                    .iter()
                    .map(|(ns, s)| NamespaceStats {
                        ns: ns.clone(),
                        stats: s.stats().clone(),
                        far_nodes: s.far_nodes(),
                    })
                    .collect();
                let _ = reply.send(out);
            }
            StoreMsg::Crash => panic!("kv-store: crash injected"),
        }
        Ok(())
    }
}
