//! A request entering node A's gateway and served by node B's tier produces one
//! trace: B's `tier.generate` span is a child of A's gateway span (W3C trace
//! context carried in the wire call).

use std::time::Duration;

use mesh::config::{bundled_tiers, ClusterSettings, NodeConfig};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use tracing_subscriber::layer::SubscriberExt;

fn node(name: &str, certs: &std::path::Path, tiers: &[&str], seeds: Vec<String>) -> NodeConfig {
    let models = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models");
    let mut t = bundled_tiers(&models);
    t.retain(|c| tiers.contains(&c.name.as_str()));
    for c in &mut t {
        c.n_ctx = 2048;
        c.n_seq_max = 2;
    }
    NodeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        tiers: t,
        cluster: Some(ClusterSettings {
            name: name.into(),
            listen: "127.0.0.1:0".parse().unwrap(),
            seeds,
            cert_dir: certs.to_path_buf(),
            heartbeat_ms: 100,
            failure_timeout_ms: 1000,
            ..ClusterSettings::default()
        }),
        ..NodeConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tier_span_on_other_node_is_child_of_gateway_span() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    opentelemetry::global::set_text_map_propagator(
        opentelemetry_sdk::propagation::TraceContextPropagator::new(),
    );
    let subscriber = tracing_subscriber::registry()
        .with(tracing_subscriber::EnvFilter::new("info"))
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    tracing::subscriber::set_global_default(subscriber).unwrap();

    let dir = tempfile::tempdir().unwrap();
    mesh_transport::tls::init_ca(dir.path(), "trace").unwrap();
    for n in ["serving", "entry"] {
        mesh_transport::tls::issue(dir.path(), n).unwrap();
    }
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stop = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.changed().await;
    };
    let b = mesh::start(
        node("serving", dir.path(), &["t1"], vec![]),
        stop(stop_rx.clone()),
    )
    .await
    .unwrap();
    let seed = b.cluster.as_ref().unwrap().quic_addr().to_owned();
    let a = mesh::start(node("entry", dir.path(), &[], vec![seed]), stop(stop_rx))
        .await
        .unwrap();

    let http = reqwest::Client::new();
    let url = format!("http://{}/v1/chat/completions", a.addr);
    let body = serde_json::json!({"model": "t1", "max_tokens": 8,
        "messages": [{"role": "user", "content": "What is the weather in Oslo?"}]});
    let mut ok = false;
    for _ in 0..100 {
        // The entry node learns about t1 from the first heartbeat.
        let r = http.post(&url).json(&body).send().await.unwrap();
        if r.status().is_success() {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ok, "the entry gateway never served t1");

    let mut found = None;
    for _ in 0..100 {
        let spans = exporter.get_finished_spans().unwrap();
        let tier = spans.iter().find(|s| {
            s.name == "tier.generate"
                && s.attributes
                    .iter()
                    .any(|kv| kv.key.as_str() == "mesh.remote")
        });
        if let Some(tier) = tier {
            let trace = tier.span_context.trace_id();
            if spans
                .iter()
                .any(|s| s.name == "gateway.chat" && s.span_context.trace_id() == trace)
            {
                found = Some((tier.clone(), spans.clone()));
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (tier, spans) = found.expect("the remote tier span shares a trace with a gateway span");
    // Its parent is a span of the entry node (tier.submit under gateway.chat), received over the wire.
    let parent = spans
        .iter()
        .find(|s| s.span_context.span_id() == tier.parent_span_id)
        .expect("parent span exported");
    assert_eq!(parent.span_context.trace_id(), tier.span_context.trace_id());
    assert_eq!(parent.name, "tier.submit");
    assert!(tier.parent_span_is_remote, "the parent came over the wire");
    let _ = stop_tx.send(true);
}
