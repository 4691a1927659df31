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
//! Beside them: [`config`], [`keys`] (API keys and scopes), [`metrics`], [`models`] (the model
//! pack and its cache), [`telemetry`], [`env`], and, with only the
//! `client` feature, the Rust client SDK ([`client`]), which does not build llama.cpp.
//!
//! Start a node in-process with [`start`]; the binary does the same behind `mesh up`.

#[cfg(feature = "client")]
pub mod client;
#[cfg(feature = "node")]
pub mod config;
#[cfg(feature = "node")]
pub mod deploy;
pub mod env;
#[cfg(feature = "node")]
pub mod http;
#[cfg(feature = "node")]
pub mod keys;
#[cfg(feature = "node")]
pub mod limits;
#[cfg(feature = "node")]
pub mod metrics;
#[cfg(feature = "node")]
pub mod models;
#[cfg(feature = "node")]
pub mod node;
#[cfg(feature = "node")]
pub mod service;
#[cfg(feature = "node")]
pub mod telemetry;

#[cfg(feature = "node")]
pub use node::{serve, start, Running};

#[cfg(all(test, feature = "node"))]
mod layers {
    use std::path::{Path, PathBuf};

    fn sources(dir: &Path) -> Vec<PathBuf> {
        let mut out = vec![];
        for e in std::fs::read_dir(dir).expect("source folder").flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(sources(&p));
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
        out
    }

    /// `http` → `service`, `node` → both, never back: the service layer imports neither the
    /// HTTP layer nor the node, and the HTTP layer does not import the node.
    #[test]
    fn layers_import_one_way() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut wrong = vec![];
        for (layer, forbidden) in [
            ("service", &["crate::http", "crate::node", "axum"][..]),
            ("http", &["crate::node"][..]),
        ] {
            for f in sources(&src.join(layer)) {
                let text = std::fs::read_to_string(&f).expect("readable source");
                for (i, line) in text.lines().enumerate() {
                    let code = line.split("//").next().unwrap_or("");
                    for bad in forbidden {
                        if code.contains(bad) {
                            wrong.push(format!("{}:{}: {}", f.display(), i + 1, line.trim()));
                        }
                    }
                }
            }
        }
        assert!(
            wrong.is_empty(),
            "imports against the layering:\n{}",
            wrong.join("\n")
        );
    }
}
