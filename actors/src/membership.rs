//! The membership table: who is in the cluster, what they host, who has gone
//! quiet. Pure logic (time is passed in); the membership actor
//! ([`crate::cluster::MembershipActor`]) feeds it heartbeats and sweeps it every heartbeat.
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

use crate::wire::{NodeAdvert, PeerAddr};

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

/// The table.
#[derive(Debug)]
pub struct Membership {
    me: String,
    peers: BTreeMap<String, Peer>,
    /// Every tier name a peer has advertised, also after it stopped (an engine restarting).
    hosted: BTreeSet<String>,
}

impl Membership {
    /// Empty table for node `me`.
    pub fn new(me: impl Into<String>) -> Self {
        Self {
            me: me.into(),
            peers: BTreeMap::new(),
            hosted: BTreeSet::new(),
        }
    }

    /// Records a heartbeat.
    pub fn heartbeat(&mut self, advert: NodeAdvert, now: Instant) -> Change {
        for t in &advert.tiers {
            if !self.hosted.contains(&t.name) {
                self.hosted.insert(t.name.clone());
            }
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
    pub fn leave(&mut self, node: &str) -> bool {
        match self.peers.get_mut(node) {
            Some(p) if p.state == PeerState::Alive => {
                p.state = PeerState::Left;
                true
            }
            _ => false,
        }
    }

    /// Marks a peer dead now (its connection closed); true if it was alive.
    pub fn fail(&mut self, node: &str) -> bool {
        match self.peers.get_mut(node) {
            Some(p) if p.state == PeerState::Alive => {
                p.state = PeerState::Dead;
                true
            }
            _ => false,
        }
    }

    /// Marks peers silent for longer than `timeout` dead; returns them.
    pub fn sweep(&mut self, now: Instant, timeout: Duration) -> Vec<String> {
        let mut dead = vec![];
        for (name, p) in &mut self.peers {
            if p.state == PeerState::Alive && now.saturating_duration_since(p.last_seen) > timeout {
                p.state = PeerState::Dead;
                dead.push(name.clone());
            }
        }
        dead
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
    pub fn unknown(&self, advert: &NodeAdvert) -> Vec<PeerAddr> {
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
        let mut m = Membership::new("a");
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
        let mut m = Membership::new("a");
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
        let mut m = Membership::new("a");
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
}
