//! When the only node hosting a tier dies, a gateway-only node answers requests for that
//! tier with a clear 503 within a bounded time (no hang), and forgets the dead node.

use std::time::{Duration, Instant};

use mesh_tests::{mesh, Node};
use serde_json::{json, Value};

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
    let t0 = Instant::now();
    while post(ask.clone()).await.0 != 200 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "front never served t1"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Unknown tiers are 404 and name what exists.
    let (s, v) =
        post(json!({"model": "nope", "messages": [{"role": "user", "content": "hi"}]})).await;
    assert_eq!(s, 404);
    assert!(
        v["error"]["message"].as_str().unwrap().contains("t1"),
        "{v}"
    );

    host.kill();
    let killed = Instant::now();
    let (status, body) = loop {
        let (s, v) = post(ask.clone()).await;
        if s != 200 {
            break (s, v);
        }
        assert!(
            killed.elapsed() < Duration::from_secs(5),
            "still 200 long after the host died"
        );
    };
    assert_eq!(status, 503, "{body}");
    assert!(killed.elapsed() < Duration::from_secs(5));
    let msg = body["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        msg.contains("t1") || msg.contains("no node"),
        "unclear 503: {body}"
    );
    // The front forgets the dead host: it is marked dead and t1 stays 503 (not 404, not a hang).
    let t1 = Instant::now();
    loop {
        let v: Value = client
            .get(format!("{}/v1/cluster", front.http))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let dead = v["members"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["node"] == "host" && m["state"] == "dead");
        if dead {
            break;
        }
        assert!(
            t1.elapsed() < Duration::from_secs(5),
            "host never marked dead: {v}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (s, v) = post(ask.clone()).await;
    assert_eq!(s, 503, "{v}");
}
