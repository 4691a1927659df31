//! The quantization policy on a `mesh up` process with the bundled t1: `mesh quantize`
//! makes a q4_0 variant; `PUT /v1/control/policy` moves t1's tool calls onto it (q8_0 KV)
//! while four long streams run, then back while two long tool-call streams run on the
//! variant. Every stream completes in full, later requests are served by the engine the
//! policy names (`mesh.engine`, `mesh_engine_requests_total`), the retired engine drains
//! and stops, the policy file's version goes up with each reload, and refused policies
//! (missing GGUF, a tier not hosted, a bad KV type) get 400 and leave the file's bytes.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::StreamExt;
use mesh_tests::{mesh, root, Node};
use serde_json::{json, Value};

/// Long enough that four streams outlast a reload by far (per-sequence context 2048).
const LONG: u64 = 1800;
const VARIANT: &str = "t1:q4_0:q8_0";

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])
}

/// A chat request of each role; `long` ones ignore end-of-generation and run `LONG` tokens.
fn request(role: &str, stream: bool, long: bool) -> Value {
    let mut body = json!({
        "model": "t1",
        "messages": [{"role": "user", "content": "What is the weather in Oslo today?"}],
        "max_tokens": if long { LONG } else { 48 },
        "ignore_eos": long,
        "temperature": 0,
        "stream": stream,
        "stream_options": {"include_usage": true},
    });
    match role {
        "tool_calls" => body["tools"] = tools(),
        "reasoning" => body["reasoning_budget"] = json!(32),
        _ => {}
    }
    if !stream {
        body.as_object_mut().unwrap().remove("stream_options");
    }
    body
}

/// Reads a streamed chat completion to its end; signals `started` at the first token.
/// Returns the completion tokens of the final usage chunk.
async fn stream(
    c: reqwest::Client,
    base: String,
    body: Value,
    started: tokio::sync::oneshot::Sender<()>,
) -> Result<u64, String> {
    let r = c
        .post(format!("{base}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !r.status().is_success() {
        return Err(format!("status {}", r.status()));
    }
    let mut started = Some(started);
    let (mut buf, mut usage, mut done) = (String::new(), None, false);
    let mut s = r.bytes_stream();
    while let Some(chunk) = s.next().await {
        buf.push_str(&String::from_utf8_lossy(&chunk.map_err(|e| e.to_string())?));
        while let Some(i) = buf.find("\n\n") {
            let event: String = buf.drain(..i + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else {
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
            // The gateway's first chunk carries the role and an empty content before the
            // engine has taken the request; only a generated piece counts as started.
            let text = delta["content"].as_str().is_some_and(|t| !t.is_empty());
            if text || delta["tool_calls"].is_array() {
                if let Some(tx) = started.take() {
                    let _ = tx.send(());
                }
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                usage = Some(n);
            }
        }
    }
    match (done, usage) {
        (true, Some(n)) => Ok(n),
        _ => Err(format!("stream ended early (done {done}, usage {usage:?})")),
    }
}

/// Starts `bodies` as streams and returns once each has produced its first token.
async fn start_streams(
    c: &reqwest::Client,
    base: &str,
    bodies: Vec<Value>,
) -> Vec<tokio::task::JoinHandle<Result<u64, String>>> {
    let mut handles = vec![];
    let mut started = vec![];
    for body in bodies {
        let (tx, rx) = tokio::sync::oneshot::channel();
        started.push(rx);
        handles.push(tokio::spawn(stream(c.clone(), base.to_owned(), body, tx)));
    }
    for rx in started {
        rx.await.expect("every stream starts");
    }
    handles
}

async fn call(
    c: &reqwest::Client,
    method: reqwest::Method,
    url: String,
    body: Option<Value>,
) -> (u16, Value) {
    let mut r = c.request(method, url);
    if let Some(b) = body {
        r = r.json(&b);
    }
    let r = r.send().await.expect("answered");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

async fn chat(c: &reqwest::Client, base: &str, body: Value) -> Value {
    let (s, v) = call(
        c,
        reqwest::Method::POST,
        format!("{base}/v1/chat/completions"),
        Some(body),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    v
}

async fn put_policy(c: &reqwest::Client, base: &str, body: Value) -> (u16, Value) {
    call(
        c,
        reqwest::Method::PUT,
        format!("{base}/v1/control/policy"),
        Some(body),
    )
    .await
}

async fn engines(c: &reqwest::Client, base: &str) -> Vec<Value> {
    let (_, v) = call(
        c,
        reqwest::Method::GET,
        format!("{base}/v1/control/policy"),
        None,
    )
    .await;
    v["engines"].as_array().cloned().unwrap_or_default()
}

fn engine<'a>(list: &'a [Value], id: &str) -> Option<&'a Value> {
    list.iter().find(|e| e["id"] == id)
}

fn busy(e: &Value) -> u64 {
    e["active"].as_u64().unwrap_or(0) + e["queued"].as_u64().unwrap_or(0)
}

fn file_version(file: &Path) -> u64 {
    let v: Value = serde_json::from_slice(&std::fs::read(file).unwrap()).unwrap();
    v["version"].as_u64().unwrap()
}

async fn engine_count(c: &reqwest::Client, base: &str, gguf: &str, kv: &str, role: &str) -> u64 {
    let text = c
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let series = format!(
        "mesh_engine_requests_total{{model=\"t1\",gguf=\"{gguf}\",kv_type=\"{kv}\",role=\"{role}\"}} "
    );
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .map_or(0, |v| v.trim().parse().unwrap())
}

/// `<d>/node.toml` naming `file` as the tuner's policy state file.
fn tuner_config(d: &Path, file: &Path) -> PathBuf {
    let config = d.join("node.toml");
    let toml = format!("[tuner]\nstate_file = {:?}\n", file.display().to_string());
    std::fs::write(&config, toml).unwrap();
    config
}

/// `mesh up` of tier t1 at `t1` (1 thread) with `file` as its policy state file.
fn up_with_policy(d: &Path, t1: &Path, file: &Path) -> Result<Node, String> {
    let config = tuner_config(d, file).display().to_string();
    let tier = format!("t1={}", t1.display());
    Node::up(d, &["--config", &config, "--tier", &tier, "--threads", "1"])
}

/// The bundled t1 linked into `d` with a q4_0 variant made next to it by `mesh quantize`
/// (where the quantization policy looks); returns the tier's path.
fn tier_with_q4_variant(d: &Path) -> PathBuf {
    let t1 = d.join("t1-q8_0.gguf");
    std::os::unix::fs::symlink(root().join("models/t1-q8_0.gguf"), &t1).unwrap();
    let t1s = t1.display().to_string();
    let out = mesh(&[
        "quantize",
        "--model",
        &t1s,
        "--type",
        "q4_0",
        "--threads",
        "1",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    t1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_reload_moves_tool_calls_to_a_quantized_engine_without_dropping_requests() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // The tier's file in the temp folder, so its variants are made and found next to it.
    let t1 = tier_with_q4_variant(d);
    let t1s = t1.display().to_string();
    let variant: PathBuf = d.join("t1-q4_0.gguf");
    let size = |p: &Path| std::fs::metadata(p).unwrap().len();
    assert!(
        size(&variant) < size(&t1) * 7 / 10,
        "q4_0 ({} B) is well under q8_0 ({} B)",
        size(&variant),
        size(&t1)
    );

    let file = d.join("policy.json");
    let config = tuner_config(d, &file);
    let node = Node::up(
        d,
        &[
            "--config",
            &config.display().to_string(),
            "--tier",
            &format!("t1={t1s}"),
            "--threads",
            "1",
            "--ctx",
            "8192",
            "--parallel",
            "4",
        ],
    )
    .expect("node starts");
    let base = node.http.clone();
    let c = reqwest::Client::builder()
        .timeout(Duration::from_secs(180))
        .build()
        .unwrap();
    assert_eq!(file_version(&file), 0);
    let list = engines(&c, &base).await;
    assert_eq!(list.len(), 1, "{list:?}");
    assert_eq!(
        (list[0]["gguf"].as_str(), list[0]["kv_type"].as_str()),
        (Some("t1-q8_0.gguf"), Some("f16"))
    );

    // Phase 1: tool calls move to the q4_0 variant with q8_0 KV while two tool-call and two
    // summary streams run on t1's own engine.
    let handles = start_streams(
        &c,
        &base,
        ["tool_calls", "summaries", "tool_calls", "summaries"]
            .iter()
            .map(|r| request(r, true, true))
            .collect(),
    )
    .await;
    let t0 = Instant::now();
    let (s, v) = put_policy(
        &c,
        &base,
        json!({"quantization": {"tool_calls": {"t1": {"gguf": "q4_0", "kv": "q8_0"}}}}),
    )
    .await;
    let reload_ms = t0.elapsed().as_millis();
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["version"], 1);
    let list = v["engines"].as_array().unwrap();
    assert_eq!(
        busy(engine(list, "t1").unwrap()),
        4,
        "all four streams were running on t1's own engine across the swap: {list:?}"
    );
    let new = engine(list, VARIANT).expect("the variant runs before the swap");
    assert_eq!(
        (
            new["gguf"].as_str(),
            new["kv_type"].as_str(),
            new["state"].as_str()
        ),
        (Some("t1-q4_0.gguf"), Some("q8_0"), Some("serving"))
    );
    for h in handles {
        assert_eq!(
            h.await.unwrap(),
            Ok(LONG),
            "an in-flight stream completes in full"
        );
    }
    assert_eq!(
        engine_count(&c, &base, "t1-q8_0.gguf", "f16", "tool_calls").await,
        2
    );
    assert_eq!(
        engine_count(&c, &base, "t1-q8_0.gguf", "f16", "summaries").await,
        2
    );

    // Later requests: tool calls on the variant, the other roles on t1's own engine.
    let v = chat(&c, &base, request("tool_calls", false, false)).await;
    assert_eq!(
        v["mesh"]["engine"],
        json!({"gguf": "t1-q4_0.gguf", "kv_type": "q8_0", "role": "tool_calls"}),
        "{v}"
    );
    let v = chat(&c, &base, request("summaries", false, false)).await;
    assert_eq!(
        v["mesh"]["engine"],
        json!({"gguf": "t1-q8_0.gguf", "kv_type": "f16", "role": "summaries"}),
        "{v}"
    );
    let v = chat(&c, &base, request("reasoning", false, false)).await;
    assert_eq!(
        v["mesh"]["engine"],
        json!({"gguf": "t1-q8_0.gguf", "kv_type": "f16", "role": "reasoning"}),
        "{v}"
    );
    assert_eq!(
        engine_count(&c, &base, "t1-q4_0.gguf", "q8_0", "tool_calls").await,
        1
    );
    assert_eq!(file_version(&file), 1);
    let state: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    assert_eq!(
        state["policy"]["quantization"]["tool_calls"]["t1"],
        json!({"gguf": "q4_0", "kv": "q8_0"})
    );
    assert_eq!(state["history"][0]["rule"], "operator");
    assert_eq!(state["history"][0]["knob"], "quantization");

    // Phase 2: the policy drops the variant while two long tool-call streams run on it:
    // they finish there, then it stops.
    let handles = start_streams(
        &c,
        &base,
        vec![
            request("tool_calls", true, true),
            request("tool_calls", true, true),
        ],
    )
    .await;
    let (s, v) = put_policy(&c, &base, json!({"quantization": {}})).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["version"], 2);
    let list = v["engines"].as_array().unwrap();
    let old = engine(list, VARIANT).expect("the retired engine is listed while it drains");
    assert_eq!(old["state"], "draining", "{list:?}");
    assert!(
        busy(old) >= 1,
        "streams were still on the retired engine: {old}"
    );
    let v = chat(&c, &base, request("tool_calls", false, false)).await;
    assert_eq!(
        v["mesh"]["engine"],
        json!({"gguf": "t1-q8_0.gguf", "kv_type": "f16", "role": "tool_calls"}),
        "new tool calls go to t1's own engine at once: {v}"
    );
    for h in handles {
        assert_eq!(
            h.await.unwrap(),
            Ok(LONG),
            "a stream on the retired engine completes in full"
        );
    }
    let t0 = Instant::now();
    while engine(&engines(&c, &base).await, VARIANT).is_some() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the retired engine never stopped"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        engine_count(&c, &base, "t1-q4_0.gguf", "q8_0", "tool_calls").await,
        3
    );
    assert_eq!(file_version(&file), 2);

    // Phase 3: refused policies change nothing.
    let before = std::fs::read(&file).unwrap();
    let (s, v) = put_policy(
        &c,
        &base,
        json!({"quantization": {"tool_calls": {"t1": {"gguf": "q5_0"}}}}),
    )
    .await;
    assert_eq!(s, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("t1-q5_0.gguf does not exist") && msg.contains("mesh quantize"),
        "{msg}"
    );
    assert_eq!(v["error"]["param"], "quantization.tool_calls.t1.gguf");
    let (s, v) = put_policy(
        &c,
        &base,
        json!({"quantization": {"summaries": {"t3": {"kv": "q8_0"}}}}),
    )
    .await;
    assert_eq!(s, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not hosted"),
        "{v}"
    );
    let (s, v) = put_policy(
        &c,
        &base,
        json!({"quantization": {"reasoning": {"t1": {"kv": "q2"}}}}),
    )
    .await;
    assert_eq!(s, 400, "{v}");
    assert_eq!(
        std::fs::read(&file).unwrap(),
        before,
        "the file keeps its bytes"
    );
    let (_, v) = call(
        &c,
        reqwest::Method::GET,
        format!("{base}/v1/control/policy"),
        None,
    )
    .await;
    assert_eq!(v["version"], 2);
    assert_eq!(v["engines"].as_array().unwrap().len(), 1, "{v}");
    eprintln!("reload with a new engine: {reload_ms} ms");
}

#[test]
fn a_state_file_naming_a_missing_variant_stops_the_node_with_its_path() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let t1 = d.join("t1-q8_0.gguf");
    std::os::unix::fs::symlink(root().join("models/t1-q8_0.gguf"), &t1).unwrap();
    let file = d.join("policy.json");
    let state = json!({"format": 1, "version": 3, "history": [],
        "policy": {"quantization": {"summaries": {"t1": {"gguf": "q5_0"}}}}});
    std::fs::write(&file, state.to_string()).unwrap();
    let log = up_with_policy(d, &t1, &file)
        .map(|_| ())
        .expect_err("the node refuses to start");
    assert!(
        log.contains("policy.json") && log.contains("t1-q5_0.gguf does not exist"),
        "{log}"
    );
}

/// A request forwarded to a peer carries its role (`GenerateCall.role`, wire version 3): the
/// peer runs it on the engine its own policy gives that role, and holds that engine while
/// the stream lasts. Node b hosts t1 with tool calls on a q4_0 variant; node a hosts no
/// tier, so every request through a's gateway is served by b.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_serves_a_forwarded_request_on_the_engine_its_policy_gives_the_role() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let t1 = tier_with_q4_variant(d);
    let t1s = t1.display().to_string();
    let file = d.join("policy.json");
    let state = json!({"format": 1, "version": 0, "history": [],
        "policy": {"quantization": {"tool_calls": {"t1": {"gguf": "q4_0"}}}}});
    std::fs::write(&file, state.to_string()).unwrap();
    let config = tuner_config(d, &file);
    let certs = d.join("certs");
    let c_dir = certs.display().to_string();
    assert!(mesh(&["cert", "init", "--dir", &c_dir]).status.success());
    for n in ["a", "b"] {
        assert!(mesh(&["cert", "issue", n, "--dir", &c_dir])
            .status
            .success());
    }
    let tier = format!("t1={t1s}");
    let b = Node::start(
        "b",
        &certs,
        &[],
        "t1",
        &["--config", &config.display().to_string(), "--tier", &tier],
    )
    .expect("b starts");
    let a = Node::start("a", &certs, &[&b.quic], "none", &[]).expect("a joins");
    let c = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    let t0 = Instant::now();
    loop {
        let (_, v) = call(
            &c,
            reqwest::Method::GET,
            format!("{}/v1/cluster", a.http),
            None,
        )
        .await;
        let hosts =
            v["members"].as_array().into_iter().flatten().any(|m| {
                m["node"] == "b" && m["state"] == "alive" && m["tiers"][0]["name"] == "t1"
            });
        if hosts {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "a never saw b's t1: {v}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let tokens = |list: &[Value], gguf: &str| -> u64 {
        list.iter()
            .find(|e| e["gguf"] == gguf)
            .unwrap_or_else(|| panic!("no {gguf} engine: {list:?}"))["prompt_tokens"]
            .as_u64()
            .unwrap()
    };
    let before = engines(&c, &b.http).await;
    assert_eq!(before.len(), 2, "b runs t1 and its variant: {before:?}");
    let (own0, variant0) = (
        tokens(&before, "t1-q8_0.gguf"),
        tokens(&before, "t1-q4_0.gguf"),
    );

    // A tool call through a: served by b on the q4_0 variant, and it parses.
    let v = chat(&c, &a.http, request("tool_calls", false, false)).await;
    assert!(
        v["choices"][0]["message"]["tool_calls"][0]["function"]["name"].is_string(),
        "{v}"
    );
    let after = engines(&c, &b.http).await;
    assert!(tokens(&after, "t1-q4_0.gguf") > variant0, "{after:?}");
    assert_eq!(tokens(&after, "t1-q8_0.gguf"), own0, "{after:?}");

    // A plain answer through a: the policy names no engine for summaries, so t1's own.
    chat(&c, &a.http, request("summaries", false, false)).await;
    let last = engines(&c, &b.http).await;
    assert!(tokens(&last, "t1-q8_0.gguf") > own0, "{last:?}");
    assert_eq!(
        tokens(&last, "t1-q4_0.gguf"),
        tokens(&after, "t1-q4_0.gguf"),
        "{last:?}"
    );
}

/// SIGHUP makes a node read its policy state file again: an operator's edit of the policy
/// section is put in force like a `PUT /v1/control/policy` (engines started, decision
/// journaled, version up); an unreadable file or a policy naming a missing variant changes
/// nothing, and the node keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_puts_an_edited_state_file_in_force_and_refuses_a_bad_one() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let t1 = tier_with_q4_variant(d);
    let file = d.join("policy.json");
    let node = up_with_policy(d, &t1, &file).expect("node starts");
    let log = node.log.clone();
    let c = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    let policy = async |c: &reqwest::Client| {
        call(
            c,
            reqwest::Method::GET,
            format!("{}/v1/control/policy", node.http),
            None,
        )
        .await
        .1
    };
    assert_eq!(policy(&c).await["version"], 0);
    let refusals = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .matches("SIGHUP: policy not reloaded")
            .count()
    };

    // The operator moves tool calls to the q4_0 variant in the file, then signals.
    let mut state: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    state["policy"]["quantization"] = json!({"tool_calls": {"t1": {"gguf": "q4_0"}}});
    std::fs::write(&file, state.to_string()).unwrap();
    node.signal("HUP");
    let t0 = Instant::now();
    while policy(&c).await["version"] != 1 {
        assert!(t0.elapsed() < Duration::from_secs(30), "SIGHUP not applied");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let now = policy(&c).await;
    assert_eq!(
        now["policy"]["quantization"]["tool_calls"]["t1"]["gguf"],
        "q4_0"
    );
    let v = chat(&c, &node.http, request("tool_calls", false, false)).await;
    assert_eq!(v["mesh"]["engine"]["gguf"], "t1-q4_0.gguf", "{v}");
    let written: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    assert_eq!(written["version"], 1);
    let last = written["history"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert!(
        last["reason"].as_str().unwrap().contains("SIGHUP"),
        "{last}"
    );

    // Bad edits: not JSON; then a variant that was never made. Each is refused as a whole.
    for (n, bad) in [
        "{ not json".to_owned(),
        json!({"format": 1, "version": 1, "history": [],
               "policy": {"quantization": {"summaries": {"t1": {"gguf": "q5_0"}}}}})
        .to_string(),
    ]
    .into_iter()
    .enumerate()
    {
        std::fs::write(&file, &bad).unwrap();
        node.signal("HUP");
        let t0 = Instant::now();
        while refusals() < n + 1 {
            assert!(t0.elapsed() < Duration::from_secs(30), "no refusal logged");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let now = policy(&c).await;
        assert_eq!(now["version"], 1, "{now}");
        assert_eq!(
            now["policy"]["quantization"]["tool_calls"]["t1"]["gguf"],
            "q4_0"
        );
        assert!(
            now["policy"]["quantization"].get("summaries").is_none(),
            "{now}"
        );
    }
    let v = chat(&c, &node.http, request("summaries", false, false)).await;
    assert_eq!(v["mesh"]["engine"]["gguf"], "t1-q8_0.gguf", "{v}");
}
