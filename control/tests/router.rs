//! The router's public API on the bundled embedding model.
//!
//! Needs `models/embed/minilm-l6-tools-f16.gguf` (in git) and, for the comparison with
//! sentence-transformers, the model it was fine-tuned from,
//! `models/embed/all-minilm-l6-v2-f16.gguf` (converted by `scripts/setup.sh`); a missing
//! model fails the tests, it never skips them. The routing test uses the bundled
//! tool catalog and agent tasks in `models/fixtures/`.

use std::path::PathBuf;
use std::sync::OnceLock;

use mesh_control::{Embedder, EmbedderConfig, RouterConfig, Tool, ToolRouter};

fn root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

fn new_embedder() -> Embedder {
    embedder_of(mesh_control::embed::BUNDLED_MODEL)
}

fn embedder_of(relative: &str) -> Embedder {
    let model = root().join(relative);
    assert!(
        model.is_file(),
        "{} is missing: run scripts/setup.sh",
        model.display()
    );
    Embedder::new(EmbedderConfig {
        model,
        ..EmbedderConfig::default()
    })
    .expect("load the embedding model")
}

/// One embedder for the tests that do not look at cache counters.
fn shared() -> &'static Embedder {
    static EMBEDDER: OnceLock<Embedder> = OnceLock::new();
    EMBEDDER.get_or_init(new_embedder)
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[test]
fn batched_embeddings_equal_one_at_a_time_and_are_unit_length() {
    let e = shared();
    assert_eq!(e.dim(), 384);
    let long = "word ".repeat(600);
    let texts = [
        "Get the weather forecast for a city.",
        "Send an email.",
        "Book a table at a restaurant for four people tonight at eight.",
        long.as_str(),
        "",
    ];
    let batched = e
        .embed_batch(&texts, mesh_control::TextRole::Query)
        .unwrap();
    assert_eq!(batched.len(), texts.len());
    for (text, b) in texts.iter().zip(&batched) {
        let single = e.embed(text).unwrap();
        let norm: f32 = b.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "norm {norm}");
        let cos = cosine(&single, b);
        assert!(
            cos > 0.9999,
            "batched vs single cos {cos} for {:.40?}",
            text
        );
    }
    // Different texts are different vectors.
    assert!(cosine(&batched[0], &batched[1]) < 0.9);
}

/// Packing many texts into one `llama_decode` must not change them: compare with
/// sentence-transformers' own vectors (`models/fixtures/embed_reference.json`).
#[test]
fn packed_embeddings_match_sentence_transformers() {
    let path = root().join("models/fixtures/embed_reference.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let sentences: Vec<&str> = json["sentences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    let expected: Vec<Vec<f32>> = json["embeddings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect();
    assert!(sentences.len() >= 4, "too few reference sentences");
    // The reference is the published all-MiniLM-L6-v2, which the bundled model was
    // fine-tuned from.
    let got = embedder_of(mesh_control::embed::BASE_MODEL)
        .embed_batch(&sentences, mesh_control::TextRole::Raw)
        .unwrap();
    for ((s, e), g) in sentences.iter().zip(&expected).zip(&got) {
        let norm: f32 = e.iter().map(|x| x * x).sum::<f32>().sqrt();
        let cos = cosine(g, e) / norm;
        assert!(
            cos > 0.999,
            "cosine {cos} against sentence-transformers for {s:?}"
        );
    }
}

#[test]
fn similar_intents_are_closer_than_unrelated_ones() {
    let e = shared();
    let v = e
        .embed_batch(
            &[
                "What will the weather be like in Paris tomorrow?",
                "weather_get_forecast: Get the forecast by city and date.",
                "email_send: Send an email to a recipient.",
            ],
            mesh_control::TextRole::Raw,
        )
        .unwrap();
    assert!(cosine(&v[0], &v[1]) > cosine(&v[0], &v[2]) + 0.2);
}

#[test]
fn an_unchanged_catalog_is_never_re_embedded() {
    let e = new_embedder();
    let tools = catalog();
    let n = tools.len() as u64;
    ToolRouter::build(&e, tools.clone(), RouterConfig::default()).unwrap();
    let first = e.cache().stats();
    assert_eq!(first.misses, n);
    assert_eq!(first.entries as u64, n);
    ToolRouter::build(&e, tools.clone(), RouterConfig::default()).unwrap();
    let second = e.cache().stats();
    assert_eq!(second.misses, n, "no new misses");
    assert_eq!(second.hits, first.hits + n);
    // A changed description is one miss; queries never enter the cache.
    let mut changed = tools;
    changed[0].description.push_str(" Now faster.");
    let router = ToolRouter::build(&e, changed, RouterConfig::default()).unwrap();
    router.route(&e, "anything", 3).unwrap();
    let third = e.cache().stats();
    assert_eq!(third.misses, n + 1);
    assert_eq!(third.entries as u64, n + 1);
}

fn catalog() -> Vec<Tool> {
    let path = root().join("models/fixtures/catalog.jsonl");
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| Tool::from_openai(&serde_json::from_str(l).unwrap()).unwrap())
        .collect()
}

#[test]
fn routes_the_bundled_agent_tasks_to_their_tools() {
    let e = shared();
    let router = ToolRouter::build(e, catalog(), RouterConfig::default()).unwrap();
    assert_eq!(router.len(), 200);
    let path = root().join("models/fixtures/agent_tasks.jsonl");
    let text = std::fs::read_to_string(&path).unwrap();
    let (mut n, mut top1, mut top5) = (0, 0, 0);
    let mut misses = Vec::new();
    for line in text.lines() {
        let task: serde_json::Value = serde_json::from_str(line).unwrap();
        let Some(expected) = task["expected"].as_array().and_then(|a| a.first()) else {
            continue;
        };
        let want = expected["name"].as_str().unwrap();
        let user = task["user"].as_str().unwrap();
        let routing = router.route(e, user, 5).unwrap();
        let names = routing.names();
        n += 1;
        top1 += usize::from(names[0] == want);
        if names.contains(&want) {
            top5 += 1;
        } else {
            misses.push(format!("{user:?} → {names:?}, want {want}"));
        }
    }
    assert!(n >= 30, "only {n} tasks with an expected call");
    let (r1, r5) = (top1 as f64 / n as f64, top5 as f64 / n as f64);
    println!("{n} tasks: recall@1 {r1:.3}, recall@5 {r5:.3}");
    assert!(
        r5 >= 0.9,
        "recall@5 {r5:.3} < 0.9; misses:\n{}",
        misses.join("\n")
    );
    assert!(r1 >= 0.6, "recall@1 {r1:.3} < 0.6");
}
