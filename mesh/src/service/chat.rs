//! Chat and raw completions.
//!
//! Request path: read the live policy once → (chat with more than `route_above` tools) the
//! router actor keeps the top-k → render the prompt, build the tool-call grammar → pick
//! the node hosting the tier, local or a peer (404 `model_not_found`; while this node's
//! engine restarts, wait for it) → take a concurrency permit (429) → tokenize on that node
//! → with the prompt known, prefer a node holding its prefix pages → check the context
//! (400 `context_length_exceeded`) → the governor actor decides the thinking budget → the
//! quantization policy picks the local engine for the request's role → dispatch. A caller
//! that drops the [`Reply`] cancels the generation and frees its sequence.

use std::sync::Arc;
use std::time::Instant;

use mesh_actors::governor::{self, BudgetQuery};
use mesh_actors::remote::Protocol;
use mesh_actors::router::{self, RouteQuery, RouterProtocol};
use mesh_control::policy::{Policy, Role as RequestRole};
use mesh_control::Tool;
use mesh_tiers::chat::{self, ChatMessage, Role, ToolSpec};
use mesh_tiers::format::grammar::{self, GrammarPlan};
use mesh_tiers::format::parse::{ParseOptions, ToolNames};
use mesh_tiers::format::{ChatInput, FormatSpec, ToolSyntax};
use mesh_tiers::{GenerateRequest, SamplingParams, TierError};
use tracing::{info_span, warn, Instrument};

use super::dispatch::{RenderError, RouteError, StartError, Target};
use super::stream::Timed;
use super::{
    ChatCall, CompleteCall, Error, Hold, MeshInfo, Prompt, Reply, ResponseFormat, RouterInfo,
    Sampling, Service, ToolChoice,
};
use crate::metrics::{EngineLabel, RoutingLabel};

/// A chat call ready for a tier: what its template renders, which tools it shows, and
/// which calls `tool_choice` forces.
pub(crate) struct Prepared {
    /// The conversation and shown tools, for the tier's chat template.
    pub(crate) input: ChatInput,
    /// Tools shown in the prompt.
    pub(crate) shown: Vec<ToolSpec>,
    /// The tools one of which must be called (`required`, or the named one).
    forced: Option<Vec<ToolSpec>>,
    pub(crate) scope: String,
    /// The tool router's top-1 score, when it routed this request (cascade entry tier,
    /// reasoning budget).
    pub(crate) confidence: Option<f32>,
}

/// Checks `call` (whose tools are already routed): the conversation, the tools it shows,
/// the calls `tool_choice` forces, and the page scope.
pub(crate) fn prepare(call: &ChatCall, routed: Option<&RouterInfo>) -> Result<Prepared, Error> {
    if call.messages.is_empty() {
        return Err(Error::invalid(
            "messages must not be empty",
            Some("messages"),
        ));
    }
    let (shown, forced) = tool_plan(call.tools.clone(), &call.tool_choice)?;
    // Prefix pages are shared only between requests offered the same tools (routing keeps
    // the offered set's scope, so the routed steps of one conversation share pages).
    let scope = call.scope.clone().unwrap_or_else(|| cache_scope(&shown));
    Ok(Prepared {
        input: ChatInput {
            messages: call.messages.clone(),
            tools: shown.clone(),
            kwargs: call.template_kwargs.clone(),
        },
        shown,
        forced,
        scope,
        confidence: routed.map(|i| i.top1),
    })
}

/// A prompt rendered by a tier, with the grammar its reply is held to and how the reply
/// is read.
pub(crate) struct TierPrompt {
    /// Prompt tokens.
    pub(crate) tokens: Vec<i32>,
    grammar: Option<GrammarPlan>,
    /// How the reply is parsed.
    pub(crate) parse: ParseOptions,
}

/// The grammar and the parse options of a call on a tier with format `spec` (`thinking_open`:
/// its rendered prompt opened a reasoning span): the forced calls' grammar, else
/// `response_format`'s, else the lazy grammar of the shown tools.
pub(crate) fn constrain(
    call: &ChatCall,
    p: &Prepared,
    spec: &FormatSpec,
    thinking_open: bool,
) -> Result<(Option<GrammarPlan>, ParseOptions), Error> {
    let tools_err = |m: String| Error::invalid(m, Some("tools"));
    let grammar = if let Some(f) = &p.forced {
        Some(grammar::tools(spec, f, true, thinking_open).map_err(tools_err)?)
    } else {
        let schema = match &call.response_format {
            ResponseFormat::Text => None,
            ResponseFormat::JsonObject => Some(serde_json::json!({"type": "object"})),
            ResponseFormat::JsonSchema(s) => Some(s.clone()),
        };
        match schema {
            Some(s) => Some(
                grammar::json_answer(spec, &s, thinking_open)
                    .map_err(|m| Error::invalid(m, Some("response_format")))?,
            ),
            None if p.shown.is_empty() => None,
            None => Some(grammar::tools(spec, &p.shown, false, thinking_open).map_err(tools_err)?),
        }
    };
    let parse = ParseOptions {
        syntax: Some(spec.syntax),
        think: spec.think.clone(),
        thinking_open,
        tools: if p.shown.is_empty() {
            ToolNames::None
        } else {
            ToolNames::Only(p.shown.iter().map(|t| t.name.clone()).collect())
        },
    };
    Ok((grammar, parse))
}

/// The page scope of a tool set: its sorted names, or, past 256 bytes (a routed request
/// offering a large catalog), their blake3 hash, so the scope every generate request carries
/// (to a peer too) stays small.
fn cache_scope(tools: &[ToolSpec]) -> String {
    let mut names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    let joined = names.join(",");
    if joined.len() <= 256 {
        format!("tools:{joined}")
    } else {
        format!("tools#{}", blake3::hash(joined.as_bytes()).to_hex())
    }
}

/// Tools to show in the prompt and the ones a call must name, from `tool_choice`.
#[allow(clippy::type_complexity)]
pub(crate) fn tool_plan(
    tools: Vec<ToolSpec>,
    choice: &ToolChoice,
) -> Result<(Vec<ToolSpec>, Option<Vec<ToolSpec>>), Error> {
    let err = |m: String| Error::invalid(m, Some("tool_choice"));
    match choice {
        ToolChoice::Unset | ToolChoice::Auto => Ok((tools, None)),
        ToolChoice::None => Ok((Vec::new(), None)),
        ToolChoice::Required if tools.is_empty() => {
            Err(err("tool_choice `required` needs at least one tool".into()))
        }
        ToolChoice::Required => Ok((tools.clone(), Some(tools))),
        ToolChoice::Named(name) => {
            let chosen: Vec<ToolSpec> = tools.iter().filter(|t| &t.name == name).cloned().collect();
            if chosen.is_empty() {
                return Err(err(format!(
                    "tool_choice names `{name}`, which is not in tools"
                )));
            }
            Ok((tools, Some(chosen)))
        }
    }
}

/// A seed for a sampled request that names none (in the range the sampler uses).
fn random_seed() -> u64 {
    // The OS's generator; if it fails, the clock's low bits still differ per request.
    getrandom::u32().map(u64::from).unwrap_or_else(|_| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| u64::from(d.subsec_nanos()))
            .unwrap_or(0)
    })
}

/// Checks the sampling fields.
pub(crate) fn sampling(s: &Sampling) -> Result<SamplingParams, Error> {
    let t = s.temperature.unwrap_or(0.0);
    if !(0.0..=2.0).contains(&t) {
        return Err(Error::invalid(
            "temperature must be between 0 and 2",
            Some("temperature"),
        ));
    }
    let p = s.top_p.unwrap_or(1.0);
    if !(p > 0.0 && p <= 1.0) {
        return Err(Error::invalid("top_p must be in (0, 1]", Some("top_p")));
    }
    let k = s.top_k.unwrap_or(0);
    if k < 0 {
        return Err(Error::invalid("top_k must be >= 0", Some("top_k")));
    }
    Ok(SamplingParams {
        temperature: t,
        top_p: p,
        top_k: k,
        seed: s.seed.unwrap_or(0) as u32,
    })
}

/// The completion budget: the asked one if it fits the context, else the default within it.
fn budget(
    default: usize,
    limit: usize,
    prompt_len: usize,
    asked: Option<usize>,
) -> Result<usize, Error> {
    let exceeded = |max_tokens| {
        Error::from_tier(
            TierError::ContextExceeded {
                prompt: prompt_len,
                max_tokens,
                limit,
            },
            0,
        )
    };
    match asked {
        Some(0) => Err(Error::invalid(
            "max_tokens must be at least 1",
            Some("max_tokens"),
        )),
        Some(n) if prompt_len + n > limit => Err(exceeded(n)),
        Some(n) => Ok(n),
        None if prompt_len >= limit => Err(exceeded(0)),
        None => Ok(default.min(limit - prompt_len)),
    }
}

/// The calls of the conversation's last assistant turn when only tool results follow it:
/// what the model is now to answer from.
pub(crate) fn answered_calls(messages: &[ChatMessage]) -> Vec<chat::ToolCall> {
    if messages.last().is_none_or(|m| m.role != Role::Tool) {
        return vec![];
    }
    match messages.iter().rposition(|m| m.role == Role::Assistant) {
        Some(i) if messages[i + 1..].iter().all(|m| m.role == Role::Tool) => {
            messages[i].tool_calls.clone()
        }
        _ => vec![],
    }
}

/// What the tool router matches for the current step of a conversation.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct StepQuery {
    /// The model's stated next step when it wrote one after the last user message, else that
    /// message.
    pub(crate) intent: String,
    /// Tools the conversation's assistant turns called, first use first, once each.
    pub(crate) used: Vec<String>,
}

/// The routing question of a conversation's current step: the text of the latest assistant
/// turn after the last user message (what the model said it does next) when there is one,
/// else that user message (the task, or the user's latest turn); and every tool already
/// called, which stays offered. The stated step alone is what measured best on LiveMCPBench
/// (`livemcp_router`, docs/tool-router.md): joined to the task it drowns in the task's other
/// needs. Tool results are not part of the query: their text is data, not intent. `None`
/// without a
/// non-empty user message.
pub(crate) fn step_query(messages: &[ChatMessage]) -> Option<StepQuery> {
    let u = messages
        .iter()
        .rposition(|m| m.role == Role::User && !m.content.trim().is_empty())?;
    let stated = messages[u + 1..]
        .iter()
        .rev()
        .find(|m| m.role == Role::Assistant && !m.content.trim().is_empty());
    let intent = match stated {
        Some(m) => m.content.trim().to_owned(),
        None => messages[u].content.clone(),
    };
    let mut used: Vec<String> = vec![];
    for c in messages
        .iter()
        .filter(|m| m.role == Role::Assistant)
        .flat_map(|m| &m.tool_calls)
    {
        if !used.contains(&c.name) {
            used.push(c.name.clone());
        }
    }
    Some(StepQuery { intent, used })
}

/// A generation job ready for a tier.
pub(crate) struct Job {
    pub(crate) model: String,
    pub(crate) req: GenerateRequest,
    pub(crate) engine: Option<super::EngineInfo>,
    pub(crate) lease: Option<Arc<()>>,
    /// What the request is for (quantization policy); a peer serving it picks its engine by it.
    pub(crate) role: RequestRole,
}

impl Job {
    /// The reply of this job's token stream `rx`, holding `permit` (and the engine's lease)
    /// until it is dropped.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn reply(
        self,
        service: &Service,
        rx: tokio::sync::mpsc::UnboundedReceiver<mesh_tiers::TokenEvent>,
        permit: Option<tokio::sync::OwnedSemaphorePermit>,
        router: Option<RouterInfo>,
        arrived: Instant,
        parse: Option<ParseOptions>,
    ) -> Reply {
        let s = &self.req.sampling;
        Reply {
            mesh: MeshInfo {
                tier: self.model.clone(),
                router,
                engine: self.engine,
                seed: (s.temperature > 0.0).then_some(u64::from(s.seed)),
                ..MeshInfo::default()
            },
            events: Timed::new(rx, &self.model, service.metrics().clone(), arrived),
            parse,
            parser: None,
            pending_done: None,
            guard: None,
            held: vec![],
            prompt_token_ids: None,
            model: self.model,
            _hold: Hold {
                _permit: permit,
                _lease: self.lease,
            },
        }
    }
}

impl Service {
    /// The node for `model` now (404 when no node knows it, 503 when none can take it).
    pub(crate) fn find_tier(&self, model: &str) -> Result<Target, Error> {
        self.inner
            .dispatcher
            .route(model, &[])
            .map_err(|e| self.route_error(model, e))
    }

    /// [`find_tier`](Self::find_tier), waiting for this node's restarting engine.
    pub(crate) async fn find_tier_waiting(
        &self,
        model: &str,
        deadline: Instant,
    ) -> Result<Target, Error> {
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .min(self.settings().restart_wait);
        self.inner
            .dispatcher
            .route_or_wait(model, wait)
            .await
            .map_err(|e| self.route_error(model, e))
    }

    fn route_error(&self, model: &str, e: RouteError) -> Error {
        match e {
            RouteError::Unknown(names) => Error::model_not_found(model, &names),
            RouteError::NoneAvailable => Error::unavailable(format!(
                "No node hosting `{model}` is available right now (restarting or lost); retry shortly."
            )),
        }
    }

    pub(crate) fn deadline(&self) -> Instant {
        Instant::now() + self.settings().request_timeout
    }

    /// Tokenizes on `target`; if that node fails, moves `target` to the next node hosting
    /// the tier and tries there.
    pub(crate) async fn tokenize(
        &self,
        target: &mut Target,
        model: &str,
        parts: Vec<chat::PromptPart>,
    ) -> Result<Vec<i32>, Error> {
        let d = &self.inner.dispatcher;
        let mut failed: Vec<String> = vec![];
        loop {
            match d.tokenize(target, model, parts.clone()).await {
                Ok(t) => return Ok(t),
                Err(why) => self.fail_over(target, model, &mut failed, &why)?,
            }
        }
    }

    /// After `target` could not answer (`why`): moves it to the next node hosting `model`
    /// (a remote target, at most [`super::dispatch::MAX_ATTEMPTS`] nodes), or gives up.
    fn fail_over(
        &self,
        target: &mut Target,
        model: &str,
        failed: &mut Vec<String>,
        why: &str,
    ) -> Result<(), Error> {
        if let Target::Remote { node, .. } = &*target {
            failed.push(node.clone());
        }
        let next = match &*target {
            Target::Remote { .. } if failed.len() < super::dispatch::MAX_ATTEMPTS => {
                self.inner.dispatcher.route(model, failed).ok()
            }
            _ => None,
        };
        match next {
            Some(t) => {
                *target = t;
                Ok(())
            }
            None => Err(Error::unavailable(format!(
                "No node hosting `{model}` is available right now ({why}); retry shortly."
            ))),
        }
    }

    /// Renders `p`'s conversation with the chat template of `model` on `target` and reads
    /// the grammar and parse options off its format; if that node fails, moves `target` to
    /// the next node hosting the tier and tries there. A template that refuses the
    /// conversation is the caller's error.
    pub(crate) async fn render(
        &self,
        target: &mut Target,
        model: &str,
        call: &ChatCall,
        p: &Prepared,
    ) -> Result<TierPrompt, Error> {
        let d = &self.inner.dispatcher;
        let mut failed: Vec<String> = vec![];
        let r = loop {
            match d.render(target, model, &p.input).await {
                Ok(r) => break r,
                Err(RenderError::Refused(m)) => {
                    return Err(Error::invalid(m, Some("messages")));
                }
                Err(RenderError::Unavailable(why)) => {
                    self.fail_over(target, model, &mut failed, &why)?
                }
            }
        };
        let (grammar, parse) = constrain(call, p, &r.spec, r.thinking_open)?;
        Ok(TierPrompt {
            tokens: r.tokens,
            grammar,
            parse,
        })
    }

    /// With more tools than `route_above`, the router actor keeps its top-k for the
    /// conversation's current step ([`step_query`]); a `tool_choice` tool and the tools
    /// earlier steps called always stay. Routing problems (no embedding
    /// model, duplicate names, the router down) are logged and the call keeps every tool.
    pub(crate) async fn route_tools(
        &self,
        call: &mut ChatCall,
        top_k: usize,
    ) -> Option<RouterInfo> {
        let cfg = &self.settings().tool_routing;
        if cfg.route_above == 0 || call.tools.len() <= cfg.route_above {
            return None;
        }
        if call.tool_choice == ToolChoice::None {
            return None;
        }
        // This node's router, else (a gateway without tiers) a peer's.
        let local = self.inner.actors.router.clone();
        let peer = match (&local, self.cluster()) {
            (None, Some(c)) => Some((
                c.clone(),
                c.peers_with(RouterProtocol::ACTOR).into_iter().next()?,
            )),
            (None, None) => return None,
            _ => None,
        };
        let StepQuery { intent, used } = step_query(&call.messages)?;
        let query = RouteQuery {
            tools: call
                .tools
                .iter()
                .map(|t| Tool {
                    name: t.name.clone(),
                    description: t.description.clone(),
                    parameters: t.parameters.clone(),
                })
                .collect(),
            intent,
            top_k,
            forced: match &call.tool_choice {
                ToolChoice::Named(n) => Some(n.clone()),
                _ => None,
            },
        };
        let offered = call.tools.len();
        let offered_scope = cache_scope(&call.tools);
        let routed = async {
            match (&local, &peer) {
                (Some(slot), _) => router::ask(slot, query).await,
                (None, Some((cluster, node))) => cluster
                    .route_tools(node, router::to_wire(&query))
                    .await
                    .map_err(|e| e.to_string())
                    .and_then(router::routed_from_wire),
                (None, None) => Err("no router".into()),
            }
        }
        .instrument(info_span!(
            "router.route",
            mesh.router.offered = offered,
            mesh.router.peer = peer.as_ref().map_or("", |p| p.1.as_str())
        ))
        .await;
        let m = self.metrics();
        let outcome = |o: &str| {
            m.tool_routing
                .get_or_create(&RoutingLabel { outcome: o.into() })
                .inc();
        };
        match routed {
            Ok(mut info) => {
                outcome("routed");
                // Tools earlier steps called stay offered (after the routed ones).
                for u in &used {
                    if !info.shown.contains(u) && call.tools.iter().any(|t| &t.name == u) {
                        info.shown.push(u.clone());
                    }
                }
                // The previous step's list first, in its order, then this step's other
                // tools in the request's order (so requests routed to the same tools share
                // one prompt prefix, and a conversation's steps extend each other's).
                let routed: Vec<String> = call
                    .tools
                    .iter()
                    .filter(|t| info.shown.contains(&t.name))
                    .map(|t| t.name.clone())
                    .collect();
                let kept: Vec<String> = call
                    .keep_tools
                    .iter()
                    .filter(|n| call.tools.iter().any(|t| &t.name == *n))
                    .cloned()
                    .collect();
                let listed = mesh_control::router::listing_order(&kept, &routed, 2 * routed.len());
                for n in &listed {
                    if !info.shown.contains(n) {
                        info.shown.push(n.clone());
                    }
                }
                let mut tools = std::mem::take(&mut call.tools);
                call.tools = listed
                    .iter()
                    .filter_map(|n| {
                        let i = tools.iter().position(|t| &t.name == n)?;
                        Some(tools.swap_remove(i))
                    })
                    .collect();
                info.listed = listed;
                call.scope = Some(offered_scope);
                m.tools_removed.inc_by((offered - call.tools.len()) as u64);
                Some(info)
            }
            Err(e) => {
                outcome("failed");
                warn!(error = %e, "tool routing failed; the prompt shows every tool");
                None
            }
        }
    }

    /// The thinking budget of a request, from the governor actor (or, when it cannot
    /// answer, from the same rule here).
    async fn thinking_budget(
        &self,
        policy: &Policy,
        role: RequestRole,
        requested: Option<usize>,
        confidence: Option<f32>,
    ) -> Option<usize> {
        let query = BudgetQuery {
            role,
            requested,
            confidence,
            policy: policy.reasoning.clone(),
        };
        match governor::ask(&self.inner.actors.governor, query).await {
            Some(b) => b,
            None => {
                warn!("the governor did not answer; deciding the budget here");
                governor::budget(&policy.reasoning, role, requested, confidence)
            }
        }
    }

    /// The request a chat call sends to a tier with `max_seq_len` tokens of context.
    pub(crate) async fn build_request(
        &self,
        call: &ChatCall,
        p: &Prepared,
        tp: &TierPrompt,
        max_seq_len: usize,
        policy: &Policy,
        role: RequestRole,
    ) -> Result<GenerateRequest, Error> {
        let prompt = tp.tokens.clone();
        let max_tokens = budget(
            self.settings().default_max_tokens,
            max_seq_len,
            prompt.len(),
            call.max_tokens,
        )?;
        let sampling = sampling(&call.sampling)?;
        let reasoning_budget = self
            .thinking_budget(policy, role, call.reasoning_budget, p.confidence)
            .await;
        Ok(GenerateRequest {
            prompt,
            max_tokens,
            sampling,
            stop: call.stop.clone(),
            grammar: tp.grammar.as_ref().map(|g| g.grammar.clone()),
            grammar_trigger: tp
                .grammar
                .as_ref()
                .and_then(|g| g.trigger_words.first().cloned()),
            grammar_patterns: tp
                .grammar
                .as_ref()
                .map(|g| g.trigger_patterns.clone())
                .unwrap_or_default(),
            logprobs: call.logprobs,
            ignore_eos: call.ignore_eos,
            request_id: String::new(),
            cache_scope: p.scope.clone(),
            reasoning_budget,
            thinking_open: tp.parse.thinking_open,
            draft_max: Some(policy.draft_k_max),
        })
    }

    /// The engine a request of `role` runs on: for a local tier, the one the quantization
    /// policy names (or the tier's own); a peer's tier as it is.
    pub(crate) fn engine_for(
        &self,
        target: Target,
        tier: &str,
        role: RequestRole,
        q: &mesh_control::policy::QuantPolicy,
    ) -> (Target, Option<super::EngineInfo>, Option<Arc<()>>) {
        match target {
            Target::Local(entry) => {
                let p = self.engines().pick(q, role, tier, entry);
                (Target::Local(p.entry), Some(p.info), p.lease)
            }
            remote => (remote, None, None),
        }
    }

    /// Sends `job` to `target` (failing over as [`super::dispatch`] says); the token stream.
    pub(crate) async fn submit(
        &self,
        target: Target,
        job: &Job,
        deadline: Instant,
    ) -> Result<tokio::sync::mpsc::UnboundedReceiver<mesh_tiers::TokenEvent>, Error> {
        let retry = self.settings().retry_after_s;
        let m = self.metrics();
        if job.req.reasoning_budget.is_some() {
            m.reasoning_budgeted(&job.model);
        }
        if let Some(e) = &job.engine {
            m.engine_requests
                .get_or_create(&EngineLabel {
                    model: job.model.clone(),
                    gguf: e.gguf.clone(),
                    kv_type: e.kv_type.clone(),
                    role: e.role.clone(),
                })
                .inc();
        }
        self.inner
            .dispatcher
            .clone()
            .dispatch(
                target,
                job.model.clone(),
                job.req.clone(),
                job.role,
                deadline.into(),
            )
            .await
            .map_err(|e| match e {
                StartError::Tier(e) => Error::from_tier(e, retry),
                StartError::Call(mesh_actors::CallError::Remote(r)) => {
                    Error::from_tier(mesh_actors::tier::remote_to_tier(&r), retry)
                }
                StartError::Call(e) => {
                    Error::unavailable(format!("no node could take the request: {e}"))
                }
            })
    }

    /// A chat completion under the live policy.
    pub async fn chat(&self, call: ChatCall) -> Result<Reply, Error> {
        self.chat_with(call, self.policy()).await
    }

    /// The prompt tokens a chat call would be answered from, tools routed as a completion
    /// would route them (Anthropic's `count_tokens`). The cascade counts with its first
    /// tier's tokenizer.
    pub async fn count_tokens(&self, mut call: ChatCall) -> Result<usize, Error> {
        let policy = self.policy();
        let routed = self.route_tools(&mut call, policy.router_top_k).await;
        let model = if call.model == policy.cascade.model {
            policy
                .cascade
                .tiers
                .first()
                .cloned()
                .ok_or_else(|| Error::unavailable("the cascade has no tiers"))?
        } else {
            call.model.clone()
        };
        let p = prepare(&call, routed.as_ref())?;
        let mut tier = self.find_tier_waiting(&model, self.deadline()).await?;
        Ok(self
            .render(&mut tier, &model, &call, &p)
            .await?
            .tokens
            .len())
    }

    /// A chat completion under `policy` (the live one, or a tuner trial's).
    pub async fn chat_with(&self, mut call: ChatCall, policy: Arc<Policy>) -> Result<Reply, Error> {
        let arrived = Instant::now();
        let deadline = self.deadline();
        let span = info_span!("gateway.chat", gen_ai.request.model = %call.model, gen_ai.operation.name = "chat",
            gen_ai.usage.input_tokens = tracing::field::Empty, mesh.tier = %call.model);
        call.sampling.admit_seed(random_seed);
        async move {
            let routed = self.route_tools(&mut call, policy.router_top_k).await;
            if call.model == policy.cascade.model {
                return self.cascade(call, arrived, deadline, routed, &policy).await;
            }
            let p = prepare(&call, routed.as_ref())?;
            let mut tier = self.find_tier_waiting(&call.model, deadline).await?;
            let permit = self.permit()?;
            let tp = self
                .render(&mut tier, &call.model, &call, &p)
                .instrument(info_span!("render"))
                .await?;
            let prompt = &tp.tokens;
            // With the prompt known, prefer a node that holds its prefix pages.
            let tier = self
                .inner
                .dispatcher
                .route_prompt(&call.model, prompt, &p.scope)
                .await
                .unwrap_or(tier);
            tracing::Span::current().record("gen_ai.usage.input_tokens", prompt.len());
            let role = RequestRole::classify(!p.shown.is_empty(), call.reasoning_budget);
            let (tier, engine, lease) =
                self.engine_for(tier, &call.model, role, &policy.quantization);
            let req = self
                .build_request(&call, &p, &tp, tier.max_seq_len(), &policy, role)
                .await?;
            let job = Job {
                model: call.model.clone(),
                req,
                engine,
                lease,
                role,
            };
            let rx = self
                .submit(tier.clone(), &job, deadline)
                .instrument(info_span!("tier.submit"))
                .await?;
            let guard = self.repeat_guard(&call, &tp, &tier, &job, deadline);
            let mut reply = job.reply(self, rx, Some(permit), routed, arrived, Some(tp.parse));
            reply.guard = guard;
            reply.prompt_token_ids = call.return_token_ids.then(|| prompt.clone());
            Ok(reply)
        }
        .instrument(span.clone())
        .await
        .map(|mut reply| {
            reply.mesh.trace_id = crate::telemetry::trace_id(&span);
            reply
        })
    }

    /// The retry of a reply that only repeats a call the conversation just answered: the
    /// conversation rendered again without its tools (as `tool_choice: none` renders it),
    /// the answer held to words ([`grammar::text_answer`]). A small model that loops on a
    /// call its result is already there for then answers from the result. None when the
    /// conversation does not end with tool results, or the reply's tokens must stay as they
    /// come (log-probabilities asked for).
    fn repeat_guard(
        &self,
        call: &ChatCall,
        tp: &TierPrompt,
        target: &Target,
        job: &Job,
        deadline: Instant,
    ) -> Option<super::RepeatGuard> {
        let answered = answered_calls(&call.messages);
        if answered.is_empty() || call.logprobs.is_some() || tp.parse.tools == ToolNames::None {
            return None;
        }
        let retry_call = ChatCall {
            tool_choice: ToolChoice::None,
            ..call.clone()
        };
        let mut req = job.req.clone();
        req.grammar_trigger = None;
        req.grammar_patterns = vec![];
        let retry = Job {
            model: job.model.clone(),
            req,
            engine: job.engine.clone(),
            lease: job.lease.clone(),
            role: job.role,
        };
        let (service, mut target) = (self.clone(), target.clone());
        let metrics = self.metrics().clone();
        let model = call.model.clone();
        Some(super::RepeatGuard {
            answered,
            retry: Box::new(move || {
                Box::pin(async move {
                    let mut retry = retry;
                    let p = prepare(&retry_call, None)?;
                    let tp = service
                        .render(&mut target, &retry.model, &retry_call, &p)
                        .await?;
                    let spec = FormatSpec {
                        syntax: tp.parse.syntax.unwrap_or(ToolSyntax::Json),
                        think: tp.parse.think.clone(),
                        template_tools: true,
                        template: String::new(),
                    };
                    retry.req.grammar =
                        Some(grammar::text_answer(&spec, tp.parse.thinking_open).grammar);
                    retry.req.prompt = tp.tokens;
                    retry.req.thinking_open = tp.parse.thinking_open;
                    retry.req.cache_scope = p.scope;
                    service.submit(target, &retry, deadline).await
                })
            }),
            counted: Box::new(move || {
                metrics
                    .repeated_calls
                    .get_or_create(&crate::metrics::ModelLabel {
                        model: model.clone(),
                    })
                    .inc();
            }),
        })
    }

    /// A raw completion.
    pub async fn complete(&self, mut call: CompleteCall) -> Result<Reply, Error> {
        call.sampling.admit_seed(random_seed);
        let arrived = Instant::now();
        let deadline = self.deadline();
        let span = info_span!("gateway.completions", gen_ai.request.model = %call.model, gen_ai.operation.name = "text_completion");
        async move {
            let mut tier = self.find_tier_waiting(&call.model, deadline).await?;
            let permit = self.permit()?;
            let prompt = match call.prompt {
                // A raw prompt is the caller's own template: its control tokens are parsed.
                Prompt::Text(s) => {
                    self.tokenize(&mut tier, &call.model, vec![chat::PromptPart::template(s)])
                        .await?
                }
                Prompt::Tokens(t) => t,
            };
            let tier = self
                .inner
                .dispatcher
                .route_prompt(&call.model, &prompt, "")
                .await
                .unwrap_or(tier);
            let role = RequestRole::Summaries;
            let (tier, engine, lease) =
                self.engine_for(tier, &call.model, role, &self.policy().quantization);
            let max_tokens = budget(
                self.settings().default_max_tokens,
                tier.max_seq_len(),
                prompt.len(),
                call.max_tokens,
            )?;
            let req = GenerateRequest {
                prompt,
                max_tokens,
                sampling: sampling(&call.sampling)?,
                stop: call.stop,
                ignore_eos: call.ignore_eos,
                logprobs: call.logprobs,
                ..Default::default()
            };
            let job = Job {
                model: call.model.clone(),
                req,
                engine,
                lease,
                role,
            };
            let rx = self.submit(tier, &job, deadline).await?;
            Ok(job.reply(self, rx, Some(permit), None, arrived, None))
        }
        .instrument(span.clone())
        .await
        .map(|mut reply| {
            reply.mesh.trace_id = crate::telemetry::trace_id(&span);
            reply
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tools() -> Vec<ToolSpec> {
        vec![ToolSpec {
            name: "f".into(),
            description: String::new(),
            parameters: json!({"type": "object"}),
        }]
    }

    fn msg(role: Role, content: &str, calls: &[&str]) -> ChatMessage {
        ChatMessage {
            role,
            content: content.into(),
            tool_calls: calls
                .iter()
                .map(|n| chat::ToolCall::new(*n, json!({})))
                .collect(),
            ..ChatMessage::default()
        }
    }

    #[test]
    fn a_plain_request_routes_on_its_last_user_message() {
        let q = step_query(&[
            msg(Role::System, "be brief", &[]),
            msg(Role::User, "book a flight", &[]),
            msg(Role::Assistant, "done", &[]),
            msg(Role::User, "now a hotel", &[]),
        ])
        .unwrap();
        assert_eq!(q.intent, "now a hotel");
    }

    #[test]
    fn the_models_stated_next_step_is_the_intent() {
        let q = step_query(&[
            msg(Role::User, "plan my trip", &[]),
            msg(Role::Assistant, "First the flight.", &["search_flights"]),
            msg(Role::Tool, "{\"flights\": []}", &[]),
            msg(
                Role::Assistant,
                "No flights; I will look for trains.",
                &["search_trains"],
            ),
            msg(Role::Tool, "{\"trains\": [1]}", &[]),
        ])
        .unwrap();
        assert_eq!(q.intent, "No flights; I will look for trains.");
    }

    #[test]
    fn tool_calls_without_text_leave_the_user_message_as_the_intent() {
        let q = step_query(&[
            msg(Role::User, "plan my trip", &[]),
            msg(Role::Assistant, " ", &["search_flights"]),
            msg(Role::Tool, "{\"flights\": []}", &[]),
        ])
        .unwrap();
        assert_eq!(q.intent, "plan my trip");
    }

    #[test]
    fn tools_already_called_are_listed_once_in_order() {
        let q = step_query(&[
            msg(Role::User, "go", &[]),
            msg(Role::Assistant, "", &["b", "a"]),
            msg(Role::Tool, "ok", &[]),
            msg(Role::Assistant, "", &["a", "c"]),
        ])
        .unwrap();
        assert_eq!(q.used, ["b", "a", "c"]);
    }

    #[test]
    fn no_user_text_means_no_routing() {
        assert_eq!(
            step_query(&[msg(Role::System, "s", &[]), msg(Role::User, " ", &[])]),
            None
        );
    }

    #[test]
    fn a_conversation_ending_in_tool_results_has_answered_calls() {
        let msgs = [
            msg(Role::User, "weather?", &[]),
            msg(Role::Assistant, "", &["get_weather"]),
            msg(Role::Tool, "{\"t\": 18}", &[]),
        ];
        let a = answered_calls(&msgs);
        assert_eq!(a.len(), 1);
        assert_eq!(a[0].name, "get_weather");
    }

    #[test]
    fn a_conversation_ending_with_the_user_has_none() {
        let msgs = [
            msg(Role::Assistant, "", &["get_weather"]),
            msg(Role::Tool, "x", &[]),
            msg(Role::User, "and now?", &[]),
        ];
        assert!(answered_calls(&msgs).is_empty());
    }

    #[test]
    fn only_the_same_call_with_the_same_arguments_is_a_repeat() {
        let answered = [chat::ToolCall::new("w", json!({"city": "Paris"}))];
        let same = [chat::ToolCall::new("w", json!({"city": "Paris"}))];
        let other_city = [chat::ToolCall::new("w", json!({"city": "Rome"}))];
        let other_tool = [chat::ToolCall::new("t", json!({"city": "Paris"}))];
        assert!(super::super::repeats_answered(&same, &answered));
        assert!(!super::super::repeats_answered(&other_city, &answered));
        assert!(!super::super::repeats_answered(&other_tool, &answered));
        assert!(!super::super::repeats_answered(&[], &answered));
    }

    #[test]
    fn tool_choice_none_hides_tools() {
        let (shown, forced) = tool_plan(tools(), &ToolChoice::None).unwrap();
        assert!(shown.is_empty() && forced.is_none());
    }

    #[test]
    fn auto_offers_tools_without_forcing_a_call() {
        let (shown, forced) = tool_plan(tools(), &ToolChoice::Unset).unwrap();
        assert_eq!(shown.len(), 1);
        assert!(forced.is_none());
    }

    #[test]
    fn a_named_tool_is_forced() {
        let (_, forced) = tool_plan(tools(), &ToolChoice::Named("f".into())).unwrap();
        assert_eq!(forced.unwrap()[0].name, "f");
    }

    #[test]
    fn a_large_tool_set_has_a_short_scope_of_its_own() {
        let named = |n: usize| -> Vec<ToolSpec> {
            (0..n)
                .map(|i| ToolSpec {
                    name: format!("catalog_tool_{i}"),
                    ..tools()[0].clone()
                })
                .collect()
        };
        let (all, fewer) = (cache_scope(&named(200)), cache_scope(&named(199)));
        assert!(all.len() < 80 && fewer.len() < 80, "{all}");
        assert_ne!(all, fewer);
        assert_eq!(cache_scope(&tools()), "tools:f");
    }

    fn call_with(choice: ToolChoice, format: ResponseFormat) -> ChatCall {
        ChatCall {
            messages: vec![ChatMessage::text(Role::User, "q")],
            tools: tools(),
            tool_choice: choice,
            response_format: format,
            ..ChatCall::default()
        }
    }

    #[test]
    fn auto_gets_the_lazy_grammar_of_the_formats_syntax() {
        let call = call_with(ToolChoice::Auto, ResponseFormat::Text);
        let p = prepare(&call, None).unwrap();
        let (g, parse) = constrain(&call, &p, &FormatSpec::mesh_tiers(), false).unwrap();
        assert!(g.unwrap().is_lazy());
        assert_eq!(parse.tools, ToolNames::Only(vec!["f".into()]));
    }

    #[test]
    fn response_format_json_constrains_from_the_first_token() {
        let mut call = call_with(ToolChoice::None, ResponseFormat::JsonObject);
        call.tools.clear();
        let p = prepare(&call, None).unwrap();
        let (g, parse) = constrain(&call, &p, &FormatSpec::mesh_tiers(), false).unwrap();
        let g = g.unwrap();
        assert!(!g.is_lazy() && g.grammar.starts_with("root ::= mesh-think? mesh-json"));
        assert_eq!(parse.tools, ToolNames::None);
    }

    #[test]
    fn tool_choice_none_parses_no_calls() {
        let call = call_with(ToolChoice::None, ResponseFormat::Text);
        let p = prepare(&call, None).unwrap();
        let (g, parse) = constrain(&call, &p, &FormatSpec::mesh_tiers(), false).unwrap();
        assert!(g.is_none());
        assert_eq!(parse.tools, ToolNames::None);
    }

    #[test]
    fn naming_a_tool_not_offered_is_refused_on_tool_choice() {
        let e = tool_plan(tools(), &ToolChoice::Named("zzz".into())).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
    }

    #[test]
    fn the_budget_fits_the_context() {
        assert_eq!(budget(100, 50, 10, None).unwrap(), 40);
        assert_eq!(budget(100, 500, 10, Some(7)).unwrap(), 7);
        assert_eq!(
            budget(100, 50, 10, Some(41)).unwrap_err().kind,
            super::super::Kind::ContextLengthExceeded
        );
        assert_eq!(
            budget(100, 50, 10, Some(0)).unwrap_err().param.as_deref(),
            Some("max_tokens")
        );
    }
}
