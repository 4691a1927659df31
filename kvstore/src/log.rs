//! A node's page events: what its stores hold, as a sequence of numbered changes that
//! peers apply to their page index, with a snapshot for a peer that is new or missed some.
//!
//! ```text
//! stores ──(touched ids, held or not; or everything held)──▶ PageLog::record
//!                                                              │ net change vs. what
//!                                                              ▼ peers were told
//!                              seq n-1 ─▶ Delta { seq n, [ns: stored, removed] } ─▶ peers
//! peer at seq k ──▶ PageLog::since(k): the deltas k+1..=n, or a snapshot when k is too old
//! ```
//!
//! Pure: the page-store actor feeds it what each store saw since the last period
//! ([`Observed`]); the log compares with what it last told peers, so a page that came
//! and went within one period is no event, and a page moving between levels (RAM to
//! disk) is none either. Ids are short ids ([`crate::PageId::short`]), as routers use them.

use std::collections::{BTreeMap, VecDeque};

use crate::index::IdSet;

/// What one store saw since the last period.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observed {
    /// Ids whose pages were stored or removed at any level, each with whether the store
    /// holds it now (an id listed twice: the later entry counts).
    Touched(Vec<(u64, bool)>),
    /// Every id it holds (after a restart, or when it lost count of what it touched).
    All(Vec<u64>),
}

/// One namespace's part of a change.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NsChange {
    /// Namespace.
    pub ns: String,
    /// Ids now held.
    pub stored: Vec<u64>,
    /// Ids no longer held.
    pub removed: Vec<u64>,
}

/// What a peer applies to move from seq `from` to seq `seq`: changes in order (a
/// namespace may appear more than once), or, when `snapshot`, everything held at `seq`
/// as `stored` (the peer replaces what it had).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LogEntry {
    /// Everything held, not a change.
    pub snapshot: bool,
    /// The seq the changes apply to (0 for a snapshot).
    pub from: u64,
    /// The seq after them.
    pub seq: u64,
    /// The changes.
    pub changes: Vec<NsChange>,
}

/// The log. See the module documentation.
#[derive(Debug)]
pub struct PageLog {
    seq: u64,
    held: BTreeMap<String, IdSet>,
    /// Recent deltas, oldest first: `(seq, changes)`.
    recent: VecDeque<(u64, Vec<NsChange>)>,
    keep: usize,
}

impl PageLog {
    /// An empty log at seq 0 keeping the last `keep` deltas for peers that fall behind.
    pub fn new(keep: usize) -> Self {
        Self {
            seq: 0,
            held: BTreeMap::new(),
            recent: VecDeque::new(),
            keep: keep.max(1),
        }
    }

    /// The current seq.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Ids held, over all namespaces.
    pub fn len(&self) -> usize {
        self.held.values().map(|s| s.len()).sum()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records what the stores saw; returns the new delta (`from` = the previous seq) when
    /// anything changed, `None` otherwise (the seq stays).
    pub fn record(&mut self, seen: Vec<(String, Observed)>) -> Option<LogEntry> {
        let mut changes = vec![];
        for (ns, observed) in seen {
            let held = self.held.entry(ns.clone()).or_default();
            let mut c = NsChange {
                ns,
                ..NsChange::default()
            };
            match observed {
                Observed::Touched(ids) => {
                    // The last word on each id counts: stored and removed stay disjoint.
                    let last: std::collections::HashMap<u64, bool> = ids.into_iter().collect();
                    for (id, now) in last {
                        if now && held.insert(id) {
                            c.stored.push(id);
                        } else if !now && held.remove(&id) {
                            c.removed.push(id);
                        }
                    }
                }
                Observed::All(ids) => {
                    let all: IdSet = ids.into_iter().collect();
                    c.removed = held.difference(&all).copied().collect();
                    c.stored = all.difference(held).copied().collect();
                    *held = all;
                }
            }
            if !c.stored.is_empty() || !c.removed.is_empty() {
                changes.push(c);
            }
        }
        self.held.retain(|_, s| !s.is_empty());
        if changes.is_empty() {
            return None;
        }
        let from = self.seq;
        self.seq += 1;
        self.recent.push_back((self.seq, changes.clone()));
        while self.recent.len() > self.keep {
            self.recent.pop_front();
        }
        Some(LogEntry {
            snapshot: false,
            from,
            seq: self.seq,
            changes,
        })
    }

    /// What a peer at `seq` (`None`: knows nothing) needs: the deltas after it in order,
    /// or a snapshot when it knows nothing, is ahead (this node restarted its log) or is
    /// behind the deltas kept.
    pub fn since(&self, seq: Option<u64>) -> LogEntry {
        match seq {
            Some(s) if s == self.seq => LogEntry {
                snapshot: false,
                from: s,
                seq: s,
                changes: vec![],
            },
            Some(s) if s < self.seq && self.recent.front().is_some_and(|(f, _)| *f <= s + 1) => {
                LogEntry {
                    snapshot: false,
                    from: s,
                    seq: self.seq,
                    changes: self
                        .recent
                        .iter()
                        .filter(|(q, _)| *q > s)
                        .flat_map(|(_, c)| c.iter().cloned())
                        .collect(),
                }
            }
            _ => self.snapshot(),
        }
    }

    /// Everything held now.
    pub fn snapshot(&self) -> LogEntry {
        LogEntry {
            snapshot: true,
            from: 0,
            seq: self.seq,
            changes: self
                .held
                .iter()
                .map(|(ns, ids)| NsChange {
                    ns: ns.clone(),
                    stored: ids.iter().copied().collect(),
                    removed: vec![],
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touched(ns: &str, ids: &[(u64, bool)]) -> Vec<(String, Observed)> {
        vec![(ns.into(), Observed::Touched(ids.to_vec()))]
    }

    fn sorted(mut v: Vec<u64>) -> Vec<u64> {
        v.sort();
        v
    }

    /// Applies entries the way a peer does: a set per namespace.
    fn replay(entries: &[LogEntry]) -> BTreeMap<String, Vec<u64>> {
        let mut out: BTreeMap<String, std::collections::BTreeSet<u64>> = BTreeMap::new();
        for e in entries {
            if e.snapshot {
                out.clear();
            }
            for c in &e.changes {
                let s = out.entry(c.ns.clone()).or_default();
                s.extend(c.stored.iter().copied());
                for id in &c.removed {
                    s.remove(id);
                }
            }
        }
        out.into_iter()
            .filter(|(_, s)| !s.is_empty())
            .map(|(ns, s)| (ns, s.into_iter().collect()))
            .collect()
    }

    #[test]
    fn a_stored_page_is_one_event_with_the_next_seq() {
        let mut log = PageLog::new(8);
        let e = log.record(touched("t1", &[(5, true)])).unwrap();
        assert_eq!((e.from, e.seq, e.snapshot), (0, 1, false));
        assert_eq!(e.changes[0].stored, vec![5]);
        assert_eq!(log.seq(), 1);
    }

    #[test]
    fn a_page_that_came_and_went_in_one_period_is_no_event() {
        let mut log = PageLog::new(8);
        assert_eq!(log.record(touched("t1", &[(5, false)])), None);
        assert_eq!(log.seq(), 0);
    }

    #[test]
    fn a_page_touched_again_while_held_is_no_event() {
        let mut log = PageLog::new(8);
        log.record(touched("t1", &[(5, true)]));
        assert_eq!(log.record(touched("t1", &[(5, true)])), None);
    }

    #[test]
    fn a_removed_page_is_an_event() {
        let mut log = PageLog::new(8);
        log.record(touched("t1", &[(5, true), (6, true)]));
        let e = log.record(touched("t1", &[(5, false)])).unwrap();
        assert_eq!(
            (e.changes[0].stored.len(), e.changes[0].removed.clone()),
            (0, vec![5])
        );
    }

    #[test]
    fn everything_held_is_compared_with_what_peers_were_told() {
        let mut log = PageLog::new(8);
        log.record(touched("t1", &[(1, true), (2, true)]));
        let e = log
            .record(vec![("t1".into(), Observed::All(vec![2, 3]))])
            .unwrap();
        assert_eq!(
            (
                sorted(e.changes[0].stored.clone()),
                e.changes[0].removed.clone()
            ),
            (vec![3], vec![1])
        );
    }

    #[test]
    fn a_peer_behind_gets_the_deltas_it_missed_in_order() {
        let mut log = PageLog::new(8);
        let first = log.record(touched("t1", &[(1, true)])).unwrap();
        log.record(touched("t1", &[(2, true)]));
        log.record(touched("t1", &[(1, false)]));
        let catch_up = log.since(Some(1));
        assert_eq!(
            (catch_up.from, catch_up.seq, catch_up.snapshot),
            (1, 3, false)
        );
        assert_eq!(
            replay(&[first, catch_up]),
            BTreeMap::from([("t1".to_owned(), vec![2])])
        );
    }

    #[test]
    fn a_peer_up_to_date_gets_nothing() {
        let mut log = PageLog::new(8);
        log.record(touched("t1", &[(1, true)]));
        let e = log.since(Some(1));
        assert_eq!(
            (e.from, e.seq, e.changes.len(), e.snapshot),
            (1, 1, 0, false)
        );
    }

    #[test]
    fn a_peer_older_than_the_deltas_kept_gets_a_snapshot() {
        let mut log = PageLog::new(2);
        for id in 1..=5 {
            log.record(touched("t1", &[(id, true)]));
        }
        let e = log.since(Some(1));
        assert!(e.snapshot);
        assert_eq!(e.seq, 5);
        assert_eq!(
            replay(&[e]),
            BTreeMap::from([("t1".to_owned(), vec![1, 2, 3, 4, 5])])
        );
        assert!(!log.since(Some(3)).snapshot, "deltas 4 and 5 are kept");
    }

    #[test]
    fn a_peer_ahead_of_the_log_or_knowing_nothing_gets_a_snapshot() {
        let mut log = PageLog::new(8);
        log.record(touched("t1", &[(1, true)]));
        assert!(log.since(Some(7)).snapshot);
        assert!(log.since(None).snapshot);
    }

    #[test]
    fn replaying_every_delta_gives_what_is_held() {
        // Random stores and removals over three namespaces; a peer applying each delta
        // ends where a snapshot says.
        let mut log = PageLog::new(1000);
        let mut entries = vec![];
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..500 {
            let mut seen = vec![];
            for ns in ["t1", "t2", "t3"] {
                let ids = (0..4)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        (x % 50, x % 3 != 0)
                    })
                    .collect();
                seen.push((ns.to_owned(), Observed::Touched(ids)));
            }
            entries.extend(log.record(seen));
        }
        assert_eq!(replay(&entries), replay(&[log.snapshot()]));
        assert_eq!(entries.last().unwrap().seq, log.seq());
    }
}
