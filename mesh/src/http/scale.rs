//! Tier scaling over HTTP: `GET /v1/control/scale` (the planner's status: who plans, each
//! scaled tier's replicas, queue time and pin, recent starts and drains) and
//! `POST /v1/control/scale` (`{"tier": "t3", "replicas": 2}` pins a tier's replicas;
//! `"replicas": null` hands it back to its `[scaling.tiers]` policy). Any node answers: its
//! planner forwards to the one planning. The work is the planner's, through the service
//! layer ([`crate::service::control::Scaling`]); this module only translates.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::error::ApiError;
use super::HttpState;
use crate::service::Error;

/// `POST /v1/control/scale` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScaleBody {
    /// Tier name.
    tier: String,
    /// Replicas to keep; `null` or absent: back to the tier's scaling policy.
    #[serde(default)]
    replicas: Option<u32>,
}

/// The planner's status JSON as it came, or the error.
fn answer(r: Result<String, Error>) -> Response {
    match r {
        Ok(json) => ([(CONTENT_TYPE, "application/json")], json).into_response(),
        Err(e) => ApiError(e).into_response(),
    }
}

/// `GET /v1/control/scale`: the planner's status, from the node that plans.
#[utoipa::path(get, path = "/v1/control/scale", tag = "control",
    responses(
        (status = 200, description = "The planning node, each scaled tier's replicas, queue time and pin, and recent starts and drains", body = Object),
        super::openapi::ControlErrors,
    ))]
pub(crate) async fn show(State(state): State<HttpState>) -> Response {
    match state.service.scaling() {
        Ok(scaling) => answer(scaling.status().await),
        Err(e) => ApiError(e).into_response(),
    }
}

/// `POST /v1/control/scale`: pins a tier's replicas (`replicas: null` unpins); answered with
/// the planner's status once the first start or drain toward the pin is decided. 400 when
/// no live node can run the tier or too few can for the count.
#[utoipa::path(post, path = "/v1/control/scale", tag = "control",
    request_body(content = Object, description = "`tier` (string), `replicas` (integer, or null for the tier's policy)"),
    responses(
        (status = 200, description = "The planner's status after the pin", body = Object),
        super::openapi::ControlErrors,
    ))]
pub(crate) async fn scale(State(state): State<HttpState>, body: Bytes) -> Response {
    let scaling = match state.service.scaling() {
        Ok(s) => s,
        Err(e) => return ApiError(e).into_response(),
    };
    let body: ScaleBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => {
            return ApiError::bad_request(format!("invalid request body: {e}"), None)
                .into_response()
        }
    };
    answer(scaling.pin(&body.tier, body.replicas).await)
}
