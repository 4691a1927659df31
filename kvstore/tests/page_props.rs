//! Property tests of the KV page decoders: the stored form of a page
//! (`mesh_kvstore::page`) and llama.cpp's sequence-state blob (`mesh_kvstore::codec`).

use bytes::Bytes;
use mesh_kvstore::codec::{self, CodecError, Layout, VLayer, STATE_MAGIC};
use mesh_kvstore::page::{self, PageError, PageMeta, HEADER_LEN};
use mesh_kvstore::{PageId, Salt};
use proptest::prelude::*;

fn meta() -> impl Strategy<Value = PageMeta> {
    (
        any::<[u8; 32]>(),
        any::<[u8; 32]>(),
        any::<u32>(),
        any::<u32>(),
    )
        .prop_map(|(id, salt, block, index)| PageMeta {
            id: PageId(id),
            salt: Salt(salt),
            block,
            index,
        })
}

fn payload() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..600)
}

/// V layout of one layer in a generated blob.
#[derive(Debug, Clone)]
enum VSpec {
    Rows { ty: i32, row: u64 },
    Trans { ty: i32, el: u32, n_embd: u32 },
}

/// A sequence state as llama.cpp writes it: `n` cells stored in `perm` order in stream
/// `stream_at` of `n_stream`, K and V bytes derived from (layer, position, component).
#[derive(Debug, Clone)]
struct Spec {
    seq: i32,
    n_stream: u32,
    stream_at: u32,
    v_trans: bool,
    rot: (u32, u32),
    k: Vec<(i32, u64)>,
    v: Vec<VSpec>,
    perm: Vec<usize>,
    seed: u8,
}

impl Spec {
    fn byte(&self, layer: usize, pos: usize, at: usize) -> u8 {
        (self.seed as usize ^ (layer * 131 + pos * 31 + at * 7)) as u8
    }

    fn layout(&self) -> Layout {
        Layout {
            n_stream: self.n_stream,
            v_trans: self.v_trans as u32,
            n_layer: self.k.len() as u32,
            n_rot_k: self.rot.0,
            n_rot_v: self.rot.1,
            k: self.k.clone(),
            v: self
                .v
                .iter()
                .map(|v| match *v {
                    VSpec::Rows { ty, row } => VLayer::Rows { ty, row },
                    VSpec::Trans { ty, el, n_embd } => VLayer::Trans { ty, el, n_embd },
                })
                .collect(),
        }
    }

    fn blob(&self) -> Vec<u8> {
        let mut b = vec![];
        let w32 = |b: &mut Vec<u8>, x: u32| b.extend_from_slice(&x.to_le_bytes());
        w32(&mut b, STATE_MAGIC);
        b.extend_from_slice(&self.seq.to_le_bytes());
        w32(&mut b, self.n_stream);
        for s in 0..self.n_stream {
            if s != self.stream_at {
                w32(&mut b, 0);
                continue;
            }
            w32(&mut b, self.perm.len() as u32);
            for &p in &self.perm {
                b.extend_from_slice(&(p as i32).to_le_bytes());
                w32(&mut b, 1);
                b.extend_from_slice(&self.seq.to_le_bytes());
            }
            for x in [
                self.v_trans as u32,
                self.k.len() as u32,
                self.rot.0,
                self.rot.1,
            ] {
                w32(&mut b, x);
            }
            for (l, (ty, row)) in self.k.iter().enumerate() {
                b.extend_from_slice(&ty.to_le_bytes());
                b.extend_from_slice(&row.to_le_bytes());
                for &p in &self.perm {
                    b.extend((0..*row as usize).map(|i| self.byte(l, p, i)));
                }
            }
            for (l, v) in self.v.iter().enumerate() {
                let l = 1000 + l;
                match *v {
                    VSpec::Rows { ty, row } => {
                        b.extend_from_slice(&ty.to_le_bytes());
                        b.extend_from_slice(&row.to_le_bytes());
                        for &p in &self.perm {
                            b.extend((0..row as usize).map(|i| self.byte(l, p, i)));
                        }
                    }
                    VSpec::Trans { ty, el, n_embd } => {
                        b.extend_from_slice(&ty.to_le_bytes());
                        w32(&mut b, el);
                        w32(&mut b, n_embd);
                        for j in 0..n_embd as usize {
                            for &p in &self.perm {
                                b.extend((0..el as usize).map(|i| self.byte(l, p, j * 64 + i)));
                            }
                        }
                    }
                }
            }
        }
        b
    }

    /// Page `index` of `block` cells, written from the definition of the page format.
    fn page(&self, index: usize, block: usize) -> Vec<u8> {
        let cells = index * block..(index + 1) * block;
        let mut out = vec![];
        for (l, (_, row)) in self.k.iter().enumerate() {
            for p in cells.clone() {
                out.extend((0..*row as usize).map(|i| self.byte(l, p, i)));
            }
        }
        for (l, v) in self.v.iter().enumerate() {
            let l = 1000 + l;
            match *v {
                VSpec::Rows { row, .. } => {
                    for p in cells.clone() {
                        out.extend((0..row as usize).map(|i| self.byte(l, p, i)));
                    }
                }
                VSpec::Trans { el, n_embd, .. } => {
                    for j in 0..n_embd as usize {
                        for p in cells.clone() {
                            out.extend((0..el as usize).map(|i| self.byte(l, p, j * 64 + i)));
                        }
                    }
                }
            }
        }
        out
    }
}

fn spec() -> impl Strategy<Value = Spec> {
    (1u32..4, any::<bool>(), 1usize..4, 1usize..20).prop_flat_map(
        |(n_stream, v_trans, n_layer, n)| {
            let v = if v_trans {
                (any::<i32>(), 1u32..4, 0u32..4)
                    .prop_map(|(ty, el, n_embd)| VSpec::Trans { ty, el, n_embd })
                    .boxed()
            } else {
                (any::<i32>(), 0u64..6)
                    .prop_map(|(ty, row)| VSpec::Rows { ty, row })
                    .boxed()
            };
            (
                any::<i32>(),
                0..n_stream,
                (any::<u32>(), any::<u32>()),
                prop::collection::vec((any::<i32>(), 0u64..6), n_layer),
                prop::collection::vec(v, n_layer),
                Just((0..n).collect::<Vec<usize>>()).prop_shuffle(),
                any::<u8>(),
            )
                .prop_map(move |(seq, stream_at, rot, k, v, perm, seed)| Spec {
                    seq,
                    n_stream,
                    stream_at,
                    v_trans,
                    rot,
                    k,
                    v,
                    perm,
                    seed,
                })
        },
    )
}

/// Whatever `parse` accepts must be usable: every full page has the layout's size.
fn check_consistent(kv: &codec::SeqKv) -> Result<(), TestCaseError> {
    for block in [1, 2, 3, 16] {
        for i in 0..kv.full_blocks(block) {
            let p = kv.page(i, block).expect("full block");
            prop_assert_eq!(p.len(), kv.layout.page_bytes(block));
        }
        prop_assert!(kv.page(kv.full_blocks(block), block).is_none());
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    /// A page encoded then decoded with its own id and salt gives back its header fields
    /// and payload.
    #[test]
    fn page_roundtrip(m in meta(), p in payload()) {
        let stored = page::encode(&m, &p);
        prop_assert_eq!(stored.len(), HEADER_LEN + p.len());
        let (got, body) = page::decode(&stored, &m.id, &m.salt).unwrap();
        prop_assert_eq!(got, m);
        prop_assert_eq!(&body[..], &p[..]);
    }

    /// Any flipped bit pattern in any byte, header or payload, is refused: a damaged page
    /// is never accepted with other header fields or another payload.
    #[test]
    fn damaged_page_is_refused(
        m in meta(), p in payload(), at in any::<prop::sample::Index>(), mask in 1u8..,
    ) {
        let mut bad = page::encode(&m, &p).to_vec();
        let i = at.index(bad.len());
        bad[i] ^= mask;
        let got = page::decode(&Bytes::from(bad), &m.id, &m.salt);
        prop_assert!(got.is_err(), "byte {} ^ {:#04x} accepted: {:?}", i, mask, got);
    }

    /// A page cut short, or with bytes after it, is refused.
    #[test]
    fn truncated_or_extended_page_is_refused(
        m in meta(), p in payload(), cut in any::<prop::sample::Index>(),
        extra in prop::collection::vec(any::<u8>(), 1..16),
    ) {
        let stored = page::encode(&m, &p);
        let short = stored.slice(..cut.index(stored.len()));
        prop_assert!(page::decode(&short, &m.id, &m.salt).is_err());
        let mut long = stored.to_vec();
        long.extend_from_slice(&extra);
        prop_assert_eq!(
            page::decode(&Bytes::from(long), &m.id, &m.salt),
            Err(PageError::Corrupt("length"))
        );
    }

    /// A page read as another page or from another namespace is refused as a mismatch.
    #[test]
    fn page_of_another_id_or_salt_is_refused(
        m in meta(), p in payload(), other in any::<[u8; 32]>(), which in any::<bool>(),
    ) {
        prop_assume!(other != m.id.0 && other != m.salt.0);
        let stored = page::encode(&m, &p);
        let got = if which {
            page::decode(&stored, &PageId(other), &m.salt)
        } else {
            page::decode(&stored, &m.id, &Salt(other))
        };
        prop_assert_eq!(got, Err(PageError::Mismatch));
    }

    /// Arbitrary bytes, read with the id and salt their own header names, never panic the
    /// decoder, and whatever it accepts is exactly the encoding of what it returned.
    #[test]
    fn arbitrary_bytes_are_refused_or_canonical(
        bytes in prop_oneof![
            prop::collection::vec(any::<u8>(), 0..300),
            // Right magic and version, so the later checks are reached.
            prop::collection::vec(any::<u8>(), HEADER_LEN..300).prop_map(|mut b| {
                b[..4].copy_from_slice(&page::PAGE_MAGIC);
                b[4..6].copy_from_slice(&page::PAGE_VERSION.to_le_bytes());
                b
            }),
        ],
    ) {
        let id = PageId(bytes.get(8..40).map_or([0; 32], |s| s.try_into().unwrap()));
        let salt = page::salt_of(&bytes).unwrap_or(Salt([0; 32]));
        let stored = Bytes::from(bytes);
        if let Ok((m, p)) = page::decode(&stored, &id, &salt) {
            prop_assert_eq!(page::encode(&m, &p), stored);
        }
    }

    /// A sequence state parses into pages that hold the cells in position order, whatever
    /// order llama.cpp stored them in and whichever stream holds them.
    #[test]
    fn parsed_pages_hold_cells_in_position_order(s in spec(), block in 1usize..6) {
        let kv = codec::parse(&s.blob()).unwrap();
        prop_assert_eq!(&kv.layout, &s.layout());
        prop_assert_eq!(kv.n_cells, s.perm.len());
        prop_assert_eq!(kv.full_blocks(block), s.perm.len() / block);
        for i in 0..kv.full_blocks(block) {
            prop_assert_eq!(kv.page(i, block).unwrap(), s.page(i, block), "page {}", i);
        }
        check_consistent(&kv)?;
    }

    /// A prefix of pages assembled into a blob parses back to the same pages, with the
    /// stream count of the destination.
    #[test]
    fn assembled_prefix_parses_back(s in spec(), block in 1usize..6, n_stream in 0u32..4) {
        let kv = codec::parse(&s.blob()).unwrap();
        let pages: Vec<Vec<u8>> =
            (0..kv.full_blocks(block)).map(|i| kv.page(i, block).unwrap()).collect();
        prop_assume!(!pages.is_empty());
        let refs: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
        let blob = codec::assemble(&kv.layout, &refs, block, n_stream).unwrap();
        let back = codec::parse(&blob).unwrap();
        prop_assert_eq!(
            &back.layout,
            &Layout { n_stream: n_stream.max(1), ..kv.layout.clone() }
        );
        prop_assert_eq!(back.n_cells, pages.len() * block);
        for (i, p) in pages.iter().enumerate() {
            prop_assert_eq!(&back.page(i, block).unwrap(), p);
        }
    }

    /// A damaged or truncated sequence state never panics the parser; what it still accepts
    /// is consistent (every full page has the layout's size).
    #[test]
    fn damaged_blob_is_refused_or_consistent(
        s in spec(), at in any::<prop::sample::Index>(), mask in 1u8..,
        cut in any::<prop::sample::Index>(), truncate in any::<bool>(),
    ) {
        let mut blob = s.blob();
        let i = at.index(blob.len());
        blob[i] ^= mask;
        if truncate {
            blob.truncate(cut.index(blob.len()));
        }
        match codec::parse(&blob) {
            Ok(kv) => check_consistent(&kv)?,
            Err(CodecError::Malformed(_) | CodecError::NotPageable(_)) => {}
            Err(e) => prop_assert!(false, "unexpected error {:?}", e),
        }
    }

    /// Arbitrary bytes after a valid magic never panic the parser.
    #[test]
    fn arbitrary_blob_is_refused_or_consistent(tail in prop::collection::vec(any::<u8>(), 0..400)) {
        let mut blob = STATE_MAGIC.to_le_bytes().to_vec();
        blob.extend_from_slice(&tail);
        if let Ok(kv) = codec::parse(&blob) {
            check_consistent(&kv)?;
        }
    }
}
