//! `mesh up` as a process: serves with an unreachable OTLP collector, and stops cleanly on SIGTERM.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_collector_does_not_block_and_sigterm_stops() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut child = Command::new(env!("CARGO_BIN_EXE_mesh"))
        .args([
            "up",
            "--port",
            "0",
            "--only",
            "t1",
            "--threads",
            "2",
            "--ctx",
            "4096",
            "--parallel",
            "2",
        ])
        .current_dir(&root)
        // Nothing listens on port 9: every export fails.
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("mesh starts");
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let base = loop {
        let line = lines.next().expect("mesh exited early").unwrap();
        if let Some(url) = line.strip_prefix("mesh listening on ") {
            break url.to_owned();
        }
    };
    let http = reqwest::Client::new();
    for _ in 0..3 {
        let t = Instant::now();
        let r = http
            .post(format!("{base}/v1/completions"))
            .json(&serde_json::json!({"model": "t1", "prompt": "<|user|>Hello!<|end|><|assistant|>", "max_tokens": 8, "temperature": 0}))
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .expect("request answered");
        assert_eq!(r.status(), 200);
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "request took {:?} with a dead collector",
            t.elapsed()
        );
    }
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            assert!(s.success(), "mesh exited with {s} after SIGTERM");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "mesh did not stop within 20 s of SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
