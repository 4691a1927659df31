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
pub fn tier_device_bytes(
    cfg: &EngineConfig,
    shape: &ModelShape,
    draft: Option<&ModelShape>,
) -> u64 {
    let share = |s: &ModelShape, kv: KvType| -> f64 {
        let whole = s.file_bytes + u64::from(cfg.n_ctx) * s.kv_bytes_per_cell(kv);
        whole as f64 * offloaded_share(cfg.gpu_layers, s.n_layer)
    };
    let mut bytes = share(shape, cfg.kv_type);
    if bytes == 0.0 {
        return 0;
    }
    if let (Some(d), Some(_)) = (draft, &cfg.draft) {
        bytes += share(d, KvType::F16);
    }
    bytes.ceil() as u64 + GPU_CONTEXT_OVERHEAD_BYTES
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
            tier_device_bytes(&half, &shape(), None),
            whole / 2 + GPU_CONTEXT_OVERHEAD_BYTES
        );
    }

    #[test]
    fn a_tier_kept_on_the_cpu_takes_no_device_memory() {
        let cpu = EngineConfig {
            gpu_layers: crate::GpuLayers::Count(0),
            ..EngineConfig::default()
        };
        assert_eq!(tier_device_bytes(&cpu, &shape(), None), 0);
    }
}
