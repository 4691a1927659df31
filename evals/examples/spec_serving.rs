//! Decode speed of the serving engine with and without a draft model: t3 alone vs t1
//! drafting for t3, 1 and 4 concurrent greedy sequences, on held-out task prompts.
//!
//! ```sh
//! cargo build --release --workspace --examples
//! target/release/examples/spec_serving --prompts 16 --max-tokens 96
//! target/release/examples/spec_serving --prompts 16 --max-tokens 96 --grammar
//! ```
//!
//! With `--grammar` each request carries the lazy tool-call grammar the gateway attaches
//! when a chat request offers tools (built from the prompt's `<tools>` block). With
//! `--temperature T` the requests are sampled (top-k 40, seed = the prompt's index) and
//! the drafted engine keeps drafts by `--acceptance rejection` (speculative sampling, the
//! default), `exact` (kept when the target draws that very token), or `both` (one drafted
//! engine each, same run); sampled outputs are identical to t3 alone only under `exact`.
//! `--turns N` makes each prompt a conversation of N turns (each next prompt is the last one,
//! its answer and a further user message), so a slot's kept KV serves the next turn.
//! `--raw` feeds each task's user message as bare text to continue (no chat template, no
//! tools, end-of-text banned): open-ended text, where the models are far less sure than
//! on their tasks.
//!
//! Other models: `--target GGUF --draft GGUF --render` renders each task's user message and
//! its tools with the target's own chat template (from the GGUF), e.g. the pack's Qwen pair:
//!
//! ```sh
//! M=~/.cache/mesh/models
//! target/release/examples/spec_serving --target $M/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
//!     --draft $M/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --render --streams 1,2 \
//!     --prompts 8 --max-tokens 128
//! ```
//!
//! Both engines live in one process, each warmed up with one prompt, and run the same
//! prompts one after the other (t3 alone, then t3 with the draft, for each concurrency),
//! so machine load hits both.
//! Figures: per-sequence decode rate (tokens after the first over the time from the first
//! token to the last, summed over sequences), wall-clock rate (all generated tokens over
//! the run, prefill included), how many outputs equal t3 alone token for token, and the
//! CPU other processes used meanwhile (from /proc/stat minus this process).
//! A measurement, not a test: timings depend on the machine and its load.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use mesh_tiers::{
    DraftAcceptance, DraftConfig, Engine, EngineConfig, GenerateRequest, KvPagesConfig,
    SamplingParams, TokenEvent,
};

struct Args {
    prompts: usize,
    max_tokens: usize,
    threads: i32,
    models: PathBuf,
    grammar: bool,
    raw: bool,
    draft_threads: i32,
    draft_threads_batch: i32,
    temperature: f32,
    acceptance: Vec<DraftAcceptance>,
    turns: usize,
    target: Option<PathBuf>,
    draft: Option<PathBuf>,
    render: bool,
    streams: Vec<usize>,
    k_init: usize,
    k_max: usize,
}

fn args() -> Args {
    let mut a = Args {
        prompts: 16,
        max_tokens: 96,
        threads: 2,
        models: PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../models")),
        grammar: false,
        raw: false,
        draft_threads: DraftConfig::default().threads,
        draft_threads_batch: DraftConfig::default().threads_batch,
        temperature: 0.0,
        acceptance: vec![DraftAcceptance::Rejection],
        turns: 1,
        target: None,
        draft: None,
        render: false,
        streams: vec![1, 4],
        k_init: DraftConfig::default().k_init,
        k_max: DraftConfig::default().k_max,
    };
    const USAGE: &str =
        "usage: spec_serving [--prompts N] [--max-tokens N] [--threads N] [--draft-threads N] [--draft-threads-batch N] [--models DIR] [--grammar | --raw] [--temperature T] [--acceptance rejection|exact|both] [--turns N] [--target GGUF] [--draft GGUF] [--render] [--streams 1,4] [--k-init N] [--k-max N]";
    let usage = |why: &str| -> ! {
        eprintln!("spec_serving: {why}\n{USAGE}");
        std::process::exit(2)
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        match k.as_str() {
            "--grammar" => {
                a.grammar = true;
                continue;
            }
            "--raw" => {
                a.raw = true;
                continue;
            }
            "--render" => {
                a.render = true;
                continue;
            }
            "--help" | "-h" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            _ => {}
        }
        let v = it
            .next()
            .unwrap_or_else(|| usage(&format!("{k} needs a value")));
        match k.as_str() {
            "--prompts" => a.prompts = v.parse().expect("--prompts N"),
            "--max-tokens" => a.max_tokens = v.parse().expect("--max-tokens N"),
            "--threads" => a.threads = v.parse().expect("--threads N"),
            "--draft-threads" => a.draft_threads = v.parse().expect("--draft-threads N"),
            "--draft-threads-batch" => {
                a.draft_threads_batch = v.parse().expect("--draft-threads-batch N")
            }
            "--models" => a.models = v.into(),
            "--temperature" => a.temperature = v.parse().expect("--temperature T"),
            "--turns" => a.turns = v.parse().expect("--turns N"),
            "--target" => a.target = Some(v.into()),
            "--k-init" => a.k_init = v.parse().expect("--k-init N"),
            "--k-max" => a.k_max = v.parse().expect("--k-max N"),
            "--draft" => a.draft = Some(v.into()),
            "--streams" => {
                a.streams = v
                    .split(',')
                    .map(|n| n.parse().expect("--streams N,M"))
                    .collect()
            }
            "--acceptance" => {
                a.acceptance = match v.as_str() {
                    "rejection" => vec![DraftAcceptance::Rejection],
                    "exact" => vec![DraftAcceptance::Exact],
                    "both" => vec![DraftAcceptance::Exact, DraftAcceptance::Rejection],
                    _ => usage("--acceptance is rejection, exact or both"),
                }
            }
            _ => usage(&format!("unknown argument {k}")),
        }
    }
    if a.render && (a.grammar || a.raw || a.turns > 1) {
        usage("--render takes neither --grammar (the bundled tiers' grammar), --raw nor --turns");
    }
    if a.streams.is_empty() || a.streams.contains(&0) {
        usage("--streams needs positive counts");
    }
    a
}

impl Args {
    fn target(&self) -> PathBuf {
        self.target
            .clone()
            .unwrap_or_else(|| self.models.join("t3-q8_0.gguf"))
    }

    fn draft(&self) -> PathBuf {
        self.draft
            .clone()
            .unwrap_or_else(|| self.models.join("t1-q8_0.gguf"))
    }
}

/// A model's short name: its file name up to the first `-q` quantization suffix.
fn short(path: &std::path::Path) -> String {
    let stem = path
        .file_stem()
        .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
    stem.rsplit_once("-q")
        .map_or(stem.clone(), |(s, _)| s.to_owned())
}

fn engine(a: &Args, draft: Option<DraftAcceptance>) -> Engine {
    Engine::start(EngineConfig {
        name: if draft.is_some() {
            "target+draft"
        } else {
            "target"
        }
        .into(),
        model: a.target(),
        n_ctx: a.streams.iter().max().copied().unwrap_or(4).max(1) as u32 * 2048,
        n_seq_max: a.streams.iter().max().copied().unwrap_or(4).max(1) as u32,
        n_batch: 512,
        prefill_chunk: 256,
        threads: a.threads,
        // No prefix pages: every run prefills its prompts, as the first run does.
        kv_pages: KvPagesConfig {
            block: 0,
            ..KvPagesConfig::default()
        },
        draft: draft.map(|acceptance| DraftConfig {
            model: a.draft(),
            k_init: a.k_init,
            k_max: a.k_max,
            k_min: a.k_init.min(DraftConfig::default().k_min),
            threads: a.draft_threads,
            threads_batch: a.draft_threads_batch,
            acceptance,
            ..DraftConfig::default()
        }),
        ..EngineConfig::default()
    })
    .expect("engine starts")
}

/// Busy and total jiffies of the machine, and this process's jiffies.
fn cpu() -> (u64, u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let f: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: u64 = f.iter().sum();
    let idle = f.get(3).copied().unwrap_or(0) + f.get(4).copied().unwrap_or(0);
    let me = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name: state, then utime and stime 12th and 13th.
    let rest: Vec<&str> = me
        .rsplit_once(')')
        .map(|(_, r)| r)
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let field = |i: usize| rest.get(i).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    let mine = field(11) + field(12);
    (total - idle, total, mine)
}

struct Run {
    tokens: Vec<Vec<i32>>,
    decode_tokens: usize,
    decode_s: f64,
    generated: usize,
    wall_s: f64,
    drafted: usize,
    accepted: usize,
    /// Cores' worth of CPU other processes used during the run.
    others: f64,
}

async fn one(
    e: &Engine,
    req: &GenerateRequest,
    max_tokens: usize,
) -> (Vec<i32>, Option<Duration>, usize, usize) {
    let mut rx = e
        .submit(GenerateRequest {
            max_tokens,
            ..req.clone()
        })
        .expect("submitted");
    let (mut toks, mut first, mut last) = (Vec::new(), None, None);
    while let Some(ev) = rx.recv().await {
        match ev {
            TokenEvent::Started { .. } => {}
            TokenEvent::Token { id, .. } => {
                toks.push(id);
                let now = Instant::now();
                first.get_or_insert(now);
                last = Some(now);
            }
            TokenEvent::Done { usage, .. } => {
                let span = first.zip(last).map(|(f, l)| l - f);
                return (toks, span, usage.draft_tokens, usage.draft_accepted);
            }
            TokenEvent::Error(err) => panic!("generation failed: {err}"),
        }
    }
    panic!("engine stopped")
}

/// One conversation of `turns` turns: each next prompt is the previous one, its answer and
/// `follow` (a further user message); one result per turn.
async fn conversation(
    e: &Engine,
    req: &GenerateRequest,
    max_tokens: usize,
    turns: usize,
    follow: &[i32],
) -> Vec<(Vec<i32>, Option<Duration>, usize, usize)> {
    let mut req = req.clone();
    let mut outs = Vec::with_capacity(turns);
    for _ in 0..turns {
        let out = one(e, &req, max_tokens).await;
        req.prompt.extend_from_slice(&out.0);
        req.prompt.extend_from_slice(follow);
        outs.push(out);
    }
    outs
}

/// Runs the prompts (conversations of `turns` turns) in waves of `conc` concurrent ones.
async fn run(
    e: &Engine,
    prompts: &[GenerateRequest],
    conc: usize,
    max_tokens: usize,
    (turns, follow): (usize, &[i32]),
) -> Run {
    let (busy0, total0, mine0) = cpu();
    let t0 = Instant::now();
    let mut r = Run {
        tokens: vec![],
        decode_tokens: 0,
        decode_s: 0.0,
        generated: 0,
        wall_s: 0.0,
        drafted: 0,
        accepted: 0,
        others: 0.0,
    };
    for wave in prompts.chunks(conc) {
        let outs = futures::future::join_all(
            wave.iter()
                .map(|p| conversation(e, p, max_tokens, turns, follow)),
        )
        .await;
        for (toks, span, drafted, accepted) in outs.into_iter().flatten() {
            r.generated += toks.len();
            r.decode_tokens += toks.len().saturating_sub(1);
            r.decode_s += span.map_or(0.0, |d| d.as_secs_f64());
            r.drafted += drafted;
            r.accepted += accepted;
            r.tokens.push(toks);
        }
    }
    r.wall_s = t0.elapsed().as_secs_f64();
    let (busy1, total1, mine1) = cpu();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let others = (busy1 - busy0).saturating_sub(mine1 - mine0) as f64;
    r.others = cores * others / (total1 - total0).max(1) as f64;
    r
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// The user message that opens every turn after the first (`--turns`).
const FOLLOW_UP: &str = "<|end|><|user|>Thanks. Now do the same again, please.<|end|><|assistant|>";

/// The user turn of a chat-formatted prompt (the whole prompt when it has none).
fn user_message(prompt: &str) -> &str {
    prompt.split_once("<|user|>").map_or(prompt, |(_, rest)| {
        rest.split_once("<|end|>").map_or(rest, |(u, _)| u)
    })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let a = args();
    let tasks = mesh_tiers::eval::load_tasks(&a.models.join("fixtures/eval-heldout.jsonl"))
        .unwrap_or_else(|e| panic!("{e}"));
    let plain = engine(&a, None);
    let (tname, dname) = (short(&a.target()), short(&a.draft()));
    let drafted: Vec<(String, Engine)> = a
        .acceptance
        .iter()
        .map(|&acc| {
            let name = match (a.temperature > 0.0, acc) {
                (false, _) => format!("{dname} drafts, {tname} verifies"),
                (true, acc) => format!("{dname} drafts, {tname} verifies ({acc:?} acceptance)"),
            };
            (name, engine(&a, Some(acc)))
        })
        .collect();
    let step = (tasks.len() / a.prompts).max(1);
    let prompts: Vec<GenerateRequest> = tasks
        .iter()
        .step_by(step)
        .take(a.prompts)
        .enumerate()
        .map(|(i, t)| {
            let text = if a.raw {
                user_message(&t.prompt)
            } else {
                &t.prompt
            };
            let tools = mesh_tiers::eval::offered_tools(text);
            let grammar = (a.grammar && !tools.is_empty()).then(|| {
                mesh_tiers::chat::tool_call_grammar(&tools).expect("grammar for the tools")
            });
            let prompt = if a.render {
                let input = mesh_tiers::format::ChatInput {
                    messages: vec![mesh_tiers::chat::ChatMessage::text(
                        mesh_tiers::chat::Role::User,
                        user_message(text),
                    )],
                    tools,
                    ..Default::default()
                };
                plain
                    .render(&input)
                    .expect("the target's template renders")
                    .0
            } else {
                plain.tokenize(text)
            };
            GenerateRequest {
                prompt,
                // Bare text ends at once otherwise; continue for max_tokens.
                ignore_eos: a.raw,
                grammar_trigger: grammar.as_ref().map(|_| mesh_tiers::chat::CALL.to_owned()),
                grammar,
                sampling: SamplingParams {
                    temperature: a.temperature,
                    top_k: 40,
                    seed: i as u32,
                    ..SamplingParams::default()
                },
                ..Default::default()
            }
        })
        .collect();
    // A further user message after each answer (`--turns`), without the BOS a bare
    // tokenization starts with.
    let bos = plain.tokenize("").len();
    let follow = plain.tokenize(FOLLOW_UP)[bos..].to_vec();
    // Warm-up, not measured: the first decodes fault the mmapped weights in from disk.
    for e in std::iter::once(&plain).chain(drafted.iter().map(|d| &d.1)) {
        run(e, &prompts[..1], 1, a.max_tokens, (1, &follow)).await;
    }
    println!(
        "{} held-out prompts{} ({} with the tool-call grammar), {} turn(s) each, {}{}, at most {} new tokens, {} llama.cpp threads for {tname} and {}/{} for the draft {dname} (one token/batches; 0 = same), loadavg at start {}",
        prompts.len(),
        if a.render {
            ", user message and tools rendered with the target's chat template"
        } else {
            ""
        },
        prompts.iter().filter(|r| r.grammar.is_some()).count(),
        a.turns,
        if a.raw { "bare user messages to continue, " } else { "" },
        if a.temperature > 0.0 {
            format!("sampled at temperature {} (top-k 40)", a.temperature)
        } else {
            "greedy".to_owned()
        },
        a.max_tokens,
        a.threads,
        a.draft_threads,
        a.draft_threads_batch,
        loadavg()
    );
    println!();
    println!("| concurrent | engine | decode tok/s per sequence | wall tok/s (incl. prefill) | identical outputs | drafts accepted | other processes' CPU (cores) |");
    println!("|---:|---|---:|---:|---:|---:|---:|");
    for &conc in &a.streams {
        let base = run(&plain, &prompts, conc, a.max_tokens, (a.turns, &follow)).await;
        let mut runs = vec![(format!("{tname} alone"), base)];
        for (name, e) in &drafted {
            runs.push((
                name.clone(),
                run(e, &prompts, conc, a.max_tokens, (a.turns, &follow)).await,
            ));
        }
        let speed = |r: &Run| r.decode_tokens as f64 / r.decode_s.max(1e-9);
        let wall = |r: &Run| r.generated as f64 / r.wall_s;
        let base = &runs[0].1;
        for (name, r) in &runs {
            let drafts = if r.drafted > 0 {
                format!(
                    "{} / {} ({:.0}%)",
                    r.accepted,
                    r.drafted,
                    100.0 * r.accepted as f64 / r.drafted as f64
                )
            } else {
                String::new()
            };
            let same = base
                .tokens
                .iter()
                .zip(&r.tokens)
                .filter(|(x, y)| x == y)
                .count();
            let ident = if r.drafted > 0 {
                format!("{same} / {}", prompts.len() * a.turns)
            } else {
                String::new()
            };
            println!(
                "| {conc} | {name} | {:.1} | {:.1} | {ident} | {drafts} | {:.2} |",
                speed(r),
                wall(r),
                r.others
            );
        }
        for (name, r) in &runs[1..] {
            println!(
                "| {conc} | speed-up, {name} | {:.2}x | {:.2}x | | | |",
                speed(r) / speed(base),
                wall(r) / wall(base)
            );
        }
    }
    println!();
    let phases = |e: &Engine| {
        let st = e.stats();
        mesh_tiers::STEP_PHASES
            .iter()
            .zip(&st.step_ns)
            .map(|(p, ns)| {
                let s = ns.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1e9;
                format!("{p} {s:.1} s")
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "{tname} alone, engine thread by step phase (whole run): {}",
        phases(&plain)
    );
    for (name, e) in &drafted {
        println!(
            "{name}, engine thread by step phase (whole run): {}",
            phases(e)
        );
    }
    for (name, e) in &drafted {
        let st = e.stats();
        let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        println!(
            "{name}: draft decoded {} catch-up tokens, reused {} in place; the target reused {} in place",
            load(&st.draft_prefill_tokens),
            load(&st.draft_resident_tokens),
            load(&st.resident_tokens)
        );
    }
    println!("loadavg at end {}", loadavg());
}
