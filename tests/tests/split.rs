//! The prefill/decode split: a `decode` node hands a long prompt to a `prefill` node, pulls
//! the pages it computed over QUIC and decodes from them; short prompts and failed
//! hand-offs are prefilled where they landed. Real `mesh join` processes on 127.0.0.1.

use mesh_tests::{certs, member_view, metric, post_json, tools_prompt, wait_until, Node};
use serde_json::{json, Value};

/// A prefill node `p` and a decode node `d` (the gateway) in front of it, both with tier
/// t1 and KV pages; `d` hands prompts of 64 uncached tokens or more to `p`. `p_extra` are
/// more flags for `p`.
async fn split(dir: &std::path::Path, p_extra: &[&str]) -> (Node, Node) {
    let certs = certs(dir, &["p", "d"]);
    let cfg = dir.join("split.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[tiers]]\nname = \"t1\"\nmodel = \"{}\"\n[tiers.kv_pages]\nram_bytes = 8000000\n\
             [cluster]\nhandoff_tokens = 64\n",
            mesh_tests::root().join("models/t1-q8_0.gguf").display()
        ),
    )
    .unwrap();
    let cfg = cfg.display().to_string();
    // Two slots of 2,048 tokens: a prompt of ten tools fits.
    let mut args = vec![
        "--config",
        cfg.as_str(),
        "--parallel",
        "2",
        "--roles",
        "prefill",
    ];
    args.extend_from_slice(p_extra);
    let p = Node::start("p", &certs, &[], "t1", &args).expect("p");
    let d_args = [
        "--config",
        &cfg,
        "--parallel",
        "2",
        "--roles",
        "gateway,decode",
    ];
    let d = Node::start("d", &certs, &[&p.quic], "t1", &d_args).expect("d");
    let c = reqwest::Client::new();
    wait_until("d to see p's prefill tier", async || {
        let m = member_view(&c, &d.http, "p").await;
        m["roles"] == json!(["prefill"]) && m["tiers"][0]["name"] == "t1"
    })
    .await;
    (p, d)
}

async fn complete(c: &reqwest::Client, base: &str, prompt: &str) -> Value {
    let body = json!({"model": "t1", "prompt": prompt, "max_tokens": 8, "temperature": 0});
    let v = post_json(c, &format!("{base}/v1/completions"), &body).await;
    assert!(v["choices"][0]["text"].is_string(), "{v}");
    v
}

async fn handoffs(c: &reqwest::Client, d: &Node, outcome: &str) -> f64 {
    let series = format!("mesh_prefill_handoffs_total{{outcome=\"{outcome}\"}}");
    metric(c, &d.http, &series).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prompt_is_prefilled_on_the_prefill_node_and_decoded_from_its_pages() {
    let dir = tempfile::tempdir().unwrap();
    let (p, d) = split(dir.path(), &[]).await;
    let c = reqwest::Client::new();
    let v = complete(&c, &d.http, &tools_prompt(0)).await;
    assert_eq!(handoffs(&c, &d, "done").await, 1.0);
    let published = metric(&c, &p.http, "mesh_kv_pages_published_total").await;
    let pulled = metric(&c, &d.http, "mesh_kv_pages_fetched_from_peers_total").await;
    assert!(
        published > 0.0,
        "p computed the prompt and published its pages"
    );
    assert_eq!(pulled, published, "d pulled every page p computed");
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        cached * 10 >= prompt * 9,
        "d restored most of the prompt from p's pages: {cached} of {prompt}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_prompt_is_prefilled_where_it_landed() {
    let dir = tempfile::tempdir().unwrap();
    let (p, d) = split(dir.path(), &[]).await;
    let c = reqwest::Client::new();
    complete(&c, &d.http, "Rivers run to the sea because").await;
    assert_eq!(handoffs(&c, &d, "done").await, 0.0);
    assert_eq!(handoffs(&c, &d, "failed").await, 0.0);
    assert_eq!(
        metric(&c, &p.http, "mesh_kv_pages_published_total").await,
        0.0,
        "p computed nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_hand_off_is_prefilled_on_the_decode_node() {
    let dir = tempfile::tempdir().unwrap();
    // p's slots (512 tokens) are too short for the prompt: it refuses the hand-off.
    let (_p, d) = split(dir.path(), &["--ctx", "1024"]).await;
    let c = reqwest::Client::new();
    let v = complete(&c, &d.http, &tools_prompt(0)).await;
    assert_eq!(handoffs(&c, &d, "failed").await, 1.0);
    assert_eq!(handoffs(&c, &d, "done").await, 0.0);
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 512, "{v}");
}
