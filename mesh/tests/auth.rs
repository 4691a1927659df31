//! API keys on a live node (bundled t1, the reference MCP filesystem server): every `/v1`
//! route asks for a key with the scope it needs; health, readiness and metrics stay open;
//! agent tasks run only the tools their key may run; a node on an open address without
//! keys does not start.

use crate::common;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use mesh::config::NodeConfig;
use mesh::keys::{self, Scope};
use mesh_control::mcp::McpServerConfig;
use serde_json::{json, Value};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A node hosting the bundled t1 on `listen`.
fn t1_node(listen: &str) -> NodeConfig {
    NodeConfig {
        listen: listen.parse().unwrap(),
        ..common::t1_config(4096, 2)
    }
}

/// The shared node and its keys.
struct Fixture {
    base: String,
    /// The folder the filesystem server may write to.
    dir: PathBuf,
    inference: String,
    agent: String,
    agent_writer: String,
    control: String,
}

static NODE: OnceLock<String> = OnceLock::new();
static FIXTURE: OnceLock<Fixture> = OnceLock::new();

fn fixture() -> &'static Fixture {
    FIXTURE.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap().keep();
        let file = dir.join("keys.json");
        let make = |scopes: Vec<Scope>, tools: Option<Vec<&str>>| {
            let tools = tools.map(|t| t.into_iter().map(str::to_owned).collect());
            keys::create(&file, "test", scopes, tools, keys::KeyLimits::default())
                .unwrap()
                .1
        };
        let inference = make(vec![Scope::Inference], None);
        let agent = make(vec![Scope::Agent], None);
        let agent_writer = make(
            vec![Scope::Agent],
            Some(vec!["list_allowed_directories", "write_file"]),
        );
        let control = make(vec![Scope::Control], None);
        let work = dir.join("files");
        std::fs::create_dir_all(&work).unwrap();
        let work = work.canonicalize().unwrap();
        let (file2, work2) = (file.clone(), work.clone());
        let base = common::shared_node(&NODE, move || {
            let js = root().join(
                ".cache/mcp/node_modules/@modelcontextprotocol/server-filesystem/dist/index.js",
            );
            let mut cfg = t1_node("127.0.0.1:0");
            cfg.tool_routing.route_above = 0;
            cfg.mcp.servers = vec![McpServerConfig::stdio(
                "fs",
                "node",
                &[js.to_str().unwrap(), work2.to_str().unwrap()],
            )];
            cfg.auth.keys_file = Some(file2);
            cfg
        });
        Fixture {
            base,
            dir: work,
            inference,
            agent,
            agent_writer,
            control,
        }
    })
}

async fn call(
    method: reqwest::Method,
    path: &str,
    key: Option<&str>,
    body: Option<Value>,
) -> (u16, reqwest::header::HeaderMap, Value) {
    let f = fixture();
    let mut r = reqwest::Client::new().request(method, format!("{}{path}", f.base));
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    if let Some(b) = body {
        r = r.json(&b);
    }
    let r = r.send().await.unwrap();
    let (status, headers) = (r.status().as_u16(), r.headers().clone());
    let text = r.text().await.unwrap();
    (
        status,
        headers,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

fn chat_body() -> Value {
    json!({"model": "t1", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_a_key_gets_401_in_openais_shape() {
    let (status, headers, body) = call(
        reqwest::Method::POST,
        "/v1/chat/completions",
        None,
        Some(chat_body()),
    )
    .await;
    assert_eq!(status, 401, "{body}");
    assert_eq!(body["error"]["code"], "invalid_api_key", "{body}");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(headers["www-authenticate"]
        .to_str()
        .unwrap()
        .starts_with("Bearer"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_that_is_not_the_nodes_gets_401() {
    let forged = format!("msk_00000000_{}", "0".repeat(48));
    let (status, _, body) = call(reqwest::Method::GET, "/v1/models", Some(&forged), None).await;
    assert_eq!(status, 401, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inference_key_completes_a_chat() {
    let f = fixture();
    let (status, _, body) = call(
        reqwest::Method::POST,
        "/v1/chat/completions",
        Some(&f.inference),
        Some(chat_body()),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(body["choices"][0]["message"].is_object(), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inference_key_may_not_change_the_policy() {
    let f = fixture();
    let (status, _, body) = call(
        reqwest::Method::PUT,
        "/v1/control/policy",
        Some(&f.inference),
        Some(json!({"policy": {}, "reason": "not allowed"})),
    )
    .await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(body["error"]["type"], "permission_error", "{body}");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("control"));
    let (status, _, policy) = call(
        reqwest::Method::GET,
        "/v1/control/policy",
        Some(&f.control),
        None,
    )
    .await;
    assert_eq!(status, 200, "{policy}");
    assert_eq!(policy["version"], 0, "{policy}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_key_may_not_run_completions() {
    let f = fixture();
    let (status, _, body) = call(
        reqwest::Method::POST,
        "/v1/chat/completions",
        Some(&f.control),
        Some(chat_body()),
    )
    .await;
    assert_eq!(status, 403, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_readiness_and_metrics_need_no_key() {
    for path in ["/health", "/ready", "/metrics"] {
        let (status, _, body) = call(reqwest::Method::GET, path, None, None).await;
        assert_eq!(status, 200, "{path}: {body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_counted() {
    call(reqwest::Method::GET, "/v1/models", None, None).await;
    let (_, _, text) = call(reqwest::Method::GET, "/metrics", None, None).await;
    let text = text.as_str().unwrap().to_owned();
    let line = text
        .lines()
        .find(|l| l.starts_with("mesh_auth_refused_total{status=\"unauthenticated\"}"))
        .unwrap_or_else(|| panic!("no refusal series in:\n{text}"));
    let n: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(n >= 1.0, "{line}");
}

/// `POST /v1/agent/tasks` with `key`: one turn offering `tools`, forced to call `first`.
async fn agent_task(key: &str, input: &str, tools: &[&str], first: Option<&str>) -> (u16, Value) {
    let mut body = json!({"model": "t1", "input": input, "tools": tools,
        "max_turns": 1, "max_tokens": 64});
    if let Some(f) = first {
        body["tool_choice"] = json!({"type": "function", "function": {"name": f}});
    }
    let (status, _, v) = call(
        reqwest::Method::POST,
        "/v1/agent/tasks",
        Some(key),
        Some(body),
    )
    .await;
    (status, v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_key_without_a_tool_list_may_not_run_a_tool_with_side_effects() {
    let f = fixture();
    let target = f.dir.join("written.txt");
    let input = format!("Write hello to {}", target.display());
    let (status, body) = agent_task(&f.agent, &input, &["write_file"], Some("write_file")).await;
    assert_eq!(status, 403, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("side effects"),
        "{body}"
    );
    assert!(!target.exists(), "the tool ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_key_without_a_tool_list_runs_a_read_only_tool() {
    let f = fixture();
    let tool = "list_allowed_directories";
    let (status, body) =
        agent_task(&f.agent, "Which folders may you read?", &[tool], Some(tool)).await;
    assert_eq!(status, 200, "{body}");
    let first = &body["turns"][0]["tool_calls"][0];
    assert_eq!(first["name"], tool, "{body}");
    assert_eq!(first["is_error"], false, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_listing_a_tool_with_side_effects_may_offer_it() {
    let f = fixture();
    let tools = ["list_allowed_directories", "write_file"];
    let (status, body) = agent_task(
        &f.agent_writer,
        "Which folders may you read?",
        &tools,
        Some(tools[0]),
    )
    .await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_may_not_offer_a_tool_outside_its_list() {
    let f = fixture();
    let (status, body) =
        agent_task(&f.agent_writer, "Read notes.txt", &["read_text_file"], None).await;
    assert_eq!(status, 403, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sdk_sends_its_key() {
    let f = fixture();
    use mesh::client::{ChatRequest, Client, ClientError, Message};
    let req = ChatRequest::new("t1", vec![Message::user("Hi")]);
    let without = Client::new([f.base.clone()]).unwrap();
    match without.chat(&req).await {
        Err(ClientError::Refused { status, .. }) => assert_eq!(status, 401),
        other => panic!("expected a 401, got {other:?}"),
    }
    let with = Client::new([f.base.clone()])
        .unwrap()
        .with_api_key(f.inference.clone());
    with.chat(&req).await.expect("the keyed client completes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_on_an_open_address_without_keys_refuses_to_start() {
    let cfg = t1_node("0.0.0.0:0");
    let err = match mesh::start(cfg, std::future::pending()).await {
        Ok(_) => panic!("the node started"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("refusing to serve") && err.contains("--insecure-no-auth"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_file_with_no_keys_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("keys.json");
    std::fs::write(&file, r#"{"keys": []}"#).unwrap();
    let mut cfg = t1_node("127.0.0.1:0");
    cfg.auth.keys_file = Some(file);
    let err = match mesh::start(cfg, std::future::pending()).await {
        Ok(_) => panic!("the node started"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("holds no keys"), "{err}");
}
