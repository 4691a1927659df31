//! Rolling upgrades: a node of this build and a node speaking only the previous wire
//! version (`MESH_WIRE_VERSION=9`, as the previous build) connect at the older version,
//! and requests and KV page pulls cross between them.

use mesh_tests::{
    certs, cluster_view, member_view, mesh, metric_total, post_json, wait_until, Node,
};
use serde_json::{json, Value};

const OLD: (&str, &str) = ("MESH_WIRE_VERSION", "9");

async fn formed(client: &reqwest::Client, at: &str, n: usize) {
    wait_until("the cluster to form", async || {
        let v = cluster_view(client, at).await;
        v["members"]
            .as_array()
            .is_some_and(|m| m.len() == n && m.iter().all(|m| m["state"] == "alive"))
    })
    .await;
}

async fn complete(c: &reqwest::Client, base: &str, model: &str, prompt: &str, n: usize) -> Value {
    let body = json!({"model": model, "prompt": prompt, "max_tokens": n,
        "temperature": 0, "ignore_eos": true});
    post_json(c, &format!("{base}/v1/completions"), &body).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_connection_speaks_the_newest_version_both_ends_know() {
    let dir = tempfile::tempdir().unwrap();
    let certs = certs(dir.path(), &["a", "b", "c"]);
    let a = Node::start("a", &certs, &[], "t1", &[]).expect("a");
    let b = Node::start_with_env("b", &certs, &[&a.quic], "t1", &[], &[OLD]).expect("b");
    let c = Node::start("c", &certs, &[&a.quic], "t1", &[]).expect("c");
    let client = reqwest::Client::new();
    formed(&client, &a.http, 3).await;
    formed(&client, &c.http, 3).await;
    // a and c are both new: they speak 10, and each sees the other's build.
    let ac = member_view(&client, &a.http, "c").await;
    assert_eq!(ac["wire"], 10, "{ac}");
    assert!(
        ac["build"].as_str().is_some_and(|b| b.starts_with("mesh ")),
        "{ac}"
    );
    assert!(
        ac["capabilities"].as_array().is_some_and(|c| !c.is_empty()),
        "{ac}"
    );
    // With b, both speak 9: b's adverts carry no build, and b reads a's in the old layout.
    let ab = member_view(&client, &a.http, "b").await;
    assert_eq!(ab["wire"], 9, "{ab}");
    assert_eq!(ab["build"], "", "{ab}");
    let ba = member_view(&client, &b.http, "a").await;
    assert_eq!(ba["wire"], 9, "{ba}");
    assert_eq!(ba["build"], "", "{ba}");
    assert_eq!(
        cluster_view(&client, &b.http).await["members"]
            .as_array()
            .map(Vec::len),
        Some(3)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_status_shows_the_wire_version_of_each_member() {
    let dir = tempfile::tempdir().unwrap();
    let certs = certs(dir.path(), &["a", "b"]);
    let a = Node::start("a", &certs, &[], "t1", &[]).expect("a");
    let b = Node::start_with_env("b", &certs, &[&a.quic], "t1", &[], &[OLD]).expect("b");
    let client = reqwest::Client::new();
    formed(&client, &a.http, 2).await;
    formed(&client, &b.http, 2).await;
    let out = mesh(&["status", "--gateway", &a.http]);
    assert!(out.status.success());
    let table = String::from_utf8_lossy(&out.stdout);
    let wire = |node: &str| {
        table
            .lines()
            .find(|l| l.split_whitespace().next() == Some(node))
            .and_then(|l| l.split_whitespace().nth(2))
            .map(str::to_owned)
    };
    assert_eq!(wire("a*").as_deref(), Some("10"), "{table}");
    assert_eq!(wire("b").as_deref(), Some("9"), "{table}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_of_the_older_version_calls_a_new_one_and_pulls_its_pages() {
    let dir = tempfile::tempdir().unwrap();
    let certs = certs(dir.path(), &["a", "b"]);
    // a (new) runs t1 with one slot, and t2; b (old) runs t1 only.
    let a = Node::start(
        "a",
        &certs,
        &[],
        "t1,t2",
        &["--parallel", "1", "--kv-block", "16"],
    )
    .expect("a");
    let b = Node::start_with_env("b", &certs, &[&a.quic], "t1", &["--kv-block", "16"], &[OLD])
        .expect("b");
    let client = reqwest::Client::new();
    formed(&client, &b.http, 2).await;
    assert_eq!(member_view(&client, &b.http, "a").await["wire"], 9);
    // A request for t2 at b is served by a (b has no t2).
    let r = complete(
        &client,
        &b.http,
        "t2",
        "<|user|>Name a colour.<|end|><|assistant|>",
        8,
    )
    .await;
    assert!(r["choices"][0]["text"].is_string(), "{r}");
    // a computes a long prefix; b hears of its pages, then a's only t1 slot is kept busy.
    let prefix = format!(
        "<|system|>You are a helpful agent.{}<|end|>",
        " Answer in one short sentence and name the tool you would call.".repeat(12)
    );
    let p1 = format!("{prefix}<|user|>What is the weather in Oslo?<|end|><|assistant|>");
    let p2 = format!("{prefix}<|user|>Send an email to Dana.<|end|><|assistant|>");
    complete(&client, &a.http, "t1", &p1, 4).await;
    let published = metric_total(&a.http, "mesh_kv_pages_published_total").await as u64;
    assert!(published > 0);
    wait_until("b to see a's pages", async || {
        let v = member_view(&client, &b.http, "a").await;
        v["tiers"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|t| t["name"] == "t1" && t["pages"].as_u64().is_some_and(|n| n >= published))
    })
    .await;
    let busy = {
        let (client, base) = (client.clone(), a.http.clone());
        tokio::spawn(async move {
            complete(
                &client,
                &base,
                "t1",
                "<|user|>Tell a long story.<|end|><|assistant|>",
                1500,
            )
            .await
        })
    };
    wait_until("b to see a busy", async || {
        let v = member_view(&client, &b.http, "a").await;
        v["tiers"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|t| t["name"] == "t1" && t["active"].as_u64().is_some_and(|n| n >= 1))
    })
    .await;
    let r = complete(&client, &b.http, "t1", &p2, 8).await;
    assert!(r["choices"][0]["text"].is_string(), "{r}");
    let fetched = metric_total(&b.http, "mesh_kv_pages_fetched_from_peers_total").await;
    assert!(fetched > 0.0, "b fetched no pages from a");
    busy.abort();
}
