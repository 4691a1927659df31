//! Chat templates rendered by mesh (minijinja) against the reference: the same templates
//! and conversations rendered by Python's `jinja2` the way Hugging Face's `transformers`
//! renders them (`scripts/render-templates.py`). The templates are public models' own
//! (`tiers/tests/templates/`, from llama.cpp's `models/templates/`); the conversations
//! (`cases.json`) have system prompts, tools, tool calls and results, parallel calls,
//! multi-turn chats and marker-like user text.
//!
//! Needs Python with `jinja2`: `MESH_PYTHON` (set by `./dev.sh test` to the project's
//! venv), else `python3`.

use std::path::{Path, PathBuf};
use std::process::Command;

use mesh_tiers::chat::{ChatMessage, Role, ToolCall, ToolSpec};
use mesh_tiers::format::{
    template_messages, template_tools, CallsContent, ChatFormat, ChatInput, SpecialTokens,
};
use serde_json::{json, Value};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/templates")
}

/// A case's OpenAI-shaped messages as mesh's messages (what the gateway makes of them).
fn messages(v: &Value) -> Vec<ChatMessage> {
    v.as_array()
        .expect("messages is a list")
        .iter()
        .map(|m| ChatMessage {
            role: match m["role"].as_str().unwrap() {
                "system" => Role::System,
                "user" => Role::User,
                "assistant" => Role::Assistant,
                "tool" => Role::Tool,
                r => panic!("role {r}"),
            },
            content: m["content"].as_str().unwrap_or_default().to_owned(),
            tool_calls: m["tool_calls"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|c| ToolCall {
                    name: c["function"]["name"].as_str().unwrap().to_owned(),
                    arguments: match &c["function"]["arguments"] {
                        Value::String(s) => serde_json::from_str(s).unwrap(),
                        a => a.clone(),
                    },
                    id: c["id"].as_str().map(str::to_owned),
                })
                .collect(),
            reasoning: m["reasoning_content"].as_str().map(str::to_owned),
            tool_call_id: m["tool_call_id"].as_str().map(str::to_owned),
            name: m["name"].as_str().map(str::to_owned),
        })
        .collect()
}

fn tools(v: &Value) -> Vec<ToolSpec> {
    v.as_array()
        .into_iter()
        .flatten()
        .map(|t| ToolSpec {
            name: t["function"]["name"].as_str().unwrap().to_owned(),
            description: t["function"]["description"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            parameters: t["function"]["parameters"].clone(),
        })
        .collect()
}

#[test]
fn every_template_renders_every_conversation_as_jinja2_does() {
    let cases: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(dir().join("cases.json")).unwrap()).unwrap();
    let mut templates: Vec<PathBuf> = std::fs::read_dir(dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "jinja"))
        .collect();
    templates.sort();
    assert!(templates.len() >= 10, "{templates:?}");
    let (bos, eos) = ("<s>", "</s>");

    // One list for Python: each template with each case, given exactly the messages and
    // tools mesh hands its own renderer.
    let mut jobs = vec![];
    let mut reference = vec![];
    for t in &templates {
        for c in &cases {
            let input = ChatInput {
                messages: messages(&c["messages"]),
                tools: tools(&c["tools"]),
                kwargs: {
                    let mut k = c["extra"].as_object().cloned().unwrap_or_default();
                    k.insert(
                        "add_generation_prompt".into(),
                        c["add_generation_prompt"].clone(),
                    );
                    k
                },
            };
            let tools_json = template_tools(&input.tools);
            reference.push(json!({
                "template": t,
                "messages": template_messages(&input.messages),
                "tools": if input.tools.is_empty() { Value::Null } else { tools_json },
                "add_generation_prompt": c["add_generation_prompt"],
                "bos_token": bos,
                "eos_token": eos,
                "extra": c["extra"],
            }));
            jobs.push((t.clone(), c["name"].as_str().unwrap().to_owned(), input));
        }
    }
    let list =
        std::env::temp_dir().join(format!("mesh-template-cases-{}.json", std::process::id()));
    std::fs::write(&list, serde_json::to_vec(&reference).unwrap()).unwrap();
    let python = std::env::var("MESH_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/render-templates.py");
    let out = Command::new(&python)
        .arg(&script)
        .arg(&list)
        .output()
        .unwrap_or_else(|e| panic!("{python}: {e}"));
    let _ = std::fs::remove_file(&list);
    assert!(
        out.status.success(),
        "{} failed (scripts/setup.sh installs jinja2 into .venv): {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let want: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(want.len(), jobs.len());

    let mut failures = vec![];
    let mut rendered = 0;
    for ((template, case, input), want) in jobs.iter().zip(&want) {
        let source = std::fs::read_to_string(template).unwrap();
        let name = template.file_name().unwrap().to_string_lossy().into_owned();
        let tokens = SpecialTokens {
            bos: bos.into(),
            eos: eos.into(),
            ..SpecialTokens::default()
        };
        let got = ChatFormat::new(&source, &name, tokens)
            .map_err(|e| e.to_string())
            .and_then(|f| f.render_text(input).map_err(|e| e.to_string()));
        match (got, want["ok"].as_bool().unwrap()) {
            (Ok(text), true) => {
                rendered += 1;
                if text != want["text"].as_str().unwrap() {
                    failures.push(format!(
                        "{name} / {case}: differs\n--- jinja2\n{}\n--- mesh\n{text}",
                        want["text"].as_str().unwrap()
                    ));
                }
            }
            (Err(_), false) => {}
            // minijinja iterates `none` as an empty list where Python raises: templates
            // written for tools (Hermes' `tool_use`) still render a chat without tools.
            (Ok(_), false) if want["error"].as_str().unwrap().ends_with("is not iterable") => {}
            (Ok(_), false) => failures.push(format!(
                "{name} / {case}: jinja2 refused ({}), mesh rendered",
                want["error"]
            )),
            (Err(e), true) => failures.push(format!("{name} / {case}: mesh failed: {e}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} renderings differ:\n{}",
        failures.len(),
        jobs.len(),
        failures.join("\n\n")
    );
    // Most pairs render (templates refuse some conversations, in both engines: Llama 3
    // parallel calls, Mistral's call ids of other than nine characters, Gemma's system
    // role).
    assert!(
        rendered * 2 >= jobs.len(),
        "only {rendered} of {} rendered",
        jobs.len()
    );
}

/// What each public template renders itself; the rest mesh writes into the turns it does
/// render (see `Shows`).
#[test]
fn templates_are_probed_for_calls_results_and_system_turns() {
    // (template, calls, the `content` beside calls, arguments as text, results, system)
    let want = [
        (
            "HuggingFaceTB-SmolLM2-135M-Instruct-gguf",
            false,
            CallsContent::Absent,
            false,
            true,
            true,
        ),
        (
            "google-gemma-2-2b-it",
            false,
            CallsContent::Absent,
            false,
            false,
            false,
        ),
        (
            "Qwen-Qwen2.5-7B-Instruct",
            true,
            CallsContent::Absent,
            false,
            true,
            true,
        ),
        (
            "Qwen-Qwen2.5-Coder-0.5B-Instruct-gguf",
            true,
            CallsContent::Absent,
            false,
            true,
            true,
        ),
        (
            "Qwen-Qwen3-0.6B",
            true,
            CallsContent::Empty,
            false,
            true,
            true,
        ),
        (
            "meta-llama-Llama-3.1-8B-Instruct",
            true,
            CallsContent::Absent,
            false,
            true,
            true,
        ),
        (
            "mistralai-Mistral-Nemo-Instruct-2407",
            true,
            CallsContent::Absent,
            false,
            true,
            true,
        ),
        (
            "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
            true,
            CallsContent::Absent,
            false,
            true,
            true,
        ),
        (
            "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
            true,
            CallsContent::Null,
            true,
            true,
            true,
        ),
        (
            "llama-cpp-microsoft-Phi-4-mini-instruct",
            true,
            CallsContent::Absent,
            false,
            true,
            true,
        ),
    ];
    let mut got = vec![];
    for (name, ..) in want {
        let source = std::fs::read_to_string(dir().join(format!("{name}.jinja"))).unwrap();
        let f = ChatFormat::new(&source, name, SpecialTokens::default()).unwrap();
        let s = f.shows();
        got.push((
            name,
            s.calls,
            s.calls_content,
            s.arguments_text,
            s.results,
            s.system,
        ));
    }
    assert_eq!(got, want);
}

/// The serving path's rendering of a case (tools described when the template shows none,
/// and the parts it does not render written into the turns it does).
fn serve(template: &str, case: &str) -> Result<String, String> {
    let cases: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(dir().join("cases.json")).unwrap()).unwrap();
    let c = cases.iter().find(|c| c["name"] == case).expect("case");
    let source = std::fs::read_to_string(dir().join(format!("{template}.jinja"))).unwrap();
    let f = ChatFormat::new(&source, template, SpecialTokens::default()).unwrap();
    let input = ChatInput {
        messages: messages(&c["messages"]),
        tools: tools(&c["tools"]),
        ..Default::default()
    };
    f.render(&input, &mesh_tiers::markers::Markers::new([]))
        .map(|r| r.text())
        .map_err(|e| e.to_string())
}

#[test]
fn a_template_without_calls_is_served_them_as_json_text() {
    let text = serve(
        "HuggingFaceTB-SmolLM2-135M-Instruct-gguf",
        "tool_call_empty_content",
    )
    .expect("rendered");
    assert!(
        text.contains("assistant\n{\"name\": \"get_weather\", \"arguments\": {"),
        "{text}"
    );
}

#[test]
fn a_template_without_tool_or_system_turns_is_served_them_in_user_turns() {
    let text = serve("google-gemma-2-2b-it", "tool_call_roundtrip").expect("rendered");
    assert!(
        text.contains("<start_of_turn>user\n{\"tool_response\": {\"tool\": \"get_weather\""),
        "{text}"
    );
}

#[test]
fn deepseek_r1_is_served_calls_with_text_arguments_and_no_content() {
    let text = serve(
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
        "tool_call_empty_content",
    )
    .expect("rendered");
    assert!(
        text.contains("<｜tool▁sep｜>get_weather\n```json\n{\""),
        "{text}"
    );
}
