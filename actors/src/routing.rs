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
}
