//! Logging and tracing set-up.
//!
//! Logs go to stderr (`RUST_LOG`, default `info`). When
//! `OTEL_EXPORTER_OTLP_ENDPOINT` is set, spans are also exported over OTLP/gRPC
//! with a batch exporter on its own thread: a missing collector costs one
//! logged export error per batch and never blocks a request.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

use crate::env;

/// Keeps the exporter alive; flushes pending spans on drop.
#[derive(Debug, Default)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            let _ = p.shutdown();
        }
    }
}

/// Installs the global subscriber. `service` names this process in traces (e.g. `mesh@node-a`).
pub fn init(service: &str) -> Telemetry {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_target(false);
    let endpoint = std::env::var(env::OTLP_ENDPOINT)
        .ok()
        .filter(|s| !s.is_empty());
    let Some(endpoint) = endpoint else {
        let _ = tracing_subscriber::registry()
            .with(filter)
            .with(fmt)
            .try_init();
        return Telemetry::default();
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build();
    match exporter {
        Ok(exporter) => {
            let resource = opentelemetry_sdk::Resource::builder()
                .with_service_name(service.to_owned())
                .build();
            let provider = SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_resource(resource)
                .build();
            let tracer = provider.tracer("mesh");
            opentelemetry::global::set_text_map_propagator(
                opentelemetry_sdk::propagation::TraceContextPropagator::new(),
            );
            let otel = tracing_opentelemetry::layer().with_tracer(tracer);
            let _ = tracing_subscriber::registry()
                .with(filter)
                .with(fmt)
                .with(otel)
                .try_init();
            tracing::info!(%endpoint, "exporting traces over OTLP");
            Telemetry {
                provider: Some(provider),
            }
        }
        Err(e) => {
            let _ = tracing_subscriber::registry()
                .with(filter)
                .with(fmt)
                .try_init();
            tracing::warn!(error = %e, %endpoint, "OTLP exporter not started; traces stay local");
            Telemetry::default()
        }
    }
}

/// The trace id of `span` as Jaeger shows it (32 hex digits), when spans are exported.
pub fn trace_id(span: &tracing::Span) -> Option<String> {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| sc.trace_id().to_string())
}

/// Trace context of the current span, as wire headers (W3C `traceparent`, `tracestate`).
pub fn inject_context() -> Vec<mesh_actors::wire::Header> {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let cx = tracing::Span::current().context();
    let mut map: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&cx, &mut map));
    map.into_iter()
        .map(|(key, value)| mesh_actors::wire::Header { key, value })
        .collect()
}

/// The trace context a caller sent in wire headers.
pub fn extract_context(headers: &[mesh_actors::wire::Header]) -> opentelemetry::Context {
    let map: std::collections::HashMap<String, String> = headers
        .iter()
        .map(|h| (h.key.clone(), h.value.clone()))
        .collect();
    opentelemetry::global::get_text_map_propagator(|p| p.extract(&map))
}
