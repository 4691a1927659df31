//! Gateway behaviour against a real node (bundled t1 model) started in-process, one
//! behaviour per test. The tests that need nothing of the node's counters share one node
//! started once for this test binary ([`shared`]); the others start their own.

use crate::common;

use std::sync::OnceLock;
use std::time::Duration;

use futures::StreamExt;
use mesh::config::NodeConfig;
use mesh_tiers::EngineConfig;
use serde_json::{json, Value};

fn models() -> std::path::PathBuf {
    std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../models"))
}

async fn node(max_concurrent: usize, n_seq_max: u32) -> (String, tokio::sync::oneshot::Sender<()>) {
    let cfg = NodeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        max_concurrent,
        tiers: vec![EngineConfig {
            name: "t1".into(),
            model: models().join("t1-q8_0.gguf"),
            n_ctx: 4096,
            n_seq_max,
            threads: 2,
            ..EngineConfig::default()
        }],
        ..NodeConfig::default()
    };
    common::in_process(cfg).await
}

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "weather_get_forecast", "description": "Get the forecast by city and date.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}, "date": {"type": "string", "description": "Date as YYYY-MM-DD"}}, "required": ["city", "date"]}}},
        {"type": "function", "function": {"name": "finance_get_stock_quote", "description": "Get the stock quote by ticker.",
          "parameters": {"type": "object", "properties": {"ticker": {"type": "string", "description": "Stock ticker symbol"}}, "required": ["ticker"]}}},
        {"type": "function", "function": {"name": "email_send_email", "description": "Send the email by recipient and topic.",
          "parameters": {"type": "object", "properties": {"recipient": {"type": "string", "description": "Recipient name"}, "topic": {"type": "string", "description": "Topic or title"}}, "required": ["recipient", "topic"]}}}
    ])
}

async fn post(
    c: &reqwest::Client,
    url: String,
    body: Value,
) -> (u16, reqwest::header::HeaderMap, Value) {
    let r = c.post(url).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    let v = r.json::<Value>().await.unwrap_or(Value::Null);
    (status, headers, v)
}

/// The node the behaviour tests share: 16 requests in flight, 4 sequences.
fn shared() -> String {
    static NODE: OnceLock<String> = OnceLock::new();
    common::shared_node(&NODE, || {
        let mut cfg = NodeConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            max_concurrent: 16,
            tiers: vec![EngineConfig {
                name: "t1".into(),
                model: models().join("t1-q8_0.gguf"),
                n_ctx: 4096,
                n_seq_max: 4,
                threads: 2,
                ..EngineConfig::default()
            }],
            embeddings: vec![minilm()],
            ..NodeConfig::default()
        };
        cfg.tool_routing.route_above = 0;
        cfg
    })
}

/// all-MiniLM-L6-v2 (f16, converted by `scripts/setup.sh`) served as `minilm`.
fn minilm() -> mesh::config::EmbeddingModel {
    mesh::config::EmbeddingModel {
        name: "minilm".into(),
        model: models().join("embed/all-minilm-l6-v2-f16.gguf"),
        max_text_tokens: 64,
        ..mesh::config::EmbeddingModel::default()
    }
}

async fn embed(base: &str, body: Value) -> (u16, Value) {
    let (status, _, v) = post(
        &reqwest::Client::new(),
        format!("{base}/v1/embeddings"),
        body,
    )
    .await;
    (status, v)
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("an array of floats")
        .iter()
        .map(|x| x.as_f64().expect("a float") as f32)
        .collect()
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn chat_url() -> String {
    format!("{}/v1/chat/completions", shared())
}

fn forecast_request() -> Value {
    json!({"model": "t1", "temperature": 0,
        "messages": [{"role": "user", "content": "What is the forecast in Oslo on 2026-05-01?"}],
        "tools": weather_tools()})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_ready_and_the_model_list_answer() {
    let (base, c) = (shared(), reqwest::Client::new());
    let status = |path: &str| {
        let (c, url) = (c.clone(), format!("{base}{path}"));
        async move { c.get(url).send().await.unwrap().status().as_u16() }
    };
    assert_eq!(status("/health").await, 200);
    assert_eq!(status("/ready").await, 200);
    let models: Value = c
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert!(ids.contains(&"t1"), "{ids:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_call_comes_back_as_openai_tool_calls_with_json_string_arguments() {
    let c = reqwest::Client::new();
    let (s, _, v) = post(&c, chat_url(), forecast_request()).await;
    assert_eq!(s, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "weather_get_forecast");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Oslo", "date": "2026-05-01"}));
    assert_eq!(v["mesh"]["tier"], "t1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_totals_add_up() {
    let c = reqwest::Client::new();
    let (s, _, v) = post(&c, chat_url(), forecast_request()).await;
    assert_eq!(s, 200, "{v}");
    let usage = &v["usage"];
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(
            usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_turn_after_a_tool_result_answers_from_it() {
    let c = reqwest::Client::new();
    let follow = json!({"model": "t1", "temperature": 0, "tools": weather_tools(), "messages": [
        {"role": "user", "content": "What is the forecast in Oslo on 2026-05-01?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather_get_forecast", "arguments": "{\"city\": \"Oslo\", \"date\": \"2026-05-01\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"status\": \"ok\", \"value\": 17, \"items\": 3}"}]});
    let (s, _, v) = post(&c, chat_url(), follow).await;
    assert_eq!(s, 200);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text.contains("17"), "answer uses the tool result: {text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_gives_the_same_call_in_chunks_ending_with_usage_and_done() {
    let c = reqwest::Client::new();
    let mut sbody = forecast_request();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let resp = c.post(chat_url()).json(&sbody).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let raw = resp.text().await.unwrap();
    let events: Vec<&str> = raw
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(*events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed_call = chunks
        .iter()
        .find_map(|c| {
            c["choices"][0]["delta"]["tool_calls"][0]
                .as_object()
                .cloned()
        })
        .expect("a tool_calls delta");
    assert_eq!(streamed_call["function"]["name"], "weather_get_forecast");
    assert_eq!(streamed_call["index"], 0);
    assert!(chunks
        .iter()
        .any(|c| c["choices"][0]["finish_reason"] == "tool_calls"));
    assert!(
        chunks.last().unwrap()["usage"]["completion_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_completions_take_a_raw_prompt() {
    let c = reqwest::Client::new();
    let (s, _, v) = post(&c, format!("{}/v1/completions", shared()), json!({"model": "t1", "prompt": "<|user|>Hello!<|end|><|assistant|>", "max_tokens": 5, "temperature": 0, "ignore_eos": true})).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_json_is_a_400_saying_so() {
    let c = reqwest::Client::new();
    let r = c.post(chat_url()).body("{not json").send().await.unwrap();
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["type"], "invalid_request_error");
    assert!(e["error"]["message"]
        .as_str()
        .unwrap()
        .contains("invalid request body"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_messages_is_a_400_naming_them() {
    let c = reqwest::Client::new();
    let (s, _, e) = post(&c, chat_url(), json!({"model": "t1"})).await;
    assert_eq!(s, 400);
    assert!(
        e["error"]["message"].as_str().unwrap().contains("messages"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_model_is_a_404_model_not_found() {
    let c = reqwest::Client::new();
    let (s, _, e) = post(
        &c,
        chat_url(),
        json!({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(s, 404);
    assert_eq!(e["error"]["code"], "model_not_found");
}

/// `(status, param)` of a chat request for t1 with `extra` fields.
async fn refused_on(extra: Value) -> (u16, Option<String>) {
    let c = reqwest::Client::new();
    let mut body = json!({"model": "t1", "messages": [{"role": "user", "content": "hi"}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let (s, _, e) = post(&c, chat_url(), body).await;
    (s, e["error"]["param"].as_str().map(str::to_owned))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_role_is_a_400_naming_the_message() {
    assert_eq!(
        refused_on(json!({"messages": [{"role": "wizard", "content": "hi"}]})).await,
        (400, Some("messages[0].role".into()))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_than_one_choice_is_a_400_on_n() {
    assert_eq!(refused_on(json!({"n": 2})).await, (400, Some("n".into())));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_out_of_range_temperature_is_a_400_on_temperature() {
    assert_eq!(
        refused_on(json!({"temperature": 7})).await,
        (400, Some("temperature".into()))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_choice_naming_a_missing_tool_is_a_400_on_tool_choice() {
    assert_eq!(
        refused_on(json!({"tool_choice": {"type": "function", "function": {"name": "missing"}}, "tools": weather_tools()})).await,
        (400, Some("tool_choice".into()))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_over_the_context_is_context_length_exceeded() {
    let c = reqwest::Client::new();
    let long = "word ".repeat(3000);
    let (s, _, e) = post(
        &c,
        chat_url(),
        json!({"model": "t1", "messages": [{"role": "user", "content": long}]}),
    )
    .await;
    assert_eq!(
        (s, e["error"]["code"].as_str()),
        (400, Some("context_length_exceeded"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_budget_over_the_context_is_context_length_exceeded() {
    let c = reqwest::Client::new();
    let (s, _, e) = post(
        &c,
        chat_url(),
        json!({"model": "t1", "max_tokens": 4000, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(
        (s, e["error"]["code"].as_str()),
        (400, Some("context_length_exceeded"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_prometheus_text_with_request_and_latency_series() {
    let (base, c) = (shared(), reqwest::Client::new());
    // One served request and one 404, counted before the scrape.
    let (s, _, _) = post(&c, chat_url(), forecast_request()).await;
    assert_eq!(s, 200);
    let (s, _, _) = post(
        &c,
        chat_url(),
        json!({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(s, 404);
    let m = common::scrape(&c, &base).await;
    for name in [
        "mesh_http_requests_total",
        "mesh_time_to_first_token_seconds_bucket",
        "mesh_inter_token_latency_seconds_bucket",
        "mesh_generation_tokens_total",
        "mesh_active_sequences",
        "mesh_actor_restarts_total",
    ] {
        assert!(m.contains(name), "missing {name}");
    }
    assert!(m.contains("status=\"404\""));
}

/// Every engine step lands once in `mesh_tier_step_duration_seconds`, under its kind: the
/// step that ends the prompt and publishes its pages is the one `publish` step, the tokens
/// after it come from `decode` steps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_engine_step_is_timed_once_under_its_kind() {
    let (base, _stop) = node(4, 2).await;
    let c = reqwest::Client::new();
    let mut req = forecast_request();
    req["max_tokens"] = json!(6);
    let (s, _, v) = post(&c, format!("{base}/v1/chat/completions"), req).await;
    assert_eq!(s, 200, "{v}");
    let count = |m: &str, kind: &str| {
        metric(
            m,
            &format!("mesh_tier_step_duration_seconds_count{{model=\"t1\",kind=\"{kind}\"}}"),
        )
    };
    let timed = |m: &str| count(m, "decode") + count(m, "prefill") + count(m, "publish");
    // The last token reaches the client before its step's time is recorded, so the scrape
    // waits (a bounded while) for the engine to finish that step.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let m = loop {
        let m = common::scrape(&c, &base).await;
        if timed(&m) == metric(&m, "mesh_tier_steps_total") || std::time::Instant::now() > deadline
        {
            break m;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(count(&m, "publish"), 1.0, "{m}");
    assert!(count(&m, "decode") >= 1.0, "{m}");
    assert_eq!(timed(&m), metric(&m, "mesh_tier_steps_total"), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_gets_429_and_disconnect_frees_the_sequence() {
    let (base, _stop) = node(1, 1).await;
    let c = reqwest::Client::new();
    let url = format!("{base}/v1/completions");
    let long = json!({"model": "t1", "prompt": "<|user|>Hello!<|end|><|assistant|>", "max_tokens": 1500, "ignore_eos": true, "stream": true});
    // One streaming request holds the only permit.
    let resp = c.post(url.clone()).json(&long).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.bytes_stream();
    let first = body.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    let r = c
        .post(url.clone())
        .json(&json!({"model": "t1", "prompt": "hi", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["type"], "rate_limit_error");

    // The client goes away mid-stream: the sequence is cancelled and the permit returns.
    drop(body);
    let mut ok = false;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let r = c
            .post(url.clone())
            .json(&json!({"model": "t1", "prompt": "hi", "max_tokens": 2, "temperature": 0}))
            .send()
            .await
            .unwrap();
        if r.status() == 200 {
            ok = true;
            break;
        }
    }
    assert!(ok, "the slot never came free after the client left");
    let m = common::scrape(&c, &base).await;
    let cancelled = m
        .lines()
        .find(|l| l.starts_with("mesh_cancelled_requests{"))
        .unwrap();
    assert!(cancelled.ends_with(" 1"), "{cancelled}");
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Requests that reused a prefix: restored from pages or kept in their slot.
fn prefix_reuses(text: &str) -> f64 {
    metric(text, "mesh_kv_prefix_hits_total") + metric(text, "mesh_kv_resident_hits_total")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_with_the_same_tools_share_prefix_pages() {
    let (base, _stop) = node(8, 4).await;
    let c = reqwest::Client::new();
    let ask = |city: &str, tools: Value| {
        json!({"model": "t1", "max_tokens": 16, "tools": tools,
               "messages": [{"role": "user", "content": format!("What is the forecast in {city} for 2026-05-01?")}]})
    };
    let (s, _, first) = post(
        &c,
        format!("{base}/v1/chat/completions"),
        ask("Oslo", weather_tools()),
    )
    .await;
    assert_eq!(s, 200);
    let m0 = common::scrape(&c, &base).await;
    assert_eq!(prefix_reuses(&m0), 0.0);
    assert!(metric(&m0, "mesh_kv_pages_published_total") > 0.0, "{m0}");
    // This host has no far memory: the tier is reported absent and has no rows of its own.
    assert!(
        m0.lines().any(|l| l == "mesh_kv_far_memory_nodes 0"),
        "{m0}"
    );
    assert!(!m0.contains("tier=\"far\""), "{m0}");
    // Hardware counters: where the kernel gives perf events they counted the requests so
    // far; where it gives none (this VM) they are reported unavailable, with no series.
    let hw = m0
        .lines()
        .find(|l| l.starts_with("mesh_hw_counters_available{"))
        .unwrap_or_else(|| panic!("no hw availability: {m0}"));
    if hw.ends_with(" 1") {
        assert!(metric(&m0, "mesh_hw_instructions_total") > 0.0, "{m0}");
    } else {
        assert!(hw.ends_with(" 0"), "{hw}");
        assert!(
            !m0.contains("mesh_hw_instructions_total"),
            "absent, not zero: {m0}"
        );
    }
    // Same tools, another question: the shared prefix (tool schemas) is reused (kept in
    // the slot the first request left, or restored from pages).
    let (s, _, _) = post(
        &c,
        format!("{base}/v1/chat/completions"),
        ask("Lima", weather_tools()),
    )
    .await;
    assert_eq!(s, 200);
    let m1 = common::scrape(&c, &base).await;
    assert_eq!(prefix_reuses(&m1), 1.0, "{m1}");
    assert!(
        metric(&m1, "mesh_kv_recompute_avoided_tokens_total")
            + metric(&m1, "mesh_kv_resident_tokens_total")
            >= 32.0,
        "{m1}"
    );
    // The same request again gives the same answer from reused KV.
    let (_, _, again) = post(
        &c,
        format!("{base}/v1/chat/completions"),
        ask("Oslo", weather_tools()),
    )
    .await;
    assert_eq!(
        again["choices"][0]["message"]["tool_calls"][0]["function"],
        first["choices"][0]["message"]["tool_calls"][0]["function"]
    );
    assert_eq!(
        again["choices"][0]["message"]["content"],
        first["choices"][0]["message"]["content"]
    );
    // Another tool set (a subset of the same schemas) is another scope: no reuse across scopes.
    let hits_before = prefix_reuses(&common::scrape(&c, &base).await);
    let fewer = json!([weather_tools()[0].clone(), weather_tools()[1].clone()]);
    let (s, _, _) = post(
        &c,
        format!("{base}/v1/chat/completions"),
        ask("Oslo", fewer),
    )
    .await;
    assert_eq!(s, 200);
    let m2 = common::scrape(&c, &base).await;
    assert_eq!(
        prefix_reuses(&m2),
        hits_before,
        "KV crossed a tool-access scope"
    );
    assert!(
        m2.contains("mesh_kv_page_bytes{model=\"t1\",tier=\"ram\"}"),
        "{m2}"
    );

    // The Grafana dashboard only queries series this node exports.
    let dash = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/grafana-mesh.json"
    ))
    .unwrap();
    let mut names: Vec<String> = vec![];
    let mut rest = dash.as_str();
    while let Some(i) = rest.find("mesh_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.push(tail[..end].to_owned());
        rest = &tail[end..];
    }
    names.sort();
    names.dedup();
    assert!(names.len() >= 10, "{names:?}");
    for n in &names {
        let series = n.strip_suffix("_bucket").unwrap_or(n);
        assert!(
            m2.lines().any(|l| l.starts_with(series)),
            "dashboard queries {n}, which /metrics lacks"
        );
    }
}

fn story(extra: Value) -> Value {
    let mut body = json!({"model": "t1", "max_tokens": 24, "ignore_eos": true,
        "prompt": "<|user|>Tell me a short story about a lighthouse.<|end|><|assistant|>"});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn completions_url(base: &str) -> String {
    format!("{base}/v1/completions")
}

/// The generated text (24 tokens: never empty).
fn text_of(v: &Value) -> String {
    let t = v["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no text: {v}"));
    assert!(!t.is_empty(), "{v}");
    t.to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unseeded_sampled_requests_get_seeds_of_their_own() {
    let c = reqwest::Client::new();
    let mut seeds = std::collections::HashSet::new();
    let mut texts = std::collections::HashSet::new();
    for _ in 0..4 {
        let url = completions_url(&shared());
        let (status, _, v) = post(&c, url, story(json!({"temperature": 1.0}))).await;
        assert_eq!(status, 200, "{v}");
        seeds.insert(v["mesh"]["seed"].as_u64().expect("mesh.seed"));
        texts.insert(text_of(&v));
    }
    assert_eq!(seeds.len(), 4, "{seeds:?}");
    assert!(
        texts.len() > 1,
        "four unseeded requests drew the same text: {texts:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sending_the_seed_back_repeats_the_draws() {
    // A node of its own: no other sequence shares its batches.
    let (base, _stop) = node(4, 1).await;
    let url = completions_url(&base);
    let c = reqwest::Client::new();
    let (status, _, first) = post(&c, url.clone(), story(json!({"temperature": 1.0}))).await;
    assert_eq!(status, 200, "{first}");
    let seed = first["mesh"]["seed"].as_u64().expect("mesh.seed");
    let (_, _, again) = post(&c, url, story(json!({"temperature": 1.0, "seed": seed}))).await;
    assert_eq!(again["mesh"]["seed"].as_u64(), Some(seed));
    assert_eq!(text_of(&again), text_of(&first));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_greedy_response_names_no_seed() {
    let c = reqwest::Client::new();
    let url = completions_url(&shared());
    let (status, _, v) = post(&c, url, story(json!({"temperature": 0}))).await;
    assert_eq!(status, 200, "{v}");
    assert!(v["mesh"].get("seed").is_none(), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_reports_its_reused_tokens_as_cached_tokens() {
    let c = reqwest::Client::new();
    let body = json!({"model": "t1", "temperature": 0, "max_tokens": 4,
        "messages": [{"role": "user", "content":
            format!("Ledger 7731. {} Total?", "Item forty-two costs nine coins. ".repeat(30))}]});
    let (s, _, first) = post(&c, chat_url(), body.clone()).await;
    assert_eq!(s, 200, "{first}");
    let (s, _, second) = post(&c, chat_url(), body).await;
    assert_eq!(s, 200, "{second}");
    let prompt = second["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > prompt / 2 && cached < prompt, "{second}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_come_one_per_input_in_order() {
    let (status, v) = embed(
        &shared(),
        json!({"model": "minilm", "input": [
            "What will the weather be like in Paris tomorrow?",
            "Get the weather forecast for a city and a date.",
            "Send an email to a colleague."]}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let data = v["data"].as_array().expect("data");
    let vecs: Vec<Vec<f32>> = data.iter().map(|d| floats(&d["embedding"])).collect();
    assert_eq!(
        data.iter()
            .map(|d| d["index"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [0, 1, 2]
    );
    assert!(vecs.iter().all(|e| e.len() == 384));
    // The question is nearer the forecast tool than the email one: the order held.
    assert!(dot(&vecs[0], &vecs[1]) > dot(&vecs[0], &vecs[2]) + 0.1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_report_the_tokens_read() {
    let (status, v) = embed(
        &shared(),
        json!({"model": "minilm", "input": "hello world"}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    // [CLS] hello world [SEP]
    assert_eq!(v["usage"]["prompt_tokens"], 4, "{v}");
    assert_eq!(v["usage"]["total_tokens"], 4);
    assert_eq!(v["model"], "minilm");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_in_base64_are_the_same_floats() {
    let base = shared();
    let (_, f) = embed(&base, json!({"model": "minilm", "input": "a tool router"})).await;
    let (status, b) = embed(
        &base,
        json!({"model": "minilm", "input": "a tool router", "encoding_format": "base64"}),
    )
    .await;
    assert_eq!(status, 200, "{b}");
    use base64::Engine as _;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b["data"][0]["embedding"].as_str().expect("a base64 string"))
        .expect("base64");
    let decoded: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(decoded, floats(&f["data"][0]["embedding"]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_embedding_model_is_404() {
    let (status, v) = embed(&shared(), json!({"model": "t1", "input": "hi"})).await;
    assert_eq!(status, 404, "{v}");
    assert_eq!(v["error"]["param"], "model");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedding_input_over_the_limit_is_refused_not_cut() {
    let long = "word ".repeat(100);
    let (status, v) = embed(&shared(), json!({"model": "minilm", "input": ["ok", long]})).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "input");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("input 1") && msg.contains("at most 64"),
        "{msg}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedding_models_are_listed_as_such() {
    let v: Value = reqwest::get(format!("{}/v1/models", shared()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let m = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == "minilm")
        .expect("minilm listed");
    assert_eq!(m["meta"]["embedding"], true, "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_are_served_again_after_the_actor_crashes() {
    const TOKEN: &str = "embeddings-crash-test-token";
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        tiers: vec![EngineConfig {
            name: "t1".into(),
            model: models().join("t1-q8_0.gguf"),
            n_ctx: 1024,
            n_seq_max: 1,
            threads: 1,
            ..EngineConfig::default()
        }],
        embeddings: vec![minilm()],
        fault_token: Some(TOKEN.into()),
        ..NodeConfig::default()
    };
    cfg.tool_routing.route_above = 0;
    let (base, _stop) = common::in_process(cfg).await;
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/debug/crash"))
        .header("x-mesh-fault-token", TOKEN)
        .json(&json!({"actor": "embeddings"}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    // While the supervisor restarts it, calls get 503; then 200.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (status, v) = embed(
            &base,
            json!({"model": "minilm", "input": "after the crash"}),
        )
        .await;
        if status == 200 {
            assert_eq!(floats(&v["data"][0]["embedding"]).len(), 384);
            break;
        }
        assert_eq!(status, 503, "{v}");
        assert!(
            std::time::Instant::now() < deadline,
            "not served again within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
