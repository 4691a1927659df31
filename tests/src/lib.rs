//! Multi-node integration tests: `tests/cluster.rs` starts real `mesh join`
//! processes on 127.0.0.1 (built by `cargo test --workspace` as the `mesh` package's
//! binary) and checks membership, routing, failover, certificates and frame handling;
//! `tests/kv_fabric.rs` checks that prefix pages move between nodes.
//!
//! This library is the one way tests and benchmarks start a node and wait for it: the
//! integration tests here, the `mesh` package's process-level tests and `mesh-bench fabric`
//! all start `mesh up` / `mesh join` through [`Node`].

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Runs `tests/python/SCRIPT ARGS` with `MESH_PYTHON` (set by `./dev.sh test` to the
/// project's virtualenv), else `python3`; prints its output and panics with a hint when it
/// fails (`scripts/setup.sh` installs the packages these scripts need).
pub fn run_python(script: &str, args: &[&str]) {
    let python = std::env::var("MESH_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(&python)
        .arg(root().join("tests/python").join(script))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{python} does not run: {e}"));
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "{script} {args:?} failed (scripts/setup.sh installs what it needs; MESH_PYTHON names the Python)"
    );
}

/// The members a node's gateway lists (`GET /v1/cluster`).
pub async fn members(http: &str) -> Vec<serde_json::Value> {
    let v: serde_json::Value = reqwest::get(format!("{http}/v1/cluster"))
        .await
        .expect("cluster endpoint")
        .json()
        .await
        .expect("json");
    v["members"].as_array().cloned().unwrap_or_default()
}

/// The `mesh` binary next to the test executable.
pub fn mesh_bin() -> PathBuf {
    // target/<profile>/deps/cluster-HASH -> target/<profile>/mesh
    let exe = std::env::current_exe().expect("test exe path");
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .expect("target dir")
        .join("mesh");
    assert!(
        bin.exists(),
        "{} not found: build it with `cargo build --release -p mesh` (cargo test --workspace does)",
        bin.display()
    );
    bin
}

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs `mesh ARGS` to completion.
pub fn mesh(args: &[&str]) -> std::process::Output {
    Command::new(mesh_bin())
        .args(args)
        .current_dir(root())
        .output()
        .expect("mesh runs")
}

/// A `mesh join` process; killed on drop.
pub struct Node {
    child: Child,
    /// Gateway base URL.
    pub http: String,
    /// QUIC address.
    pub quic: String,
    /// The file its stderr (the node's log) goes to.
    pub log: PathBuf,
}

impl Node {
    /// Starts `mesh join` and waits for its gateway; `Err` carries its log if it exits first.
    pub fn start(
        name: &str,
        certs: &Path,
        seeds: &[&str],
        tiers: &str,
        extra: &[&str],
    ) -> Result<Node, String> {
        Self::start_with_env(name, certs, seeds, tiers, extra, &[])
    }

    /// [`Node::start`] with extra environment variables.
    pub fn start_with_env(
        name: &str,
        certs: &Path,
        seeds: &[&str],
        tiers: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Node, String> {
        let args = Self::join_args(name, certs, seeds, tiers, extra);
        // Node logs stay next to the certs for a failed run: <tmp>/<name>-<pid>.log.
        let log = certs
            .join("..")
            .join(format!("{name}-{}.log", std::process::id()));
        Self::spawn(&mesh_bin(), &args, &log, env)
    }

    /// The arguments of `mesh join` for a node on 127.0.0.1 with ephemeral ports, small-machine
    /// defaults (1 thread, 4096 context, 4 slots, 100 ms heartbeats, 1 s failure timeout; a
    /// flag given in `extra` replaces its default), `extra`, then `--seeds`.
    pub fn join_args(
        name: &str,
        certs: &Path,
        seeds: &[&str],
        tiers: &str,
        extra: &[&str],
    ) -> Vec<String> {
        let mut args: Vec<String> = [
            "join",
            "--name",
            name,
            "--quic",
            "127.0.0.1:0",
            "--port",
            "0",
            "--tiers",
            tiers,
            "--cert-dir",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.push(certs.display().to_string());
        // Defaults for a small machine; a flag given in `extra` replaces its default.
        for (flag, value) in [
            ("--threads", "1"),
            ("--ctx", "4096"),
            ("--parallel", "4"),
            ("--heartbeat-ms", "100"),
            ("--failure-timeout-ms", "1000"),
        ] {
            if !extra.contains(&flag) {
                args.push(flag.into());
                args.push(value.into());
            }
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        if !seeds.is_empty() {
            args.push("--seeds".into());
            args.push(seeds.join(","));
        }
        args
    }

    /// Runs `BIN ARGS` (a `mesh` binary; stderr to `log`) until it prints its gateway address;
    /// `Err` carries the log if it exits first.
    pub fn spawn(
        bin: &Path,
        args: &[String],
        log: &Path,
        env: &[(&str, &str)],
    ) -> Result<Node, String> {
        let mut cmd = Command::new(bin);
        // The node dies with the thread that started it: a test's nodes with the test, a
        // shared fixture's with the thread that keeps it (as long as the test process).
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = cmd
            .args(args)
            .current_dir(root())
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log).expect("log file"))
            .spawn()
            .expect("mesh starts");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let mut quic = String::new();
        loop {
            match lines.next() {
                Some(Ok(line)) => {
                    if let Some(rest) = line.split(" quic on ").nth(1) {
                        quic = rest.to_owned();
                    }
                    if let Some(url) = line.strip_prefix("mesh listening on ") {
                        // Keep draining stdout so the child never blocks on a full pipe.
                        std::thread::spawn(move || for _ in lines.by_ref() {});
                        return Ok(Node {
                            child,
                            http: url.to_owned(),
                            quic,
                            log: log.to_owned(),
                        });
                    }
                }
                _ => {
                    let _ = child.wait();
                    return Err(std::fs::read_to_string(log).unwrap_or_default());
                }
            }
        }
    }

    /// Starts a standalone `mesh up --port 0 ARGS` (log in `<log_dir>/up-<pid>.log`) and
    /// waits for its gateway; `Err` carries its log if it exits first.
    pub fn up(log_dir: &Path, args: &[&str]) -> Result<Node, String> {
        Self::up_with_env(log_dir, args, &[])
    }

    /// [`Node::up`] with extra environment variables.
    pub fn up_with_env(
        log_dir: &Path,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Node, String> {
        static STARTED: AtomicUsize = AtomicUsize::new(0);
        let n = STARTED.fetch_add(1, Ordering::Relaxed);
        let log = log_dir.join(format!("up-{}-{n}.log", std::process::id()));
        let mut all: Vec<String> = vec!["up".into(), "--port".into(), "0".into()];
        all.extend(args.iter().map(|s| s.to_string()));
        Self::spawn(&mesh_bin(), &all, &log, env)
    }

    /// The exit status if the process has exited, without waiting.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Waits up to `limit` for the process to exit; `None` if it is still running.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(s) = self.try_wait() {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends a signal by name (`HUP`, `USR1`, ...) and returns at once.
    pub fn signal(&self, name: &str) {
        let ok = Command::new("kill")
            .args([format!("-{name}"), self.child.id().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -{name} failed");
    }

    /// SIGTERM, then wait.
    pub fn terminate(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `POST url` with the JSON `body`; the answer's JSON (panics when there is no answer or it
/// is not JSON, whatever the status: tests assert on the body).
pub async fn post_json(
    c: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
) -> serde_json::Value {
    c.post(url)
        .json(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e}"))
        .json()
        .await
        .unwrap_or_else(|e| panic!("POST {url}: the answer is not JSON: {e}"))
}

/// `GET BASE/v1/cluster`: the membership table as that node sees it (`Null` when it does not
/// answer).
pub async fn cluster_view(c: &reqwest::Client, base: &str) -> serde_json::Value {
    match c.get(format!("{base}/v1/cluster")).send().await {
        Ok(r) => r.json().await.unwrap_or(serde_json::Value::Null),
        Err(_) => serde_json::Value::Null,
    }
}

/// The entry of `node` in `base`'s membership table (from `node`'s last heartbeat), or
/// `Null`.
pub async fn member_view(c: &reqwest::Client, base: &str, node: &str) -> serde_json::Value {
    cluster_view(c, base).await["members"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["node"] == node)
        .cloned()
        .unwrap_or(serde_json::Value::Null)
}

/// A cluster CA in `DIR/certs` with a certificate for each of `names`; the folder.
pub fn certs(dir: &Path, names: &[&str]) -> PathBuf {
    let certs = dir.join("certs");
    let c = certs.display().to_string();
    assert!(mesh(&["cert", "init", "--dir", &c]).status.success());
    for n in names {
        assert!(mesh(&["cert", "issue", n, "--dir", &c]).status.success());
    }
    certs
}

/// Tool schemas `from..to` of the fixture catalog (`models/fixtures/catalog.jsonl`).
pub fn catalog(from: usize, to: usize) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(root().join("models/fixtures/catalog.jsonl")).unwrap();
    text.lines()
        .skip(from)
        .take(to - from)
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A raw t1 prompt with the fixture catalog's tools `from..from + 10` in its system part
/// (about 20 pages of t1).
pub fn tools_prompt(from: usize) -> String {
    let tools: Vec<String> = catalog(from, from + 10)
        .iter()
        .map(serde_json::Value::to_string)
        .collect();
    format!(
        "<|system|>You are a helpful agent.\n<tools>\n{}\n</tools><|end|><|user|>What is the weather in Oslo?<|end|><|assistant|>",
        tools.join("\n")
    )
}

/// A node config `DIR/NAME.toml` with tier t1 whose KV pages get `ram_bytes` of RAM and no
/// disk (t1: ~48 KiB a page); returns its path for `--config`.
pub fn t1_config(dir: &Path, name: &str, ram_bytes: u64) -> String {
    let cfg = dir.join(format!("{name}.toml"));
    std::fs::write(
        &cfg,
        format!(
            "[[tiers]]\nname = \"t1\"\nmodel = \"{}\"\n[tiers.kv_pages]\nram_bytes = {ram_bytes}\n",
            root().join("models/t1-q8_0.gguf").display()
        ),
    )
    .unwrap();
    cfg.display().to_string()
}

/// Polls `f` until it holds; panics naming `what` after 30 s.
pub async fn wait_until(what: &str, mut f: impl AsyncFnMut() -> bool) {
    let t0 = Instant::now();
    while !f().await {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// t1's greedy reply (temperature 0, 32 tokens) to one fixed prompt, from the gateway at
/// `http`: what two builds or two ways of running `mesh` must agree on.
pub async fn greedy_reply(http: &str) -> String {
    let v: serde_json::Value = reqwest::Client::new()
        .post(format!("{http}/v1/chat/completions"))
        .json(&serde_json::json!({
            "model": "t1",
            "messages": [{"role": "user", "content": "Write one sentence about rivers."}],
            "max_tokens": 32,
            "temperature": 0
        }))
        .send()
        .await
        .expect("chat request")
        .json()
        .await
        .expect("json");
    assert_eq!(v["mesh"]["tier"], "t1", "{v}");
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("no text: {v}"))
        .to_owned()
}

/// Sum of the series on `base`'s `/metrics` whose line starts with `series`: a metric's
/// name, or its name and leading labels (`mesh_kv_pages{model="t1",tier="ram"}`).
pub async fn metric(c: &reqwest::Client, base: &str, series: &str) -> f64 {
    let text = c
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("metrics text");
    text.lines()
        .filter(|l| l.starts_with(series) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Sum of every series of Prometheus metric `name` (all label sets) on `http`'s `/metrics`.
pub async fn metric_total(http: &str, name: &str) -> f64 {
    let text = reqwest::get(format!("{http}/metrics"))
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("metrics text");
    text.lines()
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
