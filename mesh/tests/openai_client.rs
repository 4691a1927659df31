//! End to end: a `mesh up` process driven by the official `openai` Python client.
//!
//! Needs Python with the `openai` package: `MESH_PYTHON` (set by `./dev.sh test` to the
//! project's virtualenv), else `python3`. A missing package fails the test with a hint.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

struct Kill(std::process::Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn official_openai_client_against_mesh_up() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = std::env::var("MESH_PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = Command::new(&python).args(["-c", "import openai"]).status();
    assert!(
        probe.is_ok_and(|s| s.success()),
        "`{python} -c 'import openai'` failed: run scripts/setup.sh (or set MESH_PYTHON to a Python with openai)"
    );

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
            "4",
        ])
        .current_dir(&root)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("mesh starts");
    let stdout = child.stdout.take().unwrap();
    let child = Kill(child);
    let mut lines = BufReader::new(stdout).lines();
    let deadline = Instant::now() + Duration::from_secs(60);
    let base = loop {
        assert!(Instant::now() < deadline, "mesh did not report its address");
        let line = lines.next().expect("mesh exited early").unwrap();
        if let Some(url) = line.strip_prefix("mesh listening on ") {
            break format!("{url}/v1");
        }
    };
    let out = Command::new(&python)
        .arg(root.join("tests/python/openai_e2e.py"))
        .args(["--base-url", &base])
        .output()
        .expect("python runs");
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "openai client checks failed");
    drop(child);
}
