//! `mesh up` as a process: serves with an unreachable OTLP collector, and stops cleanly on SIGTERM.

use std::time::{Duration, Instant};

use crate::common;
use common::mesh_up;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_collector_does_not_block_and_sigterm_stops() {
    // Nothing listens on port 9: every export fails.
    let mut mesh = mesh_up(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")]);
    let base = mesh.http.clone();
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
    mesh.signal("TERM");
    let status = mesh.wait_exit(Duration::from_secs(20));
    let status = status.expect("mesh did not stop within 20 s of SIGTERM");
    assert!(status.success(), "mesh exited with {status} after SIGTERM");
}
