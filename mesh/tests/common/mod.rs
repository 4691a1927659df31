//! Starting nodes for the `mesh` package's tests: as child processes (through the shared
//! helper in `mesh-tests`) or inside the test process.

/// Starts `mesh up --port 0 --only t1` (2 threads, 8192 context, 4 slots) as a child process
/// with these extra environment variables and waits for its gateway; killed on drop. Its log
/// goes to the system temp folder.
#[allow(dead_code)] // only the process-level tests start child processes
pub(crate) fn mesh_up(env: &[(&str, &str)]) -> mesh_tests::Node {
    mesh_tests::Node::up_with_env(
        &std::env::temp_dir(),
        &[
            "--only",
            "t1",
            "--threads",
            "2",
            "--ctx",
            "8192",
            "--parallel",
            "4",
        ],
        env,
    )
    .unwrap_or_else(|log| panic!("mesh up exited before listening:\n{log}"))
}

/// A node hosting the bundled t1 (2 threads, `n_ctx` cells shared by `n_seq_max` slots) on
/// 127.0.0.1 with an ephemeral port.
#[allow(dead_code)] // not every test binary that includes this module uses it
pub(crate) fn t1_config(n_ctx: u32, n_seq_max: u32) -> mesh::config::NodeConfig {
    mesh::config::NodeConfig {
        listen: "127.0.0.1:0".parse().expect("an address"),
        tiers: vec![mesh_tiers::EngineConfig {
            name: "t1".into(),
            model: std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/t1-q8_0.gguf"),
            n_ctx,
            n_seq_max,
            threads: 2,
            ..mesh_tiers::EngineConfig::default()
        }],
        ..mesh::config::NodeConfig::default()
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

/// A node started once for a whole test binary and shared by its tests. It runs on a
/// runtime of its own (each `#[tokio::test]` has its own runtime, which stops at the end of
/// its test) and lives until the process exits. Returns `http://ADDR`.
#[allow(dead_code)] // not every test binary that includes this module shares a node
pub(crate) fn shared_node(
    cell: &'static std::sync::OnceLock<String>,
    cfg: impl FnOnce() -> mesh::config::NodeConfig + Send + 'static,
) -> String {
    cell.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("a runtime");
            rt.block_on(async move {
                let running = mesh::start(cfg(), std::future::pending())
                    .await
                    .expect("the shared node starts");
                tx.send(format!("http://{}", running.addr))
                    .expect("the test waits");
                let _ = running.wait().await;
            });
        });
        rx.recv().expect("the shared node started")
    })
    .clone()
}

/// The text of `base`'s `/metrics` page.
pub(crate) async fn scrape(c: &reqwest::Client, base: &str) -> String {
    c.get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}
