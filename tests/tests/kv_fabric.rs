//! Prefix pages move between nodes: a prompt's prefix computed on node A is pulled by
//! node B when B serves a request sharing it (A busy), and B's answer equals a node
//! without any page reuse.

use mesh_tests::{cluster_view, member_view, mesh, metric, wait_until, Node};
use serde_json::{json, Value};

fn catalog_prefix() -> String {
    let text =
        std::fs::read_to_string(mesh_tests::root().join("models/fixtures/catalog.jsonl")).unwrap();
    let tools: Vec<String> = text
        .lines()
        .take(8)
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            json!({"name": v["name"], "description": v["description"], "parameters": v["parameters"]}).to_string()
        })
        .collect();
    format!(
        "<|system|>You are a helpful agent. Call a tool when one fits the request, otherwise answer directly.\n<tools>\n{}\n</tools><|end|>",
        tools.join("\n")
    )
}

fn prompt(prefix: &str, q: &str) -> String {
    format!("{prefix}<|user|>{q}<|end|><|assistant|>")
}

async fn complete(c: &reqwest::Client, base: &str, prompt: &str, max_tokens: usize) -> String {
    let r: Value = c
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": "t1", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    r["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no text: {r}"))
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_computed_on_one_node_are_pulled_by_another() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    let c = certs.display().to_string();
    assert!(mesh(&["cert", "init", "--dir", &c]).status.success());
    for n in ["a", "b", "r"] {
        assert!(mesh(&["cert", "issue", n, "--dir", &c]).status.success());
    }
    let a = Node::start(
        "a",
        &certs,
        &[],
        "t1",
        &["--parallel", "1", "--kv-block", "16"],
    )
    .expect("a");
    let b = Node::start("b", &certs, &[&a.quic], "t1", &["--kv-block", "16"]).expect("b");
    // Reference: a standalone cluster of one with page reuse off.
    let r = Node::start("r", &certs, &[], "t1", &["--kv-block", "0"]).expect("r");
    let client = reqwest::Client::new();
    let prefix = catalog_prefix();
    let p1 = prompt(&prefix, "What is the weather in Oslo?");
    let p2 = prompt(&prefix, "Send an email to Dana about the launch.");
    let want = complete(&client, &r.http, &p2, 24).await;

    // Wait for a and b to see each other.
    wait_until("the cluster to form", async || {
        let v = cluster_view(&client, &b.http).await;
        v["members"]
            .as_array()
            .is_some_and(|m| m.len() == 2 && m.iter().all(|m| m["state"] == "alive"))
    })
    .await;
    // a computes the prefix (served locally: both idle, local preferred).
    complete(&client, &a.http, &p1, 4).await;
    assert!(metric(&client, &a.http, "mesh_kv_pages_published_total").await > 0.0);
    assert_eq!(
        metric(&client, &b.http, "mesh_kv_pages_published_total").await,
        0.0,
        "p1 ran on b"
    );
    // b hears a's advert with the new pages, then a's only slot is kept busy.
    let published = metric(&client, &a.http, "mesh_kv_pages_published_total").await as u64;
    wait_until("b to see a's pages", async || {
        member_view(&client, &b.http, "a").await["tiers"][0]["pages"]
            .as_u64()
            .is_some_and(|n| n >= published)
    })
    .await;
    let busy = {
        let (client, base) = (client.clone(), a.http.clone());
        tokio::spawn(async move {
            complete(
                &client,
                &base,
                "<|user|>Tell a long story.<|end|><|assistant|>",
                1500,
            )
            .await
        })
    };
    // b hears (next heartbeat) that a is busy, so its gateway serves p2 itself.
    wait_until("b to see a busy", async || {
        member_view(&client, &b.http, "a").await["tiers"][0]["active"]
            .as_u64()
            .is_some_and(|n| n >= 1)
    })
    .await;
    // b serves p2, three times at once (agents started together), and pulls the shared
    // prefix from a instead of prefilling it: once, however many requests want it.
    let calls = (0..3).map(|_| {
        let (client, base, p2) = (client.clone(), b.http.clone(), p2.clone());
        tokio::spawn(async move { complete(&client, &base, &p2, 24).await })
    });
    for got in futures::future::join_all(calls).await {
        assert_eq!(
            got.unwrap(),
            want,
            "restored-from-peer prefix changed the answer"
        );
    }
    let fetched = metric(&client, &b.http, "mesh_kv_pages_fetched_from_peers_total").await;
    assert!(fetched > 0.0, "b fetched no pages from a");
    let pulls = metric(
        &client,
        &b.http,
        "mesh_kv_peer_pulls_total{outcome=\"started\"}",
    )
    .await;
    let joined = metric(
        &client,
        &b.http,
        "mesh_kv_peer_pulls_total{outcome=\"joined\"}",
    )
    .await;
    eprintln!("b: {pulls} page pull(s) started, {joined} call(s) joined one in flight");
    assert_eq!(
        pulls, 1.0,
        "b pulled the same prefix more than once ({joined} calls joined a pull in flight)"
    );
    assert!(metric(&client, &b.http, "mesh_kv_prefix_hits_total").await >= 1.0);
    assert!(
        metric(&client, &b.http, "mesh_kv_recompute_avoided_tokens_total").await >= 16.0 * fetched
    );
    busy.abort();
}
