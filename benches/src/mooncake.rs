//! `mesh-bench mooncake`: replay of a Mooncake-format trace (`timestamp`, `input_length`,
//! `output_length`, `hash_ids`) against mesh and llama-server, side by side.
//!
//! Scale (stated in every report): each 512-token trace block becomes `--block-tokens`
//! deterministic token ids (seeded by the block's hash id, so equal ids give equal tokens and
//! reusable prefixes stay reusable); prompts are cut to `--max-blocks` blocks; outputs are
//! `min(output_length, --max-output)` tokens with EOS ignored; arrival times are divided by
//! `--compress` and at most `--max-inflight` requests are outstanding. Prompts go as token-id
//! arrays to `/v1/completions` (both servers accept them). mesh runs with `--kv-block`
//! equal to the scaled block, so one trace block = one page.
//!
//! Reported: requests/s, TTFT p50/p95 per target; mesh's prefix hit ratio (prompt tokens
//! restored from pages / prompt tokens) against the trace's own upper bound (share of
//! blocks whose hash id appeared in an earlier request of the replayed part).

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use indicatif::ProgressBar;
use serde_json::{json, Value};

use crate::sidebyside::ServerArgs;
use crate::stats::Percentiles;

/// Options of `mesh-bench mooncake`.
#[derive(clap::Args, Debug)]
pub(crate) struct MooncakeArgs {
    /// The trace (JSON lines).
    #[arg(long, default_value = "../shared/data/mooncake_synthetic_trace.jsonl")]
    trace: PathBuf,
    /// Requests replayed (from the start of the trace).
    #[arg(long, default_value_t = 300)]
    requests: usize,
    /// Tokens per 512-token trace block.
    #[arg(long, default_value_t = 16)]
    block_tokens: usize,
    /// Longest prompt in blocks (the rest of a longer one is dropped).
    #[arg(long, default_value_t = 100)]
    max_blocks: usize,
    /// Longest output in tokens.
    #[arg(long, default_value_t = 16)]
    max_output: usize,
    /// Arrival times are divided by this.
    #[arg(long, default_value_t = 20.0)]
    compress: f64,
    /// Requests outstanding at most (the rest wait their turn).
    #[arg(long, default_value_t = 16)]
    max_inflight: usize,
    #[command(flatten)]
    servers: ServerArgs,
    /// JSON report.
    #[arg(long, default_value = "bench-results/mooncake.json")]
    out: PathBuf,
}

/// One trace request, scaled.
pub(crate) struct Req {
    /// Arrival, seconds after the first request (already divided by the compression).
    pub(crate) at_s: f64,
    pub(crate) tokens: Vec<i32>,
    pub(crate) blocks: Vec<u64>,
    pub(crate) output: usize,
}

/// How a trace is cut down to the machine.
pub(crate) struct Scale {
    pub(crate) requests: usize,
    pub(crate) block_tokens: usize,
    pub(crate) max_blocks: usize,
    pub(crate) max_output: usize,
    pub(crate) compress: f64,
}

fn block_tokens(hash: u64, n: usize) -> Vec<i32> {
    // splitmix64 over (hash, i): ordinary vocabulary ids, clear of the special tokens.
    (0..n as u64)
        .map(|i| {
            let z = hash.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(i + 1);
            100 + (crate::workload::splitmix64_mix(z) % 2900) as i32
        })
        .collect()
}

fn load(a: &MooncakeArgs) -> Result<Vec<Req>> {
    load_trace(
        &a.trace,
        &Scale {
            requests: a.requests,
            block_tokens: a.block_tokens,
            max_blocks: a.max_blocks,
            max_output: a.max_output,
            compress: a.compress,
        },
    )
}

/// The first `a.requests` requests of the trace at `path`, scaled by `a`.
pub(crate) fn load_trace(path: &std::path::Path, a: &Scale) -> Result<Vec<Req>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = vec![];
    for (i, line) in text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .take(a.requests)
        .enumerate()
    {
        let v: Value =
            serde_json::from_str(line).with_context(|| format!("trace line {}", i + 1))?;
        let blocks: Vec<u64> = v["hash_ids"]
            .as_array()
            .context("hash_ids")?
            .iter()
            .filter_map(Value::as_u64)
            .take(a.max_blocks)
            .collect();
        if blocks.is_empty() {
            continue;
        }
        let tokens = blocks
            .iter()
            .flat_map(|&h| block_tokens(h, a.block_tokens))
            .collect();
        out.push(Req {
            at_s: v["timestamp"].as_f64().unwrap_or(0.0) / 1000.0 / a.compress,
            tokens,
            blocks,
            output: (v["output_length"].as_u64().unwrap_or(1) as usize).clamp(1, a.max_output),
        });
    }
    Ok(out)
}

/// Streams one request; returns time to first token.
async fn send(client: &reqwest::Client, base: &str, tier: &str, r: &Req) -> Result<f64> {
    let body = json!({"model": tier, "prompt": r.tokens, "max_tokens": r.output, "temperature": 0.0,
        "ignore_eos": true, "cache_prompt": true, "stream": true});
    let t0 = Instant::now();
    let resp = client
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await?;
    if !resp.status().is_success() {
        bail!(
            "HTTP {}: {}",
            resp.status(),
            resp.text().await.unwrap_or_default()
        );
    }
    let mut first = None;
    let mut s = resp.bytes_stream();
    while let Some(b) = s.next().await {
        let b = b?;
        if first.is_none() && String::from_utf8_lossy(&b).contains("\"text\"") {
            first = Some(t0.elapsed().as_secs_f64());
        }
    }
    Ok(first.unwrap_or_else(|| t0.elapsed().as_secs_f64()))
}

async fn replay(
    client: &reqwest::Client,
    base: &str,
    a: &MooncakeArgs,
    reqs: &[Req],
) -> Result<(f64, Vec<f64>)> {
    let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(a.max_inflight));
    let t0 = Instant::now();
    let futs = reqs.iter().map(|r| {
        let sem = sem.clone();
        async move {
            let due = Duration::from_secs_f64(r.at_s);
            if let Some(wait) = due.checked_sub(t0.elapsed()) {
                tokio::time::sleep(wait).await;
            }
            let _permit = sem.acquire().await.expect("semaphore open");
            send(client, base, &a.servers.tier, r).await
        }
    });
    let ttft = futures::future::try_join_all(futs).await?;
    Ok((t0.elapsed().as_secs_f64(), ttft))
}

async fn scrape(client: &reqwest::Client, base: &str, name: &str) -> f64 {
    let Ok(r) = client.get(format!("{base}/metrics")).send().await else {
        return 0.0;
    };
    r.text()
        .await
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

pub(crate) async fn run(a: MooncakeArgs) -> Result<()> {
    a.servers.check(&[(&a.trace, "trace")])?;
    let reqs = load(&a)?;
    if reqs
        .iter()
        .any(|r| r.tokens.len() + r.output > a.servers.ctx as usize)
    {
        bail!("--max-blocks × --block-tokens + --max-output exceeds --ctx");
    }
    // Upper bound on block reuse within the replayed part.
    let mut seen = HashSet::new();
    let (mut reusable, mut total) = (0usize, 0usize);
    for r in &reqs {
        for h in &r.blocks {
            total += 1;
            reusable += usize::from(seen.contains(h));
        }
        seen.extend(r.blocks.iter().copied());
    }
    let bound = reusable as f64 / total.max(1) as f64;
    let prompt_tokens: usize = reqs.iter().map(|r| r.tokens.len()).sum();
    let mut servers = Vec::new();
    let kv_block = ["--kv-block".to_owned(), a.block_tokens.to_string()];
    let (client, _) = a
        .servers
        .start(&a.out, &kv_block, &mut servers, &ProgressBar::hidden())
        .await?;
    let mut res = vec![];
    for s in &servers {
        eprintln!("replaying {} requests against {}", reqs.len(), s.name);
        res.push(
            replay(&client, &s.base_url, &a, &reqs)
                .await
                .with_context(|| s.name)?,
        );
    }
    let restored = scrape(
        &client,
        &servers[0].base_url,
        "mesh_kv_recompute_avoided_tokens_total",
    )
    .await;
    let hit = restored / prompt_tokens.max(1) as f64;
    for s in servers.drain(..) {
        let _ = s.stop().await;
    }
    let (m, l) = (&res[0], &res[1]);
    let (mp, lp) = (Percentiles::of(&m.1), Percentiles::of(&l.1));
    let n = reqs.len() as f64;
    let report = json!({
        "machine": crate::machine::machine(),
        "scale": {"block_tokens_per_512": a.block_tokens, "max_blocks": a.max_blocks, "max_output": a.max_output,
                  "compress": a.compress, "max_inflight": a.max_inflight, "requests": reqs.len(), "prompt_tokens": prompt_tokens},
        "mesh": {"requests_per_s": n / m.0, "ttft_s": mp, "prefix_hit_ratio": hit},
        "llama_server": {"requests_per_s": n / l.0, "ttft_s": lp},
        "trace_upper_bound_block_reuse": bound,
        "ratios": {"throughput": l.0 / m.0, "ttft_p50": mp.p50.zip(lp.p50).map(|(x, y)| x / y), "ttft_p95": mp.p95.zip(lp.p95).map(|(x, y)| x / y)},
    });
    std::fs::write(&a.out, serde_json::to_string_pretty(&report)? + "\n")?;
    let f = |x: Option<f64>| x.map(|v| format!("{v:.3}")).unwrap_or_else(|| "-".into());
    println!("| Mooncake replay, {} requests, 512→{} tokens/block, ≤{} blocks, ≤{} out, {}x faster arrivals | mesh | llama-server | ratio |",
        reqs.len(), a.block_tokens, a.max_blocks, a.max_output, a.compress);
    println!("|---|---|---|---|");
    println!(
        "| requests/s | {:.2} | {:.2} | {:.2} |",
        n / m.0,
        n / l.0,
        l.0 / m.0
    );
    println!(
        "| TTFT p50 (s) | {} | {} | {} |",
        f(mp.p50),
        f(lp.p50),
        f(mp.p50.zip(lp.p50).map(|(x, y)| x / y))
    );
    println!(
        "| TTFT p95 (s) | {} | {} | {} |",
        f(mp.p95),
        f(lp.p95),
        f(mp.p95.zip(lp.p95).map(|(x, y)| x / y))
    );
    println!(
        "mesh prefix hit ratio {:.3} of prompt tokens; trace upper bound {:.3}",
        hit, bound
    );
    println!("wrote {}", a.out.display());
    Ok(())
}
