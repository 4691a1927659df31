//! Tier scaling over HTTP: `GET /v1/control/scale` (the planner's status: who plans, each
//! scaled tier's replicas, queue time and pin, recent starts and drains) and
//! `POST /v1/control/scale` (`{"tier": "t3", "replicas": 2}` pins a tier's replicas;
//! `"replicas": null` hands it back to its `[scaling.tiers]` policy). Any node answers: its
//! planner forwards to the one planning. The work is the planner actor's
//! (`mesh_actors::planner`); this module only translates.

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use mesh_actors::planner::PlannerMsg;
use mesh_actors::supervisor;
use serde::Deserialize;

use super::error::ApiError;
use super::HttpState;
use crate::service::Error;

/// How long a call waits for a restarting planner.
const RESTART_WAIT: Duration = Duration::from_secs(1);
/// Longest the planner (or the one it forwards to) may take to answer.
const CALL_TIMEOUT: Duration = Duration::from_secs(20);

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

fn not_clustered() -> ApiError {
    ApiError::bad_request(
        "this node is not in a cluster: tiers scale across the nodes of one (`mesh join`)",
        None,
    )
}

fn answer(r: Result<Result<String, String>, supervisor::ActorCallError>) -> Response {
    match r {
        Ok(Ok(json)) => ([(CONTENT_TYPE, "application/json")], json).into_response(),
        Ok(Err(why)) => {
            let param = if why.contains("replicas cannot") {
                "replicas"
            } else {
                "tier"
            };
            ApiError::bad_request(why, Some(param)).into_response()
        }
        Err(e) => ApiError(Error::unavailable(format!("{e}; retry shortly"))).into_response(),
    }
}

/// `GET /v1/control/scale`: the planner's status, from the node that plans.
#[utoipa::path(get, path = "/v1/control/scale", tag = "control",
    responses(
        (status = 200, description = "The planning node, each scaled tier's replicas, queue time and pin, and recent starts and drains", body = Object),
        super::openapi::ControlErrors,
    ))]
pub(crate) async fn show(State(state): State<HttpState>) -> Response {
    let Some((slot, _)) = &state.planner else {
        return not_clustered().into_response();
    };
    answer(
        supervisor::call(slot, "planner", RESTART_WAIT, CALL_TIMEOUT, |reply| {
            PlannerMsg::Show { reply }
        })
        .await,
    )
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
    let Some((slot, _)) = &state.planner else {
        return not_clustered().into_response();
    };
    let body: ScaleBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => {
            return ApiError::bad_request(format!("invalid request body: {e}"), None)
                .into_response()
        }
    };
    if body.tier.is_empty() {
        return ApiError::bad_request("tier must not be empty", Some("tier")).into_response();
    }
    answer(
        supervisor::call(slot, "planner", RESTART_WAIT, CALL_TIMEOUT, |reply| {
            PlannerMsg::Scale {
                tier: body.tier.clone(),
                replicas: body.replicas,
                reply,
            }
        })
        .await,
    )
}
