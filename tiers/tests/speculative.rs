//! Speculative decoding (t1 drafts for t3) gives exactly t3's greedy tokens on
//! held-out prompts, one sequence at a time and several in one batch, and the
//! draft is actually used (some drafted tokens are accepted): in the stand-alone
//! [`Speculative`] and in the serving engine with a draft model, where stop strings,
//! `max_tokens`, cancellation, a seeded sampled request and a request under the tool-call
//! grammar (all three drafted too) still behave as on the target alone (exact-match
//! acceptance); and under rejection sampling a sampled request's drafted token follows the
//! target's own distribution, with drafts kept as often as speculative sampling says.

use std::path::PathBuf;

use std::num::NonZeroU32;
use std::time::Duration;

use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::sampling::LlamaSampler;
use llama_cpp_2::token::LlamaToken;

use mesh_tiers::chat::tool_call_grammar;
use mesh_tiers::chat::CALL;
use mesh_tiers::speculative::{greedy, SpecConfig, Speculative};
use mesh_tiers::{
    backend, DraftAcceptance, DraftConfig, Engine, EngineConfig, FinishReason, GenerateRequest,
    SamplingParams, TokenEvent, Usage,
};
use serde::Deserialize;

fn models_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../models"))
}

fn load(tier: &str) -> LlamaModel {
    let path = models_dir().join(format!("{tier}-q8_0.gguf"));
    LlamaModel::load_from_file(backend(), &path, &LlamaModelParams::default())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[derive(Deserialize)]
struct Case {
    prompt_ids: Vec<i32>,
}

#[derive(Deserialize)]
struct Fixture {
    cases: Vec<Case>,
}

/// Held-out prompts (the greedy-reference fixture's), `n` of them spread over the kinds.
fn prompts(n: usize) -> Vec<Vec<i32>> {
    let path = models_dir().join("fixtures/greedy-t3.json");
    let fx: Fixture = serde_json::from_slice(&std::fs::read(&path).expect("fixture")).unwrap();
    let step = fx.cases.len() / n;
    fx.cases
        .into_iter()
        .step_by(step.max(1))
        .take(n)
        .map(|c| c.prompt_ids)
        .collect()
}

const MAX_TOKENS: usize = 64;

#[test]
fn draft_and_verify_reproduces_the_target() {
    let target = load("t3");
    let draft = load("t1");
    let prompts = prompts(12);
    let reference: Vec<Vec<i32>> = prompts
        .iter()
        .map(|p| greedy(&target, p, MAX_TOKENS, 2).expect("greedy"))
        .collect();

    let cfg = SpecConfig {
        n_seq_max: 4,
        ..Default::default()
    };
    let mut spec = Speculative::new(&target, &draft, cfg).expect("contexts");
    let (mut drafted, mut accepted) = (0, 0);
    // One at a time.
    for (p, want) in prompts.iter().zip(&reference).take(6) {
        let out = spec.generate(std::slice::from_ref(p), MAX_TOKENS).unwrap();
        assert_eq!(
            &out[0].tokens, want,
            "single sequence differs from t3 alone"
        );
        drafted += out[0].drafted;
        accepted += out[0].accepted;
    }
    // Four sequences per batch, different lengths finishing at different rounds.
    for (ps, wants) in prompts[6..].chunks(4).zip(reference[6..].chunks(4)) {
        let outs = spec.generate(ps, MAX_TOKENS).unwrap();
        for (out, want) in outs.iter().zip(wants) {
            assert_eq!(&out.tokens, want, "batched sequence differs from t3 alone");
            drafted += out.drafted;
            accepted += out.accepted;
        }
    }
    assert!(drafted > 0);
    assert!(
        accepted * 2 > drafted,
        "t1 drafts should mostly be accepted on held-out prompts: {accepted}/{drafted}"
    );
}

#[test]
fn mismatched_limits_are_refused() {
    let target = load("t2");
    let draft = load("t1");
    let bad = SpecConfig {
        k_min: 3,
        k_init: 2,
        ..Default::default()
    };
    assert!(Speculative::new(&target, &draft, bad).is_err());
    let mut spec = Speculative::new(&target, &draft, SpecConfig::default()).unwrap();
    let long = vec![1; 4000];
    assert!(spec.generate(&[long], 8).is_err());
    let nine: Vec<Vec<i32>> = (0..9).map(|_| vec![1, 2, 3]).collect();
    assert!(spec.generate(&nine, 8).is_err());
}

/// t3's engine, with t1 drafting under `acceptance` when given.
fn engine(draft: Option<DraftAcceptance>) -> Engine {
    Engine::start(EngineConfig {
        name: "t3".into(),
        model: models_dir().join("t3-q8_0.gguf"),
        n_ctx: 4 * 2048,
        n_seq_max: 4,
        n_batch: 512,
        prefill_chunk: 256,
        threads: 2,
        draft: draft.map(|acceptance| DraftConfig {
            model: models_dir().join("t1-q8_0.gguf"),
            acceptance,
            ..DraftConfig::default()
        }),
        ..EngineConfig::default()
    })
    .expect("engine starts")
}

/// `n` held-out task prompts (`eval-heldout.jsonl`), spread over the file.
fn heldout(e: &Engine, n: usize) -> Vec<Vec<i32>> {
    let tasks = mesh_tiers::eval::load_tasks(&models_dir().join("fixtures/eval-heldout.jsonl"))
        .expect("held-out tasks");
    let step = (tasks.len() / n).max(1);
    tasks
        .iter()
        .step_by(step)
        .take(n)
        .map(|t| e.tokenize(&t.prompt))
        .collect()
}

#[derive(Debug, Default)]
struct Out {
    tokens: Vec<i32>,
    text: String,
    finish: Option<FinishReason>,
    usage: Usage,
}

async fn run(mut rx: tokio::sync::mpsc::UnboundedReceiver<TokenEvent>) -> Out {
    let mut o = Out::default();
    while let Some(ev) = tokio::time::timeout(Duration::from_secs(300), rx.recv())
        .await
        .expect("no stall")
    {
        match ev {
            TokenEvent::Started { .. } => {}
            TokenEvent::Token { id, text, .. } => {
                o.tokens.push(id);
                o.text.push_str(&text);
            }
            TokenEvent::Done {
                finish,
                usage,
                tail,
            } => {
                o.text.push_str(&tail);
                o.finish = Some(finish);
                o.usage = usage;
                break;
            }
            TokenEvent::Error(e) => panic!("generation failed: {e}"),
        }
    }
    o
}

fn greedy_req(prompt: &[i32], max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt: prompt.to_vec(),
        max_tokens,
        ..Default::default()
    }
}

/// Submits every request at once (the engine runs 4, queues the rest) and waits for all.
async fn all(e: &Engine, reqs: Vec<GenerateRequest>) -> Vec<Out> {
    let rxs: Vec<_> = reqs.into_iter().map(|r| e.submit(r).unwrap()).collect();
    futures::future::join_all(rxs.into_iter().map(run)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serving_engine_with_a_draft_gives_the_targets_tokens() {
    let plain = engine(None);
    let spec = engine(Some(DraftAcceptance::Exact));
    let prompts = heldout(&plain, 8);
    let sampled = GenerateRequest {
        sampling: SamplingParams {
            temperature: 0.8,
            top_k: 40,
            seed: 7,
            ..SamplingParams::default()
        },
        ..greedy_req(&prompts[0], MAX_TOKENS)
    };
    // A request offering tools, with the gateway's lazy tool-call grammar.
    let tasks = mesh_tiers::eval::load_tasks(&models_dir().join("fixtures/eval-heldout.jsonl"))
        .expect("held-out tasks");
    let call = tasks
        .iter()
        .find(|t| t.kind == "call")
        .expect("a call task");
    let grammar = tool_call_grammar(&mesh_tiers::eval::offered_tools(&call.prompt)).unwrap();
    let with_grammar = GenerateRequest {
        grammar: Some(grammar),
        grammar_trigger: Some(CALL.to_owned()),
        ..greedy_req(&plain.tokenize(&call.prompt), MAX_TOKENS)
    };
    let mut reqs: Vec<GenerateRequest> =
        prompts.iter().map(|p| greedy_req(p, MAX_TOKENS)).collect();
    reqs.push(sampled);
    reqs.push(with_grammar);

    // 8 greedy sequences, a sampled one and one under a grammar, 4 at a time, on each engine.
    let want = all(&plain, reqs.clone()).await;
    let got = all(&spec, reqs).await;
    let (mut drafted, mut accepted) = (0, 0);
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        assert_eq!(
            g.tokens, w.tokens,
            "request {i}: tokens differ from t3 alone"
        );
        assert_eq!(g.text, w.text, "request {i}: text differs");
        assert_eq!(g.finish, w.finish, "request {i}: finish differs");
        assert_eq!(w.usage.draft_tokens, 0, "no draft, no drafted tokens");
        drafted += g.usage.draft_tokens;
        accepted += g.usage.draft_accepted;
    }
    let called = &got.last().expect("the grammar request").text;
    assert!(
        called.contains(CALL),
        "the grammar request made a call: {called}"
    );
    assert!(
        got.iter().all(|o| o.usage.draft_tokens > 0),
        "every request drafted, the sampled and the grammar one included"
    );
    assert!(
        accepted * 2 > drafted,
        "t1 drafts should mostly be accepted: {accepted}/{drafted}"
    );
    let stats = spec.stats();
    assert_eq!(
        stats
            .draft_tokens
            .load(std::sync::atomic::Ordering::Relaxed) as usize,
        drafted
    );
    assert_eq!(
        stats
            .draft_accepted
            .load(std::sync::atomic::Ordering::Relaxed) as usize,
        accepted
    );
    // Fewer target decodes than tokens: the point of drafting.
    let steps = |e: &Engine| e.stats().steps.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        steps(&spec) < steps(&plain),
        "drafting saves target decodes"
    );

    // max_tokens and stop strings end a sequence inside a round, with the target's prefix.
    let long = &want[1];
    let short = run(spec.submit(greedy_req(&prompts[1], 5)).unwrap()).await;
    assert_eq!(short.tokens, long.tokens[..5]);
    assert_eq!(short.finish, Some(FinishReason::Length));
    let cut = long
        .text
        .char_indices()
        .nth(long.text.chars().count() / 2)
        .unwrap()
        .0;
    let stop: String = long.text[cut..].chars().take(3).collect();
    let head = &long.text[..long.text.find(&stop).unwrap()];
    let mut stopped_req = greedy_req(&prompts[1], MAX_TOKENS);
    stopped_req.stop = vec![stop.clone()];
    let stopped = run(spec.submit(stopped_req.clone()).unwrap()).await;
    let stopped_plain = run(plain.submit(stopped_req).unwrap()).await;
    assert_eq!(stopped.finish, Some(FinishReason::Stop));
    assert_eq!(stopped.text, head, "stop string {stop:?}");
    assert_eq!(stopped.tokens, stopped_plain.tokens);

    // A cancelled sequence frees its slot; the next requests still match the target.
    let mut rx = spec.submit(greedy_req(&prompts[2], MAX_TOKENS)).unwrap();
    while !matches!(rx.recv().await, Some(TokenEvent::Token { .. })) {}
    drop(rx);
    let again = all(
        &spec,
        prompts[..4]
            .iter()
            .map(|p| greedy_req(p, MAX_TOKENS))
            .collect(),
    )
    .await;
    for (i, (w, g)) in want.iter().zip(&again).enumerate() {
        assert_eq!(g.tokens, w.tokens, "request {i} after a cancellation");
    }
    assert_eq!(stats.active.load(std::sync::atomic::Ordering::Relaxed), 0);
    assert!(stats.cancelled.load(std::sync::atomic::Ordering::Relaxed) >= 1);

    // A request's draft cap (the policy's `draft_k_max`): at most one draft per round, so
    // a round emits at most two tokens and takes about half as many target steps as tokens;
    // the same request uncapped (k grows while drafts are accepted) takes far fewer. The
    // tokens are the target's either way.
    let alone = |cap: Option<usize>| {
        let spec = &spec;
        let prompt = &prompts[3];
        async move {
            let before = steps(spec);
            let out = run(spec
                .submit(GenerateRequest {
                    draft_max: cap,
                    ..greedy_req(prompt, MAX_TOKENS)
                })
                .unwrap())
            .await;
            (out, steps(spec) - before)
        }
    };
    let (capped, capped_steps) = alone(Some(1)).await;
    let (free, free_steps) = alone(None).await;
    for o in [&capped, &free] {
        assert_eq!(o.tokens, want[3].tokens, "a draft cap changes no token");
    }
    let n = capped.tokens.len() as u64;
    assert!(n >= 16, "long enough to tell: {n} tokens");
    assert!(capped.usage.draft_tokens > 0 && capped.usage.draft_tokens as u64 <= n);
    // Prefill takes one or two steps; every later step emits at most cap + 1 tokens.
    assert!(
        2 * capped_steps + 4 >= n,
        "{capped_steps} steps for {n} tokens with one draft a round"
    );
    assert!(
        free_steps < capped_steps,
        "uncapped: {free_steps} steps, capped {capped_steps}"
    );
}

/// A conversation's next turn on a drafted tier: the slot keeps the turn's KV in both
/// contexts, so the draft catches up on the new tokens only instead of the whole prompt
/// again; the tokens stay t3's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_turn_reuses_the_drafts_kept_kv() {
    let plain = engine(None);
    let spec = engine(Some(DraftAcceptance::Exact));
    let p1 = heldout(&plain, 1).remove(0);
    let turn1 = run(spec.submit(greedy_req(&p1, 24)).unwrap()).await;
    let want1 = run(plain.submit(greedy_req(&p1, 24)).unwrap()).await;
    assert_eq!(turn1.tokens, want1.tokens);
    let follow =
        plain.tokenize("<|end|><|user|>Now the same for Rome, please.<|end|><|assistant|>");
    let p2 = [p1.clone(), turn1.tokens.clone(), follow[1..].to_vec()].concat();

    let stats = spec.stats();
    let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    let (fed0, kept0) = (
        load(&stats.draft_prefill_tokens),
        load(&stats.draft_resident_tokens),
    );
    let turn2 = run(spec.submit(greedy_req(&p2, 24)).unwrap()).await;
    let fed = (load(&stats.draft_prefill_tokens) - fed0) as usize;
    let kept = (load(&stats.draft_resident_tokens) - kept0) as usize;
    let want2 = run(plain.submit(greedy_req(&p2, 24)).unwrap()).await;
    assert_eq!(
        turn2.tokens, want2.tokens,
        "turn 2 tokens differ from t3 alone"
    );
    assert!(turn2.usage.draft_tokens > 0, "turn 2 drafted");
    // The first turn's prompt stays in both KVs, and its answer up to the last round.
    assert!(
        kept >= p1.len(),
        "draft kept {kept} tokens of a {}-token first turn",
        p1.len()
    );
    // The draft fed the new prompt tokens and, per round, the target's own token: far
    // less than the whole prompt.
    assert!(
        fed <= p2.len() - kept + turn2.tokens.len(),
        "draft fed {fed} tokens for a {}-token prompt ({kept} kept, {} generated)",
        p2.len(),
        turn2.tokens.len()
    );
    assert!(
        fed * 2 < p2.len(),
        "draft fed {fed} of a {}-token prompt",
        p2.len()
    );
}

/// The distribution a sampled request draws its next token from after `tokens` on
/// `model` (top-k, then temperature, as the engine's chain), nonzero entries by token.
fn next_distribution(model: &LlamaModel, tokens: &[i32], s: &SamplingParams) -> Vec<(i32, f32)> {
    let params = LlamaContextParams::default().with_n_ctx(NonZeroU32::new(512));
    let mut ctx = model.new_context(backend(), params).expect("context");
    let mut batch = LlamaBatch::new(512, 1);
    for (i, &t) in tokens.iter().enumerate() {
        batch
            .add(LlamaToken(t), i as i32, &[0], i + 1 == tokens.len())
            .unwrap();
    }
    ctx.decode(&mut batch).expect("decode");
    let mut all = ctx.token_data_array_ith(batch.n_tokens() - 1);
    let mut chain = LlamaSampler::chain_simple([
        LlamaSampler::top_k(s.top_k),
        LlamaSampler::temp(s.temperature),
        LlamaSampler::dist(0),
    ]);
    chain.apply(&mut all);
    let mut d: Vec<(i32, f32)> = all
        .data
        .iter()
        .filter(|e| e.p() > 0.0)
        .map(|e| (e.id().0, e.p()))
        .collect();
    d.sort_unstable_by_key(|e| e.0);
    d
}

fn prob(d: &[(i32, f32)], t: i32) -> f64 {
    d.iter().find(|e| e.0 == t).map_or(0.0, |e| f64::from(e.1))
}

/// Total variation distance between two distributions (nonzero entries, by token).
fn total_variation(a: &[(i32, f32)], b: &[(i32, f32)]) -> f64 {
    let mut tokens: Vec<i32> = a.iter().chain(b).map(|e| e.0).collect();
    tokens.sort_unstable();
    tokens.dedup();
    tokens
        .iter()
        .map(|&t| (prob(a, t) - prob(b, t)).abs())
        .sum::<f64>()
        / 2.0
}

/// Rejection sampling (the default acceptance) keeps the target's distribution: many seeded
/// requests of one prompt, 3 tokens each; the second token is the first drafted one (t1
/// draws it, t3 keeps it or replaces it). Among requests whose first token is the likeliest,
/// the second token's frequencies match t3's exact conditional distribution, at a position
/// where t1's differs enough that emitting t1's draws would fail the check; and the draft is
/// kept at the rate speculative sampling predicts (sum of min(p, q)), above exact-match's
/// (sum of p * q).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejection_sampling_follows_the_targets_distribution() {
    const N: u32 = 800;
    let sampling = SamplingParams {
        temperature: 1.0,
        top_k: 6,
        ..SamplingParams::default()
    };
    let spec = engine(Some(DraftAcceptance::Rejection));
    let (t3, t1) = (load("t3"), load("t1"));
    // A prompt whose first token is mostly one token and whose second token the two models
    // disagree on (checked below).
    let prompt = spec.tokenize(PROMPT);
    let first_dist = next_distribution(&t3, &prompt, &sampling);
    let &(first, p_first) = first_dist
        .iter()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap();
    let after = [prompt.clone(), vec![first]].concat();
    let p = next_distribution(&t3, &after, &sampling);
    let q = next_distribution(&t1, &after, &sampling);
    let gap = total_variation(&p, &q);
    let min_pq: f64 = p.iter().map(|&(t, x)| f64::from(x).min(prob(&q, t))).sum();
    let pq: f64 = p.iter().map(|&(t, x)| f64::from(x) * prob(&q, t)).sum();
    eprintln!("first token {first} p {p_first:.3}; p {p:?}; q {q:?}; tv {gap:.3}; sum min {min_pq:.3}; sum pq {pq:.3}");
    assert!(
        p_first >= 0.3,
        "the first token should mostly be one: {p_first}"
    );
    assert!(
        gap >= 0.25,
        "t1 and t3 should differ at the drafted position: tv {gap}"
    );

    let reqs: Vec<GenerateRequest> = (0..N)
        .map(|seed| GenerateRequest {
            sampling: SamplingParams { seed, ..sampling },
            ..greedy_req(&prompt, 3)
        })
        .collect();
    let mut outs = Vec::new();
    // In waves the engine's queue takes.
    for wave in reqs.chunks(32) {
        outs.extend(all(&spec, wave.to_vec()).await);
    }
    let cond: Vec<&Out> = outs
        .iter()
        .filter(|o| o.tokens.len() >= 2 && o.tokens[0] == first)
        .collect();
    assert!(
        cond.len() as f64 >= f64::from(N) * f64::from(p_first) * 0.7,
        "{} of {N}",
        cond.len()
    );
    let mut seen: Vec<(i32, f32)> = Vec::new();
    for o in &cond {
        assert_eq!(o.usage.draft_tokens, 1, "one draft: at the second token");
        match seen.iter_mut().find(|e| e.0 == o.tokens[1]) {
            Some(e) => e.1 += 1.0,
            None => seen.push((o.tokens[1], 1.0)),
        }
    }
    for e in &mut seen {
        e.1 /= cond.len() as f32;
    }
    seen.sort_unstable_by_key(|e| e.0);
    let off = total_variation(&seen, &p);
    let kept =
        cond.iter().map(|o| o.usage.draft_accepted).sum::<usize>() as f64 / cond.len() as f64;
    eprintln!(
        "{} samples: tv to t3 {off:.3}, to t1 {:.3}; kept {kept:.3}",
        cond.len(),
        total_variation(&seen, &q)
    );
    assert!(
        off < 0.1 && off < gap / 2.0,
        "second token {seen:?} vs t3 {p:?}: tv {off}"
    );
    assert!(
        seen.iter().all(|e| prob(&p, e.0) > 0.0),
        "only tokens t3 may draw"
    );
    assert!(
        (kept - min_pq).abs() < 0.1,
        "kept {kept}, speculative sampling predicts {min_pq}"
    );
    assert!(kept > pq + 0.05, "kept {kept}, exact match would keep {pq}");
}

const PROMPT: &str = "The weather today is";
