use serde::{Deserialize, Serialize};

/// How tokens are chosen.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// Nucleus sampling mass (1.0 = off).
    pub top_p: f32,
    /// Keep the k most likely tokens (0 = off).
    pub top_k: i32,
    /// Seed for the random sampler; the same seed and inputs give the same tokens.
    pub seed: u32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
        }
    }
}

/// One generation request, already tokenized.
#[derive(Debug, Clone, Default)]
pub struct GenerateRequest {
    /// Prompt tokens, including BOS when the model wants it.
    pub prompt: Vec<i32>,
    /// Completion budget.
    pub max_tokens: usize,
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Generation stops when the output contains any of these; the stop string is not returned.
    pub stop: Vec<String>,
    /// GBNF grammar (root rule `root`); from the first token on unless a trigger is set.
    pub grammar: Option<String>,
    /// Text that switches the grammar on when generated (e.g. `<tool_call>`): the grammar is
    /// lazy.
    pub grammar_trigger: Option<String>,
    /// Regular expressions (ECMAScript) over the generated text that switch the grammar on;
    /// it then takes the text from the first capture group on (lazy too).
    pub grammar_patterns: Vec<String>,
    /// Return each token's log-probability and this many most likely alternatives
    /// (`logprobs` / `top_logprobs`); `None`: no log-probabilities.
    pub logprobs: Option<usize>,
    /// Ban end-of-generation tokens so exactly `max_tokens` are generated (benchmarks).
    pub ignore_eos: bool,
    /// Trace/log label for this request.
    pub request_id: String,
    /// Who may reuse this request's prefix KV pages: pages are shared only between
    /// requests with the same scope (the gateway uses the offered tool set).
    pub cache_scope: String,
    /// Reasoning governor: at most this many tokens inside `<think>`; when they are
    /// spent the engine emits `</think>` itself and the model goes on to its answer.
    /// `None` = no cap. Needs a tier whose format has think markers (one token each or
    /// several).
    pub reasoning_budget: Option<usize>,
    /// The prompt ends inside an open think span (the template opened it, as QwQ's and
    /// DeepSeek-R1's do): the reply starts with reasoning, which the budget counts.
    pub thinking_open: bool,
    /// Speculative decoding: at most this many drafts per round for this request (the
    /// policy's `draft_k_max`), below the tier's own `draft.k_max`. `None` = the tier's.
    pub draft_max: Option<usize>,
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// End-of-generation token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The sequence reached the context limit.
    ContextFull,
}

/// Token counts of one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Generated tokens inside `<think>`...`</think>`: the open marker excluded, and the
    /// close marker's last token (its leading pieces count when it is spelled in several).
    #[serde(default)]
    pub reasoning_tokens: usize,
    /// True when the reasoning governor closed the think block.
    #[serde(default)]
    pub reasoning_capped: bool,
    /// Tokens the draft model proposed for this request (speculative decoding).
    #[serde(default)]
    pub draft_tokens: usize,
    /// Drafted tokens the target accepted (each saved one target decode).
    #[serde(default)]
    pub draft_accepted: usize,
    /// Prompt tokens not computed for this request: reused in place from its slot's kept
    /// KV or restored from KV pages (OpenAI's `cached_tokens`, Anthropic's
    /// `cache_read_input_tokens`).
    #[serde(default)]
    pub cached_tokens: usize,
    /// The index of the request's stop string that ended generation, when one did.
    #[serde(default)]
    pub stop_index: Option<usize>,
}

/// What the engine streams back for one request.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenEvent {
    /// The request got a sequence slot and prefill started.
    Started {
        /// Milliseconds spent waiting in the queue.
        queued_ms: u64,
    },
    /// One generated token. `text` is the UTF-8 text completed by this token (may be empty
    /// while a multi-byte character is incomplete, or held back while it may begin a stop string).
    Token {
        /// Token id.
        id: i32,
        /// Text released by this token.
        text: String,
        /// Log-probability gap between the chosen token and the runner-up (greedy confidence).
        margin: f32,
        /// The token's log-probability and the most likely alternatives, when asked for.
        logprobs: Option<Box<TokenLogprobs>>,
    },
    /// Generation finished.
    Done {
        /// Why it stopped.
        finish: FinishReason,
        /// Token counts (thinking tokens included in `completion_tokens`).
        usage: Usage,
        /// Text released only at the end (a held-back stop-string prefix, or bytes of an
        /// incomplete UTF-8 character).
        tail: String,
    },
    /// Generation failed.
    Error(String),
}

/// Log-probabilities of one generated token (the model's distribution, before sampling).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct TokenLogprobs {
    /// The chosen token's text piece (special tokens rendered) and its log-probability.
    pub token: LogprobEntry,
    /// The most likely tokens at this position, most likely first.
    pub top: Vec<LogprobEntry>,
}

/// One token and its log-probability.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct LogprobEntry {
    /// Token id.
    pub id: i32,
    /// The token's bytes (a piece of a multi-byte character is not valid UTF-8 alone).
    pub bytes: Vec<u8>,
    /// Natural log of its probability.
    pub logprob: f32,
}
