//! One request through a 2-node mesh produces one trace at a real OTLP receiver: the
//! entry node's gateway spans and the serving node's tier span, parent-linked across
//! the wire. The receiver is the `rotel` collector from PyPI (installed into `.venv` by
//! `scripts/setup.sh`), printing every span it receives.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::Duration;

use mesh_tests::{mesh, Node};

/// `rotel-agent` inside the Python package, copied to `dir` and made executable.
fn rotel_agent(dir: &std::path::Path) -> std::path::PathBuf {
    let python = std::env::var("MESH_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(&python)
        .args([
            "-c",
            "import os, rotel; print(os.path.join(os.path.dirname(rotel.__file__), 'rotel-agent'))",
        ])
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "`{python}` has no `rotel` package: run scripts/setup.sh (or set MESH_PYTHON to a Python with rotel)"
    );
    let src = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    let dst = dir.join("rotel-agent");
    std::fs::copy(&src, &dst).expect("copy rotel-agent");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    dst
}

#[derive(Debug, Clone, PartialEq)]
struct Span {
    service: String,
    name: String,
    trace: String,
    parent: String,
    id: String,
}

/// Spans from rotel's detailed debug log (`Trace ID`, `Parent ID`, `ID`, `Name` lines, the
/// service from the enclosing resource).
fn parse_spans(log: &str) -> Vec<Span> {
    let mut out = vec![];
    let (mut service, mut trace, mut parent, mut id) =
        (String::new(), String::new(), String::new(), String::new());
    for raw in log.lines() {
        let line: String = strip_ansi(raw);
        let l = line.trim();
        let value = |l: &str| {
            l.split_once(':')
                .map(|(_, v)| v.trim().to_owned())
                .unwrap_or_default()
        };
        if l.starts_with("-> service.name:") {
            service = value(l)
                .trim_start_matches("Str(")
                .trim_end_matches(')')
                .to_owned();
        } else if l.starts_with("Trace ID") {
            trace = value(l);
        } else if l.starts_with("Parent ID") {
            parent = value(l);
        } else if l.starts_with("ID ") || l.starts_with("ID:") {
            id = value(l);
        } else if l.starts_with("Name ") || l.starts_with("Name:") {
            out.push(Span {
                service: service.clone(),
                name: value(l),
                trace: trace.clone(),
                parent: parent.clone(),
                id: id.clone(),
            });
        }
    }
    out
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_spans_both_nodes_at_a_real_otlp_receiver() {
    let dir = tempfile::tempdir().unwrap();
    let agent = rotel_agent(dir.path());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let http_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let log_path = dir.path().join("rotel.log");
    let mut rotel = Command::new(&agent)
        .args([
            "start",
            "--exporter",
            "blackhole",
            "--debug-log",
            "traces",
            "--debug-log-verbosity",
            "detailed",
        ])
        .args([
            "--otlp-grpc-endpoint",
            &format!("127.0.0.1:{port}"),
            "--otlp-http-endpoint",
            &format!("127.0.0.1:{http_port}"),
        ])
        .stdout(std::fs::File::create(&log_path).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .expect("rotel-agent starts");
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }

    let certs = dir.path().join("certs");
    let c = certs.display().to_string();
    assert!(mesh(&["cert", "init", "--dir", &c]).status.success());
    for n in ["entry", "serving"] {
        assert!(mesh(&["cert", "issue", n, "--dir", &c]).status.success());
    }
    let endpoint = format!("http://127.0.0.1:{port}");
    // Given to these two nodes only: the test process runs other tests' nodes beside them.
    let env = [("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str())];
    let mut serving =
        Node::start_with_env("serving", &certs, &[], "t1", &[], &env).expect("serving node");
    let mut entry = Node::start_with_env("entry", &certs, &[&serving.quic], "none", &[], &env)
        .expect("entry node");

    let client = reqwest::Client::new();
    let body = serde_json::json!({"model": "t1", "max_tokens": 8,
        "messages": [{"role": "user", "content": "What is the weather in Oslo?"}]});
    let mut served = None;
    for _ in 0..100 {
        let r = client
            .post(format!("{}/v1/chat/completions", entry.http))
            .json(&body)
            .send()
            .await
            .unwrap();
        if r.status().is_success() {
            served = Some(r.json::<serde_json::Value>().await.unwrap());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await; // until the entry node sees t1
    }
    let served = served.expect("the entry gateway never served t1");
    // SIGTERM flushes each node's batch exporter.
    entry.terminate();
    serving.terminate();
    let mut log = String::new();
    for _ in 0..100 {
        log.clear();
        std::fs::File::open(&log_path)
            .unwrap()
            .read_to_string(&mut log)
            .unwrap();
        let spans = parse_spans(&log);
        if spans
            .iter()
            .any(|s| s.service == "mesh@serving" && s.name == "tier.generate")
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = rotel.kill();
    let _ = rotel.wait();
    let spans = parse_spans(&log);
    let tier = spans
        .iter()
        .find(|s| s.service == "mesh@serving" && s.name == "tier.generate")
        .unwrap_or_else(|| {
            panic!("no tier.generate span from the serving node; received: {spans:?}")
        });
    let parent = spans
        .iter()
        .find(|s| s.id == tier.parent)
        .unwrap_or_else(|| {
            panic!(
                "the tier span's parent {} was not received: {spans:?}",
                tier.parent
            )
        });
    assert_eq!(parent.service, "mesh@entry");
    assert_eq!(parent.name, "tier.submit");
    assert_eq!(parent.trace, tier.trace);
    let gateway = spans
        .iter()
        .find(|s| s.service == "mesh@entry" && s.name == "gateway.chat" && s.trace == tier.trace)
        .expect("the entry node's gateway span is in the same trace");
    assert!(gateway.parent.is_empty(), "gateway.chat is the root");
    // The response names that trace (the console shows it per reply).
    assert_eq!(
        served["mesh"]["trace_id"].as_str(),
        Some(tier.trace.as_str()),
        "{served}"
    );
    // The serving node looks up the prompt's KV pages (local, then peers) inside its tier span.
    let lookup = spans
        .iter()
        .find(|s| s.service == "mesh@serving" && s.name == "kv.lookup" && s.trace == tier.trace)
        .unwrap_or_else(|| panic!("no kv.lookup span in the request's trace: {spans:?}"));
    assert_eq!(
        lookup.parent, tier.id,
        "kv.lookup is a child of the serving node's tier.generate"
    );
}
