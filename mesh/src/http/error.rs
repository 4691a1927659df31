//! The HTTP layer's one error type and its code table: every service error kind has one
//! status, OpenAI error `type` and `code`; bodies are OpenAI's error JSON (Anthropic's on
//! the Messages API's routes, [`Dialect`]) and a `Retry-After` header goes with 429 and 503.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::anthropic::{AnthropicErrorBody, AnthropicErrorDetail};
use super::openai::{ErrorBody, ErrorDetail};
use crate::service::{Error, Kind};

/// `(status, type, code)` of each kind.
pub fn class(kind: Kind) -> (StatusCode, &'static str, Option<&'static str>) {
    match kind {
        Kind::InvalidRequest => (StatusCode::BAD_REQUEST, "invalid_request_error", None),
        Kind::Unauthenticated => (
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            Some("invalid_api_key"),
        ),
        Kind::PermissionDenied => (
            StatusCode::FORBIDDEN,
            "permission_error",
            Some("insufficient_permissions"),
        ),
        Kind::ContextLengthExceeded => (
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("context_length_exceeded"),
        ),
        Kind::ModelNotFound => (
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            Some("model_not_found"),
        ),
        Kind::RateLimited => (
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            Some("rate_limit_exceeded"),
        ),
        Kind::PayloadTooLarge => (
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            Some("request_too_large"),
        ),
        Kind::Unavailable => (
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            Some("tier_unavailable"),
        ),
        Kind::TunerDisabled => (StatusCode::CONFLICT, "tuner_disabled", None),
        Kind::TuningInProgress => (StatusCode::CONFLICT, "tuning_in_progress", None),
        Kind::EngineStartFailed => (
            StatusCode::UNPROCESSABLE_ENTITY,
            "engine_start_failed",
            None,
        ),
        Kind::NotReady => (StatusCode::SERVICE_UNAVAILABLE, "server_error", None),
        Kind::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", None),
    }
}

/// An error as the HTTP API answers it.
#[derive(Debug)]
pub struct ApiError(pub Error);

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        Self(e)
    }
}

impl ApiError {
    /// A 400 naming the field at fault.
    pub fn bad_request(message: impl Into<String>, param: Option<&str>) -> Self {
        Self(Error::invalid(message, param))
    }

    /// The status this error is answered with.
    pub fn status(&self) -> StatusCode {
        class(self.0.kind).0
    }
}

/// Which API's error shape a route answers in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// OpenAI's `{"error": {"message", "type", "param", "code"}}`.
    OpenAi,
    /// Anthropic's `{"type": "error", "error": {"type", "message"}}`.
    Anthropic,
}

impl Dialect {
    /// The dialect of a request path: Anthropic's for `/v1/messages` and below.
    pub fn of_path(path: &str) -> Self {
        if path == "/v1/messages" || path.starts_with("/v1/messages/") {
            Dialect::Anthropic
        } else {
            Dialect::OpenAi
        }
    }
}

impl ApiError {
    /// The response in `dialect`'s error shape.
    pub fn respond(self, dialect: Dialect) -> Response {
        let (status, kind, code) = class(self.0.kind);
        let mut resp = match dialect {
            Dialect::OpenAi => (
                status,
                Json(ErrorBody {
                    error: ErrorDetail {
                        message: self.0.message,
                        kind: kind.into(),
                        param: self.0.param,
                        code: code.map(str::to_owned),
                    },
                }),
            )
                .into_response(),
            Dialect::Anthropic => {
                let message = match &self.0.param {
                    Some(p) if !self.0.message.contains(p.as_str()) => {
                        format!("{}: {}", p, self.0.message)
                    }
                    _ => self.0.message,
                };
                (
                    status,
                    Json(AnthropicErrorBody {
                        kind: "error".into(),
                        error: AnthropicErrorDetail {
                            kind: super::anthropic::error_type(status.as_u16()).into(),
                            message,
                        },
                    }),
                )
                    .into_response()
            }
        };
        if status == StatusCode::UNAUTHORIZED {
            resp.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"mesh\""),
            );
        }
        if let Some(s) = self.0.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.respond(Dialect::OpenAi)
    }
}

/// Parses a JSON body; an empty or malformed one is a 400 saying why.
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.is_empty() {
        return Err(ApiError::bad_request(
            "request body is empty; expected a JSON object",
            None,
        ));
    }
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}"), None))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_that_asks_for_a_retry_says_when() {
        let e = Error::busy("full", 3);
        let r = ApiError(e).into_response();
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[header::RETRY_AFTER], "3");
        let r = ApiError(Error::unavailable("restarting")).into_response();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
    }

    #[tokio::test]
    async fn messages_routes_answer_in_anthropics_shape() {
        assert_eq!(
            Dialect::of_path("/v1/messages/count_tokens"),
            Dialect::Anthropic
        );
        assert_eq!(Dialect::of_path("/v1/messagesx"), Dialect::OpenAi);
        let r = ApiError(Error::model_not_found("t9", &["t1".into()])).respond(Dialect::Anthropic);
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
        let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], "not_found_error");
        assert!(v["error"]["message"].as_str().unwrap().contains("t9"));
    }

    #[test]
    fn client_errors_and_server_errors_stay_apart() {
        for kind in [
            Kind::InvalidRequest,
            Kind::Unauthenticated,
            Kind::PermissionDenied,
            Kind::ContextLengthExceeded,
            Kind::ModelNotFound,
            Kind::RateLimited,
            Kind::PayloadTooLarge,
        ] {
            assert!(class(kind).0.is_client_error(), "{kind:?}");
        }
        for kind in [Kind::Unavailable, Kind::NotReady, Kind::Internal] {
            assert!(class(kind).0.is_server_error(), "{kind:?}");
        }
    }
}
