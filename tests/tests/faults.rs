//! Failure behaviour under injected faults: a node started with `--fault-injection` crashes
//! the actor a `POST /v1/debug/crash` names, and its supervisor restarts it. One behaviour
//! per test, each on nodes of its own (real `mesh` processes on 127.0.0.1).

use std::time::{Duration, Instant};

use futures::future::join_all;
use mesh_tests::{certs, metric, Node};
use serde_json::{json, Value};

const TOKEN: &str = "fault-token-for-the-failure-tests";

fn fault_env() -> Vec<(&'static str, &'static str)> {
    vec![("MESH_FAULT_TOKEN", TOKEN)]
}

/// A standalone node hosting t1 with fault injection on.
fn node(dir: &std::path::Path, extra: &[&str]) -> Node {
    let mut args = vec![
        "--only",
        "t1",
        "--threads",
        "1",
        "--ctx",
        "4096",
        "--fault-injection",
    ];
    if !extra.contains(&"--parallel") {
        args.extend_from_slice(&["--parallel", "2"]);
    }
    args.extend_from_slice(extra);
    Node::up_with_env(dir, &args, &fault_env()).expect("node starts")
}

async fn crash(c: &reqwest::Client, base: &str, actor: &str) -> (u16, Value) {
    let r = c
        .post(format!("{base}/v1/debug/crash"))
        .header("x-mesh-fault-token", TOKEN)
        .json(&json!({"actor": actor}))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

/// `GET URL` as JSON.
async fn get_json(c: &reqwest::Client, url: String) -> Value {
    c.get(url).send().await.unwrap().json().await.unwrap()
}

/// The node supervisor's child `name` as `GET /v1/cluster` lists it.
async fn actor(c: &reqwest::Client, base: &str, name: &str) -> Value {
    let v = get_json(c, format!("{base}/v1/cluster")).await;
    v["actors"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|a| a["name"] == name)
        .cloned()
        .unwrap_or_else(|| panic!("no actor {name}: {v}"))
}

/// `(running, restarts)` of the node supervisor's child `name`.
async fn child(c: &reqwest::Client, base: &str, name: &str) -> (bool, u64) {
    let a = actor(c, base, name).await;
    (a["running"] == true, a["restarts"].as_u64().unwrap())
}

/// Crashes `name`, waits until its supervisor has it running again, and returns how long
/// the supervisor took from the failure to the new incarnation (measured by the node, so
/// a busy test machine's polling does not count).
async fn crash_and_time_restart(c: &reqwest::Client, base: &str, name: &str) -> Duration {
    // A crash just before (under load) may still be restarting: only a running actor can
    // be crashed.
    let t0 = Instant::now();
    let before = loop {
        match child(c, base, name).await {
            (true, restarts) => break restarts,
            _ => assert!(
                t0.elapsed() < Duration::from_secs(10),
                "{name} not running before the crash"
            ),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let t0 = Instant::now();
    let (s, v) = crash(c, base, name).await;
    assert_eq!(s, 200, "{v}");
    loop {
        let a = actor(c, base, name).await;
        if a["running"] == true && a["restarts"].as_u64().unwrap() > before {
            return Duration::from_millis(a["last_restart_ms"].as_u64().expect("timed"));
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{name} not restarted"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn chat_body(i: usize, tools: &[Value], max_tokens: usize) -> Value {
    let cities = ["Oslo", "Lima", "Tokyo", "Cairo", "Quito", "Perth"];
    json!({
        "model": "t1",
        "messages": [{"role": "user", "content": format!("What is the weather in {} tomorrow?", cities[i % cities.len()])}],
        "tools": tools,
        "max_tokens": max_tokens,
        "ignore_eos": true,
        "temperature": 0,
    })
}

/// Tools from the bundled catalog, in OpenAI's shape.
fn catalog_tools(n: usize) -> Vec<Value> {
    let text =
        std::fs::read_to_string(mesh_tests::root().join("models/fixtures/catalog.jsonl")).unwrap();
    text.lines()
        .take(n)
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            json!({"type": "function", "function": {"name": v["name"], "description": v["description"], "parameters": v["parameters"]}})
        })
        .collect()
}

/// `(status, body)` of one chat completion.
async fn chat(c: &reqwest::Client, base: &str, body: &Value) -> (u16, Value) {
    let r = c
        .post(format!("{base}/v1/chat/completions"))
        .json(body)
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

/// What a chat answered: content and calls (call ids are random per response).
fn answer(v: &Value) -> String {
    let m = &v["choices"][0]["message"];
    let calls: Vec<&Value> = m["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| &c["function"])
        .collect();
    format!("{}|{}", m["content"].as_str().unwrap_or(""), json!(calls))
}

/// Sends `bodies` at once, crashes `actor` once the first is running, and returns the
/// answers in order (each must be a 200).
async fn crash_under_load(
    c: &reqwest::Client,
    base: &str,
    actor: &str,
    bodies: &[Value],
) -> Vec<String> {
    replies_across_crash(c, base, actor, bodies)
        .await
        .iter()
        .map(answer)
        .collect()
}

/// [`crash_under_load`], returning the whole replies.
async fn replies_across_crash(
    c: &reqwest::Client,
    base: &str,
    actor: &str,
    bodies: &[Value],
) -> Vec<Value> {
    let running = bodies.iter().map(|b| {
        let (c, base, b) = (c.clone(), base.to_owned(), b.clone());
        tokio::spawn(async move { chat(&c, &base, &b).await })
    });
    let running: Vec<_> = running.collect();
    // Crash while requests are in flight (the engine reports them active).
    let t0 = Instant::now();
    loop {
        let m = c
            .get(format!("{base}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let active = m
            .lines()
            .find(|l| l.starts_with("mesh_active_sequences{"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0);
        if active > 0.0 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "nothing ran");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (s, v) = crash(c, base, actor).await;
    assert_eq!(s, 200, "{v}");
    join_all(running)
        .await
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            let (s, v) = r.unwrap();
            assert_eq!(s, 200, "request {i} failed after the {actor} crash: {v}");
            v
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_needs_the_fault_token() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), &[]);
    let c = reqwest::Client::new();
    let r = c
        .post(format!("{}/v1/debug/crash", n.http))
        .header("x-mesh-fault-token", "not-the-token-at-all-0000")
        .json(&json!({"actor": "governor"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    assert_eq!(child(&c, &n.http, "governor").await, (true, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_fault_injection_the_crash_route_is_absent() {
    let dir = tempfile::tempdir().unwrap();
    let n = Node::up(dir.path(), &["--only", "t1", "--threads", "1"]).expect("node");
    let c = reqwest::Client::new();
    let r = c
        .post(format!("{}/v1/debug/crash", n.http))
        .header("x-mesh-fault-token", TOKEN)
        .json(&json!({"actor": "governor"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_router_restarts_within_a_second_and_requests_across_it_succeed() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), &[]);
    let c = reqwest::Client::new();
    let tools = catalog_tools(12);
    let bodies: Vec<Value> = (0..4).map(|i| chat_body(i, &tools, 24)).collect();
    // Warm: the embedding model loads on the first routed request.
    let (s, v) = chat(&c, &n.http, &bodies[0]).await;
    assert_eq!(s, 200, "{v}");
    assert!(
        v["mesh"]["router"]["shown"].as_array().is_some(),
        "routed: {v}"
    );
    let failed = "mesh_tool_routing_total{outcome=\"failed\"}";
    let failed_before = metric(&c, &n.http, failed).await;
    let replies = replies_across_crash(&c, &n.http, "router", &bodies).await;
    assert_eq!(replies.len(), 4);
    // A request the crashed router could not route shows every tool; each is counted.
    let unrouted = replies
        .iter()
        .filter(|v| v["mesh"]["router"]["shown"].as_array().is_none())
        .count();
    assert_eq!(
        metric(&c, &n.http, failed).await - failed_before,
        unrouted as f64,
        "requests that showed every tool during the crash, counted"
    );
    let took = crash_and_time_restart(&c, &n.http, "router").await;
    assert!(
        took < Duration::from_secs(1),
        "router restarted in {took:?}"
    );
    let failed_before = metric(&c, &n.http, failed).await;
    let (s, v) = chat(&c, &n.http, &bodies[1]).await;
    assert_eq!(s, 200, "{v}");
    let shown = v["mesh"]["router"]["shown"].as_array().map_or(0, Vec::len);
    assert!(
        (1..tools.len()).contains(&shown),
        "the restarted router chose a few of the {} tools: {v}",
        tools.len()
    );
    assert_eq!(
        metric(&c, &n.http, failed).await,
        failed_before,
        "the request after the restart was routed, not shown every tool"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_governor_restarts_within_a_second_and_requests_across_it_succeed() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), &[]);
    let c = reqwest::Client::new();
    let bodies: Vec<Value> = (0..4).map(|i| chat_body(i, &[], 24)).collect();
    let before: Vec<String> = join_all(bodies.iter().map(|b| chat(&c, &n.http, b)))
        .await
        .iter()
        .map(|(_, v)| answer(v))
        .collect();
    let during = crash_under_load(&c, &n.http, "governor", &bodies).await;
    assert_eq!(during, before, "the same answers across the crash");
    let took = crash_and_time_restart(&c, &n.http, "governor").await;
    assert!(
        took < Duration::from_secs(1),
        "governor restarted in {took:?}"
    );
    let (s, v) = chat(&c, &n.http, &bodies[0]).await;
    assert_eq!((s, answer(&v)), (200, before[0].clone()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_page_store_restarts_within_a_second_and_answers_stay_correct() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), &["--no-keep-resident"]);
    let c = reqwest::Client::new();
    // Shared tools: a long common prefix, so prompts restore pages from the store.
    let tools = catalog_tools(6);
    let bodies: Vec<Value> = (0..4).map(|i| chat_body(i, &tools, 24)).collect();
    let mut before = vec![];
    for b in &bodies {
        let (s, v) = chat(&c, &n.http, b).await;
        assert_eq!(s, 200, "{v}");
        before.push(answer(&v));
    }
    let during = crash_under_load(&c, &n.http, "kv-store", &bodies).await;
    assert_eq!(during, before, "pages lost, never wrong");
    let took = crash_and_time_restart(&c, &n.http, "kv-store").await;
    assert!(
        took < Duration::from_secs(1),
        "kv-store restarted in {took:?}"
    );
    for (b, want) in bodies.iter().zip(&before) {
        let (s, v) = chat(&c, &n.http, b).await;
        assert_eq!((s, answer(&v)), (200, want.clone()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_tuner_restarts_within_a_second_and_keeps_the_policy() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), &[]);
    let c = reqwest::Client::new();
    let r = c
        .put(format!("{}/v1/control/policy", n.http))
        .json(&json!({"router_top_k": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let took = crash_and_time_restart(&c, &n.http, "tuner").await;
    assert!(took < Duration::from_secs(1), "tuner restarted in {took:?}");
    let p = get_json(&c, format!("{}/v1/control/policy", n.http)).await;
    assert_eq!(
        (p["version"].as_u64(), p["policy"]["router_top_k"].as_u64()),
        (Some(1), Some(4))
    );
    let (s, v) = chat(&c, &n.http, &chat_body(0, &[], 8)).await;
    assert_eq!(s, 200, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_queued_on_a_crashed_engine_wait_for_its_restart() {
    let dir = tempfile::tempdir().unwrap();
    // One slot: the other requests queue on the engine that crashes. Long answers keep
    // them there when the crash comes.
    let n = node(dir.path(), &["--parallel", "1"]);
    let c = reqwest::Client::new();
    let bodies: Vec<Value> = (0..4).map(|i| chat_body(i, &[], 600)).collect();
    let mut before = vec![];
    for b in &bodies {
        let (s, v) = chat(&c, &n.http, b).await;
        assert_eq!(s, 200, "{v}");
        before.push(answer(&v));
    }
    let (_, restarts) = child(&c, &n.http, "engines").await;
    let during = crash_under_load(&c, &n.http, "tier:t1", &bodies).await;
    assert_eq!(
        during, before,
        "every request finished, with the tokens it would have had"
    );
    assert!(
        metric(&c, &n.http, "mesh_request_reruns_total").await >= 1.0,
        "the crash caught requests in flight"
    );
    // The engine was restarted under the engines actor, which itself kept running.
    assert_eq!(child(&c, &n.http, "engines").await, (true, restarts));
}

async fn tiers_of(c: &reqwest::Client, base: &str, node: &str) -> Vec<String> {
    let v: Value = c
        .get(format!("{base}/v1/cluster"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["members"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["node"] == node)
        .map(|m| {
            m["tiers"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| t["name"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_engine_leaves_the_adverts_without_any_request_reaching_it() {
    let dir = tempfile::tempdir().unwrap();
    let certs = certs(dir.path(), &["a", "b"]);
    let env = fault_env();
    let a = Node::start_with_env("a", &certs, &[], "none", &[], &env).expect("a");
    let b = Node::start_with_env("b", &certs, &[&a.quic], "t1", &["--fault-injection"], &env)
        .expect("b");
    let c = reqwest::Client::new();
    let t0 = Instant::now();
    while tiers_of(&c, &a.http, "b").await != ["t1"] {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "b's t1 never advertised"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The engine's restart takes its model load; the advert must drop t1 before it is back.
    let (s, v) = crash(&c, &b.http, "tier:t1").await;
    assert_eq!(s, 200, "{v}");
    let t0 = Instant::now();
    while !tiers_of(&c, &a.http, "b").await.is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the dead t1 is still advertised"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // Requests while t1 is not advertised: a refuses them itself (503, no node hosting t1)
    // instead of sending them to b's dead engine; once t1 is back they are served.
    let mut refused = 0;
    loop {
        let (s, v) = chat(&c, &a.http, &chat_body(refused, &[], 8)).await;
        match s {
            200 => break,
            503 => {
                let why = v["error"]["message"].as_str().unwrap_or_default();
                assert!(
                    why.contains("No node hosting `t1` is available"),
                    "refused at a for want of a node, not by b's dead engine: {v}"
                );
                refused += 1;
            }
            _ => panic!("a request while b's t1 was dead: {s} {v}"),
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the restarted t1 never served"
        );
    }
    assert!(refused >= 1, "no request was sent while t1 was dead");
    while tiers_of(&c, &a.http, "b").await != ["t1"] {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the restarted t1 was not advertised"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_cluster_requests_on_a_crashed_engine_move_to_a_peer() {
    let dir = tempfile::tempdir().unwrap();
    let certs = certs(dir.path(), &["a", "b"]);
    let env = fault_env();
    let a = Node::start_with_env(
        "a",
        &certs,
        &[],
        "t1",
        &["--parallel", "1", "--fault-injection"],
        &env,
    )
    .expect("a");
    let b = Node::start_with_env("b", &certs, &[&a.quic], "t1", &[], &env).expect("b");
    let c = reqwest::Client::new();
    let t0 = Instant::now();
    while tiers_of(&c, &a.http, "b").await != ["t1"] {
        assert!(t0.elapsed() < Duration::from_secs(30), "b never joined");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let bodies: Vec<Value> = (0..4).map(|i| chat_body(i, &[], 600)).collect();
    // The reference answers run through a, so a holds their prefix pages and the router
    // keeps at least the first request of the burst below on a's engine.
    let mut before = vec![];
    for body in &bodies {
        let (s, v) = chat(&c, &a.http, body).await;
        assert_eq!(s, 200, "{v}");
        before.push(answer(&v));
    }
    // Through a, whose only slot runs one request while the others queue; a's engine dies
    // and its requests re-run on b (or, for those routed there already, finish on b).
    // Each generation b's engine starts looks its prompt up in b's page store.
    let lookups = "mesh_kv_prefix_lookups_total";
    let b_before = metric(&c, &b.http, lookups).await;
    let reruns_before = metric(&c, &a.http, "mesh_request_reruns_total").await;
    let during = crash_under_load(&c, &a.http, "tier:t1", &bodies).await;
    assert_eq!(during, before, "the same tokens after the move");
    let reruns = metric(&c, &a.http, "mesh_request_reruns_total").await - reruns_before;
    assert!(reruns >= 1.0, "a's crash caught requests");
    assert!(
        metric(&c, &b.http, lookups).await - b_before >= reruns,
        "b, the peer, started every re-run ({reruns}) of a's requests"
    );
    let a_metrics = c
        .get(format!("{}/metrics", a.http))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        !a_metrics
            .contains("mesh_http_requests_total{endpoint=\"/v1/chat/completions\",status=\"503\"}"),
        "no request was refused while a's engine restarted: {a_metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_membership_crash_does_not_make_the_node_look_dead() {
    let dir = tempfile::tempdir().unwrap();
    let certs = certs(dir.path(), &["a", "b"]);
    let env = fault_env();
    // Default helper settings: heartbeat 100 ms, failure timeout 1,000 ms.
    let a =
        Node::start_with_env("a", &certs, &[], "none", &["--fault-injection"], &env).expect("a");
    let b = Node::start_with_env("b", &certs, &[&a.quic], "t1", &[], &env).expect("b");
    let c = reqwest::Client::new();
    let state_of_a = || {
        let (c, http) = (c.clone(), b.http.clone());
        async move {
            let v: Value = c
                .get(format!("{http}/v1/cluster"))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            v["members"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|m| m["node"] == "a")
                .map(|m| {
                    (
                        m["state"].as_str().unwrap_or("").to_owned(),
                        m["last_seen_ms"].as_u64().unwrap_or(0),
                    )
                })
        }
    };
    let t0 = Instant::now();
    while state_of_a().await.map(|s| s.0).as_deref() != Some("alive") {
        assert!(t0.elapsed() < Duration::from_secs(30), "b never saw a");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = crash_and_time_restart(&c, &a.http, "membership").await;
    assert!(
        took < Duration::from_secs(1),
        "membership restarted in {took:?}"
    );
    // Over two failure timeouts b keeps hearing from a: never dead, never silent for long.
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(2) {
        let (state, silent_ms) = state_of_a().await.expect("b knows a");
        assert_eq!(state, "alive");
        assert!(
            silent_ms < 1000,
            "b has not heard from a for {silent_ms} ms"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_planner_restarts_within_a_second_and_keeps_the_pins() {
    let dir = tempfile::tempdir().unwrap();
    let certs = certs(dir.path(), &["a"]);
    let a = Node::start_with_env("a", &certs, &[], "t1", &["--fault-injection"], &fault_env())
        .expect("a");
    let c = reqwest::Client::new();
    let pin = c
        .post(format!("{}/v1/control/scale", a.http))
        .json(&json!({"tier": "t1", "replicas": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        pin.status(),
        200,
        "{}",
        pin.text().await.unwrap_or_default()
    );
    let took = crash_and_time_restart(&c, &a.http, "planner").await;
    assert!(
        took < Duration::from_secs(1),
        "planner restarted in {took:?}"
    );
    // Pins live outside the actor, so the new incarnation keeps planning t1 at its pin; a
    // tier neither pinned nor under a policy would leave the view at the next tick (1 s).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let v = get_json(&c, format!("{}/v1/control/scale", a.http)).await;
    assert_eq!(v["planning"], true, "{v}");
    assert_eq!(v["tiers"]["t1"]["pinned"], 1, "{v}");
}
