//! Which engine serves a request on this node: the quantization policy
//! ([`QuantPolicy`]) maps a request's role and tier to a GGUF variant and KV cache type.
//!
//! ```text
//!            role (tool_calls | reasoning | summaries), tier
//! request ──▶ policy.quantization.get(role, tier) ──None──▶ the tier's engine (registry)
//!                          │ Some(entry)
//!                          ▼
//!            Variants[engine_id(tier, entry)] ──missing──▶ the tier's engine
//!                          │
//!                          ▼  lease held until the response ends
//!                    variant engine (same tier name, other GGUF / KV type)
//! ```
//!
//! A tier's configured engine stays in the registry and serves everything the policy does
//! not send elsewhere, so a node without a quantization policy does one empty-map lookup
//! per request and nothing else. Each distinct `(GGUF, KV type)` a policy names runs as
//! one more engine of that tier (its own llama.cpp context and weights: memory adds up).
//!
//! **Reload** ([`Engines::resolve`], [`Engines::start`], [`Engines::retire_unused`]): a new
//! policy is checked (tier hosted here, GGUF present), the engines it needs are started,
//! and only then is the policy swapped in. Engines the new policy no longer names leave
//! the lookup map at once; requests already on them keep their stream, and each is stopped
//! once nobody holds its lease and its engine counts no running or queued sequence.

use std::collections::BTreeMap;
use std::io::Read as _;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use mesh_control::policy::{kv_name, QuantPolicy, Role, TierQuant};
use mesh_tiers::{EngineConfig, KvType};
use ractor::ActorRef;
use serde_json::{json, Value};

use crate::node::{SupervisorMsg, TierEntry, VariantEntry, Variants};
use crate::openai::EngineInfo;

/// How often a retired engine is checked for idleness.
const DRAIN_POLL: Duration = Duration::from_millis(50);

/// The id of the engine a policy entry names on `tier` (`t1:q4_0:q8_0`; `-` for "as
/// configured").
pub fn engine_id(tier: &str, q: &TierQuant) -> String {
    format!(
        "{tier}:{}:{}",
        q.gguf.as_deref().unwrap_or("-"),
        q.kv.map_or("-", kv_name)
    )
}

/// A request's engine: the entry to submit to, what to report, and the lease that keeps
/// a variant engine alive until the response ends (none for a tier's own engine).
#[derive(Debug, Clone)]
pub struct Picked {
    /// The engine's actor.
    pub entry: TierEntry,
    /// What served the request (`mesh.engine`, `mesh_engine_requests_total`).
    pub info: EngineInfo,
    /// Held while the request runs (variant engines only).
    pub lease: Option<Arc<()>>,
}

/// The engines of this node's tiers under the quantization policy.
pub struct Engines {
    tiers: BTreeMap<String, EngineConfig>,
    supervisor: Option<ActorRef<SupervisorMsg>>,
    variants: Variants,
    /// Retired engines still finishing requests (the entry without its lease).
    draining: Arc<DashMap<String, VariantEntry>>,
}

impl std::fmt::Debug for Engines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engines")
            .field("tiers", &self.tiers.keys().collect::<Vec<_>>())
            .field("variants", &self.variants.len())
            .field("draining", &self.draining.len())
            .finish()
    }
}

fn file_name(p: &std::path::Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| p.display().to_string())
}

impl Engines {
    /// Over the node's tier configs (as started), its supervisor and its variant map.
    pub fn new(
        tiers: &[EngineConfig],
        supervisor: Option<ActorRef<SupervisorMsg>>,
        variants: Variants,
    ) -> Self {
        Self {
            tiers: tiers.iter().map(|t| (t.name.clone(), t.clone())).collect(),
            supervisor,
            variants,
            draining: Arc::default(),
        }
    }

    /// No tiers known and no supervisor: every tier runs as configured and a policy
    /// naming any tier is refused.
    pub fn none() -> Self {
        Self::new(&[], None, Arc::default())
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
        let missing: Vec<(&String, &EngineConfig)> = wanted
            .iter()
            .filter(|(id, _)| !self.variants.contains_key(*id))
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        let Some(sup) = &self.supervisor else {
            return Err("this node cannot start engines".into());
        };
        let mut started: Vec<String> = vec![];
        for (id, cfg) in missing {
            let (id2, cfg2) = (id.clone(), cfg.clone());
            let r = ractor::call!(sup, |reply| SupervisorMsg::StartVariant {
                id: id2,
                cfg: cfg2,
                reply: Some(reply),
            })
            .map_err(|e| e.to_string())
            .and_then(|r| r);
            if let Err(e) = r {
                for s in started {
                    if let Some((_, v)) = self.variants.remove(&s) {
                        let _ = sup.send_message(SupervisorMsg::StopVariant {
                            id: s,
                            actor: v.entry.actor,
                        });
                    }
                }
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

    /// Takes every running variant that `wanted` does not name out of the lookup map and
    /// stops it once it is idle: no request holds its lease and its engine has nothing
    /// running or queued.
    pub fn retire_unused(&self, wanted: &BTreeMap<String, EngineConfig>) {
        let old: Vec<String> = self
            .variants
            .iter()
            .map(|e| e.key().clone())
            .filter(|id| !wanted.contains_key(id))
            .collect();
        for id in old {
            let Some((_, v)) = self.variants.remove(&id) else {
                continue;
            };
            let Some(sup) = self.supervisor.clone() else {
                continue;
            };
            let shown = VariantEntry {
                lease: Arc::new(()),
                ..v.clone()
            };
            self.draining.insert(id.clone(), shown);
            let draining = self.draining.clone();
            tracing::info!(engine = %id, "engine retired by the policy; draining");
            tokio::spawn(async move {
                let t0 = std::time::Instant::now();
                loop {
                    let s = &v.entry.desc.stats;
                    let busy = s.active.load(Relaxed) + s.queued.load(Relaxed);
                    if Arc::strong_count(&v.lease) == 1 && busy == 0 {
                        break;
                    }
                    tokio::time::sleep(DRAIN_POLL).await;
                }
                tracing::info!(engine = %id, drained_ms = t0.elapsed().as_millis() as u64, "retired engine idle; stopping");
                let _ = sup.send_message(SupervisorMsg::StopVariant {
                    id: id.clone(),
                    actor: v.entry.actor.clone(),
                });
                draining.remove(&id);
            });
        }
    }

    /// The engine for `role` on the local tier `entry` under `q`: a variant when the
    /// policy names one that runs, else `entry` itself.
    pub fn pick(&self, q: &QuantPolicy, role: Role, tier: &str, entry: TierEntry) -> Picked {
        if let Some(tq) = q.get(role, tier) {
            let hit = self
                .variants
                .get(&engine_id(tier, tq))
                .map(|v| v.value().clone());
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

    /// Every engine of this node: the tiers' own, the variants serving now and the retired
    /// ones still draining, with their running and queued sequences.
    pub fn list(&self, registry: &crate::node::Registry) -> Vec<Value> {
        let row = |id: &str, tier: &str, gguf: String, kv: KvType, e: &TierEntry, state: &str| {
            let s = &e.desc.stats;
            json!({"id": id, "tier": tier, "gguf": gguf, "kv_type": kv_name(kv), "state": state,
                   "active": s.active.load(Relaxed), "queued": s.queued.load(Relaxed),
                   "prompt_tokens": s.prompt_tokens.load(Relaxed),
                   "generated_tokens": s.generated_tokens.load(Relaxed)})
        };
        let mut out = vec![];
        for (name, c) in &self.tiers {
            if let Some(e) = registry.get(name) {
                out.push(row(
                    name,
                    name,
                    file_name(&c.model),
                    c.kv_type,
                    &e,
                    "serving",
                ));
            }
        }
        for (map, state) in [(&*self.variants, "serving"), (&*self.draining, "draining")] {
            for v in map.iter() {
                out.push(row(
                    v.key(),
                    &v.tier,
                    v.gguf.clone(),
                    v.kv_type,
                    &v.entry,
                    state,
                ));
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
