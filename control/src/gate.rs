//! The statistical safety gate of the tuner: a trial's samples (window B, the proposed
//! policy) against the baseline's (window A, the current policy).
//!
//! A change is **accepted** only when both hold:
//! - its objective metric is better in B with one-sided p < `alpha` and by at least
//!   `min_effect` (relative for continuous metrics, absolute for rates);
//! - no guarded metric is worse: neither significantly (one-sided p < `alpha`) nor by
//!   more than its tolerance in the observed effect (so a small sample cannot hide a
//!   large regression).
//!
//! A guarded metric (or the objective) that is worse makes the verdict **revert**; anything
//! else (noise, too small an effect, too few samples) is **reject**: the policy is left as
//! it was either way, the verdicts differ only in what they tell the operator.
//!
//! Tests: continuous metrics (latency, tokens) use the Mann–Whitney U test (normal
//! approximation with tie and continuity correction; it assumes nothing about the shape
//! of latency distributions); rates (accuracy, errors: 0/1 samples) use the two-proportion
//! z-test with a pooled variance.

use serde::{Deserialize, Serialize};

/// Which way is better.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Better {
    /// Latency, errors, tokens.
    Lower,
    /// Accuracy, throughput.
    Higher,
}

/// How a metric's samples are compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Real values (latency in ms): Mann–Whitney U, effect = relative change of the median.
    Continuous,
    /// 0/1 outcomes (correct, failed): two-proportion z-test, effect = difference of rates.
    Rate,
}

/// One metric the gate reads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Metric {
    /// Name of the sample series (`latency_ms`, `accuracy`, `error`).
    pub name: String,
    /// Which way is better.
    pub better: Better,
    /// Test used.
    pub kind: Kind,
    /// Largest worsening tolerated in the observed effect even when not significant
    /// (relative for continuous, absolute for rates).
    pub tolerance: f64,
}

impl Metric {
    /// A continuous metric.
    pub fn continuous(name: &str, better: Better, tolerance: f64) -> Self {
        Self {
            name: name.into(),
            better,
            kind: Kind::Continuous,
            tolerance,
        }
    }

    /// A 0/1 rate.
    pub fn rate(name: &str, better: Better, tolerance: f64) -> Self {
        Self {
            name: name.into(),
            better,
            kind: Kind::Rate,
            tolerance,
        }
    }
}

/// Gate thresholds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GateConfig {
    /// One-sided significance level of every test. Default 0.05.
    pub alpha: f64,
    /// Fewest samples per window and metric; fewer rejects the trial. Default 20.
    pub min_samples: usize,
    /// Smallest improvement of the objective worth a change (relative for continuous
    /// metrics, absolute for rates). Default 0.05.
    pub min_effect: f64,
    /// Metrics that must not get worse.
    pub guards: Vec<Metric>,
}

impl Default for GateConfig {
    fn default() -> Self {
        Self {
            alpha: 0.05,
            min_samples: 20,
            min_effect: 0.05,
            guards: vec![
                Metric::continuous("latency_ms", Better::Lower, 0.10),
                Metric::rate("accuracy", Better::Higher, 0.05),
                Metric::rate("error", Better::Lower, 0.02),
            ],
        }
    }
}

impl GateConfig {
    /// Checks the thresholds make sense.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.alpha > 0.0 && self.alpha < 0.5) {
            return Err("gate.alpha must be in (0, 0.5)".into());
        }
        if self.min_samples < 2 {
            return Err("gate.min_samples must be at least 2".into());
        }
        if !(self.min_effect >= 0.0) || self.guards.iter().any(|g| !(g.tolerance >= 0.0)) {
            return Err("gate.min_effect and tolerances must be >= 0".into());
        }
        Ok(())
    }
}

/// Outcome of one test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Finding {
    /// B is significantly better.
    Better,
    /// B is significantly worse, or worse beyond the tolerance.
    Worse,
    /// No significant difference.
    NoDifference,
    /// Fewer samples than `min_samples` in a window.
    TooFewSamples,
}

/// One metric's comparison, kept in the decision history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TestResult {
    /// Metric name.
    pub metric: String,
    /// Whether it was the objective or a guard.
    pub role: String,
    /// `mann_whitney_u` or `two_proportion_z`.
    pub test: String,
    /// Samples in A (baseline) and B (trial).
    pub n_a: usize,
    /// Samples in B.
    pub n_b: usize,
    /// Median (continuous) or rate (0/1) in A.
    pub a: f64,
    /// Median or rate in B.
    pub b: f64,
    /// U of B (Mann–Whitney) or z (two proportions).
    pub statistic: f64,
    /// z score (B larger = positive).
    pub z: f64,
    /// One-sided p that B is better.
    pub p_better: f64,
    /// One-sided p that B is worse.
    pub p_worse: f64,
    /// Effect, positive = better (relative median change, or rate difference).
    pub effect: f64,
    /// Effect in the wrong direction counted as worse even without significance.
    #[serde(default)]
    pub tolerance: f64,
    /// What the test found.
    pub finding: Finding,
}

/// The gate's verdict on a trial.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Keep the change.
    Accept,
    /// No evidence it helps (noise, too small, too few samples): keep the old policy.
    Reject,
    /// It made something worse: back to the old policy.
    Revert,
}

/// Verdict, why, and every test behind it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GateDecision {
    /// The verdict.
    pub verdict: Verdict,
    /// One sentence for the log and the API.
    pub reason: String,
    /// Objective first, then the guards.
    pub tests: Vec<TestResult>,
}

/// Standard normal CDF.
pub fn normal_cdf(z: f64) -> f64 {
    0.5 * erfc(-z / std::f64::consts::SQRT_2)
}

/// Complementary error function (Numerical Recipes' Chebyshev fit, relative error < 1.2e-7).
fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let r = t
        * (-z * z - 1.265_512_23
            + t * (1.000_023_68
                + t * (0.374_091_96
                    + t * (0.096_784_18
                        + t * (-0.186_288_06
                            + t * (0.278_868_07
                                + t * (-1.135_203_98
                                    + t * (1.488_515_87
                                        + t * (-0.822_152_23 + t * 0.170_872_77)))))))))
            .exp();
    if x >= 0.0 {
        r
    } else {
        2.0 - r
    }
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

/// Mann–Whitney U of `b` against `a`: `(U_b, z)`, z > 0 when `b` tends to be larger.
pub fn mann_whitney(a: &[f64], b: &[f64]) -> (f64, f64) {
    let (na, nb) = (a.len() as f64, b.len() as f64);
    let mut all: Vec<(f64, bool)> = a
        .iter()
        .map(|&x| (x, false))
        .chain(b.iter().map(|&x| (x, true)))
        .collect();
    all.sort_by(|x, y| x.0.total_cmp(&y.0));
    let n = all.len();
    let mut rank_b = 0.0;
    let mut ties = 0.0;
    let mut i = 0;
    while i < n {
        let mut j = i;
        while j + 1 < n && all[j + 1].0 == all[i].0 {
            j += 1;
        }
        let avg = (i + j) as f64 / 2.0 + 1.0;
        let t = (j - i + 1) as f64;
        ties += t * t * t - t;
        rank_b += all[i..=j].iter().filter(|x| x.1).count() as f64 * avg;
        i = j + 1;
    }
    let u = rank_b - nb * (nb + 1.0) / 2.0;
    let nn = na + nb;
    let var = na * nb / 12.0 * ((nn + 1.0) - ties / (nn * (nn - 1.0)));
    if var <= 0.0 {
        return (u, 0.0);
    }
    let d = u - na * nb / 2.0;
    let cc = if d > 0.0 {
        -0.5
    } else if d < 0.0 {
        0.5
    } else {
        0.0
    };
    (u, (d + cc) / var.sqrt())
}

/// Two-proportion z of `b`'s rate against `a`'s (samples are 0/1): `z > 0` when `b` is higher.
pub fn two_proportions(a: &[f64], b: &[f64]) -> f64 {
    let (na, nb) = (a.len() as f64, b.len() as f64);
    let (pa, pb) = (mean(a), mean(b));
    let p = (pa * na + pb * nb) / (na + nb);
    let se = (p * (1.0 - p) * (1.0 / na + 1.0 / nb)).sqrt();
    if se == 0.0 {
        0.0
    } else {
        (pb - pa) / se
    }
}

/// Compares one metric's samples. `threshold_better` is the smallest effect that counts
/// as an improvement (the objective's `min_effect`; guards pass `f64::INFINITY`, they can
/// only be worse or not).
fn compare(
    m: &Metric,
    role: &str,
    a: &[f64],
    b: &[f64],
    cfg: &GateConfig,
    threshold_better: f64,
) -> TestResult {
    let sign = match m.better {
        Better::Higher => 1.0,
        Better::Lower => -1.0,
    };
    let mut r = TestResult {
        metric: m.name.clone(),
        role: role.into(),
        test: match m.kind {
            Kind::Continuous => "mann_whitney_u",
            Kind::Rate => "two_proportion_z",
        }
        .into(),
        n_a: a.len(),
        n_b: b.len(),
        a: f64::NAN,
        b: f64::NAN,
        statistic: f64::NAN,
        z: 0.0,
        p_better: 1.0,
        p_worse: 1.0,
        effect: 0.0,
        tolerance: m.tolerance,
        finding: Finding::TooFewSamples,
    };
    if a.len() < cfg.min_samples || b.len() < cfg.min_samples {
        return r;
    }
    let (z, stat) = match m.kind {
        Kind::Continuous => {
            let (u, z) = mann_whitney(a, b);
            r.a = median(a);
            r.b = median(b);
            let base = r.a.abs().max(f64::EPSILON);
            r.effect = sign * (r.b - r.a) / base;
            (z, u)
        }
        Kind::Rate => {
            let z = two_proportions(a, b);
            r.a = mean(a);
            r.b = mean(b);
            r.effect = sign * (r.b - r.a);
            (z, z)
        }
    };
    r.statistic = stat;
    r.z = z;
    let zb = sign * z;
    r.p_better = 1.0 - normal_cdf(zb);
    r.p_worse = normal_cdf(zb);
    r.finding = if r.p_worse < cfg.alpha || r.effect < -m.tolerance {
        Finding::Worse
    } else if r.p_better < cfg.alpha && r.effect >= threshold_better {
        Finding::Better
    } else {
        Finding::NoDifference
    };
    r
}

/// Samples of one window by metric name.
pub type Samples = std::collections::BTreeMap<String, Vec<f64>>;

/// Judges a trial: `a` = baseline window, `b` = trial window.
pub fn evaluate(cfg: &GateConfig, objective: &Metric, a: &Samples, b: &Samples) -> GateDecision {
    let empty = vec![];
    let get = |s: &Samples, name: &str| s.get(name).unwrap_or(&empty).clone();
    let mut tests = vec![compare(
        objective,
        "objective",
        &get(a, &objective.name),
        &get(b, &objective.name),
        cfg,
        cfg.min_effect,
    )];
    for g in cfg.guards.iter().filter(|g| g.name != objective.name) {
        tests.push(compare(
            g,
            "guard",
            &get(a, &g.name),
            &get(b, &g.name),
            cfg,
            f64::INFINITY,
        ));
    }
    let worse: Vec<&TestResult> = tests
        .iter()
        .filter(|t| t.finding == Finding::Worse)
        .collect();
    let short: Vec<&TestResult> = tests
        .iter()
        .filter(|t| t.finding == Finding::TooFewSamples)
        .collect();
    let obj = &tests[0];
    let (verdict, reason) = if let Some(w) = worse.first() {
        // Worse is either significant or a change past the metric's tolerance: a regression
        // that large is not kept on the chance that it is noise.
        let why = if w.p_worse < cfg.alpha {
            format!("p_worse {:.4}", w.p_worse)
        } else {
            format!(
                "past the {:.2} tolerance, p_worse {:.4}",
                w.tolerance, w.p_worse
            )
        };
        (
            Verdict::Revert,
            format!(
                "{} got worse: {:.4} -> {:.4} (effect {:+.3}, {why})",
                w.metric, w.a, w.b, w.effect
            ),
        )
    } else if let Some(s) = short.first() {
        (
            Verdict::Reject,
            format!(
                "too few samples of {} ({} and {}, need {})",
                s.metric, s.n_a, s.n_b, cfg.min_samples
            ),
        )
    } else if obj.finding == Finding::Better {
        (
            Verdict::Accept,
            format!(
                "{} improved: {:.4} -> {:.4} (effect {:+.3}, p {:.4}); no guard got worse",
                obj.metric, obj.a, obj.b, obj.effect, obj.p_better
            ),
        )
    } else {
        (
            Verdict::Reject,
            format!(
                "no significant improvement of {}: {:.4} -> {:.4} (effect {:+.3}, p {:.4}, need p < {} and effect >= {})",
                obj.metric, obj.a, obj.b, obj.effect, obj.p_better, cfg.alpha, cfg.min_effect
            ),
        )
    };
    GateDecision {
        verdict,
        reason,
        tests,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Deterministic pseudo-random numbers (xorshift64*), so sample sets are fixed.
    pub(crate) struct Rng(u64);
    impl Rng {
        pub(crate) fn new(seed: u64) -> Self {
            Self(seed.max(1))
        }
        pub(crate) fn unit(&mut self) -> f64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
        }
        /// Latency-like: base x lognormal-ish noise.
        pub(crate) fn latency(&mut self, base: f64) -> f64 {
            let g: f64 = (0..6).map(|_| self.unit()).sum::<f64>() - 3.0;
            base * (0.25 * g).exp()
        }
        pub(crate) fn bernoulli(&mut self, p: f64) -> f64 {
            f64::from(u8::from(self.unit() < p))
        }
    }

    pub(crate) fn window(seed: u64, n: usize, lat: f64, acc: f64, err: f64) -> Samples {
        let mut r = Rng::new(seed);
        let mut s = Samples::new();
        s.insert(
            "latency_ms".into(),
            (0..n).map(|_| r.latency(lat)).collect(),
        );
        s.insert(
            "accuracy".into(),
            (0..n).map(|_| r.bernoulli(acc)).collect(),
        );
        s.insert("error".into(), (0..n).map(|_| r.bernoulli(err)).collect());
        s
    }

    #[test]
    fn normal_cdf_matches_tables() {
        assert!((normal_cdf(0.0) - 0.5).abs() < 1e-7);
        assert!((normal_cdf(1.959_964) - 0.975).abs() < 1e-6);
        assert!((normal_cdf(-2.326_348) - 0.01).abs() < 1e-6);
    }

    #[test]
    fn mann_whitney_on_separated_and_tied_samples() {
        let a = [1.0, 2.0, 3.0, 4.0, 5.0];
        let b = [6.0, 7.0, 8.0, 9.0, 10.0];
        let (u, z) = mann_whitney(&a, &b);
        assert_eq!(u, 25.0);
        // Normal approximation with continuity correction: z = 12 / sqrt(275/12).
        assert!((z - 12.0 / (275.0f64 / 12.0).sqrt()).abs() < 1e-9, "{z}");
        let (u, z) = mann_whitney(&b, &a);
        assert_eq!(u, 0.0);
        assert!(z < -2.4);
        let (_, z) = mann_whitney(&[3.0; 10], &[3.0; 10]);
        assert_eq!(z, 0.0, "all tied: no evidence");
    }

    #[test]
    fn a_real_improvement_is_accepted() {
        let cfg = GateConfig::default();
        let a = window(1, 60, 100.0, 0.80, 0.0);
        let b = window(2, 60, 70.0, 0.80, 0.0);
        let d = evaluate(&cfg, &cfg.guards[0], &a, &b);
        assert_eq!(d.verdict, Verdict::Accept, "{d:#?}");
        assert_eq!(d.tests[0].finding, Finding::Better);
        assert!(d.tests[0].effect > 0.2, "{:?}", d.tests[0]);
        assert_eq!(d.tests.len(), 3, "objective + two other guards");
    }

    #[test]
    fn a_regression_past_the_tolerance_reverts_without_significance_and_says_so() {
        let cfg = GateConfig::default();
        let lat =
            |scale: f64| -> Vec<f64> { (0..24).map(|i| (60.0 + 4.0 * i as f64) * scale).collect() };
        let rest = |s: &mut Samples| {
            s.insert("accuracy".into(), vec![1.0; 24]);
            s.insert("error".into(), vec![0.0; 24]);
        };
        let mut a = Samples::from([("latency_ms".to_string(), lat(1.0))]);
        let mut b = Samples::from([("latency_ms".to_string(), lat(1.12))]);
        rest(&mut a);
        rest(&mut b);
        let d = evaluate(&cfg, &cfg.guards[0], &a, &b);
        let t = &d.tests[0];
        assert!(t.p_worse >= cfg.alpha, "not significant: {t:?}");
        assert!(t.effect < -t.tolerance, "{t:?}");
        assert_eq!(d.verdict, Verdict::Revert, "{d:#?}");
        assert!(d.reason.contains("past the 0.10 tolerance"), "{}", d.reason);
    }

    #[test]
    fn pure_noise_is_rejected() {
        let cfg = GateConfig::default();
        // Same distributions, several seeds: never accepted, never called a regression
        // of more than the tolerance.
        for seed in 0..10 {
            let a = window(100 + seed, 60, 100.0, 0.8, 0.02);
            let b = window(200 + seed, 60, 100.0, 0.8, 0.02);
            let d = evaluate(&cfg, &cfg.guards[0], &a, &b);
            assert_ne!(d.verdict, Verdict::Accept, "seed {seed}: {d:#?}");
        }
        let a = window(7, 60, 100.0, 0.8, 0.0);
        let b = window(8, 60, 100.0, 0.8, 0.0);
        let d = evaluate(&cfg, &cfg.guards[0], &a, &b);
        assert_eq!(d.verdict, Verdict::Reject, "{d:#?}");
        assert!(
            d.reason.contains("no significant improvement"),
            "{}",
            d.reason
        );
    }

    #[test]
    fn a_faster_but_less_accurate_change_is_reverted() {
        let cfg = GateConfig::default();
        let a = window(3, 80, 100.0, 0.85, 0.0);
        let b = window(4, 80, 60.0, 0.55, 0.0);
        let d = evaluate(&cfg, &cfg.guards[0], &a, &b);
        assert_eq!(d.verdict, Verdict::Revert, "{d:#?}");
        assert!(d.reason.starts_with("accuracy got worse"), "{}", d.reason);
        assert_eq!(d.tests[0].finding, Finding::Better, "latency did improve");
    }

    #[test]
    fn a_slower_change_is_reverted_even_when_more_accurate() {
        let cfg = GateConfig::default();
        let acc = Metric::rate("accuracy", Better::Higher, 0.0);
        let a = window(5, 80, 100.0, 0.6, 0.0);
        let b = window(6, 80, 180.0, 0.9, 0.0);
        let d = evaluate(&cfg, &acc, &a, &b);
        assert_eq!(d.verdict, Verdict::Revert, "{d:#?}");
        assert!(d.reason.starts_with("latency_ms got worse"), "{}", d.reason);
    }

    #[test]
    fn too_few_samples_is_rejected_not_accepted() {
        let cfg = GateConfig::default();
        let a = window(9, 10, 100.0, 0.8, 0.0);
        let b = window(10, 10, 50.0, 0.8, 0.0);
        let d = evaluate(&cfg, &cfg.guards[0], &a, &b);
        assert_eq!(d.verdict, Verdict::Reject);
        assert!(d.reason.contains("too few samples"), "{}", d.reason);
    }
}
