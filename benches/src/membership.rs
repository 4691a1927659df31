//! `mesh-bench membership`: the real membership table at fleet sizes in one process
//! (`mesh_actors::membership_sim`: the table, its page-event following and the prefix index,
//! over a simulated network with loss and delay). For each fleet size it reports:
//! - how long until every node sees a crashed node gone (from the crash);
//! - false deaths while nobody crashed, at `--loss`, per node-hour of simulated time;
//! - control bytes each node sends per second at rest (heartbeats, framed as the transport
//!   frames them; QUIC and UDP headers not counted);
//! - how long until a node's `--pages` pages are in every peer's index after it starts
//!   holding them (its peers fetch a snapshot of its page log);
//! - the wall time the simulation took, and from it the CPU time one node's table and
//!   heartbeat handling take per second of cluster time at that size (every node runs on
//!   the one simulation thread; encoding each heartbeat and cloning it per receiver stand
//!   in for the real node's encoding and decoding).
//!
//! The membership it measures is today's: every node heartbeats every other node. SWIM-style
//! probing (issue 43, item 1) is to be measured with the same command.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Result;
use mesh_actors::membership_sim::Sim;
use serde_json::json;

/// Options of `mesh-bench membership`.
#[derive(clap::Args, Debug)]
pub(crate) struct MembershipArgs {
    /// Fleet sizes (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "64,256,1024")]
    nodes: Vec<usize>,
    /// Probability that a heartbeat is lost.
    #[arg(long, default_value_t = 0.01)]
    loss: f64,
    /// Most heartbeat periods a message is late (uniform from 0).
    #[arg(long, default_value_t = 1)]
    max_delay: u64,
    /// Heartbeat period in ms (the node default).
    #[arg(long, default_value_t = 250)]
    period_ms: u64,
    /// Failure timeout in ms (the node default).
    #[arg(long, default_value_t = 2000)]
    failure_timeout_ms: u64,
    /// Periods run at rest, with the loss, to count false deaths and bytes.
    #[arg(long, default_value_t = 240)]
    rest_periods: u64,
    /// Pages the new holder publishes.
    #[arg(long, default_value_t = 100_000)]
    pages: usize,
    /// Seed of the loss and delay draws.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Where to write the result JSON (the markdown table goes next to it).
    #[arg(long)]
    out: Option<PathBuf>,
}

pub(crate) async fn run(a: MembershipArgs) -> Result<()> {
    anyhow::ensure!(
        a.nodes.iter().all(|n| *n >= 3),
        "every fleet needs at least 3 nodes"
    );
    anyhow::ensure!((0.0..1.0).contains(&a.loss), "--loss must be in [0, 1)");
    let period = Duration::from_millis(a.period_ms.max(1));
    let timeout = Duration::from_millis(a.failure_timeout_ms);
    let mut rows = vec![];
    for &n in &a.nodes {
        let wall = Instant::now();
        let mut sim = Sim::new(n, period, timeout, a.seed);
        sim.loss = a.loss;
        sim.max_delay = a.max_delay;
        // Join: everyone through node 0, until the tables agree.
        let mut join_periods = 0;
        while !sim.converged() && join_periods < 200 {
            sim.run(1);
            join_periods += 1;
        }
        anyhow::ensure!(sim.converged(), "{n} nodes did not converge in 200 periods");
        // At rest: bytes and false deaths.
        let bytes0: u64 = sim.sent_bytes.iter().sum();
        let deaths0 = sim.deaths.len();
        sim.run(a.rest_periods);
        let rest_s = sim.time(a.rest_periods).as_secs_f64();
        let per_node_bps = (sim.sent_bytes.iter().sum::<u64>() - bytes0) as f64 / n as f64 / rest_s;
        let false_deaths = sim.deaths.len() - deaths0;
        let node_hours = n as f64 * rest_s / 3600.0;
        // A node's pages become routable.
        let holder = n - 1;
        let ids: Vec<u64> = (0..a.pages as u64)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
            .collect();
        sim.hold_pages(holder, ids);
        let mut page_periods = 0;
        while sim.least_indexed(holder) < a.pages && page_periods < 400 {
            sim.run(1);
            page_periods += 1;
        }
        let routable = (sim.least_indexed(holder) >= a.pages).then(|| sim.time(page_periods));
        // A crash: until every node up sees it gone.
        let victim = n / 2;
        sim.crash(victim);
        let mut crash_periods = 0;
        while sim.seen_gone_by(victim) < n - 1 && crash_periods < 400 {
            sim.run(1);
            crash_periods += 1;
        }
        let detected = (sim.seen_gone_by(victim) == n - 1).then(|| sim.time(crash_periods));
        let wall_s = wall.elapsed().as_secs_f64();
        let simulated_s = sim.time(sim.period).as_secs_f64();
        let row = json!({
            "nodes": n,
            "join_s": sim.time(join_periods).as_secs_f64(),
            "failure_seen_by_all_s": detected.map(|d| d.as_secs_f64()),
            "false_deaths": false_deaths,
            "false_deaths_per_node_hour": false_deaths as f64 / node_hours,
            "rest_s": rest_s,
            "control_bytes_per_node_per_s": per_node_bps,
            "pages": a.pages,
            "pages_routable_s": routable.map(|d| d.as_secs_f64()),
            "sim_wall_s": wall_s,
            "simulated_s": simulated_s,
            // Every node's table runs on this one thread: its share per node.
            "table_cpu_ms_per_node_per_s": wall_s * 1e3 / n as f64 / simulated_s,
        });
        eprintln!("{row}");
        rows.push(row);
    }
    let out = json!({
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "membership": "full mesh: every node heartbeats every other node",
        "loss": a.loss,
        "max_delay_periods": a.max_delay,
        "period_ms": a.period_ms,
        "failure_timeout_ms": a.failure_timeout_ms,
        "rest_periods": a.rest_periods,
        "seed": a.seed,
        "rows": rows,
    });
    let md = markdown(&out);
    println!("{md}");
    if let Some(path) = &a.out {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(path, serde_json::to_string_pretty(&out)?)?;
        std::fs::write(path.with_extension("md"), md)?;
    }
    Ok(())
}

fn markdown(out: &serde_json::Value) -> String {
    let mut s = String::from(
        "| nodes | failure seen by all, s | false deaths (per node-hour) | control bytes per node per s | pages routable everywhere, s | join, s | table CPU per node, ms per s | simulation wall, s |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let secs = |v: &serde_json::Value| {
        v.as_f64()
            .map_or("not reached".into(), |x| format!("{x:.2}"))
    };
    for r in out["rows"].as_array().into_iter().flatten() {
        s.push_str(&format!(
            "| {} | {} | {} ({:.3}) | {:.0} | {} | {} | {:.2} | {:.1} |\n",
            r["nodes"],
            secs(&r["failure_seen_by_all_s"]),
            r["false_deaths"],
            r["false_deaths_per_node_hour"].as_f64().unwrap_or(0.0),
            r["control_bytes_per_node_per_s"].as_f64().unwrap_or(0.0),
            secs(&r["pages_routable_s"]),
            secs(&r["join_s"]),
            r["table_cpu_ms_per_node_per_s"].as_f64().unwrap_or(0.0),
            r["sim_wall_s"].as_f64().unwrap_or(0.0),
        ));
    }
    s
}
