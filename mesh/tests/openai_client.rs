//! End to end: a `mesh up` process driven by the official `openai` Python client.
//!
//! Needs Python with the `openai` package: `MESH_PYTHON` (set by `./dev.sh test` to the
//! project's virtualenv), else `python3`. A missing package fails the test with a hint.

use std::process::Command;

use crate::common;
use common::mesh_up;

#[test]
fn official_openai_client_against_mesh_up() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = std::env::var("MESH_PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = Command::new(&python).args(["-c", "import openai"]).status();
    assert!(
        probe.is_ok_and(|s| s.success()),
        "`{python} -c 'import openai'` failed: run scripts/setup.sh (or set MESH_PYTHON to a Python with openai)"
    );

    let mesh = mesh_up(&[]);
    let base = format!("{}/v1", mesh.http);
    let out = Command::new(&python)
        .arg(root.join("tests/python/openai_e2e.py"))
        .args(["--base-url", &base])
        .output()
        .expect("python runs");
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "openai client checks failed");
    drop(mesh);
}
