//! Model tiers for mesh.
//!
//! A tier is one GGUF model served by one llama.cpp context. The [`Engine`]
//! owns that context on a dedicated OS thread (llama.cpp contexts are not
//! `Send`) and runs a continuous-batching loop over it:
//!
//! ```text
//!  submit() ──▶ queue ──admit (free seq id + KV cells)──▶ slots
//!                                                          │
//!  every step: one batch = decode tokens of running slots  │
//!              + prompt chunks of prefilling slots ◀───────┘
//!              ──▶ llama_decode ──▶ sample per slot ──▶ TokenEvent stream
//! ```
//!
//! New requests join the running batch at the next step; long prompts are
//! prefilled in fixed-size chunks so running decodes are never stalled for a
//! whole prompt; a request whose receiver is dropped (client gone) is removed
//! and its KV cells freed at the next step.
//!
//! Decision logic that needs no model lives in plain modules with unit tests:
//! [`plan`] (what goes into the next batch), [`stop`] (stop strings),
//! [`chat`] (messages, tools and calls), [`format`] (a model's chat template, its tool-call
//! and reasoning syntax, grammars and the output parser),
//! [`cascade`] (when a tier's answer is kept or escalated; the reasoning budget).
//! [`quantize`] makes other GGUF variants of a tier's model. The supervised actor that
//! owns an engine on a node lives in `mesh-actors`.
//!
//! Caveat: llama.cpp's backend is process-global; [`backend`] initialises it
//! once.

pub mod cascade;
pub mod chat;
mod config;
mod engine;
mod error;
pub mod eval;
pub mod format;
pub mod gpu;
pub mod hwcount;
pub mod kvcache;
pub mod markers;
pub mod plan;
pub mod quantize;
pub mod reasoning;
mod request;
mod sampler;
mod shape;
pub mod speculative;
pub mod stop;

pub use config::{
    CpuMoe, DraftAcceptance, DraftConfig, EngineConfig, GpuLayers, KvPagesConfig, KvType,
    PageStoreRef, ThreadSetup, EXPERT_TENSORS,
};
pub use engine::{
    backend, step_bucket, step_kind, Engine, EngineStats, ModelInfo, PageHandles, STEP_BUCKETS,
    STEP_BUCKET_BOUNDS_S, STEP_KINDS, STEP_PHASES,
};
pub use error::TierError;
pub use request::{
    FinishReason, GenerateRequest, LogprobEntry, SamplingParams, TokenEvent, TokenLogprobs, Usage,
};
pub use shape::{
    bytes_matching, host_kept_bytes, tensor_sizes, tier_device_bytes, tier_memory_bytes,
    ModelShape, CONTEXT_OVERHEAD_BYTES, GPU_CONTEXT_OVERHEAD_BYTES,
};
