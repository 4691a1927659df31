//! The control layer of mesh: decisions about a request that need no model tier.
//!
//! Built today: the **semantic tool router**. An agent may carry hundreds or thousands
//! of tool schemas; sending all of them costs prompt tokens on every call and makes a
//! small tier pick the wrong tool. The router embeds each tool once
//! ([`embed::Embedder`], llama.cpp + the bundled all-MiniLM-L6-v2, cached by content
//! hash), finds the tools nearest to the user's intent ([`index`]: exact SIMD scan, or
//! an int8 scan with exact re-rank for large catalogs), re-ranks with BM25 when the
//! embedding is unsure ([`lexical`]), and always keeps the tools the request forces
//! ([`router::ToolRouter`]). `docs/tool-router.md` has its measured recall on the
//! Berkeley Function-Calling Leaderboard data and its latency.
//!
//! Caveats: the embedder blocks its caller (call it from `spawn_blocking` in async
//! code); MiniLM is English-only and cuts texts at 256 tokens; the router's catalog is
//! immutable (rebuild it, the cache makes that cheap).
//!
//! Also here: the host's topology ([`topology`], hwloc) and the placement of tier threads
//! on its cores ([`placement`]); page memory on far NUMA nodes for the KV page store
//! ([`farmem`]); the tuner's rules ([`tuner`]), statistical gate
//! ([`gate`]), knobs and policy state file ([`policy`]) (`docs/tuner.md`).
//!
//! On a node the tuner actor (`mesh-actors`) runs these decisions; `mesh/src/http/control.rs` serves them.

pub mod embed;
mod error;
pub mod farmem;
pub mod gate;
pub mod index;
pub mod lexical;
pub mod mcp;
pub mod placement;
pub mod policy;
pub mod router;
pub mod scaling;
pub mod spec_tools;
pub mod topology;
pub mod tuner;

pub use embed::{Embedded, Embedder, EmbedderConfig, TextRole};
pub use error::ControlError;
pub use index::{FlatIndex, Hit, QuantizedIndex, VectorIndex};
pub use router::{Confidence, Routed, RouterConfig, Routing, Tool, ToolRouter, ToolText};
