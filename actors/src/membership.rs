//! The membership table: who is in the cluster, what they host, who has gone
//! quiet. A deterministic state machine (time is passed in): [`Membership::step`] takes an
//! [`Input`] (a heartbeat, a leave, a closed connection, a period's tick) and returns the
//! [`Effect`]s the driver performs (dial a peer, close a dead peer's connection, re-dial
//! the seeds, report a change). The driver is the membership actor
//! ([`crate::cluster::MembershipActor`]), which owns the connections and the timer.
//!
//! ```text
//!            heartbeat                 no heartbeat for failure_timeout
//!   (new) ─────────────▶ Alive ────────────────────────────────────────▶ Dead
//!                          ▲ │ Leave                                      │
//!                          │ ▼                                            │
//!                          │ Left                                         │
//!                          └──────────── heartbeat (rejoin) ◀─────────────┘
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use mesh_kvstore::{PageSpace, PrefixIndex};

use crate::wire::{NodeAdvert, PageLogEntry, PeerAddr};

/// The capability of a peer that sends page events ([`crate::wire::Control::Pages`]).
pub const PAGE_LOG: &str = "page-log";

/// Liveness of a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerState {
    /// Heartbeats arrive.
    Alive,
    /// Missed heartbeats for longer than the failure timeout.
    Dead,
    /// Said goodbye.
    Left,
}

/// One peer as this node knows it.
#[derive(Debug, Clone)]
pub struct Peer {
    /// Latest advert.
    pub advert: NodeAdvert,
    /// Liveness.
    pub state: PeerState,
    /// When the latest heartbeat arrived.
    pub last_seen: Instant,
    /// When this incarnation was first seen.
    pub since: Instant,
}

/// What a heartbeat changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// First time this node is seen.
    Joined,
    /// A dead or departed node is back, or the node restarted (new start time).
    Rejoined,
    /// Nothing but the advert changed.
    Updated,
}

/// What happens to the table.
#[derive(Debug, Clone)]
pub enum Input {
    /// A heartbeat from `advert.node` (its certificate checked by the driver).
    Heartbeat(NodeAdvert),
    /// The peer said goodbye.
    Leave(String),
    /// A connection to the peer closed.
    Closed {
        /// The peer.
        node: String,
        /// It was the connection the driver held for the peer (not an older one).
        current: bool,
        /// The peer closed it while leaving.
        leaving: bool,
    },
    /// One heartbeat period passed (the driver has sent this node's heartbeats).
    Tick,
    /// A peer's page events, pushed by it.
    Pages {
        /// The peer.
        node: String,
        /// Its process start time.
        started_ms: u64,
        /// The events.
        entry: PageLogEntry,
    },
    /// The answer to an [`Effect::FetchPages`] (`None`: the call failed).
    PageLog {
        /// The peer.
        node: String,
        /// Its process start time when the fetch was asked for.
        started_ms: u64,
        /// Its events or snapshot.
        entry: Option<PageLogEntry>,
    },
}

/// Why a peer was declared dead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeathCause {
    /// No heartbeat for the failure timeout.
    Silent,
    /// Its connection closed.
    ConnectionLost,
}

/// What the driver does after a [`Membership::step`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Connect to a peer gossip named that this node has no live entry for.
    Dial {
        /// The peer.
        node: String,
        /// Its QUIC address.
        addr: String,
    },
    /// Close the connection to a peer declared dead for silence.
    Close(String),
    /// Dial again every seed that is none of these live peers' addresses (every
    /// [`SEED_PERIODS`] periods: seeds that restarted or were down at start).
    RedialSeeds {
        /// QUIC addresses of the live peers.
        known: Vec<String>,
    },
    /// A peer joined (first seen).
    Joined(String),
    /// A peer came back (after death or departure, or restarted).
    Rejoined(String),
    /// A peer left gracefully.
    Left(String),
    /// A peer was declared dead.
    Died(String, DeathCause),
    /// Ask a peer for its page events after `since` (`None`: a snapshot), and hand the
    /// answer back as [`Input::PageLog`].
    FetchPages {
        /// The peer.
        node: String,
        /// Its process start time.
        started_ms: u64,
        /// The seq applied so far.
        since: Option<u64>,
    },
}

/// How this node follows one peer's page events.
#[derive(Debug, Clone)]
struct PageSync {
    started_ms: u64,
    /// The seq applied; `None` until a snapshot arrived (the index holds the advert's
    /// capped list meanwhile).
    seq: Option<u64>,
    /// When the fetch under way was asked for.
    fetching: Option<Instant>,
    /// Namespace → page space, from the advert the events are followed under.
    spaces: BTreeMap<String, PageSpace>,
}

/// Seeds are re-dialed every this many periods.
pub const SEED_PERIODS: u64 = 8;

/// A fetch of page events not answered in this long counts as failed (the call's own
/// deadline is shorter).
pub const FETCH_GIVE_UP: Duration = Duration::from_secs(60);

/// An unchanged gossip list is sent again every this many periods.
pub const GOSSIP_PERIODS: u64 = 8;

/// The table.
#[derive(Debug)]
pub struct Membership {
    me: String,
    peers: BTreeMap<String, Peer>,
    /// Every tier name a peer has advertised, also after it stopped (an engine restarting).
    hosted: BTreeSet<String>,
    /// Every live peer's pages (its tiers' and its store's), for routing.
    index: PrefixIndex,
    /// Peers whose page events this node follows (they have the `page-log` capability).
    sync: BTreeMap<String, PageSync>,
    /// Silence after which a peer is declared dead.
    failure_timeout: Duration,
    /// Periods ticked.
    ticks: u64,
    /// The gossip list last sent in a period's heartbeats, and the tick it was sent at.
    gossip_sent: Vec<PeerAddr>,
    gossip_sent_at: u64,
}

impl Membership {
    /// Empty table for node `me`, declaring peers dead after `failure_timeout` of silence.
    pub fn new(me: impl Into<String>, failure_timeout: Duration) -> Self {
        Self {
            me: me.into(),
            peers: BTreeMap::new(),
            hosted: BTreeSet::new(),
            index: PrefixIndex::new(),
            sync: BTreeMap::new(),
            failure_timeout,
            ticks: 0,
            gossip_sent: vec![],
            gossip_sent_at: 0,
        }
    }

    /// Silence after which a peer is declared dead.
    pub fn failure_timeout(&self) -> Duration {
        self.failure_timeout
    }

    /// Applies `input` at `now`; returns what the driver must do, in order.
    pub fn step(&mut self, input: Input, now: Instant) -> Vec<Effect> {
        match input {
            Input::Heartbeat(advert) => {
                let node = advert.node.clone();
                let mut out: Vec<Effect> = self
                    .unknown(&advert)
                    .into_iter()
                    .map(|p| Effect::Dial {
                        node: p.node,
                        addr: p.quic_addr,
                    })
                    .collect();
                let fetch = self.follow(&advert, now);
                match self.heartbeat(advert, now) {
                    Change::Joined => out.insert(0, Effect::Joined(node)),
                    Change::Rejoined => out.insert(0, Effect::Rejoined(node)),
                    Change::Updated => {}
                }
                out.extend(fetch);
                out
            }
            Input::Pages {
                node,
                started_ms,
                entry,
            } => self
                .pushed(&node, started_ms, &entry, now)
                .into_iter()
                .collect(),
            Input::PageLog {
                node,
                started_ms,
                entry,
            } => {
                self.fetched(&node, started_ms, entry);
                vec![]
            }
            Input::Leave(node) => {
                if self.leave(&node) {
                    vec![Effect::Left(node)]
                } else {
                    vec![]
                }
            }
            Input::Closed {
                node,
                current,
                leaving,
            } => {
                if leaving {
                    if self.leave(&node) {
                        return vec![Effect::Left(node)];
                    }
                } else if current && self.fail(&node) {
                    return vec![Effect::Died(node, DeathCause::ConnectionLost)];
                }
                vec![]
            }
            Input::Tick => {
                self.ticks += 1;
                let mut out = vec![];
                for node in self.sweep(now, self.failure_timeout) {
                    out.push(Effect::Died(node.clone(), DeathCause::Silent));
                    out.push(Effect::Close(node));
                }
                if self.ticks % SEED_PERIODS == 0 {
                    out.push(Effect::RedialSeeds {
                        known: self.alive().map(|p| p.advert.quic_addr.clone()).collect(),
                    });
                }
                out
            }
        }
    }

    /// Records a heartbeat.
    fn heartbeat(&mut self, advert: NodeAdvert, now: Instant) -> Change {
        for t in &advert.tiers {
            if !self.hosted.contains(&t.name) {
                self.hosted.insert(t.name.clone());
            }
        }
        let changed = self
            .peers
            .get(&advert.node)
            .is_none_or(|p| p.state != PeerState::Alive || !same_pages(&p.advert, &advert));
        let synced = self.sync.get(&advert.node).is_some_and(|s| s.seq.is_some());
        if changed && !synced {
            self.index.set_node(&advert.node, spaces(&advert));
        }
        match self.peers.get_mut(&advert.node) {
            None => {
                self.peers.insert(
                    advert.node.clone(),
                    Peer {
                        advert,
                        state: PeerState::Alive,
                        last_seen: now,
                        since: now,
                    },
                );
                Change::Joined
            }
            Some(p) => {
                let restarted = p.advert.started_ms != advert.started_ms;
                let back = p.state != PeerState::Alive;
                p.advert = advert;
                p.last_seen = now;
                p.state = PeerState::Alive;
                if restarted || back {
                    p.since = now;
                    Change::Rejoined
                } else {
                    Change::Updated
                }
            }
        }
    }

    /// Records a graceful leave; true if the node was alive.
    fn leave(&mut self, node: &str) -> bool {
        match self.peers.get_mut(node) {
            Some(p) if p.state == PeerState::Alive => {
                p.state = PeerState::Left;
                self.index.remove_node(node);
                self.sync.remove(node);
                true
            }
            _ => false,
        }
    }

    /// Marks a peer dead now (its connection closed); true if it was alive.
    fn fail(&mut self, node: &str) -> bool {
        match self.peers.get_mut(node) {
            Some(p) if p.state == PeerState::Alive => {
                p.state = PeerState::Dead;
                self.index.remove_node(node);
                self.sync.remove(node);
                true
            }
            _ => false,
        }
    }

    /// Marks peers silent for longer than `timeout` dead; returns them.
    fn sweep(&mut self, now: Instant, timeout: Duration) -> Vec<String> {
        let mut dead = vec![];
        for (name, p) in &mut self.peers {
            if p.state == PeerState::Alive && now.saturating_duration_since(p.last_seen) > timeout {
                p.state = PeerState::Dead;
                dead.push(name.clone());
            }
        }
        for name in &dead {
            self.index.remove_node(name);
            self.sync.remove(name);
        }
        dead
    }

    /// Starts or keeps following the page events of the peer whose heartbeat this is
    /// (before the heartbeat is recorded); returns the fetch to make, if any. A peer that
    /// is new, back, restarted or changed its namespaces is followed afresh from a
    /// snapshot.
    fn follow(&mut self, advert: &NodeAdvert, now: Instant) -> Option<Effect> {
        let node = &advert.node;
        if !advert.capabilities.iter().any(|c| c == PAGE_LOG) {
            self.sync.remove(node);
            return None;
        }
        let spaces: BTreeMap<String, PageSpace> =
            spaces(advert).map(|(sp, _)| (sp.ns.clone(), sp)).collect();
        let alive = self
            .peers
            .get(node)
            .is_some_and(|p| p.state == PeerState::Alive);
        let keep = alive
            && self
                .sync
                .get(node)
                .is_some_and(|s| s.started_ms == advert.started_ms && s.spaces == spaces);
        if !keep {
            if self.sync.get(node).is_some_and(|s| s.seq.is_some()) {
                // Back to the advert's list until the new snapshot comes.
                self.index.set_node(node, self::spaces(advert));
            }
            self.sync.insert(
                node.clone(),
                PageSync {
                    started_ms: advert.started_ms,
                    seq: None,
                    fetching: None,
                    spaces,
                },
            );
        }
        let s = self.sync.get_mut(node).expect("followed");
        if s.fetching
            .is_some_and(|at| now.saturating_duration_since(at) > FETCH_GIVE_UP)
        {
            // Its answer never came back: ask again.
            s.fetching = None;
        }
        if s.seq.is_none() && s.fetching.is_none() {
            s.fetching = Some(now);
            return Some(Effect::FetchPages {
                node: node.clone(),
                started_ms: s.started_ms,
                since: None,
            });
        }
        None
    }

    /// Applies events a peer pushed, or returns the fetch that fills a gap before them.
    fn pushed(
        &mut self,
        node: &str,
        started_ms: u64,
        entry: &PageLogEntry,
        now: Instant,
    ) -> Option<Effect> {
        let s = self.sync.get_mut(node)?;
        if s.started_ms != started_ms {
            return None;
        }
        match s.seq {
            Some(k) if !entry.snapshot && entry.from == k => {
                s.seq = Some(entry.seq);
                apply(&mut self.index, node, &s.spaces, entry);
                None
            }
            Some(k) if entry.seq <= k => None,
            // Waiting for a snapshot, or events went missing: ask once.
            _ if s.fetching.is_some() => None,
            since => {
                s.fetching = Some(now);
                Some(Effect::FetchPages {
                    node: node.to_owned(),
                    started_ms,
                    since,
                })
            }
        }
    }

    /// Applies the answer to a fetch (a snapshot replaces what the peer had).
    fn fetched(&mut self, node: &str, started_ms: u64, entry: Option<PageLogEntry>) {
        let Some(s) = self.sync.get_mut(node) else {
            return;
        };
        if s.started_ms != started_ms {
            return;
        }
        s.fetching = None;
        let Some(e) = entry else {
            return;
        };
        if e.snapshot {
            let lists: Vec<(PageSpace, &[u64])> = e
                .changes
                .iter()
                .filter_map(|c| Some((s.spaces.get(&c.ns)?.clone(), c.stored.as_slice())))
                .collect();
            self.index.set_node(node, lists);
            s.seq = Some(e.seq);
        } else if s.seq == Some(e.from) {
            s.seq = Some(e.seq);
            apply(&mut self.index, node, &s.spaces, &e);
        }
    }

    /// The seq of `node`'s page events this node has applied (`None`: not following them,
    /// or no snapshot yet).
    pub fn page_seq(&self, node: &str) -> Option<u64> {
        self.sync.get(node).and_then(|s| s.seq)
    }

    /// Pages of `node` in the index.
    pub fn pages_indexed(&self, node: &str) -> usize {
        self.index.count(node)
    }

    /// The live peers' pages: which of them hold how many leading pages of `ids` in
    /// `space` (see [`PrefixIndex::runs`]).
    pub fn prefix_runs(&self, space: &PageSpace, ids: &[u64]) -> Vec<(&str, usize)> {
        self.index.runs(space, ids)
    }

    /// Alive peers.
    pub fn alive(&self) -> impl Iterator<Item = &Peer> {
        self.peers.values().filter(|p| p.state == PeerState::Alive)
    }

    /// Every peer ever seen.
    pub fn all(&self) -> impl Iterator<Item = &Peer> {
        self.peers.values()
    }

    /// Whether any peer, live or not, has ever advertised `tier` (a request for it is then
    /// "none available now", not "unknown model"), also if no advert lists it any more.
    pub fn ever_hosted(&self, tier: &str) -> bool {
        self.hosted.contains(tier)
    }

    /// Peers named in `advert` that this node has no live entry for (candidates to dial).
    fn unknown(&self, advert: &NodeAdvert) -> Vec<PeerAddr> {
        advert
            .peers
            .iter()
            .filter(|p| p.node != self.me)
            .filter(|p| {
                self.peers
                    .get(&p.node)
                    .is_none_or(|known| known.state != PeerState::Alive)
            })
            .cloned()
            .collect()
    }

    /// Gossip list: the alive peers.
    pub fn gossip(&self) -> Vec<PeerAddr> {
        self.alive()
            .map(|p| PeerAddr {
                node: p.advert.node.clone(),
                quic_addr: p.advert.quic_addr.clone(),
            })
            .collect()
    }

    /// The gossip list for this period's heartbeats: the alive peers when they changed
    /// since the list was last sent, or every [`GOSSIP_PERIODS`] periods (for a peer that
    /// missed it); otherwise empty, since every peer already has it. The list is most of a
    /// heartbeat's bytes in a full mesh (n entries to each of n - 1 peers per period). A
    /// heartbeat on a new connection carries the whole list ([`Membership::gossip`]).
    pub fn gossip_for_period(&mut self) -> Vec<PeerAddr> {
        let now = self.gossip();
        let due = self.ticks.saturating_sub(self.gossip_sent_at) >= GOSSIP_PERIODS;
        if now != self.gossip_sent || due {
            self.gossip_sent.clone_from(&now);
            self.gossip_sent_at = self.ticks;
            now
        } else {
            vec![]
        }
    }
}

/// The page sets an advert lists: each tier's own, and a store's beside them.
fn spaces(a: &NodeAdvert) -> impl Iterator<Item = (PageSpace, &[u64])> {
    let tiers = a.tiers.iter().filter(|t| t.page_block > 0).map(|t| {
        (
            space(&t.name, &t.page_base, t.page_block),
            t.pages.as_slice(),
        )
    });
    let stores = a
        .pages
        .iter()
        .map(|p| (space(&p.ns, &p.base, p.block), p.ids.as_slice()));
    tiers.chain(stores)
}

/// Applies a peer's page events, in order, to the index (namespaces it has no page space
/// for are skipped: routers cannot name those pages).
fn apply(
    index: &mut PrefixIndex,
    node: &str,
    spaces: &BTreeMap<String, PageSpace>,
    e: &PageLogEntry,
) {
    for c in &e.changes {
        if let Some(space) = spaces.get(&c.ns) {
            index.apply(node, space, &c.stored, &c.removed);
        }
    }
}

fn space(ns: &str, base: &[u8], block: u32) -> PageSpace {
    PageSpace {
        ns: ns.to_owned(),
        base: base.to_vec(),
        block,
    }
}

/// Whether two adverts list the same pages (most heartbeats: nothing was stored).
fn same_pages(a: &NodeAdvert, b: &NodeAdvert) -> bool {
    fn tiers(x: &NodeAdvert) -> impl Iterator<Item = (&String, &Vec<u8>, u32, &Vec<u64>)> {
        x.tiers
            .iter()
            .map(|t| (&t.name, &t.page_base, t.page_block, &t.pages))
    }
    fn stores(x: &NodeAdvert) -> impl Iterator<Item = (&String, &Vec<u8>, u32, &Vec<u64>)> {
        x.pages.iter().map(|p| (&p.ns, &p.base, p.block, &p.ids))
    }
    tiers(a).eq(tiers(b)) && stores(a).eq(stores(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn advert(node: &str, started: u64, peers: &[&str]) -> NodeAdvert {
        NodeAdvert {
            node: node.into(),
            quic_addr: format!("{node}:1"),
            http_addr: String::new(),
            started_ms: started,
            tiers: vec![],
            peers: peers
                .iter()
                .map(|p| PeerAddr {
                    node: (*p).into(),
                    quic_addr: format!("{p}:1"),
                })
                .collect(),
            roles: vec![],
            actors: vec![],
            pages: vec![],
            capacity: Default::default(),
            build: String::new(),
            capabilities: vec![],
        }
    }

    #[test]
    fn lifecycle() {
        let t0 = Instant::now();
        let to = Duration::from_secs(2);
        let mut m = Membership::new("a", Duration::from_secs(5));
        assert_eq!(m.heartbeat(advert("b", 1, &[]), t0), Change::Joined);
        assert_eq!(
            m.heartbeat(advert("b", 1, &[]), t0 + Duration::from_secs(1)),
            Change::Updated
        );
        assert!(m.sweep(t0 + Duration::from_secs(2), to).is_empty());
        assert_eq!(
            m.sweep(t0 + Duration::from_millis(3100), to),
            vec!["b".to_string()]
        );
        assert_eq!(m.alive().count(), 0);
        // Swept once only.
        assert!(m.sweep(t0 + Duration::from_secs(9), to).is_empty());
        // Back after a restart.
        assert_eq!(
            m.heartbeat(advert("b", 2, &[]), t0 + Duration::from_secs(10)),
            Change::Rejoined
        );
        assert_eq!(m.alive().count(), 1);
        // Restart without ever being declared dead is also a rejoin.
        assert_eq!(
            m.heartbeat(advert("b", 3, &[]), t0 + Duration::from_secs(11)),
            Change::Rejoined
        );
        assert!(m.leave("b"));
        assert!(!m.leave("b"));
        assert_eq!(m.alive().count(), 0);
        assert!(!m.fail("b"));
    }

    #[test]
    fn a_tier_stays_known_after_its_advert_drops_it() {
        let t0 = Instant::now();
        let mut m = Membership::new("a", Duration::from_secs(5));
        let mut b = advert("b", 1, &[]);
        b.tiers.push(crate::wire::TierAdvert {
            name: "t1".into(),
            max_seq_len: 4096,
            n_seq_max: 1,
            active: 0,
            queued: 0,
            kv_cells: 4096,
            kv_reserved: 0,
            page_base: vec![],
            page_block: 0,
            pages: vec![],
            started: 0,
            queued_ms_total: 0,
        });
        m.heartbeat(b, t0);
        // The engine died: the next advert lists no tier.
        m.heartbeat(advert("b", 1, &[]), t0 + Duration::from_secs(1));
        assert!(m.all().all(|p| p.advert.tiers.is_empty()));
        assert!(m.ever_hosted("t1"));
        assert!(!m.ever_hosted("t2"));
    }

    #[test]
    fn gossip_finds_unknown_peers_but_not_self() {
        let t0 = Instant::now();
        let mut m = Membership::new("a", Duration::from_secs(5));
        m.heartbeat(advert("b", 1, &["a", "c"]), t0);
        let unknown: Vec<String> = m
            .unknown(&advert("b", 1, &["a", "c", "b"]))
            .into_iter()
            .map(|p| p.node)
            .collect();
        // "b" is alive and known, "a" is self.
        assert_eq!(unknown, vec!["c".to_string()]);
        assert!(m.fail("b"));
        assert_eq!(m.unknown(&advert("c", 1, &["b"])).len(), 1);
        assert!(m.gossip().is_empty());
    }

    #[test]
    fn a_dead_peers_pages_leave_the_index_until_it_is_heard_again() {
        let t0 = Instant::now();
        let mut m = Membership::new("a", Duration::from_secs(2));
        let mut b = advert("b", 1, &[]);
        b.pages.push(crate::wire::NamespacePages {
            ns: "t1".into(),
            ids: vec![5, 6],
            base: vec![1; 32],
            block: 16,
        });
        let t1 = space("t1", &[1; 32], 16);
        m.step(Input::Heartbeat(b.clone()), t0);
        assert_eq!(m.prefix_runs(&t1, &[5, 6, 7]), vec![("b", 2)]);
        m.step(Input::Tick, t0 + Duration::from_secs(3));
        assert_eq!(m.prefix_runs(&t1, &[5, 6, 7]), vec![]);
        m.step(Input::Heartbeat(b), t0 + Duration::from_secs(4));
        assert_eq!(m.prefix_runs(&t1, &[5, 6, 7]), vec![("b", 2)]);
    }

    /// b with the page log, holding `ids` of t1 in its advert's (capped) list.
    fn logging(started: u64, ids: &[u64]) -> NodeAdvert {
        let mut b = advert("b", started, &[]);
        b.capabilities = vec![PAGE_LOG.into()];
        b.pages.push(crate::wire::NamespacePages {
            ns: "t1".into(),
            ids: ids.to_vec(),
            base: vec![1; 32],
            block: 16,
        });
        b
    }

    fn entry(snapshot: bool, from: u64, seq: u64, stored: &[u64], removed: &[u64]) -> PageLogEntry {
        PageLogEntry {
            snapshot,
            from,
            seq,
            changes: vec![crate::wire::PageChange {
                ns: "t1".into(),
                stored: stored.to_vec(),
                removed: removed.to_vec(),
            }],
        }
    }

    fn fetches(effects: &[Effect]) -> Vec<Option<u64>> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::FetchPages { since, .. } => Some(*since),
                _ => None,
            })
            .collect()
    }

    /// a following b from a snapshot of `ids` at seq `seq`.
    fn following(ids: &[u64], seq: u64) -> Membership {
        let mut m = Membership::new("a", Duration::from_secs(2));
        m.step(Input::Heartbeat(logging(1, &ids[..1])), Instant::now());
        m.step(
            Input::PageLog {
                node: "b".into(),
                started_ms: 1,
                entry: Some(entry(true, 0, seq, ids, &[])),
            },
            Instant::now(),
        );
        m
    }

    #[test]
    fn a_peer_with_the_page_log_is_asked_for_a_snapshot_once() {
        let mut m = Membership::new("a", Duration::from_secs(2));
        let t0 = Instant::now();
        let first = m.step(Input::Heartbeat(logging(1, &[5])), t0);
        assert_eq!(fetches(&first), vec![None]);
        let again = m.step(Input::Heartbeat(logging(1, &[5])), t0);
        assert_eq!(fetches(&again), vec![], "a fetch is under way");
    }

    #[test]
    fn a_peer_without_the_page_log_is_indexed_from_its_advert() {
        let mut m = Membership::new("a", Duration::from_secs(2));
        let mut b = logging(1, &[5, 6]);
        b.capabilities.clear();
        assert_eq!(
            fetches(&m.step(Input::Heartbeat(b), Instant::now())),
            vec![]
        );
        assert_eq!(m.pages_indexed("b"), 2);
        assert_eq!(m.page_seq("b"), None);
    }

    #[test]
    fn a_snapshot_indexes_every_page_beyond_the_adverts_list() {
        let ids: Vec<u64> = (1..=5000).collect();
        let m = following(&ids, 9);
        assert_eq!(m.pages_indexed("b"), 5000);
        assert_eq!(m.page_seq("b"), Some(9));
        assert_eq!(
            m.prefix_runs(&space("t1", &[1; 32], 16), &[1, 2, 3]),
            vec![("b", 3)]
        );
    }

    #[test]
    fn pushed_events_in_order_are_applied() {
        let mut m = following(&[1, 2, 3], 4);
        let out = m.step(
            Input::Pages {
                node: "b".into(),
                started_ms: 1,
                entry: entry(false, 4, 5, &[7], &[2]),
            },
            Instant::now(),
        );
        assert_eq!(fetches(&out), vec![]);
        assert_eq!(m.page_seq("b"), Some(5));
        let t1 = space("t1", &[1; 32], 16);
        assert_eq!(m.prefix_runs(&t1, &[1, 2]), vec![("b", 1)]);
        assert_eq!(m.prefix_runs(&t1, &[7]), vec![("b", 1)]);
    }

    #[test]
    fn a_heartbeat_of_a_followed_peer_does_not_replace_its_pages() {
        let mut m = following(&[1, 2, 3], 4);
        m.step(Input::Heartbeat(logging(1, &[1])), Instant::now());
        assert_eq!(m.pages_indexed("b"), 3);
    }

    #[test]
    fn a_gap_in_pushed_events_fetches_what_was_missed_once() {
        let mut m = following(&[1], 4);
        let gap = |from| Input::Pages {
            node: "b".into(),
            started_ms: 1,
            entry: entry(false, from, from + 1, &[9], &[]),
        };
        assert_eq!(fetches(&m.step(gap(6), Instant::now())), vec![Some(4)]);
        assert_eq!(fetches(&m.step(gap(7), Instant::now())), vec![]);
        assert_eq!(m.pages_indexed("b"), 1, "nothing applied past the gap");
        m.step(
            Input::PageLog {
                node: "b".into(),
                started_ms: 1,
                entry: Some(entry(false, 4, 8, &[9, 10], &[])),
            },
            Instant::now(),
        );
        assert_eq!((m.page_seq("b"), m.pages_indexed("b")), (Some(8), 3));
    }

    #[test]
    fn events_already_applied_are_ignored() {
        let mut m = following(&[1], 4);
        let old = Input::Pages {
            node: "b".into(),
            started_ms: 1,
            entry: entry(false, 2, 3, &[], &[1]),
        };
        assert_eq!(fetches(&m.step(old, Instant::now())), vec![]);
        assert_eq!(m.pages_indexed("b"), 1);
    }

    #[test]
    fn a_failed_fetch_is_asked_again_at_the_next_heartbeat() {
        let mut m = Membership::new("a", Duration::from_secs(2));
        m.step(Input::Heartbeat(logging(1, &[5])), Instant::now());
        m.step(
            Input::PageLog {
                node: "b".into(),
                started_ms: 1,
                entry: None,
            },
            Instant::now(),
        );
        let again = m.step(Input::Heartbeat(logging(1, &[5])), Instant::now());
        assert_eq!(fetches(&again), vec![None]);
    }

    #[test]
    fn a_fetch_never_answered_is_asked_again_after_the_give_up_time() {
        let mut m = Membership::new("a", Duration::from_secs(2));
        let t0 = Instant::now();
        m.step(Input::Heartbeat(logging(1, &[5])), t0);
        let soon = m.step(
            Input::Heartbeat(logging(1, &[5])),
            t0 + Duration::from_secs(1),
        );
        assert_eq!(fetches(&soon), vec![]);
        let late = t0 + FETCH_GIVE_UP + Duration::from_secs(1);
        assert_eq!(
            fetches(&m.step(Input::Heartbeat(logging(1, &[5])), late)),
            vec![None]
        );
    }

    #[test]
    fn a_restarted_peer_is_followed_afresh_and_its_old_events_dropped() {
        let mut m = following(&[1, 2, 3], 4);
        let out = m.step(Input::Heartbeat(logging(2, &[8])), Instant::now());
        assert_eq!(fetches(&out), vec![None]);
        // Until the new snapshot: the new advert's list.
        assert_eq!(m.pages_indexed("b"), 1);
        let stale = Input::PageLog {
            node: "b".into(),
            started_ms: 1,
            entry: Some(entry(true, 0, 5, &[1, 2, 3], &[])),
        };
        m.step(stale, Instant::now());
        assert_eq!((m.page_seq("b"), m.pages_indexed("b")), (None, 1));
    }

    #[test]
    fn a_dead_peers_followed_pages_leave_the_index() {
        let mut m = following(&[1, 2, 3], 4);
        m.step(
            Input::Closed {
                node: "b".into(),
                current: true,
                leaving: false,
            },
            Instant::now(),
        );
        assert_eq!((m.page_seq("b"), m.pages_indexed("b")), (None, 0));
        let late = Input::Pages {
            node: "b".into(),
            started_ms: 1,
            entry: entry(false, 4, 5, &[7], &[]),
        };
        assert_eq!(fetches(&m.step(late, Instant::now())), vec![]);
        assert_eq!(m.pages_indexed("b"), 0);
    }

    #[test]
    fn the_gossip_list_goes_out_when_it_changed_or_is_due() {
        let t0 = Instant::now();
        let mut m = Membership::new("a", Duration::from_secs(2));
        m.step(Input::Heartbeat(advert("b", 1, &[])), t0);
        assert_eq!(m.gossip_for_period().len(), 1, "b joined");
        assert!(m.gossip_for_period().is_empty(), "unchanged");
        m.step(Input::Heartbeat(advert("c", 1, &[])), t0);
        assert_eq!(m.gossip_for_period().len(), 2, "c joined");
        for _ in 0..GOSSIP_PERIODS {
            m.step(Input::Tick, t0);
        }
        assert_eq!(m.gossip_for_period().len(), 2, "due again");
        assert!(m.gossip_for_period().is_empty());
    }

    #[test]
    fn a_new_peers_heartbeat_reports_it_and_dials_the_peers_it_names() {
        let mut m = Membership::new("a", Duration::from_secs(2));
        let effects = m.step(
            Input::Heartbeat(advert("b", 1, &["a", "c"])),
            Instant::now(),
        );
        assert_eq!(
            effects,
            vec![
                Effect::Joined("b".into()),
                Effect::Dial {
                    node: "c".into(),
                    addr: "c:1".into()
                }
            ]
        );
    }

    #[test]
    fn a_tick_after_the_timeout_declares_the_silent_peer_dead_and_closes_it() {
        let t0 = Instant::now();
        let mut m = Membership::new("a", Duration::from_secs(2));
        m.step(Input::Heartbeat(advert("b", 1, &[])), t0);
        assert!(m.step(Input::Tick, t0 + Duration::from_secs(2)).is_empty());
        assert_eq!(
            m.step(Input::Tick, t0 + Duration::from_millis(2001)),
            vec![
                Effect::Died("b".into(), DeathCause::Silent),
                Effect::Close("b".into())
            ]
        );
    }

    #[test]
    fn only_the_current_connection_closing_kills_a_peer() {
        let t0 = Instant::now();
        let mut m = Membership::new("a", Duration::from_secs(2));
        m.step(Input::Heartbeat(advert("b", 1, &[])), t0);
        let closed = |current, leaving| Input::Closed {
            node: "b".into(),
            current,
            leaving,
        };
        assert!(m.step(closed(false, false), t0).is_empty());
        assert_eq!(
            m.step(closed(true, false), t0),
            vec![Effect::Died("b".into(), DeathCause::ConnectionLost)]
        );
        m.step(Input::Heartbeat(advert("b", 1, &[])), t0);
        assert_eq!(
            m.step(closed(true, true), t0),
            vec![Effect::Left("b".into())]
        );
    }

    #[test]
    fn seeds_are_redialed_every_eighth_period_with_the_live_addresses() {
        let t0 = Instant::now();
        let mut m = Membership::new("a", Duration::from_secs(60));
        m.step(Input::Heartbeat(advert("b", 1, &[])), t0);
        let want = Effect::RedialSeeds {
            known: vec!["b:1".into()],
        };
        let redials: Vec<u64> = (1..=24)
            .filter(|_| m.step(Input::Tick, t0).contains(&want))
            .collect();
        assert_eq!(redials, vec![8, 16, 24]);
    }

    const PERIOD: Duration = Duration::from_millis(250);
    const TIMEOUT: Duration = Duration::from_secs(2);

    /// `n` nodes of the simulated fleet ([`crate::membership_sim`]) at `loss`.
    fn sim(n: usize, loss: f64, seed: u64) -> crate::membership_sim::Sim {
        let mut s = crate::membership_sim::Sim::new(n, PERIOD, TIMEOUT, seed);
        s.loss = loss;
        s
    }

    #[test]
    fn nodes_joining_through_one_seed_all_see_each_other_within_three_periods() {
        let mut sim = sim(32, 0.0, 1);
        sim.run(3);
        assert!(sim.converged());
        assert!((0..32).all(|i| sim.connections(i) == 31));
    }

    #[test]
    fn no_peer_is_declared_dead_in_ten_thousand_periods_at_one_percent_loss() {
        let mut sim = sim(16, 0.01, 7);
        sim.run(10_000);
        assert_eq!(sim.deaths, vec![]);
        assert!(sim.converged());
    }

    #[test]
    fn a_crashed_node_is_declared_dead_by_every_peer_within_the_timeout_and_a_period() {
        let mut sim = sim(16, 0.01, 11);
        sim.run(20);
        let crashed_at = sim.period;
        sim.crash(5);
        sim.run(20);
        let seen: BTreeSet<usize> = sim.deaths.iter().map(|d| d.1).collect();
        assert_eq!(seen, (0..16).filter(|i| *i != 5).collect());
        let limit = (TIMEOUT.as_millis() / PERIOD.as_millis()) as u64 + 1;
        for (period, observer, dead) in &sim.deaths {
            assert_eq!(*dead, 5, "n{observer} declared n{dead} dead");
            assert!(
                period - crashed_at <= limit,
                "n{observer} after {} periods",
                period - crashed_at
            );
        }
        assert!(sim.converged());
    }

    #[test]
    fn false_deaths_under_heavy_loss_heal_once_the_loss_stops() {
        let mut sim = sim(16, 0.5, 3);
        sim.run(2_000);
        assert!(
            !sim.deaths.is_empty(),
            "50% loss caused no false death: the test proves nothing"
        );
        sim.loss = 0.0;
        sim.run(3 * SEED_PERIODS);
        assert!(sim.converged());
    }

    #[test]
    fn a_nodes_pages_beyond_its_advert_reach_every_peers_index_through_its_page_log() {
        let mut sim = sim(8, 0.0, 5);
        sim.run(3);
        let ids: Vec<u64> = (1..=5_000).collect();
        sim.hold_pages(3, ids);
        sim.run(3);
        assert_eq!(sim.least_indexed(3), 5_000);
    }
}
