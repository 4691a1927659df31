//! A request's sampler: its llama.cpp sampler chain (EOS ban, grammar, greedy or
//! top-k/top-p/temperature/seeded draw), with the grammar checked last for greedy requests.
//!
//! llama.cpp's grammar sampler tests every vocabulary token against the grammar's stacks
//! on every step, which costs as much as a small model's decode. A greedy request picks
//! the argmax; when the grammar allows the unconstrained argmax, that token is also the
//! argmax of the constrained distribution (the grammar only removes tokens), so checking
//! that one token is enough. Only when the grammar refuses it is the full vocabulary
//! masked and the argmax taken again (what llama.cpp's own `common_sampler` does for
//! every request). The result is exactly the grammar-first chain's, token for token.
//!
//! A drafted greedy request's draft proposes only tokens the grammar allows: the draft
//! advances a copy of the grammar over its drafts ([`allowed_argmax`], same check).
//!
//! Sampled requests keep the grammar inside the chain: drawing first and checking after
//! would change the distribution (and the seeded draws) of a constrained request.

use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::sampling::LlamaSampler;
use llama_cpp_2::token::data::LlamaTokenData;
use llama_cpp_2::token::data_array::LlamaTokenDataArray;
use llama_cpp_2::token::logit_bias::LlamaLogitBias;
use llama_cpp_2::token::LlamaToken;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::{GenerateRequest, SamplingParams, TierError};

/// The sampler of one sequence.
pub(crate) struct RequestSampler {
    /// The chain (with the grammar inside unless `grammar` holds it).
    chain: LlamaSampler,
    /// The grammar, checked after the chain's choice (greedy requests only).
    grammar: Option<LlamaSampler>,
}

impl RequestSampler {
    /// Builds the sampler of `req` for `model` (a bad grammar is the request's error).
    pub(crate) fn new(model: &LlamaModel, req: &GenerateRequest) -> Result<Self, TierError> {
        let mut chain: Vec<LlamaSampler> = eos_ban(model, req).into_iter().collect();
        let grammar = match &req.grammar {
            Some(g) => {
                let grammar = match &req.grammar_trigger {
                    Some(trigger) => {
                        let ids = model.vocab().tokenize(trigger.as_bytes(), false, true);
                        if ids.len() == 1 {
                            LlamaSampler::grammar_lazy(model, g, "root", Vec::<&[u8]>::new(), &ids)
                        } else {
                            LlamaSampler::grammar_lazy(model, g, "root", [trigger.as_bytes()], &[])
                        }
                    }
                    None => LlamaSampler::grammar(model, g, "root"),
                };
                Some(grammar.map_err(|e| TierError::InvalidRequest(format!("grammar: {e}")))?)
            }
            None => None,
        };
        let greedy = req.sampling.temperature <= 0.0;
        let checked = match grammar {
            Some(g) if !greedy => {
                chain.push(g);
                None
            }
            g => g,
        };
        if greedy {
            chain.push(LlamaSampler::greedy());
        } else {
            chain.extend(draw(&req.sampling, req.sampling.seed));
        }
        Ok(Self {
            chain: LlamaSampler::chain_simple(chain),
            grammar: checked,
        })
    }

    /// The distribution the chain draws from at logits row `row` (after the EOS ban, the
    /// grammar, top-k, top-p and temperature): every token with a nonzero probability.
    /// For sampled requests (a greedy chain selects without probabilities).
    pub(crate) fn distribution(&mut self, ctx: &LlamaContext<'_>, row: i32) -> Vec<(i32, f32)> {
        let mut all = ctx.token_data_array_ith(row);
        self.chain.apply(&mut all);
        nonzero(&all)
    }

    /// Chooses and accepts the token for logits row `row` of `ctx`; says whether a checked
    /// grammar refused the free choice (and the vocabulary was masked).
    pub(crate) fn sample(&mut self, ctx: &LlamaContext<'_>, row: i32) -> (LlamaToken, bool) {
        let Some(grammar) = &mut self.grammar else {
            return (self.chain.sample(ctx, row), false);
        };
        let mut all = ctx.token_data_array_ith(row);
        self.chain.apply(&mut all);
        let mut tok = all.selected_token().expect("greedy selects a token");
        let logit = ctx.get_logits_ith(row)[tok.0 as usize];
        let mut one = LlamaTokenDataArray::new(vec![LlamaTokenData::new(tok, logit, 0.0)], false);
        grammar.apply(&mut one);
        let refused = one.data[0].logit() == f32::NEG_INFINITY;
        if refused {
            // The grammar refuses the free choice: mask the whole vocabulary, choose again.
            let mut all = ctx.token_data_array_ith(row);
            grammar.apply(&mut all);
            self.chain.apply(&mut all);
            tok = all.selected_token().expect("greedy selects a token");
        }
        grammar.accept(tok);
        self.chain.accept(tok);
        (tok, refused)
    }

    /// A copy of the grammar a greedy request checks its choices against, in its current
    /// state, for the draft to propose only tokens it allows; `None` without one (a
    /// sampled request's grammar is inside its chain).
    pub(crate) fn grammar_copy(&self) -> Option<LlamaSampler> {
        self.grammar.clone()
    }

    /// Accepts a token chosen elsewhere (the reasoning governor's `</think>`).
    pub(crate) fn accept(&mut self, tok: LlamaToken) {
        if let Some(g) = &mut self.grammar {
            g.accept(tok);
        }
        self.chain.accept(tok);
    }
}

/// A sampled request's draft-side sampler (speculative sampling, `DraftAcceptance::Rejection`):
/// the request's EOS ban, top-k, top-p and temperature over the draft model's logits (no
/// grammar: the target's check enforces it), and the uniform draws of the acceptance test.
pub(crate) struct DraftSampler {
    chain: LlamaSampler,
    rng: SmallRng,
}

impl DraftSampler {
    /// `None` for greedy requests (their drafts are the draft model's argmax).
    pub(crate) fn new(model: &LlamaModel, req: &GenerateRequest) -> Option<Self> {
        let s = &req.sampling;
        if s.temperature <= 0.0 {
            return None;
        }
        // Seeded from the request, apart from the target's stream: a seeded request is
        // reproducible under the same draft configuration.
        let seed = s.seed ^ 0x5eed_d4af;
        let chain: Vec<LlamaSampler> = eos_ban(model, req)
            .into_iter()
            .chain(draw(s, seed))
            .collect();
        Some(Self {
            chain: LlamaSampler::chain_simple(chain),
            rng: SmallRng::seed_from_u64(u64::from(s.seed) << 1 | 1),
        })
    }

    /// Draws a draft token from logits row `row` of the draft context; returns it with the
    /// draft's distribution (nonzero entries, sorted by token).
    pub(crate) fn draw(&mut self, ctx: &LlamaContext<'_>, row: i32) -> (i32, Vec<(i32, f32)>) {
        let mut all = ctx.token_data_array_ith(row);
        self.chain.apply(&mut all);
        let tok = all.selected_token().expect("dist selects a token").0;
        let mut q = nonzero(&all);
        q.sort_unstable_by_key(|e| e.0);
        (tok, q)
    }

    /// A uniform draw in `[0, 1)`.
    pub(crate) fn uniform(&mut self) -> f32 {
        self.rng.random()
    }
}

/// The greedy token of logits row `row` of `ctx` that `grammar` allows, accepted into it:
/// the argmax when the grammar allows it, else the argmax of the masked vocabulary; `None`
/// when the grammar allows no token.
pub(crate) fn allowed_argmax(
    ctx: &LlamaContext<'_>,
    row: i32,
    grammar: &mut LlamaSampler,
) -> Option<LlamaToken> {
    let logits = ctx.get_logits_ith(row);
    let free = crate::speculative::argmax(logits);
    let mut one = LlamaTokenDataArray::new(
        vec![LlamaTokenData::new(
            LlamaToken(free),
            logits[free as usize],
            0.0,
        )],
        false,
    );
    grammar.apply(&mut one);
    let tok = if one.data[0].logit() > f32::NEG_INFINITY {
        LlamaToken(free)
    } else {
        let mut all = ctx.token_data_array_ith(row);
        grammar.apply(&mut all);
        all.data
            .iter()
            .filter(|d| d.logit() > f32::NEG_INFINITY)
            .max_by(|a, b| a.logit().total_cmp(&b.logit()))?
            .id()
    };
    grammar.accept(tok);
    Some(tok)
}

/// Bans end-of-generation tokens for `ignore_eos` requests.
fn eos_ban(model: &LlamaModel, req: &GenerateRequest) -> Option<LlamaSampler> {
    req.ignore_eos.then(|| {
        let vocab = model.vocab();
        let bans: Vec<LlamaLogitBias> = (0..model.n_vocab())
            .map(LlamaToken)
            .filter(|&t| vocab.is_eog(t))
            .map(|t| LlamaLogitBias::new(t, f32::NEG_INFINITY))
            .collect();
        LlamaSampler::logit_bias(model.n_vocab(), &bans)
    })
}

/// A sampled request's draw: top-k, top-p, temperature, then a seeded random pick.
fn draw(s: &SamplingParams, seed: u32) -> Vec<LlamaSampler> {
    let mut chain = Vec::new();
    if s.top_k > 0 {
        chain.push(LlamaSampler::top_k(s.top_k));
    }
    if s.top_p < 1.0 {
        chain.push(LlamaSampler::top_p(s.top_p, 1));
    }
    chain.push(LlamaSampler::temp(s.temperature));
    chain.push(LlamaSampler::dist(seed));
    chain
}

/// The tokens of an applied chain's candidates with nonzero probability.
fn nonzero(all: &LlamaTokenDataArray) -> Vec<(i32, f32)> {
    all.data
        .iter()
        .filter(|d| d.p() > 0.0)
        .map(|d| (d.id().0, d.p()))
        .collect()
}
