//! What ran where: machine, versions and build flags, recorded beside the results.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};

/// Processes whose presence makes timings worthless on a small machine (compilers, builds).
const HEAVY: &[&str] = &["cc1plus", "cc1", "rustc", "cmake", "ld", "ld.lld", "mold"];

/// CMake cache entries worth recording for a llama.cpp build.
const CMAKE_KEYS: &[&str] = &[
    "CMAKE_BUILD_TYPE",
    "CMAKE_C_FLAGS",
    "CMAKE_CXX_COMPILER",
    "BUILD_SHARED_LIBS",
    "GGML_NATIVE",
    "GGML_AVX",
    "GGML_AVX2",
    "GGML_AVX512",
    "GGML_AVX512_VNNI",
    "GGML_AVX512_BF16",
    "GGML_FMA",
    "GGML_F16C",
    "GGML_OPENMP",
    "GGML_LLAMAFILE",
    "GGML_BLAS",
    "GGML_CPU_REPACK",
];

/// `nproc`, CPU model, memory, kernel and load.
pub(crate) fn machine() -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo.lines().find_map(|l| {
        l.strip_prefix("model name")?
            .split_once(':')
            .map(|(_, v)| v.trim().to_owned())
    });
    let flags: Vec<&str> = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("flags")?.split_once(':').map(|(_, v)| v))
        .unwrap_or("")
        .split_whitespace()
        .filter(|f| f.starts_with("avx") || matches!(*f, "fma" | "f16c" | "amx_int8" | "amx_bf16"))
        .collect();
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_total_kib = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok());
    json!({
        "nproc": run_text("nproc", &[]).and_then(|s| s.parse::<u64>().ok()),
        "logical_cpus": cpuinfo.lines().filter(|l| l.starts_with("processor")).count(),
        "cpu_model": cpu_model,
        "cpu_simd_flags": flags,
        "mem_total_kib": mem_total_kib,
        "kernel": read_trimmed("/proc/sys/kernel/osrelease"),
        "loadavg_start": load_average(),
    })
}

/// `/proc/loadavg` as text.
pub(crate) fn load_average() -> Option<String> {
    read_trimmed("/proc/loadavg")
}

/// Compilers and build tools running now, as `name (pid)`.
pub(crate) fn heavy_processes() -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|s| s.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        if let Some(comm) = read_trimmed(&format!("/proc/{pid}/comm")) {
            if HEAVY.contains(&comm.as_str()) {
                found.push(format!("{comm} ({pid})"));
            }
        }
    }
    found
}

/// Output of `program args` (stdout then stderr), trimmed; `None` when it cannot run.
pub(crate) fn run_text(program: impl AsRef<std::ffi::OsStr>, args: &[&str]) -> Option<String> {
    let out = Command::new(program).args(args).output().ok()?;
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    Some(text.trim().to_owned())
}

/// Versions of the named packages in a `Cargo.lock`.
pub(crate) fn cargo_lock_versions(lock: &Path, names: &[&str]) -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(lock).unwrap_or_default();
    let mut out = BTreeMap::new();
    let mut current: Option<&str> = None;
    for line in text.lines() {
        if let Some(n) = line.strip_prefix("name = ") {
            current = Some(n.trim_matches('"'));
        } else if let (Some(n), Some(v)) = (current, line.strip_prefix("version = ")) {
            if names.contains(&n) {
                out.insert(n.to_owned(), v.trim_matches('"').to_owned());
            }
            current = None;
        }
    }
    out
}

/// The interesting entries of a `CMakeCache.txt`.
pub(crate) fn cmake_flags(cache: &Path) -> Option<BTreeMap<String, String>> {
    let text = std::fs::read_to_string(cache).ok()?;
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some((key, value)) = line.split_once('=') else {
            continue;
        };
        let key = key.split(':').next().unwrap_or(key);
        if CMAKE_KEYS.contains(&key) {
            out.insert(key.to_owned(), value.to_owned());
        }
    }
    Some(out)
}

/// The CMake cache of the newest llama-cpp-sys-2 build under a cargo profile folder (the one
/// `target/release/mesh` most likely links; cargo keeps older builds beside it).
pub(crate) fn llama_sys_cmake_cache(profile_dir: &Path) -> Option<PathBuf> {
    let dir = std::fs::read_dir(profile_dir.join("build")).ok()?;
    dir.flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("llama-cpp-sys-2-")
        })
        .map(|e| e.path().join("out/build/CMakeCache.txt"))
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .max()
        .map(|(_, p)| p)
}

/// Commit of the working tree and whether it has uncommitted changes.
pub(crate) fn git_state() -> Value {
    let commit = run_text("git", &["rev-parse", "HEAD"]).filter(|s| s.len() == 40);
    let dirty =
        run_text("git", &["status", "--porcelain", "--untracked-files=no"]).map(|s| !s.is_empty());
    json!({"commit": commit, "dirty": dirty})
}

/// CPU time of the whole machine and of the processes under test at one instant, in clock
/// ticks, to tell afterwards how much of a measurement window other processes took.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CpuSnapshot {
    machine_busy: u64,
    steal: u64,
    own: u64,
}

/// Other processes' CPU use and hypervisor steal between two snapshots, in seconds.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub(crate) struct ForeignCpu {
    pub(crate) others_cpu_s: f64,
    pub(crate) steal_s: f64,
}

/// Clock ticks per second of `/proc` times (`getconf CLK_TCK`, 100 when unknown).
pub(crate) fn clock_ticks() -> u64 {
    run_text("getconf", &["CLK_TCK"])
        .and_then(|s| s.parse().ok())
        .filter(|&t| t > 0)
        .unwrap_or(100)
}

/// Snapshot of the machine's busy time and of `pids`' own CPU time (all their threads).
pub(crate) fn cpu_snapshot(pids: &[u32]) -> Option<CpuSnapshot> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let (machine_busy, steal) = machine_busy_ticks(stat.lines().next()?)?;
    let mut own = 0;
    for pid in pids {
        let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        own += process_ticks(&text)?;
    }
    Some(CpuSnapshot {
        machine_busy,
        steal,
        own,
    })
}

impl CpuSnapshot {
    /// What others used between `self` and `later`.
    pub(crate) fn foreign_until(&self, later: &CpuSnapshot, ticks_per_s: u64) -> ForeignCpu {
        let t = ticks_per_s.max(1) as f64;
        let busy = later.machine_busy.saturating_sub(self.machine_busy);
        let own = later.own.saturating_sub(self.own);
        ForeignCpu {
            others_cpu_s: busy.saturating_sub(own) as f64 / t,
            steal_s: later.steal.saturating_sub(self.steal) as f64 / t,
        }
    }
}

/// Busy (user, nice, system, irq, softirq, steal) and steal ticks from the `cpu` line of
/// `/proc/stat`.
fn machine_busy_ticks(cpu_line: &str) -> Option<(u64, u64)> {
    let f: Vec<u64> = cpu_line
        .strip_prefix("cpu ")?
        .split_whitespace()
        .map(|v| v.parse().ok())
        .collect::<Option<_>>()?;
    let get = |i: usize| f.get(i).copied().unwrap_or(0);
    let (user, nice, system, irq, softirq, steal) =
        (get(0), get(1), get(2), get(5), get(6), get(7));
    Some((user + nice + system + irq + softirq + steal, steal))
}

/// utime + stime of a `/proc/PID/stat` line (fields 14 and 15; the command name may hold
/// spaces, so fields are counted after its closing parenthesis).
pub(crate) fn process_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// Modification time of a file, seconds since the Unix epoch.
pub(crate) fn modified_unix_s(path: &Path) -> Option<u64> {
    let t = std::fs::metadata(path).ok()?.modified().ok()?;
    Some(t.duration_since(std::time::UNIX_EPOCH).ok()?.as_secs())
}

fn read_trimmed(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_versions_from_a_lock_file() {
        let lock = "[[package]]\nname = \"llama-cpp-sys-2\"\nversion = \"0.1.161\"\n\n[[package]]\nname = \"other\"\nversion = \"1.0.0\"\n";
        let path = std::env::temp_dir().join(format!("mesh-bench-lock-{}", std::process::id()));
        std::fs::write(&path, lock).unwrap();
        let v = cargo_lock_versions(&path, &["llama-cpp-sys-2", "missing"]);
        std::fs::remove_file(&path).unwrap();
        assert_eq!(v.len(), 1);
        assert_eq!(v["llama-cpp-sys-2"], "0.1.161");
    }

    #[test]
    fn parses_proc_cpu_times() {
        let cpu = "cpu  100 5 50 1000 20 3 2 7 0 0";
        assert_eq!(machine_busy_ticks(cpu), Some((167, 7)));
        let stat = "42 (tokio rt (x)) S 1 42 42 0 -1 4194560 100 0 0 0 30 12 0 0 20 0 4 0";
        assert_eq!(process_ticks(stat), Some(42));
        let a = CpuSnapshot {
            machine_busy: 100,
            steal: 1,
            own: 40,
        };
        let b = CpuSnapshot {
            machine_busy: 300,
            steal: 11,
            own: 190,
        };
        let f = a.foreign_until(&b, 100);
        assert!((f.others_cpu_s - 0.5).abs() < 1e-9);
        assert!((f.steal_s - 0.1).abs() < 1e-9);
    }

    #[test]
    fn keeps_only_known_cmake_keys() {
        let cache =
            "# comment\nGGML_NATIVE:BOOL=ON\nCMAKE_BUILD_TYPE:STRING=Release\nFOO:BOOL=OFF\n";
        let path = std::env::temp_dir().join(format!("mesh-bench-cmake-{}", std::process::id()));
        std::fs::write(&path, cache).unwrap();
        let f = cmake_flags(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(f.len(), 2);
        assert_eq!(f["GGML_NATIVE"], "ON");
    }
}
