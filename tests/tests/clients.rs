//! Official clients and the web console against a cluster of separate `mesh join`
//! processes: `serving` hosts t1, `entry` is a gateway only, so everything sent to `entry`
//! is served by its peer. One behaviour per test; the cluster is started once for this
//! test binary ([`shared`]).
//!
//! The Anthropic checks need the `anthropic` package, the console checks `selenium` and
//! Debian's `chromium` and `chromium-driver` (scripts/setup.sh installs all of them;
//! `MESH_PYTHON` names the Python, else `python3`). With `MESH_CONSOLE_SHOTS=DIR` the
//! console checks save a screenshot of each pane there (docs/console.md's pictures).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use mesh_tests::{mesh, run_python, Node};
use serde_json::Value;

/// The two-node cluster the tests share.
struct Shared {
    _serving: Node,
    entry: Node,
}

fn certificates(base: &Path, names: &[&str]) -> PathBuf {
    let certs = base.join("certs");
    let c = certs.display().to_string();
    for args in std::iter::once(vec!["cert", "init", "--dir", &c])
        .chain(names.iter().map(|n| vec!["cert", "issue", n, "--dir", &c]))
    {
        let out = mesh(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    certs
}

/// Starts the cluster once, from a thread that lives as long as this test process (its
/// nodes die with that thread), and waits until `entry` can route to t1 on `serving`.
fn shared() -> &'static Shared {
    static CLUSTER: OnceLock<Shared> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let dir = tempfile::tempdir().unwrap().keep();
            let certs = certificates(&dir, &["serving", "entry"]);
            let serving = Node::start("serving", &certs, &[], "t1", &["--threads", "2"])
                .expect("serving starts");
            let entry =
                Node::start("entry", &certs, &[&serving.quic], "none", &[]).expect("entry joins");
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let deadline = Instant::now() + Duration::from_secs(30);
                loop {
                    let models: Value = reqwest::get(format!("{}/v1/models", entry.http))
                        .await
                        .expect("models")
                        .json()
                        .await
                        .expect("json");
                    let ids: Vec<&str> = models["data"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|m| m["id"].as_str())
                        .collect();
                    if ids.contains(&"t1") {
                        break;
                    }
                    assert!(Instant::now() < deadline, "entry never saw t1: {models}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            });
            tx.send(Shared {
                _serving: serving,
                entry,
            })
            .unwrap();
            loop {
                std::thread::park();
            }
        });
        rx.recv().expect("the shared cluster started")
    })
}

fn anthropic_check(check: &str) {
    let s = shared();
    run_python(
        "anthropic_e2e.py",
        &["--base-url", &s.entry.http, "--check", check],
    );
}

fn console_check(check: &str, extra: &[&str]) {
    let s = shared();
    let shots = std::env::var("MESH_CONSOLE_SHOTS").unwrap_or_default();
    let mut args = vec![
        "--base-url",
        &s.entry.http,
        "--check",
        check,
        "--nodes",
        "2",
    ];
    if !shots.is_empty() {
        args.extend(["--shots", &shots]);
    }
    args.extend(extra);
    run_python("console_e2e.py", &args);
}

#[test]
fn an_anthropic_message_is_served_through_a_gateway_only_peer() {
    anthropic_check("plain");
}

#[test]
fn an_anthropic_stream_is_served_through_a_gateway_only_peer() {
    anthropic_check("streaming");
}

#[test]
fn an_anthropic_tool_call_is_served_through_a_gateway_only_peer() {
    anthropic_check("tool_call");
}

#[test]
fn an_anthropic_tool_result_turn_is_served_through_a_gateway_only_peer() {
    anthropic_check("tool_result");
}

#[test]
fn the_console_streams_a_reply_and_names_the_tier_that_answered() {
    console_check("chat", &[]);
}

#[test]
fn the_console_shows_a_tool_call_as_a_tool_call() {
    console_check("tool_call", &[]);
}

#[test]
fn the_console_cluster_pane_lists_the_second_node() {
    console_check("cluster", &[]);
}

#[test]
fn the_console_policy_pane_shows_the_live_policy() {
    console_check("policy", &[]);
}

/// A standalone node with API keys and an inference-only key for it.
fn keyed_node() -> (tempfile::TempDir, Node, String) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("keys.json").display().to_string();
    let out = mesh(&["keys", "create", "--scope", "inference", "--file", &file]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let key = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let node = Node::up(
        dir.path(),
        &["--only", "t1", "--threads", "2", "--keys", &file],
    )
    .unwrap_or_else(|log| panic!("mesh up exited before listening:\n{log}"));
    (dir, node, key)
}

#[test]
fn the_console_asks_for_a_key_and_chats_with_it() {
    let (_dir, node, key) = keyed_node();
    run_python(
        "console_e2e.py",
        &["--base-url", &node.http, "--check", "chat", "--key", &key],
    );
}

#[test]
fn the_console_says_when_a_key_lacks_the_control_scope() {
    let (_dir, node, key) = keyed_node();
    run_python(
        "console_e2e.py",
        &[
            "--base-url",
            &node.http,
            "--check",
            "policy_refused",
            "--key",
            &key,
        ],
    );
}

#[test]
fn an_anthropic_client_is_served_with_its_key_in_x_api_key() {
    let (_dir, node, key) = keyed_node();
    run_python(
        "anthropic_e2e.py",
        &[
            "--base-url",
            &node.http,
            "--check",
            "plain",
            "--api-key",
            &key,
        ],
    );
}

#[test]
fn a_wrong_key_is_an_authentication_error_in_anthropics_shape() {
    let (_dir, node, _key) = keyed_node();
    run_python(
        "anthropic_e2e.py",
        &[
            "--base-url",
            &node.http,
            "--check",
            "key_refused",
            "--api-key",
            "msk_00000000_nope",
        ],
    );
}
