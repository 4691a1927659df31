//! A network partition: three `mesh join` nodes (a a gateway only, b and c hosting t1), each
//! in a network namespace of its own,
//! joined by veth links to a bridge in a fourth namespace (addresses 10.213.0.0/24, which
//! exist only inside these namespaces). Under traffic, node c's link is cut, then restored:
//! no request is lost and gateways a and b answer none with a 5xx (they fail over between
//! nodes; the SDK's retries across them are counted past, not relied on), membership
//! converges within [`CONVERGE`] of healing, and tools with side effects run, none twice.
//!
//! Needs root (it creates namespaces); everything it creates is removed when it ends.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use mesh::client::{AgentTaskRequest, ChatRequest, Client, Message, Retry};
use mesh_tests::{mesh, mesh_bin, Node};
use serde_json::{json, Value};

/// How soon after the link is restored every node must see every other alive again.
const CONVERGE: Duration = Duration::from_secs(10);

fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .expect("iproute2's `ip`");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The namespaces of one run, removed on drop.
struct Net {
    /// Node namespaces a, b, c.
    nodes: [String; 3],
    /// The bridge's namespace.
    switch: String,
}

impl Net {
    fn new() -> Net {
        let tag = std::process::id();
        let net = Net {
            nodes: ["a", "b", "c"].map(|n| format!("mesh-{tag}-{n}")),
            switch: format!("mesh-{tag}-sw"),
        };
        ip(&["netns", "add", &net.switch]);
        for ns in &net.nodes {
            ip(&["netns", "add", ns]);
        }
        let sw = net.switch.as_str();
        ip(&["-n", sw, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", sw, "link", "set", "br0", "up"]);
        for (i, ns) in net.nodes.iter().enumerate() {
            let port = Self::port(i);
            ip(&[
                "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", &port, "netns", sw,
            ]);
            ip(&["-n", sw, "link", "set", &port, "master", "br0"]);
            ip(&["-n", sw, "link", "set", &port, "up"]);
            ip(&[
                "-n",
                ns,
                "addr",
                "add",
                &format!("{}/24", Self::addr(i)),
                "dev",
                "eth0",
            ]);
            ip(&["-n", ns, "link", "set", "eth0", "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        net
    }

    fn addr(i: usize) -> String {
        format!("10.213.0.{}", i + 1)
    }

    fn port(i: usize) -> String {
        format!("p{}", ["a", "b", "c"][i])
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in self.nodes.iter().chain([&self.switch]) {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// Starts node `i` in its namespace: gateway on its own address (no keys: these addresses
/// exist only here), QUIC on its own address, seeds given.
fn start(net: &Net, certs: &Path, i: usize, tiers: &str, seeds: &[&str], extra: &[&str]) -> Node {
    let name = ["a", "b", "c"][i];
    let addr = Net::addr(i);
    let mut args: Vec<String> = ["netns", "exec", &net.nodes[i]].map(str::to_owned).to_vec();
    args.push(mesh_bin().display().to_string());
    let join = Node::join_args(name, certs, seeds, tiers, extra);
    // Replace the loopback defaults with this namespace's address.
    let mut it = join.into_iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quic" => {
                it.next();
                args.extend(["--quic".into(), format!("{addr}:7070")]);
            }
            "--port" => {
                it.next();
                args.extend([
                    "--listen".into(),
                    format!("{addr}:8080"),
                    "--insecure-no-auth".into(),
                ]);
            }
            _ => args.push(a),
        }
    }
    let log = certs.join("..").join(format!("{name}.log"));
    Node::spawn(Path::new("ip"), &args, &log, &[])
        .unwrap_or_else(|log| panic!("node {name} exited before listening:\n{log}"))
}

/// Runs `f` on a thread inside namespace `ns`, on a runtime of its own: every socket it
/// opens lives in that namespace.
fn inside<T: Send + 'static>(ns: &str, f: impl AsyncFnOnce() -> T + Send + 'static) -> T {
    let path = PathBuf::from("/run/netns").join(ns);
    std::thread::spawn(move || {
        let fd = File::open(&path).expect("the namespace's handle");
        // SAFETY: setns on this thread only; fd is a valid namespace handle.
        let rc = unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
            .block_on(f())
    })
    .join()
    .expect("the client thread")
}

/// The sum of every series of `name` in `base`'s `/metrics` (0 when absent or unreachable).
async fn metric(c: &reqwest::Client, base: &str, name: &str) -> f64 {
    let text = match c
        .get(format!("{base}/metrics"))
        .timeout(Duration::from_secs(1))
        .send()
        .await
    {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => return 0.0,
    };
    text.lines()
        .filter(|l| {
            l.starts_with(name)
                && (l[name.len()..].starts_with('{') || l[name.len()..].starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Responses with a 5xx status the gateways in `gateways` have sent (their request counters).
async fn server_errors(c: &reqwest::Client, gateways: &[String]) -> f64 {
    let mut sum = 0.0;
    for g in gateways {
        let text = c
            .get(format!("{g}/metrics"))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .expect("a gateway that is not cut off answers /metrics")
            .text()
            .await
            .unwrap_or_default();
        sum += text
            .lines()
            .filter(|l| l.starts_with("mesh_http_requests_total{") && l.contains("status=\"5"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>();
    }
    sum
}

/// Node names each gateway sees alive.
async fn alive(c: &reqwest::Client, gateways: &[String]) -> Vec<Vec<String>> {
    let mut out = vec![];
    for g in gateways {
        let v: Value = match c
            .get(format!("{g}/v1/cluster"))
            .timeout(Duration::from_secs(1))
            .send()
            .await
        {
            Ok(r) => r.json().await.unwrap_or(Value::Null),
            Err(_) => Value::Null,
        };
        let mut names: Vec<String> = v["members"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|m| m["state"] == "alive")
            .filter_map(|m| m["node"].as_str().map(str::to_owned))
            .collect();
        names.sort();
        out.push(names);
    }
    out
}

async fn all_alive(c: &reqwest::Client, gateways: &[String]) -> bool {
    alive(c, gateways).await.iter().all(|v| v.len() == 3)
}

#[test]
fn a_partitioned_node_loses_no_request_and_rejoins() {
    let dir = tempfile::tempdir().unwrap().keep();
    let certs = dir.join("certs");
    let c = certs.display().to_string();
    assert!(mesh(&["cert", "init", "--dir", &c]).status.success());
    for n in ["a", "b", "c"] {
        assert!(mesh(&["cert", "issue", n, "--dir", &c]).status.success());
    }
    // Node a runs agent tasks with the catalog MCP server, which logs every executed call.
    let calls = dir.join("calls.jsonl");
    let server = mesh_tests::root().join(".cache/mcp/catalog-server.mjs");
    assert!(
        server.exists(),
        "{} is missing: run scripts/setup.sh",
        server.display()
    );
    let cfg = dir.join("a.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[mcp.servers]]\nname = \"catalog\"\ncommand = \"node\"\nargs = [{:?}, {:?}, \"20\"]\nenv = {{ CATALOG_CALL_LOG = {:?} }}\n",
            server.display().to_string(),
            mesh_tests::root().join("models/fixtures/catalog.jsonl").display().to_string(),
            calls.display().to_string()
        ),
    )
    .unwrap();
    let net = Net::new();
    // a is a gateway only, so its requests go to b and c.
    let _a = start(
        &net,
        &certs,
        0,
        "none",
        &[],
        &["--config", cfg.to_str().unwrap()],
    );
    let seed = _a.quic.clone();
    let _b = start(&net, &certs, 1, "t1", &[&seed], &[]);
    let _c = start(&net, &certs, 2, "t1", &[&seed], &[]);
    let gateways: Vec<String> = (0..3)
        .map(|i| format!("http://{}:8080", Net::addr(i)))
        .collect();
    let (g, switch) = (gateways.clone(), net.switch.clone());
    let c_port = Net::port(2);
    let outcome = inside(&net.nodes[0], async move || {
        let http = reqwest::Client::new();
        mesh_tests::wait_until("every node sees the other two", async || {
            all_alive(&http, &g).await
        })
        .await;
        // Chats through gateways a and b (c is the node cut off), agent tasks through a, in
        // loops that run until the cluster has healed.
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let sdk = Client::new(g[..2].to_vec()).unwrap().with_retry(Retry {
            attempts: 12,
            ..Retry::default()
        });
        let mut work = tokio::task::JoinSet::new();
        for w in 0..4usize {
            let (sdk, stop, done) = (sdk.clone(), stop.clone(), done.clone());
            work.spawn(async move {
                let mut n = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let mut r = ChatRequest::new(
                        "t1",
                        vec![Message::user(format!(
                            "What is the weather in Lima on day {w}{n}?"
                        ))],
                    );
                    r.max_tokens = Some(48);
                    r.temperature = Some(0.0);
                    sdk.chat(&r)
                        .await
                        .map_err(|e| format!("chat {w}/{n}: {e}"))?;
                    done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    n += 1;
                }
                Ok::<usize, String>(0)
            });
        }
        for w in 0..2usize {
            let (stop, done) = (stop.clone(), done.clone());
            let sdk = Client::new([g[0].clone()]).unwrap();
            work.spawn(async move {
                let (mut n, mut ran) = (0, 0);
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let mut t = AgentTaskRequest::new(
                        "t1",
                        format!(
                            "Create an invoice for account AC-{w}{n:03} of {} dollars.",
                            100 + n
                        ),
                    );
                    t.tools = Some(vec!["finance_create_invoice".into()]);
                    t.tool_choice = Some(json!("required"));
                    t.max_turns = Some(2);
                    let task = sdk
                        .agent_task(&t)
                        .await
                        .map_err(|e| format!("task {w}/{n}: {e}"))?;
                    // Executed: it has a result and the tool did not refuse it.
                    ran += task
                        .turns
                        .iter()
                        .flat_map(|t| t["tool_calls"].as_array().cloned().unwrap_or_default())
                        .filter(|c| {
                            c["name"] == "finance_create_invoice"
                                && c["result"].is_string()
                                && c["is_error"] != true
                        })
                        .count();
                    done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    n += 1;
                }
                Ok::<usize, String>(ran)
            });
        }
        // Cut c off once it is serving part of the traffic.
        // Each generation on c's engine looks its prompt up in c's page store.
        let c_served = async || metric(&http, &g[2], "mesh_kv_prefix_lookups_total").await;
        mesh_tests::wait_until("c serves some of the traffic", async || {
            c_served().await >= 2.0
        })
        .await;
        let before = done.load(std::sync::atomic::Ordering::Relaxed);
        // The SDK retries across gateways, which would hide a gateway's error: count them.
        let errors_before = server_errors(&http, &g[..2]).await;
        ip(&["-n", &switch, "link", "set", &c_port, "down"]);
        mesh_tests::wait_until("a and b see c gone", async || {
            alive(&http, &g[..2]).await.iter().all(|v| v.len() == 2)
        })
        .await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let during = done.load(std::sync::atomic::Ordering::Relaxed) - before;
        ip(&["-n", &switch, "link", "set", &c_port, "up"]);
        let healed = Instant::now();
        mesh_tests::wait_until("every node sees the other two again", async || {
            all_alive(&http, &g).await
        })
        .await;
        let converged = healed.elapsed();
        tokio::time::sleep(Duration::from_secs(1)).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut errors: Vec<String> = vec![];
        let mut side_effects = 0;
        while let Some(r) = work.join_next().await {
            match r.expect("no panic") {
                Ok(n) => side_effects += n,
                Err(e) => errors.push(e),
            }
        }
        let total = done.load(std::sync::atomic::Ordering::Relaxed);
        let server_errors = server_errors(&http, &g[..2]).await - errors_before;
        eprintln!("requests completed: {total} ({during} while c was cut off); gateway 5xx {server_errors}; membership converged {converged:?} after healing; side-effecting calls {side_effects}");
        assert!(during > 0, "no request completed while c was cut off");
        (errors, server_errors, side_effects, converged)
    });
    let (errors, server_errors, reported, converged) = outcome;
    assert!(errors.is_empty(), "requests lost: {errors:?}");
    assert_eq!(
        server_errors, 0.0,
        "gateways a and b answered with a 5xx from the cut to the end (the SDK retried them)"
    );
    assert!(
        converged <= CONVERGE,
        "membership took {converged:?} after healing"
    );
    let executed = std::fs::read_to_string(&calls)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("finance_create_invoice"))
        .count();
    assert!(
        reported > 0,
        "no side-effecting call ran, so none running twice shows nothing"
    );
    assert_eq!(
        executed, reported,
        "side-effecting calls executed vs reported"
    );
}
