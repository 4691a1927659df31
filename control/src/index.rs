//! Top-k search over unit-length vectors, where the dot product is the cosine.
//!
//! * [`FlatIndex`]: exact scan of a row-major `f32` matrix. The dot product is written
//!   as 16 independent accumulators over fixed-size chunks, which LLVM turns into SIMD
//!   adds and multiplies; on x86-64 the scan is compiled twice and AVX2 is picked at
//!   run time when the CPU has it (the same Rust code, no intrinsics).
//! * [`QuantizedIndex`]: the same rows as `i8` codes with one scale per row (a quarter
//!   of the bytes to stream). The `i8` scan yields a shortlist that is re-ranked with
//!   the exact `f32` rows, so the returned scores are exact and only membership of the
//!   shortlist is approximate; [`recall`] measures that against the exact scan.
//!
//! Neither allocates per row; a search allocates its top-k heap once.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use crate::ControlError;

/// One search result: row id and cosine score.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hit {
    /// Row (insertion order, from 0).
    pub id: usize,
    /// Dot product with the query (= cosine for unit vectors).
    pub score: f32,
}

const LANES: usize = 16;

/// Dot product of two equal-length slices.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    let mut acc = [0.0f32; LANES];
    for (x, y) in ca.zip(cb) {
        let x: &[f32; LANES] = x.try_into().expect("chunk of LANES");
        let y: &[f32; LANES] = y.try_into().expect("chunk of LANES");
        for j in 0..LANES {
            acc[j] += x[j] * y[j];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Dot product of two equal-length `i8` slices, accumulated in `i32` (exact for
/// vectors up to 133,000 components).
#[inline(always)]
pub fn dot_i8(a: &[i8], b: &[i8]) -> i32 {
    debug_assert_eq!(a.len(), b.len());
    const L: usize = 32;
    let (ca, cb) = (a.chunks_exact(L), b.chunks_exact(L));
    let tail: i32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(&x, &y)| i32::from(x) * i32::from(y))
        .sum();
    let mut acc = [0i32; L];
    for (x, y) in ca.zip(cb) {
        let x: &[i8; L] = x.try_into().expect("chunk of L");
        let y: &[i8; L] = y.try_into().expect("chunk of L");
        for j in 0..L {
            acc[j] += i32::from(i16::from(x[j]) * i16::from(y[j]));
        }
    }
    acc.iter().sum::<i32>() + tail
}

/// Heap entry ordered so that the heap's top is the worst hit kept: lowest score, and
/// among equal scores the highest id (ties resolve to the lower id, deterministically).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Worst(Hit);

impl Eq for Worst {}

impl PartialOrd for Worst {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Worst {
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .0
            .score
            .total_cmp(&self.0.score)
            .then(self.0.id.cmp(&other.0.id))
    }
}

/// The `k` best hits of a stream, in O(log k) per accepted hit.
#[derive(Debug)]
pub(crate) struct TopK {
    k: usize,
    heap: BinaryHeap<Worst>,
    /// The worst kept score once `k` are kept (−∞ before): most hits of a scan fall below
    /// it and are rejected by one comparison, which keeps the scan loop tight.
    floor: f32,
}

impl TopK {
    pub(crate) fn new(k: usize) -> Self {
        Self {
            k,
            heap: BinaryHeap::with_capacity(k + 1),
            floor: f32::NEG_INFINITY,
        }
    }

    #[inline(always)]
    pub(crate) fn push(&mut self, id: usize, score: f32) {
        if score < self.floor {
            return;
        }
        self.insert(Worst(Hit { id, score }));
    }

    fn insert(&mut self, candidate: Worst) {
        if self.heap.len() < self.k {
            self.heap.push(candidate);
        } else if let Some(mut worst) = self.heap.peek_mut() {
            // Smaller in this order = better hit.
            if candidate < *worst {
                *worst = candidate;
            }
        }
        if self.heap.len() == self.k {
            self.floor = self.heap.peek().map_or(f32::NEG_INFINITY, |w| w.0.score);
        }
    }

    /// Best first; equal scores by ascending id.
    pub(crate) fn into_sorted(self) -> Vec<Hit> {
        self.heap
            .into_sorted_vec()
            .into_iter()
            .map(|w| w.0)
            .collect()
    }
}

/// Exact top-k over a flat row-major matrix of unit vectors.
#[derive(Clone, Debug, Default)]
pub struct FlatIndex {
    dim: usize,
    data: Vec<f32>,
}

impl FlatIndex {
    /// An empty index of `dim`-dimensional rows.
    pub fn new(dim: usize) -> Self {
        Self {
            dim,
            data: Vec::new(),
        }
    }

    /// An index holding `rows`, in order.
    pub fn from_rows<R: AsRef<[f32]>>(dim: usize, rows: &[R]) -> Result<Self, ControlError> {
        let mut index = Self::new(dim);
        index.data.reserve(rows.len() * dim);
        for row in rows {
            index.push(row.as_ref())?;
        }
        Ok(index)
    }

    /// Appends a row (expected unit length) and returns its id.
    pub fn push(&mut self, row: &[f32]) -> Result<usize, ControlError> {
        if row.len() != self.dim || self.dim == 0 {
            return Err(ControlError::Dimension {
                expected: self.dim,
                got: row.len(),
            });
        }
        self.data.extend_from_slice(row);
        Ok(self.len() - 1)
    }

    /// Row width.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.data.len().checked_div(self.dim).unwrap_or(0)
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Row `id`.
    ///
    /// # Panics
    ///
    /// If `id >= len()`.
    pub fn row(&self, id: usize) -> &[f32] {
        &self.data[id * self.dim..(id + 1) * self.dim]
    }

    /// Cosine of `query` with row `id`.
    pub fn score(&self, query: &[f32], id: usize) -> f32 {
        dot(query, self.row(id))
    }

    /// Bytes held by the vectors.
    pub fn memory_bytes(&self) -> usize {
        self.data.len() * std::mem::size_of::<f32>()
    }

    /// The `k` rows most similar to `query`, best first (ties: lower id first).
    ///
    /// # Panics
    ///
    /// If `query.len() != dim()`.
    pub fn search(&self, query: &[f32], k: usize) -> Vec<Hit> {
        assert_eq!(query.len(), self.dim, "query dimension");
        let mut top = TopK::new(k.min(self.len()));
        if k > 0 {
            scan_f32(query, &self.data, self.dim, &mut top);
        }
        top.into_sorted()
    }
}

#[inline(always)]
fn scan_f32_portable(query: &[f32], data: &[f32], dim: usize, top: &mut TopK) {
    for (id, row) in data.chunks_exact(dim).enumerate() {
        top.push(id, dot(query, row));
    }
}

#[inline(always)]
fn scan_i8_portable(query: &[i8], codes: &[i8], scales: &[f32], top: &mut TopK) {
    let dim = query.len();
    for (id, (row, &scale)) in codes.chunks_exact(dim).zip(scales).enumerate() {
        top.push(id, dot_i8(query, row) as f32 * scale);
    }
}

#[inline(always)]
fn rerank_portable(query: &[f32], data: &[f32], dim: usize, ids: &[Hit], top: &mut TopK) {
    for hit in ids {
        top.push(hit.id, dot(query, &data[hit.id * dim..(hit.id + 1) * dim]));
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The portable scans compiled with AVX2 enabled; chosen at run time.
    use super::{rerank_portable, scan_f32_portable, scan_i8_portable, Hit, TopK};

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn scan_f32(query: &[f32], data: &[f32], dim: usize, top: &mut TopK) {
        scan_f32_portable(query, data, dim, top);
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn scan_i8(query: &[i8], codes: &[i8], scales: &[f32], top: &mut TopK) {
        scan_i8_portable(query, codes, scales, top);
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn rerank(
        query: &[f32],
        data: &[f32],
        dim: usize,
        ids: &[Hit],
        top: &mut TopK,
    ) {
        rerank_portable(query, data, dim, ids, top);
    }
}

fn scan_f32(query: &[f32], data: &[f32], dim: usize, top: &mut TopK) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected on this CPU.
        unsafe { avx2::scan_f32(query, data, dim, top) };
        return;
    }
    scan_f32_portable(query, data, dim, top);
}

fn scan_i8(query: &[i8], codes: &[i8], scales: &[f32], top: &mut TopK) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected on this CPU.
        unsafe { avx2::scan_i8(query, codes, scales, top) };
        return;
    }
    scan_i8_portable(query, codes, scales, top);
}

/// Exact scores of the rows `ids` into `top`.
fn rerank(query: &[f32], data: &[f32], dim: usize, ids: &[Hit], top: &mut TopK) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected on this CPU.
        unsafe { avx2::rerank(query, data, dim, ids, top) };
        return;
    }
    rerank_portable(query, data, dim, ids, top);
}

/// Symmetric int8 quantization of one vector: `v ≈ scale × code`, `|code| ≤ 127`.
/// Returns the scale (0 for a zero vector).
pub fn quantize(v: &[f32], codes: &mut [i8]) -> f32 {
    debug_assert_eq!(v.len(), codes.len());
    let max = v.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    if max == 0.0 {
        codes.fill(0);
        return 0.0;
    }
    let inv = 127.0 / max;
    for (c, x) in codes.iter_mut().zip(v) {
        *c = (x * inv).round().clamp(-127.0, 127.0) as i8;
    }
    max / 127.0
}

/// Approximate top-k: an `i8` scan picks a shortlist, exact `f32` dot products re-rank it.
///
/// Memory: `dim` bytes + 4 per row on top of the exact rows it keeps for the re-rank.
#[derive(Clone, Debug)]
pub struct QuantizedIndex {
    exact: FlatIndex,
    codes: Vec<i8>,
    scales: Vec<f32>,
    shortlist: usize,
}

impl QuantizedIndex {
    /// Quantizes every row of `exact`. A search re-ranks `max(k, shortlist)` rows.
    pub fn new(exact: FlatIndex, shortlist: usize) -> Self {
        let dim = exact.dim();
        let mut codes = vec![0i8; exact.data.len()];
        let scales = if dim == 0 {
            Vec::new()
        } else {
            exact
                .data
                .chunks_exact(dim)
                .zip(codes.chunks_exact_mut(dim))
                .map(|(row, c)| quantize(row, c))
                .collect()
        };
        Self {
            exact,
            codes,
            scales,
            shortlist,
        }
    }

    /// The exact rows.
    pub fn exact(&self) -> &FlatIndex {
        &self.exact
    }

    /// Rows re-ranked per search (at least `k`).
    pub fn shortlist(&self) -> usize {
        self.shortlist
    }

    /// Bytes held by codes, scales and the exact rows.
    pub fn memory_bytes(&self) -> usize {
        self.codes.len() + self.scales.len() * 4 + self.exact.memory_bytes()
    }

    /// The `k` rows most similar to `query` (exact scores), best first.
    ///
    /// # Panics
    ///
    /// If `query.len() != dim()`.
    pub fn search(&self, query: &[f32], k: usize) -> Vec<Hit> {
        let dim = self.exact.dim();
        assert_eq!(query.len(), dim, "query dimension");
        let n = self.exact.len();
        if k == 0 || n == 0 {
            return Vec::new();
        }
        let mut q = vec![0i8; dim];
        // The query's own scale multiplies every score alike: irrelevant to the order.
        quantize(query, &mut q);
        let mut short = TopK::new(k.max(self.shortlist).min(n));
        scan_i8(&q, &self.codes, &self.scales, &mut short);
        let mut top = TopK::new(k.min(n));
        rerank(query, &self.exact.data, dim, &short.into_sorted(), &mut top);
        top.into_sorted()
    }
}

/// Either index, chosen by catalog size.
#[derive(Clone, Debug)]
pub enum VectorIndex {
    /// Exact scan.
    Exact(FlatIndex),
    /// Quantized scan + exact re-rank.
    Quantized(QuantizedIndex),
}

impl VectorIndex {
    /// The exact rows (both variants keep them).
    pub fn flat(&self) -> &FlatIndex {
        match self {
            Self::Exact(f) => f,
            Self::Quantized(q) => q.exact(),
        }
    }

    /// The `k` best rows for `query`, best first.
    pub fn search(&self, query: &[f32], k: usize) -> Vec<Hit> {
        match self {
            Self::Exact(f) => f.search(query, k),
            Self::Quantized(q) => q.search(query, k),
        }
    }

    /// Exact cosine of `query` with row `id`.
    pub fn score(&self, query: &[f32], id: usize) -> f32 {
        self.flat().score(query, id)
    }

    /// Bytes held.
    pub fn memory_bytes(&self) -> usize {
        match self {
            Self::Exact(f) => f.memory_bytes(),
            Self::Quantized(q) => q.memory_bytes(),
        }
    }
}

/// Share of `exact`'s ids that `approx` also returned (recall@k with k = `exact.len()`);
/// 1.0 when `exact` is empty.
pub fn recall(exact: &[Hit], approx: &[Hit]) -> f64 {
    if exact.is_empty() {
        return 1.0;
    }
    let found = exact
        .iter()
        .filter(|e| approx.iter().any(|a| a.id == e.id))
        .count();
    found as f64 / exact.len() as f64
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::embed::normalize;

    /// splitmix64: deterministic test data without a rand dependency.
    pub(crate) struct Rng(pub(crate) u64);

    impl Rng {
        pub(crate) fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }

        /// Uniform in [-1, 1).
        pub(crate) fn uniform(&mut self) -> f32 {
            (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }

        /// Approximately standard normal (sum of 4 uniforms, rescaled).
        pub(crate) fn normal(&mut self) -> f32 {
            (0..4).map(|_| self.uniform()).sum::<f32>() * (3.0f32 / 4.0).sqrt()
        }

        pub(crate) fn unit(&mut self, dim: usize) -> Vec<f32> {
            let mut v: Vec<f32> = (0..dim).map(|_| self.normal()).collect();
            normalize(&mut v);
            v
        }
    }

    fn naive_dot(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    #[test]
    fn dot_matches_naive_for_every_tail_length() {
        let mut rng = Rng(1);
        for len in [0, 1, 15, 16, 17, 33, 384, 385] {
            let a: Vec<f32> = (0..len).map(|_| rng.uniform()).collect();
            let b: Vec<f32> = (0..len).map(|_| rng.uniform()).collect();
            assert!((dot(&a, &b) - naive_dot(&a, &b)).abs() < 1e-4, "len {len}");
            let qa: Vec<i8> = (0..len).map(|i| (i % 255) as i8).collect();
            let qb: Vec<i8> = (0..len).map(|i| -((i * 7 % 255) as i8)).collect();
            let naive: i32 = qa
                .iter()
                .zip(&qb)
                .map(|(&x, &y)| i32::from(x) * i32::from(y))
                .sum();
            assert_eq!(dot_i8(&qa, &qb), naive, "len {len}");
        }
        // Extremes do not overflow the i16 product.
        assert_eq!(dot_i8(&[-128; 64], &[-128; 64]), 64 * 16384);
    }

    #[test]
    fn exact_index_returns_the_known_nearest_rows_in_order() {
        let mut rng = Rng(7);
        let dim = 64;
        let rows: Vec<Vec<f32>> = (0..500).map(|_| rng.unit(dim)).collect();
        let index = FlatIndex::from_rows(dim, &rows).unwrap();
        // A query close to row 123, a bit further from row 321.
        let mut q: Vec<f32> = rows[123]
            .iter()
            .zip(&rows[321])
            .map(|(a, b)| 0.8 * a + 0.5 * b)
            .collect();
        normalize(&mut q);
        let hits = index.search(&q, 5);
        assert_eq!(hits.len(), 5);
        assert_eq!(hits[0].id, 123);
        assert_eq!(hits[1].id, 321);
        assert!(hits.windows(2).all(|w| w[0].score >= w[1].score));
        // Scores are the cosines.
        assert!((hits[0].score - naive_dot(&q, &rows[123])).abs() < 1e-5);
        // Brute-force order agrees.
        let mut all: Vec<(usize, f32)> = rows
            .iter()
            .enumerate()
            .map(|(i, r)| (i, naive_dot(&q, r)))
            .collect();
        all.sort_by(|a, b| b.1.total_cmp(&a.1));
        let ids: Vec<usize> = hits.iter().map(|h| h.id).collect();
        let want: Vec<usize> = all[..5].iter().map(|a| a.0).collect();
        assert_eq!(ids, want);
    }

    #[test]
    fn exact_index_handles_k_beyond_len_ties_and_bad_rows() {
        let mut index = FlatIndex::new(2);
        index.push(&[1.0, 0.0]).unwrap();
        index.push(&[1.0, 0.0]).unwrap();
        index.push(&[0.0, 1.0]).unwrap();
        assert!(matches!(
            index.push(&[1.0]),
            Err(ControlError::Dimension {
                expected: 2,
                got: 1
            })
        ));
        let hits = index.search(&[1.0, 0.0], 10);
        let ids: Vec<usize> = hits.iter().map(|h| h.id).collect();
        assert_eq!(ids, vec![0, 1, 2], "ties by ascending id, k capped at len");
        assert!(index.search(&[1.0, 0.0], 0).is_empty());
        // Ties at the cut keep the lowest ids, whatever the scan order.
        let same = FlatIndex::from_rows(2, &[[0.6f32, 0.8]; 6]).unwrap();
        let ids: Vec<usize> = same.search(&[0.6, 0.8], 3).iter().map(|h| h.id).collect();
        assert_eq!(ids, vec![0, 1, 2]);
        let q = QuantizedIndex::new(same, 4);
        let ids: Vec<usize> = q.search(&[0.6, 0.8], 2).iter().map(|h| h.id).collect();
        assert_eq!(ids, vec![0, 1]);
    }

    #[test]
    fn quantization_round_trips_within_half_a_step() {
        let mut rng = Rng(3);
        let v = rng.unit(384);
        let mut codes = vec![0i8; 384];
        let scale = quantize(&v, &mut codes);
        for (x, c) in v.iter().zip(&codes) {
            assert!((x - scale * f32::from(*c)).abs() <= scale * 0.5 + 1e-7);
        }
        assert!(codes.iter().any(|&c| c.abs() == 127));
        assert_eq!(quantize(&[0.0; 4], &mut [0; 4]), 0.0);
    }

    #[test]
    fn quantized_recall_on_random_data() {
        let mut rng = Rng(11);
        let dim = 384;
        // Clustered data (as real embeddings are): 200 centres, 20 noisy members each.
        let centres: Vec<Vec<f32>> = (0..200).map(|_| rng.unit(dim)).collect();
        let rows: Vec<Vec<f32>> = (0..4000)
            .map(|i| {
                let c = &centres[i % 200];
                let mut v: Vec<f32> = c.iter().map(|x| x + 0.06 * rng.normal()).collect();
                normalize(&mut v);
                v
            })
            .collect();
        let exact = FlatIndex::from_rows(dim, &rows).unwrap();
        let quant = QuantizedIndex::new(exact.clone(), 50);
        let k = 10;
        let mut sum = 0.0;
        let queries = 100;
        for _ in 0..queries {
            let c = &centres[(rng.next_u64() % 200) as usize];
            let mut q: Vec<f32> = c.iter().map(|x| x + 0.06 * rng.normal()).collect();
            normalize(&mut q);
            let e = exact.search(&q, k);
            let a = quant.search(&q, k);
            // Re-ranked scores are exact.
            for h in &a {
                assert!((h.score - exact.score(&q, h.id)).abs() < 1e-6);
            }
            sum += recall(&e, &a);
        }
        let r = sum / f64::from(queries);
        assert!(r >= 0.97, "quantized recall@{k} = {r:.3}");
    }

    #[test]
    fn recall_counts_shared_ids() {
        let h = |id| Hit { id, score: 0.0 };
        assert_eq!(recall(&[h(1), h(2)], &[h(2), h(3)]), 0.5);
        assert_eq!(recall(&[], &[h(1)]), 1.0);
    }
}
