//! Per-client limits on `/v1` routes: a body declared larger than `max_body_bytes` gets 413
//! before it is read; a client over its rate or its requests in flight gets 429 with
//! `Retry-After`, in OpenAI's error shape. The client's in-flight slot is held until the
//! response body ends (a stream counts until its last event). What applies to whom is
//! decided in [`crate::limits`].

use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{ConnectInfo, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;
use hyper::body::{Frame, SizeHint};

use super::error::{ApiError, Dialect};
use super::HttpState;
use crate::keys::Principal;
use crate::limits::{client_id, client_limits, Admitted, Refused};
use crate::service::{Error, Kind};

/// The middleware.
pub(crate) async fn enforce(State(state): State<HttpState>, req: Request, next: Next) -> Response {
    if !req.uri().path().starts_with("/v1/") {
        return next.run(req).await;
    }
    let dialect = Dialect::of_path(req.uri().path());
    let metrics = state.service.metrics();
    let max = state.limiter.settings().max_body_bytes as u64;
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if let Some(n) = declared.filter(|&n| n > max) {
        metrics.limit_hit("body_size");
        return ApiError(Error::new(
            Kind::PayloadTooLarge,
            format!("the request body is {n} bytes; this node takes at most {max} (limits.max_body_bytes)"),
        ))
        .respond(dialect);
    }
    let principal = req.extensions().get::<Principal>().cloned();
    if !state.limiter.active(principal.as_ref()) {
        return next.run(req).await;
    }
    let peer = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip());
    let client = client_id(principal.as_ref(), peer);
    let limits = client_limits(
        state.limiter.settings(),
        principal.map(|p| p.limits).unwrap_or_default(),
    );
    match state.limiter.admit(&client, limits) {
        Ok(admitted) => next.run(req).await.map(|inner| {
            Body::new(Held {
                inner,
                _admitted: admitted,
            })
        }),
        Err(Refused::Rate {
            per_minute,
            retry_after_s,
        }) => {
            metrics.limit_hit("rate");
            ApiError(Error::busy(
                format!("rate limit reached: {per_minute} requests per minute for this client; retry in {retry_after_s} s"),
                retry_after_s,
            ))
            .respond(dialect)
        }
        Err(Refused::Concurrency { limit }) => {
            metrics.limit_hit("concurrency");
            ApiError(Error::busy(
                format!("this client already has {limit} requests in flight, its limit; retry when one ends"),
                1,
            ))
            .respond(dialect)
        }
    }
}

/// A response body that holds the client's in-flight slot until it ends.
struct Held {
    inner: Body,
    _admitted: Admitted,
}

impl HttpBody for Held {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
