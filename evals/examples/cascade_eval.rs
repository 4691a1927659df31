//! Evaluates the tier cascade, speculative decoding and the reasoning governor on the
//! bundled held-out tasks (`docs/cascade.md`).
//!
//! ```text
//! cargo run --release -p mesh-evals --example cascade_eval -- \
//!     --eval models/fixtures/eval-heldout.jsonl --out target/cascade-eval.json --md docs/cascade-results.md
//! ```
//!
//! Method (all greedy, one request at a time so latencies compare; free decoding, or with
//! `--grammar` the lazy tool-call grammar the gateway applies by default when tools are
//! offered — speculative decoding has no grammar support and always decodes freely):
//!
//! 1. every task runs on every tier through the crate's [`Engine`]; each run keeps the
//!    text, the per-token logit margins, the token counts and the wall time;
//! 2. **T3-only** is the t3 run. **Cascade** replays the policy of
//!    [`mesh_tiers::cascade::assess`] over those runs for each threshold pair of the sweep
//!    (greedy runs are deterministic, so a tier's answer to a task is the same whether the
//!    cascade or the sweep asks for it); a task's compute and time are the sums over the
//!    tiers it visited;
//! 3. **speculative decoding**: the tasks that reach t3 under the chosen thresholds run
//!    again through [`Speculative`] (t1 drafts, t3 verifies) and through plain t3 greedy
//!    decoding, one sequence at a time; outputs must be identical and the time ratio is
//!    the speed-up. **Cascade + spec** uses the speculative time for the t3 steps;
//! 4. **governor**: t3 on every task again with each `--budgets` value as the reasoning
//!    budget; thinking tokens and accuracy against the unbudgeted run.
//!
//! Compute per task is (prompt + generated tokens) x parameters, summed over the tiers a
//! task visited (the draft's tokens x parameters included for speculative decoding).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use mesh_tiers::cascade::{assess, CascadePolicy, Output};
use mesh_tiers::chat::tool_call_grammar;
use mesh_tiers::chat::CALL;
use mesh_tiers::eval::{self, Task};
use mesh_tiers::speculative::{greedy_timed, SpecConfig, Speculative};
use mesh_tiers::{backend, Engine, EngineConfig, FinishReason, GenerateRequest, TokenEvent};
use serde_json::{json, Value};

struct Args {
    tiers: Vec<String>,
    eval: PathBuf,
    out: Option<PathBuf>,
    md: Option<PathBuf>,
    margins: Vec<f32>,
    budgets: Vec<usize>,
    max_tokens: usize,
    threads: i32,
    limit: usize,
    k: usize,
    spec_only: bool,
    grammar: bool,
    n_ctx: u32,
    outputs: Option<PathBuf>,
    router_scores: Option<PathBuf>,
}

fn parse_args() -> Args {
    let mut a = Args {
        tiers: vec!["t1".into(), "t2".into(), "t3".into()],
        eval: "models/fixtures/eval-heldout.jsonl".into(),
        out: None,
        md: None,
        margins: vec![0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
        budgets: vec![16, 8, 4],
        max_tokens: 128,
        threads: 2,
        limit: usize::MAX,
        k: 4,
        spec_only: false,
        grammar: false,
        n_ctx: 4096,
        outputs: None,
        router_scores: None,
    };
    const USAGE: &str = "usage: cascade_eval [--tiers t1,t2,t3 | NAME=PATH.gguf,...] [--eval FILE] \
        [--out JSON] [--md FILE] [--margins 0,1,2,..] [--budgets 16,8,4|none] [--max-tokens N] \
        [--threads N] [--limit N] [--k N] [--spec-only] [--grammar] [--n-ctx N] [--outputs FILE.jsonl] \
        [--router-scores FILE.json]";
    let usage = |why: &str| -> ! {
        eprintln!("cascade_eval: {why}\n{USAGE}");
        std::process::exit(2)
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        if k == "--help" || k == "-h" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        let mut v = || {
            it.next()
                .unwrap_or_else(|| usage(&format!("{k} needs a value")))
        };
        match k.as_str() {
            "--tiers" => a.tiers = v().split(',').map(str::to_owned).collect(),
            "--eval" => a.eval = v().into(),
            "--out" => a.out = Some(v().into()),
            "--md" => a.md = Some(v().into()),
            "--margins" => a.margins = v().split(',').map(|x| x.parse().expect("margin")).collect(),
            "--budgets" => {
                let b = v();
                a.budgets = if b == "none" {
                    vec![]
                } else {
                    b.split(',').map(|x| x.parse().expect("budget")).collect()
                }
            }
            "--max-tokens" => a.max_tokens = v().parse().expect("max tokens"),
            "--threads" => a.threads = v().parse().expect("threads"),
            "--limit" => a.limit = v().parse().expect("limit"),
            "--k" => a.k = v().parse().expect("k"),
            "--spec-only" => a.spec_only = true,
            "--grammar" => a.grammar = true,
            "--n-ctx" => a.n_ctx = v().parse().expect("n_ctx"),
            "--outputs" => a.outputs = Some(v().into()),
            "--router-scores" => a.router_scores = Some(v().into()),
            _ => usage(&format!("unknown option {k}")),
        }
    }
    a
}

/// A tier's GGUF: `NAME=PATH` names it explicitly (e.g. a quantized variant from
/// `mesh quantize`), a bare name is the bundled `models/NAME-q8_0.gguf`.
fn model_path(tier: &str) -> PathBuf {
    match tier.split_once('=') {
        Some((_, path)) => PathBuf::from(path),
        None => PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../models"))
            .join(format!("{tier}-q8_0.gguf")),
    }
}

/// One tier's greedy run of one task.
#[derive(Clone)]
struct Run {
    text: String,
    margins: Vec<f32>,
    prompt: usize,
    generated: usize,
    thinking: usize,
    truncated: bool,
    seconds: f64,
    exact: bool,
}

async fn run(engine: &Engine, task: &Task, a: &Args, budget: Option<usize>) -> Run {
    let max_tokens = a.max_tokens;
    let prompt = engine.tokenize(&task.prompt);
    // The gateway's default for requests that offer tools: a lazy grammar from `<tool_call>` on.
    let (grammar, grammar_trigger) = if a.grammar {
        let tools = eval::offered_tools(&task.prompt);
        let g = tool_call_grammar(&tools).expect("grammar for the offered tools");
        (Some(g), Some(CALL.to_owned()))
    } else {
        (None, None)
    };
    let n_prompt = prompt.len();
    let t0 = Instant::now();
    let mut rx = engine
        .submit(GenerateRequest {
            prompt,
            max_tokens,
            reasoning_budget: budget,
            grammar,
            grammar_trigger,
            ..Default::default()
        })
        .expect("submit");
    let (mut text, mut margins) = (String::new(), Vec::new());
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(300), rx.recv())
            .await
            .expect("engine stalled")
            .expect("event stream ended");
        match ev {
            TokenEvent::Started { .. } => {}
            TokenEvent::Token {
                text: t, margin, ..
            } => {
                text.push_str(&t);
                margins.push(margin);
            }
            TokenEvent::Done {
                finish,
                usage,
                tail,
            } => {
                text.push_str(&tail);
                let exact = eval::exact(task, &text);
                return Run {
                    text,
                    margins,
                    prompt: n_prompt,
                    generated: usage.completion_tokens,
                    thinking: usage.reasoning_tokens,
                    truncated: finish != FinishReason::Stop,
                    seconds: t0.elapsed().as_secs_f64(),
                    exact,
                };
            }
            TokenEvent::Error(e) => panic!("generation failed: {e}"),
        }
    }
}

/// Speculative decoding against plain greedy decoding of the largest tier.
struct SpecReport {
    json: Value,
    /// Per task: speculative / plain time, prefill included (tasks that ran).
    ratio: Vec<Option<f64>>,
}

fn speculate(a: &Args, tasks: &[Task], select: &[bool], draft_params: f64) -> SpecReport {
    let last = a.tiers.len() - 1;
    let load = |tier: &str| {
        LlamaModel::load_from_file(backend(), model_path(tier), &LlamaModelParams::default())
            .unwrap_or_else(|e| panic!("{tier}: {e}"))
    };
    let (target, draft) = (load(&a.tiers[last]), load(&a.tiers[0]));
    let cfg = SpecConfig {
        threads: a.threads,
        n_seq_max: 1,
        k_init: a.k,
        ..Default::default()
    };
    let mut spec = Speculative::new(&target, &draft, cfg).expect("speculative contexts");
    let mut ratio = vec![None; tasks.len()];
    let (mut plain_decode, mut spec_decode, mut plain_total, mut spec_total) = (0.0, 0.0, 0.0, 0.0);
    let (mut tokens, mut same, mut n, mut drafted, mut accepted, mut draft_compute) =
        (0usize, 0usize, 0usize, 0usize, 0usize, 0.0);
    let mut differ = Vec::new();
    for (i, t) in tasks.iter().enumerate().filter(|(i, _)| select[*i]) {
        let p: Vec<i32> = target
            .vocab()
            .tokenize(t.prompt.as_bytes(), true, true)
            .iter()
            .map(|x| x.0)
            .collect();
        let plain = greedy_timed(&target, &p, a.max_tokens, a.threads).expect("greedy");
        let out = spec
            .generate(std::slice::from_ref(&p), a.max_tokens)
            .expect("speculative")
            .remove(0);
        plain_decode += plain.decode_s;
        spec_decode += out.decode_s;
        plain_total += plain.prefill_s + plain.decode_s;
        spec_total += out.prefill_s + out.decode_s;
        // Tokens after the first (which comes from the prefill in both).
        tokens += plain.tokens.len().saturating_sub(1);
        if plain.tokens == out.tokens {
            same += 1;
        } else {
            let at = plain
                .tokens
                .iter()
                .zip(&out.tokens)
                .take_while(|(x, y)| x == y)
                .count();
            differ.push(json!({"task": i, "first_difference_at": at}));
        }
        n += 1;
        drafted += out.drafted;
        accepted += out.accepted;
        draft_compute += (p.len() + out.drafted) as f64 * draft_params;
        ratio[i] = Some((out.prefill_s + out.decode_s) / (plain.prefill_s + plain.decode_s));
    }
    eprintln!(
        "speculative: {n} tasks, identical {same}, decode {:.1} vs {:.1} tok/s ({:.2}x), with prefill {:.2}x, acceptance {:.2}",
        tokens as f64 / spec_decode,
        tokens as f64 / plain_decode,
        plain_decode / spec_decode,
        plain_total / spec_total,
        accepted as f64 / drafted.max(1) as f64
    );
    SpecReport {
        json: json!({"tasks": n, "identical": same, "differ": differ,
                     "plain_decode_tok_s": tokens as f64 / plain_decode, "spec_decode_tok_s": tokens as f64 / spec_decode,
                     "speedup": plain_decode / spec_decode, "speedup_with_prefill": plain_total / spec_total,
                     "drafted": drafted, "accepted": accepted, "draft_compute": draft_compute, "k_init": a.k}),
        ratio,
    }
}

fn percentile(mut v: Vec<f64>, q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// Accuracy by kind plus totals of one mode.
#[derive(Default)]
struct Tally {
    by_kind: BTreeMap<String, (usize, usize)>,
    compute: Vec<f64>,
    seconds: Vec<f64>,
    thinking: usize,
    tier_mix: BTreeMap<String, usize>,
}

impl Tally {
    fn add(&mut self, task: &Task, exact: bool, compute: f64, seconds: f64) {
        for k in [task.kind.clone(), "all".into()] {
            let e = self.by_kind.entry(k).or_default();
            e.0 += usize::from(exact);
            e.1 += 1;
        }
        self.compute.push(compute);
        self.seconds.push(seconds);
    }

    fn accuracy(&self, kind: &str) -> f64 {
        self.by_kind
            .get(kind)
            .map_or(f64::NAN, |(a, n)| *a as f64 / *n as f64)
    }

    fn to_json(&self) -> Value {
        let n = self.compute.len().max(1) as f64;
        json!({
            "accuracy": self.by_kind.iter().map(|(k, (a, n))| (k.clone(), json!({"exact": a, "n": n, "rate": *a as f64 / *n as f64}))).collect::<serde_json::Map<_, _>>(),
            "compute_per_task": self.compute.iter().sum::<f64>() / n,
            "seconds_per_task": self.seconds.iter().sum::<f64>() / n,
            "latency_p50_s": percentile(self.seconds.clone(), 0.5),
            "latency_p95_s": percentile(self.seconds.clone(), 0.95),
            "thinking_tokens": self.thinking,
            "tier_mix": self.tier_mix,
        })
    }
}

/// Replays the cascade policy over the per-tier runs; with `router` (each task's router
/// top-1 score) a task below `min_router_score` starts at the second tier.
fn cascade(
    policy: &CascadePolicy,
    tasks: &[Task],
    runs: &[Vec<Run>],
    params: &[f64],
    t3_seconds: Option<&[Option<f64>]>,
    router: Option<&[f32]>,
) -> (Tally, Vec<bool>) {
    let mut t = Tally::default();
    let mut reached_last = vec![false; tasks.len()];
    for (i, task) in tasks.iter().enumerate() {
        let offered: Vec<String> = eval::offered_tools(&task.prompt)
            .into_iter()
            .map(|s| s.name)
            .collect();
        let offered: Vec<&str> = offered.iter().map(String::as_str).collect();
        let (mut compute, mut seconds) = (0.0, 0.0);
        let (start, _) = mesh_tiers::cascade::first_tier(policy, router.map(|r| r[i]));
        for (j, tier_runs) in runs.iter().enumerate().skip(start) {
            let r = &tier_runs[i];
            compute += (r.prompt + r.generated) as f64 * params[j];
            let last = j + 1 == runs.len();
            seconds += match (last, t3_seconds) {
                (true, Some(s)) => s[i].expect("speculative time for a task reaching t3"),
                _ => r.seconds,
            };
            let parsed = mesh_tiers::chat::parse_output(&r.text);
            let a = assess(
                policy,
                j,
                Output {
                    parsed: &parsed,
                    margins: &r.margins,
                    texts: &[],
                    truncated: r.truncated,
                },
                &offered,
            );
            if a.verdict.kept() {
                reached_last[i] = last;
                *t.tier_mix.entry(policy.tiers[j].clone()).or_default() += 1;
                t.thinking += r.thinking;
                t.add(task, r.exact, compute, seconds);
                break;
            }
        }
    }
    (t, reached_last)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let a = parse_args();
    assert!(a.tiers.len() >= 2, "a cascade needs at least two tiers");
    let mut tasks = eval::load_tasks(&a.eval).unwrap_or_else(|e| panic!("{e}"));
    tasks.truncate(a.limit);
    let kinds: Vec<String> = {
        let mut k: Vec<String> = tasks.iter().map(|t| t.kind.clone()).collect();
        k.sort();
        k.dedup();
        k
    };

    if a.spec_only {
        // Speculative decoding alone, on every task (no cascade selection).
        let sp = speculate(&a, &tasks, &vec![true; tasks.len()], 0.0);
        println!("{}", serde_json::to_string_pretty(&sp.json).expect("json"));
        return;
    }

    // 1. Every task on every tier.
    let mut runs: Vec<Vec<Run>> = Vec::new();
    let mut params = Vec::new();
    let mut engines = Vec::new();
    for tier in &a.tiers {
        let e = Engine::start(EngineConfig {
            name: tier.clone(),
            model: model_path(tier),
            n_ctx: a.n_ctx,
            n_seq_max: 1,
            threads: a.threads,
            ..EngineConfig::default()
        })
        .unwrap_or_else(|e| panic!("{tier}: {e}"));
        params.push(e.info().n_params as f64);
        let t0 = Instant::now();
        let mut rs = Vec::with_capacity(tasks.len());
        for t in &tasks {
            rs.push(run(&e, t, &a, None).await);
        }
        eprintln!(
            "{tier}: {} tasks in {:.1} s, exact {}",
            tasks.len(),
            t0.elapsed().as_secs_f64(),
            rs.iter().filter(|r| r.exact).count()
        );
        if let Some(path) = &a.outputs {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            for (i, (t, r)) in tasks.iter().zip(&rs).enumerate() {
                let line = json!({"tier": tier, "i": i, "split": t.split, "kind": t.kind, "sub": t.sub,
                                  "exact": r.exact, "output": r.text, "expected": t.completion});
                writeln!(f, "{line}").expect("write outputs");
            }
        }
        runs.push(rs);
        engines.push(e);
    }
    let last = runs.len() - 1;

    // 2. Largest tier alone, and the cascade over a threshold sweep.
    let mut only = Tally::default();
    for (i, t) in tasks.iter().enumerate() {
        let r = &runs[last][i];
        only.add(
            t,
            r.exact,
            (r.prompt + r.generated) as f64 * params[last],
            r.seconds,
        );
        only.thinking += r.thinking;
    }
    *only.tier_mix.entry(a.tiers[last].clone()).or_default() = tasks.len();
    let base_acc = only.accuracy("all");
    let base_compute = only.compute.iter().sum::<f64>();
    let mut sweep = Vec::new();
    let mut best: Option<(Vec<f32>, f64)> = None;
    for &m1 in &a.margins {
        for &m2 in &a.margins {
            if runs.len() < 3 && m2 != m1 {
                continue;
            }
            let policy = CascadePolicy {
                tiers: a.tiers.clone(),
                min_margin: vec![m1, m2],
                ..Default::default()
            };
            let (t, _) = cascade(&policy, &tasks, &runs, &params, None, None);
            let acc = t.accuracy("all");
            let compute = t.compute.iter().sum::<f64>();
            // Within one task of 1 point below the largest tier alone.
            let ok = acc >= base_acc - 0.01 - 1e-9;
            if ok && best.as_ref().is_none_or(|(_, c)| compute < *c) {
                best = Some((vec![m1, m2], compute));
            }
            sweep.push(json!({"min_margin": [m1, m2], "accuracy": acc, "compute_ratio": base_compute / compute,
                              "tier_mix": t.tier_mix}));
        }
    }
    let chosen = best
        .map(|(m, _)| m)
        .unwrap_or_else(|| vec![f32::INFINITY, f32::INFINITY]);
    let policy = CascadePolicy {
        tiers: a.tiers.clone(),
        min_margin: chosen.clone(),
        ..Default::default()
    };
    let (casc, reaches) = cascade(&policy, &tasks, &runs, &params, None, None);
    eprintln!(
        "cascade at min_margin {chosen:?}: accuracy {:.3} vs {:.3}, compute ratio {:.2}",
        casc.accuracy("all"),
        base_acc,
        base_compute / casc.compute.iter().sum::<f64>()
    );

    // 2b. The router's confidence as a further signal: tasks whose top-1 router score is
    // below `min_router_score` skip the first tier (at the chosen margins). Thresholds at
    // the scores' deciles, so each row moves another tenth of the tasks.
    let mut router_sweep = Vec::new();
    if let Some(path) = &a.router_scores {
        let file: Value = serde_json::from_slice(
            &std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        )
        .expect("router scores JSON");
        let scores: Vec<f32> = file["top1"]
            .as_array()
            .expect("`top1` array (router_scores --out)")
            .iter()
            .map(|x| x.as_f64().expect("score") as f32)
            .collect();
        assert!(scores.len() >= tasks.len(), "a router score per task");
        let mut sorted = scores[..tasks.len()].to_vec();
        sorted.sort_by(f32::total_cmp);
        let mut thresholds = vec![0.0];
        thresholds.extend((1..=5).map(|d| sorted[sorted.len() * d / 10]));
        for thr in thresholds {
            let p = CascadePolicy {
                min_router_score: thr,
                ..policy.clone()
            };
            let (t, _) = cascade(&p, &tasks, &runs, &params, None, Some(&scores));
            let compute = t.compute.iter().sum::<f64>();
            let skipped = scores[..tasks.len()].iter().filter(|&&s| s < thr).count();
            let on_skipped = |tier: usize| {
                (0..tasks.len())
                    .filter(|&i| scores[i] < thr)
                    .filter(|&i| runs[tier][i].exact)
                    .count()
            };
            eprintln!(
                "min_router_score {thr:.3}: {skipped} tasks start at {}, accuracy {:.3}, compute ratio {:.2}",
                a.tiers[1],
                t.accuracy("all"),
                base_compute / compute
            );
            router_sweep.push(json!({"min_router_score": thr, "skipped": skipped,
                "accuracy": t.accuracy("all"), "compute_ratio": base_compute / compute,
                "tier_mix": t.tier_mix,
                "skipped_exact_per_tier": (0..runs.len()).map(on_skipped).collect::<Vec<_>>()}));
        }
    }

    // 3. Speculative decoding for the tasks that reach the last tier.
    drop(engines);
    let sp = speculate(&a, &tasks, &reaches, params[0]);
    let spec_seconds: Vec<Option<f64>> = (0..tasks.len())
        .map(|i| sp.ratio[i].map(|r| runs[last][i].seconds * r))
        .collect();
    let (casc_spec, _) = cascade(&policy, &tasks, &runs, &params, Some(&spec_seconds), None);
    let draft_compute = sp.json["draft_compute"].as_f64().unwrap_or(0.0);

    // 4. Reasoning governor on the largest tier.
    let e = Engine::start(EngineConfig {
        name: a.tiers[last].clone(),
        model: model_path(&a.tiers[last]),
        n_ctx: a.n_ctx,
        n_seq_max: 1,
        threads: a.threads,
        ..EngineConfig::default()
    })
    .expect("engine");
    let mut governor = Vec::new();
    for &b in &a.budgets {
        let mut t = Tally::default();
        for task in &tasks {
            let r = run(&e, task, &a, Some(b)).await;
            t.thinking += r.thinking;
            t.add(
                task,
                r.exact,
                (r.prompt + r.generated) as f64 * params[last],
                r.seconds,
            );
        }
        eprintln!(
            "budget {b}: thinking {} (vs {}), accuracy {:.3}",
            t.thinking,
            only.thinking,
            t.accuracy("all")
        );
        governor.push(json!({"budget": b, "result": t.to_json()}));
    }

    let report = json!({
        "tasks": tasks.len(),
        "eval": a.eval,
        "tiers": a.tiers,
        "params": params,
        "max_tokens": a.max_tokens,
        "grammar": a.grammar,
        "threads": a.threads,
        "largest_only": only.to_json(),
        "cascade": {"min_margin": chosen, "result": casc.to_json()},
        "cascade_spec": casc_spec.to_json(),
        "speculative": sp.json,
        "governor": governor,
        "sweep": sweep,
        "router_sweep": router_sweep,
    });
    if let Some(out) = &a.out {
        std::fs::write(out, serde_json::to_string_pretty(&report).expect("json"))
            .expect("write --out");
        eprintln!("wrote {}", out.display());
    }
    let md = markdown(
        &report,
        &kinds,
        &only,
        &casc,
        &casc_spec,
        base_compute,
        draft_compute,
    );
    println!("{md}");
    if let Some(p) = &a.md {
        std::fs::write(p, &md).expect("write --md");
    }
}

fn markdown(
    r: &Value,
    kinds: &[String],
    only: &Tally,
    casc: &Tally,
    casc_spec: &Tally,
    base: f64,
    draft: f64,
) -> String {
    let mut s = String::new();
    let pct = |x: f64| format!("{:.1}%", 100.0 * x);
    s.push_str(&format!(
        "{} tasks; tiers {}; greedy, {}, at most {} new tokens, {} threads, one request at a time.\n\n",
        r["tasks"], r["tiers"], if r["grammar"] == true { "with the gateway's tool-call grammar" } else { "free decoding" },
        r["max_tokens"], r["threads"]
    ));
    s.push_str("| mode | ");
    for k in kinds {
        s.push_str(&format!("{k} | "));
    }
    s.push_str("all | compute / task (vs largest alone) | p50 s | p95 s | tier mix |\n|---|");
    for _ in 0..=kinds.len() {
        s.push_str("---:|");
    }
    s.push_str("---:|---:|---:|---|\n");
    let row = |name: &str, t: &Tally, extra: f64| {
        let c = t.compute.iter().sum::<f64>() + extra;
        let mut line = format!("| {name} | ");
        for k in kinds {
            line.push_str(&format!("{} | ", pct(t.accuracy(k))));
        }
        line.push_str(&format!(
            "{} | {:.3e} ({:.2}x less) | {:.3} | {:.3} | {} |\n",
            pct(t.accuracy("all")),
            c / t.compute.len().max(1) as f64,
            base / c,
            percentile(t.seconds.clone(), 0.5),
            percentile(t.seconds.clone(), 0.95),
            t.tier_mix
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
        line
    };
    s.push_str(&row("largest tier alone", only, 0.0));
    s.push_str(&row(
        &format!("cascade (min_margin {})", r["cascade"]["min_margin"]),
        casc,
        0.0,
    ));
    s.push_str(&row("cascade + speculative decoding", casc_spec, draft));
    let sp = &r["speculative"];
    s.push_str(&format!(
        "\nSpeculative decoding (t1 drafts for the largest tier) on the {} tasks that reach it: \
         identical output on {}; decode {:.1} tok/s vs {:.1} tok/s alone ({:.2}x; {:.2}x with the prefill); \
         {} of {} drafted tokens accepted.\n",
        sp["tasks"], sp["identical"], sp["spec_decode_tok_s"].as_f64().unwrap_or(0.0),
        sp["plain_decode_tok_s"].as_f64().unwrap_or(0.0), sp["speedup"].as_f64().unwrap_or(0.0),
        sp["speedup_with_prefill"].as_f64().unwrap_or(0.0), sp["accepted"], sp["drafted"]
    ));
    s.push_str("\nReasoning governor on the largest tier (all tasks):\n\n| budget | thinking tokens | hard accuracy | all accuracy |\n|---:|---:|---:|---:|\n");
    s.push_str(&format!(
        "| none | {} | {} | {} |\n",
        only.thinking,
        pct(only.accuracy("hard")),
        pct(only.accuracy("all"))
    ));
    for g in r["governor"].as_array().into_iter().flatten() {
        let res = &g["result"];
        let rate = |k: &str| res["accuracy"][k]["rate"].as_f64().map_or("–".into(), pct);
        s.push_str(&format!(
            "| {} | {} ({:.0}% fewer) | {} | {} |\n",
            g["budget"],
            res["thinking_tokens"],
            100.0
                * (1.0
                    - res["thinking_tokens"].as_f64().unwrap_or(0.0) / only.thinking.max(1) as f64),
            rate("hard"),
            rate("all")
        ));
    }
    s
}
