//! What goes into the next llama.cpp batch. Pure logic, no model.
//!
//! Every running (decoding) sequence contributes its one pending token, so
//! decodes never wait behind a prompt. The rest of the batch budget goes to
//! prompt chunks of prefilling sequences, oldest first. Chunk boundaries are
//! fixed per sequence (`prefill_chunk` tokens from the start of the prompt):
//! a chunk that does not fit this step waits whole for the next one, so a
//! sequence is computed the same way whatever else shares the batch.

/// What the planner needs to know about one occupied slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotView {
    /// Slot index.
    pub slot: usize,
    /// Admission order (smaller = older).
    pub age: u64,
    /// Prompt tokens already in the KV cache.
    pub prefilled: usize,
    /// Prompt length.
    pub prompt_len: usize,
    /// Whether a sampled token waits to be fed (prompt fully prefilled).
    pub decoding: bool,
}

/// One unit of work in the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// Feed the slot's pending token and compute its logits.
    Decode {
        /// Slot index.
        slot: usize,
    },
    /// Feed prompt tokens `start..start + len`; logits only when `last`.
    Prefill {
        /// Slot index.
        slot: usize,
        /// First prompt token of the chunk.
        start: usize,
        /// Number of tokens.
        len: usize,
        /// Whether this chunk ends the prompt (its last token gets logits).
        last: bool,
    },
}

/// Plans one step. `n_batch` must be at least the number of decoding slots plus `chunk`.
pub fn plan_step(slots: &[SlotView], n_batch: usize, chunk: usize) -> Vec<Work> {
    let mut work: Vec<Work> = slots
        .iter()
        .filter(|s| s.decoding)
        .map(|s| Work::Decode { slot: s.slot })
        .collect();
    let mut budget = n_batch.saturating_sub(work.len());
    let mut prefilling: Vec<&SlotView> = slots
        .iter()
        .filter(|s| !s.decoding && s.prefilled < s.prompt_len)
        .collect();
    prefilling.sort_by_key(|s| s.age);
    for s in prefilling {
        let len = chunk.min(s.prompt_len - s.prefilled);
        if len > budget {
            continue;
        }
        budget -= len;
        work.push(Work::Prefill {
            slot: s.slot,
            start: s.prefilled,
            len,
            last: s.prefilled + len == s.prompt_len,
        });
    }
    work
}

/// Tokens a request reserves in the shared KV cache: prompt plus completion, capped by the
/// per-sequence limit.
pub fn reservation(prompt_len: usize, max_tokens: usize, max_seq_len: usize) -> usize {
    (prompt_len + max_tokens).min(max_seq_len)
}

/// A finished sequence's KV kept in a slot on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kept {
    /// The slot holding it.
    pub slot: usize,
    /// Tokens (KV cells) it holds.
    pub tokens: usize,
    /// When it was last used (larger is later).
    pub used: u64,
}

/// The slots whose kept KV leaves the device so that what stays holds at most `budget`
/// tokens: least recently used first, and no more than needed.
pub fn over_keep_budget(kept: &[Kept], budget: usize) -> Vec<usize> {
    let mut total: usize = kept.iter().map(|k| k.tokens).sum();
    let mut order: Vec<&Kept> = kept.iter().collect();
    order.sort_by_key(|k| k.used);
    let mut out = Vec::new();
    for k in order {
        if total <= budget {
            break;
        }
        total -= k.tokens;
        out.push(k.slot);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(
        slot: usize,
        age: u64,
        prefilled: usize,
        prompt_len: usize,
        decoding: bool,
    ) -> SlotView {
        SlotView {
            slot,
            age,
            prefilled,
            prompt_len,
            decoding,
        }
    }

    #[test]
    fn kept_kv_over_the_budget_leaves_least_recently_used_first() {
        let k = |slot, tokens, used| Kept { slot, tokens, used };
        let kept = [k(0, 400, 7), k(1, 300, 2), k(2, 500, 9)];
        assert_eq!(over_keep_budget(&kept, 1200), Vec::<usize>::new());
        assert_eq!(over_keep_budget(&kept, 1000), vec![1]);
        assert_eq!(over_keep_budget(&kept, 800), vec![1, 0]);
        assert_eq!(over_keep_budget(&kept, 0), vec![1, 0, 2]);
        assert_eq!(over_keep_budget(&[], 0), Vec::<usize>::new());
    }

    #[test]
    fn decodes_always_fit_before_prefill() {
        let slots = [
            view(0, 5, 10, 10, true),
            view(1, 1, 0, 1000, false),
            view(2, 6, 3, 3, true),
        ];
        let w = plan_step(&slots, 300, 256);
        assert_eq!(w[0], Work::Decode { slot: 0 });
        assert_eq!(w[1], Work::Decode { slot: 2 });
        assert_eq!(
            w[2],
            Work::Prefill {
                slot: 1,
                start: 0,
                len: 256,
                last: false
            }
        );
        assert_eq!(w.len(), 3);
    }

    #[test]
    fn chunk_that_does_not_fit_waits_whole() {
        // Oldest prefiller takes 256; the next one's 256-token chunk does not fit in 44, but a
        // younger one with a short tail does.
        let slots = [
            view(0, 1, 0, 600, false),
            view(1, 2, 0, 600, false),
            view(2, 3, 0, 40, false),
        ];
        let w = plan_step(&slots, 300, 256);
        assert_eq!(
            w,
            vec![
                Work::Prefill {
                    slot: 0,
                    start: 0,
                    len: 256,
                    last: false
                },
                Work::Prefill {
                    slot: 2,
                    start: 0,
                    len: 40,
                    last: true
                },
            ]
        );
    }

    #[test]
    fn chunk_boundaries_do_not_depend_on_neighbours() {
        // Alone or with neighbours, slot 0's chunks start at multiples of the chunk size.
        let alone = plan_step(&[view(0, 1, 256, 600, false)], 512, 256);
        let crowded = plan_step(
            &[
                view(0, 1, 256, 600, false),
                view(1, 0, 0, 0, true),
                view(2, 0, 0, 0, true),
            ],
            512,
            256,
        );
        let pick = |w: &[Work]| {
            w.iter()
                .copied()
                .find(|x| matches!(x, Work::Prefill { slot: 0, .. }))
        };
        assert_eq!(pick(&alone), pick(&crowded));
        assert_eq!(
            pick(&alone),
            Some(Work::Prefill {
                slot: 0,
                start: 256,
                len: 256,
                last: false
            })
        );
    }

    #[test]
    fn last_chunk_is_marked() {
        let w = plan_step(&[view(0, 1, 512, 600, false)], 512, 256);
        assert_eq!(
            w,
            vec![Work::Prefill {
                slot: 0,
                start: 512,
                len: 88,
                last: true
            }]
        );
    }

    #[test]
    fn empty_when_nothing_to_do() {
        assert!(plan_step(&[], 512, 256).is_empty());
        assert!(plan_step(&[view(0, 0, 5, 5, false)], 512, 256).is_empty());
    }

    #[test]
    fn reservation_is_capped() {
        assert_eq!(reservation(100, 50, 2048), 150);
        assert_eq!(reservation(2000, 500, 2048), 2048);
    }
}
