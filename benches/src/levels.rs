//! `mesh-bench levels`: time to first token of a long shared prefix (about 8K tokens by
//! default) served from each level of one node's KV hierarchy, against recomputing it.
//!
//! ```text
//! node K (KV kept on the device):  recomputed ─▶ device, kept ─▶ device, copied
//! node P (--no-keep-resident):     recomputed (warms its pages) ─▶ host RAM
//! node P restarted (RAM empty):    disk
//! ```
//! - *recomputed*: a prefix no level holds;
//! - *device, kept*: the same prefix again; the slot that computed it still holds its KV;
//! - *device, copied*: while a sequence holding the prefix is decoding, another request
//!   copies that KV into its own slot (`llama_memory_seq_cp`);
//! - *host RAM*: restored from the node's page store in RAM (state API);
//! - *disk*: restored from `--kv-dir` after a restart.
//!
//! Each sample asks a new question after the prefix and generates `max_tokens`; each
//! repetition has a new prefix. Every sample is checked against the node's counters (prompt
//! tokens kept in place, copied on the device or restored from pages, and page hits by
//! storage tier); samples the counters credit to another level are reported and left out
//! of the figures.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use serde_json::{json, Value};

use crate::server::{free_port, metric_sum, Server};
use crate::stats::Percentiles;
use crate::workload::{self, RequestSpec};

/// Options of `mesh-bench levels`.
#[derive(clap::Args, Debug)]
pub(crate) struct LevelsArgs {
    /// GGUF model.
    #[arg(long, default_value = "models/t1-q8_0.gguf")]
    model: PathBuf,
    /// Tier name the node serves the model under.
    #[arg(long, default_value = "t1")]
    tier: String,
    /// Threads.
    #[arg(long, default_value_t = 1)]
    threads: u32,
    /// Context per sequence (must hold the prefix, a question and `max_tokens`).
    #[arg(long, default_value_t = 9216)]
    ctx: u32,
    /// Sequences decoded together (two are needed for the copied case).
    #[arg(long, default_value_t = 2)]
    parallel: u32,
    /// Tokens per step.
    #[arg(long, default_value_t = 512)]
    batch: u32,
    /// Tool schemas in the shared prefix (about 100 tokens each).
    #[arg(long, default_value_t = 80)]
    prefix_tools: usize,
    /// Tokens generated per measured request.
    #[arg(long, default_value_t = 8)]
    max_tokens: usize,
    /// Tokens the holder generates while the copied case is measured.
    #[arg(long, default_value_t = 512)]
    hold_tokens: usize,
    /// Repetitions (a new prefix each).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Host RAM for KV pages, MiB (must hold every repetition's prefix for the RAM case).
    #[arg(long, default_value_t = 8192)]
    kv_ram_mib: u64,
    /// Write 3 to /proc/sys/vm/drop_caches before the disk case, so that pages are read from
    /// the device rather than the page cache (needs root; reported either way).
    #[arg(long)]
    drop_caches: bool,
    /// mesh binary.
    #[arg(long, default_value = "target/release/mesh")]
    mesh_bin: PathBuf,
    /// Extra `mesh up` argument (repeatable), e.g. `--mesh-arg=--gpu-layers --mesh-arg=all`.
    #[arg(long = "mesh-arg", value_name = "ARG", allow_hyphen_values = true)]
    mesh_extra: Vec<String>,
    /// Tool catalog.
    #[arg(long, default_value = "models/fixtures/catalog.jsonl")]
    catalog: PathBuf,
    /// Seconds to wait for the node's /health.
    #[arg(long, default_value_t = 300)]
    ready_timeout_s: u64,
    /// JSON report (markdown next to it, `.md`; node logs `.kept.log`, `.pages.log`, `.disk.log`).
    #[arg(long, default_value = "bench-results/levels.json")]
    out: PathBuf,
}

/// The cases, in report order.
const CASES: [&str; 5] = [
    "recomputed",
    "device, kept",
    "device, copied",
    "host RAM",
    "disk",
];

/// The shared prefix of repetition `rep` (other catalog slices than `mesh-bench prefix`'s).
fn prefix(catalog: &[Value], rep: usize, n: usize) -> String {
    crate::prefix::shared_prefix(catalog, rep + 1000, n)
}

fn question(rep: usize, k: usize) -> String {
    format!("<|user|>Question {k} of round {rep}: which tool lists the open issues of a repository, and what does it need?<|end|><|assistant|>")
}

/// Counters that tell which level served a request: prompt tokens reused per level, and
/// page hits per storage tier.
#[derive(Debug, Clone, Copy, Default)]
struct Levels {
    kept: f64,
    copied: f64,
    restored: f64,
    ram_hits: f64,
    disk_hits: f64,
}

impl Levels {
    fn minus(self, b: Levels) -> Levels {
        Levels {
            kept: self.kept - b.kept,
            copied: self.copied - b.copied,
            restored: self.restored - b.restored,
            ram_hits: self.ram_hits - b.ram_hits,
            disk_hits: self.disk_hits - b.disk_hits,
        }
    }
}

fn sum_where(m: &serde_json::Map<String, Value>, name: &str, label: &str) -> f64 {
    m.iter()
        .filter(|(k, _)| k.split('{').next() == Some(name) && k.contains(label))
        .filter_map(|(_, v)| v.as_f64())
        .sum()
}

async fn levels(client: &reqwest::Client, node: &Server) -> Levels {
    let m = node.metrics(client).await;
    let get = |n: &str| metric_sum(&m, n).unwrap_or(0.0);
    Levels {
        kept: get("mesh_kv_resident_tokens_total"),
        copied: get("mesh_kv_device_copy_tokens_total"),
        restored: get("mesh_kv_recompute_avoided_tokens_total"),
        ram_hits: sum_where(&m, "mesh_kv_page_hits_total", "\"ram\""),
        disk_hits: sum_where(&m, "mesh_kv_page_hits_total", "\"disk\""),
    }
}

/// Which level the counters say served a request of `prompt` tokens (`d`: the counters'
/// change over it): the one that gave most of its reused tokens, when they are at least
/// half the prompt; pages count as disk when any came from disk.
fn served_by(d: Levels, prompt: f64) -> &'static str {
    let best = d.kept.max(d.copied).max(d.restored);
    if best * 2.0 < prompt {
        "recomputed"
    } else if best == d.kept {
        "device, kept"
    } else if best == d.copied {
        "device, copied"
    } else if d.disk_hits > 0.0 {
        "disk"
    } else {
        "host RAM"
    }
}

struct Sample {
    case: &'static str,
    rep: usize,
    ttft_s: f64,
    prompt_tokens: Option<usize>,
    served_by: &'static str,
}

impl LevelsArgs {
    fn node_args(&self, port: u16, kv_dir: &std::path::Path, keep: bool) -> Vec<String> {
        let mut v: Vec<String> = vec![
            "up".into(),
            "--port".into(),
            port.to_string(),
            "--tier".into(),
            format!("{}={}", self.tier, self.model.display()),
            "--threads".into(),
            self.threads.to_string(),
            "--parallel".into(),
            self.parallel.to_string(),
            "--ctx".into(),
            (self.ctx * self.parallel).to_string(),
            "--batch".into(),
            self.batch.to_string(),
            "--kv-dir".into(),
            kv_dir.display().to_string(),
            "--kv-ram-mib".into(),
            self.kv_ram_mib.to_string(),
        ];
        if !keep {
            v.push("--no-keep-resident".into());
        }
        v.extend(self.mesh_extra.iter().cloned());
        v
    }

    async fn start(
        &self,
        client: &reqwest::Client,
        kv_dir: &std::path::Path,
        keep: bool,
        log: &str,
    ) -> Result<Server> {
        let port = free_port()?;
        let mut s = Server::spawn(
            "mesh",
            &self.mesh_bin,
            self.node_args(port, kv_dir, keep),
            port,
            crate::sidebyside::sibling(&self.out, log),
        )?;
        s.wait_healthy(client, Duration::from_secs(self.ready_timeout_s))
            .await?;
        Ok(s)
    }
}

/// One measured request: TTFT and the level the node's counters credit.
async fn measure(
    client: &reqwest::Client,
    node: &Server,
    a: &LevelsArgs,
    case: &'static str,
    rep: usize,
    prompt: &str,
) -> Result<Sample> {
    let before = levels(client, node).await;
    let spec = RequestSpec {
        model: &a.tier,
        max_tokens: a.max_tokens,
    };
    let r = workload::one_request(client, &node.base_url, &spec, prompt)
        .await
        .with_context(|| format!("{case}, repetition {rep}"))?;
    let after = levels(client, node).await;
    let s = Sample {
        case,
        rep,
        ttft_s: r.times.first().copied().unwrap_or(r.e2e_s),
        prompt_tokens: r.prompt_tokens,
        served_by: served_by(
            after.minus(before),
            r.prompt_tokens.unwrap_or(usize::MAX) as f64,
        ),
    };
    eprintln!(
        "rep {rep} {case}: TTFT {:.4} s, {} prompt tokens, served by {}",
        s.ttft_s,
        s.prompt_tokens.unwrap_or(0),
        s.served_by
    );
    Ok(s)
}

/// Starts a long streamed request and returns once its first token arrived, with the task
/// that drains the rest.
async fn hold(
    client: &reqwest::Client,
    base: &str,
    a: &LevelsArgs,
    prompt: String,
) -> Result<tokio::task::JoinHandle<Result<()>>> {
    let body = json!({
        "model": a.tier,
        "prompt": prompt,
        "max_tokens": a.hold_tokens,
        "temperature": 0.0,
        "ignore_eos": true,
        "stream": true,
    });
    let resp = client
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await?;
    if !resp.status().is_success() {
        bail!(
            "the holding request was refused: {} {}",
            resp.status(),
            resp.text().await.unwrap_or_default()
        );
    }
    let mut stream = resp.bytes_stream();
    let mut seen = String::new();
    loop {
        let Some(b) = stream.next().await else {
            bail!("the holding request ended before its first token");
        };
        seen.push_str(&String::from_utf8_lossy(&b?));
        if seen.contains("\"text\"") {
            break;
        }
    }
    Ok(tokio::spawn(async move {
        while let Some(b) = stream.next().await {
            b?;
        }
        Ok(())
    }))
}

pub(crate) async fn run(a: LevelsArgs) -> Result<()> {
    for (p, hint) in [
        (&a.model, "the GGUF file"),
        (
            &a.mesh_bin,
            "build it with `cargo build --release --workspace --bins`",
        ),
        (&a.catalog, "the tool catalog"),
    ] {
        if !p.exists() {
            bail!("{} not found ({hint})", p.display());
        }
    }
    if a.reps == 0 || a.prefix_tools == 0 || a.max_tokens == 0 {
        bail!("--reps, --prefix-tools and --max-tokens must be at least 1");
    }
    if a.parallel < 2 {
        bail!("--parallel must be at least 2 (the copied case runs two sequences)");
    }
    if let Some(d) = a.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(d)?;
    }
    let catalog = workload::load_catalog(&a.catalog)?;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .tcp_nodelay(true)
        .build()?;
    let dirs = tempfile::tempdir()?;
    let warm = |n: &Server| {
        let spec = RequestSpec {
            model: &a.tier,
            max_tokens: 4,
        };
        let url = n.base_url.clone();
        let client = client.clone();
        async move {
            workload::one_request(&client, &url, &spec, "<|user|>Hello<|end|><|assistant|>")
                .await
                .map(|_| ())
        }
    };
    let mut samples = Vec::new();
    let t0 = Instant::now();

    // Node K: KV kept on the device.
    let k = a
        .start(&client, &dirs.path().join("k"), true, ".kept.log")
        .await?;
    let argv_k = k.argv.clone();
    warm(&k).await?;
    for rep in 0..a.reps {
        let p = prefix(&catalog, rep, a.prefix_tools);
        samples.push(
            measure(
                &client,
                &k,
                &a,
                CASES[0],
                rep,
                &format!("{p}{}", question(rep, 0)),
            )
            .await?,
        );
        samples.push(
            measure(
                &client,
                &k,
                &a,
                CASES[1],
                rep,
                &format!("{p}{}", question(rep, 1)),
            )
            .await?,
        );
        let holder = hold(&client, &k.base_url, &a, format!("{p}{}", question(rep, 2))).await?;
        samples.push(
            measure(
                &client,
                &k,
                &a,
                CASES[2],
                rep,
                &format!("{p}{}", question(rep, 3)),
            )
            .await?,
        );
        holder.await??;
    }
    k.stop().await;

    // Node P: pages only, then restarted for the disk case (a different prefix set, so
    // its first requests recompute).
    let pdir = dirs.path().join("p");
    let node = a.start(&client, &pdir, false, ".pages.log").await?;
    let argv_p = node.argv.clone();
    warm(&node).await?;
    for rep in 0..a.reps {
        let p = prefix(&catalog, rep + a.reps, a.prefix_tools);
        let cold = measure(
            &client,
            &node,
            &a,
            CASES[0],
            rep + a.reps,
            &format!("{p}{}", question(rep, 0)),
        )
        .await?;
        samples.push(cold);
        samples.push(
            measure(
                &client,
                &node,
                &a,
                CASES[3],
                rep,
                &format!("{p}{}", question(rep, 1)),
            )
            .await?,
        );
    }
    // Let the disk writer catch up with what was published before the node is killed.
    let mut last = -1.0;
    for _ in 0..120 {
        let m = node.metrics(&client).await;
        let on_disk = sum_where(&m, "mesh_kv_pages", "\"disk\"");
        if on_disk == last && on_disk > 0.0 {
            break;
        }
        last = on_disk;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    node.stop().await;
    let dropped = a.drop_caches && std::fs::write("/proc/sys/vm/drop_caches", "3\n").is_ok();
    let node = a.start(&client, &pdir, false, ".disk.log").await?;
    warm(&node).await?;
    for rep in 0..a.reps {
        let p = prefix(&catalog, rep + a.reps, a.prefix_tools);
        samples.push(
            measure(
                &client,
                &node,
                &a,
                CASES[4],
                rep,
                &format!("{p}{}", question(rep, 2)),
            )
            .await?,
        );
    }
    node.stop().await;

    let report = report(&a, &samples, [argv_k, argv_p], dropped, t0.elapsed());
    std::fs::write(&a.out, serde_json::to_string_pretty(&report)?)?;
    let md = markdown(&report);
    std::fs::write(crate::sidebyside::sibling(&a.out, ".md"), &md)?;
    println!("{md}");
    Ok(())
}

fn report(
    a: &LevelsArgs,
    samples: &[Sample],
    argv: [Vec<String>; 2],
    dropped: bool,
    wall: Duration,
) -> Value {
    let ok = |s: &Sample| s.served_by == s.case;
    let mut cases = serde_json::Map::new();
    let recompute = Percentiles::of(
        &samples
            .iter()
            .filter(|s| s.case == CASES[0] && ok(s))
            .map(|s| s.ttft_s)
            .collect::<Vec<_>>(),
    )
    .p50;
    for case in CASES {
        let all: Vec<&Sample> = samples.iter().filter(|s| s.case == case).collect();
        let good: Vec<f64> = all.iter().filter(|s| ok(s)).map(|s| s.ttft_s).collect();
        let p = Percentiles::of(&good);
        cases.insert(
            case.into(),
            json!({
                "samples": all.len(),
                "confirmed": good.len(),
                "ttft_p50_s": p.p50,
                "ttft_min_s": good.iter().copied().reduce(f64::min),
                "ttft_max_s": good.iter().copied().reduce(f64::max),
                "vs_recomputed": crate::stats::ratio(p.p50, recompute),
            }),
        );
    }
    json!({
        "bench": "levels",
        "settings": {
            "model": a.model.display().to_string(),
            "tier": a.tier,
            "threads": a.threads,
            "ctx_per_sequence": a.ctx,
            "parallel": a.parallel,
            "batch": a.batch,
            "prefix_tools": a.prefix_tools,
            "max_tokens": a.max_tokens,
            "hold_tokens": a.hold_tokens,
            "reps": a.reps,
            "kv_ram_mib": a.kv_ram_mib,
            "page_cache_dropped_before_disk": dropped,
        },
        "command": std::env::args().collect::<Vec<_>>(),
        "nodes": {"kept": argv[0], "pages": argv[1]},
        "wall_s": wall.as_secs_f64(),
        "cases": cases,
        "samples": samples.iter().map(|s| json!({
            "case": s.case,
            "rep": s.rep,
            "ttft_s": s.ttft_s,
            "prompt_tokens": s.prompt_tokens,
            "served_by": s.served_by,
        })).collect::<Vec<_>>(),
    })
}

fn markdown(r: &Value) -> String {
    let s = &r["settings"];
    let tokens: Vec<u64> = r["samples"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|x| x["prompt_tokens"].as_u64())
        .collect();
    let mut out = format!(
        "# KV levels: TTFT of a shared prefix by the level that serves it\n\n\
         `{}`\n\n\
         Model `{}`, {} threads, {} slots of {} tokens, batch {}; prompts of {}-{} tokens, \
         {} tokens generated; {} repetitions; page cache dropped before the disk case: {}.\n\n\
         | served from | TTFT p50 (s) | min-max (s) | / recomputed | confirmed samples |\n|---|---:|---:|---:|---:|\n",
        r["command"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join(" "),
        s["model"].as_str().unwrap_or(""),
        s["threads"],
        s["parallel"],
        s["ctx_per_sequence"],
        s["batch"],
        tokens.iter().min().unwrap_or(&0),
        tokens.iter().max().unwrap_or(&0),
        s["max_tokens"],
        s["reps"],
        s["page_cache_dropped_before_disk"],
    );
    for case in CASES {
        let c = &r["cases"][case];
        let f = |v: &Value| v.as_f64().map_or("-".into(), |x| format!("{x:.4}"));
        out.push_str(&format!(
            "| {case} | {} | {}-{} | {} | {}/{} |\n",
            f(&c["ttft_p50_s"]),
            f(&c["ttft_min_s"]),
            f(&c["ttft_max_s"]),
            c["vs_recomputed"]
                .as_f64()
                .map_or("-".into(), |x| format!("{x:.3}x")),
            c["confirmed"],
            c["samples"],
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(kept: f64, copied: f64, restored: f64, disk_hits: f64) -> Levels {
        Levels {
            kept,
            copied,
            restored,
            ram_hits: 0.0,
            disk_hits,
        }
    }

    #[test]
    fn the_level_that_gave_most_of_the_prompt_served_it() {
        assert_eq!(served_by(at(0.0, 0.0, 0.0, 0.0), 1000.0), "recomputed");
        // A few tokens kept from an unrelated prompt do not make a hit.
        assert_eq!(served_by(at(3.0, 0.0, 0.0, 0.0), 1000.0), "recomputed");
        assert_eq!(served_by(at(999.0, 0.0, 0.0, 0.0), 1000.0), "device, kept");
        assert_eq!(
            served_by(at(3.0, 990.0, 0.0, 0.0), 1000.0),
            "device, copied"
        );
        assert_eq!(served_by(at(0.0, 0.0, 992.0, 0.0), 1000.0), "host RAM");
        assert_eq!(served_by(at(0.0, 0.0, 992.0, 31.0), 1000.0), "disk");
    }
}
