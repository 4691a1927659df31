//! Multi-node integration tests: `tests/cluster.rs` starts real `mesh join`
//! processes on 127.0.0.1 (built by `cargo test --workspace` as the `mesh` package's
//! binary) and checks membership, routing, failover, certificates and frame handling;
//! `tests/kv_fabric.rs` checks that prefix pages move between nodes. This library holds
//! the process helpers they share.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

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
        // Node logs stay next to the certs for a failed run: <tmp>/<name>-<pid>.log.
        let log = certs
            .join("..")
            .join(format!("{name}-{}.log", std::process::id()));
        args.extend(extra.iter().map(|s| s.to_string()));
        if !seeds.is_empty() {
            args.push("--seeds".into());
            args.push(seeds.join(","));
        }
        Self::spawn(&args, &log, env)
    }

    /// Runs `mesh ARGS` (stderr to `log`) until it prints its gateway address; `Err`
    /// carries the log if it exits first.
    fn spawn(args: &[String], log: &Path, env: &[(&str, &str)]) -> Result<Node, String> {
        let mut child = Command::new(mesh_bin())
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
        let log = log_dir.join(format!("up-{}.log", std::process::id()));
        let mut all: Vec<String> = vec!["up".into(), "--port".into(), "0".into()];
        all.extend(args.iter().map(|s| s.to_string()));
        Self::spawn(&all, &log, env)
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
