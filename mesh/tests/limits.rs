//! Client limits (`[limits]` and a key's own `--rpm`/`--concurrency`) on in-process nodes
//! hosting the bundled t1: 429 with `Retry-After` past a key's rate or its requests in
//! flight, 413 for a body over the limit, connections closed when they do not send their
//! headers in time, and connections past the limit waiting until one closes.

use crate::common;

use std::io::{Read, Write};
use std::sync::OnceLock;
use std::time::Duration;

use mesh::keys::{self, KeyLimits, Scope};
use serde_json::{json, Value};

/// The shared node with keys, and keys with their own limits.
struct Fixture {
    base: String,
    /// One request a minute.
    slow: String,
    /// One request a minute, for the counter test.
    slow2: String,
    /// One request in flight.
    single: String,
    /// No limits of its own.
    plain: String,
}

static NODE: OnceLock<String> = OnceLock::new();
static FIXTURE: OnceLock<Fixture> = OnceLock::new();

fn fixture() -> &'static Fixture {
    FIXTURE.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap().keep();
        let file = dir.join("keys.json");
        let make = |rpm, concurrency| {
            keys::create(
                &file,
                "test",
                vec![Scope::Inference],
                None,
                KeyLimits { rpm, concurrency },
            )
            .unwrap()
            .1
        };
        let (slow, slow2) = (make(Some(1), None), make(Some(1), None));
        let (single, plain) = (make(None, Some(1)), make(None, None));
        let file2 = file.clone();
        let base = common::shared_node(&NODE, move || {
            let mut cfg = common::t1_config(8192, 2);
            cfg.auth.keys_file = Some(file2);
            cfg.limits.max_body_bytes = 4096;
            cfg
        });
        Fixture {
            base,
            slow,
            slow2,
            single,
            plain,
        }
    })
}

async fn get(path: &str, key: &str) -> reqwest::Response {
    reqwest::Client::new()
        .get(format!("{}{path}", fixture().base))
        .bearer_auth(key)
        .send()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_its_rate_a_key_gets_429_with_retry_after() {
    let key = &fixture().slow;
    assert_eq!(get("/v1/models", key).await.status(), 200);
    let r = get("/v1/models", key).await;
    assert_eq!(r.status(), 429);
    let wait: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "rate_limit_exceeded", "{body}");
    assert!((1..=60).contains(&wait), "Retry-After {wait}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_keys_rate_does_not_limit_another() {
    let f = fixture();
    // `slow2` spends its one request; `plain` has no rate of its own.
    get("/v1/models", &f.slow2).await;
    for _ in 0..5 {
        assert_eq!(get("/v1/models", &f.plain).await.status(), 200);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_refusals_are_counted() {
    let f = fixture();
    // Two requests on a one-a-minute key: at least one refusal, whatever ran before.
    get("/v1/models", &f.slow2).await;
    get("/v1/models", &f.slow2).await;
    let text = get("/metrics", &f.plain).await.text().await.unwrap();
    let hits: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("mesh_limits_hit_total{limit=\"rate\"} "))
        .unwrap_or_else(|| panic!("no rate counter in:\n{text}"))
        .parse()
        .unwrap();
    assert!(hits >= 1.0, "{hits}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_at_its_concurrency_gets_429_until_its_request_ends() {
    let f = fixture();
    let c = reqwest::Client::new();
    // Long enough to still run when the second request comes (t1's context is 2048).
    let long = json!({"model": "t1", "prompt": "Once", "max_tokens": 1900, "ignore_eos": true,
                      "temperature": 0, "stream": true});
    let mut first = c
        .post(format!("{}/v1/completions", f.base))
        .bearer_auth(&f.single)
        .json(&long)
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 200);
    first.chunk().await.unwrap().expect("a first event");
    let second = get("/v1/models", &f.single).await;
    assert_eq!(second.status(), 429);
    assert!(second.headers().contains_key("retry-after"));
    drop(first);
    mesh_tests::wait_until("the key's slot is free again", async || {
        get("/v1/models", &f.single).await.status() == 200
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_limit_gets_413_in_openais_shape() {
    let f = fixture();
    let big = json!({"model": "t1", "messages": [{"role": "user", "content": "x".repeat(8000)}]});
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", f.base))
        .bearer_auth(&f.plain)
        .json(&big)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "request_too_large", "{body}");
}

/// Reads until the server closes the connection; `false` if it stays open past `limit`.
fn closed_within(s: &mut std::net::TcpStream, limit: Duration) -> bool {
    s.set_read_timeout(Some(limit)).unwrap();
    let mut buf = [0u8; 1024];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_does_not_finish_its_headers_is_closed() {
    let mut cfg = common::t1_config(8192, 2);
    cfg.limits.header_read_timeout_s = 1;
    let (base, _stop) = common::in_process(cfg).await;
    let addr = base.trim_start_matches("http://").to_owned();
    let closed = tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n").unwrap();
        closed_within(&mut s, Duration::from_secs(10))
    })
    .await
    .unwrap();
    assert!(closed, "the half-sent request's connection stayed open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_max_connections_a_client_waits_until_one_closes() {
    let mut cfg = common::t1_config(8192, 2);
    cfg.limits.max_connections = 2;
    let (base, _stop) = common::in_process(cfg).await;
    let addr = base.trim_start_matches("http://").to_owned();
    let idle: Vec<std::net::TcpStream> = (0..2)
        .map(|_| std::net::TcpStream::connect(&addr).unwrap())
        .collect();
    let quick = reqwest::Client::builder()
        .timeout(Duration::from_millis(700))
        .build()
        .unwrap();
    assert!(
        quick.get(format!("{base}/health")).send().await.is_err(),
        "a third connection was served while two were open"
    );
    drop(idle);
    mesh_tests::wait_until("a connection slot is free", async || {
        quick.get(format!("{base}/health")).send().await.is_ok()
    })
    .await;
}
