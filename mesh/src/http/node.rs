//! The node over HTTP: `GET /v1/models`, `GET /v1/cluster` (`mesh status`), `GET /ready`,
//! `GET /metrics`, and `POST /v1/debug/crash` (fault injection, only on a node started with
//! it and only with its token).

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use subtle_eq::constant_time_eq;

use super::error::ApiError;
use super::HttpState;
use crate::service::TierAdvert;

mod subtle_eq {
    /// Compares two byte strings in time that does not depend on where they differ.
    pub(super) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

/// `GET /v1/models`.
#[utoipa::path(get, path = "/v1/models", tag = "inference",
    responses(
        (status = 200, description = "The tiers this node hosts or can reach, and the cascade", body = ModelList),
        super::openapi::KeyErrors,
    ))]
pub(crate) async fn models(State(state): State<HttpState>) -> Json<ModelList> {
    let card = |id: &str, meta: Value| ModelCard {
        id: id.to_owned(),
        object: "model".into(),
        created: 0,
        owned_by: "mesh".into(),
        meta,
    };
    let table = state.service.engines().table();
    let mut data: Vec<ModelCard> = table
        .running
        .values()
        .map(|e| {
            let i = &e.desc.info;
            card(
                &i.name,
                json!({"n_params": i.n_params, "n_ctx_train": i.n_ctx_train, "max_seq_len": i.max_seq_len,
                       "n_seq_max": i.n_seq_max, "size_bytes": i.size_bytes}),
            )
        })
        .collect();
    for name in state.service.tier_names() {
        if !table.running.contains_key(&name) {
            data.push(card(&name, json!({"remote": true})));
        }
    }
    for name in state.service.embedding_models() {
        data.push(card(name, json!({"embedding": true})));
    }
    let c = state.service.cascade_policy();
    if c.tiers.iter().all(|t| data.iter().any(|m| &m.id == t)) {
        data.push(card(&c.model, json!({"cascade": c.tiers})));
    }
    data.sort_by(|a, b| a.id.cmp(&b.id));
    Json(ModelList {
        object: "list".into(),
        data,
    })
}

/// `GET /v1/models` answer (OpenAI's shape).
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub(crate) struct ModelList {
    /// `list`.
    object: String,
    /// The models.
    data: Vec<ModelCard>,
}

/// A model of `GET /v1/models`.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub(crate) struct ModelCard {
    /// The model id requests name.
    id: String,
    /// `model`.
    object: String,
    /// Always 0.
    created: u64,
    /// `mesh`.
    owned_by: String,
    /// Model facts, `remote: true` for a tier only peers host, or the cascade's tiers.
    #[schema(value_type = Object)]
    meta: Value,
}

fn tier_json(t: &TierAdvert) -> Value {
    json!({"name": t.name, "active": t.active, "queued": t.queued, "n_seq_max": t.n_seq_max,
           "max_seq_len": t.max_seq_len, "kv_cells": t.kv_cells, "kv_reserved": t.kv_reserved,
           "pages": t.pages.len(), "started": t.started, "queued_ms_total": t.queued_ms_total})
}

/// `GET /v1/cluster`: the members this node knows, its placement, its actors and its KV
/// pages by storage level.
#[utoipa::path(get, path = "/v1/cluster", tag = "inference",
    responses(
        (status = 200, description = "Members, their tiers, load and health; placement; actors", body = Object),
        super::openapi::KeyErrors,
    ))]
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
                    "build": m.build, "capabilities": m.capabilities, "wire": m.wire,
                    "pages_indexed": m.pages_indexed, "page_seq": m.page_seq,
                    "udp_tx_bytes": m.udp_bytes.0, "udp_rx_bytes": m.udp_bytes.1,
                    "stored_pages": m.stored_pages.iter().cloned().collect::<std::collections::BTreeMap<_, _>>(),
                    "tiers": m.tiers.iter().map(tier_json).collect::<Vec<_>>(),
                    "capacity": {"cores": m.capacity.cores, "cores_used": m.capacity.cores_used,
                        "free_bytes": m.capacity.free_bytes,
                        "loadable": m.capacity.loadable.iter().map(|l| json!({"name": l.name, "threads": l.threads, "bytes": l.bytes, "gpu_bytes": l.gpu_bytes})).collect::<Vec<_>>(),
                        "on_request": m.capacity.on_request,
                        "gpus": m.capacity.gpus.iter().map(|g| json!({"name": g.name, "description": g.description,
                            "memory_total": g.memory_total, "memory_free": g.memory_free})).collect::<Vec<_>>()},
                })
            })
            .collect(),
        None => {
            let tiers = state.service.engines().adverts(&[]);
            vec![json!({"node": "local", "local": true, "state": "alive", "quic_addr": null, "http_addr": null,
                "uptime_s": null, "last_seen_ms": 0, "tiers": tiers.iter().map(tier_json).collect::<Vec<_>>()})]
        }
    };
    let actors = state.service.node_actors().await;
    // This node's pages by storage level, per namespace.
    let store = state.service.store_stats().await;
    let page_levels: Vec<Value> = store
        .iter()
        .map(|n| {
            use std::sync::atomic::Ordering::Relaxed;
            let s = &n.stats;
            let mut pages =
                json!({"ram": s.pages_ram.load(Relaxed), "disk": s.pages_disk.load(Relaxed)});
            let mut bytes =
                json!({"ram": s.bytes_ram.load(Relaxed), "disk": s.bytes_disk.load(Relaxed)});
            if n.far_nodes.is_some() {
                pages["far"] = s.pages_far.load(Relaxed).into();
                bytes["far"] = s.bytes_far.load(Relaxed).into();
            }
            json!({"namespace": n.ns, "pages": pages, "bytes": bytes})
        })
        .collect();
    Json(json!({
        "clustered": state.service.cluster().is_some(),
        "members": members,
        "placement": state.service.placement(),
        "actors": actors,
        "page_levels": page_levels,
        "planner": state.service.planner_status(),
    }))
}

/// `GET /health`.
#[utoipa::path(get, path = "/health", tag = "node",
    responses((status = 200, description = "The process serves: `{\"status\": \"ok\"}`", body = Object)))]
pub(crate) async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

/// `GET /ready`.
#[utoipa::path(get, path = "/ready", tag = "node",
    responses(
        (status = 200, description = "Every configured tier is loaded", body = Object),
        (status = 503, description = "Still loading: `missing_tiers`", body = Object),
    ))]
pub(crate) async fn ready(State(state): State<HttpState>) -> Response {
    let table = state.service.engines().table();
    let missing: Vec<&String> = state
        .expected_tiers
        .iter()
        .filter(|t| !table.running.contains_key(*t))
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

/// `GET /metrics`.
#[utoipa::path(get, path = "/metrics", tag = "node",
    responses((status = 200, description = "Prometheus text exposition", content_type = "text/plain", body = String)))]
pub(crate) async fn metrics(State(state): State<HttpState>) -> Response {
    let store = state.service.store_stats().await;
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
