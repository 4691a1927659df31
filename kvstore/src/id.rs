//! Page identity.
//!
//! `page_id[i] = blake3_keyed(salt, page_id[i-1] ‖ tokens of block i)` with
//! `page_id[-1] = 0`. The salt is derived from everything that makes KV bytes
//! incompatible or private: the model fingerprint, the KV layout (dtypes,
//! v_trans, rotation, layer shapes) and the caller's access scope (its tool
//! set), so a page is only ever reused by a model that can read it and an
//! agent allowed to see what produced it. Only full blocks get an id.

use std::fmt;
use std::io::Read;
use std::path::Path;

/// Content address of one KV page.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageId(pub [u8; 32]);

impl fmt::Debug for PageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PageId({})", &self.to_hex()[..16])
    }
}

impl fmt::Display for PageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl PageId {
    /// Lowercase hex (file names).
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
    /// Parses [`Self::to_hex`] output.
    pub fn from_hex(s: &str) -> Option<Self> {
        if s.len() != 64 {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(Self(out))
    }
}

/// Identity of a model file.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct ModelFingerprint(pub [u8; 32]);

impl ModelFingerprint {
    /// blake3 over the file's size, its first and its last 4 MiB (GGUF headers and
    /// metadata sit at the start; the tail catches re-quantized weights). Cheap on
    /// multi-GB files.
    pub fn of_file(path: &Path) -> std::io::Result<Self> {
        use std::io::{Seek, SeekFrom};
        const SPAN: u64 = 4 << 20;
        let mut f = std::fs::File::open(path)?;
        let len = f.metadata()?.len();
        let mut h = blake3::Hasher::new();
        h.update(b"mesh model fingerprint v1");
        h.update(&len.to_le_bytes());
        let mut buf = Vec::with_capacity(SPAN as usize);
        f.by_ref().take(SPAN).read_to_end(&mut buf)?;
        h.update(&buf);
        if len > SPAN {
            buf.clear();
            f.seek(SeekFrom::Start(len.saturating_sub(SPAN).max(SPAN)))?;
            f.take(SPAN).read_to_end(&mut buf)?;
            h.update(&buf);
        }
        Ok(Self(*h.finalize().as_bytes()))
    }
}

/// The key of one page namespace.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Salt(pub [u8; 32]);

/// The part of a salt fixed by the model and KV layout; nodes advertise it so that a
/// router can compute page ids for any scope without the model.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct SaltBase(pub [u8; 32]);

impl SaltBase {
    /// Base for a model and a KV layout description.
    pub fn new(model: &ModelFingerprint, layout: &[u8]) -> Self {
        let mut h = blake3::Hasher::new_derive_key("mesh kv page salt base v1");
        h.update(&model.0);
        h.update(&(layout.len() as u64).to_le_bytes());
        h.update(layout);
        Self(*h.finalize().as_bytes())
    }

    /// The salt of one access scope.
    pub fn salt(&self, scope: &str) -> Salt {
        Salt(*blake3::keyed_hash(&self.0, scope.as_bytes()).as_bytes())
    }
}

impl Salt {
    /// Salt for a model, a KV layout description and an access scope.
    pub fn new(model: &ModelFingerprint, layout: &[u8], scope: &str) -> Self {
        SaltBase::new(model, layout).salt(scope)
    }
}

impl PageId {
    /// First 8 bytes as an integer: what adverts carry (a collision only costs a failed fetch,
    /// never a wrong page: fetched pages are checked against the full id).
    pub fn short(&self) -> u64 {
        u64::from_le_bytes(self.0[..8].try_into().expect("8 bytes"))
    }
}

/// Ids of every full block of `tokens`, chained.
pub fn chain(salt: &Salt, tokens: &[i32], block: usize) -> Vec<PageId> {
    assert!(block > 0, "block size must be positive");
    let mut parent = [0u8; 32];
    tokens
        .chunks_exact(block)
        .map(|blk| {
            let mut h = blake3::Hasher::new_keyed(&salt.0);
            h.update(&parent);
            for t in blk {
                h.update(&t.to_le_bytes());
            }
            parent = *h.finalize().as_bytes();
            PageId(parent)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_is_prefix_stable_and_salted() {
        let s = Salt::new(&ModelFingerprint([1; 32]), b"f16", "");
        let a: Vec<i32> = (0..100).collect();
        let mut b = a.clone();
        b[70] = -1;
        let (ca, cb) = (chain(&s, &a, 32), chain(&s, &b, 32));
        assert_eq!(ca.len(), 3); // 100 tokens = 3 full blocks of 32
        assert_eq!(ca[..2], cb[..2]); // first 64 tokens equal
        assert_ne!(ca[2], cb[2]);
        // Same block content at another position has another id (chained).
        let shifted: Vec<i32> = (32..132).collect();
        assert_ne!(chain(&s, &shifted, 32)[0], ca[1]);
        // Another scope (tool set) or model never shares ids.
        let s2 = Salt::new(&ModelFingerprint([1; 32]), b"f16", "tools:a,b");
        assert_ne!(chain(&s2, &a, 32)[0], ca[0]);
        let s3 = Salt::new(&ModelFingerprint([2; 32]), b"f16", "");
        assert_ne!(chain(&s3, &a, 32)[0], ca[0]);
        assert_eq!(PageId::from_hex(&ca[0].to_hex()), Some(ca[0]));
    }
}
