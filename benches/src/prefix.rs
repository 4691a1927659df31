//! `mesh-bench prefix`: many agents sharing a long prompt prefix (system prompt + tool
//! schemas), each asking distinct questions. mesh (prefix KV pages) and llama-server (its
//! per-slot prompt cache, `--cache-prompt`) run side by side on the same GGUF with the same
//! slots, threads and context.
//!
//! One repetition = `agents` concurrent agents × `turns` requests each (streamed
//! `/v1/completions`, `max_tokens` with EOS ignored). Every repetition uses a new shared
//! prefix (another slice of the catalog), so neither server starts it with a warm cache. The
//! targets alternate A B A B. Reported per target: agent-task throughput (requests/s), TTFT
//! p50/p95, and for mesh the page-store bytes each repetition added against one copy of
//! the shared prefix plus the requests' distinct tails (token counts from llama-server's
//! `/tokenize`, bytes per token from the store's own totals).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use indicatif::ProgressBar;
use serde_json::{json, Value};

use crate::sidebyside::ServerArgs;
use crate::stats::Percentiles;
use crate::workload::{self, RequestSpec};

/// Options of `mesh-bench prefix`.
#[derive(clap::Args, Debug)]
pub(crate) struct PrefixArgs {
    #[command(flatten)]
    servers: ServerArgs,
    /// Concurrent agents.
    #[arg(long, default_value_t = 16)]
    agents: usize,
    /// Requests per agent per repetition.
    #[arg(long, default_value_t = 2)]
    turns: usize,
    /// Tool schemas in the shared prefix (about 100 tokens each for t1).
    #[arg(long, default_value_t = 12)]
    prefix_tools: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 16)]
    max_tokens: usize,
    /// Measured repetitions per target.
    #[arg(long, default_value_t = 2)]
    reps: usize,
    /// Tokens per mesh KV page (`mesh up --kv-block`).
    #[arg(long, default_value_t = 32)]
    kv_block: usize,
    /// Tool catalog.
    #[arg(long, default_value = "models/fixtures/catalog.jsonl")]
    catalog: PathBuf,
    /// JSON report (markdown next to it, `.md`; server logs `.mesh.log`, `.llama-server.log`).
    #[arg(long, default_value = "bench-results/prefix.json")]
    out: PathBuf,
}

const CITIES: &[&str] = &[
    "Lisbon", "Osaka", "Nairobi", "Toronto", "Oslo", "Lima", "Hanoi", "Perth", "Dublin", "Quito",
    "Seville", "Tbilisi", "Halifax", "Accra", "Kraków", "Bergen",
];

/// The shared prefix of repetition `rep`: a system turn with `n` tool schemas from the
/// catalog, starting at entry `37 rep` (mod its length).
pub(crate) fn shared_prefix(catalog: &[Value], rep: usize, n: usize) -> String {
    let start = (rep * 37) % catalog.len();
    let mut out = String::from("<|system|>You are a helpful agent. Call a tool when one fits the request, otherwise answer directly.\n<tools>\n");
    for j in 0..n {
        if j > 0 {
            out.push('\n');
        }
        out.push_str(&serde_json::to_string(&catalog[(start + j) % catalog.len()]).expect("json"));
    }
    out.push_str("\n</tools><|end|>");
    out
}

fn question(agent: usize, turn: usize) -> String {
    format!(
        "<|user|>Agent {agent} asks: what is the weather in {} on day {} of the trip?<|end|><|assistant|>",
        CITIES[agent % CITIES.len()],
        turn + 1
    )
}

struct RepResult {
    wall_s: f64,
    ttft: Vec<f64>,
    prompt_tokens: Vec<usize>,
}

async fn run_rep(
    client: &reqwest::Client,
    base: &str,
    a: &PrefixArgs,
    prefix: &str,
) -> Result<RepResult> {
    let spec = RequestSpec {
        model: &a.servers.tier,
        max_tokens: a.max_tokens,
    };
    let t0 = Instant::now();
    let agents = (0..a.agents).map(|agent| {
        let spec = &spec;
        async move {
            let mut out = vec![];
            for turn in 0..a.turns {
                let p = format!("{prefix}{}", question(agent, turn));
                let r = workload::one_request(client, base, spec, &p).await?;
                let ttft = r.times.first().copied().unwrap_or(r.e2e_s);
                out.push((ttft, r.prompt_tokens.unwrap_or(0)));
            }
            anyhow::Ok(out)
        }
    });
    let all = futures::future::try_join_all(agents).await?;
    let wall_s = t0.elapsed().as_secs_f64();
    let flat: Vec<(f64, usize)> = all.into_iter().flatten().collect();
    Ok(RepResult {
        wall_s,
        ttft: flat.iter().map(|x| x.0).collect(),
        prompt_tokens: flat.iter().map(|x| x.1).collect(),
    })
}

/// Token count of `text` by llama-server's `/tokenize` (same GGUF, same tokenizer).
async fn count_tokens(client: &reqwest::Client, llama: &str, text: &str) -> Result<usize> {
    let v: Value = client
        .post(format!("{llama}/tokenize"))
        .json(&json!({"content": text, "add_special": false}))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    v["tokens"]
        .as_array()
        .map(Vec::len)
        .context("llama-server /tokenize gave no tokens")
}

async fn scrape(client: &reqwest::Client, base: &str, name: &str) -> f64 {
    let Ok(r) = client.get(format!("{base}/metrics")).send().await else {
        return 0.0;
    };
    let text = r.text().await.unwrap_or_default();
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

pub(crate) async fn run(a: PrefixArgs) -> Result<()> {
    a.servers.check(&[(&a.catalog, "catalog")])?;
    if a.agents == 0 || a.turns == 0 || a.reps == 0 || a.kv_block == 0 {
        bail!("--agents, --turns, --reps and --kv-block must be at least 1");
    }
    let catalog = workload::load_catalog(&a.catalog)?;
    if let Some(d) = a.out.parent() {
        std::fs::create_dir_all(d)?;
    }
    let model = a.servers.model.display().to_string();
    let mut servers = Vec::new();
    let kv_block = ["--kv-block".to_owned(), a.kv_block.to_string()];
    let (client, _) = a
        .servers
        .start(&a.out, &kv_block, &mut servers, &ProgressBar::hidden())
        .await?;
    let bases: Vec<String> = servers.iter().map(|s| s.base_url.clone()).collect();
    // Warm-up on a prefix no repetition uses (repetition r starts at catalog entry 37 r mod
    // the catalog's length: distinct for r below it when the length is coprime to 37).
    let warm = shared_prefix(&catalog, a.reps, a.prefix_tools);
    for b in &bases {
        workload::one_request(
            &client,
            b,
            &RequestSpec {
                model: &a.servers.tier,
                max_tokens: 4,
            },
            &format!("{warm}{}", question(0, 0)),
        )
        .await?;
    }
    let mut results: [Vec<RepResult>; 2] = [vec![], vec![]];
    let mut page_bytes = vec![];
    for rep in 0..a.reps {
        let prefix = shared_prefix(&catalog, rep, a.prefix_tools);
        let order = if rep % 2 == 0 { [0, 1] } else { [1, 0] };
        for t in order {
            let before = if t == 0 {
                scrape(&client, &bases[0], "mesh_kv_page_bytes").await
            } else {
                0.0
            };
            let r = run_rep(&client, &bases[t], &a, &prefix)
                .await
                .with_context(|| format!("{} rep {rep}", servers[t].name))?;
            eprintln!(
                "rep {rep} {}: {:.2}s, TTFT p50 {:.3}s",
                servers[t].name,
                r.wall_s,
                Percentiles::of(&r.ttft).p50.unwrap_or(0.0)
            );
            if t == 0 {
                page_bytes.push(scrape(&client, &bases[0], "mesh_kv_page_bytes").await - before);
            }
            results[t].push(r);
        }
    }
    let reused = scrape(&client, &bases[0], "mesh_kv_recompute_avoided_tokens_total").await;
    // KV memory: what the page store gained per repetition against one copy of the shared
    // prefix plus every request's distinct tail, at the store's own bytes per token
    // (payload and page headers, from its totals).
    let stored_pages = scrape(&client, &bases[0], "mesh_kv_pages{").await;
    let stored_bytes = scrape(&client, &bases[0], "mesh_kv_page_bytes{").await;
    let block = a.kv_block as f64;
    let last = shared_prefix(&catalog, a.reps - 1, a.prefix_tools);
    let prefix_tokens = count_tokens(&client, &bases[1], &last).await?;
    let mut tails = 0usize;
    for agent in 0..a.agents {
        for turn in 0..a.turns {
            let full = count_tokens(
                &client,
                &bases[1],
                &format!("{last}{}", question(agent, turn)),
            )
            .await?;
            tails += full.saturating_sub(prefix_tokens);
        }
    }
    let bytes_per_token =
        (stored_pages > 0.0 && block > 0.0).then(|| stored_bytes / (stored_pages * block));
    let ideal = bytes_per_token.map(|b| b * (prefix_tokens + tails) as f64);
    let memory_ratio: Vec<f64> = match ideal {
        Some(i) if i > 0.0 => page_bytes.iter().map(|b| b / i).collect(),
        _ => vec![],
    };
    let summarize = |rs: &[RepResult]| {
        let n: usize = rs.iter().map(|r| r.ttft.len()).sum();
        let wall: f64 = rs.iter().map(|r| r.wall_s).sum();
        let ttft: Vec<f64> = rs.iter().flat_map(|r| r.ttft.clone()).collect();
        (n as f64 / wall, Percentiles::of(&ttft))
    };
    let (m_tput, m_ttft) = summarize(&results[0]);
    let (l_tput, l_ttft) = summarize(&results[1]);
    let prompt_tokens = results[0]
        .first()
        .and_then(|r| r.prompt_tokens.first().copied())
        .unwrap_or(0);
    let ratio = |m: Option<f64>, l: Option<f64>| m.zip(l).map(|(m, l)| m / l);
    for s in servers.drain(..) {
        let _ = s.stop().await;
    }
    let report = json!({
        "machine": crate::machine::machine(),
        "settings": {"model": model, "agents": a.agents, "turns": a.turns, "prefix_tools": a.prefix_tools, "max_tokens": a.max_tokens,
                     "threads": a.servers.threads, "parallel": a.servers.parallel, "ctx": a.servers.ctx, "reps": a.reps, "prompt_tokens": prompt_tokens},
        "mesh": {"requests_per_s": m_tput, "ttft_s": m_ttft, "page_store_bytes_per_rep": page_bytes, "recompute_avoided_tokens": reused,
                 "kv_memory": {"prefix_tokens": prefix_tokens, "distinct_tail_tokens": tails, "page_bytes_per_token": bytes_per_token,
                               "one_prefix_plus_tails_bytes": ideal, "ratio_per_rep": memory_ratio}},
        "llama_server": {"requests_per_s": l_tput, "ttft_s": l_ttft},
        "ratios": {"throughput": m_tput / l_tput, "ttft_p50": ratio(m_ttft.p50, l_ttft.p50), "ttft_p95": ratio(m_ttft.p95, l_ttft.p95)},
    });
    let f = |x: Option<f64>| x.map(|v| format!("{:.3}", v)).unwrap_or_else(|| "-".into());
    let md = format!(
        "| {} agents × {} turns, {}-token prompts, {} tokens out | mesh | llama-server | ratio |\n|---|---|---|---|\n\
| requests/s | {:.2} | {:.2} | {:.2} |\n| TTFT p50 (s) | {} | {} | {} |\n| TTFT p95 (s) | {} | {} | {} |\n",
        a.agents, a.turns, prompt_tokens, a.max_tokens, m_tput, l_tput, m_tput / l_tput,
        f(m_ttft.p50), f(l_ttft.p50), f(ratio(m_ttft.p50, l_ttft.p50)),
        f(m_ttft.p95), f(l_ttft.p95), f(ratio(m_ttft.p95, l_ttft.p95)),
    );
    std::fs::write(&a.out, serde_json::to_string_pretty(&report)? + "\n")?;
    std::fs::write(a.out.with_extension("md"), &md)?;
    println!("{md}\nmesh page store per repetition: {page_bytes:?} bytes; prompt tokens restored from pages: {reused}");
    if let Some(i) = ideal {
        println!(
            "KV memory: one copy of the {prefix_tokens}-token prefix + {tails} distinct tail tokens = {:.0} bytes; page store / that per repetition: {}",
            i,
            memory_ratio.iter().map(|r| format!("{r:.2}")).collect::<Vec<_>>().join(", ")
        );
    }
    println!("wrote {}", a.out.display());
    Ok(())
}
