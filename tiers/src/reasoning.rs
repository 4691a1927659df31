//! The reasoning governor's view of a sequence: whether it is inside its think span
//! (`<think>` .. `</think>`), how many tokens it has spent there, and which token closes the
//! span when the budget is spent.
//!
//! Markers are matched on text, not token ids, so the governor works whether a vocabulary
//! holds each marker as one token (Qwen3, QwQ, DeepSeek-R1) or spells it in several
//! (Qwen2.5 writes `</think>` as `</`, `think`, `>`), and however the model split the marker
//! when it wrote it. Closing writes the marker's own tokenization, one token per step.

/// A sequence's place relative to its think span.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpanState {
    /// Inside the span.
    pub thinking: bool,
    /// Tokens generated inside the span (a multi-token close marker's leading pieces count).
    pub tokens: usize,
    /// The end of the text seen so far, long enough to find a marker split across tokens.
    tail: String,
}

impl SpanState {
    /// A sequence's state before its first token: inside the span when its prompt opened
    /// it (templates such as QwQ's and DeepSeek-R1's end with `<think>`).
    pub fn new(thinking: bool) -> Self {
        Self {
            thinking,
            ..Self::default()
        }
    }

    /// Takes one generated token's text. A token inside the span counts unless it completes
    /// the close marker; the span opens when a token completes the open marker.
    pub fn push(&mut self, piece: &str, open: &str, close: &str) {
        let seen = self.tail.len();
        self.tail.push_str(piece);
        let marker = if self.thinking { close } else { open };
        // Only a marker that ends in this piece is new: the search starts where one could
        // begin and still reach the piece (the tail never holds a marker already seen).
        let mut start = seen.saturating_sub(marker.len().saturating_sub(1));
        while !self.tail.is_char_boundary(start) {
            start -= 1;
        }
        let completed = self.tail[start..].contains(marker);
        if self.thinking {
            if completed {
                self.thinking = false;
            } else {
                self.tokens += 1;
            }
        } else if completed {
            self.thinking = true;
        }
        if completed {
            // Text before the marker cannot complete the next one.
            self.tail.clear();
        } else {
            let keep = open.len().max(close.len());
            let mut cut = self.tail.len().saturating_sub(keep);
            while !self.tail.is_char_boundary(cut) {
                cut -= 1;
            }
            self.tail.drain(..cut);
        }
    }
}

/// Whether the budget is spent: the span's tokens, plus the close marker's tokens still to
/// write after the first, reach `budget`, so that the span closes at `budget` tokens.
pub fn budget_spent(state: &SpanState, budget: Option<usize>, close_len: usize) -> bool {
    state.thinking && budget.is_some_and(|b| state.tokens + close_len.saturating_sub(1) >= b)
}

/// The next token of the close marker `close` (its tokenization) after `out`: the marker's
/// first token, or the one after the longest start of it that `out` already ends with.
pub fn next_close_token(out: &[i32], close: &[i32]) -> i32 {
    let done = (1..close.len())
        .rev()
        .find(|&k| out.ends_with(&close[..k]))
        .unwrap_or(0);
    close[done]
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPEN: &str = "<think>";
    const CLOSE: &str = "</think>";

    fn feed(s: &mut SpanState, pieces: &[&str]) {
        for p in pieces {
            s.push(p, OPEN, CLOSE);
        }
    }

    #[test]
    fn a_prompt_that_opened_the_span_counts_from_the_first_token() {
        let mut s = SpanState::new(true);
        feed(&mut s, &["so", "</think>", "x"]);
        assert_eq!(s.tokens, 1);
        assert!(!s.thinking);
    }

    #[test]
    fn a_marker_split_over_tokens_opens_and_closes_the_span() {
        let mut s = SpanState::default();
        feed(&mut s, &["<", "think", ">"]);
        assert!(s.thinking);
        assert_eq!(s.tokens, 0);
        feed(&mut s, &["let", " me", " see"]);
        assert_eq!(s.tokens, 3);
        feed(&mut s, &["</", "think", ">"]);
        assert!(!s.thinking);
        // `</` and `think` were written inside the span.
        assert_eq!(s.tokens, 5);
        feed(&mut s, &["answer"]);
        assert_eq!(s.tokens, 5);
    }

    #[test]
    fn one_token_markers_count_as_they_did() {
        let mut s = SpanState::default();
        feed(&mut s, &["<think>", "a", "b", "</think>", "c"]);
        assert!(!s.thinking);
        assert_eq!(s.tokens, 2);
    }

    #[test]
    fn a_marker_glued_to_other_text_is_found() {
        let mut s = SpanState::default();
        feed(&mut s, &["ok<th", "ink>\n", "so", ".</", "think>done"]);
        assert!(!s.thinking);
        assert_eq!(s.tokens, 2);
    }

    #[test]
    fn a_second_span_opens_after_the_first_closed() {
        let mut s = SpanState::default();
        feed(&mut s, &["<think>", "a", "</think>", "x", "<think>"]);
        assert!(s.thinking);
    }

    #[test]
    fn text_outside_the_span_is_not_counted() {
        let mut s = SpanState::default();
        feed(&mut s, &["just", " an", " answer", " with", " </think>"]);
        assert!(!s.thinking);
        assert_eq!(s.tokens, 0);
    }

    #[test]
    fn multibyte_text_keeps_the_tail_on_a_char_boundary() {
        let mut s = SpanState::new(true);
        feed(&mut s, &["ééééééééééé", "思考中", "</think>"]);
        assert!(!s.thinking);
        assert_eq!(s.tokens, 2);
    }

    #[test]
    fn the_budget_leaves_room_for_a_multi_token_close() {
        let mut s = SpanState::new(true);
        feed(&mut s, &["a"; 7]);
        assert!(!budget_spent(&s, Some(10), 3));
        feed(&mut s, &["a"]);
        assert!(budget_spent(&s, Some(10), 3));
        assert!(!budget_spent(&s, None, 3));
        // A one-token close spends the whole budget on thinking.
        assert!(!budget_spent(&s, Some(9), 1));
        assert!(budget_spent(&s, Some(8), 1));
    }

    #[test]
    fn no_budget_is_spent_outside_the_span() {
        assert!(!budget_spent(&SpanState::default(), Some(0), 1));
    }

    #[test]
    fn the_close_marker_is_written_from_where_the_sequence_stands() {
        let close = [10, 11, 12];
        assert_eq!(next_close_token(&[1, 2], &close), 10);
        assert_eq!(next_close_token(&[1, 10], &close), 11);
        assert_eq!(next_close_token(&[1, 10, 11], &close), 12);
        assert_eq!(next_close_token(&[5], &[99]), 99);
    }
}
