//! Stop strings over streamed text. Pure logic.
//!
//! Text that could still be the beginning of a stop string is held back, so a
//! client never sees part of a stop string; once a stop string appears,
//! everything before it is released and generation ends.

/// Incremental stop-string matcher for one sequence.
#[derive(Debug, Default, Clone)]
pub struct StopMatcher {
    /// The non-empty stop strings, with their index in the list given to [`Self::new`].
    stops: Vec<(usize, String)>,
    held: String,
    matched: Option<usize>,
}

/// Result of feeding text.
#[derive(Debug, PartialEq, Eq)]
pub struct Fed {
    /// Text that can be released to the client now.
    pub release: String,
    /// A stop string was found; nothing after it is released.
    pub stopped: bool,
}

impl StopMatcher {
    /// A matcher for these stop strings (empty strings are ignored).
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops
                .iter()
                .enumerate()
                .filter(|(_, s)| !s.is_empty())
                .map(|(i, s)| (i, s.clone()))
                .collect(),
            held: String::new(),
            matched: None,
        }
    }

    /// Feeds newly generated text.
    pub fn feed(&mut self, text: &str) -> Fed {
        if self.stops.is_empty() {
            return Fed {
                release: text.to_owned(),
                stopped: false,
            };
        }
        self.held.push_str(text);
        if let Some((at, i)) = self
            .stops
            .iter()
            .filter_map(|(i, s)| self.held.find(s.as_str()).map(|at| (at, *i)))
            .min()
        {
            let release = self.held[..at].to_owned();
            self.held.clear();
            self.matched = Some(i);
            return Fed {
                release,
                stopped: true,
            };
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let keep = self
            .stops
            .iter()
            .map(|(_, s)| longest_suffix_prefix(&self.held, s))
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let release = self.held[..cut].to_owned();
        self.held.drain(..cut);
        Fed {
            release,
            stopped: false,
        }
    }

    /// The index (in the list given to [`Self::new`]) of the stop string that ended the
    /// text, once one has.
    pub fn matched(&self) -> Option<usize> {
        self.matched
    }

    /// Releases whatever is held (generation ended for another reason).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    let max = stop.len().saturating_sub(1).min(text.len());
    (1..=max)
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && stop.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(stops: &[&str]) -> StopMatcher {
        StopMatcher::new(&stops.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn passes_through_without_stops() {
        let mut s = m(&[]);
        assert_eq!(
            s.feed("abc"),
            Fed {
                release: "abc".into(),
                stopped: false
            }
        );
    }

    #[test]
    fn stop_split_over_tokens() {
        let mut s = m(&["END"]);
        assert_eq!(
            s.feed("hello E"),
            Fed {
                release: "hello ".into(),
                stopped: false
            }
        );
        assert_eq!(
            s.feed("N"),
            Fed {
                release: "".into(),
                stopped: false
            }
        );
        assert_eq!(
            s.feed("D and more"),
            Fed {
                release: "".into(),
                stopped: true
            }
        );
    }

    #[test]
    fn false_start_is_released() {
        let mut s = m(&["END"]);
        assert_eq!(
            s.feed("EN"),
            Fed {
                release: "".into(),
                stopped: false
            }
        );
        assert_eq!(
            s.feed("x"),
            Fed {
                release: "ENx".into(),
                stopped: false
            }
        );
    }

    #[test]
    fn earliest_stop_wins() {
        let mut s = m(&["cd", "b"]);
        assert_eq!(
            s.feed("abcd"),
            Fed {
                release: "a".into(),
                stopped: true
            }
        );
    }

    #[test]
    fn the_matched_stop_is_named_by_its_index_in_the_request() {
        let mut s = StopMatcher::new(&["".into(), "cd".into(), "b".into()]);
        assert_eq!(s.matched(), None);
        s.feed("abcd");
        assert_eq!(s.matched(), Some(2));
    }

    #[test]
    fn flush_returns_held_text() {
        let mut s = m(&["###"]);
        assert_eq!(s.feed("a##").release, "a");
        assert_eq!(s.flush(), "##");
    }

    #[test]
    fn multibyte_text_is_not_split() {
        let mut s = m(&["éx"]);
        assert_eq!(
            s.feed("café"),
            Fed {
                release: "caf".into(),
                stopped: false
            }
        );
        assert_eq!(
            s.feed("!"),
            Fed {
                release: "é!".into(),
                stopped: false
            }
        );
    }
}
