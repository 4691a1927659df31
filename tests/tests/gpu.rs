//! Accelerators (`mesh_tiers::gpu`, docs/gpu.md).
//!
//! On every machine: a backend module that does not load is reported with the loader's
//! reason and the node serves its tiers on the CPU; a tier asking for a GPU the machine lacks
//! is refused when the node starts; prompts whose KV left the device (more prompts than
//! slots) come back from host-RAM pages with the same replies.
//!
//! On a GPU node only (ignored elsewhere; run them after `scripts/build-cuda-module.sh` with
//! `cargo test --release --workspace --test integration gpu:: -- --ignored`): `mesh topology` lists the GPU
//! with its memory; pages a GPU node wrote to `--kv-dir` are restored on the GPU after a
//! restart, with the same reply; a shared prefix served from each level of a GPU node
//! (kept in the slot, copied from a running sequence on the GPU, restored from host RAM)
//! gives the replies of a GPU node that prefills every prompt from scratch; prompts whose
//! KV left the GPU come back from host RAM with the same replies.
use std::path::Path;
use std::process::Command;

use mesh_tests::{mesh_bin, metric_total, post_json, root, Node};
use serde_json::{json, Value};

/// `mesh topology --json` with backend modules from `modules` (the test's folder, so that a
/// module beside the binary never leaks in).
fn topology(modules: &Path) -> Value {
    let o = Command::new(mesh_bin())
        .args(["topology", "--json"])
        .current_dir(root())
        .env("MESH_BACKENDS_DIR", modules)
        .output()
        .expect("mesh runs");
    assert!(
        o.status.success(),
        "mesh topology failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).expect("topology JSON")
}

/// A file named like a CUDA module that is not a shared object.
fn broken_module(dir: &Path) {
    std::fs::write(
        dir.join("libggml-cuda.so"),
        "not a shared object, but long enough to be read as one".repeat(4),
    )
    .unwrap();
}

#[test]
fn a_module_that_does_not_load_is_named_with_the_loaders_reason() {
    let d = tempfile::tempdir().unwrap();
    broken_module(d.path());
    let v = topology(d.path());
    let m = &v["backend_modules"][0];
    assert!(
        m["path"]
            .as_str()
            .is_some_and(|p| p.ends_with("libggml-cuda.so")),
        "{v}"
    );
    let err = m["outcome"]["Err"].as_str().unwrap_or_default();
    assert!(err.contains("ELF"), "loader's reason missing: {v}");
    assert_eq!(v["gpus"], json!([]), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_module_does_not_load_serves_its_tier_on_the_cpu() {
    let d = tempfile::tempdir().unwrap();
    broken_module(d.path());
    let dir = d.path().display().to_string();
    let node = Node::up_with_env(
        d.path(),
        &[
            "--tier",
            "t1=models/t1-q8_0.gguf",
            "--threads",
            "1",
            "--ctx",
            "2048",
            "--parallel",
            "1",
        ],
        &[("MESH_BACKENDS_DIR", &dir)],
    )
    .expect("node starts");
    let reply = mesh_tests::greedy_reply(&node.http).await;
    assert!(!reply.is_empty());
    let log = std::fs::read_to_string(&node.log).unwrap();
    assert!(log.contains("ggml backend not loaded"), "{log}");
}

#[test]
fn a_tier_asking_for_a_gpu_the_machine_lacks_is_refused_at_start() {
    let d = tempfile::tempdir().unwrap();
    let cfg = d.path().join("node.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[tiers]]\nname = \"t1\"\nmodel = \"{}\"\nn_ctx = 2048\nn_seq_max = 1\ngpu = 0\n",
            root().join("models/t1-q8_0.gguf").display()
        ),
    )
    .unwrap();
    let dir = d.path().display().to_string();
    let r = Node::up_with_env(
        d.path(),
        &["--config", &cfg.display().to_string()],
        &[("MESH_BACKENDS_DIR", &dir)],
    );
    let log = match r {
        Ok(n) => panic!(
            "the node started: {}",
            std::fs::read_to_string(&n.log).unwrap()
        ),
        Err(log) => log,
    };
    assert!(
        log.contains("gpu 0 asked for, but llama.cpp has no GPU here"),
        "{log}"
    );
}

// ---- On a GPU node ------------------------------------------------------------------------

/// The folder `scripts/build-cuda-module.sh` writes to: beside the mesh binary.
fn modules_beside_mesh() -> std::path::PathBuf {
    mesh_bin().parent().unwrap().to_path_buf()
}

#[test]
#[ignore = "needs a GPU and scripts/build-cuda-module.sh"]
fn topology_lists_the_gpu_with_its_memory() {
    let v = topology(&modules_beside_mesh());
    let g = &v["gpus"][0];
    assert_eq!(g["kind"], "gpu", "{v}");
    assert!(g["memory_total"].as_u64().unwrap_or(0) > 0, "{v}");
}

#[test]
fn without_a_gpu_there_is_no_gpu_plan() {
    let d = tempfile::tempdir().unwrap();
    let v = topology(d.path());
    assert_eq!(v["gpu_plan"], Value::Null, "{v}");
}

#[test]
#[ignore = "needs a GPU and scripts/build-cuda-module.sh"]
fn the_gpu_plan_puts_the_bundled_tiers_on_the_gpu() {
    let v = topology(&modules_beside_mesh());
    let tiers = v["gpu_plan"]["tiers"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(tiers.len(), 3, "{v}");
    for t in tiers {
        assert_eq!(t["choice"], json!({"gpu": 0}), "{v}");
    }
}

/// A prompt of about 800 t1 tokens, different for each `i`.
fn long_prompt(i: usize) -> String {
    let facts: String = (0..30)
        .map(|k| {
            format!(
                "Fact {k}: river {} flows {} km to the sea. ",
                k + i,
                (k * 37 + i * 11) % 900
            )
        })
        .collect();
    format!("{facts}\nWhich river is the longest? Answer in one sentence.")
}

async fn greedy(http: &str, prompt: &str) -> String {
    let v = post_json(
        &reqwest::Client::new(),
        &format!("{http}/v1/chat/completions"),
        &json!({"model": "t1", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 48, "temperature": 0}),
    )
    .await;
    // t1 answers some prompts with a tool call: compare its name and arguments (call ids
    // are random) or the text.
    let m = &v["choices"][0]["message"];
    match m["content"].as_str() {
        Some(text) => text.to_owned(),
        None => {
            let f = &m["tool_calls"][0]["function"];
            assert!(f["name"].is_string(), "neither text nor a tool call: {v}");
            format!("{}({})", f["name"], f["arguments"])
        }
    }
}

fn t1_node(dir: &Path, gpu_layers: &str, extra: &[&str]) -> Node {
    let mut args = vec![
        "--tier",
        "t1=models/t1-q8_0.gguf",
        "--threads",
        "4",
        "--ctx",
        "8192",
        "--parallel",
        "2",
        "--gpu-layers",
        gpu_layers,
    ];
    args.extend_from_slice(extra);
    Node::up_with_env(dir, &args, &[("MESH_LLAMA_LOGS", "1")]).expect("node starts")
}

/// Panics unless llama.cpp's log of `node` says every layer went to the GPU.
fn assert_all_layers_on_gpu(node: &Node) {
    let log = std::fs::read_to_string(&node.log).unwrap();
    let all = log.lines().any(|l| {
        l.split("offloaded ")
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .and_then(|f| f.split_once('/'))
            .is_some_and(|(a, b)| a == b && l.contains("layers to GPU"))
    });
    assert!(all, "not every layer is on the GPU: {log}");
}

async fn tokens_restored(http: &str) -> u64 {
    metric_total(http, "mesh_kv_recompute_avoided_tokens_total").await as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU and scripts/build-cuda-module.sh"]
async fn pages_a_gpu_node_wrote_to_disk_restore_on_the_gpu_after_a_restart() {
    let d = tempfile::tempdir().unwrap();
    let kv = d.path().join("kv").display().to_string();
    let p = long_prompt(7);
    let first = {
        let mut n = t1_node(d.path(), "all", &["--kv-dir", &kv, "--no-keep-resident"]);
        let r = greedy(&n.http, &p).await;
        n.terminate();
        r
    };
    let n = t1_node(d.path(), "all", &["--kv-dir", &kv, "--no-keep-resident"]);
    assert_all_layers_on_gpu(&n);
    assert_eq!(greedy(&n.http, &p).await, first);
    assert!(
        tokens_restored(&n.http).await >= 512,
        "no prefix restored from disk"
    );
}

/// Chat prompts sharing one long prefix (about 800 tokens of facts), with question `q`.
fn shared_prefix_prompt(q: usize) -> String {
    let facts = long_prompt(0);
    let facts = facts.split('\n').next().unwrap();
    format!("{facts}\nQuestion {q}: which river is number {q} by length? One sentence.")
}

/// Starts a long streamed chat request and returns once its first chunk came, with the
/// task that reads the rest. (t1's context is 2048 tokens: the prompt's 807 and 1200 more.)
async fn hold(http: &str, prompt: &str) -> tokio::task::JoinHandle<()> {
    use futures::StreamExt;
    let resp = reqwest::Client::new()
        .post(format!("{http}/v1/chat/completions"))
        .json(
            &json!({"model": "t1", "messages": [{"role": "user", "content": prompt}],
                      "max_tokens": 1200, "temperature": 0, "ignore_eos": true, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    if !resp.status().is_success() {
        panic!(
            "the holding request was refused: {}",
            resp.text().await.unwrap()
        );
    }
    let mut stream = resp.bytes_stream();
    let mut seen = String::new();
    while !seen.contains("\"delta\"") {
        seen.push_str(&String::from_utf8_lossy(
            &stream.next().await.unwrap().unwrap(),
        ));
    }
    tokio::spawn(async move { while stream.next().await.is_some() {} })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU and scripts/build-cuda-module.sh"]
async fn a_prefix_served_from_each_gpu_node_level_gives_the_replies_of_a_fresh_prefill() {
    let d = tempfile::tempdir().unwrap();
    // The reference: every prompt prefilled from scratch on the GPU. (Not the CPU: its
    // kernels round differently, and t1, a 3M-parameter model, has near-ties that then go
    // either way; on the H200 its greedy replies left the CPU's after 8-35 tokens.)
    let fresh = t1_node(d.path(), "all", &["--no-keep-resident", "--kv-block", "0"]);
    assert_all_layers_on_gpu(&fresh);
    let mut want = vec![];
    for q in 0..4 {
        want.push(greedy(&fresh.http, &shared_prefix_prompt(q)).await);
    }
    // KV kept on the GPU: recomputed, kept in the slot, copied from a running sequence.
    let gpu = t1_node(d.path(), "all", &[]);
    assert_all_layers_on_gpu(&gpu);
    assert_eq!(
        greedy(&gpu.http, &shared_prefix_prompt(0)).await,
        want[0],
        "recomputed"
    );
    assert_eq!(
        greedy(&gpu.http, &shared_prefix_prompt(1)).await,
        want[1],
        "kept"
    );
    assert_eq!(
        metric_total(&gpu.http, "mesh_kv_resident_hits_total").await,
        1.0
    );
    let holder = hold(&gpu.http, &shared_prefix_prompt(2)).await;
    assert_eq!(
        greedy(&gpu.http, &shared_prefix_prompt(3)).await,
        want[3],
        "copied"
    );
    assert_eq!(
        metric_total(&gpu.http, "mesh_kv_device_copies_total").await,
        1.0
    );
    assert!(metric_total(&gpu.http, "mesh_kv_device_copy_tokens_total").await >= 512.0);
    holder.await.unwrap();
    // Pages only: the second prompt restores the prefix from host RAM onto the GPU.
    let pages = t1_node(d.path(), "all", &["--no-keep-resident"]);
    assert_eq!(greedy(&pages.http, &shared_prefix_prompt(0)).await, want[0]);
    assert_eq!(
        greedy(&pages.http, &shared_prefix_prompt(1)).await,
        want[1],
        "from RAM"
    );
    assert!(
        tokens_restored(&pages.http).await >= 512,
        "no prefix restored from RAM"
    );
}

/// Five distinct prompts of about 800 tokens through a node whose device holds two (two
/// slots), twice over. In the second round each prompt's KV has left the device (the two
/// slots took later prompts), so its prefix comes back from host-RAM pages onto the device;
/// every reply equals the first round's.
async fn prefixes_beyond_the_device_come_back_from_ram(gpu_layers: &str) {
    let d = tempfile::tempdir().unwrap();
    let n = t1_node(d.path(), gpu_layers, &[]);
    let prompts: Vec<String> = (10..15).map(long_prompt).collect();
    let mut first = vec![];
    for p in &prompts {
        first.push(greedy(&n.http, p).await);
    }
    let restored = tokens_restored(&n.http).await;
    let dropped = metric_total(&n.http, "mesh_kv_resident_dropped_tokens_total").await;
    for (i, p) in prompts.iter().enumerate() {
        assert_eq!(greedy(&n.http, p).await, first[i], "prompt {i}");
    }
    let restored = tokens_restored(&n.http).await - restored;
    let dropped = metric_total(&n.http, "mesh_kv_resident_dropped_tokens_total").await - dropped;
    assert!(restored >= 5 * 512, "{restored} tokens restored from RAM");
    assert!(dropped >= 5.0 * 512.0, "{dropped} tokens left the device");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefixes_beyond_the_slots_come_back_from_ram_with_the_same_replies() {
    prefixes_beyond_the_device_come_back_from_ram("0").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU and scripts/build-cuda-module.sh"]
async fn prefixes_beyond_the_gpu_come_back_from_ram_with_the_same_replies() {
    prefixes_beyond_the_device_come_back_from_ram("all").await;
}
