//! The tuner over HTTP: `POST /v1/control/tune` (one cycle: 200 with the applied change,
//! 422 with the gate's reason, 409 while another runs), `GET /v1/control/policy` (the policy,
//! knobs, decisions and engines) and `PUT /v1/control/policy` (an operator's reload: the
//! body's sections replace the current ones). The work is the tuner's, through the
//! service layer ([`crate::service::control`]); this module only translates.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::ApiError;
use super::HttpState;
use crate::service::control::{TuneOutcome, TuneRequest, Verdict};
use crate::service::Error;

/// `POST /v1/control/tune` body; all optional (empty body: the rules decide).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct TuneBody {
    knob: Option<String>,
    value: Option<f64>,
    /// `latency_ms` (default), `accuracy` or `error`.
    objective: Option<String>,
}

fn verdict_str(v: Verdict) -> &'static str {
    match v {
        Verdict::Accept => "accept",
        Verdict::Reject => "reject",
        Verdict::Revert => "revert",
    }
}

/// A cycle's outcome as `POST /v1/control/tune` answers it (and as the periodic cycles
/// show their last one).
pub(crate) fn tune_response(r: Result<TuneOutcome, Error>) -> (StatusCode, Value) {
    match r {
        Err(e) => {
            let (status, kind, code) = super::error::class(e.kind);
            (
                status,
                json!({"error": {"message": e.message, "type": kind, "param": e.param, "code": code}}),
            )
        }
        Ok(TuneOutcome::NoRuleFired { counters, version }) => (
            StatusCode::OK,
            json!({"applied": null, "reason": "no rule fired on this window",
                   "counters": counters, "version": version}),
        ),
        Ok(TuneOutcome::Decided {
            decision: d,
            counters,
            trial,
        }) => {
            if d.verdict == Verdict::Accept {
                (
                    StatusCode::OK,
                    json!({
                        "applied": {"knob": d.knob, "before": d.before, "after": d.after},
                        "version": d.version,
                        "decision": d,
                        "counters": counters,
                        "trial": trial,
                    }),
                )
            } else {
                (
                    StatusCode::UNPROCESSABLE_ENTITY,
                    json!({
                        "error": {
                            "message": format!("{} -> {} rejected ({}): {}", d.knob, d.after,
                                verdict_str(d.verdict), d.reason),
                            "type": "tuning_rejected",
                            "param": null,
                            "code": verdict_str(d.verdict),
                        },
                        "version": d.version,
                        "decision": d,
                        "counters": counters,
                        "trial": trial,
                    }),
                )
            }
        }
    }
}

/// `POST /v1/control/tune`: one tuning cycle.
#[utoipa::path(post, path = "/v1/control/tune", tag = "control",
    request_body(content = Object, description = "Optional: `knob`, `value`, `objective`"),
    responses(
        (status = 200, description = "The change the gate accepted", body = Object),
        super::openapi::ControlErrors,
    ))]
pub(crate) async fn tune(State(state): State<HttpState>, body: Bytes) -> Response {
    let body: TuneBody = if body.iter().all(u8::is_ascii_whitespace) {
        TuneBody::default()
    } else {
        match serde_json::from_slice(&body) {
            Ok(b) => b,
            Err(e) => {
                return ApiError::bad_request(format!("invalid request body: {e}"), None)
                    .into_response()
            }
        }
    };
    let request = TuneRequest {
        knob: body.knob,
        value: body.value,
        objective: body.objective,
    };
    match state.service.tune(request).await {
        Ok(out) => {
            let (status, v) = tune_response(Ok(out));
            (status, Json(v)).into_response()
        }
        Err(e) => ApiError(e).into_response(),
    }
}

/// `GET /v1/control/policy`.
#[utoipa::path(get, path = "/v1/control/policy", tag = "control",
    responses(
        (status = 200, description = "The policy in force, its knobs, decisions and engines", body = Object),
        super::openapi::ControlErrors,
    ))]
pub(crate) async fn show_policy(State(state): State<HttpState>) -> Response {
    let view = match state.service.tuner_view().await {
        Ok(v) => v,
        Err(e) => return ApiError(e).into_response(),
    };
    let c = &view.cycles;
    let last = c.last.clone().map(|r| {
        let (status, body) = tune_response(r.map_err(Error::from));
        json!({"status": status.as_u16(), "body": body})
    });
    Json(json!({
        "version": view.version,
        "policy": view.policy,
        "knobs": view.knobs,
        "history": view.history,
        "decisions": view.decisions,
        "state_file": view.state_file,
        "journal": view.journal,
        "enabled": view.enabled,
        "periodic": {
            "interval_s": view.interval_s,
            "cycles": {"ran": c.ran, "idle": c.idle, "busy": c.busy, "last": last},
        },
        "engines": view.engines,
    }))
    .into_response()
}

/// `PUT /v1/control/policy`: the body's top-level sections (`cascade`, `reasoning`,
/// `router_top_k`, `draft_k_max`, `quantization`) replace the current ones; sections left
/// out stay. Checked like a state file at start, 400 with the reason otherwise; an engine
/// the policy needs that does not start: 422, nothing changed; 409 while a cycle runs.
#[utoipa::path(put, path = "/v1/control/policy", tag = "control",
    request_body(content = Object, description = "Policy sections to replace: `cascade`, `reasoning`, `router_top_k`, `draft_k_max`, `quantization`"),
    responses(
        (status = 200, description = "The new version and policy", body = Object),
        super::openapi::ControlErrors,
    ))]
pub(crate) async fn put_policy(State(state): State<HttpState>, body: Bytes) -> Response {
    let patch: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return ApiError::bad_request(format!("invalid request body: {e}"), None)
                .into_response()
        }
    };
    match state
        .service
        .replace_policy(patch, "PUT /v1/control/policy")
        .await
    {
        Ok(done) => Json(json!({
            "version": done.version,
            "policy": done.policy,
            "decision": done.decision,
            "engines": done.engines,
        }))
        .into_response(),
        Err(e) => ApiError(e).into_response(),
    }
}
