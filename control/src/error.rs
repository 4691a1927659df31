use thiserror::Error;

/// Errors of the control layer.
#[derive(Debug, Error)]
pub enum ControlError {
    /// The embedding GGUF could not be loaded; check the path (`scripts/setup.sh` converts
    /// the bundled one) and that it is a llama.cpp embedding model.
    #[error("cannot load embedding model {path}: {reason}")]
    ModelLoad {
        /// Path that was given.
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// The llama.cpp embeddings context could not be created (too little memory for
    /// `batch_tokens`, or a model without an encoder).
    #[error("cannot create embeddings context: {0}")]
    Context(String),
    /// llama.cpp failed while computing embeddings.
    #[error("embedding failed: {0}")]
    Embed(String),
    /// A text is longer than the embedding model reads (`max_text_tokens`); shorten or
    /// split it.
    #[error("input {index} has {tokens} tokens; this embedding model reads at most {max}")]
    TextTooLong {
        /// Position of the text in the request.
        index: usize,
        /// Its tokens (special tokens included).
        tokens: usize,
        /// The most the model reads.
        max: usize,
    },
    /// The embedder's worker thread has stopped (it panicked or the embedder is shutting
    /// down); build a new [`Embedder`](crate::Embedder).
    #[error("embedder thread stopped")]
    EmbedderStopped,
    /// A vector does not have the index's dimension (embeddings from another model?).
    #[error("vector has dimension {got}, expected {expected}")]
    Dimension {
        /// The index's dimension.
        expected: usize,
        /// The vector's.
        got: usize,
    },
    /// A forced tool (`tool_choice`) is not in the router's catalog.
    #[error("tool {0:?} is not in the catalog")]
    UnknownTool(String),
    /// Two tools of a catalog share a name; names identify tools, as in OpenAI's API.
    #[error("tool {0:?} appears twice in the catalog")]
    DuplicateTool(String),
    /// A configuration value is out of range.
    #[error("invalid config: {0}")]
    Config(String),
    /// hwloc could not bind a thread to its cores (the CPUs are outside this process's
    /// cgroup or affinity mask, or the OS does not support thread binding); the tier runs
    /// unbound.
    #[error("cannot bind {0}")]
    Bind(String),
    /// The host has no CPU-less NUMA node (far memory such as CXL-attached DRAM), so the
    /// KV page store runs without its far tier. Nothing to fix unless the host should
    /// have one: then check `mesh topology` and the kernel's view (`numactl -H`).
    #[error("no far memory: this host has no CPU-less NUMA node")]
    NoFarMemory,
    /// The policy state file could not be read or written; the message names the path.
    #[error("policy state: {0}")]
    PolicyState(String),
}
