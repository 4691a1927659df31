//! KV kept on the device between requests: what a free slot holds for the next prompt of
//! its cache scope, prefix copies between running sequences, the keep budget, and freeing.

use std::sync::atomic::Ordering;

use llama_cpp_2::context::LlamaContext;
use tracing::debug;

use super::batch::{Loop, Slot};
use crate::plan;

/// KV a finished sequence left in its slot: its tokens (prompt, then answer) at positions
/// `0..tokens.len()`, reusable by a request of the same cache scope.
pub(super) struct Resident {
    pub(super) tokens: Vec<i32>,
    /// Leading tokens of `tokens` the slot's draft KV holds too (0 without a draft).
    pub(super) draft: usize,
    pub(super) scope: String,
    /// Age stamp of its last use (lower = older, handed out first).
    pub(super) used: u64,
}

/// Drops sequence `seq`'s KV cells from position `from` on and returns the positions kept:
/// `from`, or 0 when the memory cannot drop a suffix (recurrent models), which then loses
/// them all.
pub(super) fn cut_seq(ctx: &mut LlamaContext<'_>, seq: usize, from: usize) -> usize {
    let cut = ctx
        .clear_kv_cache_seq(Some(seq as u32), Some(from as u32), None)
        .unwrap_or(false);
    if cut {
        from
    } else {
        let _ = ctx.clear_kv_cache_seq(Some(seq as u32), None, None);
        0
    }
}

/// Fewest more tokens a copy of another sequence's KV must give over what the slot holds
/// in place: with one KV stream per sequence the copy moves the whole stream (on a GPU a
/// device-to-device copy of microseconds, on a CPU a memcpy), so a few tokens are cheaper
/// to prefill.
pub(super) const MIN_COPY_GAIN: usize = 16;

/// Whether copying `shared` prompt tokens from another sequence beats the `in_place`
/// tokens the slot already holds.
pub(super) fn worth_copying(shared: usize, in_place: usize) -> bool {
    shared >= in_place + MIN_COPY_GAIN
}

/// Makes sequence `dst` hold the first `n` positions of sequence `src`. With one KV stream
/// per sequence (the only layout that keeps KV on the device between requests) llama.cpp
/// copies `src`'s whole stream at the start of the next decode, before that decode writes
/// anything, and `dst` is cut to `n`; `src`'s positions below `n` are prompt tokens it has
/// already decoded, so the copy sees them as they are now.
pub(super) fn copy_prefix(ctx: &mut LlamaContext<'_>, src: usize, dst: usize, n: usize) {
    let _ = ctx.clear_kv_cache_seq(Some(dst as u32), None, None);
    let _ = ctx.copy_kv_cache_seq(src as i32, dst as i32, None, None);
    let _ = ctx.clear_kv_cache_seq(Some(dst as u32), Some(n as u32), None);
}

/// Length of the common leading run of `a` and `b`.
pub(super) fn common_prefix(a: &[i32], b: &[i32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Tokens a slot's KV holds that are known to be its prompt followed by its output:
/// the prefilled prompt, and once generating, every emitted token but the last (which
/// is either not fed yet or, in a speculative round, may sit over a rejected draft).
pub(super) fn kept_tokens(prefilled: usize, prompt_len: usize, generated: usize) -> usize {
    if generated == 0 {
        prefilled
    } else {
        prompt_len + generated - 1
    }
}

impl<'m> Loop<'m> {
    /// Picks a free slot for a prompt (there is one): the one whose kept KV shares the
    /// longest prefix with it, else the one kept longest unused (empty ones first). Cuts
    /// the slot's KV (the target's and the draft's) to the shared part; returns the slot,
    /// the tokens kept in place (at most `prompt.len() - 1`: the last prompt token is
    /// always prefilled for its logits) and how many of them the draft's KV holds.
    pub(super) fn take_slot(&mut self, prompt: &[i32], scope: &str) -> (usize, usize, usize) {
        let limit = prompt.len().saturating_sub(1);
        let mut best: Option<(usize, usize, u64)> = None;
        for (i, slot) in self.slots.iter().enumerate() {
            if slot.is_some() {
                continue;
            }
            let (shared, used) = match &self.resident[i] {
                Some(r) if r.scope == scope => {
                    (common_prefix(&r.tokens, prompt).min(limit), r.used + 1)
                }
                Some(r) => (0, r.used + 1),
                None => (0, 0),
            };
            if best.is_none_or(|(_, m, u)| shared > m || (shared == m && used < u)) {
                best = Some((i, shared, used));
            }
        }
        let (slot, mut shared, _) = best.expect("admit checked for a free slot");
        let mut draft_shared = 0;
        if let Some(r) = self.resident[slot].take() {
            shared = cut_seq(&mut self.ctx, slot, shared);
            let dropped = r.tokens.len().saturating_sub(shared);
            self.stats
                .resident_dropped_tokens
                .fetch_add(dropped as u64, Ordering::Relaxed);
            if let Some(d) = &mut self.draft {
                draft_shared = cut_seq(&mut d.ctx, slot, shared.min(r.draft));
            }
        }
        (slot, shared, draft_shared)
    }

    /// The running sequence whose KV holds the longest prefix of `prompt` (same cache scope,
    /// prompt positions already decoded) and how many tokens of it, when copying them into
    /// slot `dst` beats what `dst` holds in place ([`worth_copying`]). None when KV is not
    /// kept on the device between sequences (`keep_resident` off, or a unified KV cache) and
    /// for models whose memory cannot be cut after a copy (recurrent, hybrid).
    pub(super) fn copy_source(
        &self,
        dst: usize,
        prompt: &[i32],
        scope: &str,
        in_place: usize,
    ) -> Option<(usize, usize)> {
        if !self.keep_resident || self.recurrent {
            return None;
        }
        let limit = prompt.len().saturating_sub(1);
        let (src, n) = self
            .slots
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != dst)
            .filter_map(|(i, s)| {
                let s = s.as_ref()?;
                if s.req.cache_scope != scope {
                    return None;
                }
                let held = &s.req.prompt[..s.prefilled.min(s.req.prompt.len())];
                Some((i, common_prefix(held, prompt).min(limit)))
            })
            .max_by_key(|&(i, n)| (n, std::cmp::Reverse(i)))?;
        worth_copying(n, in_place).then_some((src, n))
    }

    /// Drops kept KV from the device, least recently used first, until what stays fits the
    /// keep budget (`EngineConfig::keep_resident_mib`); its prompt pages, published when it
    /// was prefilled, bring it back from host RAM.
    pub(super) fn keep_within_budget(&mut self) {
        let Some(budget) = self.keep_budget else {
            return;
        };
        let kept: Vec<plan::Kept> = self
            .resident
            .iter()
            .enumerate()
            .filter_map(|(slot, r)| {
                r.as_ref().map(|r| plan::Kept {
                    slot,
                    tokens: r.tokens.len(),
                    used: r.used,
                })
            })
            .collect();
        for slot in plan::over_keep_budget(&kept, budget) {
            let tokens = self.resident[slot].as_ref().map_or(0, |r| r.tokens.len());
            self.forget(slot);
            self.stats
                .resident_dropped_tokens
                .fetch_add(tokens as u64, Ordering::Relaxed);
            debug!(
                slot,
                tokens, "kept KV left the device (over the keep budget)"
            );
        }
    }

    /// Forgets what a slot keeps (its KV state is not known to match its tokens).
    pub(super) fn forget(&mut self, slot: usize) {
        self.resident[slot] = None;
        let _ = self.ctx.clear_kv_cache_seq(Some(slot as u32), None, None);
        if let Some(d) = &mut self.draft {
            let _ = d.ctx.clear_kv_cache_seq(Some(slot as u32), None, None);
        }
    }

    /// Drops a slot's claim on the pages it was going to publish.
    pub(super) fn unpend(&mut self, slot: &Slot) {
        for id in slot.pages.pending() {
            if let Some(n) = self.pending.get_mut(id) {
                *n -= 1;
                if *n == 0 {
                    self.pending.remove(id);
                }
            }
        }
    }

    /// Removes a slot and releases its KV cells (or keeps them in the slot for the next
    /// request, `keep_resident`); returns it so the caller can still report.
    pub(super) fn free(&mut self, i: usize) -> Option<Slot> {
        let mut s = self.slots[i].take()?;
        // A sequence that ends at its first token publishes before its KV goes; its end is
        // reported once its pages are stored.
        self.publish(i, &mut s);
        self.unpend(&s);
        s.pages.clear_pending();
        if let Some(kv) = &self.kv {
            kv.wait(&s.pages);
        }
        let prompt_len = s.req.prompt.len();
        let keep = kept_tokens(s.prefilled, prompt_len, s.generated);
        let kept = self.keep_resident
            && keep > 0
            && self
                .ctx
                .clear_kv_cache_seq(Some(i as u32), Some(keep as u32), None)
                .unwrap_or(false);
        if kept {
            let mut tokens = s.req.prompt[..keep.min(prompt_len)].to_vec();
            tokens.extend_from_slice(&s.out[..keep.saturating_sub(prompt_len)]);
            // The draft keeps what it holds of those tokens for the slot's next request
            // (a conversation's next turn), past it only drafts, which go.
            let draft = match (&mut self.draft, &s.spec) {
                (Some(d), Some(sp)) => cut_seq(&mut d.ctx, i, sp.fed.min(keep)),
                _ => 0,
            };
            self.resident[i] = Some(Resident {
                tokens,
                draft,
                scope: s.req.cache_scope.clone(),
                used: self.next_age,
            });
            self.next_age += 1;
            self.keep_within_budget();
        } else {
            self.forget(i);
        }
        self.reserved -= s.reserve;
        self.stats
            .reserved_cells
            .fetch_sub(s.reserve, Ordering::Relaxed);
        self.stats.active.fetch_sub(1, Ordering::Relaxed);
        Some(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_copy_must_beat_the_tokens_held_in_place_by_a_margin() {
        assert!(worth_copying(MIN_COPY_GAIN, 0));
        assert!(!worth_copying(MIN_COPY_GAIN - 1, 0));
        assert!(worth_copying(500, 100));
        assert!(!worth_copying(100 + MIN_COPY_GAIN - 1, 100));
        assert!(!worth_copying(0, 0));
    }
}
