//! Page events: a node tells its peers every page it stores and removes (numbered events,
//! a snapshot for a peer that is new or missed some), so their page index holds every
//! page, not only the newest ids its adverts list. Here adverts list 2 ids per namespace
//! (`MESH_ADVERTISED_PAGES=2`) and a gateway-only peer must still index all of a's pages.

use mesh_tests::{
    certs, member_view, metric_total, post_json, t1_config, tools_prompt, wait_until, Node,
};
use serde_json::json;

/// A node `a` with tier t1 whose RAM holds about 33 pages (t1: ~48 KiB a page) and no
/// disk, listing 2 page ids in its adverts; and a gateway-only node `g` that follows it.
fn pair(dir: &std::path::Path) -> (Node, Node) {
    let certs = certs(dir, &["a", "g"]);
    let cf = t1_config(dir, "a", 1_600_000);
    let a = Node::start_with_env(
        "a",
        &certs,
        &[],
        "t1",
        &["--config", &cf, "--no-keep-resident", "--parallel", "2"],
        &[("MESH_ADVERTISED_PAGES", "2")],
    )
    .expect("a");
    let g = Node::start("g", &certs, &[&a.quic], "none", &["--roles", "gateway"]).expect("g");
    (a, g)
}

/// Waits until `g` follows `a`'s page events (it has applied a snapshot).
async fn following(c: &reqwest::Client, g: &Node) {
    wait_until("g to follow a's page events", async || {
        member_view(c, &g.http, "a").await["page_seq"].is_u64()
    })
    .await;
}

async fn complete(c: &reqwest::Client, base: &str, p: &str) {
    let body = json!({"model": "t1", "prompt": p, "max_tokens": 4, "temperature": 0});
    let v = post_json(c, &format!("{base}/v1/completions"), &body).await;
    assert!(v["choices"][0]["text"].is_string(), "{v}");
}

/// `(pages a holds, pages g's index holds for a)`.
async fn counts(c: &reqwest::Client, a: &Node, g: &Node) -> (u64, u64) {
    let pages = async |at: &str| member_view(c, at, "a").await["pages_indexed"].as_u64();
    (
        pages(&a.http).await.unwrap_or(0),
        pages(&g.http).await.unwrap_or(0),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_indexes_every_page_beyond_the_advertised_list() {
    let dir = tempfile::tempdir().unwrap();
    let (a, g) = pair(dir.path());
    let c = reqwest::Client::new();
    following(&c, &g).await;
    complete(&c, &a.http, &tools_prompt(0)).await;
    wait_until("g to index all of a's pages", async || {
        let (held, indexed) = counts(&c, &a, &g).await;
        held > 2 && indexed == held
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_a_node_evicts_leave_its_peers_index() {
    let dir = tempfile::tempdir().unwrap();
    let (a, g) = pair(dir.path());
    let c = reqwest::Client::new();
    following(&c, &g).await;
    // Three prompts of about 20 pages each: the first one's pages leave a's RAM, and a
    // has no other level to keep them.
    for from in [0, 10, 20] {
        complete(&c, &a.http, &tools_prompt(from)).await;
    }
    let evicted = metric_total(&a.http, "mesh_kv_pages_evicted_total").await;
    let published = metric_total(&a.http, "mesh_kv_pages_published_total").await;
    assert!(evicted > 0.0, "a evicted pages (published {published})");
    wait_until("g's index to match a's pages", async || {
        let (held, indexed) = counts(&c, &a, &g).await;
        held > 2 && indexed == held
    })
    .await;
    let (held, _) = counts(&c, &a, &g).await;
    assert!(
        (held as f64) < published,
        "a holds {held} of the {published} pages it published: the rest were removed"
    );
}
