//! Evaluates the tool router on the Berkeley Function-Calling Leaderboard data.
//!
//! ```sh
//! bash scripts/fetch-bfcl.sh            # prints the data folder
//! cargo run --release -p mesh-evals --example bfcl_router -- --data DIR [--out report.json]
//! ```
//!
//! Reports, for several router settings:
//! * **per record**: each question routed among its own record's functions (2–37);
//! * **pooled**: all distinct functions (by name) of simple_python, multiple,
//!   parallel_multiple, live_simple and live_multiple in one catalog (~1,200), each
//!   `multiple` / `live_multiple` question routed against it, and again for the held-out
//!   fifth of each (positions 0, 5, 10, ... in the file), which the embedder's fine-tune
//!   (`models/recipe/finetune_embedding.py`) never trains on;
//!
//! recall@1/3/5 against the function name(s) of the possible answer; the schema tokens a
//! prompt carries with the top-5 tools versus all of them; and route latency at 100,
//! 1,000 and 10,000 tools with the exact and the quantized index.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use serde::Serialize;
use serde_json::{json, Value};

use mesh_control::embed::normalize;
use mesh_control::index::recall;
use mesh_control::router::tool_text;
use mesh_control::{Embedder, EmbedderConfig, RouterConfig, TextRole, Tool, ToolRouter, ToolText};
use mesh_evals::bfcl::{find_file, read_jsonl};
use mesh_evals::multistep::{self, merge_rankings, split_intents, Mean};

#[derive(Parser, Debug)]
#[command(about = "Tool-router recall, prompt tokens and latency on BFCL data")]
struct Args {
    /// The BFCL data folder (holds BFCL_v{3,4}_*.json and possible_answer/).
    #[arg(long)]
    data: PathBuf,
    /// Write the full report as JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
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
    /// Also count schema tokens with this GGUF's tokenizer (e.g. models/t1-q8_0.gguf).
    #[arg(long)]
    count_model: Option<PathBuf>,
    /// Queries timed with their embedding included (each one is embedded once per case).
    #[arg(long, default_value_t = 200)]
    latency_queries: usize,
    /// Print this many pooled live_multiple misses (truth not in the top 5) of the
    /// default router, to see what it confuses.
    #[arg(long, default_value_t = 0)]
    misses: usize,
    /// Only the latency table (skips recall, sweep and token counts).
    #[arg(long)]
    latency_only: bool,
    /// Tool counts for the latency table.
    #[arg(long, value_delimiter = ',', default_value = "100,1000,10000")]
    sizes: Vec<usize>,
}

const CATEGORIES: [&str; 5] = [
    "simple_python",
    "multiple",
    "parallel_multiple",
    "live_simple",
    "live_multiple",
];

struct Question {
    category: &'static str,
    /// The last user message.
    query: String,
    tools: Vec<Tool>,
    /// Function names of the possible answer.
    truth: Vec<String>,
    /// Every fifth question of its category file (positions 0, 5, 10, ...), which
    /// `models/recipe/finetune_embedding.py` keeps out of training: reported apart.
    held_out: bool,
}

fn last_user_message(question: &Value) -> Option<String> {
    let mut messages = Vec::new();
    for turn in question.as_array()? {
        match turn {
            Value::Array(ms) => messages.extend(ms),
            m => messages.push(m),
        }
    }
    messages
        .iter()
        .rev()
        .find(|m| m["role"] == "user")
        .and_then(|m| m["content"].as_str())
        .map(str::to_owned)
}

fn load(dir: &Path) -> Result<Vec<Question>> {
    let mut out = Vec::new();
    for category in CATEGORIES {
        let questions = read_jsonl(&find_file(dir, category)?)?;
        let answers = read_jsonl(&find_file(&dir.join("possible_answer"), category)?)?;
        let truth: HashMap<&str, Vec<String>> = answers
            .iter()
            .filter_map(|a| {
                let names = a["ground_truth"]
                    .as_array()?
                    .iter()
                    .filter_map(|call| call.as_object()?.keys().next().cloned())
                    .collect();
                Some((a["id"].as_str()?, names))
            })
            .collect();
        for (position, q) in questions.iter().enumerate() {
            let id = q["id"].as_str().context("question without id")?;
            let mut seen = HashSet::new();
            let tools = q["function"]
                .as_array()
                .context("question without functions")?
                .iter()
                .filter_map(Tool::from_openai)
                .filter(|t| seen.insert(t.name.clone()))
                .collect();
            out.push(Question {
                category,
                query: last_user_message(&q["question"])
                    .with_context(|| format!("{id}: no user message"))?,
                tools,
                truth: truth.get(id).cloned().unwrap_or_default(),
                held_out: position % 5 == 0,
            });
        }
    }
    Ok(out)
}

/// Mean recall@1/3/5: the share of a question's true functions among the first k routed.
#[derive(Clone, Copy, Debug, Default, Serialize)]
struct Recall {
    questions: usize,
    at1: f64,
    at3: f64,
    at5: f64,
    /// Share of questions where the hybrid re-rank ran.
    reranked: f64,
}

impl Recall {
    fn add(&mut self, names: &[&str], truth: &[String], reranked: bool) {
        let truth: HashSet<&str> = truth.iter().map(String::as_str).collect();
        let at = |k: usize| {
            let found = names.iter().take(k).filter(|n| truth.contains(*n)).count();
            found as f64 / truth.len().max(1) as f64
        };
        self.questions += 1;
        self.at1 += at(1);
        self.at3 += at(3);
        self.at5 += at(5);
        self.reranked += f64::from(u8::from(reranked));
    }

    fn mean(mut self) -> Self {
        let n = self.questions.max(1) as f64;
        self.at1 /= n;
        self.at3 /= n;
        self.at5 /= n;
        self.reranked /= n;
        self
    }
}

#[derive(Clone, Debug, Serialize)]
struct Variant {
    name: String,
    config: RouterConfig,
    per_record: HashMap<String, Recall>,
    pooled: HashMap<String, Recall>,
}

fn variants() -> Vec<(&'static str, RouterConfig)> {
    let dense = |tool_text| RouterConfig {
        tool_text,
        hybrid_weight: 0.0,
        ..RouterConfig::default()
    };
    let always = RouterConfig {
        min_score: 1.0,
        ..RouterConfig::default()
    };
    vec![
        (
            "cosine, name: description (baseline)",
            dense(ToolText::NameDescription),
        ),
        ("cosine, + parameter names", dense(ToolText::Parameters)),
        (
            "cosine, + parameter descriptions",
            dense(ToolText::ParameterDescriptions),
        ),
        ("hybrid when unsure (default)", RouterConfig::default()),
        ("hybrid always", always.clone()),
        (
            "BM25 only",
            RouterConfig {
                hybrid_weight: 1.0,
                ..always
            },
        ),
    ]
}

fn main() -> Result<()> {
    let args = Args::parse();
    let questions = load(&args.data)?;
    println!(
        "{} questions from {} ({})",
        questions.len(),
        args.data.display(),
        CATEGORIES.join(", ")
    );
    let embedder = Embedder::new(EmbedderConfig {
        model: args.model.clone(),
        threads: args.threads,
        query_prefix: args.query_prefix.clone(),
        document_prefix: args.document_prefix.clone(),
        ..EmbedderConfig::default()
    })?;

    // The pooled catalog: distinct names, first definition wins, in category order.
    let mut seen = HashSet::new();
    let pooled: Vec<Tool> = questions
        .iter()
        .flat_map(|q| &q.tools)
        .filter(|t| seen.insert(t.name.clone()))
        .cloned()
        .collect();
    let pooled_names: HashSet<&str> = pooled.iter().map(|t| t.name.as_str()).collect();
    let missing_truth = questions
        .iter()
        .filter(|q| q.truth.iter().any(|t| !pooled_names.contains(t.as_str())))
        .count();
    println!(
        "pooled catalog: {} distinct functions; {missing_truth} questions name a function outside it",
        pooled.len()
    );

    // Embedding throughput on the pooled catalog, then the cache on a second pass.
    let texts: Vec<String> = pooled
        .iter()
        .map(|t| tool_text(t, ToolText::default()))
        .collect();
    let t0 = Instant::now();
    embedder.embed_cached(&texts)?;
    let embed_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    embedder.embed_cached(&texts)?;
    let cached_s = t0.elapsed().as_secs_f64();
    let cache = embedder.cache().stats();
    println!(
        "embedded {} tool texts in {embed_s:.1} s ({:.0}/s); again through the cache in {:.1} ms ({} hits, {} misses)",
        texts.len(),
        texts.len() as f64 / embed_s,
        cached_s * 1e3,
        cache.hits,
        cache.misses
    );

    let t0 = Instant::now();
    let queries: Vec<&str> = questions.iter().map(|q| q.query.as_str()).collect();
    let query_vecs = embedder.embed_batch(&queries, TextRole::Query)?;
    println!(
        "embedded {} queries in {:.1} s",
        queries.len(),
        t0.elapsed().as_secs_f64()
    );

    // Recall for every variant.
    let mut results = Vec::new();
    let all_variants = if args.latency_only {
        Vec::new()
    } else {
        variants()
    };
    for (name, config) in all_variants {
        let mut per_record: HashMap<String, Recall> = HashMap::new();
        for (q, v) in questions.iter().zip(&query_vecs) {
            if q.tools.len() < 2 {
                continue; // simple categories: one function, nothing to route
            }
            let router = ToolRouter::build(&embedder, q.tools.clone(), config.clone())?;
            let routing = router.route_vector(v, &q.query, 5, &[])?;
            per_record.entry(q.category.to_owned()).or_default().add(
                &routing.names(),
                &q.truth,
                routing.reranked,
            );
        }
        let router = ToolRouter::build(&embedder, pooled.clone(), config.clone())?;
        let mut pooled_recall: HashMap<String, Recall> = HashMap::new();
        for (q, v) in questions.iter().zip(&query_vecs) {
            if !matches!(q.category, "multiple" | "live_multiple") {
                continue;
            }
            let routing = router.route_vector(v, &q.query, 5, &[])?;
            let names = routing.names();
            pooled_recall.entry(q.category.to_owned()).or_default().add(
                &names,
                &q.truth,
                routing.reranked,
            );
            if q.held_out {
                pooled_recall
                    .entry(format!("{}_held_out", q.category))
                    .or_default()
                    .add(&names, &q.truth, routing.reranked);
            }
        }
        results.push(Variant {
            name: name.to_owned(),
            config,
            per_record: per_record.into_iter().map(|(k, r)| (k, r.mean())).collect(),
            pooled: pooled_recall
                .into_iter()
                .map(|(k, r)| (k, r.mean()))
                .collect(),
        });
    }
    let (mut sweep_rows, mut token_rows, mut split_rows) = (Vec::new(), Vec::new(), Vec::new());
    if !args.latency_only {
        print_recall(&results);
        if args.misses > 0 {
            print_misses(&embedder, &pooled, &questions, &query_vecs, args.misses)?;
        }
        split_rows = split_check(&embedder, &pooled, &questions, &query_vecs)?;
        sweep_rows = sweep(&embedder, &pooled, &questions, &query_vecs)?;
        token_rows = tokens(&args, &embedder, &pooled, &questions, &query_vecs)?;
    }

    let load_before = load_average();
    let latency = latency(&args, &embedder, &pooled, &questions, &query_vecs)?;
    let load_after = load_average();
    println!("\n1-minute load average: {load_before} before the latency runs, {load_after} after");

    if let Some(out) = &args.out {
        let report = json!({
            "data": args.data,
            "questions": questions.len(),
            "pooled_tools": pooled.len(),
            "embedding": {
                "model": args.model,
                "tool_texts": texts.len(),
                "seconds": embed_s,
                "cached_seconds": cached_s,
                "cache": cache,
            },
            "recall": results,
            "sweep": sweep_rows,
            "split": split_rows,
            "tokens": token_rows,
            "latency": latency,
            "load_average": [load_before, load_after],
            "embedder_threads": args.threads,
        });
        std::fs::write(out, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", out.display()))?;
        println!("\nwrote {}", out.display());
    }
    Ok(())
}

/// Multi-intent queries: `parallel_multiple` questions (each asks for several functions)
/// against the pooled catalog with the default router, ranked on the whole question and on
/// the whole question interleaved with its sub-queries (`mesh_evals::multistep`).
fn split_check(
    embedder: &Embedder,
    pooled: &[Tool],
    questions: &[Question],
    vecs: &[Vec<f32>],
) -> Result<Vec<Value>> {
    let router = ToolRouter::build(embedder, pooled.to_vec(), RouterConfig::default())?;
    println!("\n### Multi-intent: parallel_multiple, pooled catalog, default router\n");
    println!("| k | questions | split into 2+ | recall whole question | recall split and merged |");
    println!("|---|---|---|---|---|");
    let mut rows = vec![];
    for k in [5, 10] {
        let (mut whole, mut split, mut n_split) = (Mean::default(), Mean::default(), 0);
        for (q, v) in questions.iter().zip(vecs) {
            if q.category != "parallel_multiple" {
                continue;
            }
            let names = |r: mesh_control::Routing| -> Vec<String> {
                r.names().into_iter().map(str::to_owned).collect()
            };
            let ranked = names(router.route_vector(v, &q.query, k, &[])?);
            let subs = split_intents(&q.query);
            let merged = if subs.len() < 2 {
                ranked.clone()
            } else {
                n_split += 1;
                let mut lists = vec![ranked.clone()];
                for s in &subs {
                    lists.push(names(router.route_with(embedder, s, k, &[])?));
                }
                merge_rankings(&lists, k)
            };
            let mut truth = q.truth.clone();
            truth.dedup();
            whole.add(multistep::recall(&ranked, &truth));
            split.add(multistep::recall(&merged, &truth));
        }
        println!(
            "| {k} | {} | {n_split} | {:.3} | {:.3} |",
            whole.count(),
            whole.get().unwrap_or(f64::NAN),
            split.get().unwrap_or(f64::NAN)
        );
        rows.push(json!({"k": k, "questions": whole.count(), "split": n_split,
            "recall_whole": whole.get(), "recall_split": split.get()}));
    }
    Ok(rows)
}

fn print_recall(results: &[Variant]) {
    println!("\n### Recall@1/3/5 (pooled: ~1,200 tools; per record: the record's own 2–37)\n");
    println!("| router | pooled live_multiple | pooled multiple | per-record live_multiple | per-record multiple | per-record parallel_multiple | pooled live_multiple, held out | pooled multiple, held out |");
    println!("|---|---|---|---|---|---|---|---|");
    let cell = |r: Option<&Recall>| {
        r.map_or("–".to_owned(), |r| {
            let re = if r.reranked > 0.0 {
                format!(" ({:.0}% re-ranked)", r.reranked * 100.0)
            } else {
                String::new()
            };
            format!("{:.2} / {:.2} / {:.2}{re}", r.at1, r.at3, r.at5)
        })
    };
    for v in results {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            v.name,
            cell(v.pooled.get("live_multiple")),
            cell(v.pooled.get("multiple")),
            cell(v.per_record.get("live_multiple")),
            cell(v.per_record.get("multiple")),
            cell(v.per_record.get("parallel_multiple")),
            cell(v.pooled.get("live_multiple_held_out")),
            cell(v.pooled.get("multiple_held_out")),
        );
    }
}

fn print_misses(
    embedder: &Embedder,
    pooled: &[Tool],
    questions: &[Question],
    query_vecs: &[Vec<f32>],
    limit: usize,
) -> Result<()> {
    let router = ToolRouter::build(embedder, pooled.to_vec(), RouterConfig::default())?;
    println!("\n### Pooled live_multiple misses at k = 5 (first {limit})\n");
    let mut shown = 0;
    for (q, v) in questions.iter().zip(query_vecs) {
        if q.category != "live_multiple" || shown >= limit {
            continue;
        }
        let r = router.route_vector(v, &q.query, 5, &[])?;
        if q.truth.iter().all(|t| r.names().contains(&t.as_str())) {
            continue;
        }
        shown += 1;
        let query: String = q.query.chars().take(160).collect();
        println!("- {query:?}\n  want {:?}, got {:?}", q.truth, r.names());
    }
    Ok(())
}

/// Pooled recall for hybrid weights, with the re-rank always on and gated.
fn sweep(
    embedder: &Embedder,
    pooled: &[Tool],
    questions: &[Question],
    query_vecs: &[Vec<f32>],
) -> Result<Vec<Value>> {
    println!("\n### Hybrid weight sweep (pooled recall@1/3/5)\n");
    println!("| hybrid_weight | gate | live_multiple | multiple |");
    println!("|---|---|---|---|");
    let mut out = Vec::new();
    let default = RouterConfig::default();
    let gated = format!(
        "top1 < {} or margin < {}",
        default.min_score, default.min_margin
    );
    for w in [0.1f32, 0.2, 0.3, 0.4, 0.5] {
        for (gate, min_score) in [("always", 1.0f32), (gated.as_str(), default.min_score)] {
            let config = RouterConfig {
                hybrid_weight: w,
                min_score,
                ..RouterConfig::default()
            };
            let router = ToolRouter::build(embedder, pooled.to_vec(), config)?;
            let mut by_cat: HashMap<&str, Recall> = HashMap::new();
            for (q, v) in questions.iter().zip(query_vecs) {
                if !matches!(q.category, "multiple" | "live_multiple") {
                    continue;
                }
                let r = router.route_vector(v, &q.query, 5, &[])?;
                by_cat
                    .entry(q.category)
                    .or_default()
                    .add(&r.names(), &q.truth, r.reranked);
            }
            let live = by_cat.remove("live_multiple").unwrap_or_default().mean();
            let multiple = by_cat.remove("multiple").unwrap_or_default().mean();
            println!(
                "| {w:.1} | {gate} | {:.2} / {:.2} / {:.2} | {:.2} / {:.2} / {:.2} |",
                live.at1, live.at3, live.at5, multiple.at1, multiple.at3, multiple.at5
            );
            out.push(json!({"hybrid_weight": w, "min_score": min_score, "live_multiple": live, "multiple": multiple}));
        }
    }
    Ok(out)
}

/// A tokenizer for counting prompt tokens.
struct Counter<'a> {
    name: String,
    count: Box<dyn Fn(&str) -> usize + 'a>,
}

/// The embedder's WordPiece tokenizer, and with `--count-model` a tier's own tokenizer
/// (the GGUF is loaded vocabulary-only).
fn counters<'a>(args: &Args, embedder: &'a Embedder) -> Result<Vec<Counter<'a>>> {
    let mut out = vec![Counter {
        name: "all-MiniLM-L6-v2 WordPiece".into(),
        count: Box::new(|s| embedder.count_tokens(s)),
    }];
    if let Some(path) = &args.count_model {
        use llama_cpp_2::model::params::LlamaModelParams;
        use llama_cpp_2::model::LlamaModel;
        let model = LlamaModel::load_from_file(
            mesh_tiers::backend(),
            path,
            &LlamaModelParams::default().with_vocab_only(true),
        )
        .with_context(|| format!("loading the vocabulary of {}", path.display()))?;
        out.push(Counter {
            name: path
                .file_name()
                .map_or("model".into(), |f| f.to_string_lossy().into_owned()),
            count: Box::new(move |s| model.vocab().tokenize(s.as_bytes(), false, false).len()),
        });
    }
    Ok(out)
}

/// Schema tokens in the prompt: all tools versus the routed top 5.
fn tokens(
    args: &Args,
    embedder: &Embedder,
    pooled: &[Tool],
    questions: &[Question],
    query_vecs: &[Vec<f32>],
) -> Result<Vec<Value>> {
    let router = ToolRouter::build(embedder, pooled.to_vec(), RouterConfig::default())?;
    let mut out = Vec::new();
    println!("\n### Tool-schema prompt tokens per request (compact OpenAI `tools[]` JSON, sum over the offered tools)\n");
    println!("| tokenizer | catalog | all tools | top-5 routed | saved |");
    println!("|---|---|---|---|---|");
    for counter in counters(args, embedder)? {
        let schema_tokens: HashMap<&str, usize> = pooled
            .iter()
            .map(|t| {
                (
                    t.name.as_str(),
                    (counter.count)(&serde_json::to_string(&t.to_openai()).unwrap_or_default()),
                )
            })
            .collect();
        let all_pooled: usize = schema_tokens.values().sum();
        let (mut pooled_top, mut n_pooled) = (0usize, 0usize);
        let (mut rec_all, mut rec_top, mut n_rec) = (0usize, 0usize, 0usize);
        for (q, v) in questions.iter().zip(query_vecs) {
            if !matches!(q.category, "multiple" | "live_multiple") {
                continue;
            }
            let routing = router.route_vector(v, &q.query, 5, &[])?;
            pooled_top += routing
                .names()
                .iter()
                .map(|n| schema_tokens[n])
                .sum::<usize>();
            n_pooled += 1;
            // Per record: the record's own functions, all of them versus the routed 5.
            let own: Vec<usize> = q
                .tools
                .iter()
                .map(|t| {
                    (counter.count)(&serde_json::to_string(&t.to_openai()).unwrap_or_default())
                })
                .collect();
            let record = ToolRouter::build(embedder, q.tools.clone(), RouterConfig::default())?;
            let routed = record.route_vector(v, &q.query, 5, &[])?;
            rec_all += own.iter().sum::<usize>();
            rec_top += routed.tools.iter().map(|r| own[r.id]).sum::<usize>();
            n_rec += 1;
        }
        let mean = |s: usize, n: usize| s as f64 / n.max(1) as f64;
        let pooled_mean = mean(pooled_top, n_pooled);
        let (rec_all_mean, rec_top_mean) = (mean(rec_all, n_rec), mean(rec_top, n_rec));
        println!(
            "| {} | pooled ({} tools) | {all_pooled} | {pooled_mean:.0} | {:.1}% |",
            counter.name,
            pooled.len(),
            100.0 * (1.0 - pooled_mean / all_pooled as f64)
        );
        println!(
            "| {} | own record (multiple + live_multiple, 2–37 tools) | {rec_all_mean:.0} | {rec_top_mean:.0} | {:.1}% |",
            counter.name,
            100.0 * (1.0 - rec_top_mean / rec_all_mean)
        );
        out.push(json!({
            "tokenizer": counter.name,
            "pooled_all": all_pooled,
            "pooled_top5_mean": pooled_mean,
            "record_all_mean": rec_all_mean,
            "record_top5_mean": rec_top_mean,
            "questions": n_pooled,
        }));
    }
    Ok(out)
}

/// The 1-minute load average (Linux), to tell a quiet machine from a busy one.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

#[derive(Debug, Serialize)]
struct Latency {
    tools: usize,
    index: &'static str,
    /// Route call only, query already embedded (µs).
    route_p50_us: f64,
    route_p99_us: f64,
    /// Embedding the query plus routing (µs).
    with_embed_p50_us: f64,
    with_embed_p99_us: f64,
    /// Recall@5 of the index's dense top-5 against the exact scan's.
    dense_recall_at5: f64,
    reranked: f64,
    memory_bytes: usize,
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    let i = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

/// Catalogs of `n` tools: the pooled tools, then perturbed copies of them (same texts
/// under new names, vectors `normalize(v + 0.5·g/√dim)`, cosine ≈ 0.9 to the original).
fn synthetic(
    pooled: &[Tool],
    vectors: &[std::sync::Arc<[f32]>],
    n: usize,
) -> (Vec<Tool>, Vec<Vec<f32>>) {
    let mut state = 0x5eed_u64;
    let mut normal = move || {
        // Box-Muller over splitmix64.
        let mut next = || {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
        };
        let (u, v) = (next().max(1e-12), next());
        ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
    };
    let mut tools = Vec::with_capacity(n);
    let mut vecs = Vec::with_capacity(n);
    for i in 0..n {
        let base = i % pooled.len();
        let copy = i / pooled.len();
        let mut tool = pooled[base].clone();
        let mut v = vectors[base].to_vec();
        if copy > 0 {
            tool.name = format!("{}__copy{copy}", tool.name);
            let sigma = 0.5 / (v.len() as f32).sqrt();
            v.iter_mut().for_each(|x| *x += sigma * normal());
            normalize(&mut v);
        }
        tools.push(tool);
        vecs.push(v);
    }
    (tools, vecs)
}

fn latency(
    args: &Args,
    embedder: &Embedder,
    pooled: &[Tool],
    questions: &[Question],
    query_vecs: &[Vec<f32>],
) -> Result<Vec<Latency>> {
    let texts: Vec<String> = pooled
        .iter()
        .map(|t| tool_text(t, ToolText::default()))
        .collect();
    let vectors = embedder.embed_cached(&texts)?;
    let live: Vec<(usize, &Question)> = questions
        .iter()
        .enumerate()
        .filter(|(_, q)| q.category == "live_multiple")
        .collect();
    let mut out = Vec::new();
    let mut lengths: Vec<f64> = live
        .iter()
        .map(|(_, q)| embedder.count_tokens(&q.query) as f64)
        .collect();
    println!("\n### Route latency (live_multiple queries, k = 5, default config; 2-core x86 VM)\n");
    println!(
        "Query length (WordPiece tokens): p50 {:.0}, p99 {:.0}, max {:.0} (embedded up to 256).\n",
        percentile(&mut lengths, 0.5),
        percentile(&mut lengths, 0.99),
        percentile(&mut lengths, 1.0)
    );
    println!("| tools | index | route p50 / p99 | embed + route p50 / p99 | dense recall@5 vs exact | re-ranked | index memory |");
    println!("|---|---|---|---|---|---|---|");
    for &n in &args.sizes {
        let (tools, vecs) = synthetic(pooled, &vectors, n);
        let exact_cfg = RouterConfig {
            quantize_above: usize::MAX,
            ..RouterConfig::default()
        };
        let quant_cfg = RouterConfig {
            quantize_above: 0,
            ..RouterConfig::default()
        };
        let exact = ToolRouter::from_embeddings(tools.clone(), &vecs, exact_cfg)?;
        let quant = ToolRouter::from_embeddings(tools, &vecs, quant_cfg)?;
        for (label, router) in [("exact", &exact), ("int8 + re-rank", &quant)] {
            // Warm up caches and the branch predictor.
            for &(i, q) in live.iter().take(50) {
                router.route_vector(&query_vecs[i], &q.query, 5, &[])?;
            }
            let mut route_us = Vec::with_capacity(live.len());
            let mut reranked = 0usize;
            let mut rec = 0.0;
            for &(i, q) in &live {
                let t = Instant::now();
                let r = router.route_vector(&query_vecs[i], &q.query, 5, &[])?;
                route_us.push(t.elapsed().as_secs_f64() * 1e6);
                reranked += usize::from(r.reranked);
                let e = exact.index().search(&query_vecs[i], 5);
                let a = router.index().search(&query_vecs[i], 5);
                rec += recall(&e, &a);
            }
            let mut with_embed_us = Vec::new();
            for &(_, q) in live.iter().take(args.latency_queries) {
                let t = Instant::now();
                router.route(embedder, &q.query, 5)?;
                with_embed_us.push(t.elapsed().as_secs_f64() * 1e6);
            }
            let row = Latency {
                tools: n,
                index: label,
                route_p50_us: percentile(&mut route_us, 0.5),
                route_p99_us: percentile(&mut route_us, 0.99),
                with_embed_p50_us: percentile(&mut with_embed_us, 0.5),
                with_embed_p99_us: percentile(&mut with_embed_us, 0.99),
                dense_recall_at5: rec / live.len() as f64,
                reranked: reranked as f64 / live.len() as f64,
                memory_bytes: router.index().memory_bytes(),
            };
            println!(
                "| {} | {} | {:.2} / {:.2} ms | {:.1} / {:.1} ms | {:.3} | {:.0}% | {:.1} MiB |",
                row.tools,
                row.index,
                row.route_p50_us / 1e3,
                row.route_p99_us / 1e3,
                row.with_embed_p50_us / 1e3,
                row.with_embed_p99_us / 1e3,
                row.dense_recall_at5,
                row.reranked * 100.0,
                row.memory_bytes as f64 / (1 << 20) as f64
            );
            out.push(row);
        }
    }
    Ok(out)
}
