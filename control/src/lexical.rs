//! BM25 over tool texts: the lexical half of the router's hybrid re-rank.
//!
//! Tool names are identifiers (`Movies_1_FindMovies`, `get_current_weather`,
//! `uber.ride`), so [`terms`] splits snake_case, camelCase, dots and letter/digit
//! boundaries before lowercasing; a light suffix stemmer folds plurals and `-ing`/`-ed`
//! so "tickets" meets "ticket". Documents are weighted bags of terms (a name term counts
//! more than a description term); an inverted index scores only the documents that
//! share a term with the query.

use std::collections::HashMap;

/// English function words and request filler that carry no tool identity.
const STOPWORDS: &[&str] = &[
    "a", "about", "all", "also", "am", "an", "and", "any", "are", "as", "at", "be", "been", "but",
    "by", "can", "could", "do", "does", "for", "from", "give", "has", "have", "he", "her", "his",
    "how", "i", "if", "in", "into", "is", "it", "its", "just", "let", "like", "me", "my", "need",
    "no", "not", "now", "of", "on", "or", "our", "please", "she", "should", "so", "some", "such",
    "than", "that", "the", "their", "them", "then", "there", "these", "they", "this", "those",
    "to", "us", "use", "using", "was", "we", "were", "what", "when", "where", "which", "who",
    "will", "with", "would", "you", "your",
];

/// Lowercased, stemmed terms of `text`, stopwords and one-letter terms dropped.
pub fn terms(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for word in text.split(|c: char| !c.is_alphanumeric()) {
        for piece in split_identifier(word) {
            let lower = piece.to_lowercase();
            if lower.chars().count() < 2 || STOPWORDS.binary_search(&lower.as_str()).is_ok() {
                continue;
            }
            out.push(stem(lower));
        }
    }
    out
}

/// Splits at lower→upper (`findMovies`), at the last capital of an acronym before a
/// lowercase letter (`HTTPServer` → `HTTP`, `Server`) and at letter/digit boundaries.
fn split_identifier(word: &str) -> Vec<&str> {
    let chars: Vec<(usize, char)> = word.char_indices().collect();
    let mut pieces = Vec::new();
    let mut start = 0;
    for i in 1..chars.len() {
        let (prev, cur) = (chars[i - 1].1, chars[i].1);
        let next_lower = chars.get(i + 1).is_some_and(|c| c.1.is_lowercase());
        let boundary = (prev.is_lowercase() && cur.is_uppercase())
            || (prev.is_uppercase() && cur.is_uppercase() && next_lower)
            || (prev.is_alphabetic() && cur.is_numeric())
            || (prev.is_numeric() && cur.is_alphabetic());
        if boundary {
            pieces.push(&word[start..chars[i].0]);
            start = chars[i].0;
        }
    }
    if start < word.len() {
        pieces.push(&word[start..]);
    }
    pieces
}

/// A few suffix rules, applied identically to tools and queries: `-ies`→`-y`, plural
/// `-s`, `-ing`, `-ed`. Over-stemming is harmless as long as both sides agree.
fn stem(mut w: String) -> String {
    let n = w.len();
    if !w.is_ascii() {
        return w;
    }
    if n > 4 && w.ends_with("ies") {
        w.truncate(n - 3);
        w.push('y');
    } else if n > 5 && w.ends_with("ing") {
        w.truncate(n - 3);
    } else if n > 4 && w.ends_with("ed") {
        w.truncate(n - 2);
    } else if n > 3 && w.ends_with('s') && !w.ends_with("ss") && !w.ends_with("us") {
        w.truncate(n - 1);
    }
    w
}

/// BM25 parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bm25 {
    /// Term-frequency saturation (1.2 is the usual choice).
    pub k1: f32,
    /// Length normalisation, 0 (none) to 1 (full); 0.75 is the usual choice.
    pub b: f32,
}

impl Default for Bm25 {
    fn default() -> Self {
        Self { k1: 1.2, b: 0.75 }
    }
}

/// An inverted index with precomputed BM25 weights.
#[derive(Clone, Debug, Default)]
pub struct LexicalIndex {
    vocab: HashMap<String, u32>,
    /// Per term: (document, BM25 weight including idf).
    postings: Vec<Vec<(u32, f32)>>,
    /// Per term: idf × (k1 + 1), the most one term can add to any document.
    ceiling: Vec<f32>,
    n_docs: usize,
}

impl LexicalIndex {
    /// Indexes documents given as weighted terms (a term listed twice adds its weights).
    pub fn build(docs: &[Vec<(String, f32)>], params: Bm25) -> Self {
        let n_docs = docs.len();
        let mut vocab: HashMap<String, u32> = HashMap::new();
        let mut tf: Vec<Vec<(u32, f32)>> = Vec::new();
        let mut lens = Vec::with_capacity(n_docs);
        for (d, doc) in docs.iter().enumerate() {
            let mut local: HashMap<u32, f32> = HashMap::new();
            let mut len = 0.0;
            for (term, w) in doc {
                let next = u32::try_from(vocab.len()).expect("fewer than 2^32 terms");
                let t = *vocab.entry(term.clone()).or_insert(next);
                if t as usize == tf.len() {
                    tf.push(Vec::new());
                }
                *local.entry(t).or_default() += w;
                len += w;
            }
            let d = u32::try_from(d).expect("fewer than 2^32 documents");
            for (t, f) in local {
                tf[t as usize].push((d, f));
            }
            lens.push(len);
        }
        let avg = (lens.iter().sum::<f32>() / n_docs.max(1) as f32).max(f32::EPSILON);
        let mut ceiling = Vec::with_capacity(tf.len());
        let postings = tf
            .into_iter()
            .map(|mut list| {
                list.sort_by_key(|p| p.0);
                let df = list.len() as f32;
                let idf = (1.0 + (n_docs as f32 - df + 0.5) / (df + 0.5)).ln();
                ceiling.push(idf * (params.k1 + 1.0));
                list.into_iter()
                    .map(|(d, f)| {
                        let norm = params.k1 * (1.0 - params.b + params.b * lens[d as usize] / avg);
                        (d, idf * f * (params.k1 + 1.0) / (f + norm))
                    })
                    .collect()
            })
            .collect();
        Self {
            vocab,
            postings,
            ceiling,
            n_docs,
        }
    }

    /// Number of documents.
    pub fn len(&self) -> usize {
        self.n_docs
    }

    /// Whether there are no documents.
    pub fn is_empty(&self) -> bool {
        self.n_docs == 0
    }

    /// Term ids of the query terms the index knows, each once.
    pub fn query(&self, terms: &[String]) -> Vec<u32> {
        let mut ids: Vec<u32> = terms
            .iter()
            .filter_map(|t| self.vocab.get(t).copied())
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Adds every document's BM25 score for `query` into `scores` (length `len()`).
    pub fn score_into(&self, query: &[u32], scores: &mut [f32]) {
        debug_assert_eq!(scores.len(), self.n_docs);
        for &t in query {
            for &(d, w) in &self.postings[t as usize] {
                scores[d as usize] += w;
            }
        }
    }

    /// The highest score any document could reach for `query` (each term at saturation).
    pub fn ceiling(&self, query: &[u32]) -> f32 {
        query.iter().map(|&t| self.ceiling[t as usize]).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stopwords_are_sorted_for_binary_search() {
        assert!(STOPWORDS.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn identifiers_split_into_words() {
        assert_eq!(terms("Movies_1_FindMovies"), vec!["movy", "find", "movy"]);
        assert_eq!(
            terms("HTTPServer.getStatus2"),
            vec!["http", "server", "get", "status"]
        );
        assert_eq!(terms("uber.ride"), vec!["uber", "ride"]);
        assert_eq!(terms("Can you book the tickets?"), vec!["book", "ticket"]);
        assert_eq!(terms("booking booked books"), vec!["book", "book", "book"]);
    }

    #[test]
    fn bm25_prefers_the_document_with_the_rare_shared_term() {
        let doc = |s: &str| terms(s).into_iter().map(|t| (t, 1.0)).collect::<Vec<_>>();
        let docs = vec![
            doc("get weather forecast for a city"),
            doc("get stock price for a ticker"),
            doc("get the time for a city"),
        ];
        let index = LexicalIndex::build(&docs, Bm25::default());
        let q = index.query(&terms("What's the weather forecast in Lima?"));
        let mut scores = vec![0.0; 3];
        index.score_into(&q, &mut scores);
        assert!(scores[0] > 0.0 && scores[1] == 0.0 && scores[2] == 0.0);
        assert!(scores[0] <= index.ceiling(&q));
        // "city" is shared by two documents, "get" by all three: lower idf.
        let q = index.query(&terms("city get"));
        let mut scores = vec![0.0; 3];
        index.score_into(&q, &mut scores);
        assert!(scores[0] > 0.0 && scores[2] > 0.0 && scores[1] > 0.0);
        assert!(scores[1] < scores[0]);
        assert!(index.query(&terms("unknown words only")).is_empty());
    }
}
