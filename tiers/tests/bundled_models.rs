//! The bundled tier GGUFs reproduce the PyTorch model's greedy output.
//!
//! `models/fixtures/greedy-<tier>.json` holds, for 100 held-out prompts, the
//! prompt token ids and the greedy continuation computed by the training
//! script (fp32 PyTorch). llama.cpp must produce the same tokens on at least
//! 99 of them, and its tokenizer must give the same prompt ids.

use std::num::NonZeroU32;
use std::path::PathBuf;
use std::sync::OnceLock;

use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;
use serde::Deserialize;

fn backend() -> &'static LlamaBackend {
    static B: OnceLock<LlamaBackend> = OnceLock::new();
    B.get_or_init(|| {
        let mut b = LlamaBackend::init().expect("llama backend");
        b.void_logs();
        b
    })
}

fn models_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../models"))
}

#[derive(Deserialize)]
struct Case {
    kind: String,
    prompt_ids: Vec<i32>,
    fp32: Vec<i32>,
    q8: Vec<i32>,
}

#[derive(Deserialize)]
struct Fixture {
    max_new: usize,
    cases: Vec<Case>,
}

fn check_tier(tier: &str) {
    let dir = models_dir();
    let gguf = dir.join(format!("{tier}-q8_0.gguf"));
    let fixture = dir.join(format!("fixtures/greedy-{tier}.json"));
    let fx: Fixture = serde_json::from_slice(
        &std::fs::read(&fixture).unwrap_or_else(|e| panic!("{}: {e}", fixture.display())),
    )
    .expect("fixture json");
    let model = LlamaModel::load_from_file(backend(), &gguf, &LlamaModelParams::default())
        .unwrap_or_else(|e| panic!("{}: {e}", gguf.display()));
    let params = LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(2048))
        .with_n_batch(2048)
        .with_n_ubatch(512)
        .with_n_threads(2)
        .with_n_threads_batch(2);
    let mut ctx = model.new_context(backend(), params).expect("context");
    let vocab = model.vocab();
    let (mut same, mut same_q8, mut tok_same) = (0usize, 0usize, 0usize);
    let mut batch = LlamaBatch::new(2048, 1);
    for (i, case) in fx.cases.iter().enumerate() {
        // The llama.cpp tokenizer must agree with SentencePiece on the prompt.
        let text = vocab.detokenize(
            &case.prompt_ids[1..]
                .iter()
                .map(|&t| LlamaToken(t))
                .collect::<Vec<_>>(),
            false,
            true,
        );
        let ids: Vec<i32> = vocab
            .tokenize(&text, true, true)
            .iter()
            .map(|t| t.0)
            .collect();
        tok_same += usize::from(ids == case.prompt_ids);

        ctx.clear_kv_cache();
        batch.clear();
        let n = case.prompt_ids.len();
        for (p, &t) in case.prompt_ids.iter().enumerate() {
            batch
                .add(LlamaToken(t), p as i32, &[0], p + 1 == n)
                .unwrap();
        }
        ctx.decode(&mut batch).expect("prefill");
        let mut out = Vec::new();
        let mut pos = n as i32;
        let mut last = batch.n_tokens() - 1;
        for _ in 0..fx.max_new {
            let logits = ctx.get_logits_ith(last);
            let t = argmax(logits);
            out.push(t);
            if vocab.is_eog(LlamaToken(t)) {
                break;
            }
            batch.clear();
            batch.add(LlamaToken(t), pos, &[0], true).unwrap();
            ctx.decode(&mut batch).expect("decode");
            pos += 1;
            last = 0;
        }
        if out == case.fp32 {
            same += 1;
        } else {
            eprintln!(
                "{tier} case {i} ({}) differs: llama {out:?} vs torch {:?}",
                case.kind, case.fp32
            );
        }
        same_q8 += usize::from(out == case.q8);
    }
    let total = fx.cases.len();
    eprintln!(
        "{tier}: greedy equal to PyTorch fp32 on {same}/{total}, to q8-rounded PyTorch on {same_q8}/{total}, tokenizer equal on {tok_same}/{total}"
    );
    assert_eq!(total, 100);
    assert_eq!(
        tok_same, total,
        "llama.cpp tokenizer disagrees with SentencePiece"
    );
    assert!(
        same >= 99,
        "{tier}: only {same}/{total} greedy continuations match PyTorch"
    );
}

fn argmax(v: &[f32]) -> i32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as i32
}

#[test]
fn bundled_tiers_match_pytorch_greedy() {
    for tier in std::env::var("MESH_TIERS")
        .unwrap_or("t1,t2,t3".into())
        .split(",")
    {
        check_tier(tier.trim());
    }
}
