//! `mesh-bench index`: the routing lookup of a prompt's prefix pages across a fleet, in the
//! peers' page index (`mesh_kvstore::PrefixIndex`, what routing reads now) against the status
//! quo it replaced (each request built a hash set of every candidate's advertised ids, at
//! most 1,024 a node, and counted the leading pages in it).
//!
//! Synthetic and in one process: `--pages` pages in chains of `--prompt-pages` (one chain
//! per conversation prefix), each chain held by 1 to 3 random nodes as a random-length
//! prefix of it (a node keeps the start of what it computed). A lookup is a random chain's
//! ids. Reports the lookup time (p50, p99) of both, the index's build time and the resident
//! memory it added, and how many lookups each could see any held page of (the status quo
//! sees only the 1,024 newest ids a node advertised).

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use mesh_kvstore::{PageSpace, PrefixIndex};
use serde_json::json;

/// Options of `mesh-bench index`.
#[derive(clap::Args, Debug)]
pub(crate) struct IndexArgs {
    /// Nodes in the fleet.
    #[arg(long, default_value_t = 64)]
    nodes: usize,
    /// Pages held across the fleet (before the 1-3 copies).
    #[arg(long, default_value_t = 1_000_000)]
    pages: usize,
    /// Pages of one prompt (256 pages of 16 tokens: a 4,096-token prompt).
    #[arg(long, default_value_t = 256)]
    prompt_pages: usize,
    /// Lookups timed for each method.
    #[arg(long, default_value_t = 20_000)]
    lookups: usize,
    /// Ids a node advertised under the status quo.
    #[arg(long, default_value_t = 1024)]
    advertised: usize,
    /// Seed of the synthetic fleet.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Where to write the result JSON.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

pub(crate) async fn run(a: IndexArgs) -> Result<()> {
    anyhow::ensure!(
        a.nodes > 0 && a.prompt_pages > 0 && a.lookups > 0,
        "counts must be positive"
    );
    let mut rng = Rng(a.seed);
    let chains: Vec<Vec<u64>> = (0..a.pages.div_ceil(a.prompt_pages))
        .map(|_| (0..a.prompt_pages).map(|_| rng.next()).collect())
        .collect();
    // Each node's pages, in the order it stored them (newest last).
    let mut held: Vec<Vec<u64>> = vec![vec![]; a.nodes];
    for chain in &chains {
        for _ in 0..1 + rng.below(3) {
            let node = rng.below(a.nodes);
            let len = 1 + rng.below(chain.len());
            held[node].extend_from_slice(&chain[..len]);
        }
    }
    let names: Vec<String> = (0..a.nodes).map(|i| format!("n{i}")).collect();
    let space = PageSpace {
        ns: "t1".into(),
        base: vec![0; 32],
        block: 16,
    };
    let rss0 = rss_bytes();
    let t0 = Instant::now();
    let mut index = PrefixIndex::new();
    for (name, ids) in names.iter().zip(&held) {
        index.set_node(name, [(space.clone(), ids.as_slice())]);
    }
    let build_s = t0.elapsed().as_secs_f64();
    let index_bytes = rss_bytes().saturating_sub(rss0);
    // The status quo: the newest `advertised` ids of each node.
    let adverts: Vec<Vec<u64>> = held
        .iter()
        .map(|ids| ids.iter().rev().take(a.advertised).copied().collect())
        .collect();
    let queries: Vec<&Vec<u64>> = (0..a.lookups)
        .map(|_| &chains[rng.below(chains.len())])
        .collect();

    let mut t_index = Vec::with_capacity(a.lookups);
    let mut seen_index = 0usize;
    for q in &queries {
        let t = Instant::now();
        let runs = index.runs(&space, q);
        t_index.push(t.elapsed().as_secs_f64() * 1e6);
        seen_index += usize::from(runs.iter().any(|(_, r)| *r > 0));
    }
    let mut t_sets = Vec::with_capacity(a.lookups);
    let mut seen_sets = 0usize;
    for q in &queries {
        let t = Instant::now();
        let runs: Vec<usize> = adverts
            .iter()
            .map(|ids| {
                let set: HashSet<u64> = ids.iter().copied().collect();
                q.iter().take_while(|id| set.contains(id)).count()
            })
            .collect();
        t_sets.push(t.elapsed().as_secs_f64() * 1e6);
        seen_sets += usize::from(runs.iter().any(|r| *r > 0));
    }
    t_index.sort_by(f64::total_cmp);
    t_sets.sort_by(f64::total_cmp);
    let indexed = index.len();
    let result = json!({
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "nodes": a.nodes, "pages": a.pages, "prompt_pages": a.prompt_pages,
        "indexed_pages": indexed, "lookups": a.lookups, "advertised": a.advertised,
        "index": {"build_s": build_s, "rss_bytes": index_bytes,
            "p50_us": percentile(&t_index, 0.5), "p99_us": percentile(&t_index, 0.99),
            "lookups_seeing_pages": seen_index},
        "status_quo": {"p50_us": percentile(&t_sets, 0.5), "p99_us": percentile(&t_sets, 0.99),
            "lookups_seeing_pages": seen_sets},
    });
    println!(
        "{} nodes, {} pages indexed ({} per node on average), prompts of {} pages, {} lookups\n\
         | method | p50 | p99 | lookups that saw held pages |\n|---|---|---|---|\n\
         | page index | {:.1} us | {:.1} us | {} |\n\
         | hash set per candidate ({} ids a node) | {:.1} us | {:.1} us | {} |\n\
         index built in {:.2} s, {:.0} MiB resident",
        a.nodes,
        indexed,
        indexed / a.nodes,
        a.prompt_pages,
        a.lookups,
        percentile(&t_index, 0.5),
        percentile(&t_index, 0.99),
        seen_index,
        a.advertised,
        percentile(&t_sets, 0.5),
        percentile(&t_sets, 0.99),
        seen_sets,
        build_s,
        index_bytes as f64 / (1u64 << 20) as f64,
    );
    if let Some(out) = a.out {
        std::fs::write(&out, serde_json::to_string_pretty(&result)?)?;
    }
    Ok(())
}
