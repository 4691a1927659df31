//! `POST /v1/embeddings` in OpenAI's shape: the request's text inputs to the service's
//! typed call, the vectors back as floats or, as the official clients ask by default,
//! base64 of little-endian f32.

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::error::{parse_body, ApiError};
use super::HttpState;
use crate::service::embeddings::{EmbedCall, EmbedReply};

/// `POST /v1/embeddings` body.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[schema(example = json!({"model": "nomic-embed-text-v1.5",
    "input": ["search_query: weather in Lima", "search_document: Get the forecast by city."]}))]
pub struct EmbeddingsRequest {
    /// A served embedding model (`GET /v1/models` marks them `"embedding": true`).
    pub model: String,
    /// A text or an array of texts (token-id arrays are not taken).
    #[schema(value_type = Object)]
    pub input: Value,
    /// `float` (default) or `base64` (little-endian f32, what the official clients ask for).
    pub encoding_format: Option<String>,
    /// Fewer dimensions; not supported (the model's full width is returned).
    pub dimensions: Option<u32>,
    /// The end user (accepted and ignored).
    pub user: Option<String>,
}

/// One vector of an [`EmbeddingList`].
#[derive(Debug, Serialize, ToSchema)]
pub struct EmbeddingItem {
    /// `embedding`.
    object: &'static str,
    /// Position of its input.
    index: usize,
    /// Floats, or a base64 string of little-endian f32.
    #[schema(value_type = Object)]
    embedding: Value,
}

/// Tokens an embeddings request used.
#[derive(Debug, Serialize, ToSchema)]
pub struct EmbeddingUsage {
    /// Tokens the model read.
    prompt_tokens: usize,
    /// The same (nothing is generated).
    total_tokens: usize,
}

/// `POST /v1/embeddings` answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct EmbeddingList {
    /// `list`.
    object: &'static str,
    /// One vector per input, in order.
    data: Vec<EmbeddingItem>,
    /// The model.
    model: String,
    /// Tokens read.
    usage: EmbeddingUsage,
}

/// The texts of `input`: a string or an array of strings.
fn texts(input: Value) -> Result<Vec<String>, ApiError> {
    let token_ids = || {
        ApiError::bad_request(
            "`input` as token ids is not supported; send the text",
            Some("input"),
        )
    };
    match input {
        Value::String(s) => Ok(vec![s]),
        Value::Array(items) if items.is_empty() => Err(ApiError::bad_request(
            "`input` must hold at least one text",
            Some("input"),
        )),
        Value::Array(items) => items
            .into_iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => Ok(s),
                Value::Number(_) | Value::Array(_) => Err(token_ids()),
                _ => Err(ApiError::bad_request(
                    format!("`input[{i}]` must be a string"),
                    Some("input"),
                )),
            })
            .collect(),
        _ => Err(ApiError::bad_request(
            "`input` must be a string or an array of strings",
            Some("input"),
        )),
    }
}

fn body(reply: EmbedReply, base64: bool) -> EmbeddingList {
    let data = reply
        .vectors
        .into_iter()
        .enumerate()
        .map(|(index, v)| EmbeddingItem {
            object: "embedding",
            index,
            embedding: if base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                Value::from(v)
            },
        })
        .collect();
    EmbeddingList {
        object: "list",
        data,
        model: reply.model,
        usage: EmbeddingUsage {
            prompt_tokens: reply.prompt_tokens,
            total_tokens: reply.prompt_tokens,
        },
    }
}

/// `POST /v1/embeddings`.
#[utoipa::path(post, path = "/v1/embeddings", tag = "inference",
    request_body = EmbeddingsRequest,
    responses(
        (status = 200, description = "One vector per input", body = EmbeddingList),
        super::openapi::RouteErrors,
    ))]
pub(crate) async fn embeddings(State(state): State<HttpState>, raw: Bytes) -> Response {
    const EP: &str = "/v1/embeddings";
    let resp = match inner(&state, &raw).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    };
    state.count(EP, resp.status());
    resp
}

async fn inner(state: &HttpState, raw: &[u8]) -> Result<Response, ApiError> {
    let r: EmbeddingsRequest = parse_body(raw)?;
    let base64 = match r.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::bad_request(
                format!("`encoding_format` must be `float` or `base64`, not `{other}`"),
                Some("encoding_format"),
            ))
        }
    };
    if r.dimensions.is_some() {
        return Err(ApiError::bad_request(
            "`dimensions` is not supported; the model's full width is returned",
            Some("dimensions"),
        ));
    }
    let call = EmbedCall {
        model: r.model,
        input: texts(r.input)?,
    };
    let reply = state.service.embed(call).await?;
    Ok(Json(body(reply, base64)).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_string_is_one_input() {
        assert_eq!(texts(json!("hi")).unwrap(), vec!["hi".to_owned()]);
    }

    #[test]
    fn token_ids_are_refused_by_name() {
        let e = texts(json!([[1, 2, 3]])).unwrap_err();
        assert!(e.0.message.contains("token ids"), "{}", e.0.message);
        assert_eq!(e.0.param.as_deref(), Some("input"));
    }

    #[test]
    fn an_empty_array_is_refused() {
        assert!(texts(json!([])).is_err());
    }

    #[test]
    fn base64_holds_little_endian_floats() {
        let b = body(
            EmbedReply {
                model: "m".into(),
                vectors: vec![vec![1.0, -0.5]],
                prompt_tokens: 3,
            },
            true,
        );
        let s = b.data[0].embedding.as_str().unwrap();
        let bytes = base64::engine::general_purpose::STANDARD.decode(s).unwrap();
        let back: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(back, vec![1.0, -0.5]);
    }
}
