//! A deliberately bad knob setting tried live on the bundled t1: the gate reverts it and
//! the policy file stays byte for byte as it was.

use mesh_control::gate::{Better, Metric, Verdict};
use mesh_control::policy::{journal_path, Policy, PolicyState};
use mesh_control::tuner;
use mesh_evals::trial;
use mesh_tiers::eval;
use mesh_tiers::{Engine, EngineConfig};

fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn no_thinking_budget_is_reverted_and_the_policy_file_is_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policy.json");
    let mut p = Policy::default();
    p.set("reasoning.default_budget", 32.0).unwrap();
    let mut state = PolicyState::new(p);
    state.save(&path).unwrap();
    let saved = std::fs::read(&path).unwrap();

    // Cutting the thinking budget to 0 makes answers faster, and wrong.
    let prop = tuner::manual(
        &state.policy,
        "reasoning.default_budget",
        0.0,
        Metric::continuous("latency_ms", Better::Lower, 0.10),
    )
    .unwrap();
    let tasks: Vec<_> = eval::load_tasks(&root().join("models/fixtures/eval-heldout.jsonl"))
        .unwrap()
        .into_iter()
        .filter(|t| t.kind == "hard")
        .take(30)
        .collect();
    let engine = Engine::start(EngineConfig {
        name: "t1".into(),
        model: root().join("models/t1-q8_0.gguf"),
        n_ctx: 2048,
        n_seq_max: 1,
        ..EngineConfig::default()
    })
    .unwrap();
    let trial_policy = prop.apply_to(&state.policy).unwrap();
    let budgets = [
        state.policy.reasoning.budget(None, None),
        trial_policy.reasoning.budget(None, None),
    ];
    assert_eq!(budgets, [Some(32), Some(0)]);
    let [a, b] = trial::probe_windows(&engine, &tasks, budgets, 160);
    let d = tuner::judge(&prop, &a, &b, &tuner::TunerConfig::default().gate);
    assert_eq!(d.verdict, Verdict::Revert, "{d:#?}");
    assert!(d.reason.starts_with("accuracy got worse"), "{}", d.reason);
    state.record(d, Some(&path)).unwrap();

    assert_eq!(
        std::fs::read(&path).unwrap(),
        saved,
        "policy file unchanged"
    );
    assert_eq!(state.version, 0);
    assert_eq!(state.policy.reasoning.default_budget, Some(32));
    let journal = std::fs::read_to_string(journal_path(&path)).unwrap();
    assert!(journal.contains("\"verdict\":\"revert\""), "{journal}");
}
