//! GGUF variants of a tier: requantizing a model file with llama.cpp's
//! `llama_model_quantize` (llama-cpp-2 does not wrap it, so this goes through the sys crate).
//!
//! The bundled tiers ship as `q8_0`; other variants are made from that file, which is
//! requantization (llama.cpp's `--allow-requantize`): every tensor is dequantized from q8_0
//! and quantized again, so a q4_0 made this way is slightly worse than one made from the f16
//! weights. A variant is named `<tier>-<type>.gguf` and lives next to the tier's file
//! ([`variant_path`]), which is where the quantization policy looks for it.

use std::ffi::CString;
use std::path::{Path, PathBuf};

use crate::TierError;

/// A weight type llama.cpp can quantize a model to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightType {
    /// 16-bit floats (no quantization; from q8_0 this only widens the q8_0 values).
    F16,
    /// 8-bit blocks (the bundled form).
    Q8_0,
    /// 6-bit k-quant.
    Q6K,
    /// 5-bit blocks.
    Q5_0,
    /// 5-bit k-quant, medium.
    Q5KM,
    /// 4-bit blocks.
    Q4_0,
    /// 4-bit k-quant, medium.
    Q4KM,
}

impl WeightType {
    /// Every type, in the order `mesh quantize --help` lists them.
    pub const ALL: [WeightType; 7] = [
        WeightType::F16,
        WeightType::Q8_0,
        WeightType::Q6K,
        WeightType::Q5_0,
        WeightType::Q5KM,
        WeightType::Q4_0,
        WeightType::Q4KM,
    ];

    /// The name in file names and on the command line (`q4_0`).
    pub fn as_str(self) -> &'static str {
        match self {
            WeightType::F16 => "f16",
            WeightType::Q8_0 => "q8_0",
            WeightType::Q6K => "q6_k",
            WeightType::Q5_0 => "q5_0",
            WeightType::Q5KM => "q5_k_m",
            WeightType::Q4_0 => "q4_0",
            WeightType::Q4KM => "q4_k_m",
        }
    }

    /// The type of a name (case-insensitive).
    pub fn parse(name: &str) -> Result<Self, TierError> {
        let n = name.to_ascii_lowercase();
        Self::ALL
            .into_iter()
            .find(|t| t.as_str() == n)
            .ok_or_else(|| {
                let known: Vec<&str> = Self::ALL.iter().map(|t| t.as_str()).collect();
                TierError::Config(format!(
                    "unknown weight type `{name}` (known: {})",
                    known.join(", ")
                ))
            })
    }

    fn ftype(self) -> llama_cpp_sys_2::llama_ftype {
        use llama_cpp_sys_2 as sys;
        match self {
            WeightType::F16 => sys::LLAMA_FTYPE_MOSTLY_F16,
            WeightType::Q8_0 => sys::LLAMA_FTYPE_MOSTLY_Q8_0,
            WeightType::Q6K => sys::LLAMA_FTYPE_MOSTLY_Q6_K,
            WeightType::Q5_0 => sys::LLAMA_FTYPE_MOSTLY_Q5_0,
            WeightType::Q5KM => sys::LLAMA_FTYPE_MOSTLY_Q5_K_M,
            WeightType::Q4_0 => sys::LLAMA_FTYPE_MOSTLY_Q4_0,
            WeightType::Q4KM => sys::LLAMA_FTYPE_MOSTLY_Q4_K_M,
        }
    }
}

/// `<dir of model>/<tier>-<variant>.gguf`: where the variant `variant` of the tier whose
/// file is `model` lives.
pub fn variant_path(model: &Path, tier: &str, variant: &str) -> PathBuf {
    let dir = model.parent().unwrap_or(Path::new(""));
    dir.join(format!("{tier}-{variant}.gguf"))
}

/// Writes `output`, the model of `input` quantized to `to`, using `threads` threads
/// (0: all cores). Blocking (t1 to q4_0: 0.1 s on this 2-core VM). Requantizes an
/// already quantized input (the bundled q8_0). A failed run leaves no `output` behind.
pub fn quantize(
    input: &Path,
    output: &Path,
    to: WeightType,
    threads: i32,
) -> Result<(), TierError> {
    let fail = |reason: String| TierError::ModelLoad {
        path: input.display().to_string(),
        reason,
    };
    if !input.is_file() {
        return Err(fail("no such file".into()));
    }
    if output.exists() && output.canonicalize().ok() == input.canonicalize().ok() {
        return Err(fail("the output would overwrite the input".into()));
    }
    let cstr = |p: &Path| {
        CString::new(p.to_string_lossy().as_bytes()).map_err(|_| fail("path holds a NUL".into()))
    };
    let (inp, out) = (cstr(input)?, cstr(output)?);
    crate::backend();
    // SAFETY: the default parameters are plain values; the pointers passed to
    // llama_model_quantize are valid NUL-terminated strings and a live params struct for
    // the whole call, and the optional pointer fields stay null as the defaults set them.
    let rc = unsafe {
        let mut params = llama_cpp_sys_2::llama_model_quantize_default_params();
        params.nthread = threads;
        params.ftype = to.ftype();
        params.allow_requantize = true;
        llama_cpp_sys_2::llama_model_quantize(inp.as_ptr(), out.as_ptr(), &params)
    };
    if rc != 0 {
        let _ = std::fs::remove_file(output);
        return Err(fail(format!(
            "llama_model_quantize to {} failed (code {rc})",
            to.as_str()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_ones_list_the_known() {
        for t in WeightType::ALL {
            assert_eq!(WeightType::parse(t.as_str()).unwrap(), t);
        }
        assert_eq!(WeightType::parse("Q4_0").unwrap(), WeightType::Q4_0);
        let e = WeightType::parse("q3").unwrap_err().to_string();
        assert!(e.contains("q4_0") && e.contains("`q3`"), "{e}");
    }

    #[test]
    fn variants_sit_next_to_the_tier_file() {
        assert_eq!(
            variant_path(Path::new("models/t3-q8_0.gguf"), "t3", "q4_0"),
            Path::new("models/t3-q4_0.gguf")
        );
        assert_eq!(
            variant_path(Path::new("t1.gguf"), "t1", "f16"),
            Path::new("t1-f16.gguf")
        );
    }
}
