//! Speculative decoding on the engine thread: the draft model's context, each sequence's
//! draft state, the draft phase of a step and the verification of drafts.

use std::sync::atomic::Ordering;

use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::token::LlamaToken;
use tracing::warn;

use super::batch::Loop;
use crate::plan::Work;
use crate::sampler::{allowed_argmax, DraftSampler};
use crate::speculative;
use crate::{DraftConfig, EngineConfig};

/// The draft model's context, on the engine thread next to the target's.
pub(super) struct Draft<'m> {
    pub(super) ctx: LlamaContext<'m>,
    pub(super) batch: LlamaBatch<'static>,
    pub(super) cfg: DraftConfig,
}

impl<'m> Draft<'m> {
    pub(super) fn new(ctx: LlamaContext<'m>, cfg: &DraftConfig, engine: &EngineConfig) -> Self {
        Self {
            ctx,
            batch: LlamaBatch::new(engine.n_batch as usize, 1),
            cfg: cfg.clone(),
        }
    }
}

/// Speculative state of one sequence.
///
/// The sequence's tokens are its prompt followed by `out`; the last of them is the
/// pending token (not yet in the target's KV). The draft's KV holds the first `dpos`.
pub(super) struct SpecSeq {
    pub(super) out: Vec<i32>,
    pub(super) dpos: usize,
    /// Leading positions of the draft's KV known to hold the sequence's own tokens (the
    /// rest, up to `dpos`, are this round's drafts).
    pub(super) fed: usize,
    /// Draft length of the next round (adapts, `speculative::next_k`).
    pub(super) k: usize,
    /// Drafts this step may propose (planned before the step).
    pub(super) k_step: usize,
    /// Drafts proposed this step, verified in the same step.
    pub(super) drafts: Vec<i32>,
    /// The draft's distribution at each of `drafts` (sampled requests under rejection
    /// sampling; empty otherwise).
    pub(super) dists: Vec<Vec<(i32, f32)>>,
    /// Draws the drafts of a sampled request under rejection sampling.
    pub(super) sampled: Option<DraftSampler>,
    /// This round's copy of a greedy request's grammar, advanced over its drafts, so the
    /// draft proposes only tokens the grammar allows.
    pub(super) grammar: Option<llama_cpp_2::sampling::LlamaSampler>,
    pub(super) drafted: usize,
    pub(super) accepted: usize,
}

impl SpecSeq {
    pub(super) fn token(&self, prompt: &[i32], i: usize) -> i32 {
        if i < prompt.len() {
            prompt[i]
        } else {
            self.out[i - prompt.len()]
        }
    }
}

impl<'m> Loop<'m> {
    /// Sets each decoding speculative sequence's draft length for this step; returns the
    /// target rows they add.
    pub(super) fn plan_drafts(&mut self) -> usize {
        let max_seq_len = self.max_seq_len;
        let mut rows = 0;
        for s in self.slots.iter_mut().flatten() {
            let Some(sp) = &mut s.spec else { continue };
            sp.k_step = 0;
            if s.pending.is_some() {
                let n = s.req.prompt.len() + s.generated;
                let k = s.req.draft_max.map_or(sp.k, |m| sp.k.min(m.max(1)));
                sp.k_step = speculative::draft_len(
                    k,
                    s.req.max_tokens.saturating_sub(s.generated),
                    max_seq_len.saturating_sub(n),
                );
                rows += sp.k_step;
            }
        }
        rows
    }

    /// Draft phase of a step. The first draft decode feeds every speculative sequence the
    /// tokens its draft KV lacks (prompt chunks alongside the target's, up to
    /// `prefill_chunk` per sequence, then the tokens accepted since its last round);
    /// a decoding sequence that is caught up then proposes `k_step` tokens greedily, one
    /// draft decode per token with all drafting sequences in each.
    pub(super) fn draft(&mut self, work: &[Work]) {
        let Some(d) = self.draft.as_mut() else {
            return;
        };
        let cap = self.cfg.n_batch as usize;
        let chunk = self.cfg.prefill_chunk as usize;
        d.batch.clear();
        let mut rows: Vec<(usize, i32)> = Vec::new();
        for w in work {
            let (slot, decoding) = match *w {
                Work::Decode { slot } => (slot, true),
                Work::Prefill { slot, .. } => (slot, false),
            };
            let Some(s) = self.slots[slot].as_mut() else {
                continue;
            };
            let Some(sp) = s.spec.as_mut() else {
                continue;
            };
            // Tokens the target holds after this step (a decoding sequence: with its pending one).
            let goal = match *w {
                Work::Prefill { start, len, .. } => start + len,
                Work::Decode { .. } => s.req.prompt.len() + s.generated,
            };
            let from = sp.dpos;
            let to = goal.min(from + chunk);
            if from >= to || d.batch.n_tokens() as usize + (to - from) > cap {
                continue;
            }
            let drafting = decoding && sp.k_step > 0 && to == goal;
            for i in from..to {
                let logits = drafting && i + 1 == to;
                d.batch
                    .add(
                        LlamaToken(sp.token(&s.req.prompt, i)),
                        i as i32,
                        &[slot as i32],
                        logits,
                    )
                    .expect("checked against the batch capacity");
            }
            self.stats
                .draft_prefill_tokens
                .fetch_add((to - from) as u64, Ordering::Relaxed);
            sp.dpos = to;
            sp.fed = to;
            if drafting {
                // The grammar as the target will check the first draft's position (it has
                // accepted every emitted token, the pending one included).
                sp.grammar = s.sampler.grammar_copy();
                rows.push((slot, d.batch.n_tokens() - 1));
            }
        }
        if d.batch.n_tokens() == 0 {
            return;
        }
        loop {
            if let Err(e) = d.ctx.decode(&mut d.batch) {
                warn!(error = %e, "draft decode failed; sequences decode without drafts until their draft KV is rebuilt");
                for (i, s) in self.slots.iter_mut().enumerate() {
                    if let Some(sp) = s.as_mut().and_then(|s| s.spec.as_mut()) {
                        sp.drafts.clear();
                        sp.dists.clear();
                        sp.dpos = 0;
                        sp.fed = 0;
                        let _ = d.ctx.clear_kv_cache_seq(Some(i as u32), None, None);
                    }
                }
                return;
            }
            d.batch.clear();
            let mut next = Vec::new();
            for (slot, row) in rows {
                let sp = self.slots[slot]
                    .as_mut()
                    .and_then(|s| s.spec.as_mut())
                    .expect("drafting slot is speculative");
                let t = match (&mut sp.sampled, &mut sp.grammar) {
                    (Some(ds), _) => {
                        let (t, q) = ds.draw(&d.ctx, row);
                        sp.dists.push(q);
                        t
                    }
                    (None, Some(g)) => match allowed_argmax(&d.ctx, row, g) {
                        Some(t) => t.0,
                        // The grammar allows nothing more: the round's drafts end here.
                        None => continue,
                    },
                    (None, None) => speculative::argmax(d.ctx.get_logits_ith(row)),
                };
                sp.drafts.push(t);
                if sp.drafts.len() < sp.k_step {
                    d.batch
                        .add(LlamaToken(t), sp.dpos as i32, &[slot as i32], true)
                        .expect("one row per drafting sequence");
                    sp.dpos += 1;
                    next.push((slot, d.batch.n_tokens() - 1));
                }
            }
            if next.is_empty() {
                return;
            }
            rows = next;
        }
    }

    /// Verifies a speculative sequence's drafts. Rows `row..=row + drafts.len()` hold the
    /// target's logits after its pending token and after each draft; tokens are chosen
    /// row by row exactly as in plain decoding and emitted while they equal the drafts,
    /// or, when `dists` holds the draft's distributions (rejection sampling), kept or
    /// replaced by [`speculative::accept_sampled`]. The first token that is not the draft,
    /// or the one after the last draft, ends the round (so a round emits 1..=k+1 tokens,
    /// fewer when the sequence finishes inside it). KV cells past the accepted tokens are
    /// then removed from both contexts.
    pub(super) fn verify(
        &mut self,
        slot: usize,
        row: i32,
        drafts: &[i32],
        dists: &[Vec<(i32, f32)>],
    ) {
        let n = {
            let s = self.slots[slot].as_mut().expect("verified slot exists");
            s.spec.as_mut().expect("speculative slot").drafted += drafts.len();
            s.req.prompt.len() + s.generated
        };
        self.stats
            .draft_tokens
            .fetch_add(drafts.len() as u64, Ordering::Relaxed);
        let mut accepted = 0;
        for j in 0..=drafts.len() {
            let (tok, margin) = match (drafts.get(j), dists.get(j)) {
                (Some(&x), Some(q)) => self.choose_sampled(slot, row + j as i32, x, q),
                _ => self.choose(slot, row + j as i32),
            };
            let hit = drafts.get(j) == Some(&tok.0);
            if hit {
                accepted += 1;
                self.stats.draft_accepted.fetch_add(1, Ordering::Relaxed);
                if let Some(sp) = self.slots[slot].as_mut().and_then(|s| s.spec.as_mut()) {
                    sp.accepted += 1;
                }
            }
            let finished = self.emit(slot, tok, margin);
            if finished || !hit {
                break;
            }
        }
        // A finished sequence was freed, cells and all.
        let Some(sp) = self.slots[slot].as_mut().and_then(|s| s.spec.as_mut()) else {
            return;
        };
        let d = self
            .draft
            .as_mut()
            .expect("speculative slots imply a draft");
        sp.k = speculative::next_k(sp.k, drafts.len(), accepted, d.cfg.k_min, d.cfg.k_max);
        // The target holds the pending token and the accepted drafts; the new pending
        // token is the next position.
        let keep = n + accepted;
        let _ = self
            .ctx
            .clear_kv_cache_seq(Some(slot as u32), Some(keep as u32), None);
        // What the draft KV keeps now is the sequence's: the caught-up tokens and the
        // accepted drafts.
        sp.dpos = sp.dpos.min(keep);
        sp.fed = sp.dpos;
        let _ = d
            .ctx
            .clear_kv_cache_seq(Some(slot as u32), Some(sp.dpos as u32), None);
    }
}
