//! Multi-node integration tests: real `mesh` processes started by the tests.
//!
//! One test binary per package (`cargo test --release --workspace --test integration`),
//! so the dependency graph is linked once; each file is a module, and a test is still
//! picked by name or by module, e.g. `--test integration arm64::`.

mod arm64;
mod clients;
mod cluster;
mod faults;
mod fleet;
mod gpu;
mod kv_fabric;
mod no_host;
mod otlp_trace;
mod page_events;
mod partition;
mod placement;
mod quant_reload;
mod roles;
mod scaling;
mod shapes;
mod split;
mod upgrade;
