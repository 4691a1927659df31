//! Placement: which cores each tier's llama.cpp threads run on.
//!
//! [`plan`] is a pure function of a [`Topology`] and each tier's wanted thread count:
//!
//! 1. **No PU is shared.** Tiers get disjoint core sets, one hardware thread per physical
//!    core (llama.cpp's matrix kernels gain little from SMT siblings and lose cache to
//!    them). When the tiers want more threads than there are cores, every tier is shrunk
//!    in proportion to what it asked for (at least one thread each) instead of
//!    oversubscribing. Only when there are more tiers than cores do SMT siblings serve
//!    as separate slots; with more tiers than hardware threads nothing is bound
//!    ([`PlacementPlan::bound`] is false) and the threads are left to the OS.
//! 2. **Locality.** Tiers are placed largest first, each in the NUMA node (else package,
//!    else last-level-cache group) with the fewest free cores that still holds it whole
//!    (best fit), so a tier's threads share one memory controller and its weights stay in
//!    local memory; a tier that fits in no single node spans the emptiest ones.
//! 3. **Memory.** On hosts with several NUMA nodes with CPUs, a tier that sits in one node
//!    gets that node as its memory binding. CPU-less (far-memory) nodes are never bound:
//!    they are reported for the KV page tiers.
//!
//! [`bind_current_thread`] applies one tier's placement to the calling thread with hwloc;
//! the engine calls it on its own thread before creating the llama.cpp context, so the
//! worker threads llama.cpp starts later inherit the mask.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::topology::{cpu_list, Topology};

/// What a node does with its placement plan (`[placement]` in the node config).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlacementMode {
    /// No plan; tiers run with their configured threads, unbound.
    Off,
    /// Plan, log and report it, cap thread counts to it; do not bind. The default:
    /// several nodes on one host (tests, `examples/cluster.sh`) cannot see each other's
    /// plans and would bind to the same cores.
    #[default]
    Plan,
    /// Plan and bind each tier's engine thread (and so llama.cpp's workers) to its cores,
    /// and its memory to its NUMA node on multi-NUMA hosts. For one node per host.
    Bind,
}

/// `[placement]` in the node config.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PlacementConfig {
    /// `off`, `plan` (default) or `bind`.
    pub mode: PlacementMode,
}

/// What one tier asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierDemand {
    /// Tier name.
    pub tier: String,
    /// Threads it is configured with.
    pub threads: usize,
}

/// The core set of one tier.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierPlacement {
    /// Tier name.
    pub tier: String,
    /// Threads it asked for.
    pub wanted: usize,
    /// Threads it gets (= `pus.len()` when bound).
    pub threads: usize,
    /// OS indices of the hardware threads it is bound to; empty when unbound.
    pub pus: Vec<u32>,
    /// Logical indices of the physical cores those belong to.
    pub cores: Vec<usize>,
    /// NUMA nodes (OS index) its cores sit in, when known.
    pub numa_nodes: Vec<u32>,
    /// Packages its cores sit in, when known.
    pub packages: Vec<u32>,
    /// NUMA nodes its memory is bound to (multi-NUMA hosts, tier within one node).
    pub mem_bind: Vec<u32>,
}

impl TierPlacement {
    /// A tier left to the OS scheduler.
    pub fn unbound(tier: &str, wanted: usize, threads: usize) -> Self {
        Self {
            tier: tier.into(),
            wanted,
            threads,
            pus: vec![],
            cores: vec![],
            numa_nodes: vec![],
            packages: vec![],
            mem_bind: vec![],
        }
    }
}

/// A placement of every tier of a node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlacementPlan {
    /// One entry per tier, in the order asked.
    pub tiers: Vec<TierPlacement>,
    /// Whether the core sets are meant to be applied (false: too many tiers for the host).
    pub bound: bool,
    /// Physical cores and hardware threads the plan had.
    pub cores: usize,
    /// Hardware threads the plan had.
    pub pus: usize,
    /// CPU-less NUMA nodes (far memory) left for memory tiers.
    pub far_memory_nodes: Vec<u32>,
    /// Hardware threads of the cores no tier got, for the node's own threads (gateway,
    /// transport); empty when the tiers take every core or nothing is bound.
    #[serde(default)]
    pub node_pus: Vec<u32>,
    /// Shrunk tiers, spanning tiers, unbound tiers: what the operator should know.
    pub warnings: Vec<String>,
}

impl PlacementPlan {
    /// Threads for a tier, if the plan has it.
    pub fn threads_for(&self, tier: &str) -> Option<usize> {
        self.tiers
            .iter()
            .find(|t| t.tier == tier)
            .map(|t| t.threads)
    }

    /// One line per tier plus the warnings, for the start-up log and `mesh status`.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "placement over {} cores / {} hardware threads{}",
            self.cores,
            self.pus,
            if self.bound { "" } else { " (not bound)" }
        );
        for t in &self.tiers {
            let _ = writeln!(
                s,
                "  {:<10} threads {:>3}/{:<3} PUs {:<12} numa {:<6} package {:<6} membind {}",
                t.tier,
                t.threads,
                t.wanted,
                cpu_list(&t.pus),
                list_or_dash(&t.numa_nodes),
                list_or_dash(&t.packages),
                list_or_dash(&t.mem_bind)
            );
        }
        if self.bound {
            let _ = writeln!(
                s,
                "  {:<10} PUs {} (gateway, transport)",
                "node",
                if self.node_pus.is_empty() {
                    "- (every core has a tier: unbound)".to_string()
                } else {
                    cpu_list(&self.node_pus)
                }
            );
        }
        if !self.far_memory_nodes.is_empty() {
            let _ = writeln!(
                s,
                "  far memory (CPU-less NUMA nodes): {}",
                list_or_dash(&self.far_memory_nodes)
            );
        }
        for w in &self.warnings {
            let _ = writeln!(s, "  warning: {w}");
        }
        s
    }
}

fn list_or_dash(v: &[u32]) -> String {
    if v.is_empty() {
        "-".into()
    } else {
        cpu_list(v)
    }
}

/// Splits `total` slots over demands in proportion to them (largest remainder), at least
/// one each; requires `total >= demands.len()`.
fn shrink(demands: &[usize], total: usize) -> Vec<usize> {
    let want: usize = demands.iter().sum();
    if want <= total {
        return demands.to_vec();
    }
    let n = demands.len();
    let spare = total - n;
    let over: Vec<f64> = demands
        .iter()
        .map(|&d| (d - 1) as f64 * spare as f64 / (want - n).max(1) as f64)
        .collect();
    let mut got: Vec<usize> = over.iter().map(|x| 1 + x.floor() as usize).collect();
    let mut left = total - got.iter().sum::<usize>();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| {
        let ra = over[a] - over[a].floor();
        let rb = over[b] - over[b].floor();
        rb.total_cmp(&ra).then(a.cmp(&b))
    });
    for i in order {
        if left == 0 {
            break;
        }
        if got[i] < demands[i] {
            got[i] += 1;
            left -= 1;
        }
    }
    got
}

/// Plans one core set per tier. Pure: same inputs, same plan.
pub fn plan(topo: &Topology, demands: &[TierDemand]) -> PlacementPlan {
    let far: Vec<u32> = topo.far_memory().map(|n| n.os_index).collect();
    let mut out = PlacementPlan {
        tiers: vec![],
        bound: true,
        cores: topo.cores.len(),
        pus: topo.pu_count(),
        far_memory_nodes: far,
        node_pus: vec![],
        warnings: vec![],
    };
    let n = demands.len();
    if n == 0 {
        return out;
    }
    let wanted: Vec<usize> = demands.iter().map(|d| d.threads.max(1)).collect();
    // A slot is one hardware thread; by default the first of each core only.
    let slots_per_core = if n > topo.cores.len() && topo.has_smt() {
        out.warnings.push(format!(
            "{n} tiers on {} cores: SMT siblings used as separate slots",
            topo.cores.len()
        ));
        topo.cores.iter().map(|c| c.pus.len()).max().unwrap_or(1)
    } else {
        1
    };
    let total_slots: usize = topo
        .cores
        .iter()
        .map(|c| c.pus.len().min(slots_per_core))
        .sum();
    if n > total_slots {
        out.bound = false;
        out.warnings.push(format!(
            "{n} tiers but {total_slots} hardware threads: tiers not bound, the OS schedules them"
        ));
        out.tiers = demands
            .iter()
            .zip(&wanted)
            // More tiers than hardware threads already: one thread each.
            .map(|(d, &w)| TierPlacement::unbound(&d.tier, w, 1))
            .collect();
        return out;
    }
    let got = shrink(&wanted, total_slots);
    for (d, (&w, &g)) in demands.iter().zip(wanted.iter().zip(&got)) {
        if g < w {
            out.warnings.push(format!(
                "{}: {w} threads wanted, {g} given ({} wanted in all, {total_slots} available)",
                d.tier,
                wanted.iter().sum::<usize>()
            ));
        }
    }

    // Slots grouped by locality domain: NUMA node, else package, else LLC, else one group.
    let domain_of = |c: &crate::topology::Core| -> (u8, u32) {
        if let Some(nm) = c.numa {
            (0, nm)
        } else if let Some(p) = c.package {
            (1, p)
        } else if let Some(l) = c.llc {
            (2, l)
        } else {
            (3, 0)
        }
    };
    // Each slot: (core index, pu). Within a domain, the last cores first (the first core,
    // where the OS tends to run its own work and interrupts, is left to the node's other
    // threads for as long as possible), first sibling of every core before any second.
    let mut domains: BTreeMap<(u8, u32), Vec<(usize, u32)>> = BTreeMap::new();
    for round in 0..slots_per_core {
        for c in topo.cores.iter().rev() {
            if let Some(&pu) = c.pus.get(round) {
                domains.entry(domain_of(c)).or_default().push((c.index, pu));
            }
        }
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| got[b].cmp(&got[a]).then(a.cmp(&b)));
    let mut placed: Vec<Option<TierPlacement>> = vec![None; n];
    for i in order {
        let need = got[i];
        let fit = domains
            .iter()
            .filter(|(_, free)| free.len() >= need)
            .min_by_key(|(k, free)| (free.len(), **k))
            .map(|(k, _)| *k);
        let mut slots: Vec<(usize, u32)> = vec![];
        match fit {
            Some(k) => {
                let free = domains.get_mut(&k).expect("domain exists");
                slots.extend(free.drain(..need));
            }
            None => {
                while slots.len() < need {
                    let k = *domains
                        .iter()
                        .filter(|(_, f)| !f.is_empty())
                        .max_by_key(|(k, f)| (f.len(), std::cmp::Reverse(**k)))
                        .expect("enough slots in all")
                        .0;
                    let free = domains.get_mut(&k).expect("domain exists");
                    let take = (need - slots.len()).min(free.len());
                    slots.extend(free.drain(..take));
                }
                out.warnings.push(format!(
                    "{}: {need} threads span several NUMA nodes/packages",
                    demands[i].tier
                ));
            }
        }
        let mut cores: Vec<usize> = slots.iter().map(|s| s.0).collect();
        cores.sort_unstable();
        cores.dedup();
        let mut numa: Vec<u32> = cores.iter().filter_map(|&c| topo.cores[c].numa).collect();
        numa.sort_unstable();
        numa.dedup();
        let mut packages: Vec<u32> = cores
            .iter()
            .filter_map(|&c| topo.cores[c].package)
            .collect();
        packages.sort_unstable();
        packages.dedup();
        let cpu_nodes = topo.numa_nodes.iter().filter(|n| !n.is_cpuless()).count();
        let mem_bind = if cpu_nodes > 1 && numa.len() == 1 {
            numa.clone()
        } else {
            vec![]
        };
        let mut pus: Vec<u32> = slots.iter().map(|s| s.1).collect();
        pus.sort_unstable();
        placed[i] = Some(TierPlacement {
            tier: demands[i].tier.clone(),
            wanted: wanted[i],
            threads: pus.len(),
            pus,
            cores,
            numa_nodes: numa,
            packages,
            mem_bind,
        });
    }
    out.tiers = placed
        .into_iter()
        .map(|p| p.expect("every tier placed"))
        .collect();
    let used: std::collections::BTreeSet<usize> =
        out.tiers.iter().flat_map(|t| t.cores.clone()).collect();
    out.node_pus = topo
        .cores
        .iter()
        .filter(|c| !used.contains(&c.index))
        .flat_map(|c| c.pus.clone())
        .collect();
    out.node_pus.sort_unstable();
    out
}

/// Binds every thread of this process to `pus` (hwloc, process CPU binding); threads it
/// starts afterwards inherit the mask. Run before the tiers' engine threads start: each
/// binds itself to its own cores next.
pub fn bind_process(pus: &[u32]) -> Result<(), crate::ControlError> {
    use hwlocality::cpu::binding::CpuBindingFlags;
    use hwlocality::cpu::cpuset::CpuSet;

    let err = |e: String| crate::ControlError::Bind(format!("node threads: {e}"));
    if pus.is_empty() {
        return Err(err("no CPUs left for them".into()));
    }
    let topo = hwlocality::Topology::new().map_err(|e| err(e.to_string()))?;
    let mut set = CpuSet::new();
    for &pu in pus {
        set.set(pu as usize);
    }
    topo.bind_cpu(&set, CpuBindingFlags::PROCESS)
        .map_err(|e| err(e.to_string()))
}

/// What [`bind_current_thread`] managed to apply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BindOutcome {
    /// CPU binding applied.
    pub cpus: bool,
    /// Memory binding applied (only attempted when the placement has one).
    pub memory: Option<bool>,
    /// Why something was not applied.
    pub notes: Vec<String>,
}

/// Binds the calling thread to `placement`'s PUs (and, when it has one, its memory to its
/// NUMA node) through hwloc. Threads the caller starts afterwards inherit the CPU mask.
/// Blocks for the time hwloc takes to read the topology (milliseconds).
pub fn bind_current_thread(placement: &TierPlacement) -> Result<BindOutcome, crate::ControlError> {
    use hwlocality::cpu::binding::CpuBindingFlags;
    use hwlocality::cpu::cpuset::CpuSet;
    use hwlocality::memory::binding::{MemoryBindingFlags, MemoryBindingPolicy};
    use hwlocality::memory::nodeset::NodeSet;

    let err = |e: String| crate::ControlError::Bind(format!("{}: {e}", placement.tier));
    if placement.pus.is_empty() {
        return Err(err("no CPUs in the placement".into()));
    }
    let topo = hwlocality::Topology::new().map_err(|e| err(e.to_string()))?;
    let mut set = CpuSet::new();
    for &pu in &placement.pus {
        set.set(pu as usize);
    }
    topo.bind_cpu(&set, CpuBindingFlags::THREAD | CpuBindingFlags::STRICT)
        .map_err(|e| err(e.to_string()))?;
    let mut out = BindOutcome {
        cpus: true,
        memory: None,
        notes: vec![],
    };
    if !placement.mem_bind.is_empty() {
        let mut nodes = NodeSet::new();
        for &n in &placement.mem_bind {
            nodes.set(n as usize);
        }
        match topo.bind_memory(
            &nodes,
            MemoryBindingPolicy::Bind,
            MemoryBindingFlags::THREAD,
        ) {
            Ok(()) => out.memory = Some(true),
            Err(e) => {
                out.memory = Some(false);
                out.notes.push(format!("memory binding: {e}"));
            }
        }
    }
    Ok(out)
}

/// One GPU as the GPU plan sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuSpace {
    /// GPU index (0 = the first GPU, as `gpu` in a tier config counts).
    pub index: usize,
    /// Free device memory when the node starts.
    pub free: u64,
}

/// What one tier asks of the GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuDemand {
    /// Tier name.
    pub tier: String,
    /// Device bytes it takes (weights and KV of its offloaded layers, working buffers);
    /// 0 for a tier kept on the CPU (`gpu_layers = 0`).
    pub bytes: u64,
    /// The GPU its config names, if any: kept as given.
    pub pinned: Option<usize>,
}

/// Where a tier's offloaded layers go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuChoice {
    /// No GPU: no GPU on the host, `gpu_layers = 0`, or it fits in no GPU memory at all.
    Cpu,
    /// This GPU alone.
    Gpu(usize),
    /// Split over every GPU (llama.cpp's layer split): it fits in their memory together only.
    Split,
}

/// The GPU plan of one tier.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuAssignment {
    /// Tier name.
    pub tier: String,
    /// Device bytes it was planned with.
    pub bytes: u64,
    /// Where it goes.
    pub choice: GpuChoice,
}

/// Every tier's GPU, and what the operator should know.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct GpuPlan {
    /// One entry per tier, in the order asked.
    pub tiers: Vec<GpuAssignment>,
    /// Free bytes left on each GPU (by position in the `gpus` given) after the plan.
    pub free_after: Vec<u64>,
    /// Tiers moved to the CPU, split, or pinned past a GPU's free memory.
    pub warnings: Vec<String>,
}

impl GpuPlan {
    /// One line per tier plus the warnings, for the start-up log and `mesh topology`.
    pub fn render(&self) -> String {
        let mut s = String::new();
        for t in &self.tiers {
            let at = match t.choice {
                GpuChoice::Cpu => "cpu".to_string(),
                GpuChoice::Gpu(i) => format!("gpu {i}"),
                GpuChoice::Split => "split over every gpu".to_string(),
            };
            let _ = writeln!(
                s,
                "  {:<10} {at} ({:.1} GiB of device memory)",
                t.tier,
                t.bytes as f64 / f64::from(1u32 << 30)
            );
        }
        for w in &self.warnings {
            let _ = writeln!(s, "  warning: {w}");
        }
        s
    }
}

/// Plans which GPU each tier's offloaded layers go to. Pure: same inputs, same plan.
///
/// - A tier whose config names a GPU keeps it (a warning when it exceeds that GPU's free
///   memory: llama.cpp will fail to allocate).
/// - The others, largest first, go to the GPU with the most free memory that holds them
///   whole, so tiers spread over the GPUs (each decodes on a device of its own when there
///   are enough) and the large ones find room.
/// - A tier that fits in no single GPU but in all of them together is split over every GPU.
/// - A tier that fits nowhere runs on the CPU: it would fail to load otherwise. Setting
///   `gpu_layers` to a count offloads part of it.
pub fn plan_gpus(gpus: &[GpuSpace], demands: &[GpuDemand]) -> GpuPlan {
    let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
    let mut free: Vec<u64> = gpus.iter().map(|g| g.free).collect();
    let mut choice: Vec<GpuChoice> = vec![GpuChoice::Cpu; demands.len()];
    let mut warnings = vec![];
    if gpus.is_empty() {
        return GpuPlan {
            tiers: demands
                .iter()
                .map(|d| GpuAssignment {
                    tier: d.tier.clone(),
                    bytes: d.bytes,
                    choice: GpuChoice::Cpu,
                })
                .collect(),
            free_after: vec![],
            warnings,
        };
    }
    for (i, d) in demands.iter().enumerate() {
        let Some(p) = d.pinned else { continue };
        if d.bytes == 0 {
            continue;
        }
        choice[i] = GpuChoice::Gpu(p);
        if let Some(pos) = gpus.iter().position(|g| g.index == p) {
            if d.bytes > free[pos] {
                warnings.push(format!(
                    "{}: needs {:.1} GiB on gpu {p}, which has {:.1} GiB free",
                    d.tier,
                    gib(d.bytes),
                    gib(free[pos])
                ));
            }
            free[pos] = free[pos].saturating_sub(d.bytes);
        }
    }
    let mut order: Vec<usize> = (0..demands.len())
        .filter(|&i| demands[i].pinned.is_none() && demands[i].bytes > 0)
        .collect();
    order.sort_by(|&a, &b| demands[b].bytes.cmp(&demands[a].bytes).then(a.cmp(&b)));
    for i in order {
        let d = &demands[i];
        let best = (0..gpus.len())
            .filter(|&g| free[g] >= d.bytes)
            .max_by(|&a, &b| free[a].cmp(&free[b]).then(b.cmp(&a)));
        let total: u64 = free.iter().sum();
        if let Some(g) = best {
            free[g] -= d.bytes;
            choice[i] = GpuChoice::Gpu(gpus[g].index);
        } else if total >= d.bytes {
            // llama.cpp splits by its own rule; the plan takes from each GPU in proportion
            // to its free memory.
            let mut left = d.bytes;
            for (g, f) in free.iter_mut().enumerate() {
                let take = if g + 1 == gpus.len() {
                    left
                } else {
                    ((u128::from(*f) * u128::from(d.bytes)) / u128::from(total.max(1))) as u64
                };
                let take = take.min(*f).min(left);
                *f -= take;
                left -= take;
            }
            choice[i] = GpuChoice::Split;
            warnings.push(format!(
                "{}: {:.1} GiB fits in no single gpu: split over every gpu",
                d.tier,
                gib(d.bytes)
            ));
        } else {
            warnings.push(format!(
                "{}: needs {:.1} GiB of device memory, the gpus have {:.1} GiB free: runs on the cpu (set gpu_layers to a count to offload part of it)",
                d.tier,
                gib(d.bytes),
                gib(total)
            ));
        }
    }
    GpuPlan {
        tiers: demands
            .iter()
            .zip(choice)
            .map(|(d, choice)| GpuAssignment {
                tier: d.tier.clone(),
                bytes: d.bytes,
                choice,
            })
            .collect(),
        free_after: free,
        warnings,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::{Core, NumaNode, Package};

    fn allowed_cpus_of_this_thread() -> Vec<u32> {
        let s = std::fs::read_to_string("/proc/thread-self/status").unwrap();
        let line = s
            .lines()
            .find(|l| l.starts_with("Cpus_allowed_list:"))
            .unwrap();
        crate::topology::parse_cpu_list(line.split_once(':').unwrap().1.trim()).unwrap()
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn binding_applies_to_the_thread_and_the_threads_it_starts() {
        let topo = Topology::detect();
        let last = topo.cores.last().unwrap().pus[0];
        let p = TierPlacement {
            pus: vec![last],
            cores: vec![topo.cores.len() - 1],
            ..TierPlacement::unbound("t", 1, 1)
        };
        let before = allowed_cpus_of_this_thread();
        let (own, child) = std::thread::spawn(move || {
            let out = bind_current_thread(&p).unwrap();
            assert!(out.cpus && out.memory.is_none(), "{out:?}");
            let own = allowed_cpus_of_this_thread();
            let child = std::thread::spawn(allowed_cpus_of_this_thread)
                .join()
                .unwrap();
            (own, child)
        })
        .join()
        .unwrap();
        assert_eq!(own, vec![last]);
        assert_eq!(
            child,
            vec![last],
            "a worker started later inherits the mask"
        );
        assert_eq!(
            allowed_cpus_of_this_thread(),
            before,
            "other threads untouched"
        );
        assert!(bind_current_thread(&TierPlacement::unbound("u", 1, 1)).is_err());
    }

    /// `sockets` x `cores` cores, `smt` threads per core, one NUMA node per socket;
    /// PU numbering like Linux: first siblings 0.., second siblings after all cores.
    fn host(sockets: u32, cores: u32, smt: u32) -> Topology {
        let mut t = Topology::empty("synthetic");
        let total = sockets * cores;
        for s in 0..sockets {
            t.packages.push(Package {
                os_index: Some(s),
                cpu_model: None,
            });
            let mut node = NumaNode {
                os_index: s,
                memory_bytes: Some(64 << 30),
                pus: vec![],
                subtype: None,
            };
            for c in 0..cores {
                let id = s * cores + c;
                let pus: Vec<u32> = (0..smt).map(|k| id + k * total).collect();
                node.pus.extend(&pus);
                t.cores.push(Core {
                    index: id as usize,
                    os_index: Some(c),
                    package: Some(s),
                    numa: Some(s),
                    llc: Some(s),
                    pus,
                });
            }
            t.numa_nodes.push(node);
        }
        t
    }

    fn demand(v: &[(&str, usize)]) -> Vec<TierDemand> {
        v.iter()
            .map(|(t, n)| TierDemand {
                tier: (*t).into(),
                threads: *n,
            })
            .collect()
    }

    fn assert_disjoint(p: &PlacementPlan) {
        let mut all: Vec<u32> = p.tiers.iter().flat_map(|t| t.pus.clone()).collect();
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n, "a PU given twice: {p:?}");
        for t in &p.tiers {
            assert_eq!(t.threads, t.pus.len(), "{t:?}");
        }
    }

    #[test]
    fn one_socket_eight_cores_fits_without_sharing() {
        let t = host(1, 8, 1);
        let p = plan(&t, &demand(&[("t1", 2), ("t2", 2), ("t3", 4)]));
        assert!(p.bound && p.warnings.is_empty(), "{p:?}");
        assert_disjoint(&p);
        let threads: Vec<usize> = p.tiers.iter().map(|t| t.threads).collect();
        assert_eq!(threads, vec![2, 2, 4]);
        // The largest tier is placed first, on the last cores.
        assert_eq!(p.tiers[2].pus, vec![4, 5, 6, 7]);
        assert!(p.node_pus.is_empty(), "every core has a tier");
        assert!(p.render().contains("every core has a tier"));
        // Single NUMA node: no memory binding.
        assert!(p.tiers.iter().all(|t| t.mem_bind.is_empty()));
    }

    #[test]
    fn cores_no_tier_gets_go_to_the_node_threads_first_core_included() {
        let t = host(1, 8, 2);
        let p = plan(&t, &demand(&[("t1", 2), ("t3", 3)]));
        assert_disjoint(&p);
        assert_eq!(p.tiers[1].pus, vec![5, 6, 7]);
        assert_eq!(p.tiers[0].pus, vec![3, 4]);
        // Cores 0-2 with their SMT siblings (8-10); no sibling of a tier core.
        assert_eq!(p.node_pus, vec![0, 1, 2, 8, 9, 10]);
        assert!(
            p.render().contains("node       PUs 0-2,8-10"),
            "{}",
            p.render()
        );
        // Not bound: nothing for the node either.
        let p = plan(&host(1, 2, 1), &demand(&[("a", 4), ("b", 1), ("c", 1)]));
        assert!(!p.bound && p.node_pus.is_empty());
    }

    #[test]
    fn demand_beyond_cores_shrinks_in_proportion() {
        let t = host(1, 8, 1);
        let p = plan(&t, &demand(&[("t1", 4), ("t2", 4), ("t3", 8)]));
        assert_disjoint(&p);
        let threads: Vec<usize> = p.tiers.iter().map(|t| t.threads).collect();
        assert_eq!(threads.iter().sum::<usize>(), 8);
        assert_eq!(threads, vec![2, 2, 4]);
        assert_eq!(p.warnings.len(), 3, "{:?}", p.warnings);
        assert!(p.warnings[0].contains("4 threads wanted, 2 given"));
        // Every tier keeps at least one thread even when one asks for far more.
        let p = plan(&t, &demand(&[("small", 1), ("huge", 100)]));
        assert_eq!(p.tiers[0].threads, 1);
        assert_eq!(p.tiers[1].threads, 7);
        assert_disjoint(&p);
    }

    #[test]
    fn two_sockets_smt_keep_tiers_in_one_node_on_first_siblings() {
        let t = host(2, 32, 2);
        assert_eq!(t.pu_count(), 128);
        let p = plan(&t, &demand(&[("t1", 8), ("t2", 16), ("t3", 32)]));
        assert!(p.bound && p.warnings.is_empty(), "{:?}", p.warnings);
        assert_disjoint(&p);
        for tp in &p.tiers {
            assert_eq!(tp.numa_nodes.len(), 1, "{tp:?} stays in one node");
            assert_eq!(tp.packages, tp.numa_nodes);
            assert_eq!(tp.mem_bind, tp.numa_nodes, "memory follows the cores");
            assert!(
                tp.pus.iter().all(|&pu| pu < 64),
                "no SMT sibling used: {tp:?}"
            );
            assert_eq!(tp.cores.len(), tp.threads, "one PU per core");
        }
        // t3 fills a whole socket; t1 and t2 share the other.
        assert_ne!(p.tiers[2].numa_nodes, p.tiers[0].numa_nodes);
        assert_eq!(p.tiers[0].numa_nodes, p.tiers[1].numa_nodes);
    }

    #[test]
    fn a_tier_larger_than_a_socket_spans_and_says_so() {
        let t = host(2, 32, 2);
        let p = plan(&t, &demand(&[("big", 48), ("small", 8)]));
        assert_disjoint(&p);
        assert_eq!(p.tiers[0].threads, 48);
        assert_eq!(p.tiers[0].numa_nodes, vec![0, 1]);
        assert!(p.tiers[0].mem_bind.is_empty(), "spanning tier: no membind");
        assert_eq!(p.tiers[1].numa_nodes.len(), 1);
        assert!(p
            .warnings
            .iter()
            .any(|w| w.contains("big") && w.contains("span")));
    }

    #[test]
    fn cpuless_node_is_reported_never_bound() {
        let mut t = host(1, 8, 1);
        t.numa_nodes.push(NumaNode {
            os_index: 1,
            memory_bytes: Some(256 << 30),
            pus: vec![],
            subtype: Some("CXL-DRAM".into()),
        });
        let p = plan(&t, &demand(&[("t1", 4), ("t2", 4)]));
        assert_eq!(p.far_memory_nodes, vec![1]);
        assert_disjoint(&p);
        for tp in &p.tiers {
            assert_eq!(tp.numa_nodes, vec![0]);
            assert!(
                tp.mem_bind.is_empty(),
                "one node with CPUs: nothing to choose"
            );
        }
        assert!(p.render().contains("far memory (CPU-less NUMA nodes): 1"));
    }

    #[test]
    fn more_tiers_than_cores_uses_siblings_then_gives_up_binding() {
        let t = host(1, 2, 2);
        let p = plan(&t, &demand(&[("a", 1), ("b", 1), ("c", 1)]));
        assert!(p.bound);
        assert_disjoint(&p);
        assert!(p.warnings[0].contains("SMT siblings"));
        let t = host(1, 2, 1);
        let p = plan(&t, &demand(&[("a", 4), ("b", 1), ("c", 1)]));
        assert!(!p.bound);
        assert!(p.tiers.iter().all(|t| t.pus.is_empty() && t.threads == 1));
        assert!(p.render().contains("not bound"));
    }

    #[test]
    fn unknown_locality_still_plans() {
        let mut t = Topology::empty("fallback");
        for i in 0..4 {
            t.cores.push(Core {
                index: i,
                os_index: None,
                package: None,
                numa: None,
                llc: None,
                pus: vec![i as u32],
            });
        }
        let p = plan(&t, &demand(&[("t1", 3), ("t2", 3)]));
        assert_disjoint(&p);
        assert_eq!(
            p.tiers.iter().map(|t| t.threads).collect::<Vec<_>>(),
            vec![2, 2]
        );
        assert!(p.tiers.iter().all(|t| t.numa_nodes.is_empty()));
        assert_eq!(p.threads_for("t2"), Some(2));
        assert_eq!(plan(&t, &[]).tiers.len(), 0);
    }

    const GIB: u64 = 1 << 30;

    fn gpus(free: &[u64]) -> Vec<GpuSpace> {
        free.iter()
            .enumerate()
            .map(|(index, &f)| GpuSpace {
                index,
                free: f * GIB,
            })
            .collect()
    }

    fn gpu_demand(tier: &str, gib: u64, pinned: Option<usize>) -> GpuDemand {
        GpuDemand {
            tier: tier.into(),
            bytes: gib * GIB,
            pinned,
        }
    }

    fn choices(p: &GpuPlan) -> Vec<GpuChoice> {
        p.tiers.iter().map(|t| t.choice).collect()
    }

    #[test]
    fn tiers_spread_over_gpus_largest_first() {
        let p = plan_gpus(
            &gpus(&[24, 24]),
            &[
                gpu_demand("t1", 2, None),
                gpu_demand("t3", 16, None),
                gpu_demand("t2", 6, None),
            ],
        );
        // t3 takes gpu 0 (tie: lower index), t2 then the emptier gpu 1, t1 gpu 1 again.
        assert_eq!(
            choices(&p),
            [GpuChoice::Gpu(1), GpuChoice::Gpu(0), GpuChoice::Gpu(1)]
        );
        assert_eq!(p.free_after, [8 * GIB, 16 * GIB]);
        assert!(p.warnings.is_empty(), "{:?}", p.warnings);
    }

    #[test]
    fn a_pinned_tier_keeps_its_gpu_and_others_avoid_the_space_it_took() {
        let p = plan_gpus(
            &gpus(&[24, 24]),
            &[gpu_demand("big", 20, Some(1)), gpu_demand("t2", 10, None)],
        );
        assert_eq!(choices(&p), [GpuChoice::Gpu(1), GpuChoice::Gpu(0)]);
    }

    #[test]
    fn a_pinned_tier_past_its_gpus_free_memory_is_warned_about() {
        let p = plan_gpus(&gpus(&[8]), &[gpu_demand("big", 20, Some(0))]);
        assert_eq!(choices(&p), [GpuChoice::Gpu(0)]);
        assert!(
            p.warnings[0].contains("needs 20.0 GiB on gpu 0"),
            "{:?}",
            p.warnings
        );
    }

    #[test]
    fn a_tier_too_large_for_one_gpu_is_split_over_all() {
        let p = plan_gpus(&gpus(&[24, 24]), &[gpu_demand("70b", 40, None)]);
        assert_eq!(choices(&p), [GpuChoice::Split]);
        assert_eq!(p.free_after.iter().sum::<u64>(), 8 * GIB);
    }

    #[test]
    fn a_tier_too_large_for_every_gpu_runs_on_the_cpu_with_a_warning() {
        let p = plan_gpus(&gpus(&[24]), &[gpu_demand("405b", 200, None)]);
        assert_eq!(choices(&p), [GpuChoice::Cpu]);
        assert!(
            p.warnings[0].contains("runs on the cpu"),
            "{:?}",
            p.warnings
        );
    }

    #[test]
    fn cpu_tiers_and_gpu_less_hosts_plan_the_cpu() {
        let p = plan_gpus(&gpus(&[24]), &[gpu_demand("cpu", 0, None)]);
        assert_eq!(choices(&p), [GpuChoice::Cpu]);
        let p = plan_gpus(&[], &[gpu_demand("t1", 2, None)]);
        assert_eq!(choices(&p), [GpuChoice::Cpu]);
    }
}
