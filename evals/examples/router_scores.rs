//! The tool router's confidence for each bundled held-out task: the task's last user
//! message routed among the tools its prompt offers, as the gateway routes a chat request
//! (same embedder, same router settings), written as JSON for `cascade_eval
//! --router-scores`, which replays the cascade with `min_router_score` thresholds.
//!
//! ```sh
//! cargo build --release --workspace --examples
//! target/release/examples/router_scores --out target/router-scores.json
//! target/release/examples/cascade_eval --grammar --budgets none --margins 0.25 \
//!     --router-scores target/router-scores.json
//! ```

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Parser;
use serde_json::json;

use mesh_control::{Embedder, EmbedderConfig, RouterConfig, Tool, ToolRouter};
use mesh_tiers::eval;

#[derive(Parser, Debug)]
#[command(about = "Router confidence (top-1 cosine, margin) per held-out task")]
struct Args {
    /// Tasks (JSONL of the model card's evaluation format).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/fixtures/eval-heldout.jsonl"))]
    eval: PathBuf,
    /// Embedding GGUF.
    #[arg(long, default_value = mesh_control::embed::BUNDLED_MODEL)]
    model: PathBuf,
    /// llama.cpp threads for the embedder (0 = all cores).
    #[arg(long, default_value_t = 0)]
    threads: u32,
    /// Where to write the scores.
    #[arg(long)]
    out: PathBuf,
}

/// The last user turn of a chat-formatted prompt (what the gateway routes on).
fn last_user_message(prompt: &str) -> &str {
    prompt.rsplit_once("<|user|>").map_or(prompt, |(_, rest)| {
        rest.split_once("<|end|>").map_or(rest, |(u, _)| u)
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    let tasks = eval::load_tasks(&args.eval).map_err(|e| anyhow::anyhow!("{e}"))?;
    let embedder = Embedder::new(EmbedderConfig {
        model: args.model.clone(),
        threads: args.threads,
        ..EmbedderConfig::default()
    })?;
    let mut rows = Vec::with_capacity(tasks.len());
    for (i, t) in tasks.iter().enumerate() {
        let tools: Vec<Tool> = eval::offered_tools(&t.prompt)
            .into_iter()
            .map(|s| Tool {
                name: s.name,
                description: s.description,
                parameters: s.parameters,
            })
            .collect();
        let intent = last_user_message(&t.prompt);
        let n = tools.len();
        let router = ToolRouter::build(&embedder, tools, RouterConfig::default())
            .with_context(|| format!("task {i}: router"))?;
        let routing = router
            .route(&embedder, intent, n)
            .with_context(|| format!("task {i}: route"))?;
        rows.push(json!({
            "i": i, "kind": t.kind, "tools": n,
            "top1": routing.confidence.top1, "margin": routing.confidence.margin,
            "best": routing.names().first(),
        }));
    }
    let top1: Vec<f64> = rows
        .iter()
        .map(|r| r["top1"].as_f64().unwrap_or(0.0))
        .collect();
    let mut sorted = top1.clone();
    sorted.sort_by(f64::total_cmp);
    let q = |p: f64| sorted[((sorted.len() - 1) as f64 * p) as usize];
    println!(
        "{} tasks from {}: top-1 cosine min {:.3}, p10 {:.3}, p50 {:.3}, p90 {:.3}, max {:.3}",
        rows.len(),
        args.eval.display(),
        q(0.0),
        q(0.1),
        q(0.5),
        q(0.9),
        q(1.0)
    );
    let out = json!({"eval": args.eval, "model": args.model, "tasks": rows, "top1": top1});
    std::fs::write(&args.out, serde_json::to_vec_pretty(&out)?)
        .with_context(|| args.out.display().to_string())?;
    println!("wrote {}", args.out.display());
    Ok(())
}
