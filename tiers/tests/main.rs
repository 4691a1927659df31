//! The `mesh-tiers` package's integration tests: the llama.cpp engine, templates, parsers and speculative decoding on real GGUF models.
//!
//! One test binary per package (`cargo test --release --workspace --test integration`),
//! so the dependency graph is linked once; each file is a module, and a test is still
//! picked by name or by module, e.g. `--test integration bundled_models::`.

mod bundled_models;
mod embedding;
mod engine;
mod kv_pages;
mod output_parser_props;
mod parse_props;
mod parser_cases;
mod speculative;
mod templates;
