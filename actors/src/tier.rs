//! The tier actor: one llama.cpp [`Engine`] behind a ractor mailbox.
//!
//! The engine runs on its own OS thread. The actor watches that thread: when it ends
//! (a crash in llama.cpp, a panic in the loop) the actor fails at once with
//! [`TierMsg::EngineExited`], so its supervisor ([`crate::engines`]) takes the tier out of
//! the registry and the adverts at the moment it dies, not when the next request finds it
//! dead, and starts it again. Requests that were running or queued on the dead engine see
//! their token stream end and are re-run by the dispatcher.

use std::sync::Arc;

use mesh_tiers::{
    Engine, EngineConfig, EngineStats, GenerateRequest, ModelInfo, PageHandles, TierError,
    TokenEvent,
};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::sync::mpsc::UnboundedReceiver;

/// Messages of [`TierActor`].
#[derive(Debug)]
pub enum TierMsg {
    /// Start a generation; the reply carries the token stream.
    Generate {
        /// The request.
        req: GenerateRequest,
        /// Where the stream (or the refusal) goes.
        reply: RpcReplyPort<Result<UnboundedReceiver<TokenEvent>, TierError>>,
    },
    /// Report model facts and live counters.
    Describe(RpcReplyPort<TierDescription>),
    /// Tokenize a prompt (template parts with control tokens, content parts as plain text;
    /// BOS added when the model wants it).
    Tokenize {
        /// The prompt.
        parts: Vec<mesh_tiers::chat::PromptPart>,
        /// Token ids.
        reply: RpcReplyPort<Vec<i32>>,
    },
    /// Render a conversation with the tier's chat template and tokenize it.
    Render {
        /// The conversation.
        input: Box<mesh_tiers::format::ChatInput>,
        /// Token ids, the tier's format and whether the prompt opened reasoning; or why the
        /// template refused it.
        reply: RpcReplyPort<Result<Rendered, mesh_tiers::format::FormatError>>,
    },
    /// The engine thread ended (sent by the actor's own watcher): the actor fails.
    EngineExited,
    /// Fault injection ([`crate::faults`]): end the engine thread as a crash would.
    CrashEngine,
}

/// A conversation rendered and tokenized by a tier.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    /// Prompt token ids.
    pub tokens: Vec<i32>,
    /// The tier's chat format.
    pub spec: mesh_tiers::format::FormatSpec,
    /// The prompt ends inside an open reasoning span.
    pub thinking_open: bool,
}

/// What a tier actor reports about itself.
#[derive(Debug, Clone)]
pub struct TierDescription {
    /// Model facts.
    pub info: ModelInfo,
    /// Live counters of the engine.
    pub stats: Arc<EngineStats>,
    /// Prefix-page handles (salt base, block, reuse counters), when paging is on.
    pub pages: Option<PageHandles>,
}

/// A supervised actor owning one engine.
#[derive(Debug, Default, Clone, Copy)]
pub struct TierActor;

/// The engine and the task that watches its thread.
pub struct TierState {
    engine: Engine,
    watcher: Option<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for TierState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierState")
            .field("tier", &self.engine.info().name)
            .finish()
    }
}

impl Actor for TierActor {
    type Msg = TierMsg;
    type State = TierState;
    type Arguments = EngineConfig;

    async fn pre_start(
        &self,
        _myself: ActorRef<TierMsg>,
        cfg: EngineConfig,
    ) -> Result<TierState, ActorProcessingErr> {
        let engine = tokio::task::spawn_blocking(move || Engine::start(cfg)).await??;
        Ok(TierState {
            engine,
            watcher: None,
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<TierMsg>,
        state: &mut TierState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(exited) = state.engine.exit_signal() {
            state.watcher = Some(tokio::spawn(async move {
                let _ = exited.await;
                let _ = myself.send_message(TierMsg::EngineExited);
            }));
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<TierMsg>,
        state: &mut TierState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(w) = state.watcher.take() {
            w.abort();
        }
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<TierMsg>,
        msg: TierMsg,
        state: &mut TierState,
    ) -> Result<(), ActorProcessingErr> {
        let engine = &state.engine;
        if !engine.is_running() {
            if let TierMsg::Generate { reply, .. } = msg {
                let _ = reply.send(Err(TierError::EngineStopped));
            }
            return Err(format!("engine {} stopped", engine.info().name).into());
        }
        match msg {
            TierMsg::Generate { req, reply } => {
                let _ = reply.send(engine.submit(req));
            }
            TierMsg::Describe(reply) => {
                let _ = reply.send(TierDescription {
                    info: engine.info().clone(),
                    stats: engine.stats().clone(),
                    pages: engine.pages().cloned(),
                });
            }
            TierMsg::Tokenize { parts, reply } => {
                let _ = reply.send(engine.tokenize_parts(&parts));
            }
            TierMsg::Render { input, reply } => {
                let r = engine.render(&input).map(|(tokens, r)| Rendered {
                    tokens,
                    spec: engine.format().spec().clone(),
                    thinking_open: r.thinking_open,
                });
                let _ = reply.send(r);
            }
            TierMsg::EngineExited => {
                return Err(format!("engine {} thread exited", engine.info().name).into());
            }
            TierMsg::CrashEngine => engine.crash(),
        }
        Ok(())
    }
}

/// The remote protocol of tier actors: peers generate and tokenize on this node's tiers.
#[derive(Debug, Clone, Copy)]
pub struct TierProtocol;

impl crate::remote::Protocol for TierProtocol {
    const ACTOR: &'static str = "tier";
    type Call = crate::wire::TierCall;
    type Item = crate::wire::TierItem;
}

/// A request as it crosses the wire to a peer's tier (`role` names the engine the peer's
/// quantization policy gives it; `trace` carries the caller's trace context).
pub fn to_call(
    model: &str,
    req: &GenerateRequest,
    deadline: std::time::Duration,
    role: &str,
    trace: Vec<crate::wire::Header>,
) -> crate::wire::GenerateCall {
    crate::wire::GenerateCall {
        role: role.to_owned(),
        model: model.to_owned(),
        prompt: req.prompt.clone(),
        max_tokens: req.max_tokens as u32,
        temperature: req.sampling.temperature,
        top_p: req.sampling.top_p,
        top_k: req.sampling.top_k,
        seed: req.sampling.seed,
        stop: req.stop.clone(),
        grammar: req.grammar.clone(),
        grammar_trigger: req.grammar_trigger.clone(),
        grammar_patterns: req.grammar_patterns.clone(),
        logprobs: req.logprobs.map(|n| n as u32),
        ignore_eos: req.ignore_eos,
        request_id: req.request_id.clone(),
        deadline_ms: deadline.as_millis() as u64,
        trace,
        cache_scope: req.cache_scope.clone(),
        reasoning_budget: req
            .reasoning_budget
            .map(|b| b.min(u32::MAX as usize) as u32),
        thinking_open: req.thinking_open,
    }
}

/// The request a peer's call asks this node's tier to run.
pub fn from_call(c: crate::wire::GenerateCall) -> GenerateRequest {
    GenerateRequest {
        prompt: c.prompt,
        max_tokens: c.max_tokens as usize,
        sampling: mesh_tiers::SamplingParams {
            temperature: c.temperature,
            top_p: c.top_p,
            top_k: c.top_k,
            seed: c.seed,
        },
        stop: c.stop,
        grammar: c.grammar,
        grammar_trigger: c.grammar_trigger,
        grammar_patterns: c.grammar_patterns,
        logprobs: c.logprobs.map(|n| n as usize),
        ignore_eos: c.ignore_eos,
        request_id: c.request_id,
        cache_scope: c.cache_scope,
        reasoning_budget: c.reasoning_budget.map(|b| b as usize),
        thinking_open: c.thinking_open,
        // Not on the wire: a forwarded request drafts as the serving tier is configured.
        draft_max: None,
    }
}

/// A token event as it crosses the wire.
pub fn to_wire(ev: TokenEvent) -> crate::wire::Event {
    use crate::wire::{Event, Finish};
    use mesh_tiers::FinishReason;
    match ev {
        TokenEvent::Started { queued_ms } => Event::Started { queued_ms },
        TokenEvent::Token {
            id,
            text,
            margin,
            logprobs,
        } => Event::Token {
            id,
            text,
            margin,
            logprobs: logprobs.map(|l| crate::wire::TokenLogprobs {
                token: entry_to_wire(l.token),
                top: l.top.into_iter().map(entry_to_wire).collect(),
            }),
        },
        TokenEvent::Done {
            finish,
            usage,
            tail,
        } => Event::Done {
            finish: match finish {
                FinishReason::Stop => Finish::Stop,
                FinishReason::Length => Finish::Length,
                FinishReason::ContextFull => Finish::ContextFull,
            },
            prompt_tokens: usage.prompt_tokens as u32,
            completion_tokens: usage.completion_tokens as u32,
            reasoning_tokens: usage.reasoning_tokens as u32,
            reasoning_capped: usage.reasoning_capped,
            draft_tokens: usage.draft_tokens as u32,
            draft_accepted: usage.draft_accepted as u32,
            cached_tokens: usage.cached_tokens as u32,
            stop_index: usage.stop_index.map(|i| i as u32),
            tail,
        },
        TokenEvent::Error(e) => Event::Error(e),
    }
}

fn entry_to_wire(e: mesh_tiers::LogprobEntry) -> crate::wire::LogprobEntry {
    crate::wire::LogprobEntry {
        id: e.id,
        bytes: e.bytes,
        logprob: e.logprob,
    }
}

fn entry_from_wire(e: crate::wire::LogprobEntry) -> mesh_tiers::LogprobEntry {
    mesh_tiers::LogprobEntry {
        id: e.id,
        bytes: e.bytes,
        logprob: e.logprob,
    }
}

/// A token event from the wire.
pub fn from_wire(ev: crate::wire::Event) -> TokenEvent {
    use crate::wire::{Event, Finish};
    use mesh_tiers::{FinishReason, Usage};
    match ev {
        Event::Started { queued_ms } => TokenEvent::Started { queued_ms },
        Event::Token {
            id,
            text,
            margin,
            logprobs,
        } => TokenEvent::Token {
            id,
            text,
            margin,
            logprobs: logprobs.map(|l| {
                Box::new(mesh_tiers::TokenLogprobs {
                    token: entry_from_wire(l.token),
                    top: l.top.into_iter().map(entry_from_wire).collect(),
                })
            }),
        },
        Event::Done {
            finish,
            prompt_tokens,
            completion_tokens,
            reasoning_tokens,
            reasoning_capped,
            draft_tokens,
            draft_accepted,
            cached_tokens,
            stop_index,
            tail,
        } => TokenEvent::Done {
            finish: match finish {
                Finish::Stop => FinishReason::Stop,
                Finish::Length => FinishReason::Length,
                Finish::ContextFull => FinishReason::ContextFull,
            },
            usage: Usage {
                prompt_tokens: prompt_tokens as usize,
                completion_tokens: completion_tokens as usize,
                reasoning_tokens: reasoning_tokens as usize,
                reasoning_capped,
                draft_tokens: draft_tokens as usize,
                draft_accepted: draft_accepted as usize,
                cached_tokens: cached_tokens as usize,
                stop_index: stop_index.map(|i| i as usize),
            },
            tail,
        },
        Event::Error(e) => TokenEvent::Error(e),
    }
}

/// A tier's refusal as the wire carries it.
pub fn remote_error(e: TierError) -> crate::wire::RemoteError {
    use crate::wire::ErrorClass;
    let class = match &e {
        TierError::ContextExceeded { .. } => ErrorClass::ContextExceeded,
        TierError::Overloaded(_) => ErrorClass::Overloaded,
        TierError::InvalidRequest(_) => ErrorClass::InvalidRequest,
        _ => ErrorClass::Unavailable,
    };
    crate::wire::RemoteError {
        class,
        message: e.to_string(),
    }
}

/// A peer's refusal as a tier error (the same HTTP mapping as a local one).
pub fn remote_to_tier(e: &crate::wire::RemoteError) -> TierError {
    use crate::wire::ErrorClass;
    match e.class {
        ErrorClass::InvalidRequest | ErrorClass::ContextExceeded => {
            TierError::InvalidRequest(e.message.clone())
        }
        ErrorClass::Overloaded => TierError::Overloaded(0),
        _ => TierError::EngineStopped,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mesh_tiers::{FinishReason, Usage};
    use mesh_transport::frame::{self, HEADER_LEN};

    /// A peer's `Done` reaches the gateway with its usage whole: the reasoning and the draft
    /// counts survive the frame (encoded, validated, decoded).
    #[test]
    fn done_carries_usage_and_draft_counts_across_the_wire() {
        let usage = Usage {
            prompt_tokens: 700,
            completion_tokens: 41,
            reasoning_tokens: 9,
            reasoning_capped: true,
            draft_tokens: 37,
            draft_accepted: 33,
            cached_tokens: 640,
            stop_index: Some(1),
        };
        let ev = TokenEvent::Done {
            finish: FinishReason::Length,
            usage,
            tail: "tail".into(),
        };
        let bytes = frame::encode(&to_wire(ev)).unwrap();
        let back: crate::wire::Event = frame::decode(&bytes[HEADER_LEN..]).unwrap();
        match from_wire(back) {
            TokenEvent::Done {
                finish,
                usage: got,
                tail,
            } => {
                assert_eq!(finish, FinishReason::Length);
                assert_eq!(got, usage);
                assert_eq!(tail, "tail");
            }
            other => panic!("not a Done: {other:?}"),
        }
    }
}
