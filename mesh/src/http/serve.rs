//! The gateway's accept loop: at most `max_connections` client connections at once (more
//! wait in the listen backlog until one closes), and an HTTP/1 connection that has not sent
//! a request's headers within `header_read_timeout` is closed, so idle or half-open
//! connections cannot hold the slots. Each request carries its peer address
//! (`ConnectInfo<SocketAddr>`). On shutdown the loop stops accepting and waits for open
//! connections to finish their requests.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tower::ServiceExt;

use crate::metrics::Metrics;

/// Connection limits of the accept loop.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// Client connections open at once.
    pub max_connections: usize,
    /// Time a connection has to send a request's headers.
    pub header_read_timeout: Duration,
}

/// Serves `app` on `listener` until `shutdown` completes, then waits for open connections.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            s = slots.clone().acquire_owned() => s.expect("the connection semaphore is never closed"),
            () = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors and the like: wait rather than spin.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        metrics.connection_opened();
        let service = app
            .clone()
            .map_request(move |mut req: axum::http::Request<Incoming>| {
                req.extensions_mut().insert(ConnectInfo(peer));
                req.map(axum::body::Body::new)
            });
        let conn = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), TowerToHyperService::new(service))
            .into_owned();
        let conn = graceful.watch(conn);
        let metrics = metrics.clone();
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                if is_header_timeout(e.as_ref()) {
                    metrics.limit_hit("header_timeout");
                }
                tracing::debug!(%peer, error = %e, "client connection ended with an error");
            }
            metrics.connection_closed();
            drop(slot);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

fn is_header_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(h) = err.downcast_ref::<hyper::Error>() {
            if h.is_timeout() {
                return true;
            }
        }
        cur = err.source();
    }
    false
}
