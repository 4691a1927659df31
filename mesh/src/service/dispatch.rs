//! Where a request runs, and keeping it running: the node for a tier (this node's engine or
//! a peer's, by load and by the prompt's prefix pages), the prefix pages a node pulls from a
//! peer before its tier runs, and the token stream relayed across failures.
//!
//! **Failover.** When the serving node is lost (stream error, connection closed) or a local
//! engine stops, the request is re-run on the next best node with the same prompt,
//! sampling and seed; the re-run's first *n* tokens, already sent, are skipped, so the
//! caller sees one stream with the tokens it would have had. When no other node hosts the
//! tier and this node does, the request waits for the local engine's restart (bounded by
//! its deadline) instead of failing: a crashed engine on a single node delays its requests,
//! it does not drop them.
//!
//! **Prefill/decode split** (roles `prefill` and `decode`). A decode node that is to run a
//! prompt with many tokens that neither it nor a peer holds as pages hands the prompt to a `prefill` node
//! first ([`routing::prefill_peer`] decides, from the prompt's length and the prefill
//! nodes' queues): that node computes it, one token long, and publishes its pages; the
//! decode node pulls them over QUIC and decodes from them, so long prompts do not stall
//! the sequences it is decoding. When the hand-off fails the decode node prefills itself.
//! Requests are routed to a prefill node for decoding only when no other node hosts the
//! tier.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use mesh_actors::engines::{Engines, TierEntry};
use mesh_actors::pagestore::{PageStores, StoreMsg};
use mesh_actors::routing::{self, Candidate};
use mesh_actors::tier::{self as tier_wire, TierMsg};
use mesh_actors::wire::{ErrorClass, Event};
use mesh_actors::{CallError, Cluster, InflightGuard};
use mesh_control::policy::Role;
use mesh_kvstore::PageId;
use mesh_tiers::chat::PromptPart;
use mesh_tiers::{GenerateRequest, TierError, TokenEvent};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::warn;

/// Most nodes one request is tried on before the caller gets an error.
pub const MAX_ATTEMPTS: usize = 4;

/// This node's part in the prefill/decode split (roles `prefill` and `decode`).
#[derive(Debug, Clone, Default)]
pub struct Split {
    /// A decode node: hands long prompts to prefill nodes under this rule.
    pub handoff: Option<routing::Handoff>,
    /// A prefill node: requests are routed here for decoding only when no other node
    /// hosts their tier.
    pub prefill_only: bool,
    /// Hand-offs made and failed, shared by the node's dispatchers.
    pub counts: Arc<HandoffCounts>,
}

/// Prompts a decode node handed to prefill nodes (`mesh_prefill_handoffs_total`).
#[derive(Debug, Default)]
pub struct HandoffCounts {
    /// Prefilled there; the decode node then pulled the pages.
    pub done: AtomicU64,
    /// The prefill node failed or refused; the decode node prefilled itself.
    pub failed: AtomicU64,
}

/// Where a request runs.
#[derive(Debug, Clone)]
pub enum Target {
    /// A tier actor of this node.
    Local(TierEntry),
    /// A tier on a peer.
    Remote {
        /// Peer name.
        node: String,
        /// Per-sequence context of that tier.
        max_seq_len: usize,
    },
}

impl Target {
    /// Per-sequence context limit.
    pub fn max_seq_len(&self) -> usize {
        match self {
            Target::Local(e) => e.desc.info.max_seq_len,
            Target::Remote { max_seq_len, .. } => *max_seq_len,
        }
    }
}

/// Why no target could be chosen.
#[derive(Debug, Clone)]
pub enum RouteError {
    /// No node (local or remote) knows this tier name.
    Unknown(Vec<String>),
    /// The tier exists (configured here or seen in the cluster) but no live node can take it now.
    NoneAvailable,
}

/// Why a conversation was not rendered.
#[derive(Debug, Clone)]
pub enum RenderError {
    /// The tier's chat template refused it: the caller's to fix.
    Refused(String),
    /// The node could not answer: another may.
    Unavailable(String),
}

/// Why a start failed.
#[derive(Debug)]
pub enum StartError {
    /// A local tier refused.
    Tier(TierError),
    /// A remote call failed.
    Call(CallError),
}

impl StartError {
    fn retryable(&self) -> bool {
        match self {
            StartError::Tier(e) => matches!(e, TierError::EngineStopped),
            StartError::Call(e) => {
                e.retryable()
                    && !matches!(e, CallError::Remote(r) if r.class == ErrorClass::Overloaded)
            }
        }
    }
}

enum Source {
    Local(mpsc::UnboundedReceiver<TokenEvent>),
    Remote(mpsc::UnboundedReceiver<Result<Event, CallError>>),
}

impl Source {
    /// Next event; `Err` when the run broke (engine stopped, node lost).
    async fn next(&mut self) -> Result<TokenEvent, String> {
        match self {
            Source::Local(rx) => match rx.recv().await {
                Some(TokenEvent::Error(e)) => Err(e),
                Some(ev) => Ok(ev),
                None => Err("the tier stopped before finishing".into()),
            },
            Source::Remote(rx) => match rx.recv().await {
                Some(Ok(Event::Error(e))) => Err(e),
                Some(Ok(ev)) => Ok(tier_wire::from_wire(ev)),
                Some(Err(e)) => Err(e.to_string()),
                None => Err("the remote stream ended before finishing".into()),
            },
        }
    }
}

/// Routing over this node's engines and the cluster.
#[derive(Debug, Clone)]
pub struct Dispatcher {
    /// This node's engines.
    pub engines: Engines,
    /// This node's page stores.
    pub pages: PageStores,
    /// The cluster, when this node is in one.
    pub cluster: Option<Cluster>,
    /// Longest a request waits for this node's restarting engine.
    pub restart_wait: Duration,
    /// This node's part in the prefill/decode split.
    pub split: Split,
    /// Requests re-run after the engine or node serving them failed (shared by clones).
    reruns: Arc<AtomicU64>,
}

impl Dispatcher {
    /// Routing over `engines`, `pages` and the cluster, with its re-run count at zero.
    pub fn new(
        engines: Engines,
        pages: PageStores,
        cluster: Option<Cluster>,
        restart_wait: Duration,
    ) -> Self {
        Self {
            engines,
            pages,
            cluster,
            restart_wait,
            split: Split::default(),
            reruns: Arc::default(),
        }
    }

    /// The same dispatcher playing `split`'s part in the prefill/decode split.
    pub fn with_split(mut self, split: Split) -> Self {
        self.split = split;
        self
    }

    /// Requests this dispatcher re-ran (on a peer, or on this node's restarted engine)
    /// after the engine or node serving them failed (`mesh_request_reruns_total`).
    pub fn reruns(&self) -> u64 {
        self.reruns.load(Relaxed)
    }

    fn me(&self) -> &str {
        self.cluster.as_ref().map(|c| c.name()).unwrap_or("local")
    }

    /// Every tier name this node can route to.
    pub fn tier_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.engines.table().running.keys().cloned().collect();
        if let Some(c) = &self.cluster {
            names.extend(c.remote_tier_names());
        }
        names.sort();
        names.dedup();
        names
    }

    fn candidates(&self, model: &str) -> (Vec<Candidate>, Option<TierEntry>) {
        let mut cands = vec![];
        let local = self.engines.get(model);
        if let Some(e) = &local {
            let s = &e.desc.stats;
            cands.push(Candidate {
                node: self.me().to_owned(),
                local: true,
                active: s.active.load(Relaxed) as u32,
                queued: s.queued.load(Relaxed) as u32,
                n_seq_max: e.desc.info.n_seq_max as u32,
                inflight: 0,
                cached_tokens: 0,
                prompt_tokens: 0,
            });
        }
        if let Some(c) = &self.cluster {
            cands.extend(c.candidates(model));
            // Prefill nodes decode only when no other node hosts the tier.
            let prefill = c.peers_in_role(crate::config::Role::Prefill.as_str());
            routing::decoders(&mut cands, |x| {
                if x.local {
                    self.split.prefill_only
                } else {
                    prefill.contains(&x.node)
                }
            });
        }
        (cands, local)
    }

    fn resolve(
        &self,
        model: &str,
        cands: &[Candidate],
        local: Option<TierEntry>,
        exclude: &[String],
    ) -> Result<Target, RouteError> {
        match routing::pick(cands, exclude) {
            Some(c) if c.local => Ok(Target::Local(local.expect("local candidate has an entry"))),
            Some(c) => {
                let cluster = self
                    .cluster
                    .as_ref()
                    .expect("remote candidate has a cluster");
                let adv = cluster
                    .remote_tier(&c.node, model)
                    .ok_or(RouteError::NoneAvailable)?;
                Ok(Target::Remote {
                    node: c.node.clone(),
                    max_seq_len: adv.max_seq_len as usize,
                })
            }
            None if self.engines.hosts(model)
                || !cands.is_empty()
                || !exclude.is_empty()
                || self.cluster.as_ref().is_some_and(|c| c.ever_hosted(model)) =>
            {
                Err(RouteError::NoneAvailable)
            }
            None => Err(RouteError::Unknown(self.tier_names())),
        }
    }

    /// Picks the node for `model` by load, skipping `exclude`.
    pub fn route(&self, model: &str, exclude: &[String]) -> Result<Target, RouteError> {
        let (cands, local) = self.candidates(model);
        self.resolve(model, &cands, local, exclude)
    }

    /// [`route`](Self::route); when nothing can take `model` now but this node hosts it
    /// (its engine is restarting), waits up to `wait` for the engine to be back.
    ///
    /// Cancel safety: cancel-safe.
    pub async fn route_or_wait(&self, model: &str, wait: Duration) -> Result<Target, RouteError> {
        match self.route(model, &[]) {
            Err(RouteError::NoneAvailable) if self.engines.hosts(model) => self
                .engines
                .wait_for(model, wait, None)
                .await
                .map(Target::Local)
                .ok_or(RouteError::NoneAvailable),
            r => r,
        }
    }

    /// Picks the node for a tokenized prompt by load and by how much of its prefix each node
    /// holds as KV pages (`routing::score`); `None` when no node can take it now.
    ///
    /// Cancel safety: cancel-safe.
    pub async fn route_prompt(&self, model: &str, prompt: &[i32], scope: &str) -> Option<Target> {
        let (mut cands, local) = self.candidates(model);
        let usable = &prompt[..prompt.len().saturating_sub(1)];
        // Page ids from the local tier, else from a peer's advertised salt base.
        let params = local
            .as_ref()
            .and_then(|e| e.desc.pages.as_ref().map(|p| (p.base, p.block)))
            .or_else(|| {
                let (base, block) = self.cluster.as_ref()?.page_params(model)?;
                let base: [u8; 32] = base.as_slice().try_into().ok()?;
                Some((mesh_kvstore::SaltBase(base), block as usize))
            });
        // With no peer to weigh against, the local tier takes it whatever it holds.
        let params = params.filter(|_| cands.iter().any(|c| !c.local));
        if let Some((base, block)) = params {
            let ids = mesh_kvstore::chain(&base.salt(scope), usable, block);
            let local_run = if local.as_ref().is_some_and(|e| e.desc.pages.is_some()) {
                self.stored_run(model, &ids).await
            } else {
                0
            };
            let short: Vec<u64> = ids.iter().map(PageId::short).collect();
            let peer_runs = self
                .cluster
                .as_ref()
                .map(|c| c.prefix_runs(model, &base.0, block as u32, &short))
                .unwrap_or_default();
            for c in &mut cands {
                c.prompt_tokens = prompt.len() as u32;
                let run = if c.local {
                    local_run
                } else {
                    peer_runs
                        .iter()
                        .find(|(n, _)| *n == c.node)
                        .map_or(0, |(_, run)| *run)
                };
                c.cached_tokens = (run * block) as u32;
            }
        }
        self.resolve(model, &cands, local, &[]).ok()
    }

    /// Leading pages of `ids` this node's store holds for `model`.
    async fn stored_run(&self, model: &str, ids: &[PageId]) -> usize {
        let held = self
            .pages
            .call(|reply| StoreMsg::Held {
                ns: model.to_owned(),
                ids: ids.to_vec(),
                reply,
            })
            .await
            .unwrap_or_default();
        held.iter().take_while(|h| **h).count()
    }

    /// Renders a conversation with the target's chat template and tokenizes it.
    ///
    /// Cancel safety: cancel-safe.
    pub async fn render(
        &self,
        target: &Target,
        model: &str,
        input: &mesh_tiers::format::ChatInput,
    ) -> Result<tier_wire::Rendered, RenderError> {
        match target {
            Target::Local(e) => {
                let input = Box::new(input.clone());
                match ractor::call!(e.actor, |reply| TierMsg::Render { input, reply }) {
                    Ok(Ok(r)) => Ok(r),
                    Ok(Err(e)) => Err(RenderError::Refused(e.to_string())),
                    Err(e) => Err(RenderError::Unavailable(format!("tier unavailable: {e}"))),
                }
            }
            Target::Remote { node, .. } => self
                .cluster
                .as_ref()
                .expect("remote target has a cluster")
                .render(node, model, input)
                .await
                .map_err(|e| match e {
                    CallError::Remote(r) if r.class == ErrorClass::InvalidRequest => {
                        RenderError::Refused(r.message)
                    }
                    e => RenderError::Unavailable(e.to_string()),
                }),
        }
    }

    /// Tokenizes the prompt `parts` with the target's tokenizer.
    ///
    /// Cancel safety: cancel-safe.
    pub async fn tokenize(
        &self,
        target: &Target,
        model: &str,
        parts: Vec<PromptPart>,
    ) -> Result<Vec<i32>, String> {
        match target {
            Target::Local(e) => ractor::call!(e.actor, |reply| TierMsg::Tokenize { parts, reply })
                .map_err(|e| format!("tier unavailable: {e}")),
            Target::Remote { node, .. } => self
                .cluster
                .as_ref()
                .expect("remote target has a cluster")
                .tokenize(node, model, &parts)
                .await
                .map_err(|e| e.to_string()),
        }
    }

    async fn start(
        &self,
        target: &Target,
        model: &str,
        req: &GenerateRequest,
        role: Role,
        deadline: Instant,
    ) -> Result<(Source, Option<InflightGuard>), StartError> {
        match target {
            Target::Local(e) => {
                prefetch(self, model, &req.prompt, &req.cache_scope, deadline).await;
                let req = req.clone();
                match ractor::call!(e.actor, |reply| TierMsg::Generate { req, reply }) {
                    Ok(Ok(rx)) => Ok((Source::Local(rx), None)),
                    Ok(Err(e)) => Err(StartError::Tier(e)),
                    Err(_) => Err(StartError::Tier(TierError::EngineStopped)),
                }
            }
            Target::Remote { node, .. } => {
                let cluster = self.cluster.as_ref().expect("remote target has a cluster");
                let guard = cluster.track(node, model);
                let left = deadline.saturating_duration_since(Instant::now());
                let call = tier_wire::to_call(
                    model,
                    req,
                    left,
                    role.as_str(),
                    crate::telemetry::inject_context(),
                );
                let rx = cluster
                    .generate(node, call)
                    .await
                    .map_err(StartError::Call)?;
                Ok((Source::Remote(rx), Some(guard)))
            }
        }
    }

    fn node_of(&self, t: &Target) -> String {
        match t {
            Target::Local(_) => self.me().to_owned(),
            Target::Remote { node, .. } => node.clone(),
        }
    }

    /// The next node for a request whose run on `failed` did not work: another node hosting
    /// the tier, or, when none can take it and this node hosts it, this node's engine once
    /// it is back (waiting until `deadline`).
    async fn next_target(
        &self,
        model: &str,
        failed: &Target,
        exclude: &mut Vec<String>,
        deadline: Instant,
    ) -> Option<Target> {
        if exclude.len() < MAX_ATTEMPTS {
            if let Ok(t) = self.route(model, exclude) {
                return Some(t);
            }
        }
        let Target::Local(dead) = failed else {
            return None;
        };
        let left = deadline
            .saturating_duration_since(Instant::now())
            .min(self.restart_wait);
        let back = self
            .engines
            .wait_for(model, left, Some(dead.actor.get_id()))
            .await?;
        let me = self.me().to_owned();
        exclude.retain(|n| n != &me);
        Some(Target::Local(back))
    }

    /// Starts `req` on `first` (or, if it refuses with a retryable error, on the next node)
    /// and returns the token stream. If the serving node is lost mid-stream the request is
    /// re-run elsewhere (or on this node's restarted engine) and the stream continues where
    /// it was. Gives up at `deadline`.
    ///
    /// Cancel safety: cancel-safe before it returns; afterwards dropping the receiver
    /// cancels the run.
    pub async fn dispatch(
        self: Arc<Self>,
        first: Target,
        model: String,
        req: GenerateRequest,
        role: Role,
        deadline: Instant,
    ) -> Result<mpsc::UnboundedReceiver<TokenEvent>, StartError> {
        let mut exclude: Vec<String> = vec![];
        let mut target = first;
        let (mut src, mut guard) = loop {
            match self.start(&target, &model, &req, role, deadline).await {
                Ok(s) => break s,
                Err(e) if e.retryable() => {
                    let node = self.node_of(&target);
                    warn!(%node, tier = %model, error = ?e, "start failed; trying another node");
                    self.reruns.fetch_add(1, Relaxed);
                    exclude.push(node);
                    target = match self
                        .next_target(&model, &target, &mut exclude, deadline)
                        .await
                    {
                        Some(t) => t,
                        None => return Err(e),
                    };
                }
                Err(e) => return Err(e),
            }
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let me = self.clone();
        tokio::spawn(async move {
            let mut delivered = 0usize;
            let mut skip = 0usize;
            let mut rerun = false;
            loop {
                match src.next().await {
                    Ok(ev) => {
                        match &ev {
                            TokenEvent::Started { .. } if rerun => continue,
                            TokenEvent::Token { .. } if skip > 0 => {
                                skip -= 1;
                                continue;
                            }
                            TokenEvent::Token { .. } => delivered += 1,
                            _ => {}
                        }
                        let last = matches!(ev, TokenEvent::Done { .. });
                        if tx.send(ev).is_err() || last {
                            return;
                        }
                    }
                    Err(why) => {
                        if tx.is_closed() {
                            return;
                        }
                        let node = me.node_of(&target);
                        warn!(%node, tier = %model, delivered, reason = %why, "serving node failed; re-running");
                        exclude.push(node);
                        drop(guard.take());
                        let mut restarted = false;
                        let mut failed = target.clone();
                        while let Some(t) = me
                            .next_target(&model, &failed, &mut exclude, deadline)
                            .await
                        {
                            match me.start(&t, &model, &req, role, deadline).await {
                                Ok((s, g)) => {
                                    target = t;
                                    src = s;
                                    guard = g;
                                    restarted = true;
                                    break;
                                }
                                Err(e) => {
                                    warn!(node = %me.node_of(&t), error = ?e, "re-run refused");
                                    exclude.push(me.node_of(&t));
                                    failed = t;
                                }
                            }
                        }
                        if !restarted {
                            let _ = tx.send(TokenEvent::Error(format!(
                                "the node serving this request failed ({why}) and no node hosting `{model}` could take it in time"
                            )));
                            return;
                        }
                        skip = delivered;
                        rerun = true;
                        me.reruns.fetch_add(1, Relaxed);
                    }
                }
            }
        });
        Ok(rx)
    }
}

/// Pulls the leading prefix pages of `prompt` that this node lacks from the live peer
/// advertising the longest run of them; returns how many pages were stored. On a decode
/// node a long prompt is first handed to a prefill node ([`hand_off`]), and its pages are
/// pulled from there. Fetched pages are checked against their ids and salt by the store
/// before they are kept. Traced as `kv.lookup`: pages of the prompt, how many are local,
/// how many were pulled and from which peer.
#[tracing::instrument(name = "kv.lookup", skip_all, fields(gen_ai.request.model = %model,
    mesh.kv.pages = tracing::field::Empty, mesh.kv.pages_local = tracing::field::Empty,
    mesh.kv.pages_pulled = tracing::field::Empty, mesh.kv.peer = tracing::field::Empty))]
pub async fn prefetch(
    d: &Dispatcher,
    model: &str,
    prompt: &[i32],
    scope: &str,
    deadline: Instant,
) -> usize {
    let Some(cluster) = d.cluster.as_ref() else {
        return 0;
    };
    let Some(pages) = d.engines.get(model).and_then(|e| e.desc.pages.clone()) else {
        return 0;
    };
    let usable = prompt.len().saturating_sub(1);
    let (salt, ids) = pages.chain(&prompt[..usable], scope);
    let local = d.stored_run(model, &ids).await;
    let span = tracing::Span::current();
    span.record("mesh.kv.pages", ids.len());
    span.record("mesh.kv.pages_local", local);
    if local == ids.len() {
        return 0;
    }
    // Peers serving the tier, and store nodes keeping its pages.
    let short: Vec<u64> = ids.iter().map(PageId::short).collect();
    let runs = cluster.prefix_runs(model, &pages.base.0, pages.block as u32, &short);
    let handed = match &d.split.handoff {
        Some(h) => {
            // Pages a peer already holds need only a pull, not a prefill anywhere.
            let pullable = runs.iter().map(|(_, run)| *run).max().unwrap_or(0);
            let cached_here = local.max(pullable) * pages.block;
            hand_off(
                d,
                cluster,
                h,
                model,
                prompt,
                scope,
                cached_here,
                &runs,
                pages.block,
                deadline,
            )
            .await
        }
        None => None,
    };
    // The prefill node holds the whole prompt now, whatever its index entry says yet.
    let best = handed.map(|node| (node, ids.len())).or_else(|| {
        runs.into_iter()
            .filter(|(_, run)| *run > local)
            .max_by_key(|(_, run)| *run)
    });
    let Some((node, run)) = best else { return 0 };
    span.record("mesh.kv.peer", node.as_str());
    let want: Vec<[u8; 32]> = ids[local..run].iter().map(|i| i.0).collect();
    let t0 = std::time::Instant::now();
    // Keep the pulled pages that continue the prefix, in order, in this node's store (before
    // the pull ends, so a request arriving after it finds them local).
    let keep = {
        let (store, ns, expect) = (d.pages.clone(), model.to_owned(), ids[local..].to_vec());
        move |got: mesh_actors::cluster::PulledPages| {
            async move {
                let pulled: Vec<(PageId, bytes::Bytes)> = got
                    .into_iter()
                    .zip(&expect)
                    .take_while(|((id, _), expect)| *id == expect.0)
                    .map(|((id, stored), _)| (PageId(id), bytes::Bytes::from(stored)))
                    .collect();
                store
                    .call(|reply| StoreMsg::PutStored {
                        ns: ns.clone(),
                        salt,
                        pages: pulled.clone(),
                        reply,
                    })
                    .await
                    .unwrap_or(0)
            }
            .boxed()
        }
    };
    match cluster.fetch_pages(&node, model, salt.0, want, keep).await {
        Ok(n) => {
            span.record("mesh.kv.pages_pulled", n);
            tracing::debug!(%node, tier = %model, pages = n, ms = t0.elapsed().as_millis() as u64, "pulled prefix pages from a peer");
            n
        }
        Err(e) => {
            warn!(%node, tier = %model, error = %e, "pulling prefix pages failed; prefilling instead");
            0
        }
    }
}

/// A decode node's hand-off: when [`routing::prefill_peer`] picks a prefill node for this
/// prompt (`cached_here` of its tokens are pages here or on a peer; `runs` are the peers' indexed
/// prefix runs, in pages of `block` tokens), runs the prompt there for one token, which
/// stores its pages on that node before the call ends. Returns the node; `None` when the
/// prompt stays here or the prefill node failed (counted, logged: this node prefills).
///
/// Cancel safety: cancel-safe (dropping it cancels the call on the prefill node).
#[allow(clippy::too_many_arguments)]
#[tracing::instrument(name = "kv.handoff", skip_all, fields(gen_ai.request.model = %model,
    mesh.prefill.node = tracing::field::Empty, mesh.prefill.tokens = prompt.len()))]
async fn hand_off(
    d: &Dispatcher,
    cluster: &Cluster,
    h: &routing::Handoff,
    model: &str,
    prompt: &[i32],
    scope: &str,
    cached_here: usize,
    runs: &[(String, usize)],
    block: usize,
    deadline: Instant,
) -> Option<String> {
    let prefill = cluster.peers_in_role(crate::config::Role::Prefill.as_str());
    if prefill.is_empty() {
        return None;
    }
    let peers: Vec<Candidate> = cluster
        .candidates(model)
        .into_iter()
        .filter(|c| prefill.contains(&c.node))
        .map(|mut c| {
            c.prompt_tokens = prompt.len() as u32;
            c.cached_tokens = runs
                .iter()
                .find(|(n, _)| *n == c.node)
                .map_or(0, |(_, run)| (run * block) as u32);
            c
        })
        .collect();
    let node = routing::prefill_peer(h, prompt.len(), cached_here, &peers)?
        .node
        .clone();
    tracing::Span::current().record("mesh.prefill.node", node.as_str());
    let req = GenerateRequest {
        prompt: prompt.to_vec(),
        max_tokens: 1,
        cache_scope: scope.to_owned(),
        request_id: "prefill-handoff".into(),
        ..GenerateRequest::default()
    };
    let left = deadline.saturating_duration_since(Instant::now());
    let call = tier_wire::to_call(model, &req, left, "", crate::telemetry::inject_context());
    let _inflight = cluster.track(&node, model);
    let run = async {
        let mut rx = cluster
            .generate(&node, call)
            .await
            .map_err(|e| e.to_string())?;
        loop {
            match rx.recv().await {
                Some(Ok(Event::Done { .. })) => return Ok(()),
                Some(Ok(Event::Error(e))) => return Err(e),
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(e.to_string()),
                None => return Err("the prefill node's stream ended early".to_owned()),
            }
        }
    };
    let counts = &d.split.counts;
    match tokio::time::timeout_at(deadline, run).await {
        Ok(Ok(())) => {
            counts.done.fetch_add(1, Relaxed);
            Some(node)
        }
        Ok(Err(e)) => {
            counts.failed.fetch_add(1, Relaxed);
            warn!(%node, tier = %model, error = %e, "prefill hand-off failed; prefilling here");
            None
        }
        Err(_) => {
            counts.failed.fetch_add(1, Relaxed);
            warn!(%node, tier = %model, "prefill hand-off ran past the deadline; prefilling here");
            None
        }
    }
}
