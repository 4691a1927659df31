//! The `mesh` command.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand};
use mesh::config::NodeConfig;
use mesh_tiers::EngineConfig;

#[derive(Parser, Debug)]
#[command(name = "mesh", version, about = "An inference mesh for AI agents")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Start one node: load its tiers and serve the OpenAI-compatible API.
    Up(UpArgs),
}

#[derive(clap::Args, Debug)]
struct UpArgs {
    /// TOML config file (see docs/architecture.md); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Gateway address.
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Gateway port on 127.0.0.1 (shorthand for --listen).
    #[arg(long, conflicts_with = "listen")]
    port: Option<u16>,
    /// Tier to host, as NAME=PATH.gguf (repeatable); replaces the configured tiers.
    #[arg(long = "tier", value_name = "NAME=PATH")]
    tiers: Vec<String>,
    /// Only these tier names from the config or the bundled set (comma-separated).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// llama.cpp threads per tier.
    #[arg(long)]
    threads: Option<i32>,
    /// KV cells per tier.
    #[arg(long)]
    ctx: Option<u32>,
    /// Concurrent sequences per tier.
    #[arg(long)]
    parallel: Option<u32>,
}

fn node_config(a: &UpArgs) -> anyhow::Result<NodeConfig> {
    let mut cfg = NodeConfig::load(a.config.as_deref())?;
    if let Some(l) = a.listen {
        cfg.listen = l;
    }
    if let Some(p) = a.port {
        cfg.listen = SocketAddr::from(([127, 0, 0, 1], p));
    }
    if !a.tiers.is_empty() {
        cfg.tiers = a
            .tiers
            .iter()
            .map(|s| {
                let (name, path) = s
                    .split_once('=')
                    .ok_or_else(|| anyhow::anyhow!("--tier expects NAME=PATH, got `{s}`"))?;
                Ok(EngineConfig {
                    name: name.into(),
                    model: path.into(),
                    ..EngineConfig::default()
                })
            })
            .collect::<anyhow::Result<_>>()?;
    }
    if !a.only.is_empty() {
        cfg.tiers.retain(|t| a.only.contains(&t.name));
    }
    for t in &mut cfg.tiers {
        if let Some(n) = a.threads {
            t.threads = n;
        }
        if let Some(c) = a.ctx {
            t.n_ctx = c;
        }
        if let Some(p) = a.parallel {
            t.n_seq_max = p;
        }
    }
    Ok(cfg)
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    tracing::info!("shutting down");
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Up(a) => {
            let cfg = node_config(&a)?;
            let _telemetry = mesh::telemetry::init("mesh");
            let names: Vec<&str> = cfg.tiers.iter().map(|t| t.name.as_str()).collect();
            tracing::info!(listen = %cfg.listen, tiers = ?names, "starting node");
            let running = mesh::start(cfg, shutdown_signal()).await?;
            tracing::info!(addr = %running.addr, "gateway listening");
            println!("mesh listening on http://{}", running.addr);
            running.wait().await
        }
    }
}
