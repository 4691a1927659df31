//! A model's shape as llama.cpp reads it from the GGUF header, and the memory a tier
//! needs for it: what deployment files request per node.

use std::path::Path;

use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;

use crate::{EngineConfig, KvType, TierError};

/// The parts of a model's hyper-parameters that size its memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ModelShape {
    /// Bytes of the GGUF file (the weights are mapped or loaded whole).
    pub file_bytes: u64,
    /// Transformer layers.
    pub n_layer: u32,
    /// Embedding width.
    pub n_embd: u32,
    /// Attention heads.
    pub n_head: u32,
    /// Key/value heads (fewer than `n_head` with grouped-query attention).
    pub n_head_kv: u32,
}

impl ModelShape {
    /// Reads the shape from `path`. The weights are memory-mapped, not read (llama.cpp's
    /// `vocab_only` load leaves the per-layer hyper-parameters empty, so it cannot be used).
    pub fn read(path: &Path) -> Result<Self, TierError> {
        let file_bytes = std::fs::metadata(path)
            .map_err(|e| TierError::ModelLoad {
                path: path.display().to_string(),
                reason: e.to_string(),
            })?
            .len();
        // On the CPU: reading a shape must not take device memory.
        let params = LlamaModelParams::default().with_n_gpu_layers(0);
        let model = LlamaModel::load_from_file(crate::backend(), path, &params).map_err(|e| {
            TierError::ModelLoad {
                path: path.display().to_string(),
                reason: e.to_string(),
            }
        })?;
        Ok(Self {
            file_bytes,
            n_layer: model.n_layer(),
            n_embd: model.n_embd().max(0) as u32,
            n_head: model.n_head(),
            n_head_kv: model.n_head_kv(),
        })
    }

    /// KV cache bytes per cell (one token of one sequence) at `kv`: keys and values of
    /// every layer, `n_embd / n_head * n_head_kv` wide each.
    pub fn kv_bytes_per_cell(&self, kv: KvType) -> u64 {
        let head = u64::from(self.n_embd) / u64::from(self.n_head.max(1));
        let width = head * u64::from(self.n_head_kv);
        let elems = 2 * u64::from(self.n_layer) * width;
        // ggml block sizes: f16 2 bytes; q8_0 34 bytes per 32; q4_0 18 bytes per 32.
        match kv {
            KvType::F16 => elems * 2,
            KvType::Q8_0 => elems.div_ceil(32) * 34,
            KvType::Q4_0 => elems.div_ceil(32) * 18,
        }
    }
}

/// Working buffers a llama.cpp context allocates beside weights and KV (compute graph,
/// logits), as a flat allowance per tier: measured RSS of the bundled tiers stays under it.
pub const CONTEXT_OVERHEAD_BYTES: u64 = 96 << 20;

/// Memory one tier needs: its weights, a full KV cache (`n_ctx` cells), the RAM budget
/// of its prefix pages, a draft model's weights and KV when it drafts, and the context
/// allowance.
pub fn tier_memory_bytes(
    cfg: &EngineConfig,
    shape: &ModelShape,
    draft: Option<&ModelShape>,
) -> u64 {
    let mut bytes = shape.file_bytes
        + u64::from(cfg.n_ctx) * shape.kv_bytes_per_cell(cfg.kv_type)
        + cfg.kv_pages.ram_bytes
        + CONTEXT_OVERHEAD_BYTES;
    if let (Some(d), Some(_)) = (draft, &cfg.draft) {
        bytes += d.file_bytes + u64::from(cfg.n_ctx) * d.kv_bytes_per_cell(KvType::F16);
    }
    bytes
}

/// Device working buffers of a tier on a GPU (compute graph, logits) as a flat allowance per
/// tier. Not measured per model: an allowance of the order llama.cpp's CUDA compute buffers
/// take for 1-8B models at 512-token micro-batches.
pub const GPU_CONTEXT_OVERHEAD_BYTES: u64 = 1 << 30;

/// The share of a model's layers `gpu_layers` puts on a GPU, in 0..=1.
fn offloaded_share(gpu_layers: crate::GpuLayers, n_layer: u32) -> f64 {
    match gpu_layers {
        crate::GpuLayers::All => 1.0,
        crate::GpuLayers::Count(n) => f64::from(n.min(n_layer)) / f64::from(n_layer.max(1)),
    }
}

/// Device memory a tier takes on a GPU: the offloaded share (`gpu_layers`) of its weights
/// and of a full KV cache (`n_ctx` cells), a draft model's likewise (it loads with the
/// target's placement), and [`GPU_CONTEXT_OVERHEAD_BYTES`]. 0 for a tier kept on the CPU.
/// `host_kept` is the bytes of the tier's weights its `cpu_moe` / `cpu_tensors` keep in
/// host memory ([`host_kept_bytes`]), which the device does not hold.
pub fn tier_device_bytes(
    cfg: &EngineConfig,
    shape: &ModelShape,
    draft: Option<&ModelShape>,
    host_kept: u64,
) -> u64 {
    let share = |s: &ModelShape, kv: KvType, kept: u64| -> f64 {
        let whole =
            s.file_bytes.saturating_sub(kept) + u64::from(cfg.n_ctx) * s.kv_bytes_per_cell(kv);
        whole as f64 * offloaded_share(cfg.gpu_layers, s.n_layer)
    };
    let mut bytes = share(shape, cfg.kv_type, host_kept);
    if bytes == 0.0 {
        return 0;
    }
    if let (Some(d), Some(_)) = (draft, &cfg.draft) {
        bytes += share(d, KvType::F16, 0);
    }
    bytes.ceil() as u64 + GPU_CONTEXT_OVERHEAD_BYTES
}

/// Names and sizes in bytes of a GGUF's tensors, from its header (no weights are read).
pub fn tensor_sizes(path: &Path) -> Result<Vec<(String, u64)>, TierError> {
    let fail = |reason: String| TierError::ModelLoad {
        path: path.display().to_string(),
        reason,
    };
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|e| fail(e.to_string()))?;
    let params = llama_cpp_sys_2::gguf_init_params {
        no_alloc: true,
        ctx: std::ptr::null_mut(),
    };
    // SAFETY: `c` is a NUL-terminated path; with `no_alloc` and no ggml context gguf reads
    // the header only. The context is freed below, after its strings were copied out.
    let ctx = unsafe { llama_cpp_sys_2::gguf_init_from_file(c.as_ptr(), params) };
    if ctx.is_null() {
        return Err(fail("not a readable GGUF file".into()));
    }
    let mut out = Vec::new();
    // SAFETY: `ctx` is a valid gguf context; ids are in 0..n; names are NUL-terminated
    // strings owned by the context, copied before it is freed.
    unsafe {
        let n = llama_cpp_sys_2::gguf_get_n_tensors(ctx);
        for i in 0..n {
            let name = std::ffi::CStr::from_ptr(llama_cpp_sys_2::gguf_get_tensor_name(ctx, i));
            let size = llama_cpp_sys_2::gguf_get_tensor_size(ctx, i) as u64;
            out.push((name.to_string_lossy().into_owned(), size));
        }
        llama_cpp_sys_2::gguf_free(ctx);
    }
    Ok(out)
}

/// Bytes of the tensors whose names contain a match of any of `patterns` (searched, as
/// llama.cpp applies its buffer-type overrides). Patterns that do not compile match nothing
/// (the tier's config check refuses them first).
pub fn bytes_matching(tensors: &[(String, u64)], patterns: &[String]) -> u64 {
    let res: Vec<regex::Regex> = patterns
        .iter()
        .filter_map(|p| regex::Regex::new(p).ok())
        .collect();
    tensors
        .iter()
        .filter(|(name, _)| res.iter().any(|r| r.is_match(name)))
        .map(|(_, bytes)| bytes)
        .sum()
}

/// Bytes of `cfg`'s model that its `cpu_moe` and `cpu_tensors` keep in host memory; 0
/// when it keeps none or the file's header cannot be read.
pub fn host_kept_bytes(cfg: &EngineConfig) -> u64 {
    let patterns = cfg.cpu_patterns();
    if patterns.is_empty() {
        return 0;
    }
    tensor_sizes(&cfg.model).map_or(0, |t| bytes_matching(&t, &patterns))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> ModelShape {
        // Llama-3.2-1B: 16 layers, 2048 wide, 32 heads, 8 KV heads.
        ModelShape {
            file_bytes: 1 << 30,
            n_layer: 16,
            n_embd: 2048,
            n_head: 32,
            n_head_kv: 8,
        }
    }

    #[test]
    fn kv_bytes_per_cell_follow_grouped_query_attention() {
        // 2 (K,V) x 16 layers x 512 wide x 2 bytes = 32 KiB, llama.cpp's figure for 1B.
        assert_eq!(shape().kv_bytes_per_cell(KvType::F16), 32 << 10);
    }

    #[test]
    fn quantized_kv_takes_ggml_block_sizes() {
        let s = shape();
        assert_eq!(s.kv_bytes_per_cell(KvType::Q8_0), 16384 / 32 * 34);
        assert_eq!(s.kv_bytes_per_cell(KvType::Q4_0), 16384 / 32 * 18);
    }

    #[test]
    fn tier_memory_adds_weights_kv_pages_and_overhead() {
        let cfg = EngineConfig {
            n_ctx: 4096,
            draft: None,
            ..EngineConfig::default()
        };
        let want = (1 << 30) + 4096 * (32 << 10) + cfg.kv_pages.ram_bytes + CONTEXT_OVERHEAD_BYTES;
        assert_eq!(tier_memory_bytes(&cfg, &shape(), None), want);
    }

    #[test]
    fn device_bytes_take_the_offloaded_share_of_weights_and_kv() {
        let half = EngineConfig {
            n_ctx: 4096,
            draft: None,
            gpu_layers: crate::GpuLayers::Count(8),
            ..EngineConfig::default()
        };
        let whole = (1u64 << 30) + 4096 * (32 << 10);
        assert_eq!(
            tier_device_bytes(&half, &shape(), None, 0),
            whole / 2 + GPU_CONTEXT_OVERHEAD_BYTES
        );
    }

    #[test]
    fn a_tier_kept_on_the_cpu_takes_no_device_memory() {
        let cpu = EngineConfig {
            gpu_layers: crate::GpuLayers::Count(0),
            ..EngineConfig::default()
        };
        assert_eq!(tier_device_bytes(&cpu, &shape(), None, 0), 0);
    }

    fn moe_tensors() -> Vec<(String, u64)> {
        let mut t = vec![("token_embd.weight".to_owned(), 100)];
        for i in [0, 1, 10] {
            t.push((format!("blk.{i}.attn_q.weight"), 10));
            for p in ["gate", "up", "down"] {
                t.push((format!("blk.{i}.ffn_{p}_exps.weight"), 1000));
            }
            t.push((format!("blk.{i}.ffn_gate_inp.weight"), 1));
        }
        t
    }

    #[test]
    fn cpu_moe_all_counts_every_expert_tensor_and_nothing_else() {
        let kept = bytes_matching(&moe_tensors(), &crate::CpuMoe::All.patterns());
        assert_eq!(kept, 9 * 1000);
    }

    #[test]
    fn cpu_moe_of_two_layers_leaves_layer_ten_on_the_device() {
        let kept = bytes_matching(&moe_tensors(), &crate::CpuMoe::First(2).patterns());
        assert_eq!(kept, 6 * 1000);
    }

    #[test]
    fn weights_kept_in_host_memory_leave_the_device_estimate() {
        let cfg = EngineConfig {
            n_ctx: 4096,
            draft: None,
            ..EngineConfig::default()
        };
        let all = tier_device_bytes(&cfg, &shape(), None, 0);
        let kept = tier_device_bytes(&cfg, &shape(), None, 600 << 20);
        assert_eq!(all - kept, 600 << 20);
    }
}
