//! Measures the model card of the bundled tiers on the held-out evaluation set
//! (`models/CARD.md`).
//!
//! ```text
//! python3 models/recipe/evalset.py --n 100 --out models/fixtures/eval-heldout.jsonl
//! cargo run --release -p mesh-evals --example model_card -- \
//!     --tiers t1,t2,t3 --eval models/fixtures/eval-heldout.jsonl --out models/card.json
//! ```
//!
//! Every prompt is decoded greedily through the crate's own [`Engine`] (continuous
//! batching, up to `--parallel` requests in flight), at most `--max-tokens` tokens.
//! Scoring follows `score()` in `models/recipe/train.py`:
//!
//! - tool calls are the bodies between `<tool_call>` and `</tool_call>` (an unclosed one runs
//!   to the end), each parsed as JSON; a turn is exact when the parsed calls equal the
//!   expected ones, in order (JSON object equality, key order ignored);
//! - a turn whose expected answer has no call is exact when the output has no call either and
//!   its text after `</think>` equals the expected text (both trimmed).
//!
//! `--no-eval` skips the accuracy part and replaces only the speed figures of an existing
//! `--out` (which must have been measured on the same files).
//!
//! With `--grammar`, each request carries the lazy tool-call grammar the gateway applies by
//! default when a chat request offers tools (`mesh_tiers::chat::tool_call_grammar` over the
//! prompt's `<tools>` block, switched on by `<tool_call>`); without it the model decodes freely.
//!
//! Per tier and per (split, kind), and per hard sub-kind, it reports exact match, the share
//! of emitted calls that parse as JSON, parsed calls naming a tool the prompt does not
//! offer, tool-name accuracy (first call's name, over turns that expect a call), turns that
//! call at all, mean generated tokens (the end token included), mean thinking tokens (the
//! text between `<think>` and `</think>`, re-tokenized) and turns cut off by the token
//! budget.
//!
//! Once every tier is evaluated (and `--out` written), it times single-stream decode speed
//! per tier: `--max-tokens` tokens with end-of-generation banned on one prompt, median of
//! `--speed-runs` runs. Before each run it waits (up to `--wait-idle-s`) until other
//! processes use less than `--max-busy` of the CPUs, and a run during which they used more
//! is recorded but discarded and repeated.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use mesh_tiers::chat::tool_call_grammar;
use mesh_tiers::{Engine, EngineConfig, FinishReason, GenerateRequest, TokenEvent};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::task::JoinSet;

use mesh_tiers::chat::CALL;
use mesh_tiers::eval::{self, call_name, offered_tools, parse_calls, reasoning, Task};

struct Args {
    tiers: Vec<String>,
    eval: PathBuf,
    out: PathBuf,
    models: PathBuf,
    threads: i32,
    parallel: u32,
    max_tokens: usize,
    speed_runs: usize,
    max_busy: f64,
    wait_idle_s: u64,
    outputs: Option<PathBuf>,
    grammar: bool,
    no_eval: bool,
}

fn usage() -> ! {
    eprintln!(
        "usage: model_card [--tiers t1,t2,t3] [--eval models/fixtures/eval-heldout.jsonl] \
         [--out models/card.json] [--models models] [--threads 2] [--parallel 8] \
         [--max-tokens 128] [--speed-runs 3] [--max-busy 0.25] [--wait-idle-s 600] \
         [--outputs FILE.jsonl] [--grammar] [--no-eval]"
    );
    std::process::exit(2)
}

fn parse_args() -> Args {
    let mut a = Args {
        tiers: vec!["t1".into(), "t2".into(), "t3".into()],
        eval: "models/fixtures/eval-heldout.jsonl".into(),
        out: "models/card.json".into(),
        models: "models".into(),
        threads: 2,
        parallel: 8,
        max_tokens: 128,
        speed_runs: 3,
        max_busy: 0.25,
        wait_idle_s: 600,
        outputs: None,
        grammar: false,
        no_eval: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| usage());
        let num = |s: String| -> f64 { s.parse().unwrap_or_else(|_| usage()) };
        match flag.as_str() {
            "--tiers" => a.tiers = val().split(',').map(|s| s.trim().to_owned()).collect(),
            "--eval" => a.eval = val().into(),
            "--out" => a.out = val().into(),
            "--models" => a.models = val().into(),
            "--threads" => a.threads = num(val()) as i32,
            "--parallel" => a.parallel = num(val()) as u32,
            "--max-tokens" => a.max_tokens = num(val()) as usize,
            "--speed-runs" => a.speed_runs = num(val()) as usize,
            "--max-busy" => a.max_busy = num(val()),
            "--wait-idle-s" => a.wait_idle_s = num(val()) as u64,
            "--outputs" => a.outputs = Some(val().into()),
            "--grammar" => a.grammar = true,
            "--no-eval" => a.no_eval = true,
            _ => usage(),
        }
    }
    a
}

fn load_tasks(path: &std::path::Path) -> Vec<Task> {
    eval::load_tasks(path).unwrap_or_else(|e| panic!("{e}"))
}

/// What one greedy run gave and how it scores.
#[derive(Default, Clone)]
struct Scored {
    exact: bool,
    calls_emitted: usize,
    calls_valid: usize,
    calls_not_offered: usize,
    expects_call: bool,
    name_right: bool,
    called: bool,
    generated: usize,
    thinking: usize,
    truncated: bool,
}

fn score(
    task: &Task,
    text: &str,
    generated: usize,
    truncated: bool,
    think_tokens: usize,
) -> Scored {
    let want = parse_calls(&task.completion);
    let got = parse_calls(text);
    let exact = eval::exact(task, text);
    let offered: Vec<String> = offered_tools(&task.prompt)
        .into_iter()
        .map(|t| t.name)
        .collect();
    Scored {
        exact,
        calls_emitted: got.len(),
        calls_valid: got.iter().filter(|c| c.is_some()).count(),
        calls_not_offered: got
            .iter()
            .filter(|c| {
                c.is_some() && !call_name(c).is_some_and(|n| offered.iter().any(|o| o == n))
            })
            .count(),
        expects_call: !want.is_empty(),
        name_right: !want.is_empty()
            && got
                .first()
                .is_some_and(|g| call_name(g).is_some() && call_name(g) == call_name(&want[0])),
        called: !got.is_empty(),
        generated,
        thinking: think_tokens,
        truncated,
    }
}

/// Figures of one group of tasks.
#[derive(Default)]
struct Agg {
    n: usize,
    exact: usize,
    calls_emitted: usize,
    calls_valid: usize,
    calls_not_offered: usize,
    expects_call: usize,
    name_right: usize,
    called: usize,
    generated: usize,
    thinking: usize,
    truncated: usize,
}

impl Agg {
    fn add(&mut self, s: &Scored) {
        self.n += 1;
        self.exact += usize::from(s.exact);
        self.calls_emitted += s.calls_emitted;
        self.calls_valid += s.calls_valid;
        self.calls_not_offered += s.calls_not_offered;
        self.expects_call += usize::from(s.expects_call);
        self.name_right += usize::from(s.name_right);
        self.called += usize::from(s.called);
        self.generated += s.generated;
        self.thinking += s.thinking;
        self.truncated += s.truncated as usize;
    }

    fn ratio(a: usize, b: usize) -> Value {
        if b == 0 {
            Value::Null
        } else {
            json!(a as f64 / b as f64)
        }
    }

    fn to_json(&self) -> Value {
        json!({
            "n": self.n,
            "exact": self.exact,
            "exact_rate": Self::ratio(self.exact, self.n),
            "calls_emitted": self.calls_emitted,
            "calls_valid_json": self.calls_valid,
            "valid_json_rate": Self::ratio(self.calls_valid, self.calls_emitted),
            "calls_not_offered": self.calls_not_offered,
            "not_offered_rate": Self::ratio(self.calls_not_offered, self.calls_valid),
            "expects_call": self.expects_call,
            "tool_name_right": self.name_right,
            "tool_name_accuracy": Self::ratio(self.name_right, self.expects_call),
            "turns_with_call": self.called,
            "call_rate": Self::ratio(self.called, self.n),
            "mean_generated_tokens": Self::ratio(self.generated, self.n),
            "mean_thinking_tokens": Self::ratio(self.thinking, self.n),
            "truncated": self.truncated,
        })
    }
}

struct Outcome {
    tokens: usize,
    text: String,
    finish: Option<FinishReason>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
}

async fn collect(mut rx: UnboundedReceiver<TokenEvent>) -> Result<Outcome, String> {
    let mut o = Outcome {
        tokens: 0,
        text: String::new(),
        finish: None,
        first_token: None,
        last_token: None,
    };
    while let Some(ev) = tokio::time::timeout(Duration::from_secs(600), rx.recv())
        .await
        .map_err(|_| "engine stalled for 600 s".to_owned())?
    {
        match ev {
            TokenEvent::Started { .. } => {}
            TokenEvent::Token { text, .. } => {
                let now = Instant::now();
                o.first_token.get_or_insert(now);
                o.last_token = Some(now);
                o.tokens += 1;
                o.text.push_str(&text);
            }
            TokenEvent::Done {
                finish,
                tail,
                usage,
            } => {
                o.text.push_str(&tail);
                o.finish = Some(finish);
                o.tokens = usage.completion_tokens;
                return Ok(o);
            }
            TokenEvent::Error(e) => return Err(e),
        }
    }
    Err("event stream ended without Done".into())
}

/// Tokens of `text` without the BOS the tokenizer adds.
fn count_tokens(engine: &Engine, bos: &[i32], text: &str) -> usize {
    let ids = engine.tokenize(text);
    ids.len() - if ids.starts_with(bos) { bos.len() } else { 0 }
}

/// (busy, total) jiffies of all CPUs from /proc/stat.
fn cpu_jiffies() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3)? + v.get(4).copied().unwrap_or(0);
    Some((total - idle, total))
}

/// CPU jiffies (user + system) this process used so far.
fn own_jiffies() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// Share of all CPUs busy over `window` (while this process is idle: other processes' load).
fn cpu_busy(window: Duration) -> Option<f64> {
    let (b0, t0) = cpu_jiffies()?;
    std::thread::sleep(window);
    let (b1, t1) = cpu_jiffies()?;
    (t1 > t0).then(|| (b1 - b0) as f64 / (t1 - t0) as f64)
}

fn wait_for_idle(max_busy: f64, limit: Duration) -> (Option<f64>, f64) {
    let start = Instant::now();
    loop {
        let busy = cpu_busy(Duration::from_secs(2));
        match busy {
            Some(b) if b > max_busy && start.elapsed() < limit => {
                eprintln!("  machine busy ({:.0}% of CPUs), waiting", b * 100.0);
                std::thread::sleep(Duration::from_secs(8));
            }
            _ => return (busy, start.elapsed().as_secs_f64()),
        }
    }
}

fn machine_info() -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|| "unknown".into());
    let nproc = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|k| k.parse::<u64>().ok())
        })
        .map(|kib| kib / 1024);
    json!({
        "nproc": nproc,
        "cpu_model": cpu,
        "mem_mib": mem,
        "os": std::env::consts::OS,
        "arch": std::env::consts::ARCH,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn group_key(t: &Task) -> String {
    format!("{}/{}", t.split, t.kind)
}

fn pct(v: &Value) -> String {
    v.as_f64()
        .map_or("–".into(), |x| format!("{:.0}%", x * 100.0))
}

fn num1(v: &Value) -> String {
    v.as_f64().map_or("–".into(), |x| format!("{x:.1}"))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let a = parse_args();
    let tasks = load_tasks(&a.eval);
    assert!(!tasks.is_empty(), "no tasks in {}", a.eval.display());
    eprintln!("{} tasks from {}", tasks.len(), a.eval.display());
    let mut outputs = a.outputs.as_ref().map(|p| {
        std::io::BufWriter::new(
            std::fs::File::create(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
        )
    });

    // With --no-eval only the speed figures of an existing card are replaced.
    let previous: Value = if a.no_eval {
        std::fs::read(&a.out)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or(Value::Null)
    } else {
        Value::Null
    };

    // Phase 1: accuracy of every tier. Engines stay loaded for phase 2.
    let mut loaded: Vec<(String, PathBuf, Engine, Value)> = Vec::new();
    for tier in &a.tiers {
        let path = a.models.join(format!("{tier}-q8_0.gguf"));
        let engine = Engine::start(EngineConfig {
            name: tier.clone(),
            model: path.clone(),
            n_ctx: 16384,
            n_seq_max: a.parallel,
            n_batch: 512,
            prefill_chunk: 256,
            threads: a.threads,
            max_queue: 1024,
            ..EngineConfig::default()
        })
        .unwrap_or_else(|e| panic!("{tier}: {e}"));
        let info = engine.info().clone();
        eprintln!(
            "{tier}: {} params, {} bytes{}",
            info.n_params,
            info.size_bytes,
            if a.no_eval { "" } else { "; evaluating" }
        );
        let sha = sha256(&path);
        if a.no_eval {
            let mut kept = previous["tiers"][tier.as_str()].clone();
            if kept.is_object() {
                assert_eq!(
                    kept["sha256"].as_str(),
                    sha.as_deref(),
                    "{}: not the file {} was measured on",
                    path.display(),
                    a.out.display()
                );
                kept.as_object_mut().expect("object").remove("speed");
            } else {
                kept = json!({"sha256": sha});
            }
            loaded.push((tier.clone(), path, engine, kept));
            continue;
        }
        let mut eval = evaluate(&engine, tier, &tasks, &a, outputs.as_mut()).await;
        assert_eq!(
            sha,
            sha256(&path),
            "{}: file changed during the evaluation",
            path.display()
        );
        eval["sha256"] = json!(sha);
        if let Some(w) = outputs.as_mut() {
            use std::io::Write;
            w.flush().expect("flush outputs");
        }
        loaded.push((tier.clone(), path, engine, eval));
    }
    // Accuracy is saved before the (possibly long) wait for a quiet machine.
    if !a.no_eval {
        let partial: serde_json::Map<String, Value> = loaded
            .iter()
            .map(|(t, _, _, e)| (t.clone(), e.clone()))
            .collect();
        write_card(&a, &card_json(&a, tasks.len(), partial));
    }

    // Phase 2: single-stream decode speed, on an otherwise quiet machine where possible.
    let mut tiers_json = serde_json::Map::new();
    for (tier, path, engine, eval) in loaded {
        eprintln!("{tier}: single-stream decode speed");
        let speed = decode_speed(&engine, &tier, &tasks[0].prompt, &a).await;
        let info = engine.info().clone();
        let mut v = json!({
            "model": path.display().to_string(),
            "file_bytes": info.size_bytes,
            "n_params": info.n_params,
            "n_ctx_train": info.n_ctx_train,
            "speed": speed,
        });
        for (k, x) in eval.as_object().expect("eval object") {
            v[k] = x.clone();
        }
        tiers_json.insert(tier, v);
        drop(engine);
    }
    if let Some(mut w) = outputs {
        use std::io::Write;
        w.flush().expect("flush outputs");
    }

    let card = if a.no_eval && previous.is_object() {
        let mut card = previous;
        for (t, v) in tiers_json {
            card["tiers"][t] = v;
        }
        card["machine"] = machine_info();
        card
    } else {
        card_json(&a, tasks.len(), tiers_json)
    };
    write_card(&a, &card);
    print!("{}", markdown(&card, &a.tiers));
}

/// SHA-256 of a file via `sha256sum` (None where that tool is missing).
fn sha256(path: &std::path::Path) -> Option<String> {
    let out = std::process::Command::new("sha256sum")
        .arg(path)
        .output()
        .ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    text.split_whitespace().next().map(str::to_owned)
}

fn card_json(a: &Args, n_tasks: usize, tiers: serde_json::Map<String, Value>) -> Value {
    json!({
        "eval_set": a.eval.display().to_string(),
        "n_tasks": n_tasks,
        "decoding": {"sampling": "greedy", "max_tokens": a.max_tokens, "in_flight": a.parallel,
                     "tool_call_grammar": a.grammar,
                     "threads": a.threads, "engine": "mesh-tiers Engine (llama.cpp via llama-cpp-2)"},
        "machine": machine_info(),
        "tiers": tiers,
    })
}

fn write_card(a: &Args, card: &Value) {
    if let Some(dir) = a.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).expect("output folder");
    }
    std::fs::write(
        &a.out,
        serde_json::to_string_pretty(card).expect("json") + "\n",
    )
    .unwrap_or_else(|e| panic!("{}: {e}", a.out.display()));
    eprintln!("wrote {}", a.out.display());
}

/// Greedy decoding of every task with `parallel` requests in flight, scored per group.
async fn evaluate(
    engine: &Engine,
    tier: &str,
    tasks: &[Task],
    a: &Args,
    mut outputs: Option<&mut std::io::BufWriter<std::fs::File>>,
) -> Value {
    let bos = engine.tokenize("");
    let started = Instant::now();
    let mut results: Vec<Option<Outcome>> = (0..tasks.len()).map(|_| None).collect();
    let mut prompt_tokens = 0usize;
    let mut inflight = JoinSet::new();
    let mut next = 0;
    while next < tasks.len() || !inflight.is_empty() {
        while next < tasks.len() && inflight.len() < a.parallel as usize {
            let prompt = engine.tokenize(&tasks[next].prompt);
            prompt_tokens += prompt.len();
            let (grammar, grammar_trigger) = if a.grammar {
                let tools = offered_tools(&tasks[next].prompt);
                let g = tool_call_grammar(&tools).unwrap_or_else(|e| panic!("task {next}: {e}"));
                (Some(g), Some(CALL.to_owned()))
            } else {
                (None, None)
            };
            let rx = engine
                .submit(GenerateRequest {
                    prompt,
                    max_tokens: a.max_tokens,
                    grammar,
                    grammar_trigger,
                    request_id: format!("{tier}-{next}"),
                    ..Default::default()
                })
                .unwrap_or_else(|e| panic!("{tier} task {next}: {e}"));
            let i = next;
            inflight.spawn(async move { (i, collect(rx).await) });
            next += 1;
        }
        if let Some(r) = inflight.join_next().await {
            let (i, o) = r.expect("collector task");
            results[i] = Some(o.unwrap_or_else(|e| panic!("{tier} task {i}: {e}")));
        }
    }
    let eval_s = started.elapsed().as_secs_f64();

    let mut groups: BTreeMap<String, Agg> = BTreeMap::new();
    let mut total_generated = 0usize;
    for (i, (t, o)) in tasks.iter().zip(&results).enumerate() {
        let o = o.as_ref().expect("every task ran");
        let think = reasoning(&o.text).map_or(0, |r| count_tokens(engine, &bos, r));
        let s = score(
            t,
            &o.text,
            o.tokens,
            o.finish == Some(FinishReason::Length),
            think,
        );
        total_generated += o.tokens;
        let mut keys = vec![group_key(t), t.split.clone(), "all".to_owned()];
        if t.kind == "hard" {
            keys.push(format!("{}/hard/{}", t.split, t.sub));
            keys.push(format!("all/hard/{}", t.sub));
        }
        keys.push(format!("all/{}", t.kind));
        for k in keys {
            groups.entry(k).or_default().add(&s);
        }
        if let Some(w) = outputs.as_mut() {
            use std::io::Write;
            let line = json!({"tier": tier, "i": i, "split": t.split, "kind": t.kind, "sub": t.sub,
                              "exact": s.exact, "output": o.text, "expected": t.completion});
            writeln!(w, "{line}").expect("write outputs");
        }
    }
    eprintln!(
        "{tier}: {} tasks in {eval_s:.1} s ({:.1} generated tok/s with {} in flight)",
        tasks.len(),
        total_generated as f64 / eval_s,
        a.parallel
    );
    let groups_json: serde_json::Map<String, Value> = groups
        .iter()
        .map(|(k, g)| (k.clone(), g.to_json()))
        .collect();
    json!({
        "eval": {
            "seconds": eval_s,
            "prompt_tokens": prompt_tokens,
            "generated_tokens": total_generated,
            "generated_tok_s": total_generated as f64 / eval_s,
        },
        "groups": groups_json,
    })
}

/// `max_tokens` tokens with end-of-generation banned on one prompt, until `speed_runs` runs
/// were clean (other processes used at most `max_busy` of the CPUs during the run) or
/// `3 * speed_runs` attempts were made. The medians are over the clean runs (over all runs,
/// flagged, when too few were clean).
async fn decode_speed(engine: &Engine, tier: &str, prompt: &str, a: &Args) -> Value {
    let speed_prompt = engine.tokenize(prompt);
    let mut runs = Vec::new();
    let mut clean = 0;
    for attempt in 0..3 * a.speed_runs {
        if clean == a.speed_runs {
            break;
        }
        let (busy, waited) = wait_for_idle(a.max_busy, Duration::from_secs(a.wait_idle_s));
        let cpu0 = (cpu_jiffies(), own_jiffies());
        let t0 = Instant::now();
        let rx = engine
            .submit(GenerateRequest {
                prompt: speed_prompt.clone(),
                max_tokens: a.max_tokens,
                ignore_eos: true,
                request_id: format!("{tier}-speed-{attempt}"),
                ..Default::default()
            })
            .expect("speed request");
        let o = collect(rx).await.expect("speed run");
        let total_s = t0.elapsed().as_secs_f64();
        let cpu1 = (cpu_jiffies(), own_jiffies());
        let others = match (cpu0, cpu1) {
            ((Some((b0, t0)), Some(o0)), (Some((b1, t1)), Some(o1))) if t1 > t0 => {
                Some(((b1 - b0) as f64 - (o1 - o0) as f64).max(0.0) / (t1 - t0) as f64)
            }
            _ => None,
        };
        let is_clean = others.is_none_or(|x| x <= a.max_busy);
        clean += usize::from(is_clean);
        assert_eq!(o.tokens, a.max_tokens, "ignore_eos run stopped early");
        let (first, last) = (
            o.first_token.expect("tokens"),
            o.last_token.expect("tokens"),
        );
        let decode_tps = (o.tokens - 1) as f64 / (last - first).as_secs_f64();
        let ttft_ms = (first - t0).as_secs_f64() * 1e3;
        eprintln!(
            "  speed attempt {attempt}: {decode_tps:.1} tok/s decode, first token {ttft_ms:.0} ms; \
             other processes {:.0}% of CPUs before, {:.0}% during{}",
            busy.unwrap_or(f64::NAN) * 100.0,
            others.unwrap_or(f64::NAN) * 100.0,
            if is_clean { "" } else { " (discarded)" }
        );
        runs.push(json!({
            "tokens": o.tokens,
            "decode_tok_s": decode_tps,
            "end_to_end_tok_s": o.tokens as f64 / total_s,
            "first_token_ms": ttft_ms,
            "prompt_tokens": speed_prompt.len(),
            "others_cpu_before": busy,
            "others_cpu_during": others,
            "waited_s": waited,
            "clean": is_clean,
        }));
    }
    let enough = clean > 0;
    let med = |k: &str| -> Value {
        let v: Vec<f64> = runs
            .iter()
            .filter(|r| !enough || r["clean"] == json!(true))
            .filter_map(|r| r[k].as_f64())
            .collect();
        if v.is_empty() {
            Value::Null
        } else {
            json!(median(v))
        }
    };
    json!({
        "single_stream_decode_tok_s": med("decode_tok_s"),
        "single_stream_end_to_end_tok_s": med("end_to_end_tok_s"),
        "first_token_ms": med("first_token_ms"),
        "clean_runs": clean,
        "runs": runs,
    })
}

fn markdown(card: &Value, tiers: &[String]) -> String {
    let mut out = String::new();
    let tier_groups = |t: &str| card["tiers"][t]["groups"].clone();
    let mut keys: Vec<String> = Vec::new();
    for split in ["heldout_requests", "heldout_tools"] {
        for kind in ["call", "hard", "none", "result"] {
            keys.push(format!("{split}/{kind}"));
        }
        for sub in ["arith", "convert", "choose", "plan"] {
            keys.push(format!("{split}/hard/{sub}"));
        }
        keys.push(split.to_owned());
    }
    keys.push("all".into());
    out.push_str("| tier | split/kind | n | exact | valid JSON | tool name | mean gen tok | mean think tok |\n");
    out.push_str("|---|---|---:|---:|---:|---:|---:|---:|\n");
    for t in tiers {
        let g = tier_groups(t);
        for k in &keys {
            let v = &g[k];
            if v.is_null() {
                continue;
            }
            out.push_str(&format!(
                "| {t} | {k} | {} | {} ({}) | {} | {} | {} | {} |\n",
                v["n"],
                pct(&v["exact_rate"]),
                v["exact"],
                pct(&v["valid_json_rate"]),
                pct(&v["tool_name_accuracy"]),
                num1(&v["mean_generated_tokens"]),
                num1(&v["mean_thinking_tokens"]),
            ));
        }
    }
    out.push_str("\n| tier | params | file | decode tok/s (1 stream) | first token ms |\n");
    out.push_str("|---|---:|---:|---:|---:|\n");
    for t in tiers {
        let v = &card["tiers"][t];
        out.push_str(&format!(
            "| {t} | {:.1} M | {:.1} MiB | {} | {} |\n",
            v["n_params"].as_f64().unwrap_or(0.0) / 1e6,
            v["file_bytes"].as_f64().unwrap_or(0.0) / (1024.0 * 1024.0),
            num1(&v["speed"]["single_stream_decode_tok_s"]),
            v["speed"]["first_token_ms"]
                .as_f64()
                .map_or("–".into(), |x| format!("{x:.0}")),
        ));
    }
    out
}
