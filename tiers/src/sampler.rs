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
//! Sampled requests keep the grammar inside the chain: drawing first and checking after
//! would change the distribution (and the seeded draws) of a constrained request.

use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::sampling::LlamaSampler;
use llama_cpp_2::token::data::LlamaTokenData;
use llama_cpp_2::token::data_array::LlamaTokenDataArray;
use llama_cpp_2::token::logit_bias::LlamaLogitBias;
use llama_cpp_2::token::LlamaToken;

use crate::{GenerateRequest, TierError};

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
        let s = &req.sampling;
        let mut chain = Vec::new();
        if req.ignore_eos {
            let vocab = model.vocab();
            let bans: Vec<LlamaLogitBias> = (0..model.n_vocab())
                .map(LlamaToken)
                .filter(|&t| vocab.is_eog(t))
                .map(|t| LlamaLogitBias::new(t, f32::NEG_INFINITY))
                .collect();
            chain.push(LlamaSampler::logit_bias(model.n_vocab(), &bans));
        }
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
        let greedy = s.temperature <= 0.0;
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
            if s.top_k > 0 {
                chain.push(LlamaSampler::top_k(s.top_k));
            }
            if s.top_p < 1.0 {
                chain.push(LlamaSampler::top_p(s.top_p, 1));
            }
            chain.push(LlamaSampler::temp(s.temperature));
            chain.push(LlamaSampler::dist(s.seed));
        }
        Ok(Self {
            chain: LlamaSampler::chain_simple(chain),
            grammar: checked,
        })
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

    /// Accepts a token chosen elsewhere (the reasoning governor's `</think>`).
    pub(crate) fn accept(&mut self, tok: LlamaToken) {
        if let Some(g) = &mut self.grammar {
            g.accept(tok);
        }
        self.chain.accept(tok);
    }
}
