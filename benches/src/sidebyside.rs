//! What every mesh vs llama-server workload shares: the server options both get, starting and
//! stopping the pair, the record of what ran where (machine, versions, build flags, argv,
//! peak RSS, `/metrics` at the end), how much CPU other processes took, and writing the JSON
//! and markdown.
//!
//! A workload implements [`Workload`]; [`run`] gives it a progress bar and a vector its
//! `bench` starts the servers into ([`ServerArgs::start`]), and always drains that vector, so
//! both children are reaped on success, error and Ctrl-C / SIGTERM alike.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};

use crate::gguf;
use crate::machine::{self, CpuSnapshot, ForeignCpu};
use crate::report::TARGETS;
use crate::server::{free_port, Server};

/// Server options shared by the side-by-side workloads.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct ServerArgs {
    /// GGUF model both servers load.
    #[arg(long, default_value = "models/t1-q8_0.gguf")]
    pub(crate) model: PathBuf,
    /// Tier name mesh serves the model under (also llama-server's alias).
    #[arg(long, default_value = "t1")]
    pub(crate) tier: String,
    /// Threads for both servers (llama-server: -t and -tb; mesh: --threads).
    #[arg(long, default_value_t = 1)]
    pub(crate) threads: u32,
    /// Context per sequence; both servers get `ctx * parallel` cells in total.
    #[arg(long, default_value_t = 2048)]
    pub(crate) ctx: u32,
    /// Sequences decoded together (llama-server slots, mesh --parallel).
    #[arg(long, default_value_t = 8)]
    pub(crate) parallel: u32,
    /// Tokens per step for both servers (llama-server: -b and -ub; mesh: --batch).
    #[arg(long, default_value_t = 512)]
    pub(crate) batch: u32,
    /// mesh binary (build it with `cargo build --release --workspace --bins`).
    #[arg(long, default_value = "target/release/mesh")]
    pub(crate) mesh_bin: PathBuf,
    /// llama-server binary (build it with `scripts/build-llama-server.sh`).
    #[arg(long, default_value = ".cache/llama-server/bin/llama-server")]
    pub(crate) llama_server: PathBuf,
    /// Extra `mesh up` argument (repeatable), e.g. `--mesh-arg=--no-keep-resident`.
    #[arg(long = "mesh-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub(crate) mesh_extra: Vec<String>,
    /// Extra llama-server argument (repeatable), e.g. `--llama-arg=-ngl --llama-arg=999` for
    /// a CUDA build (pair it with `--mesh-arg=--gpu-layers --mesh-arg=all`).
    #[arg(long = "llama-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub(crate) llama_extra: Vec<String>,
    /// Draft model for speculative decoding on both servers (mesh: `--draft TIER=PATH`,
    /// llama-server: `-md PATH`); it must share the model's vocabulary. Settings beyond the
    /// model are each server's defaults unless given with `--mesh-arg` / `--llama-arg`.
    #[arg(long)]
    pub(crate) draft: Option<PathBuf>,
    /// Give llama-server one unified KV buffer as mesh has (default: its per-slot buffers).
    #[arg(long)]
    pub(crate) llama_kv_unified: bool,
    /// Seconds to wait for each server's /health.
    #[arg(long, default_value_t = 180)]
    pub(crate) ready_timeout_s: u64,
}

impl ServerArgs {
    /// Positive sizes and existing files (`extra`: the workload's own inputs, with a hint).
    pub(crate) fn check(&self, extra: &[(&Path, &str)]) -> Result<()> {
        if self.threads == 0 || self.parallel == 0 || self.ctx == 0 || self.batch == 0 {
            bail!("--threads, --parallel, --ctx and --batch must be at least 1");
        }
        let own: [(&Path, &str); 3] = [
            (&self.model, "the GGUF file"),
            (
                &self.mesh_bin,
                "build it with `cargo build --release --workspace --bins`",
            ),
            (
                &self.llama_server,
                "build it with `scripts/build-llama-server.sh`",
            ),
        ];
        let draft = self.draft.as_deref().map(|d| (d, "the draft GGUF"));
        for (path, hint) in own.iter().chain(extra).chain(draft.iter()) {
            if !path.exists() {
                bail!("{} not found ({hint})", path.display());
            }
        }
        Ok(())
    }

    /// `mesh up` arguments for `port`, then `extra`.
    pub(crate) fn mesh_args(&self, port: u16, extra: &[String]) -> Vec<String> {
        let mut v: Vec<String> = [
            "up",
            "--port",
            &port.to_string(),
            "--tier",
            &format!("{}={}", self.tier, self.model.display()),
            "--threads",
            &self.threads.to_string(),
            "--parallel",
            &self.parallel.to_string(),
            "--ctx",
            &(self.ctx * self.parallel).to_string(),
            "--batch",
            &self.batch.to_string(),
        ]
        .map(String::from)
        .to_vec();
        if let Some(d) = &self.draft {
            v.push("--draft".into());
            v.push(format!("{}={}", self.tier, d.display()));
        }
        v.extend_from_slice(&self.mesh_extra);
        v.extend_from_slice(extra);
        v
    }

    /// llama-server arguments for `port`: same model, threads, context, slots and batch as
    /// mesh, continuous batching, prompt cache and metrics on.
    pub(crate) fn llama_args(&self, port: u16) -> Vec<String> {
        let (threads, batch) = (self.threads.to_string(), self.batch.to_string());
        let mut v: Vec<String> = [
            "-m",
            &self.model.display().to_string(),
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--alias",
            &self.tier,
            "-t",
            &threads,
            "-tb",
            &threads,
            "-c",
            &(self.ctx * self.parallel).to_string(),
            "-np",
            &self.parallel.to_string(),
            "-b",
            &batch,
            "-ub",
            &batch,
            "--cont-batching",
            "--cache-prompt",
            "--no-webui",
            "--metrics",
        ]
        .map(String::from)
        .to_vec();
        v.push(
            if self.llama_kv_unified {
                "--kv-unified"
            } else {
                "--no-kv-unified"
            }
            .into(),
        );
        if let Some(d) = &self.draft {
            v.push("-md".into());
            v.push(d.display().to_string());
        }
        v.extend_from_slice(&self.llama_extra);
        v
    }

    /// Starts mesh (with `mesh_extra` arguments) and llama-server into `servers` (logs beside
    /// `out`) and waits for both `/health`; returns the HTTP client for both and each one's
    /// seconds to healthy. The servers are in `servers` as soon as they are spawned, so the
    /// caller reaps them even when this fails.
    pub(crate) async fn start(
        &self,
        out: &Path,
        mesh_extra: &[String],
        servers: &mut Vec<Server>,
        progress: &ProgressBar,
    ) -> Result<(reqwest::Client, Vec<f64>)> {
        let client = client()?;
        if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        progress.set_message("starting servers");
        let port = free_port()?;
        servers.push(Server::spawn(
            TARGETS[0],
            &self.mesh_bin,
            self.mesh_args(port, mesh_extra),
            port,
            sibling(out, ".mesh.log"),
        )?);
        let port = free_port()?;
        servers.push(Server::spawn(
            TARGETS[1],
            &self.llama_server,
            self.llama_args(port),
            port,
            sibling(out, ".llama-server.log"),
        )?);
        let mut ready_s = Vec::new();
        for s in servers.iter_mut() {
            progress.set_message(format!("waiting for {} /health", s.name));
            ready_s.push(
                s.wait_healthy(&client, Duration::from_secs(self.ready_timeout_s))
                    .await?
                    .as_secs_f64(),
            );
        }
        Ok((client, ready_s))
    }

    /// The settings both servers got, with the workload's own `extra` settings after them.
    pub(crate) fn settings_json(&self, extra: Value) -> Value {
        let mut v = json!({
            "tier": self.tier,
            "threads": self.threads,
            "ctx_per_sequence": self.ctx,
            "ctx_total": self.ctx * self.parallel,
            "parallel": self.parallel,
            "batch": self.batch,
            "ubatch": self.batch,
            "draft": self.draft.as_ref().map(|d| d.display().to_string()),
            "mesh_extra_args": self.mesh_extra,
            "llama_server_extra_args": self.llama_extra,
        });
        if let (Some(v), Value::Object(extra)) = (v.as_object_mut(), extra) {
            v.extend(extra);
        }
        v
    }
}

/// `out` with its extension replaced by `suffix` (`bench/x.json` + `.mesh.log` → `bench/x.mesh.log`).
pub(crate) fn sibling(out: &Path, suffix: &str) -> PathBuf {
    let stem = out
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "bench".into());
    out.with_file_name(format!("{stem}{suffix}"))
}

/// HTTP client for both targets: one fresh connection per request, because llama-server can
/// close a connection after a streamed response and reusing it from a pool races with that.
fn client() -> Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .tcp_nodelay(true)
        .build()?)
}

/// A progress bar over `len` requests, ticking on its own so the elapsed time moves.
fn progress_bar(len: usize) -> Result<ProgressBar> {
    let progress = ProgressBar::new(len as u64);
    progress.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} requests  {msg}",
        )
        .context("progress template")?,
    );
    progress.enable_steady_tick(Duration::from_millis(500));
    Ok(progress)
}

/// A workload run side by side: how many requests it sends to each target, and the run
/// itself, which starts the servers into the vector it is given and returns the JSON and the
/// markdown.
pub(crate) trait Workload {
    fn requests_per_target(&self) -> usize;
    async fn bench(
        &self,
        servers: &mut Vec<Server>,
        progress: &ProgressBar,
    ) -> Result<(Value, String)>;
}

/// Runs `w` with a progress bar, stops and reaps both servers whatever the outcome (Ctrl-C and
/// SIGTERM included), then writes the JSON to `out` and the markdown beside it.
pub(crate) async fn run(w: &impl Workload, out: &Path) -> Result<()> {
    let progress = progress_bar(2 * w.requests_per_target())?;
    let mut servers: Vec<Server> = Vec::new();
    let outcome = until_interrupted(w.bench(&mut servers, &progress)).await;
    finish(servers, &progress, outcome, out).await
}

/// Runs `work` until it ends or Ctrl-C / SIGTERM arrives (then an error naming the signal).
async fn until_interrupted<T>(work: impl Future<Output = Result<T>>) -> Result<T> {
    tokio::select! {
        r = work => r,
        sig = interrupted() => Err(anyhow!("interrupted by {sig}")),
    }
}

/// Resolves on Ctrl-C or SIGTERM, naming the signal.
async fn interrupted() -> &'static str {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    let sigterm = async {
        match term.as_mut() {
            Some(t) => {
                t.recv().await;
            }
            None => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => "SIGINT",
        _ = sigterm => "SIGTERM",
    }
}

/// Clears the progress bar, stops and reaps every server, then writes the JSON to `out` and
/// the markdown beside it (`.md`) and prints the markdown; returns `outcome`'s error if any.
async fn finish(
    servers: Vec<Server>,
    progress: &ProgressBar,
    outcome: Result<(Value, String)>,
    out: &Path,
) -> Result<()> {
    progress.finish_and_clear();
    for s in servers {
        let name = s.name;
        if s.stop().await.is_none() {
            eprintln!("warning: could not reap {name}");
        }
    }
    let (json, markdown) = outcome?;
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let md_path = out.with_extension("md");
    std::fs::write(out, serde_json::to_string_pretty(&json)? + "\n")
        .with_context(|| format!("writing {}", out.display()))?;
    std::fs::write(&md_path, &markdown)
        .with_context(|| format!("writing {}", md_path.display()))?;
    println!("{markdown}");
    println!("wrote {} and {}", out.display(), md_path.display());
    Ok(())
}

/// Measures other processes' CPU use around a batch: the machine's busy time minus that of
/// the driver and both servers.
pub(crate) struct CpuMeter {
    pids: Vec<u32>,
    ticks: u64,
}

impl CpuMeter {
    pub(crate) fn new(servers: &[Server]) -> Self {
        let mut pids = vec![std::process::id()];
        pids.extend(servers.iter().map(Server::pid));
        Self {
            pids,
            ticks: machine::clock_ticks(),
        }
    }

    pub(crate) fn snapshot(&self) -> Option<CpuSnapshot> {
        machine::cpu_snapshot(&self.pids)
    }

    /// Others' CPU since `before` (`None` when `/proc` could not be read).
    pub(crate) fn since(&self, before: Option<CpuSnapshot>) -> Option<ForeignCpu> {
        Some(before?.foreign_until(&self.snapshot()?, self.ticks))
    }
}

/// Sum of other processes' CPU over measured batches given as `(wall_s, foreign)`.
pub(crate) fn noise_json(batches: impl IntoIterator<Item = (f64, Option<ForeignCpu>)>) -> Value {
    let (mut wall, mut others, mut steal) = (0.0, 0.0, 0.0);
    for (w, f) in batches {
        wall += w;
        if let Some(f) = f {
            others += f.others_cpu_s;
            steal += f.steal_s;
        }
    }
    json!({
        "measured_wall_s": wall,
        "others_cpu_s": others,
        "others_cores": if wall > 0.0 { others / wall } else { 0.0 },
        "steal_s": steal,
    })
}

/// Facts gathered when a run starts, completed by [`RunRecord::finish`].
pub(crate) struct RunRecord {
    started_unix: u64,
    t0: Instant,
    busy_at_start: Vec<String>,
    machine: Value,
}

impl RunRecord {
    /// Notes the time, the machine and any build running now (warned about on `progress`).
    pub(crate) fn begin(progress: &ProgressBar) -> Self {
        let busy_at_start = machine::heavy_processes();
        if !busy_at_start.is_empty() {
            progress.println(format!(
                "warning: build processes are running ({}); timings will be noisy",
                busy_at_start.join(", ")
            ));
        }
        Self {
            started_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            t0: Instant::now(),
            busy_at_start,
            machine: machine::machine(),
        }
    }

    /// The run's record: benchmark name, argv, git state, machine, model, and per target the
    /// binary, version, build flags, argv, log, readiness, RSS and `/metrics` at the end.
    /// Reads the servers while they still run.
    pub(crate) async fn finish(
        mut self,
        benchmark: &str,
        args: &ServerArgs,
        servers: &[Server],
        ready_s: &[f64],
        client: &reqwest::Client,
    ) -> Result<Value> {
        let mut metrics = Vec::new();
        for s in servers {
            metrics.push(s.metrics(client).await);
        }
        let peak: Vec<Option<u64>> = servers.iter().map(|s| s.status_kib("VmHWM")).collect();
        let rss: Vec<Option<u64>> = servers.iter().map(|s| s.status_kib("VmRSS")).collect();
        self.machine["loadavg_end"] = json!(machine::load_average());
        self.machine["busy_processes_at_start"] = json!(self.busy_at_start);
        self.machine["busy_processes_at_end"] = json!(machine::heavy_processes());
        let gguf = gguf::read(&args.model)?;
        let repo = Path::new(".");
        let mesh_cmake = machine::llama_sys_cmake_cache(args.mesh_bin.parent().unwrap_or(repo));
        let llama_cmake = args
            .llama_server
            .parent()
            .and_then(Path::parent)
            .map(|d| d.join("build/CMakeCache.txt"));
        let target = |t: usize| {
            json!({
                "argv": servers[t].argv,
                "log": servers[t].log.display().to_string(),
                "ready_s": ready_s.get(t),
                "peak_rss_kib": peak[t],
                "rss_at_end_kib": rss[t],
                "metrics_at_end": metrics[t],
            })
        };
        let mut mesh = json!({
            "binary": args.mesh_bin.display().to_string(),
            "version": machine::run_text(&args.mesh_bin, &["--version"]),
            "binary_modified_unix_s": machine::modified_unix_s(&args.mesh_bin),
            "llama_cpp": {
                "crates": machine::cargo_lock_versions(&repo.join("Cargo.lock"), &["llama-cpp-2", "llama-cpp-sys-2"]),
                "cmake_cache": mesh_cmake.as_ref().map(|p| p.display().to_string()),
                "build_flags": mesh_cmake.as_deref().and_then(machine::cmake_flags),
            },
            "fixed_settings": {
                "n_batch": args.batch,
                "n_ubatch": args.batch,
                // `mesh up --batch` caps prompt chunks so one fits beside every decode.
                "prefill_chunk": 512.min(args.batch.saturating_sub(args.parallel)),
                "kv_unified": false,
                "kv_type": "f16",
                "flash_attn": "llama.cpp default (auto)",
            },
        });
        let mut llama = json!({
            "binary": args.llama_server.display().to_string(),
            "version": machine::run_text(&args.llama_server, &["--version"]),
            "binary_modified_unix_s": machine::modified_unix_s(&args.llama_server),
            "build_flags": llama_cmake.as_deref().and_then(machine::cmake_flags),
            "config_notes": {
                "prompt_cache": "on (--cache-prompt, cache_prompt: true per request; --cache-ram default)",
                "kv_unified": args.llama_kv_unified,
                "flash_attn": "default (auto)",
            },
        });
        for (t, v) in [&mut mesh, &mut llama].into_iter().enumerate() {
            if let (Some(v), Value::Object(extra)) = (v.as_object_mut(), target(t)) {
                v.extend(extra);
            }
        }
        let mib = |k: Option<u64>| k.map(|k| k as f64 / 1024.0);
        Ok(json!({
            "benchmark": benchmark,
            "command_line": std::env::args().collect::<Vec<_>>(),
            "cwd": std::env::current_dir().ok().map(|d| d.display().to_string()),
            "started_unix_s": self.started_unix,
            "duration_s": self.t0.elapsed().as_secs_f64(),
            "git": machine::git_state(),
            "machine": self.machine,
            "model": {
                "path": args.model.display().to_string(),
                "bytes": std::fs::metadata(&args.model)?.len(),
                "quantization": gguf.file_type(),
                "gguf_version": gguf.version,
                "tensors": gguf.tensors,
                "metadata": gguf.metadata,
            },
            "targets": {TARGETS[0]: mesh, TARGETS[1]: llama},
            "peak_rss": {
                "mesh_kib": peak[0],
                "llama_server_kib": peak[1],
                "ratio_mesh_over_llama_server": crate::stats::ratio(mib(peak[0]), mib(peak[1])),
            },
        }))
    }
}

/// Markdown lines on what ran where, from a run's JSON: machine and load, both llama.cpp
/// builds, other processes' CPU during the measured batches, both servers' argv and the
/// driver's command line.
pub(crate) fn environment_markdown(j: &Value) -> String {
    let s = |v: &Value| {
        v.as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| v.to_string())
    };
    let m = &j["machine"];
    let mut out = String::new();
    out.push_str(&format!(
        "- machine: {} (nproc {}), {:.1} GiB; load average at start {}, at end {}; build processes at start: {}\n",
        s(&m["cpu_model"]),
        s(&m["nproc"]),
        m["mem_total_kib"].as_f64().unwrap_or(0.0) / (1 << 20) as f64,
        load3(&m["loadavg_start"]),
        load3(&m["loadavg_end"]),
        m["busy_processes_at_start"].as_array().map_or(0, Vec::len),
    ));
    out.push_str(&format!(
        "- mesh: llama-cpp-2 {} / llama-cpp-sys-2 {} ({}); llama-server: {} ({})\n",
        s(&j["targets"]["mesh"]["llama_cpp"]["crates"]["llama-cpp-2"]),
        s(&j["targets"]["mesh"]["llama_cpp"]["crates"]["llama-cpp-sys-2"]),
        build_flags(&j["targets"]["mesh"]["llama_cpp"]["build_flags"]),
        version_line(&s(&j["targets"]["llama-server"]["version"])),
        build_flags(&j["targets"]["llama-server"]["build_flags"]),
    ));
    let n = &j["other_processes_during_measured_batches"];
    out.push_str(&format!(
        "- other processes during the measured batches: {:.1} CPU-s over {:.1} s ({:.2} cores on average), hypervisor steal {:.1} s\n",
        n["others_cpu_s"].as_f64().unwrap_or(0.0),
        n["measured_wall_s"].as_f64().unwrap_or(0.0),
        n["others_cores"].as_f64().unwrap_or(0.0),
        n["steal_s"].as_f64().unwrap_or(0.0),
    ));
    for t in TARGETS {
        out.push_str(&format!(
            "- {t}: `{}`\n",
            shell_join(&j["targets"][t]["argv"])
        ));
    }
    out.push_str(&format!(
        "- command: `{}`\n",
        shell_join(&j["command_line"])
    ));
    out
}

/// The `version: ...` line of `llama-server --version` (which may print backend lines first).
fn version_line(text: &str) -> &str {
    text.lines()
        .find(|l| l.starts_with("version"))
        .or_else(|| text.lines().next())
        .unwrap_or("?")
}

/// Build type and CPU features of a llama.cpp CMake cache. With GGML_NATIVE=ON the compiler
/// targets the host (-march=native) and the GGML_AVX* switches stay OFF in the cache, so they
/// are listed only for non-native builds.
fn build_flags(f: &Value) -> String {
    let get = |k: &str| f[k].as_str().unwrap_or("?").to_owned();
    let mut parts = vec![format!("CMAKE_BUILD_TYPE={}", get("CMAKE_BUILD_TYPE"))];
    if get("GGML_NATIVE") == "ON" {
        parts.push("GGML_NATIVE=ON (-march=native)".into());
    } else {
        parts.push(format!("GGML_NATIVE={}", get("GGML_NATIVE")));
        let simd: Vec<&str> = [
            "GGML_AVX",
            "GGML_AVX2",
            "GGML_FMA",
            "GGML_F16C",
            "GGML_AVX512",
            "GGML_AVX512_VNNI",
            "GGML_AVX512_BF16",
        ]
        .into_iter()
        .filter(|k| get(k) == "ON")
        .collect();
        let simd = if simd.is_empty() {
            "baseline".to_owned()
        } else {
            simd.join(",")
        };
        parts.push(format!("SIMD {simd}"));
    }
    parts.join(" ")
}

/// The 1, 5 and 15 minute load averages of a `/proc/loadavg` line.
fn load3(v: &Value) -> String {
    v.as_str().map_or("?".into(), |l| {
        l.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    })
}

/// An argv as a shell line, quoting what needs it.
pub(crate) fn shell_join(v: &Value) -> String {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(|s| {
                    if !s.is_empty()
                        && s.bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b"-_./=,:".contains(&b))
                    {
                        s.to_owned()
                    } else {
                        format!("'{}'", s.replace('\'', r"'\''"))
                    }
                })
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        servers: ServerArgs,
    }

    #[test]
    fn both_servers_get_the_same_model_threads_context_and_slots() {
        let a =
            Cli::parse_from(["x", "--threads", "2", "--ctx", "1024", "--parallel", "4"]).servers;
        let m = a.mesh_args(7000, &["--kv-block".into(), "16".into()]);
        assert_eq!(
            m.join(" "),
            "up --port 7000 --tier t1=models/t1-q8_0.gguf --threads 2 --parallel 4 --ctx 4096 --batch 512 --kv-block 16"
        );
        let l = a.llama_args(7001).join(" ");
        assert!(l.starts_with("-m models/t1-q8_0.gguf --host 127.0.0.1 --port 7001 --alias t1 -t 2 -tb 2 -c 4096 -np 4 -b 512 -ub 512"));
        assert!(l.contains("--cache-prompt") && l.ends_with("--no-kv-unified"));
    }

    #[test]
    fn shell_join_quotes_only_what_needs_it() {
        let v = json!(["mesh-bench", "decode", "--streams", "1,2", "it's here"]);
        assert_eq!(
            shell_join(&v),
            r"mesh-bench decode --streams 1,2 'it'\''s here'"
        );
    }

    #[test]
    fn sibling_replaces_the_extension() {
        assert_eq!(
            sibling(Path::new("b/sessions.json"), ".mesh.log"),
            Path::new("b/sessions.mesh.log")
        );
    }
}
