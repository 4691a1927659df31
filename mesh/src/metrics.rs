//! Prometheus metrics (`GET /metrics`, text format).
//!
//! Names follow Prometheus conventions (`mesh_` prefix, base units, `_total`
//! counters); label sets are bounded (model id, endpoint, status class).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use mesh_tiers::EngineStats;

/// Label: model id.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabel {
    /// Model (tier) id.
    pub model: String,
}

/// Label: endpoint and HTTP status.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabel {
    /// Route, e.g. `/v1/chat/completions`.
    pub endpoint: String,
    /// HTTP status code.
    pub status: u16,
}

/// All metrics of a node.
pub struct Metrics {
    registry: Registry,
    /// Finished HTTP requests.
    pub requests: Family<RequestLabel, Counter>,
    /// Prompt tokens processed.
    pub prompt_tokens: Family<ModelLabel, Counter>,
    /// Tokens generated.
    pub generation_tokens: Family<ModelLabel, Counter>,
    /// Time to first token.
    pub ttft: Family<ModelLabel, Histogram>,
    /// Time between consecutive tokens of one request.
    pub itl: Family<ModelLabel, Histogram>,
    /// Whole request latency.
    pub e2e: Family<ModelLabel, Histogram>,
    active: Family<ModelLabel, Gauge>,
    queued: Family<ModelLabel, Gauge>,
    kv_reserved: Family<ModelLabel, Gauge>,
    cancelled: Family<ModelLabel, Gauge>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

fn latency_family() -> Family<ModelLabel, Histogram> {
    Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.001, 2.0, 16)))
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("mesh");
        let m = Self {
            requests: Family::default(),
            prompt_tokens: Family::default(),
            generation_tokens: Family::default(),
            ttft: latency_family(),
            itl: latency_family(),
            e2e: latency_family(),
            active: Family::default(),
            queued: Family::default(),
            kv_reserved: Family::default(),
            cancelled: Family::default(),
            registry: Registry::default(),
        };
        registry.register(
            "http_requests",
            "HTTP requests by endpoint and status",
            m.requests.clone(),
        );
        registry.register(
            "prompt_tokens",
            "Prompt tokens processed",
            m.prompt_tokens.clone(),
        );
        registry.register(
            "generation_tokens",
            "Tokens generated",
            m.generation_tokens.clone(),
        );
        registry.register(
            "time_to_first_token_seconds",
            "Time to first token",
            m.ttft.clone(),
        );
        registry.register(
            "inter_token_latency_seconds",
            "Time between tokens of one request",
            m.itl.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "End-to-end request latency",
            m.e2e.clone(),
        );
        registry.register(
            "active_sequences",
            "Sequences holding an engine slot",
            m.active.clone(),
        );
        registry.register(
            "queued_requests",
            "Requests waiting for an engine slot",
            m.queued.clone(),
        );
        registry.register(
            "kv_reserved_cells",
            "KV cells reserved by running sequences",
            m.kv_reserved.clone(),
        );
        registry.register(
            "cancelled_requests",
            "Requests dropped because the client went away",
            m.cancelled.clone(),
        );
        Self { registry, ..m }
    }
}

impl Metrics {
    /// Text exposition, after refreshing gauges from the engines.
    pub fn render(&self, engines: &[(String, Arc<EngineStats>)]) -> String {
        for (model, s) in engines {
            let l = ModelLabel {
                model: model.clone(),
            };
            self.active
                .get_or_create(&l)
                .set(s.active.load(Ordering::Relaxed) as i64);
            self.queued
                .get_or_create(&l)
                .set(s.queued.load(Ordering::Relaxed) as i64);
            self.kv_reserved
                .get_or_create(&l)
                .set(s.reserved_cells.load(Ordering::Relaxed) as i64);
            self.cancelled
                .get_or_create(&l)
                .set(s.cancelled.load(Ordering::Relaxed) as i64);
        }
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }

    /// Label helper.
    pub fn model(model: &str) -> ModelLabel {
        ModelLabel {
            model: model.to_owned(),
        }
    }
}
