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
//!
//! A greedy request's free choice does not go through llama.cpp's chain: the engine scans
//! the logits once ([`top2`]) for the margin it reports and the argmax, which is the chain's
//! choice (llama.cpp's greedy sampler takes the first largest logit) unless the argmax is an
//! end-of-generation token an `ignore_eos` request bans; only then does the chain run. The
//! chain would copy the whole vocabulary into a candidate array and scan it again, for every
//! sequence on every step (128,256 entries on Llama-3 vocabularies).

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
    /// Greedy: the chain's choice is the argmax unless that token is in `banned`.
    greedy: bool,
    /// Tokens the chain bans (end of generation, for `ignore_eos`), sorted.
    banned: Vec<i32>,
}

impl RequestSampler {
    /// Builds the sampler of `req` for `model` (a bad grammar is the request's error).
    pub(crate) fn new(model: &LlamaModel, req: &GenerateRequest) -> Result<Self, TierError> {
        let banned = if req.ignore_eos {
            eog_tokens(model)
        } else {
            Vec::new()
        };
        let mut chain: Vec<LlamaSampler> = eos_ban(model, &banned, req).into_iter().collect();
        let grammar = match &req.grammar {
            Some(g) => {
                let lazy = req.grammar_trigger.is_some() || !req.grammar_patterns.is_empty();
                let grammar = if lazy {
                    // A trigger word that is one token triggers on that token; any other
                    // word becomes a pattern (llama.cpp's word triggers are patterns too).
                    let mut patterns = req.grammar_patterns.clone();
                    let mut tokens = vec![];
                    if let Some(w) = &req.grammar_trigger {
                        match model.vocab().tokenize(w.as_bytes(), false, true)[..] {
                            [t] => tokens.push(t),
                            _ => patterns
                                .push(format!("({})", crate::format::grammar::regex_escape(w))),
                        }
                    }
                    LlamaSampler::grammar_lazy_patterns(model, g, "root", &patterns, &tokens)
                } else {
                    LlamaSampler::grammar(model, g, "root")
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
            greedy,
            banned,
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

    /// Chooses and accepts the token for logits row `row` of `ctx`, whose argmax (first
    /// largest logit, [`top2`]) is `argmax`; says whether a checked grammar refused the free
    /// choice (and the vocabulary was masked).
    pub(crate) fn sample(
        &mut self,
        ctx: &LlamaContext<'_>,
        row: i32,
        argmax: i32,
    ) -> (LlamaToken, bool) {
        let free = self.greedy && self.banned.binary_search(&argmax).is_err();
        let Some(grammar) = &mut self.grammar else {
            if free {
                let tok = LlamaToken(argmax);
                self.chain.accept(tok);
                return (tok, false);
            }
            return (self.chain.sample(ctx, row), false);
        };
        let mut tok = if free {
            LlamaToken(argmax)
        } else {
            let mut all = ctx.token_data_array_ith(row);
            self.chain.apply(&mut all);
            all.selected_token().expect("greedy selects a token")
        };
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
        let banned = if req.ignore_eos {
            eog_tokens(model)
        } else {
            Vec::new()
        };
        let chain: Vec<LlamaSampler> = eos_ban(model, &banned, req)
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
    let free = top2(logits).0 as i32;
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

/// The end-of-generation tokens of `model`'s vocabulary, sorted.
fn eog_tokens(model: &LlamaModel) -> Vec<i32> {
    let vocab = model.vocab();
    (0..model.n_vocab())
        .filter(|&t| vocab.is_eog(LlamaToken(t)))
        .collect()
}

/// Bans the end-of-generation tokens `eog` for `ignore_eos` requests.
fn eos_ban(model: &LlamaModel, eog: &[i32], req: &GenerateRequest) -> Option<LlamaSampler> {
    req.ignore_eos.then(|| {
        let bans: Vec<LlamaLogitBias> = eog
            .iter()
            .map(|&t| LlamaLogitBias::new(LlamaToken(t), f32::NEG_INFINITY))
            .collect();
        LlamaSampler::logit_bias(model.n_vocab(), &bans)
    })
}

/// Lanes of [`top2`]'s scan: enough for two 8-wide vector registers per value.
const LANES: usize = 16;

/// One pass over a logits row: the index of its first largest value, that value, and the
/// second largest value (equal to the largest when it occurs twice; `-inf` for a row of one
/// value). NaN is never chosen. The scan keeps a best value, its index and a second value
/// per lane, without branches, and merges the lanes at the end. On a Llama-3 vocabulary
/// (128,256 logits) it took 0.5-0.8x the time of a branching scan on the 2-core VM
/// (x86-64 baseline); the saving that matters is skipping the sampler chain's copy.
pub(crate) fn top2(logits: &[f32]) -> (usize, f32, f32) {
    let mut best = [f32::NEG_INFINITY; LANES];
    let mut second = [f32::NEG_INFINITY; LANES];
    let mut at = [u32::MAX; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    for (c, chunk) in chunks.enumerate() {
        let base = (c * LANES) as u32;
        for l in 0..LANES {
            let x = chunk[l];
            let above = x > best[l];
            second[l] = if above {
                best[l]
            } else if x > second[l] {
                x
            } else {
                second[l]
            };
            at[l] = if above { base + l as u32 } else { at[l] };
            best[l] = if above { x } else { best[l] };
        }
    }
    // The tail joins lane 0 (its indices are the largest, so ties still go to the first).
    let base = (logits.len() - tail.len()) as u32;
    for (i, &x) in tail.iter().enumerate() {
        if x > best[0] {
            second[0] = best[0];
            best[0] = x;
            at[0] = base + i as u32;
        } else if x > second[0] {
            second[0] = x;
        }
    }
    let mut win = 0;
    for l in 1..LANES {
        if best[l] > best[win] || (best[l] == best[win] && at[l] < at[win]) {
            win = l;
        }
    }
    let mut runner_up = second[win];
    for l in 0..LANES {
        if l != win {
            runner_up = runner_up.max(best[l]);
        }
    }
    let index = if at[win] == u32::MAX {
        0
    } else {
        at[win] as usize
    };
    (index, best[win], runner_up)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The branching scan `top2` replaces: first index of the largest, largest, second.
    fn reference(logits: &[f32]) -> (usize, f32, f32) {
        let (mut i, mut a, mut b) = (0, f32::NEG_INFINITY, f32::NEG_INFINITY);
        for (j, &x) in logits.iter().enumerate() {
            if x > a {
                b = a;
                a = x;
                i = j;
            } else if x > b {
                b = x;
            }
        }
        (i, a, b)
    }

    fn same(logits: &[f32]) {
        let (i, a, b) = top2(logits);
        let (ri, ra, rb) = reference(logits);
        assert_eq!(
            (i, a.to_bits(), b.to_bits()),
            (ri, ra.to_bits(), rb.to_bits()),
            "{logits:?}"
        );
    }

    #[test]
    fn top2_equals_a_plain_scan_on_random_rows_of_every_tail_length() {
        let mut rng = SmallRng::seed_from_u64(7);
        for len in (1..70).chain([3072, 128_256]) {
            let row: Vec<f32> = (0..len).map(|_| rng.random_range(-20.0..20.0)).collect();
            same(&row);
        }
    }

    #[test]
    fn top2_takes_the_first_of_equal_largest_logits_with_a_zero_margin() {
        let mut row = vec![0.0f32; 100];
        row[37] = 5.0;
        row[90] = 5.0;
        row[3] = 4.0;
        assert_eq!(top2(&row), (37, 5.0, 5.0));
        // Ties in the same lane and in the tail.
        let mut row = vec![-1.0f32; 35];
        row[33] = 2.0;
        row[17] = 2.0;
        row[1] = 2.0;
        assert_eq!(top2(&row), (1, 2.0, 2.0));
        same(&row);
    }

    #[test]
    fn top2_skips_nan_and_handles_infinite_and_single_rows() {
        let mut row = vec![1.0f32; 40];
        row[5] = f32::NAN;
        row[20] = 3.0;
        assert_eq!(top2(&row), (20, 3.0, 1.0));
        let mut row = vec![f32::NEG_INFINITY; 40];
        row[39] = 0.5;
        assert_eq!(top2(&row), (39, 0.5, f32::NEG_INFINITY));
        assert_eq!(top2(&[2.0]), (0, 2.0, f32::NEG_INFINITY));
    }
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
