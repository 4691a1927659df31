//! What the tuner actor (`mesh_actors::tuner`) needs of the node: probe requests through
//! the node's own request path under a trial's policy, the node's counters as typed
//! totals, and which models can serve probes. Probe requests are real: they use engine
//! slots next to live traffic and show in the token and cascade metrics (not in
//! `mesh_http_requests_total`).

use std::sync::Arc;
use std::time::Instant;

use futures::future::BoxFuture;
use mesh_actors::tuner::{ProbeResult, TunerHost};
use mesh_control::policy::Policy;
use mesh_control::tuner::Counters;
use mesh_tiers::chat::{
    self, ChatMessage, Role, ToolCall, ToolSpec, CALL, END, END_CALL, END_THINK, THINK,
};
use mesh_tiers::eval;

pub use mesh_tiers::eval::Task;

use super::{ChatCall, Completion, Service};

/// A held-out task (a prompt rendered in the bundled chat format) as the chat call that
/// renders to exactly that prompt: system text, tools, and every earlier turn; greedy.
pub fn task_call(task: &Task, model: &str, max_tokens: usize) -> Result<ChatCall, String> {
    let p = task.prompt.as_str();
    let rest = p
        .strip_prefix("<|system|>")
        .ok_or("prompt does not start with <|system|>")?;
    let (head, mut rest) = rest.split_once(END).ok_or("system turn not closed")?;
    let (system, tools) = match head.split_once("\n<tools>\n") {
        Some((sys, block)) => {
            let block = block
                .strip_suffix("\n</tools>")
                .ok_or("tools block not closed")?;
            let tools = block
                .lines()
                .map(|l| {
                    serde_json::from_str::<ToolSpec>(l).map_err(|e| format!("tool schema: {e}"))
                })
                .collect::<Result<Vec<ToolSpec>, String>>()?;
            (sys, tools)
        }
        None => (head, vec![]),
    };
    let mut messages = vec![ChatMessage::text(Role::System, system)];
    loop {
        if rest == "<|assistant|>" {
            break;
        }
        let (role, after) = [
            ("user", Role::User),
            ("assistant", Role::Assistant),
            ("tool", Role::Tool),
            ("system", Role::System),
        ]
        .iter()
        .find_map(|(name, r)| rest.strip_prefix(&format!("<|{name}|>")).map(|a| (*r, a)))
        .ok_or_else(|| format!("unexpected text at `{}`", &rest[..rest.len().min(20)]))?;
        let (content, next) = after
            .split_once(END)
            .ok_or_else(|| format!("{role:?} turn not closed"))?;
        rest = next;
        if role == Role::Assistant {
            let parsed = chat::parse_output(content);
            if parsed.reasoning.is_some() || parsed.malformed_calls > 0 {
                return Err("an earlier assistant turn has reasoning or a malformed call".into());
            }
            messages.push(ChatMessage {
                role,
                content: parsed.content,
                tool_calls: parsed.tool_calls,
                ..ChatMessage::default()
            });
        } else {
            messages.push(ChatMessage::text(role, content));
        }
    }
    Ok(ChatCall {
        model: model.to_owned(),
        messages,
        tools,
        max_tokens: Some(max_tokens),
        ..ChatCall::default()
    })
}

/// The model's text as the held-out scorer reads it, rebuilt from a completion's parts:
/// reasoning in a think block, the content, then each call.
pub fn scored_text(reasoning: Option<&str>, content: &str, calls: &[ToolCall]) -> String {
    let mut text = String::new();
    if let Some(r) = reasoning {
        text.push_str(&format!("{THINK}{r}{END_THINK}"));
    }
    text.push_str(content);
    for c in calls {
        let call = serde_json::json!({"name": c.name, "arguments": c.arguments});
        text.push_str(&format!("{CALL}{}{END_CALL}", chat::py_json(&call)));
    }
    text
}

fn completion_text(c: &Completion) -> String {
    let o = &c.output;
    // A reply that only calls tools has no content (the client sees `null`).
    let content = if o.content.is_empty() { "" } else { &o.content };
    scored_text(o.reasoning.as_deref(), content, &o.tool_calls)
}

/// The node as the tuner sees it.
#[derive(Debug, Clone)]
pub struct Host {
    service: Service,
}

impl Host {
    /// Over the node's service layer.
    pub fn new(service: Service) -> Self {
        Self { service }
    }
}

impl TunerHost for Host {
    fn probe(
        &self,
        task: Task,
        model: String,
        max_tokens: usize,
        policy: Arc<Policy>,
    ) -> BoxFuture<'static, ProbeResult> {
        let service = self.service.clone();
        Box::pin(async move {
            let t0 = Instant::now();
            let call = match task_call(&task, &model, max_tokens) {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "probe task skipped: its prompt is not in the chat format");
                    return ProbeResult {
                        ms: 0.0,
                        exact: false,
                        failed: true,
                    };
                }
            };
            let out = match service.chat_with(call, policy).await {
                Ok(reply) => reply.collect().await.ok(),
                Err(_) => None,
            };
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            match out {
                Some(c) => ProbeResult {
                    ms,
                    exact: eval::exact(&task, &completion_text(&c)),
                    failed: false,
                },
                None => ProbeResult {
                    ms,
                    exact: false,
                    failed: true,
                },
            }
        })
    }

    fn totals(&self, first_tier: &str) -> Counters {
        self.service
            .metrics()
            .totals(first_tier, self.service.engines())
    }

    fn check_model(&self, model: &str) -> Result<(), String> {
        self.service.find_model(model).map_err(|e| e.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn tasks() -> Vec<Task> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        eval::load_tasks(&root.join("models/fixtures/eval-heldout.jsonl")).unwrap()
    }

    #[test]
    fn every_heldout_task_renders_back_to_its_prompt() {
        let tasks = tasks();
        assert_eq!(tasks.len(), 200);
        for t in &tasks {
            let call = task_call(t, "t1", 64).unwrap();
            let p = super::super::chat::prepare(&call, None).unwrap_or_else(|e| panic!("{e}"));
            let text = chat::mesh_tiers_format().render_text(&p.input).unwrap();
            assert_eq!(text, t.prompt, "{} task", t.kind);
        }
    }

    #[test]
    fn a_prompt_not_in_the_chat_format_is_refused() {
        let t = Task {
            prompt: "<|user|>hi<|end|>".into(),
            ..tasks()[0].clone()
        };
        assert!(task_call(&t, "t1", 8).is_err());
    }

    #[test]
    fn completions_score_like_raw_text() {
        let t = Task {
            kind: "hard".into(),
            sub: "plan".into(),
            split: "s".into(),
            prompt: String::new(),
            completion: r#"<think>two</think><tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call><|end|>"#.into(),
        };
        let calls = vec![
            ToolCall::new("a", serde_json::json!({"x": 1})),
            ToolCall::new("b", serde_json::json!({})),
        ];
        assert!(eval::exact(&t, &scored_text(Some("two"), "", &calls)));
        let wrong = vec![ToolCall::new("a", serde_json::json!({"x": 2}))];
        assert!(!eval::exact(&t, &scored_text(None, "", &wrong)));
        let answer = Task {
            completion: "No tool fits.<|end|>".into(),
            ..t
        };
        assert!(eval::exact(
            &answer,
            &scored_text(Some("none"), "No tool fits.", &[])
        ));
    }
}
