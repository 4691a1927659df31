//! The continuous-batching loop on the engine thread: admitting requests into slots,
//! planning and decoding each step, choosing and emitting tokens, publishing pages.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;
use tokio::sync::mpsc;
use tracing::{debug, warn};

use super::drafting::{Draft, SpecSeq};
use super::residency::{copy_prefix, Resident};
use super::{phase, step_kind, Command, EngineStats, ModelInfo, Pending};
use crate::format::ThinkMarkers;
use crate::kvcache::{KvCache, PromptPages};
use crate::plan::{self, SlotView, Work};
use crate::reasoning::{self, SpanState};
use crate::sampler::{top2, DraftSampler, RequestSampler};
use crate::speculative;
use crate::stop::StopMatcher;
use crate::{
    DraftAcceptance, EngineConfig, FinishReason, GenerateRequest, LogprobEntry, TokenEvent,
    TokenLogprobs, Usage,
};

pub(super) struct Slot {
    pub(super) pages: PromptPages,
    pub(super) req: GenerateRequest,
    pub(super) events: mpsc::UnboundedSender<TokenEvent>,
    pub(super) sampler: RequestSampler,
    pub(super) stop: StopMatcher,
    pub(super) age: u64,
    pub(super) reserve: usize,
    pub(super) prefilled: usize,
    /// Prompt tokens that were not computed (kept in place or restored from pages).
    pub(super) cached: usize,
    pub(super) pending: Option<LlamaToken>,
    pub(super) generated: usize,
    pub(super) utf8: Vec<u8>,
    /// Where the sequence stands relative to its think span (reasoning governor state).
    pub(super) span: SpanState,
    pub(super) reasoning_capped: bool,
    /// Draft state when this sequence is decoded speculatively.
    pub(super) spec: Option<SpecSeq>,
    /// Tokens emitted so far (the sequence's KV holds the prompt, then these).
    pub(super) out: Vec<i32>,
    /// Its prompt was prefilled in this step and its new pages are not published yet: they
    /// are, once the step's first tokens went out (or before the slot is freed).
    pub(super) publish_due: bool,
    /// Log-probabilities of the token being emitted, when the request asks for them.
    pub(super) logprobs: Option<Box<TokenLogprobs>>,
}

pub(super) struct Loop<'m> {
    pub(super) model: &'m LlamaModel,
    pub(super) ctx: LlamaContext<'m>,
    pub(super) cfg: EngineConfig,
    pub(super) max_seq_len: usize,
    pub(super) n_ctx: usize,
    pub(super) stats: Arc<EngineStats>,
    pub(super) slots: Vec<Option<Slot>>,
    pub(super) waiting: VecDeque<Pending>,
    pub(super) reserved: usize,
    pub(super) next_age: u64,
    pub(super) batch: LlamaBatch<'static>,
    pub(super) kv: Option<KvCache>,
    /// Pages some running sequence will publish when its prompt is prefilled (refcounts).
    pub(super) pending: std::collections::HashMap<mesh_kvstore::PageId, usize>,
    /// The reasoning markers, when the tier's format has them (the governor's).
    pub(super) think: Option<Think>,
    /// The draft model, when sequences are decoded speculatively.
    pub(super) draft: Option<Draft<'m>>,
    /// Hardware counters of this thread and llama.cpp's, when the kernel gives them.
    pub(super) hw: Option<crate::hwcount::HwCounters>,
    /// KV kept in each free slot by its last sequence (`EngineConfig::keep_resident`).
    pub(super) resident: Vec<Option<Resident>>,
    pub(super) keep_resident: bool,
    /// Most tokens of kept KV on the device (`EngineConfig::keep_resident_mib`).
    pub(super) keep_budget: Option<usize>,
    /// The model's memory cannot drop a suffix (recurrent or hybrid): no prefix copies.
    pub(super) recurrent: bool,
}

impl<'m> Loop<'m> {
    pub(super) fn new(
        model: &'m LlamaModel,
        ctx: LlamaContext<'m>,
        cfg: &EngineConfig,
        info: &ModelInfo,
        stats: Arc<EngineStats>,
        kv: Option<KvCache>,
        draft: Option<Draft<'m>>,
    ) -> Self {
        Self {
            model,
            ctx,
            cfg: cfg.clone(),
            max_seq_len: info.max_seq_len,
            n_ctx: info.n_ctx,
            stats,
            slots: (0..cfg.n_seq_max).map(|_| None).collect(),
            waiting: VecDeque::new(),
            reserved: 0,
            next_age: 0,
            batch: LlamaBatch::new(cfg.n_batch as usize, 1),
            kv,
            pending: std::collections::HashMap::new(),
            think: None,
            draft,
            hw: None,
            resident: (0..cfg.n_seq_max).map(|_| None).collect(),
            keep_resident: cfg.keep_resident && !cfg.kv_unified,
            keep_budget: cfg.keep_resident_mib.map(|mib| {
                let shape = crate::shape::ModelShape {
                    file_bytes: 0,
                    n_layer: model.n_layer(),
                    n_embd: model.n_embd().max(0) as u32,
                    n_head: model.n_head(),
                    n_head_kv: model.n_head_kv(),
                };
                ((mib << 20) / shape.kv_bytes_per_cell(cfg.kv_type).max(1)) as usize
            }),
            recurrent: model.is_recurrent() || model.is_hybrid(),
        }
    }

    pub(super) fn run(mut self, rx: std_mpsc::Receiver<Command>) {
        loop {
            let idle = self.waiting.is_empty() && self.slots.iter().all(Option::is_none);
            if idle {
                match rx.recv() {
                    Ok(Command::Submit(p)) => self.waiting.push_back(*p),
                    Ok(Command::Shutdown) | Err(_) => break,
                    Ok(Command::Crash) => panic!("engine {}: crash injected", self.cfg.name),
                }
            }
            let mut shutdown = false;
            while let Ok(cmd) = rx.try_recv() {
                match cmd {
                    Command::Submit(p) => self.waiting.push_back(*p),
                    Command::Shutdown => shutdown = true,
                    Command::Crash => panic!("engine {}: crash injected", self.cfg.name),
                }
            }
            if shutdown {
                break;
            }
            self.drop_cancelled();
            self.admit();
            self.step();
        }
        for i in 0..self.slots.len() {
            if let Some(s) = self.slots[i].take() {
                let _ = s.events.send(TokenEvent::Error("engine stopped".into()));
            }
        }
        for p in self.waiting.drain(..) {
            let _ = p.events.send(TokenEvent::Error("engine stopped".into()));
        }
    }

    pub(super) fn drop_cancelled(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|p| !p.events.is_closed());
        let gone = before - self.waiting.len();
        if gone > 0 {
            self.stats.queued.fetch_sub(gone, Ordering::Relaxed);
            self.stats
                .cancelled
                .fetch_add(gone as u64, Ordering::Relaxed);
        }
        for i in 0..self.slots.len() {
            if self.slots[i].as_ref().is_some_and(|s| s.events.is_closed()) {
                debug!(slot = i, "client went away; freeing sequence");
                self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
                let _ = self.free(i);
            }
        }
    }

    pub(super) fn admit(&mut self) {
        let start = Instant::now();
        self.admit_waiting();
        self.add_time(phase::ADMIT, start.elapsed());
    }

    fn admit_waiting(&mut self) {
        let mut i = 0;
        while i < self.waiting.len() {
            if self.slots.iter().all(Option::is_some) {
                break;
            }
            let p = &self.waiting[i];
            if self.reserved + p.reserve > self.n_ctx {
                break;
            }
            // A request whose next uncached pages are being prefilled by a running sequence
            // waits for them to be published instead of computing the same prefix again,
            // when they are at least half of its remaining prompt (`worth_waiting`);
            // requests behind it may go first.
            if let Some(kv) = &mut self.kv {
                if kv.waits_for(&p.req.prompt, &p.req.cache_scope, &self.pending) {
                    i += 1;
                    continue;
                }
            }
            let p = self.waiting.remove(i).expect("index in range");
            self.stats.queued.fetch_sub(1, Ordering::Relaxed);
            let sampler = match RequestSampler::new(self.model, &p.req) {
                Ok(s) => s,
                Err(e) => {
                    let _ = p.events.send(TokenEvent::Error(e.to_string()));
                    continue;
                }
            };
            let queued_ms = p.queued_at.elapsed().as_millis() as u64;
            self.stats.started.fetch_add(1, Ordering::Relaxed);
            self.stats
                .queued_ms_total
                .fetch_add(queued_ms, Ordering::Relaxed);
            let _ = p.events.send(TokenEvent::Started { queued_ms });
            self.reserved += p.reserve;
            self.stats
                .reserved_cells
                .fetch_add(p.reserve, Ordering::Relaxed);
            self.stats.active.fetch_add(1, Ordering::Relaxed);
            let stop = StopMatcher::new(&p.req.stop);
            let (seq, in_place, draft_in_place) = self.take_slot(&p.req.prompt, &p.req.cache_scope);
            self.stats
                .draft_resident_tokens
                .fetch_add(draft_in_place as u64, Ordering::Relaxed);
            // The nearest level first: the slot's own kept KV, then a copy of another running
            // sequence's KV on the same device, then pages (host RAM, far memory, disk, peer),
            // which are restored only when they cover more than either.
            let copy = self.copy_source(seq, &p.req.prompt, &p.req.cache_scope, in_place);
            let device = copy.map_or(in_place, |(_, n)| n);
            let (pages, prefilled) = match &mut self.kv {
                Some(kv) => kv.restore(
                    &mut self.ctx,
                    seq as i32,
                    &p.req.prompt,
                    &p.req.cache_scope,
                    device,
                ),
                None => (PromptPages::default(), device),
            };
            let copied = match copy {
                Some((src, n)) if prefilled == n => {
                    copy_prefix(&mut self.ctx, src, seq, n);
                    self.stats.device_copies.fetch_add(1, Ordering::Relaxed);
                    self.stats
                        .device_copy_tokens
                        .fetch_add(n as u64, Ordering::Relaxed);
                    debug!(
                        src,
                        dst = seq,
                        tokens = n,
                        "copied a prompt prefix on the device"
                    );
                    true
                }
                _ => false,
            };
            if !copied && in_place > 0 && prefilled == in_place {
                self.stats.resident_hits.fetch_add(1, Ordering::Relaxed);
                self.stats
                    .resident_tokens
                    .fetch_add(in_place as u64, Ordering::Relaxed);
            }
            for id in pages.pending() {
                *self.pending.entry(*id).or_default() += 1;
            }
            // Every request is decoded speculatively when the tier has a draft. Verification
            // runs the request's own sampler chain (grammar, sampling) row by row: greedy and
            // `exact` sampled requests keep a draft only when the chain picks that very token,
            // so the chain sees exactly the calls plain decoding would make, in the same
            // order (greedy output is identical, a seeded sampled request draws the same
            // random numbers for the same positions); under `rejection` a sampled request's
            // drafts are drawn from the draft's distribution and kept by speculative
            // sampling against the chain's distribution. A grammar is enforced on every
            // emitted token either way.
            let spec = self.draft.as_ref().map(|d| SpecSeq {
                out: Vec::new(),
                dpos: draft_in_place,
                fed: draft_in_place,
                k: d.cfg.k_init,
                k_step: 0,
                drafts: Vec::new(),
                dists: Vec::new(),
                sampled: match d.cfg.acceptance {
                    DraftAcceptance::Rejection => DraftSampler::new(self.model, &p.req),
                    DraftAcceptance::Exact => None,
                },
                grammar: None,
                drafted: 0,
                accepted: 0,
            });
            let span = SpanState::new(self.think.is_some() && p.req.thinking_open);
            self.slots[seq] = Some(Slot {
                pages,
                req: p.req,
                events: p.events,
                sampler,
                stop,
                age: self.next_age,
                reserve: p.reserve,
                prefilled,
                cached: prefilled,
                pending: None,
                generated: 0,
                utf8: Vec::new(),
                span,
                reasoning_capped: false,
                spec,
                out: Vec::new(),
                publish_due: false,
                logprobs: None,
            });
            self.next_age += 1;
        }
    }

    pub(super) fn step(&mut self) {
        let start = Instant::now();
        let views: Vec<SlotView> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                s.as_ref().map(|s| SlotView {
                    slot: i,
                    age: s.age,
                    prefilled: s.prefilled,
                    prompt_len: s.req.prompt.len(),
                    decoding: s.pending.is_some(),
                })
            })
            .collect();
        // The drafts of speculative sequences take target rows before any prompt chunk.
        let draft_rows = self.plan_drafts();
        let work = plan::plan_step(
            &views,
            (self.cfg.n_batch as usize).saturating_sub(draft_rows),
            self.cfg.prefill_chunk as usize,
        );
        if work.is_empty() {
            return;
        }
        let drafting = Instant::now();
        self.draft(&work);
        let drafted = Instant::now();
        self.batch.clear();
        let mut rows: Vec<(usize, i32)> = Vec::new();
        let mut prompt_done: Vec<usize> = Vec::new();
        let mut prompt_tokens = 0u64;
        for w in &work {
            match *w {
                Work::Decode { slot } => {
                    let s = self.slots[slot].as_mut().expect("planned slot exists");
                    let pos = (s.req.prompt.len() + s.generated - 1) as i32;
                    let tok = s.pending.take().expect("decoding slot has a token");
                    let row = self.batch.n_tokens();
                    self.batch
                        .add(tok, pos, &[slot as i32], true)
                        .expect("batch sized for plan");
                    // Drafts follow the pending token, each with logits, so one decode
                    // scores all of them.
                    for (j, &d) in s.spec.iter().flat_map(|sp| &sp.drafts).enumerate() {
                        self.batch
                            .add(LlamaToken(d), pos + 1 + j as i32, &[slot as i32], true)
                            .expect("batch sized for plan and drafts");
                    }
                    rows.push((slot, row));
                }
                Work::Prefill {
                    slot,
                    start,
                    len,
                    last,
                } => {
                    let s = self.slots[slot].as_mut().expect("planned slot exists");
                    for p in start..start + len {
                        let logits = last && p + 1 == start + len;
                        let row = self.batch.n_tokens();
                        self.batch
                            .add(
                                LlamaToken(s.req.prompt[p]),
                                p as i32,
                                &[slot as i32],
                                logits,
                            )
                            .expect("batch sized for plan");
                        if logits {
                            rows.push((slot, row));
                        }
                    }
                    s.prefilled += len;
                    prompt_tokens += len as u64;
                    if last {
                        prompt_done.push(slot);
                    }
                }
            }
        }
        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        if let Some(hw) = &mut self.hw {
            hw.publish(&self.stats.hw);
        }
        self.stats
            .prompt_tokens
            .fetch_add(prompt_tokens, Ordering::Relaxed);
        let decoding = Instant::now();
        self.add_time(phase::SCHEDULE, decoding - start - (drafted - drafting));
        self.add_time(phase::DRAFT, drafted - drafting);
        let decoded = self.ctx.decode(&mut self.batch);
        // Waits here for a device's results, so that the time is the decode's.
        self.ctx.synchronize();
        let sampling = Instant::now();
        self.add_time(phase::DECODE, sampling - decoding);
        if let Err(e) = decoded {
            warn!(error = %e, "decode failed; failing the sequences of this batch");
            let mut failed: Vec<usize> = work
                .iter()
                .map(|w| match *w {
                    Work::Decode { slot } | Work::Prefill { slot, .. } => slot,
                })
                .collect();
            failed.dedup();
            for slot in failed {
                let freed = self.free(slot);
                self.forget(slot);
                if let Some(s) = freed {
                    let _ = s
                        .events
                        .send(TokenEvent::Error(format!("decode failed: {e}")));
                }
            }
            return;
        }
        // Prompts prefilled in this step publish their new pages after their first token
        // went out: a publish reads the sequence's whole KV state (on a GPU, a copy to host
        // memory of every layer's cells), which the first token need not wait for.
        if self.kv.is_some() {
            for &slot in &prompt_done {
                if let Some(s) = self.slots[slot].as_mut() {
                    s.publish_due = true;
                }
            }
        }
        let emitted = self.stats.step_ns[phase::EMIT].load(Ordering::Relaxed);
        for (slot, row) in rows {
            let (drafts, dists) = self.slots[slot]
                .as_mut()
                .and_then(|s| s.spec.as_mut())
                .map(|sp| {
                    (
                        std::mem::take(&mut sp.drafts),
                        std::mem::take(&mut sp.dists),
                    )
                })
                .unwrap_or_default();
            if drafts.is_empty() {
                let (tok, margin) = self.choose(slot, row);
                self.emit(slot, tok, margin);
            } else {
                self.verify(slot, row, &drafts, &dists);
            }
        }
        let publishing = Instant::now();
        let emit_ns = self.stats.step_ns[phase::EMIT].load(Ordering::Relaxed) - emitted;
        self.add_time(
            phase::SAMPLE,
            (publishing - sampling).saturating_sub(Duration::from_nanos(emit_ns)),
        );
        let mut published = false;
        for slot in prompt_done {
            if let Some(mut s) = self.slots[slot].take() {
                published |= self.publish(slot, &mut s);
                self.slots[slot] = Some(s);
            }
        }
        let end = Instant::now();
        self.add_time(phase::PUBLISH, end - publishing);
        self.stats
            .time_step(step_kind(prompt_tokens, published), end - start);
    }

    /// Adds `d` to the time of step phase `i`.
    pub(super) fn add_time(&self, i: usize, d: Duration) {
        self.stats.step_ns[i].fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Publishes the new pages of `s` (in slot `slot`) when they are due, and releases its
    /// claim on them, so that requests waiting for them go on. Returns whether the
    /// sequence's KV state was read for it.
    pub(super) fn publish(&mut self, slot: usize, s: &mut Slot) -> bool {
        if !std::mem::take(&mut s.publish_due) {
            return false;
        }
        let read = match &mut self.kv {
            Some(kv) => kv.publish(&self.ctx, slot as i32, &mut s.pages),
            None => false,
        };
        self.unpend(s);
        s.pages.clear_pending();
        read
    }

    /// The token plain decoding would choose from logits row `row`: the request's sampler
    /// chain, or `</think>` when the reasoning budget is spent. Returns it with its margin.
    pub(super) fn choose(&mut self, slot: usize, row: i32) -> (LlamaToken, f32) {
        let (argmax, first, second) = top2(self.ctx.get_logits_ith(row));
        let margin = margin_of(first, second);
        let spent = self.budget_spent(slot);
        let s = self.slots[slot].as_mut().expect("sampled slot exists");
        let tok = match &self.think {
            // Reasoning governor: the budget is spent, so close the think block in place
            // of whatever the model would have said next (one token of the close marker
            // per step when the vocabulary spells it in several).
            Some(t) if spent => {
                let close = LlamaToken(reasoning::next_close_token(&s.out, &t.close_tokens));
                s.sampler.accept(close);
                s.reasoning_capped = true;
                self.stats.reasoning_capped.fetch_add(1, Ordering::Relaxed);
                close
            }
            _ => {
                let (tok, refused) = s.sampler.sample(&self.ctx, row, argmax as i32);
                if refused {
                    self.stats.grammar_refusals.fetch_add(1, Ordering::Relaxed);
                }
                tok
            }
        };
        self.note_logprobs(slot, row, tok);
        (tok, margin)
    }

    /// Keeps the log-probabilities of `tok` at logits row `row` for its event, when the
    /// request asks for them.
    pub(super) fn note_logprobs(&mut self, slot: usize, row: i32, tok: LlamaToken) {
        let s = self.slots[slot].as_mut().expect("sampled slot exists");
        if let Some(n) = s.req.logprobs {
            let lp = token_logprobs(self.model, self.ctx.get_logits_ith(row), tok, n);
            s.logprobs = Some(Box::new(lp));
        }
    }

    /// The token for logits row `row` of a sampled sequence whose draft `x` was drawn from
    /// `q`: speculative sampling against the distribution the request's chain draws from
    /// (its draws then follow that distribution exactly, as plain decoding's do). The
    /// reasoning governor's `</think>` overrides, as in [`Self::choose`].
    pub(super) fn choose_sampled(
        &mut self,
        slot: usize,
        row: i32,
        x: i32,
        q: &[(i32, f32)],
    ) -> (LlamaToken, f32) {
        if self.budget_spent(slot) {
            return self.choose(slot, row);
        }
        let (_, first, second) = top2(self.ctx.get_logits_ith(row));
        let margin = margin_of(first, second);
        let s = self.slots[slot].as_mut().expect("sampled slot exists");
        let p = s.sampler.distribution(&self.ctx, row);
        let ds = s
            .spec
            .as_mut()
            .and_then(|sp| sp.sampled.as_mut())
            .expect("drafts with distributions come from a draft sampler");
        let (u, v) = (ds.uniform(), ds.uniform());
        let tok = LlamaToken(speculative::accept_sampled(&p, q, x, u, v).0);
        s.sampler.accept(tok);
        self.note_logprobs(slot, row, tok);
        (tok, margin)
    }

    /// Whether the reasoning governor closes the think block of `slot` at its next token.
    pub(super) fn budget_spent(&self, slot: usize) -> bool {
        let s = self.slots[slot].as_ref().expect("slot exists");
        self.think.as_ref().is_some_and(|t| {
            reasoning::budget_spent(&s.span, s.req.reasoning_budget, t.close_tokens.len())
        })
    }

    /// Appends a chosen token to its sequence: reasoning state, text, stop strings, the
    /// event, and the end of the sequence. Returns whether the sequence finished (its slot
    /// is then free).
    pub(super) fn emit(&mut self, slot: usize, tok: LlamaToken, margin: f32) -> bool {
        let start = Instant::now();
        let finished = self.emit_token(slot, tok, margin);
        self.add_time(phase::EMIT, start.elapsed());
        finished
    }

    /// [`Self::emit`]'s work, untimed.
    pub(super) fn emit_token(&mut self, slot: usize, tok: LlamaToken, margin: f32) -> bool {
        let model = self.model;
        let s = self.slots[slot].as_mut().expect("emitting slot exists");
        s.out.push(tok.0);
        if let Some(sp) = &mut s.spec {
            sp.out.push(tok.0);
        }
        let eog = model.vocab().is_eog(tok);
        // The token's text, looked up once for the reasoning span and the reply.
        let piece = (!eog || self.think.is_some())
            .then(|| model.vocab().token_to_piece(tok, true, None))
            .unwrap_or_default();
        if let Some(t) = &self.think {
            let before = s.span.tokens;
            s.span
                .push(&String::from_utf8_lossy(&piece), &t.open, &t.close);
            if s.span.tokens > before {
                self.stats.reasoning_tokens.fetch_add(1, Ordering::Relaxed);
            }
        }
        s.generated += 1;
        self.stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
        let mut text = String::new();
        let mut stopped = false;
        if !eog {
            s.utf8.extend(piece);
            let valid = match std::str::from_utf8(&s.utf8) {
                Ok(t) => t.len(),
                Err(e) if e.error_len().is_none() => e.valid_up_to(),
                Err(_) => s.utf8.len(), // invalid bytes: release them lossily
            };
            let piece: Vec<u8> = s.utf8.drain(..valid).collect();
            let fed = s.stop.feed(&String::from_utf8_lossy(&piece));
            text = fed.release;
            stopped = fed.stopped;
        }
        let _ = s.events.send(TokenEvent::Token {
            id: tok.0,
            text,
            margin,
            logprobs: s.logprobs.take(),
        });
        let total = s.req.prompt.len() + s.generated;
        let finish = if eog || stopped {
            Some(FinishReason::Stop)
        } else if s.generated >= s.req.max_tokens {
            Some(FinishReason::Length)
        } else if total >= self.max_seq_len {
            Some(FinishReason::ContextFull)
        } else {
            None
        };
        match finish {
            Some(finish) => {
                let tail = if stopped {
                    String::new()
                } else {
                    s.stop.flush() + &String::from_utf8_lossy(&std::mem::take(&mut s.utf8))
                };
                let usage = Usage {
                    prompt_tokens: s.req.prompt.len(),
                    completion_tokens: s.generated,
                    reasoning_tokens: s.span.tokens,
                    reasoning_capped: s.reasoning_capped,
                    draft_tokens: s.spec.as_ref().map_or(0, |sp| sp.drafted),
                    draft_accepted: s.spec.as_ref().map_or(0, |sp| sp.accepted),
                    cached_tokens: s.cached,
                    stop_index: s.stop.matched(),
                };
                // Free before reporting, so a caller that sees Done also sees the slot free.
                let s = self.free(slot).expect("slot exists");
                let _ = s.events.send(TokenEvent::Done {
                    finish,
                    usage,
                    tail,
                });
                true
            }
            None => {
                s.pending = Some(tok);
                false
            }
        }
    }
}

/// The reasoning markers as the governor uses them: their text, found in what a sequence
/// writes however the model split it into tokens, and the close marker's tokenization,
/// which the governor writes when a budget is spent.
pub(super) struct Think {
    pub(super) open: String,
    pub(super) close: String,
    pub(super) close_tokens: Vec<i32>,
}

impl Think {
    pub(super) fn new(model: &LlamaModel, t: &ThinkMarkers) -> Self {
        let close_tokens = model
            .vocab()
            .tokenize(t.close.as_bytes(), false, true)
            .iter()
            .map(|t| t.0)
            .collect();
        Self {
            open: t.open.clone(),
            close: t.close.clone(),
            close_tokens,
        }
    }
}

/// The log-probability of `tok` and the `n` most likely tokens of logits row `logits`.
pub(super) fn token_logprobs(
    model: &LlamaModel,
    logits: &[f32],
    tok: LlamaToken,
    n: usize,
) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let lse = max + sum.ln() as f32;
    let entry = |id: i32| LogprobEntry {
        id,
        bytes: model.vocab().token_to_piece(LlamaToken(id), true, None),
        logprob: logits[id as usize] - lse,
    };
    let mut top: Vec<(f32, i32)> = Vec::with_capacity(n + 1);
    if n > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if top.len() < n || l > top[top.len() - 1].0 {
                let at = top.partition_point(|(x, _)| *x >= l);
                top.insert(at, (l, i as i32));
                top.truncate(n);
            }
        }
    }
    TokenLogprobs {
        token: entry(tok.0),
        top: top.into_iter().map(|(_, id)| entry(id)).collect(),
    }
}

/// Difference between the two largest logits (= their log-probability gap), from
/// [`top2`]'s largest and second largest.
pub(super) fn margin_of(first: f32, second: f32) -> f32 {
    if second.is_finite() {
        first - second
    } else {
        f32::INFINITY
    }
}
