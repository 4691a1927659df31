//! Node roles over remote actors: a gateway without tiers routes tools through a peer's
//! router actor; a store node keeps the KV pages a compute node demotes to it and serves
//! them back. Real `mesh join` processes on 127.0.0.1.

use std::time::{Duration, Instant};

use mesh_tests::{catalog, certs, metric, t1_config, tools_prompt, Node};
use serde_json::{json, Value};

async fn get(c: &reqwest::Client, url: String) -> Value {
    c.get(url).send().await.unwrap().json().await.unwrap()
}

/// The member `node` as `base` sees it.
async fn member(c: &reqwest::Client, base: &str, node: &str) -> Value {
    let v = get(c, format!("{base}/v1/cluster")).await;
    v["members"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["node"] == node)
        .cloned()
        .unwrap_or(Value::Null)
}

async fn wait_until(what: &str, limit: Duration, mut f: impl AsyncFnMut() -> bool) {
    let t0 = Instant::now();
    while !f().await {
        assert!(t0.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_without_tiers_routes_tools_through_a_peers_router() {
    let dir = tempfile::tempdir().unwrap();
    let certs = certs(dir.path(), &["g", "b"]);
    let g = Node::start("g", &certs, &[], "none", &["--roles", "gateway"]).expect("g");
    let _b = Node::start("b", &certs, &[&g.quic], "t1", &[]).expect("b");
    let c = reqwest::Client::new();
    wait_until("g to see b's router", Duration::from_secs(30), async || {
        member(&c, &g.http, "b").await["actors"]
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x == "router"))
    })
    .await;
    let me = member(&c, &g.http, "g").await;
    assert_eq!(me["roles"], json!(["gateway"]));
    assert!(
        !me["actors"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a == "router"),
        "g runs no router of its own: {me}"
    );
    let tools: Vec<Value> = catalog(0, 12)
        .into_iter()
        .map(|t| json!({"type": "function", "function": t}))
        .collect();
    let body = json!({"model": "t1", "max_tokens": 32, "temperature": 0, "tools": tools,
        "messages": [{"role": "user", "content": "What is the weather in Lima tomorrow?"}]});
    let r = c
        .post(format!("{}/v1/chat/completions", g.http))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let v: Value = r.json().await.unwrap();
    let shown = v["mesh"]["router"]["shown"].as_array().expect("routed");
    assert_eq!(v["mesh"]["router"]["offered"], 12);
    assert!(
        !shown.is_empty() && shown.len() < 12,
        "the peer's router kept a few tools: {v}"
    );
    assert_eq!(
        metric(&c, &g.http, "mesh_tool_routing_total{outcome=\"routed\"}").await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_node_keeps_demoted_pages_and_serves_them_back() {
    let dir = tempfile::tempdir().unwrap();
    let certs = certs(dir.path(), &["s", "c"]);
    let store_dir = dir.path().join("store");
    let sd = store_dir.display().to_string();
    let s = Node::start(
        "s",
        &certs,
        &[],
        "none",
        &["--roles", "store", "--kv-dir", &sd],
    )
    .expect("s");
    // The compute node's RAM holds about one prompt's pages (t1: ~48 KiB a page), and it
    // has no disk tier: pages it evicts would be lost without the store node.
    let cf = t1_config(dir.path(), "c", 1_600_000);
    let cn = Node::start(
        "c",
        &certs,
        &[&s.quic],
        "t1",
        &["--config", &cf, "--no-keep-resident", "--parallel", "2"],
    )
    .expect("c");
    let client = reqwest::Client::new();
    let c = &client;
    wait_until(
        "c to see the store node",
        Duration::from_secs(30),
        async || member(c, &cn.http, "s").await["roles"] == json!(["store"]),
    )
    .await;
    let prompt = tools_prompt;
    let complete = async |p: &str| -> String {
        let v: Value = c
            .post(format!("{}/v1/completions", cn.http))
            .json(&json!({"model": "t1", "prompt": p, "max_tokens": 24, "temperature": 0}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        v["choices"][0]["text"]
            .as_str()
            .unwrap_or_else(|| panic!("{v}"))
            .to_owned()
    };
    let first = complete(&prompt(0)).await;
    // Two other prompts push the first one's pages out of c's RAM, to the store node.
    complete(&prompt(10)).await;
    complete(&prompt(20)).await;
    wait_until(
        "pages on the store node's disk",
        Duration::from_secs(30),
        async || {
            std::fs::read_dir(store_dir.join("t1"))
                .map(|d| d.count() > 0)
                .unwrap_or(false)
        },
    )
    .await;
    assert!(metric(c, &s.http, "mesh_kv_pages{model=\"t1\",tier=\"ram\"}").await > 0.0);
    wait_until(
        "c to see the store node's pages",
        Duration::from_secs(30),
        async || {
            member(c, &cn.http, "s").await["stored_pages"]["t1"]
                .as_u64()
                .is_some_and(|n| n > 0)
        },
    )
    .await;
    let pulled_before = metric(c, &cn.http, "mesh_kv_pages_fetched_from_peers_total").await;
    let again = complete(&prompt(0)).await;
    assert_eq!(
        again, first,
        "the same answer from pages the store node kept"
    );
    let pulled =
        metric(c, &cn.http, "mesh_kv_pages_fetched_from_peers_total").await - pulled_before;
    assert!(
        pulled > 0.0,
        "c pulled the first prompt's pages back from s"
    );
}

/// A request a gateway sends to a peer is counted where it runs: the peer's engine counts
/// it in `mesh_tier_sequences_total` (with its prefilled prompt tokens), and the gateway,
/// which ran nothing, counts no local engine request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_counts_the_requests_it_serves_for_another_gateway() {
    let dir = tempfile::tempdir().unwrap();
    let certs = certs(dir.path(), &["g", "b"]);
    let g = Node::start("g", &certs, &[], "none", &["--roles", "gateway"]).expect("g");
    let b = Node::start("b", &certs, &[&g.quic], "t1", &[]).expect("b");
    let c = reqwest::Client::new();
    wait_until("g to see b's t1", Duration::from_secs(30), async || {
        let m = member(&c, &g.http, "b").await;
        m["state"] == "alive" && m["tiers"][0]["name"] == "t1"
    })
    .await;
    let served = metric(&c, &b.http, "mesh_tier_sequences_total").await;
    for q in ["Name a colour.", "Name a fruit."] {
        let body = json!({"model": "t1", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": q}]});
        let r = c
            .post(format!("{}/v1/chat/completions", g.http))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
    }
    assert_eq!(
        metric(&c, &b.http, "mesh_tier_sequences_total").await - served,
        2.0
    );
    assert!(metric(&c, &b.http, "mesh_tier_prompt_tokens_total").await > 0.0);
    assert_eq!(metric(&c, &g.http, "mesh_engine_requests_total").await, 0.0);
}
