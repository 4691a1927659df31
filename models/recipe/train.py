"""Train one tier of the bundled model family, export it to GGUF, record greedy references.

The model is a plain Llama layout (RMSNorm, rotary attention over adjacent
pairs as llama.cpp's LLAMA rope expects, grouped-query attention, SwiGLU, tied
embeddings), so the GGUF needs no weight permutation.

    # data once (any machine), then one tier:
    python3 models/recipe/train.py data --out work/data --examples 400000
    python3 models/recipe/train.py fit --tier t1 --data work/data --out work/t1 --minutes 8
    python3 models/recipe/train.py fit --tier t1 --data work/data --out work/t1 --device cpu --minutes 20

`fit` writes `model.pt`, `<tier>-q8_0.gguf`, `greedy.json` (greedy continuations
of the fixed held-out prompts, by the fp32 model and by the model with q8_0-rounded
weights) and `train.log`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from multiprocessing import Pool

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402
import ggufw  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER = os.path.join(HERE, "..", "tokenizer", "tokenizer.model")


@dataclass
class TierConfig:
    """Shape of one tier."""

    name: str
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    lr: float
    batch: int  # sequences per step
    vocab: int = 3072
    ctx: int = 2048
    rope_base: float = 10000.0
    eps: float = 1e-5


TIERS = {
    "t1": TierConfig("t1", dim=256, layers=3, heads=4, kv_heads=2, ffn=704, lr=2e-3, batch=64),
    "t2": TierConfig("t2", dim=384, layers=7, heads=6, kv_heads=2, ffn=1152, lr=1.2e-3, batch=64),
    "t3": TierConfig("t3", dim=640, layers=9, heads=10, kv_heads=2, ffn=1728, lr=8e-4, batch=64),
}

# ---------------------------------------------------------------------------
# Data


def _sp():
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=TOKENIZER)


def _encode_shard(args):
    seed, n, split = args
    sp = _sp()
    ast, end = sp.piece_to_id(corpus.AST), sp.piece_to_id(corpus.END)
    toks, mask = [], []
    for ex in corpus.generate(seed, n, split):
        ids = [sp.bos_id()] + sp.encode(ex.text())
        m = np.zeros(len(ids), dtype=np.uint8)
        inside = False
        for i, t in enumerate(ids):
            if inside:
                m[i] = 1
                if t == end:
                    inside = False
            elif t == ast:
                inside = True
        toks.append(np.asarray(ids, dtype=np.uint16))
        mask.append(m)
    return np.concatenate(toks), np.concatenate(mask)


def cmd_data(a) -> None:
    os.makedirs(a.out, exist_ok=True)
    shards = a.workers * 4
    per = a.examples // shards
    jobs = [(a.seed * 100003 + i, per, "train") for i in range(shards)]
    t0 = time.time()
    with Pool(a.workers) as pool:
        parts = pool.map(_encode_shard, jobs)
    toks = np.concatenate([p[0] for p in parts])
    mask = np.concatenate([p[1] for p in parts])
    np.save(os.path.join(a.out, "tokens.npy"), toks)
    np.save(os.path.join(a.out, "mask.npy"), mask)
    print(f"data: {shards * per} examples, {len(toks)} tokens, {mask.mean():.3f} supervised, "
          f"{time.time() - t0:.0f}s", flush=True)


def heldout_prompts(n: int = 100, seed: int = 4242) -> list[corpus.Example]:
    """The fixed prompts used for greedy-equivalence checks (mixed kinds)."""
    half = n // 2
    return corpus.generate(seed, half, "heldout_requests") + corpus.generate(seed, n - half, "heldout_tools")


# ---------------------------------------------------------------------------
# Model

def build_model(cfg: TierConfig):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    hd = cfg.dim // cfg.heads

    class RMSNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + cfg.eps)).type_as(x) * self.weight

    def rope(x, pos):
        # x: (B, T, H, D); rotate adjacent pairs (x[2i], x[2i+1]) like llama.cpp's NORM rope.
        inv = cfg.rope_base ** (-torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
        ang = pos[:, None].float() * inv[None, :]
        cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
        xf = x.float().reshape(*x.shape[:-1], hd // 2, 2)
        x0, x1 = xf[..., 0], xf[..., 1]
        out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
        return out.reshape(x.shape).type_as(x)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm = RMSNorm(cfg.dim)
            self.wq = nn.Linear(cfg.dim, cfg.heads * hd, bias=False)
            self.wk = nn.Linear(cfg.dim, cfg.kv_heads * hd, bias=False)
            self.wv = nn.Linear(cfg.dim, cfg.kv_heads * hd, bias=False)
            self.wo = nn.Linear(cfg.heads * hd, cfg.dim, bias=False)
            self.ffn_norm = RMSNorm(cfg.dim)
            self.w_gate = nn.Linear(cfg.dim, cfg.ffn, bias=False)
            self.w_up = nn.Linear(cfg.dim, cfg.ffn, bias=False)
            self.w_down = nn.Linear(cfg.ffn, cfg.dim, bias=False)

        def forward(self, x, pos, cache=None):
            B, T, _ = x.shape
            h = self.attn_norm(x)
            q = rope(self.wq(h).view(B, T, cfg.heads, hd), pos)
            k = rope(self.wk(h).view(B, T, cfg.kv_heads, hd), pos)
            v = self.wv(h).view(B, T, cfg.kv_heads, hd)
            if cache is not None:
                if "k" in cache:
                    k = torch.cat([cache["k"], k], 1)
                    v = torch.cat([cache["v"], v], 1)
                cache["k"], cache["v"] = k, v
            rep = cfg.heads // cfg.kv_heads
            qt = q.transpose(1, 2)
            kt = k.transpose(1, 2).repeat_interleave(rep, 1)
            vt = v.transpose(1, 2).repeat_interleave(rep, 1)
            causal = cache is None or T > 1
            if cache is not None and T > 1 and kt.shape[2] != T:
                raise ValueError("chunked prefill with a cache is not supported")
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            x = x + self.wo(o.transpose(1, 2).reshape(B, T, -1))
            h = self.ffn_norm(x)
            return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(cfg.vocab, cfg.dim)
            self.blocks = nn.ModuleList([Block() for _ in range(cfg.layers)])
            self.norm = RMSNorm(cfg.dim)
            for n, p in self.named_parameters():
                if p.dim() == 2:
                    std = 0.02 / math.sqrt(2 * cfg.layers) if n.endswith(("wo.weight", "w_down.weight")) else 0.02
                    nn.init.normal_(p, std=std)

        def forward(self, idx, start=0, caches=None):
            pos = torch.arange(start, start + idx.shape[1], device=idx.device)
            x = self.tok(idx)
            for i, b in enumerate(self.blocks):
                x = b(x, pos, None if caches is None else caches[i])
            return self.norm(x) @ self.tok.weight.T

    return Model()


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------
# Training


def cmd_fit(a) -> None:
    import torch
    import torch.nn.functional as F

    cfg = TIERS[a.tier]
    if a.batch:
        cfg.batch = a.batch
    if a.lr:
        cfg.lr = a.lr
    torch.manual_seed(a.seed)
    np.random.seed(a.seed)
    dev = torch.device(a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    os.makedirs(a.out, exist_ok=True)
    log = open(os.path.join(a.out, "train.log"), "a")

    def say(msg):
        print(f"[{cfg.name}] {msg}", flush=True)
        log.write(msg + "\n")
        log.flush()

    toks = np.load(os.path.join(a.data, "tokens.npy"))
    mask = np.load(os.path.join(a.data, "mask.npy"))
    seq = a.seq or cfg.ctx
    model = build_model(cfg)
    if a.init:
        # Continue from an exported GGUF (its q8_0 weights, dequantized).
        from reference import state_dict_from_gguf

        _, tensors = ggufw.read_gguf(a.init)
        model.load_state_dict(state_dict_from_gguf(tensors), strict=True)
        say(f"initialised from {a.init}")
    model = model.to(dev)
    say(f"config {json.dumps(asdict(cfg))} params={n_params(model)} device={dev} seq={seq} data_tokens={len(toks)}")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=dev.type == "cuda")
    toks_t = torch.from_numpy(toks.astype(np.int64))
    mask_t = torch.from_numpy(mask.astype(np.bool_))
    fwd = model
    if a.compile and dev.type == "cuda":
        try:
            fwd = torch.compile(model)
            say("torch.compile on")
        except Exception as e:  # noqa: BLE001 - eager still trains, only slower
            say(f"torch.compile unavailable ({e}); eager")
    budget = a.minutes * 60.0
    t0 = time.time()
    step, seen = 0, 0
    warm = 100
    while True:
        elapsed = time.time() - t0
        frac = step / a.steps if a.steps else elapsed / budget
        if frac >= 1.0:
            break
        lr = cfg.lr * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        off = torch.randint(0, len(toks_t) - seq - 1, (cfg.batch,))
        idx = off[:, None] + torch.arange(seq + 1)[None, :]
        x, m = toks_t[idx].to(dev, non_blocking=True), mask_t[idx].to(dev, non_blocking=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            try:
                logits = fwd(x[:, :-1])
            except Exception as e:  # noqa: BLE001 - a failed compile falls back to eager
                if fwd is model:
                    raise
                say(f"compiled forward failed ({type(e).__name__}: {e}); eager")
                fwd = model
                logits = fwd(x[:, :-1])
        loss_all = F.cross_entropy(logits.float().reshape(-1, cfg.vocab), x[:, 1:].reshape(-1), reduction="none")
        mm = m[:, 1:].reshape(-1).float()
        loss = (loss_all * mm).sum() / mm.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        seen += cfg.batch * seq
        if step % 100 == 0 or step == 1:
            el = time.time() - t0
            say(f"step {step} loss {loss.item():.4f} lr {lr:.2e} tokens {seen} {seen / max(el, 1e-9):.0f} tok/s {el:.0f}s")
    say(f"done steps={step} tokens={seen} seconds={time.time() - t0:.0f}")
    model = model.float().eval()
    torch.save({"config": asdict(cfg), "state": model.state_dict(), "steps": step, "tokens": seen},
               os.path.join(a.out, "model.pt"))
    export_gguf(model, cfg, os.path.join(a.out, f"{cfg.name}-q8_0.gguf"))
    write_greedy(model, cfg, dev, a.out, say)
    quick_eval(model, cfg, dev, say, n=a.eval_n)


# ---------------------------------------------------------------------------
# Export

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def gguf_tensors(model, cfg: TierConfig):
    """(name, numpy array, ggml type) in llama.cpp's LLAMA naming."""
    sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    Q, F32 = ggufw.GGML_Q8_0, ggufw.GGML_F32
    out = [("token_embd.weight", sd["tok.weight"], Q), ("output_norm.weight", sd["norm.weight"], F32)]
    names = {"attn_norm.weight": ("attn_norm.weight", F32), "wq.weight": ("attn_q.weight", Q),
             "wk.weight": ("attn_k.weight", Q), "wv.weight": ("attn_v.weight", Q),
             "wo.weight": ("attn_output.weight", Q), "ffn_norm.weight": ("ffn_norm.weight", F32),
             "w_gate.weight": ("ffn_gate.weight", Q), "w_up.weight": ("ffn_up.weight", Q),
             "w_down.weight": ("ffn_down.weight", Q)}
    for i in range(cfg.layers):
        for src, (dst, t) in names.items():
            out.append((f"blk.{i}.{dst}", sd[f"blocks.{i}.{src}"], t))
    return out


def export_gguf(model, cfg: TierConfig, path: str) -> None:
    sp = _sp()
    user_defined = set(corpus.SPECIAL_TOKENS) | {"\n"}
    tokens, scores, types = [], [], []
    # llama token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        tokens.append(piece)
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(2)
        elif sp.is_control(i):
            types.append(3)
        elif sp.is_byte(i):
            types.append(6)
        elif sp.is_unused(i):
            types.append(5)
        elif piece in user_defined:
            types.append(4)
        else:
            types.append(1)
    assert len(tokens) == cfg.vocab
    w = ggufw.GGUFWriter()
    w.add_str("general.architecture", "llama")
    w.add_str("general.name", f"mesh-{cfg.name}")
    w.add_str("general.license", "Apache-2.0")
    w.add_u32("general.file_type", ggufw.FTYPE_Q8_0)
    w.add_u32("general.quantization_version", 2)
    w.add_u32("llama.context_length", cfg.ctx)
    w.add_u32("llama.embedding_length", cfg.dim)
    w.add_u32("llama.block_count", cfg.layers)
    w.add_u32("llama.feed_forward_length", cfg.ffn)
    w.add_u32("llama.attention.head_count", cfg.heads)
    w.add_u32("llama.attention.head_count_kv", cfg.kv_heads)
    w.add_f32("llama.rope.freq_base", cfg.rope_base)
    w.add_u32("llama.rope.dimension_count", cfg.dim // cfg.heads)
    w.add_f32("llama.attention.layer_norm_rms_epsilon", cfg.eps)
    w.add_u32("llama.vocab_size", cfg.vocab)
    w.add_str("tokenizer.ggml.model", "llama")
    w.add_array("tokenizer.ggml.tokens", ggufw.T_STRING, tokens)
    w.add_array("tokenizer.ggml.scores", ggufw.T_FLOAT32, scores)
    w.add_array("tokenizer.ggml.token_type", ggufw.T_INT32, types)
    w.add_u32("tokenizer.ggml.bos_token_id", sp.bos_id())
    w.add_u32("tokenizer.ggml.eos_token_id", sp.piece_to_id(corpus.END))
    w.add_u32("tokenizer.ggml.eot_token_id", sp.piece_to_id(corpus.END))
    w.add_u32("tokenizer.ggml.unknown_token_id", sp.unk_id())
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_bool("tokenizer.ggml.add_eos_token", False)
    w.add_bool("tokenizer.ggml.add_space_prefix", False)
    w.add_str("tokenizer.chat_template", CHAT_TEMPLATE)
    for name, arr, t in gguf_tensors(model, cfg):
        w.add_tensor(name, arr, t)
    w.write(path)


# ---------------------------------------------------------------------------
# Greedy references and a quick evaluation


def greedy(model, prompt_ids, dev, end_id, max_new=64):
    import torch

    with torch.no_grad():
        caches = [dict() for _ in model.blocks]
        x = torch.tensor([prompt_ids], device=dev)
        logits = model(x, 0, caches)
        out = []
        pos = len(prompt_ids)
        for _ in range(max_new):
            t = int(logits[0, -1].argmax())
            out.append(t)
            if t == end_id:
                break
            logits = model(torch.tensor([[t]], device=dev), pos, caches)
            pos += 1
        return out


def q8_rounded(model, cfg):
    """A copy of the model whose q8_0-exported weights are replaced by their dequantized values."""
    import copy

    import torch

    m = copy.deepcopy(model)
    sd = m.state_dict()
    for k, v in sd.items():
        if v.dim() == 2:
            a = v.detach().float().cpu().numpy()
            deq = ggufw.dequantize_q8_0(ggufw.quantize_q8_0(a), a.shape)
            sd[k].copy_(torch.from_numpy(deq))
    return m


def write_greedy(model, cfg, dev, out_dir, say) -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    sp = _sp()
    end = sp.piece_to_id(corpus.END)
    prompts = heldout_prompts()
    qm = q8_rounded(model, cfg).to(dev)
    cases = []
    for ex in prompts:
        ids = [sp.bos_id()] + sp.encode(ex.prompt)
        cases.append({"kind": ex.kind, "sub": ex.sub, "prompt_ids": ids,
                      "fp32": greedy(model.to(dev), ids, dev, end), "q8": greedy(qm, ids, dev, end)})
    same = sum(c["fp32"] == c["q8"] for c in cases)
    say(f"greedy refs: {len(cases)} prompts, fp32 == q8-rounded on {same}")
    with open(os.path.join(out_dir, "greedy.json"), "w") as f:
        json.dump({"tier": cfg.name, "max_new": 64, "cases": cases}, f, separators=(",", ":"))


def parse_calls(text: str):
    calls = []
    for part in text.split(corpus.CALL)[1:]:
        body = part.split(corpus.ECALL)[0]
        try:
            calls.append(json.loads(body))
        except json.JSONDecodeError:
            calls.append(None)
    return calls


def score(ex: corpus.Example, text: str) -> dict:
    want, got = parse_calls(ex.completion), parse_calls(text)
    answer_want = ex.completion.split(corpus.ETHINK)[-1]
    exact = want == got and (bool(want) or text.strip() == answer_want.replace(corpus.END, "").strip())
    return {"exact": exact, "valid_json": all(c is not None for c in got) if got else None}


def quick_eval(model, cfg, dev, say, n=200) -> None:
    sp = _sp()
    end = sp.piece_to_id(corpus.END)
    res: dict[str, list[bool]] = {}
    for split in ("heldout_requests", "heldout_tools"):
        for ex in corpus.generate(777, n, split):
            ids = [sp.bos_id()] + sp.encode(ex.prompt)
            out = greedy(model, ids, dev, end, max_new=96)
            text = sp.decode([t for t in out if t != end])
            res.setdefault(f"{split}/{ex.kind}", []).append(score(ex, text)["exact"])
    for k, v in sorted(res.items()):
        say(f"eval {k}: exact {sum(v)}/{len(v)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data", help="generate and tokenize the training corpus")
    d.add_argument("--out", required=True)
    d.add_argument("--examples", type=int, default=400000)
    d.add_argument("--seed", type=int, default=1234)
    d.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    f = sub.add_parser("fit", help="train one tier, export GGUF, write greedy references")
    f.add_argument("--tier", required=True, choices=sorted(TIERS))
    f.add_argument("--data", required=True)
    f.add_argument("--out", required=True)
    f.add_argument("--minutes", type=float, default=8.0, help="time budget (ignored with --steps)")
    f.add_argument("--steps", type=int, default=0, help="fixed step count instead of a time budget")
    f.add_argument("--batch", type=int, default=0)
    f.add_argument("--seq", type=int, default=0, help="training window (default: tier context)")
    f.add_argument("--device", default="auto")
    f.add_argument("--seed", type=int, default=1)
    f.add_argument("--init", default="", help="start from the weights of this GGUF (continued training)")
    f.add_argument("--lr", type=float, default=0.0, help="peak learning rate (default: the tier's)")
    f.add_argument("--eval-n", type=int, default=100)
    f.add_argument("--compile", action="store_true", help="torch.compile the model (CUDA only)")
    a = ap.parse_args()
    {"data": cmd_data, "fit": cmd_fit}[a.cmd](a)


if __name__ == "__main__":
    main()
