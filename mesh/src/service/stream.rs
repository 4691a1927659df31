//! A generation's token stream with its latency metrics recorded as it is read (TTFT,
//! inter-token latency, request duration, tokens).

use std::sync::Arc;
use std::time::Instant;

use mesh_tiers::TokenEvent;
use tokio::sync::mpsc;

use crate::metrics::Metrics;

/// Token events of one generation, timed.
pub(crate) struct Timed {
    rx: mpsc::UnboundedReceiver<TokenEvent>,
    model: String,
    metrics: Arc<Metrics>,
    arrived: Instant,
    last: Option<Instant>,
}

impl Timed {
    /// Times the events of `rx` for `model`, from `arrived`.
    pub(crate) fn new(
        rx: mpsc::UnboundedReceiver<TokenEvent>,
        model: &str,
        metrics: Arc<Metrics>,
        arrived: Instant,
    ) -> Self {
        Self {
            rx,
            model: model.to_owned(),
            metrics,
            arrived,
            last: None,
        }
    }

    /// Reads `rx` from now on (a generation asked again); the one before is dropped, which
    /// cancels it.
    pub(crate) fn replace(&mut self, rx: mpsc::UnboundedReceiver<TokenEvent>) {
        self.rx = rx;
        self.last = None;
    }

    /// The next event.
    ///
    /// Cancel safety: cancel-safe.
    pub(crate) async fn next(&mut self) -> Option<TokenEvent> {
        let ev = self.rx.recv().await?;
        let l = Metrics::model(&self.model);
        match &ev {
            TokenEvent::Started { .. } | TokenEvent::Error(_) => {}
            TokenEvent::Token { .. } => {
                let now = Instant::now();
                match self.last {
                    None => self
                        .metrics
                        .ttft
                        .get_or_create(&l)
                        .observe((now - self.arrived).as_secs_f64()),
                    Some(prev) => self
                        .metrics
                        .itl
                        .get_or_create(&l)
                        .observe((now - prev).as_secs_f64()),
                }
                self.last = Some(now);
            }
            TokenEvent::Done { usage, .. } => {
                let m = &self.metrics;
                m.reasoning_tokens
                    .get_or_create(&l)
                    .inc_by(usage.reasoning_tokens as u64);
                if usage.reasoning_capped {
                    m.reasoning_capped(&self.model);
                }
                m.prompt_tokens
                    .get_or_create(&l)
                    .inc_by(usage.prompt_tokens as u64);
                m.generation_tokens
                    .get_or_create(&l)
                    .inc_by(usage.completion_tokens as u64);
                m.e2e
                    .get_or_create(&l)
                    .observe(self.arrived.elapsed().as_secs_f64());
            }
        }
        Some(ev)
    }
}
