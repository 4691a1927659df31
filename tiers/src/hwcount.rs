//! Hardware counters of an engine: instructions, cycles and cache misses of its thread and
//! of the llama.cpp compute threads that thread starts (Linux perf events, user space only,
//! counted per engine so they can be divided by the tokens it generated).
//!
//! Where the kernel gives no counters (a VM without a virtual PMU, `perf_event_paranoid`
//! above 2, a seccomp filter) the engine runs without them and [`HwStats::available`] says
//! so, with the reason; the metrics then leave the counter series out instead of reporting
//! zeros.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use perf_event::events::Hardware;
use perf_event::{Builder, Counter};

/// The counted events, in the order of [`HwStats::values`].
pub const EVENTS: [(&str, Hardware); 3] = [
    ("instructions", Hardware::INSTRUCTIONS),
    ("cycles", Hardware::CPU_CYCLES),
    ("cache_misses", Hardware::CACHE_MISSES),
];

/// What the engine thread publishes for the metrics.
#[derive(Debug, Default)]
pub struct HwStats {
    /// `None` until the engine thread has tried; then `Ok(())` or the reason they are absent.
    state: Mutex<Option<Result<(), String>>>,
    values: [AtomicU64; 3],
}

impl HwStats {
    /// Whether the counters run: `None` before the engine started, else `Err(reason)` when
    /// the kernel refused them.
    pub fn available(&self) -> Option<Result<(), String>> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Totals per event of [`EVENTS`] since the engine started; `None` when absent.
    pub fn values(&self) -> Option<[u64; 3]> {
        matches!(self.available(), Some(Ok(()))).then(|| {
            [
                self.values[0].load(Relaxed),
                self.values[1].load(Relaxed),
                self.values[2].load(Relaxed),
            ]
        })
    }
}

/// Open counters, owned by the engine thread.
pub struct HwCounters {
    counters: Vec<Counter>,
}

impl HwCounters {
    /// Opens and starts the counters for the calling thread and every thread it starts
    /// from now on (`inherit`), and records the outcome in `stats`.
    pub fn open(stats: &HwStats) -> Option<Self> {
        let opened: Result<Vec<Counter>, String> = EVENTS
            .iter()
            .map(|(name, ev)| {
                let mut c = Builder::new(*ev)
                    .inherit(true)
                    .build()
                    .map_err(|e| format!("{name}: {e}"))?;
                c.enable().map_err(|e| format!("{name}: {e}"))?;
                Ok(c)
            })
            .collect();
        let (state, counters) = match opened {
            Ok(c) => (Ok(()), Some(Self { counters: c })),
            Err(e) => (Err(format!("perf events unavailable ({e})")), None),
        };
        *stats
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(state);
        counters
    }

    /// Reads the counters into `stats` (three reads; called once per engine step).
    pub fn publish(&mut self, stats: &HwStats) {
        for (c, v) in self.counters.iter_mut().zip(&stats.values) {
            if let Ok(n) = c.read() {
                v.store(n, Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a host with a PMU the counters count this thread's work; where the kernel has
    /// none (this project's CI VM has no virtual PMU) they are reported absent with a
    /// reason and no values. Either way the answer is consistent.
    #[test]
    fn counters_count_or_are_reported_absent() {
        let stats = HwStats::default();
        assert!(stats.available().is_none() && stats.values().is_none());
        match HwCounters::open(&stats) {
            Some(mut hw) => {
                let mut x = 0u64;
                for i in 0..2_000_000u64 {
                    x = x.wrapping_mul(31).wrapping_add(i);
                }
                std::hint::black_box(x);
                hw.publish(&stats);
                let v = stats.values().expect("values when available");
                assert!(v[0] > 2_000_000, "instructions {v:?}");
                assert!(v[1] > 0, "cycles {v:?}");
            }
            None => {
                let why = stats.available().expect("tried").unwrap_err();
                assert!(why.contains("perf events unavailable"), "{why}");
                assert!(stats.values().is_none(), "absent, not zero");
            }
        }
    }
}
