//! What the router evaluations share: the router settings they compare and the schema
//! tokens of an offer.

use std::collections::HashMap;

use mesh_control::{Embedder, RouterConfig, Tool, ToolText};

/// Plain cosine over `name: description` (the baseline) and the default router.
pub fn baseline_and_default() -> [(&'static str, RouterConfig); 2] {
    [
        (
            "cosine (name: description)",
            RouterConfig {
                tool_text: ToolText::NameDescription,
                hybrid_weight: 0.0,
                ..RouterConfig::default()
            },
        ),
        (
            "default router (hybrid when unsure)",
            RouterConfig::default(),
        ),
    ]
}

/// Prompt tokens of each tool's schema: its compact OpenAI `tools[]` JSON, counted with the
/// embedder's tokenizer.
pub struct SchemaTokens {
    per_tool: Vec<usize>,
    position: HashMap<String, usize>,
    /// The whole catalog's.
    pub all: usize,
}

impl SchemaTokens {
    /// Counts every tool of `tools`.
    pub fn new(embedder: &Embedder, tools: &[Tool]) -> Self {
        let per_tool: Vec<usize> = tools
            .iter()
            .map(|t| {
                embedder.count_tokens(&serde_json::to_string(&t.to_openai()).unwrap_or_default())
            })
            .collect();
        Self {
            all: per_tool.iter().sum(),
            position: tools
                .iter()
                .enumerate()
                .map(|(i, t)| (t.name.clone(), i))
                .collect(),
            per_tool,
        }
    }

    /// The tokens of the tools named in `offer` (names outside the catalog count nothing).
    pub fn of(&self, offer: &[String]) -> usize {
        offer
            .iter()
            .filter_map(|n| self.position.get(n))
            .map(|&i| self.per_tool[i])
            .sum()
    }
}
