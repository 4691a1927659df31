//! Tier scaling across a real 3-node cluster (`mesh join` processes on 127.0.0.1): the
//! planner starts a replica of t3 on another node when t3's queue time rises and drains it
//! once load falls, without a failed request; `mesh scale` pins a tier's replicas by hand;
//! the planner's node hands planning over when it dies; a replica whose GGUF is missing is
//! a failed decision, retried until it starts.
//!
//! Nodes are named so that `a` plans (the first live name): `a` is the gateway with t1,
//! `b` runs t3 from its config, `c` has t3's config in standby (`[scaling] standby`).

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mesh_tests::{certs, member_view, mesh, post_json, Node};
use serde_json::{json, Value};

/// Tokens of the request a draining replica must finish (t3 on one thread takes seconds).
const LONG: u64 = 1800;

/// A node config with t3's scaling policy (every node gets it; `a`'s is the one used),
/// and t3 in standby when `standby`.
fn config(dir: &Path, name: &str, standby: bool, cooldown_s: u64) -> String {
    let p = dir.join(format!("{name}.toml"));
    let standby = if standby { r#"standby = ["t3"]"# } else { "" };
    std::fs::write(
        &p,
        format!(
            r#"
[scaling]
{standby}
interval_ms = 250
window_s = 3

[scaling.tiers.t3]
min_replicas = 1
max_replicas = 2
target_queue_ms = 200
cooldown_s = {cooldown_s}
scale_in_below = 0.5
"#
        ),
    )
    .unwrap();
    p.display().to_string()
}

struct Cluster {
    _dir: tempfile::TempDir,
    a: Node,
    b: Node,
    c: Node,
}

async fn wait_for(what: &str, limit: Duration, mut f: impl AsyncFnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !f().await {
        assert!(
            t0.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    t0.elapsed()
}

/// Whether `base` sees `node` running `tier`.
async fn runs(c: &reqwest::Client, base: &str, node: &str, tier: &str) -> bool {
    member_view(c, base, node).await["tiers"]
        .as_array()
        .is_some_and(|t| t.iter().any(|t| t["name"] == tier))
}

async fn start(cooldown_s: u64) -> Cluster {
    start_with(tempfile::tempdir().unwrap(), cooldown_s, &[]).await
}

/// [`start`] in `dir`, with `c_extra` added to c's flags.
async fn start_with(dir: tempfile::TempDir, cooldown_s: u64, c_extra: &[&str]) -> Cluster {
    let certs = certs(dir.path(), &["a", "b", "c"]);
    let ca = config(dir.path(), "a", false, cooldown_s);
    let cb = config(dir.path(), "b", false, cooldown_s);
    let cc = config(dir.path(), "c", true, cooldown_s);
    let a = Node::start("a", &certs, &[], "t1", &["--config", &ca]).expect("a");
    let b = Node::start("b", &certs, &[&a.quic], "t3", &["--config", &cb]).expect("b");
    let mut c_args = vec!["--config", cc.as_str()];
    c_args.extend_from_slice(c_extra);
    let c = Node::start("c", &certs, &[&a.quic], "t3", &c_args).expect("c");
    let http = reqwest::Client::new();
    wait_for(
        "a to see b run t3 and c in standby",
        Duration::from_secs(30),
        async || {
            let cm = member_view(&http, &a.http, "c").await;
            runs(&http, &a.http, "b", "t3").await
                && cm["capacity"]["loadable"]
                    .as_array()
                    .is_some_and(|l| l.iter().any(|t| t["name"] == "t3"))
        },
    )
    .await;
    Cluster { _dir: dir, a, b, c }
}

async fn scale_status(c: &reqwest::Client, base: &str) -> Value {
    c.get(format!("{base}/v1/control/scale"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Requests to t3 through `a` from `workers` clients back to back until `stop`; counts
/// successes and failures.
struct Load {
    ok: Arc<AtomicUsize>,
    failed: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(base: &str, workers: usize) -> Load {
        let (ok, failed, stop) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let tasks = (0..workers)
            .map(|w| {
                let (ok, failed, stop) = (ok.clone(), failed.clone(), stop.clone());
                let url = format!("{base}/v1/chat/completions");
                tokio::spawn(async move {
                    let http = reqwest::Client::new();
                    let mut i = 0;
                    while !stop.load(Ordering::Relaxed) {
                        i += 1;
                        let body = json!({"model": "t3", "max_tokens": 32, "ignore_eos": true,
                            "messages": [{"role": "user", "content": format!("Worker {w} asks question {i}: name a colour.")}]});
                        let r = http.post(&url).json(&body).send().await;
                        let outcome = match r {
                            Ok(r) if r.status().is_success() => {
                                match r.json::<Value>().await {
                                    Ok(v) if v["choices"][0]["message"].is_object() => Ok(()),
                                    Ok(v) => Err(format!("a 200 without a message: {v}")),
                                    Err(e) => Err(e.to_string()),
                                }
                            }
                            Ok(r) => Err(format!("{} {}", r.status(), r.text().await.unwrap_or_default())),
                            Err(e) => Err(e.to_string()),
                        };
                        match outcome {
                            Ok(()) => ok.fetch_add(1, Ordering::Relaxed),
                            Err(e) => {
                                eprintln!("request failed: {e}");
                                failed.fetch_add(1, Ordering::Relaxed)
                            }
                        };
                    }
                })
            })
            .collect();
        Load {
            ok,
            failed,
            stop,
            tasks,
        }
    }

    async fn stop(self) -> (usize, usize) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.unwrap();
        }
        (
            self.ok.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_planner_adds_a_replica_under_load_and_drains_it_after_without_failing_a_request() {
    let cl = start(6).await;
    let http = reqwest::Client::new();
    // 12 clients on t3's 4 slots: most requests wait.
    let load = Load::start(&cl.a.http, 12);
    let up = wait_for(
        "the planner to start t3 on c",
        Duration::from_secs(60),
        async || runs(&http, &cl.a.http, "c", "t3").await,
    )
    .await;
    eprintln!("t3 started on c {up:?} after the load began");
    wait_for(
        "c to serve t3 requests",
        Duration::from_secs(30),
        async || {
            member_view(&http, &cl.a.http, "c").await["tiers"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|t| t["name"] == "t3" && t["started"].as_u64() > Some(0))
        },
    )
    .await;
    let (ok, failed) = load.stop().await;
    eprintln!("{ok} requests completed under load, {failed} failed");
    assert!(ok > 0);
    let down = wait_for(
        "the planner to drain t3 on c",
        Duration::from_secs(60),
        async || !runs(&http, &cl.a.http, "c", "t3").await,
    )
    .await;
    eprintln!("t3 drained on c {down:?} after the load stopped");
    let s = scale_status(&http, &cl.a.http).await;
    let actions: Vec<(String, String, String)> = s["decisions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            (
                d["action"].as_str().unwrap().to_owned(),
                d["node"].as_str().unwrap().to_owned(),
                d["outcome"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        actions,
        vec![
            ("start".into(), "c".into(), "ok".into()),
            ("drain".into(), "c".into(), "ok".into())
        ],
        "{s}"
    );
    // b kept its replica: min_replicas.
    assert!(runs(&http, &cl.a.http, "b", "t3").await);
    assert_eq!(failed, 0, "no request fails while replicas start and drain");
    drop(cl.b);
    drop(cl.c);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_scale_starts_and_drains_replicas_by_hand() {
    // A long cooldown: only the pin moves replicas.
    let cl = start(3600).await;
    let http = reqwest::Client::new();
    let out = mesh(&["scale", "t3", "--replicas", "2", "--gateway", &cl.b.http]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_for("t3 on c", Duration::from_secs(30), async || {
        runs(&http, &cl.a.http, "c", "t3").await
    })
    .await;
    let out = mesh(&["scale", "t3", "--replicas", "1", "--gateway", &cl.c.http]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_for("t3 to drain on c", Duration::from_secs(30), async || {
        !runs(&http, &cl.a.http, "c", "t3").await
    })
    .await;
    assert!(runs(&http, &cl.a.http, "b", "t3").await);
    let out = mesh(&["status", "--gateway", &cl.c.http]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("planner: a"), "{text}");
    assert!(text.contains("drain t3 on c: ok"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_scale_refuses_a_count_no_nodes_can_hold() {
    let cl = start(3600).await;
    let out = mesh(&["scale", "t3", "--replicas", "3", "--gateway", &cl.a.http]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("can run on 2 live node(s)"), "{err}");
    let out = mesh(&["scale", "t9", "--replicas", "1", "--gateway", &cl.a.http]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("no live node runs tier `t9`"),
        "{err}"
    );
    drop((cl.b, cl.c));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_cannot_start_is_reported_and_started_once_its_model_is_back() {
    // c keeps t3 in standby from its own copy of the GGUF, which goes away once c is up.
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("t3-copy.gguf");
    std::fs::copy(mesh_tests::root().join("models/t3-q8_0.gguf"), &gguf).unwrap();
    let tier = format!("t3={}", gguf.display());
    let cl = start_with(dir, 3600, &["--tier", &tier]).await;
    let hidden = gguf.with_extension("away");
    std::fs::rename(&gguf, &hidden).unwrap();
    let http = reqwest::Client::new();
    let out = mesh(&["scale", "t3", "--replicas", "2", "--gateway", &cl.a.http]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let failed = |s: &Value| {
        s["decisions"].as_array().and_then(|d| {
            d.iter()
                .find(|d| d["tier"] == "t3" && d["action"] == "start" && d["outcome"] != "ok")
                .cloned()
        })
    };
    wait_for(
        "a failed start of t3 on c",
        Duration::from_secs(30),
        async || failed(&scale_status(&http, &cl.a.http).await).is_some(),
    )
    .await;
    let d = failed(&scale_status(&http, &cl.a.http).await).unwrap();
    assert_eq!(d["node"], "c", "{d}");
    let why = d["outcome"].as_str().unwrap_or_default();
    assert!(
        why.contains("t3-copy.gguf") && why.contains("file not found"),
        "{d}"
    );
    assert!(!runs(&http, &cl.a.http, "c", "t3").await);
    // t3 still answers, from b.
    let body = json!({"model": "t3", "max_tokens": 8,
        "messages": [{"role": "user", "content": "Name a colour."}]});
    let r = post_json(&http, &format!("{}/v1/chat/completions", cl.a.http), &body).await;
    assert!(r["choices"][0]["message"].is_object(), "{r}");
    // The pin stands: once the file is back, the next try starts the replica.
    std::fs::rename(&hidden, &gguf).unwrap();
    wait_for("t3 on c", Duration::from_secs(30), async || {
        runs(&http, &cl.a.http, "c", "t3").await
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planning_moves_to_the_next_node_when_the_planner_dies() {
    let mut cl = start(3600).await;
    let http = reqwest::Client::new();
    let s = scale_status(&http, &cl.b.http).await;
    assert_eq!(s["leader"], "a", "{s}");
    cl.a.kill();
    // At once, before c's membership has marked a dead: c's forward to a fails, and c
    // follows membership to b, which plans now. The pin reaches c through b.
    let out = mesh(&["scale", "t3", "--replicas", "2", "--gateway", &cl.c.http]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(scale_status(&http, &cl.b.http).await["leader"], "b");
    wait_for("t3 on c", Duration::from_secs(30), async || {
        runs(&http, &cl.b.http, "c", "t3").await
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_replica_finishes_the_request_it_is_running() {
    // c gets 2048 cells per sequence, so its request outlasts the drain on an idle machine.
    let cl = start_with(tempfile::tempdir().unwrap(), 3600, &["--ctx", "8192"]).await;
    let http = reqwest::Client::new();
    let out = mesh(&["scale", "t3", "--replicas", "2", "--gateway", &cl.a.http]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_for("t3 on c", Duration::from_secs(30), async || {
        runs(&http, &cl.c.http, "c", "t3").await
    })
    .await;
    // A long request on c's own replica (a gateway prefers its local engine).
    let url = format!("{}/v1/chat/completions", cl.c.http);
    let long = tokio::spawn(async move {
        let body = json!({"model": "t3", "max_tokens": LONG, "ignore_eos": true,
            "messages": [{"role": "user", "content": "Tell a long story."}]});
        let r = reqwest::Client::new()
            .post(&url)
            .json(&body)
            .send()
            .await
            .unwrap();
        (r.status(), r.json::<Value>().await.unwrap())
    });
    wait_for(
        "the request to run on c",
        Duration::from_secs(30),
        async || {
            member_view(&http, &cl.c.http, "c").await["tiers"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|t| t["name"] == "t3" && t["active"].as_u64() > Some(0))
        },
    )
    .await;
    let out = mesh(&["scale", "t3", "--replicas", "1", "--gateway", &cl.a.http]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_for(
        "c to leave t3's adverts",
        Duration::from_secs(30),
        async || !runs(&http, &cl.a.http, "c", "t3").await,
    )
    .await;
    assert!(
        !long.is_finished(),
        "the request ended before the drain; make it longer"
    );
    let (status, v) = long.await.unwrap();
    assert!(status.is_success(), "{v}");
    assert_eq!(v["usage"]["completion_tokens"], LONG, "{v}");
    drop(cl.b);
}
