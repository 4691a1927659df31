//! An agent built on the Rust client SDK (`mesh` with only its `client` feature).
//!
//! ```text
//! cargo run --release -p mesh --no-default-features --features client --example sdk_agent -- \
//!     --gateways http://127.0.0.1:8080,http://127.0.0.1:8081 [--model t1] [--tasks 4]
//! ```
//!
//! Takes tasks from the bundled held-out agent tasks, lets the model call tools
//! (executed here by a stand-in that returns deterministic values), and prints
//! each answer. Gateways are tried in order; if one dies, the next takes over.

use mesh::client::{Client, Message, ToolCall};
use serde_json::{json, Value};

fn stand_in_tool(call: &ToolCall) -> String {
    // Deterministic value from the call, so runs can be compared.
    let h = call
        .function
        .arguments
        .bytes()
        .chain(call.function.name.bytes())
        .fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)));
    json!({"status": "ok", "value": h % 1000}).to_string()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut gateways = vec!["http://127.0.0.1:8080".to_owned()];
    let mut model = "t1".to_owned();
    let mut n_tasks = 4usize;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--gateways" => gateways = val()?.split(',').map(str::to_owned).collect(),
            "--model" => model = val()?,
            "--tasks" => n_tasks = val()?.parse()?,
            other => return Err(format!("unknown flag {other} (see the file header)").into()),
        }
    }
    let client = Client::new(gateways)?;
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../models/fixtures/agent_tasks.jsonl"
    );
    let tasks: Vec<Value> = std::fs::read_to_string(path)?
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .filter(|t: &Value| t["kind"] == "call")
        .take(n_tasks)
        .collect();
    for task in tasks {
        let tools: Vec<Value> = task["tools"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| json!({"type": "function", "function": t}))
            .collect();
        let user = task["user"].as_str().unwrap_or_default();
        let mut calls = vec![];
        let (answer, convo) = client
            .run_agent(&model, vec![Message::user(user)], tools, 4, |call| {
                calls.push(format!(
                    "{}({})",
                    call.function.name, call.function.arguments
                ));
                stand_in_tool(call)
            })
            .await?;
        println!("task: {user}");
        for c in &calls {
            println!("  call: {c}");
        }
        println!("  answer ({} messages): {answer}\n", convo.len());
    }
    Ok(())
}
