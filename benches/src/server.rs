//! Server child processes: start on a free port, wait for `/health`, read peak RSS, stop.
//!
//! Children run in their own process group, so a Ctrl-C in the terminal reaches only the
//! driver, which then kills and reaps them itself. `kill_on_drop` is the backstop for paths
//! that never reach [`Server::stop`] (a panic).

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tokio::process::{Child, Command};

/// A running server the driver started.
pub(crate) struct Server {
    /// Short name used in reports (`mesh`, `llama-server`).
    pub(crate) name: &'static str,
    /// `http://127.0.0.1:PORT`.
    pub(crate) base_url: String,
    /// Program and arguments exactly as started.
    pub(crate) argv: Vec<String>,
    /// File receiving the child's stdout and stderr.
    pub(crate) log: PathBuf,
    pid: u32,
    child: Child,
}

/// A port that was free a moment ago on 127.0.0.1 (the child binds it right after).
pub(crate) fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind(("127.0.0.1", 0)).context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

impl Server {
    /// Starts `program args`, output to `log`.
    pub(crate) fn spawn(
        name: &'static str,
        program: &Path,
        args: Vec<String>,
        port: u16,
        log: PathBuf,
    ) -> Result<Self> {
        let out = std::fs::File::create(&log)
            .with_context(|| format!("creating log file {}", log.display()))?;
        let err = out.try_clone()?;
        let child = Command::new(program)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {name} ({})", program.display()))?;
        let pid = child.id().context("child has no pid")?;
        let mut argv = vec![program.display().to_string()];
        argv.extend(args);
        Ok(Self {
            name,
            base_url: format!("http://127.0.0.1:{port}"),
            argv,
            log,
            pid,
            child,
        })
    }

    /// Polls `GET /health` until it answers 200; fails early if the child exits.
    /// Returns how long it took. Cancel-safe.
    pub(crate) async fn wait_healthy(
        &mut self,
        client: &reqwest::Client,
        timeout: Duration,
    ) -> Result<Duration> {
        let start = Instant::now();
        let url = format!("{}/health", self.base_url);
        loop {
            self.ensure_running()?;
            let ok = client
                .get(&url)
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                return Ok(start.elapsed());
            }
            if start.elapsed() > timeout {
                bail!(
                    "{} did not become healthy within {timeout:?}; last log lines:\n{}",
                    self.name,
                    log_tail(&self.log, 20)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Process id of the child.
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// Fails with the log tail if the child has exited.
    pub(crate) fn ensure_running(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "{} exited ({status}); last log lines of {}:\n{}",
                self.name,
                self.log.display(),
                log_tail(&self.log, 20)
            );
        }
        Ok(())
    }

    /// A `/proc/PID/status` field in KiB (`VmHWM` = peak RSS, `VmRSS` = current RSS).
    pub(crate) fn status_kib(&self, field: &str) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
    }

    /// `GET /metrics` as `series -> value`, histogram buckets left out (they stay in the
    /// server's own scrape). Empty when the server has no such endpoint. Cancel-safe.
    pub(crate) async fn metrics(
        &self,
        client: &reqwest::Client,
    ) -> serde_json::Map<String, serde_json::Value> {
        let url = format!("{}/metrics", self.base_url);
        let text = match client
            .get(&url)
            .timeout(Duration::from_secs(5))
            .send()
            .await
        {
            Ok(r) if r.status().is_success() => r.text().await.unwrap_or_default(),
            _ => String::new(),
        };
        parse_prometheus(&text)
    }

    /// Kills the child and waits for it to be reaped.
    pub(crate) async fn stop(mut self) -> Option<ExitStatus> {
        // An error here means the child is already gone; `wait` still reaps it.
        let _ = self.child.start_kill();
        self.child.wait().await.ok()
    }
}

/// Sum of every series of metric `name` (all label sets) in a [`Server::metrics`] map; `None`
/// when the server exposes no such metric.
pub(crate) fn metric_sum(
    metrics: &serde_json::Map<String, serde_json::Value>,
    name: &str,
) -> Option<f64> {
    let mut found = None;
    for (series, v) in metrics {
        if series.split('{').next() == Some(name) {
            *found.get_or_insert(0.0) += v.as_f64().unwrap_or(0.0);
        }
    }
    found
}

/// Histograms whose buckets [`parse_prometheus`] keeps (the others' buckets are left out).
pub(crate) const KEPT_HISTOGRAMS: &[&str] = &[
    "mesh_inter_token_latency_seconds_bucket",
    "mesh_tier_step_duration_seconds_bucket",
];

/// Samples of a Prometheus text exposition, without comments and histogram buckets (but
/// those of [`KEPT_HISTOGRAMS`]).
fn parse_prometheus(text: &str) -> serde_json::Map<String, serde_json::Value> {
    let mut out = serde_json::Map::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        if series.contains("_bucket") && !KEPT_HISTOGRAMS.iter().any(|h| series.starts_with(h)) {
            continue;
        }
        if let Ok(v) = value.parse::<f64>() {
            out.insert(series.to_owned(), serde_json::json!(v));
        }
    }
    out
}

/// The last `n` lines of a log file (empty when unreadable).
fn log_tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_samples_without_comments_and_buckets() {
        let text = "# HELP x\n# TYPE x counter\nmesh_generation_tokens_total{model=\"t1\"} 8\n\
                    mesh_ttft_seconds_bucket{le=\"0.1\"} 1\nllamacpp:n_decode_total 42\nbad line x\n\
                    mesh_inter_token_latency_seconds_bucket{model=\"t1\",le=\"0.002\"} 5\n";
        let m = parse_prometheus(text);
        assert_eq!(m.len(), 3);
        assert_eq!(
            m["mesh_inter_token_latency_seconds_bucket{model=\"t1\",le=\"0.002\"}"],
            5.0
        );
        assert_eq!(m["mesh_generation_tokens_total{model=\"t1\"}"], 8.0);
        assert_eq!(m["llamacpp:n_decode_total"], 42.0);
        assert_eq!(metric_sum(&m, "mesh_generation_tokens_total"), Some(8.0));
        assert_eq!(metric_sum(&m, "mesh_generation_tokens"), None);
    }
}
