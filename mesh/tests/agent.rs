//! The agent loop (`POST /v1/agent/tasks`) over a real MCP server: the reference
//! `@modelcontextprotocol/server-filesystem`, started by the node over stdio, with the
//! bundled t1 model.

use crate::common;

use std::path::{Path, PathBuf};

use mesh::config::NodeConfig;
use mesh_control::mcp::McpServerConfig;
use mesh_tiers::EngineConfig;
use serde_json::{json, Value};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn filesystem_server(dir: &Path) -> McpServerConfig {
    let js = root()
        .join(".cache/mcp/node_modules/@modelcontextprotocol/server-filesystem/dist/index.js");
    assert!(
        js.exists(),
        "{} missing: run scripts/setup.sh",
        js.display()
    );
    McpServerConfig::stdio("fs", "node", &[js.to_str().unwrap(), dir.to_str().unwrap()])
}

/// A node with the bundled t1 and the filesystem server over `dir`.
fn config(dir: &Path) -> NodeConfig {
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        tiers: vec![EngineConfig {
            name: "t1".into(),
            model: root().join("models/t1-q8_0.gguf"),
            n_ctx: 8192,
            n_seq_max: 2,
            threads: 2,
            ..EngineConfig::default()
        }],
        ..NodeConfig::default()
    };
    cfg.tool_routing.route_above = 0;
    cfg.mcp.servers = vec![filesystem_server(dir)];
    cfg
}

async fn node(dir: &Path) -> (String, tokio::sync::oneshot::Sender<()>) {
    common::in_process(config(dir)).await
}

async fn task(c: &reqwest::Client, base: &str, body: Value) -> (u16, Value) {
    let r = c
        .post(format!("{base}/v1/agent/tasks"))
        .json(&body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

/// `GET /v1/tools`.
async fn listed_tools(c: &reqwest::Client, base: &str) -> Value {
    c.get(format!("{base}/v1/tools"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

fn metric(text: &str, line_start: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_task_calls_a_real_mcp_tool_and_repeats_hit_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let dir_path = dir.path().canonicalize().unwrap();
    std::fs::write(dir_path.join("notes.txt"), "launch on friday\n").unwrap();
    let (base, _stop) = node(&dir_path).await;
    let c = reqwest::Client::new();

    // The catalog: the server's tools, with their read-only flags.
    let tools = listed_tools(&c, &base).await;
    assert_eq!(tools["servers"][0]["name"], "fs");
    assert_eq!(tools["servers"][0]["connected"], true);
    let find = |n: &str| {
        tools["tools"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == n)
            .cloned()
            .unwrap()
    };
    assert_eq!(find("list_allowed_directories")["read_only"], true);
    assert_eq!(find("write_file")["read_only"], false);

    // One task: the first turn must call list_allowed_directories (tool_choice), the
    // node runs it on the server and feeds the result back for the next turn.
    let body = json!({
        "model": "t1",
        "input": "Which folders may you read?",
        "tools": ["list_allowed_directories", "read_text_file", "write_file"],
        "tool_choice": {"type": "function", "function": {"name": "list_allowed_directories"}},
        "max_turns": 2,
        "max_tokens": 64,
    });
    let (status, t1) = task(&c, &base, body.clone()).await;
    assert_eq!(status, 200, "{t1}");
    assert!(
        ["completed", "max_turns"].contains(&t1["status"].as_str().unwrap()),
        "{t1}"
    );
    let first = &t1["turns"][0]["tool_calls"][0];
    assert_eq!(first["name"], "list_allowed_directories", "{t1}");
    assert_eq!(first["source"], "fresh");
    assert_eq!(first["is_error"], false, "{t1}");
    assert!(
        first["result"]
            .as_str()
            .unwrap()
            .contains(dir_path.to_str().unwrap()),
        "the server's answer names the allowed folder: {first}"
    );
    assert!(
        t1["turns"].as_array().unwrap().len() <= 2,
        "max_turns is 2: {t1}"
    );
    assert!(t1["usage"]["prompt_tokens"].as_u64().unwrap() > 0);

    // The same task again: the read-only result is served from the cache.
    let (status, t2) = task(&c, &base, body).await;
    assert_eq!(status, 200, "{t2}");
    let again = &t2["turns"][0]["tool_calls"][0];
    assert_eq!(again["name"], "list_allowed_directories");
    assert_eq!(again["source"], "cached", "{t2}");
    assert_eq!(again["result"], first["result"]);

    let metrics = common::scrape(&c, &base).await;
    assert!(
        metric(
            &metrics,
            "mesh_spec_tool_calls_total{outcome=\"cache_hit\"}"
        ) >= 1.0,
        "{metrics}"
    );
    assert!(
        metric(&metrics, "mesh_agent_tasks_total{status=") >= 1.0,
        "{metrics}"
    );
    // Both tasks' first calls, one execution on the server (plus whatever later turns ran).
    let executed = metric(&metrics, "mesh_mcp_tool_executions_total");
    let asked: usize = [&t1, &t2]
        .iter()
        .flat_map(|t| t["turns"].as_array().unwrap().iter())
        .map(|turn| turn["tool_calls"].as_array().unwrap().len())
        .sum();
    assert!(
        executed >= 1.0 && (executed as usize) < asked,
        "executed {executed}, asked {asked}"
    );
}

/// A task's usage says how many of its prompt tokens came from KV the tier kept, as chat's
/// does: the same task again starts from the first one's prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_reports_the_prompt_tokens_reused_from_kept_kv() {
    let dir = tempfile::tempdir().unwrap();
    let (base, _stop) = node(&dir.path().canonicalize().unwrap()).await;
    let c = reqwest::Client::new();
    let body = json!({
        "model": "t1",
        // Long enough that its prefix fills whole KV pages.
        "input": format!("{} Which folders may you read?", "The notes are kept in one folder. ".repeat(30)),
        "tools": ["list_allowed_directories"],
        "max_turns": 1,
        "max_tokens": 8,
    });
    let (status, first) = task(&c, &base, body.clone()).await;
    assert_eq!(status, 200, "{first}");
    let (status, again) = task(&c, &base, body).await;
    assert_eq!(status, 200, "{again}");
    let prompt = again["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > prompt / 2 && cached < prompt, "{again}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_agent_tasks_get_400_with_a_reason_and_streaming_reports_progress() {
    let dir = tempfile::tempdir().unwrap();
    let dir_path = dir.path().canonicalize().unwrap();
    let (base, _stop) = node(&dir_path).await;
    let c = reqwest::Client::new();

    let (s, e) = task(
        &c,
        &base,
        json!({"model": "t1", "input": "hi", "tools": ["rm_rf"]}),
    )
    .await;
    assert_eq!(s, 400);
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("unknown tool `rm_rf`") && msg.contains("read_text_file"),
        "{msg}"
    );
    let (s, e) = task(&c, &base, json!({"model": "t1"})).await;
    assert_eq!(s, 400, "{e}");
    let (s, e) = task(
        &c,
        &base,
        json!({"model": "t1", "input": "hi", "max_turns": 0}),
    )
    .await;
    assert_eq!((s, e["error"]["param"].as_str()), (400, Some("max_turns")));
    let (s, e) = task(&c, &base, json!({"model": "t9", "input": "hi"})).await;
    assert_eq!(
        (s, e["error"]["code"].as_str()),
        (404, Some("model_not_found"))
    );
    let (s, _) = task(&c, &base, json!({"model": "t1", "input": "hi", "bogus": 1})).await;
    assert_eq!(s, 400);

    // Streaming: a `turn` event, a `tool` event with the server's answer, then `done`.
    let body = json!({
        "model": "t1",
        "input": "Which folders may you read?",
        "tools": ["list_allowed_directories"],
        "tool_choice": {"type": "function", "function": {"name": "list_allowed_directories"}},
        "max_turns": 1,
        "max_tokens": 48,
        "stream": true,
    });
    let text = c
        .post(format!("{base}/v1/agent/tasks"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let events: Vec<(&str, Value)> = text
        .split("\n\n")
        .filter_map(|block| {
            let ev = block.lines().find_map(|l| l.strip_prefix("event: "))?;
            let data = block.lines().find_map(|l| l.strip_prefix("data: "))?;
            Some((ev, serde_json::from_str(data).ok()?))
        })
        .collect();
    let kinds: Vec<&str> = events.iter().map(|(k, _)| *k).collect();
    assert_eq!(kinds, ["turn", "tool", "done"], "{text}");
    assert_eq!(events[1].1["call"]["name"], "list_allowed_directories");
    assert_eq!(events[2].1["status"], "max_turns");
    assert_eq!(
        events[2].1["turns"][0]["tool_calls"][0]["name"],
        "list_allowed_directories"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catalog_file_tools_stop_the_task_for_the_client() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(&dir.path().canonicalize().unwrap());
    cfg.agent.catalog_files = vec![root().join("models/fixtures/catalog.jsonl")];
    let (base, _stop) = common::in_process(cfg).await;
    let c = reqwest::Client::new();

    let tools = listed_tools(&c, &base).await;
    assert_eq!(tools["catalog"].as_array().unwrap().len(), 200);
    assert_eq!(tools["catalog"][0]["executor"], "client");

    // The model calls a catalog tool: the node does not run it, the task stops and
    // hands the call and the conversation to the client.
    let (s, t) = task(
        &c,
        &base,
        json!({"model": "t1", "input": "What is the weather in Oslo right now?",
            "tools": ["weather_get_current_weather", "list_allowed_directories"],
            "tool_choice": {"type": "function", "function": {"name": "weather_get_current_weather"}},
            "max_turns": 3, "max_tokens": 64}),
    )
    .await;
    assert_eq!(s, 200, "{t}");
    assert_eq!(t["status"], "requires_action", "{t}");
    let call = &t["required_action"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "weather_get_current_weather");
    let messages = t["messages"].as_array().unwrap().clone();
    assert_eq!(messages.last().unwrap()["role"], "assistant");
    assert_eq!(
        t["turns"][0]["tool_calls"].as_array().unwrap().len(),
        0,
        "nothing ran on the node"
    );

    // The client answers and continues the same conversation.
    let mut messages = messages;
    messages.push(json!({"role": "tool", "tool_call_id": call["id"], "content": "{\"temp_c\": 4, \"sky\": \"rain\"}"}));
    let (s, t2) = task(
        &c,
        &base,
        json!({"model": "t1", "messages": messages, "tools": ["weather_get_current_weather", "list_allowed_directories"],
            "max_turns": 1, "max_tokens": 64}),
    )
    .await;
    assert_eq!(s, 200, "{t2}");
    assert!(
        ["completed", "requires_action"].contains(&t2["status"].as_str().unwrap()),
        "{t2}"
    );
    // Same tools, a longer conversation: the call and its result are in the prompt.
    assert!(
        t2["usage"]["prompt_tokens"].as_u64().unwrap()
            > t["usage"]["prompt_tokens"].as_u64().unwrap(),
        "{t} then {t2}"
    );
}

/// A node that routes tasks offering more than 8 tools to the top 3, with the catalog
/// file's client-side tools beside the filesystem server's.
async fn routing_node(dir: &Path) -> (String, tokio::sync::oneshot::Sender<()>) {
    let mut cfg = config(dir);
    cfg.agent.catalog_files = vec![root().join("models/fixtures/catalog.jsonl")];
    cfg.tool_routing.route_above = 8;
    cfg.tool_routing.router.top_k = 3;
    cfg.tool_routing.embedder.model = root().join("models/embed/minilm-l6-tools-f16.gguf");
    common::in_process(cfg).await
}

/// 40 client-side catalog tools and the server's list_allowed_directories, as the node
/// lists them (`GET /v1/tools`).
fn routed_entries(listed: &Value) -> Vec<Value> {
    let entries: Vec<Value> = listed["catalog"]
        .as_array()
        .unwrap()
        .iter()
        .take(40)
        .chain(
            listed["tools"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|t| t["name"] == "list_allowed_directories"),
        )
        .cloned()
        .collect();
    assert_eq!(entries.len(), 41);
    entries
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_agent_step_is_routed_and_keeps_the_tools_it_called() {
    let dir = tempfile::tempdir().unwrap();
    let (base, _stop) = routing_node(&dir.path().canonicalize().unwrap()).await;
    let c = reqwest::Client::new();
    let input = "What is the weather in Oslo right now?";
    let entries = routed_entries(&listed_tools(&c, &base).await);
    let names: Vec<&Value> = entries.iter().map(|t| &t["name"]).collect();

    // Routed on the task's text alone, the folder tool is not among the top 3.
    let specs: Vec<Value> = entries
        .iter()
        .map(|t| {
            json!({"type": "function", "function": {"name": t["name"],
            "description": t["description"], "parameters": t["parameters"]}})
        })
        .collect();
    let r = c
        .post(format!("{base}/v1/chat/completions"))
        .json(&json!({"model": "t1", "max_tokens": 1, "tools": specs,
            "messages": [{"role": "user", "content": input}]}))
        .send()
        .await
        .unwrap();
    let v: Value = r.json().await.unwrap();
    let alone = v["mesh"]["router"]["shown"].as_array().unwrap().clone();
    assert!(!alone.contains(&json!("list_allowed_directories")), "{v}");

    // Turn 1 must call the folder tool (the node runs it); turn 2 is routed again and
    // still offers it.
    let (s, t) = task(
        &c,
        &base,
        json!({"model": "t1", "input": input, "tools": names,
            "tool_choice": {"type": "function", "function": {"name": "list_allowed_directories"}},
            "max_turns": 2, "max_tokens": 48}),
    )
    .await;
    assert_eq!(s, 200, "{t}");
    assert_eq!(
        t["turns"][0]["tool_calls"][0]["name"], "list_allowed_directories",
        "{t}"
    );
    let second = t["turns"][1]["tools_shown"]
        .as_array()
        .unwrap_or_else(|| panic!("turn 2 was routed: {t}"));
    assert!(
        second.contains(&json!("list_allowed_directories")),
        "{second:?}"
    );
    assert_eq!(
        second.len(),
        4,
        "turn 1's three (its top 2 and the forced tool) and turn 2's other routed tool: {second:?}"
    );
}

/// A routed turn lists the tools the turn before it listed first, in the same order, and
/// its new ones after them, so its prompt starts with the previous turn's and reuses its KV
/// (both turns are in the scope of the offered tools, not of the tools each one shows). On a
/// fresh node every cached token of the task is turn 2 reusing turn 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routed_turn_lists_the_previous_turns_tools_first_and_reuses_its_prompt() {
    let dir = tempfile::tempdir().unwrap();
    let (base, _stop) = routing_node(&dir.path().canonicalize().unwrap()).await;
    let c = reqwest::Client::new();
    let entries = routed_entries(&listed_tools(&c, &base).await);
    let names: Vec<&Value> = entries.iter().map(|t| &t["name"]).collect();
    let (s, t) = task(
        &c,
        &base,
        json!({"model": "t1", "input": "What is the weather in Oslo right now?", "tools": names,
            "tool_choice": {"type": "function", "function": {"name": "list_allowed_directories"}},
            "max_turns": 2, "max_tokens": 48}),
    )
    .await;
    assert_eq!(s, 200, "{t}");
    let shown = |turn: usize| {
        t["turns"][turn]["tools_shown"]
            .as_array()
            .unwrap_or_else(|| panic!("turn {} was routed: {t}", turn + 1))
            .clone()
    };
    let (first, second) = (shown(0), shown(1));
    assert!(
        second.len() > first.len() && second.starts_with(&first),
        "turn 2 routed to other tools lists turn 1's first: {first:?} then {second:?}"
    );
    let cached = t["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 0, "turn 2 reused turn 1's prompt: {t}");
}
