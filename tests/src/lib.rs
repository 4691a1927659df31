//! Multi-node integration tests: `tests/cluster.rs` starts real `mesh join`
//! processes on 127.0.0.1 (built by `cargo test --workspace` as the `mesh` package's
//! binary) and checks membership, routing, failover, certificates and frame handling.
