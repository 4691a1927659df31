//! Percentiles and medians. Pure functions.

use serde::Serialize;

/// Linear-interpolated percentile (`q` in 0..=100) of unsorted values; `None` when empty.
pub(crate) fn percentile(values: &[f64], q: f64) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let rank = (q / 100.0).clamp(0.0, 1.0) * (v.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    Some(v[lo] + (v[hi] - v[lo]) * (rank - lo as f64))
}

/// Median of unsorted values; `None` when empty.
pub(crate) fn median(values: &[f64]) -> Option<f64> {
    percentile(values, 50.0)
}

/// p50 / p95 / p99 of a set of values, with the count they come from.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub(crate) struct Percentiles {
    pub(crate) n: usize,
    pub(crate) p50: Option<f64>,
    pub(crate) p95: Option<f64>,
    pub(crate) p99: Option<f64>,
}

impl Percentiles {
    pub(crate) fn of(values: &[f64]) -> Self {
        Self {
            n: values.len(),
            p50: percentile(values, 50.0),
            p95: percentile(values, 95.0),
            p99: percentile(values, 99.0),
        }
    }
}

/// `a / b` when both are known and `b` is not zero.
pub(crate) fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b != 0.0 => Some(a / b),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_interpolates_between_ranks() {
        let v = [4.0, 1.0, 3.0, 2.0];
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 100.0), Some(4.0));
        assert_eq!(median(&v), Some(2.5));
        assert_eq!(percentile(&v, 25.0), Some(1.75));
    }

    #[test]
    fn median_of_odd_count_is_the_middle_value() {
        assert_eq!(median(&[9.0, 1.0, 5.0]), Some(5.0));
        assert_eq!(median(&[7.0]), Some(7.0));
    }

    #[test]
    fn empty_and_non_finite_values_give_none() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[f64::NAN]), None);
        assert_eq!(median(&[f64::NAN, 2.0]), Some(2.0));
        let p = Percentiles::of(&[]);
        assert_eq!((p.n, p.p50, p.p99), (0, None, None));
    }

    #[test]
    fn ratio_needs_both_sides_and_a_non_zero_divisor() {
        assert_eq!(ratio(Some(3.0), Some(2.0)), Some(1.5));
        assert_eq!(ratio(Some(3.0), Some(0.0)), None);
        assert_eq!(ratio(None, Some(2.0)), None);
    }
}
