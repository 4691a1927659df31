//! The `mesh-transport` package's integration tests.
//!
//! One test binary per package (`cargo test --release --workspace --test integration`),
//! so the dependency graph is linked once; each file is a module, and a test is still
//! picked by name or by module, e.g. `--test integration frame_props::`.

mod frame_props;
