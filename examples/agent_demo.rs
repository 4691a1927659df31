//! The main job: start a local mesh node on the bundled models and a real instruct model,
//! and run a short agent workload against its OpenAI-compatible API, printing what happened.
//!
//! ```text
//! cargo run --release -p mesh --example agent_demo -- [--tasks N] [--agents N] [--tiers t1,t2,t3,cascade,qwen05]
//! ```
//!
//! `qwen05` is Qwen2.5-Coder-0.5B-Instruct from the model pack (`mesh models pull
//! qwen2.5-coder-0.5b-instruct`; the demo pulls it on its first run, 491 MB), served with the
//! chat template and tool-call format its GGUF carries, beside the bundled tiers. After the
//! bundled tiers' workload it has everyday exchanges through both APIs: a question, its
//! tool call, the result, the answer from the result (OpenAI's chat API), and the same with
//! Anthropic's Messages API. The workload's tasks come from the bundled tiers' own corpus
//! and catalog, so it runs them only when named in `--tiers`. `--no-real-model` leaves it
//! out.
//!
//! Each agent takes a task (a user request plus the tool schemas it may use,
//! from the held-out split of the bundled corpus), asks the tier for the next
//! step, executes the tool calls it gets against a local stand-in tool, sends
//! the results back and prints the final answer. Several agents run at once,
//! so the engine batches their sequences. At the end a table compares the
//! tiers on the same tasks; `cascade` is the gateway's tier cascade (t1 first,
//! escalating when its answer is not confident), whose token count includes
//! every tier it tried.
//!
//! Then the node runs the same tasks itself (`POST /v1/agent/tasks`): the tools
//! are served by an MCP server over stdio (`scripts/mcp/catalog-server.mjs`, the
//! bundled catalog with stand-in results after 150 ms, installed by
//! `scripts/setup.sh`), the node calls them, and t1 drafts each t3 turn so that
//! read-only calls start before t3 has finished. The tasks run twice: the second
//! round is served from the read-only result cache. `--no-mcp` skips this part.

use std::time::{Duration, Instant};

use mesh::config::{bundled_tiers, models_dir, NodeConfig};
use serde_json::{json, Value};

struct Args {
    tasks: usize,
    agents: usize,
    tiers: Vec<String>,
    quiet: bool,
    mcp: bool,
    real: bool,
}

/// The real model's tier name and its pack name.
const REAL_TIER: &str = "qwen05";
const REAL_MODEL: &str = "qwen2.5-coder-0.5b-instruct";

fn args() -> Args {
    let mut a = Args {
        tasks: 12,
        agents: 4,
        tiers: vec!["t1".into(), "t2".into(), "t3".into(), "cascade".into()],
        quiet: false,
        mcp: true,
        real: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--tasks" => a.tasks = val().parse().expect("--tasks N"),
            "--agents" => a.agents = val().parse().expect("--agents N"),
            "--tiers" => a.tiers = val().split(',').map(str::to_owned).collect(),
            "--quiet" => a.quiet = true,
            "--no-mcp" => a.mcp = false,
            "--no-real-model" => a.real = false,
            "-h" | "--help" => {
                println!(
                    "agent_demo [--tasks N] [--agents N] [--tiers t1,t2,t3,cascade,qwen05] [--quiet] [--no-mcp] [--no-real-model]"
                );
                std::process::exit(0);
            }
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

/// What one agent did with one task.
struct Outcome {
    calls: Vec<Value>,
    answer: String,
    correct: bool,
    turns: usize,
    tokens: u64,
    elapsed: Duration,
}

/// The stand-in for a real tool: a deterministic result derived from the call.
fn run_tool(name: &str, args: &Value) -> Value {
    let h = blake3::hash(format!("{name}{args}").as_bytes());
    let b = h.as_bytes();
    json!({"status": "ok", "value": u16::from_le_bytes([b[0], b[1]]) % 1000, "items": b[2] % 40})
}

async fn run_task(
    http: &reqwest::Client,
    base: &str,
    tier: &str,
    task: &Value,
) -> anyhow::Result<Outcome> {
    let start = Instant::now();
    let tools: Vec<Value> = task["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| json!({"type": "function", "function": t}))
        .collect();
    let mut messages = vec![json!({"role": "user", "content": task["user"]})];
    let (mut calls, mut tokens, mut turns) = (Vec::new(), 0u64, 0usize);
    let answer = loop {
        turns += 1;
        let body = json!({"model": tier, "messages": messages, "tools": tools, "temperature": 0, "max_tokens": 160});
        let r: Value = http
            .post(format!("{base}/v1/chat/completions"))
            .json(&body)
            .send()
            .await?
            .json()
            .await?;
        if let Some(e) = r.get("error") {
            anyhow::bail!("{e}");
        }
        tokens += r["usage"]["total_tokens"].as_u64().unwrap_or(0);
        let msg = &r["choices"][0]["message"];
        let made = msg["tool_calls"].as_array().cloned().unwrap_or_default();
        if made.is_empty() || turns >= 3 {
            break msg["content"].as_str().unwrap_or("").to_owned();
        }
        messages.push(msg.clone());
        for c in made {
            let name = c["function"]["name"].as_str().unwrap_or("").to_owned();
            let args: Value =
                serde_json::from_str(c["function"]["arguments"].as_str().unwrap_or("{}"))
                    .unwrap_or(Value::Null);
            let result = run_tool(&name, &args);
            calls.push(json!({"name": name, "arguments": args}));
            messages.push(
                json!({"role": "tool", "tool_call_id": c["id"], "content": result.to_string()}),
            );
        }
    };
    let correct = match task["answer"].as_str() {
        Some(expected) => calls.is_empty() && answer.trim() == expected.trim(),
        None => calls == task["expected"].as_array().cloned().unwrap_or_default(),
    };
    Ok(Outcome {
        calls,
        answer,
        correct,
        turns,
        tokens,
        elapsed: start.elapsed(),
    })
}

/// Seconds since `./dev.sh demo` was typed (it exports `MESH_DEMO_STARTED`, Unix seconds),
/// set-up and build included; `None` when run some other way.
fn since_command() -> Option<f64> {
    let started: f64 = std::env::var("MESH_DEMO_STARTED").ok()?.parse().ok()?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?
        .as_secs_f64();
    Some((now - started).max(0.0))
}

fn short(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_owned()
    } else {
        format!("{}…", s.chars().take(n).collect::<String>())
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = args();
    let dir = models_dir();
    let tasks: Vec<Value> = std::fs::read_to_string(dir.join("fixtures/agent_tasks.jsonl"))?
        .lines()
        .take(a.tasks)
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    let mut tiers = bundled_tiers(&dir);
    tiers.retain(|t| a.tiers.contains(&t.name));
    for t in &mut tiers {
        t.threads = 1;
        t.n_seq_max = a.agents.max(1) as u32;
        t.n_ctx = 2048 * t.n_seq_max;
    }
    let mut a = a;
    if !a.real {
        a.tiers.retain(|t| t != REAL_TIER);
    }
    if a.real {
        let n_seq_max = a.agents.max(1) as u32;
        tiers.push(mesh_tiers::EngineConfig {
            name: REAL_TIER.into(),
            model: real_model().await?,
            threads: 2,
            n_seq_max,
            n_ctx: 4096 * n_seq_max,
            ..mesh_tiers::EngineConfig::default()
        });
    }
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse()?,
        tiers,
        ..NodeConfig::default()
    };
    let catalog_server =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/mcp/catalog-server.mjs");
    let mcp = a.mcp && catalog_server.exists();
    if a.mcp && !mcp {
        println!(
            "(no MCP part: {} is missing; run scripts/setup.sh)",
            catalog_server.display()
        );
    }
    if mcp {
        let mut server = mesh_control::mcp::McpServerConfig::stdio(
            "catalog",
            "node",
            &[
                catalog_server.to_str().unwrap_or_default(),
                dir.join("fixtures/catalog.jsonl")
                    .to_str()
                    .unwrap_or_default(),
                "150",
            ],
        );
        // Its 200 tools touch unrelated (stand-in) state: a booking does not change
        // a weather report, so writes need not drop the cached reads.
        server.invalidate_on_write = false;
        cfg.mcp.servers = vec![server];
    }
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let t0 = Instant::now();
    let node = mesh::start(cfg, async move {
        let _ = stop_rx.await;
    })
    .await?;
    let base = format!("http://{}", node.addr);
    println!(
        "mesh node up at {base} with tiers {:?} in {:.1}s",
        a.tiers,
        t0.elapsed().as_secs_f64()
    );
    println!(
        "workload: {} agent tasks from the held-out split, {} agents at a time, per tier\n",
        tasks.len(),
        a.agents
    );

    let http = reqwest::Client::new();
    let mut summary = Vec::new();
    let mut answered = false;
    for tier in &a.tiers {
        let started = Instant::now();
        let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(a.agents));
        let mut handles = Vec::new();
        for (i, task) in tasks.iter().cloned().enumerate() {
            let (http, base, tier, sem) = (http.clone(), base.clone(), tier.clone(), sem.clone());
            handles.push(tokio::spawn(async move {
                let _p = sem.acquire().await;
                (i, task.clone(), run_task(&http, &base, &tier, &task).await)
            }));
        }
        let (mut ok, mut toks, mut lat) = (0usize, 0u64, Vec::new());
        for h in handles {
            let (i, task, out) = h.await?;
            let out = out?;
            if !answered {
                answered = true;
                if let Some(s) = since_command() {
                    println!(
                        "first agent answer {}m {:02}s after `./dev.sh demo` started",
                        (s / 60.0) as u64,
                        (s % 60.0) as u64
                    );
                }
            }
            ok += usize::from(out.correct);
            toks += out.tokens;
            lat.push(out.elapsed.as_secs_f64());
            if !a.quiet {
                let calls: Vec<String> = out
                    .calls
                    .iter()
                    .map(|c| format!("{}({})", c["name"].as_str().unwrap_or(""), c["arguments"]))
                    .collect();
                println!(
                    "[{tier}] #{i:<2} {:<12} {}  user: {}\n      calls: {}\n      answer: {}  ({} turns, {:.0} ms)",
                    format!("{}/{}", task["kind"].as_str().unwrap_or(""), task["sub"].as_str().unwrap_or("")),
                    if out.correct { "✓" } else { "✗" },
                    short(task["user"].as_str().unwrap_or(""), 90),
                    if calls.is_empty() { "(none)".into() } else { short(&calls.join(", "), 140) },
                    short(&out.answer, 90),
                    out.turns,
                    out.elapsed.as_secs_f64() * 1e3
                );
            }
        }
        let wall = started.elapsed().as_secs_f64();
        lat.sort_by(f64::total_cmp);
        summary.push((
            tier.clone(),
            ok,
            tasks.len(),
            wall,
            toks,
            lat[lat.len() / 2],
            lat[(lat.len() * 95 / 100).min(lat.len() - 1)],
        ));
        if !a.quiet {
            println!();
        }
    }
    println!("| tier | tasks right | tasks/s | tokens (prompt+completion) | p50 task latency | p95 task latency |");
    println!("|---|---|---|---|---|---|");
    for (tier, ok, n, wall, toks, p50, p95) in &summary {
        println!(
            "| {tier} | {ok}/{n} | {:.2} | {toks} | {:.0} ms | {:.0} ms |",
            *n as f64 / wall,
            p50 * 1e3,
            p95 * 1e3
        );
    }
    let metrics = http
        .get(format!("{base}/metrics"))
        .send()
        .await?
        .text()
        .await?;
    let generated: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("mesh_generation_tokens_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    println!("\nnode metrics: {generated} tokens generated (see {base}/metrics while it runs)");
    if a.real {
        everyday(&http, &base).await?;
        everyday_anthropic(&http, &base).await?;
    }
    if mcp {
        mcp_rounds(&http, &base, &tasks, &a).await?;
    }
    let _ = stop_tx.send(());
    node.wait().await
}

/// The pack's Qwen2.5-Coder-0.5B-Instruct in the model cache, pulled (and checked) when it
/// is not there yet.
async fn real_model() -> anyhow::Result<std::path::PathBuf> {
    let m = mesh::models::pack().get(REAL_MODEL)?;
    let dir = mesh::models::cache_dir();
    if let Some(p) = m.cached(&dir) {
        return Ok(p);
    }
    println!(
        "pulling {REAL_MODEL} ({} MB) into {} (once; `--no-real-model` skips it)",
        m.download_size() / 1_000_000,
        dir.display()
    );
    Ok(mesh::models::pull(m, &mesh::models::PullOptions::from_env()).await?)
}

/// One everyday exchange with the real model: a question, the call it makes, the tool's
/// result, and the answer it gives from that result.
async fn everyday(http: &reqwest::Client, base: &str) -> anyhow::Result<()> {
    let tools = json!([{"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    let mut messages =
        vec![json!({"role": "user", "content": "What's the weather in Lisbon right now?"})];
    println!("\n{REAL_TIER} (Qwen2.5-Coder-0.5B-Instruct, its own chat template) through OpenAI's chat API:");
    println!(
        "  user:      {}",
        messages[0]["content"].as_str().unwrap_or("")
    );
    for _ in 0..2 {
        let r: Value = http
            .post(format!("{base}/v1/chat/completions"))
            .json(&json!({"model": REAL_TIER, "messages": messages, "tools": tools, "temperature": 0, "max_tokens": 96}))
            .send()
            .await?
            .json()
            .await?;
        let msg = r["choices"][0]["message"].clone();
        let Some(call) = msg["tool_calls"].get(0).cloned() else {
            println!("  assistant: {}", msg["content"].as_str().unwrap_or(""));
            break;
        };
        let args = call["function"]["arguments"].as_str().unwrap_or("{}");
        println!(
            "  call:      {}({args})",
            call["function"]["name"].as_str().unwrap_or("")
        );
        let result = json!({"city": "Lisbon", "temperature_c": 21, "condition": "sunny"});
        println!("  result:    {result}");
        messages.push(msg);
        messages.push(
            json!({"role": "tool", "tool_call_id": call["id"], "content": result.to_string()}),
        );
    }
    Ok(())
}

/// The same kind of exchange through Anthropic's Messages API: `tool_use`, then a
/// `tool_result` block answered in words.
async fn everyday_anthropic(http: &reqwest::Client, base: &str) -> anyhow::Result<()> {
    let tools = json!([{"name": "flight_status", "description": "Get the status of a flight by its number.",
        "input_schema": {"type": "object", "properties": {"flight": {"type": "string"}}, "required": ["flight"]}}]);
    let mut messages = vec![json!({"role": "user", "content": "Is the flight LH 1234 on time?"})];
    println!("\n{REAL_TIER} through Anthropic's Messages API:");
    println!(
        "  user:      {}",
        messages[0]["content"].as_str().unwrap_or("")
    );
    for _ in 0..2 {
        let r: Value = http
            .post(format!("{base}/v1/messages"))
            .json(
                &json!({"model": REAL_TIER, "max_tokens": 96, "temperature": 0,
                "messages": messages, "tools": tools}),
            )
            .send()
            .await?
            .json()
            .await?;
        let blocks = r["content"].as_array().cloned().unwrap_or_default();
        let Some(call) = blocks.iter().find(|b| b["type"] == "tool_use").cloned() else {
            let text: String = blocks.iter().filter_map(|b| b["text"].as_str()).collect();
            println!("  assistant: {text}");
            break;
        };
        println!(
            "  tool_use:  {}({})",
            call["name"].as_str().unwrap_or(""),
            call["input"]
        );
        let result = json!({"flight": "LH1234", "status": "delayed", "delay_minutes": 35});
        println!("  result:    {result}");
        messages.push(json!({"role": "assistant", "content": blocks}));
        messages.push(json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call["id"], "content": result.to_string()}]}));
    }
    Ok(())
}

/// The tasks again, run by the node with its MCP tools, twice.
async fn mcp_rounds(
    http: &reqwest::Client,
    base: &str,
    tasks: &[Value],
    a: &Args,
) -> anyhow::Result<()> {
    let model = ["t3", "t2", "cascade", "t1"]
        .into_iter()
        .find(|m| a.tiers.iter().any(|t| t == m))
        .unwrap_or("t1");
    println!(
        "\nthe same tasks as agent tasks run by the node (POST /v1/agent/tasks, model {model}, \
         tools served over MCP by catalog-server.mjs, 150 ms per call):"
    );
    println!(
        "| round | tasks | tool calls | fresh | speculative | cached | tool time saved | wall |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for round in 1..=2 {
        let t0 = Instant::now();
        let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(a.agents));
        let mut handles = Vec::new();
        for task in tasks.iter().cloned() {
            let (http, base, sem) = (http.clone(), base.to_owned(), sem.clone());
            let tools: Vec<Value> = task["tools"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|t| t["name"].clone())
                .collect();
            let body = json!({"model": model, "input": task["user"], "tools": tools, "max_turns": 3, "max_tokens": 128});
            handles.push(tokio::spawn(async move {
                let _p = sem.acquire().await;
                let r = http
                    .post(format!("{base}/v1/agent/tasks"))
                    .json(&body)
                    .send()
                    .await?;
                anyhow::Ok(r.json::<Value>().await?)
            }));
        }
        let (mut calls, mut by_source, mut saved) =
            (0, std::collections::BTreeMap::<String, usize>::new(), 0u64);
        for h in handles {
            let r = h.await??;
            if r.get("turns").is_none() {
                anyhow::bail!("agent task refused: {r}");
            }
            for c in r["turns"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|t| t["tool_calls"].as_array().cloned().unwrap_or_default())
            {
                calls += 1;
                let src = c["source"].as_str().unwrap_or("error").to_owned();
                *by_source.entry(src).or_default() += 1;
                saved += c["saved_ms"].as_u64().unwrap_or(0);
            }
        }
        let n = |k: &str| by_source.get(k).copied().unwrap_or(0);
        println!(
            "| {round} | {} | {calls} | {} | {} | {} | {saved} ms | {:.0} ms |",
            tasks.len(),
            n("fresh"),
            n("speculative"),
            n("cached"),
            t0.elapsed().as_secs_f64() * 1e3
        );
    }
    let metrics = http
        .get(format!("{base}/metrics"))
        .send()
        .await?
        .text()
        .await?;
    let spec: Vec<&str> = metrics
        .lines()
        .filter(|l| {
            l.starts_with("mesh_spec_tool_") || l.starts_with("mesh_mcp_tool_executions_total")
        })
        .collect();
    println!("\nGET /metrics:\n  {}", spec.join("\n  "));
    Ok(())
}
