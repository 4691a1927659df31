//! `mesh-bench fabric`: time to first token on node B when the prompt's prefix was
//! computed on node A (B pulls the pages over QUIC) vs when no node has it (B prefills).
//!
//! Two `mesh join` processes on this machine. A hosts the tier with one slot and is kept
//! busy by a long request during each measurement, so B's gateway serves locally; before each
//! "cached on a peer" sample a new prefix is computed on A (published pages reach B's view
//! with A's next heartbeats). "Recomputed" samples use prefixes no node has seen. Samples
//! alternate between the two cases.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use serde_json::{json, Value};

use crate::stats::Percentiles;
use crate::workload::{self, RequestSpec};

/// Options of `mesh-bench fabric`.
#[derive(clap::Args, Debug)]
pub(crate) struct FabricArgs {
    /// Samples per case.
    #[arg(long, default_value_t = 10)]
    samples: usize,
    /// Tool schemas in each prefix (about 100 tokens each for t1).
    #[arg(long, default_value_t = 12)]
    prefix_tools: usize,
    /// Tier (a bundled one: the nodes start with `--tiers NAME`).
    #[arg(long, default_value = "t1")]
    tier: String,
    /// Tool catalog.
    #[arg(long, default_value = "models/fixtures/catalog.jsonl")]
    catalog: PathBuf,
    /// mesh binary.
    #[arg(long, default_value = "target/release/mesh")]
    mesh_bin: PathBuf,
    /// JSON report.
    #[arg(long, default_value = "bench-results/fabric.json")]
    out: PathBuf,
}

/// Starts `mesh join` for the benchmark through the shared node helper.
async fn start(
    bin: &std::path::Path,
    certs: &std::path::Path,
    name: &str,
    tier: &str,
    parallel: &str,
    seed: Option<&str>,
) -> Result<mesh_tests::Node> {
    let ctx = (2048 * parallel.parse::<u32>()?).to_string();
    let seeds: Vec<&str> = seed.into_iter().collect();
    let args = mesh_tests::Node::join_args(
        name,
        certs,
        &seeds,
        tier,
        // mesh's own heartbeat defaults (250 ms, 2 s), not the tests' faster ones.
        &[
            "--parallel",
            parallel,
            "--ctx",
            &ctx,
            "--kv-block",
            "32",
            "--heartbeat-ms",
            "250",
            "--failure-timeout-ms",
            "2000",
        ],
    );
    let (bin, log) = (bin.to_owned(), certs.join("..").join(format!("{name}.log")));
    let name = name.to_owned();
    tokio::task::spawn_blocking(move || mesh_tests::Node::spawn(&bin, &args, &log, &[]))
        .await?
        .map_err(|log| anyhow::anyhow!("{name} exited before listening:\n{log}"))
}

/// Polls `ok` on a's entry in B's view until it holds (10 s at most).
async fn until_b_sees_a(
    client: &reqwest::Client,
    b: &str,
    what: &str,
    ok: impl Fn(&Value) -> bool,
) -> Result<()> {
    let t0 = Instant::now();
    while !ok(&mesh_tests::member_view(client, b, "a").await) {
        if t0.elapsed() > Duration::from_secs(10) {
            bail!("B never saw {what}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

fn prefix(catalog: &[Value], k: usize, n: usize) -> String {
    let mut out = String::from("<|system|>You are a helpful agent. Call a tool when one fits the request, otherwise answer directly.\n<tools>\n");
    for j in 0..n {
        if j > 0 {
            out.push('\n');
        }
        out.push_str(&catalog[(k * 17 + j * 3) % catalog.len()].to_string());
    }
    out.push_str("\n</tools><|end|>");
    out
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

pub(crate) async fn run(a: FabricArgs) -> Result<()> {
    if !a.mesh_bin.exists() {
        bail!(
            "{} not found (cargo build --release -p mesh)",
            a.mesh_bin.display()
        );
    }
    mesh_transport::tls::install_crypto_provider();
    let catalog = workload::load_catalog(&a.catalog)?;
    let dir = std::env::temp_dir().join(format!("mesh-bench-fabric-{}", std::process::id()));
    let certs = dir.join("certs");
    mesh_transport::tls::init_ca(&certs, "bench")?;
    for n in ["a", "b"] {
        mesh_transport::tls::issue(&certs, n)?;
    }
    let mut na = start(&a.mesh_bin, &certs, "a", &a.tier, "1", None).await?;
    let mut nb = start(&a.mesh_bin, &certs, "b", &a.tier, "4", Some(&na.quic)).await?;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()?;
    until_b_sees_a(&client, &nb.http, "a alive", |m| m["state"] == "alive").await?;
    let spec = RequestSpec {
        model: &a.tier,
        max_tokens: 1,
    };
    let mut ttft = [vec![], vec![]];
    let mut prompt_tokens = 0;
    let result: Result<()> = async {
        for i in 0..2 * a.samples {
            let cached = i % 2 == 0;
            let p = prefix(&catalog, i + 1, a.prefix_tools);
            if cached {
                workload::one_request(
                    &client,
                    &na.http,
                    &RequestSpec {
                        model: &a.tier,
                        max_tokens: 1,
                    },
                    &format!("{p}<|user|>Warm up.<|end|><|assistant|>"),
                )
                .await?;
                let published = scrape(&client, &na.http, "mesh_kv_pages_published_total").await;
                until_b_sees_a(&client, &nb.http, "a's new pages", |m| {
                    m["tiers"][0]["pages"]
                        .as_f64()
                        .is_some_and(|n| n >= published)
                })
                .await?;
            }
            // Keep A's only slot busy so B serves the request itself.
            let busy = {
                let (client, base, tier) = (client.clone(), na.http.clone(), a.tier.clone());
                tokio::spawn(async move {
                    let spec = RequestSpec {
                        model: &tier,
                        max_tokens: 1900,
                    };
                    let _ = workload::one_request(
                        &client,
                        &base,
                        &spec,
                        "<|user|>Tell a long story.<|end|><|assistant|>",
                    )
                    .await;
                })
            };
            let t0 = Instant::now();
            while scrape(&client, &na.http, "mesh_active_sequences").await < 1.0 {
                if t0.elapsed() > Duration::from_secs(10) || busy.is_finished() {
                    let why = if busy.is_finished() {
                        format!("{:?}", busy.await)
                    } else {
                        "timeout".into()
                    };
                    bail!("node a never started the busy request: {why}");
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            // B's view of A shows the busy slot (A's next heartbeat).
            until_b_sees_a(&client, &nb.http, "a busy", |m| {
                m["tiers"][0]["active"].as_u64().is_some_and(|n| n >= 1)
            })
            .await?;
            let fetched_before =
                scrape(&client, &nb.http, "mesh_kv_pages_fetched_from_peers_total").await;
            let r = workload::one_request(
                &client,
                &nb.http,
                &spec,
                &format!("{p}<|user|>What is the weather in Oslo on day {i}?<|end|><|assistant|>"),
            )
            .await?;
            busy.abort();
            let fetched = scrape(&client, &nb.http, "mesh_kv_pages_fetched_from_peers_total").await
                - fetched_before;
            if cached && fetched == 0.0 {
                bail!("sample {i}: B fetched no pages from A");
            }
            if !cached && fetched > 0.0 {
                bail!("sample {i}: B fetched pages for a prefix nobody had");
            }
            prompt_tokens = r.prompt_tokens.unwrap_or(prompt_tokens);
            ttft[usize::from(!cached)].push(r.times.first().copied().unwrap_or(r.e2e_s));
            // Let A finish cancelling before the next sample.
            while scrape(&client, &na.http, "mesh_active_sequences").await > 0.0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        Ok(())
    }
    .await;
    na.kill();
    nb.kill();
    if let Err(e) = result {
        bail!("{e:#} (node logs in {})", dir.display());
    }
    let _ = std::fs::remove_dir_all(&dir);
    let (c, r) = (Percentiles::of(&ttft[0]), Percentiles::of(&ttft[1]));
    let ratio = c.p50.zip(r.p50).map(|(c, r)| c / r);
    let report = json!({
        "machine": crate::machine::machine(),
        "settings": {"tier": a.tier, "samples": a.samples, "prefix_tools": a.prefix_tools, "prompt_tokens": prompt_tokens},
        "ttft_s": {"prefix_on_peer": c, "recomputed": r, "ratio_p50": ratio},
    });
    if let Some(d) = a.out.parent() {
        std::fs::create_dir_all(d)?;
    }
    std::fs::write(&a.out, serde_json::to_string_pretty(&report)? + "\n")?;
    let f = |x: Option<f64>| {
        x.map(|v| format!("{:.1}", v * 1e3))
            .unwrap_or_else(|| "-".into())
    };
    println!(
        "| TTFT on node B, {prompt_tokens}-token prompt | p50 (ms) | p95 (ms) |\n|---|---|---|"
    );
    println!(
        "| prefix pulled from node A | {} | {} |",
        f(c.p50),
        f(c.p95)
    );
    println!("| prefix recomputed | {} | {} |", f(r.p50), f(r.p95));
    println!(
        "ratio p50: {}",
        ratio
            .map(|x| format!("{x:.2}"))
            .unwrap_or_else(|| "-".into())
    );
    println!("wrote {}", a.out.display());
    Ok(())
}
