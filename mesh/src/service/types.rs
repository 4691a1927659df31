//! The typed values the service layer takes and gives: what a chat or completion call asks
//! for ([`ChatCall`], [`CompleteCall`]), what comes back ([`Reply`], [`Completion`]) and
//! what mesh says about how it served it ([`MeshInfo`]). The HTTP layer translates OpenAI's
//! JSON to and from these; the agent loop and the tuner's probes use them directly.

use mesh_tiers::chat::ParsedOutput;
use mesh_tiers::format::parse::{OutputParser, ParseOptions};
use mesh_tiers::format::ToolSyntax;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

pub use mesh_actors::engines::EngineInfo;
pub use mesh_actors::router::Routed as RouterInfo;
pub use mesh_actors::wire::TierAdvert;
pub use mesh_tiers::chat::{ChatMessage, Role, ToolCall, ToolSpec};
pub use mesh_tiers::format::parse::Delta;
pub use mesh_tiers::{FinishReason, LogprobEntry, TokenEvent, TokenLogprobs, Usage};

/// Which tool calls a request allows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ToolChoice {
    /// Not set: `auto` when tools are offered.
    #[default]
    Unset,
    /// The model may call a tool or answer.
    Auto,
    /// The model may not call tools (the prompt shows none).
    None,
    /// The model must call one of the tools.
    Required,
    /// The model must call this tool.
    Named(String),
}

/// The shape an answer must have (`response_format`).
#[derive(Debug, Clone, Default, PartialEq)]
pub enum ResponseFormat {
    /// Free text.
    #[default]
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON matching this schema.
    JsonSchema(Value),
}

/// Sampling as the caller asked for it (checked by the service).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Sampling {
    /// Temperature, 0..=2 (unset: greedy).
    pub temperature: Option<f32>,
    /// Nucleus mass, (0, 1].
    pub top_p: Option<f32>,
    /// Top-k, 0 = off.
    pub top_k: Option<i32>,
    /// Seed.
    pub seed: Option<u64>,
}

impl Sampling {
    /// Whether tokens are drawn at random (a temperature above 0).
    pub fn is_sampled(&self) -> bool {
        self.temperature.is_some_and(|t| t > 0.0)
    }

    /// Gives a sampled request without a seed the seed `fresh()` draws, once, at admission:
    /// each such request then draws its own tokens, the response says which seed
    /// (`mesh.seed`, to repeat it), and a re-run after a failover continues with the same
    /// draws. Greedy requests and requests that name a seed are left as they are.
    pub fn admit_seed(&mut self, fresh: impl FnOnce() -> u64) {
        if self.seed.is_none() && self.is_sampled() {
            self.seed = Some(fresh());
        }
    }
}

/// A chat completion call.
#[derive(Debug, Clone, Default)]
pub struct ChatCall {
    /// A tier name or the cascade's model id.
    pub model: String,
    /// The conversation so far.
    pub messages: Vec<ChatMessage>,
    /// Tools the model may call.
    pub tools: Vec<ToolSpec>,
    /// Which tool calls are allowed.
    pub tool_choice: ToolChoice,
    /// Completion budget (unset: the node's default, within the context).
    pub max_tokens: Option<usize>,
    /// Sampling.
    pub sampling: Sampling,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Thinking-token cap the caller asks for (unset: the governor decides).
    pub reasoning_budget: Option<usize>,
    /// Keep generating past end-of-generation (benchmarks).
    pub ignore_eos: bool,
    /// The shape the answer must have.
    pub response_format: ResponseFormat,
    /// Log-probabilities of each token with this many alternatives (`None`: none).
    pub logprobs: Option<usize>,
    /// Extra variables for the chat template (`chat_template_kwargs`, e.g.
    /// `enable_thinking`).
    pub template_kwargs: Map<String, Value>,
    /// Return the prompt's and the answer's token ids (as vLLM's `return_token_ids`).
    pub return_token_ids: bool,
    /// The tools the conversation's previous step listed, in the order its prompt listed
    /// them (`Routed::listed`; the agent loop passes its last turn's): routing keeps them
    /// first, so this step's prompt extends that step's. Not part of the HTTP API.
    pub keep_tools: Vec<String>,
    /// The page scope: set by routing to the offered tools' (so that the steps of one
    /// conversation, routed to different tools, share pages); unset, the shown tools'.
    pub scope: Option<String>,
}

/// A raw prompt.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// Text, tokenized by the tier.
    Text(String),
    /// Token ids.
    Tokens(Vec<i32>),
}

/// A raw completion call (`/v1/completions`).
#[derive(Debug, Clone)]
pub struct CompleteCall {
    /// Tier name.
    pub model: String,
    /// The prompt.
    pub prompt: Prompt,
    /// Completion budget.
    pub max_tokens: Option<usize>,
    /// Sampling.
    pub sampling: Sampling,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Keep generating past end-of-generation.
    pub ignore_eos: bool,
    /// Log-probabilities of each token with this many alternatives (`None`: none).
    pub logprobs: Option<usize>,
}

/// One tier attempt of a cascade request.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct CascadeStep {
    /// Tier.
    pub tier: String,
    /// `accept`, `last_tier`, or why the answer was passed on.
    pub verdict: String,
    /// Smallest logit margin over the tier's tokens.
    pub min_margin: Option<f32>,
    /// Tokens the tier generated.
    pub completion_tokens: usize,
}

/// Speculative decoding of one response (a draft model proposed, the tier verified).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Default)]
pub struct SpecInfo {
    /// Tokens the draft model proposed.
    pub draft_tokens: usize,
    /// Proposed tokens the tier accepted.
    pub accepted_tokens: usize,
}

impl SpecInfo {
    /// The draft counts of a finished generation; none when nothing was drafted.
    pub fn of(u: &Usage) -> Option<Self> {
        (u.draft_tokens > 0).then_some(Self {
            draft_tokens: u.draft_tokens,
            accepted_tokens: u.draft_accepted,
        })
    }
}

/// How mesh served a response (`mesh` in response bodies).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct MeshInfo {
    /// Tier that produced the answer.
    pub tier: String,
    /// Milliseconds waiting for an engine slot.
    pub queued_ms: u64,
    /// The reasoning governor closed the think block.
    #[serde(default)]
    pub reasoning_capped: bool,
    /// Cascade requests: every tier tried, in order, and its verdict.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cascade: Vec<CascadeStep>,
    /// Requests whose tools were routed: what the router kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router: Option<RouterInfo>,
    /// Requests decoded speculatively: drafted and accepted tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speculative: Option<SpecInfo>,
    /// The local engine that produced the answer (quantization policy); absent when a
    /// peer served it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<EngineInfo>,
    /// Sampled requests: the seed the tokens were drawn with (the request's, or the one
    /// chosen at admission); sending it back repeats the draws.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// The request's trace id (32 hex digits), when the node exports traces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
}

/// A finished completion.
#[derive(Debug, Clone)]
pub struct Completion {
    /// The model the caller asked for (a tier or the cascade).
    pub model: String,
    /// Generated text (special tokens as text, end token excluded).
    pub text: String,
    /// The text split into reasoning, content and tool calls (each call with its id), in
    /// the tier's chat format.
    pub output: ParsedOutput,
    /// Log-probabilities of every generated token, when asked for.
    pub logprobs: Vec<TokenLogprobs>,
    /// The prompt's token ids, when the call asked for them (`return_token_ids`).
    pub prompt_token_ids: Option<Vec<i32>>,
    /// The generated token ids, end token included when generation stopped on it.
    pub token_ids: Vec<i32>,
    /// Why generation stopped.
    pub finish: FinishReason,
    /// Tokens (a cascade's: every tier it tried).
    pub usage: Usage,
    /// How mesh served it.
    pub mesh: MeshInfo,
    /// Per-token logit margins (top-1 minus top-2 probability).
    pub margins: Vec<f32>,
    /// Every event in order (a cascade replays the kept answer's).
    pub events: Vec<TokenEvent>,
}

/// What a chat reply gives as it is read ([`Reply::next_output`]).
#[derive(Debug, Clone, PartialEq)]
pub enum ReplyEvent {
    /// The request got a sequence after this long in the queue.
    Started {
        /// Milliseconds queued.
        queued_ms: u64,
    },
    /// Output that is now certain (text, reasoning, complete tool calls with their ids),
    /// and the log-probabilities of the tokens read since the last event, when asked for.
    Output {
        /// Parsed output, in order.
        deltas: Vec<Delta>,
        /// Log-probabilities of the tokens behind it.
        logprobs: Vec<TokenLogprobs>,
    },
    /// The generation finished.
    Done {
        /// Why.
        finish: FinishReason,
        /// Token counts.
        usage: Usage,
    },
    /// The generation failed.
    Error(String),
}

/// A generation under way: its token events, and what mesh knew when it started.
pub struct Reply {
    /// The model the caller asked for.
    pub model: String,
    /// Tier, router and engine (queue time, draft counts and the governor's cap are set by
    /// [`Reply::collect`]).
    pub mesh: MeshInfo,
    pub(crate) events: super::stream::Timed,
    /// How the tier's output is parsed (`None`: raw completions, text only).
    pub(crate) parse: Option<ParseOptions>,
    /// The parser of [`Reply::next_output`], made on first use.
    pub(crate) parser: Option<OutputParser>,
    /// The end, given after the output its tail completed.
    pub(crate) pending_done: Option<ReplyEvent>,
    /// Asks again when the reply only repeats calls the conversation just answered.
    pub(crate) guard: Option<RepeatGuard>,
    /// Output held while the guard decides (until the first answer text or call).
    pub(crate) held: Vec<Delta>,
    /// The prompt's token ids, when the call asked for them.
    pub prompt_token_ids: Option<Vec<i32>>,
    /// Held until the reply is dropped: the concurrency permit, a variant engine's lease.
    pub(crate) _hold: super::Hold,
}

/// Starts a generation again (with calls banned from the reply's start); its token stream.
pub(crate) type Retry = Box<
    dyn FnOnce() -> futures::future::BoxFuture<
            'static,
            Result<tokio::sync::mpsc::UnboundedReceiver<TokenEvent>, super::Error>,
        > + Send,
>;

/// A reply to a conversation that ends with tool results: when the model's first call
/// repeats one those results answered (the same name and arguments), the reply is
/// generated again, once, as an answer in words ([`repeats_answered`]). The tokens of the
/// first attempt are not in the reply's usage.
pub(crate) struct RepeatGuard {
    /// The calls the conversation's last tool results answered.
    pub(crate) answered: Vec<ToolCall>,
    /// How to ask again.
    pub(crate) retry: Retry,
    /// Counts the retry.
    pub(crate) counted: Box<dyn Fn() + Send + Sync>,
}

/// Whether `calls` only repeat `answered` calls (same name, same arguments): a model
/// looping on a call whose result it already has.
pub fn repeats_answered(calls: &[ToolCall], answered: &[ToolCall]) -> bool {
    !calls.is_empty()
        && calls.iter().all(|c| {
            answered
                .iter()
                .any(|a| a.name == c.name && a.arguments == c.arguments)
        })
}

/// A fresh id for a call the model made: nine letters and digits for Mistral's templates
/// (they refuse others), else `call_` and 24 hex digits.
pub fn call_id(syntax: Option<ToolSyntax>) -> String {
    let hex = uuid::Uuid::new_v4().simple().to_string();
    match syntax {
        Some(ToolSyntax::Mistral) => hex[..9].to_owned(),
        _ => format!("call_{}", &hex[..24]),
    }
}

/// Gives every call without an id a fresh one.
fn with_ids(deltas: &mut [Delta], syntax: Option<ToolSyntax>) {
    for d in deltas {
        if let Delta::Call(ToolCall { id, .. }) = d {
            if id.is_none() {
                *id = Some(call_id(syntax));
            }
        }
    }
}

impl std::fmt::Debug for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reply").field("model", &self.model).finish()
    }
}

impl Reply {
    /// The next event; `None` after the last. Dropping the reply cancels the generation.
    ///
    /// Cancel safety: cancel-safe.
    pub async fn next(&mut self) -> Option<TokenEvent> {
        self.events.next().await
    }

    /// The next parsed event of a chat reply (text, reasoning and calls as the tier's
    /// format writes them); `None` after the last. A raw completion's text is all content.
    ///
    /// Cancel safety: cancel-safe.
    pub async fn next_output(&mut self) -> Option<ReplyEvent> {
        if let Some(done) = self.pending_done.take() {
            return Some(done);
        }
        loop {
            let ev = self.next_parsed().await?;
            if self.guard.is_none() {
                return Some(ev);
            }
            // Hold output until the reply shows whether it is an answer or a call.
            let ReplyEvent::Output { deltas, .. } = &ev else {
                if matches!(ev, ReplyEvent::Started { .. }) {
                    return Some(ev);
                }
                return Some(self.release(ev));
            };
            self.held.extend(deltas.iter().cloned());
            let decided = self.held.iter().find_map(|d| match d {
                Delta::Call(c) => Some(Some(c.clone())),
                Delta::Content(t) if !t.trim().is_empty() => Some(None),
                _ => None,
            });
            match decided {
                None if self.pending_done.is_some() => {
                    let end = self.pending_done.take().expect("checked");
                    return Some(self.release(end));
                }
                None => continue,
                Some(Some(call)) => {
                    let guard = self.guard.take().expect("checked");
                    if repeats_answered(std::slice::from_ref(&call), &guard.answered) {
                        (guard.counted)();
                        match (guard.retry)().await {
                            Ok(rx) => {
                                self.events.replace(rx);
                                self.answer_in_words();
                                self.parser = None;
                                self.pending_done = None;
                                self.held.clear();
                                continue;
                            }
                            Err(e) => return Some(ReplyEvent::Error(e.to_string())),
                        }
                    }
                    return Some(self.release_held());
                }
                Some(None) => {
                    self.guard = None;
                    return Some(self.release_held());
                }
            }
        }
    }

    /// After a retry: the answer is words, nothing in it is parsed as a call.
    fn answer_in_words(&mut self) {
        if let Some(p) = &mut self.parse {
            p.tools = mesh_tiers::format::parse::ToolNames::None;
        }
    }

    /// The held output, then `next` (the end).
    fn release(&mut self, next: ReplyEvent) -> ReplyEvent {
        self.guard = None;
        if self.held.is_empty() {
            return next;
        }
        self.pending_done = Some(next);
        self.release_held()
    }

    fn release_held(&mut self) -> ReplyEvent {
        ReplyEvent::Output {
            deltas: std::mem::take(&mut self.held),
            logprobs: vec![],
        }
    }

    /// The next event of the tier's stream, parsed.
    async fn next_parsed(&mut self) -> Option<ReplyEvent> {
        let syntax = self.parse.as_ref().and_then(|p| p.syntax);
        if self.parser.is_none() {
            self.parser = Some(OutputParser::new(self.parse.clone().unwrap_or_default()));
        }
        let ev = self.events.next().await?;
        let parser = self.parser.as_mut().expect("made above");
        Some(match ev {
            TokenEvent::Started { queued_ms } => ReplyEvent::Started { queued_ms },
            TokenEvent::Token { text, logprobs, .. } => {
                let mut deltas = match &self.parse {
                    Some(_) => parser.push(&text),
                    None if text.is_empty() => vec![],
                    None => vec![Delta::Content(text)],
                };
                with_ids(&mut deltas, syntax);
                ReplyEvent::Output {
                    deltas,
                    logprobs: logprobs.map(|l| *l).into_iter().collect(),
                }
            }
            TokenEvent::Done {
                finish,
                usage,
                tail,
            } => {
                // The held text, then the end.
                let mut deltas = match &self.parse {
                    Some(_) => {
                        let mut d = parser.push(&tail);
                        d.extend(parser.finish());
                        d
                    }
                    None if tail.is_empty() => vec![],
                    None => vec![Delta::Content(tail)],
                };
                with_ids(&mut deltas, syntax);
                self.pending_done = Some(ReplyEvent::Done { finish, usage });
                ReplyEvent::Output {
                    deltas,
                    logprobs: vec![],
                }
            }
            TokenEvent::Error(e) => ReplyEvent::Error(e),
        })
    }

    /// Reads the whole generation.
    pub async fn collect(mut self) -> Result<Completion, super::Error> {
        let mut text = String::new();
        let mut margins = Vec::new();
        let mut events = Vec::new();
        let mut logprobs = Vec::new();
        let mut token_ids = Vec::new();
        while let Some(ev) = self.events.next().await {
            events.push(ev.clone());
            match ev {
                TokenEvent::Started { queued_ms } => self.mesh.queued_ms = queued_ms,
                TokenEvent::Token {
                    id,
                    text: piece,
                    margin,
                    logprobs: lp,
                } => {
                    text.push_str(&piece);
                    margins.push(margin);
                    token_ids.push(id);
                    logprobs.extend(lp.map(|l| *l));
                }
                TokenEvent::Done {
                    finish,
                    usage,
                    tail,
                } => {
                    text.push_str(&tail);
                    let mut mesh = self.mesh.clone();
                    mesh.reasoning_capped = usage.reasoning_capped;
                    mesh.speculative = SpecInfo::of(&usage);
                    let output = match self.parse.clone() {
                        Some(opts) => {
                            let syntax = opts.syntax;
                            let mut out = mesh_tiers::format::parse::parse_all(&text, opts);
                            for c in &mut out.tool_calls {
                                if c.id.is_none() {
                                    c.id = Some(call_id(syntax));
                                }
                            }
                            out
                        }
                        None => ParsedOutput {
                            content: text.clone(),
                            ..ParsedOutput::default()
                        },
                    };
                    // A first call that repeats one the conversation just answered: ask
                    // again, once, for an answer in words.
                    if let Some(guard) = self.guard.take() {
                        let first = output.tool_calls.first().cloned();
                        let text_first = !output.content.trim().is_empty()
                            && !text.trim_start().starts_with(['{', '[', '<', '`']);
                        if let (Some(c), false) = (first, text_first) {
                            if repeats_answered(std::slice::from_ref(&c), &guard.answered) {
                                (guard.counted)();
                                let rx = (guard.retry)().await?;
                                self.events.replace(rx);
                                self.answer_in_words();
                                return Box::pin(self.collect()).await;
                            }
                        }
                    }
                    return Ok(Completion {
                        model: self.model,
                        output,
                        logprobs,
                        prompt_token_ids: self.prompt_token_ids,
                        token_ids,
                        text,
                        finish,
                        usage,
                        mesh,
                        margins,
                        events,
                    });
                }
                TokenEvent::Error(e) => {
                    return Err(super::Error::unavailable(format!("generation failed: {e}")))
                }
            }
        }
        Err(super::Error::unavailable(
            "the tier stopped before finishing",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::Sampling;

    fn sampled(seed: Option<u64>) -> Sampling {
        Sampling {
            temperature: Some(1.0),
            seed,
            ..Sampling::default()
        }
    }

    #[test]
    fn an_unseeded_sampled_request_gets_the_fresh_seed() {
        let mut s = sampled(None);
        s.admit_seed(|| 42);
        assert_eq!(s.seed, Some(42));
    }

    #[test]
    fn a_seed_the_request_names_is_kept() {
        let mut s = sampled(Some(7));
        s.admit_seed(|| 42);
        assert_eq!(s.seed, Some(7));
    }

    #[test]
    fn a_greedy_request_gets_no_seed() {
        for t in [None, Some(0.0)] {
            let mut s = Sampling {
                temperature: t,
                ..Sampling::default()
            };
            s.admit_seed(|| 42);
            assert_eq!(s.seed, None, "{t:?}");
        }
    }
}
