//! The tier cascade and the reasoning governor through the gateway, on the bundled
//! t1 and t2 models: which tier answers follows the policy's thresholds, the kept
//! answer is exactly that tier's own answer, streaming replays it, and a reasoning
//! budget closes the think block.

use crate::common;

use futures::StreamExt;
use mesh::config::NodeConfig;
use mesh_tiers::cascade::CascadePolicy;
use mesh_tiers::EngineConfig;
use serde_json::{json, Value};

fn models() -> std::path::PathBuf {
    std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../models"))
}

async fn node(min_margin: f32) -> (String, tokio::sync::oneshot::Sender<()>) {
    node_with(min_margin, 0.0).await
}

async fn node_with(
    min_margin: f32,
    min_router_score: f32,
) -> (String, tokio::sync::oneshot::Sender<()>) {
    let tier = |name: &str| EngineConfig {
        name: name.into(),
        model: models().join(format!("{name}-q8_0.gguf")),
        n_ctx: 4096,
        n_seq_max: 2,
        threads: 2,
        ..EngineConfig::default()
    };
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        tiers: vec![tier("t1"), tier("t2")],
        cascade: CascadePolicy {
            tiers: vec!["t1".into(), "t2".into()],
            min_margin: vec![min_margin],
            min_router_score,
            ..CascadePolicy::default()
        },
        ..NodeConfig::default()
    };
    cfg.tool_routing.embedder.model = models().join("embed/minilm-l6-tools-f16.gguf");
    common::in_process(cfg).await
}

fn request(model: &str) -> Value {
    json!({
        "model": model,
        "temperature": 0,
        "max_tokens": 96,
        "messages": [{"role": "user", "content": "What is the forecast for Oslo on 2026-05-01?"}],
        "tools": [
            {"type": "function", "function": {"name": "weather_get_forecast", "description": "Get the forecast by city and date.",
              "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}, "date": {"type": "string", "description": "Date as YYYY-MM-DD"}}, "required": ["city", "date"]}}},
            {"type": "function", "function": {"name": "finance_get_stock_quote", "description": "Get the stock quote by ticker.",
              "parameters": {"type": "object", "properties": {"ticker": {"type": "string", "description": "Stock ticker symbol"}}, "required": ["ticker"]}}}
        ]
    })
}

async fn chat(c: &reqwest::Client, base: &str, body: Value) -> Value {
    let r = c
        .post(format!("{base}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

fn message(v: &Value) -> &Value {
    &v["choices"][0]["message"]
}

fn steps(v: &Value) -> Vec<(String, String)> {
    v["mesh"]["cascade"]
        .as_array()
        .expect("cascade steps")
        .iter()
        .map(|s| {
            (
                s["tier"].as_str().unwrap().to_owned(),
                s["verdict"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cascade_keeps_the_first_confident_tier() {
    let c = reqwest::Client::new();

    // A threshold no answer can meet: t1 escalates, t2 (the last tier) answers.
    let (strict, _s1) = node(1.0e6).await;
    let models: Value = c
        .get(format!("{strict}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(models["data"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["id"] == "cascade"));
    let v = chat(&c, &strict, request("cascade")).await;
    assert_eq!(v["model"], "cascade");
    assert_eq!(v["mesh"]["tier"], "t2");
    assert_eq!(
        steps(&v),
        vec![
            ("t1".into(), "low_margin".into()),
            ("t2".into(), "last_tier".into())
        ]
    );
    let direct = chat(&c, &strict, request("t2")).await;
    assert_eq!(
        message(&v)["tool_calls"][0]["function"],
        message(&direct)["tool_calls"][0]["function"]
    );
    // Usage counts both tiers' tokens.
    assert!(
        v["usage"]["completion_tokens"].as_u64() > direct["usage"]["completion_tokens"].as_u64()
    );

    // Streaming replays the kept answer.
    let mut body = request("cascade");
    body["stream"] = json!(true);
    let r = c
        .post(format!("{strict}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut sse = String::new();
    let mut s = r.bytes_stream();
    while let Some(b) = s.next().await {
        sse.push_str(&String::from_utf8_lossy(&b.unwrap()));
    }
    assert!(
        sse.contains("weather_get_forecast") && sse.contains("[DONE]"),
        "{sse}"
    );

    let metrics = common::scrape(&c, &strict).await;
    assert!(
        metrics.contains(r#"mesh_cascade_steps_total{tier="t1",verdict="low_margin"} 2"#),
        "{metrics}"
    );

    // No threshold: t1's well-formed call is kept, and it is t1's own answer.
    let (lenient, _s2) = node(0.0).await;
    let v = chat(&c, &lenient, request("cascade")).await;
    assert_eq!(v["mesh"]["tier"], "t1");
    assert_eq!(steps(&v), vec![("t1".into(), "accept".into())]);
    let direct = chat(&c, &lenient, request("t1")).await;
    assert_eq!(
        message(&v)["tool_calls"][0]["function"],
        message(&direct)["tool_calls"][0]["function"]
    );
    assert_eq!(
        v["usage"]["completion_tokens"],
        direct["usage"]["completion_tokens"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_budget_caps_thinking() {
    let c = reqwest::Client::new();
    let (base, _stop) = node(0.0).await;
    let hard = |budget: Option<u64>| {
        let mut b = json!({
            "model": "t1",
            "temperature": 0,
            "max_tokens": 96,
            "messages": [{"role": "user", "content": "Check the pantry stock quantity 47 times 17 matching contract."}],
            "tools": [{"type": "function", "function": {"name": "kitchen_check_pantry_stock", "description": "Check the pantry stock by query.",
                "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "Search keywords"}, "count": {"type": "integer", "description": "How many"}}, "required": ["query"]}}}]
        });
        if let Some(n) = budget {
            b["reasoning_budget"] = json!(n);
        }
        b
    };
    let free = chat(&c, &base, hard(None)).await;
    let thought = free["usage"]["completion_tokens_details"]["reasoning_tokens"]
        .as_u64()
        .unwrap();
    assert!(thought > 4, "the model reasons first: {free}");
    assert_eq!(free["mesh"]["reasoning_capped"], false);

    let capped = chat(&c, &base, hard(Some(2))).await;
    assert_eq!(
        capped["usage"]["completion_tokens_details"]["reasoning_tokens"],
        2
    );
    assert_eq!(capped["mesh"]["reasoning_capped"], true);
    assert!(message(&capped)["reasoning_content"].is_string());
    // The model still commits to a call after the closed think block.
    assert_eq!(
        message(&capped)["tool_calls"][0]["function"]["name"],
        "kitchen_check_pantry_stock"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn low_router_confidence_skips_the_first_tier() {
    let c = reqwest::Client::new();
    // No cosine reaches 2: every routed request starts at t2.
    let (base, _stop) = node_with(0.0, 2.0).await;
    let tools: Vec<Value> = std::fs::read_to_string(models().join("fixtures/catalog.jsonl"))
        .unwrap()
        .lines()
        .take(30)
        .map(|l| {
            let t: Value = serde_json::from_str(l).unwrap();
            json!({"type": "function", "function": {"name": t["name"], "description": t["description"], "parameters": t["parameters"]}})
        })
        .collect();
    let mut body = request("cascade");
    body["tools"] = json!(tools);
    let v = chat(&c, &base, body).await;
    assert_eq!(v["mesh"]["router"]["offered"], 30);
    assert_eq!(
        steps(&v),
        vec![
            ("t1".into(), "low_router_score".into()),
            ("t2".into(), "last_tier".into())
        ]
    );
    // Few tools: no router score, the cascade starts at t1 as usual.
    let v = chat(&c, &base, request("cascade")).await;
    assert_eq!(steps(&v)[0].0, "t1");
    assert_ne!(steps(&v)[0].1, "low_router_score");
}
