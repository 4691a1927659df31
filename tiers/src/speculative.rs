//! Speculative decoding across tiers: a small tier drafts, a large tier verifies.
//!
//! Both models must share one vocabulary (the bundled tiers do). Each round, for
//! every running sequence:
//!
//! 1. the draft model proposes `k` tokens greedily, one decode per token, all
//!    sequences in one batch per step;
//! 2. the target model scores the sequence's last accepted token plus the `k`
//!    drafts in **one** batch, with logits at every position;
//! 3. drafts are accepted while they equal the target's own greedy choice; the
//!    target's choice at the first disagreement (or after the last draft, when all
//!    were accepted) is appended too, so every round yields 1..=k+1 tokens;
//! 4. KV cells past the accepted prefix are removed from both contexts.
//!
//! Greedy acceptance means the output is the target model's greedy output, token
//! for token; only the number of target decodes changes. `k` adapts per sequence:
//! one longer after a fully accepted round, shorter after a round that accepted
//! less than half ([`next_k`]).
//!
//! Sampled requests in the serving engine use [`accept_sampled`] instead of step 3
//! (speculative sampling: the draft samples, the target keeps a draft with probability
//! `min(1, p / q)`), which keeps the target's distribution rather than its tokens.
//!
//! [`Speculative`] is the stand-alone form (its own two contexts, used by the
//! evaluation). The serving engine runs the same rounds inside its continuous-batching
//! loop when its config has a draft ([`crate::DraftConfig`]); see `engine/drafting.rs`.

use std::num::NonZeroU32;

use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;

use crate::engine::backend;
use crate::TierError;

/// Draft-length control and context sizes.
#[derive(Debug, Clone)]
pub struct SpecConfig {
    /// Draft length of a sequence's first round.
    pub k_init: usize,
    /// Shortest draft.
    pub k_min: usize,
    /// Longest draft.
    pub k_max: usize,
    /// llama.cpp threads for each model.
    pub threads: i32,
    /// KV cells per sequence in each context.
    pub max_seq_len: u32,
    /// Most sequences decoded together.
    pub n_seq_max: u32,
}

impl Default for SpecConfig {
    fn default() -> Self {
        Self {
            k_init: 4,
            k_min: 1,
            k_max: 12,
            threads: 2,
            max_seq_len: 2048,
            n_seq_max: 8,
        }
    }
}

/// One finished sequence.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SpecOutput {
    /// Generated tokens, the end token included when generation stopped on it.
    pub tokens: Vec<i32>,
    /// Drafted tokens.
    pub drafted: usize,
    /// Drafted tokens the target accepted.
    pub accepted: usize,
    /// Verification rounds (target decodes after the prompt).
    pub rounds: usize,
    /// Seconds spent prefilling the prompts (both models; shared by a batch).
    pub prefill_s: f64,
    /// Seconds from the end of the prefill to this sequence's last token.
    pub decode_s: f64,
}

impl SpecOutput {
    /// Share of drafted tokens accepted.
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
}

struct Seq {
    out: SpecOutput,
    /// Position of the next token to enter the target's KV (= tokens already in it).
    pos: usize,
    /// Accepted tokens not yet in the target's KV (always exactly the last one).
    last: i32,
    /// Accepted tokens not yet in the draft's KV (1 or 2).
    draft_feed: Vec<i32>,
    k: usize,
    drafts: Vec<i32>,
    max_tokens: usize,
    done: bool,
}

/// A target model and a draft model, each with its own context on the caller's thread.
pub struct Speculative<'m> {
    target: &'m LlamaModel,
    tctx: LlamaContext<'m>,
    dctx: LlamaContext<'m>,
    cfg: SpecConfig,
}

fn context<'m>(model: &'m LlamaModel, cfg: &SpecConfig) -> Result<LlamaContext<'m>, TierError> {
    let n_ctx = cfg.max_seq_len * cfg.n_seq_max;
    let params = LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(n_ctx))
        .with_n_batch(n_ctx.min(4096))
        .with_n_ubatch(512)
        .with_n_seq_max(cfg.n_seq_max)
        .with_n_threads(cfg.threads)
        .with_n_threads_batch(cfg.threads);
    model
        .new_context(backend(), params)
        .map_err(|e| TierError::Context(e.to_string()))
}

/// Draft length of a sequence's next round after a round that drafted `drafted` tokens and
/// had `accepted` of them accepted: one longer after a fully accepted round, one shorter
/// after a round that accepted less than half, kept within `k_min..=k_max`.
pub fn next_k(k: usize, drafted: usize, accepted: usize, k_min: usize, k_max: usize) -> usize {
    if drafted == 0 {
        k
    } else if accepted == drafted {
        (k + 1).min(k_max)
    } else if 2 * accepted < drafted {
        k.saturating_sub(1).max(k_min)
    } else {
        k
    }
}

/// Most tokens a sequence may draft this round: its current `k`, leaving room for the
/// target's own token within the completion budget (`room` tokens left) and the drafts'
/// KV positions within the sequence limit (`cells` positions left after the pending token).
pub fn draft_len(k: usize, room: usize, cells: usize) -> usize {
    k.min(room.saturating_sub(1)).min(cells)
}

/// Speculative sampling's verdict on one drafted token of a sampled sequence (Leviathan
/// et al. 2023, Chen et al. 2023): the draft drew `x` from its distribution `q`; the token
/// is kept with probability `min(1, p(x) / q(x))`, else a token is drawn from the residual
/// `max(0, p - q)`, normalized. Tokens emitted this way are distributed exactly as draws
/// from the target's `p`, whatever `q` is, and a draft is kept with probability
/// `sum min(p, q)` (exact-match acceptance keeps it with `sum p * q`, less unless one of
/// them is one-hot).
///
/// `p` lists the target's probabilities (any order, unlisted tokens 0); `q` the draft's,
/// sorted by token. `u` and `v` are uniform draws in `[0, 1)`: `u` decides, `v` draws
/// from the residual. Returns the token and whether it is the draft's.
pub fn accept_sampled(p: &[(i32, f32)], q: &[(i32, f32)], x: i32, u: f32, v: f32) -> (i32, bool) {
    let q_of = |t: i32| q.binary_search_by_key(&t, |e| e.0).map_or(0.0, |i| q[i].1);
    let px = p.iter().find(|e| e.0 == x).map_or(0.0, |e| e.1);
    let qx = q_of(x);
    // u < p/q, without dividing (a draft the draft model gave no mass is never kept).
    if px > 0.0 && u * qx < px {
        return (x, true);
    }
    let residual = |e: &(i32, f32)| (e.1 - q_of(e.0)).max(0.0);
    let total: f32 = p.iter().map(residual).sum();
    let pick = |weight: &dyn Fn(&(i32, f32)) -> f32, total: f32| {
        let mut left = v * total;
        let mut last = None;
        for e in p {
            let w = weight(e);
            if w > 0.0 {
                last = Some(e.0);
                if left < w {
                    return e.0;
                }
                left -= w;
            }
        }
        // Rounding left a sliver past the last weighted token.
        last.unwrap_or(x)
    };
    if total > 0.0 {
        (pick(&residual, total), false)
    } else {
        // p == q up to rounding: the residual is empty, p itself is the right law.
        (
            pick(&|e: &(i32, f32)| e.1, p.iter().map(|e| e.1).sum()),
            false,
        )
    }
}

/// The first index of the largest logit (llama.cpp's greedy choice).
pub(crate) fn argmax(logits: &[f32]) -> i32 {
    crate::sampler::top2(logits).0 as i32
}

impl<'m> Speculative<'m> {
    /// Contexts for both models. The vocabularies must match.
    pub fn new(
        target: &'m LlamaModel,
        draft: &'m LlamaModel,
        cfg: SpecConfig,
    ) -> Result<Self, TierError> {
        if target.n_vocab() != draft.n_vocab() {
            return Err(TierError::InvalidRequest(format!(
                "draft vocabulary ({}) differs from the target's ({})",
                draft.n_vocab(),
                target.n_vocab()
            )));
        }
        if cfg.k_min == 0 || cfg.k_min > cfg.k_max || !(cfg.k_min..=cfg.k_max).contains(&cfg.k_init)
        {
            return Err(TierError::InvalidRequest(
                "need 1 <= k_min <= k_init <= k_max".into(),
            ));
        }
        Ok(Self {
            target,
            tctx: context(target, &cfg)?,
            dctx: context(draft, &cfg)?,
            cfg,
        })
    }

    /// Generates greedily for every prompt (at most `n_seq_max` at once), stopping at an
    /// end-of-generation token or after `max_tokens`.
    pub fn generate(
        &mut self,
        prompts: &[Vec<i32>],
        max_tokens: usize,
    ) -> Result<Vec<SpecOutput>, TierError> {
        if prompts.len() > self.cfg.n_seq_max as usize {
            return Err(TierError::InvalidRequest(format!(
                "{} prompts, at most {} sequences",
                prompts.len(),
                self.cfg.n_seq_max
            )));
        }
        let limit = self.cfg.max_seq_len as usize;
        for p in prompts {
            if p.is_empty() || p.len() + max_tokens + self.cfg.k_max + 1 > limit {
                return Err(TierError::ContextExceeded {
                    prompt: p.len(),
                    max_tokens,
                    limit,
                });
            }
        }
        self.tctx.clear_kv_cache();
        self.dctx.clear_kv_cache();
        let t0 = std::time::Instant::now();
        let first = self.prefill(prompts)?;
        let prefill_s = t0.elapsed().as_secs_f64();
        let t1 = std::time::Instant::now();
        let mut seqs: Vec<Seq> = prompts
            .iter()
            .zip(first)
            .map(|(p, t)| Seq {
                out: SpecOutput {
                    tokens: vec![t],
                    prefill_s,
                    ..Default::default()
                },
                pos: p.len(),
                last: t,
                draft_feed: vec![t],
                k: self.cfg.k_init,
                drafts: Vec::new(),
                max_tokens,
                done: false,
            })
            .collect();
        for s in &mut seqs {
            self.finish_if_done(s);
        }
        while seqs.iter().any(|s| !s.done) {
            self.draft_round(&mut seqs)?;
            self.verify_round(&mut seqs)?;
            for s in seqs.iter_mut().filter(|s| s.done && s.out.decode_s == 0.0) {
                s.out.decode_s = t1.elapsed().as_secs_f64();
            }
        }
        Ok(seqs.into_iter().map(|s| s.out).collect())
    }

    /// Prefills every prompt into both contexts; returns the target's first token per prompt.
    fn prefill(&mut self, prompts: &[Vec<i32>]) -> Result<Vec<i32>, TierError> {
        let mut first = Vec::with_capacity(prompts.len());
        for (i, p) in prompts.iter().enumerate() {
            for (ctx, want_logits) in [(&mut self.tctx, true), (&mut self.dctx, false)] {
                let mut batch = LlamaBatch::new(p.len(), 1);
                for (j, &t) in p.iter().enumerate() {
                    let logits = want_logits && j + 1 == p.len();
                    batch
                        .add(LlamaToken(t), j as i32, &[i as i32], logits)
                        .map_err(|e| TierError::Decode(e.to_string()))?;
                }
                ctx.decode(&mut batch)
                    .map_err(|e| TierError::Decode(e.to_string()))?;
                if want_logits {
                    first.push(argmax(ctx.get_logits_ith(batch.n_tokens() - 1)));
                }
            }
        }
        Ok(first)
    }

    fn finish_if_done(&self, s: &mut Seq) {
        let last = *s.out.tokens.last().expect("at least one token");
        if self.target.vocab().is_eog(LlamaToken(last)) || s.out.tokens.len() >= s.max_tokens {
            s.done = true;
        }
    }

    /// k draft steps; every running sequence contributes one row per step.
    fn draft_round(&mut self, seqs: &mut [Seq]) -> Result<(), TierError> {
        for s in seqs.iter_mut() {
            s.drafts.clear();
            // Never draft past the token budget.
            let room = s.max_tokens.saturating_sub(s.out.tokens.len());
            s.k = s.k.min(room.max(1));
        }
        let steps = seqs
            .iter()
            .filter(|s| !s.done)
            .map(|s| s.k)
            .max()
            .unwrap_or(0);
        let mut batch = LlamaBatch::new(2 * seqs.len(), 1);
        for step in 0..steps {
            batch.clear();
            let mut rows = Vec::new();
            for (i, s) in seqs.iter_mut().enumerate() {
                if s.done || s.drafts.len() >= s.k {
                    continue;
                }
                let feed: Vec<i32> = if step == 0 {
                    std::mem::take(&mut s.draft_feed)
                } else {
                    vec![*s.drafts.last().expect("drafted in the previous step")]
                };
                // Position of the first fed token: the draft KV holds everything before it.
                let start = s.pos + s.drafts.len() + 1 - feed.len();
                for (j, &t) in feed.iter().enumerate() {
                    let logits = j + 1 == feed.len();
                    batch
                        .add(LlamaToken(t), (start + j) as i32, &[i as i32], logits)
                        .map_err(|e| TierError::Decode(e.to_string()))?;
                }
                rows.push((i, batch.n_tokens() - 1));
            }
            if rows.is_empty() {
                break;
            }
            self.dctx
                .decode(&mut batch)
                .map_err(|e| TierError::Decode(e.to_string()))?;
            for (i, row) in rows {
                let d = argmax(self.dctx.get_logits_ith(row));
                seqs[i].drafts.push(d);
            }
        }
        Ok(())
    }

    /// One target batch: per sequence its last accepted token and its drafts.
    fn verify_round(&mut self, seqs: &mut [Seq]) -> Result<(), TierError> {
        let rows_total: usize = seqs
            .iter()
            .filter(|s| !s.done)
            .map(|s| s.drafts.len() + 1)
            .sum();
        let mut batch = LlamaBatch::new(rows_total.max(1), 1);
        let mut spans = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            if s.done {
                continue;
            }
            let first = batch.n_tokens();
            let toks = std::iter::once(s.last).chain(s.drafts.iter().copied());
            for (j, t) in toks.enumerate() {
                batch
                    .add(LlamaToken(t), (s.pos + j) as i32, &[i as i32], true)
                    .map_err(|e| TierError::Decode(e.to_string()))?;
            }
            spans.push((i, first));
        }
        if spans.is_empty() {
            return Ok(());
        }
        self.tctx
            .decode(&mut batch)
            .map_err(|e| TierError::Decode(e.to_string()))?;
        for (i, first) in spans {
            let k = seqs[i].drafts.len();
            let mut accepted = 0;
            let mut next = 0;
            for j in 0..=k {
                let t = argmax(self.tctx.get_logits_ith(first + j as i32));
                if j < k && seqs[i].drafts[j] == t {
                    accepted += 1;
                } else {
                    next = t;
                    break;
                }
            }
            let s = &mut seqs[i];
            s.out.rounds += 1;
            s.out.drafted += k;
            s.out.accepted += accepted;
            // New tokens: the accepted drafts, then the target's own next token.
            let mut new: Vec<i32> = s.drafts[..accepted].to_vec();
            new.push(next);
            for &t in &new {
                s.out.tokens.push(t);
                if self.target.vocab().is_eog(LlamaToken(t)) || s.out.tokens.len() >= s.max_tokens {
                    break;
                }
            }
            // Target KV now holds `last` and the accepted drafts; drop the rejected rest.
            let kept = s.pos + 1 + accepted;
            let _ = self
                .tctx
                .clear_kv_cache_seq(Some(i as u32), Some(kept as u32), None);
            // The draft holds `last` and drafts[..k-1]; keep what was accepted.
            let dkept = kept.min(s.pos + k);
            let _ = self
                .dctx
                .clear_kv_cache_seq(Some(i as u32), Some(dkept as u32), None);
            s.draft_feed = if accepted == k {
                vec![s.drafts[k - 1], next]
            } else {
                vec![next]
            };
            s.pos = kept;
            s.last = next;
            s.k = next_k(s.k, k, accepted, self.cfg.k_min, self.cfg.k_max);
            self.finish_if_done(s);
        }
        Ok(())
    }
}

/// Plain greedy decoding of one prompt on one model, one token per decode (the
/// reference speculative decoding must reproduce).
pub fn greedy(
    model: &LlamaModel,
    prompt: &[i32],
    max_tokens: usize,
    threads: i32,
) -> Result<Vec<i32>, TierError> {
    greedy_timed(model, prompt, max_tokens, threads).map(|o| o.tokens)
}

/// [`greedy`] with its prefill and decode times (`drafted`/`accepted` stay 0).
pub fn greedy_timed(
    model: &LlamaModel,
    prompt: &[i32],
    max_tokens: usize,
    threads: i32,
) -> Result<SpecOutput, TierError> {
    let cfg = SpecConfig {
        threads,
        n_seq_max: 1,
        ..Default::default()
    };
    let mut ctx = context(model, &cfg)?;
    let mut batch = LlamaBatch::new(prompt.len().max(1), 1);
    for (j, &t) in prompt.iter().enumerate() {
        batch
            .add(LlamaToken(t), j as i32, &[0], j + 1 == prompt.len())
            .map_err(|e| TierError::Decode(e.to_string()))?;
    }
    let t0 = std::time::Instant::now();
    ctx.decode(&mut batch)
        .map_err(|e| TierError::Decode(e.to_string()))?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let t1 = std::time::Instant::now();
    let mut out = Vec::new();
    let mut pos = prompt.len();
    loop {
        let t = argmax(ctx.get_logits_ith(batch.n_tokens() - 1));
        out.push(t);
        if model.vocab().is_eog(LlamaToken(t)) || out.len() >= max_tokens {
            return Ok(SpecOutput {
                tokens: out,
                prefill_s,
                decode_s: t1.elapsed().as_secs_f64(),
                ..Default::default()
            });
        }
        batch.clear();
        batch
            .add(LlamaToken(t), pos as i32, &[0], true)
            .map_err(|e| TierError::Decode(e.to_string()))?;
        pos += 1;
        ctx.decode(&mut batch)
            .map_err(|e| TierError::Decode(e.to_string()))?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn k_grows_after_full_acceptance_and_shrinks_after_poor_rounds() {
        assert_eq!(next_k(4, 4, 4, 1, 12), 5);
        assert_eq!(next_k(12, 12, 12, 1, 12), 12);
        assert_eq!(next_k(4, 4, 2, 1, 12), 4);
        assert_eq!(next_k(4, 4, 1, 1, 12), 3);
        assert_eq!(next_k(1, 1, 0, 1, 12), 1);
        assert_eq!(
            next_k(4, 0, 0, 1, 12),
            4,
            "a round without drafts changes nothing"
        );
    }

    #[test]
    fn drafts_stay_within_budget_and_cells() {
        assert_eq!(draft_len(4, 100, 100), 4);
        assert_eq!(
            draft_len(4, 3, 100),
            2,
            "the target's own token needs one of the 3"
        );
        assert_eq!(draft_len(4, 1, 100), 0);
        assert_eq!(draft_len(4, 0, 100), 0);
        assert_eq!(draft_len(4, 100, 2), 2);
    }

    /// A small deterministic generator for the Monte Carlo checks (splitmix64).
    fn uniform(state: &mut u64) -> f32 {
        *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
    }

    fn draw(dist: &[(i32, f32)], u: f32) -> i32 {
        let mut left = u;
        for &(t, w) in dist {
            if left < w {
                return t;
            }
            left -= w;
        }
        dist.last().unwrap().0
    }

    /// Runs `n` draft-then-verify trials; returns each token's frequency and the share kept.
    fn trials(p: &[(i32, f32)], q: &[(i32, f32)], n: usize) -> (Vec<(i32, f64)>, f64) {
        let mut rng = 7u64;
        let mut counts = std::collections::BTreeMap::new();
        let mut kept = 0;
        for _ in 0..n {
            let x = draw(q, uniform(&mut rng));
            let (t, hit) = accept_sampled(p, q, x, uniform(&mut rng), uniform(&mut rng));
            *counts.entry(t).or_insert(0usize) += 1;
            kept += hit as usize;
        }
        let freq = counts
            .into_iter()
            .map(|(t, c)| (t, c as f64 / n as f64))
            .collect();
        (freq, kept as f64 / n as f64)
    }

    #[test]
    fn sampled_acceptance_emits_the_targets_distribution() {
        // The draft misses token 4, gives mass to token 9 the target never says, and
        // disagrees on the rest; the target's list is unsorted.
        let p = [(3, 0.1), (1, 0.5), (2, 0.2), (4, 0.2)];
        let q = [(1, 0.3), (2, 0.4), (3, 0.1), (9, 0.2)];
        let n = 200_000;
        let (freq, kept) = trials(&p, &q, n);
        for &(t, want) in &p {
            let got = freq.iter().find(|e| e.0 == t).map_or(0.0, |e| e.1);
            assert!(
                (got - want as f64).abs() < 0.005,
                "token {t}: {got} vs {want}"
            );
        }
        assert!(
            freq.iter().all(|e| e.0 != 9),
            "a token the target gives no mass is never emitted"
        );
        // Kept with probability sum min(p, q) = 0.3 + 0.2 + 0.1 = 0.6; exact match would keep
        // sum p * q = 0.15 + 0.08 + 0.01 = 0.24.
        assert!((kept - 0.6).abs() < 0.005, "kept {kept}");
    }

    #[test]
    fn sampled_acceptance_keeps_every_draft_when_the_models_agree() {
        let p = [(5, 0.7), (6, 0.3)];
        let (freq, kept) = trials(&p, &p, 20_000);
        assert_eq!(kept, 1.0);
        assert!((freq[0].1 - 0.7).abs() < 0.01, "{freq:?}");
        // A one-hot target (greedy after top-k 1, or a grammar leaving one token) keeps
        // the draft only when it is that token.
        assert_eq!(
            accept_sampled(&[(5, 1.0)], &[(5, 0.5), (6, 0.5)], 6, 0.0, 0.9),
            (5, false)
        );
        assert_eq!(
            accept_sampled(&[(5, 1.0)], &[(5, 0.5), (6, 0.5)], 5, 0.99, 0.9),
            (5, true)
        );
    }
}
