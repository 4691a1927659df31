//! KV pages: the stored form (`mesh_kvstore::page::decode`) and llama.cpp's sequence-state
//! blob (`mesh_kvstore::codec::parse`), on arbitrary bytes and on damaged encodings of
//! structured pages and blobs.

#![no_main]

use bytes::Bytes;
use libfuzzer_sys::arbitrary::{self, Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use mesh_kvstore::codec::{self, SeqKv, STATE_MAGIC};
use mesh_kvstore::page::{self, PageMeta, HEADER_LEN};
use mesh_kvstore::{PageId, Salt};

/// Damage to apply to an encoding: bytes flipped, then a cut.
#[derive(Arbitrary, Debug)]
struct Damage {
    flips: Vec<(u32, u8)>,
    cut: Option<u32>,
}

impl Damage {
    fn apply(&self, b: &mut Vec<u8>) {
        for &(at, mask) in &self.flips {
            if !b.is_empty() {
                let i = at as usize % b.len();
                b[i] ^= mask;
            }
        }
        if let Some(cut) = self.cut {
            b.truncate(cut as usize);
        }
    }

    fn changes(&self, b: &[u8]) -> bool {
        let mut d = b.to_vec();
        self.apply(&mut d);
        d != b
    }
}

/// A layer's V part as the blob header declares it; the data written is capped, so a
/// header may declare more than follows.
#[derive(Arbitrary, Debug)]
enum V {
    Rows { ty: i32, row: u8 },
    Trans { ty: i32, el: u32, n_embd: u32 },
}

/// A sequence state in llama.cpp's layout with arbitrary header values.
#[derive(Arbitrary, Debug)]
struct Blob {
    seq: i32,
    n_stream: u8,
    stream_at: u8,
    v_trans: bool,
    rot: (u32, u32),
    k: Vec<(i32, u8)>,
    v: Vec<V>,
    positions: Vec<u8>,
    fill: u8,
}

const DATA_CAP: usize = 1 << 14;

impl Blob {
    fn bytes(&self) -> Vec<u8> {
        let mut b = vec![];
        let w32 = |b: &mut Vec<u8>, x: u32| b.extend_from_slice(&x.to_le_bytes());
        let n = self.positions.len();
        let n_layer = self.k.len().min(self.v.len());
        let data = |b: &mut Vec<u8>, len: usize| {
            let len = len.min(DATA_CAP);
            b.extend((0..len).map(|i| self.fill.wrapping_add(i as u8)));
        };
        w32(&mut b, STATE_MAGIC);
        b.extend_from_slice(&self.seq.to_le_bytes());
        let n_stream = u32::from(self.n_stream.max(1));
        w32(&mut b, n_stream);
        for s in 0..n_stream {
            if s != u32::from(self.stream_at) % n_stream {
                w32(&mut b, 0);
                continue;
            }
            w32(&mut b, n as u32);
            for &p in &self.positions {
                w32(&mut b, u32::from(p));
                w32(&mut b, 1);
                b.extend_from_slice(&self.seq.to_le_bytes());
            }
            for x in [self.v_trans as u32, n_layer as u32, self.rot.0, self.rot.1] {
                w32(&mut b, x);
            }
            for &(ty, row) in &self.k[..n_layer] {
                b.extend_from_slice(&ty.to_le_bytes());
                b.extend_from_slice(&u64::from(row).to_le_bytes());
                data(&mut b, n * row as usize);
            }
            for v in &self.v[..n_layer] {
                match *v {
                    V::Rows { ty, row } => {
                        b.extend_from_slice(&ty.to_le_bytes());
                        b.extend_from_slice(&u64::from(row).to_le_bytes());
                        data(&mut b, n * row as usize);
                    }
                    V::Trans { ty, el, n_embd } => {
                        b.extend_from_slice(&ty.to_le_bytes());
                        w32(&mut b, el);
                        w32(&mut b, n_embd);
                        data(
                            &mut b,
                            n.saturating_mul(el as usize)
                                .saturating_mul(n_embd as usize),
                        );
                    }
                }
            }
        }
        b
    }
}

/// Whatever `parse` accepts must be usable: every full page has the layout's size, and the
/// pages assembled into a blob parse back to the same pages.
fn check_parsed(kv: &SeqKv) {
    for block in [1usize, 2, 16] {
        let pages: Vec<Vec<u8>> = (0..kv.full_blocks(block))
            .map(|i| kv.page(i, block).expect("full block"))
            .collect();
        assert!(kv.page(pages.len(), block).is_none());
        for p in &pages {
            assert_eq!(p.len(), kv.layout.page_bytes(block));
        }
        if pages.is_empty() {
            continue;
        }
        let refs: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
        let blob = codec::assemble(&kv.layout, &refs, block, 1).expect("pages of the layout");
        let back = codec::parse(&blob).expect("assembled blob parses");
        assert_eq!(back.n_cells, pages.len() * block);
        for (i, p) in pages.iter().enumerate() {
            assert_eq!(&back.page(i, block).expect("page"), p);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut u = Unstructured::new(rest);
    match mode % 4 {
        // The bytes as a stored page, read with the id and salt its header names: what is
        // accepted is exactly the encoding of what was returned.
        0 => {
            let id = PageId(
                rest.get(8..40)
                    .map_or([0; 32], |s| s.try_into().expect("32")),
            );
            let salt = page::salt_of(rest).unwrap_or(Salt([0; 32]));
            let stored = Bytes::copy_from_slice(rest);
            if let Ok((m, p)) = page::decode(&stored, &id, &salt) {
                assert_eq!(page::encode(&m, &p), stored);
            }
        }
        // A page encoded, then damaged: refused unless the damage changed nothing.
        1 => {
            let (Ok(id), Ok(salt), Ok(block), Ok(index), Ok(payload), Ok(damage)) = (
                <[u8; 32]>::arbitrary(&mut u),
                <[u8; 32]>::arbitrary(&mut u),
                u32::arbitrary(&mut u),
                u32::arbitrary(&mut u),
                Vec::<u8>::arbitrary(&mut u),
                Damage::arbitrary(&mut u),
            ) else {
                return;
            };
            let meta = PageMeta {
                id: PageId(id),
                salt: Salt(salt),
                block,
                index,
            };
            let stored = page::encode(&meta, &payload);
            assert_eq!(stored.len(), HEADER_LEN + payload.len());
            let mut bad = stored.to_vec();
            damage.apply(&mut bad);
            let got = page::decode(&Bytes::from(bad), &meta.id, &meta.salt);
            if damage.changes(&stored) {
                assert!(got.is_err(), "damaged page accepted: {got:?}");
            } else {
                let (m, p) = got.expect("undamaged page");
                assert_eq!((m, &p[..]), (meta, &payload[..]));
            }
        }
        // The bytes as a sequence state.
        2 => {
            if let Ok(kv) = codec::parse(rest) {
                check_parsed(&kv);
            }
        }
        // A sequence state with arbitrary header values, then damaged.
        _ => {
            let (Ok(blob), Ok(damage)) = (Blob::arbitrary(&mut u), Damage::arbitrary(&mut u))
            else {
                return;
            };
            let mut b = blob.bytes();
            damage.apply(&mut b);
            if let Ok(kv) = codec::parse(&b) {
                check_parsed(&kv);
            }
        }
    }
});
