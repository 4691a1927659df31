//! What this host's CPUs and memory look like: packages, NUMA nodes (including CPU-less
//! memory nodes such as CXL-attached far memory), cores, their hardware threads (PUs),
//! cache sizes and the CPU features that select llama.cpp's kernels.
//!
//! [`Topology::detect`] asks hwloc (through `hwlocality`); the placement planner
//! ([`crate::placement`]) only reads the plain, serializable [`Topology`] it returns, so
//! tests build synthetic hosts by hand. Where hwloc reports less (containers, VMs, a
//! missing library), fields are `None` or lists are empty, never zero, and
//! [`Topology::notes`] says what was missing; without hwloc the snapshot falls back to one
//! core per CPU the process may run on.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

/// A snapshot of the host as seen by this process (CPUs outside its cgroup/affinity are
/// left out by hwloc).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Topology {
    /// Where the facts came from: `hwloc <version>`, `fallback` or `synthetic`.
    pub source: String,
    /// CPU architecture (`x86_64`, `aarch64`, ...).
    pub arch: String,
    /// CPU model name, when the OS reports one.
    pub cpu_model: Option<String>,
    /// Physical packages (sockets); empty when unknown.
    pub packages: Vec<Package>,
    /// NUMA nodes, those with CPUs and CPU-less memory nodes; empty when unknown.
    pub numa_nodes: Vec<NumaNode>,
    /// Physical cores the process may use, in hwloc's logical order (neighbours share caches).
    pub cores: Vec<Core>,
    /// Cache levels with their sizes.
    pub caches: Vec<CacheLevel>,
    /// Memory the machine reports in total, in bytes.
    pub total_memory_bytes: Option<u64>,
    /// CPU features that select llama.cpp kernels, `true`/`false` for those checked on
    /// this architecture (absent = not checked).
    pub features: BTreeMap<String, bool>,
    /// What could not be learned, for the operator.
    pub notes: Vec<String>,
}

/// One physical package (socket).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Package {
    /// OS index of the package, when known.
    pub os_index: Option<u32>,
    /// CPU model reported for this package, when known.
    pub cpu_model: Option<String>,
}

/// One NUMA node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NumaNode {
    /// OS index (what `numactl` calls the node).
    pub os_index: u32,
    /// Local memory in bytes, when reported.
    pub memory_bytes: Option<u64>,
    /// OS indices of the PUs local to the node; empty for a CPU-less memory node.
    pub pus: Vec<u32>,
    /// hwloc's subtype (`HBM`, `DRAM`, `NVM`, `SPM`, `CXL-DRAM`, ...), when reported.
    pub subtype: Option<String>,
}

impl NumaNode {
    /// A node without CPUs: far memory (CXL, HBM exposed as memory-only, persistent memory).
    pub fn is_cpuless(&self) -> bool {
        self.pus.is_empty()
    }
}

/// One physical core.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Core {
    /// Position of the core in the snapshot (hwloc's logical order).
    pub index: usize,
    /// OS index of the core, when known.
    pub os_index: Option<u32>,
    /// Package (by `os_index`) the core sits in, when known.
    pub package: Option<u32>,
    /// NUMA node (by `os_index`) whose memory is local to the core, when known.
    pub numa: Option<u32>,
    /// Index of the last-level cache shared by this core (cores with the same value share
    /// it), when known.
    pub llc: Option<u32>,
    /// OS indices of the core's hardware threads (SMT siblings); the first is used first.
    pub pus: Vec<u32>,
}

/// One level of cache.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheLevel {
    /// `L1d`, `L1i`, `L2`, `L3`, ...
    pub name: String,
    /// Size of one instance in bytes, when reported.
    pub size_bytes: Option<u64>,
    /// How many instances the process can use.
    pub instances: usize,
    /// Cores sharing one instance.
    pub cores_per_instance: Option<usize>,
}

impl Topology {
    /// A topology with no facts, to be filled in (used by tests and by the fallback).
    pub fn empty(source: &str) -> Self {
        Self {
            source: source.to_owned(),
            arch: std::env::consts::ARCH.to_owned(),
            cpu_model: None,
            packages: vec![],
            numa_nodes: vec![],
            cores: vec![],
            caches: vec![],
            total_memory_bytes: None,
            features: BTreeMap::new(),
            notes: vec![],
        }
    }

    /// Hardware threads over all cores.
    pub fn pu_count(&self) -> usize {
        self.cores.iter().map(|c| c.pus.len()).sum()
    }

    /// Whether any core has more than one hardware thread.
    pub fn has_smt(&self) -> bool {
        self.cores.iter().any(|c| c.pus.len() > 1)
    }

    /// NUMA nodes that hold memory but no CPUs (far memory).
    pub fn far_memory(&self) -> impl Iterator<Item = &NumaNode> {
        self.numa_nodes.iter().filter(|n| n.is_cpuless())
    }

    /// Size of one instance of a cache level (`"L3"`), when reported.
    pub fn cache_size(&self, name: &str) -> Option<u64> {
        self.caches
            .iter()
            .find(|c| c.name == name)
            .and_then(|c| c.size_bytes)
    }

    /// Reads the host: hwloc when it works, else the fallback (see the module docs).
    pub fn detect() -> Self {
        let mut t = match detect::with_hwloc() {
            Ok(t) => t,
            Err(why) => {
                let mut t = detect::fallback();
                t.notes.insert(0, format!("hwloc unavailable: {why}"));
                t
            }
        };
        t.features = features::detect();
        if t.cpu_model.is_none() {
            t.cpu_model = features::cpuinfo_model();
        }
        if t.features.is_empty() {
            t.notes.push(format!(
                "CPU feature detection not implemented for {}",
                t.arch
            ));
        }
        t
    }

    /// A human-readable report (what `mesh topology` prints).
    pub fn render(&self) -> String {
        let mut s = String::new();
        let or_unknown = |o: Option<String>| o.unwrap_or_else(|| "unknown".into());
        let _ = writeln!(s, "source     {}", self.source);
        let _ = writeln!(
            s,
            "cpu        {} ({})",
            or_unknown(self.cpu_model.clone()),
            self.arch
        );
        let _ = writeln!(
            s,
            "packages   {}",
            if self.packages.is_empty() {
                "unknown".into()
            } else {
                self.packages.len().to_string()
            }
        );
        let _ = writeln!(
            s,
            "cores      {} physical, {} hardware threads{}",
            self.cores.len(),
            self.pu_count(),
            if self.has_smt() { " (SMT)" } else { "" }
        );
        let _ = writeln!(
            s,
            "memory     {}",
            or_unknown(self.total_memory_bytes.map(human_bytes))
        );
        if self.caches.is_empty() {
            let _ = writeln!(s, "caches     unknown");
        }
        for c in &self.caches {
            let _ = writeln!(
                s,
                "cache      {:<4} {:>9} x {}{}",
                c.name,
                or_unknown(c.size_bytes.map(human_bytes)),
                c.instances,
                match c.cores_per_instance {
                    Some(1) => " (per core)".to_owned(),
                    Some(n) => format!(" (shared by {n} cores)"),
                    None => String::new(),
                }
            );
        }
        if self.numa_nodes.is_empty() {
            let _ = writeln!(s, "numa       unknown");
        }
        for n in &self.numa_nodes {
            let _ = writeln!(
                s,
                "numa       node {}: {}, {}{}",
                n.os_index,
                or_unknown(n.memory_bytes.map(human_bytes)),
                if n.is_cpuless() {
                    "no CPUs (far memory)".to_owned()
                } else {
                    format!("CPUs {}", cpu_list(&n.pus))
                },
                n.subtype
                    .as_ref()
                    .map(|t| format!(" [{t}]"))
                    .unwrap_or_default()
            );
        }
        for c in &self.cores {
            let _ = writeln!(
                s,
                "core       {:>3}: PUs {:<8} package {:<7} numa {:<7} llc {}",
                c.index,
                cpu_list(&c.pus),
                opt(c.package),
                opt(c.numa),
                opt(c.llc)
            );
        }
        let have: Vec<&str> = self
            .features
            .iter()
            .filter(|(_, v)| **v)
            .map(|(k, _)| k.as_str())
            .collect();
        let lack: Vec<&str> = self
            .features
            .iter()
            .filter(|(_, v)| !**v)
            .map(|(k, _)| k.as_str())
            .collect();
        let _ = writeln!(s, "features   {}", join_or_none(&have));
        let _ = writeln!(s, "lacking    {}", join_or_none(&lack));
        for n in &self.notes {
            let _ = writeln!(s, "note       {n}");
        }
        s
    }
}

fn opt(v: Option<u32>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "?".into())
}

fn join_or_none(v: &[&str]) -> String {
    if v.is_empty() {
        "none".into()
    } else {
        v.join(" ")
    }
}

/// `0-3,8,10-11` for a sorted or unsorted list of CPU ids.
pub fn cpu_list(ids: &[u32]) -> String {
    let mut v = ids.to_vec();
    v.sort_unstable();
    v.dedup();
    let mut out: Vec<String> = vec![];
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        out.push(if j == i {
            v[i].to_string()
        } else {
            format!("{}-{}", v[i], v[j])
        });
        i = j + 1;
    }
    if out.is_empty() {
        "-".into()
    } else {
        out.join(",")
    }
}

/// `1.5 GiB`, `48 KiB`.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 || v.fract() == 0.0 {
        format!("{v:.0} {}", UNITS[u])
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

mod detect {
    use super::*;

    /// One core per CPU in this process's affinity mask (Linux), else per
    /// `available_parallelism`; nothing else is known.
    pub(super) fn fallback() -> Topology {
        let mut t = Topology::empty("fallback");
        let cpus = affinity_cpus().unwrap_or_else(|| {
            let n = std::thread::available_parallelism().map_or(1, |n| n.get());
            (0..n as u32).collect()
        });
        t.cores = cpus
            .iter()
            .enumerate()
            .map(|(i, &cpu)| Core {
                index: i,
                os_index: None,
                package: None,
                numa: None,
                llc: None,
                pus: vec![cpu],
            })
            .collect();
        t.notes
            .push("SMT siblings, packages, NUMA nodes and caches unknown".into());
        t
    }

    fn affinity_cpus() -> Option<Vec<u32>> {
        // `Cpus_allowed_list:   0-3,8` in /proc/self/status.
        let s = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = s.lines().find(|l| l.starts_with("Cpus_allowed_list:"))?;
        parse_cpu_list(line.split_once(':')?.1.trim())
    }

    pub(super) fn parse_cpu_list(s: &str) -> Option<Vec<u32>> {
        let mut v = vec![];
        for part in s.split(',').filter(|p| !p.is_empty()) {
            match part.split_once('-') {
                Some((a, b)) => v.extend(a.trim().parse::<u32>().ok()?..=b.trim().parse().ok()?),
                None => v.push(part.trim().parse().ok()?),
            }
        }
        (!v.is_empty()).then_some(v)
    }

    pub(super) fn with_hwloc() -> Result<Topology, String> {
        super::hw::read()
    }
}

#[cfg(test)]
pub(crate) fn parse_cpu_list(s: &str) -> Option<Vec<u32>> {
    detect::parse_cpu_list(s)
}

mod hw {
    //! The hwloc reader. Kept apart so the rest of the module never touches hwloc types.
    use hwlocality::object::types::ObjectType;
    use hwlocality::object::TopologyObject;

    use super::*;

    fn os_index(o: &TopologyObject) -> Option<u32> {
        o.os_index().and_then(|i| u32::try_from(i).ok())
    }

    fn pus_of(topo: &hwlocality::Topology, o: &TopologyObject) -> Vec<u32> {
        let Some(set) = o.cpuset() else {
            return vec![];
        };
        topo.objects_with_type(ObjectType::PU)
            .filter(|pu| pu.cpuset().is_some_and(|s| set.includes(s)))
            .filter_map(os_index)
            .collect()
    }

    fn ancestor(o: &TopologyObject, ty: ObjectType) -> Option<&TopologyObject> {
        o.ancestors().find(|a| a.object_type() == ty)
    }

    pub(super) fn read() -> Result<Topology, String> {
        let topo = hwlocality::Topology::new().map_err(|e| e.to_string())?;
        let v = hwlocality::hwloc_api_version();
        let mut t = Topology::empty(&format!(
            "hwloc (API {}.{}.{})",
            v >> 16,
            (v >> 8) & 0xff,
            v & 0xff
        ));
        t.packages = topo
            .objects_with_type(ObjectType::Package)
            .map(|p| Package {
                os_index: os_index(p),
                cpu_model: p
                    .info("CPUModel")
                    .and_then(|s| s.to_str().ok())
                    .map(str::to_owned),
            })
            .collect();
        t.cpu_model = t.packages.iter().find_map(|p| p.cpu_model.clone());
        t.numa_nodes = topo
            .objects_with_type(ObjectType::NUMANode)
            .filter_map(|n| {
                Some(NumaNode {
                    os_index: os_index(n)?,
                    memory_bytes: match n.attributes() {
                        Some(hwlocality::object::attributes::ObjectAttributes::NUMANode(a)) => {
                            a.local_memory().map(|m| m.get())
                        }
                        _ => None,
                    },
                    pus: pus_of(&topo, n),
                    subtype: n.subtype().and_then(|s| s.to_str().ok()).map(str::to_owned),
                })
            })
            .collect();
        let total: u64 = t.numa_nodes.iter().filter_map(|n| n.memory_bytes).sum();
        t.total_memory_bytes = (total > 0).then_some(total);

        let llc_type = [ObjectType::L3Cache, ObjectType::L2Cache]
            .into_iter()
            .find(|ty| topo.objects_with_type(*ty).next().is_some());
        t.cores = topo
            .objects_with_type(ObjectType::Core)
            .enumerate()
            .map(|(i, c)| {
                let numa = c.cpuset().and_then(|cs| {
                    topo.objects_with_type(ObjectType::NUMANode).find_map(|n| {
                        n.cpuset()
                            .is_some_and(|ns| !ns.is_empty() && ns.includes(cs))
                            .then(|| os_index(n))
                            .flatten()
                    })
                });
                Core {
                    index: i,
                    os_index: os_index(c),
                    package: ancestor(c, ObjectType::Package).and_then(os_index),
                    numa,
                    llc: llc_type
                        .and_then(|ty| ancestor(c, ty))
                        .map(|o| o.logical_index() as u32),
                    pus: pus_of(&topo, c),
                }
            })
            .filter(|c| !c.pus.is_empty())
            .collect();
        if t.cores.is_empty() {
            // Some VMs report PUs without cores: treat each PU as a core.
            t.cores = topo
                .objects_with_type(ObjectType::PU)
                .enumerate()
                .filter_map(|(i, pu)| {
                    Some(Core {
                        index: i,
                        os_index: None,
                        package: ancestor(pu, ObjectType::Package).and_then(os_index),
                        numa: None,
                        llc: None,
                        pus: vec![os_index(pu)?],
                    })
                })
                .collect();
            t.notes
                .push("hwloc reported no cores: one core per hardware thread assumed".into());
        }
        if t.cores.is_empty() {
            return Err("hwloc reported no CPUs".into());
        }
        for (ty, name) in [
            (ObjectType::L1Cache, "L1d"),
            (ObjectType::L1ICache, "L1i"),
            (ObjectType::L2Cache, "L2"),
            (ObjectType::L3Cache, "L3"),
        ] {
            let caches: Vec<&TopologyObject> = topo.objects_with_type(ty).collect();
            let Some(first) = caches.first() else {
                continue;
            };
            let size = match first.attributes() {
                Some(hwlocality::object::attributes::ObjectAttributes::Cache(a)) => {
                    a.size().map(|s| s.get())
                }
                _ => None,
            };
            let cores = topo
                .objects_with_type(ObjectType::Core)
                .filter(|c| {
                    c.cpuset()
                        .zip(first.cpuset())
                        .is_some_and(|(cs, fs)| fs.includes(cs))
                })
                .count();
            t.caches.push(CacheLevel {
                name: name.into(),
                size_bytes: size,
                instances: caches.len(),
                cores_per_instance: (cores > 0).then_some(cores),
            });
        }
        if t.packages.is_empty() {
            t.notes.push("hwloc reported no packages".into());
        }
        if t.numa_nodes.is_empty() {
            t.notes.push("hwloc reported no NUMA nodes".into());
        } else if t.numa_nodes.iter().all(|n| n.memory_bytes.is_none()) {
            t.notes.push("NUMA memory sizes not reported".into());
        }
        if t.caches.is_empty() {
            t.notes.push("cache sizes not reported".into());
        }
        Ok(t)
    }
}

pub(crate) mod features {
    //! CPU features that decide which llama.cpp kernels run.
    use std::collections::BTreeMap;

    /// Features checked on this architecture, with whether this CPU has them.
    pub(crate) fn detect() -> BTreeMap<String, bool> {
        #[allow(unused_mut)]
        let mut m = BTreeMap::new();
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            for (name, v) in [
                ("avx", has!("avx")),
                ("avx2", has!("avx2")),
                ("fma", has!("fma")),
                ("f16c", has!("f16c")),
                ("avx512f", has!("avx512f")),
                ("avx512bw", has!("avx512bw")),
                ("avx512_vnni", has!("avx512vnni")),
                ("avx512_bf16", has!("avx512bf16")),
            ] {
                m.insert(name.to_owned(), v);
            }
            // AMX and AVX-VNNI (256-bit) are read from the kernel's flags, which also say
            // whether the OS enabled the tile state.
            let flags = cpuinfo_field(&["flags"]).unwrap_or_default();
            let flags: Vec<&str> = flags.split_whitespace().collect();
            for (name, flag) in [
                ("avx_vnni", "avx_vnni"),
                ("amx_tile", "amx_tile"),
                ("amx_int8", "amx_int8"),
                ("amx_bf16", "amx_bf16"),
            ] {
                m.insert(name.to_owned(), flags.contains(&flag));
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            use std::arch::is_aarch64_feature_detected as has;
            for (name, v) in [
                ("neon", has!("neon")),
                ("dotprod", has!("dotprod")),
                ("i8mm", has!("i8mm")),
                ("bf16", has!("bf16")),
                ("fp16", has!("fp16")),
                ("sve", has!("sve")),
                ("sve2", has!("sve2")),
            ] {
                m.insert(name.to_owned(), v);
            }
        }
        m
    }

    fn cpuinfo_field(keys: &[&str]) -> Option<String> {
        let s = std::fs::read_to_string("/proc/cpuinfo").ok()?;
        s.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            keys.contains(&k.trim()).then(|| v.trim().to_owned())
        })
    }

    /// The model name from /proc/cpuinfo (`model name` on x86, `Model`/`CPU part` elsewhere).
    pub(crate) fn cpuinfo_model() -> Option<String> {
        cpuinfo_field(&["model name", "Model", "cpu model"]).filter(|s| !s.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_render_and_parse() {
        assert_eq!(cpu_list(&[3, 0, 1, 2, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(cpu_list(&[]), "-");
        assert_eq!(
            parse_cpu_list("0-3,8,10-11"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpu_list("x"), None);
        assert_eq!(human_bytes(48 << 10), "48 KiB");
        assert_eq!(human_bytes(3 << 29), "1.5 GiB");
    }

    #[test]
    fn detect_reads_this_host() {
        let t = Topology::detect();
        assert!(!t.cores.is_empty(), "{t:?}");
        let avail = std::thread::available_parallelism().unwrap().get();
        assert_eq!(t.pu_count(), avail, "every CPU this process may use, once");
        let mut pus: Vec<u32> = t.cores.iter().flat_map(|c| c.pus.clone()).collect();
        pus.sort_unstable();
        pus.dedup();
        assert_eq!(pus.len(), avail, "no PU listed under two cores");
        if t.source.starts_with("hwloc") {
            assert!(!t.numa_nodes.is_empty(), "hwloc always reports a NUMA node");
            for n in &t.numa_nodes {
                assert_ne!(n.memory_bytes, Some(0), "unknown sizes are None, not 0");
            }
        }
        #[cfg(target_arch = "x86_64")]
        assert_eq!(
            t.features.get("avx2").copied(),
            Some(std::arch::is_x86_feature_detected!("avx2"))
        );
        let text = t.render();
        assert!(text.contains("cores "), "{text}");
        let back: Topology = serde_json::from_str(&serde_json::to_string(&t).unwrap()).unwrap();
        assert_eq!(back, t);
    }

    #[test]
    fn fallback_knows_cpus_and_nothing_else() {
        let t = detect::fallback();
        assert!(!t.cores.is_empty());
        assert!(t
            .cores
            .iter()
            .all(|c| c.package.is_none() && c.numa.is_none()));
        assert!(t.total_memory_bytes.is_none() && t.caches.is_empty());
        let text = t.render();
        assert!(text.contains("packages   unknown"), "{text}");
        assert!(text.contains("caches     unknown"), "{text}");
    }
}
