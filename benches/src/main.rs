//! `mesh-bench`: the workload driver that runs mesh and llama.cpp's own `llama-server` side by
//! side, on the same GGUF with the same settings, and reports medians and mesh/llama-server
//! ratios as JSON plus a short markdown table (see `shared/MEASURING.md`).
//!
//! Design: the driver starts both servers itself as child processes on free ports, sends both
//! the same prompt strings with the same output length (`ignore_eos`, fixed `max_tokens`,
//! temperature 0), alternates the targets A B A B after a warm-up, and reads each server's
//! peak RSS before stopping it. Every child is killed and reaped on exit, on error and on
//! Ctrl-C / SIGTERM.
//!
//! Caveats: wall-clock numbers on a shared machine drift; the ratios from one run are what to
//! compare across runs. The driver runs on a single-threaded runtime so that it takes as
//! little CPU as it can from the servers it measures, but it still shares the machine with
//! them. Benchmarks never gate CI.

mod decode;
mod fabric;
mod fleet;
mod gguf;
mod index;
mod levels;
mod machine;
mod membership;
mod mooncake;
mod page;
mod prefix;
mod proxy;
mod report;
mod server;
mod sessions;
mod sidebyside;
mod soak;
mod stats;
mod transport;
mod workload;

use clap::{Parser, Subcommand};

/// Compare mesh with llama.cpp's llama-server.
#[derive(Parser)]
#[command(name = "mesh-bench", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Streaming decode: single stream and N concurrent streams, TTFT, inter-token latency,
    /// tokens/s and peak RSS, mesh vs llama-server.
    Decode(decode::DecodeArgs),
    /// Mesh transport (QUIC + mTLS + rkyv frames) vs plain TCP: round trip and bulk; and the
    /// gateway's forwarding overhead vs serving locally.
    Transport(transport::TransportArgs),
    /// Agents sharing a long prompt prefix: throughput and TTFT, mesh (prefix KV pages) vs
    /// llama-server (prompt cache).
    Prefix(prefix::PrefixArgs),
    /// Time to first token when a prompt's prefix lives on a peer node vs recomputed.
    Fabric(fabric::FabricArgs),
    /// Time to first token of a long shared prefix by the KV level that serves it (device
    /// kept or copied, host RAM, disk) vs recomputed, on one node.
    Levels(levels::LevelsArgs),
    /// Replay of a Mooncake-format trace (scaled), mesh vs llama-server.
    Mooncake(mooncake::MooncakeArgs),
    /// Multi-turn agent sessions, each turn sending the whole conversation so far: TTFT per
    /// turn, total time and prompt reuse, mesh (KV pages) vs llama-server (prompt cache).
    Sessions(sessions::SessionsArgs),
    /// A long mixed workload (chat, streams, agent tasks, bad requests, dropped clients)
    /// against one node: errors, RSS and open descriptors over time.
    Soak(soak::SoakArgs),
    /// N mesh nodes against N llama-servers behind a load balancer (round-robin and
    /// session-sticky): agent sessions or the Mooncake trace, requests/s, TTFT, shed requests,
    /// reuse and CPU-seconds per task.
    Fleet(fleet::FleetArgs),
    /// The HTTP load balancer `fleet` puts in front of each fleet (round-robin or by session).
    Proxy(proxy::ProxyArgs),
    /// The results page (docs/benchmarks.md) with PNG plots, from decode and sessions JSONs.
    Report(page::ReportArgs),
    /// Routing lookups of a prompt's prefix pages across a synthetic fleet: the peers' page
    /// index vs a hash set of each candidate's advertised ids per request.
    Index(index::IndexArgs),
    /// The membership table at fleet sizes in one process (simulated network with loss and
    /// delay): failure detection, false deaths, control bytes, pages routable.
    Membership(membership::MembershipArgs),
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Decode(args) => decode::run(args).await,
        Command::Transport(args) => transport::run(args).await,
        Command::Prefix(args) => prefix::run(args).await,
        Command::Fabric(args) => fabric::run(args).await,
        Command::Levels(args) => levels::run(args).await,
        Command::Mooncake(args) => mooncake::run(args).await,
        Command::Sessions(args) => sessions::run(args).await,
        Command::Soak(args) => soak::run(args).await,
        Command::Fleet(args) => fleet::run(args).await,
        Command::Proxy(args) => proxy::run(args).await,
        Command::Report(args) => page::run(args),
        Command::Index(args) => index::run(args).await,
        Command::Membership(args) => membership::run(args).await,
    }
}
