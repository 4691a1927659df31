//! Reads the scalar metadata of a GGUF file header, to record what model ran.

use std::io::{BufReader, Read};
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::{Map, Value};

/// Scalar metadata of a GGUF file, without the tokenizer tables.
pub(crate) struct GgufInfo {
    pub(crate) version: u32,
    pub(crate) tensors: u64,
    pub(crate) metadata: Map<String, Value>,
}

impl GgufInfo {
    /// llama.cpp's name for `general.file_type` (e.g. `Q8_0`).
    pub(crate) fn file_type(&self) -> Option<String> {
        let t = self.metadata.get("general.file_type")?.as_u64()?;
        Some(file_type_name(t))
    }
}

/// Reads the header of `path`.
pub(crate) fn read(path: &Path) -> Result<GgufInfo> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut r = BufReader::new(file);
    let mut magic = [0u8; 4];
    r.read_exact(&mut magic)?;
    if &magic != b"GGUF" {
        bail!("{} is not a GGUF file", path.display());
    }
    let version = read_u32(&mut r)?;
    if version < 2 {
        bail!("GGUF version {version} is not supported (need 2 or later)");
    }
    let tensors = read_u64(&mut r)?;
    let n_kv = read_u64(&mut r)?;
    let mut metadata = Map::new();
    for _ in 0..n_kv {
        let key = read_string(&mut r)?;
        let ty = read_u32(&mut r)?;
        let value = read_value(&mut r, ty).with_context(|| format!("reading GGUF key {key}"))?;
        if let Some(v) = value {
            if !key.starts_with("tokenizer.") {
                metadata.insert(key, v);
            }
        }
    }
    Ok(GgufInfo {
        version,
        tensors,
        metadata,
    })
}

/// Reads one value; arrays are skipped (`None`), as only scalars are recorded.
fn read_value(r: &mut impl Read, ty: u32) -> Result<Option<Value>> {
    let v = match ty {
        0 => Value::from(read_n::<1>(r)?[0]),
        1 => Value::from(read_n::<1>(r)?[0] as i8),
        2 => Value::from(u16::from_le_bytes(read_n(r)?)),
        3 => Value::from(i16::from_le_bytes(read_n(r)?)),
        4 => Value::from(read_u32(r)?),
        5 => Value::from(i32::from_le_bytes(read_n(r)?)),
        6 => Value::from(f32::from_le_bytes(read_n(r)?)),
        7 => Value::from(read_n::<1>(r)?[0] != 0),
        8 => Value::from(read_string(r)?),
        9 => {
            let elem = read_u32(r)?;
            let n = read_u64(r)?;
            for _ in 0..n {
                read_value(r, elem)?;
            }
            return Ok(None);
        }
        10 => Value::from(read_u64(r)?),
        11 => Value::from(i64::from_le_bytes(read_n(r)?)),
        12 => Value::from(f64::from_le_bytes(read_n(r)?)),
        other => bail!("unknown GGUF value type {other}"),
    };
    Ok(Some(v))
}

fn read_n<const N: usize>(r: &mut impl Read) -> Result<[u8; N]> {
    let mut b = [0u8; N];
    r.read_exact(&mut b)?;
    Ok(b)
}

fn read_u32(r: &mut impl Read) -> Result<u32> {
    Ok(u32::from_le_bytes(read_n(r)?))
}

fn read_u64(r: &mut impl Read) -> Result<u64> {
    Ok(u64::from_le_bytes(read_n(r)?))
}

fn read_string(r: &mut impl Read) -> Result<String> {
    let n = read_u64(r)?;
    if n > 1 << 26 {
        bail!("GGUF string of {n} bytes is implausible");
    }
    let mut b = vec![0u8; n as usize];
    r.read_exact(&mut b)?;
    Ok(String::from_utf8_lossy(&b).into_owned())
}

/// `llama_ftype` names for the common values.
fn file_type_name(t: u64) -> String {
    let name = match t {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K",
        11 => "Q3_K_S",
        12 => "Q3_K_M",
        13 => "Q3_K_L",
        14 => "Q4_K_S",
        15 => "Q4_K_M",
        16 => "Q5_K_S",
        17 => "Q5_K_M",
        18 => "Q6_K",
        32 => "BF16",
        _ => return format!("file_type {t}"),
    };
    name.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn string(s: &str) -> Vec<u8> {
        let mut b = (s.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(s.as_bytes());
        b
    }

    #[test]
    fn reads_scalars_and_skips_arrays_and_tokenizer_keys() {
        let mut f = b"GGUF".to_vec();
        f.extend_from_slice(&3u32.to_le_bytes());
        f.extend_from_slice(&5u64.to_le_bytes());
        f.extend_from_slice(&4u64.to_le_bytes());
        f.extend(string("general.file_type"));
        f.extend_from_slice(&4u32.to_le_bytes());
        f.extend_from_slice(&7u32.to_le_bytes());
        f.extend(string("tokenizer.ggml.tokens"));
        f.extend_from_slice(&9u32.to_le_bytes());
        f.extend_from_slice(&8u32.to_le_bytes());
        f.extend_from_slice(&2u64.to_le_bytes());
        f.extend(string("<s>"));
        f.extend(string("</s>"));
        f.extend(string("tokenizer.ggml.model"));
        f.extend_from_slice(&8u32.to_le_bytes());
        f.extend(string("llama"));
        f.extend(string("llama.context_length"));
        f.extend_from_slice(&4u32.to_le_bytes());
        f.extend_from_slice(&2048u32.to_le_bytes());

        let path =
            std::env::temp_dir().join(format!("mesh-bench-gguf-{}.gguf", std::process::id()));
        std::fs::write(&path, &f).unwrap();
        let info = read(&path);
        std::fs::remove_file(&path).unwrap();
        let info = info.unwrap();
        assert_eq!((info.version, info.tensors), (3, 5));
        assert_eq!(info.file_type().as_deref(), Some("Q8_0"));
        assert_eq!(
            info.metadata.get("llama.context_length"),
            Some(&Value::from(2048u32))
        );
        assert_eq!(info.metadata.len(), 2);
    }

    #[test]
    fn rejects_other_files() {
        let path = std::env::temp_dir().join(format!("mesh-bench-notgguf-{}", std::process::id()));
        std::fs::write(&path, b"GGML\0\0\0\0").unwrap();
        let r = read(&path);
        std::fs::remove_file(&path).unwrap();
        assert!(r.is_err());
    }
}
