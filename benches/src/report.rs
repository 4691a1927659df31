//! Summaries, consistency checks and the markdown table. Pure functions over measured batches.
//!
//! Headline numbers per workload and target: throughput and p50 latencies are the median over
//! repetitions of each repetition's value (robust to drift between repetitions); p95/p99
//! latencies pool every measured request of the workload, as one repetition holds too few
//! requests for a tail.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

use crate::stats::{median, ratio, Percentiles};
use crate::workload::{Batch, Sample};

/// Report names of the two targets, in run order (A, B).
pub(crate) const TARGETS: [&str; 2] = ["mesh", "llama-server"];

/// Which direction of a metric is better.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Better {
    Higher,
    Lower,
}

impl Better {
    pub(crate) fn word(self) -> &'static str {
        match self {
            Better::Higher => "higher",
            Better::Lower => "lower",
        }
    }
}

/// One headline metric.
pub(crate) struct Metric {
    pub(crate) key: &'static str,
    pub(crate) label: &'static str,
    pub(crate) better: Better,
    decimals: usize,
}

/// Headline metrics, in table order.
pub(crate) const METRICS: &[Metric] = &[
    Metric {
        key: "total_tok_s",
        label: "generated tok/s (all streams)",
        better: Better::Higher,
        decimals: 1,
    },
    Metric {
        key: "decode_tok_s_p50",
        label: "decode tok/s per request, p50",
        better: Better::Higher,
        decimals: 1,
    },
    Metric {
        key: "prefill_tok_s_p50",
        label: "prefill tok/s per request (prompt tokens / TTFT), p50",
        better: Better::Higher,
        decimals: 1,
    },
    Metric {
        key: "ttft_p50_ms",
        label: "TTFT p50 (ms)",
        better: Better::Lower,
        decimals: 2,
    },
    Metric {
        key: "ttft_p95_ms",
        label: "TTFT p95 (ms)",
        better: Better::Lower,
        decimals: 2,
    },
    Metric {
        key: "itl_p50_ms",
        label: "inter-token latency p50 (ms)",
        better: Better::Lower,
        decimals: 3,
    },
    Metric {
        key: "itl_p95_ms",
        label: "inter-token latency p95 (ms)",
        better: Better::Lower,
        decimals: 3,
    },
    Metric {
        key: "itl_p99_ms",
        label: "inter-token latency p99 (ms)",
        better: Better::Lower,
        decimals: 3,
    },
];

/// Headline values of one target on one workload, by metric key.
pub(crate) type Headline = BTreeMap<&'static str, Option<f64>>;

fn ms(v: &[f64]) -> Vec<f64> {
    v.iter().map(|s| s * 1e3).collect()
}

fn total_tokens(b: &Batch) -> usize {
    b.samples.iter().map(|s| s.completion_tokens).sum()
}

fn total_tok_s(b: &Batch) -> Option<f64> {
    (b.wall_s > 0.0).then(|| total_tokens(b) as f64 / b.wall_s)
}

fn ttfts(samples: &[&Sample]) -> Vec<f64> {
    ms(&samples.iter().map(|s| s.ttft_s).collect::<Vec<_>>())
}

fn itls(samples: &[&Sample]) -> Vec<f64> {
    ms(&samples
        .iter()
        .flat_map(|s| s.itl_s.iter().copied())
        .collect::<Vec<_>>())
}

fn decode_rates(samples: &[&Sample]) -> Vec<f64> {
    samples.iter().filter_map(|s| s.decode_tok_s).collect()
}

/// Prompt tokens over TTFT, per request that reported its prompt tokens: the prefill rate a
/// client sees (queueing and the first decode step included).
fn prefill_rates(samples: &[&Sample]) -> Vec<f64> {
    samples
        .iter()
        .filter(|s| s.ttft_s > 0.0)
        .filter_map(|s| s.prompt_tokens.map(|n| n as f64 / s.ttft_s))
        .collect()
}

fn samples(b: &Batch) -> Vec<&Sample> {
    b.samples.iter().collect()
}

/// A metric computed from one repetition alone, or `None` for metrics pooled over all.
fn rep_value(key: &str, b: &Batch) -> Option<f64> {
    match key {
        "total_tok_s" => total_tok_s(b),
        "decode_tok_s_p50" => median(&decode_rates(&samples(b))),
        "prefill_tok_s_p50" => median(&prefill_rates(&samples(b))),
        "ttft_p50_ms" => median(&ttfts(&samples(b))),
        "itl_p50_ms" => median(&itls(&samples(b))),
        _ => None,
    }
}

fn is_per_rep(key: &str) -> bool {
    matches!(
        key,
        "total_tok_s" | "decode_tok_s_p50" | "prefill_tok_s_p50" | "ttft_p50_ms" | "itl_p50_ms"
    )
}

/// Headline values from the measured repetitions.
pub(crate) fn headline(reps: &[Batch]) -> Headline {
    let pooled: Vec<&Sample> = reps.iter().flat_map(|b| b.samples.iter()).collect();
    let (ttft, itl) = (
        Percentiles::of(&ttfts(&pooled)),
        Percentiles::of(&itls(&pooled)),
    );
    METRICS
        .iter()
        .map(|m| {
            let v = match m.key {
                k if is_per_rep(k) => median(
                    &reps
                        .iter()
                        .filter_map(|b| rep_value(k, b))
                        .collect::<Vec<_>>(),
                ),
                "ttft_p95_ms" => ttft.p95,
                "itl_p95_ms" => itl.p95,
                "itl_p99_ms" => itl.p99,
                _ => None,
            };
            (m.key, v)
        })
        .collect()
}

/// mesh / llama-server per repetition pair (repetition i of each, run back to back), for the
/// metrics a single repetition yields; their spread shows how stable a ratio is.
pub(crate) fn pair_ratios(mesh: &[Batch], llama: &[Batch]) -> BTreeMap<&'static str, Vec<f64>> {
    METRICS
        .iter()
        .filter(|m| is_per_rep(m.key))
        .map(|m| {
            let r = mesh
                .iter()
                .zip(llama)
                .filter_map(|(a, b)| ratio(rep_value(m.key, a), rep_value(m.key, b)))
                .collect();
            (m.key, r)
        })
        .collect()
}

fn batch_json(b: &Batch) -> Value {
    let s: Vec<&Sample> = b.samples.iter().collect();
    json!({
        "wall_s": b.wall_s,
        "requests": b.samples.len(),
        "completion_tokens": total_tokens(b),
        "total_tok_s": total_tok_s(b),
        "ttft_ms": Percentiles::of(&ttfts(&s)),
        "itl_ms": Percentiles::of(&itls(&s)),
        "decode_tok_s": Percentiles::of(&decode_rates(&s)),
        "other_processes": b.foreign,
    })
}

fn headline_json(h: &Headline) -> Value {
    let mut m = Map::new();
    for metric in METRICS {
        m.insert(
            metric.key.to_owned(),
            json!(h.get(metric.key).copied().flatten()),
        );
    }
    Value::Object(m)
}

/// Everything recorded for one target on one workload.
pub(crate) fn target_json(warmup: Option<&Batch>, reps: &[Batch]) -> Value {
    let pooled: Vec<&Sample> = reps.iter().flat_map(|b| b.samples.iter()).collect();
    json!({
        "headline": headline_json(&headline(reps)),
        "pooled": {
            "requests": pooled.len(),
            "ttft_ms": Percentiles::of(&ttfts(&pooled)),
            "itl_ms": Percentiles::of(&itls(&pooled)),
            "decode_tok_s": Percentiles::of(&decode_rates(&pooled)),
            "e2e_ms": Percentiles::of(&ms(&pooled.iter().map(|s| s.e2e_s).collect::<Vec<_>>())),
        },
        "reps": reps.iter().map(batch_json).collect::<Vec<_>>(),
        "warmup": warmup.map(batch_json),
        "requests": reps.iter().flat_map(|b| b.samples.iter()).collect::<Vec<_>>(),
    })
}

/// mesh / llama-server per headline metric.
pub(crate) fn ratios(mesh: &Headline, llama: &Headline) -> Value {
    let mut m = Map::new();
    for metric in METRICS {
        let r = ratio(
            mesh.get(metric.key).copied().flatten(),
            llama.get(metric.key).copied().flatten(),
        );
        m.insert(metric.key.to_owned(), json!(r));
    }
    Value::Object(m)
}

/// Checks that both targets did the same work: same prompt token counts for the same prompt,
/// the requested number of tokens, and (informative only) the same greedy text.
pub(crate) fn checks(mesh: &[&Batch], llama: &[&Batch], max_tokens: usize) -> Value {
    let index = |batches: &[&Batch]| -> BTreeMap<usize, Sample> {
        batches
            .iter()
            .flat_map(|b| b.samples.iter())
            .map(|s| (s.prompt, s.clone()))
            .collect()
    };
    let (a, b) = (index(mesh), index(llama));
    let mut compared = 0;
    let mut prompt_mismatch = Vec::new();
    let mut same_text = 0;
    for (k, sa) in &a {
        let Some(sb) = b.get(k) else { continue };
        compared += 1;
        if sa.prompt_tokens != sb.prompt_tokens {
            prompt_mismatch.push(
                json!({"prompt": k, "mesh": sa.prompt_tokens, "llama-server": sb.prompt_tokens}),
            );
        }
        if sa.text == sb.text {
            same_text += 1;
        }
    }
    let short = |m: &BTreeMap<usize, Sample>| {
        m.values()
            .filter(|s| s.completion_tokens != max_tokens)
            .count()
    };
    let from_usage = |m: &BTreeMap<usize, Sample>| m.values().all(|s| s.tokens_from_usage);
    let prompt_tokens: Vec<f64> = a
        .values()
        .filter_map(|s| s.prompt_tokens.map(|n| n as f64))
        .collect();
    json!({
        "prompts_compared": compared,
        "prompt_token_count_mismatches": prompt_mismatch.len(),
        "prompt_token_count_mismatch_examples": prompt_mismatch.into_iter().take(10).collect::<Vec<_>>(),
        "prompt_tokens": {
            "min": prompt_tokens.iter().copied().reduce(f64::min),
            "median": median(&prompt_tokens),
            "max": prompt_tokens.iter().copied().reduce(f64::max),
        },
        "requests_not_max_tokens": {"mesh": short(&a), "llama-server": short(&b)},
        "tokens_counted_from_usage": {"mesh": from_usage(&a), "llama-server": from_usage(&b)},
        "identical_greedy_text": same_text,
    })
}

/// One table row.
pub(crate) struct Row {
    pub(crate) workload: String,
    pub(crate) label: String,
    pub(crate) mesh: Option<f64>,
    pub(crate) llama: Option<f64>,
    pub(crate) decimals: usize,
    pub(crate) better: Better,
    /// Ratios of the repetition pairs (empty for pooled metrics).
    pub(crate) pair_ratios: Vec<f64>,
}

/// Rows for one workload's headline metrics.
pub(crate) fn rows(
    workload: &str,
    mesh: &Headline,
    llama: &Headline,
    pairs: &BTreeMap<&'static str, Vec<f64>>,
) -> Vec<Row> {
    METRICS
        .iter()
        .map(|m| Row {
            workload: workload.to_owned(),
            label: m.label.to_owned(),
            mesh: mesh.get(m.key).copied().flatten(),
            llama: llama.get(m.key).copied().flatten(),
            decimals: m.decimals,
            better: m.better,
            pair_ratios: pairs.get(m.key).cloned().unwrap_or_default(),
        })
        .collect()
}

/// The markdown table of rows.
pub(crate) fn table(rows: &[Row]) -> String {
    let fmt = |v: Option<f64>, d: usize| v.map_or("n/a".to_owned(), |v| format!("{v:.d$}"));
    let mut out = String::from(
        "| workload | metric | better | mesh | llama-server | mesh / llama-server | per-pair ratios |\n|---|---|---|---:|---:|---:|---|\n",
    );
    for r in rows {
        let pairs = if r.pair_ratios.is_empty() {
            "–".to_owned()
        } else {
            r.pair_ratios
                .iter()
                .map(|v| format!("{v:.2}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} |\n",
            r.workload,
            r.label,
            r.better.word(),
            fmt(r.mesh, r.decimals),
            fmt(r.llama, r.decimals),
            fmt(ratio(r.mesh, r.llama), 3),
            pairs,
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(prompt: usize, ttft: f64, gaps: &[f64], tokens: usize, text: &str) -> Sample {
        Sample {
            prompt,
            stream: 0,
            ttft_s: ttft,
            e2e_s: ttft + gaps.iter().sum::<f64>(),
            completion_tokens: tokens,
            tokens_from_usage: true,
            prompt_tokens: Some(100),
            chunks: gaps.len() + 1,
            decode_tok_s: Some((tokens - 1) as f64 / gaps.iter().sum::<f64>()),
            itl_s: gaps.to_vec(),
            text: text.to_owned(),
        }
    }

    #[test]
    fn headline_takes_median_over_reps_for_throughput() {
        let reps: Vec<Batch> = [1.0, 2.0, 4.0]
            .iter()
            .map(|&wall| Batch {
                wall_s: wall,
                foreign: None,
                samples: vec![sample(0, 0.01, &[0.001, 0.003], 3, "x")],
            })
            .collect();
        let h = headline(&reps);
        let pairs = pair_ratios(&reps, &reps[1..]);
        assert_eq!(pairs["total_tok_s"], vec![2.0, 2.0]);
        assert!(!pairs.contains_key("itl_p99_ms"));
        // 3 tokens over 1, 2 and 4 s: the median is 1.5 tok/s.
        assert_eq!(h["total_tok_s"], Some(1.5));
        assert!((h["ttft_p50_ms"].unwrap() - 10.0).abs() < 1e-9);
        assert!((h["itl_p50_ms"].unwrap() - 2.0).abs() < 1e-9);
    }

    #[test]
    fn prefill_rate_is_prompt_tokens_over_ttft_and_skips_requests_without_a_count() {
        let mut unknown = sample(1, 0.5, &[0.1], 2, "y");
        unknown.prompt_tokens = None;
        let b = Batch {
            wall_s: 1.0,
            foreign: None,
            // 100 prompt tokens in 0.25 s and in 0.5 s: 400 and 200 tok/s, median 300.
            samples: vec![
                sample(0, 0.25, &[0.1], 2, "x"),
                sample(2, 0.5, &[0.1], 2, "z"),
                unknown,
            ],
        };
        assert_eq!(rep_value("prefill_tok_s_p50", &b), Some(300.0));
    }

    #[test]
    fn checks_compare_the_same_prompt_across_targets() {
        let a = Batch {
            wall_s: 1.0,
            foreign: None,
            samples: vec![
                sample(0, 0.1, &[0.1], 2, "ab"),
                sample(1, 0.1, &[0.1], 2, "cd"),
            ],
        };
        let mut other = sample(1, 0.1, &[0.1], 1, "zz");
        other.prompt_tokens = Some(99);
        let b = Batch {
            wall_s: 1.0,
            foreign: None,
            samples: vec![sample(0, 0.1, &[0.1], 2, "ab"), other],
        };
        let c = checks(&[&a], &[&b], 2);
        assert_eq!(c["prompts_compared"], 2);
        assert_eq!(c["prompt_token_count_mismatches"], 1);
        assert_eq!(c["identical_greedy_text"], 1);
        assert_eq!(c["requests_not_max_tokens"]["llama-server"], 1);
        assert_eq!(c["requests_not_max_tokens"]["mesh"], 0);
    }

    #[test]
    fn table_prints_ratio_mesh_over_llama_server() {
        let row = |mesh, llama| Row {
            workload: "1 stream".into(),
            label: "tok/s".into(),
            mesh,
            llama,
            decimals: 1,
            better: Better::Higher,
            pair_ratios: vec![0.8, 1.0],
        };
        let t = table(&[row(Some(90.0), Some(100.0))]);
        assert!(t.contains("| 1 stream | tok/s | higher | 90.0 | 100.0 | 0.900 | 0.80 1.00 |"));
        let rows = vec![row(None, Some(1.0))];
        assert!(table(&rows).contains("| n/a | 1.0 | n/a |"));
    }
}
