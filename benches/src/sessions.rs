//! `mesh-bench sessions`: multi-turn agent sessions, mesh vs llama-server side by side.
//!
//! One repetition = `sessions` concurrent sessions of `turns` turns each. A session opens with
//! a system prompt listing `tools` schemas from the catalog (a different list per session and
//! repetition, so no session starts on another's cache). Turn n sends the whole conversation
//! so far: the system prompt, every earlier user message with the assistant reply *that
//! server* returned (cut at the end-of-turn marker), then the new user message. Each turn's
//! prompt therefore extends the previous one, which is what a prefix cache can serve: mesh from
//! its KV pages, llama-server from its per-slot prompt cache (`cache_prompt`).
//!
//! Same work on both targets: the same system prompts and user messages, fixed `max_tokens`
//! with EOS ignored, temperature 0. The replies come from each server's own greedy decode, so
//! later prompts are identical on both only where the replies were; the run counts how many.
//! After a warm-up per target, repetitions alternate A B / B A.
//!
//! Measured per turn index: TTFT (median over sessions and repetitions) and prompt tokens; per
//! repetition: the wall time of the whole batch of sessions, prompt tokens sent, and how many
//! of them each server did not have to evaluate (mesh: `mesh_kv_recompute_avoided_tokens_total`
//! + `mesh_kv_resident_tokens_total` + `mesh_kv_device_copy_tokens_total`, restored from KV
//! pages, kept in the slot or copied from a running sequence; llama-server: `llamacpp:prompt_tokens_cached_total`, reused from its
//! prompt cache), from `/metrics` before and after.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use indicatif::ProgressBar;
use serde::Serialize;
use serde_json::{json, Map, Value};

use crate::machine::ForeignCpu;
use crate::report::{self, Better, Row, TARGETS};
use crate::server::{metric_sum, Server};
use crate::sidebyside::{self, CpuMeter, RunRecord, ServerArgs, Workload};
use crate::stats::{median, ratio};
use crate::workload::{self, RequestSpec, ASSISTANT, END};

/// Options of `mesh-bench sessions`.
#[derive(clap::Args, Debug)]
pub(crate) struct SessionsArgs {
    #[command(flatten)]
    servers: ServerArgs,
    /// Concurrent sessions (at most --parallel).
    #[arg(long, default_value_t = 4)]
    sessions: usize,
    /// Turns per session.
    #[arg(long, default_value_t = 4)]
    turns: usize,
    /// Tokens generated per turn (EOS ignored, so every turn makes exactly this many).
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Tool schemas in each session's system prompt (about 100 tokens each for t1).
    #[arg(long, default_value_t = 4)]
    tools: usize,
    /// Measured repetitions per target, after one warm-up each.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Tool catalog the system prompts and user messages are built from.
    #[arg(long, default_value = "models/fixtures/catalog.jsonl")]
    catalog: PathBuf,
    /// JSON output; the markdown goes next to it (`.md`), server logs with `.mesh.log` and
    /// `.llama-server.log`.
    #[arg(long, default_value = "bench-results/sessions.json")]
    out: PathBuf,
}

impl SessionsArgs {
    fn validate(&self) -> Result<()> {
        if self.sessions == 0 || self.turns == 0 || self.reps == 0 || self.max_tokens == 0 {
            bail!("--sessions, --turns, --reps and --max-tokens must be at least 1");
        }
        if self.sessions > self.servers.parallel as usize {
            bail!(
                "{} sessions exceed --parallel {}: turns would queue",
                self.sessions,
                self.servers.parallel
            );
        }
        self.servers.check(&[(&self.catalog, "the tool catalog")])
    }
}

/// A conversation in the bundled chat format, as sent so far.
#[derive(Debug, Clone)]
pub(crate) struct Conversation {
    text: String,
}

impl Conversation {
    /// A conversation holding only its system turn.
    pub(crate) fn new(system_turn: String) -> Self {
        Self { text: system_turn }
    }

    /// Everything sent and received so far.
    pub(crate) fn text(&self) -> &str {
        &self.text
    }

    /// The prompt of the next turn: everything so far, the user message, the open assistant
    /// turn.
    pub(crate) fn prompt(&self, user: &str) -> String {
        format!("{}{}{ASSISTANT}", self.text, workload::user_turn(user))
    }

    /// Appends a finished turn: the user message and the reply up to its end-of-turn marker
    /// (with EOS ignored a server keeps writing past it; what follows is not the reply).
    pub(crate) fn push_turn(&mut self, user: &str, reply: &str) {
        let reply = reply.split(END).next().unwrap_or_default();
        self.text = format!("{}{reply}{END}", self.prompt(user));
    }
}

/// The scripted side of one session: its system turn and one user message per turn.
#[derive(Debug, Clone)]
pub(crate) struct Script {
    system: String,
    users: Vec<String>,
}

/// Session `k`'s script: `n_tools` schemas starting at catalog entry `k`, and requests for
/// those tools in turn, with values that vary with `k` and the turn.
pub(crate) fn script(catalog: &[Value], k: usize, n_tools: usize, turns: usize) -> Script {
    let tools = workload::tools_for(catalog, k, n_tools);
    Script {
        system: workload::system_turn(&tools),
        users: (0..turns)
            .map(|t| workload::user_request(tools[t % tools.len()], k * turns + t))
            .collect(),
    }
}

/// One turn as measured.
#[derive(Debug, Clone, Serialize)]
struct Turn {
    session: usize,
    /// 0-based turn index.
    turn: usize,
    ttft_s: f64,
    e2e_s: f64,
    prompt_tokens: Option<usize>,
    completion_tokens: usize,
    prompt_chars: usize,
    #[serde(skip)]
    prompt: String,
}

/// One batch of sessions against one target.
struct SessionBatch {
    wall_s: f64,
    turns: Vec<Turn>,
    foreign: Option<ForeignCpu>,
    /// Prompt tokens the server did not evaluate, from its `/metrics`.
    reused_tokens: Option<f64>,
    /// Counter deltas read for `reused_tokens`.
    metrics_delta: Map<String, Value>,
}

impl SessionBatch {
    fn prompt_tokens(&self) -> usize {
        self.turns.iter().filter_map(|t| t.prompt_tokens).sum()
    }

    fn reused_fraction(&self) -> Option<f64> {
        ratio(self.reused_tokens, Some(self.prompt_tokens() as f64))
    }
}

/// Runs `scripts` as concurrent sessions against `base_url`. Cancel-safe.
async fn run_sessions(
    client: &reqwest::Client,
    base_url: &str,
    spec: &RequestSpec<'_>,
    scripts: &[Script],
    progress: &ProgressBar,
) -> Result<(f64, Vec<Turn>)> {
    let start = Instant::now();
    let per_session = scripts.iter().enumerate().map(|(session, s)| async move {
        let mut conv = Conversation::new(s.system.clone());
        let mut out = Vec::with_capacity(s.users.len());
        for (turn, user) in s.users.iter().enumerate() {
            let prompt = conv.prompt(user);
            let sample = workload::one_request(client, base_url, spec, &prompt)
                .await
                .and_then(|r| workload::sample_from(turn, session, r))
                .with_context(|| format!("{base_url}: session {session} turn {turn}"))?;
            conv.push_turn(user, &sample.text);
            out.push(Turn {
                session,
                turn,
                ttft_s: sample.ttft_s,
                e2e_s: sample.e2e_s,
                prompt_tokens: sample.prompt_tokens,
                completion_tokens: sample.completion_tokens,
                prompt_chars: prompt.len(),
                prompt,
            });
            progress.inc(1);
        }
        anyhow::Ok(out)
    });
    let turns = futures::future::try_join_all(per_session).await?;
    Ok((
        start.elapsed().as_secs_f64(),
        turns.into_iter().flatten().collect(),
    ))
}

/// Counters read around each batch: mesh's page reuse, llama-server's evaluated prompt tokens.
const COUNTERS: &[&str] = &[
    "mesh_kv_recompute_avoided_tokens_total",
    "mesh_kv_resident_tokens_total",
    "mesh_kv_device_copy_tokens_total",
    "mesh_kv_prefix_hits_total",
    "mesh_kv_prefix_lookups_total",
    "mesh_kv_pages_published_total",
    "llamacpp:prompt_tokens_total",
    "llamacpp:prompt_tokens_cached_total",
    "llamacpp:tokens_predicted_total",
];

fn counters(m: &Map<String, Value>) -> Map<String, Value> {
    COUNTERS
        .iter()
        .filter_map(|&c| Some((c.to_owned(), json!(metric_sum(m, c)?))))
        .collect()
}

fn delta(before: &Map<String, Value>, after: &Map<String, Value>) -> Map<String, Value> {
    after
        .iter()
        .filter_map(|(k, v)| Some((k.clone(), json!(v.as_f64()? - before.get(k)?.as_f64()?))))
        .collect()
}

/// Prompt tokens a target did not evaluate in a batch, from its counter deltas: mesh's
/// tokens restored from pages plus those reused in place from a slot's kept KV or copied from
/// a running sequence's; llama-server's tokens reused from its prompt cache (or, from a
/// build without that counter, the tokens sent minus the tokens it evaluated).
fn reused_tokens(target: usize, d: &Map<String, Value>, prompt_tokens: usize) -> Option<f64> {
    let get = |k: &str| d.get(k).and_then(Value::as_f64);
    match target {
        0 => get("mesh_kv_recompute_avoided_tokens_total").map(|p| {
            p + get("mesh_kv_resident_tokens_total").unwrap_or(0.0)
                + get("mesh_kv_device_copy_tokens_total").unwrap_or(0.0)
        }),
        _ => get("llamacpp:prompt_tokens_cached_total").or_else(|| {
            get("llamacpp:prompt_tokens_total").map(|e| (prompt_tokens as f64 - e).max(0.0))
        }),
    }
}

async fn bench(
    args: &SessionsArgs,
    servers: &mut Vec<Server>,
    progress: &ProgressBar,
) -> Result<(Value, String)> {
    let record = RunRecord::begin(progress);
    let catalog = workload::load_catalog(&args.catalog)?;
    let (client, ready_s) = args
        .servers
        .start(&args.out, &[], servers, progress)
        .await?;
    let spec = RequestSpec {
        model: &args.servers.tier,
        max_tokens: args.max_tokens,
    };
    let meter = CpuMeter::new(servers);
    let mut warmup: Vec<Option<SessionBatch>> = vec![None, None];
    let mut reps: [Vec<SessionBatch>; 2] = [Vec::new(), Vec::new()];
    for phase in 0..=args.reps {
        // Fresh sessions per phase (warm-up = phase 0), the same on both targets.
        let scripts: Vec<Script> = (0..args.sessions)
            .map(|s| script(&catalog, phase * args.sessions + s, args.tools, args.turns))
            .collect();
        let order = if phase % 2 == 0 { [0, 1] } else { [1, 0] };
        for t in order {
            let server = &mut servers[t];
            let what = if phase == 0 {
                "warm-up".to_owned()
            } else {
                format!("rep {phase}/{}", args.reps)
            };
            progress.set_message(format!(
                "{} sessions, {}, {what}",
                args.sessions, server.name
            ));
            server.ensure_running()?;
            let m0 = counters(&server.metrics(&client).await);
            let before = meter.snapshot();
            let (wall_s, turns) =
                run_sessions(&client, &server.base_url, &spec, &scripts, progress).await?;
            let foreign = meter.since(before);
            let d = delta(&m0, &counters(&server.metrics(&client).await));
            let mut b = SessionBatch {
                wall_s,
                turns,
                foreign,
                reused_tokens: None,
                metrics_delta: d,
            };
            b.reused_tokens = reused_tokens(t, &b.metrics_delta, b.prompt_tokens());
            if phase == 0 {
                warmup[t] = Some(b);
            } else {
                reps[t].push(b);
            }
        }
    }
    let mut json = record
        .finish("sessions", &args.servers, servers, &ready_s, &client)
        .await?;
    json["other_processes_during_measured_batches"] =
        sidebyside::noise_json(reps.iter().flatten().map(|b| (b.wall_s, b.foreign)));
    json["settings"] = args.servers.settings_json(json!({
        "sessions": args.sessions,
        "turns": args.turns,
        "tools_per_session": args.tools,
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
        "ignore_eos": true,
        "stream": true,
        "cache_prompt": true,
        "reps": args.reps,
        "warmups_per_target": 1,
        "order": "warm-up A B, then B A, A B, ... (A = mesh, B = llama-server)",
        "arrival": "closed loop: all sessions start together, each sends its next turn when the previous reply has ended",
        "prompts": "turn n = system prompt with the session's tool schemas + earlier user messages and this server's replies (cut at <|end|>) + a new user message",
        "catalog": args.catalog.display().to_string(),
        "endpoint": "/v1/completions",
        "connections": "a new TCP connection per request (no keep-alive reuse)",
    }));
    json["checks"] = checks(&reps, args.max_tokens);
    json["summary"] = summary(&reps, args.turns);
    let batch_json = |b: &SessionBatch| {
        json!({
            "wall_s": b.wall_s,
            "prompt_tokens": b.prompt_tokens(),
            "reused_tokens": b.reused_tokens,
            "reused_fraction": b.reused_fraction(),
            "metrics_delta": b.metrics_delta,
            "other_processes": b.foreign,
            "turns": b.turns,
        })
    };
    json["reps"] = json!({
        TARGETS[0]: reps[0].iter().map(batch_json).collect::<Vec<_>>(),
        TARGETS[1]: reps[1].iter().map(batch_json).collect::<Vec<_>>(),
    });
    json["warmup"] = json!({
        TARGETS[0]: warmup[0].as_ref().map(batch_json),
        TARGETS[1]: warmup[1].as_ref().map(batch_json),
    });
    let markdown = markdown(&json);
    Ok((json, markdown))
}

/// Same work on both targets: prompts compared turn by turn (equal only while the replies
/// were), turns short of `max_tokens`.
fn checks(reps: &[Vec<SessionBatch>; 2], max_tokens: usize) -> Value {
    let (mut compared, mut same_prompt, mut same_tokens) = (0, 0, 0);
    for (a, b) in reps[0].iter().zip(&reps[1]) {
        for ta in &a.turns {
            let Some(tb) = b
                .turns
                .iter()
                .find(|t| t.session == ta.session && t.turn == ta.turn)
            else {
                continue;
            };
            compared += 1;
            same_prompt += usize::from(ta.prompt == tb.prompt);
            same_tokens += usize::from(ta.prompt_tokens == tb.prompt_tokens);
        }
    }
    let short = |t: usize| {
        reps[t]
            .iter()
            .flat_map(|b| &b.turns)
            .filter(|x| x.completion_tokens != max_tokens)
            .count()
    };
    json!({
        "turns_compared": compared,
        "identical_prompts": same_prompt,
        "identical_prompt_token_counts": same_tokens,
        "turns_not_max_tokens": {TARGETS[0]: short(0), TARGETS[1]: short(1)},
    })
}

/// Medians per turn index and per repetition, with mesh / llama-server ratios.
fn summary(reps: &[Vec<SessionBatch>; 2], turns: usize) -> Value {
    let per_turn: Vec<Value> = (0..turns)
        .map(|n| {
            let of = |t: usize, f: fn(&Turn) -> Option<f64>| {
                median(
                    &reps[t]
                        .iter()
                        .flat_map(|b| &b.turns)
                        .filter(|x| x.turn == n)
                        .filter_map(f)
                        .collect::<Vec<_>>(),
                )
            };
            let ttft = |x: &Turn| Some(x.ttft_s * 1e3);
            let tokens = |x: &Turn| x.prompt_tokens.map(|p| p as f64);
            json!({
                "turn": n + 1,
                "ttft_ms_p50": pair(of(0, ttft), of(1, ttft)),
                "prompt_tokens_p50": pair(of(0, tokens), of(1, tokens)),
            })
        })
        .collect();
    let per_rep = |t: usize, f: fn(&SessionBatch) -> Option<f64>| -> Vec<Option<f64>> {
        reps[t].iter().map(f).collect()
    };
    let rep_metric = |f: fn(&SessionBatch) -> Option<f64>| {
        let (a, b) = (per_rep(0, f), per_rep(1, f));
        let med = |v: &[Option<f64>]| median(&v.iter().flatten().copied().collect::<Vec<_>>());
        let mut p = pair(med(&a), med(&b));
        p["pair_ratios"] = json!(a
            .iter()
            .zip(&b)
            .filter_map(|(x, y)| ratio(*x, *y))
            .collect::<Vec<_>>());
        p
    };
    json!({
        "per_turn": per_turn,
        "session_batch_wall_s": rep_metric(|b| Some(b.wall_s)),
        "ttft_ms_p50_all_turns": rep_metric(|b| median(&b.turns.iter().map(|x| x.ttft_s * 1e3).collect::<Vec<_>>())),
        "prompt_tokens_per_rep": rep_metric(|b| Some(b.prompt_tokens() as f64)),
        "reused_fraction": rep_metric(SessionBatch::reused_fraction),
    })
}

/// `{mesh, llama-server, ratio}` of two values.
fn pair(mesh: Option<f64>, llama: Option<f64>) -> Value {
    json!({TARGETS[0]: mesh, TARGETS[1]: llama, "ratio": ratio(mesh, llama)})
}

/// Table rows of a sessions run's `summary`.
pub(crate) fn rows(summary: &Value) -> Vec<Row> {
    let row = |workload: String, label: &str, v: &Value, decimals, better| Row {
        workload,
        label: label.to_owned(),
        mesh: v[TARGETS[0]].as_f64(),
        llama: v[TARGETS[1]].as_f64(),
        decimals,
        better,
        pair_ratios: v["pair_ratios"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_f64).collect())
            .unwrap_or_default(),
    };
    let mut out = Vec::new();
    for t in summary["per_turn"].as_array().into_iter().flatten() {
        let name = format!("turn {}", t["turn"]);
        out.push(row(
            name.clone(),
            "TTFT p50 (ms)",
            &t["ttft_ms_p50"],
            1,
            Better::Lower,
        ));
        out.push(row(
            name,
            "prompt tokens p50",
            &t["prompt_tokens_p50"],
            0,
            Better::Lower,
        ));
    }
    let all = "all turns".to_owned();
    out.push(row(
        all.clone(),
        "TTFT p50 (ms)",
        &summary["ttft_ms_p50_all_turns"],
        1,
        Better::Lower,
    ));
    out.push(row(
        all.clone(),
        "session batch wall time (s)",
        &summary["session_batch_wall_s"],
        2,
        Better::Lower,
    ));
    out.push(row(
        all.clone(),
        "prompt tokens per repetition",
        &summary["prompt_tokens_per_rep"],
        0,
        Better::Lower,
    ));
    out.push(row(
        all,
        "share of prompt tokens not evaluated (cache)",
        &summary["reused_fraction"],
        3,
        Better::Higher,
    ));
    out
}

/// The run's markdown: table, what was run, checks, environment.
pub(crate) fn markdown(j: &Value) -> String {
    let st = &j["settings"];
    let c = &j["checks"];
    let mut out = String::from("# sessions: mesh vs llama-server\n\n");
    out.push_str(&report::table(&rows(&j["summary"])));
    out.push_str(&format!(
        "\nRatio = mesh / llama-server. Per-turn values: median over all sessions and repetitions; whole-batch values: median over repetitions, with the ratio of each back-to-back repetition pair. \
         Not evaluated: mesh = prompt tokens restored from KV pages or reused in place from a slot's kept KV or copied from a running sequence's (`mesh_kv_recompute_avoided_tokens_total` + `mesh_kv_resident_tokens_total` + `mesh_kv_device_copy_tokens_total`); llama-server = prompt tokens reused from its slot prompt cache (`llamacpp:prompt_tokens_cached_total`).\n\n\
         - {} concurrent sessions × {} turns, {} tool schemas per system prompt, {} tokens per reply (ignore_eos, temperature 0, streaming), {} repetitions per target after one warm-up, order alternating\n",
        st["sessions"], st["turns"], st["tools_per_session"], st["max_tokens"], st["reps"],
    ));
    out.push_str(&format!(
        "- checks: {} of {} turn prompts identical on both targets ({} with equal prompt token counts; they differ once the servers' greedy replies differ); turns short of max_tokens: mesh {}, llama-server {}\n",
        c["identical_prompts"], c["turns_compared"], c["identical_prompt_token_counts"],
        c["turns_not_max_tokens"]["mesh"], c["turns_not_max_tokens"]["llama-server"],
    ));
    out.push_str(&sidebyside::environment_markdown(j));
    out
}

/// Runs the benchmark, writes the JSON and markdown, prints the table. Both servers are
/// stopped and reaped before this returns, whatever the outcome.
pub(crate) async fn run(args: SessionsArgs) -> Result<()> {
    args.validate()?;
    sidebyside::run(&args, &args.out).await
}

impl Workload for SessionsArgs {
    /// Requests per target over the whole run (warm-ups included).
    fn requests_per_target(&self) -> usize {
        self.sessions * self.turns * (self.reps + 1)
    }

    async fn bench(
        &self,
        servers: &mut Vec<Server>,
        progress: &ProgressBar,
    ) -> Result<(Value, String)> {
        bench(self, servers, progress).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::tests::catalog;

    #[test]
    fn each_turn_prompt_extends_the_previous_one_verbatim() {
        let s = script(&catalog(), 3, 2, 4);
        assert_eq!(s.users.len(), 4);
        let mut conv = Conversation::new(s.system.clone());
        let replies = [
            "<tool_call>{\"name\": \"tool_3\"}</tool_call><|end|>garbage after EOS",
            "Sure.",
            "",
            "Done.<|end|>",
        ];
        let mut prompts: Vec<String> = Vec::new();
        for (user, reply) in s.users.iter().zip(replies) {
            let p = conv.prompt(user);
            assert!(p.starts_with(&s.system));
            assert!(p.ends_with(&format!("<|user|>{user}<|end|><|assistant|>")));
            if let Some(prev) = prompts.last() {
                assert!(p.len() > prev.len());
                assert!(
                    p.starts_with(prev.as_str()),
                    "turn prompt must extend the previous one"
                );
            }
            prompts.push(p);
            conv.push_turn(user, reply);
        }
        // Earlier turns stay verbatim; the reply is cut at the end-of-turn marker.
        let last = prompts.last().unwrap();
        assert!(last
            .contains("<|assistant|><tool_call>{\"name\": \"tool_3\"}</tool_call><|end|><|user|>"));
        assert!(!last.contains("garbage"));
        assert!(last.contains("<|assistant|>Sure.<|end|><|user|>"));
        assert!(last.contains("<|assistant|><|end|><|user|>"));
        for u in &s.users {
            assert_eq!(last.matches(&format!("<|user|>{u}<|end|>")).count(), 1);
        }
    }

    #[test]
    fn sessions_get_distinct_scripts() {
        let c = catalog();
        let (a, b) = (script(&c, 0, 2, 3), script(&c, 1, 2, 3));
        assert_ne!(a.system, b.system);
        assert_ne!(a.users, b.users);
        assert_ne!(a.users[0], a.users[1]);
    }

    fn batch(wall_s: f64, ttfts: &[f64], prompt_tokens: usize, reused: f64) -> SessionBatch {
        SessionBatch {
            wall_s,
            turns: ttfts
                .iter()
                .enumerate()
                .map(|(i, &t)| Turn {
                    session: 0,
                    turn: i,
                    ttft_s: t,
                    e2e_s: t + 1.0,
                    prompt_tokens: Some(prompt_tokens),
                    completion_tokens: 8,
                    prompt_chars: 10,
                    prompt: format!("p{i}"),
                })
                .collect(),
            foreign: None,
            reused_tokens: Some(reused),
            metrics_delta: Map::new(),
        }
    }

    #[test]
    fn summary_gives_per_turn_medians_and_ratios() {
        let reps = [
            vec![
                batch(2.0, &[0.1, 0.02], 100, 200.0),
                batch(4.0, &[0.3, 0.04], 100, 100.0),
            ],
            vec![
                batch(4.0, &[0.2, 0.08], 100, 0.0),
                batch(4.0, &[0.2, 0.08], 100, 0.0),
            ],
        ];
        let s = summary(&reps, 2);
        assert_eq!(s["per_turn"][0]["turn"], 1);
        assert!((s["per_turn"][0]["ttft_ms_p50"]["mesh"].as_f64().unwrap() - 200.0).abs() < 1e-9);
        assert!((s["per_turn"][1]["ttft_ms_p50"]["ratio"].as_f64().unwrap() - 0.375).abs() < 1e-9);
        assert_eq!(s["session_batch_wall_s"]["ratio"], 0.75);
        assert_eq!(s["session_batch_wall_s"]["pair_ratios"], json!([0.5, 1.0]));
        // 200 prompt tokens per repetition; mesh reused 200 and 100 of them.
        assert_eq!(s["reused_fraction"]["mesh"], 0.75);
        let r = rows(&s);
        assert_eq!(r.len(), 2 * 2 + 4);
        let t = report::table(&r);
        assert!(t.contains("| turn 1 | TTFT p50 (ms) | lower | 200.0 | 200.0 | 1.000 | – |"));
        assert!(t.contains(
            "| all turns | session batch wall time (s) | lower | 3.00 | 4.00 | 0.750 | 0.50 1.00 |"
        ));
    }

    #[test]
    fn llama_server_reuse_is_its_cached_counter_or_sent_minus_evaluated() {
        let mut d = Map::new();
        d.insert("llamacpp:prompt_tokens_total".into(), json!(30.0));
        assert_eq!(reused_tokens(1, &d, 100), Some(70.0));
        assert_eq!(reused_tokens(0, &d, 100), None);
        d.insert("mesh_kv_recompute_avoided_tokens_total".into(), json!(64.0));
        assert_eq!(reused_tokens(0, &d, 100), Some(64.0));
        d.insert("mesh_kv_resident_tokens_total".into(), json!(20.0));
        assert_eq!(reused_tokens(0, &d, 100), Some(84.0));
        d.insert("llamacpp:prompt_tokens_cached_total".into(), json!(66.0));
        assert_eq!(reused_tokens(1, &d, 100), Some(66.0));
    }
}
