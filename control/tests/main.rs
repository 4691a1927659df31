//! The `mesh-control` package's integration tests: the tool router and the MCP client.
//!
//! One test binary per package (`cargo test --release --workspace --test integration`),
//! so the dependency graph is linked once; each file is a module, and a test is still
//! picked by name or by module, e.g. `--test integration mcp::`.

mod mcp;
mod router;
