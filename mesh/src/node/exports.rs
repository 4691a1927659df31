//! What this node serves to peers: its actors' remote protocols (`tier`, `kv-store`,
//! `router`), the advert its heartbeats carry, and the demotion of pages its stores let
//! go of to a store peer.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use mesh_actors::cluster::{AdvertSource, LocalAdvert};
use mesh_actors::engines::Engines;
use mesh_actors::pagestore::{Demoted, PageLogProtocol, PageStores, StoreMsg, StoreProtocol};
use mesh_actors::planner::{EnginesProtocol, PlanError, PlannerMsg, PlannerProtocol};
use mesh_actors::remote::{CallContext, Exports, Started};
use mesh_actors::router::{self, RouterMsg, RouterProtocol};
use mesh_actors::supervisor::ActorSlot;
use mesh_actors::tasks::{Life, Tasks};
use mesh_actors::tier::{self as tier_wire, TierMsg, TierProtocol};
use mesh_actors::tuner::LivePolicy;
use mesh_actors::wire::{
    Capacity, EnginesCall, EnginesItem, ErrorClass, LoadableTier, NamespacePages, PageBlob,
    PageLogCall, PageLogItem, PlannerCall, PlannerItem, RemoteError, RouterCall, RouterItem,
    StoreCall, StoreItem, TierCall, TierItem,
};
use mesh_actors::Cluster;
use mesh_control::policy::Role;
use mesh_kvstore::{PageId, Salt};
use mesh_tiers::TokenEvent;
use tokio::sync::mpsc;
use tracing::{info_span, warn, Instrument};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::service::dispatch::{prefetch, Dispatcher};

/// Adverts carry at most this many page ids per namespace (most recently used first).
const ADVERTISED_PAGES: usize = 1024;

/// Page ids listed per namespace in adverts: [`ADVERTISED_PAGES`], or
/// `MESH_ADVERTISED_PAGES` (a test hook: peers that follow the page events see every page
/// whatever the list holds; peers older than the events see the list).
fn advertised_pages() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("MESH_ADVERTISED_PAGES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(ADVERTISED_PAGES)
    })
}
/// Most pages one demotion call carries.
const DEMOTE_BATCH: usize = 32;

fn refused(class: ErrorClass, message: impl Into<String>) -> RemoteError {
    RemoteError {
        class,
        message: message.into(),
    }
}

fn one<I: Send + 'static>(item: I) -> Started<I> {
    let (tx, rx) = mpsc::unbounded_channel();
    let _ = tx.send(Ok(item));
    Ok(rx)
}

/// Exports the tier protocol: a peer's generate call runs on the engine this node's
/// quantization policy gives the call's role (its prefix pages pulled first when another
/// peer holds them), its tokenize call on the tier's tokenizer.
pub fn export_tiers(
    exports: &Exports,
    engines: Engines,
    policy: Arc<LivePolicy>,
    dispatcher: Arc<std::sync::OnceLock<Dispatcher>>,
) {
    exports.export::<TierProtocol>(move |call: TierCall, ctx: CallContext| -> BoxFuture<'static, Started<TierItem>> {
        match call {
            TierCall::Tokenize { model, parts } => {
                let parts: Vec<mesh_tiers::chat::PromptPart> = parts.into_iter().map(Into::into).collect();
                let entry = engines.get(&model);
                Box::pin(async move {
                    let entry = entry.ok_or_else(|| {
                        refused(ErrorClass::NotFound, format!("tier `{model}` is not running on this node"))
                    })?;
                    let tokens = ractor::call!(entry.actor, |reply| TierMsg::Tokenize { parts, reply })
                        .map_err(|e| refused(ErrorClass::Unavailable, format!("tier actor unavailable: {e}")))?;
                    one(TierItem::Tokens(tokens))
                })
            }
            TierCall::Render { model, input } => {
                let entry = engines.get(&model);
                Box::pin(async move {
                    let entry = entry.ok_or_else(|| {
                        refused(ErrorClass::NotFound, format!("tier `{model}` is not running on this node"))
                    })?;
                    let input: mesh_tiers::format::ChatInput = serde_json::from_str(&input)
                        .map_err(|e| refused(ErrorClass::InvalidRequest, format!("unreadable conversation: {e}")))?;
                    let input = Box::new(input);
                    let r = ractor::call!(entry.actor, |reply| TierMsg::Render { input, reply })
                        .map_err(|e| refused(ErrorClass::Unavailable, format!("tier actor unavailable: {e}")))?
                        .map_err(|e| refused(ErrorClass::InvalidRequest, e.to_string()))?;
                    one(TierItem::Rendered {
                        tokens: r.tokens,
                        spec: serde_json::to_string(&r.spec).expect("a format spec serializes"),
                        thinking_open: r.thinking_open,
                    })
                })
            }
            TierCall::Generate(call) => {
                let entry = engines.get(&call.model);
                // The engine this node's quantization policy gives the call's role (the
                // tier's own when the policy names none, or the caller sent no role).
                let (entry, lease, engine) = match (entry, Role::from_name(&call.role)) {
                    (Some(e), Some(role)) => {
                        let p = policy.load().policy.clone();
                        let picked = engines.pick(&p.quantization, role, &call.model, e);
                        (Some(picked.entry), picked.lease, Some(picked.info.gguf))
                    }
                    (e, _) => (e, None, None),
                };
                let dispatcher = dispatcher.clone();
                Box::pin(async move {
                    let span = info_span!("tier.generate", gen_ai.request.model = %call.model,
                        gen_ai.operation.name = "chat", mesh.remote = true, mesh.request_id = %call.request_id,
                        mesh.peer = %ctx.peer, mesh.role = %call.role, mesh.engine = engine.as_deref().unwrap_or(""),
                        gen_ai.usage.input_tokens = call.prompt.len(), gen_ai.usage.output_tokens = tracing::field::Empty);
                    let _ = span.set_parent(crate::telemetry::extract_context(&ctx.envelope.trace));
                    if let Some(d) = dispatcher.get() {
                        // 0: no deadline (an hour bounds a prefill hand-off).
                        let ms = if call.deadline_ms == 0 { 3_600_000 } else { call.deadline_ms };
                        let deadline = tokio::time::Instant::now() + Duration::from_millis(ms);
                        prefetch(d, &call.model, &call.prompt, &call.cache_scope, deadline)
                            .instrument(span.clone())
                            .await;
                    }
                    let Some(entry) = entry else {
                        return Err(refused(
                            ErrorClass::NotFound,
                            format!("tier `{}` is not running on this node", call.model),
                        ));
                    };
                    let req = tier_wire::from_call(call);
                    let mut rx = match ractor::call!(entry.actor, |reply| TierMsg::Generate { req, reply }) {
                        Ok(Ok(rx)) => rx,
                        Ok(Err(e)) => return Err(tier_wire::remote_error(e)),
                        Err(e) => {
                            return Err(refused(ErrorClass::Unavailable, format!("tier actor unavailable: {e}")))
                        }
                    };
                    let (tx, out) = mpsc::unbounded_channel();
                    tokio::spawn(
                        async move {
                            // A variant engine stays up until this stream ends.
                            let _lease = lease;
                            while let Some(ev) = rx.recv().await {
                                if let TokenEvent::Done { usage, .. } = &ev {
                                    tracing::Span::current()
                                        .record("gen_ai.usage.output_tokens", usage.completion_tokens);
                                }
                                let last = matches!(ev, TokenEvent::Done { .. } | TokenEvent::Error(_));
                                // A failed send means the caller went away: dropping rx cancels
                                // the sequence.
                                if tx.send(Ok(TierItem::Event(tier_wire::to_wire(ev)))).is_err() || last {
                                    return;
                                }
                            }
                        }
                        .instrument(span),
                    );
                    Ok(out)
                })
            }
        }
    });
}

/// Exports the page-store protocol: peers fetch prefix pages; compute nodes demote pages.
pub fn export_store(exports: &Exports, pages: PageStores) {
    exports.export::<StoreProtocol>(
        move |call: StoreCall, _ctx: CallContext| -> BoxFuture<'static, Started<StoreItem>> {
            let pages = pages.clone();
            Box::pin(async move {
                match call {
                    StoreCall::Fetch { ns, salt, ids } => {
                        let salt = <[u8; 32]>::try_from(salt).map_err(|_| {
                            refused(ErrorClass::InvalidRequest, "salt must be 32 bytes")
                        })?;
                        let ids: Vec<PageId> = ids
                            .iter()
                            .map_while(|id| <[u8; 32]>::try_from(id.as_slice()).ok().map(PageId))
                            .collect();
                        let got = pages
                            .call(|reply| StoreMsg::GetStored {
                                ns: ns.clone(),
                                salt: Salt(salt),
                                ids: ids.clone(),
                                reply,
                            })
                            .await
                            .map_err(|e| refused(ErrorClass::Unavailable, e.to_string()))?;
                        let (tx, rx) = mpsc::unbounded_channel();
                        for (id, b) in got {
                            let _ = tx.send(Ok(StoreItem::Page(PageBlob {
                                id: id.0.to_vec(),
                                stored: b.to_vec(),
                            })));
                        }
                        Ok(rx)
                    }
                    StoreCall::Put {
                        ns,
                        base,
                        block,
                        pages: blobs,
                    } => {
                        let base = <[u8; 32]>::try_from(base).map_err(|_| {
                            refused(ErrorClass::InvalidRequest, "salt base must be 32 bytes")
                        })?;
                        let blobs: Vec<(PageId, Bytes)> = blobs
                            .into_iter()
                            .filter_map(|b| {
                                let id = <[u8; 32]>::try_from(b.id.as_slice()).ok()?;
                                Some((PageId(id), Bytes::from(b.stored)))
                            })
                            .collect();
                        let n = pages
                            .call(|reply| StoreMsg::PutDemoted {
                                ns: ns.clone(),
                                base,
                                block,
                                pages: blobs.clone(),
                                reply,
                            })
                            .await
                            .map_err(|e| refused(ErrorClass::Unavailable, e.to_string()))?;
                        one(StoreItem::Stored { pages: n as u32 })
                    }
                }
            })
        },
    );
}

/// Exports the page-log protocol: a peer that is new or missed page events asks for them
/// (answered from the log, not through the page-store actor's mailbox).
pub fn export_page_log(exports: &Exports, pages: PageStores) {
    exports.export::<PageLogProtocol>(
        move |call: PageLogCall, _ctx: CallContext| -> BoxFuture<'static, Started<PageLogItem>> {
            let PageLogCall::Since { seq } = call;
            let entry = pages.log_since(seq);
            Box::pin(async move { one(PageLogItem::Entry(entry.into())) })
        },
    );
}

/// Exports the router protocol: a gateway without a router routes through this one.
pub fn export_router(exports: &Exports, slot: Arc<ActorSlot<RouterMsg>>) {
    exports.export::<RouterProtocol>(
        move |call: RouterCall, _ctx: CallContext| -> BoxFuture<'static, Started<RouterItem>> {
            let slot = slot.clone();
            Box::pin(async move {
                let r = router::ask(&slot, router::from_wire(call)).await;
                one(router::routed_to_wire(r))
            })
        },
    );
}

/// Exports the engines protocol: the cluster's planner starts and drains tiers here. The
/// answer comes when the tier is up (or draining); the call is accepted at once, so a
/// slow model load does not run into the call's first-reply timeout.
pub fn export_engines(exports: &Exports, engines: Engines) {
    exports.export::<EnginesProtocol>(
        move |call: EnginesCall, ctx: CallContext| -> BoxFuture<'static, Started<EnginesItem>> {
            let engines = engines.clone();
            Box::pin(async move {
                let (tx, rx) = mpsc::unbounded_channel();
                tokio::spawn(async move {
                    let (verb, tier, r) = match call {
                        EnginesCall::Load { tier } => ("load", tier.clone(), engines.load(&tier).await),
                        EnginesCall::Drain { tier } => ("drain", tier.clone(), engines.drain(&tier).await),
                    };
                    tracing::info!(peer = %ctx.peer, %tier, action = verb, ok = r.is_ok(), "planner request");
                    let _ = tx.send(Ok(match r {
                        Ok(()) => EnginesItem::Done,
                        Err(e) => EnginesItem::Refused(e),
                    }));
                });
                Ok(rx)
            })
        },
    );
}

/// Exports the planner protocol: `mesh scale` and the planner's status, from any node.
pub fn export_planner(exports: &Exports, slot: Arc<ActorSlot<PlannerMsg>>) {
    exports.export::<PlannerProtocol>(
        move |call: PlannerCall, _ctx: CallContext| -> BoxFuture<'static, Started<PlannerItem>> {
            let slot = slot.clone();
            Box::pin(async move {
                let r = mesh_actors::supervisor::call(
                    &slot,
                    "planner",
                    Duration::from_secs(1),
                    Duration::from_secs(15),
                    |reply| match &call {
                        PlannerCall::Scale { tier, replicas } => PlannerMsg::Scale {
                            tier: tier.clone(),
                            replicas: *replicas,
                            reply,
                        },
                        PlannerCall::Show => PlannerMsg::Show { reply },
                    },
                )
                .await;
                match r {
                    Ok(Ok(s)) => one(PlannerItem::Status(s)),
                    Ok(Err(PlanError::Refused(e))) => one(PlannerItem::Refused(e)),
                    Ok(Err(PlanError::Unavailable(e))) => Err(refused(ErrorClass::Unavailable, e)),
                    Err(e) => Err(refused(
                        ErrorClass::Unavailable,
                        format!("planner unavailable: {e}"),
                    )),
                }
            })
        },
    );
}

/// What each configured tier needs on this node, and the cores it offers: the capacity
/// part of its adverts.
#[derive(Debug, Clone, Default)]
pub struct TierNeeds {
    cores: u32,
    tiers: Vec<LoadableTier>,
}

impl TierNeeds {
    /// Reads each tier's model shape (memory-mapped) to size it; a tier whose model cannot
    /// be read is left out (the planner then never starts it here).
    pub fn read(tiers: &[mesh_tiers::EngineConfig], cores: u32) -> Self {
        let mut out = vec![];
        for t in tiers {
            let shape = match mesh_tiers::ModelShape::read(&t.model) {
                Ok(s) => s,
                Err(e) => {
                    warn!(tier = %t.name, error = %e, "cannot size this tier; the planner will not start it here");
                    continue;
                }
            };
            let draft = t
                .draft
                .as_ref()
                .and_then(|d| mesh_tiers::ModelShape::read(&d.model).ok());
            out.push(LoadableTier {
                name: t.name.clone(),
                threads: t.threads.max(1) as u32,
                bytes: mesh_tiers::tier_memory_bytes(t, &shape, draft.as_ref()),
                gpu_bytes: mesh_tiers::tier_device_bytes(
                    t,
                    &shape,
                    draft.as_ref(),
                    mesh_tiers::host_kept_bytes(t),
                ),
            });
        }
        Self { cores, tiers: out }
    }

    fn capacity(&self, engines: &Engines) -> Capacity {
        let loadable = engines.loadable();
        Capacity {
            cores: self.cores,
            cores_used: engines.threads_used(),
            free_bytes: available_memory(),
            loadable: self
                .tiers
                .iter()
                .filter(|t| loadable.contains(&t.name))
                .cloned()
                .collect(),
            on_request: engines.on_request(),
            gpus: mesh_tiers::gpu::gpus()
                .into_iter()
                .map(|g| mesh_actors::wire::GpuAdvert {
                    name: g.name,
                    description: g.description,
                    memory_total: g.memory_total,
                    memory_free: g.memory_free,
                })
                .collect(),
        }
    }
}

/// Memory available to this process: the kernel's `MemAvailable`, capped by what is left
/// under the cgroup's (v2) memory limit.
fn available_memory() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let avail = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024);
    let read = |p: &str| -> Option<u64> { std::fs::read_to_string(p).ok()?.trim().parse().ok() };
    match (
        read("/sys/fs/cgroup/memory.max"),
        read("/sys/fs/cgroup/memory.current"),
    ) {
        (Some(max), Some(cur)) => avail.min(max.saturating_sub(cur)),
        _ => avail,
    }
}

/// What this node's heartbeats say: its tiers with their page sets, the pages its store
/// keeps for peers, and its room for more tiers.
pub fn advert_source(engines: Engines, pages: PageStores, needs: TierNeeds) -> AdvertSource {
    Arc::new(move || {
        let (engines, pages, needs) = (engines.clone(), pages.clone(), needs.clone());
        Box::pin(async move {
            let advert = pages
                .call(|reply| StoreMsg::Advert {
                    limit: advertised_pages(),
                    reply,
                })
                .await
                .unwrap_or_default();
            let set = advert.ids;
            let foreign = pages.foreign();
            LocalAdvert {
                capacity: needs.capacity(&engines),
                tiers: engines.adverts(&set),
                page_events: advert.entry.map(Into::into),
                page_seq: advert.seq,
                pages_held: advert.held,
                pages: set
                    .into_iter()
                    .filter_map(|(ns, ids)| {
                        let (base, block) = foreign.get(&ns)?;
                        Some(NamespacePages {
                            ns,
                            ids,
                            base: base.to_vec(),
                            block: *block,
                        })
                    })
                    .collect(),
            }
        })
    })
}

/// Forwards the pages this node's stores let go of to a store peer (a tracked task): up to
/// [`DEMOTE_BATCH`] pages a call, each namespace's with the salt base and block its tier
/// advertises. Pages arriving while no store peer is up are dropped (they were being
/// evicted anyway).
pub fn start_demotion(tasks: &Tasks, pages: &PageStores, engines: Engines, cluster: Cluster) {
    let (tx, mut rx) = mpsc::unbounded_channel::<Demoted>();
    pages.demote_to(tx);
    tasks.spawn("kv-demote", Life::Long, async move {
        while let Some(first) = rx.recv().await {
            let mut batch = vec![first];
            while batch.len() < DEMOTE_BATCH {
                match rx.try_recv() {
                    Ok(d) => batch.push(d),
                    Err(_) => break,
                }
            }
            let Some(node) = cluster.peers_in_role("store").into_iter().next() else {
                continue;
            };
            let mut by_ns: std::collections::BTreeMap<String, Vec<PageBlob>> = Default::default();
            for d in batch {
                by_ns.entry(d.ns).or_default().push(PageBlob {
                    id: d.id.0.to_vec(),
                    stored: d.stored.to_vec(),
                });
            }
            for (ns, blobs) in by_ns {
                let Some(p) = engines.get(&ns).and_then(|e| e.desc.pages.clone()) else {
                    continue;
                };
                let n = blobs.len();
                match tokio::time::timeout(
                    Duration::from_secs(30),
                    cluster.put_pages(&node, &ns, p.base.0, p.block as u32, blobs),
                )
                .await
                {
                    Ok(Ok(kept)) => tracing::debug!(%node, %ns, pages = n, kept, "demoted pages to a store peer"),
                    Ok(Err(e)) => warn!(%node, %ns, error = %e, "demoting pages failed"),
                    Err(_) => warn!(%node, %ns, "demoting pages timed out"),
                }
            }
        }
    });
}
