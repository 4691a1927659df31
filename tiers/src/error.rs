use thiserror::Error;

/// Errors of the tier layer.
#[derive(Debug, Error)]
pub enum TierError {
    /// The GGUF file could not be loaded; check the path and that it is a llama.cpp model.
    #[error("cannot load model {path}: {reason}")]
    ModelLoad {
        /// Path that was given.
        path: String,
        /// What llama.cpp reported.
        reason: String,
    },
    /// The llama.cpp context could not be created (usually too little memory for `n_ctx`).
    #[error("cannot create context: {0}")]
    Context(String),
    /// The prompt plus `max_tokens` does not fit in one sequence's context.
    #[error("prompt of {prompt} tokens plus max_tokens {max_tokens} exceeds the context of {limit} tokens")]
    ContextExceeded {
        /// Prompt length in tokens.
        prompt: usize,
        /// Requested completion budget.
        max_tokens: usize,
        /// Per-sequence limit.
        limit: usize,
    },
    /// The request queue is full; retry later.
    #[error("engine queue is full ({0} waiting)")]
    Overloaded(usize),
    /// The request is malformed (empty prompt, bad sampling values, bad grammar).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The engine thread has stopped; the tier must be restarted.
    #[error("engine stopped")]
    EngineStopped,
    /// llama.cpp failed while decoding.
    #[error("decode failed: {0}")]
    Decode(String),
    /// Configuration is invalid.
    #[error("invalid engine config: {0}")]
    Config(String),
}
