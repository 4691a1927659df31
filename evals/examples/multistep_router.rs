//! Tool routing over the steps of multi-step agent tasks, on BFCL's multi-turn categories.
//!
//! ```sh
//! bash scripts/fetch-bfcl.sh            # prints the data folder
//! cargo run --release -p mesh-evals --example multistep_router -- --data DIR [--out report.json]
//! ```
//!
//! Why BFCL multi-turn: it ships on PyPI with its data (`bfcl-eval`, the wheel the single-step
//! evaluation already uses), every task has several user turns, and each turn's ground truth
//! names the functions it calls, from a catalog of 8 API classes (file system, math, messages,
//! posting, tickets, trading, travel, vehicle). The catalog here is all of them pooled (the
//! `multi_turn_func_doc` files, memory and web-search ones left out), about 130 functions.
//!
//! For each router setting (plain cosine; the default hybrid router) and each strategy of
//! `mesh_evals::multistep` (route once on the first message; per step; per step keeping the
//! tools already used; per step split into sub-queries; per step, two-level: the `--servers`
//! API classes whose descriptions best match the step, then their tools in the router's
//! order), it reports recall@k per step (needed functions of the step among those
//! offered), per task (mean of its steps), the share of tasks whose every step was covered,
//! the mean number of tools offered and their schema tokens (all-MiniLM-L6-v2 WordPiece,
//! compact OpenAI JSON) against the whole catalog's. Every fifth task (by its number) is held
//! out, and reported apart: decisions are to be made on the other part only.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde_json::json;

use mesh_control::embed::normalize;
use mesh_control::router::tool_text;
use mesh_control::{Embedder, EmbedderConfig, TextRole, Tool, ToolRouter, ToolText};
use mesh_evals::bfcl::{find_file, read_jsonl};
use mesh_evals::multistep::{
    self, held_out, merge_rankings, offered, recall, split_intents, two_level, Mean, Ranked,
    Strategy, Task,
};
use mesh_evals::routing::{baseline_and_default, SchemaTokens};
use mesh_evals::vectors::{matryoshka_truncate, top_k};

#[derive(Parser, Debug)]
#[command(about = "Tool routing per step of BFCL's multi-turn agent tasks")]
struct Args {
    /// The BFCL data folder (holds BFCL_v4_multi_turn_*.json, possible_answer/ and
    /// multi_turn_func_doc/).
    #[arg(long)]
    data: PathBuf,
    /// Multi-turn categories.
    #[arg(long, value_delimiter = ',', default_value = "multi_turn_base")]
    categories: Vec<String>,
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
    /// Servers (API classes) the two-level strategy keeps before ranking tools.
    #[arg(long, default_value_t = 2)]
    servers: usize,
    /// Prefix lengths for the Matryoshka check: plain cosine (name: description) per step on
    /// the first d dimensions of the layer-normed vectors; empty to skip.
    #[arg(long, value_delimiter = ',', default_value = "64,128,192,384")]
    matryoshka: Vec<usize>,
    /// Write the full report as JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// The catalog's API classes as servers: each one's description and which tools it has.
struct Servers {
    /// What each class says of itself: the part of its first tool's description before
    /// "Tool description:" (the file name when there is none).
    descriptions: Vec<String>,
    /// Tool name to its class's index.
    server_of: HashMap<String, usize>,
}

/// The multi-turn functions, all classes pooled, first definition of a name wins.
fn catalog(dir: &Path) -> Result<(Vec<Tool>, Servers)> {
    let docs = dir.join("multi_turn_func_doc");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&docs)
        .with_context(|| format!("reading {} (run scripts/fetch-bfcl.sh)", docs.display()))?
        .filter_map(|e| Some(e.ok()?.path()))
        .filter(|p| {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
            name.is_some_and(|n| {
                n.ends_with(".json") && !n.starts_with("memory_") && n != "web_search.json"
            })
        })
        .collect();
    files.sort();
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    let mut servers = Servers {
        descriptions: vec![],
        server_of: HashMap::new(),
    };
    for f in files {
        let index = servers.descriptions.len();
        let mut description = None;
        for v in read_jsonl(&f)? {
            if let Some(t) = Tool::from_openai(&v) {
                description.get_or_insert_with(|| {
                    t.description
                        .split("Tool description:")
                        .next()
                        .unwrap_or_default()
                        .trim()
                        .to_owned()
                });
                if seen.insert(t.name.clone()) {
                    servers.server_of.insert(t.name.clone(), index);
                    out.push(t);
                }
            }
        }
        let stem = f.file_stem().unwrap_or_default().to_string_lossy();
        servers.descriptions.push(
            description
                .filter(|d| !d.is_empty())
                .unwrap_or_else(|| stem.replace('_', " ")),
        );
    }
    Ok((out, servers))
}

/// Recall per step of plain cosine on the whole vectors and on Matryoshka prefixes of
/// `--matryoshka` lengths, both parts; printed and returned as JSON rows.
fn matryoshka_check(
    args: &Args,
    embedder: &Embedder,
    tools: &[Tool],
    tasks: &[Task],
    vecs: &[Vec<f32>],
) -> Result<Vec<serde_json::Value>> {
    if args.matryoshka.is_empty() {
        return Ok(vec![]);
    }
    let dim = vecs.first().map_or(0, Vec::len);
    if let Some(d) = args.matryoshka.iter().find(|&&d| d == 0 || d > dim) {
        bail!("--matryoshka {d}: prefixes are 1..={dim} dimensions");
    }
    let texts: Vec<String> = tools
        .iter()
        .map(|t| tool_text(t, ToolText::NameDescription))
        .collect();
    let tool_vecs = embedder.embed_batch(&texts, TextRole::Document)?;
    let unit = |v: &Vec<f32>| {
        let mut v = v.clone();
        normalize(&mut v);
        v
    };
    let mut settings: Vec<(String, Vec<Vec<f32>>, Vec<Vec<f32>>)> = vec![(
        format!("whole vector ({dim})"),
        tool_vecs.iter().map(unit).collect(),
        vecs.iter().map(unit).collect(),
    )];
    for &d in &args.matryoshka {
        settings.push((
            format!("first {d} of the layer-normed vector"),
            tool_vecs
                .iter()
                .map(|v| matryoshka_truncate(v, d))
                .collect(),
            vecs.iter().map(|v| matryoshka_truncate(v, d)).collect(),
        ));
    }
    println!("\n### Matryoshka prefixes: plain cosine per step\n");
    let ks: Vec<String> = args.ks.iter().map(|k| format!("recall@{k}")).collect();
    println!("| vector | part | {} |", ks.join(" | "));
    println!("|---|---|{}", "---|".repeat(ks.len()));
    let mut rows = vec![];
    for (label, tv, qv) in &settings {
        for (part, pname) in ["tuning part", "held-out part"].into_iter().enumerate() {
            let mut means = vec![Mean::default(); args.ks.len()];
            let mut v = 0;
            for task in tasks {
                for step in &task.steps {
                    if usize::from(held_out(&task.id)) == part {
                        for (ki, &k) in args.ks.iter().enumerate() {
                            let offer: Vec<String> = top_k(&qv[v], tv, k)
                                .into_iter()
                                .map(|i| tools[i].name.clone())
                                .collect();
                            means[ki].add(recall(&offer, &step.truth));
                        }
                    }
                    v += 1;
                }
            }
            let cells: Vec<String> = means
                .iter()
                .map(|m| format!("{:.3}", m.get().unwrap_or(f64::NAN)))
                .collect();
            println!("| {label} | {pname} | {} |", cells.join(" | "));
            rows.push(json!({"vector": label, "part": pname, "ks": args.ks,
                "recall_per_step": means.iter().map(Mean::get).collect::<Vec<_>>()}));
        }
    }
    Ok(rows)
}

#[derive(Default, Clone)]
struct Cell {
    step: Mean,
    task: Mean,
    covered: Mean,
    offered: Mean,
    tokens: Mean,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.ks.is_empty() || args.ks.contains(&0) {
        bail!("--ks takes offer sizes of at least 1");
    }
    let (tools, servers) = catalog(&args.data)?;
    let mut tasks: Vec<Task> = Vec::new();
    for c in &args.categories {
        let q = read_jsonl(&find_file(&args.data, c)?)?;
        let a = read_jsonl(&find_file(&args.data.join("possible_answer"), c)?)?;
        tasks.extend(multistep::bfcl_multi_turn(&q, &a)?);
    }
    let names: HashSet<&str> = tools.iter().map(|t| t.name.as_str()).collect();
    let outside: usize = tasks
        .iter()
        .flat_map(|t| &t.steps)
        .flat_map(|s| &s.truth)
        .filter(|n| !names.contains(n.as_str()))
        .count();
    let steps: usize = tasks.iter().map(|t| t.steps.len()).sum();
    let held = tasks.iter().filter(|t| held_out(&t.id)).count();
    println!(
        "{} tasks ({held} held out), {steps} steps, from {}; catalog {} functions; {outside} needed calls name a function outside it",
        tasks.len(),
        args.categories.join(", "),
        tools.len()
    );
    let split_steps = tasks
        .iter()
        .flat_map(|t| &t.steps)
        .filter(|s| split_intents(&s.query).len() > 1)
        .count();
    println!("{split_steps} steps split into two or more sub-queries");
    let embedder = Embedder::new(EmbedderConfig {
        model: args.model.clone(),
        threads: args.threads,
        query_prefix: args.query_prefix.clone(),
        document_prefix: args.document_prefix.clone(),
        ..EmbedderConfig::default()
    })?;
    let schema = SchemaTokens::new(&embedder, &tools);
    let all_tokens = schema.all;
    let queries: Vec<&str> = tasks
        .iter()
        .flat_map(|t| &t.steps)
        .map(|s| s.query.as_str())
        .collect();
    let vecs = embedder.embed_batch(&queries, TextRole::Query)?;
    let mut server_vecs = embedder.embed_batch(&servers.descriptions, TextRole::Document)?;
    server_vecs.iter_mut().for_each(|v| normalize(v));

    let variants = baseline_and_default();
    let matryoshka = matryoshka_check(&args, &embedder, &tools, &tasks, &vecs)?;
    let mut report = Vec::new();
    for (vname, config) in &variants {
        let router = ToolRouter::build(&embedder, tools.clone(), config.clone())?;
        // cells[part][strategy][k]: part 0 = tuning, 1 = held out.
        let mut cells = vec![vec![vec![Cell::default(); args.ks.len()]; Strategy::ALL.len()]; 2];
        let mut v = 0;
        for task in &tasks {
            let part = usize::from(held_out(&task.id));
            let first_v = v;
            let mut per_task = vec![vec![Mean::default(); args.ks.len()]; Strategy::ALL.len()];
            let mut used: Vec<String> = Vec::new();
            for step in &task.steps {
                for (ki, &k) in args.ks.iter().enumerate() {
                    let rank = |i: usize, q: &str| -> Result<Vec<String>> {
                        Ok(router
                            .route_vector(&vecs[i], q, k, &[])?
                            .names()
                            .into_iter()
                            .map(str::to_owned)
                            .collect())
                    };
                    let first = rank(first_v, &task.steps[0].query)?;
                    let this = rank(v, &step.query)?;
                    let subs = split_intents(&step.query);
                    let split = if subs.len() < 2 {
                        this.clone()
                    } else {
                        let mut lists = vec![this.clone()];
                        for q in &subs {
                            lists.push(
                                router
                                    .route_with(&embedder, q, k, &[])?
                                    .names()
                                    .into_iter()
                                    .map(str::to_owned)
                                    .collect(),
                            );
                        }
                        merge_rankings(&lists, k)
                    };
                    let flat: Vec<String> = router
                        .route_vector(&vecs[v], &step.query, tools.len(), &[])?
                        .names()
                        .into_iter()
                        .map(str::to_owned)
                        .collect();
                    let best = top_k(&vecs[v], &server_vecs, args.servers);
                    let two = two_level(&flat, &servers.server_of, &best, k);
                    let ranked = Ranked {
                        first: &first,
                        step: &this,
                        split: &split,
                        two_level: &two,
                    };
                    for (si, s) in Strategy::ALL.into_iter().enumerate() {
                        let o = offered(s, ranked, &used, k);
                        let r = recall(&o, &step.truth);
                        let c = &mut cells[part][si][ki];
                        c.step.add(r);
                        c.offered.add(o.len() as f64);
                        c.tokens.add(schema.of(&o) as f64);
                        per_task[si][ki].add(r);
                    }
                }
                for n in &step.truth {
                    if !used.contains(n) {
                        used.push(n.clone());
                    }
                }
                v += 1;
            }
            for si in 0..Strategy::ALL.len() {
                for ki in 0..args.ks.len() {
                    let m = per_task[si][ki].get().unwrap_or(0.0);
                    cells[part][si][ki].task.add(m);
                    cells[part][si][ki]
                        .covered
                        .add(f64::from(u8::from(m >= 1.0)));
                }
            }
        }
        for (part, pname) in ["tuning part", "held-out part"].into_iter().enumerate() {
            println!(
                "\n### {vname}, {pname} ({} tasks)\n",
                cells[part][0][0].task.count()
            );
            println!("| strategy | k | recall per step | per task | tasks fully covered | tools offered | schema tokens offered / all |");
            println!("|---|---|---|---|---|---|---|");
            for (si, s) in Strategy::ALL.into_iter().enumerate() {
                for (ki, &k) in args.ks.iter().enumerate() {
                    let c = &cells[part][si][ki];
                    let g = |m: &Mean| m.get().unwrap_or(f64::NAN);
                    println!(
                        "| {} | {k} | {:.3} | {:.3} | {:.3} | {:.1} | {:.0} / {all_tokens} ({:.1}% fewer) |",
                        s.label(),
                        g(&c.step),
                        g(&c.task),
                        g(&c.covered),
                        g(&c.offered),
                        g(&c.tokens),
                        100.0 * (1.0 - g(&c.tokens) / all_tokens as f64),
                    );
                    report.push(json!({
                        "router": vname, "part": pname, "strategy": s.label(), "k": k,
                        "recall_per_step": c.step.get(), "recall_per_task": c.task.get(),
                        "tasks_fully_covered": c.covered.get(), "tools_offered": c.offered.get(),
                        "schema_tokens_offered": c.tokens.get(), "schema_tokens_all": all_tokens,
                        "steps": c.step.count(), "tasks": c.task.count(),
                    }));
                }
            }
        }
    }
    if let Some(out) = &args.out {
        let j = json!({
            "data": args.data.display().to_string(),
            "categories": args.categories,
            "catalog_functions": tools.len(),
            "tasks": tasks.len(),
            "held_out_tasks": held,
            "steps": steps,
            "steps_split": split_steps,
            "two_level_servers": args.servers,
            "servers": servers.descriptions,
            "matryoshka": matryoshka,
            "needed_calls_outside_catalog": outside,
            "embedder": args.model.display().to_string(),
            "results": report,
        });
        std::fs::write(out, serde_json::to_string_pretty(&j)? + "\n")
            .with_context(|| format!("writing {}", out.display()))?;
        println!("\nwrote {}", out.display());
    }
    Ok(())
}
