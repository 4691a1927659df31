//! `mesh-bench transport`: the mesh wire against plain TCP on loopback, and the
//! gateway's forwarding cost.
//!
//! 1. Round trip: a 64-byte request and its echo, one at a time. Mesh: a fresh QUIC
//!    bidirectional stream per call with mutual TLS already established, rkyv frames (what
//!    every remote call does). TCP: one connection, the same frames written and read in turn.
//! 2. Bulk: `--bulk-mib` MiB in 1 MiB frames on one stream / one TCP connection.
//! 3. Forwarding: the same one-token chat request to a node hosting t1, and to a
//!    gateway-only node that forwards it to that node over QUIC (two `mesh join` processes).
//!
//! Both sides of 1 and 2 run in this process on one thread, so the ratio compares protocol
//! stacks, not scheduling. Loopback hides network latency: the figures are the protocol's own
//! CPU cost.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use mesh_actors::wire::{Reply, Request};
use mesh_transport::frame::{read_frame, write_frame};
use mesh_transport::{Endpoint, Identity, IdentityPaths};
use serde_json::{json, Value};
use tokio::io::AsyncBufReadExt;
use tokio::net::{TcpListener, TcpStream};

use crate::stats::Percentiles;

/// Options of `mesh-bench transport`.
#[derive(clap::Args, Debug)]
pub(crate) struct TransportArgs {
    /// Sequential round trips per protocol.
    #[arg(long, default_value_t = 2000)]
    pings: usize,
    /// MiB moved in the bulk test.
    #[arg(long, default_value_t = 256)]
    bulk_mib: usize,
    /// Requests in the forwarding test (0 skips it).
    #[arg(long, default_value_t = 200)]
    forward_requests: usize,
    /// The mesh binary for the forwarding test.
    #[arg(long, default_value = "target/release/mesh")]
    mesh_bin: PathBuf,
    /// Write the JSON report here.
    #[arg(long)]
    out: Option<PathBuf>,
}

const MAX: usize = 2 << 20;

fn ping(n: usize) -> Request {
    Request::Ping {
        nonce: n as u64,
        payload: vec![7u8; 64],
    }
}

async fn quic_pair(dir: &std::path::Path) -> anyhow::Result<(Endpoint, Endpoint)> {
    mesh_transport::tls::init_ca(dir, "bench")?;
    let mut eps = vec![];
    for n in ["server", "client"] {
        let id = Identity::load(&mesh_transport::tls::issue(dir, n)?)?;
        eps.push(Endpoint::bind(
            &id,
            "127.0.0.1:0".parse()?,
            &Default::default(),
        )?);
    }
    let client = eps.pop().expect("two");
    let server = eps.pop().expect("two");
    let _ = IdentityPaths::in_dir(dir, "server");
    Ok((server, client))
}

async fn echo(send: &mut quinn::SendStream, recv: &mut quinn::RecvStream) {
    while let Ok(Some(req)) = read_frame::<Request, _>(recv, MAX).await {
        if let Request::Ping { nonce, payload } = req {
            if write_frame(send, &Reply::Pong { nonce, payload })
                .await
                .is_err()
            {
                return;
            }
        }
    }
}

async fn quic_bench(a: &TransportArgs) -> anyhow::Result<(Vec<f64>, f64)> {
    let dir = tempdir()?;
    let (server, client) = quic_pair(&dir).await?;
    let addr = server.local_addr()?;
    tokio::spawn(async move {
        while let Some(pc) = server.accept().await {
            tokio::spawn(async move {
                while let Ok((mut s, mut r)) = pc.conn.accept_bi().await {
                    tokio::spawn(async move {
                        echo(&mut s, &mut r).await;
                        let _ = s.finish();
                    });
                }
            });
        }
    });
    let pc = client.connect(addr).await?;
    let mut rtt = vec![];
    for i in 0..a.pings + 100 {
        let t = Instant::now();
        let (mut s, mut r) = pc.conn.open_bi().await?;
        write_frame(&mut s, &ping(i)).await?;
        s.finish()?;
        let reply = read_frame::<Reply, _>(&mut r, MAX).await?;
        anyhow::ensure!(matches!(reply, Some(Reply::Pong { .. })), "bad echo");
        if i >= 100 {
            rtt.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    // Bulk: one stream, frames echoed back as a 1-byte-payload ack at the end.
    let (mut s, mut r) = pc.conn.open_bi().await?;
    let chunk = Request::Ping {
        nonce: 0,
        payload: vec![1u8; 1 << 20],
    };
    let t = Instant::now();
    let reader = tokio::spawn(async move {
        let mut n = 0usize;
        while let Ok(Some(_)) = read_frame::<Reply, _>(&mut r, MAX).await {
            n += 1;
        }
        n
    });
    for _ in 0..a.bulk_mib {
        write_frame(&mut s, &chunk).await?;
    }
    s.finish()?;
    let n = reader.await?;
    anyhow::ensure!(n == a.bulk_mib, "bulk echo lost frames ({n})");
    let mib_s = (2 * a.bulk_mib) as f64 / t.elapsed().as_secs_f64();
    Ok((rtt, mib_s))
}

async fn tcp_bench(a: &TransportArgs) -> anyhow::Result<(Vec<f64>, f64)> {
    let l = TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    tokio::spawn(async move {
        while let Ok((sock, _)) = l.accept().await {
            sock.set_nodelay(true).ok();
            tokio::spawn(async move {
                let (mut r, mut w) = sock.into_split();
                while let Ok(Some(Request::Ping { nonce, payload })) =
                    read_frame::<Request, _>(&mut r, MAX).await
                {
                    if write_frame(&mut w, &Reply::Pong { nonce, payload })
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    let sock = TcpStream::connect(addr).await?;
    sock.set_nodelay(true)?;
    let (mut r, mut w) = sock.into_split();
    let mut rtt = vec![];
    for i in 0..a.pings + 100 {
        let t = Instant::now();
        write_frame(&mut w, &ping(i)).await?;
        let reply = read_frame::<Reply, _>(&mut r, MAX).await?;
        anyhow::ensure!(matches!(reply, Some(Reply::Pong { .. })), "bad echo");
        if i >= 100 {
            rtt.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    let chunk = Request::Ping {
        nonce: 0,
        payload: vec![1u8; 1 << 20],
    };
    let t = Instant::now();
    let bulk = a.bulk_mib;
    let reader = tokio::spawn(async move {
        let mut n = 0usize;
        while n < bulk {
            match read_frame::<Reply, _>(&mut r, MAX).await {
                Ok(Some(_)) => n += 1,
                _ => break,
            }
        }
        n
    });
    for _ in 0..a.bulk_mib {
        write_frame(&mut w, &chunk).await?;
    }
    let n = reader.await?;
    anyhow::ensure!(n == a.bulk_mib, "bulk echo lost frames ({n})");
    let mib_s = (2 * a.bulk_mib) as f64 / t.elapsed().as_secs_f64();
    Ok((rtt, mib_s))
}

fn tempdir() -> anyhow::Result<PathBuf> {
    let d = std::env::temp_dir().join(format!(
        "mesh-bench-{}-{}",
        std::process::id(),
        rand_suffix()
    ));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

struct Child(tokio::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.start_kill();
    }
}

async fn start_node(
    bin: &PathBuf,
    certs: &std::path::Path,
    name: &str,
    tiers: &str,
    seed: Option<&str>,
) -> anyhow::Result<(Child, String, String)> {
    let mut cmd = tokio::process::Command::new(bin);
    cmd.args([
        "join",
        "--name",
        name,
        "--quic",
        "127.0.0.1:0",
        "--port",
        "0",
        "--tiers",
        tiers,
        "--threads",
        "1",
        "--ctx",
        "4096",
        "--parallel",
        "4",
        "--cert-dir",
    ])
    .arg(certs)
    .stdout(Stdio::piped())
    .stderr(Stdio::null())
    .kill_on_drop(true);
    if let Some(s) = seed {
        cmd.args(["--seeds", s]);
    }
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let mut lines = tokio::io::BufReader::new(child.stdout.take().context("stdout")?).lines();
    let mut quic = String::new();
    while let Some(line) = lines.next_line().await? {
        if let Some(q) = line.split(" quic on ").nth(1) {
            quic = q.to_owned();
        }
        if let Some(url) = line.strip_prefix("mesh listening on ") {
            tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
            return Ok((Child(child), url.to_owned(), quic));
        }
    }
    anyhow::bail!("{name} exited before listening")
}

async fn forward_bench(a: &TransportArgs) -> anyhow::Result<Value> {
    let dir = tempdir()?;
    let certs = dir.join("certs");
    mesh_transport::tls::init_ca(&certs, "bench")?;
    for n in ["host", "fwd"] {
        mesh_transport::tls::issue(&certs, n)?;
    }
    let (_h, host, quic) = start_node(&a.mesh_bin, &certs, "host", "t1", None).await?;
    let (_f, fwd, _) = start_node(&a.mesh_bin, &certs, "fwd", "none", Some(&quic)).await?;
    let http = reqwest::Client::new();
    // Wait until the forwarding node sees t1.
    for _ in 0..100 {
        let v: Value = http
            .get(format!("{fwd}/v1/models"))
            .send()
            .await?
            .json()
            .await?;
        if v["data"]
            .as_array()
            .is_some_and(|d| d.iter().any(|m| m["id"] == "t1"))
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let body = json!({"model": "t1", "messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
        "max_tokens": 1, "temperature": 0});
    let mut lat = [vec![], vec![]];
    for i in 0..a.forward_requests + 20 {
        for (k, base) in [&host, &fwd].into_iter().enumerate() {
            let t = Instant::now();
            let r = http
                .post(format!("{base}/v1/chat/completions"))
                .json(&body)
                .send()
                .await?;
            anyhow::ensure!(r.status().is_success(), "{base}: {}", r.status());
            let _: Value = r.json().await?;
            if i >= 20 {
                lat[k].push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let (l, f) = (Percentiles::of(&lat[0]), Percentiles::of(&lat[1]));
    Ok(json!({
        "requests": a.forward_requests,
        "local_ms": l, "forwarded_ms": f,
        "added_p50_ms": f.p50.zip(l.p50).map(|(f, l)| f - l),
        "ratio_p50": f.p50.zip(l.p50).map(|(f, l)| f / l),
    }))
}

pub(crate) async fn run(a: TransportArgs) -> anyhow::Result<()> {
    mesh_transport::tls::install_crypto_provider();
    let (q_rtt, q_bulk) = quic_bench(&a).await?;
    let (t_rtt, t_bulk) = tcp_bench(&a).await?;
    let (q, t) = (Percentiles::of(&q_rtt), Percentiles::of(&t_rtt));
    let forward = if a.forward_requests > 0 && a.mesh_bin.exists() {
        forward_bench(&a).await?
    } else {
        json!("not measured (no mesh binary or --forward-requests 0)")
    };
    let report = json!({
        "machine": crate::machine::machine(),
        "round_trip_us": {"mesh_quic": q, "tcp": t, "ratio_p50": q.p50.zip(t.p50).map(|(q, t)| q / t)},
        "bulk_mib_s": {"mesh_quic": q_bulk, "tcp": t_bulk, "ratio": q_bulk / t_bulk},
        "forwarding": forward,
    });
    let f = |x: Option<f64>| x.map(|v| format!("{v:.1}")).unwrap_or_else(|| "-".into());
    println!("| measure | mesh (QUIC+mTLS, rkyv) | plain TCP | ratio |");
    println!("|---|---|---|---|");
    println!(
        "| round trip p50 (µs) | {} | {} | {} |",
        f(q.p50),
        f(t.p50),
        f(q.p50.zip(t.p50).map(|(q, t)| q / t))
    );
    println!(
        "| round trip p99 (µs) | {} | {} | {} |",
        f(q.p99),
        f(t.p99),
        f(q.p99.zip(t.p99).map(|(q, t)| q / t))
    );
    println!(
        "| bulk (MiB/s, echo) | {q_bulk:.0} | {t_bulk:.0} | {:.2} |",
        q_bulk / t_bulk
    );
    if let Some(fw) = forward.as_object() {
        println!("\nforwarding (1-token chat, {} requests): local p50 {} ms, forwarded p50 {} ms, added {} ms",
            a.forward_requests, f(fw["local_ms"]["p50"].as_f64()), f(fw["forwarded_ms"]["p50"].as_f64()), f(fw["added_p50_ms"].as_f64()));
    }
    if let Some(out) = &a.out {
        if let Some(p) = out.parent() {
            std::fs::create_dir_all(p)?;
        }
        std::fs::write(out, serde_json::to_string_pretty(&report)?)?;
        println!("wrote {}", out.display());
    }
    Ok(())
}
