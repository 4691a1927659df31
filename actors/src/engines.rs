//! The engines of a node: the actor that supervises its tier actors and owns the table of
//! them ([`EngineTable`]), and the read side the request path finds them through
//! ([`Engines`]: the table the actor last published).
//!
//! ```text
//! EnginesActor ──linked──▶ TierActor(t1) ─▶ engine thread
//!              ──linked──▶ TierActor(t2) ─▶ engine thread
//!              ──linked──▶ TierActor(t3:q4_0:-)   (a variant the quantization policy names)
//! ```
//!
//! A tier actor that fails (its engine thread died, or it panicked) leaves the table at
//! once — the hook [`Engines::on_change`] tells membership to advertise without it right
//! away — and is started again from the same config after the back-off of its
//! [`RestartPolicy`]; past the policy's intensity the engines actor fails itself and the node
//! supervisor decides. Requests waiting for a restarting tier use [`Engines::wait_for`].
//!
//! **Quantization policy.** Another GGUF variant or KV cache type of a tier runs as one
//! more engine, a *variant*, kept in [`EngineTable::variants`] by engine id, not with the tiers' own, so peers,
//! `/v1/models` and the default path see one engine per tier.
//!
//! ```text
//!            role (tool_calls | reasoning | summaries), tier
//! request ──▶ policy.quantization.get(role, tier) ──None──▶ the tier's engine (running)
//!                          │ Some(entry)
//!                          ▼
//!            variants[engine_id(tier, entry)] ──missing──▶ the tier's engine
//!                          │
//!                          ▼  lease held until the response ends
//!                    variant engine (same tier name, other GGUF / KV type)
//! ```
//!
//! A reload ([`Engines::resolve`], [`Engines::start`], [`Engines::retire_unused`]) checks a
//! new policy (tier hosted here, GGUF present), starts the engines it needs, and only then is
//! the policy swapped in by its caller. Engines the new policy no longer names leave the
//! lookup map as soon as the actor has taken the retire; requests already on them keep their stream, and each is stopped once
//! nobody holds its lease and its engine counts no running or queued sequence (the actor
//! checks every [`DRAIN_POLL`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Read as _;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use mesh_control::policy::{kv_name, QuantPolicy, Role, TierQuant};
use mesh_tiers::{EngineConfig, KvType};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use serde::Serialize;
use tokio::sync::watch;
use tracing::{error, info, warn};

use crate::supervisor::{ActorSlot, Decision, RestartLog, RestartPolicy};
use crate::tier::{TierActor, TierDescription, TierMsg};

/// How often a retired engine is checked for idleness.
pub const DRAIN_POLL: Duration = Duration::from_millis(50);

/// A drained tier keeps running at least this long, idle or not: a peer that picked it
/// from an advert sent before the drain still gets its call taken.
pub const DRAIN_GRACE: Duration = Duration::from_secs(2);

/// A running tier as the request path sees it.
#[derive(Debug, Clone)]
pub struct TierEntry {
    /// The actor.
    pub actor: ActorRef<TierMsg>,
    /// Model facts and counters.
    pub desc: TierDescription,
}

/// An engine the quantization policy runs besides a tier's default one.
#[derive(Debug, Clone)]
pub struct VariantEntry {
    /// The tier it serves.
    pub tier: String,
    /// Its GGUF file name.
    pub gguf: String,
    /// Its KV cache type.
    pub kv_type: KvType,
    /// The actor and its counters.
    pub entry: TierEntry,
    /// Held by every request picked for this engine until its response ends; the engine is
    /// stopped only when nobody else holds it and its queue is empty.
    pub lease: Arc<()>,
    /// When it entered its current state (started, or retired).
    pub since: Instant,
}

/// The engines of a node: owned by the [`EnginesActor`], which publishes a copy after
/// every change; the request path reads the copy ([`Engines::table`]).
#[derive(Debug, Clone, Default)]
pub struct EngineTable {
    /// Running tiers (each tier's own engine) by name.
    pub running: BTreeMap<String, TierEntry>,
    /// Variant engines serving now, by engine id ([`engine_id`]).
    pub variants: BTreeMap<String, VariantEntry>,
    /// Retired engines still finishing requests (a drained tier's own engine is here under
    /// the tier's name).
    pub draining: BTreeMap<String, VariantEntry>,
    /// Variants the policy wants, with their configs (started again with the actor).
    pub wanted: BTreeMap<String, EngineConfig>,
    /// Configured tiers this node does not run now: it starts them on request.
    pub standby: BTreeSet<String>,
    /// Running tiers started on request rather than by the config.
    pub on_request: BTreeSet<String>,
}

/// Which engine of a tier served a request (`mesh.engine` in responses).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct EngineInfo {
    /// GGUF file name (`t1-q4_0.gguf`).
    pub gguf: String,
    /// KV cache type (`f16`, `q8_0`, `q4_0`).
    pub kv_type: String,
    /// The request's role (`tool_calls`, `reasoning`, `summaries`).
    pub role: String,
}

/// A request's engine: the entry to submit to, what to report, and the lease that keeps
/// a variant engine alive until the response ends (none for a tier's own engine).
#[derive(Debug, Clone)]
pub struct Picked {
    /// The engine's actor.
    pub entry: TierEntry,
    /// What served the request.
    pub info: EngineInfo,
    /// Held while the request runs (variant engines only).
    pub lease: Option<Arc<()>>,
}

/// One engine as `GET /v1/control/policy` lists it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct EngineRow {
    /// Engine id (the tier name for a tier's own engine).
    pub id: String,
    /// Tier.
    pub tier: String,
    /// GGUF file name.
    pub gguf: String,
    /// KV cache type.
    pub kv_type: &'static str,
    /// `serving` or `draining`.
    pub state: &'static str,
    /// Running sequences.
    pub active: usize,
    /// Queued requests.
    pub queued: usize,
    /// Prompt tokens prefilled.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
}

/// The id of the engine a policy entry names on `tier` (`t1:q4_0:q8_0`; `-` for "as
/// configured").
pub fn engine_id(tier: &str, q: &TierQuant) -> String {
    format!(
        "{tier}:{}:{}",
        q.gguf.as_deref().unwrap_or("-"),
        q.kv.map_or("-", kv_name)
    )
}

fn file_name(p: &std::path::Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| p.display().to_string())
}

type Hook = Box<dyn Fn() + Send + Sync>;

/// The engines of this node: the read side of the [`EnginesActor`] (cheap to clone).
///
/// The table survives a restart of the actor: the next incarnation starts from the last one
/// published (the tiers started on request, the variants the policy wants), with no engine
/// running, and starts them again.
#[derive(Clone)]
pub struct Engines {
    tiers: Arc<BTreeMap<String, EngineConfig>>,
    /// The table the actor published last.
    view: Arc<watch::Sender<Arc<EngineTable>>>,
    actor: Arc<ActorSlot<EnginesMsg>>,
    on_change: Arc<OnceLock<Hook>>,
}

impl std::fmt::Debug for Engines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = self.table();
        f.debug_struct("Engines")
            .field("tiers", &self.tiers.keys().collect::<Vec<_>>())
            .field("running", &t.running.len())
            .field("variants", &t.variants.len())
            .field("draining", &t.draining.len())
            .finish()
    }
}

impl Engines {
    /// The engines of `tiers` (configs as they will be started); nothing runs until an
    /// [`EnginesActor`] is spawned over it.
    pub fn new(tiers: &[EngineConfig]) -> Self {
        Self {
            tiers: Arc::new(tiers.iter().map(|t| (t.name.clone(), t.clone())).collect()),
            view: Arc::new(watch::Sender::new(Arc::default())),
            actor: Arc::default(),
            on_change: Arc::default(),
        }
    }

    /// Engines of no tier (a node that hosts none).
    pub fn none() -> Self {
        Self::new(&[])
    }

    /// Marks the configured tiers `names` as standby: not started with the node, started
    /// when asked ([`Engines::load`]). Names without a config are ignored.
    pub fn with_standby<'a>(self, names: impl IntoIterator<Item = &'a str>) -> Self {
        let names: Vec<String> = names
            .into_iter()
            .filter(|n| self.tiers.contains_key(*n))
            .map(str::to_owned)
            .collect();
        self.view
            .send_modify(|t| Arc::make_mut(t).standby.extend(names));
        self
    }

    /// The engines as the actor last published them.
    pub fn table(&self) -> Arc<EngineTable> {
        self.view.borrow().clone()
    }

    /// Tiers started with the node (configured, not standby).
    pub fn autostart(&self) -> Vec<String> {
        let t = self.table();
        self.tiers
            .keys()
            .filter(|n| !t.standby.contains(*n))
            .cloned()
            .collect()
    }

    /// The config of tier `tier`, if this node has one.
    pub fn config(&self, tier: &str) -> Option<&EngineConfig> {
        self.tiers.get(tier)
    }

    /// Configured tiers not running now that this node starts on request.
    pub fn loadable(&self) -> Vec<String> {
        self.table().standby.iter().cloned().collect()
    }

    /// Running tiers started on request.
    pub fn on_request(&self) -> Vec<String> {
        self.table().on_request.iter().cloned().collect()
    }

    /// Threads of the engines running now (tiers and variants, draining ones included).
    pub fn threads_used(&self) -> u32 {
        let t = |cfg: Option<&EngineConfig>| cfg.map_or(0, |c| c.threads.max(1) as u32);
        let table = self.table();
        let tiers: u32 = table.running.keys().map(|k| t(self.tiers.get(k))).sum();
        let others: u32 = table
            .variants
            .values()
            .chain(table.draining.values())
            .map(|v| t(self.tiers.get(&v.tier)))
            .sum();
        tiers + others
    }

    /// Starts tier `tier` from its config (a planner's request); already running is done.
    /// A tier draining here is taken back into service.
    ///
    /// Cancel safety: cancel-safe (the actor finishes the start).
    pub async fn load(&self, tier: &str) -> Result<(), String> {
        let actor = self
            .actor
            .get()
            .ok_or("this node's engines are not running")?;
        let tier = tier.to_owned();
        ractor::call!(actor, |reply| EnginesMsg::LoadTier { tier, reply })
            .map_err(|e| e.to_string())
            .and_then(|r| r)
    }

    /// Takes tier `tier` out of service: it leaves the registry (and the adverts) at once
    /// and stops once its requests are done.
    ///
    /// Cancel safety: cancel-safe.
    pub async fn drain(&self, tier: &str) -> Result<(), String> {
        let actor = self
            .actor
            .get()
            .ok_or("this node's engines are not running")?;
        let tier = tier.to_owned();
        ractor::call!(actor, |reply| EnginesMsg::DrainTier { tier, reply })
            .map_err(|e| e.to_string())
            .and_then(|r| r)
    }

    /// Calls `hook` whenever a tier starts or stops (first call wins): membership uses it
    /// to advertise the change at once.
    pub fn on_change(&self, hook: impl Fn() + Send + Sync + 'static) {
        let _ = self.on_change.set(Box::new(hook));
    }

    /// Publishes the actor's table and calls the change hook. Draining engines go out with
    /// a lease of their own: their real one is counted by the actor (an engine stops when
    /// nothing but the actor's table holds it), and no request picks a draining engine.
    fn publish(&self, table: &EngineTable) {
        let mut copy = table.clone();
        for v in copy.draining.values_mut() {
            v.lease = Arc::new(());
        }
        self.view.send_replace(Arc::new(copy));
        if let Some(h) = self.on_change.get() {
            h();
        }
    }

    /// Names of the tiers this node is configured to host.
    pub fn configured(&self) -> impl Iterator<Item = &str> {
        self.tiers.keys().map(String::as_str)
    }

    /// Whether this node hosts `tier`: configured for it and not in standby (a request
    /// waits for such a tier while it restarts).
    pub fn hosts(&self, tier: &str) -> bool {
        self.tiers.contains_key(tier) && !self.view.borrow().standby.contains(tier)
    }

    /// The running tier `tier`.
    pub fn get(&self, tier: &str) -> Option<TierEntry> {
        self.view.borrow().running.get(tier).cloned()
    }

    /// The running tier `tier`, waiting up to `timeout` for it to (re)start when this node
    /// hosts it; an incarnation whose actor is `not` (one a request just saw fail) does not
    /// count. `None` when it is not hosted here or did not come back in time.
    ///
    /// Cancel safety: cancel-safe.
    pub async fn wait_for(
        &self,
        tier: &str,
        timeout: Duration,
        not: Option<ractor::ActorId>,
    ) -> Option<TierEntry> {
        let fresh = |e: &TierEntry| not.is_none_or(|id| e.actor.get_id() != id);
        if !self.hosts(tier) {
            return self.get(tier).filter(fresh);
        }
        let mut rx = self.view.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(e) = self.get(tier).filter(fresh) {
                return Some(e);
            }
            if tokio::time::timeout_at(deadline, rx.changed())
                .await
                .is_err()
            {
                return None;
            }
        }
    }

    /// The engine actor, for its supervisor and fault injection.
    pub fn actor(&self) -> &Arc<ActorSlot<EnginesMsg>> {
        &self.actor
    }

    /// The engine config of every engine `q` needs besides the tiers' own, by engine id;
    /// entries that come down to a tier's own model and KV type need none. Refused with
    /// `(reason, param)` when an entry names a tier this node does not host, or a GGUF
    /// that is missing or not a GGUF file.
    pub fn resolve(
        &self,
        q: &QuantPolicy,
    ) -> Result<BTreeMap<String, EngineConfig>, (String, String)> {
        q.validate()?;
        let mut out = BTreeMap::new();
        for (role, tier, entry) in q.entries() {
            let at = format!("quantization.{}.{tier}", role.as_str());
            let Some(base) = self.tiers.get(tier) else {
                let hosted: Vec<&str> = self.tiers.keys().map(String::as_str).collect();
                return Err((
                    format!(
                        "{at}: tier `{tier}` is not hosted by this node (hosted: {})",
                        if hosted.is_empty() {
                            "none".to_owned()
                        } else {
                            hosted.join(", ")
                        }
                    ),
                    at,
                ));
            };
            let model = match &entry.gguf {
                None => base.model.clone(),
                Some(g) if TierQuant::gguf_is_path(g) => PathBuf::from(g),
                Some(g) => mesh_tiers::quantize::variant_path(&base.model, tier, g),
            };
            if let Some(g) = &entry.gguf {
                check_gguf(&model).map_err(|why| {
                    let hint = if TierQuant::gguf_is_path(g) {
                        String::new()
                    } else {
                        format!(
                            " (make it with `mesh quantize --model {} --type {g}`)",
                            base.model.display()
                        )
                    };
                    (
                        format!("{at}.gguf: {} {why}{hint}", model.display()),
                        format!("{at}.gguf"),
                    )
                })?;
            }
            let kv = entry.kv.unwrap_or(base.kv_type);
            if model == base.model && kv == base.kv_type {
                continue;
            }
            let mut cfg = base.clone();
            cfg.model = model;
            cfg.kv_type = kv;
            // Pages of another model or KV layout never match the tier's; a variant keeps
            // its pages in RAM so two stores do not share one disk folder.
            cfg.kv_pages.disk_dir = None;
            out.insert(engine_id(tier, entry), cfg);
        }
        Ok(out)
    }

    /// Starts the engines of `wanted` that are not running yet; on a failure stops the
    /// ones this call started and reports which engine failed. Not cancel-safe (an engine
    /// started before the cancel keeps running until the next retire).
    pub async fn start(&self, wanted: &BTreeMap<String, EngineConfig>) -> Result<(), String> {
        let table = self.table();
        let missing: Vec<(&String, &EngineConfig)> = wanted
            .iter()
            .filter(|(id, _)| !table.variants.contains_key(*id))
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        let Some(actor) = self.actor.get() else {
            return Err("this node's engines are not running".into());
        };
        let mut started: Vec<String> = vec![];
        for (id, cfg) in missing {
            let (id2, cfg2) = (id.clone(), cfg.clone());
            let r = ractor::call!(actor, |reply| EnginesMsg::StartVariant {
                id: id2,
                cfg: cfg2,
                reply,
            })
            .map_err(|e| e.to_string())
            .and_then(|r| r);
            if let Err(e) = r {
                let _ = actor.send_message(EnginesMsg::Retire {
                    ids: started,
                    reply: None,
                });
                return Err(format!(
                    "engine {id} ({}, kv {}) did not start: {e}",
                    cfg.model.display(),
                    kv_name(cfg.kv_type)
                ));
            }
            started.push(id.clone());
        }
        Ok(())
    }

    /// Takes every running variant that `wanted` does not name out of the lookup map (it is
    /// listed as draining once this returns); the actor stops each once it is idle (no
    /// request holds its lease, nothing running or queued on its engine).
    ///
    /// Cancel safety: cancel-safe (the actor finishes the retire).
    pub async fn retire_unused(&self, wanted: &BTreeMap<String, EngineConfig>) {
        let old: Vec<String> = self
            .table()
            .variants
            .keys()
            .filter(|id| !wanted.contains_key(*id))
            .cloned()
            .collect();
        if old.is_empty() {
            return;
        }
        if let Some(actor) = self.actor.get() {
            let _ = ractor::call!(actor, |reply| EnginesMsg::Retire {
                ids: old,
                reply: Some(reply),
            });
        }
    }

    /// The engine for `role` on the local tier `entry` under `q`: a variant when the
    /// policy names one that runs, else `entry` itself.
    pub fn pick(&self, q: &QuantPolicy, role: Role, tier: &str, entry: TierEntry) -> Picked {
        if let Some(tq) = q.get(role, tier) {
            let hit = self.table().variants.get(&engine_id(tier, tq)).cloned();
            if let Some(v) = hit {
                return Picked {
                    info: EngineInfo {
                        gguf: v.gguf,
                        kv_type: kv_name(v.kv_type).to_owned(),
                        role: role.as_str().to_owned(),
                    },
                    entry: v.entry,
                    lease: Some(v.lease),
                };
            }
        }
        let (gguf, kv) = self
            .tiers
            .get(tier)
            .map_or(("?".to_owned(), KvType::F16), |c| {
                (file_name(&c.model), c.kv_type)
            });
        Picked {
            info: EngineInfo {
                gguf,
                kv_type: kv_name(kv).to_owned(),
                role: role.as_str().to_owned(),
            },
            entry,
            lease: None,
        }
    }

    /// The running tiers as adverts carry them; `pages` is the page set by namespace (from
    /// the page-store actor).
    pub fn adverts(&self, pages: &[(String, Vec<u64>)]) -> Vec<crate::wire::TierAdvert> {
        let table = self.table();
        let mut v: Vec<crate::wire::TierAdvert> = table
            .running
            .iter()
            .map(|(name, e)| {
                let (i, s) = (&e.desc.info, &e.desc.stats);
                let handles = e.desc.pages.as_ref();
                crate::wire::TierAdvert {
                    name: name.clone(),
                    max_seq_len: i.max_seq_len as u32,
                    n_seq_max: i.n_seq_max as u32,
                    active: s.active.load(Relaxed) as u32,
                    queued: s.queued.load(Relaxed) as u32,
                    kv_cells: i.n_ctx as u32,
                    kv_reserved: s.reserved_cells.load(Relaxed) as u32,
                    page_base: handles.map(|p| p.base.0.to_vec()).unwrap_or_default(),
                    page_block: handles.map(|p| p.block as u32).unwrap_or(0),
                    pages: handles
                        .and_then(|_| pages.iter().find(|(ns, _)| ns == name))
                        .map(|(_, ids)| ids.clone())
                        .unwrap_or_default(),
                    started: s.started.load(Relaxed),
                    queued_ms_total: s.queued_ms_total.load(Relaxed),
                }
            })
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// Every engine of this node: the tiers' own, the variants serving now and the retired
    /// ones still draining, with their running and queued sequences.
    pub fn list(&self) -> Vec<EngineRow> {
        let row = |id: &str, tier: &str, gguf: String, kv: KvType, e: &TierEntry, state| {
            let s = &e.desc.stats;
            EngineRow {
                id: id.to_owned(),
                tier: tier.to_owned(),
                gguf,
                kv_type: kv_name(kv),
                state,
                active: s.active.load(Relaxed),
                queued: s.queued.load(Relaxed),
                prompt_tokens: s.prompt_tokens.load(Relaxed),
                generated_tokens: s.generated_tokens.load(Relaxed),
            }
        };
        let table = self.table();
        let mut out = vec![];
        for (name, c) in self.tiers.iter() {
            if let Some(e) = table.running.get(name) {
                out.push(row(
                    name,
                    name,
                    file_name(&c.model),
                    c.kv_type,
                    e,
                    "serving",
                ));
            }
        }
        for (map, state) in [(&table.variants, "serving"), (&table.draining, "draining")] {
            for (id, v) in map {
                out.push(row(id, &v.tier, v.gguf.clone(), v.kv_type, &v.entry, state));
            }
        }
        out
    }
}

/// The file exists and starts with the GGUF magic.
fn check_gguf(path: &std::path::Path) -> Result<(), String> {
    let mut f = std::fs::File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => "does not exist".to_owned(),
        _ => format!("cannot be read: {e}"),
    })?;
    let mut magic = [0u8; 4];
    f.read_exact(&mut magic)
        .map_err(|_| "is not a GGUF file".to_owned())?;
    if &magic != b"GGUF" {
        return Err("is not a GGUF file".into());
    }
    Ok(())
}

/// A child of the engines actor.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ChildKey {
    /// A tier's own engine, by tier name.
    Tier(String),
    /// A variant engine, by engine id.
    Variant(String),
}

/// Messages of [`EnginesActor`].
#[derive(Debug)]
pub enum EnginesMsg {
    /// Start a variant engine and put it in [`EngineTable::variants`] under `id`; the outcome is
    /// reported and a failure is final (the policy that wanted it is refused).
    StartVariant {
        /// Engine id.
        id: String,
        /// Its config (the tier's, with another model file or KV cache type).
        cfg: EngineConfig,
        /// Where the outcome goes.
        reply: RpcReplyPort<Result<(), String>>,
    },
    /// These variants are out of service: out of the lookup map now, each stopped once it
    /// is idle.
    Retire {
        /// Engine ids.
        ids: Vec<String>,
        /// Told once they are out of the lookup map.
        reply: Option<RpcReplyPort<()>>,
    },
    /// Start tier `tier` from its config, or take it back from draining.
    LoadTier {
        /// Tier name.
        tier: String,
        /// The outcome.
        reply: RpcReplyPort<Result<(), String>>,
    },
    /// Take tier `tier` out of service and stop it once idle.
    DrainTier {
        /// Tier name.
        tier: String,
        /// The outcome.
        reply: RpcReplyPort<Result<(), String>>,
    },
    /// Start a child again (sent to itself after the back-off).
    Restart(ChildKey),
    /// Stop the retired engines that are idle (sent to itself while some drain).
    CheckDrain,
    /// Fault injection: end the engine thread of `tier` as a crash would; false when the
    /// tier is not running.
    CrashTier {
        /// Tier name.
        tier: String,
        /// Whether a crash was injected.
        reply: RpcReplyPort<bool>,
    },
}

/// Supervises the tier actors of a node (see the module docs).
#[derive(Debug, Default, Clone, Copy)]
pub struct EnginesActor;

/// Arguments of [`EnginesActor`].
#[derive(Debug, Clone)]
pub struct EnginesArgs {
    /// The shared side.
    pub engines: Engines,
    /// How failed engines are restarted.
    pub policy: RestartPolicy,
}

/// State of [`EnginesActor`].
#[derive(Debug)]
pub struct EnginesState {
    engines: Engines,
    /// The engines; published to `engines` after every change.
    table: EngineTable,
    policy: RestartPolicy,
    restarts: HashMap<ChildKey, RestartLog>,
}

async fn spawn_engine(
    myself: &ActorRef<EnginesMsg>,
    cfg: EngineConfig,
) -> Result<TierEntry, ActorProcessingErr> {
    let (actor, _) = Actor::spawn_linked(None, TierActor, cfg, myself.get_cell()).await?;
    let desc = ractor::call!(actor, TierMsg::Describe)?;
    Ok(TierEntry { actor, desc })
}

impl EnginesState {
    fn publish(&self) {
        self.engines.publish(&self.table);
    }

    /// Moves variants from the lookup map to the draining ones and forgets their configs.
    fn retire(&mut self, ids: &[String]) {
        for id in ids {
            self.table.wanted.remove(id);
            if let Some(v) = self.table.variants.remove(id) {
                info!(engine = %id, "engine retired by the policy; draining");
                self.table.draining.insert(id.clone(), v);
            }
        }
        self.publish();
    }

    async fn start_tier(
        &mut self,
        myself: &ActorRef<EnginesMsg>,
        cfg: EngineConfig,
    ) -> Result<(), ActorProcessingErr> {
        let name = cfg.name.clone();
        let entry = spawn_engine(myself, cfg).await?;
        let info = &entry.desc.info;
        info!(tier = %name, params = info.n_params, n_ctx = info.n_ctx, seqs = info.n_seq_max, "tier ready");
        self.table.running.insert(name, entry);
        self.publish();
        Ok(())
    }

    async fn start_variant(
        &mut self,
        myself: &ActorRef<EnginesMsg>,
        id: &str,
        cfg: EngineConfig,
    ) -> Result<(), ActorProcessingErr> {
        let tier = cfg.name.clone();
        let gguf = file_name(&cfg.model);
        let kv_type = cfg.kv_type;
        let entry = spawn_engine(myself, cfg).await?;
        info!(%tier, engine = %id, "variant engine ready");
        self.table.variants.insert(
            id.to_owned(),
            VariantEntry {
                tier,
                gguf,
                kv_type,
                entry,
                lease: Arc::new(()),
                since: Instant::now(),
            },
        );
        self.publish();
        Ok(())
    }

    async fn load_tier(&mut self, myself: &ActorRef<EnginesMsg>, tier: &str) -> Result<(), String> {
        if self.table.running.contains_key(tier) {
            return Ok(());
        }
        let tiers = &self.engines.tiers;
        let Some(cfg) = tiers.get(tier).cloned() else {
            let known: Vec<&str> = tiers.keys().map(String::as_str).collect();
            return Err(format!(
                "this node has no config for tier `{tier}` (it has: {})",
                if known.is_empty() {
                    "none".to_owned()
                } else {
                    known.join(", ")
                }
            ));
        };
        if let Some(v) = self.table.draining.remove(tier) {
            info!(%tier, "drain cancelled; the tier serves again");
            self.table.running.insert(tier.to_owned(), v.entry);
        } else {
            self.start_tier(myself, cfg)
                .await
                .map_err(|err| format!("tier `{tier}` did not start: {err}"))?;
        }
        self.table.standby.remove(tier);
        self.table.on_request.insert(tier.to_owned());
        self.restarts.remove(&ChildKey::Tier(tier.to_owned()));
        self.publish();
        Ok(())
    }

    fn drain_tier(&mut self, tier: &str) -> Result<(), String> {
        let Some(entry) = self.table.running.remove(tier) else {
            return if self.engines.tiers.contains_key(tier) {
                Ok(()) // not running: nothing to drain
            } else {
                Err(format!("this node has no config for tier `{tier}`"))
            };
        };
        let cfg = &self.engines.tiers[tier];
        info!(%tier, "tier drained: no new requests; stopping once its own are done");
        self.table.draining.insert(
            tier.to_owned(),
            VariantEntry {
                tier: tier.to_owned(),
                gguf: file_name(&cfg.model),
                kv_type: cfg.kv_type,
                entry,
                lease: Arc::new(()),
                since: Instant::now(),
            },
        );
        self.table.standby.insert(tier.to_owned());
        self.table.on_request.remove(tier);
        self.restarts.remove(&ChildKey::Tier(tier.to_owned()));
        self.publish();
        Ok(())
    }

    /// Decides about a failed child: schedules its restart, or escalates.
    fn failed(
        &mut self,
        myself: &ActorRef<EnginesMsg>,
        key: ChildKey,
        why: &str,
    ) -> Result<(), ActorProcessingErr> {
        let log = self.restarts.entry(key.clone()).or_default();
        match log.decide(&self.policy, Instant::now()) {
            Decision::Restart { after, attempt } => {
                warn!(child = ?key, reason = %why, attempt, backoff_ms = after.as_millis() as u64, "engine exited; restarting");
                myself.send_after(after, move || EnginesMsg::Restart(key));
                Ok(())
            }
            Decision::Escalate { restarts } => {
                error!(child = ?key, reason = %why, restarts, window_s = self.policy.window.as_secs(), "engine keeps failing; escalating");
                Err(format!(
                    "{key:?} failed {restarts} times within {} s: {why}",
                    self.policy.window.as_secs()
                )
                .into())
            }
        }
    }
}

impl Actor for EnginesActor {
    type Msg = EnginesMsg;
    type State = EnginesState;
    type Arguments = EnginesArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<EnginesMsg>,
        args: EnginesArgs,
    ) -> Result<EnginesState, ActorProcessingErr> {
        // From the last table published: what was started on request and what the policy
        // wants; a previous incarnation's engines died with it.
        let last = args.engines.table();
        let mut state = EnginesState {
            table: EngineTable {
                standby: last.standby.clone(),
                on_request: last.on_request.clone(),
                wanted: last.wanted.clone(),
                ..EngineTable::default()
            },
            engines: args.engines,
            policy: args.policy,
            restarts: HashMap::new(),
        };
        state.publish();
        for name in state.engines.autostart() {
            let cfg = state.engines.tiers[&name].clone();
            state.start_tier(&myself, cfg).await?;
        }
        // Tiers started on request come back with the actor; the rest of standby waits.
        for name in state.engines.on_request() {
            let cfg = state.engines.tiers[&name].clone();
            if let Err(e) = state.start_tier(&myself, cfg).await {
                warn!(tier = %name, error = %e, "tier started on request did not start again");
                state.table.on_request.remove(&name);
                state.table.standby.insert(name);
                state.publish();
            }
        }
        let wanted = state.table.wanted.clone();
        for (id, cfg) in wanted {
            if let Err(e) = state.start_variant(&myself, &id, cfg).await {
                warn!(engine = %id, error = %e, "variant engine did not start again");
            }
        }
        Ok(state)
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<EnginesMsg>,
        state: &mut EnginesState,
    ) -> Result<(), ActorProcessingErr> {
        state.table.running.clear();
        state.publish();
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<EnginesMsg>,
        msg: EnginesMsg,
        state: &mut EnginesState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            EnginesMsg::StartVariant { id, cfg, reply } => {
                if state.table.variants.contains_key(&id) {
                    let _ = reply.send(Ok(()));
                    return Ok(());
                }
                match state.start_variant(&myself, &id, cfg.clone()).await {
                    Ok(()) => {
                        state.table.wanted.insert(id, cfg);
                        state.publish();
                        let _ = reply.send(Ok(()));
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e.to_string()));
                    }
                }
            }
            EnginesMsg::Retire { ids, reply } => {
                state.retire(&ids);
                for id in ids {
                    state.restarts.remove(&ChildKey::Variant(id));
                }
                if let Some(r) = reply {
                    let _ = r.send(());
                }
                myself.send_message(EnginesMsg::CheckDrain)?;
            }
            EnginesMsg::CheckDrain => {
                let idle: Vec<String> = state
                    .table
                    .draining
                    .iter()
                    .filter(|(id, v)| {
                        let s = &v.entry.desc.stats;
                        let own = *id == &v.tier;
                        Arc::strong_count(&v.lease) == 1
                            && s.active.load(Relaxed) + s.queued.load(Relaxed) == 0
                            && (!own || v.since.elapsed() >= DRAIN_GRACE)
                    })
                    .map(|(id, _)| id.clone())
                    .collect();
                if !idle.is_empty() {
                    // Published before the stops: a request never picks a stopping engine.
                    let stopping: Vec<(String, VariantEntry)> = idle
                        .iter()
                        .filter_map(|id| state.table.draining.remove(id).map(|v| (id.clone(), v)))
                        .collect();
                    state.publish();
                    for (id, v) in stopping {
                        info!(engine = %id, "retired engine idle; stopping");
                        v.entry.actor.stop(Some(if id == v.tier {
                            "drained".into()
                        } else {
                            "retired by the quantization policy".into()
                        }));
                    }
                }
                if !state.table.draining.is_empty() {
                    myself.send_after(DRAIN_POLL, || EnginesMsg::CheckDrain);
                }
            }
            EnginesMsg::Restart(key) => {
                let started = match &key {
                    ChildKey::Tier(name) => match state.engines.tiers.get(name).cloned() {
                        Some(cfg)
                            if !state.table.running.contains_key(name)
                                && !state.table.standby.contains(name) =>
                        {
                            state.start_tier(&myself, cfg).await
                        }
                        _ => Ok(()),
                    },
                    ChildKey::Variant(id) => {
                        let cfg = state.table.wanted.get(id).cloned();
                        match cfg {
                            Some(cfg) if !state.table.variants.contains_key(id) => {
                                state.start_variant(&myself, id, cfg).await
                            }
                            _ => Ok(()), // retired while it was down
                        }
                    }
                };
                if let Err(e) = started {
                    state.failed(&myself, key, &format!("start failed: {e}"))?;
                }
            }
            EnginesMsg::LoadTier { tier, reply } => {
                let _ = reply.send(state.load_tier(&myself, &tier).await);
            }
            EnginesMsg::DrainTier { tier, reply } => {
                let r = state.drain_tier(&tier);
                if r.is_ok() {
                    myself.send_message(EnginesMsg::CheckDrain)?;
                }
                let _ = reply.send(r);
            }
            EnginesMsg::CrashTier { tier, reply } => {
                let hit = state.table.running.get(&tier).cloned();
                if let Some(e) = &hit {
                    warn!(%tier, "fault injection: crashing the engine thread");
                    let _ = e.actor.send_message(TierMsg::CrashEngine);
                }
                let _ = reply.send(hit.is_some());
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<EnginesMsg>,
        evt: SupervisionEvent,
        state: &mut EnginesState,
    ) -> Result<(), ActorProcessingErr> {
        let Some((cell, why)) = crate::supervisor::exited(evt) else {
            return Ok(());
        };
        let id = cell.get_id();
        let tier = state
            .table
            .running
            .iter()
            .find(|(_, e)| e.actor.get_id() == id)
            .map(|(name, _)| name.clone());
        if let Some(name) = tier {
            state.table.running.remove(&name);
            state.publish();
            return state.failed(&myself, ChildKey::Tier(name), &why);
        }
        let variant = state
            .table
            .variants
            .iter()
            .find(|(_, e)| e.entry.actor.get_id() == id)
            .map(|(vid, _)| vid.clone());
        if let Some(vid) = variant {
            state.table.variants.remove(&vid);
            state.publish();
            return state.failed(&myself, ChildKey::Variant(vid), &why);
        }
        // A retired engine stopped, or a child that never made it into a map.
        Ok(())
    }
}
