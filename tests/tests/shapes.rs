//! Benchmark models in the shape of public architectures (`scripts/shape-gguf.py`): the
//! file is a function of its arguments, llama.cpp loads it with the architecture's
//! parameter count, a `mesh up` node decodes exactly the tokens asked with `ignore_eos`, and
//! bad arguments are refused before anything is written. The tests write the first layer
//! of the Llama-3.2-1B shape only (the 128256 x 2048 embedding included), to stay quick, and
//! one layer of the Qwen2.5-0.5B shape (the `qwen2` architecture).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use mesh_tests::{post_json, root, Node};
use serde_json::{json, Value};

/// Llama-3.2-1B's published config: vocabulary, width, heads, KV heads, feed-forward width.
const VOCAB: u64 = 128_256;
const DIM: u64 = 2048;
const HEADS: u64 = 32;
const KV_HEADS: u64 = 8;
const FFN: u64 = 8192;

fn shape_gguf(args: &[&str]) -> Output {
    let python = std::env::var("MESH_PYTHON").unwrap_or_else(|_| "python3".into());
    Command::new(&python)
        .arg(root().join("scripts/shape-gguf.py"))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{python} does not run: {e}"))
}

/// Writes one layer of the 1B shape as `qtype` with `seed` into `dir`.
fn write_1b_layer(dir: &Path, qtype: &str, seed: u32) -> PathBuf {
    let out = dir.join(format!("1b-1layer-{qtype}-{seed}.gguf"));
    let o = shape_gguf(&[
        "--shape",
        "llama-3.2-1b",
        "--layers",
        "1",
        "--type",
        qtype,
        "--seed",
        &seed.to_string(),
        "--out",
        &out.display().to_string(),
    ]);
    assert!(
        o.status.success(),
        "shape-gguf.py failed (scripts/setup.sh installs numpy; MESH_PYTHON names the Python): {}",
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

/// One q4_0 file shared by the tests that start a node on it (kept for the test process).
fn shared_q4() -> &'static Path {
    static FILE: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    let (_, p) = FILE.get_or_init(|| {
        let d = tempfile::tempdir().unwrap();
        let p = write_1b_layer(d.path(), "q4_0", 7);
        (d, p)
    });
    p
}

fn up(dir: &Path, model: &Path) -> Node {
    up_with(dir, model, &[])
}

/// A node serving `model` as t1 on one thread and one slot, with `extra` arguments.
fn up_with(dir: &Path, model: &Path, extra: &[&str]) -> Node {
    let tier = format!("t1={}", model.display());
    let mut args = vec![
        "--tier",
        &tier,
        "--threads",
        "1",
        "--ctx",
        "256",
        "--parallel",
        "1",
    ];
    args.extend_from_slice(extra);
    Node::up(dir, &args).unwrap_or_else(|log| panic!("node did not start:\n{log}"))
}

/// The parameter count llama.cpp reports for the node's t1, and the model list it is in.
async fn t1_params(node: &Node) -> (Option<u64>, Value) {
    let v: Value = reqwest::get(format!("{}/v1/models", node.http))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let n = v["data"]
        .as_array()
        .and_then(|d| d.iter().find(|m| m["id"] == "t1"))
        .and_then(|m| m["meta"]["n_params"].as_u64());
    (n, v)
}

fn same_bytes(a: &Path, b: &Path) -> bool {
    std::fs::read(a).unwrap() == std::fs::read(b).unwrap()
}

#[test]
fn the_same_arguments_write_the_same_bytes() {
    let d = tempfile::tempdir().unwrap();
    let a = write_1b_layer(d.path(), "q8_0", 3);
    let b = d.path().join("again.gguf");
    std::fs::rename(&a, &b).unwrap();
    let a = write_1b_layer(d.path(), "q8_0", 3);
    assert!(same_bytes(&a, &b), "two writes with seed 3 differ");
}

#[test]
fn another_seed_writes_other_weights() {
    let d = tempfile::tempdir().unwrap();
    let a = write_1b_layer(d.path(), "q8_0", 3);
    let b = write_1b_layer(d.path(), "q8_0", 4);
    assert_eq!(
        std::fs::metadata(&a).unwrap().len(),
        std::fs::metadata(&b).unwrap().len()
    );
    assert!(!same_bytes(&a, &b), "seeds 3 and 4 wrote the same file");
}

#[tokio::test(flavor = "multi_thread")]
async fn llama_cpp_counts_the_architectures_parameters() {
    let d = tempfile::tempdir().unwrap();
    let node = up(d.path(), shared_q4());
    let head = DIM / HEADS;
    // Tied embedding; one block: q, k, v, output, gate, up, down; two norms per block + final.
    let block = DIM * DIM * 2 + 2 * KV_HEADS * head * DIM + 3 * FFN * DIM;
    let expected = VOCAB * DIM + block + 3 * DIM;
    let (n, v) = t1_params(&node).await;
    assert_eq!(n, Some(expected), "{v}");
}

/// The Qwen2.5 shapes are llama.cpp's `qwen2` architecture: llama's blocks with biases on
/// the q, k and v projections, and an output matrix of their own as in Qwen's GGUFs.
#[tokio::test(flavor = "multi_thread")]
async fn llama_cpp_loads_the_qwen2_shape_with_its_parameters() {
    let d = tempfile::tempdir().unwrap();
    let out = write_shape(
        d.path(),
        &["--shape", "qwen2.5-0.5b", "--layers", "1", "--type", "q4_0"],
    );
    let node = up(d.path(), &out);
    // Qwen2.5-0.5B: vocabulary 151936, width 896, 14 heads of 64, 2 KV heads, FFN 4864.
    let (vocab, dim, kv, ffn) = (151_936u64, 896u64, 2 * 64u64, 4_864u64);
    let block = 2 * dim * dim + 2 * kv * dim + 3 * ffn * dim + (dim + 2 * kv) + 2 * dim;
    let expected = 2 * vocab * dim + block + dim;
    let (n, v) = t1_params(&node).await;
    assert_eq!(n, Some(expected), "{v}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_node_decodes_exactly_the_tokens_asked_with_ignore_eos() {
    let d = tempfile::tempdir().unwrap();
    let node = up(d.path(), shared_q4());
    let body = json!({"model": "t1", "prompt": "Weather in Oslo?", "max_tokens": 12,
                      "ignore_eos": true, "temperature": 0});
    let url = format!("{}/v1/completions", node.http);
    let v = post_json(&reqwest::Client::new(), &url, &body).await;
    assert_eq!(v["usage"]["completion_tokens"], 12, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap_or_default();
    assert!(!text.trim().is_empty(), "no text: {v}");
}

#[test]
fn a_layer_count_outside_the_shape_is_refused_and_nothing_is_written() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("x.gguf");
    let o = shape_gguf(&[
        "--shape",
        "llama-3.2-1b",
        "--layers",
        "17",
        "--out",
        &out.display().to_string(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--layers must be 1..16"), "{err}");
    assert!(!out.exists());
}

/// Writes the shape `args` name (`--shape ...`, more options after it) into `dir`.
fn write_shape(dir: &Path, args: &[&str]) -> PathBuf {
    let out = dir.join(format!("{}.gguf", args.join("-").replace('-', "")));
    let mut all = args.to_vec();
    let out_arg = out.display().to_string();
    all.extend(["--out", &out_arg]);
    let o = shape_gguf(&all);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    out
}

/// Writes the `moe-test` shape (qwen3moe: 2 layers of 8 experts, 2 per token) into `dir`.
fn write_moe(dir: &Path) -> PathBuf {
    write_shape(dir, &["--shape", "moe-test", "--type", "q8_0"])
}

/// Greedy text of 16 tokens from a node on `model` started with `extra` arguments.
async fn moe_text(dir: &Path, model: &Path, extra: &[&str]) -> String {
    let node = up_with(dir, model, extra);
    let body = json!({"model": "t1", "prompt": "Weather in Oslo?", "max_tokens": 16,
                      "ignore_eos": true, "temperature": 0});
    let url = format!("{}/v1/completions", node.http);
    let v = post_json(&reqwest::Client::new(), &url, &body).await;
    assert_eq!(v["usage"]["completion_tokens"], 16, "{v}");
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// The MoE shape is llama.cpp's `qwen3moe`: q and k norms, a router and stacked experts
/// in each layer, all of which llama.cpp counts.
#[tokio::test(flavor = "multi_thread")]
async fn llama_cpp_loads_the_moe_shape_with_its_parameters() {
    let d = tempfile::tempdir().unwrap();
    let node = up(d.path(), &write_moe(d.path()));
    // moe-test: vocabulary 3072, width 256, 4 heads of 64, 2 KV heads, 8 experts of 128.
    let (vocab, dim, hd, kv, experts, eff) = (3_072u64, 256u64, 64u64, 2 * 64u64, 8u64, 128u64);
    let attn = 2 * (4 * hd) * dim + 2 * kv * dim;
    let block = attn + 3 * experts * eff * dim + experts * dim + 2 * dim + 2 * hd;
    let expected = 2 * vocab * dim + 2 * block + dim;
    let (n, v) = t1_params(&node).await;
    assert_eq!(n, Some(expected), "{v}");
}

/// `--cpu-moe all` loads the experts through llama.cpp's buffer-type overrides; the tier
/// then writes what it writes without them (here on the CPU either way; on a GPU host the
/// experts stay in host memory, docs/gpu.md).
#[tokio::test(flavor = "multi_thread")]
async fn experts_kept_in_host_memory_write_the_same_tokens() {
    let d = tempfile::tempdir().unwrap();
    let model = write_moe(d.path());
    let (a, b) = (d.path().join("a"), d.path().join("b"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    let plain = moe_text(&a, &model, &[]).await;
    let kept = moe_text(&b, &model, &["--cpu-moe", "all"]).await;
    assert_eq!(kept, plain);
}
