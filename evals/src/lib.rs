//! Evaluation programs of mesh, and the code only they use.
//!
//! The programs are this crate's examples (`cargo build --release --workspace --all-targets`
//! builds them into `target/release/examples/`):
//!
//! | program | measures | doc |
//! |---|---|---|
//! | `model_card` | the bundled tiers on the held-out tasks, per task kind | `models/CARD.md` |
//! | `cascade_eval` | the tier cascade, speculative decoding and the reasoning governor on the held-out tasks | `docs/cascade.md` |
//! | `spec_serving` | the serving engine with and without a draft model | `docs/cascade.md` |
//! | `verify_cost` | what a verification batch of n rows costs against one row | `docs/cascade.md` |
//! | `bfcl_router` | the tool router on BFCL's function catalogs | `docs/tool-router.md` |
//! | `multistep_router` | routing per step of BFCL's multi-turn agent tasks ([`multistep`]) | `docs/tool-router.md` |
//! | `livemcp_router` | routing on LiveMCPBench's MCP catalog and multi-tool tasks ([`livemcp`]) | `docs/tool-router.md` |
//! | `router_scores` | the router's confidence per held-out task (for `cascade_eval --router-scores`) | `docs/cascade.md` |
//! | `tuner_trial` | one tuner trial on a real engine | `docs/tuner.md` |
//!
//! [`trial`] runs A/B probe windows on an engine directly (the node's tuner runs its
//! probes through the node's request path instead).

pub mod bfcl;
pub mod livemcp;
pub mod multistep;
pub mod routing;
pub mod trial;
pub mod vectors;
