//! Chat and raw completions over HTTP: `POST /v1/chat/completions` and
//! `POST /v1/completions`. Translates OpenAI's JSON into the service's typed calls and the
//! replies back into JSON bodies or server-sent events; nothing else happens here.
//!
//! A client that disconnects drops the SSE stream, which drops the [`Reply`], which frees
//! its sequence in the engine.

use std::convert::Infallible;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use mesh_tiers::chat;
use mesh_tiers::TokenEvent;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::{info_span, Instrument};

use super::error::{parse_body, ApiError};
use super::openai::*;
use super::HttpState;
use crate::service::{CompleteCall, Prompt, Reply, Sampling};

/// `POST /v1/chat/completions`.
#[utoipa::path(post, path = "/v1/chat/completions", tag = "inference",
    request_body = ChatRequest,
    responses(
        (status = 200, description = "The completion, or with `stream` server-sent `chat.completion.chunk` events ending with `[DONE]`",
            content((ChatCompletion = "application/json"), (String = "text/event-stream"))),
        super::openapi::RouteErrors,
    ))]
pub(crate) async fn chat_completions(State(state): State<HttpState>, body: Bytes) -> Response {
    const EP: &str = "/v1/chat/completions";
    let resp = match chat_inner(&state, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    };
    state.count(EP, resp.status());
    resp
}

async fn chat_inner(state: &HttpState, body: &[u8]) -> Result<Response, ApiError> {
    let r: ChatRequest = parse_body(body)?;
    let stream = r.stream;
    let include_usage = r.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let call = r.into_call()?;
    let reply = state.service.chat(call).await?;
    if stream {
        return Ok(stream_chat(reply, include_usage));
    }
    let c = reply
        .collect()
        .instrument(info_span!("tier.generate"))
        .await?;
    Ok(Json(chat_body(&c)).into_response())
}

/// Ends an SSE stream: the usage chunk (an empty-choices copy of `template`) when asked for,
/// then `[DONE]`.
async fn end_stream(
    tx: &mpsc::Sender<Result<Event, Infallible>>,
    template: Option<Value>,
    usage: mesh_tiers::Usage,
) {
    if let Some(mut last) = template {
        last["choices"] = json!([]);
        last["usage"] = serde_json::to_value(OutUsage::from(usage)).expect("serializable");
        let _ = tx.send(sse_data(&last)).await;
    }
    let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
}

fn sse_data(v: &Value) -> Result<Event, Infallible> {
    Ok(Event::default().data(v.to_string()))
}

/// Splits streamed chat text into content, reasoning and complete tool-call bodies.
#[derive(Debug, Default)]
pub struct StreamSplitter {
    buf: String,
    state: SplitState,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum SplitState {
    #[default]
    Content,
    Think,
    Call,
}

/// A piece of streamed output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Answer text.
    Content(String),
    /// Reasoning text.
    Reasoning(String),
    /// A complete tool-call body (JSON text between the markers).
    Call(String),
}

fn held_suffix(buf: &str, markers: &[&str]) -> usize {
    markers
        .iter()
        .map(|m| {
            (1..m.len().min(buf.len() + 1))
                .rev()
                .find(|&n| {
                    buf.is_char_boundary(buf.len() - n) && m.starts_with(&buf[buf.len() - n..])
                })
                .unwrap_or(0)
        })
        .max()
        .unwrap_or(0)
}

impl StreamSplitter {
    /// Feeds text; returns the pieces that are complete.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.state {
                SplitState::Content => {
                    let next = [
                        (chat::THINK, SplitState::Think),
                        (chat::CALL, SplitState::Call),
                    ]
                    .iter()
                    .filter_map(|(m, s)| self.buf.find(m).map(|i| (i, m.len(), *s)))
                    .min_by_key(|x| x.0);
                    if let Some((i, len, s)) = next {
                        if i > 0 {
                            out.push(Piece::Content(self.buf[..i].to_owned()));
                        }
                        self.buf.drain(..i + len);
                        self.state = s;
                        continue;
                    }
                    let keep = held_suffix(&self.buf, &[chat::THINK, chat::CALL]);
                    let cut = self.buf.len() - keep;
                    if cut > 0 {
                        out.push(Piece::Content(self.buf[..cut].to_owned()));
                        self.buf.drain(..cut);
                    }
                    break;
                }
                SplitState::Think => {
                    if let Some(i) = self.buf.find(chat::END_THINK) {
                        if i > 0 {
                            out.push(Piece::Reasoning(self.buf[..i].to_owned()));
                        }
                        self.buf.drain(..i + chat::END_THINK.len());
                        self.state = SplitState::Content;
                        continue;
                    }
                    let keep = held_suffix(&self.buf, &[chat::END_THINK]);
                    let cut = self.buf.len() - keep;
                    if cut > 0 {
                        out.push(Piece::Reasoning(self.buf[..cut].to_owned()));
                        self.buf.drain(..cut);
                    }
                    break;
                }
                SplitState::Call => {
                    if let Some(i) = self.buf.find(chat::END_CALL) {
                        out.push(Piece::Call(self.buf[..i].to_owned()));
                        self.buf.drain(..i + chat::END_CALL.len());
                        self.state = SplitState::Content;
                        continue;
                    }
                    break;
                }
            }
        }
        out
    }

    /// End of stream: whatever is held.
    pub fn finish(&mut self) -> Vec<Piece> {
        let rest = std::mem::take(&mut self.buf);
        match std::mem::take(&mut self.state) {
            _ if rest.is_empty() => vec![],
            SplitState::Content => vec![Piece::Content(rest)],
            SplitState::Think => vec![Piece::Reasoning(rest)],
            SplitState::Call => vec![Piece::Content(format!("{}{rest}", chat::CALL))],
        }
    }
}

fn stream_chat(mut reply: Reply, include_usage: bool) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Event, Infallible>>(64);
    let id = new_id("chatcmpl");
    let created = now_s();
    let model = reply.model.clone();
    let chunk = move |delta: Value, finish: Option<&str>| {
        json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null}]})
    };
    tokio::spawn(
        async move {
            if tx.send(sse_data(&chunk(json!({"role": "assistant", "content": ""}), None))).await.is_err() {
                return;
            }
            let mut split = StreamSplitter::default();
            let mut n_calls = 0usize;
            let send_pieces = |pieces: Vec<Piece>, n_calls: &mut usize| -> Vec<Value> {
                pieces
                    .into_iter()
                    .map(|p| match p {
                        Piece::Content(t) => chunk(json!({"content": t}), None),
                        Piece::Reasoning(t) => chunk(json!({"reasoning_content": t}), None),
                        Piece::Call(body) => match chat::parse_output(&format!("{}{body}{}", chat::CALL, chat::END_CALL)).tool_calls.first() {
                            Some(c) => {
                                let calls = out_calls(std::slice::from_ref(c), *n_calls, true);
                                *n_calls += 1;
                                chunk(json!({"tool_calls": calls}), None)
                            }
                            None => chunk(json!({"content": format!("{}{body}{}", chat::CALL, chat::END_CALL)}), None),
                        },
                    })
                    .collect()
            };
            while let Some(ev) = reply.next().await {
                let (pieces, done) = match ev {
                    TokenEvent::Started { .. } => continue,
                    TokenEvent::Token { text, .. } => (split.push(&text), None),
                    TokenEvent::Done { finish, usage, tail } => {
                        let mut p = split.push(&tail);
                        p.extend(split.finish());
                        (p, Some((finish, usage)))
                    }
                    TokenEvent::Error(e) => {
                        let _ = tx.send(sse_data(&json!({"error": {"message": e, "type": "server_error"}}))).await;
                        return;
                    }
                };
                for v in send_pieces(pieces, &mut n_calls) {
                    if tx.send(sse_data(&v)).await.is_err() {
                        return; // client went away: dropping `reply` cancels the sequence
                    }
                }
                if let Some((finish, usage)) = done {
                    let f = if n_calls > 0 { "tool_calls" } else { finish_str(finish) };
                    let _ = tx.send(sse_data(&chunk(json!({}), Some(f)))).await;
                    end_stream(&tx, include_usage.then(|| chunk(json!({}), None)), usage).await;
                    return;
                }
            }
        }
        .instrument(info_span!("tier.generate")),
    );
    Sse::new(ReceiverStream::new(rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// `POST /v1/completions`.
#[utoipa::path(post, path = "/v1/completions", tag = "inference",
    request_body = CompletionRequest,
    responses(
        (status = 200, description = "The completion, or with `stream` server-sent `text_completion` events ending with `[DONE]`",
            content((TextCompletion = "application/json"), (String = "text/event-stream"))),
        super::openapi::RouteErrors,
    ))]
pub(crate) async fn completions(State(state): State<HttpState>, body: Bytes) -> Response {
    const EP: &str = "/v1/completions";
    let resp = match completions_inner(&state, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    };
    state.count(EP, resp.status());
    resp
}

async fn completions_inner(state: &HttpState, body: &[u8]) -> Result<Response, ApiError> {
    let r: CompletionRequest = parse_body(body)?;
    if r.n.unwrap_or(1) != 1 {
        return Err(ApiError::bad_request("only n = 1 is supported", Some("n")));
    }
    let prompt =
        match &r.prompt {
            Value::String(s) => Prompt::Text(s.clone()),
            Value::Array(a) if a.len() == 1 && a[0].is_string() => {
                Prompt::Text(a[0].as_str().unwrap_or("").to_owned())
            }
            Value::Array(a) if !a.is_empty() && a.iter().all(Value::is_i64) => Prompt::Tokens(
                a.iter()
                    .filter_map(Value::as_i64)
                    .map(|t| t as i32)
                    .collect(),
            ),
            _ => return Err(ApiError::bad_request(
                "prompt must be a string, a one-element list of strings, or a list of token ids",
                Some("prompt"),
            )),
        };
    let include_usage = r.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let mut reply = state
        .service
        .complete(CompleteCall {
            model: r.model.clone(),
            prompt,
            max_tokens: r.max_tokens,
            sampling: Sampling {
                temperature: r.temperature,
                top_p: r.top_p,
                top_k: r.top_k,
                seed: r.seed,
            },
            stop: r.stop.clone().map(StopField::into_vec).unwrap_or_default(),
            ignore_eos: r.ignore_eos,
        })
        .await?;
    if !r.stream {
        let c = reply.collect().await?;
        return Ok(Json(TextCompletion {
            id: new_id("cmpl"),
            object: "text_completion".into(),
            created: now_s(),
            model: c.model.clone(),
            choices: vec![TextChoice {
                index: 0,
                text: c.text.clone(),
                finish_reason: finish_str(c.finish).into(),
                logprobs: None,
            }],
            usage: OutUsage::from(c.usage),
            mesh: mesh_json(&c.mesh),
        })
        .into_response());
    }
    let (tx, rx) = mpsc::channel::<Result<Event, Infallible>>(64);
    let (id, created, model) = (new_id("cmpl"), now_s(), reply.model.clone());
    tokio::spawn(async move {
        let chunk = |text: &str, finish: Option<&str>| {
            json!({"id": id, "object": "text_completion", "created": created, "model": model,
                   "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": null}]})
        };
        while let Some(ev) = reply.next().await {
            match ev {
                TokenEvent::Started { .. } => {}
                TokenEvent::Token { text, .. } => {
                    if tx.send(sse_data(&chunk(&text, None))).await.is_err() {
                        return;
                    }
                }
                TokenEvent::Done {
                    finish,
                    usage,
                    tail,
                } => {
                    let _ = tx
                        .send(sse_data(&chunk(&tail, Some(finish_str(finish)))))
                        .await;
                    end_stream(&tx, include_usage.then(|| chunk("", None)), usage).await;
                    return;
                }
                TokenEvent::Error(e) => {
                    let _ = tx
                        .send(sse_data(
                            &json!({"error": {"message": e, "type": "server_error"}}),
                        ))
                        .await;
                    return;
                }
            }
        }
    });
    Ok(Sse::new(ReceiverStream::new(rx))
        .keep_alive(KeepAlive::default())
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(parts: &[&str]) -> Vec<Piece> {
        let mut s = StreamSplitter::default();
        let mut out: Vec<Piece> = parts.iter().flat_map(|p| s.push(p)).collect();
        out.extend(s.finish());
        // merge adjacent pieces of the same kind for stable comparisons
        let mut merged: Vec<Piece> = Vec::new();
        for p in out {
            match (merged.last_mut(), p) {
                (Some(Piece::Content(a)), Piece::Content(b)) => a.push_str(&b),
                (Some(Piece::Reasoning(a)), Piece::Reasoning(b)) => a.push_str(&b),
                (_, p) => merged.push(p),
            }
        }
        merged
    }

    #[test]
    fn splitter_separates_reasoning_calls_and_content() {
        let got = run(&[
            "<thi",
            "nk>a + b",
            "</think><tool_call>{\"name\"",
            ": \"f\"}</tool_call>",
            "done",
        ]);
        assert_eq!(
            got,
            vec![
                Piece::Reasoning("a + b".into()),
                Piece::Call("{\"name\": \"f\"}".into()),
                Piece::Content("done".into())
            ]
        );
    }

    #[test]
    fn splitter_holds_partial_markers_only() {
        let mut s = StreamSplitter::default();
        assert_eq!(s.push("hello <"), vec![Piece::Content("hello ".into())]);
        assert_eq!(s.push("b"), vec![Piece::Content("<b".into())]);
    }

    #[test]
    fn unterminated_call_becomes_content() {
        assert_eq!(
            run(&["<tool_call>{\"na"]),
            vec![Piece::Content("<tool_call>{\"na".into())]
        );
    }
}
