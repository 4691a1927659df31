//! Starting `mesh up` as a child process for the process-level tests.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// A `mesh up` process hosting the bundled t1 on a free port; killed on drop.
#[allow(dead_code)] // only the process-level tests start child processes
pub(crate) struct MeshProcess {
    /// The child.
    pub(crate) child: Child,
    /// `http://127.0.0.1:PORT`.
    pub(crate) base: String,
}

#[allow(dead_code)]
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

/// Starts a node in this process; it runs until the returned sender is dropped or fired.
/// Returns `http://ADDR` and the stop handle.
#[allow(dead_code)] // not every test binary that includes this module starts in-process nodes
pub(crate) async fn in_process(
    cfg: mesh::config::NodeConfig,
) -> (String, tokio::sync::oneshot::Sender<()>) {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let running = mesh::start(cfg, async move {
        let _ = rx.await;
    })
    .await
    .expect("node starts");
    let base = format!("http://{}", running.addr);
    tokio::spawn(running.wait());
    (base, tx)
}
