//! A cluster of separate `mesh join` processes on 127.0.0.1, one behaviour per test.
//!
//! Behaviours that leave the cluster as it was (joining through gossip, `mesh status`, a
//! foreign certificate refused, garbage frames refused, every gateway serving) share one
//! 3-node cluster, started once for this test binary ([`shared`]). Behaviours that kill or
//! stop a node (failover under load, rejoin, graceful leave) each start a cluster of their
//! own.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use mesh_tests::{members, mesh, Node};

use serde_json::{json, Value};

fn state_of(ms: &[Value], node: &str) -> Option<String> {
    ms.iter()
        .find(|m| m["node"] == node)
        .and_then(|m| m["state"].as_str().map(str::to_owned))
}

async fn wait_for(what: &str, limit: Duration, mut f: impl AsyncFnMut() -> bool) {
    let t0 = Instant::now();
    while !f().await {
        assert!(
            t0.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn request(i: usize) -> Value {
    let cities = [
        "Oslo", "Lima", "Tokyo", "Cairo", "Quito", "Perth", "Dakar", "Hanoi", "Riga", "Bern",
    ];
    json!({
        "model": "t1",
        "messages": [{"role": "user", "content": format!("What is the weather in {} on day {}?", cities[i % 10], i % 10)}],
        "max_tokens": 96,
        "ignore_eos": true,
        "temperature": 0
    })
}

async fn complete(
    client: &reqwest::Client,
    http: &str,
    body: &Value,
) -> Result<(String, u64), String> {
    let r = client
        .post(format!("{http}/v1/chat/completions"))
        .json(body)
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = r.status();
    let v: Value = r.json().await.map_err(|e| e.to_string())?;
    if !status.is_success() {
        return Err(format!("{status}: {v}"));
    }
    let m = &v["choices"][0]["message"];
    // Call ids are random per response; compare what was called.
    let calls: Vec<&Value> = m["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| &c["function"])
        .collect();
    let text = format!("{}|{}", m["content"].as_str().unwrap_or(""), json!(calls));
    Ok((text, v["usage"]["completion_tokens"].as_u64().unwrap_or(0)))
}

async fn complete_streaming(
    client: &reqwest::Client,
    http: &str,
    body: &Value,
) -> Result<String, String> {
    use futures::StreamExt;
    let mut body = body.clone();
    body["stream"] = json!(true);
    let r = client
        .post(format!("{http}/v1/chat/completions"))
        .json(&body)
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !r.status().is_success() {
        return Err(format!("{}", r.status()));
    }
    let mut raw = String::new();
    let mut s = r.bytes_stream();
    while let Some(chunk) = s.next().await {
        raw.push_str(&String::from_utf8_lossy(&chunk.map_err(|e| e.to_string())?));
    }
    let mut content = String::new();
    let mut calls: Vec<Value> = vec![];
    let mut done = false;
    for line in raw.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).map_err(|e| format!("{e}: {data}"))?;
        if v.get("error").is_some() {
            return Err(v.to_string());
        }
        let delta = &v["choices"][0]["delta"];
        if let Some(c) = delta["content"].as_str() {
            content.push_str(c);
        }
        for c in delta["tool_calls"].as_array().into_iter().flatten() {
            calls.push(c["function"].clone());
        }
    }
    if !done {
        return Err("stream ended without [DONE]".into());
    }
    Ok(format!("{content}|{}", json!(calls)))
}

/// Raw QUIC client with a valid cluster identity, to send malformed frames.
async fn garbage_frames(certs: &Path, target: &str) {
    let paths = mesh_transport::IdentityPaths::in_dir(certs, "prober");
    let id = mesh_transport::Identity::load(&paths).unwrap();
    let ep =
        mesh_transport::Endpoint::bind(&id, "127.0.0.1:0".parse().unwrap(), &Default::default())
            .unwrap();
    let pc = ep.connect(target.parse().unwrap()).await.unwrap();
    assert_eq!(pc.peer, "a");
    // Random bytes: refused with the bad-magic code.
    let (mut send, mut recv) = pc.conn.open_bi().await.unwrap();
    send.write_all(b"\x00\x01garbage that is not a frame")
        .await
        .unwrap();
    let _ = send.finish();
    let err = recv
        .read_to_end(1 << 16)
        .await
        .expect_err("garbage refused");
    assert!(format!("{err:?}").contains("Reset(17)"), "{err:?}");
    // A header announcing 64 bytes followed by 10: truncated.
    let (mut send, mut recv) = pc.conn.open_bi().await.unwrap();
    let mut frame = b"MS".to_vec();
    frame.extend_from_slice(&mesh_transport::WIRE_VERSION.to_le_bytes());
    frame.extend_from_slice(&64u32.to_le_bytes());
    frame.extend_from_slice(&[7u8; 10]);
    send.write_all(&frame).await.unwrap();
    let _ = send.finish();
    let err = recv
        .read_to_end(1 << 16)
        .await
        .expect_err("truncated refused");
    assert!(format!("{err:?}").contains("Reset(16)"), "{err:?}");
    // Oversized announcement.
    let (mut send, mut recv) = pc.conn.open_bi().await.unwrap();
    let mut frame = b"MS".to_vec();
    frame.extend_from_slice(&mesh_transport::WIRE_VERSION.to_le_bytes());
    frame.extend_from_slice(&(512u32 << 20).to_le_bytes());
    send.write_all(&frame).await.unwrap();
    let err = recv
        .read_to_end(1 << 16)
        .await
        .expect_err("oversized refused");
    assert!(format!("{err:?}").contains("Reset(19)"), "{err:?}");
    // The same connection still answers a well-formed call.
    let (mut send, mut recv) = pc.conn.open_bi().await.unwrap();
    let ping = mesh_actors::wire::Request::Ping {
        nonce: 42,
        payload: vec![1, 2, 3],
    };
    mesh_transport::write_frame(&mut send, &ping).await.unwrap();
    let _ = send.finish();
    let reply = mesh_transport::read_frame::<mesh_actors::wire::Reply, _>(&mut recv, 1 << 20)
        .await
        .unwrap();
    assert_eq!(
        reply,
        Some(mesh_actors::wire::Reply::Pong {
            nonce: 42,
            payload: vec![1, 2, 3]
        })
    );
    pc.conn.close(0u32.into(), b"done");
}

/// A cluster's certificates: a CA and one certificate per name (and one for the prober).
fn certificates(base: &Path, names: &[&str]) -> PathBuf {
    let certs = base.join("certs");
    let c = certs.display().to_string();
    let out = mesh(&["cert", "init", "--dir", &c]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for n in names.iter().chain(&["prober"]) {
        let out = mesh(&["cert", "issue", n, "--dir", &c]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    certs
}

/// Three nodes a, b (through a), c (through a; it learns b by gossip), all alive to each
/// other.
async fn three_nodes(certs: &Path) -> (Node, Node, Node) {
    let a = Node::start("a", certs, &[], "t1", &[]).expect("a starts");
    let seed = a.quic.clone();
    let b = Node::start("b", certs, &[&seed], "t1", &[]).expect("b joins");
    let c = Node::start("c", certs, &[&seed], "t1", &[]).expect("c joins");
    for http in [&a.http, &b.http, &c.http] {
        wait_for("3 alive members", Duration::from_secs(30), async || {
            let ms = members(http).await;
            ms.len() == 3 && ms.iter().all(|m| m["state"] == "alive")
        })
        .await;
    }
    (a, b, c)
}

/// Reference answers to `request(0..10)`, plain and streamed, from a standalone node with
/// the same settings. Computing them on a member would leave that member holding every
/// prompt's KV pages, and the router would then keep a burst on it.
async fn references(base: &Path) -> (Vec<(String, u64)>, Vec<String>) {
    let client = reqwest::Client::new();
    let mut solo = Node::up(
        base,
        &[
            "--only",
            "t1",
            "--threads",
            "1",
            "--ctx",
            "4096",
            "--parallel",
            "4",
        ],
    )
    .expect("reference node starts");
    let (mut plain, mut streamed) = (vec![], vec![]);
    for i in 0..10 {
        plain.push(
            complete(&client, &solo.http, &request(i))
                .await
                .expect("reference"),
        );
        streamed.push(
            complete_streaming(&client, &solo.http, &request(i))
                .await
                .expect("reference"),
        );
    }
    solo.terminate();
    (plain, streamed)
}

/// The cluster the non-destructive tests share.
struct Shared {
    certs: PathBuf,
    base: PathBuf,
    a: Node,
    b: Node,
    c: Node,
    reference: Vec<(String, u64)>,
}

/// Starts the shared cluster once, from a thread that lives as long as this test process:
/// its nodes die with that thread, so they never outlive the tests.
fn shared() -> &'static Shared {
    static CLUSTER: OnceLock<Shared> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let dir = tempfile::tempdir().unwrap().keep();
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            let shared = rt.block_on(async {
                let certs = certificates(&dir, &["a", "b", "c"]);
                let (a, b, c) = three_nodes(&certs).await;
                let (reference, _) = references(&dir).await;
                Shared {
                    certs,
                    base: dir.clone(),
                    a,
                    b,
                    c,
                    reference,
                }
            });
            tx.send(shared).unwrap();
            loop {
                std::thread::park();
            }
        });
        rx.recv().expect("the shared cluster started")
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_joining_through_one_seed_learns_the_others_by_gossip() {
    let s = shared();
    // c was given only a as its seed.
    let ms = members(&s.c.http).await;
    assert_eq!(state_of(&ms, "b").as_deref(), Some("alive"), "{ms:?}");
    assert_eq!(state_of(&ms, "a").as_deref(), Some("alive"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_status_lists_every_member() {
    let s = shared();
    let status = mesh(&["status", "--gateway", &s.a.http]);
    let table = String::from_utf8_lossy(&status.stdout);
    assert!(status.status.success());
    for n in ["a*", "b ", "c "] {
        assert!(table.contains(n), "status lacks {n}: {table}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issuing_a_name_twice_never_overwrites_its_key() {
    let s = shared();
    let c = s.certs.display().to_string();
    assert!(!mesh(&["cert", "issue", "a", "--dir", &c]).status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_from_another_ca_cannot_join() {
    let s = shared();
    let foreign = s.base.join("foreign");
    let f = foreign.display().to_string();
    assert!(mesh(&["cert", "init", "--dir", &f]).status.success());
    assert!(mesh(&["cert", "issue", "d", "--dir", &f]).status.success());
    let err = Node::start("d", &foreign, &[&s.a.quic], "none", &[])
        .err()
        .expect("foreign node refused");
    assert!(err.contains("no seed could be reached"), "{err}");
    assert!(state_of(&members(&s.a.http).await, "d").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_frames_are_refused_and_the_connection_keeps_serving() {
    let s = shared();
    garbage_frames(&s.certs, &s.a.quic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_gateway_serves_the_reference_answers() {
    let s = shared();
    let client = reqwest::Client::new();
    for http in [&s.a.http, &s.b.http, &s.c.http] {
        for i in [0, 7] {
            let got = complete(&client, http, &request(i)).await.expect("served");
            assert_eq!(got, s.reference[i], "gateway {http} request {i}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_survive_the_loss_of_a_serving_node() {
    let dir = tempfile::tempdir().unwrap();
    let certs = certificates(dir.path(), &["a", "b", "c"]);
    let (reference, reference_stream) = references(dir.path()).await;
    let (a, mut b, cn) = three_nodes(&certs).await;
    let client = reqwest::Client::new();
    // 50 concurrent requests through a and c; b is killed while serving some of them.
    let mut tasks = vec![];
    for i in 0..50 {
        let client = client.clone();
        let http = if i % 2 == 0 {
            a.http.clone()
        } else {
            cn.http.clone()
        };
        let body = request(i);
        tasks.push(tokio::spawn(async move {
            if i % 3 == 0 {
                complete_streaming(&client, &http, &body)
                    .await
                    .map(|t| (t, 0))
            } else {
                complete(&client, &http, &body).await
            }
        }));
    }
    wait_for("b to be serving", Duration::from_secs(30), async || {
        members(&b.http)
            .await
            .iter()
            .any(|m| m["node"] == "b" && m["tiers"][0]["active"].as_u64().unwrap_or(0) > 0)
    })
    .await;
    let killed_at = Instant::now();
    b.kill();
    let mut failed = vec![];
    for (i, t) in tasks.into_iter().enumerate() {
        match t.await.unwrap() {
            Ok((text, n)) => {
                if i % 3 == 0 {
                    assert_eq!(
                        text,
                        reference_stream[i % 10],
                        "streamed request {i} differs"
                    );
                } else {
                    assert_eq!(
                        (text, n),
                        reference[i % 10].clone(),
                        "request {i} differs after failover"
                    );
                }
            }
            Err(e) => failed.push(format!("{i}: {e}")),
        }
    }
    assert!(failed.is_empty(), "requests lost: {failed:?}");
    eprintln!("all 50 completed {:?} after the kill", killed_at.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_node_is_declared_dead_and_rejoins_when_restarted() {
    let dir = tempfile::tempdir().unwrap();
    let certs = certificates(dir.path(), &["a", "b", "c"]);
    let (a, mut b, _c) = three_nodes(&certs).await;
    b.kill();
    wait_for("b declared dead", Duration::from_secs(10), async || {
        state_of(&members(&a.http).await, "b").as_deref() == Some("dead")
    })
    .await;
    let _b2 = Node::start("b", &certs, &[&a.quic], "t1", &[]).expect("b restarts");
    wait_for("b alive again", Duration::from_secs(30), async || {
        state_of(&members(&a.http).await, "b").as_deref() == Some("alive")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_node_leaves_gracefully_and_the_rest_keep_serving() {
    let dir = tempfile::tempdir().unwrap();
    let certs = certificates(dir.path(), &["a", "b", "c"]);
    let (a, _b, mut c) = three_nodes(&certs).await;
    c.terminate();
    wait_for("c left", Duration::from_secs(10), async || {
        state_of(&members(&a.http).await, "c").as_deref() == Some("left")
    })
    .await;
    let client = reqwest::Client::new();
    let got = complete(&client, &a.http, &request(3)).await;
    assert!(got.is_ok(), "still serving: {got:?}");
}
