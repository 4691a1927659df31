//! Prefix KV pages on the bundled t1: a restored prefix continues exactly like a
//! fresh prefill (greedy), identical prefixes are stored once, corrupt pages are
//! refused, pages on disk survive a restart, an unwritable disk degrades to RAM.
//! And KV kept in a slot after a request: the next turn of a conversation reuses it in
//! place with the same tokens as a fresh prefill, only within its cache scope.

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use mesh_tiers::chat::{self, ChatMessage, Role, ToolSpec};
use mesh_tiers::{Engine, EngineConfig, GenerateRequest, KvPagesConfig, TokenEvent};

fn model() -> std::path::PathBuf {
    std::path::PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../models/t1-q8_0.gguf"
    ))
}

fn engine(block: usize, disk: Option<std::path::PathBuf>, n_seq_max: u32) -> Engine {
    Engine::start(EngineConfig {
        name: "t1".into(),
        model: model(),
        n_ctx: 4096 * n_seq_max,
        n_seq_max,
        n_batch: 1024,
        prefill_chunk: 512,
        threads: 2,
        // These tests are about pages: a slot's kept KV would serve repeats in place.
        keep_resident: false,
        kv_pages: KvPagesConfig {
            block,
            ram_bytes: 64 << 20,
            disk_bytes: if disk.is_some() { 64 << 20 } else { 0 },
            disk_dir: disk,
            ..KvPagesConfig::default()
        },
        ..EngineConfig::default()
    })
    .expect("engine starts")
}

/// Agent prompts sharing a system prompt and tool schemas (~400 tokens), with distinct questions.
fn prompts(e: &Engine) -> Vec<Vec<i32>> {
    let catalog: Vec<serde_json::Value> = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../models/fixtures/catalog.jsonl"
    ))
    .unwrap()
    .lines()
    .map(|l| serde_json::from_str(l).unwrap())
    .collect();
    let tools: Vec<ToolSpec> = catalog
        .iter()
        .filter(|t| t["domain"] == "weather")
        .take(6)
        .map(|t| ToolSpec {
            name: t["name"].as_str().unwrap().into(),
            description: t["description"].as_str().unwrap().into(),
            parameters: t["parameters"].clone(),
        })
        .collect();
    [
        "Oslo",
        "Lima",
        "Tokyo on 2026-04-02",
        "Cairo in Fahrenheit",
        "Quito",
        "Perth",
    ]
    .iter()
    .map(|c| {
        let msgs = [
            ChatMessage::text(
                Role::System,
                "You are a careful assistant for a travel desk. Use the tools when they fit.",
            ),
            ChatMessage::text(Role::User, format!("What is the weather forecast for {c}?")),
        ];
        e.tokenize(&chat::render_prompt(&msgs, &tools))
    })
    .collect()
}

async fn run(e: &Engine, prompt: &[i32]) -> Vec<i32> {
    run_in(e, prompt, "").await
}

async fn run_in(e: &Engine, prompt: &[i32], scope: &str) -> Vec<i32> {
    let mut rx = e
        .submit(GenerateRequest {
            prompt: prompt.to_vec(),
            max_tokens: 48,
            ignore_eos: true,
            cache_scope: scope.into(),
            ..Default::default()
        })
        .unwrap();
    let mut out = vec![];
    while let Some(ev) = tokio::time::timeout(Duration::from_secs(120), rx.recv())
        .await
        .expect("no stall")
    {
        match ev {
            TokenEvent::Token { id, .. } => out.push(id),
            TokenEvent::Done { .. } => break,
            TokenEvent::Error(e) => panic!("{e}"),
            TokenEvent::Started { .. } => {}
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restored_prefixes_continue_exactly() {
    let fresh = engine(0, None, 4);
    assert!(fresh.pages().is_none());
    let ps = prompts(&fresh);
    assert!(ps[0].len() > 200, "prompt of {} tokens", ps[0].len());
    let mut want = vec![];
    for p in &ps {
        want.push(run(&fresh, p).await);
    }
    drop(fresh);

    for block in [16, 64] {
        let e = engine(block, None, 4);
        let pages = e.pages().expect("paging on").clone();
        // First prompt: nothing cached; then the same prompt again: all but the tail restored.
        assert_eq!(run(&e, &ps[0]).await, want[0], "block {block}: cold");
        assert_eq!(
            run(&e, &ps[0]).await,
            want[0],
            "block {block}: full-prefix restore"
        );
        let reused_one = pages.reuse.tokens_reused.load(Relaxed) as usize;
        assert_eq!(reused_one, (ps[0].len() - 1) / block * block);
        // The rest concurrently, each restoring the shared prefix while others run in the batch.
        let futs: Vec<_> = ps[1..].iter().map(|p| run(&e, p)).collect();
        let got = futures::future::join_all(futs).await;
        for (i, g) in got.iter().enumerate() {
            assert_eq!(
                g,
                &want[i + 1],
                "block {block}: prompt {} after restore",
                i + 1
            );
        }
        let r = &pages.reuse;
        assert!(
            r.hits.load(Relaxed) >= ps.len() as u64 - 1,
            "hits {}",
            r.hits.load(Relaxed)
        );
        assert_eq!(r.restore_failures.load(Relaxed), 0);
        // The shared prefix is stored once: later prompts deduplicated what they shared.
        let st = pages.store.stats();
        assert!(
            st.dedup_pages.load(Relaxed) > 0 || r.tokens_reused.load(Relaxed) > reused_one as u64
        );
        // Pages are chained: one page per distinct block-aligned prefix, however many
        // prompts share it.
        let distinct_prefixes: usize = {
            let mut ids = std::collections::HashSet::new();
            for p in &ps {
                for k in 1..=p.len() / block {
                    ids.insert(p[..k * block].to_vec());
                }
            }
            ids.len()
        };
        let total_blocks: usize = ps.iter().map(|p| p.len() / block).sum();
        assert_eq!(st.pages_ram.load(Relaxed) as usize, distinct_prefixes);
        assert!(distinct_prefixes < total_blocks, "prompts share a prefix");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_pages_survive_restart_and_corruption_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("pages");
    let e = engine(32, Some(disk.clone()), 2);
    let ps = prompts(&e);
    let want0 = run(&e, &ps[0]).await;
    let want1 = run(&e, &ps[1]).await;
    let published = e.pages().unwrap().reuse.published.load(Relaxed);
    assert!(published > 0);
    drop(e); // flushes the disk writer
    let files: Vec<_> = std::fs::read_dir(&disk)
        .unwrap()
        .flatten()
        .map(|f| f.path())
        .collect();
    assert_eq!(files.len() as u64, published);

    // Restart: prompt 1's prefix comes from disk, tokens unchanged.
    let e = engine(32, Some(disk.clone()), 2);
    assert_eq!(run(&e, &ps[1]).await, want1);
    let p = e.pages().unwrap();
    assert!(
        p.store.stats().hits_disk.load(Relaxed) > 0,
        "restart reused disk pages"
    );
    assert!(p.reuse.tokens_reused.load(Relaxed) > 0);
    drop(e);

    // Damage every page on disk: all refused, prefix recomputed, output unchanged.
    for f in std::fs::read_dir(&disk).unwrap().flatten() {
        let mut b = std::fs::read(f.path()).unwrap();
        let n = b.len();
        b[n / 2] ^= 0x5A;
        std::fs::write(f.path(), b).unwrap();
    }
    let e = engine(32, Some(disk.clone()), 2);
    assert_eq!(run(&e, &ps[0]).await, want0);
    let p = e.pages().unwrap();
    assert!(p.store.stats().corrupt.load(Relaxed) >= 1);
    assert_eq!(p.reuse.hits.load(Relaxed), 0, "no corrupt page restored");
    drop(e);

    // A disk folder that cannot be created: RAM only, still serving and reusing.
    let blocker = dir.path().join("file");
    std::fs::write(&blocker, b"x").unwrap();
    let e = engine(32, Some(blocker.join("pages")), 2);
    assert_eq!(run(&e, &ps[0]).await, want0);
    assert_eq!(run(&e, &ps[0]).await, want0);
    let p = e.pages().unwrap();
    assert_eq!(p.store.stats().disk_degraded.load(Relaxed), 1);
    assert!(p.reuse.hits.load(Relaxed) >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_kv_serves_the_next_turn_in_place() {
    let fresh = engine(0, None, 2);
    let ps = prompts(&fresh);
    // Two conversations: turn 1, then turn 2 = turn 1's prompt + its answer + a follow-up.
    let follow = fresh.tokenize("<|end|><|user|>And tomorrow?<|end|><|assistant|>");
    let mut turn1 = vec![];
    let mut turn2 = vec![];
    for p in &ps[..2] {
        let a = run(&fresh, p).await;
        let mut next = p.clone();
        next.extend(&a);
        next.extend(&follow);
        turn2.push(run(&fresh, &next).await);
        turn1.push((p.clone(), a, next));
    }
    drop(fresh);

    let e = Engine::start(EngineConfig {
        name: "t1".into(),
        model: model(),
        n_ctx: 4096 * 2,
        n_seq_max: 2,
        threads: 2,
        kv_pages: KvPagesConfig {
            block: 0,
            ..KvPagesConfig::default()
        },
        ..EngineConfig::default()
    })
    .unwrap();
    let stats = e.stats().clone();
    // Both first turns at once (one per slot), then both second turns at once: each
    // finds its own conversation kept in a slot.
    let firsts: Vec<_> = turn1.iter().map(|(p, _, _)| run(&e, p)).collect();
    for (got, (_, a, _)) in futures::future::join_all(firsts).await.iter().zip(&turn1) {
        assert_eq!(got, a, "turn 1");
    }
    assert_eq!(stats.resident_hits.load(Relaxed), 0);
    let seconds: Vec<_> = turn1.iter().map(|(_, _, next)| run(&e, next)).collect();
    let got = futures::future::join_all(seconds).await;
    assert_eq!(got, turn2, "turn 2 from kept KV equals a fresh prefill");
    assert_eq!(stats.resident_hits.load(Relaxed), 2);
    // Each kept its prompt and all of its answer but the last token.
    let kept: usize = turn1.iter().map(|(p, a, _)| p.len() + a.len() - 1).sum();
    assert_eq!(stats.resident_tokens.load(Relaxed) as usize, kept);

    // Another cache scope (another tool-access set) never reuses what this one left.
    let before = stats.prompt_tokens.load(Relaxed);
    assert_eq!(run_in(&e, &turn1[0].2, "other-tools").await, turn2[0]);
    assert_eq!(stats.resident_hits.load(Relaxed), 2);
    assert_eq!(
        (stats.prompt_tokens.load(Relaxed) - before) as usize,
        turn1[0].2.len(),
        "prefilled from scratch"
    );
}

fn submit(
    e: &Engine,
    prompt: &[i32],
    max_tokens: usize,
) -> tokio::sync::mpsc::UnboundedReceiver<TokenEvent> {
    e.submit(GenerateRequest {
        prompt: prompt.to_vec(),
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    })
    .unwrap()
}

/// Token ids until `Done`; stops after the first token when `first_only`.
async fn tokens(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<TokenEvent>,
    first_only: bool,
) -> Vec<i32> {
    let mut out = vec![];
    while let Some(ev) = tokio::time::timeout(Duration::from_secs(120), rx.recv())
        .await
        .expect("no stall")
    {
        match ev {
            TokenEvent::Token { id, .. } => {
                out.push(id);
                if first_only {
                    break;
                }
            }
            TokenEvent::Done { .. } => break,
            TokenEvent::Error(e) => panic!("{e}"),
            TokenEvent::Started { .. } => {}
        }
    }
    out
}

/// Two agents' prompts sharing a system prompt and tool schemas, each run alone on a fresh
/// engine without kept KV: (prompts, greedy tokens, shared prefix length).
async fn two_agents(long: usize) -> (Vec<Vec<i32>>, Vec<Vec<i32>>, usize) {
    let fresh = Engine::start(EngineConfig {
        keep_resident: false,
        ..device_level_config(0)
    })
    .unwrap();
    let ps: Vec<Vec<i32>> = prompts(&fresh)[1..3].to_vec();
    let mut want = vec![];
    for (p, n) in ps.iter().zip([long, 48]) {
        want.push(tokens(&mut submit(&fresh, p, n), false).await);
    }
    let shared = ps[0].iter().zip(&ps[1]).take_while(|(a, b)| a == b).count();
    (ps, want, shared)
}

fn device_level_config(block: usize) -> EngineConfig {
    EngineConfig {
        name: "t1".into(),
        model: model(),
        n_ctx: 4096 * 2,
        n_seq_max: 2,
        n_batch: 1024,
        prefill_chunk: 512,
        threads: 2,
        kv_pages: KvPagesConfig {
            block,
            ram_bytes: 64 << 20,
            ..KvPagesConfig::default()
        },
        ..EngineConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_sequences_prefix_is_copied_on_the_device_with_equal_tokens() {
    let (ps, want, shared) = two_agents(400).await;
    assert!(shared > 200, "prompts share {shared} tokens");
    let e = Engine::start(device_level_config(0)).unwrap();
    let stats = e.stats().clone();
    // The first agent has prefilled its prompt and is still decoding when the second comes.
    let mut a = submit(&e, &ps[0], 400);
    let first = tokens(&mut a, true).await;
    let b = tokens(&mut submit(&e, &ps[1], 48), false).await;
    let mut got_a = first;
    got_a.extend(tokens(&mut a, false).await);
    assert_eq!(b, want[1], "copied prefix continues like a fresh prefill");
    assert_eq!(got_a, want[0], "the source sequence is unchanged");
    assert_eq!(stats.device_copies.load(Relaxed), 1);
    assert_eq!(stats.device_copy_tokens.load(Relaxed) as usize, shared);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_device_copy_is_preferred_to_host_pages_of_the_same_prefix() {
    let (ps, want, shared) = two_agents(400).await;
    let e = Engine::start(device_level_config(32)).unwrap();
    let pages = e.pages().expect("paging on").clone();
    let mut a = submit(&e, &ps[0], 400);
    let mut got_a = tokens(&mut a, true).await;
    // The first agent's prompt pages go to host RAM right after its first token, covering
    // the shared prefix up to its last full page; the running sequence's KV covers all of it.
    let t0 = std::time::Instant::now();
    while (pages.reuse.published.load(Relaxed) as usize) < shared / 32 {
        assert!(t0.elapsed().as_secs() < 10, "prompt pages not published");
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    let b = tokens(&mut submit(&e, &ps[1], 48), false).await;
    got_a.extend(tokens(&mut a, false).await);
    assert_eq!(b, want[1]);
    assert_eq!(got_a, want[0]);
    assert_eq!(e.stats().device_copies.load(Relaxed), 1);
    assert_eq!(pages.reuse.hits.load(Relaxed), 0, "no page restored");
}

/// A sequence that ends at its first token (one token asked for, KV not kept in its slot)
/// still publishes its prompt's pages: they go before its KV is cleared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_ending_at_its_first_token_publishes_its_pages() {
    let e = engine(32, None, 1);
    let p = prompts(&e)[0].clone();
    let got = tokens(&mut submit(&e, &p, 1), false).await;
    assert_eq!(got.len(), 1);
    let published = e.pages().unwrap().reuse.published.load(Relaxed) as usize;
    assert_eq!(published, p.len() / 32);
}

/// A prompt of `n` token ids that shares no prefix with another seed's (the first ids differ).
fn unshared_prompt(seed: i32, n: usize) -> Vec<i32> {
    (0..n as i32)
        .map(|i| 100 + seed * 50 + (i * 7 + seed * 13) % 1900)
        .collect()
}

/// Two slots, KV kept in them, and a keep budget that holds one finished sequence but not
/// two: keeping the second pushes the first off the device (least recently used), and
/// asking for the first again restores its prefix from host-RAM pages, with the reply it
/// had. Without the budget both stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_kv_over_the_keep_budget_leaves_the_device_and_comes_back_from_ram() {
    let start = |keep_resident_mib| {
        Engine::start(EngineConfig {
            keep_resident_mib,
            ..device_level_config(32)
        })
        .expect("engine starts")
    };
    let (a, b) = (unshared_prompt(0, 400), unshared_prompt(1, 400));

    let unbounded = start(None);
    let want = run(&unbounded, &a).await;
    run(&unbounded, &b).await;
    let stats = unbounded.stats().clone();
    assert_eq!(stats.resident_dropped_tokens.load(Relaxed), 0);
    drop(unbounded);

    // t1's KV takes 1.5 KiB per token at f16: 1 MiB holds 682 tokens, so one kept
    // sequence (400 prompt tokens and 47 of its 48 answer tokens) and not two.
    let e = start(Some(1));
    let stats = e.stats().clone();
    assert_eq!(run(&e, &a).await, want);
    assert_eq!(stats.resident_dropped_tokens.load(Relaxed), 0);
    run(&e, &b).await;
    assert_eq!(
        stats.resident_dropped_tokens.load(Relaxed) as usize,
        a.len() + want.len() - 1,
        "the first sequence's kept KV left the device"
    );
    let reuse = e.pages().unwrap().reuse.clone();
    let restored = reuse.tokens_reused.load(Relaxed);
    assert_eq!(run(&e, &a).await, want, "restored from RAM pages");
    assert_eq!(
        reuse.tokens_reused.load(Relaxed) - restored,
        (a.len() as u64 - 1) / 32 * 32
    );
}
