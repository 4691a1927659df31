//! The membership table at fleet sizes, in one process: `n` real [`Membership`] tables over
//! a simulated network, run as the membership driver runs them. Each period every node up
//! sends its heartbeat over every connection it holds (each lost with probability `loss`,
//! delivered 0 to `max_delay` periods late), then ticks; the effects dial, close, fetch page
//! events and report deaths as the driver would. Node 0 is every node's seed.
//!
//! It counts what the real code would put on the wire: each heartbeat and page-log answer
//! is encoded as the transport frames it ([`mesh_transport::frame::encode`]; QUIC and UDP
//! headers not counted). Used by the table's unit tests and by `mesh-bench membership`,
//! which reports failure detection, false deaths, control bytes and how soon a new node's
//! pages are routable at 64 to 1,024 nodes.

use std::collections::{BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use crate::membership::{Effect, Input, Membership, PAGE_LOG};
use crate::wire::{Control, NamespacePages, NodeAdvert, PageChange, PageLogEntry};

/// Pages of a node as its advert lists them (the newest this many, as the page-store
/// actor's adverts do); the rest reach peers through the page log.
const ADVERTISED: usize = 1024;

/// The namespace every simulated node's pages are in.
pub const NAMESPACE: &str = "t1";

/// A simulated fleet.
pub struct Sim {
    tables: Vec<Membership>,
    up: Vec<bool>,
    started: Vec<u64>,
    conns: Vec<BTreeSet<usize>>,
    /// Pages each node holds (all in [`NAMESPACE`]).
    pages: Vec<Vec<u64>>,
    /// (period, observer, dead node) for every death reported.
    pub deaths: Vec<(u64, usize, usize)>,
    /// Control bytes each node sent (heartbeats and page-log answers).
    pub sent_bytes: Vec<u64>,
    /// Probability that a heartbeat is lost.
    pub loss: f64,
    /// Most periods a message is late (uniform in 0..=max_delay).
    pub max_delay: u64,
    /// Messages in flight: index k is delivered k + 1 periods from now.
    in_flight: VecDeque<Vec<(usize, Input)>>,
    rng: u64,
    /// Periods run.
    pub period: u64,
    period_len: Duration,
    t0: Instant,
}

impl Sim {
    /// `n` nodes, each connected to node 0 (its seed), not yet to each other; heartbeats every
    /// `period`, peers declared dead after `failure_timeout` of silence.
    pub fn new(n: usize, period: Duration, failure_timeout: Duration, seed: u64) -> Self {
        let mut conns = vec![BTreeSet::new(); n];
        for i in 1..n {
            conns[0].insert(i);
            conns[i].insert(0);
        }
        Self {
            tables: (0..n)
                .map(|i| Membership::new(name(i), failure_timeout))
                .collect(),
            up: vec![true; n],
            started: vec![1; n],
            conns,
            pages: vec![Vec::new(); n],
            deaths: vec![],
            sent_bytes: vec![0; n],
            loss: 0.0,
            max_delay: 0,
            in_flight: VecDeque::new(),
            rng: seed,
            period: 0,
            period_len: period,
            t0: Instant::now(),
        }
    }

    /// Nodes in the fleet.
    pub fn len(&self) -> usize {
        self.tables.len()
    }

    /// Whether the fleet has no node.
    pub fn is_empty(&self) -> bool {
        self.tables.is_empty()
    }

    /// Node `i`'s table.
    pub fn table(&self, i: usize) -> &Membership {
        &self.tables[i]
    }

    /// Connections node `i` holds.
    pub fn connections(&self, i: usize) -> usize {
        self.conns[i].len()
    }

    /// Whether node `i` runs.
    pub fn is_up(&self, i: usize) -> bool {
        self.up[i]
    }

    /// Stops node `i` without a word (a crash): its heartbeats stop.
    pub fn crash(&mut self, i: usize) {
        self.up[i] = false;
    }

    /// Starts node `i` again as a new process (a new start time), dialing its seed.
    pub fn restart(&mut self, i: usize) {
        self.up[i] = true;
        self.started[i] += 1;
        self.tables[i] = Membership::new(name(i), self.tables[i].failure_timeout());
        self.conns[i].clear();
        self.connect(i, 0);
    }

    /// Node `i` holds `ids` (replacing what it held), and follows the page log: its peers
    /// fetch a snapshot of them.
    pub fn hold_pages(&mut self, i: usize, ids: Vec<u64>) {
        self.pages[i] = ids;
    }

    /// splitmix64: a uniform draw in [0, 1).
    fn draw(&mut self) -> f64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    fn connect(&mut self, a: usize, b: usize) {
        if a != b && self.up[b] {
            self.conns[a].insert(b);
            self.conns[b].insert(a);
        }
    }

    /// Sends `input` to node `to`, `delay` periods late (0: now).
    fn deliver(&mut self, to: usize, input: Input, delay: u64, now: Instant) {
        if delay == 0 {
            if self.up[to] {
                let effects = self.tables[to].step(input, now);
                self.perform(to, effects, now);
            }
            return;
        }
        let k = delay as usize - 1;
        while self.in_flight.len() <= k {
            self.in_flight.push_back(Vec::new());
        }
        self.in_flight[k].push((to, input));
    }

    fn delay(&mut self) -> u64 {
        if self.max_delay == 0 {
            0
        } else {
            ((self.draw() * (self.max_delay + 1) as f64) as u64).min(self.max_delay)
        }
    }

    fn perform(&mut self, at: usize, effects: Vec<Effect>, now: Instant) {
        for e in effects {
            match e {
                Effect::Dial { node, .. } => self.connect(at, index(&node)),
                Effect::Close(node) => {
                    let other = index(&node);
                    self.conns[at].remove(&other);
                    if self.conns[other].remove(&at) && self.up[other] {
                        let closed = Input::Closed {
                            node: name(at),
                            current: true,
                            leaving: false,
                        };
                        let more = self.tables[other].step(closed, now);
                        self.perform(other, more, now);
                    }
                }
                Effect::RedialSeeds { known } => {
                    if at != 0 && !known.contains(&name(0)) {
                        self.connect(at, 0);
                    }
                }
                Effect::Died(node, _) => {
                    self.deaths.push((self.period, at, index(&node)));
                }
                Effect::FetchPages {
                    node, started_ms, ..
                } => {
                    // The peer answers with a snapshot of what it holds (a call: lost only
                    // when the peer is down, then answered with a failure).
                    let peer = index(&node);
                    let entry = (self.up[peer] && self.started[peer] == started_ms)
                        .then(|| snapshot(&self.pages[peer]));
                    if let Some(e) = &entry {
                        self.sent_bytes[peer] += frame_len(&Control::Pages {
                            node: node.clone(),
                            started_ms,
                            entry: e.clone(),
                        });
                    }
                    let answer = Input::PageLog {
                        node,
                        started_ms,
                        entry,
                    };
                    let d = self.delay().max(1);
                    self.deliver(at, answer, d, now);
                }
                Effect::Joined(_) | Effect::Rejoined(_) | Effect::Left(_) => {}
            }
        }
    }

    fn advert_of(&mut self, i: usize) -> NodeAdvert {
        let ids = &self.pages[i];
        let pages = if ids.is_empty() {
            vec![]
        } else {
            vec![NamespacePages {
                ns: NAMESPACE.into(),
                ids: ids.iter().rev().take(ADVERTISED).copied().collect(),
                base: vec![7; 32],
                block: 16,
            }]
        };
        NodeAdvert {
            node: name(i),
            quic_addr: name(i),
            http_addr: String::new(),
            started_ms: self.started[i],
            tiers: vec![],
            peers: self.tables[i].gossip_for_period(),
            roles: vec!["store".into()],
            actors: vec!["kv-store".into(), "page-log".into()],
            pages,
            capacity: Default::default(),
            build: "mesh 0.1.0".into(),
            capabilities: vec![PAGE_LOG.into()],
        }
    }

    /// Runs `periods` heartbeat periods.
    pub fn run(&mut self, periods: u64) {
        for _ in 0..periods {
            self.period += 1;
            let now = self.t0 + self.period_len * self.period as u32;
            for (to, input) in self.in_flight.pop_front().unwrap_or_default() {
                self.deliver(to, input, 0, now);
            }
            let n = self.tables.len();
            for i in 0..n {
                if !self.up[i] {
                    continue;
                }
                let advert = self.advert_of(i);
                let bytes = frame_len(&Control::Heartbeat(advert.clone()));
                for j in self.conns[i].clone() {
                    self.sent_bytes[i] += bytes;
                    if self.draw() < self.loss || !self.up[j] {
                        continue;
                    }
                    let d = self.delay();
                    self.deliver(j, Input::Heartbeat(advert.clone()), d, now);
                }
            }
            for i in 0..n {
                if self.up[i] {
                    let effects = self.tables[i].step(Input::Tick, now);
                    self.perform(i, effects, now);
                }
            }
        }
    }

    /// Whether every node up sees every other node up alive, and no other.
    pub fn converged(&self) -> bool {
        let up: Vec<usize> = (0..self.len()).filter(|i| self.up[*i]).collect();
        up.iter().all(|&i| {
            let alive: BTreeSet<usize> = self.tables[i]
                .alive()
                .map(|p| index(&p.advert.node))
                .collect();
            alive.len() == up.len() - 1 && up.iter().all(|j| *j == i || alive.contains(j))
        })
    }

    /// Nodes up that see node `i` as dead or gone (not alive).
    pub fn seen_gone_by(&self, i: usize) -> usize {
        (0..self.len())
            .filter(|&o| o != i && self.up[o])
            .filter(|&o| self.tables[o].alive().all(|p| index(&p.advert.node) != i))
            .count()
    }

    /// The fewest of node `i`'s pages any other node up has in its index.
    pub fn least_indexed(&self, i: usize) -> usize {
        (0..self.len())
            .filter(|&o| o != i && self.up[o])
            .map(|o| self.tables[o].pages_indexed(&name(i)))
            .min()
            .unwrap_or(0)
    }

    /// The simulated time of `periods` periods.
    pub fn time(&self, periods: u64) -> Duration {
        self.period_len * periods as u32
    }
}

/// The name of node `i`.
pub fn name(i: usize) -> String {
    format!("n{i}")
}

fn index(name: &str) -> usize {
    name[1..]
        .parse()
        .expect("simulated node names are n<index>")
}

/// A page-log snapshot of `ids` at seq 1.
fn snapshot(ids: &[u64]) -> PageLogEntry {
    PageLogEntry {
        snapshot: true,
        from: 0,
        seq: 1,
        changes: vec![PageChange {
            ns: NAMESPACE.into(),
            stored: ids.to_vec(),
            removed: vec![],
        }],
    }
}

/// Bytes of `c` as the transport frames it.
fn frame_len(c: &Control) -> u64 {
    mesh_transport::frame::encode(c).map_or(0, |b| b.len() as u64)
}
