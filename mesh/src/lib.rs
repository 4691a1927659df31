//! mesh: an actor-based inference mesh for AI agents.
//!
//! This crate is the `mesh` binary's library, in three layers with imports pointing one
//! way (`http` → `service`; `node` → both):
//!
//! - [`http`]: axum handlers, OpenAI's wire types and SSE, one error type and code table;
//!   it only translates.
//! - [`service`]: what the node does for a request (chat, cascade, dispatch and failover,
//!   the agent loop, the live policy, what the tuner needs), with typed values in and out
//!   and no HTTP.
//! - [`node`]: assembly of the supervision tree (`mesh-actors`), placement, what peers call.
//!
//! Beside them: [`config`], [`metrics`], [`telemetry`], [`env`], and, with only the
//! `client` feature, the Rust client SDK ([`client`]), which does not build llama.cpp.
//!
//! Start a node in-process with [`start`]; the binary does the same behind `mesh up`.

#[cfg(feature = "client")]
pub mod client;
#[cfg(feature = "node")]
pub mod config;
pub mod env;
#[cfg(feature = "node")]
pub mod http;
#[cfg(feature = "node")]
pub mod metrics;
#[cfg(feature = "node")]
pub mod node;
#[cfg(feature = "node")]
pub mod service;
#[cfg(feature = "node")]
pub mod telemetry;

#[cfg(feature = "node")]
pub use node::{serve, start, Running};
