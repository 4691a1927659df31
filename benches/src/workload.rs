//! Prompts and the streaming client.
//!
//! Prompts follow the bundled models' chat format with a few tool schemas from the catalog.
//! Prompt `k` starts its tool list with catalog entry `k`, so two prompts share at most the
//! system line (about 25 tokens) and no prompt cache hit hides a prefill. Both targets get the
//! same strings; the driver checks afterwards that they counted the same prompt tokens.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use indicatif::ProgressBar;
use serde::Serialize;
use serde_json::{json, Value};

use crate::machine::ForeignCpu;

/// The system line the bundled models were trained with.
const SYSTEM: &str =
    "You are a helpful agent. Call a tool when one fits the request, otherwise answer directly.";
const CITIES: &[&str] = &[
    "Lisbon", "Osaka", "Nairobi", "Toronto", "Oslo", "Lima", "Hanoi", "Perth", "Dublin", "Quito",
    "Seville", "Tbilisi", "Halifax", "Accra", "Kraków",
];

/// splitmix64's output mixing of `z`: the workloads' deterministic pseudo-random numbers
/// (jitter, synthetic token ids) without a random-number dependency. Pure.
pub(crate) fn splitmix64_mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Tool schemas from `catalog.jsonl`, in file order, as `{name, description, parameters}`.
pub(crate) fn load_catalog(path: &Path) -> Result<Vec<Value>> {
    let tools: Vec<Value> = jsonl(path)?
        .into_iter()
        .map(|(_, v)| {
            json!({
                "name": v["name"], "description": v["description"], "parameters": v["parameters"],
            })
        })
        .collect();
    if tools.is_empty() {
        bail!("{} holds no tools", path.display());
    }
    Ok(tools)
}

/// Raw prompts from a JSONL file, `{"prompt": "..."}` per line (blank lines skipped).
pub(crate) fn load_prompts(path: &Path) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for (line, v) in jsonl(path)? {
        let Some(p) = v["prompt"].as_str() else {
            bail!("{}:{line}: no \"prompt\" string", path.display());
        };
        out.push(p.to_owned());
    }
    if out.is_empty() {
        bail!("{} holds no prompts", path.display());
    }
    Ok(out)
}

/// The JSON values of a JSONL file with their line numbers (blank lines skipped).
fn jsonl(path: &Path) -> Result<Vec<(usize, Value)>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, line)| {
            serde_json::from_str(line)
                .map(|v| (i + 1, v))
                .with_context(|| format!("{}:{}: not JSON", path.display(), i + 1))
        })
        .collect()
}

/// Prompt number `k`: system line, `n_tools` schemas starting at catalog entry `k`, and a
/// user request for the first of them.
pub(crate) fn prompt(catalog: &[Value], k: usize, n_tools: usize) -> String {
    let tools = tools_for(catalog, k, n_tools);
    let mut out = system_turn(&tools);
    out.push_str(&user_turn(&user_request(tools[0], k)));
    out.push_str(ASSISTANT);
    out
}

/// Opens the assistant's turn; the model writes from here.
pub(crate) const ASSISTANT: &str = "<|assistant|>";
/// Ends every turn (the bundled models' end-of-generation token).
pub(crate) const END: &str = "<|end|>";

/// `n_tools` (at least one) catalog entries for prompt `k`, starting at entry `k`.
pub(crate) fn tools_for(catalog: &[Value], k: usize, n_tools: usize) -> Vec<&Value> {
    let n = catalog.len();
    // Past one lap of the catalog the stride changes, so the tool lists still differ early.
    let stride = 37 + 2 * (k / n);
    (0..n_tools.max(1))
        .map(|j| &catalog[(k + j * stride) % n])
        .collect()
}

/// The system turn: the trained system line and the tool schemas.
pub(crate) fn system_turn(tools: &[&Value]) -> String {
    let mut out = format!("<|system|>{SYSTEM}\n<tools>\n");
    for (j, t) in tools.iter().enumerate() {
        if j > 0 {
            out.push('\n');
        }
        out.push_str(&py_json(t));
    }
    out.push_str("\n</tools>");
    out.push_str(END);
    out
}

/// A user turn.
pub(crate) fn user_turn(text: &str) -> String {
    format!("<|user|>{text}{END}")
}

/// A request that fits `tool`, with argument values that vary with `k`.
pub(crate) fn user_request(tool: &Value, k: usize) -> String {
    let desc = tool["description"]
        .as_str()
        .unwrap_or("help me")
        .trim_end_matches('.');
    let mut chars = desc.chars();
    let desc = match chars.next() {
        Some(c) => c.to_lowercase().chain(chars).collect::<String>(),
        None => String::new(),
    };
    let mut args = Vec::new();
    if let Some(props) = tool["parameters"]["properties"].as_object() {
        for (name, schema) in props {
            let value = match (name.as_str(), schema["type"].as_str()) {
                ("city", _) => CITIES[k % CITIES.len()].to_owned(),
                ("date", _) => format!("2025-{:02}-{:02}", k % 12 + 1, k % 28 + 1),
                (_, Some("integer" | "number")) => (k % 97 + 2).to_string(),
                (_, Some("boolean")) => (k & 1 == 0).to_string(),
                _ => format!("{name} {}", k % 50 + 1),
            };
            args.push(format!("{name} {value}"));
        }
    }
    if args.is_empty() {
        format!("Please {desc}.")
    } else {
        format!("Please {desc}: {}.", args.join(", "))
    }
}

/// Compact JSON as Python's `json.dumps(v, separators=(", ", ": "))` writes it (ASCII only),
/// the form the bundled models saw tool schemas in.
fn py_json(v: &Value) -> String {
    match v {
        Value::String(s) => {
            let mut out = String::from("\"");
            for ch in s.chars() {
                match ch {
                    '"' => out.push_str("\\\""),
                    '\\' => out.push_str("\\\\"),
                    '\n' => out.push_str("\\n"),
                    '\r' => out.push_str("\\r"),
                    '\t' => out.push_str("\\t"),
                    c if (c as u32) < 0x20 || !c.is_ascii() => {
                        let mut units = [0u16; 2];
                        for u in c.encode_utf16(&mut units) {
                            out.push_str(&format!("\\u{u:04x}"));
                        }
                    }
                    c => out.push(c),
                }
            }
            out.push('"');
            out
        }
        Value::Array(a) => {
            let items: Vec<String> = a.iter().map(py_json).collect();
            format!("[{}]", items.join(", "))
        }
        Value::Object(o) => {
            let items: Vec<String> = o
                .iter()
                .map(|(k, v)| format!("{}: {}", py_json(&Value::from(k.as_str())), py_json(v)))
                .collect();
            format!("{{{}}}", items.join(", "))
        }
        other => other.to_string(),
    }
}

/// What one streamed request measured.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Sample {
    /// Index of the prompt (the same index means the same prompt string on both targets).
    pub(crate) prompt: usize,
    /// Stream that sent it (0-based).
    pub(crate) stream: usize,
    /// Request sent to first non-empty text chunk.
    pub(crate) ttft_s: f64,
    /// Request sent to end of stream.
    pub(crate) e2e_s: f64,
    /// Generated tokens: from the usage chunk when the server sent one, else text chunks.
    pub(crate) completion_tokens: usize,
    pub(crate) tokens_from_usage: bool,
    /// Prompt tokens the server reported.
    pub(crate) prompt_tokens: Option<usize>,
    /// Non-empty text chunks received.
    pub(crate) chunks: usize,
    /// (tokens - 1) / (last chunk - first chunk).
    pub(crate) decode_tok_s: Option<f64>,
    /// Gaps between consecutive non-empty chunks.
    #[serde(skip)]
    pub(crate) itl_s: Vec<f64>,
    /// Generated text, to compare the two targets' greedy outputs.
    #[serde(skip)]
    pub(crate) text: String,
}

/// Request parameters shared by every request of a run.
pub(crate) struct RequestSpec<'a> {
    pub(crate) model: &'a str,
    pub(crate) max_tokens: usize,
}

/// Raw timings of one streamed response.
pub(crate) struct Streamed {
    /// Request sent to end of stream.
    pub(crate) e2e_s: f64,
    /// Arrival of each non-empty text chunk, seconds after the request was sent.
    pub(crate) times: Vec<f64>,
    pub(crate) text: String,
    /// `usage.completion_tokens`, when the server sent usage.
    pub(crate) completion: Option<usize>,
    /// `usage.prompt_tokens`, when the server sent usage.
    pub(crate) prompt_tokens: Option<usize>,
}

/// Sends one streaming `/v1/completions` request and times its chunks. Cancel-safe (the
/// request is dropped).
pub(crate) async fn one_request(
    client: &reqwest::Client,
    base_url: &str,
    spec: &RequestSpec<'_>,
    prompt: &str,
) -> Result<Streamed> {
    stream_completion(client, base_url, spec, json!(prompt), None).await
}

/// A reply with a status other than 2xx; the error [`stream_completion`] returns for it, so a
/// caller can tell load shedding (429, 503) from other failures.
#[derive(Debug)]
pub(crate) struct HttpStatus {
    pub(crate) status: u16,
    pub(crate) body: String,
}

impl std::fmt::Display for HttpStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HTTP {}: {}", self.status, self.body)
    }
}

impl std::error::Error for HttpStatus {}

/// [`one_request`] with the prompt as any JSON `/v1/completions` takes (a string or token
/// ids) and an optional `x-session-id` header (what a session-sticky load balancer hashes).
/// A non-2xx reply is an [`HttpStatus`] error. Cancel-safe.
pub(crate) async fn stream_completion(
    client: &reqwest::Client,
    base_url: &str,
    spec: &RequestSpec<'_>,
    prompt: Value,
    session: Option<&str>,
) -> Result<Streamed> {
    let body = json!({
        "model": spec.model,
        "prompt": prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "ignore_eos": true,
        "cache_prompt": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let t0 = Instant::now();
    let mut req = client
        .post(format!("{base_url}/v1/completions"))
        .json(&body);
    if let Some(id) = session {
        req = req.header(crate::proxy::SESSION_HEADER, id);
    }
    let resp = req.send().await.context("sending the request")?;
    let status = resp.status();
    if !status.is_success() {
        let body = resp.text().await.unwrap_or_default();
        return Err(HttpStatus {
            status: status.as_u16(),
            body,
        }
        .into());
    }
    let mut stream = resp.bytes_stream();
    let mut pending: Vec<u8> = Vec::new();
    let mut times: Vec<f64> = Vec::new();
    let mut text = String::new();
    let (mut completion, mut prompt_tokens) = (None, None);
    let mut done = false;
    while let Some(bytes) = stream.next().await {
        let now = t0.elapsed().as_secs_f64();
        pending.extend_from_slice(&bytes.context("reading the stream")?);
        while let Some(nl) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&line);
            let Some(data) = line.trim().strip_prefix("data:") else {
                continue;
            };
            let data = data.trim();
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let v: Value =
                serde_json::from_str(data).with_context(|| format!("chunk is not JSON: {data}"))?;
            if let Some(err) = v.get("error") {
                bail!("server error in stream: {err}");
            }
            if let Some(t) = v["choices"][0]["text"].as_str() {
                if !t.is_empty() {
                    times.push(now);
                    text.push_str(t);
                }
            }
            if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
                completion = u["completion_tokens"]
                    .as_u64()
                    .map(|n| n as usize)
                    .or(completion);
                prompt_tokens = u["prompt_tokens"]
                    .as_u64()
                    .map(|n| n as usize)
                    .or(prompt_tokens);
            }
        }
    }
    if !done {
        bail!("stream ended without [DONE]");
    }
    Ok(Streamed {
        e2e_s: t0.elapsed().as_secs_f64(),
        times,
        text,
        completion,
        prompt_tokens,
    })
}

/// Turns a streamed response into a [`Sample`].
pub(crate) fn sample_from(prompt: usize, stream: usize, r: Streamed) -> Result<Sample> {
    let times = &r.times;
    let Some(&first) = times.first() else {
        bail!("no text chunk received")
    };
    let last = *times.last().unwrap_or(&first);
    let completion_tokens = r.completion.unwrap_or(times.len());
    let span = last - first;
    let decode_tok_s =
        (completion_tokens > 1 && span > 0.0).then(|| (completion_tokens - 1) as f64 / span);
    Ok(Sample {
        prompt,
        stream,
        ttft_s: first,
        e2e_s: r.e2e_s,
        completion_tokens,
        tokens_from_usage: r.completion.is_some(),
        prompt_tokens: r.prompt_tokens,
        chunks: times.len(),
        decode_tok_s,
        itl_s: times.windows(2).map(|w| w[1] - w[0]).collect(),
        text: r.text,
    })
}

/// One batch: `streams` closed-loop streams start together, each sends `rounds` requests back
/// to back; stream `s` round `r` uses prompt `first_prompt + s * rounds + r`.
pub(crate) struct Batch {
    pub(crate) wall_s: f64,
    pub(crate) samples: Vec<Sample>,
    /// CPU other processes took during the batch (filled in by the caller).
    pub(crate) foreign: Option<ForeignCpu>,
}

/// Runs one [`Batch`] against `base_url`. Cancel-safe.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run_batch(
    client: &reqwest::Client,
    base_url: &str,
    spec: &RequestSpec<'_>,
    prompts: &[String],
    first_prompt: usize,
    streams: usize,
    rounds: usize,
    progress: &ProgressBar,
) -> Result<Batch> {
    let start = Instant::now();
    let per_stream = (0..streams).map(|s| async move {
        let mut out = Vec::with_capacity(rounds);
        for r in 0..rounds {
            let k = first_prompt + s * rounds + r;
            let sample = one_request(client, base_url, spec, &prompts[k])
                .await
                .and_then(|r| sample_from(k, s, r))
                .with_context(|| format!("{base_url}: prompt {k}"))?;
            out.push(sample);
            progress.inc(1);
        }
        Ok::<_, anyhow::Error>(out)
    });
    let results = futures::future::try_join_all(per_stream).await?;
    Ok(Batch {
        wall_s: start.elapsed().as_secs_f64(),
        samples: results.into_iter().flatten().collect(),
        foreign: None,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn splitmix64_mix_matches_the_reference_first_output() {
        // splitmix64 seeded with 0: its first output mixes the golden-ratio increment.
        assert_eq!(splitmix64_mix(0x9E37_79B9_7F4A_7C15), 0xE220_A839_7B1D_CDAF);
    }

    /// A small catalog for tests: `tool_i` with one `city` parameter.
    pub(crate) fn catalog() -> Vec<Value> {
        (0..10)
            .map(|i| {
                json!({"name": format!("tool_{i}"), "description": format!("Do thing {i}."),
                       "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}})
            })
            .collect()
    }

    #[test]
    fn py_json_uses_python_separators_and_ascii_escapes() {
        let v = json!({"a": [1, "é"], "b": {"c": true}});
        assert_eq!(py_json(&v), r#"{"a": [1, "\u00e9"], "b": {"c": true}}"#);
    }

    #[test]
    fn prompt_has_chat_format_and_first_tool_varies_with_k() {
        let c = catalog();
        let p0 = prompt(&c, 0, 3);
        assert!(p0.starts_with("<|system|>You are a helpful agent."));
        assert!(p0.ends_with("<|end|><|assistant|>"));
        assert!(p0.contains("\n<tools>\n{\"name\": \"tool_0\", \"description\": \"Do thing 0.\""));
        assert!(p0.contains("<|user|>Please do thing 0: city Lisbon.<|end|>"));
        assert_eq!(p0.matches("\"name\": ").count(), 3);
        let p1 = prompt(&c, 1, 3);
        assert!(p1.contains("<tools>\n{\"name\": \"tool_1\""));
    }

    #[test]
    fn prompts_are_distinct_past_one_lap_of_the_catalog() {
        let c = catalog();
        let all: std::collections::HashSet<String> = (0..40).map(|k| prompt(&c, k, 3)).collect();
        assert_eq!(all.len(), 40);
    }

    fn streamed(times: &[f64], completion: Option<usize>) -> Streamed {
        Streamed {
            e2e_s: 1.0,
            times: times.to_vec(),
            text: "x".repeat(times.len()),
            completion,
            prompt_tokens: completion.map(|_| 10),
        }
    }

    #[test]
    fn sample_counts_tokens_from_usage_and_times_from_chunks() {
        let s = sample_from(3, 1, streamed(&[0.2, 0.3, 0.5], Some(4))).unwrap();
        assert_eq!(s.ttft_s, 0.2);
        assert_eq!(s.completion_tokens, 4);
        assert!(s.tokens_from_usage);
        assert!((s.decode_tok_s.unwrap() - 10.0).abs() < 1e-9);
        assert_eq!(s.itl_s.len(), 2);
        assert_eq!(s.prompt_tokens, Some(10));
        let s = sample_from(0, 0, streamed(&[0.1, 0.2], None)).unwrap();
        assert_eq!(s.completion_tokens, 2);
        assert!(!s.tokens_from_usage);
        assert!(sample_from(0, 0, streamed(&[], None)).is_err());
    }
}
