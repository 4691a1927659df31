//! The node over HTTP: `GET /v1/models`, `GET /v1/cluster` (`mesh status`), `GET /ready`,
//! `GET /metrics`, and `POST /v1/debug/crash` (fault injection, only on a node started with
//! it and only with its token).

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use mesh_actors::node::NodeMsg;
use mesh_actors::pagestore::StoreMsg;
use serde_json::{json, Value};
use subtle_eq::constant_time_eq;

use super::error::ApiError;
use super::HttpState;

mod subtle_eq {
    /// Compares two byte strings in time that does not depend on where they differ.
    pub(super) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

pub(crate) async fn models(State(state): State<HttpState>) -> Json<Value> {
    let registry = state.service.engines().registry();
    let mut data: Vec<Value> = registry
        .iter()
        .map(|e| {
            let i = &e.value().desc.info;
            json!({"id": i.name, "object": "model", "created": 0, "owned_by": "mesh",
                   "meta": {"n_params": i.n_params, "n_ctx_train": i.n_ctx_train, "max_seq_len": i.max_seq_len,
                            "n_seq_max": i.n_seq_max, "size_bytes": i.size_bytes}})
        })
        .collect();
    for name in state.service.tier_names() {
        if !registry.contains_key(&name) {
            data.push(json!({"id": name, "object": "model", "created": 0, "owned_by": "mesh", "meta": {"remote": true}}));
        }
    }
    let c = state.service.cascade_policy();
    let hosted: Vec<String> = data
        .iter()
        .filter_map(|m| m["id"].as_str().map(str::to_owned))
        .collect();
    if c.tiers.iter().all(|t| hosted.contains(t)) {
        data.push(
            json!({"id": c.model, "object": "model", "created": 0, "owned_by": "mesh",
                         "meta": {"cascade": c.tiers}}),
        );
    }
    data.sort_by(|a, b| a["id"].as_str().cmp(&b["id"].as_str()));
    Json(json!({"object": "list", "data": data}))
}

fn tier_json(t: &mesh_actors::wire::TierAdvert) -> Value {
    json!({"name": t.name, "active": t.active, "queued": t.queued, "n_seq_max": t.n_seq_max,
           "max_seq_len": t.max_seq_len, "kv_cells": t.kv_cells, "kv_reserved": t.kv_reserved,
           "pages": t.pages.len()})
}

/// `GET /v1/cluster`: the members this node knows, its placement and its actors.
pub(crate) async fn cluster(State(state): State<HttpState>) -> Json<Value> {
    let members: Vec<Value> = match state.service.cluster() {
        Some(c) => c
            .members()
            .into_iter()
            .map(|m| {
                json!({
                    "node": m.node, "local": m.local, "quic_addr": m.quic_addr, "http_addr": m.http_addr,
                    "state": m.state, "uptime_s": m.uptime_s, "last_seen_ms": m.last_seen_ms,
                    "roles": m.roles, "actors": m.actors,
                    "stored_pages": m.stored_pages.iter().cloned().collect::<std::collections::BTreeMap<_, _>>(),
                    "tiers": m.tiers.iter().map(tier_json).collect::<Vec<_>>(),
                })
            })
            .collect(),
        None => {
            let tiers = state.service.engines().adverts(&[]);
            vec![json!({"node": "local", "local": true, "state": "alive", "quic_addr": null, "http_addr": null,
                "uptime_s": null, "last_seen_ms": 0, "tiers": tiers.iter().map(tier_json).collect::<Vec<_>>()})]
        }
    };
    let actors = match &state.supervisor {
        Some(s) => ractor::call_t!(s, NodeMsg::Children, 2000).ok(),
        None => None,
    };
    Json(json!({
        "clustered": state.service.cluster().is_some(),
        "members": members,
        "placement": state.placement,
        "actors": actors,
    }))
}

pub(crate) async fn ready(State(state): State<HttpState>) -> Response {
    let registry = state.service.engines().registry();
    let missing: Vec<&String> = state
        .expected_tiers
        .iter()
        .filter(|t| !registry.contains_key(*t))
        .collect();
    if missing.is_empty() {
        Json(json!({"status": "ready"})).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "starting", "missing_tiers": missing})),
        )
            .into_response()
    }
}

pub(crate) async fn metrics(State(state): State<HttpState>) -> Response {
    // The page-store counters as the store actor has them now (none while it restarts).
    let store = state
        .service
        .pages()
        .call(StoreMsg::Stats)
        .await
        .unwrap_or_default();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.service.metrics().render(store),
    )
        .into_response()
}

/// `POST /v1/debug/crash` with `{"actor": NAME}` and the header `x-mesh-fault-token`:
/// crashes the named actor (`router`, `governor`, `kv-store`, `tuner`, `engines`,
/// `membership`, or `tier:NAME` for a tier's engine thread). 404 on a node started without
/// fault injection, 401 without the right token.
pub(crate) async fn crash(
    State(state): State<HttpState>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Some(f) = &state.faults else {
        return (
            StatusCode::NOT_FOUND,
            Json(json!({"error": {"message": "fault injection is off on this node", "type": "invalid_request_error", "param": null, "code": null}})),
        )
            .into_response();
    };
    let given = headers
        .get("x-mesh-fault-token")
        .map(|v| v.as_bytes())
        .unwrap_or_default();
    if !constant_time_eq(given, f.token.as_bytes()) {
        return (
            StatusCode::UNAUTHORIZED,
            Json(json!({"error": {"message": "missing or wrong x-mesh-fault-token", "type": "authentication_error", "param": null, "code": null}})),
        )
            .into_response();
    }
    let target = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v["actor"].as_str().map(str::to_owned));
    let Some(target) = target else {
        return ApiError::bad_request(
            format!(
                "the body must be {{\"actor\": NAME}}; NAME is one of {}",
                f.injector.targets().join(", ")
            ),
            Some("actor"),
        )
        .into_response();
    };
    match tokio::time::timeout(Duration::from_secs(5), f.injector.inject(&target)).await {
        Ok(Ok(())) => Json(json!({"crashed": target})).into_response(),
        Ok(Err(e)) => ApiError::bad_request(e, Some("actor")).into_response(),
        Err(_) => ApiError(crate::service::Error::internal(
            "the injection did not finish in 5 s",
        ))
        .into_response(),
    }
}
