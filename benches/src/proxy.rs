//! `mesh-bench proxy`: the load balancer the fleet benchmark puts in front of every fleet, as
//! users put nginx or LiteLLM in front of llama-server replicas.
//!
//! What it does, and nothing more: each HTTP request is forwarded whole (method, path, query,
//! body, `content-type` / `authorization` / `x-api-key` headers) to one backend chosen by the
//! policy, and the backend's status, `content-type` and body come back as they arrive
//! (streamed, so SSE chunks are not held back). `round-robin` takes the backends in turn;
//! `session` hashes the `x-session-id` header (FNV-1a, modulo the backend count; requests
//! without it go round-robin), the stickiness `hash $http_x_session_id` gives in nginx. A
//! backend that cannot be reached answers 502; the proxy does not retry or health-check,
//! as a plain load balancer with one upstream group does not. `GET /proxy/health` is the
//! proxy's own.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

/// How the proxy picks a backend.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Policy {
    /// Backends in turn.
    RoundRobin,
    /// The `x-session-id` header's hash picks the backend.
    Session,
}

impl Policy {
    pub(crate) fn arg(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round-robin",
            Policy::Session => "session",
        }
    }
}

/// Options of `mesh-bench proxy`.
#[derive(clap::Args, Debug)]
pub(crate) struct ProxyArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8090")]
    listen: SocketAddr,
    /// Backend base URL (repeatable), e.g. `http://127.0.0.1:8081`.
    #[arg(long = "backend", required = true)]
    backends: Vec<String>,
    /// How a request's backend is chosen.
    #[arg(long, value_enum, default_value = "round-robin")]
    policy: Policy,
}

/// The header the `session` policy hashes.
pub(crate) const SESSION_HEADER: &str = "x-session-id";

/// The backend index for one request: `session` policy with a session id hashes it,
/// otherwise the next in turn (`turn` is the request counter). Pure.
pub(crate) fn pick(policy: Policy, session: Option<&[u8]>, turn: usize, n: usize) -> usize {
    match (policy, session) {
        (Policy::Session, Some(id)) => (fnv1a(id) % n as u64) as usize,
        _ => turn % n,
    }
}

/// FNV-1a, 64 bit.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

struct Upstreams {
    backends: Vec<String>,
    policy: Policy,
    turn: AtomicUsize,
    client: reqwest::Client,
}

/// Headers passed through to the backend.
const FORWARDED: [&str; 4] = ["content-type", "authorization", "x-api-key", "accept"];

async fn forward(State(up): State<Arc<Upstreams>>, req: Request) -> Response {
    let session = req
        .headers()
        .get(SESSION_HEADER)
        .map(|v| v.as_bytes().to_vec());
    let turn = up.turn.fetch_add(1, Ordering::Relaxed);
    let i = pick(up.policy, session.as_deref(), turn, up.backends.len());
    let path = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    let url = format!("{}{path}", up.backends[i]);
    let method = req.method().clone();
    let mut headers = reqwest::header::HeaderMap::new();
    for name in FORWARDED {
        if let Some(v) = req.headers().get(name) {
            headers.insert(HeaderName::from_static(name), v.clone());
        }
    }
    let body = match axum::body::to_bytes(req.into_body(), 64 << 20).await {
        Ok(b) => b,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("reading body: {e}")).into_response(),
    };
    let resp = match up
        .client
        .request(method, &url)
        .headers(headers)
        .body(body)
        .send()
        .await
    {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_GATEWAY, format!("backend {url}: {e}")).into_response(),
    };
    let mut out = Response::builder().status(resp.status());
    for name in ["content-type", "retry-after"] {
        if let Some(v) = resp.headers().get(name) {
            out = out.header(name, v.clone());
        }
    }
    out.body(Body::from_stream(resp.bytes_stream()))
        .unwrap_or_else(|e| (StatusCode::BAD_GATEWAY, e.to_string()).into_response())
}

/// Runs the proxy until the process is stopped.
pub(crate) async fn run(a: ProxyArgs) -> Result<()> {
    if a.backends.is_empty() {
        bail!("give at least one --backend");
    }
    for b in &a.backends {
        if !(b.starts_with("http://") || b.starts_with("https://")) || b.ends_with('/') {
            bail!("--backend {b}: give a base URL such as http://127.0.0.1:8081 (no trailing /)");
        }
    }
    let up = Arc::new(Upstreams {
        backends: a.backends.clone(),
        policy: a.policy,
        turn: AtomicUsize::new(0),
        // One connection per request, as the driver does: llama-server may close a
        // connection after a streamed reply.
        client: reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .tcp_nodelay(true)
            .build()?,
    });
    let app = Router::new()
        .route("/proxy/health", get(|| async { "ok" }))
        .fallback(forward)
        .with_state(up);
    let listener = tokio::net::TcpListener::bind(a.listen)
        .await
        .with_context(|| format!("binding {}", a.listen))?;
    println!(
        "proxy ({}) on http://{} -> {}",
        a.policy.arg(),
        listener.local_addr()?,
        a.backends.join(" ")
    );
    axum::serve(listener, app).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_takes_backends_in_turn_whatever_the_session() {
        let picks: Vec<usize> = (0..6)
            .map(|t| pick(Policy::RoundRobin, Some(b"s1"), t, 3))
            .collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn session_policy_keeps_a_session_on_one_backend() {
        let first = pick(Policy::Session, Some(b"session-7"), 0, 3);
        for t in 1..20 {
            assert_eq!(pick(Policy::Session, Some(b"session-7"), t, 3), first);
        }
    }

    #[test]
    fn session_policy_spreads_sessions_over_backends() {
        let mut used = [0usize; 3];
        for s in 0..60 {
            used[pick(Policy::Session, Some(format!("s{s}").as_bytes()), 0, 3)] += 1;
        }
        assert!(used.iter().all(|&n| n >= 10), "{used:?}");
    }

    /// A backend answering every request with its own name.
    async fn backend(name: &'static str) -> String {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let app = Router::new().fallback(move || async move { name });
        tokio::spawn(async move { axum::serve(l, app).await });
        url
    }

    /// Starts the proxy in front of `backends`; its base URL once it answers.
    async fn proxy(backends: Vec<String>, policy: Policy) -> String {
        let port = crate::server::free_port().unwrap();
        let listen: SocketAddr = ([127, 0, 0, 1], port).into();
        tokio::spawn(run(ProxyArgs {
            listen,
            backends,
            policy,
        }));
        let base = format!("http://{listen}");
        for _ in 0..200 {
            if reqwest::get(format!("{base}/proxy/health")).await.is_ok() {
                return base;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("proxy did not start");
    }

    async fn get(url: &str, session: Option<&str>) -> (u16, String) {
        let mut req = reqwest::Client::new().post(url).body("{}");
        if let Some(s) = session {
            req = req.header(SESSION_HEADER, s);
        }
        let r = req.send().await.unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    }

    #[tokio::test]
    async fn requests_reach_the_backends_in_turn() {
        let base = proxy(
            vec![backend("a").await, backend("b").await],
            Policy::RoundRobin,
        )
        .await;
        let mut seen = Vec::new();
        for _ in 0..4 {
            seen.push(get(&format!("{base}/v1/completions"), Some("s")).await.1);
        }
        assert_eq!(seen, ["a", "b", "a", "b"]);
    }

    #[tokio::test]
    async fn a_session_stays_on_its_backend() {
        let base = proxy(
            vec![backend("a").await, backend("b").await],
            Policy::Session,
        )
        .await;
        let first = get(&format!("{base}/x"), Some("session-3")).await.1;
        for _ in 0..4 {
            assert_eq!(get(&format!("{base}/x"), Some("session-3")).await.1, first);
        }
    }

    #[tokio::test]
    async fn an_unreachable_backend_answers_502() {
        let dead = format!("http://127.0.0.1:{}", crate::server::free_port().unwrap());
        let base = proxy(vec![dead], Policy::RoundRobin).await;
        let (status, body) = get(&format!("{base}/v1/completions"), None).await;
        assert_eq!(status, 502);
        assert!(body.contains("backend"), "{body}");
    }

    #[tokio::test]
    async fn a_backend_url_with_a_trailing_slash_is_refused() {
        let e = run(ProxyArgs {
            listen: ([127, 0, 0, 1], 0).into(),
            backends: vec!["http://127.0.0.1:1/".into()],
            policy: Policy::RoundRobin,
        })
        .await
        .unwrap_err();
        assert!(e.to_string().contains("no trailing /"), "{e}");
    }

    #[test]
    fn session_policy_without_a_session_goes_round_robin() {
        assert_eq!(pick(Policy::Session, None, 4, 3), 1);
    }
}
