#![allow(missing_docs)] // criterion_group! generates an undocumented fn
//! Page hashing and codec throughput (criterion): `cargo bench -p mesh-kvstore`.
//!
//! Synthetic state shaped like a small Llama: 8 layers, f16 K and V rows of 512 bytes
//! (8 KiB of KV per token), 2,048 tokens, 32-token pages.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use mesh_kvstore::codec::{self, Layout, VLayer};
use mesh_kvstore::{chain, ModelFingerprint, Salt};

fn layout() -> Layout {
    Layout {
        n_stream: 1,
        v_trans: 0,
        n_layer: 8,
        n_rot_k: 0,
        n_rot_v: 0,
        k: vec![(1, 512); 8],
        v: vec![VLayer::Rows { ty: 1, row: 512 }; 8],
    }
}

fn bench(c: &mut Criterion) {
    const TOKENS: usize = 2048;
    const BLOCK: usize = 32;
    let salt = Salt::new(&ModelFingerprint([7; 32]), b"bench", "");
    let tokens: Vec<i32> = (0..TOKENS as i32).map(|t| t * 7 % 3000).collect();
    let mut g = c.benchmark_group("kvstore");
    g.throughput(Throughput::Elements(TOKENS as u64));
    g.bench_function(BenchmarkId::new("chain_ids", TOKENS), |b| {
        b.iter(|| chain(&salt, &tokens, BLOCK))
    });

    let l = layout();
    let pages: Vec<Vec<u8>> = (0..TOKENS / BLOCK)
        .map(|i| {
            (0..l.page_bytes(BLOCK))
                .map(|j| (i * 31 + j) as u8)
                .collect()
        })
        .collect();
    let refs: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
    let blob = codec::assemble(&l, &refs, BLOCK, 1).unwrap();
    g.throughput(Throughput::Bytes(blob.len() as u64));
    g.bench_function(BenchmarkId::new("assemble", TOKENS), |b| {
        b.iter(|| codec::assemble(&l, &refs, BLOCK, 1).unwrap())
    });
    g.bench_function(BenchmarkId::new("parse_and_cut", TOKENS), |b| {
        b.iter(|| {
            let kv = codec::parse(&blob).unwrap();
            (0..kv.full_blocks(BLOCK))
                .map(|i| kv.page(i, BLOCK).unwrap().len())
                .sum::<usize>()
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
