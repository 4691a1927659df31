//! Tool routing in the gateway: a request offering many tools gets only the router's
//! top-k in its prompt (the bundled embedding model), the right tool among them, and a
//! `tool_choice` tool always stays.

use crate::common;

use mesh::config::NodeConfig;
use mesh_tiers::EngineConfig;
use serde_json::{json, Value};

fn models() -> std::path::PathBuf {
    std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../models"))
}

/// The first `n` tools of the bundled catalog, as OpenAI `tools[]` entries.
fn catalog(n: usize) -> Vec<Value> {
    std::fs::read_to_string(models().join("fixtures/catalog.jsonl"))
        .unwrap()
        .lines()
        .take(n)
        .map(|l| {
            let t: Value = serde_json::from_str(l).unwrap();
            json!({"type": "function", "function": {"name": t["name"], "description": t["description"], "parameters": t["parameters"]}})
        })
        .collect()
}

/// A node with the bundled t1 and embedding model (routes above 8 tools, top 5).
async fn node() -> (String, tokio::sync::oneshot::Sender<()>) {
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        tiers: vec![EngineConfig {
            name: "t1".into(),
            model: models().join("t1-q8_0.gguf"),
            n_ctx: 8192,
            n_seq_max: 2,
            threads: 2,
            ..EngineConfig::default()
        }],
        ..NodeConfig::default()
    };
    cfg.tool_routing.embedder.model = models().join("embed/minilm-l6-tools-f16.gguf");
    common::in_process(cfg).await
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_tools_are_routed_to_the_top_k() {
    let (base, _stop) = node().await;
    let c = reqwest::Client::new();

    let tools = catalog(60);
    assert!(tools
        .iter()
        .any(|t| t["function"]["name"] == "weather_get_forecast"));
    let ask = |tools: &[Value], choice: Option<Value>| {
        let mut b = json!({
            "model": "t1", "temperature": 0, "max_tokens": 96,
            "messages": [{"role": "user", "content": "What is the forecast for Oslo on 2026-05-01?"}],
            "tools": tools,
        });
        if let Some(c) = choice {
            b["tool_choice"] = c;
        }
        b
    };

    let v = chat(&c, &base, ask(&tools, None)).await;
    let router = &v["mesh"]["router"];
    assert_eq!(router["offered"], 60);
    let shown: Vec<&str> = router["shown"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    assert_eq!(shown.len(), 5, "{router}");
    assert!(shown.contains(&"weather_get_forecast"), "{shown:?}");
    let call = &v["choices"][0]["message"]["tool_calls"][0]["function"];
    assert_eq!(call["name"], "weather_get_forecast", "{v}");
    // The prompt held 5 schemas, not 60.
    let all = chat(&c, &base, {
        let mut b = ask(&tools[..5], None);
        b["max_tokens"] = json!(1);
        b
    })
    .await;
    assert!(
        v["usage"]["prompt_tokens"].as_u64().unwrap()
            < 2 * all["usage"]["prompt_tokens"].as_u64().unwrap()
    );

    // A forced tool stays even when the router would not pick it.
    let forced = json!({"type": "function", "function": {"name": "finance_get_stock_quote"}});
    let v = chat(&c, &base, ask(&tools, Some(forced))).await;
    let shown = v["mesh"]["router"]["shown"].as_array().unwrap().clone();
    assert_eq!(shown[0], "finance_get_stock_quote");
    assert_eq!(
        v["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
        "finance_get_stock_quote"
    );

    // Few tools: no routing.
    let v = chat(&c, &base, ask(&tools[..4], None)).await;
    assert!(v["mesh"].get("router").is_none(), "{v}");

    let metrics = common::scrape(&c, &base).await;
    assert!(
        metrics.contains(r#"mesh_tool_routing_total{outcome="routed"} 2"#),
        "{metrics}"
    );
    assert!(
        metrics.contains("mesh_tool_schemas_removed_total 110"),
        "{metrics}"
    );
}

/// Names the router kept for a reply (`mesh.router.shown`).
fn shown(v: &Value) -> Vec<String> {
    v["mesh"]["router"]["shown"]
        .as_array()
        .unwrap_or_else(|| panic!("routed: {v}"))
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_an_earlier_turn_called_stays_offered_at_a_later_step() {
    let (base, _stop) = node().await;
    let c = reqwest::Client::new();
    let tools = catalog(60);
    let weather =
        json!({"role": "user", "content": "What is the forecast for Oslo on 2026-05-01?"});
    let body = |messages: Value| json!({"model": "t1", "temperature": 0, "max_tokens": 1, "messages": messages, "tools": tools});

    // The weather question alone does not route to the stock quote tool.
    let alone = shown(&chat(&c, &base, body(json!([weather.clone()]))).await);
    assert!(
        !alone.iter().any(|t| t == "finance_get_stock_quote"),
        "{alone:?}"
    );

    // The same question after a turn that called it: the call's tool is still offered,
    // after the step's own top 5.
    let v = chat(
        &c,
        &base,
        body(json!([
            {"role": "user", "content": "What is Apple's stock price?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "finance_get_stock_quote", "arguments": "{\"symbol\": \"AAPL\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "{\"price\": 190.5}"},
            weather,
        ])),
    )
    .await;
    let later = shown(&v);
    assert_eq!(later[..5], alone[..], "the step routes on its own question");
    assert_eq!(later[5..], ["finance_get_stock_quote"]);
}
