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
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::{info_span, Instrument};

use super::error::{parse_body, ApiError};
use super::openai::*;
use super::HttpState;
use crate::service::{
    CompleteCall, Delta, Prompt, Reply, ReplyEvent, Sampling, TokenEvent, TokenLogprobs, Usage,
};

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
    let logprobs = call.logprobs.is_some();
    let reply = state.service.chat(call).await?;
    if stream {
        return Ok(stream_chat(reply, include_usage, logprobs));
    }
    let c = reply
        .collect()
        .instrument(info_span!("tier.generate"))
        .await?;
    Ok(Json(chat_body(&c, logprobs)).into_response())
}

/// Ends an SSE stream: the usage chunk (an empty-choices copy of `template`) when asked for,
/// then `[DONE]`.
async fn end_stream(
    tx: &mpsc::Sender<Result<Event, Infallible>>,
    template: Option<Value>,
    usage: Usage,
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

fn stream_chat(mut reply: Reply, include_usage: bool, logprobs: bool) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Event, Infallible>>(64);
    let id = new_id("chatcmpl");
    let created = now_s();
    let model = reply.model.clone();
    let chunk = move |delta: Value, finish: Option<&str>, lp: Value| {
        json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}]})
    };
    tokio::spawn(
        async move {
            if tx
                .send(sse_data(&chunk(
                    json!({"role": "assistant", "content": ""}),
                    None,
                    Value::Null,
                )))
                .await
                .is_err()
            {
                return;
            }
            let mut n_calls = 0usize;
            // Log-probabilities ride on the next chunk that carries output.
            let mut held_lp: Vec<TokenLogprobs> = vec![];
            while let Some(ev) = reply.next_output().await {
                match ev {
                    ReplyEvent::Started { .. } => {}
                    ReplyEvent::Output {
                        deltas,
                        logprobs: lp,
                    } => {
                        held_lp.extend(lp);
                        for d in deltas {
                            let delta = match d {
                                Delta::Content(t) => json!({"content": t}),
                                Delta::Reasoning(t) => json!({"reasoning_content": t}),
                                Delta::Call(c) => {
                                    let calls = out_calls(std::slice::from_ref(&c), n_calls, true);
                                    n_calls += 1;
                                    json!({"tool_calls": calls})
                                }
                            };
                            let lp = if logprobs {
                                logprobs_json(&std::mem::take(&mut held_lp))
                            } else {
                                Value::Null
                            };
                            if tx.send(sse_data(&chunk(delta, None, lp))).await.is_err() {
                                return; // client went away: dropping `reply` cancels the sequence
                            }
                        }
                    }
                    ReplyEvent::Done { finish, usage } => {
                        let f = if n_calls > 0 {
                            "tool_calls"
                        } else {
                            finish_str(finish)
                        };
                        let lp = if logprobs && !held_lp.is_empty() {
                            logprobs_json(&held_lp)
                        } else {
                            Value::Null
                        };
                        let _ = tx.send(sse_data(&chunk(json!({}), Some(f), lp))).await;
                        end_stream(
                            &tx,
                            include_usage.then(|| chunk(json!({}), None, Value::Null)),
                            usage,
                        )
                        .await;
                        return;
                    }
                    ReplyEvent::Error(e) => {
                        let _ = tx
                            .send(sse_data(
                                &json!({"error": {"message": e, "type": "server_error"}}),
                            ))
                            .await;
                        return;
                    }
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
            logprobs: r.logprobs,
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
                logprobs: r.logprobs.map(|_| completion_logprobs_json(&c.logprobs)),
            }],
            usage: OutUsage::from(c.usage),
            mesh: mesh_json(&c.mesh),
        })
        .into_response());
    }
    let (tx, rx) = mpsc::channel::<Result<Event, Infallible>>(64);
    let (id, created, model) = (new_id("cmpl"), now_s(), reply.model.clone());
    let want_lp = r.logprobs;
    tokio::spawn(async move {
        let chunk = |text: &str, finish: Option<&str>| {
            json!({"id": id, "object": "text_completion", "created": created, "model": model,
                   "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": null}]})
        };
        while let Some(ev) = reply.next().await {
            match ev {
                TokenEvent::Started { .. } => {}
                TokenEvent::Token { text, logprobs, .. } => {
                    let mut c = chunk(&text, None);
                    if let (Some(_), Some(lp)) = (want_lp, logprobs) {
                        c["choices"][0]["logprobs"] = completion_logprobs_json(&[*lp]);
                    }
                    if tx.send(sse_data(&c)).await.is_err() {
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
