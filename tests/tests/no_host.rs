//! When the only node hosting a tier dies, a gateway-only node answers requests for that
//! tier with a clear 503 (no hang) once it has noticed, and forgets the dead node.

use std::time::Duration;

use mesh_tests::{member_view, mesh, wait_until, Node};
use serde_json::{json, Value};

/// The state of `node` and its tiers as `base` sees it.
async fn seen(c: &reqwest::Client, base: &str, node: &str) -> (String, Vec<String>) {
    let m = member_view(c, base, node).await;
    let tiers = m["tiers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t["name"].as_str().map(str::to_owned))
        .collect();
    (m["state"].as_str().unwrap_or("").to_owned(), tiers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_only_host_gives_503_not_a_hang() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    let c = certs.display().to_string();
    assert!(mesh(&["cert", "init", "--dir", &c]).status.success());
    for n in ["host", "front"] {
        assert!(mesh(&["cert", "issue", n, "--dir", &c]).status.success());
    }
    let mut host = Node::start("host", &certs, &[], "t1", &[]).expect("host");
    let front = Node::start("front", &certs, &[&host.quic], "none", &[]).expect("front");
    // Every request is bounded: a hang fails the test here.
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let ask =
        json!({"model": "t1", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]});
    let post = |body: Value| {
        let client = client.clone();
        let url = format!("{}/v1/chat/completions", front.http);
        async move {
            let r = client
                .post(url)
                .json(&body)
                .send()
                .await
                .expect("answered, no hang");
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    wait_until("front to see host's t1", async || {
        seen(&client, &front.http, "host").await == ("alive".into(), vec!["t1".into()])
    })
    .await;
    let (s, v) = post(ask.clone()).await;
    assert_eq!(s, 200, "{v}");
    // Unknown tiers are 404 and name what exists.
    let (s, v) =
        post(json!({"model": "nope", "messages": [{"role": "user", "content": "hi"}]})).await;
    assert_eq!(s, 404);
    assert!(
        v["error"]["message"].as_str().unwrap().contains("t1"),
        "{v}"
    );

    host.kill();
    // The front marks the dead host dead (its connection closed, or no heartbeat).
    wait_until("host marked dead", async || {
        seen(&client, &front.http, "host").await.0 == "dead"
    })
    .await;
    // t1 is then 503 with a reason, not 404 and not a hang.
    let (status, body) = post(ask.clone()).await;
    assert_eq!(status, 503, "{body}");
    let msg = body["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        msg.contains("t1") || msg.contains("no node"),
        "unclear 503: {body}"
    );
}
