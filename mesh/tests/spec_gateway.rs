//! Speculative decoding through the gateway: a node whose t3 has t1 as its draft
//! (`draft = "t1"`) answers chat completions exactly as a node without the draft,
//! streamed and not, reports the drafted and accepted tokens per response and in
//! `mesh_spec_*_tokens_total`; requests with a grammar (tools offered) are drafted too
//! and still match.

use crate::common;

use futures::StreamExt;
use mesh::config::NodeConfig;
use mesh_tiers::{DraftConfig, EngineConfig};
use serde_json::{json, Value};

fn models() -> std::path::PathBuf {
    std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../models"))
}

fn tier(name: &str) -> EngineConfig {
    EngineConfig {
        name: name.into(),
        model: models().join(format!("{name}-q8_0.gguf")),
        n_ctx: 4096,
        n_seq_max: 2,
        threads: 2,
        ..EngineConfig::default()
    }
}

async fn node(draft: bool) -> (String, tokio::sync::oneshot::Sender<()>) {
    let t3 = EngineConfig {
        // A tier name, resolved to that tier's GGUF when the node starts.
        draft: draft.then(|| DraftConfig {
            model: "t1".into(),
            ..DraftConfig::default()
        }),
        ..tier("t3")
    };
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        tiers: vec![tier("t1"), t3],
        ..NodeConfig::default()
    };
    cfg.cascade.tiers = vec!["t1".into(), "t3".into()];
    cfg.tool_routing.embedder.model = models().join("embed/minilm-l6-tools-f16.gguf");
    common::in_process(cfg).await
}

const QUESTIONS: [&str; 3] = [
    "What is 47 * 17?",
    "Convert 12 miles to kilometers.",
    "Say hello to the team in one sentence.",
];

fn request(content: &str) -> Value {
    json!({
        "model": "t3",
        "temperature": 0,
        "max_tokens": 64,
        "messages": [{"role": "user", "content": content}],
    })
}

fn with_tools(content: &str) -> Value {
    let mut r = request(content);
    r["tools"] = json!([
        {"type": "function", "function": {"name": "weather_get_forecast", "description": "Get the forecast by city and date.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}, "date": {"type": "string", "description": "Date as YYYY-MM-DD"}}, "required": ["city", "date"]}}}
    ]);
    r
}

/// The message with tool-call ids (random per response) removed.
fn message(v: &Value) -> Value {
    let mut m = v["choices"][0]["message"].clone();
    if let Some(calls) = m["tool_calls"].as_array_mut() {
        for c in calls {
            c.as_object_mut().map(|o| o.remove("id"));
        }
    }
    m
}

async fn chat(c: &reqwest::Client, base: &str, body: &Value) -> Value {
    let r = c
        .post(format!("{base}/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// Text, reasoning and tool calls of a streamed chat completion, concatenated.
async fn streamed(c: &reqwest::Client, base: &str, body: &Value) -> String {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let r = c
        .post(format!("{base}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut text = String::new();
    let mut raw = String::new();
    let mut s = r.bytes_stream();
    while let Some(chunk) = s.next().await {
        raw.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
    }
    for line in raw.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        let delta = &v["choices"][0]["delta"];
        for key in ["reasoning_content", "content"] {
            if let Some(t) = delta[key].as_str() {
                text.push_str(t);
            }
        }
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            for key in ["name", "arguments"] {
                text.push_str(call["function"][key].as_str().unwrap_or(""));
            }
        }
    }
    text
}

/// Value of a `mesh_spec_*` counter for t3, if exported.
fn counter(metrics: &str, name: &str) -> Option<f64> {
    metrics
        .lines()
        .find(|l| l.starts_with(&format!("{name}{{model=\"t3\"}}")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drafted_tier_answers_like_the_tier_alone() {
    let (plain, _stop_plain) = node(false).await;
    let (spec, _stop_spec) = node(true).await;
    let c = reqwest::Client::new();

    let mut drafted = 0;
    for q in QUESTIONS {
        let want = chat(&c, &plain, &request(q)).await;
        let got = chat(&c, &spec, &request(q)).await;
        assert_eq!(message(&got), message(&want), "{q}");
        assert_eq!(
            got["choices"][0]["finish_reason"],
            want["choices"][0]["finish_reason"]
        );
        assert_eq!(got["usage"], want["usage"], "{q}");
        assert!(want["mesh"].get("speculative").is_none());
        let s = &got["mesh"]["speculative"];
        let (d, a) = (
            s["draft_tokens"].as_u64().unwrap(),
            s["accepted_tokens"].as_u64().unwrap(),
        );
        assert!(d > 0 && a <= d, "{q}: drafted {d}, accepted {a}");
        drafted += d;

        // Streamed: the same deltas as the plain node's.
        let want_stream = streamed(&c, &plain, &request(q)).await;
        assert!(!want_stream.is_empty());
        assert_eq!(
            streamed(&c, &spec, &request(q)).await,
            want_stream,
            "{q} streamed"
        );
    }

    // Tools offered: the lazy tool-call grammar constrains every verified token, and the
    // drafted answer is still the tier's own.
    let q = "What is the forecast for Oslo on 2026-05-01?";
    let want = chat(&c, &plain, &with_tools(q)).await;
    let got = chat(&c, &spec, &with_tools(q)).await;
    assert_eq!(message(&got), message(&want));
    assert_eq!(got["usage"], want["usage"]);
    assert!(
        want["choices"][0]["message"]["tool_calls"][0]["function"]["name"].is_string(),
        "the tools request made a call: {want}"
    );
    let s = &got["mesh"]["speculative"];
    assert!(
        s["draft_tokens"].as_u64().unwrap() > 0,
        "grammar requests draft: {s}"
    );
    drafted += s["draft_tokens"].as_u64().unwrap();

    let m = |base: &str| {
        let c = c.clone();
        let url = format!("{base}/metrics");
        async move { c.get(url).send().await.unwrap().text().await.unwrap() }
    };
    let (mp, ms) = (m(&plain).await, m(&spec).await);
    assert!(
        counter(&mp, "mesh_spec_draft_tokens_total").is_none(),
        "no draft, no series"
    );
    let total = counter(&ms, "mesh_spec_draft_tokens_total").expect("draft counter");
    let accepted = counter(&ms, "mesh_spec_accepted_tokens_total").expect("accepted counter");
    // The streamed requests drafted too, so the counter is at least the non-streamed sum.
    assert!(
        total >= drafted as f64 && total > 0.0,
        "{total} vs {drafted}"
    );
    assert!(accepted > 0.0 && accepted <= total);
}
