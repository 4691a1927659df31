//! Speculative tool calls and the read-only result cache.
//!
//! While a tier is still generating, the agent loop asks a cheap predictor (the
//! smallest tier drafting the same turn) which tool call is coming. If the predicted
//! tool is read-only, [`ToolRunner::speculate`] starts it at once; when the model's
//! real call arrives, [`ToolRunner::execute`] looks its key up: a finished or running
//! speculative call is a **hit** (the tool's latency, or the part of it already spent,
//! is saved), anything else is a **miss** and runs now. Speculations no real call
//! asked for are cancelled at the end of the turn ([`ToolRunner::cancel`]).
//!
//! Keys are `blake3(tool name ‖ 0 ‖ canonical JSON of the arguments)`: object keys
//! sorted, no whitespace, so `{"a":1,"b":2}` and `{"b":2, "a":1}` are one call.
//! Results of read-only calls stay for `ttl` and serve later identical calls (a
//! repeated workload hits without speculating). A call of a tool with side effects is
//! never started speculatively, never served from the cache, and clears the cached
//! results of its server, since it may have changed what they read (unless the
//! server is configured with `invalidate_on_write = false`).

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dashmap::DashMap;
use serde::Serialize;
use serde_json::Value;
use tokio::sync::watch;

use crate::mcp::{McpError, McpHub, ToolOutput};

/// Canonical JSON: object keys sorted, no insignificant whitespace.
pub fn canonical_json(v: &Value) -> String {
    fn sorted(v: &Value) -> Value {
        match v {
            Value::Object(m) => {
                let b: BTreeMap<&String, Value> = m.iter().map(|(k, v)| (k, sorted(v))).collect();
                let mut out = serde_json::Map::new();
                for (k, v) in b {
                    out.insert(k.clone(), v);
                }
                Value::Object(out)
            }
            Value::Array(a) => Value::Array(a.iter().map(sorted).collect()),
            other => other.clone(),
        }
    }
    sorted(v).to_string()
}

/// Identifies a call: see [`call_key`].
pub type CallKey = blake3::Hash;

/// The cache key of a call.
pub fn call_key(name: &str, args: &Value) -> CallKey {
    let mut h = blake3::Hasher::new();
    h.update(name.as_bytes());
    h.update(&[0]);
    h.update(canonical_json(args).as_bytes());
    h.finalize()
}

/// Where the result of an executed call came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// Run when the model asked.
    Fresh,
    /// Started speculatively before the model asked.
    Speculative,
    /// An identical read-only call finished earlier, within the TTL.
    Cached,
}

/// What [`ToolRunner::speculate`] did with a prediction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Speculation {
    /// The call is running now.
    Started,
    /// The result is already cached or running.
    AlreadyThere,
    /// The tool has side effects (or is not known to be read-only): not run.
    RefusedSideEffect,
    /// No connected server offers the tool.
    UnknownTool,
}

/// A finished call.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Executed {
    /// What the tool returned.
    pub output: ToolOutput,
    /// Where it came from.
    pub source: Source,
    /// Tool time the caller did not wait for (zero for fresh calls).
    pub saved_ms: u64,
}

/// Counters of the runner (exported as `mesh_spec_tool_calls_total` and friends).
#[derive(Debug, Default)]
pub struct SpecStats {
    /// Speculative calls started.
    pub started: AtomicU64,
    /// Real calls served by a speculative call.
    pub hits: AtomicU64,
    /// Real calls served by the TTL cache.
    pub cache_hits: AtomicU64,
    /// Real calls of read-only tools that had to run.
    pub misses: AtomicU64,
    /// Speculative calls cancelled because no real call matched.
    pub cancelled: AtomicU64,
    /// Predictions of tools with side effects, not run.
    pub refused: AtomicU64,
    /// Calls that actually reached a server (fresh and speculative).
    pub executed: AtomicU64,
    /// Milliseconds of tool time saved.
    pub saved_ms: AtomicU64,
}

/// A snapshot of [`SpecStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[allow(missing_docs)]
pub struct SpecCounts {
    pub started: u64,
    pub hits: u64,
    pub cache_hits: u64,
    pub misses: u64,
    pub cancelled: u64,
    pub refused: u64,
    pub executed: u64,
    pub saved_ms: u64,
}

type Outcome = Option<Result<ToolOutput, McpError>>;

struct Slot {
    server: String,
    started: Instant,
    speculative: bool,
    rx: watch::Receiver<Outcome>,
    abort: Option<tokio::task::AbortHandle>,
    finished: Option<Instant>,
}

/// Runs a tool; what the runner executes through (an [`McpHub`] in production).
pub trait ToolBackend: Send + Sync + 'static {
    /// Runs `name(args)`.
    fn run(
        &self,
        name: &str,
        args: &Value,
    ) -> Pin<Box<dyn Future<Output = Result<ToolOutput, McpError>> + Send + '_>>;
    /// Read-only (safe to speculate and cache)? `None` for an unknown tool.
    fn read_only(&self, name: &str) -> Option<bool>;
    /// The server a tool lives on.
    fn server(&self, name: &str) -> String;
    /// Whether a call of this (not read-only) tool drops its server's cached results.
    fn invalidates(&self, _name: &str) -> bool {
        true
    }
}

impl ToolBackend for McpHub {
    fn run(
        &self,
        name: &str,
        args: &Value,
    ) -> Pin<Box<dyn Future<Output = Result<ToolOutput, McpError>> + Send + '_>> {
        let (name, args) = (name.to_owned(), args.clone());
        Box::pin(async move { self.call(&name, &args).await })
    }
    fn read_only(&self, name: &str) -> Option<bool> {
        self.tool(name).map(|t| t.read_only)
    }
    fn server(&self, name: &str) -> String {
        self.tool(name)
            .map(|t| t.server.clone())
            .unwrap_or_default()
    }
    fn invalidates(&self, name: &str) -> bool {
        self.tool(name).is_none_or(|t| t.invalidates)
    }
}

/// Executes tool calls for agent tasks: speculation, the read-only cache, invalidation.
pub struct ToolRunner<B: ToolBackend = McpHub> {
    backend: Arc<B>,
    slots: DashMap<blake3::Hash, Slot>,
    ttl: Duration,
    /// Counters.
    pub stats: SpecStats,
}

impl<B: ToolBackend> std::fmt::Debug for ToolRunner<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ToolRunner")
            .field("slots", &self.slots.len())
            .field("ttl", &self.ttl)
            .finish()
    }
}

impl<B: ToolBackend> ToolRunner<B> {
    /// A runner over `backend`; read-only results live `ttl` (zero: only until the end
    /// of the turn that speculated them).
    pub fn new(backend: Arc<B>, ttl: Duration) -> Self {
        Self {
            backend,
            slots: DashMap::new(),
            ttl,
            stats: SpecStats::default(),
        }
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }

    /// The counters now.
    pub fn counts(&self) -> SpecCounts {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let s = &self.stats;
        SpecCounts {
            started: g(&s.started),
            hits: g(&s.hits),
            cache_hits: g(&s.cache_hits),
            misses: g(&s.misses),
            cancelled: g(&s.cancelled),
            refused: g(&s.refused),
            executed: g(&s.executed),
            saved_ms: g(&s.saved_ms),
        }
    }

    fn expired(&self, s: &Slot) -> bool {
        s.finished.is_some_and(|f| f.elapsed() > self.ttl)
            || (s.finished.is_none() && s.rx.borrow().is_some() && s.started.elapsed() > self.ttl)
    }

    fn spawn(
        self: &Arc<Self>,
        key: blake3::Hash,
        name: &str,
        args: &Value,
        speculative: bool,
    ) -> watch::Receiver<Outcome> {
        let (tx, rx) = watch::channel(None);
        let this = self.clone();
        let (n, a) = (name.to_owned(), args.clone());
        self.stats.executed.fetch_add(1, Ordering::Relaxed);
        let task = tokio::spawn(async move {
            let out = this.backend.run(&n, &a).await;
            if let Some(mut s) = this.slots.get_mut(&key) {
                s.finished = Some(Instant::now());
            }
            let _ = tx.send(Some(out));
        });
        self.slots.insert(
            key,
            Slot {
                server: self.backend.server(name),
                started: Instant::now(),
                speculative,
                rx: rx.clone(),
                abort: Some(task.abort_handle()),
                finished: None,
            },
        );
        rx
    }

    /// Starts `name(args)` ahead of the model if the tool is read-only. Returns the key
    /// to pass to [`Self::cancel`] at the end of the turn.
    pub fn speculate(self: &Arc<Self>, name: &str, args: &Value) -> (Speculation, blake3::Hash) {
        let key = call_key(name, args);
        match self.backend.read_only(name) {
            None => return (Speculation::UnknownTool, key),
            Some(false) => {
                self.stats.refused.fetch_add(1, Ordering::Relaxed);
                return (Speculation::RefusedSideEffect, key);
            }
            Some(true) => {}
        }
        if let Some(s) = self.slots.get(&key) {
            if !self.expired(&s) {
                return (Speculation::AlreadyThere, key);
            }
        }
        self.stats.started.fetch_add(1, Ordering::Relaxed);
        self.spawn(key, name, args, true);
        (Speculation::Started, key)
    }

    /// Cancels the speculative calls among `keys` that are still running and no real
    /// call took; returns how many were cancelled.
    pub fn cancel(&self, keys: &[blake3::Hash]) -> usize {
        let mut n = 0;
        for k in keys {
            let running = self
                .slots
                .get(k)
                .is_some_and(|s| s.speculative && s.finished.is_none() && s.rx.borrow().is_none());
            if running {
                if let Some((_, s)) = self.slots.remove(k) {
                    if let Some(a) = s.abort {
                        a.abort();
                    }
                    n += 1;
                }
            }
        }
        if self.ttl.is_zero() {
            for k in keys {
                self.slots.remove(k);
            }
        }
        self.stats.cancelled.fetch_add(n as u64, Ordering::Relaxed);
        n
    }

    /// Runs the model's call `name(args)`, from a speculative or cached result when the
    /// tool is read-only and one matches.
    pub async fn execute(self: &Arc<Self>, name: &str, args: &Value) -> Result<Executed, McpError> {
        let read_only = self
            .backend
            .read_only(name)
            .ok_or_else(|| McpError::UnknownTool(name.to_owned()))?;
        if !read_only {
            if self.backend.invalidates(name) {
                let server = self.backend.server(name);
                self.slots.retain(|_, s| s.server != server);
            }
            self.stats.executed.fetch_add(1, Ordering::Relaxed);
            let output = self.backend.run(name, args).await?;
            return Ok(Executed {
                output,
                source: Source::Fresh,
                saved_ms: 0,
            });
        }
        let key = call_key(name, args);
        let found = self
            .slots
            .get(&key)
            .and_then(|s| (!self.expired(&s)).then(|| (s.rx.clone(), s.speculative)));
        if let Some((mut rx, speculative)) = found {
            let waited = Instant::now();
            let done = rx
                .wait_for(Option::is_some)
                .await
                .ok()
                .and_then(|v| v.clone());
            if let Some(Ok(output)) = done {
                // A speculation no real call has used yet is a hit; anything else is an
                // earlier identical call's result.
                let (source, counter) = if speculative {
                    (Source::Speculative, &self.stats.hits)
                } else {
                    (Source::Cached, &self.stats.cache_hits)
                };
                counter.fetch_add(1, Ordering::Relaxed);
                let saved = output
                    .ms
                    .saturating_sub(waited.elapsed().as_millis() as u64);
                self.stats.saved_ms.fetch_add(saved, Ordering::Relaxed);
                self.keep_if_ok(&key, &output);
                return Ok(Executed {
                    output,
                    source,
                    saved_ms: saved,
                });
            }
            // Cancelled or failed speculation: run it for real below.
        }
        self.stats.misses.fetch_add(1, Ordering::Relaxed);
        let mut rx = self.spawn(key, name, args, false);
        let out = rx
            .wait_for(Option::is_some)
            .await
            .ok()
            .and_then(|v| v.clone())
            .unwrap_or_else(|| {
                Err(McpError::Gone {
                    server: self.backend.server(name),
                    tool: name.to_owned(),
                    why: "call task stopped".into(),
                })
            });
        let output = out.inspect_err(|_| {
            self.slots.remove(&key);
        })?;
        self.keep_if_ok(&key, &output);
        Ok(Executed {
            output,
            source: Source::Fresh,
            saved_ms: 0,
        })
    }

    /// A used result stays for the TTL as an ordinary cached one, unless the server
    /// flagged it as an error (a missing file may exist by the next call).
    fn keep_if_ok(&self, key: &blake3::Hash, output: &ToolOutput) {
        if output.is_error || self.ttl.is_zero() {
            self.slots.remove(key);
        } else if let Some(mut s) = self.slots.get_mut(key) {
            s.speculative = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A backend that records what it ran; "slow_*" tools take 200 ms.
    #[derive(Default)]
    struct Recorder {
        ran: Mutex<Vec<String>>,
        /// Writes keep cached reads (`invalidate_on_write = false`).
        independent: bool,
    }

    impl ToolBackend for Recorder {
        fn run(
            &self,
            name: &str,
            args: &Value,
        ) -> Pin<Box<dyn Future<Output = Result<ToolOutput, McpError>> + Send + '_>> {
            let (name, args) = (name.to_owned(), args.clone());
            Box::pin(async move {
                let ms = if name.starts_with("slow_") { 200 } else { 1 };
                tokio::time::sleep(Duration::from_millis(ms)).await;
                self.ran
                    .lock()
                    .unwrap()
                    .push(format!("{name}{}", canonical_json(&args)));
                Ok(ToolOutput {
                    text: format!("{name} ok"),
                    is_error: false,
                    ms,
                })
            })
        }
        fn read_only(&self, name: &str) -> Option<bool> {
            match name {
                "read" | "slow_read" => Some(true),
                "write" | "slow_write" => Some(false),
                _ => None,
            }
        }
        fn invalidates(&self, _name: &str) -> bool {
            !self.independent
        }
        fn server(&self, _name: &str) -> String {
            "s".into()
        }
    }

    fn runner(ttl_ms: u64) -> Arc<ToolRunner<Recorder>> {
        Arc::new(ToolRunner::new(
            Arc::new(Recorder::default()),
            Duration::from_millis(ttl_ms),
        ))
    }

    fn ran(r: &ToolRunner<Recorder>) -> Vec<String> {
        r.backend().ran.lock().unwrap().clone()
    }

    #[test]
    fn canonical_json_sorts_keys_at_every_level() {
        let a: Value =
            serde_json::from_str(r#"{"b": 2, "a": {"y": [1, {"d": 1, "c": 2}], "x": null}}"#)
                .unwrap();
        assert_eq!(
            canonical_json(&a),
            r#"{"a":{"x":null,"y":[1,{"c":2,"d":1}]},"b":2}"#
        );
        let b: Value =
            serde_json::from_str(r#"{"a": {"x": null, "y": [1, {"c": 2, "d": 1}]}, "b": 2}"#)
                .unwrap();
        assert_eq!(call_key("t", &a), call_key("t", &b));
        assert_ne!(call_key("t", &a), call_key("u", &a));
    }

    #[tokio::test]
    async fn side_effecting_tools_never_run_speculatively() {
        let r = runner(60_000);
        let args = serde_json::json!({"path": "/x", "content": "hi"});
        let (what, _) = r.speculate("slow_write", &args);
        assert_eq!(what, Speculation::RefusedSideEffect);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            ran(&r).is_empty(),
            "a write ran speculatively: {:?}",
            ran(&r)
        );
        // The real call runs exactly once, fresh.
        let e = r.execute("slow_write", &args).await.unwrap();
        assert_eq!(e.source, Source::Fresh);
        assert_eq!(ran(&r).len(), 1);
        // And it is not cached: a second identical write runs again.
        r.execute("slow_write", &args).await.unwrap();
        assert_eq!(ran(&r).len(), 2);
        assert_eq!(r.counts().refused, 1);
        assert_eq!(r.counts().started, 0);
    }

    #[tokio::test]
    async fn a_matching_real_call_takes_the_speculative_result() {
        let r = runner(60_000);
        let args = serde_json::json!({"q": "a", "n": 1});
        let (what, key) = r.speculate("slow_read", &args);
        assert_eq!(what, Speculation::Started);
        tokio::time::sleep(Duration::from_millis(250)).await;
        // Same call, other key order.
        let e = r
            .execute("slow_read", &serde_json::json!({"n": 1, "q": "a"}))
            .await
            .unwrap();
        assert_eq!(e.source, Source::Speculative);
        assert!(
            e.saved_ms >= 150,
            "saved {} ms of a 200 ms call",
            e.saved_ms
        );
        assert_eq!(r.cancel(&[key]), 0, "a used speculation is not cancelled");
        assert_eq!(ran(&r).len(), 1);
        // Within the TTL an identical call is a cache hit and runs nothing.
        let e = r.execute("slow_read", &args).await.unwrap();
        assert_eq!(e.source, Source::Cached);
        assert_eq!(ran(&r).len(), 1);
        let c = r.counts();
        assert_eq!((c.hits, c.cache_hits, c.misses, c.executed), (1, 1, 0, 1));
    }

    #[tokio::test]
    async fn an_unmatched_speculation_is_cancelled() {
        let r = runner(60_000);
        let (_, key) = r.speculate("slow_read", &serde_json::json!({"q": "predicted"}));
        let e = r
            .execute("slow_read", &serde_json::json!({"q": "real"}))
            .await
            .unwrap();
        assert_eq!(e.source, Source::Fresh);
        assert_eq!(
            r.cancel(&[key]),
            0,
            "finished while the real call ran: kept for the TTL"
        );
        let (_, key) = r.speculate("slow_read", &serde_json::json!({"q": "other"}));
        assert_eq!(r.cancel(&[key]), 1);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut done = ran(&r);
        done.sort();
        assert_eq!(
            done,
            vec![r#"slow_read{"q":"predicted"}"#, r#"slow_read{"q":"real"}"#]
        );
        assert_eq!(r.counts().cancelled, 1);
    }

    #[tokio::test]
    async fn a_write_clears_cached_reads_of_its_server() {
        let r = runner(60_000);
        let args = serde_json::json!({"q": 1});
        r.execute("read", &args).await.unwrap();
        assert_eq!(
            r.execute("read", &args).await.unwrap().source,
            Source::Cached
        );
        r.execute("write", &serde_json::json!({})).await.unwrap();
        assert_eq!(
            r.execute("read", &args).await.unwrap().source,
            Source::Fresh
        );
        // A server configured with independent tools keeps them.
        let r = Arc::new(ToolRunner::new(
            Arc::new(Recorder {
                independent: true,
                ..Recorder::default()
            }),
            Duration::from_secs(60),
        ));
        r.execute("read", &args).await.unwrap();
        r.execute("write", &serde_json::json!({})).await.unwrap();
        assert_eq!(
            r.execute("read", &args).await.unwrap().source,
            Source::Cached
        );
    }

    #[tokio::test]
    async fn results_expire_after_the_ttl_and_unknown_tools_are_refused() {
        let r = runner(50);
        let args = serde_json::json!({});
        r.execute("read", &args).await.unwrap();
        tokio::time::sleep(Duration::from_millis(80)).await;
        assert_eq!(
            r.execute("read", &args).await.unwrap().source,
            Source::Fresh
        );
        assert_eq!(r.speculate("nope", &args).0, Speculation::UnknownTool);
        assert!(matches!(
            r.execute("nope", &args).await,
            Err(McpError::UnknownTool(_))
        ));
    }
}
