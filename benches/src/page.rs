//! `mesh-bench report`: the results page (`docs/benchmarks.md`) from result JSONs the driver
//! wrote, with PNG plots.
//!
//! Reads `decode` runs (a `--streams 1,2,4,8` sweep gives the concurrency plots: TTFT and
//! throughput vs concurrent streams, mesh vs llama-server), `sessions` runs (TTFT per turn) and
//! `fleet` runs (TTFT p95 per turn or per offered load, one line per fleet).
//! Each section states the machine, how much CPU other processes took while measuring, both
//! servers' argv and the driver's exact command, all taken from the JSON. Building the text is
//! pure ([`page`]); drawing writes PNGs with plotters' bitmap backend and a TrueType font read
//! from a file (plotters' `ab_glyph` feature: no fontconfig or freetype).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use plotters::prelude::*;
use serde_json::Value;

use crate::report::{self, Better, Row, METRICS, TARGETS};
use crate::sidebyside;

/// Options of `mesh-bench report`.
#[derive(clap::Args, Debug)]
pub(crate) struct ReportArgs {
    /// Result JSONs written by `mesh-bench decode`, `sessions` and `fleet`.
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// The page to write.
    #[arg(long, default_value = "docs/benchmarks.md")]
    out: PathBuf,
    /// Folder for the PNG plots (linked relative to the page).
    #[arg(long, default_value = "docs/img")]
    img_dir: PathBuf,
    /// A paragraph to add under the page's introduction (repeatable), e.g. which build of
    /// mesh ran.
    #[arg(long)]
    note: Vec<String>,
    /// TrueType font for the plots' text (Debian: fonts-dejavu-core, in scripts/setup.sh).
    #[arg(
        long,
        default_value = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"
    )]
    font: PathBuf,
}

/// A line plot the page links to.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Plot {
    /// File name inside the image folder.
    pub(crate) file: String,
    pub(crate) title: String,
    pub(crate) x_label: String,
    pub(crate) y_label: String,
    /// One line per target: `(name, points)`.
    pub(crate) series: Vec<(String, Vec<(f64, f64)>)>,
}

/// One point of a concurrency sweep.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct SweepPoint {
    pub(crate) streams: f64,
    /// `[mesh, llama-server]` median generated tok/s over all streams.
    pub(crate) tok_s: [Option<f64>; 2],
    /// `[mesh, llama-server]` median TTFT p50 in ms.
    pub(crate) ttft_ms: [Option<f64>; 2],
}

/// The sweep of a decode run, in stream order.
pub(crate) fn sweep(decode: &Value) -> Vec<SweepPoint> {
    let mut points: Vec<SweepPoint> = decode["workloads"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|w| {
            let h = |t: usize, k: &str| w["targets"][TARGETS[t]]["headline"][k].as_f64();
            Some(SweepPoint {
                streams: w["streams"].as_f64()?,
                tok_s: [h(0, "total_tok_s"), h(1, "total_tok_s")],
                ttft_ms: [h(0, "ttft_p50_ms"), h(1, "ttft_p50_ms")],
            })
        })
        .collect();
    points.sort_by(|a, b| a.streams.total_cmp(&b.streams));
    points
}

/// Table rows of a decode run: per workload, throughput, per-request decode rate, TTFT and
/// inter-token latency medians, with the per-pair ratios the run recorded.
pub(crate) fn decode_rows(decode: &Value) -> Vec<Row> {
    let keys = [
        "total_tok_s",
        "decode_tok_s_p50",
        "ttft_p50_ms",
        "itl_p50_ms",
    ];
    let mut out = Vec::new();
    for w in decode["workloads"].as_array().into_iter().flatten() {
        for m in METRICS.iter().filter(|m| keys.contains(&m.key)) {
            let h = |t: usize| w["targets"][TARGETS[t]]["headline"][m.key].as_f64();
            out.push(Row {
                workload: w["name"].as_str().unwrap_or("?").to_owned(),
                label: m.label.to_owned(),
                mesh: h(0),
                llama: h(1),
                decimals: if m.better == Better::Higher { 1 } else { 2 },
                better: m.better,
                pair_ratios: w["pair_ratios_mesh_over_llama_server"][m.key]
                    .as_array()
                    .map(|a| a.iter().filter_map(Value::as_f64).collect())
                    .unwrap_or_default(),
            });
        }
    }
    out
}

fn series(
    points: &[SweepPoint],
    f: fn(&SweepPoint) -> [Option<f64>; 2],
) -> Vec<(String, Vec<(f64, f64)>)> {
    (0..2)
        .map(|t| {
            let pts = points
                .iter()
                .filter_map(|p| Some((p.streams, f(p)[t]?)))
                .collect();
            (TARGETS[t].to_owned(), pts)
        })
        .collect()
}

/// Model, threads and context of a run, one line.
fn settings_line(j: &Value) -> String {
    let st = &j["settings"];
    format!(
        "- model `{}` ({}, {:.2} MiB), tier `{}`; threads {}, {} slots, ctx {} per sequence, batch/ubatch {}; both servers on the same machine, started by the driver\n",
        j["model"]["path"].as_str().unwrap_or("?"),
        j["model"]["quantization"].as_str().unwrap_or("?"),
        j["model"]["bytes"].as_f64().unwrap_or(0.0) / (1 << 20) as f64,
        st["tier"].as_str().unwrap_or("?"),
        st["threads"],
        st["parallel"],
        st["ctx_per_sequence"],
        st["batch"],
    )
}

/// One sentence on contention: cores and what other processes took while measuring.
fn contention(j: &Value) -> String {
    let n = &j["other_processes_during_measured_batches"];
    format!(
        "The machine has {} cores shared with other work: while this run measured ({:.0} s), other processes used {:.2} cores on average ({:.0} CPU-s) and the hypervisor stole {:.1} s, so absolute times are noisy and the ratios of back-to-back pairs are the figures to read.",
        j["machine"]["nproc"],
        n["measured_wall_s"].as_f64().unwrap_or(0.0),
        n["others_cores"].as_f64().unwrap_or(0.0),
        n["others_cpu_s"].as_f64().unwrap_or(0.0),
        n["steal_s"].as_f64().unwrap_or(0.0),
    )
}

/// The page's markdown and the plots it links (under `img_rel`, relative to the page), from
/// `(path, json)` of each input.
pub(crate) fn page(
    inputs: &[(String, Value)],
    notes: &[String],
    img_rel: &str,
) -> Result<(String, Vec<Plot>)> {
    let mut md = String::from(
        "# Benchmarks: mesh vs llama-server\n\n\
         Generated by `mesh-bench report` from the result JSONs named below; rerun the commands \
         in each section and then the report command at the end to refresh it. The decode and \
         sessions runs start mesh \
         and llama.cpp's own `llama-server` side by side on the same GGUF with the same threads, \
         context, slots and batch size, alternate them after a warm-up, and report medians and \
         mesh / llama-server ratios (rules in `shared/MEASURING.md`); the fleet runs start a mesh \
         of N nodes and N llama-servers behind a load balancer in turn, on the same pinned cores. Ratios: above 1 means mesh \
         is higher; for latencies lower is better. Numbers come only from these runs, on the \
         machine each section names (CPU only).\n\n",
    );
    for n in notes {
        md.push_str(n);
        md.push_str("\n\n");
    }
    let mut plots = Vec::new();
    for (path, j) in inputs {
        match j["benchmark"].as_str() {
            Some("decode") => {
                let points = sweep(j);
                let stem = file_stem(path);
                md.push_str("## Decode: concurrency sweep\n\n");
                md.push_str(&format!(
                    "Closed-loop streams, each sending {} requests back to back per repetition; {} tokens per request (EOS ignored, temperature 0, streaming); distinct prompts of about {} tokens; {} repetitions per workload and target. Source: `{path}`.\n\n",
                    j["settings"]["rounds"], j["settings"]["max_tokens"],
                    j["checks"]["prompt_tokens"]["median"].as_f64().map_or("?".into(), |v| format!("{v:.0}")),
                    j["settings"]["reps"],
                ));
                if points.len() > 1 {
                    let ttft = Plot {
                        file: format!("{stem}-ttft.png"),
                        title: "TTFT p50 vs concurrent streams".into(),
                        x_label: "concurrent streams".into(),
                        y_label: "TTFT p50 (ms)".into(),
                        series: series(&points, |p| p.ttft_ms),
                    };
                    let tput = Plot {
                        file: format!("{stem}-throughput.png"),
                        title: "Generated tokens/s vs concurrent streams".into(),
                        x_label: "concurrent streams".into(),
                        y_label: "generated tok/s (all streams)".into(),
                        series: series(&points, |p| p.tok_s),
                    };
                    md.push_str(&format!(
                        "![{}]({img_rel}/{}) ![{}]({img_rel}/{})\n\n",
                        ttft.title, ttft.file, tput.title, tput.file
                    ));
                    plots.extend([ttft, tput]);
                }
                md.push_str(&report::table(&decode_rows(j)));
                md.push('\n');
                md.push_str(&contention(j));
                md.push_str("\n\n");
                md.push_str(&settings_line(j));
                md.push_str(&sidebyside::environment_markdown(j));
                md.push('\n');
            }
            Some("sessions") => {
                let st = &j["settings"];
                let stem = file_stem(path);
                md.push_str("## Multi-turn agent sessions\n\n");
                md.push_str(&format!(
                    "{} concurrent sessions × {} turns; turn n sends the whole conversation so far (system prompt with {} tool schemas, earlier user messages and the replies that server returned, a new user message), so each prompt extends the previous one. {} tokens per reply (EOS ignored, temperature 0), {} repetitions per target. mesh reuses the conversation from the KV kept in its slot (or its KV pages); llama-server from its slot prompt cache (`cache_prompt`). Source: `{path}`.\n\n",
                    st["sessions"], st["turns"], st["tools_per_session"], st["max_tokens"], st["reps"],
                ));
                let per_turn = |t: usize| -> Vec<(f64, f64)> {
                    j["summary"]["per_turn"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|p| {
                            Some((p["turn"].as_f64()?, p["ttft_ms_p50"][TARGETS[t]].as_f64()?))
                        })
                        .collect()
                };
                let plot = Plot {
                    file: format!("{stem}-ttft-per-turn.png"),
                    title: "TTFT p50 per turn of a session".into(),
                    x_label: "turn".into(),
                    y_label: "TTFT p50 (ms)".into(),
                    series: (0..2)
                        .map(|t| (TARGETS[t].to_owned(), per_turn(t)))
                        .collect(),
                };
                md.push_str(&format!("![{}]({img_rel}/{})\n\n", plot.title, plot.file));
                plots.push(plot);
                md.push_str(&report::table(&crate::sessions::rows(&j["summary"])));
                let c = &j["checks"];
                md.push_str(&format!(
                    "\nNot evaluated: mesh = prompt tokens restored from KV pages or reused in place from a slot's kept KV or copied from a running sequence's (`mesh_kv_recompute_avoided_tokens_total` + `mesh_kv_resident_tokens_total` + `mesh_kv_device_copy_tokens_total`); llama-server = prompt tokens reused from its slot prompt cache (`llamacpp:prompt_tokens_cached_total`, equal to the prompt tokens sent minus `llamacpp:prompt_tokens_total`, the tokens it evaluated). {} of {} turn prompts were identical on both targets (they differ once the two servers' greedy replies differ).\n\n",
                    c["identical_prompts"], c["turns_compared"],
                ));
                md.push_str(&contention(j));
                md.push_str("\n\n");
                md.push_str(&settings_line(j));
                md.push_str(&sidebyside::environment_markdown(j));
                md.push('\n');
            }
            Some("fleet") => {
                let (section, plot) = crate::fleet::section(j, path, &file_stem(path));
                if let Some(plot) = plot {
                    md.push_str(&format!("![{}]({img_rel}/{})\n\n", plot.title, plot.file));
                    plots.push(plot);
                }
                md.push_str(&section);
            }
            other => bail!(
                "{path}: benchmark {other:?} is not one the report tabulates (decode, sessions, fleet)"
            ),
        }
    }
    let mut argv: Vec<&str> = vec!["target/release/mesh-bench", "report"];
    argv.extend(inputs.iter().map(|(p, _)| p.as_str()));
    argv.extend(["--out", "docs/benchmarks.md", "--img-dir", "docs/img"]);
    for n in notes {
        argv.extend(["--note", n.as_str()]);
    }
    md.push_str(&format!(
        "## Regenerating this page\n\n```sh\n{}\n```\n",
        sidebyside::shell_join(&serde_json::json!(argv))
    ));
    Ok((md, plots))
}

fn file_stem(path: &str) -> String {
    Path::new(path)
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "run".into())
}

/// Registers `font` as plotters' `sans-serif`. The bytes live for the rest of the process.
fn register_font(font: &Path) -> Result<()> {
    let bytes = std::fs::read(font).with_context(|| {
        format!(
            "reading the plot font {} (install fonts-dejavu-core: scripts/setup.sh, or pass --font)",
            font.display()
        )
    })?;
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| anyhow::anyhow!("{} is not a TrueType/OpenType font", font.display()))
}

/// Draws `plot` as a PNG at `path`: one line with markers per target, y from 0.
fn draw(plot: &Plot, path: &Path) -> Result<()> {
    let xs = plot.series.iter().flat_map(|(_, p)| p.iter().map(|q| q.0));
    let ys = plot.series.iter().flat_map(|(_, p)| p.iter().map(|q| q.1));
    let (x0, x1) = xs.fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
    let y1 = ys.fold(0.0_f64, f64::max);
    if x0 > x1 {
        bail!("{}: no points", plot.file);
    }
    let pad = ((x1 - x0) * 0.05).max(0.2);
    let root = BitMapBackend::new(path, (640, 380)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("drawing {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(&plot.title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(42)
        .y_label_area_size(64)
        .build_cartesian_2d((x0 - pad)..(x1 + pad), 0.0..(y1 * 1.15).max(1e-9))
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc(&plot.x_label)
        .y_desc(&plot.y_label)
        .x_labels(((x1 - x0) as usize + 1).clamp(2, 12))
        .x_label_formatter(&|x| {
            // Whole numbers only: stream counts and turn numbers.
            if (x - x.round()).abs() < 1e-6 {
                format!("{x:.0}")
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|y| format!("{y:.0}"))
        .light_line_style(WHITE)
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 16))
        .draw()
        .map_err(|e| err(&e))?;
    let colors = [
        RGBColor(0x1f, 0x77, 0xb4),
        RGBColor(0xd6, 0x27, 0x28),
        RGBColor(0x2c, 0xa0, 0x2c),
        RGBColor(0x94, 0x67, 0xbd),
    ];
    if plot.series.len() > colors.len() {
        bail!(
            "{}: {} lines, at most {} can be drawn",
            plot.file,
            plot.series.len(),
            colors.len()
        );
    }
    for ((name, points), color) in plot.series.iter().zip(colors) {
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|e| err(&e))?
            .label(name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))
            .map_err(|e| err(&e))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 15))
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// Writes the page and its plots.
pub(crate) fn run(a: ReportArgs) -> Result<()> {
    let mut inputs = Vec::new();
    for p in &a.inputs {
        let text =
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        let j: Value =
            serde_json::from_str(&text).with_context(|| format!("{} is not JSON", p.display()))?;
        inputs.push((p.display().to_string(), j));
    }
    let page_dir = a.out.parent().unwrap_or(Path::new("."));
    let img_rel = relative(&a.img_dir, page_dir);
    let (md, plots) = page(&inputs, &a.note, &img_rel)?;
    if !plots.is_empty() {
        register_font(&a.font)?;
        std::fs::create_dir_all(&a.img_dir)
            .with_context(|| format!("creating {}", a.img_dir.display()))?;
    }
    for plot in &plots {
        let path = a.img_dir.join(&plot.file);
        draw(plot, &path)?;
        println!("wrote {}", path.display());
    }
    if !page_dir.as_os_str().is_empty() {
        std::fs::create_dir_all(page_dir)?;
    }
    std::fs::write(&a.out, md).with_context(|| format!("writing {}", a.out.display()))?;
    println!("wrote {}", a.out.display());
    Ok(())
}

/// `img` relative to `page_dir` when it lies below it, else `img` as given.
fn relative(img: &Path, page_dir: &Path) -> String {
    img.strip_prefix(page_dir)
        .unwrap_or(img)
        .display()
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn workload(streams: u64, mesh: (f64, f64), llama: (f64, f64)) -> Value {
        let h = |(tok_s, ttft): (f64, f64)| {
            json!({"headline": {"total_tok_s": tok_s, "decode_tok_s_p50": tok_s / streams as f64,
                                 "ttft_p50_ms": ttft, "ttft_p95_ms": ttft * 2.0, "itl_p50_ms": 10.0}})
        };
        json!({
            "name": if streams == 1 { "1 stream".to_owned() } else { format!("{streams} streams") },
            "streams": streams,
            "targets": {"mesh": h(mesh), "llama-server": h(llama)},
            "pair_ratios_mesh_over_llama_server": {"total_tok_s": [mesh.0 / llama.0]},
        })
    }

    fn run_json(benchmark: &str) -> Value {
        json!({
            "benchmark": benchmark,
            "command_line": ["target/release/mesh-bench", benchmark, "--streams", "1,2"],
            "machine": {"cpu_model": "Test CPU", "nproc": 2, "mem_total_kib": 8388608,
                        "loadavg_start": "1.00 0.50 0.25 1/100 1", "loadavg_end": "2.00 1.00 0.50 1/100 1"},
            "model": {"path": "models/t1-q8_0.gguf", "quantization": "Q8_0", "bytes": 3259200},
            "settings": {"tier": "t1", "threads": 1, "parallel": 8, "ctx_per_sequence": 2048, "batch": 512,
                         "rounds": 2, "max_tokens": 32, "reps": 3, "sessions": 2, "turns": 2,
                         "tools_per_session": 4},
            "checks": {"prompt_tokens": {"median": 400.0}, "identical_prompts": 5, "turns_compared": 6},
            "other_processes_during_measured_batches": {"measured_wall_s": 100.0, "others_cpu_s": 35.0,
                                                        "others_cores": 0.35, "steal_s": 0.0},
            "targets": {"mesh": {"argv": ["target/release/mesh", "up", "--port", "1"]},
                        "llama-server": {"argv": ["llama-server", "-m", "x.gguf"], "version": "version: 1 (abc)"}},
        })
    }

    #[test]
    fn decode_sweep_gives_tables_ratios_and_two_plots() {
        let mut j = run_json("decode");
        j["workloads"] = json!([
            workload(2, (150.0, 40.0), (100.0, 50.0)),
            workload(1, (90.0, 20.0), (100.0, 20.0)),
        ]);
        let pts = sweep(&j);
        assert_eq!(
            pts.iter().map(|p| p.streams).collect::<Vec<_>>(),
            vec![1.0, 2.0]
        );
        assert_eq!(pts[1].tok_s, [Some(150.0), Some(100.0)]);
        let (md, plots) = page(
            &[("bench-results/decode.json".into(), j)],
            &["A note.".into()],
            "img",
        )
        .unwrap();
        assert_eq!(plots.len(), 2);
        assert_eq!(plots[0].file, "decode-ttft.png");
        assert_eq!(
            plots[1].series[0],
            ("mesh".to_owned(), vec![(1.0, 90.0), (2.0, 150.0)])
        );
        assert!(md.contains("![TTFT p50 vs concurrent streams](img/decode-ttft.png)"));
        assert!(md.contains(
            "| 2 streams | generated tok/s (all streams) | higher | 150.0 | 100.0 | 1.500 | 1.50 |"
        ));
        assert!(md.contains("| 2 streams | TTFT p50 (ms) | lower | 40.00 | 50.00 | 0.800 | – |"));
        assert!(md.contains(
            "| 1 stream | generated tok/s (all streams) | higher | 90.0 | 100.0 | 0.900 |"
        ));
        assert!(md.contains("distinct prompts of about 400 tokens"));
        assert!(md.contains("2 cores shared with other work"));
        assert!(md.contains("other processes used 0.35 cores on average (35 CPU-s)"));
        assert!(md.contains("- machine: Test CPU (nproc 2), 8.0 GiB"));
        assert!(md.contains("- command: `target/release/mesh-bench decode --streams 1,2`"));
        assert!(md.contains("- mesh: `target/release/mesh up --port 1`"));
        assert!(md.contains("llama-server: version: 1 (abc)"));
        assert!(md.contains("\n\nA note.\n\n## Decode"));
        assert!(md.contains("mesh-bench report bench-results/decode.json --out docs/benchmarks.md --img-dir docs/img --note 'A note.'\n"));
    }

    #[test]
    fn sessions_section_tabulates_turns_and_plots_ttft_per_turn() {
        let mut j = run_json("sessions");
        let pair = |m: f64, l: f64| json!({"mesh": m, "llama-server": l, "ratio": m / l});
        j["summary"] = json!({
            "per_turn": [
                {"turn": 1, "ttft_ms_p50": pair(100.0, 100.0), "prompt_tokens_p50": pair(400.0, 400.0)},
                {"turn": 2, "ttft_ms_p50": pair(30.0, 60.0), "prompt_tokens_p50": pair(470.0, 470.0)},
            ],
            "session_batch_wall_s": pair(3.0, 4.0),
            "ttft_ms_p50_all_turns": pair(50.0, 80.0),
            "prompt_tokens_per_rep": pair(1740.0, 1740.0),
            "reused_fraction": pair(0.4, 0.2),
        });
        let (md, plots) = page(&[("b/sessions.json".into(), j)], &[], "img").unwrap();
        assert_eq!(plots.len(), 1);
        assert_eq!(plots[0].series[1].1, vec![(1.0, 100.0), (2.0, 60.0)]);
        assert!(md.contains("## Multi-turn agent sessions"));
        assert!(md.contains("| turn 2 | TTFT p50 (ms) | lower | 30.0 | 60.0 | 0.500 | – |"));
        assert!(md.contains("| all turns | share of prompt tokens not evaluated (cache) | higher | 0.400 | 0.200 | 2.000 | – |"));
        assert!(md.contains("5 of 6 turn prompts were identical"));
    }

    #[test]
    fn unknown_benchmarks_are_refused() {
        assert!(page(
            &[("x.json".into(), json!({"benchmark": "fabric"}))],
            &[],
            "img"
        )
        .is_err());
    }

    #[test]
    fn image_links_are_relative_to_the_page() {
        assert_eq!(relative(Path::new("docs/img"), Path::new("docs")), "img");
        assert_eq!(
            relative(Path::new("/tmp/img"), Path::new("docs")),
            "/tmp/img"
        );
    }
}
