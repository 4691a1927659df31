//! Starting `mesh up` as a child process for the process-level tests.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// A `mesh up` process hosting the bundled t1 on a free port; killed on drop.
pub(crate) struct MeshProcess {
    /// The child.
    pub(crate) child: Child,
    /// `http://127.0.0.1:PORT`.
    pub(crate) base: String,
}

impl MeshProcess {
    /// Starts `mesh up --port 0 --only t1` with these extra environment variables and waits for
    /// the address it prints.
    pub(crate) fn start(env: &[(&str, &str)]) -> Self {
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
                "8192",
                "--parallel",
                "4",
            ])
            .current_dir(&root)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("mesh starts");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut lines = BufReader::new(stdout).lines();
        let base = loop {
            let line = lines
                .next()
                .expect("mesh exited before listening")
                .expect("utf-8 line");
            if let Some(url) = line.strip_prefix("mesh listening on ") {
                break url.to_owned();
            }
        };
        Self { child, base }
    }
}

impl Drop for MeshProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl MeshProcess {
    /// Kills the process now (SIGKILL).
    #[allow(dead_code)] // not every test binary that includes this module kills
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
