//! Per-client limits: requests per minute and requests in flight, per API key (per client
//! address on a node without keys). What applies to a client is decided here from the
//! node's `[limits]` and the key's own limits; the rate itself is kept by `governor`
//! (GCRA, one state per client), the in-flight count by a semaphore per client. The HTTP
//! layer asks [`Limiter::admit`] once per request and holds the [`Admitted`] until the
//! response body ends.

use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::LimitSettings;
use crate::keys::{KeyLimits, Principal};

/// The limits one client gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientLimits {
    /// Requests per minute and the burst before it applies; `None`: no rate limit.
    pub rate: Option<(NonZeroU32, NonZeroU32)>,
    /// Requests in flight; `None`: no per-client limit.
    pub concurrency: Option<NonZeroU32>,
}

/// The limits for a client with key limits `own` on a node with `node`: the key's own
/// values win over the node's per-key defaults. A burst of 0 means one second's worth of
/// the rate, at least one request.
pub fn client_limits(node: &LimitSettings, own: KeyLimits) -> ClientLimits {
    let rpm = own.rpm.unwrap_or(node.requests_per_minute);
    let rate = NonZeroU32::new(rpm).map(|per_min| {
        let burst = match node.burst {
            0 => per_min.get().div_ceil(60),
            b => b,
        };
        (per_min, NonZeroU32::new(burst).unwrap_or(NonZeroU32::MIN))
    });
    let concurrency = NonZeroU32::new(own.concurrency.unwrap_or(node.concurrent_per_key));
    ClientLimits { rate, concurrency }
}

/// Who a request counts against: its key, else the client's address.
pub fn client_id(principal: Option<&Principal>, peer: Option<IpAddr>) -> String {
    match (principal, peer) {
        (Some(p), _) => format!("key:{}", p.id),
        (None, Some(ip)) => format!("ip:{ip}"),
        (None, None) => "anonymous".to_owned(),
    }
}

/// Whole seconds to tell a client to wait (`Retry-After`): `wait` rounded up, at least 1.
pub fn retry_after_s(wait: Duration) -> u64 {
    let s = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    s.max(1)
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// Over the client's rate; retry after this many seconds.
    Rate {
        /// Requests per minute the client has.
        per_minute: u32,
        /// Seconds until a request would pass.
        retry_after_s: u64,
    },
    /// The client has this many requests in flight already.
    Concurrency {
        /// Its limit.
        limit: u32,
    },
}

/// Held while a request runs (its response body included): the client's in-flight slot.
pub struct Admitted {
    _permit: Option<OwnedSemaphorePermit>,
}

/// Client state past this many clients is dropped for clients with nothing in flight.
const MAX_CLIENTS: usize = 4096;

struct Client {
    limits: ClientLimits,
    rate: Option<DefaultDirectRateLimiter>,
    inflight: Option<Arc<Semaphore>>,
}

impl Client {
    fn new(limits: ClientLimits) -> Self {
        Self {
            limits,
            rate: limits.rate.map(|(per_min, burst)| {
                RateLimiter::direct(Quota::per_minute(per_min).allow_burst(burst))
            }),
            inflight: limits
                .concurrency
                .map(|n| Arc::new(Semaphore::new(n.get() as usize))),
        }
    }

    fn idle(&self) -> bool {
        self.inflight.as_ref().is_none_or(|s| {
            Some(s.available_permits() as u32) == self.limits.concurrency.map(NonZeroU32::get)
        })
    }
}

/// The per-client limit state of a node.
pub struct Limiter {
    settings: LimitSettings,
    clients: DashMap<String, Arc<Client>>,
}

impl Limiter {
    /// A limiter with the node's `[limits]`.
    pub fn new(settings: LimitSettings) -> Self {
        Self {
            settings,
            clients: DashMap::new(),
        }
    }

    /// The node's `[limits]`.
    pub fn settings(&self) -> &LimitSettings {
        &self.settings
    }

    /// Whether any per-client limit can apply (a node without them skips the lookup).
    pub fn active(&self, principal: Option<&Principal>) -> bool {
        let l = client_limits(
            &self.settings,
            principal.map(|p| p.limits).unwrap_or_default(),
        );
        l.rate.is_some() || l.concurrency.is_some()
    }

    /// Admits one request of `client` (limits `limits`), or says why not. A refused
    /// request does not use up the client's rate.
    pub fn admit(&self, client: &str, limits: ClientLimits) -> Result<Admitted, Refused> {
        let c = self.client(client, limits);
        let permit = match &c.inflight {
            Some(s) => Some(
                s.clone()
                    .try_acquire_owned()
                    .map_err(|_| Refused::Concurrency {
                        limit: limits.concurrency.map_or(0, NonZeroU32::get),
                    })?,
            ),
            None => None,
        };
        if let Some(rate) = &c.rate {
            if let Err(not_until) = rate.check() {
                let wait = not_until.wait_time_from(DefaultClock::default().now());
                return Err(Refused::Rate {
                    per_minute: limits.rate.map_or(0, |(r, _)| r.get()),
                    retry_after_s: retry_after_s(wait),
                });
            }
        }
        Ok(Admitted { _permit: permit })
    }

    fn client(&self, id: &str, limits: ClientLimits) -> Arc<Client> {
        if let Some(c) = self.clients.get(id) {
            if c.limits == limits {
                return c.clone();
            }
        }
        if self.clients.len() >= MAX_CLIENTS {
            self.clients.retain(|_, c| !c.idle());
        }
        let c = Arc::new(Client::new(limits));
        self.clients.insert(id.to_owned(), c.clone());
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(rpm: u32, burst: u32, conc: u32) -> LimitSettings {
        LimitSettings {
            requests_per_minute: rpm,
            burst,
            concurrent_per_key: conc,
            ..LimitSettings::default()
        }
    }

    #[test]
    fn no_limits_by_default() {
        let l = client_limits(&LimitSettings::default(), KeyLimits::default());
        assert_eq!((l.rate, l.concurrency), (None, None));
    }

    #[test]
    fn a_keys_own_limits_replace_the_nodes() {
        let own = KeyLimits {
            rpm: Some(6),
            concurrency: Some(1),
        };
        let l = client_limits(&node(600, 10, 8), own);
        assert_eq!(l.rate.map(|(r, _)| r.get()), Some(6));
        assert_eq!(l.concurrency.map(NonZeroU32::get), Some(1));
    }

    #[test]
    fn burst_zero_is_one_seconds_worth_and_at_least_one() {
        assert_eq!(
            client_limits(&node(600, 0, 0), KeyLimits::default())
                .rate
                .unwrap()
                .1
                .get(),
            10
        );
        assert_eq!(
            client_limits(&node(6, 0, 0), KeyLimits::default())
                .rate
                .unwrap()
                .1
                .get(),
            1
        );
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(retry_after_s(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_s(Duration::from_millis(2001)), 3);
        assert_eq!(retry_after_s(Duration::ZERO), 1);
    }

    #[test]
    fn a_client_is_its_key_before_its_address() {
        let p = Principal {
            id: "0badcafe".into(),
            scopes: vec![],
            tools: None,
            limits: KeyLimits::default(),
        };
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        assert_eq!(client_id(Some(&p), Some(ip)), "key:0badcafe");
        assert_eq!(client_id(None, Some(ip)), "ip:10.0.0.1");
    }

    #[test]
    fn requests_past_the_burst_are_refused_with_a_wait() {
        let lim = Limiter::new(node(60, 2, 0));
        let l = client_limits(&lim.settings, KeyLimits::default());
        assert!(lim.admit("a", l).is_ok() && lim.admit("a", l).is_ok());
        assert!(matches!(
            lim.admit("a", l),
            Err(Refused::Rate {
                per_minute: 60,
                retry_after_s: 1
            })
        ));
    }

    #[test]
    fn clients_have_separate_rates() {
        let lim = Limiter::new(node(60, 1, 0));
        let l = client_limits(&lim.settings, KeyLimits::default());
        assert!(lim.admit("a", l).is_ok());
        assert!(lim.admit("b", l).is_ok());
    }

    #[test]
    fn in_flight_past_the_limit_is_refused_until_one_ends() {
        let lim = Limiter::new(node(0, 0, 1));
        let l = client_limits(&lim.settings, KeyLimits::default());
        let first = lim.admit("a", l).unwrap();
        assert!(matches!(
            lim.admit("a", l),
            Err(Refused::Concurrency { limit: 1 })
        ));
        drop(first);
        assert!(lim.admit("a", l).is_ok());
    }

    #[test]
    fn a_refused_request_does_not_use_up_the_rate() {
        let lim = Limiter::new(node(60, 2, 1));
        let l = client_limits(&lim.settings, KeyLimits::default());
        let held = lim.admit("a", l).unwrap();
        assert!(matches!(
            lim.admit("a", l),
            Err(Refused::Concurrency { .. })
        ));
        drop(held);
        // The burst of two: one went to the first request, the refused one took none.
        assert!(lim.admit("a", l).is_ok());
    }
}
