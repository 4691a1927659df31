//! `mesh-bench fleet`: a mesh of N nodes against N llama-server replicas behind a load
//! balancer, the deployment a mesh replaces.
//!
//! Fleets, one at a time on the same cores: `mesh` = N `mesh join` nodes in one cluster;
//! `mesh-split` = the same cluster with node 0 in role `prefill` and the others in role
//! `decode`, the proxy in front of the decode nodes only (prompts of `--handoff-tokens`
//! uncached tokens or more are prefilled on node 0);
//! `llama-rr` = N llama-servers; `llama-sticky` = the same N llama-servers with session-sticky
//! balancing. Replica i of every fleet is pinned (`taskset`) to its own `--threads` cores
//! starting at `--first-core + i × threads`, with the same model, slots, context and batch.
//! Every fleet sits behind the same `mesh-bench proxy` process (round-robin; `session` for
//! `llama-sticky`), and the driver sends every request to the proxy, so the only difference
//! is what is behind it: mesh's gateways route by load and by which node holds the prompt's
//! KV pages, and pull pages from peers; llama-servers keep a prompt cache per slot.
//!
//! Each (workload, load, fleet) run starts a fresh fleet, so no run starts on another's cache.
//!
//! Workloads:
//! - `sessions`: agent sessions arriving at `--rate` sessions/s. Session k uses prompt group
//!   `k % --groups` (a long system prompt with `--tools` schemas that the group shares), asks
//!   for a tool, then gets `--turns - 1` tool results appended one by one, each after
//!   `--think-s` (± half, fixed per session and turn) of tool time; each turn sends the whole
//!   conversation so far with the replies that fleet returned. A turn shed (429/503) or failed
//!   ends its session (the agent task failed).
//! - `mooncake`: the trace in `../shared/data` from request `--skip`, scaled as
//!   `mesh-bench mooncake` scales it, replayed open-loop at its own arrival times divided by
//!   each `--compress` value (one run per value and fleet). For `llama-sticky` the session is
//!   the request's first block (requests that share it share a prefix).
//!
//! Reported per run: requests/s (completed requests / time from the first send to the last
//! reply), TTFT, inter-token and end-to-end p50/p95/p99, requests shed and failed, sessions
//! completed, prompt tokens sent / not evaluated (mesh: restored from pages or kept in the
//! slot; llama-server: its prompt cache) / pulled from a peer node, CPU-seconds of the
//! replicas (and of the proxy, apart) per completed task, and with `--price-per-node-hour`
//! the cost per completed task two ways: nodes held for the run (price × nodes × wall hours /
//! tasks; equal for all fleets when the load is offered at the same rate and all keep up) and
//! CPU-seconds used (CPU-s per task × price / (cores per node × 3600): what a task costs on a
//! fleet sized to its load). No GPU is used, so GPU-seconds are reported as none.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;
use serde_json::{json, Map, Value};

use crate::machine;
use crate::mooncake::{self, Req, Scale};
use crate::proxy::Policy;
use crate::server::{free_port, metric_sum, Server};
use crate::sessions::Conversation;
use crate::sidebyside::{shell_join, ServerArgs};
use crate::stats::{ratio, Percentiles};
use crate::workload::{self, HttpStatus, RequestSpec, ASSISTANT, END};

/// Which workload a fleet run drives.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Sessions,
    Mooncake,
}

/// A fleet under test.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fleet {
    /// N `mesh join` nodes in one cluster, round-robin in front.
    Mesh,
    /// N `mesh join` nodes that do not know each other (no routing between them, no page
    /// pulls), round-robin in front: what the cluster adds or costs.
    MeshSolo,
    /// N `mesh join` nodes in one cluster, node 0 prefilling long prompts for the others
    /// (roles `prefill`, `decode`), round-robin in front of nodes 1..N.
    MeshSplit,
    /// N llama-servers, round-robin in front.
    LlamaRr,
    /// N llama-servers, session-sticky in front.
    LlamaSticky,
}

impl Fleet {
    fn name(self) -> &'static str {
        match self {
            Fleet::Mesh => "mesh",
            Fleet::MeshSolo => "mesh-solo",
            Fleet::MeshSplit => "mesh-split",
            Fleet::LlamaRr => "llama-rr",
            Fleet::LlamaSticky => "llama-sticky",
        }
    }

    fn policy(self) -> Policy {
        match self {
            Fleet::LlamaSticky => Policy::Session,
            _ => Policy::RoundRobin,
        }
    }
}

/// Options of `mesh-bench fleet`.
#[derive(clap::Args, Debug)]
pub(crate) struct FleetArgs {
    /// The workload.
    #[arg(long, value_enum)]
    workload: Kind,
    /// Replicas per fleet (mesh nodes, llama-servers).
    #[arg(long, default_value_t = 2)]
    nodes: usize,
    /// First core of replica 0; replica i gets `--threads` cores from `first + i × threads`.
    #[arg(long, default_value_t = 0)]
    first_core: usize,
    /// Cores for the proxy (and, re-pinned at start, this driver), as taskset takes them
    /// (e.g. `12-15`); default: not pinned.
    #[arg(long)]
    driver_cores: Option<String>,
    /// Fleets to run, in order.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "mesh,llama-rr,llama-sticky"
    )]
    fleets: Vec<Fleet>,
    #[command(flatten)]
    servers: ServerArgs,
    /// Tokens per KV page for mesh (0 = mesh's default).
    #[arg(long, default_value_t = 0)]
    kv_block: usize,
    /// mesh-split: a decode node hands prompts with at least this many uncached tokens to
    /// the prefill node.
    #[arg(long, default_value_t = 256)]
    handoff_tokens: usize,
    /// Tokens generated per request (EOS ignored).
    #[arg(long, default_value_t = 24)]
    max_tokens: usize,
    /// sessions: sessions in the run.
    #[arg(long, default_value_t = 64)]
    sessions: usize,
    /// sessions: new sessions per second.
    #[arg(long, default_value_t = 1.0)]
    rate: f64,
    /// sessions: turns per session (the first asks, the others bring a tool result).
    #[arg(long, default_value_t = 4)]
    turns: usize,
    /// sessions: mean seconds of tool time between a reply and the next turn.
    #[arg(long, default_value_t = 1.0)]
    think_s: f64,
    /// sessions: distinct system prompts (agent kinds); session k uses `k % groups`.
    #[arg(long, default_value_t = 4)]
    groups: usize,
    /// sessions: tool schemas in each system prompt.
    #[arg(long, default_value_t = 12)]
    tools: usize,
    /// sessions: items in each tool result (about 12 tokens each).
    #[arg(long, default_value_t = 6)]
    result_items: usize,
    /// sessions: tool catalog.
    #[arg(long, default_value = "models/fixtures/catalog.jsonl")]
    catalog: PathBuf,
    /// mooncake: the trace.
    #[arg(long, default_value = "../shared/data/mooncake_synthetic_trace.jsonl")]
    trace: PathBuf,
    /// mooncake: trace requests skipped before the replayed part (later parts reuse more).
    #[arg(long, default_value_t = 3500)]
    skip: usize,
    /// mooncake: requests replayed.
    #[arg(long, default_value_t = 300)]
    requests: usize,
    /// mooncake: tokens per 512-token trace block.
    #[arg(long, default_value_t = 16)]
    block_tokens: usize,
    /// mooncake: longest prompt in blocks.
    #[arg(long, default_value_t = 64)]
    max_blocks: usize,
    /// mooncake: arrival times are divided by each of these (one run per value and fleet).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    compress: Vec<f64>,
    /// Seconds one request may take before it counts as failed.
    #[arg(long, default_value_t = 300)]
    request_timeout_s: u64,
    /// Price of one node-hour (any currency); adds the cost per completed task.
    #[arg(long)]
    price_per_node_hour: Option<f64>,
    /// JSON output; the markdown goes beside it (`.md`), logs into `<stem>-logs/`.
    #[arg(long, default_value = "bench-results/fleet.json")]
    out: PathBuf,
}

impl FleetArgs {
    fn validate(&self) -> Result<()> {
        if self.nodes == 0 || self.max_tokens == 0 || self.fleets.is_empty() {
            bail!("--nodes, --max-tokens and --fleets must not be zero or empty");
        }
        if self.fleets.contains(&Fleet::MeshSplit) && self.nodes < 2 {
            bail!("mesh-split needs --nodes 2 or more (one prefill node, the others decode)");
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let last = self.first_core + self.nodes * self.servers.threads as usize;
        if last > cores {
            bail!(
                "{} nodes × {} threads from core {} need cores up to {}, this machine has {cores}",
                self.nodes,
                self.servers.threads,
                self.first_core,
                last - 1
            );
        }
        match self.workload {
            Kind::Sessions => {
                if self.sessions == 0 || self.turns == 0 || self.groups == 0 || self.tools == 0 {
                    bail!("--sessions, --turns, --groups and --tools must be at least 1");
                }
                if !self.rate.is_finite()
                    || self.rate <= 0.0
                    || !self.think_s.is_finite()
                    || self.think_s < 0.0
                {
                    bail!("--rate must be above 0 and --think-s at least 0");
                }
                self.servers.check(&[(&self.catalog, "the tool catalog")])?;
            }
            Kind::Mooncake => {
                if self.requests == 0 || self.block_tokens == 0 || self.max_blocks == 0 {
                    bail!("--requests, --block-tokens and --max-blocks must be at least 1");
                }
                if self.compress.is_empty()
                    || self.compress.iter().any(|c| !c.is_finite() || *c <= 0.0)
                {
                    bail!("--compress takes positive numbers");
                }
                if self.max_blocks * self.block_tokens + self.max_tokens > self.servers.ctx as usize
                {
                    bail!("--max-blocks × --block-tokens + --max-tokens exceeds --ctx");
                }
                self.servers.check(&[(&self.trace, "the trace")])?;
            }
        }
        Ok(())
    }

    /// Cores of replica `i`, as taskset takes them.
    fn cores(&self, i: usize) -> String {
        let t = self.servers.threads as usize;
        let first = self.first_core + i * t;
        if t == 1 {
            first.to_string()
        } else {
            format!("{first}-{}", first + t - 1)
        }
    }
}

/// One request as one fleet answered it.
#[derive(Debug, Clone, Serialize)]
struct Record {
    /// Session (sessions) or trace request index (mooncake).
    task: usize,
    turn: usize,
    /// Sent, seconds after the run started.
    sent_s: f64,
    /// `ok`, `shed` (429 or 503) or `failed`.
    outcome: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    ttft_s: Option<f64>,
    e2e_s: Option<f64>,
    prompt_tokens: Option<usize>,
    completion_tokens: Option<usize>,
    #[serde(skip)]
    itl_s: Vec<f64>,
}

/// One request, classified; the reply's text when it completed.
#[allow(clippy::too_many_arguments)]
async fn request(
    client: &reqwest::Client,
    base: &str,
    spec: &RequestSpec<'_>,
    prompt: Value,
    session: &str,
    timeout: Duration,
    t0: Instant,
    (task, turn): (usize, usize),
) -> (Record, Option<String>) {
    let sent_s = t0.elapsed().as_secs_f64();
    let r = tokio::time::timeout(
        timeout,
        workload::stream_completion(client, base, spec, prompt, Some(session)),
    )
    .await
    .unwrap_or_else(|_| Err(anyhow::anyhow!("no reply within {timeout:?}")));
    let mut rec = Record {
        task,
        turn,
        sent_s,
        outcome: "ok",
        error: None,
        ttft_s: None,
        e2e_s: None,
        prompt_tokens: None,
        completion_tokens: None,
        itl_s: Vec::new(),
    };
    match r.and_then(|s| workload::sample_from(turn, task, s)) {
        Ok(s) => {
            rec.ttft_s = Some(s.ttft_s);
            rec.e2e_s = Some(s.e2e_s);
            rec.prompt_tokens = s.prompt_tokens;
            rec.completion_tokens = Some(s.completion_tokens);
            rec.itl_s = s.itl_s;
            (rec, Some(s.text))
        }
        Err(e) => {
            let status = e.downcast_ref::<HttpStatus>().map(|h| h.status);
            rec.outcome = outcome_of(status);
            rec.error = Some(format!("{e:#}").chars().take(300).collect());
            (rec, None)
        }
    }
}

/// `shed` for the statuses servers shed load with (429, 503), else `failed`. Pure.
fn outcome_of(status: Option<u16>) -> &'static str {
    match status {
        Some(429 | 503) => "shed",
        _ => "failed",
    }
}

/// The scripted side of one agent session.
#[derive(Debug, Clone)]
struct Plan {
    start_s: f64,
    system: String,
    request: String,
    /// Tool results of turns 1.., as JSON text.
    results: Vec<String>,
    /// Tool time before each turn 1.. (seconds).
    think_s: Vec<f64>,
}

/// A number in [0, 1) from `(a, b)` (splitmix64), for the plans' jitter. Pure.
fn unit(a: u64, b: u64) -> f64 {
    let z = a.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ b.wrapping_add(0x632B_E59B_D9B4_E019);
    (workload::splitmix64_mix(z) >> 11) as f64 / (1u64 << 53) as f64
}

/// Session plans: session k arrives at `k / rate`, takes group `k % groups`.
fn plans(a: &FleetArgs, catalog: &[Value]) -> Vec<Plan> {
    (0..a.sessions)
        .map(|k| {
            let group = k % a.groups;
            let tools = workload::tools_for(catalog, group * 5 + 1, a.tools);
            let tool = tools[k % tools.len()];
            Plan {
                start_s: k as f64 / a.rate,
                system: workload::system_turn(&tools),
                request: workload::user_request(tool, k),
                results: (1..a.turns)
                    .map(|t| tool_result(k, t, a.result_items))
                    .collect(),
                think_s: (1..a.turns)
                    .map(|t| a.think_s * (0.5 + unit(k as u64, t as u64)))
                    .collect(),
            }
        })
        .collect()
}

/// A tool result for session `k`, turn `t`: `items` records. Pure.
fn tool_result(k: usize, t: usize, items: usize) -> String {
    let items: Vec<Value> = (0..items)
        .map(|i| json!({"id": k * 1000 + t * 10 + i, "name": format!("item {}-{t}-{i}", k % 97), "score": (k * 7 + t * 3 + i) % 100}))
        .collect();
    json!({"status": "ok", "step": t, "items": items}).to_string()
}

/// The prompt of turn `t` of a session whose conversation so far is `conv`.
fn turn_prompt(conv: &Conversation, plan: &Plan, t: usize) -> String {
    if t == 0 {
        conv.prompt(&plan.request)
    } else {
        format!(
            "{}<|tool|>{}{END}{ASSISTANT}",
            conv.text(),
            plan.results[t - 1]
        )
    }
}

/// Runs every session against `base`; returns the records.
async fn drive_sessions(
    client: &reqwest::Client,
    base: &str,
    a: &FleetArgs,
    plans: &[Plan],
) -> Vec<Record> {
    let spec = RequestSpec {
        model: &a.servers.tier,
        max_tokens: a.max_tokens,
    };
    let timeout = Duration::from_secs(a.request_timeout_s);
    let t0 = Instant::now();
    let per_session = plans.iter().enumerate().map(|(k, plan)| {
        let spec = &spec;
        async move {
            sleep_until(t0, plan.start_s).await;
            let mut conv = Conversation::new(plan.system.clone());
            let mut out = Vec::new();
            let session = format!("session-{k}");
            for t in 0..a.turns {
                if t > 0 {
                    tokio::time::sleep(Duration::from_secs_f64(plan.think_s[t - 1])).await;
                }
                let prompt = turn_prompt(&conv, plan, t);
                let (rec, text) = request(
                    client,
                    base,
                    spec,
                    json!(prompt),
                    &session,
                    timeout,
                    t0,
                    (k, t),
                )
                .await;
                out.push(rec);
                let Some(text) = text else { break };
                let reply = text.split(END).next().unwrap_or_default();
                conv = Conversation::new(format!("{prompt}{reply}{END}"));
            }
            out
        }
    });
    futures::future::join_all(per_session)
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// Replays `reqs` against `base` at their arrival times; returns the records.
async fn drive_trace(
    client: &reqwest::Client,
    base: &str,
    a: &FleetArgs,
    reqs: &[Req],
) -> Vec<Record> {
    let timeout = Duration::from_secs(a.request_timeout_s);
    let t0 = Instant::now();
    let futs = reqs.iter().enumerate().map(|(i, r)| async move {
        sleep_until(t0, r.at_s).await;
        let spec = RequestSpec {
            model: &a.servers.tier,
            max_tokens: r.output,
        };
        let session = format!("block-{}", r.blocks.first().copied().unwrap_or(0));
        request(
            client,
            base,
            &spec,
            json!(r.tokens),
            &session,
            timeout,
            t0,
            (i, 0),
        )
        .await
        .0
    });
    futures::future::join_all(futs).await
}

async fn sleep_until(t0: Instant, at_s: f64) {
    if let Some(wait) = Duration::from_secs_f64(at_s.max(0.0)).checked_sub(t0.elapsed()) {
        tokio::time::sleep(wait).await;
    }
}

/// A running fleet: its replicas and the proxy in front.
struct Running {
    replicas: Vec<Server>,
    proxy: Option<Server>,
}

impl Running {
    async fn stop(mut self) {
        if let Some(p) = self.proxy.take() {
            let _ = p.stop().await;
        }
        for s in self.replicas.drain(..) {
            let _ = s.stop().await;
        }
    }
}

/// `taskset -c CORES PROGRAM ARGS` as (program, args).
fn pinned(cores: &str, program: &Path, args: Vec<String>) -> (PathBuf, Vec<String>) {
    let mut v = vec![
        "-c".to_owned(),
        cores.to_owned(),
        program.display().to_string(),
    ];
    v.extend(args);
    (PathBuf::from("taskset"), v)
}

/// `mesh join` arguments of node `i`.
fn join_args(
    a: &FleetArgs,
    i: usize,
    port: u16,
    quic: u16,
    certs: &Path,
    seed: Option<&str>,
    split: bool,
) -> Vec<String> {
    let s = &a.servers;
    let mut v: Vec<String> = [
        "join",
        "--name",
        &format!("n{i}"),
        "--quic",
        &format!("127.0.0.1:{quic}"),
        "--port",
        &port.to_string(),
        "--cert-dir",
        &certs.display().to_string(),
        "--tier",
        &format!("{}={}", s.tier, s.model.display()),
        "--threads",
        &s.threads.to_string(),
        "--parallel",
        &s.parallel.to_string(),
        "--ctx",
        &(s.ctx * s.parallel).to_string(),
        "--batch",
        &s.batch.to_string(),
    ]
    .map(String::from)
    .to_vec();
    if a.kv_block > 0 {
        v.extend(["--kv-block".into(), a.kv_block.to_string()]);
    }
    v.extend(s.mesh_extra.iter().cloned());
    if split {
        let role = if i == 0 { "prefill" } else { "gateway,decode" };
        v.extend(["--roles".into(), role.into()]);
        v.extend(["--handoff-tokens".into(), a.handoff_tokens.to_string()]);
    }
    if let Some(seed) = seed {
        v.extend(["--seeds".into(), seed.to_owned()]);
    }
    v
}

/// Starts `fleet` (logs in `logs/`), the proxy in front, and waits until all answer (and,
/// for mesh, every node sees every other alive). The servers are in `into` as soon as they
/// are spawned, so the caller stops them whatever happens.
async fn start(
    a: &FleetArgs,
    fleet: Fleet,
    tag: &str,
    logs: &Path,
    client: &reqwest::Client,
    into: &mut Running,
) -> Result<String> {
    let timeout = Duration::from_secs(a.servers.ready_timeout_s);
    let mut seed: Option<String> = None;
    let certs = logs.join("certs");
    let mesh = matches!(fleet, Fleet::Mesh | Fleet::MeshSolo | Fleet::MeshSplit);
    let cluster = matches!(fleet, Fleet::Mesh | Fleet::MeshSplit);
    if mesh && !certs.join("ca.pem").exists() {
        mesh_transport::tls::init_ca(&certs, "bench")?;
    }
    for i in 0..a.nodes {
        let port = free_port()?;
        let log = logs.join(format!("{tag}-{i}.log"));
        let (program, args) = match fleet {
            Fleet::Mesh | Fleet::MeshSolo | Fleet::MeshSplit => {
                if !certs.join(format!("n{i}.pem")).exists() {
                    mesh_transport::tls::issue(&certs, &format!("n{i}"))?;
                }
                let quic = free_udp_port()?;
                let split = fleet == Fleet::MeshSplit;
                let args = join_args(a, i, port, quic, &certs, seed.as_deref(), split);
                if i == 0 && cluster {
                    seed = Some(format!("127.0.0.1:{quic}"));
                }
                pinned(&a.cores(i), &a.servers.mesh_bin, args)
            }
            _ => pinned(
                &a.cores(i),
                &a.servers.llama_server,
                a.servers.llama_args(port),
            ),
        };
        let mut s = Server::spawn(
            if mesh { "mesh" } else { "llama-server" },
            &program,
            args,
            port,
            log,
        )?;
        let ready = s.wait_healthy(client, timeout).await;
        into.replicas.push(s);
        ready?;
    }
    if cluster {
        wait_cluster(client, &into.replicas, a.nodes, timeout).await?;
    }
    let port = free_port()?;
    let mut args = vec![
        "proxy".to_owned(),
        "--listen".into(),
        format!("127.0.0.1:{port}"),
        "--policy".into(),
        fleet.policy().arg().into(),
    ];
    // The prefill node of mesh-split serves no clients.
    let serving = match fleet {
        Fleet::MeshSplit if a.nodes > 1 => &into.replicas[1..],
        _ => &into.replicas[..],
    };
    for r in serving {
        args.extend(["--backend".into(), r.base_url.clone()]);
    }
    let exe = std::env::current_exe().context("finding mesh-bench's own path")?;
    let (program, args) = match &a.driver_cores {
        Some(c) => pinned(c, &exe, args),
        None => (exe, args),
    };
    let mut proxy = Server::spawn(
        "proxy",
        &program,
        args,
        port,
        logs.join(format!("{tag}-proxy.log")),
    )?;
    let ready = proxy.wait_healthy(client, timeout).await;
    let base = proxy.base_url.clone();
    into.proxy = Some(proxy);
    ready?;
    Ok(base)
}

/// A UDP port that was free a moment ago on 127.0.0.1.
fn free_udp_port() -> Result<u16> {
    let s = std::net::UdpSocket::bind(("127.0.0.1", 0)).context("finding a free UDP port")?;
    Ok(s.local_addr()?.port())
}

/// Waits until every node's `/v1/cluster` lists `n` members, all alive.
async fn wait_cluster(
    client: &reqwest::Client,
    nodes: &[Server],
    n: usize,
    timeout: Duration,
) -> Result<()> {
    let t0 = Instant::now();
    loop {
        let mut all = true;
        for s in nodes {
            let v: Value = match client
                .get(format!("{}/v1/cluster", s.base_url))
                .send()
                .await
            {
                Ok(r) => r.json().await.unwrap_or_default(),
                Err(_) => Value::Null,
            };
            let members = v["members"].as_array().cloned().unwrap_or_default();
            all &= members.len() == n && members.iter().all(|m| m["state"] == "alive");
        }
        if all {
            return Ok(());
        }
        if t0.elapsed() > timeout {
            bail!("the mesh nodes did not all see each other alive within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Counters read from each replica (summed over their label sets).
const COUNTERS: &[&str] = &[
    "mesh_engine_requests_total",
    // What each replica's engine served, forwarded requests included, and prefilled.
    "mesh_tier_sequences_total",
    "mesh_tier_prompt_tokens_total",
    "mesh_kv_recompute_avoided_tokens_total",
    "mesh_kv_resident_tokens_total",
    "mesh_kv_device_copy_tokens_total",
    "mesh_kv_pages_fetched_from_peers_total",
    "mesh_kv_peer_fetch_bytes_total",
    "mesh_request_reruns_total",
    "llamacpp:prompt_tokens_total",
    "llamacpp:prompt_tokens_cached_total",
    // llama-server's llama_decode calls and its busy time, beside mesh's steps and phases.
    "llamacpp:n_decode_total",
    "llamacpp:prompt_seconds_total",
    "llamacpp:tokens_predicted_seconds_total",
];

/// Counters read from each replica per value of their `phase` label (mesh's engine
/// step phases: where an engine thread's time went).
const PHASE_COUNTERS: &[&str] = &["mesh_tier_step_seconds_total", "mesh_tier_steps_total"];

/// Each replica's counters ([`COUNTERS`], and [`PHASE_COUNTERS`] per phase), in order.
async fn counters(client: &reqwest::Client, replicas: &[Server]) -> Vec<Map<String, Value>> {
    let mut out = Vec::new();
    for s in replicas {
        let m = s.metrics(client).await;
        let mut one = Map::new();
        for &c in COUNTERS {
            if let Some(v) = metric_sum(&m, c) {
                one.insert(c.to_owned(), json!(v));
            }
        }
        for (k, v) in by_label(&m, PHASE_COUNTERS, "phase") {
            one.insert(k, json!(v));
        }
        for (k, v) in by_label(&m, &["mesh_prefill_handoffs_total"], "outcome") {
            one.insert(k, json!(v));
        }
        for (k, v) in by_label(&m, &[GATEWAY_ITL], "le") {
            one.insert(k, json!(v));
        }
        // The engine's steps by kind and duration, series as they are (model, kind, le).
        for (k, v) in m.iter().filter(|(k, _)| k.starts_with(STEP_DURATION)) {
            one.insert(k.clone(), v.clone());
        }
        out.push(one);
    }
    out
}

/// Per replica, the counters' growth from `c0` to `c1` (a counter missing from `c0` counts
/// from zero). Pure.
fn deltas(c0: &[Map<String, Value>], c1: &[Map<String, Value>]) -> Vec<Map<String, Value>> {
    c0.iter()
        .zip(c1)
        .map(|(a, b)| {
            b.iter()
                .filter_map(|(k, v)| {
                    // A labelled counter appears at its first increment: absent is zero.
                    let before = a.get(k).and_then(Value::as_f64).unwrap_or(0.0);
                    Some((k.clone(), json!(v.as_f64()? - before)))
                })
                .collect()
        })
        .collect()
}

/// The per-replica counters summed over the fleet. Pure.
fn summed(per_replica: &[Map<String, Value>]) -> Map<String, Value> {
    let mut sum = Map::new();
    for m in per_replica {
        for (k, v) in m {
            let prev = sum.get(k).and_then(Value::as_f64).unwrap_or(0.0);
            sum.insert(k.clone(), json!(prev + v.as_f64().unwrap_or(0.0)));
        }
    }
    sum
}

/// Series of the `names` metrics summed per value of `label`, keyed `name{label="…"}` (a
/// series without that label counts under its bare name). Pure.
fn by_label(metrics: &Map<String, Value>, names: &[&str], label: &str) -> Vec<(String, f64)> {
    let mut out: Vec<(String, f64)> = Vec::new();
    let open = format!("{label}=\"");
    for (series, v) in metrics {
        let (name, labels) = series.split_once('{').unwrap_or((series, ""));
        if !names.contains(&name) {
            continue;
        }
        // The label's own name, not a longer one that ends with it (`handle="…"` for `le`).
        let value = labels
            .split(',')
            .find_map(|kv| kv.strip_prefix(open.as_str()))
            .and_then(|r| r.split('"').next());
        let key = match value {
            Some(value) => format!("{name}{{{label}=\"{value}\"}}"),
            None => name.to_owned(),
        };
        let v = v.as_f64().unwrap_or(0.0);
        match out.iter_mut().find(|(k, _)| *k == key) {
            Some((_, total)) => *total += v,
            None => out.push((key, v)),
        }
    }
    out
}

/// The histogram of mesh's engine steps by kind (decode, prefill, publish) and duration.
const STEP_DURATION: &str = "mesh_tier_step_duration_seconds";

/// The histogram of inter-token gaps mesh's gateways measured (as tokens reached the
/// gateway from its own engine or a peer's, before the HTTP layer).
const GATEWAY_ITL: &str = "mesh_inter_token_latency_seconds_bucket";

/// Upper bounds (ms) of the buckets holding the p50, p95 and p99 of a cumulative
/// Prometheus histogram given as `name{le="…"}` → count; `None` when it is empty. Pure.
fn bucket_percentiles(counters: &Map<String, Value>, name: &str) -> Option<Value> {
    let prefix = format!("{name}{{le=\"");
    let mut buckets: Vec<(f64, f64)> = counters
        .iter()
        .filter_map(|(k, v)| {
            let le = k.strip_prefix(prefix.as_str())?.trim_end_matches("\"}");
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, v.as_f64()?))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let at = |q: f64| {
        buckets
            .iter()
            .find(|(_, n)| *n >= q * total)
            .map(|(le, _)| {
                if le.is_finite() {
                    json!(le * 1e3)
                } else {
                    json!("+Inf")
                }
            })
    };
    Some(json!({"n": total, "p50_le": at(0.50), "p95_le": at(0.95), "p99_le": at(0.99)}))
}

/// CPU seconds (user + system) of the processes, in order.
fn cpu_s(pids: &[u32], ticks: u64) -> Vec<Option<f64>> {
    pids.iter()
        .map(|p| {
            let text = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
            Some(machine::process_ticks(&text)? as f64 / ticks.max(1) as f64)
        })
        .collect()
}

/// What one run measured, summarized. Pure over the records and counter deltas.
#[allow(clippy::too_many_arguments)]
fn summarize(
    records: &[Record],
    tasks_planned: usize,
    turns_per_task: usize,
    nodes: usize,
    delta: &Map<String, Value>,
    replica_cpu_s: f64,
    proxy_cpu_s: Option<f64>,
    price_per_node_hour: Option<f64>,
) -> Value {
    let ok: Vec<&Record> = records.iter().filter(|r| r.outcome == "ok").collect();
    let count = |o: &str| records.iter().filter(|r| r.outcome == o).count();
    let first = records
        .iter()
        .map(|r| r.sent_s)
        .fold(f64::INFINITY, f64::min);
    let last = records
        .iter()
        .map(|r| r.sent_s + r.e2e_s.unwrap_or(0.0))
        .fold(0.0, f64::max);
    let wall = if first.is_finite() { last - first } else { 0.0 };
    let mut done_turns = std::collections::HashMap::new();
    for r in &ok {
        *done_turns.entry(r.task).or_insert(0usize) += 1;
    }
    let tasks_done = done_turns
        .values()
        .filter(|&&n| n == turns_per_task)
        .count();
    let ms = |v: Vec<f64>| Percentiles::of(&v.iter().map(|x| x * 1e3).collect::<Vec<_>>());
    let prompt_tokens: usize = ok.iter().filter_map(|r| r.prompt_tokens).sum();
    let get = |k: &str| delta.get(k).and_then(Value::as_f64);
    let reused = get("mesh_kv_recompute_avoided_tokens_total")
        .map(|p| {
            p + get("mesh_kv_resident_tokens_total").unwrap_or(0.0)
                + get("mesh_kv_device_copy_tokens_total").unwrap_or(0.0)
        })
        .or_else(|| get("llamacpp:prompt_tokens_cached_total"))
        .or_else(|| {
            get("llamacpp:prompt_tokens_total").map(|e| (prompt_tokens as f64 - e).max(0.0))
        });
    let per_task = |x: f64| (tasks_done > 0).then(|| x / tasks_done as f64);
    json!({
        "requests_sent": records.len(),
        "requests_ok": ok.len(),
        "requests_shed": count("shed"),
        "requests_failed": count("failed"),
        "tasks_planned": tasks_planned,
        "tasks_completed": tasks_done,
        "wall_s": wall,
        "requests_per_s": (wall > 0.0).then(|| ok.len() as f64 / wall),
        "ttft_ms": ms(ok.iter().filter_map(|r| r.ttft_s).collect()),
        "itl_ms": ms(ok.iter().flat_map(|r| r.itl_s.iter().copied()).collect()),
        "e2e_ms": ms(ok.iter().filter_map(|r| r.e2e_s).collect()),
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_not_evaluated": reused,
        "not_evaluated_fraction": ratio(reused, Some(prompt_tokens as f64)),
        "gateway_itl_ms": bucket_percentiles(delta, GATEWAY_ITL),
        "pages_pulled_from_peers": get("mesh_kv_pages_fetched_from_peers_total"),
        "bytes_pulled_from_peers": get("mesh_kv_peer_fetch_bytes_total"),
        "replica_cpu_s": replica_cpu_s,
        "proxy_cpu_s": proxy_cpu_s,
        "replica_cpu_s_per_task": per_task(replica_cpu_s),
        "gpu_s_per_task": null,
        "price_per_node_hour": price_per_node_hour,
        "cost_per_task": price_per_node_hour
            .and_then(|p| per_task(p * nodes as f64 * wall / 3600.0)),
    })
}

/// Runs one fleet through one workload load; returns the run's JSON.
async fn run_one(
    a: &FleetArgs,
    fleet: Fleet,
    tag: &str,
    logs: &Path,
    client: &reqwest::Client,
    work: &Work<'_>,
) -> Result<Value> {
    let mut running = Running {
        replicas: Vec::new(),
        proxy: None,
    };
    let outcome = async {
        let base = start(a, fleet, tag, logs, client, &mut running).await?;
        let ticks = machine::clock_ticks();
        let pids: Vec<u32> = running.replicas.iter().map(Server::pid).collect();
        let proxy_pid = running.proxy.as_ref().map(Server::pid);
        let c0 = counters(client, &running.replicas).await;
        let cpu0 = cpu_s(&pids, ticks);
        let pcpu0 = proxy_pid.map(|p| cpu_s(&[p], ticks)[0]);
        eprintln!("{tag}: {} fleet of {} running", fleet.name(), a.nodes);
        let (records, tasks, turns) = match work {
            Work::Sessions(plans) => (
                drive_sessions(client, &base, a, plans).await,
                plans.len(),
                a.turns,
            ),
            Work::Trace(reqs) => (drive_trace(client, &base, a, reqs).await, reqs.len(), 1),
        };
        let cpu1 = cpu_s(&pids, ticks);
        let pcpu1 = proxy_pid.map(|p| cpu_s(&[p], ticks)[0]);
        let c1 = counters(client, &running.replicas).await;
        for r in running.replicas.iter_mut() {
            r.ensure_running()?;
        }
        let per_replica = deltas(&c0, &c1);
        let delta = summed(&per_replica);
        let replica_cpu: f64 = cpu0
            .iter()
            .zip(&cpu1)
            .filter_map(|(x, y)| Some(y.as_ref()? - x.as_ref()?))
            .sum();
        let proxy_cpu = match (pcpu0.flatten(), pcpu1.flatten()) {
            (Some(x), Some(y)) => Some(y - x),
            _ => None,
        };
        let summary = summarize(
            &records,
            tasks,
            turns,
            a.nodes,
            &delta,
            replica_cpu,
            proxy_cpu,
            a.price_per_node_hour,
        );
        let argv: Vec<Value> = running
            .replicas
            .iter()
            .map(|s| json!(shell_join(&json!(s.argv))))
            .collect();
        let peak: Vec<Option<u64>> = running
            .replicas
            .iter()
            .map(|s| s.status_kib("VmHWM"))
            .collect();
        anyhow::Ok(json!({
            "fleet": fleet.name(),
            "balancer": fleet.policy().arg(),
            "summary": summary,
            "counter_deltas": delta,
            "counter_deltas_per_replica": per_replica,
            "replica_argv": argv,
            "proxy_argv": running.proxy.as_ref().map(|p| shell_join(&json!(p.argv))),
            "replica_peak_rss_kib": peak,
            "requests": records,
        }))
    }
    .await;
    running.stop().await;
    outcome
}

enum Work<'a> {
    Sessions(&'a [Plan]),
    Trace(&'a [Req]),
}

/// The latency percentiles mesh is held to against the replicas it replaces.
const LATENCIES: [&str; 6] = [
    "ttft_ms.p50",
    "ttft_ms.p95",
    "ttft_ms.p99",
    "itl_ms.p50",
    "itl_ms.p95",
    "itl_ms.p99",
];
/// "Never worse": no latency percentile over this ratio to the other fleet's.
const NEVER_WORSE: f64 = 1.10;

/// `mesh / other` for a summary field (`path` like `ttft_ms.p95`). Pure.
fn field(v: &Value, path: &str) -> Option<f64> {
    path.split('.').try_fold(v, |v, k| v.get(k))?.as_f64()
}

/// Per load, each fleet's headline and mesh's ratios to the others, and whether the issue's
/// goal holds (no shed or failed request on either side, and >= 2x requests/s or <= 0.5x
/// TTFT p95). Pure.
fn compare(runs: &[Value]) -> Value {
    let mut out = Vec::new();
    let mut loads: Vec<String> = Vec::new();
    for r in runs {
        let l = r["load"].as_str().unwrap_or_default().to_owned();
        if !loads.contains(&l) {
            loads.push(l);
        }
    }
    for load in loads {
        let of = |name: &str| {
            runs.iter()
                .find(|r| r["load"] == load.as_str() && r["fleet"] == name)
        };
        let Some(mesh) = of("mesh") else { continue };
        let mut vs = Map::new();
        for other in ["llama-rr", "llama-sticky"] {
            let Some(o) = of(other) else { continue };
            vs.insert(other.to_owned(), over(mesh, o));
        }
        let mut row = json!({"load": load, "mesh_over": vs});
        if let Some(split) = of("mesh-split") {
            row["mesh_split_over_mesh"] = over(split, mesh);
        }
        out.push(row);
    }
    json!(out)
}

/// Ratios of run `m` to run `l` (their summaries): requests/s, latencies, CPU per task,
/// and the goals (never worse, 2x). Pure.
fn over(m: &Value, l: &Value) -> Value {
    let (m, l) = (&m["summary"], &l["summary"]);
    let rps = ratio(field(m, "requests_per_s"), field(l, "requests_per_s"));
    let p95 = ratio(field(m, "ttft_ms.p95"), field(l, "ttft_ms.p95"));
    let clean = |s: &Value| {
        field(s, "requests_shed") == Some(0.0) && field(s, "requests_failed") == Some(0.0)
    };
    let worst = LATENCIES
        .iter()
        .filter_map(|p| ratio(field(m, p), field(l, p)))
        .reduce(f64::max);
    json!({
        "requests_per_s": rps,
        "ttft_p50": ratio(field(m, "ttft_ms.p50"), field(l, "ttft_ms.p50")),
        "ttft_p95": p95,
        "ttft_p99": ratio(field(m, "ttft_ms.p99"), field(l, "ttft_ms.p99")),
        "itl_p50": ratio(field(m, "itl_ms.p50"), field(l, "itl_ms.p50")),
        "itl_p95": ratio(field(m, "itl_ms.p95"), field(l, "itl_ms.p95")),
        "itl_p99": ratio(field(m, "itl_ms.p99"), field(l, "itl_ms.p99")),
        "worst_latency": worst,
        "never_worse": clean(m) && clean(l) && worst.is_some_and(|w| w <= NEVER_WORSE),
        "cpu_s_per_task": ratio(field(m, "replica_cpu_s_per_task"), field(l, "replica_cpu_s_per_task")),
        "goal_met": clean(m) && clean(l)
            && (rps.is_some_and(|x| x >= 2.0) || p95.is_some_and(|x| x <= 0.5)),
    })
}

/// The run's markdown: one table per load, fleets as columns.
fn markdown(j: &Value) -> String {
    let mut out = format!(
        "# fleet: {} mesh nodes vs {} llama-servers behind a load balancer ({})\n\n",
        j["settings"]["nodes"], j["settings"]["nodes"], j["settings"]["workload"]
    );
    out.push_str(&table(j));
    out.push_str(&format!(
        "\n- command: `{}`\n",
        shell_join(&j["command_line"])
    ));
    out
}

/// Cost per task counting only the CPU-seconds the replicas used: CPU-s per task × the
/// price of one of a node's cores for a second. Pure.
fn cpu_cost(j: &Value, summary: &Value) -> Option<f64> {
    let cores = j["settings"]["cores_per_replica"].as_f64()?;
    Some(
        field(summary, "replica_cpu_s_per_task")? * field(summary, "price_per_node_hour")?
            / (cores * 3600.0),
    )
}

/// The tables of a fleet run's JSON, one per load.
pub(crate) fn table(j: &Value) -> String {
    let runs = j["runs"].as_array().cloned().unwrap_or_default();
    let mut out = String::new();
    let f = |v: Option<f64>, d: usize| v.map_or("–".into(), |v| format!("{v:.d$}"));
    for cmp in j["comparison"].as_array().into_iter().flatten() {
        let load = cmp["load"].as_str().unwrap_or_default();
        let fleets: Vec<&Value> = runs.iter().filter(|r| r["load"] == load).collect();
        out.push_str(&format!("**{load}**\n\n| | "));
        out.push_str(
            &fleets
                .iter()
                .map(|r| r["fleet"].as_str().unwrap_or("?").to_owned())
                .collect::<Vec<_>>()
                .join(" | "),
        );
        out.push_str(" |\n|---|");
        out.push_str(&"---|".repeat(fleets.len()));
        out.push('\n');
        let rows: &[(&str, &str, usize)] = &[
            ("requests completed / shed / failed", "", 0),
            ("tasks completed", "tasks_completed", 0),
            ("requests/s", "requests_per_s", 2),
            ("TTFT p50 (ms)", "ttft_ms.p50", 1),
            ("TTFT p95 (ms)", "ttft_ms.p95", 1),
            ("TTFT p99 (ms)", "ttft_ms.p99", 1),
            ("inter-token p50 (ms)", "itl_ms.p50", 1),
            ("inter-token p95 (ms)", "itl_ms.p95", 1),
            ("inter-token p99 (ms)", "itl_ms.p99", 1),
            (
                "inter-token p95 at mesh's gateways (ms, bucket bound)",
                "gateway_itl_ms.p95_le",
                0,
            ),
            ("prompt tokens sent", "prompt_tokens", 0),
            ("share not evaluated (cache)", "not_evaluated_fraction", 3),
            ("KV pages pulled from peers", "pages_pulled_from_peers", 0),
            ("replica CPU-s per task", "replica_cpu_s_per_task", 2),
            (
                "cost per 1,000 tasks, nodes held for the run",
                "cost_per_task",
                4,
            ),
            (
                "cost per 1,000 tasks, CPU-seconds used",
                "cpu_cost_per_task",
                4,
            ),
        ];
        for (label, path, d) in rows {
            out.push_str(&format!("| {label} |"));
            for r in &fleets {
                let s = &r["summary"];
                let cell = if *path == "cpu_cost_per_task" {
                    f(cpu_cost(j, s).map(|c| c * 1e3), *d)
                } else if *path == "cost_per_task" {
                    f(field(s, path).map(|c| c * 1e3), *d)
                } else if path.is_empty() {
                    format!(
                        "{} / {} / {}",
                        s["requests_ok"], s["requests_shed"], s["requests_failed"]
                    )
                } else {
                    f(field(s, path), *d)
                };
                out.push_str(&format!(" {cell} |"));
            }
            out.push('\n');
        }
        let split = cmp
            .get("mesh_split_over_mesh")
            .map(|v| ("mesh-split".to_owned(), "mesh".to_owned(), v));
        let pairs = cmp["mesh_over"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(other, v)| ("mesh".to_owned(), other.clone(), v))
            .chain(split);
        for (this, other, v) in pairs {
            out.push_str(&format!(
                "\n{this} / {other}: requests/s {}, TTFT p50 {}, p95 {}, p99 {}, inter-token p50 {}, p95 {}, p99 {}, CPU-s per task {}; goal (no shed or failed request, >= 2x requests/s or <= 0.5x TTFT p95): {}; never worse (every latency percentile <= {NEVER_WORSE:.2}x): {}\n",
                f(v["requests_per_s"].as_f64(), 2),
                f(v["ttft_p50"].as_f64(), 2),
                f(v["ttft_p95"].as_f64(), 2),
                f(v["ttft_p99"].as_f64(), 2),
                f(v["itl_p50"].as_f64(), 2),
                f(v["itl_p95"].as_f64(), 2),
                f(v["itl_p99"].as_f64(), 2),
                f(v["cpu_s_per_task"].as_f64(), 2),
                if v["goal_met"] == true { "met" } else { "not met" },
                if v["never_worse"] == true { "yes" } else { "no" },
            ));
        }
        out.push('\n');
    }
    out
}

/// The results page's section for a fleet run (`path` its JSON, `stem` for the plot's file):
/// what ran, the tables, and a plot of TTFT p95 per fleet (per turn for sessions, per offered
/// load for the trace).
pub(crate) fn section(j: &Value, path: &str, stem: &str) -> (String, Option<crate::page::Plot>) {
    let st = &j["settings"];
    let l = &st["load"];
    let mut md = String::new();
    let sessions = st["workload"] == "sessions";
    if sessions {
        md.push_str(&format!(
            "## Fleet: agent sessions, {n} mesh nodes vs {n} llama-servers behind a load balancer\n\n\
             {} sessions arriving at {}/s, each {} turns: a system prompt with {} tool schemas shared by its group ({} groups), a request, then a tool result per turn after {} s of tool time on average; each turn sends the whole conversation with the replies that fleet returned; {} tokens per reply (EOS ignored, temperature 0). ",
            l["sessions"], l["rate_sessions_per_s"], l["turns"], l["tools_per_system_prompt"],
            l["groups"], l["think_s_mean"], l["max_tokens"], n = st["nodes"],
        ));
    } else {
        md.push_str(&format!(
            "## Fleet: Mooncake trace, {n} mesh nodes vs {n} llama-servers behind a load balancer\n\n\
             {} requests of `{}` from request {}, each 512-token block as {} token ids, prompts cut to {} blocks, outputs up to {} tokens (EOS ignored), replayed open-loop at the trace's arrival times divided by {}. ",
            l["requests"], l["trace"].as_str().unwrap_or("?"), l["skip"], l["block_tokens_per_512"], l["max_blocks"],
            l["max_output"],
            l["compress"].as_array().map_or("?".into(), |c| c.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")),
            n = st["nodes"],
        ));
    }
    md.push_str(&format!(
        "Model `{}` (tier {}); each replica pinned to {} cores of its own ({}), {} slots × {} context, batch {}; the proxy and the driver on {}. \
         Every fleet sits behind the same `mesh-bench proxy` (round-robin; `llama-sticky`: hash of the session id, or of the first block for the trace) and starts fresh for each run. \
         Not evaluated: mesh = prompt tokens restored from KV pages or kept in a slot; llama-server = its slot prompt cache. CPU-s per task: the replicas' user + system CPU over the run / completed sessions (trace: requests). Source: `{path}`.\n\n",
        st["model"].as_str().unwrap_or("?"), st["tier"].as_str().unwrap_or("?"),
        st["cores_per_replica"],
        st["replica_cores"].as_array().map_or(String::new(), |c| c.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(", ")),
        st["parallel"], st["ctx_per_sequence"], st["batch"],
        st["driver_cores"].as_str().map_or("cores not pinned (shared with the replicas)".to_owned(), |c| format!("cores {c}")),
    ));
    md.push_str(&table(j));
    let m = &j["machine"];
    md.push_str(&format!(
        "- machine: {} (nproc {}); load average at start {}\n- mesh {}; llama-server {}\n",
        m["cpu_model"].as_str().unwrap_or("?"),
        m["nproc"],
        m["loadavg_start"]
            .as_str()
            .unwrap_or("?")
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" "),
        st["mesh_version"].as_str().unwrap_or("?").trim(),
        st["llama_server_version"]
            .as_str()
            .unwrap_or("?")
            .lines()
            .find(|x| x.starts_with("version"))
            .unwrap_or("?"),
    ));
    for r in j["runs"].as_array().into_iter().flatten().take(3) {
        if let Some(a) = r["replica_argv"][0].as_str() {
            md.push_str(&format!(
                "- {} replica 0: `{a}`\n",
                r["fleet"].as_str().unwrap_or("?")
            ));
        }
    }
    md.push_str(&format!(
        "- command: `{}`\n\n",
        shell_join(&j["command_line"])
    ));
    let runs = j["runs"].as_array().cloned().unwrap_or_default();
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for r in &runs {
        let name = r["fleet"].as_str().unwrap_or("?").to_owned();
        let points: Vec<(f64, f64)> = if sessions {
            per_turn_p95(r)
        } else {
            r["offered_per_s"]
                .as_f64()
                .zip(field(&r["summary"], "ttft_ms.p95"))
                .into_iter()
                .collect()
        };
        match series.iter_mut().find(|(n, _)| *n == name) {
            Some((_, p)) => p.extend(points),
            None => series.push((name, points)),
        }
    }
    let plot = (!series.is_empty()).then(|| crate::page::Plot {
        file: format!("{stem}-ttft-p95.png"),
        title: if sessions {
            "TTFT p95 per turn".into()
        } else {
            "TTFT p95 vs offered load".into()
        },
        x_label: if sessions {
            "turn".into()
        } else {
            "offered requests/s".into()
        },
        y_label: "TTFT p95 (ms)".into(),
        series,
    });
    (md, plot)
}

/// `(turn number, TTFT p95 in ms)` of a sessions run's completed requests.
fn per_turn_p95(run: &Value) -> Vec<(f64, f64)> {
    let reqs = run["requests"].as_array().cloned().unwrap_or_default();
    let turns = reqs
        .iter()
        .filter_map(|r| r["turn"].as_u64())
        .max()
        .map_or(0, |t| t + 1);
    (0..turns)
        .filter_map(|t| {
            let v: Vec<f64> = reqs
                .iter()
                .filter(|r| r["turn"].as_u64() == Some(t) && r["outcome"] == "ok")
                .filter_map(|r| r["ttft_s"].as_f64().map(|x| x * 1e3))
                .collect();
            Some(((t + 1) as f64, crate::stats::percentile(&v, 95.0)?))
        })
        .collect()
}

/// Runs the benchmark, writes the JSON and markdown, prints the markdown.
pub(crate) async fn run(a: FleetArgs) -> Result<()> {
    a.validate()?;
    if let Some(c) = &a.driver_cores {
        let pid = std::process::id().to_string();
        let ok = std::process::Command::new("taskset")
            .args(["-a", "-p", "-c", c, &pid])
            .stdout(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            bail!("taskset could not pin this driver to cores {c}");
        }
    }
    mesh_transport::tls::install_crypto_provider();
    let stem = a
        .out
        .file_stem()
        .map_or("fleet".into(), |s| s.to_string_lossy().into_owned());
    let logs = a.out.with_file_name(format!("{stem}-logs"));
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .tcp_nodelay(true)
        .build()?;
    let started = Instant::now();
    let machine_start = machine::machine();
    let mut runs = Vec::new();
    let work_settings;
    match a.workload {
        Kind::Sessions => {
            let catalog = workload::load_catalog(&a.catalog)?;
            let plans = plans(&a, &catalog);
            work_settings = json!({
                "sessions": a.sessions, "rate_sessions_per_s": a.rate, "turns": a.turns,
                "think_s_mean": a.think_s, "groups": a.groups, "tools_per_system_prompt": a.tools,
                "result_items": a.result_items, "max_tokens": a.max_tokens,
                "catalog": a.catalog.display().to_string(),
                "system_prompt_chars": plans.iter().take(a.groups).map(|p| p.system.len()).collect::<Vec<_>>(),
            });
            let load = format!("{} sessions × {} turns, {}/s", a.sessions, a.turns, a.rate);
            for &fleet in &a.fleets {
                let tag = format!("sessions-{}", fleet.name());
                let mut r =
                    run_one(&a, fleet, &tag, &logs, &client, &Work::Sessions(&plans)).await?;
                r["load"] = json!(load);
                print_line(&r);
                runs.push(r);
            }
        }
        Kind::Mooncake => {
            work_settings = json!({
                "trace": a.trace.display().to_string(), "skip": a.skip, "requests": a.requests,
                "block_tokens_per_512": a.block_tokens, "max_blocks": a.max_blocks,
                "max_output": a.max_tokens, "compress": a.compress,
            });
            for &c in &a.compress {
                let all = mooncake::load_trace(
                    &a.trace,
                    &Scale {
                        requests: a.skip + a.requests,
                        block_tokens: a.block_tokens,
                        max_blocks: a.max_blocks,
                        max_output: a.max_tokens,
                        compress: c,
                    },
                )?;
                let mut reqs: Vec<Req> = all.into_iter().skip(a.skip).collect();
                if reqs.is_empty() {
                    bail!("--skip {} leaves no request of the trace", a.skip);
                }
                let t0 = reqs[0].at_s;
                for r in &mut reqs {
                    r.at_s -= t0;
                }
                let span = reqs.last().map_or(0.0, |r| r.at_s);
                let load = format!(
                    "Mooncake ×{c}: {} requests in {span:.0} s ({:.2}/s offered)",
                    reqs.len(),
                    reqs.len() as f64 / span.max(1e-9)
                );
                for &fleet in &a.fleets {
                    let tag = format!("mooncake-x{c}-{}", fleet.name());
                    let mut r =
                        run_one(&a, fleet, &tag, &logs, &client, &Work::Trace(&reqs)).await?;
                    r["load"] = json!(load);
                    r["offered_per_s"] = json!(reqs.len() as f64 / span.max(1e-9));
                    print_line(&r);
                    runs.push(r);
                }
            }
        }
    }
    let s = &a.servers;
    let mut j = json!({
        "benchmark": "fleet",
        "command_line": std::env::args().collect::<Vec<_>>(),
        "started_unix_s": std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0)
            .saturating_sub(started.elapsed().as_secs()),
        "duration_s": started.elapsed().as_secs_f64(),
        "git": machine::git_state(),
        "machine": machine_start,
        "settings": {
            "workload": match a.workload { Kind::Sessions => "sessions", Kind::Mooncake => "mooncake" },
            "nodes": a.nodes,
            "cores_per_replica": s.threads,
            "replica_cores": (0..a.nodes).map(|i| a.cores(i)).collect::<Vec<_>>(),
            "driver_cores": a.driver_cores,
            "model": s.model.display().to_string(),
            "tier": s.tier,
            "parallel": s.parallel,
            "ctx_per_sequence": s.ctx,
            "batch": s.batch,
            "kv_block": a.kv_block,
            "temperature": 0.0,
            "ignore_eos": true,
            "request_timeout_s": a.request_timeout_s,
            "load": work_settings,
            "mesh_version": machine::run_text(&s.mesh_bin, &["--version"]),
            "llama_server_version": machine::run_text(&s.llama_server, &["--version"]),
        },
        "runs": runs,
    });
    j["comparison"] = compare(j["runs"].as_array().map_or(&[][..], Vec::as_slice));
    j["machine"]["loadavg_end"] = json!(machine::load_average());
    if let Some(dir) = a.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&a.out, serde_json::to_string_pretty(&j)? + "\n")
        .with_context(|| format!("writing {}", a.out.display()))?;
    let md = markdown(&j);
    let md_path = a.out.with_extension("md");
    std::fs::write(&md_path, &md)?;
    println!("{md}");
    println!("wrote {} and {}", a.out.display(), md_path.display());
    Ok(())
}

fn print_line(r: &Value) {
    let s = &r["summary"];
    eprintln!(
        "  {}: ok {} shed {} failed {}, {:.2} req/s, TTFT p50 {:.0} ms p95 {:.0} ms, not evaluated {:.3}",
        r["fleet"].as_str().unwrap_or("?"),
        s["requests_ok"],
        s["requests_shed"],
        s["requests_failed"],
        field(s, "requests_per_s").unwrap_or(0.0),
        field(s, "ttft_ms.p50").unwrap_or(0.0),
        field(s, "ttft_ms.p95").unwrap_or(0.0),
        field(s, "not_evaluated_fraction").unwrap_or(0.0),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: FleetArgs,
    }

    fn args(extra: &[&str]) -> FleetArgs {
        let mut v = vec!["x", "--workload", "sessions"];
        v.extend(extra);
        Cli::parse_from(v).a
    }

    #[test]
    fn replicas_get_disjoint_core_ranges() {
        let a = args(&["--threads", "4", "--first-core", "2"]);
        assert_eq!([a.cores(0), a.cores(1)], ["2-5", "6-9"]);
        assert_eq!(args(&[]).cores(1), "1");
    }

    #[test]
    fn more_cores_than_the_machine_has_are_refused() {
        let e = args(&["--nodes", "100000", "--threads", "4"])
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("this machine has"), "{e}");
    }

    #[test]
    fn a_session_rate_of_zero_is_refused() {
        let e = args(&["--rate", "0"]).validate().unwrap_err();
        assert!(e.to_string().contains("--rate"), "{e}");
    }

    #[test]
    fn a_trace_compression_of_zero_is_refused() {
        let a = Cli::parse_from(["x", "--workload", "mooncake", "--compress", "1,0"]).a;
        let e = a.validate().unwrap_err();
        assert!(e.to_string().contains("--compress"), "{e}");
    }

    #[test]
    fn shed_is_429_or_503_and_anything_else_failed() {
        assert_eq!(outcome_of(Some(429)), "shed");
        assert_eq!(outcome_of(Some(503)), "shed");
        assert_eq!(outcome_of(Some(500)), "failed");
        assert_eq!(outcome_of(None), "failed");
    }

    #[test]
    fn sessions_arrive_at_the_rate_and_share_their_groups_system_prompt() {
        let catalog = crate::workload::tests::catalog();
        let a = args(&[
            "--sessions",
            "8",
            "--rate",
            "2",
            "--groups",
            "3",
            "--tools",
            "2",
        ]);
        let p = plans(&a, &catalog);
        assert_eq!(p[5].start_s, 2.5);
        assert_eq!(p[1].system, p[4].system);
        assert_ne!(p[1].system, p[2].system);
        assert_ne!(p[1].request, p[4].request);
        assert_eq!(p[0].results.len(), 3);
        assert!(p[0].think_s.iter().all(|&t| (0.5..1.5).contains(&t)));
    }

    #[test]
    fn each_turn_appends_a_tool_result_to_the_conversation() {
        let catalog = crate::workload::tests::catalog();
        let a = args(&["--turns", "2", "--tools", "2"]);
        let p = &plans(&a, &catalog)[0];
        let conv = Conversation::new(p.system.clone());
        let t0 = turn_prompt(&conv, p, 0);
        assert!(t0.starts_with(&p.system) && t0.ends_with(ASSISTANT));
        let conv = Conversation::new(format!("{t0}<tool_call>x</tool_call>{END}"));
        let t1 = turn_prompt(&conv, p, 1);
        assert!(t1.starts_with(&t0));
        assert!(t1.ends_with(&format!("<|tool|>{}{END}{ASSISTANT}", p.results[0])));
    }

    fn rec(task: usize, outcome: &'static str, sent: f64, ttft: f64, prompt: usize) -> Record {
        Record {
            task,
            turn: 0,
            sent_s: sent,
            outcome,
            error: None,
            ttft_s: (outcome == "ok").then_some(ttft),
            e2e_s: (outcome == "ok").then_some(ttft + 1.0),
            prompt_tokens: (outcome == "ok").then_some(prompt),
            completion_tokens: Some(8),
            itl_s: vec![0.01, 0.02],
        }
    }

    #[test]
    fn deltas_are_per_replica_and_sum_over_the_fleet() {
        let m = |v: Value| -> Map<String, Value> { serde_json::from_value(v).unwrap() };
        let c0 = vec![m(json!({"a": 1.0, "b": 5.0})), m(json!({"a": 2.0}))];
        let c1 = vec![
            m(json!({"a": 4.0, "b": 6.0})),
            m(json!({"a": 3.0, "b": 9.0})),
        ];
        let d = deltas(&c0, &c1);
        assert_eq!(
            d,
            vec![
                m(json!({"a": 3.0, "b": 1.0})),
                m(json!({"a": 1.0, "b": 9.0}))
            ]
        );
        assert_eq!(summed(&d), m(json!({"a": 4.0, "b": 10.0})));
    }

    #[test]
    fn gateway_itl_percentiles_are_the_bounds_of_their_buckets() {
        let b = |le: &str, n: f64| (format!("{GATEWAY_ITL}{{le=\"{le}\"}}"), json!(n));
        let m: Map<String, Value> = [
            b("0.001", 10.0),
            b("0.002", 90.0),
            b("0.004", 96.0),
            b("0.008", 99.0),
            b("+Inf", 100.0),
        ]
        .into_iter()
        .collect();
        let p = bucket_percentiles(&m, GATEWAY_ITL).unwrap();
        assert_eq!(p["n"], 100.0);
        assert_eq!(p["p50_le"], 2.0);
        assert_eq!(p["p95_le"], 4.0);
        assert_eq!(p["p99_le"], 8.0);
    }

    #[test]
    fn an_empty_histogram_has_no_percentiles() {
        let m: Map<String, Value> = [(format!("{GATEWAY_ITL}{{le=\"+Inf\"}}"), json!(0.0))]
            .into_iter()
            .collect();
        assert_eq!(bucket_percentiles(&m, GATEWAY_ITL), None);
    }

    #[test]
    fn buckets_are_summed_per_bound_over_models() {
        let m: Map<String, Value> = serde_json::from_value(json!({
            "mesh_inter_token_latency_seconds_bucket{model=\"a\",le=\"0.002\"}": 3.0,
            "mesh_inter_token_latency_seconds_bucket{model=\"b\",le=\"0.002\"}": 4.0,
        }))
        .unwrap();
        assert_eq!(
            by_label(&m, &[GATEWAY_ITL], "le"),
            vec![(format!("{GATEWAY_ITL}{{le=\"0.002\"}}"), 7.0)]
        );
    }

    #[test]
    fn step_phases_are_summed_per_phase_over_models() {
        let m: Map<String, Value> = serde_json::from_value(json!({
            "mesh_tier_step_seconds_total{model=\"a\",phase=\"decode\"}": 2.0,
            "mesh_tier_step_seconds_total{model=\"b\",phase=\"decode\"}": 1.5,
            "mesh_tier_step_seconds_total{model=\"a\",phase=\"admit\"}": 0.25,
            "mesh_tier_steps_total{model=\"a\"}": 10.0,
            "mesh_tier_steps_total{model=\"b\"}": 5.0,
            "mesh_other_total{phase=\"decode\"}": 9.0,
        }))
        .unwrap();
        let mut got = by_label(&m, PHASE_COUNTERS, "phase");
        got.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            got,
            vec![
                (
                    r#"mesh_tier_step_seconds_total{phase="admit"}"#.to_owned(),
                    0.25
                ),
                (
                    r#"mesh_tier_step_seconds_total{phase="decode"}"#.to_owned(),
                    3.5
                ),
                ("mesh_tier_steps_total".to_owned(), 15.0),
            ]
        );
    }

    #[test]
    fn summary_counts_outcomes_tasks_reuse_and_cost() {
        let records = [
            rec(0, "ok", 0.0, 0.1, 100),
            rec(0, "ok", 2.0, 0.3, 200),
            rec(1, "ok", 1.0, 0.2, 100),
            rec(1, "shed", 3.0, 0.0, 0),
        ];
        let mut d = Map::new();
        d.insert(
            "mesh_kv_recompute_avoided_tokens_total".into(),
            json!(150.0),
        );
        d.insert("mesh_kv_resident_tokens_total".into(), json!(50.0));
        let s = summarize(&records, 2, 2, 2, &d, 8.0, Some(0.5), Some(3.6));
        assert_eq!(s["requests_ok"], 3);
        assert_eq!(s["requests_shed"], 1);
        // Session 1 lost its second turn: one task completed.
        assert_eq!(s["tasks_completed"], 1);
        assert_eq!(s["wall_s"], 3.3);
        assert_eq!(s["prompt_tokens"], 400);
        assert_eq!(s["not_evaluated_fraction"], 0.5);
        assert_eq!(s["replica_cpu_s_per_task"], 8.0);
        // 3.6 per node-hour × 2 nodes × 3.3 s / 1 task.
        assert!((s["cost_per_task"].as_f64().unwrap() - 0.0066).abs() < 1e-12);
    }

    #[test]
    fn cpu_cost_prices_the_cpu_seconds_used_at_a_cores_share_of_the_node() {
        let j = json!({"settings": {"cores_per_replica": 2}});
        let s = json!({"replica_cpu_s_per_task": 8.0, "price_per_node_hour": 3.6});
        assert!((cpu_cost(&j, &s).unwrap() - 0.004).abs() < 1e-12);
        assert_eq!(cpu_cost(&j, &json!({"replica_cpu_s_per_task": 8.0})), None);
    }

    #[test]
    fn llama_reuse_is_sent_minus_evaluated_without_its_cached_counter() {
        let records = [rec(0, "ok", 0.0, 0.1, 300)];
        let mut d = Map::new();
        d.insert("llamacpp:prompt_tokens_total".into(), json!(120.0));
        let s = summarize(&records, 1, 1, 1, &d, 1.0, None, None);
        assert_eq!(s["prompt_tokens_not_evaluated"], 180.0);
        assert!(s["cost_per_task"].is_null());
    }

    #[test]
    fn report_section_tabulates_each_fleet_and_plots_its_tail_per_turn() {
        let run = |fleet: &str, ttft: [f64; 2]| {
            json!({"load": "8 sessions", "fleet": fleet, "replica_argv": [format!("{fleet} argv")],
                "summary": {"requests_ok": 2, "requests_shed": 0, "requests_failed": 0,
                    "requests_per_s": 1.5, "ttft_ms": {"p50": 10.0, "p95": 20.0, "p99": 30.0},
                    "replica_cpu_s_per_task": 2.0, "price_per_node_hour": 3.6},
                "requests": [
                    {"turn": 0, "outcome": "ok", "ttft_s": ttft[0]},
                    {"turn": 1, "outcome": "ok", "ttft_s": ttft[1]},
                    {"turn": 1, "outcome": "shed", "ttft_s": null}]})
        };
        let mut j = json!({
            "benchmark": "fleet",
            "command_line": ["mesh-bench", "fleet", "--workload", "sessions"],
            "machine": {"cpu_model": "Test CPU", "nproc": 16, "loadavg_start": "0.1 0.2 0.3 1/2 3"},
            "settings": {"workload": "sessions", "nodes": 2, "cores_per_replica": 4,
                "replica_cores": ["0-3", "4-7"], "driver_cores": "12-15", "model": "m.gguf", "tier": "t3",
                "parallel": 4, "ctx_per_sequence": 2048, "batch": 512,
                "load": {"sessions": 8, "rate_sessions_per_s": 1.0, "turns": 2, "tools_per_system_prompt": 12,
                    "groups": 4, "think_s_mean": 1.0, "max_tokens": 24}},
            "runs": [run("mesh", [0.1, 0.02]), run("llama-rr", [0.1, 0.08])],
        });
        j["comparison"] = compare(j["runs"].as_array().unwrap());
        let (md, plot) = section(&j, "docs/bench-data/f.json", "f");
        assert!(md.starts_with("## Fleet: agent sessions, 2 mesh nodes vs 2 llama-servers"));
        assert!(md.contains("| | mesh | llama-rr |"), "{md}");
        assert!(md.contains("| TTFT p95 (ms) | 20.0 | 20.0 |"), "{md}");
        // 2 CPU-s per task at 3.6 per node-hour of 4 cores.
        assert!(
            md.contains("| cost per 1,000 tasks, CPU-seconds used | 0.5000 | 0.5000 |"),
            "{md}"
        );
        assert!(
            md.contains("cores 12-15") && md.contains("`mesh argv`"),
            "{md}"
        );
        let plot = plot.unwrap();
        assert_eq!(plot.file, "f-ttft-p95.png");
        assert_eq!(plot.series[0].0, "mesh");
        assert_eq!(plot.series[0].1, [(1.0, 100.0), (2.0, 20.0)]);
        assert_eq!(plot.series[1].1[1], (2.0, 80.0));
    }

    #[test]
    fn goal_needs_no_shed_and_half_the_tail() {
        let run = |fleet: &str, p95: f64, shed: u64| {
            json!({"load": "L", "fleet": fleet, "summary": {"requests_per_s": 1.0,
                "ttft_ms": {"p50": 1.0, "p95": p95, "p99": p95}, "itl_ms": {"p95": 1.0},
                "requests_shed": shed, "requests_failed": 0}})
        };
        let c = compare(&[
            run("mesh", 40.0, 0),
            run("llama-rr", 100.0, 0),
            run("llama-sticky", 70.0, 0),
        ]);
        assert_eq!(c[0]["mesh_over"]["llama-rr"]["goal_met"], true);
        assert_eq!(c[0]["mesh_over"]["llama-sticky"]["goal_met"], false);
        let c = compare(&[run("mesh", 40.0, 2), run("llama-rr", 100.0, 0)]);
        assert_eq!(c[0]["mesh_over"]["llama-rr"]["goal_met"], false);
    }

    #[test]
    fn the_split_fleet_is_compared_with_the_mesh_fleet() {
        let c = compare(&[run("mesh", 4.0), run("mesh-split", 3.0)]);
        let v = &c[0]["mesh_split_over_mesh"];
        assert!((v["itl_p99"].as_f64().unwrap() - 0.75).abs() < 1e-9);
        assert!(compare(&[run("mesh", 4.0)])[0]
            .get("mesh_split_over_mesh")
            .is_none());
    }

    /// A clean run of `fleet` whose inter-token p99 is `itl_p99`.
    fn run(fleet: &str, itl_p99: f64) -> Value {
        json!({"load": "L", "fleet": fleet, "summary": {"requests_per_s": 1.0,
            "ttft_ms": {"p50": 10.0, "p95": 20.0, "p99": 30.0},
            "itl_ms": {"p50": 1.0, "p95": 2.0, "p99": itl_p99},
            "requests_shed": 0, "requests_failed": 0}})
    }

    #[test]
    fn never_worse_fails_on_any_percentile_over_ten_percent() {
        let c = compare(&[run("mesh", 3.3), run("llama-rr", 3.0)]);
        assert_eq!(c[0]["mesh_over"]["llama-rr"]["never_worse"], true);
        let c = compare(&[run("mesh", 3.4), run("llama-rr", 3.0)]);
        let v = &c[0]["mesh_over"]["llama-rr"];
        assert_eq!(v["never_worse"], false);
        assert!((v["worst_latency"].as_f64().unwrap() - 3.4 / 3.0).abs() < 1e-9);
    }
}
