//! The tier cascade (`model: "cascade"`): each tier in policy order generates the whole
//! answer; the first whose answer [`cascade::assess`] keeps answers the caller (the last
//! tier's always is). The reply replays the kept answer's events, its usage counting every
//! tier tried, and its [`MeshInfo::cascade`] lists every step with its verdict.

use std::sync::Arc;
use std::time::Instant;

use mesh_control::policy::{Policy, Role as RequestRole};
use mesh_tiers::cascade::{self, Verdict};
use mesh_tiers::{FinishReason, TokenEvent, Usage};
use tokio::sync::mpsc;
use tracing::{info_span, Instrument};

use super::chat::{prepare, Job};
use super::stream::Timed;
use super::{CascadeStep, ChatCall, Error, Hold, MeshInfo, Reply, RouterInfo, Service};

impl Service {
    pub(crate) async fn cascade(
        &self,
        call: ChatCall,
        arrived: Instant,
        deadline: Instant,
        routed: Option<RouterInfo>,
        live: &Arc<Policy>,
    ) -> Result<Reply, Error> {
        let policy = &live.cascade;
        let p = prepare(&call, routed.as_ref())?;
        let mut first = self.find_tier_waiting(&policy.tiers[0], deadline).await?;
        let permit = self.permit()?;
        // The tiers share one tokenizer and chat format (a cascade requirement), so one
        // rendering serves all.
        let tp = self
            .render(&mut first, &policy.tiers[0], &call, &p)
            .instrument(info_span!("render"))
            .await?;
        let prompt = tp.tokens.clone();
        tracing::Span::current().record("gen_ai.usage.input_tokens", prompt.len());
        let offered: Vec<&str> = p.shown.iter().map(|t| t.name.as_str()).collect();
        let role = RequestRole::classify(!p.shown.is_empty(), call.reasoning_budget);
        let (start, skipped) = cascade::first_tier(policy, p.confidence);
        let metrics = self.metrics().clone();
        let count = |tier: &str, verdict: &str| metrics.cascade_step(tier, verdict);
        let mut steps: Vec<CascadeStep> = Vec::new();
        if let Some(v) = skipped {
            count(&policy.tiers[0], v.as_str());
            steps.push(CascadeStep {
                tier: policy.tiers[0].clone(),
                verdict: v.as_str().into(),
                min_margin: None,
                completion_tokens: 0,
            });
        }
        let mut total = Usage::default();
        let mut kept = None;
        for (i, tier) in policy.tiers.iter().enumerate().skip(start) {
            let routed_here = self
                .inner
                .dispatcher
                .route_prompt(tier, &prompt, &p.scope)
                .await;
            let target = match routed_here.map_or_else(|| self.find_tier(tier), Ok) {
                Ok(t) => t,
                // A missing middle tier is skipped; the last one must answer.
                Err(e) if i + 1 == policy.tiers.len() => return Err(e),
                Err(_) => {
                    steps.push(CascadeStep {
                        tier: tier.clone(),
                        verdict: "unavailable".into(),
                        min_margin: None,
                        completion_tokens: 0,
                    });
                    continue;
                }
            };
            let (target, engine, lease) = self.engine_for(target, tier, role, &live.quantization);
            let req = self
                .build_request(&call, &p, &tp, target.max_seq_len(), live, role)
                .await?;
            let job = Job {
                model: tier.clone(),
                req,
                engine,
                lease,
                role,
            };
            let c = async {
                let rx = self.submit(target, &job, deadline).await?;
                job.reply(self, rx, None, None, arrived, Some(tp.parse.clone()))
                    .collect()
                    .await
            }
            .instrument(
                info_span!("cascade.tier", mesh.tier = %tier, mesh.verdict = tracing::field::Empty),
            )
            .await?;
            let texts: Vec<&str> = c
                .events
                .iter()
                .filter_map(|e| match e {
                    TokenEvent::Token { text, .. } => Some(text.as_str()),
                    _ => None,
                })
                .collect();
            let out = cascade::Output {
                parsed: &c.output,
                margins: &c.margins,
                texts: &texts,
                truncated: c.finish != FinishReason::Stop,
            };
            let a = cascade::assess(policy, i, out, &offered);
            count(tier, a.verdict.as_str());
            steps.push(CascadeStep {
                tier: tier.clone(),
                verdict: a.verdict.as_str().into(),
                min_margin: a.min_margin.is_finite().then_some(a.min_margin),
                completion_tokens: c.usage.completion_tokens,
            });
            total.prompt_tokens += c.usage.prompt_tokens;
            total.completion_tokens += c.usage.completion_tokens;
            total.reasoning_tokens += c.usage.reasoning_tokens;
            total.cached_tokens += c.usage.cached_tokens;
            if a.verdict.kept() {
                kept = Some(c);
                break;
            }
            debug_assert!(a.verdict != Verdict::Accept);
        }
        let c = kept.ok_or_else(|| Error::unavailable("no cascade tier answered"))?;
        // Replay the kept answer; its final usage reports the whole cascade's tokens.
        let (tx, rx) = mpsc::unbounded_channel();
        for ev in c.events {
            let ev = match ev {
                TokenEvent::Done {
                    finish,
                    mut usage,
                    tail,
                } => {
                    usage.prompt_tokens = total.prompt_tokens;
                    usage.completion_tokens = total.completion_tokens;
                    usage.reasoning_tokens = total.reasoning_tokens;
                    usage.cached_tokens = total.cached_tokens;
                    TokenEvent::Done {
                        finish,
                        usage,
                        tail,
                    }
                }
                other => other,
            };
            let _ = tx.send(ev);
        }
        Ok(Reply {
            model: policy.model.clone(),
            mesh: MeshInfo {
                tier: c.mesh.tier,
                cascade: steps,
                router: routed,
                engine: c.mesh.engine,
                seed: c.mesh.seed,
                ..MeshInfo::default()
            },
            events: Timed::new(rx, &policy.model, metrics, arrived),
            parse: Some(tp.parse),
            parser: None,
            pending_done: None,
            guard: None,
            held: vec![],
            prompt_token_ids: None,
            _hold: Hold {
                _permit: Some(permit),
                _lease: None,
            },
        })
    }
}
