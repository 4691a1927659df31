//! `mesh-bench soak`: a long mixed workload against one node, watching its memory and file
//! descriptors.
//!
//! The driver starts `mesh up` on the bundled t1 (with the bundled catalog MCP server for
//! agent tasks when `scripts/setup.sh` installed it) and runs `--clients` loops, each cycling
//! through: a sampled chat, a streamed chat read to `[DONE]`, an agent task, a bad request
//! (malformed JSON, unknown model, out-of-range parameter, empty messages, wrong type), a
//! streamed chat the client drops after its first event, and a raw completion. Every answer
//! is checked against what that request must get (200, or the 4xx the bad request earns);
//! anything else, 5xx or a broken connection included, is an error.
//!
//! Every `--sample-s` seconds it records the node's RSS (`VmRSS`), open file descriptors
//! (`/proc/PID/fd`) and threads. RSS growth is measured from the first sample after
//! `--warmup-minutes` to the last one. At the end it checks that the node holds no sequence
//! and no connection the workload left behind.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use futures::StreamExt;
use serde::Serialize;
use serde_json::{json, Value};

use crate::server::{free_port, metric_sum, Server};

/// Options of `mesh-bench soak`.
#[derive(clap::Args, Debug)]
pub(crate) struct SoakArgs {
    /// How long the workload runs.
    #[arg(long, default_value_t = 30.0)]
    minutes: f64,
    /// RSS growth is counted from the first sample after this.
    #[arg(long, default_value_t = 3.0)]
    warmup_minutes: f64,
    /// Seconds between samples of RSS, descriptors and threads.
    #[arg(long, default_value_t = 15)]
    sample_s: u64,
    /// Concurrent client loops.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Engine threads of the node's tier.
    #[arg(long, default_value_t = 2)]
    threads: u32,
    /// The mesh binary.
    #[arg(long, default_value = "target/release/mesh")]
    mesh_bin: PathBuf,
    /// JSON output; the markdown goes next to it (`.md`), the node's log with `.mesh.log`.
    #[arg(long, default_value = "bench-results/soak.json")]
    out: PathBuf,
}

/// The request kinds, in the order each client cycles through them.
const KINDS: [&str; 6] = [
    "chat",
    "stream",
    "agent",
    "bad_request",
    "disconnect",
    "completion",
];

#[derive(Default)]
struct Tally {
    ok: [AtomicU64; KINDS.len()],
    errors: [AtomicU64; KINDS.len()],
}

#[derive(Serialize, Clone)]
struct Sample {
    t_s: f64,
    rss_mib: f64,
    fds: u64,
    threads: u64,
    requests: u64,
    errors: u64,
}

/// One client's request of `kind` (index into [`KINDS`]); `Ok(())` when the node answered
/// as it must, `Err` with what it did instead.
async fn one(c: &reqwest::Client, base: &str, kind: usize, n: u64) -> Result<(), String> {
    let chat = |extra: Value| {
        let mut b = json!({"model": "t1", "max_tokens": 32, "temperature": 0.8,
            "messages": [{"role": "user", "content": format!("What is the forecast in Lima on day {n}?")}]});
        for (k, v) in extra.as_object().expect("an object") {
            b[k] = v.clone();
        }
        b
    };
    let post = |path: &str, body: Value| c.post(format!("{base}{path}")).json(&body).send();
    let expect = |r: &reqwest::Response, want: u16| {
        if r.status().as_u16() == want {
            Ok(())
        } else {
            Err(format!("status {} (want {want})", r.status()))
        }
    };
    let err = |e: reqwest::Error| e.to_string();
    match KINDS[kind] {
        "chat" => {
            let r = post("/v1/chat/completions", chat(json!({})))
                .await
                .map_err(err)?;
            expect(&r, 200)?;
            let v: Value = r.json().await.map_err(err)?;
            v["choices"][0]["finish_reason"]
                .is_string()
                .then_some(())
                .ok_or(format!("no finish_reason: {v}"))
        }
        "stream" => {
            let r = post("/v1/chat/completions", chat(json!({"stream": true})))
                .await
                .map_err(err)?;
            expect(&r, 200)?;
            let text = r.text().await.map_err(err)?;
            text.trim_end()
                .ends_with("data: [DONE]")
                .then_some(())
                .ok_or("stream did not end with [DONE]".into())
        }
        "agent" => {
            let r = post(
                "/v1/agent/tasks",
                json!({"model": "t1", "input": format!("What is the forecast in Lima on 2026-03-{:02}?", n % 28 + 1),
                       "max_turns": 3, "max_tokens": 64}),
            )
            .await
            .map_err(err)?;
            expect(&r, 200)
        }
        "bad_request" => {
            let (path, body, want): (&str, reqwest::Body, u16) = match n % 5 {
                0 => (
                    "/v1/chat/completions",
                    "{\"model\": \"t1\", \"messages\": [".into(),
                    400,
                ),
                1 => (
                    "/v1/chat/completions",
                    chat(json!({"model": "no-such-tier"})).to_string().into(),
                    404,
                ),
                2 => (
                    "/v1/chat/completions",
                    chat(json!({"temperature": -3})).to_string().into(),
                    400,
                ),
                3 => (
                    "/v1/chat/completions",
                    json!({"model": "t1", "messages": []}).to_string().into(),
                    400,
                ),
                _ => (
                    "/v1/completions",
                    json!({"model": "t1", "prompt": {"not": "a prompt"}})
                        .to_string()
                        .into(),
                    400,
                ),
            };
            let r = c
                .post(format!("{base}{path}"))
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .map_err(err)?;
            expect(&r, want)
        }
        "disconnect" => {
            let r = post(
                "/v1/chat/completions",
                chat(json!({"stream": true, "max_tokens": 512})),
            )
            .await
            .map_err(err)?;
            expect(&r, 200)?;
            let mut s = r.bytes_stream();
            s.next().await.ok_or("no first event")?.map_err(err)?;
            Ok(()) // dropped here: the client goes away mid-stream
        }
        _ => {
            let r = post(
                "/v1/completions",
                json!({"model": "t1", "prompt": format!("Day {n}:"), "max_tokens": 16}),
            )
            .await
            .map_err(err)?;
            expect(&r, 200)
        }
    }
}

fn proc_status(pid: u32, field: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn open_fds(pid: u32) -> Option<u64> {
    Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64)
}

pub(crate) async fn run(a: SoakArgs) -> Result<()> {
    if a.minutes <= 0.0 || a.warmup_minutes < 0.0 || a.warmup_minutes >= a.minutes {
        bail!("--minutes must be positive and --warmup-minutes below it");
    }
    if a.clients == 0 || a.sample_s == 0 {
        bail!("--clients and --sample-s must be at least 1");
    }
    if !a.mesh_bin.exists() {
        bail!(
            "{} not found: build it with `cargo build --release --workspace`",
            a.mesh_bin.display()
        );
    }
    if let Some(dir) = a.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let port = free_port()?;
    let catalog = PathBuf::from(".cache/mcp/catalog-server.mjs");
    let mut args: Vec<String> = [
        "up",
        "--port",
        &port.to_string(),
        "--only",
        "t1",
        "--threads",
        &a.threads.to_string(),
        "--ctx",
        "8192",
        "--parallel",
        "4",
    ]
    .map(str::to_owned)
    .to_vec();
    let agent = catalog.exists();
    if agent {
        let cfg = a.out.with_extension("node.toml");
        std::fs::write(
            &cfg,
            format!(
                "[[mcp.servers]]\nname = \"catalog\"\ncommand = \"node\"\nargs = [{:?}, {:?}]\n",
                catalog.canonicalize()?.display().to_string(),
                PathBuf::from("models/fixtures/catalog.jsonl")
                    .canonicalize()?
                    .display()
                    .to_string()
            ),
        )?;
        args.extend(["--config".to_owned(), cfg.display().to_string()]);
    } else {
        eprintln!(
            "(no agent tasks: {} is missing; run scripts/setup.sh)",
            catalog.display()
        );
    }
    let log = a.out.with_extension("mesh.log");
    let mut node = Server::spawn("mesh", &a.mesh_bin, args, port, log)?;
    let c = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()?;
    node.wait_healthy(&c, Duration::from_secs(120)).await?;
    let base = node.base_url.clone();
    let pid = node.pid();
    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));
    let first_errors: Arc<Mutex<Vec<String>>> = Arc::default();
    let started = Instant::now();
    let mut workers = Vec::new();
    for w in 0..a.clients {
        let (c, base, tally, stop, first_errors) = (
            c.clone(),
            base.clone(),
            tally.clone(),
            stop.clone(),
            first_errors.clone(),
        );
        workers.push(tokio::spawn(async move {
            let mut n = w as u64;
            while !stop.load(Ordering::Relaxed) {
                let kind = (n as usize) % KINDS.len();
                if !agent && KINDS[kind] == "agent" {
                    n += 1;
                    continue;
                }
                match one(&c, &base, kind, n).await {
                    Ok(()) => tally.ok[kind].fetch_add(1, Ordering::Relaxed),
                    Err(e) => {
                        let mut f = first_errors.lock().expect("not poisoned");
                        if f.len() < 20 {
                            f.push(format!("{} #{n}: {e}", KINDS[kind]));
                        }
                        tally.errors[kind].fetch_add(1, Ordering::Relaxed)
                    }
                };
                n += 1;
            }
        }));
    }
    let total = Duration::from_secs_f64(a.minutes * 60.0);
    let mut samples: Vec<Sample> = Vec::new();
    loop {
        let t = started.elapsed();
        let sum =
            |x: &[AtomicU64; KINDS.len()]| x.iter().map(|v| v.load(Ordering::Relaxed)).sum::<u64>();
        let s = Sample {
            t_s: t.as_secs_f64(),
            rss_mib: proc_status(pid, "VmRSS").unwrap_or(0) as f64 / 1024.0,
            fds: open_fds(pid).unwrap_or(0),
            threads: proc_status(pid, "Threads").unwrap_or(0),
            requests: sum(&tally.ok) + sum(&tally.errors),
            errors: sum(&tally.errors),
        };
        eprintln!(
            "[soak] {:>6.0} s  rss {:>7.1} MiB  fds {:>4}  threads {:>3}  requests {:>6}  errors {}",
            s.t_s, s.rss_mib, s.fds, s.threads, s.requests, s.errors
        );
        samples.push(s);
        node.ensure_running()?;
        if t >= total {
            break;
        }
        tokio::time::sleep(Duration::from_secs(a.sample_s).min(total - t)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.await;
    }
    // Let dropped streams and closed connections settle, then look for leftovers.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let m = node.metrics(&c).await;
    let active = metric_sum(&m, "mesh_active_sequences").unwrap_or(f64::NAN);
    let conns = metric_sum(&m, "mesh_http_connections_open").unwrap_or(f64::NAN);
    let end_fds = open_fds(pid).unwrap_or(0);
    let warm = samples
        .iter()
        .find(|s| s.t_s >= a.warmup_minutes * 60.0)
        .cloned()
        .unwrap_or_else(|| samples[0].clone());
    let last = samples.last().cloned().expect("one sample at least");
    let growth = (last.rss_mib - warm.rss_mib) / warm.rss_mib * 100.0;
    let by_kind: serde_json::Map<String, Value> = KINDS
        .iter()
        .enumerate()
        .map(|(i, k)| {
            (
                (*k).to_owned(),
                json!({"ok": tally.ok[i].load(Ordering::Relaxed), "errors": tally.errors[i].load(Ordering::Relaxed)}),
            )
        })
        .collect();
    let errors: u64 = tally.errors.iter().map(|v| v.load(Ordering::Relaxed)).sum();
    let report = json!({
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "node": node.argv,
        "machine": crate::machine::machine(),
        "git": crate::machine::git_state(),
        "minutes": a.minutes, "warmup_minutes": a.warmup_minutes, "clients": a.clients,
        "requests": by_kind, "errors": errors, "first_errors": *first_errors.lock().expect("not poisoned"),
        "rss_mib_after_warmup": warm.rss_mib, "rss_mib_end": last.rss_mib, "rss_growth_pct": growth,
        "peak_fds": samples.iter().map(|s| s.fds).max(), "fds_after_warmup": warm.fds, "fds_end": end_fds,
        "active_sequences_end": active, "connections_open_end": conns,
        "samples": samples,
    });
    std::fs::write(&a.out, serde_json::to_string_pretty(&report)?)?;
    let mut md = format!(
        "# soak: {:.0} min, {} clients\n\n`{}`\n\n| kind | ok | errors |\n|---|---:|---:|\n",
        a.minutes,
        a.clients,
        report["command"].as_str().unwrap_or_default()
    );
    for (k, v) in &by_kind {
        md += &format!("| {k} | {} | {} |\n", v["ok"], v["errors"]);
    }
    md += &format!(
        "\nRSS after {:.0} min warm-up {:.1} MiB, at the end {:.1} MiB: **{:+.1}%**. Open descriptors after warm-up {}, peak {}, at the end {}. At the end: {} active sequences, {} open client connections (the driver's own keep-alive pool, idle).\n",
        a.warmup_minutes, warm.rss_mib, last.rss_mib, growth, warm.fds,
        report["peak_fds"], end_fds, active, conns
    );
    md += "\n| minute | RSS MiB | fds | threads | requests | errors |\n|---:|---:|---:|---:|---:|---:|\n";
    let mut next_minute = 0.0;
    for s in &samples {
        if s.t_s >= next_minute || std::ptr::eq(s, samples.last().expect("samples")) {
            md += &format!(
                "| {:.1} | {:.1} | {} | {} | {} | {} |\n",
                s.t_s / 60.0,
                s.rss_mib,
                s.fds,
                s.threads,
                s.requests,
                s.errors
            );
            next_minute = (s.t_s / 60.0).floor() * 60.0 + 60.0;
        }
    }
    std::fs::write(a.out.with_extension("md"), &md)?;
    println!("{md}");
    node.stop().await;
    Ok(())
}
