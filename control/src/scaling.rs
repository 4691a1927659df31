//! Tier scaling decisions: how many replicas of a tier the cluster runs, and where the
//! next one starts or which one drains. Pure; the planner actor (`mesh-actors`) gathers
//! the inputs from the members' adverts and carries the decisions out.
//!
//! ```text
//! adverts ─▶ Replica (running: load, slots)   ─┐
//!         ─▶ Host (could load it: free cores,  ├─▶ decide ─▶ Start{node} | Drain{node} | Hold
//!            free memory and GPU memory, what  │
//!            the tier needs)                   │
//! counters ─▶ queue_ms (mean queue time of the ┘
//!             requests that started in the window)
//! ```
//!
//! Rules, first match wins: a pinned count (`mesh scale`) is reached one replica a
//! decision; below `min_replicas` starts and above `max_replicas` drains at once; otherwise
//! nothing changes within `cooldown_s` of the tier's last change, nor before the counters
//! cover a whole window; a mean queue time over
//! `target_queue_ms` (or requests waiting while none started) starts one more; a tier
//! with no queueing whose running and waiting requests would fill at most
//! `scale_in_below` of the slots left after one replica goes drains that one.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A tier's scaling policy (`[scaling.tiers.NAME]` in the node config).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TierScaling {
    /// Fewest replicas the cluster runs.
    pub min_replicas: u32,
    /// Most replicas the cluster runs.
    pub max_replicas: u32,
    /// Mean time a request may wait for a sequence before another replica starts (ms).
    pub target_queue_ms: u64,
    /// Seconds after a tier's last change before the next automatic one.
    pub cooldown_s: u64,
    /// A replica drains when the requests running and waiting would fill at most this
    /// share of the slots the other replicas have.
    pub scale_in_below: f64,
}

impl Default for TierScaling {
    fn default() -> Self {
        Self {
            min_replicas: 1,
            max_replicas: 4,
            target_queue_ms: 500,
            cooldown_s: 60,
            scale_in_below: 0.5,
        }
    }
}

impl TierScaling {
    /// Checks the bounds; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_replicas == 0 {
            return Err("max_replicas must be at least 1".into());
        }
        if self.min_replicas > self.max_replicas {
            return Err(format!(
                "min_replicas ({}) is above max_replicas ({})",
                self.min_replicas, self.max_replicas
            ));
        }
        if self.target_queue_ms == 0 {
            return Err("target_queue_ms must be above 0".into());
        }
        if !(0.0..1.0).contains(&self.scale_in_below) {
            return Err(format!(
                "scale_in_below must be in [0, 1), got {}",
                self.scale_in_below
            ));
        }
        Ok(())
    }
}

/// One running replica of the tier.
#[derive(Debug, Clone, PartialEq)]
pub struct Replica {
    /// Its node.
    pub node: String,
    /// Sequences running.
    pub active: u32,
    /// Requests waiting for a sequence.
    pub queued: u32,
    /// Sequences it runs at once.
    pub slots: u32,
    /// Started on request (by a planner), not by its node's own config.
    pub on_request: bool,
}

/// A node that could start the tier: it has the tier's config and does not run it.
#[derive(Debug, Clone, PartialEq)]
pub struct Host {
    /// Node name.
    pub node: String,
    /// Cores not taken by the engines it runs.
    pub free_cores: u32,
    /// Memory available (bytes).
    pub free_bytes: u64,
    /// Threads the tier runs on there.
    pub need_cores: u32,
    /// Memory the tier needs there (bytes).
    pub need_bytes: u64,
    /// Free memory of each of its GPUs (bytes; empty on a node without GPUs).
    pub gpu_free: Vec<u64>,
    /// Device memory the tier takes on one GPU (bytes; 0 for a tier that runs on the CPU).
    pub need_gpu_bytes: u64,
}

impl Host {
    /// Whether the tier fits.
    pub fn fits(&self) -> bool {
        self.free_cores >= self.need_cores && self.free_bytes >= self.need_bytes
    }

    /// Whether the tier would run on one of its GPUs: it asks for GPU layers and one GPU
    /// has the device memory it takes. Where none has, the node runs it on the CPU.
    pub fn gpu_fits(&self) -> bool {
        self.need_gpu_bytes > 0 && self.gpu_free.iter().any(|&f| f >= self.need_gpu_bytes)
    }
}

/// What the planner does about a tier now.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Nothing; why.
    Hold(String),
    /// Start a replica on `node`.
    Start {
        /// Where.
        node: String,
        /// Why.
        reason: String,
    },
    /// Drain the replica on `node` (no new requests; it stops once its own are done).
    Drain {
        /// Where.
        node: String,
        /// Why.
        reason: String,
    },
}

/// Everything one decision about a tier reads.
#[derive(Debug, Clone, PartialEq)]
pub struct Inputs<'a> {
    /// The tier's policy, if it has one.
    pub policy: Option<&'a TierScaling>,
    /// A count set by hand (`mesh scale`), which overrides the policy.
    pub pinned: Option<u32>,
    /// Running replicas.
    pub replicas: &'a [Replica],
    /// Nodes that could start one.
    pub hosts: &'a [Host],
    /// Mean queue time of the requests that started within the window (`None`: none did).
    pub queue_ms: Option<f64>,
    /// Whether the tier's cooldown has passed since its last change.
    pub cooled: bool,
    /// Whether the counters cover a whole window (a planner that just took over, or a
    /// burst seen at one tick, is not a trend).
    pub full_window: bool,
}

/// The node to start the tier on: one where it fits; first one where it runs on a GPU
/// ([`Host::gpu_fits`]), then the most free cores, then the most free memory, then the
/// first name.
pub fn best_host(hosts: &[Host]) -> Option<&Host> {
    hosts.iter().filter(|h| h.fits()).min_by(|a, b| {
        b.gpu_fits()
            .cmp(&a.gpu_fits())
            .then(b.free_cores.cmp(&a.free_cores))
            .then(b.free_bytes.cmp(&a.free_bytes))
            .then(a.node.cmp(&b.node))
    })
}

/// The replica to drain: one started on request before one its node's config starts,
/// then the least busy, then the last name.
pub fn drain_pick(replicas: &[Replica]) -> Option<&Replica> {
    replicas.iter().min_by(|a, b| {
        b.on_request
            .cmp(&a.on_request)
            .then((a.active + a.queued).cmp(&(b.active + b.queued)))
            .then(b.node.cmp(&a.node))
    })
}

fn start(hosts: &[Host], reason: String) -> Action {
    match best_host(hosts) {
        Some(h) => Action::Start {
            node: h.node.clone(),
            reason,
        },
        None if hosts.is_empty() => {
            Action::Hold(format!("{reason}, but no live node has this tier's config"))
        }
        None => Action::Hold(format!(
            "{reason}, but no node that has this tier's config has the cores and memory free"
        )),
    }
}

fn drain(replicas: &[Replica], reason: String) -> Action {
    match drain_pick(replicas) {
        Some(r) => Action::Drain {
            node: r.node.clone(),
            reason,
        },
        None => Action::Hold(reason),
    }
}

/// The decision about one tier (see the module docs for the rules).
pub fn decide(i: &Inputs<'_>) -> Action {
    let n = i.replicas.len() as u32;
    if let Some(want) = i.pinned {
        return match n.cmp(&want) {
            std::cmp::Ordering::Less => start(i.hosts, format!("pinned at {want}, {n} running")),
            std::cmp::Ordering::Greater => {
                drain(i.replicas, format!("pinned at {want}, {n} running"))
            }
            std::cmp::Ordering::Equal => Action::Hold(format!("pinned at {want}")),
        };
    }
    let Some(p) = i.policy else {
        return Action::Hold("no scaling policy".into());
    };
    if n < p.min_replicas {
        return start(
            i.hosts,
            format!("{n} running, below min_replicas {}", p.min_replicas),
        );
    }
    if n > p.max_replicas {
        return drain(
            i.replicas,
            format!("{n} running, above max_replicas {}", p.max_replicas),
        );
    }
    if !i.cooled {
        return Action::Hold("cooling down after the last change".into());
    }
    if !i.full_window {
        return Action::Hold("measuring the queue time over a whole window".into());
    }
    let waiting: u32 = i.replicas.iter().map(|r| r.queued).sum();
    let busy: u32 = i.replicas.iter().map(|r| r.active + r.queued).sum();
    let target = p.target_queue_ms as f64;
    let over = match i.queue_ms {
        Some(q) => q > target,
        None => waiting > 0,
    };
    if over {
        let why = match i.queue_ms {
            Some(q) => format!("mean queue time {q:.0} ms over the target {target:.0} ms"),
            None => format!("{waiting} requests waiting and none started in the window"),
        };
        if n >= p.max_replicas {
            return Action::Hold(format!("{why}, at max_replicas {}", p.max_replicas));
        }
        return start(i.hosts, why);
    }
    if n > p.min_replicas && waiting == 0 && i.queue_ms.unwrap_or(0.0) <= target / 4.0 {
        if let Some(r) = drain_pick(i.replicas) {
            let left: u32 = i.replicas.iter().map(|x| x.slots).sum::<u32>() - r.slots;
            if f64::from(busy) <= p.scale_in_below * f64::from(left) {
                return Action::Drain {
                    node: r.node.clone(),
                    reason: format!(
                        "{busy} requests would fill {:.0}% of the {left} slots left",
                        if left == 0 {
                            0.0
                        } else {
                            100.0 * f64::from(busy) / f64::from(left)
                        }
                    ),
                };
            }
        }
    }
    Action::Hold("within target".into())
}

/// A tier's cumulative counters on one node: requests that got a sequence, and the
/// milliseconds they waited in all.
pub type Counters = BTreeMap<String, (u64, u64)>;

/// Mean queue time (ms) of the requests that started between two readings of the
/// counters; nodes missing from either reading, or whose counters went back (the
/// process restarted), are left out. `None` when no request started.
pub fn queue_ms(before: &Counters, after: &Counters) -> Option<f64> {
    let (mut started, mut waited) = (0u64, 0u64);
    for (node, (s1, w1)) in after {
        let Some((s0, w0)) = before.get(node) else {
            continue;
        };
        if s1 < s0 || w1 < w0 {
            continue;
        }
        started += s1 - s0;
        waited += w1 - w0;
    }
    (started > 0).then(|| waited as f64 / started as f64)
}

/// The node that plans for the cluster: the first name among the live nodes running a
/// planner. When it dies the next one takes over.
pub fn leader<'a>(nodes: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    nodes.into_iter().min()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rep(node: &str, active: u32, queued: u32, on_request: bool) -> Replica {
        Replica {
            node: node.into(),
            active,
            queued,
            slots: 4,
            on_request,
        }
    }

    fn host(node: &str, cores: u32, bytes: u64) -> Host {
        Host {
            node: node.into(),
            free_cores: cores,
            free_bytes: bytes,
            need_cores: 1,
            need_bytes: 100,
            gpu_free: vec![],
            need_gpu_bytes: 0,
        }
    }

    fn gpu_host(node: &str, cores: u32, gpu_free: &[u64], need_gpu_bytes: u64) -> Host {
        Host {
            gpu_free: gpu_free.to_vec(),
            need_gpu_bytes,
            ..host(node, cores, 1000)
        }
    }

    #[test]
    fn a_gpu_tier_starts_where_one_gpu_has_room_before_more_cores() {
        let h = [
            gpu_host("cpu-only", 64, &[], 500),
            gpu_host("gpu", 8, &[400, 600], 500),
        ];
        assert_eq!(best_host(&h).unwrap().node, "gpu");
    }

    #[test]
    fn gpus_without_room_for_the_tier_count_as_none() {
        let h = [
            gpu_host("full-gpus", 8, &[400, 400], 500),
            gpu_host("more-cores", 16, &[], 500),
        ];
        assert_eq!(best_host(&h).unwrap().node, "more-cores");
    }

    #[test]
    fn a_cpu_tier_is_placed_by_cores_whatever_the_gpus() {
        let h = [
            gpu_host("gpu", 8, &[1 << 40], 0),
            gpu_host("cores", 16, &[], 0),
        ];
        assert_eq!(best_host(&h).unwrap().node, "cores");
    }

    fn inputs<'a>(
        policy: &'a TierScaling,
        replicas: &'a [Replica],
        hosts: &'a [Host],
        queue_ms: Option<f64>,
    ) -> Inputs<'a> {
        Inputs {
            policy: Some(policy),
            pinned: None,
            replicas,
            hosts,
            queue_ms,
            cooled: true,
            full_window: true,
        }
    }

    #[test]
    fn a_queue_time_over_the_target_starts_a_replica() {
        let p = TierScaling::default();
        let r = [rep("b", 4, 6, false)];
        let h = [host("c", 2, 1000)];
        let a = decide(&inputs(&p, &r, &h, Some(900.0)));
        assert!(matches!(a, Action::Start { node, .. } if node == "c"));
    }

    #[test]
    fn waiting_requests_with_none_started_count_as_over_the_target() {
        let p = TierScaling::default();
        let r = [rep("b", 4, 3, false)];
        let h = [host("c", 2, 1000)];
        assert!(matches!(
            decide(&inputs(&p, &r, &h, None)),
            Action::Start { .. }
        ));
    }

    #[test]
    fn nothing_starts_during_the_cooldown() {
        let p = TierScaling::default();
        let r = [rep("b", 4, 6, false)];
        let h = [host("c", 2, 1000)];
        let mut i = inputs(&p, &r, &h, Some(900.0));
        i.cooled = false;
        assert!(matches!(decide(&i), Action::Hold(_)));
    }

    #[test]
    fn nothing_starts_before_a_whole_window_was_measured() {
        let p = TierScaling::default();
        let r = [rep("b", 4, 6, false)];
        let h = [host("c", 2, 1000)];
        let mut i = inputs(&p, &r, &h, None);
        i.full_window = false;
        assert!(matches!(decide(&i), Action::Hold(w) if w.contains("window")));
    }

    #[test]
    fn nothing_starts_past_max_replicas() {
        let p = TierScaling {
            max_replicas: 1,
            ..Default::default()
        };
        let r = [rep("b", 4, 6, false)];
        let h = [host("c", 2, 1000)];
        assert!(matches!(
            decide(&inputs(&p, &r, &h, Some(900.0))),
            Action::Hold(w) if w.contains("max_replicas")
        ));
    }

    #[test]
    fn a_node_without_room_is_not_chosen() {
        let p = TierScaling::default();
        let r = [rep("b", 4, 6, false)];
        let h = [host("c", 0, 1000), host("d", 2, 10)];
        assert!(matches!(
            decide(&inputs(&p, &r, &h, Some(900.0))),
            Action::Hold(w) if w.contains("cores and memory")
        ));
    }

    #[test]
    fn the_host_with_most_free_cores_is_chosen() {
        let h = [host("c", 2, 1000), host("d", 6, 500), host("e", 6, 500)];
        assert_eq!(best_host(&h).unwrap().node, "d");
    }

    #[test]
    fn below_min_replicas_starts_even_in_the_cooldown() {
        let p = TierScaling {
            min_replicas: 2,
            ..Default::default()
        };
        let r = [rep("b", 0, 0, false)];
        let h = [host("c", 2, 1000)];
        let mut i = inputs(&p, &r, &h, None);
        i.cooled = false;
        assert!(matches!(decide(&i), Action::Start { .. }));
    }

    #[test]
    fn an_idle_extra_replica_drains_the_one_started_on_request() {
        let p = TierScaling::default();
        let r = [rep("b", 1, 0, false), rep("c", 0, 0, true)];
        assert!(matches!(
            decide(&inputs(&p, &r, &[], Some(0.0))),
            Action::Drain { node, .. } if node == "c"
        ));
    }

    #[test]
    fn a_busy_cluster_keeps_its_replicas() {
        let p = TierScaling::default();
        // 3 running would fill 75% of the 4 slots left.
        let r = [rep("b", 2, 0, false), rep("c", 1, 0, true)];
        assert!(matches!(
            decide(&inputs(&p, &r, &[], Some(10.0))),
            Action::Hold(_)
        ));
    }

    #[test]
    fn min_replicas_are_never_drained_for_low_load() {
        let p = TierScaling::default();
        let r = [rep("b", 0, 0, false)];
        assert!(matches!(
            decide(&inputs(&p, &r, &[], None)),
            Action::Hold(_)
        ));
    }

    #[test]
    fn a_pin_overrides_the_policy_both_ways() {
        let p = TierScaling::default();
        let r = [rep("b", 0, 0, false)];
        let h = [host("c", 2, 1000)];
        let mut i = inputs(&p, &r, &h, None);
        i.pinned = Some(2);
        i.cooled = false;
        assert!(matches!(decide(&i), Action::Start { node, .. } if node == "c"));
        let r2 = [rep("b", 4, 9, false), rep("c", 0, 0, true)];
        let mut i = inputs(&p, &r2, &h, Some(5000.0));
        i.pinned = Some(1);
        assert!(matches!(decide(&i), Action::Drain { node, .. } if node == "c"));
    }

    #[test]
    fn a_tier_without_policy_or_pin_is_left_alone() {
        let r = [rep("b", 4, 9, false)];
        let i = Inputs {
            policy: None,
            pinned: None,
            replicas: &r,
            hosts: &[],
            queue_ms: Some(1e6),
            cooled: true,
            full_window: true,
        };
        assert!(matches!(decide(&i), Action::Hold(_)));
    }

    #[test]
    fn queue_time_is_the_mean_over_requests_started_in_the_window() {
        let before: Counters = [("b".into(), (10, 1000)), ("c".into(), (0, 0))].into();
        let after: Counters = [("b".into(), (14, 3000)), ("c".into(), (1, 1000))].into();
        // (2000 + 1000) ms over 5 requests.
        assert_eq!(queue_ms(&before, &after), Some(600.0));
    }

    #[test]
    fn a_restarted_node_or_a_new_one_is_left_out_of_the_queue_time() {
        let before: Counters = [("b".into(), (10, 1000))].into();
        let after: Counters = [("b".into(), (2, 50)), ("c".into(), (5, 500))].into();
        assert_eq!(queue_ms(&before, &after), None);
    }

    #[test]
    fn the_first_name_plans() {
        assert_eq!(leader(["c", "a", "b"]), Some("a"));
        assert_eq!(leader(Vec::<&str>::new()), None);
    }

    #[test]
    fn bounds_are_checked() {
        let bad = TierScaling {
            min_replicas: 3,
            max_replicas: 2,
            ..Default::default()
        };
        assert!(bad.validate().unwrap_err().contains("min_replicas"));
        assert!(TierScaling::default().validate().is_ok());
    }
}
