//! Choosing the node that serves a request. Pure: the gateway passes the
//! candidates (nodes hosting the tier, with their load) and gets one back.
//!
//! score = (max(advertised running + queued, requests this node has in flight there)
//!          + remote_penalty) / sequences
//!         + PREFILL_WEIGHT × (prompt tokens not cached on that node / prompt tokens)
//!
//! The first term is the queueing cost in units of "a full set of slots"; the second is the
//! prefill the node would have to do, so a node holding the prompt's prefix pages wins
//! unless it is loaded by about a full slot set more than the others.
//!
//! The in-flight count is this gateway's own, updated at once, so a burst of
//! requests spreads over nodes before the next heartbeat reports their load.

/// A node that hosts the requested tier.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// Node name.
    pub node: String,
    /// This node (no network hop).
    pub local: bool,
    /// Sequences running, from the latest advert (live for the local node).
    pub active: u32,
    /// Requests queued, same source.
    pub queued: u32,
    /// Concurrent sequences of the tier.
    pub n_seq_max: u32,
    /// Requests this gateway has in flight on that node for this tier.
    pub inflight: u32,
    /// Leading prompt tokens whose KV pages the node holds.
    pub cached_tokens: u32,
    /// Prompt tokens (0 when unknown: the prefill term is then left out).
    pub prompt_tokens: u32,
}

/// Cost added to remote candidates, in sequences: prefer local when loads tie.
pub const REMOTE_PENALTY: f64 = 0.5;
/// Weight of the uncached share of the prompt.
pub const PREFILL_WEIGHT: f64 = 1.0;

/// The cost of sending one more request to `c` (lower is better).
pub fn score(c: &Candidate) -> f64 {
    let load = f64::from((c.active + c.queued).max(c.inflight));
    let penalty = if c.local { 0.0 } else { REMOTE_PENALTY };
    let prefill = if c.prompt_tokens == 0 {
        0.0
    } else {
        let cached = f64::from(c.cached_tokens.min(c.prompt_tokens));
        PREFILL_WEIGHT * (1.0 - cached / f64::from(c.prompt_tokens))
    };
    (load + penalty) / f64::from(c.n_seq_max.max(1)) + prefill
}

/// The best candidate not in `exclude`; ties go to the lexically smaller name (stable).
pub fn pick<'a>(cands: &'a [Candidate], exclude: &[String]) -> Option<&'a Candidate> {
    let best = cands
        .iter()
        .filter(|c| !exclude.contains(&c.node))
        .min_by(|a, b| {
            score(a)
                .total_cmp(&score(b))
                .then_with(|| a.node.cmp(&b.node))
        });
    if let Some(c) = best {
        tracing::debug!(node = %c.node, local = c.local, active = c.active, queued = c.queued,
            inflight = c.inflight, n_seq_max = c.n_seq_max, cached_tokens = c.cached_tokens,
            prompt_tokens = c.prompt_tokens, score = score(c), "route");
    }
    best
}

/// Drops the candidates `prefill_only` says are prefill nodes, unless only prefill nodes
/// host the tier: those then decode too, rather than the request failing.
pub fn decoders(cands: &mut Vec<Candidate>, prefill_only: impl Fn(&Candidate) -> bool) {
    if cands.iter().any(|c| !prefill_only(c)) {
        cands.retain(|c| !prefill_only(c));
    }
}

/// When a decode node hands a prompt's prefill to a prefill node (roles `decode` and
/// `prefill`): prompts with at least `min_tokens` tokens it does not hold as pages, and only
/// to a prefill node with fewer than `max_queue` requests waiting for a slot. Shorter prompts
/// and busy prefill nodes: the decode node prefills itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handoff {
    /// Fewest uncached prompt tokens worth a hand-off.
    pub min_tokens: usize,
    /// A prefill node with this many requests queued (or more) takes no hand-off.
    pub max_queue: u32,
}

impl Default for Handoff {
    fn default() -> Self {
        Self {
            min_tokens: 1024,
            max_queue: 2,
        }
    }
}

/// The prefill node to hand a prompt of `prompt_tokens` to, of which this node holds
/// `cached_here` as pages; `None`: prefill here. `peers` are the prefill nodes hosting the
/// tier, their `cached_tokens` and `prompt_tokens` filled in; the least costly by
/// [`score`] (its load, and the share of the prompt it would still compute) among those
/// under the queue limit wins.
pub fn prefill_peer<'a>(
    h: &Handoff,
    prompt_tokens: usize,
    cached_here: usize,
    peers: &'a [Candidate],
) -> Option<&'a Candidate> {
    if prompt_tokens.saturating_sub(cached_here) < h.min_tokens {
        return None;
    }
    peers
        .iter()
        .filter(|c| c.queued < h.max_queue)
        .min_by(|a, b| {
            score(a)
                .total_cmp(&score(b))
                .then_with(|| a.node.cmp(&b.node))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(node: &str, local: bool, active: u32, inflight: u32) -> Candidate {
        Candidate {
            node: node.into(),
            local,
            active,
            queued: 0,
            n_seq_max: 4,
            inflight,
            cached_tokens: 0,
            prompt_tokens: 0,
        }
    }

    #[test]
    fn prefers_local_on_tie_and_least_loaded_otherwise() {
        let cs = [c("b", false, 0, 0), c("a", true, 0, 0)];
        assert_eq!(pick(&cs, &[]).unwrap().node, "a");
        let cs = [c("b", false, 0, 0), c("a", true, 1, 1)];
        assert_eq!(pick(&cs, &[]).unwrap().node, "b");
        // In-flight counts spread a burst before adverts catch up.
        let cs = [c("b", false, 0, 3), c("c", false, 0, 1)];
        assert_eq!(pick(&cs, &[]).unwrap().node, "c");
    }

    #[test]
    fn excludes_failed_nodes() {
        let cs = [c("a", true, 0, 0), c("b", false, 3, 3)];
        assert_eq!(pick(&cs, &["a".into()]).unwrap().node, "b");
        assert!(pick(&cs, &["a".into(), "b".into()]).is_none());
        assert!(pick(&[], &[]).is_none());
    }

    #[test]
    fn prefix_overlap_attracts_until_load_outweighs_it() {
        let with = |node: &str, local: bool, active: u32, cached: u32| Candidate {
            cached_tokens: cached,
            prompt_tokens: 1000,
            ..c(node, local, active, active)
        };
        // Idle remote node holding 90% of the prompt beats the idle local node holding none.
        let cs = [with("a", true, 0, 0), with("b", false, 0, 900)];
        assert_eq!(pick(&cs, &[]).unwrap().node, "b");
        // The same node with all 4 slots busy (and more queued) loses to the idle one.
        let cs = [with("a", true, 0, 0), with("b", false, 5, 900)];
        assert_eq!(pick(&cs, &[]).unwrap().node, "a");
        // Unknown prompt length: load alone decides.
        let (mut x, mut y) = (with("a", true, 0, 0), with("b", false, 0, 900));
        x.prompt_tokens = 0;
        y.prompt_tokens = 0;
        assert_eq!(pick(&[x, y], &[]).unwrap().node, "a");
        // More cached wins among equals.
        let cs = [with("b", false, 1, 300), with("c", false, 1, 600)];
        assert_eq!(pick(&cs, &[]).unwrap().node, "c");
    }

    #[test]
    fn capacity_matters() {
        let mut big = c("b", false, 4, 0);
        big.n_seq_max = 16;
        let small = c("a", true, 2, 0);
        assert_eq!(pick(&[small, big], &[]).unwrap().node, "b");
    }

    fn prefill(node: &str, queued: u32, cached: u32) -> Candidate {
        Candidate {
            queued,
            cached_tokens: cached,
            prompt_tokens: 4000,
            ..c(node, false, 0, 0)
        }
    }

    #[test]
    fn a_short_prompt_is_prefilled_where_it_landed() {
        let h = Handoff::default();
        let peers = [prefill("p", 0, 0)];
        assert!(prefill_peer(&h, 1023, 0, &peers).is_none());
        // Long, but most of it is already here as pages.
        assert!(prefill_peer(&h, 4000, 3500, &peers).is_none());
        assert_eq!(prefill_peer(&h, 1024, 0, &peers).unwrap().node, "p");
    }

    #[test]
    fn a_long_prompt_goes_to_the_least_loaded_prefill_node_under_the_queue_limit() {
        let h = Handoff::default();
        let peers = [prefill("p1", 1, 0), prefill("p2", 0, 0)];
        assert_eq!(prefill_peer(&h, 4000, 0, &peers).unwrap().node, "p2");
        // The prefix the peer holds counts as prefill it saves.
        let peers = [prefill("p1", 0, 3000), prefill("p2", 0, 0)];
        assert_eq!(prefill_peer(&h, 4000, 0, &peers).unwrap().node, "p1");
        // Every prefill node at its queue limit: prefill here.
        let peers = [prefill("p1", 2, 0), prefill("p2", 5, 0)];
        assert!(prefill_peer(&h, 4000, 0, &peers).is_none());
        assert!(prefill_peer(&h, 4000, 0, &[]).is_none());
    }

    #[test]
    fn prefill_nodes_decode_only_when_nothing_else_hosts_the_tier() {
        let is_p = |x: &Candidate| x.node.starts_with('p');
        let mut cs = vec![
            c("p1", false, 0, 0),
            c("d1", false, 3, 3),
            c("p2", true, 0, 0),
        ];
        decoders(&mut cs, is_p);
        assert_eq!(cs.len(), 1);
        assert_eq!(pick(&cs, &[]).unwrap().node, "d1");
        let mut cs = vec![c("p1", false, 0, 0), c("p2", true, 1, 1)];
        decoders(&mut cs, is_p);
        assert_eq!(cs.len(), 2);
    }
}
