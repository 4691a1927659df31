//! The gateway against its own OpenAPI document: schemathesis (PyPI, in `.venv`) generates
//! valid and invalid requests for every documented operation of a live node hosting the
//! bundled t1 and checks every answer: no 5xx, only documented statuses and content types,
//! bodies that match their schemas. `POST /v1/control/tune` is left out: each call runs a
//! whole tuning cycle.

use crate::common;

use std::path::{Path, PathBuf};
use std::time::Duration;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn schemathesis() -> PathBuf {
    let python = std::env::var("MESH_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root().join(".venv/bin/python"));
    python.with_file_name("schemathesis")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_keeps_to_its_openapi_document() {
    let mut cfg = common::t1_config(8192, 4);
    cfg.default_max_tokens = 8;
    let (base, _stop) = common::in_process(cfg).await;
    let bin = schemathesis();
    assert!(
        bin.exists(),
        "{} is missing: run scripts/setup.sh",
        bin.display()
    );
    let out = tokio::time::timeout(
        Duration::from_secs(600),
        tokio::process::Command::new(&bin)
            .args([
                "run",
                &format!("{base}/openapi.json"),
                "--checks",
                "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
                "--exclude-path",
                "/v1/control/tune",
                "--max-examples",
                "20",
                "--seed",
                "1",
                "--workers",
                "2",
                "--request-timeout",
                "60",
                "--no-color",
            ])
            .env("SCHEMATHESIS_HOOKS", "")
            .output(),
    )
    .await
    .expect("schemathesis finishes within 10 minutes")
    .expect("schemathesis runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "schemathesis found failures:\n{text}");
}
