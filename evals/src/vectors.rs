//! Embedding vectors in the evaluations: ranking by dot product, and Matryoshka truncation
//! (measured by `multistep_router --matryoshka`).
//!
//! Truncation is meaningful only for embedders trained with Matryoshka Representation
//! Learning (nomic-embed-text v1.5, mxbai-embed-large, OpenAI text-embedding-3), whose
//! leading dimensions carry most of the information by construction. The bundled
//! all-MiniLM-L6-v2 is not MRL-trained, so the router does not truncate; the evaluation
//! shows what a prefix of its vector loses.

use mesh_control::embed::normalize;

/// Matryoshka truncation: layer-norm over the full vector (no affine), keep the first `dim` components,
/// re-normalise.
///
/// # Panics
///
/// If `dim` is 0 or larger than `v.len()`.
pub fn matryoshka_truncate(v: &[f32], dim: usize) -> Vec<f32> {
    assert!(
        dim > 0 && dim <= v.len(),
        "matryoshka dim {dim} not in 1..={}",
        v.len()
    );
    let n = v.len() as f32;
    let mean = v.iter().sum::<f32>() / n;
    let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / n;
    let inv = 1.0 / (var + 1e-5).sqrt();
    let mut out: Vec<f32> = v[..dim].iter().map(|x| (x - mean) * inv).collect();
    normalize(&mut out);
    out
}

/// Indexes of `items` by dot product with `query`, best first, the first `k`.
pub fn top_k(query: &[f32], items: &[Vec<f32>], k: usize) -> Vec<usize> {
    let mut scored: Vec<(usize, f32)> = items
        .iter()
        .enumerate()
        .map(|(i, v)| (i, v.iter().zip(query).map(|(a, b)| a * b).sum()))
        .collect();
    scored.sort_by(|a, b| b.1.total_cmp(&a.1));
    scored.into_iter().take(k).map(|(i, _)| i).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_is_a_unit_length_prefix_of_the_layer_normed_vector() {
        let v: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let t = matryoshka_truncate(&v, 4);
        assert_eq!(t.len(), 4);
        let norm: f32 = t.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5);
        // Centred (mean 3.5): the first four components are all negative, increasing.
        assert!(t.iter().all(|&x| x < 0.0));
        assert!(t.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn the_full_length_keeps_the_centred_direction() {
        let v: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let full = matryoshka_truncate(&v, 8);
        let mut centred: Vec<f32> = v.iter().map(|x| x - 3.5).collect();
        normalize(&mut centred);
        for (a, b) in full.iter().zip(&centred) {
            assert!((a - b).abs() < 1e-4);
        }
    }

    #[test]
    #[should_panic(expected = "matryoshka dim")]
    fn a_prefix_longer_than_the_vector_is_refused() {
        matryoshka_truncate(&[1.0, 2.0], 3);
    }

    #[test]
    fn top_k_ranks_by_dot_product() {
        let items = vec![vec![1.0, 0.0], vec![0.0, 1.0], vec![0.6, 0.8]];
        assert_eq!(top_k(&[0.0, 1.0], &items, 2), [1, 2]);
    }
}
