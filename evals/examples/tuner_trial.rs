//! One tuner trial on a real tier: the same probe tasks run under the current policy
//! (window A) and under a proposed one-step change (window B), the gate judges the
//! samples, and the decision is recorded in a policy state file.
//!
//! The probe is the bundled held-out set (greedy, so a task's answer changes only when
//! the policy does); A and B alternate task by task so that machine load drifts hit both
//! windows alike. The trial drives the engine directly, so only knobs the engine reads
//! per request can be tried here: `reasoning.default_budget`.
//!
//! ```text
//! cargo run --release -p mesh-evals --example tuner_trial -- \
//!     --state /tmp/policy.json --init reasoning.default_budget=64 \
//!     --knob reasoning.default_budget --to 32 --objective latency_ms
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;

use clap::Parser;
use mesh_control::gate::{Better, Metric};
use mesh_control::policy::{Policy, PolicyState};
use mesh_control::tuner;
use mesh_evals::trial;
use mesh_tiers::eval::{self, Task};
use mesh_tiers::{Engine, EngineConfig};

#[derive(Parser, Debug)]
struct Args {
    /// Tier model.
    #[arg(long, default_value = "models/t1-q8_0.gguf")]
    model: PathBuf,
    /// Probe tasks (JSON lines, `tiers::eval` format).
    #[arg(long, default_value = "models/fixtures/eval-heldout.jsonl")]
    tasks: PathBuf,
    /// Task kinds in the probe (comma-separated).
    #[arg(long, default_value = "hard,call", value_delimiter = ',')]
    kinds: Vec<String>,
    /// Probe tasks per window.
    #[arg(long, default_value_t = 40)]
    n: usize,
    /// Completion budget per task.
    #[arg(long, default_value_t = 160)]
    max_tokens: usize,
    /// Policy state file (created with the default policy, then `--init`, if missing).
    #[arg(long)]
    state: PathBuf,
    /// `KNOB=VALUE` applied to a new state file before version 0 is written.
    #[arg(long)]
    init: Vec<String>,
    /// Knob to try.
    #[arg(long, default_value = "reasoning.default_budget")]
    knob: String,
    /// Value to try (one step from the current one).
    #[arg(long)]
    to: f64,
    /// Metric the change must improve: `latency_ms` or `accuracy`.
    #[arg(long, default_value = "latency_ms")]
    objective: String,
    /// llama.cpp threads.
    #[arg(long, default_value_t = 1)]
    threads: i32,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    anyhow::ensure!(
        a.knob == "reasoning.default_budget",
        "this trial drives the engine directly; only reasoning.default_budget is read there \
         (cascade and router knobs need the gateway)"
    );
    let mut state = match PolicyState::load(&a.state)? {
        Some(s) => s,
        None => {
            let mut p = Policy::default();
            for kv in &a.init {
                let (k, v) = kv
                    .split_once('=')
                    .ok_or_else(|| anyhow::anyhow!("--init expects KNOB=VALUE, got `{kv}`"))?;
                p.set(k, v.parse()?)?;
            }
            let s = PolicyState::new(p);
            s.save(&a.state)?;
            s
        }
    };
    let objective = match a.objective.as_str() {
        "latency_ms" => Metric::continuous("latency_ms", Better::Lower, 0.10),
        "accuracy" => Metric::rate("accuracy", Better::Higher, 0.05),
        o => anyhow::bail!("unknown objective `{o}`"),
    };
    let proposal = tuner::manual(&state.policy, &a.knob, a.to, objective)?;
    let trial = proposal.apply_to(&state.policy)?;
    let tasks: Vec<Task> = eval::load_tasks(&a.tasks)
        .map_err(anyhow::Error::msg)?
        .into_iter()
        .filter(|t| a.kinds.contains(&t.kind))
        .take(a.n)
        .collect();
    anyhow::ensure!(!tasks.is_empty(), "no probe tasks of kinds {:?}", a.kinds);
    let engine = Engine::start(EngineConfig {
        name: "probe".into(),
        model: a.model.clone(),
        n_ctx: 4096,
        n_seq_max: 1,
        threads: a.threads,
        ..EngineConfig::default()
    })?;
    let budgets = [
        state.policy.reasoning.budget(None, None),
        trial.reasoning.budget(None, None),
    ];
    let windows = trial::probe_windows(&engine, &tasks, budgets, a.max_tokens);
    let gate = tuner::TunerConfig::default().gate;
    let d = tuner::judge(&proposal, &windows[0], &windows[1], &gate);
    let summary: BTreeMap<&str, serde_json::Value> = BTreeMap::from([
        ("knob", a.knob.clone().into()),
        ("before", proposal.before.into()),
        ("after", proposal.after.into()),
        ("verdict", serde_json::to_value(d.verdict)?),
        ("reason", d.reason.clone().into()),
    ]);
    state.record(d.clone(), Some(&a.state))?;
    println!("{}", serde_json::to_string(&summary)?);
    println!("{}", serde_json::to_string_pretty(&d)?);
    Ok(())
}
