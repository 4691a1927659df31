//! The `decode` benchmark: streaming generation, one stream and N concurrent streams, mesh vs
//! llama-server, alternating A B A B after a warm-up per target.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};

use crate::gguf;
use crate::machine;
use crate::report::{self, TARGETS};
use crate::server::{free_port, Server};
use crate::workload::{self, Batch, RequestSpec};

/// Options of `mesh-bench decode`.
#[derive(clap::Args, Debug)]
pub(crate) struct DecodeArgs {
    /// GGUF model both servers load.
    #[arg(long)]
    model: PathBuf,
    /// Tier name mesh serves the model under (also llama-server's alias).
    #[arg(long, default_value = "t1")]
    tier: String,
    /// Threads for both servers (llama-server: -t and -tb; mesh: --threads).
    #[arg(long, default_value_t = 1)]
    threads: u32,
    /// Context per sequence; both servers get `ctx * parallel` cells in total.
    #[arg(long, default_value_t = 2048)]
    ctx: u32,
    /// Sequences decoded together (llama-server slots, mesh --parallel).
    #[arg(long, default_value_t = 8)]
    parallel: u32,
    /// llama-server's -b and -ub (mesh's built-in n_batch = n_ubatch is 512).
    #[arg(long, default_value_t = 512)]
    batch: u32,
    /// Tokens generated per request (EOS ignored, so every request makes exactly this many).
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Measured repetitions per workload and target, after one warm-up each.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Concurrent streams of each workload (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    streams: Vec<usize>,
    /// Requests each stream sends back to back in one repetition.
    #[arg(long, default_value_t = 4)]
    rounds: usize,
    /// Tool schemas in each prompt (sets the prompt length: about 100 tokens each for t1).
    #[arg(long, default_value_t = 4)]
    tools_per_prompt: usize,
    /// Tool catalog the prompts are built from.
    #[arg(long, default_value = "models/fixtures/catalog.jsonl")]
    catalog: PathBuf,
    /// mesh binary (build it with `cargo build --release -p mesh`).
    #[arg(long, default_value = "target/release/mesh")]
    mesh_bin: PathBuf,
    /// llama-server binary (build it with `scripts/build-llama-server.sh`).
    #[arg(long, default_value = ".cache/llama-server/bin/llama-server")]
    llama_server: PathBuf,
    /// Give llama-server one unified KV buffer as mesh has (default: its per-slot buffers).
    #[arg(long)]
    llama_kv_unified: bool,
    /// Seconds to wait for each server's /health.
    #[arg(long, default_value_t = 180)]
    ready_timeout_s: u64,
    /// JSON output; the markdown goes next to it with the extension `.md`, server logs with
    /// `.mesh.log` and `.llama-server.log`.
    #[arg(long, default_value = "bench-results/decode.json")]
    out: PathBuf,
}

impl DecodeArgs {
    fn validate(&self) -> Result<()> {
        if self.streams.is_empty() || self.streams.contains(&0) {
            bail!("--streams needs positive stream counts");
        }
        if let Some(&s) = self.streams.iter().find(|&&s| s > self.parallel as usize) {
            bail!("{s} streams exceed --parallel {}: requests would queue, which measures admission, not decode", self.parallel);
        }
        if self.reps == 0 || self.rounds == 0 || self.max_tokens == 0 {
            bail!("--reps, --rounds and --max-tokens must be at least 1");
        }
        if self.threads == 0 || self.parallel == 0 || self.ctx == 0 || self.batch == 0 {
            bail!("--threads, --parallel, --ctx and --batch must be at least 1");
        }
        for (path, hint) in [
            (&self.model, "the GGUF file"),
            (&self.catalog, "the tool catalog"),
            (
                &self.mesh_bin,
                "build it with `cargo build --release -p mesh`",
            ),
            (
                &self.llama_server,
                "build it with `scripts/build-llama-server.sh`",
            ),
        ] {
            if !path.exists() {
                bail!("{} not found ({hint})", path.display());
            }
        }
        Ok(())
    }

    /// Requests per target over the whole run (warm-ups included).
    fn requests_per_target(&self) -> usize {
        self.streams
            .iter()
            .map(|s| s * self.rounds * (self.reps + 1))
            .sum()
    }

    fn sibling(&self, suffix: &str) -> PathBuf {
        let stem = self
            .out
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "decode".into());
        self.out.with_file_name(format!("{stem}{suffix}"))
    }
}

/// Runs the benchmark, writes the JSON and markdown, prints the table. Every server started is
/// stopped and reaped before this returns, whatever the outcome.
pub(crate) async fn run(args: DecodeArgs) -> Result<()> {
    args.validate()?;
    let progress = ProgressBar::new((2 * args.requests_per_target()) as u64);
    progress.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} requests  {msg}",
        )
        .context("progress template")?,
    );
    progress.enable_steady_tick(Duration::from_millis(500));

    let mut servers: Vec<Server> = Vec::new();
    let outcome = tokio::select! {
        r = bench(&args, &mut servers, &progress) => r,
        sig = interrupted() => Err(anyhow!("interrupted by {sig}")),
    };
    progress.finish_and_clear();
    for s in servers.drain(..) {
        let name = s.name;
        if s.stop().await.is_none() {
            eprintln!("warning: could not reap {name}");
        }
    }
    let (json, markdown) = outcome?;

    if let Some(dir) = args.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let md_path = args.out.with_extension("md");
    std::fs::write(&args.out, serde_json::to_string_pretty(&json)? + "\n")
        .with_context(|| format!("writing {}", args.out.display()))?;
    std::fs::write(&md_path, &markdown)
        .with_context(|| format!("writing {}", md_path.display()))?;
    println!("{markdown}");
    println!("wrote {} and {}", args.out.display(), md_path.display());
    Ok(())
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

/// Batches of one workload: warm-up and measured repetitions, per target.
struct WorkloadRuns {
    streams: usize,
    warmup: [Option<Batch>; 2],
    reps: [Vec<Batch>; 2],
}

async fn bench(
    args: &DecodeArgs,
    servers: &mut Vec<Server>,
    progress: &ProgressBar,
) -> Result<(Value, String)> {
    let started_unix = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let t0 = Instant::now();
    let busy_at_start = machine::heavy_processes();
    if !busy_at_start.is_empty() {
        progress.println(format!(
            "warning: build processes are running ({}); timings will be noisy",
            busy_at_start.join(", ")
        ));
    }
    let mut machine_info = machine::machine();
    let model_bytes = std::fs::metadata(&args.model)?.len();
    let gguf = gguf::read(&args.model)?;
    let catalog = workload::load_catalog(&args.catalog)?;
    let n_prompts = args.requests_per_target();
    let prompts: Vec<String> = (0..n_prompts)
        .map(|k| workload::prompt(&catalog, k, args.tools_per_prompt))
        .collect();

    let model = args.model.display().to_string();
    let total_ctx = (args.ctx * args.parallel).to_string();
    let (threads, parallel, batch) = (
        args.threads.to_string(),
        args.parallel.to_string(),
        args.batch.to_string(),
    );
    let mesh_port = free_port()?;
    let mesh_args: Vec<String> = [
        "up",
        "--port",
        &mesh_port.to_string(),
        "--tier",
        &format!("{}={model}", args.tier),
        "--threads",
        &threads,
        "--parallel",
        &parallel,
        "--ctx",
        &total_ctx,
    ]
    .map(String::from)
    .to_vec();
    let llama_port = free_port()?;
    let mut llama_args: Vec<String> = [
        "-m",
        &model,
        "--host",
        "127.0.0.1",
        "--port",
        &llama_port.to_string(),
        "--alias",
        &args.tier,
        "-t",
        &threads,
        "-tb",
        &threads,
        "-c",
        &total_ctx,
        "-np",
        &parallel,
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
    llama_args.push(
        if args.llama_kv_unified {
            "--kv-unified"
        } else {
            "--no-kv-unified"
        }
        .into(),
    );

    if let Some(dir) = args.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    progress.set_message("starting servers");
    servers.push(Server::spawn(
        TARGETS[0],
        &args.mesh_bin,
        mesh_args,
        mesh_port,
        args.sibling(".mesh.log"),
    )?);
    servers.push(Server::spawn(
        TARGETS[1],
        &args.llama_server,
        llama_args,
        llama_port,
        args.sibling(".llama-server.log"),
    )?);
    // One fresh connection per request, for both targets: llama-server can close a connection
    // after a streamed response, and reusing it from a pool races with that close.
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .tcp_nodelay(true)
        .build()?;
    let mut ready_s = Vec::new();
    for s in servers.iter_mut() {
        progress.set_message(format!("waiting for {} /health", s.name));
        ready_s.push(
            s.wait_healthy(&client, Duration::from_secs(args.ready_timeout_s))
                .await?
                .as_secs_f64(),
        );
    }

    let spec = RequestSpec {
        model: &args.tier,
        max_tokens: args.max_tokens,
    };
    let mut runs = Vec::new();
    let mut next_prompt = 0;
    let ticks = machine::clock_ticks();
    let mut pids = vec![std::process::id()];
    pids.extend(servers.iter().map(Server::pid));
    for &streams in &args.streams {
        let mut w = WorkloadRuns {
            streams,
            warmup: [None, None],
            reps: [Vec::new(), Vec::new()],
        };
        for phase in 0..=args.reps {
            // Both targets get the same prompts in a phase; each phase gets fresh ones.
            for (t, server) in servers.iter_mut().enumerate() {
                let what = if phase == 0 {
                    "warm-up".to_owned()
                } else {
                    format!("rep {phase}/{}", args.reps)
                };
                progress.set_message(format!("{streams} stream(s), {}, {what}", server.name));
                server.ensure_running()?;
                let before = machine::cpu_snapshot(&pids);
                let mut b = workload::run_batch(
                    &client,
                    &server.base_url,
                    &spec,
                    &prompts,
                    next_prompt,
                    streams,
                    args.rounds,
                    progress,
                )
                .await?;
                if let (Some(a), Some(z)) = (before, machine::cpu_snapshot(&pids)) {
                    b.foreign = Some(a.foreign_until(&z, ticks));
                }
                if phase == 0 {
                    w.warmup[t] = Some(b);
                } else {
                    w.reps[t].push(b);
                }
            }
            next_prompt += streams * args.rounds;
        }
        runs.push(w);
    }
    let mut metrics = Vec::new();
    for s in servers.iter() {
        metrics.push(s.metrics(&client).await);
    }
    let peak_rss_kib: Vec<Option<u64>> = servers.iter().map(|s| s.status_kib("VmHWM")).collect();
    let rss_kib: Vec<Option<u64>> = servers.iter().map(|s| s.status_kib("VmRSS")).collect();
    machine_info["loadavg_end"] = json!(machine::load_average());
    machine_info["busy_processes_at_start"] = json!(busy_at_start);
    machine_info["busy_processes_at_end"] = json!(machine::heavy_processes());

    // Report.
    let mut workloads_json = Vec::new();
    let mut rows = Vec::new();
    for w in &runs {
        let name = if w.streams == 1 {
            "1 stream".to_owned()
        } else {
            format!("{} streams", w.streams)
        };
        let (hm, hl) = (report::headline(&w.reps[0]), report::headline(&w.reps[1]));
        let pairs = report::pair_ratios(&w.reps[0], &w.reps[1]);
        rows.extend(report::rows(&name, &hm, &hl, &pairs));
        workloads_json.push(json!({
            "name": name,
            "streams": w.streams,
            "rounds": args.rounds,
            "requests_per_rep": w.streams * args.rounds,
            "targets": {
                TARGETS[0]: report::target_json(w.warmup[0].as_ref(), &w.reps[0]),
                TARGETS[1]: report::target_json(w.warmup[1].as_ref(), &w.reps[1]),
            },
            "ratio_mesh_over_llama_server": report::ratios(&hm, &hl),
            "pair_ratios_mesh_over_llama_server": pairs,
        }));
    }
    let mib = |k: Option<u64>| k.map(|k| k as f64 / 1024.0);
    rows.push(report::Row {
        workload: "process".into(),
        label: "peak RSS, VmHWM (MiB)".into(),
        mesh: mib(peak_rss_kib[0]),
        llama: mib(peak_rss_kib[1]),
        decimals: 1,
        better: report::Better::Lower,
        pair_ratios: Vec::new(),
    });
    let all = |t: usize| -> Vec<&Batch> {
        runs.iter()
            .flat_map(|w| w.warmup[t].iter().chain(w.reps[t].iter()))
            .collect()
    };
    let checks = report::checks(&all(0), &all(1), args.max_tokens);
    let measured: Vec<&Batch> = runs.iter().flat_map(|w| w.reps.iter().flatten()).collect();
    let wall: f64 = measured.iter().map(|b| b.wall_s).sum();
    let others: f64 = measured
        .iter()
        .filter_map(|b| b.foreign)
        .map(|f| f.others_cpu_s)
        .sum();
    let steal: f64 = measured
        .iter()
        .filter_map(|b| b.foreign)
        .map(|f| f.steal_s)
        .sum();
    let noise = json!({
        "measured_wall_s": wall,
        "others_cpu_s": others,
        "others_cores": if wall > 0.0 { others / wall } else { 0.0 },
        "steal_s": steal,
    });

    let repo = Path::new(".");
    let lock_versions = machine::cargo_lock_versions(
        &repo.join("Cargo.lock"),
        &["llama-cpp-2", "llama-cpp-sys-2"],
    );
    let mesh_profile_dir = args.mesh_bin.parent().unwrap_or(repo);
    let mesh_cmake = machine::llama_sys_cmake_cache(mesh_profile_dir);
    let llama_cmake = args
        .llama_server
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("build/CMakeCache.txt"));
    let command_line: Vec<String> = std::env::args().collect();
    let elapsed_s = t0.elapsed().as_secs_f64();

    let json = json!({
        "benchmark": "decode",
        "command_line": command_line,
        "cwd": std::env::current_dir().ok().map(|d| d.display().to_string()),
        "started_unix_s": started_unix,
        "duration_s": elapsed_s,
        "git": machine::git_state(),
        "machine": machine_info,
        "model": {
            "path": model,
            "bytes": model_bytes,
            "quantization": gguf.file_type(),
            "gguf_version": gguf.version,
            "tensors": gguf.tensors,
            "metadata": gguf.metadata,
        },
        "settings": {
            "tier": args.tier,
            "threads": args.threads,
            "ctx_per_sequence": args.ctx,
            "ctx_total": args.ctx * args.parallel,
            "parallel": args.parallel,
            "batch": args.batch,
            "ubatch": args.batch,
            "max_tokens": args.max_tokens,
            "temperature": 0.0,
            "ignore_eos": true,
            "stream": true,
            "reps": args.reps,
            "warmups_per_target_and_workload": 1,
            "order": "per workload: warm-up A, warm-up B, then A B per repetition (A = mesh, B = llama-server)",
            "streams": args.streams,
            "rounds": args.rounds,
            "arrival": "closed loop: all streams start together, each sends its next request when the previous one ends",
            "tools_per_prompt": args.tools_per_prompt,
            "prompts": "chat format with tool schemas from the catalog; prompt k lists catalog entries k, k+37, ...; never reused within a target",
            "catalog": args.catalog.display().to_string(),
            "endpoint": "/v1/completions",
            "connections": "a new TCP connection per request (no keep-alive reuse)",
        },
        "targets": {
            TARGETS[0]: {
                "binary": args.mesh_bin.display().to_string(),
                "version": machine::run_text(&args.mesh_bin, &["--version"]),
                "binary_modified_unix_s": machine::modified_unix_s(&args.mesh_bin),
                "llama_cpp": {
                    "crates": lock_versions,
                    "cmake_cache": mesh_cmake.as_ref().map(|p| p.display().to_string()),
                    "build_flags": mesh_cmake.as_deref().and_then(machine::cmake_flags),
                },
                "fixed_settings": {"n_batch": 512, "n_ubatch": 512, "prefill_chunk": 256, "kv_unified": true, "kv_type": "f16", "flash_attn": "llama.cpp default (auto)"},
                "argv": servers[0].argv,
                "log": servers[0].log.display().to_string(),
                "ready_s": ready_s[0],
                "peak_rss_kib": peak_rss_kib[0],
                "rss_at_end_kib": rss_kib[0],
                "metrics_at_end": metrics[0],
            },
            TARGETS[1]: {
                "binary": args.llama_server.display().to_string(),
                "version": machine::run_text(&args.llama_server, &["--version"]),
                "binary_modified_unix_s": machine::modified_unix_s(&args.llama_server),
                "build_flags": llama_cmake.as_deref().and_then(machine::cmake_flags),
                "config_notes": {
                    "prompt_cache": "on (--cache-prompt, cache_prompt: true per request; --cache-ram default)",
                    "kv_unified": args.llama_kv_unified,
                    "flash_attn": "default (auto)",
                },
                "argv": servers[1].argv,
                "log": servers[1].log.display().to_string(),
                "ready_s": ready_s[1],
                "peak_rss_kib": peak_rss_kib[1],
                "rss_at_end_kib": rss_kib[1],
                "metrics_at_end": metrics[1],
            },
        },
        "checks": checks,
        "other_processes_during_measured_batches": noise,
        "workloads": workloads_json,
        "peak_rss": {
            "mesh_kib": peak_rss_kib[0],
            "llama_server_kib": peak_rss_kib[1],
            "ratio_mesh_over_llama_server": crate::stats::ratio(mib(peak_rss_kib[0]), mib(peak_rss_kib[1])),
        },
    });

    let markdown = markdown(args, &json, &rows, model_bytes, gguf.file_type());
    Ok((json, markdown))
}

fn markdown(
    args: &DecodeArgs,
    j: &Value,
    rows: &[report::Row],
    model_bytes: u64,
    quant: Option<String>,
) -> String {
    let s = |v: &Value| {
        v.as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| v.to_string())
    };
    let m = &j["machine"];
    let c = &j["checks"];
    let mesh_flags = &j["targets"]["mesh"]["llama_cpp"]["build_flags"];
    let llama_flags = &j["targets"]["llama-server"]["build_flags"];
    // With GGML_NATIVE=ON the compiler targets the host (-march=native) and the GGML_AVX*
    // switches stay OFF in the cache, so they are listed only for non-native builds.
    let flags = |f: &Value| {
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
    };
    let mut out = String::new();
    out.push_str("# decode: mesh vs llama-server\n\n");
    out.push_str(&report::table(rows));
    out.push_str("\nRatio = mesh / llama-server: for tok/s above 1 means mesh is faster; for latencies and RSS below 1 means mesh is better. ");
    out.push_str("Throughput and p50 latencies: median over repetitions; p95/p99: pooled over all measured requests of the workload. ");
    out.push_str("Per-pair ratios: repetition i of mesh against repetition i of llama-server, run back to back (– where the value is pooled or taken once).\n\n");
    out.push_str(&format!(
        "- model: `{}` ({}, {:.2} MiB), tier `{}`; threads {}, ctx {} per sequence ({} total, {} slots), batch/ubatch {}, max_tokens {} (ignore_eos, temperature 0, streaming)\n",
        args.model.display(),
        quant.unwrap_or_else(|| "?".into()),
        model_bytes as f64 / (1 << 20) as f64,
        args.tier,
        args.threads,
        args.ctx,
        args.ctx * args.parallel,
        args.parallel,
        args.batch,
        args.max_tokens,
    ));
    out.push_str(&format!(
        "- runs: {} repetitions per workload and target, A B alternating after one warm-up each; {} requests per stream per repetition; prompt tokens {}..{} (median {})\n",
        args.reps, args.rounds, s(&c["prompt_tokens"]["min"]), s(&c["prompt_tokens"]["max"]), s(&c["prompt_tokens"]["median"]),
    ));
    out.push_str(&format!(
        "- checks: prompt token counts differ on {} of {} prompts; requests short of max_tokens: mesh {}, llama-server {}; identical greedy text on {} of {} prompts\n",
        s(&c["prompt_token_count_mismatches"]), s(&c["prompts_compared"]),
        s(&c["requests_not_max_tokens"]["mesh"]), s(&c["requests_not_max_tokens"]["llama-server"]),
        s(&c["identical_greedy_text"]), s(&c["prompts_compared"]),
    ));
    out.push_str(&format!(
        "- machine: {} (nproc {}), {:.1} GiB; load average at start {}, at end {}; build processes at start: {}\n",
        s(&m["cpu_model"]), s(&m["nproc"]),
        m["mem_total_kib"].as_f64().unwrap_or(0.0) / (1 << 20) as f64,
        load3(&m["loadavg_start"]),
        load3(&m["loadavg_end"]),
        m["busy_processes_at_start"].as_array().map_or(0, Vec::len),
    ));
    out.push_str(&format!(
        "- mesh: llama-cpp-2 {} / llama-cpp-sys-2 {} ({}); llama-server: {} ({})\n",
        s(&j["targets"]["mesh"]["llama_cpp"]["crates"]["llama-cpp-2"]),
        s(&j["targets"]["mesh"]["llama_cpp"]["crates"]["llama-cpp-sys-2"]),
        flags(mesh_flags),
        s(&j["targets"]["llama-server"]["version"])
            .lines()
            .next()
            .unwrap_or("?"),
        flags(llama_flags),
    ));
    let n = &j["other_processes_during_measured_batches"];
    out.push_str(&format!(
        "- other processes during the measured batches: {:.1} CPU-s over {:.1} s ({:.2} cores on average), hypervisor steal {:.1} s\n",
        n["others_cpu_s"].as_f64().unwrap_or(0.0),
        n["measured_wall_s"].as_f64().unwrap_or(0.0),
        n["others_cores"].as_f64().unwrap_or(0.0),
        n["steal_s"].as_f64().unwrap_or(0.0),
    ));
    let lm = &j["targets"]["llama-server"]["metrics_at_end"];
    let num = |k: &str| lm[k].as_f64();
    if let (Some(evaluated), Some(cached)) = (
        num("llamacpp:prompt_tokens_total"),
        num("llamacpp:prompt_tokens_cached_total"),
    ) {
        let total = evaluated + cached;
        out.push_str(&format!(
            "- llama-server prompt cache: {cached:.0} of {total:.0} prompt tokens reused ({:.1}%); {} llama_decode calls, {} busy slots per call on average (whole run, warm-ups included)\n",
            if total > 0.0 { 100.0 * cached / total } else { 0.0 },
            num("llamacpp:n_decode_total").map_or("?".into(), |v| format!("{v:.0}")),
            num("llamacpp:n_busy_slots_per_decode").map_or("?".into(), |v| format!("{v:.2}")),
        ));
    }
    if model_bytes < 64 << 20 {
        out.push_str("- bound: the weights fit in CPU cache, so decode here is bound by per-step overhead and compute, not memory bandwidth; no bandwidth fraction is given.\n");
    }
    out.push_str(&format!(
        "- mesh: `{}`\n",
        shell_join(&j["targets"]["mesh"]["argv"])
    ));
    out.push_str(&format!(
        "- llama-server: `{}`\n",
        shell_join(&j["targets"]["llama-server"]["argv"])
    ));
    out.push_str(&format!(
        "- command: `{}`\n",
        shell_join(&j["command_line"])
    ));
    out
}

/// The 1, 5 and 15 minute load averages of a `/proc/loadavg` line.
fn load3(v: &Value) -> String {
    v.as_str().map_or("?".into(), |l| {
        l.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    })
}

fn shell_join(v: &Value) -> String {
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
