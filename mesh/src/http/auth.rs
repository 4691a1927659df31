//! Bearer-key authentication for every `/v1` route of a node that has keys: a request
//! without a key of this node gets 401, one whose key lacks the route's scope 403, both in
//! the route's error shape. The key comes as `Authorization: Bearer` or, as Anthropic's
//! clients send it, `x-api-key`. The key that passed travels with the request (an extension) for
//! handlers that check more (agent tasks: which tools it may run). What a route needs and
//! what a key may do are decided in [`crate::keys`].

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;

use super::error::{ApiError, Dialect};
use super::HttpState;
use crate::keys::{required_scope, Refusal};
use crate::service::{Error, Kind};

/// The middleware.
pub(crate) async fn require_key(
    State(state): State<HttpState>,
    mut req: Request,
    next: Next,
) -> Response {
    let Some(keys) = &state.keys else {
        return next.run(req).await;
    };
    let Some(scope) = required_scope(req.uri().path()) else {
        return next.run(req).await;
    };
    let dialect = Dialect::of_path(req.uri().path());
    let header = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or_else(|| {
            req.headers()
                .get("x-api-key")
                .and_then(|v| v.to_str().ok())
                .map(|k| format!("Bearer {k}"))
        });
    let refused = |kind, msg: String| {
        state
            .service
            .metrics()
            .auth_refused(kind == Kind::Unauthenticated);
        ApiError(Error::new(kind, msg)).respond(dialect)
    };
    let principal = match keys.check(header.as_deref()) {
        Ok(p) => p,
        Err(Refusal::Missing) => {
            return refused(
                Kind::Unauthenticated,
                "this node needs an API key: send `Authorization: Bearer <key>` or `x-api-key: <key>` (keys are made by `mesh keys create`)".into(),
            )
        }
        Err(Refusal::Invalid) => {
            return refused(
                Kind::Unauthenticated,
                "the API key is not one of this node's".into(),
            )
        }
    };
    if !principal.has(scope) {
        return refused(
            Kind::PermissionDenied,
            format!(
                "key {} lacks the `{}` scope that {} needs",
                principal.id,
                scope.as_str(),
                req.uri().path()
            ),
        );
    }
    req.extensions_mut().insert(principal);
    next.run(req).await
}
