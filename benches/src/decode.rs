//! The `decode` benchmark: streaming generation, one stream and N concurrent streams, mesh vs
//! llama-server, alternating A B A B after a warm-up per target.

use std::path::PathBuf;

use anyhow::{bail, Result};
use indicatif::ProgressBar;
use serde_json::{json, Value};

use crate::report::{self, TARGETS};
use crate::server::Server;
use crate::sidebyside::{self, CpuMeter, RunRecord, ServerArgs, Workload};
use crate::workload::{self, Batch, RequestSpec};

/// Options of `mesh-bench decode`.
#[derive(clap::Args, Debug)]
pub(crate) struct DecodeArgs {
    #[command(flatten)]
    servers: ServerArgs,
    /// Tokens generated per request (EOS ignored, so every request makes exactly this many).
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Measured repetitions per workload and target, after one warm-up each.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Concurrent streams of each workload (comma-separated, e.g. `1,2,4,8` for a sweep).
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    streams: Vec<usize>,
    /// Requests each stream sends back to back in one repetition.
    #[arg(long, default_value_t = 4)]
    rounds: usize,
    /// Tool schemas in each prompt (sets the prompt length: about 100 tokens each for t1).
    #[arg(long, default_value_t = 4)]
    tools_per_prompt: usize,
    /// Prompts to send instead of the catalog's (a JSONL file, `{"prompt": "..."}` per line,
    /// each already in the model's chat format, e.g. `benches/prompts/qwen-code.jsonl`);
    /// prompt k is line k, so the file needs as many lines as the run sends requests.
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// Tool catalog the prompts are built from.
    #[arg(long, default_value = "models/fixtures/catalog.jsonl")]
    catalog: PathBuf,
    /// JSON output; the markdown goes next to it with the extension `.md`, server logs with
    /// `.mesh.log` and `.llama-server.log`.
    #[arg(long, default_value = "bench-results/decode.json")]
    out: PathBuf,
}

impl DecodeArgs {
    fn validate(&self) -> Result<()> {
        if self.streams.is_empty() || self.streams.contains(&0) {
            bail!("--streams needs positive stream counts");
        }
        if let Some(&s) = self
            .streams
            .iter()
            .find(|&&s| s > self.servers.parallel as usize)
        {
            bail!("{s} streams exceed --parallel {}: requests would queue, which measures admission, not decode", self.servers.parallel);
        }
        if self.reps == 0 || self.rounds == 0 || self.max_tokens == 0 {
            bail!("--reps, --rounds and --max-tokens must be at least 1");
        }
        self.servers.check(&[(&self.catalog, "the tool catalog")])
    }
}

/// Runs the benchmark, writes the JSON and markdown, prints the table. Both servers are
/// stopped and reaped before this returns, whatever the outcome.
pub(crate) async fn run(args: DecodeArgs) -> Result<()> {
    args.validate()?;
    sidebyside::run(&args, &args.out).await
}

impl Workload for DecodeArgs {
    /// Requests per target over the whole run (warm-ups included).
    fn requests_per_target(&self) -> usize {
        self.streams
            .iter()
            .map(|s| s * self.rounds * (self.reps + 1))
            .sum()
    }

    async fn bench(
        &self,
        servers: &mut Vec<Server>,
        progress: &ProgressBar,
    ) -> Result<(Value, String)> {
        bench(self, servers, progress).await
    }
}

/// Batches of one workload: warm-up and measured repetitions, per target.
struct WorkloadRuns {
    streams: usize,
    warmup: [Option<Batch>; 2],
    reps: [Vec<Batch>; 2],
}

async fn bench(
    args: &DecodeArgs,
    servers: &mut Vec<Server>,
    progress: &ProgressBar,
) -> Result<(Value, String)> {
    let record = RunRecord::begin(progress);
    let catalog = workload::load_catalog(&args.catalog)?;
    let n_prompts = args.requests_per_target();
    let prompts: Vec<String> = match &args.prompts {
        Some(path) => {
            let given = workload::load_prompts(path)?;
            if given.len() < n_prompts {
                bail!(
                    "{} holds {} prompts; this run sends {n_prompts} per target",
                    path.display(),
                    given.len()
                );
            }
            given
        }
        None => (0..n_prompts)
            .map(|k| workload::prompt(&catalog, k, args.tools_per_prompt))
            .collect(),
    };
    let (client, ready_s) = args
        .servers
        .start(&args.out, &[], servers, progress)
        .await?;

    let spec = RequestSpec {
        model: &args.servers.tier,
        max_tokens: args.max_tokens,
    };
    let mut runs = Vec::new();
    let mut next_prompt = 0;
    let meter = CpuMeter::new(servers);
    for &streams in &args.streams {
        let mut w = WorkloadRuns {
            streams,
            warmup: [None, None],
            reps: [Vec::new(), Vec::new()],
        };
        for phase in 0..=args.reps {
            // Both targets get the same prompts in a phase; each phase gets fresh ones.
            for (t, server) in servers.iter_mut().enumerate() {
                let what = if phase == 0 {
                    "warm-up".to_owned()
                } else {
                    format!("rep {phase}/{}", args.reps)
                };
                progress.set_message(format!("{streams} stream(s), {}, {what}", server.name));
                server.ensure_running()?;
                let before = meter.snapshot();
                let mut b = workload::run_batch(
                    &client,
                    &server.base_url,
                    &spec,
                    &prompts,
                    next_prompt,
                    streams,
                    args.rounds,
                    progress,
                )
                .await?;
                b.foreign = meter.since(before);
                if phase == 0 {
                    w.warmup[t] = Some(b);
                } else {
                    w.reps[t].push(b);
                }
            }
            next_prompt += streams * args.rounds;
        }
        runs.push(w);
    }
    let mut json = record
        .finish("decode", &args.servers, servers, &ready_s, &client)
        .await?;

    // Report.
    let mut workloads_json = Vec::new();
    let mut rows = Vec::new();
    for w in &runs {
        let name = if w.streams == 1 {
            "1 stream".to_owned()
        } else {
            format!("{} streams", w.streams)
        };
        let (hm, hl) = (report::headline(&w.reps[0]), report::headline(&w.reps[1]));
        let pairs = report::pair_ratios(&w.reps[0], &w.reps[1]);
        rows.extend(report::rows(&name, &hm, &hl, &pairs));
        workloads_json.push(json!({
            "name": name,
            "streams": w.streams,
            "rounds": args.rounds,
            "requests_per_rep": w.streams * args.rounds,
            "targets": {
                TARGETS[0]: report::target_json(w.warmup[0].as_ref(), &w.reps[0]),
                TARGETS[1]: report::target_json(w.warmup[1].as_ref(), &w.reps[1]),
            },
            "ratio_mesh_over_llama_server": report::ratios(&hm, &hl),
            "pair_ratios_mesh_over_llama_server": pairs,
        }));
    }
    let kib = |t: &str| json["targets"][t]["peak_rss_kib"].as_f64();
    rows.push(report::Row {
        workload: "process".into(),
        label: "peak RSS, VmHWM (MiB)".into(),
        mesh: kib(TARGETS[0]).map(|k| k / 1024.0),
        llama: kib(TARGETS[1]).map(|k| k / 1024.0),
        decimals: 1,
        better: report::Better::Lower,
        pair_ratios: Vec::new(),
    });
    let all = |t: usize| -> Vec<&Batch> {
        runs.iter()
            .flat_map(|w| w.warmup[t].iter().chain(w.reps[t].iter()))
            .collect()
    };
    json["checks"] = report::checks(&all(0), &all(1), args.max_tokens);
    json["other_processes_during_measured_batches"] = sidebyside::noise_json(
        runs.iter()
            .flat_map(|w| w.reps.iter().flatten())
            .map(|b| (b.wall_s, b.foreign)),
    );
    json["settings"] = args.servers.settings_json(json!({
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
        "ignore_eos": true,
        "stream": true,
        "reps": args.reps,
        "warmups_per_target_and_workload": 1,
        "order": "per workload: warm-up A, warm-up B, then A B per repetition (A = mesh, B = llama-server)",
        "streams": args.streams,
        "rounds": args.rounds,
        "arrival": "closed loop: all streams start together, each sends its next request when the previous one ends",
        "tools_per_prompt": args.tools_per_prompt,
        "prompts": match &args.prompts {
            Some(p) => format!("{}, line k for request k; never reused within a target", p.display()),
            None => "chat format with tool schemas from the catalog; prompt k lists catalog entries k, k+37, ...; never reused within a target".to_owned(),
        },
        "catalog": args.catalog.display().to_string(),
        "endpoint": "/v1/completions",
        "connections": "a new TCP connection per request (no keep-alive reuse)",
    }));
    json["workloads"] = json!(workloads_json);
    let markdown = markdown(args, &json, &rows);
    Ok((json, markdown))
}

fn markdown(args: &DecodeArgs, j: &Value, rows: &[report::Row]) -> String {
    let s = |v: &Value| {
        v.as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| v.to_string())
    };
    let c = &j["checks"];
    let model_bytes = j["model"]["bytes"].as_u64().unwrap_or(0);
    let a = &args.servers;
    let mut out = String::new();
    out.push_str("# decode: mesh vs llama-server\n\n");
    out.push_str(&report::table(rows));
    out.push_str("\nRatio = mesh / llama-server: for tok/s above 1 means mesh is faster; for latencies and RSS below 1 means mesh is better. ");
    out.push_str("Throughput and p50 latencies: median over repetitions; p95/p99: pooled over all measured requests of the workload. ");
    out.push_str("Per-pair ratios: repetition i of mesh against repetition i of llama-server, run back to back (– where the value is pooled or taken once).\n\n");
    out.push_str(&format!(
        "- model: `{}` ({}, {:.2} MiB), tier `{}`; threads {}, ctx {} per sequence ({} total, {} slots), batch/ubatch {}, max_tokens {} (ignore_eos, temperature 0, streaming)\n",
        a.model.display(),
        j["model"]["quantization"].as_str().unwrap_or("?"),
        model_bytes as f64 / (1 << 20) as f64,
        a.tier,
        a.threads,
        a.ctx,
        a.ctx * a.parallel,
        a.parallel,
        a.batch,
        args.max_tokens,
    ));
    out.push_str(&format!(
        "- runs: {} repetitions per workload and target, A B alternating after one warm-up each; {} requests per stream per repetition; prompt tokens {}..{} (median {})\n",
        args.reps, args.rounds, s(&c["prompt_tokens"]["min"]), s(&c["prompt_tokens"]["max"]), s(&c["prompt_tokens"]["median"]),
    ));
    out.push_str(&format!(
        "- checks: prompt token counts differ on {} of {} prompts; requests short of max_tokens: mesh {}, llama-server {}; identical greedy text on {} of {} prompts\n",
        s(&c["prompt_token_count_mismatches"]), s(&c["prompts_compared"]),
        s(&c["requests_not_max_tokens"]["mesh"]), s(&c["requests_not_max_tokens"]["llama-server"]),
        s(&c["identical_greedy_text"]), s(&c["prompts_compared"]),
    ));
    let lm = &j["targets"]["llama-server"]["metrics_at_end"];
    let num = |k: &str| lm[k].as_f64();
    if let (Some(evaluated), Some(cached)) = (
        num("llamacpp:prompt_tokens_total"),
        num("llamacpp:prompt_tokens_cached_total"),
    ) {
        let total = evaluated + cached;
        out.push_str(&format!(
            "- llama-server prompt cache: {cached:.0} of {total:.0} prompt tokens reused ({:.1}%); {} llama_decode calls, {} busy slots per call on average (whole run, warm-ups included)\n",
            if total > 0.0 { 100.0 * cached / total } else { 0.0 },
            num("llamacpp:n_decode_total").map_or("?".into(), |v| format!("{v:.0}")),
            num("llamacpp:n_busy_slots_per_decode").map_or("?".into(), |v| format!("{v:.2}")),
        ));
    }
    if model_bytes < 64 << 20 {
        out.push_str("- bound: the weights fit in CPU cache, so decode here is bound by per-step overhead and compute, not memory bandwidth; no bandwidth fraction is given.\n");
    }
    out.push_str(&sidebyside::environment_markdown(j));
    out
}
