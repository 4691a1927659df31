//! Setting up llama.cpp for a tier: the model's placement and vocabulary markers, the
//! draft model, contexts, the page store and the chat format.

use std::ffi::CString;
use std::num::NonZeroU32;
use std::pin::Pin;

use llama_cpp_2::context::params::{KvCacheType, LlamaContextParams};
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;
use tracing::{info, warn};

use super::backend;
use crate::format::{ChatFormat, FormatError, SpecialTokens};
use crate::kvcache::KvCache;
use crate::markers::Markers;
use crate::{DraftConfig, EngineConfig, KvType, TierError};

/// The control and user-defined tokens of `model`'s vocabulary, as markers.
pub(super) fn vocab_markers(model: &LlamaModel) -> Markers {
    use llama_cpp_2::token_type::LlamaTokenAttr;
    let vocab = model.vocab();
    Markers::new(vocab.tokens().filter_map(|t| {
        let attr = vocab.attr(t);
        if !(attr.contains(LlamaTokenAttr::Control) || attr.contains(LlamaTokenAttr::UserDefined)) {
            return None;
        }
        let text = vocab.text(t)?.to_str().ok()?.to_owned();
        Some((text, t.0))
    }))
}

/// A model's placement as llama.cpp takes it: the parameters, and the tensor-name patterns
/// their buffer-type overrides point at.
pub(super) struct Placement {
    params: Pin<Box<LlamaModelParams>>,
    /// Read by llama.cpp through raw pointers in `params` while a model loads: kept alive
    /// beside them (a `CString`'s bytes stay where they are when the vector moves) and
    /// dropped after them.
    _patterns: Vec<CString>,
}

impl std::ops::Deref for Placement {
    type Target = LlamaModelParams;

    fn deref(&self) -> &LlamaModelParams {
        &self.params
    }
}

/// Where the tier's layers go: `gpu_layers` of them to the GPUs llama.cpp has (all of them,
/// or the one `gpu` names), except the tensors `cpu_moe` and `cpu_tensors` keep in host
/// memory. Without a GPU llama.cpp keeps everything on the CPU.
pub(super) fn model_params(cfg: &EngineConfig) -> Result<Placement, TierError> {
    let mut p = LlamaModelParams::default();
    if let crate::GpuLayers::Count(n) = cfg.gpu_layers {
        p = p.with_n_gpu_layers(n);
    }
    if let Some(gpu) = cfg.gpu {
        let index = crate::gpu::gpu_device_index(&crate::gpu::devices(), gpu)
            .map_err(|e| TierError::Config(format!("{}: {e}", cfg.name)))?;
        p = p
            .with_split_mode(llama_cpp_2::model::params::LlamaSplitMode::None)
            .with_main_gpu(0)
            .with_devices(&[index])
            .map_err(|e| TierError::Config(format!("{}: gpu {gpu}: {e}", cfg.name)))?;
    }
    let patterns = cfg
        .cpu_patterns()
        .into_iter()
        .map(|s| {
            CString::new(s)
                .map_err(|e| TierError::Config(format!("{}: cpu_tensors: {e}", cfg.name)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut params = Box::pin(p);
    for c in &patterns {
        params.as_mut().add_cpu_buft_override(c);
    }
    if !patterns.is_empty() {
        info!(tier = %cfg.name, patterns = ?cfg.cpu_patterns(), "tensors kept in host memory");
    }
    Ok(Placement {
        params,
        _patterns: patterns,
    })
}

/// Loads the draft model with the target's placement (`params`).
pub(super) fn load_draft(
    target: &LlamaModel,
    d: &DraftConfig,
    params: &LlamaModelParams,
) -> Result<LlamaModel, TierError> {
    let path = d.model.display().to_string();
    if !d.model.exists() {
        return Err(TierError::ModelLoad {
            path,
            reason: "draft model file not found".into(),
        });
    }
    let m = LlamaModel::load_from_file(backend(), &d.model, params).map_err(|e| {
        TierError::ModelLoad {
            path: path.clone(),
            reason: e.to_string(),
        }
    })?;
    if m.n_vocab() != target.n_vocab() {
        return Err(TierError::Config(format!(
            "draft {path}: vocabulary of {} tokens, the target has {}",
            m.n_vocab(),
            target.n_vocab()
        )));
    }
    Ok(m)
}

/// A context for `model` with the tier's settings and `(threads, threads_batch)`:
/// llama.cpp runs one-token decodes on the first, larger batches on the second.
pub(super) fn new_context<'m>(
    model: &'m LlamaModel,
    cfg: &EngineConfig,
    (threads, threads_batch): (i32, i32),
) -> Result<LlamaContext<'m>, TierError> {
    let kv = match cfg.kv_type {
        KvType::F16 => KvCacheType::F16,
        KvType::Q8_0 => KvCacheType::Q8_0,
        KvType::Q4_0 => KvCacheType::Q4_0,
    };
    let params = LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(cfg.n_ctx))
        .with_n_batch(cfg.n_batch)
        .with_n_ubatch(cfg.n_batch)
        .with_n_seq_max(cfg.n_seq_max)
        .with_kv_unified(cfg.kv_unified)
        .with_n_threads(threads)
        .with_n_threads_batch(threads_batch)
        .with_type_k(kv)
        .with_type_v(kv);
    model
        .new_context(backend(), params)
        .map_err(|e| TierError::Context(e.to_string()))
}

/// Threads of the draft context: llama.cpp's `n_threads` (one-token decodes) and
/// `n_threads_batch` (larger ones). 0 in the config: one-token decodes on one thread when
/// the tier has at most two, else the tier's count; batches on the tier's count.
pub(super) fn draft_threads(cfg: &EngineConfig, d: &DraftConfig) -> (i32, i32) {
    let one = match d.threads {
        0 if cfg.threads <= 2 => 1,
        0 => cfg.threads,
        n => n,
    };
    let batch = if d.threads_batch > 0 {
        d.threads_batch
    } else {
        cfg.threads
    };
    (one, batch)
}

/// Learns the KV layout (one probe token in sequence 0, then cleared) and opens the page
/// store. Paging is switched off, with a warning, if any of it fails.
pub(super) fn start_pages(
    model: &LlamaModel,
    ctx: &mut LlamaContext<'_>,
    cfg: &EngineConfig,
    worker: Option<crate::kvcache::Worker>,
) -> Option<KvCache> {
    if cfg.kv_pages.block == 0 {
        return None;
    }
    let mut batch = LlamaBatch::new(1, 1);
    let tok = model.vocab().bos();
    let layout = batch
        .add(tok, 0, &[0], true)
        .ok()
        .and_then(|_| ctx.decode(&mut batch).ok())
        .and_then(|_| KvCache::probe_layout(ctx, 0));
    let _ = ctx.clear_kv_cache_seq(Some(0), None, None);
    let Some(layout) = layout else {
        warn!(tier = %cfg.name, "could not read the KV layout; prefix pages off");
        return None;
    };
    let opener = cfg
        .page_store
        .as_ref()
        .map(|p| (p.opener.as_ref(), p.namespace.as_str()));
    match KvCache::new(
        &cfg.kv_pages,
        &cfg.model,
        layout,
        cfg.kv_far_memory.clone(),
        opener,
        worker,
    ) {
        Ok(k) => Some(k),
        Err(e) => {
            warn!(tier = %cfg.name, error = %e, "prefix pages off");
            None
        }
    }
}

/// Whether a GGUF's metadata (`meta`: key → value as text) describes an embedding model,
/// which pools its outputs instead of predicting tokens: its architecture and pooling, else
/// `None`. llama.cpp writes `{arch}.pooling_type` for BERT-style encoders (nomic-bert,
/// MiniLM) and embedding variants of decoders; 0 is "none".
pub(super) fn embedding_only(meta: impl Fn(&str) -> Option<String>) -> Option<String> {
    let arch = meta("general.architecture")?;
    let pooling = meta(&format!("{arch}.pooling_type"))?;
    let causal = meta(&format!("{arch}.attention.causal"));
    (pooling.trim() != "0" || causal.as_deref() == Some("false"))
        .then(|| format!("{arch}, pooling type {pooling}"))
}

/// The tier's chat format: its `chat_template` (a file or a built-in name), else the
/// GGUF's template, else ChatML. A GGUF template minijinja cannot compile falls back to
/// ChatML with a warning (the tier still chats); a configured one that fails is an error.
pub(super) fn chat_format(model: &LlamaModel, cfg: &EngineConfig) -> Result<ChatFormat, TierError> {
    let vocab = model.vocab();
    let piece =
        |t: LlamaToken| String::from_utf8_lossy(&vocab.token_to_piece(t, true, None)).into_owned();
    let single = |s: &str| matches!(vocab.tokenize(s.as_bytes(), false, true)[..], [_]);
    let tokens = SpecialTokens {
        bos: piece(vocab.bos()),
        eos: piece(vocab.eos()),
        add_bos: vocab.should_add_bos(),
        think_tokens: single("<think>") && single("</think>"),
    };
    let fail = |e: FormatError| TierError::Config(format!("{}: {e}", cfg.name));
    let f = match &cfg.chat_template {
        Some(t) => {
            let (source, origin) = match crate::format::builtin_template(t) {
                Some(src) => (src.to_owned(), t.clone()),
                None => (
                    std::fs::read_to_string(t).map_err(|e| {
                        TierError::Config(format!("{}: chat_template {t}: {e}", cfg.name))
                    })?,
                    t.clone(),
                ),
            };
            ChatFormat::new(&source, &origin, tokens).map_err(fail)?
        }
        None => match model.chat_template(None).ok().and_then(|t| t.to_string().ok()) {
            Some(src) => ChatFormat::new(&src, "gguf", tokens.clone()).or_else(|e| {
                warn!(tier = %cfg.name, error = %e, "the GGUF's chat template does not compile here; using ChatML (set chat_template to a file to override)");
                ChatFormat::new(crate::format::CHATML_TEMPLATE, "chatml", tokens)
            }).map_err(fail)?,
            None => {
                info!(tier = %cfg.name, "the GGUF has no chat template; using ChatML");
                ChatFormat::new(crate::format::CHATML_TEMPLATE, "chatml", tokens).map_err(fail)?
            }
        },
    };
    let (spec, shows) = (f.spec(), f.shows());
    info!(tier = %cfg.name, template = %spec.template, tool_syntax = spec.syntax.as_str(),
        reasoning = spec.think.is_some(), template_shows_tools = spec.template_tools,
        template_shows_calls = shows.calls, template_shows_results = shows.results,
        template_shows_system = shows.system, "chat format");
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(key, _)| *key == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn a_pooling_encoder_is_an_embedding_model() {
        let m = meta(&[
            ("general.architecture", "nomic-bert"),
            ("nomic-bert.pooling_type", "1"),
        ]);
        assert_eq!(
            embedding_only(m).as_deref(),
            Some("nomic-bert, pooling type 1")
        );
    }

    #[test]
    fn a_decoder_without_pooling_generates_text() {
        let m = meta(&[("general.architecture", "qwen2")]);
        assert_eq!(embedding_only(m), None);
    }

    #[test]
    fn pooling_none_generates_text() {
        let m = meta(&[
            ("general.architecture", "llama"),
            ("llama.pooling_type", "0"),
        ]);
        assert_eq!(embedding_only(m), None);
    }

    #[test]
    fn draft_threads_default_to_one_for_small_tiers_and_follow_the_config() {
        let tier = |threads| EngineConfig {
            threads,
            ..EngineConfig::default()
        };
        let auto = DraftConfig::default();
        assert_eq!(draft_threads(&tier(1), &auto), (1, 1));
        assert_eq!(draft_threads(&tier(2), &auto), (1, 2));
        assert_eq!(draft_threads(&tier(8), &auto), (8, 8));
        let set = DraftConfig {
            threads: 3,
            threads_batch: 5,
            ..DraftConfig::default()
        };
        assert_eq!(draft_threads(&tier(8), &set), (3, 5));
        assert_eq!(draft_threads(&tier(2), &set), (3, 5));
    }
}
