//! The semantic tool router: which of a catalog's tools to offer the model for one
//! request.
//!
//! ```text
//!  build:  tool ──tool_text()──▶ Embedder (cached) ──▶ VectorIndex (exact, or int8 + re-rank
//!                                                       above `quantize_above` tools)
//!          tool ──weighted terms──▶ LexicalIndex (BM25)
//!
//!  route:  intent ──embed──▶ dense top-`candidates` ──▶ confidence = (top1, top1 − top2)
//!            │ confident: keep the dense order
//!            │ top1 < min_score or margin < min_margin:
//!            └─▶ hybrid: candidates ∪ BM25 top-`candidates`,
//!                score = (1 − w)·cosine + w·BM25/BM25_max          (w = hybrid_weight)
//!          forced tools (tool_choice, or a tool named verbatim in the intent) go first,
//!          the best others fill up to k.
//! ```
//!
//! Everything after the query embedding is plain synchronous code
//! ([`ToolRouter::route_vector`]), tested without a model.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::embed::Embedder;
use crate::index::{FlatIndex, Hit, QuantizedIndex, TopK, VectorIndex};
use crate::lexical::{self, Bm25, LexicalIndex};
use crate::ControlError;

/// One tool of a catalog, as in OpenAI's `tools[].function`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Tool {
    /// Unique name within the catalog.
    pub name: String,
    /// What the tool does.
    #[serde(default)]
    pub description: String,
    /// JSON Schema of the arguments (`{"type":"object","properties":{…}}`).
    #[serde(default)]
    pub parameters: Value,
}

impl Tool {
    /// Reads an OpenAI tool (`{"type":"function","function":{…}}`) or a bare function
    /// object; `None` without a string `name`.
    pub fn from_openai(value: &Value) -> Option<Self> {
        let f = value.get("function").unwrap_or(value);
        Some(Self {
            name: f.get("name")?.as_str()?.to_owned(),
            description: f
                .get("description")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
            parameters: f.get("parameters").cloned().unwrap_or(Value::Null),
        })
    }

    /// The OpenAI `tools[]` entry: what the prompt carries when the tool is offered.
    pub fn to_openai(&self) -> Value {
        serde_json::json!({
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            }
        })
    }

    /// Top-level parameters: `(name, description)`, in schema order.
    pub fn parameters(&self) -> impl Iterator<Item = (&str, &str)> {
        self.parameters
            .get("properties")
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
            .map(|(name, schema)| {
                let desc = schema
                    .get("description")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                (name.as_str(), desc)
            })
    }
}

/// The tool named by an OpenAI `tool_choice` (`{"type":"function","function":{"name":…}}`
/// or `{"type":"function","name":…}`); `None` for `"auto"`, `"none"`, `"required"`.
pub fn forced_tool(tool_choice: &Value) -> Option<&str> {
    tool_choice
        .get("function")
        .and_then(|f| f.get("name"))
        .or_else(|| tool_choice.get("name"))
        .and_then(Value::as_str)
}

/// The order in which a step of a conversation lists its routed tools in the prompt.
///
/// `kept`: the tools the conversation's previous step listed, in that step's order (only
/// those the request still offers); `routed`: this step's own tools (the router's choice plus
/// the called and forced ones), in the request's order. The previous step's tools stay
/// first, in their order, and this step's new ones follow: the step's prompt then starts with
/// the previous step's tool list and reuses its KV (a list that changes at every step sends
/// each step's prompt to prefill from its first tool). When that would list more than
/// `cap` tools, the step starts over from `routed` alone.
pub fn listing_order(kept: &[String], routed: &[String], cap: usize) -> Vec<String> {
    let mut order: Vec<String> = Vec::with_capacity(kept.len() + routed.len());
    for n in kept.iter().chain(routed) {
        if !order.contains(n) {
            order.push(n.clone());
        }
    }
    if order.len() > cap {
        order.clear();
        for n in routed {
            if !order.contains(n) {
                order.push(n.clone());
            }
        }
    }
    order
}

/// Which text of a tool is embedded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolText {
    /// `name: description`.
    NameDescription,
    /// `name: description` plus the parameter names.
    Parameters,
    /// `name: description` plus parameter names and their descriptions (cut at the
    /// embedder's `max_text_tokens`).
    #[default]
    ParameterDescriptions,
}

/// Renders the text that is embedded for `tool`.
pub fn tool_text(tool: &Tool, style: ToolText) -> String {
    let mut text = format!("{}: {}", tool.name, tool.description.trim());
    match style {
        ToolText::NameDescription => {}
        ToolText::Parameters => {
            let names: Vec<&str> = tool.parameters().map(|(n, _)| n).collect();
            if !names.is_empty() {
                text.push_str(" Parameters: ");
                text.push_str(&names.join(", "));
                text.push('.');
            }
        }
        ToolText::ParameterDescriptions => {
            let params: Vec<String> = tool
                .parameters()
                .map(|(n, d)| match d.trim() {
                    "" => n.to_owned(),
                    d => format!("{n} ({d})"),
                })
                .collect();
            if !params.is_empty() {
                text.push_str(" Parameters: ");
                text.push_str(&params.join("; "));
            }
        }
    }
    text
}

/// Weights of a tool's fields in its BM25 document: the name says most about what a
/// tool is for, parameter descriptions least.
const NAME_WEIGHT: f32 = 2.0;
const DESCRIPTION_WEIGHT: f32 = 1.0;
const PARAMETER_NAME_WEIGHT: f32 = 1.0;
const PARAMETER_DESCRIPTION_WEIGHT: f32 = 0.5;

fn lexical_doc(tool: &Tool) -> Vec<(String, f32)> {
    let mut doc = Vec::new();
    let mut add = |text: &str, w: f32| doc.extend(lexical::terms(text).into_iter().map(|t| (t, w)));
    add(&tool.name, NAME_WEIGHT);
    add(&tool.description, DESCRIPTION_WEIGHT);
    for (name, desc) in tool.parameters() {
        add(name, PARAMETER_NAME_WEIGHT);
        add(desc, PARAMETER_DESCRIPTION_WEIGHT);
    }
    doc
}

/// Router settings. Every field has a default; a TOML/JSON table may set any subset.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouterConfig {
    /// Tools offered per request when the caller does not say. Default 5.
    pub top_k: usize,
    /// Below this top-1 cosine the dense ranking is not trusted and the hybrid re-rank
    /// runs. 1.0 = always re-rank. Default 0.5 (MiniLM cosines between a request and
    /// the right tool's text are mostly 0.3–0.6).
    pub min_score: f32,
    /// Below this gap between the top-1 and top-2 cosine the hybrid re-rank runs.
    /// Default 0.1.
    pub min_margin: f32,
    /// Weight `w` of the normalised BM25 score in the hybrid score
    /// `(1 − w)·cosine + w·bm25/bm25_max`; 0 disables the re-rank. Default 0.2
    /// (`docs/tool-router.md` has the sweep it was chosen from).
    pub hybrid_weight: f32,
    /// Dense candidates kept for confidence and re-rank, and lexical candidates added
    /// to them. Latency grows with it only in the re-rank (O(candidates log candidates)).
    /// Default 50.
    pub candidates: usize,
    /// What is embedded per tool. Default [`ToolText::ParameterDescriptions`].
    pub tool_text: ToolText,
    /// Catalogs larger than this use the int8 quantized index (¼ of the bytes scanned;
    /// the exact rows are kept for the re-rank, so memory is 1.25× the exact index).
    /// Default 4096.
    pub quantize_above: usize,
    /// Rows the quantized index re-ranks exactly per search (each costs one random
    /// 1.5 KiB read at 384 dimensions). Default 100.
    pub shortlist: usize,
    /// BM25 term-frequency saturation. Default 1.2.
    pub bm25_k1: f32,
    /// BM25 length normalisation (0..=1). Default 0.75.
    pub bm25_b: f32,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            top_k: 5,
            min_score: 0.5,
            min_margin: 0.1,
            hybrid_weight: 0.2,
            candidates: 50,
            tool_text: ToolText::default(),
            quantize_above: 4096,
            shortlist: 100,
            bm25_k1: 1.2,
            bm25_b: 0.75,
        }
    }
}

impl RouterConfig {
    /// Checks the ranges.
    pub fn validate(&self) -> Result<(), ControlError> {
        let bad = |what: String| Err(ControlError::Config(what));
        if self.top_k == 0 {
            return bad("top_k = 0".into());
        }
        if !(0.0..=1.0).contains(&self.hybrid_weight) {
            return bad(format!(
                "hybrid_weight = {} not in 0..=1",
                self.hybrid_weight
            ));
        }
        if self.candidates == 0 || self.shortlist == 0 {
            return bad("candidates and shortlist must be ≥ 1".into());
        }
        if self.min_margin.is_nan() || self.min_margin < 0.0 || self.min_score.is_nan() {
            return bad(format!(
                "min_margin = {} must be ≥ 0, min_score = {} a number",
                self.min_margin, self.min_score
            ));
        }
        if self.bm25_k1.is_nan() || self.bm25_k1 < 0.0 || !(0.0..=1.0).contains(&self.bm25_b) {
            return bad(format!(
                "bm25_k1 = {} must be ≥ 0, bm25_b = {} in 0..=1",
                self.bm25_k1, self.bm25_b
            ));
        }
        Ok(())
    }
}

/// How sure the dense stage was: its best cosine and the gap to the second.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Confidence {
    /// Cosine of the best tool.
    pub top1: f32,
    /// `top1 − top2` (`top1` when the catalog has one tool).
    pub margin: f32,
}

impl Confidence {
    /// Whether `config` calls this low (and re-ranks).
    pub fn is_low(&self, config: &RouterConfig) -> bool {
        self.top1 < config.min_score || self.margin < config.min_margin
    }
}

/// One routed tool.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Routed<'r> {
    /// The tool.
    pub tool: &'r Tool,
    /// Its position in the catalog.
    pub id: usize,
    /// The ranking score: the cosine, or the hybrid score after a re-rank.
    pub score: f32,
    /// Cosine with the intent.
    pub cosine: f32,
    /// BM25 score normalised by the candidates' maximum (0 without a re-rank).
    pub lexical: f32,
    /// Included because it was forced or named, whatever its score.
    pub forced: bool,
}

/// The result of [`ToolRouter::route`].
#[derive(Clone, Debug, PartialEq)]
pub struct Routing<'r> {
    /// Forced tools first, then by descending score.
    pub tools: Vec<Routed<'r>>,
    /// The dense stage's confidence.
    pub confidence: Confidence,
    /// Whether the hybrid re-rank ran.
    pub reranked: bool,
}

impl<'r> Routing<'r> {
    /// `(tool, score)` pairs, in order.
    pub fn pairs(&self) -> Vec<(&'r Tool, f32)> {
        self.tools.iter().map(|r| (r.tool, r.score)).collect()
    }

    /// Names, in order.
    pub fn names(&self) -> Vec<&'r str> {
        self.tools.iter().map(|r| r.tool.name.as_str()).collect()
    }
}

/// A catalog of tools, indexed for routing. Immutable once built; rebuild (the embedding
/// cache makes an unchanged catalog free) to change it.
#[derive(Clone, Debug)]
pub struct ToolRouter {
    config: RouterConfig,
    tools: Vec<Tool>,
    by_name: HashMap<String, usize>,
    index: VectorIndex,
    lexical: LexicalIndex,
}

/// A candidate during ranking.
#[derive(Clone, Copy, Debug)]
struct Scored {
    id: usize,
    score: f32,
    cosine: f32,
    lexical: f32,
}

impl ToolRouter {
    /// Embeds the catalog (through the embedder's cache) and indexes it.
    pub fn build(
        embedder: &Embedder,
        tools: Vec<Tool>,
        config: RouterConfig,
    ) -> Result<Self, ControlError> {
        config.validate()?;
        let texts: Vec<String> = tools
            .iter()
            .map(|t| tool_text(t, config.tool_text))
            .collect();
        let vectors = embedder.embed_cached(&texts)?;
        Self::from_embeddings(tools, &vectors, config)
    }

    /// Indexes a catalog whose tool embeddings are already known (`vectors[i]` embeds
    /// `tool_text(&tools[i], config.tool_text)`, unit length).
    pub fn from_embeddings<V: AsRef<[f32]>>(
        tools: Vec<Tool>,
        vectors: &[V],
        config: RouterConfig,
    ) -> Result<Self, ControlError> {
        config.validate()?;
        if tools.len() != vectors.len() {
            return Err(ControlError::Config(format!(
                "{} tools but {} vectors",
                tools.len(),
                vectors.len()
            )));
        }
        let mut by_name = HashMap::with_capacity(tools.len());
        for (i, tool) in tools.iter().enumerate() {
            if by_name.insert(tool.name.clone(), i).is_some() {
                return Err(ControlError::DuplicateTool(tool.name.clone()));
            }
        }
        let dim = vectors.first().map_or(0, |v| v.as_ref().len());
        let flat = if tools.is_empty() {
            FlatIndex::new(0)
        } else {
            FlatIndex::from_rows(dim, vectors)?
        };
        let index = if tools.len() > config.quantize_above {
            VectorIndex::Quantized(QuantizedIndex::new(flat, config.shortlist))
        } else {
            VectorIndex::Exact(flat)
        };
        let docs: Vec<_> = tools.iter().map(lexical_doc).collect();
        let lexical = LexicalIndex::build(
            &docs,
            Bm25 {
                k1: config.bm25_k1,
                b: config.bm25_b,
            },
        );
        Ok(Self {
            config,
            tools,
            by_name,
            index,
            lexical,
        })
    }

    /// The settings.
    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// The catalog, in order.
    pub fn tools(&self) -> &[Tool] {
        &self.tools
    }

    /// Number of tools.
    pub fn len(&self) -> usize {
        self.tools.len()
    }

    /// Whether the catalog is empty.
    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }

    /// The vector index in use.
    pub fn index(&self) -> &VectorIndex {
        &self.index
    }

    /// Routes `intent` (for chat, the last user message) to its `k` best tools. Blocks
    /// while the intent is embedded.
    pub fn route(
        &self,
        embedder: &Embedder,
        intent: &str,
        k: usize,
    ) -> Result<Routing<'_>, ControlError> {
        self.route_with(embedder, intent, k, &[])
    }

    /// [`route`](Self::route) with tools that must be offered (the `tool_choice` name).
    pub fn route_with(
        &self,
        embedder: &Embedder,
        intent: &str,
        k: usize,
        forced: &[&str],
    ) -> Result<Routing<'_>, ControlError> {
        let query = embedder.embed(intent)?;
        self.route_vector(&query, intent, k, forced)
    }

    /// Routing for an already embedded intent (`query`, unit length); `intent` is still
    /// needed for the lexical re-rank and for tools named in it.
    ///
    /// Returns `max(k, forced)` tools at most: the forced ones and the tools named in the
    /// intent first, then the best of the rest. Fails if a forced name is not in the
    /// catalog or `query` has the wrong dimension.
    pub fn route_vector(
        &self,
        query: &[f32],
        intent: &str,
        k: usize,
        forced: &[&str],
    ) -> Result<Routing<'_>, ControlError> {
        let mut forced_ids = Vec::with_capacity(forced.len());
        for name in forced {
            let id = *self
                .by_name
                .get(*name)
                .ok_or_else(|| ControlError::UnknownTool((*name).to_owned()))?;
            if !forced_ids.contains(&id) {
                forced_ids.push(id);
            }
        }
        if self.tools.is_empty() {
            return Ok(Routing {
                tools: Vec::new(),
                confidence: Confidence::default(),
                reranked: false,
            });
        }
        let dim = self.index.flat().dim();
        if query.len() != dim {
            return Err(ControlError::Dimension {
                expected: dim,
                got: query.len(),
            });
        }
        for id in self.named_in(intent) {
            if !forced_ids.contains(&id) {
                forced_ids.push(id);
            }
        }

        let dense = self
            .index
            .search(query, k.max(2).max(self.config.candidates));
        let confidence = Confidence {
            top1: dense[0].score,
            margin: dense
                .get(1)
                .map_or(dense[0].score, |h| dense[0].score - h.score),
        };
        let reranked = self.config.hybrid_weight > 0.0 && confidence.is_low(&self.config);
        let ranked = if reranked {
            self.hybrid(query, intent, &dense)
        } else {
            dense
                .iter()
                .map(|h| Scored {
                    id: h.id,
                    score: h.score,
                    cosine: h.score,
                    lexical: 0.0,
                })
                .collect()
        };

        let take = k.max(forced_ids.len());
        let mut tools = Vec::with_capacity(take);
        for &id in &forced_ids {
            let s = ranked
                .iter()
                .find(|s| s.id == id)
                .copied()
                .unwrap_or_else(|| {
                    let cosine = self.index.score(query, id);
                    Scored {
                        id,
                        score: cosine,
                        cosine,
                        lexical: 0.0,
                    }
                });
            tools.push(self.routed(s, true));
        }
        for s in &ranked {
            if tools.len() >= take {
                break;
            }
            if !forced_ids.contains(&s.id) {
                tools.push(self.routed(*s, false));
            }
        }
        tracing::debug!(
            top1 = confidence.top1,
            margin = confidence.margin,
            reranked,
            forced = forced_ids.len(),
            chosen = ?tools
                .iter()
                .take(3)
                .map(|r| format!("{}: {:.3} = cos {:.3}, bm25 {:.3}", r.tool.name, r.score, r.cosine, r.lexical))
                .collect::<Vec<_>>(),
            "tool routing"
        );
        Ok(Routing {
            tools,
            confidence,
            reranked,
        })
    }

    fn routed(&self, s: Scored, forced: bool) -> Routed<'_> {
        Routed {
            tool: &self.tools[s.id],
            id: s.id,
            score: s.score,
            cosine: s.cosine,
            lexical: s.lexical,
            forced,
        }
    }

    /// Catalog tools whose exact name appears as a word of `intent`. Only names that look
    /// like identifiers (with `_`, `.`, a digit or an inner capital) count, so a tool
    /// called `search` is not forced by the word "search".
    fn named_in(&self, intent: &str) -> Vec<usize> {
        let mut ids = Vec::new();
        for word in intent.split(|c: char| !(c.is_alphanumeric() || matches!(c, '_' | '.' | '-'))) {
            let word = word.trim_matches(|c| matches!(c, '.' | '-'));
            if let Some(&id) = self.by_name.get(word) {
                if looks_like_identifier(word) && !ids.contains(&id) {
                    ids.push(id);
                }
            }
        }
        ids
    }

    /// Dense candidates plus the best lexical ones, ranked by
    /// `(1 − w)·cosine + w·bm25/bm25_max`.
    fn hybrid(&self, query: &[f32], intent: &str, dense: &[Hit]) -> Vec<Scored> {
        let w = self.config.hybrid_weight;
        let terms = self.lexical.query(&lexical::terms(intent));
        let mut bm25 = vec![0.0f32; self.tools.len()];
        self.lexical.score_into(&terms, &mut bm25);

        let mut lexical_top = TopK::new(self.config.candidates);
        for (id, &s) in bm25.iter().enumerate() {
            if s > 0.0 {
                lexical_top.push(id, s);
            }
        }
        let mut candidates: Vec<Scored> = dense
            .iter()
            .map(|h| Scored {
                id: h.id,
                score: 0.0,
                cosine: h.score,
                lexical: bm25[h.id],
            })
            .collect();
        for hit in lexical_top.into_sorted() {
            if !dense.iter().any(|h| h.id == hit.id) {
                candidates.push(Scored {
                    id: hit.id,
                    score: 0.0,
                    cosine: self.index.score(query, hit.id),
                    lexical: hit.score,
                });
            }
        }
        let max = candidates.iter().fold(0.0f32, |m, c| m.max(c.lexical));
        for c in &mut candidates {
            c.lexical = if max > 0.0 { c.lexical / max } else { 0.0 };
            c.score = (1.0 - w) * c.cosine + w * c.lexical;
        }
        candidates.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.id.cmp(&b.id)));
        candidates
    }
}

fn looks_like_identifier(name: &str) -> bool {
    name.contains(['_', '.'])
        || name.chars().any(|c| c.is_ascii_digit())
        || name.chars().skip(1).any(char::is_uppercase)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::embed::normalize;
    use crate::index::tests::Rng;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn a_step_lists_the_previous_steps_tools_first_in_their_order() {
        let order = listing_order(&names(&["c", "a", "d"]), &names(&["a", "b", "e"]), 8);
        assert_eq!(order, names(&["c", "a", "d", "b", "e"]));
    }

    #[test]
    fn a_step_with_nothing_kept_lists_its_routed_tools_as_given() {
        assert_eq!(
            listing_order(&[], &names(&["b", "a"]), 4),
            names(&["b", "a"])
        );
    }

    #[test]
    fn a_step_whose_list_would_pass_the_cap_starts_over() {
        let order = listing_order(&names(&["a", "b", "c"]), &names(&["d", "e"]), 4);
        assert_eq!(order, names(&["d", "e"]));
    }

    #[test]
    fn a_step_routed_to_the_same_tools_lists_them_as_before() {
        let kept = names(&["c", "a", "b"]);
        assert_eq!(listing_order(&kept, &names(&["a", "b", "c"]), 3), kept);
    }

    fn tool(name: &str, description: &str, params: &[&str]) -> Tool {
        let properties: serde_json::Map<String, Value> = params
            .iter()
            .map(|p| ((*p).to_owned(), serde_json::json!({"type": "string"})))
            .collect();
        Tool {
            name: name.into(),
            description: description.into(),
            parameters: serde_json::json!({"type": "object", "properties": properties}),
        }
    }

    /// Five tools with random unit vectors; queries are built near chosen tools.
    fn catalog(config: RouterConfig) -> (ToolRouter, Vec<Vec<f32>>) {
        let tools = vec![
            tool("get_weather", "Current weather for a city.", &["city"]),
            tool(
                "get_forecast",
                "Weather forecast for a city and date.",
                &["city", "date"],
            ),
            tool(
                "send_email",
                "Send an email to a recipient.",
                &["to", "subject", "body"],
            ),
            tool(
                "book_flight",
                "Book a flight between two airports.",
                &["from", "to", "date"],
            ),
            tool("search", "Search the web.", &["query"]),
        ];
        let mut rng = Rng(5);
        let vectors: Vec<Vec<f32>> = (0..tools.len()).map(|_| rng.unit(32)).collect();
        (
            ToolRouter::from_embeddings(tools, &vectors, config).unwrap(),
            vectors,
        )
    }

    fn near(vectors: &[Vec<f32>], weights: &[(usize, f32)]) -> Vec<f32> {
        let mut q = vec![0.0; vectors[0].len()];
        for &(i, w) in weights {
            for (x, v) in q.iter_mut().zip(&vectors[i]) {
                *x += w * v;
            }
        }
        normalize(&mut q);
        q
    }

    #[test]
    fn confident_routing_keeps_the_dense_order() {
        let (router, vectors) = catalog(RouterConfig::default());
        let q = near(&vectors, &[(2, 1.0), (3, 0.5)]);
        let r = router.route_vector(&q, "mail my boss", 2, &[]).unwrap();
        assert_eq!(r.names(), vec!["send_email", "book_flight"]);
        assert!(!r.reranked);
        assert!(
            r.confidence.top1 > 0.8 && r.confidence.margin > 0.3,
            "{:?}",
            r.confidence
        );
        assert_eq!(r.tools[0].score, r.tools[0].cosine);
        assert_eq!(r.pairs()[0].0.name, "send_email");
    }

    #[test]
    fn low_margin_triggers_the_lexical_rerank() {
        let (router, vectors) = catalog(RouterConfig {
            hybrid_weight: 0.5,
            ..RouterConfig::default()
        });
        // Equidistant from get_weather and get_forecast: the dense stage cannot tell.
        let q = near(&vectors, &[(0, 1.0), (1, 1.0)]);
        let r = router
            .route_vector(&q, "What is the forecast for Lima next Monday?", 2, &[])
            .unwrap();
        assert!(r.confidence.margin < 0.05, "{:?}", r.confidence);
        assert!(r.reranked);
        assert_eq!(r.names(), vec!["get_forecast", "get_weather"]);
        assert_eq!(r.tools[0].lexical, 1.0);
        // Disabled re-rank: same query, dense order only.
        let (plain, _) = catalog(RouterConfig {
            hybrid_weight: 0.0,
            ..RouterConfig::default()
        });
        assert!(!plain.route_vector(&q, "forecast", 2, &[]).unwrap().reranked);
    }

    #[test]
    fn forced_and_named_tools_are_always_included() {
        let (router, vectors) = catalog(RouterConfig::default());
        let q = near(&vectors, &[(2, 1.0)]);
        let r = router
            .route_vector(&q, "mail my boss", 2, &["search"])
            .unwrap();
        assert_eq!(r.names(), vec!["search", "send_email"]);
        assert!(r.tools[0].forced && !r.tools[1].forced);
        // More forced tools than k: all of them, nothing else.
        let r = router
            .route_vector(&q, "x", 1, &["search", "book_flight", "search"])
            .unwrap();
        assert_eq!(r.names(), vec!["search", "book_flight"]);
        // A tool named verbatim in the intent is forced; a plain word is not.
        let r = router
            .route_vector(&q, "call book_flight. then search", 1, &[])
            .unwrap();
        assert_eq!(r.names(), vec!["book_flight"]);
        assert!(r.tools[0].forced);
        assert!(matches!(
            router.route_vector(&q, "x", 1, &["nope"]),
            Err(ControlError::UnknownTool(n)) if n == "nope"
        ));
    }

    #[test]
    fn rejects_duplicates_and_wrong_dimensions() {
        let tools = vec![tool("a_b", "", &[]), tool("a_b", "", &[])];
        let v = vec![vec![1.0, 0.0], vec![0.0, 1.0]];
        assert!(matches!(
            ToolRouter::from_embeddings(tools, &v, RouterConfig::default()),
            Err(ControlError::DuplicateTool(_))
        ));
        let (router, _) = catalog(RouterConfig::default());
        assert!(matches!(
            router.route_vector(&[1.0], "x", 1, &[]),
            Err(ControlError::Dimension {
                expected: 32,
                got: 1
            })
        ));
        let empty = ToolRouter::from_embeddings(
            Vec::new(),
            &Vec::<Vec<f32>>::new(),
            RouterConfig::default(),
        )
        .unwrap();
        assert!(empty
            .route_vector(&[], "x", 3, &[])
            .unwrap()
            .tools
            .is_empty());
    }

    #[test]
    fn large_catalogs_use_the_quantized_index_with_the_same_answer() {
        let mut rng = Rng(9);
        let tools: Vec<Tool> = (0..300)
            .map(|i| tool(&format!("tool_{i}"), "", &[]))
            .collect();
        let vectors: Vec<Vec<f32>> = (0..300).map(|_| rng.unit(64)).collect();
        let config = RouterConfig {
            quantize_above: 100,
            shortlist: 20,
            ..RouterConfig::default()
        };
        let router = ToolRouter::from_embeddings(tools.clone(), &vectors, config).unwrap();
        assert!(matches!(router.index(), VectorIndex::Quantized(_)));
        let exact = ToolRouter::from_embeddings(tools, &vectors, RouterConfig::default()).unwrap();
        assert!(matches!(exact.index(), VectorIndex::Exact(_)));
        let q = near(&vectors, &[(42, 1.0), (7, 0.4)]);
        let a = router.route_vector(&q, "", 2, &[]).unwrap();
        let b = exact.route_vector(&q, "", 2, &[]).unwrap();
        assert_eq!(a.names(), vec!["tool_42", "tool_7"]);
        assert_eq!(a.names(), b.names());
    }

    #[test]
    fn tool_text_styles_and_openai_round_trip() {
        let t = tool("get_forecast", "Weather forecast.", &["city", "date"]);
        assert_eq!(
            tool_text(&t, ToolText::NameDescription),
            "get_forecast: Weather forecast."
        );
        assert_eq!(
            tool_text(&t, ToolText::Parameters),
            "get_forecast: Weather forecast. Parameters: city, date."
        );
        let openai = t.to_openai();
        assert_eq!(Tool::from_openai(&openai), Some(t.clone()));
        assert_eq!(Tool::from_openai(&openai["function"]), Some(t));
        let choice = serde_json::json!({"type": "function", "function": {"name": "get_forecast"}});
        assert_eq!(forced_tool(&choice), Some("get_forecast"));
        assert_eq!(forced_tool(&serde_json::json!("auto")), None);
    }

    #[test]
    fn config_defaults_round_trip_and_validate() {
        let cfg: RouterConfig = serde_json::from_str(r#"{"top_k": 3}"#).unwrap();
        assert_eq!(cfg.top_k, 3);
        assert_eq!(cfg.candidates, RouterConfig::default().candidates);
        assert!(serde_json::from_str::<RouterConfig>(r#"{"topk": 3}"#).is_err());
        let bad = RouterConfig {
            hybrid_weight: 1.5,
            ..RouterConfig::default()
        };
        assert!(matches!(bad.validate(), Err(ControlError::Config(_))));
    }
}
