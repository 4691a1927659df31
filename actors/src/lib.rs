//! mesh actors layer: the cluster a node belongs to.
//!
//! - [`wire`]: every message that crosses nodes (rkyv, versioned by the frame header).
//! - [`membership`]: the membership table and failure detector (pure logic).
//! - [`routing`]: which node serves a request (pure cost function).
//! - [`cluster`]: the I/O: one QUIC connection per peer, heartbeats carrying adverts and
//!   gossip, failure detection, remote generate/tokenize calls with streamed replies.
//!
//! Remote calls end at the callee's tier actors (ractor) through the [`cluster::Service`]
//! the node implements; the node's supervisor restarts a crashed tier actor, and a call
//! that was on it fails with a retryable error that the gateway re-runs elsewhere.

pub mod cluster;
pub mod membership;
pub mod routing;
// rkyv derives undocumented `Archived*` twins of the wire types.
#[allow(missing_docs)]
pub mod wire;

pub use cluster::{CallError, Cluster, ClusterConfig, InflightGuard, MemberView, Service};
