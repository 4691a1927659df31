//! What a speculative round costs on this machine: the time of one decode of `n` rows
//! with logits at every row (what verifying `n - 1` drafts costs the target) relative to
//! one row (a plain decode step), after a held-out prompt, for each bundled tier and
//! thread count; and the speed-up over the target alone that those costs allow for t1
//! drafting for t3 at a given acceptance rate (before any engine overhead).
//!
//! ```sh
//! cargo build --release --workspace --example verify_cost
//! target/release/examples/verify_cost --threads 1,2,8 --reps 30
//! ```
//!
//! Speculative decoding pays when a batch of rows costs little more than one row, which is
//! the case while a decode step waits on reading the weights from memory; when the weights
//! sit in the CPU's caches the step is bound by arithmetic and `n` rows cost nearer `n`
//! times one. A measurement, not a test.

use std::num::NonZeroU32;
use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;
use mesh_tiers::backend;

const ROWS: [usize; 8] = [1, 2, 3, 4, 5, 6, 8, 16];

#[derive(Parser, Debug)]
#[command(about = "Cost of one decode of n rows vs one row, per bundled tier")]
struct Args {
    /// llama.cpp thread counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    threads: Vec<i32>,
    /// Timed decodes per row count (after two untimed ones).
    #[arg(long, default_value_t = 30)]
    reps: usize,
    /// Draft acceptance rate for the speed-up bound.
    #[arg(long, default_value_t = 0.9)]
    accept: f64,
    /// Folder of the bundled models.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../models"))]
    models: PathBuf,
}

/// Median milliseconds of one decode of `n` rows after `prompt`, for each `n` of [`ROWS`].
fn costs(model: &LlamaModel, prompt: &[i32], threads: i32, reps: usize) -> Vec<f64> {
    let params = LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(2048))
        .with_n_batch(2048)
        .with_n_ubatch(512)
        .with_n_threads(threads)
        .with_n_threads_batch(threads);
    let mut ctx = model.new_context(backend(), params).expect("context");
    let mut batch = LlamaBatch::new(2048, 1);
    for (i, &t) in prompt.iter().enumerate() {
        batch.add(LlamaToken(t), i as i32, &[0], false).unwrap();
    }
    ctx.decode(&mut batch).expect("prefill");
    let p = prompt.len();
    ROWS.iter()
        .map(|&n| {
            let mut ms: Vec<f64> = (0..reps + 2)
                .map(|_| {
                    batch.clear();
                    for j in 0..n {
                        let t = prompt[(p - n + j) % p];
                        batch
                            .add(LlamaToken(t), (p + j) as i32, &[0], true)
                            .unwrap();
                    }
                    let t0 = Instant::now();
                    ctx.decode(&mut batch).expect("decode");
                    let took = t0.elapsed().as_secs_f64() * 1e3;
                    ctx.clear_kv_cache_seq(Some(0), Some(p as u32), None)
                        .unwrap();
                    took
                })
                .skip(2)
                .collect();
            ms.sort_by(f64::total_cmp);
            ms[ms.len() / 2]
        })
        .collect()
}

fn main() {
    let a = Args::parse();
    let tasks = mesh_tiers::eval::load_tasks(&a.models.join("fixtures/eval-heldout.jsonl"))
        .unwrap_or_else(|e| panic!("{e}"));
    let load = |tier: &str| {
        let path = a.models.join(format!("{tier}-q8_0.gguf"));
        LlamaModel::load_from_file(backend(), &path, &LlamaModelParams::default())
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    };
    let models = [("t1", load("t1")), ("t2", load("t2")), ("t3", load("t3"))];
    let prompt: Vec<i32> = models[2]
        .1
        .vocab()
        .tokenize(tasks[0].prompt.as_bytes(), true, true)
        .into_iter()
        .map(|t| t.0)
        .collect();
    println!(
        "one decode of n rows (logits at every row) after a {}-token held-out prompt, median of {} ms",
        prompt.len(),
        a.reps
    );
    println!();
    let head: Vec<String> = ROWS.iter().map(|n| format!("n={n}")).collect();
    println!("| tier | threads | {} |", head.join(" | "));
    println!("|---|---:|{}", "---:|".repeat(ROWS.len()));
    for &threads in &a.threads {
        let mut per: Vec<(&str, Vec<f64>)> = Vec::new();
        for (name, m) in &models {
            let c = costs(m, &prompt, threads, a.reps);
            let cells: Vec<String> = c
                .iter()
                .map(|ms| format!("{ms:.2} ms ({:.2}x)", ms / c[0]))
                .collect();
            println!("| {name} | {threads} | {} |", cells.join(" | "));
            per.push((name, c));
        }
        // t1 drafting k for t3: a round costs k one-row t1 decodes and one (k+1)-row t3
        // decode, and yields (1 - a^(k+1)) / (1 - a) tokens at acceptance a.
        let (t1, t3) = (&per[0].1, &per[2].1);
        let bounds: Vec<String> = [(2, 2), (4, 4), (5, 5), (7, 6)]
            .iter()
            .map(|&(k, i)| {
                let yielded = (1.0 - a.accept.powi(k as i32 + 1)) / (1.0 - a.accept);
                let cost = k as f64 * t1[0] + t3[i];
                format!("k={k}: {:.2}x", yielded * t3[0] / cost)
            })
            .collect();
        println!(
            "| bound, t1 drafts for t3 at {:.0}% acceptance | {threads} | {} |",
            100.0 * a.accept,
            bounds.join(" | ")
        );
    }
}
