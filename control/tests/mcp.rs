//! MCP client against real, independently written MCP servers: the reference
//! `@modelcontextprotocol/server-filesystem` (stdio) and
//! `@modelcontextprotocol/server-everything` (streamable HTTP), installed by
//! `scripts/setup.sh` into `.cache/mcp`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mesh_control::mcp::{McpError, McpHub, McpServerConfig};
use mesh_control::spec_tools::{Source, Speculation, ToolRunner};
use serde_json::json;

fn server_js(package: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../.cache/mcp/node_modules/@modelcontextprotocol")
        .join(package)
        .join("dist/index.js");
    assert!(
        p.exists(),
        "{} is missing: run scripts/setup.sh (it installs the reference MCP servers)",
        p.display()
    );
    p
}

fn filesystem(root: &Path) -> McpServerConfig {
    McpServerConfig::stdio(
        "fs",
        "node",
        &[
            server_js("server-filesystem").to_str().unwrap(),
            root.to_str().unwrap(),
        ],
    )
}

/// The flag that gives Node 18 (Debian 12's `nodejs`) the global `crypto` server-everything
/// names its HTTP sessions with; later versions have it without a flag.
fn webcrypto_flag() -> Option<&'static str> {
    let out = Command::new("node")
        .arg("--version")
        .output()
        .expect("node runs (scripts/setup.sh installs it)");
    let version = String::from_utf8_lossy(&out.stdout);
    let major: u32 = version
        .trim()
        .trim_start_matches('v')
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .unwrap_or_else(|| panic!("node --version printed {version:?}"));
    (major < 19).then_some("--experimental-global-webcrypto")
}

/// `server-everything` over streamable HTTP on a free port; killed on drop.
struct Everything {
    child: Child,
    port: u16,
}

impl Everything {
    fn start(port: u16) -> Self {
        let child = Command::new("node")
            .args(webcrypto_flag())
            .arg(server_js("server-everything"))
            .arg("streamableHttp")
            .env("PORT", port.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("node starts");
        // Wait until it accepts connections.
        let t0 = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "server-everything did not listen"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Self { child, port }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/mcp", self.port)
    }
}

impl Drop for Everything {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test]
async fn stdio_filesystem_server_lists_and_runs_tools() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    std::fs::write(root.join("notes.txt"), "the launch is on friday\n").unwrap();
    let hub = McpHub::connect(&[filesystem(&root)]).await;
    let status = hub.servers();
    assert!(status[0].connected, "{status:?}");
    let read = hub.tool("read_text_file").expect("read_text_file listed");
    assert!(read.read_only, "annotated readOnlyHint: true");
    assert_eq!(read.server, "fs");
    assert!(read.parameters["properties"]["path"].is_object());
    assert!(!hub.tool("write_file").expect("write_file listed").read_only);
    assert!(hub.tools().len() >= 10, "{} tools", hub.tools().len());

    let path = root.join("notes.txt");
    let out = hub
        .call("read_text_file", &json!({"path": path}))
        .await
        .unwrap();
    assert!(!out.is_error);
    assert_eq!(out.text, "the launch is on friday\n");

    // Outside the allowed folder: the server answers with an error result.
    let denied = hub
        .call("read_text_file", &json!({"path": "/etc/hostname"}))
        .await;
    match denied {
        Ok(o) => assert!(o.is_error, "{o:?}"),
        Err(e) => assert!(matches!(e, McpError::Refused { .. }), "{e}"),
    }
    assert_eq!(
        hub.call("no_such_tool", &json!({})).await.unwrap_err(),
        McpError::UnknownTool("no_such_tool".into())
    );
    assert_eq!(
        hub.call("read_text_file", &json!(["not", "an", "object"]))
            .await
            .unwrap_err(),
        McpError::BadArguments("read_text_file".into())
    );
}

#[tokio::test]
async fn streamable_http_server_and_a_server_that_crashes() {
    let port = free_port();
    let server = Everything::start(port);
    let hub = McpHub::connect(&[McpServerConfig::http("everything", &server.url())]).await;
    assert!(hub.servers()[0].connected, "{:?}", hub.servers());
    let out = hub
        .call("echo", &json!({"message": "over http"}))
        .await
        .unwrap();
    assert!(out.text.contains("over http"), "{out:?}");
    let sum = hub
        .call("get-sum", &json!({"a": 2, "b": 40}))
        .await
        .unwrap();
    assert!(sum.text.contains("42"), "{sum:?}");

    // The server dies: the next call fails with a clear error, quickly.
    drop(server);
    let t0 = Instant::now();
    let err = hub
        .call("echo", &json!({"message": "x"}))
        .await
        .unwrap_err();
    assert!(
        t0.elapsed() < Duration::from_secs(15),
        "took {:?}",
        t0.elapsed()
    );
    assert!(
        matches!(
            err,
            McpError::Gone { .. } | McpError::Connect { .. } | McpError::Timeout { .. }
        ),
        "{err}"
    );
    // It comes back on the same port: the hub reconnects on the next call.
    let _server = Everything::start(port);
    let mut ok = None;
    for _ in 0..3 {
        match hub.call("echo", &json!({"message": "back"})).await {
            Ok(o) => {
                ok = Some(o);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(300)).await,
        }
    }
    assert!(ok.expect("reconnected").text.contains("back"));
}

#[tokio::test]
async fn a_hanging_tool_times_out_and_broken_servers_are_reported() {
    let port = free_port();
    let server = Everything::start(port);
    let mut slow = McpServerConfig::http("everything", &server.url());
    slow.call_timeout_ms = 500;
    let dir = tempfile::tempdir().unwrap();
    let mut silent = McpServerConfig::stdio("silent", "sleep", &["30"]);
    silent.connect_timeout_ms = 500;
    let t0 = Instant::now();
    let hub = McpHub::connect(&[
        slow,
        McpServerConfig::stdio("broken", "/nonexistent/mcp-server", &[]),
        silent,
        filesystem(dir.path()),
    ])
    .await;
    assert!(
        t0.elapsed() < Duration::from_secs(15),
        "connect took {:?}",
        t0.elapsed()
    );
    let st = hub.servers();
    assert!(st[0].connected && st[3].connected, "{st:?}");
    assert!(
        !st[1].connected
            && st[1]
                .error
                .as_deref()
                .unwrap()
                .contains("could not be started"),
        "{st:?}"
    );
    assert!(
        !st[2].connected && st[2].error.as_deref().unwrap().contains("500 ms"),
        "{st:?}"
    );
    // The working servers' tools are all there, the broken ones add none.
    assert!(hub.tool("echo").is_some() && hub.tool("read_text_file").is_some());
    assert_eq!(st[1].tools + st[2].tools, 0);

    let t0 = Instant::now();
    let err = hub
        .call(
            "trigger-long-running-operation",
            &json!({"duration": 20, "steps": 2}),
        )
        .await
        .unwrap_err();
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "waited {:?}",
        t0.elapsed()
    );
    assert_eq!(
        err,
        McpError::Timeout {
            server: "everything".into(),
            tool: "trigger-long-running-operation".into(),
            ms: 500
        }
    );
    // The server is still usable afterwards.
    assert!(hub
        .call("echo", &json!({"message": "still here"}))
        .await
        .unwrap()
        .text
        .contains("still here"));
}

#[tokio::test]
async fn speculation_runs_reads_early_and_never_writes() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    std::fs::write(root.join("notes.txt"), "alpha\n").unwrap();
    let hub = Arc::new(McpHub::connect(&[filesystem(&root)]).await);
    let runner = Arc::new(ToolRunner::new(hub, Duration::from_secs(60)));

    // A predicted write is refused and never reaches the server.
    let target = root.join("written.txt");
    let write_args = json!({"path": target, "content": "should not exist"});
    assert_eq!(
        runner.speculate("write_file", &write_args).0,
        Speculation::RefusedSideEffect
    );
    // Refused means nothing was started: no call reached the server.
    let c = runner.counts();
    assert_eq!((c.refused, c.started, c.executed), (1, 0, 0));

    // A predicted read runs at once; the model's identical call takes its result.
    let read_args = json!({"path": root.join("notes.txt")});
    let (what, _) = runner.speculate("read_text_file", &read_args);
    assert_eq!(what, Speculation::Started);
    let e = runner.execute("read_text_file", &read_args).await.unwrap();
    assert_eq!(e.source, Source::Speculative);
    assert_eq!(e.output.text, "alpha\n");

    // The model's real write runs, once, and invalidates the cached read.
    let e = runner
        .execute(
            "write_file",
            &json!({"path": root.join("notes.txt"), "content": "beta\n"}),
        )
        .await
        .unwrap();
    assert_eq!(e.source, Source::Fresh);
    let e = runner.execute("read_text_file", &read_args).await.unwrap();
    assert_eq!(
        (e.source, e.output.text.as_str()),
        (Source::Fresh, "beta\n")
    );
    let c = runner.counts();
    assert_eq!((c.refused, c.started, c.hits), (1, 1, 1));
    assert_eq!(
        c.executed, 3,
        "the read, the write and the re-read reached the server"
    );
    assert!(!target.exists(), "the refused write never ran");
}
