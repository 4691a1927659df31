//! mesh actors: every long-lived component of a node as a supervised ractor actor, and the
//! cluster those actors span.
//!
//! The supervision tree of a node ([`node`]):
//!
//! ```text
//! NodeSupervisor ──▶ membership MembershipActor  (cluster: heartbeats, peers, failure detection)
//!                ──▶ kv-store   PageStoreActor   (pagestore: RAM/far/disk pages, adverts)
//!                ──▶ engines    EnginesActor     (engines: supervises one TierActor per engine)
//!                ──▶ router     RouterActor      (router: embedder, catalog indexes)
//!                ──▶ embeddings EmbeddingsActor  (embeddings: models served at /v1/embeddings)
//!                ──▶ governor   GovernorActor    (governor: thinking budgets)
//!                ──▶ tuner      TunerActor       (tuner: policy state, cycles, reloads)
//!                ──▶ planner    PlannerActor     (planner: tier replicas across the cluster)
//! ```
//!
//! Decisions stay pure and tested apart from the actors: restart back-off and intensity
//! ([`supervisor`]), routing cost ([`routing`]), membership ([`membership`]), thinking
//! budgets ([`governor::budget`]), the tuner's rules (`mesh_control::tuner`), tier scaling
//! (`mesh_control::scaling`).
//!
//! The cluster: [`wire`] holds every message that crosses nodes (rkyv, versioned by the
//! frame header); [`remote`] the one generic way to call a named actor on another node
//! (envelopes, deadlines, streamed answers, errors as values); [`cluster`] the QUIC
//! connections, heartbeats with adverts and gossip, failure detection (the membership
//! actor). [`tasks`] tracks the long-lived tasks that are not actors.

pub mod cluster;
pub mod embeddings;
pub mod engines;
pub mod governor;
pub mod membership;
pub mod membership_sim;
pub mod node;
pub mod pagestore;
pub mod planner;
pub mod remote;
pub mod router;
pub mod routing;
pub mod seeds;
pub mod supervisor;
pub mod tasks;
pub mod tier;
pub mod tuner;
// rkyv derives undocumented `Archived*` twins of the wire types.
#[allow(missing_docs)]
pub mod wire;

pub use cluster::{CallError, Cluster, ClusterConfig, InflightGuard, MemberView};
