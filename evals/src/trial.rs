//! A/B windows over a fixed probe workload on a real engine: each probe task runs once
//! under each of two reasoning budgets, alternating which goes first so that warm-up and
//! load drift hit both windows alike. Greedy decoding makes a task's answer change only
//! when the budget does. Blocks the caller (call it from `spawn_blocking` in async code).

use std::time::Instant;

use mesh_tiers::eval::{self, Task};
use mesh_tiers::{Engine, GenerateRequest, TokenEvent};

use mesh_control::gate::Samples;

/// One probe request.
struct Outcome {
    ms: f64,
    exact: bool,
    failed: bool,
}

fn run(engine: &Engine, task: &Task, budget: Option<usize>, max_tokens: usize) -> Outcome {
    let t0 = Instant::now();
    let rx = engine.submit(GenerateRequest {
        prompt: engine.tokenize(&task.prompt),
        max_tokens,
        reasoning_budget: budget,
        ..Default::default()
    });
    let Ok(mut rx) = rx else {
        return Outcome {
            ms: t0.elapsed().as_secs_f64() * 1e3,
            exact: false,
            failed: true,
        };
    };
    let mut text = String::new();
    loop {
        match rx.blocking_recv() {
            Some(TokenEvent::Token { text: t, .. }) => text.push_str(&t),
            Some(TokenEvent::Started { .. }) => {}
            Some(TokenEvent::Done { tail, .. }) => {
                text.push_str(&tail);
                return Outcome {
                    ms: t0.elapsed().as_secs_f64() * 1e3,
                    exact: eval::exact(task, &text),
                    failed: false,
                };
            }
            Some(TokenEvent::Error(_)) | None => {
                return Outcome {
                    ms: t0.elapsed().as_secs_f64() * 1e3,
                    exact: false,
                    failed: true,
                }
            }
        }
    }
}

/// Samples (`latency_ms`, `accuracy`, `error`) of window A (`budgets[0]`) and window B
/// (`budgets[1]`) over `tasks`.
pub fn probe_windows(
    engine: &Engine,
    tasks: &[Task],
    budgets: [Option<usize>; 2],
    max_tokens: usize,
) -> [Samples; 2] {
    let mut windows = [Samples::new(), Samples::new()];
    for (i, task) in tasks.iter().enumerate() {
        let order = if i % 2 == 0 { [0, 1] } else { [1, 0] };
        for w in order {
            let o = run(engine, task, budgets[w], max_tokens);
            let s = &mut windows[w];
            s.entry("latency_ms".into()).or_default().push(o.ms);
            s.entry("accuracy".into())
                .or_default()
                .push(f64::from(u8::from(o.exact)));
            s.entry("error".into())
                .or_default()
                .push(f64::from(u8::from(o.failed)));
        }
    }
    windows
}
