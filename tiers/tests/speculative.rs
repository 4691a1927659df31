//! Speculative decoding (t1 drafts for t3) gives exactly t3's greedy tokens on
//! held-out prompts, one sequence at a time and several in one batch, and the
//! draft is actually used (some drafted tokens are accepted).

use std::path::PathBuf;

use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use mesh_tiers::backend;
use mesh_tiers::speculative::{greedy, SpecConfig, Speculative};
use serde::Deserialize;

fn models_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../models"))
}

fn load(tier: &str) -> LlamaModel {
    let path = models_dir().join(format!("{tier}-q8_0.gguf"));
    LlamaModel::load_from_file(backend(), &path, &LlamaModelParams::default())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[derive(Deserialize)]
struct Case {
    prompt_ids: Vec<i32>,
}

#[derive(Deserialize)]
struct Fixture {
    cases: Vec<Case>,
}

/// Held-out prompts (the greedy-reference fixture's), `n` of them spread over the kinds.
fn prompts(n: usize) -> Vec<Vec<i32>> {
    let path = models_dir().join("fixtures/greedy-t3.json");
    let fx: Fixture = serde_json::from_slice(&std::fs::read(&path).expect("fixture")).unwrap();
    let step = fx.cases.len() / n;
    fx.cases
        .into_iter()
        .step_by(step.max(1))
        .take(n)
        .map(|c| c.prompt_ids)
        .collect()
}

const MAX_TOKENS: usize = 64;

#[test]
fn draft_and_verify_reproduces_the_target() {
    let target = load("t3");
    let draft = load("t1");
    let prompts = prompts(12);
    let reference: Vec<Vec<i32>> = prompts
        .iter()
        .map(|p| greedy(&target, p, MAX_TOKENS, 2).expect("greedy"))
        .collect();

    let cfg = SpecConfig {
        n_seq_max: 4,
        ..Default::default()
    };
    let mut spec = Speculative::new(&target, &draft, cfg).expect("contexts");
    let (mut drafted, mut accepted) = (0, 0);
    // One at a time.
    for (p, want) in prompts.iter().zip(&reference).take(6) {
        let out = spec.generate(std::slice::from_ref(p), MAX_TOKENS).unwrap();
        assert_eq!(
            &out[0].tokens, want,
            "single sequence differs from t3 alone"
        );
        drafted += out[0].drafted;
        accepted += out[0].accepted;
    }
    // Four sequences per batch, different lengths finishing at different rounds.
    for (ps, wants) in prompts[6..].chunks(4).zip(reference[6..].chunks(4)) {
        let outs = spec.generate(ps, MAX_TOKENS).unwrap();
        for (out, want) in outs.iter().zip(wants) {
            assert_eq!(&out.tokens, want, "batched sequence differs from t3 alone");
            drafted += out.drafted;
            accepted += out.accepted;
        }
    }
    assert!(drafted > 0);
    assert!(
        accepted * 2 > drafted,
        "t1 drafts should mostly be accepted on held-out prompts: {accepted}/{drafted}"
    );
}

#[test]
fn mismatched_limits_are_refused() {
    let target = load("t2");
    let draft = load("t1");
    let bad = SpecConfig {
        k_min: 3,
        k_init: 2,
        ..Default::default()
    };
    assert!(Speculative::new(&target, &draft, bad).is_err());
    let mut spec = Speculative::new(&target, &draft, SpecConfig::default()).unwrap();
    let long = vec![1; 4000];
    assert!(spec.generate(&[long], 8).is_err());
    let nine: Vec<Vec<i32>> = (0..9).map(|_| vec![1, 2, 3]).collect();
    assert!(spec.generate(&nine, 8).is_err());
}
