//! The `mesh` package's integration tests: the gateway, the client SDK and the agent layer against real nodes (in-process or `mesh up` processes).
//!
//! One test binary per package (`cargo test --release --workspace --test integration`),
//! so the dependency graph is linked once; each file is a module, and a test is still
//! picked by name or by module, e.g. `--test integration agent::`.

mod agent;
mod anthropic_client;
mod auth;
mod cascade;
mod client_sdk;
mod common;
mod gateway;
mod limits;
mod models_pull;
mod openai_client;
mod openapi;
mod process;
mod real_model;
mod spec_gateway;
mod tool_routing;
mod trace_context;
mod tuner;
