//! Messages that cross nodes. Every type here is on the wire: never rename or
//! reorder a variant or field; add new variants at the end and bump
//! [`mesh_transport::WIRE_VERSION`] when an old node could not read a new frame, keeping
//! the previous layout of each changed type in a module named after its version ([`v9`])
//! with conversions both ways: a connection speaks the newest version both ends know, so a
//! new node writes and reads the old layout on a connection to an old one. A message only
//! peers with a capability ([`CAPABILITIES`]) are sent needs no new version, as long as
//! the archived size of its enum does not grow ([`Control::Pages`] is smaller than a
//! heartbeat; `tests::a_page_event_leaves_the_control_layout_as_it_was` checks).
//!
//! Streams:
//! - unidirectional, one [`Control`] frame each: heartbeats (with the sender's advert and
//!   the peers it knows) and leave notices;
//! - bidirectional, one per call: the caller writes one [`Request`]; for
//!   [`Request::Call`] the [`Envelope`] names the actor and the next frame is that actor's
//!   call ([`TierCall`], [`StoreCall`], [`RouterCall`]); the callee answers with
//!   [`CallStatus`] frame, then [`Answer`] frames (items, then `End`, or an `Error`) and
//!   finishes the stream
//!   (`crate::remote`).

use rkyv::{Archive, Deserialize, Serialize};

/// A tier as advertised by the node hosting it.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct TierAdvert {
    /// Tier (model) name, e.g. `t1`.
    pub name: String,
    /// Longest prompt + completion one sequence can hold.
    pub max_seq_len: u32,
    /// Concurrent sequences.
    pub n_seq_max: u32,
    /// Sequences running now.
    pub active: u32,
    /// Requests waiting for a sequence.
    pub queued: u32,
    /// KV cells of the context (capacity).
    pub kv_cells: u32,
    /// KV cells reserved by running sequences.
    pub kv_reserved: u32,
    /// Salt base of the tier's KV pages (32 bytes; empty when paging is off).
    pub page_base: Vec<u8>,
    /// Tokens per page.
    pub page_block: u32,
    /// Short ids (first 8 bytes) of pages held, most recently used first (capped).
    pub pages: Vec<u64>,
    /// Requests that got a sequence since the engine started.
    pub started: u64,
    /// Milliseconds those requests waited for it, summed (the planner's queue time).
    pub queued_ms_total: u64,
}

/// A tier a node can start on request, and what it needs there.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct LoadableTier {
    /// Tier name.
    pub name: String,
    /// Threads it runs on.
    pub threads: u32,
    /// Memory it needs (weights, KV cache, page budget, buffers).
    pub bytes: u64,
    /// Device memory it takes on one GPU (0 when it runs on the CPU: `gpu_layers = 0`).
    pub gpu_bytes: u64,
}

/// What a node has room for, as the planner reads it.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct Capacity {
    /// Cores the node offers to tiers.
    pub cores: u32,
    /// Threads of the engines it runs.
    pub cores_used: u32,
    /// Memory available now (bytes).
    pub free_bytes: u64,
    /// Tiers it has a config for and does not run now: it starts them on request.
    pub loadable: Vec<LoadableTier>,
    /// Running tiers it started on request (a planner's), not from its own config.
    pub on_request: Vec<String>,
    /// GPUs llama.cpp has on the node (none without a GPU backend module).
    pub gpus: Vec<GpuAdvert>,
}

/// A GPU of a node, with its memory when the heartbeat was sent.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct GpuAdvert {
    /// Device name, e.g. `CUDA0`.
    pub name: String,
    /// Description, e.g. `NVIDIA H200`.
    pub description: String,
    /// Total memory in bytes.
    pub memory_total: u64,
    /// Free memory in bytes.
    pub memory_free: u64,
}

/// Where a peer listens.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct PeerAddr {
    /// Node name.
    pub node: String,
    /// QUIC address.
    pub quic_addr: String,
}

/// What a node says about itself in every heartbeat.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct NodeAdvert {
    /// Node name (must equal the certificate's CN).
    pub node: String,
    /// QUIC address peers dial.
    pub quic_addr: String,
    /// HTTP gateway address.
    pub http_addr: String,
    /// Start time of this process (ms since the Unix epoch): a new value means a restart.
    pub started_ms: u64,
    /// Tiers hosted.
    pub tiers: Vec<TierAdvert>,
    /// Peers the sender considers alive (gossip).
    pub peers: Vec<PeerAddr>,
    /// What the node runs (`gateway`, `tiers`, `store`).
    pub roles: Vec<String>,
    /// Actors peers may call on it (`tier`, `kv-store`, `router`).
    pub actors: Vec<String>,
    /// Pages its store holds outside its tiers' own (a `store` node: pages peers demoted
    /// to it), by namespace.
    pub pages: Vec<NamespacePages>,
    /// Room for more tiers, and the tiers it would start.
    pub capacity: Capacity,
    /// The build: `mesh <version>` (since wire 10; empty from older nodes).
    pub build: String,
    /// Cross-node behaviours a peer may rely on, by name ([`CAPABILITIES`]; since wire 10,
    /// none from older nodes). A feature added without a new wire version gets a name
    /// here, and callers check it before they use it.
    pub capabilities: Vec<String>,
}

/// What this build's nodes advertise as their capabilities:
/// - `scale-forward`: a `mesh scale` reaching a node while the planning node is gone is
///   forwarded on to the next one, and answered as unavailable (retryable) if none answers;
/// - `wire-negotiation`: the node speaks more than one wire version;
/// - `page-log`: the node sends its page events ([`Control::Pages`]) to peers that have
///   this capability too, and answers [`PageLogCall`]s.
pub const CAPABILITIES: &[&str] = &["scale-forward", "wire-negotiation", "page-log"];

/// Short ids (first 8 bytes) of pages a store holds in one namespace, most recently used
/// first (capped).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct NamespacePages {
    /// Namespace (the tier the pages belong to).
    pub ns: String,
    /// Short page ids.
    pub ids: Vec<u64>,
    /// Salt base of the namespace's pages (32 bytes; routers compute page ids with it).
    pub base: Vec<u8>,
    /// Tokens per page.
    pub block: u32,
}

/// Frames on unidirectional streams.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum Control {
    /// Periodic liveness + advert.
    Heartbeat(NodeAdvert),
    /// The sender is shutting down gracefully.
    Leave {
        /// Node leaving.
        node: String,
    },
    /// The sender's page events: what its stores stored and removed since its previous
    /// entry (sent only to peers advertising the `page-log` capability).
    Pages {
        /// The sender.
        node: String,
        /// Its process start time (its advert's `started_ms`; a log belongs to one process).
        started_ms: u64,
        /// The changes.
        entry: PageLogEntry,
    },
}

/// One namespace's part of a page event: short ids (first 8 bytes) stored and removed.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct PageChange {
    /// Namespace (a tier, or on a store node the tier the pages came from).
    pub ns: String,
    /// Ids now held.
    pub stored: Vec<u64>,
    /// Ids no longer held.
    pub removed: Vec<u64>,
}

/// A node's page events from seq `from` to seq `seq` (`mesh_kvstore::LogEntry` on the
/// wire): changes in order, or, when `snapshot`, everything held at `seq`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct PageLogEntry {
    /// Everything held rather than changes.
    pub snapshot: bool,
    /// The seq the changes apply to.
    pub from: u64,
    /// The seq after them.
    pub seq: u64,
    /// The changes.
    pub changes: Vec<PageChange>,
}

impl From<mesh_kvstore::LogEntry> for PageLogEntry {
    fn from(e: mesh_kvstore::LogEntry) -> Self {
        Self {
            snapshot: e.snapshot,
            from: e.from,
            seq: e.seq,
            changes: e
                .changes
                .into_iter()
                .map(|c| PageChange {
                    ns: c.ns,
                    stored: c.stored,
                    removed: c.removed,
                })
                .collect(),
        }
    }
}

/// Calls of the page log (`page-log`): a peer that missed events, or is new, asks for
/// what it lacks.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum PageLogCall {
    /// The events after `seq`, or a snapshot when `seq` is `None`, too old or unknown.
    Since {
        /// The seq the caller has applied.
        seq: Option<u64>,
    },
}

/// Answers of the page log.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum PageLogItem {
    /// The events or the snapshot.
    Entry(PageLogEntry),
}

/// The types whose layout wire version 10 changed, as version 9 wrote them.
pub mod v9 {
    use rkyv::{Archive, Deserialize, Serialize};

    use super::{Capacity, NamespacePages, PeerAddr, TierAdvert};

    /// [`super::NodeAdvert`] without the build and capabilities.
    #[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
    #[allow(missing_docs)]
    pub struct NodeAdvert {
        pub node: String,
        pub quic_addr: String,
        pub http_addr: String,
        pub started_ms: u64,
        pub tiers: Vec<TierAdvert>,
        pub peers: Vec<PeerAddr>,
        pub roles: Vec<String>,
        pub actors: Vec<String>,
        pub pages: Vec<NamespacePages>,
        pub capacity: Capacity,
    }

    /// [`super::Control`] carrying a version-9 advert.
    #[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
    #[allow(missing_docs)]
    pub enum Control {
        Heartbeat(NodeAdvert),
        Leave { node: String },
    }

    impl TryFrom<super::Control> for Control {
        /// A message version 9 has no variant for (page events), given back.
        type Error = super::Control;

        fn try_from(c: super::Control) -> Result<Self, super::Control> {
            Ok(match c {
                super::Control::Heartbeat(a) => Self::Heartbeat(NodeAdvert {
                    node: a.node,
                    quic_addr: a.quic_addr,
                    http_addr: a.http_addr,
                    started_ms: a.started_ms,
                    tiers: a.tiers,
                    peers: a.peers,
                    roles: a.roles,
                    actors: a.actors,
                    pages: a.pages,
                    capacity: a.capacity,
                }),
                super::Control::Leave { node } => Self::Leave { node },
                other @ super::Control::Pages { .. } => return Err(other),
            })
        }
    }

    impl From<Control> for super::Control {
        fn from(c: Control) -> Self {
            match c {
                Control::Heartbeat(a) => Self::Heartbeat(super::NodeAdvert {
                    node: a.node,
                    quic_addr: a.quic_addr,
                    http_addr: a.http_addr,
                    started_ms: a.started_ms,
                    tiers: a.tiers,
                    peers: a.peers,
                    roles: a.roles,
                    actors: a.actors,
                    pages: a.pages,
                    capacity: a.capacity,
                    build: String::new(),
                    capabilities: vec![],
                }),
                Control::Leave { node } => Self::Leave { node },
            }
        }
    }
}

/// One key/value header (trace context).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Header {
    /// Name.
    pub key: String,
    /// Value.
    pub value: String,
}

/// A generation call on a remote tier.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct GenerateCall {
    /// Tier name.
    pub model: String,
    /// Prompt token ids.
    pub prompt: Vec<i32>,
    /// Completion budget.
    pub max_tokens: u32,
    /// Sampling temperature (0 = greedy).
    pub temperature: f32,
    /// Nucleus mass.
    pub top_p: f32,
    /// Top-k (0 = off).
    pub top_k: i32,
    /// Sampling seed.
    pub seed: u32,
    /// Stop strings.
    pub stop: Vec<String>,
    /// GBNF grammar.
    pub grammar: Option<String>,
    /// Lazy-grammar trigger word.
    pub grammar_trigger: Option<String>,
    /// Lazy-grammar trigger patterns (regular expressions).
    pub grammar_patterns: Vec<String>,
    /// Log-probabilities with this many alternatives per token (`None`: none).
    pub logprobs: Option<u32>,
    /// Keep generating past end-of-generation.
    pub ignore_eos: bool,
    /// Caller's request id (logs).
    pub request_id: String,
    /// The callee stops the call after this many ms (0 = no deadline).
    pub deadline_ms: u64,
    /// Trace context (W3C `traceparent`, `tracestate`).
    pub trace: Vec<Header>,
    /// Prefix-page sharing scope (requests share KV pages only within one scope).
    pub cache_scope: String,
    /// Reasoning-token budget (`None` = no cap).
    pub reasoning_budget: Option<u32>,
    /// The prompt ends inside an open think span.
    pub thinking_open: bool,
    /// What the request is for, as the quantization policy names it (`tool_calls`,
    /// `reasoning`, `summaries`); the callee runs it on the engine its own policy gives
    /// that role on the tier. Empty: the tier's own engine.
    pub role: String,
}

/// The header of a call to a named actor ([`Request::Call`]); the call itself is the next
/// frame on the stream.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct Envelope {
    /// The actor addressed (`tier`, `kv-store`, `router`).
    pub actor: String,
    /// The callee stops the call after this many ms (0 = no deadline).
    pub deadline_ms: u64,
    /// Trace context (W3C `traceparent`, `tracestate`).
    pub trace: Vec<Header>,
}

/// Frames a caller sends.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum Request {
    /// Round trip (latency measurement).
    Ping {
        /// Echoed back.
        nonce: u64,
        /// Opaque payload echoed back (bulk measurement).
        payload: Vec<u8>,
    },
    /// A call to a named actor; its call frame follows.
    Call(Envelope),
}

/// The callee's first frame on a call stream: whether it took the call.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum CallStatus {
    /// The call runs; its [`Answer`] frames follow.
    Accepted,
    /// The call was refused (no such actor, the actor down, bad arguments); the stream ends.
    Refused(RemoteError),
}

/// One answer frame of a call.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum Answer<T> {
    /// One item.
    Item(T),
    /// No more items.
    End,
    /// The call was refused or failed; no more items.
    Error(RemoteError),
}

/// Calls of a tier actor (`tier`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum TierCall {
    /// Generate tokens; answered by [`TierItem::Event`]s.
    Generate(GenerateCall),
    /// Tokenize a prompt with a tier's tokenizer; answered by one [`TierItem::Tokens`].
    Tokenize {
        /// Tier name.
        model: String,
        /// The prompt's parts.
        parts: Vec<PromptPart>,
    },
    /// Render a conversation with the tier's chat template and tokenize it; answered by one
    /// [`TierItem::Rendered`].
    Render {
        /// Tier name.
        model: String,
        /// `mesh_tiers::format::ChatInput` as JSON.
        input: String,
    },
}

/// One part of a prompt to tokenize (`mesh_tiers::chat::PromptPart` on the wire).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct PromptPart {
    /// The text.
    pub text: String,
    /// Template text (control tokens parsed) rather than content (plain text only).
    pub special: bool,
}

impl From<&mesh_tiers::chat::PromptPart> for PromptPart {
    fn from(p: &mesh_tiers::chat::PromptPart) -> Self {
        Self {
            text: p.text.clone(),
            special: p.special,
        }
    }
}

impl From<PromptPart> for mesh_tiers::chat::PromptPart {
    fn from(p: PromptPart) -> Self {
        Self {
            text: p.text,
            special: p.special,
        }
    }
}

/// Answers of a tier actor.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum TierItem {
    /// A generation event.
    Event(Event),
    /// Token ids.
    Tokens(Vec<i32>),
    /// A rendered, tokenized conversation.
    Rendered {
        /// Prompt token ids.
        tokens: Vec<i32>,
        /// The tier's `mesh_tiers::format::FormatSpec` as JSON.
        spec: String,
        /// The prompt ends inside an open reasoning span.
        thinking_open: bool,
    },
}

/// A page in its stored form (header with checksum + payload).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct PageBlob {
    /// Page id (32 bytes).
    pub id: Vec<u8>,
    /// Stored form.
    pub stored: Vec<u8>,
}

/// Calls of a page-store actor (`kv-store`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum StoreCall {
    /// Pages by id in namespace `ns`, answered by one [`StoreItem::Page`] per page held, in
    /// order, stopping at the first page the callee does not have.
    Fetch {
        /// Namespace (tier).
        ns: String,
        /// Page namespace salt (32 bytes).
        salt: Vec<u8>,
        /// Page ids (32 bytes each).
        ids: Vec<Vec<u8>>,
    },
    /// Keep these pages in namespace `ns` (a compute node demotes pages to a store node);
    /// answered by one [`StoreItem::Stored`].
    Put {
        /// Namespace (tier).
        ns: String,
        /// Salt base of the namespace's pages (advertised with them).
        base: Vec<u8>,
        /// Tokens per page.
        block: u32,
        /// Pages.
        pages: Vec<PageBlob>,
    },
}

/// Answers of a page-store actor.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum StoreItem {
    /// One page.
    Page(PageBlob),
    /// How many pages of a `Put` were kept (refused ones failed their checks).
    Stored {
        /// Pages kept.
        pages: u32,
    },
}

/// A tool as the router sees it.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct WireTool {
    /// Name.
    pub name: String,
    /// Description.
    pub description: String,
    /// JSON schema of the arguments, as JSON text.
    pub parameters: String,
}

/// Calls of a tool router actor (`router`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum RouterCall {
    /// Which of `tools` a prompt for `intent` should show; answered by one [`RouterItem`].
    Route {
        /// The request's tools.
        tools: Vec<WireTool>,
        /// The last user message.
        intent: String,
        /// Tools to keep.
        top_k: u32,
        /// A tool that must stay.
        forced: Option<String>,
    },
}

/// Answers of a tool router actor.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum RouterItem {
    /// The tools to show, best first, and the router's confidence.
    Routed {
        /// Tools the request offered.
        offered: u32,
        /// Tools to show.
        shown: Vec<String>,
        /// Cosine of the best tool.
        top1: f32,
        /// Top-1 minus top-2 cosine.
        margin: f32,
        /// The lexical re-rank ran.
        reranked: bool,
    },
    /// Routing failed (the request shows every tool).
    Failed(String),
}

/// Calls of a node's engines actor (`engines`): the planner starts and drains tiers.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum EnginesCall {
    /// Start tier `tier` from this node's config for it; answered by one [`EnginesItem`].
    Load {
        /// Tier name.
        tier: String,
    },
    /// Take tier `tier` out of service: no new requests, stopped once its own are done.
    Drain {
        /// Tier name.
        tier: String,
    },
}

/// Answers of an engines actor.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum EnginesItem {
    /// Done (or already so).
    Done,
    /// Refused, with the reason.
    Refused(String),
}

/// Calls of the planner (`planner`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum PlannerCall {
    /// Pin `tier` at `replicas` (`None`: back to its scaling policy); answered by one
    /// [`PlannerItem::Status`] (the one planning) or forwarded to the node that plans.
    Scale {
        /// Tier name.
        tier: String,
        /// Replicas, or `None` for automatic.
        replicas: Option<u32>,
    },
    /// The planner's status; answered by one [`PlannerItem::Status`].
    Show,
}

/// Answers of the planner.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum PlannerItem {
    /// The planning node's status as JSON text (what `GET /v1/control/scale` shows).
    Status(String),
    /// Refused, with the reason.
    Refused(String),
}

/// Why a generation ended.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// End of generation or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The sequence filled its context.
    ContextFull,
}

/// A streamed generation event.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum Event {
    /// The request got a sequence.
    Started {
        /// Time spent queued.
        queued_ms: u64,
    },
    /// One token.
    Token {
        /// Token id.
        id: i32,
        /// Its text (may be empty while a stop string is pending).
        text: String,
        /// Top-1 minus top-2 probability.
        margin: f32,
        /// Log-probabilities, when the request asked for them.
        logprobs: Option<TokenLogprobs>,
    },
    /// Finished.
    Done {
        /// Why.
        finish: Finish,
        /// Prompt tokens.
        prompt_tokens: u32,
        /// Generated tokens.
        completion_tokens: u32,
        /// Generated tokens inside the think block.
        reasoning_tokens: u32,
        /// The reasoning governor closed the think block.
        reasoning_capped: bool,
        /// Tokens the serving tier's draft model proposed (0 without one).
        draft_tokens: u32,
        /// Of those, the ones the tier accepted.
        draft_accepted: u32,
        /// Prompt tokens reused from the slot or restored from pages.
        cached_tokens: u32,
        /// The index of the request's stop string that ended generation.
        stop_index: Option<u32>,
        /// Held-back text released at the end.
        tail: String,
    },
    /// The generation failed (engine stopped).
    Error(String),
}

/// Log-probabilities of one token (`mesh_tiers::TokenLogprobs` on the wire).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The chosen token.
    pub token: LogprobEntry,
    /// The most likely tokens, most likely first.
    pub top: Vec<LogprobEntry>,
}

/// One token and its log-probability.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct LogprobEntry {
    /// Token id.
    pub id: i32,
    /// Its bytes.
    pub bytes: Vec<u8>,
    /// Natural log of its probability.
    pub logprob: f32,
}

/// Closed set of error classes crossing the wire.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// The request is invalid; retrying elsewhere will not help.
    InvalidRequest,
    /// Prompt + budget exceed the context.
    ContextExceeded,
    /// No such tier on the callee.
    NotFound,
    /// The tier's queue is full.
    Overloaded,
    /// The tier is not running (restarting, stopped).
    Unavailable,
    /// The call ran past its deadline.
    Deadline,
}

/// An error reply.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct RemoteError {
    /// Class.
    pub class: ErrorClass,
    /// Human-readable reason.
    pub message: String,
}

impl std::fmt::Display for RemoteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}: {}", self.class, self.message)
    }
}

/// Frames a callee sends outside calls.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum Reply {
    /// Answer to a ping.
    Pong {
        /// The ping's nonce.
        nonce: u64,
        /// The ping's payload.
        payload: Vec<u8>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use mesh_transport::frame::{decode, encode, HEADER_LEN};

    /// `Control` as wire 10 first had it, before page events.
    #[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
    enum ControlBeforePages {
        Heartbeat(NodeAdvert),
        Leave { node: String },
    }

    #[test]
    fn a_page_event_leaves_the_control_layout_as_it_was() {
        assert_eq!(
            std::mem::size_of::<ArchivedControl>(),
            std::mem::size_of::<ArchivedControlBeforePages>()
        );
        // A frame of this build reads in the layout before page events.
        let bytes = encode(&Control::Leave { node: "b".into() }).unwrap();
        let old: ControlBeforePages = decode(&bytes[HEADER_LEN..]).unwrap();
        assert_eq!(old, ControlBeforePages::Leave { node: "b".into() });
    }

    #[test]
    fn a_heartbeat_through_the_version_9_layout_loses_only_the_build_and_capabilities() {
        let advert = NodeAdvert {
            node: "a".into(),
            quic_addr: "10.0.0.1:7070".into(),
            http_addr: "10.0.0.1:8080".into(),
            started_ms: 42,
            tiers: vec![],
            peers: vec![PeerAddr {
                node: "b".into(),
                quic_addr: "10.0.0.2:7070".into(),
            }],
            roles: vec!["tiers".into()],
            actors: vec!["tier".into()],
            pages: vec![],
            capacity: Capacity::default(),
            build: "mesh 0.1.0".into(),
            capabilities: vec!["scale-forward".into()],
        };
        let old = v9::Control::try_from(Control::Heartbeat(advert.clone())).unwrap();
        let bytes = encode(&old).unwrap();
        let back: Control = decode::<v9::Control>(&bytes[HEADER_LEN..]).unwrap().into();
        let want = NodeAdvert {
            build: String::new(),
            capabilities: vec![],
            ..advert
        };
        assert_eq!(back, Control::Heartbeat(want));
    }

    #[test]
    fn a_call_roundtrips() {
        let r = TierCall::Generate(GenerateCall {
            model: "t1".into(),
            prompt: vec![1, 2, 3],
            max_tokens: 9,
            stop: vec!["\n".into()],
            grammar: Some("root ::= \"x\"".into()),
            trace: vec![Header {
                key: "traceparent".into(),
                value: "00-abc-def-01".into(),
            }],
            ..Default::default()
        });
        let b = encode(&r).unwrap();
        assert_eq!(decode::<TierCall>(&b[HEADER_LEN..]).unwrap(), r);
    }

    #[test]
    fn an_answer_carries_an_item_or_an_error() {
        for a in [
            Answer::Item(TierItem::Tokens(vec![1, 2])),
            Answer::End,
            Answer::Error(RemoteError {
                class: ErrorClass::Deadline,
                message: "late".into(),
            }),
        ] {
            let b = encode(&a).unwrap();
            assert_eq!(decode::<Answer<TierItem>>(&b[HEADER_LEN..]).unwrap(), a);
        }
    }
}
