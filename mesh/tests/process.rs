//! `mesh up` as a process: serves with an unreachable OTLP collector, and stops cleanly on SIGTERM.

use std::process::Command;
use std::time::{Duration, Instant};

mod common;
use common::MeshProcess;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_collector_does_not_block_and_sigterm_stops() {
    // Nothing listens on port 9: every export fails.
    let mut mesh = MeshProcess::start(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")]);
    let base = mesh.base.clone();
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
        .args(["-TERM", &mesh.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(s) = mesh.child.try_wait().unwrap() {
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
