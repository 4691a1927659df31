//! A live tuning session under load: a node on the bundled t1 and t3 whose tuner runs on a
//! timer, a closed-loop workload of held-out tasks through `model: "cascade"`, and the
//! node's decisions at the end.
//!
//! ```text
//! cargo build --release --workspace --examples
//! target/release/examples/tuner_session [--seconds 300] [--agents 2] [--interval 60]
//!     [--margin 1.0] [--probe-n 24] [--out FILE]
//! ```
//!
//! The node starts with the first tier's logit-margin threshold at `--margin` (the shipped
//! default is 0.25), so more of t1's answers escalate to t3 than need to. Agents send the
//! held-out tasks (`models/fixtures/eval-heldout.jsonl`, as the chat requests the tuner's
//! probe sends) one after another for `--seconds`; every `--interval` seconds the node runs
//! a tuning cycle by itself (`[tuner] interval_s`): rules over the window's counters, a
//! trial of the proposed step on the probe workload, the statistical gate, and the policy
//! file. The workload prints one line per interval (requests, accuracy, latency, which tier
//! answered, the policy version in force); at the end the node's decision journal
//! (`GET /v1/control/policy`), which `--out` also writes as JSON.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mesh::config::{bundled_tiers, models_dir, NodeConfig};
use serde_json::Value;

struct Args {
    seconds: u64,
    agents: usize,
    interval: u64,
    margin: f32,
    probe_n: usize,
    out: Option<std::path::PathBuf>,
}

fn args() -> Args {
    let mut a = Args {
        seconds: 300,
        agents: 2,
        interval: 60,
        margin: 1.0,
        probe_n: 24,
        out: None,
    };
    const USAGE: &str = "usage: tuner_session [--seconds N] [--agents N] [--interval S] [--margin M] [--probe-n N] [--out FILE]";
    let usage = |why: &str| -> ! {
        eprintln!("tuner_session: {why}\n{USAGE}");
        std::process::exit(2)
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        if k == "-h" || k == "--help" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        let v = it
            .next()
            .unwrap_or_else(|| usage(&format!("{k} needs a value")));
        let n = || -> u64 {
            v.parse()
                .unwrap_or_else(|_| usage(&format!("{k}: not a whole number: {v}")))
        };
        match k.as_str() {
            "--seconds" => a.seconds = n(),
            "--agents" => a.agents = n() as usize,
            "--interval" => a.interval = n(),
            "--margin" => a.margin = v.parse().unwrap_or_else(|_| usage("--margin M")),
            "--probe-n" => a.probe_n = n() as usize,
            "--out" => a.out = Some(v.into()),
            _ => usage(&format!("unknown argument {k}")),
        }
    }
    if a.agents == 0 || a.interval == 0 || a.seconds == 0 {
        usage("--agents, --interval and --seconds must be at least 1");
    }
    a
}

/// What the workload saw in one interval.
#[derive(Default)]
struct Window {
    requests: u64,
    exact: u64,
    failed: u64,
    latency_ms: Vec<f64>,
    tiers: BTreeMap<String, u64>,
}

fn p50(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = args();
    let dir = models_dir();
    let tasks = mesh_tiers::eval::load_tasks(&dir.join("fixtures/eval-heldout.jsonl"))
        .map_err(anyhow::Error::msg)?;
    let work: Vec<(mesh_tiers::eval::Task, Value)> = tasks
        .into_iter()
        .filter_map(|t| {
            let body = mesh::http::openai::task_request(&t, "cascade", 160).ok()?;
            Some((t, body))
        })
        .collect();
    let work = Arc::new(work);

    let mut tiers = bundled_tiers(&dir);
    tiers.retain(|t| t.name == "t1" || t.name == "t3");
    for t in &mut tiers {
        t.threads = 1;
        // The agents plus the tuner's probe, one sequence each.
        t.n_seq_max = a.agents as u32 + 1;
        t.n_ctx = 2048 * t.n_seq_max;
    }
    let state_dir = tempfile::tempdir()?;
    let state_file = state_dir.path().join("policy.json");
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse()?,
        tiers,
        ..NodeConfig::default()
    };
    cfg.cascade.tiers = vec!["t1".into(), "t3".into()];
    cfg.cascade.min_margin = vec![a.margin];
    cfg.tuner.interval_s = a.interval;
    cfg.tuner.state_file = Some(state_file.clone());
    cfg.tuner.probe_n = a.probe_n;
    cfg.tuner.probe_model = Some("cascade".into());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let node = mesh::start(cfg, async move {
        let _ = stop_rx.await;
    })
    .await?;
    let base = format!("http://{}", node.addr);
    let http = reqwest::Client::new();
    println!(
        "node at {base}: cascade t1 -> t3, first-tier margin {}, tuner every {} s (probe: {} held-out tasks), policy file {}",
        a.margin,
        a.interval,
        a.probe_n,
        state_file.display()
    );
    println!(
        "workload: {} agents sending {} held-out tasks in turn for {} s\n",
        a.agents,
        work.len(),
        a.seconds
    );
    println!("| s | requests | exact | failed | latency p50 ms | answered by | policy version | first-tier margin |");
    println!("|---:|---:|---:|---:|---:|---|---:|---:|");

    let window = Arc::new(Mutex::new(Window::default()));
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(a.seconds);
    let mut agents = Vec::new();
    for i in 0..a.agents {
        let (http, base, work, window) = (http.clone(), base.clone(), work.clone(), window.clone());
        agents.push(tokio::spawn(async move {
            let mut k = i;
            while Instant::now() < deadline {
                let (task, body) = &work[k % work.len()];
                k += a.agents;
                let t = Instant::now();
                let r = http
                    .post(format!("{base}/v1/chat/completions"))
                    .json(body)
                    .send()
                    .await;
                let body: Option<Value> = match r {
                    Ok(r) if r.status().is_success() => r.json().await.ok(),
                    _ => None,
                };
                let ms = t.elapsed().as_secs_f64() * 1e3;
                let mut w = window.lock().expect("window lock");
                w.requests += 1;
                w.latency_ms.push(ms);
                match body {
                    Some(v) => {
                        let text = mesh::http::openai::response_text(&v);
                        w.exact += u64::from(mesh_tiers::eval::exact(task, &text));
                        let tier = v["mesh"]["tier"].as_str().unwrap_or("?").to_owned();
                        *w.tiers.entry(tier).or_default() += 1;
                    }
                    None => w.failed += 1,
                }
            }
        }));
    }
    let policy = |http: reqwest::Client, base: String| async move {
        http.get(format!("{base}/v1/control/policy"))
            .send()
            .await
            .ok()?
            .json::<Value>()
            .await
            .ok()
    };
    let tick = Duration::from_secs(a.interval);
    let mut next = t0 + tick;
    loop {
        let now = Instant::now();
        let at = next.min(deadline);
        if at > now {
            tokio::time::sleep(at - now).await;
        }
        let mut w = std::mem::take(&mut *window.lock().expect("window lock"));
        let p = policy(http.clone(), base.clone())
            .await
            .unwrap_or(Value::Null);
        let tiers: Vec<String> = w.tiers.iter().map(|(t, n)| format!("{t} {n}")).collect();
        println!(
            "| {:.0} | {} | {} | {} | {:.0} | {} | {} | {} |",
            t0.elapsed().as_secs_f64(),
            w.requests,
            w.exact,
            w.failed,
            p50(&mut w.latency_ms),
            tiers.join(", "),
            p["version"],
            p["policy"]["cascade"]["min_margin"][0]
        );
        if Instant::now() >= deadline {
            break;
        }
        next += tick;
    }
    for h in agents {
        h.await?;
    }
    let p = policy(http.clone(), base.clone())
        .await
        .ok_or_else(|| anyhow::anyhow!("GET /v1/control/policy failed"))?;
    println!("\nperiodic cycles: {}", p["periodic"]["cycles"]);
    println!("decisions (GET /v1/control/policy):");
    for d in p["decisions"].as_array().cloned().unwrap_or_default() {
        println!(
            "  {} {} {} {} -> {} objective {}: {} ({}) version {}",
            d["at"].as_str().unwrap_or(""),
            d["rule"].as_str().unwrap_or(""),
            d["knob"].as_str().unwrap_or(""),
            d["before"],
            d["after"],
            d["objective"].as_str().unwrap_or(""),
            d["verdict"].as_str().unwrap_or(""),
            d["reason"].as_str().unwrap_or(""),
            d["version"]
        );
    }
    println!(
        "policy now: version {}, cascade {}",
        p["version"], p["policy"]["cascade"]
    );
    if let Some(out) = &a.out {
        std::fs::write(out, serde_json::to_vec_pretty(&p)?)?;
        println!("wrote {}", out.display());
    }
    let _ = stop_tx.send(());
    Ok(())
}
