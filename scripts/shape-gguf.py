#!/usr/bin/env python3
"""Write a GGUF with random weights in the exact shape of a public model, for speed benchmarks.

    scripts/shape-gguf.py --shape llama-3.2-1b --type q8_0 --seed 1 --out /tmp/1b-q8_0.gguf
    scripts/shape-gguf.py --list

Every tensor has the shape, name and quantization it has in llama.cpp's conversion of the
public model (norms F32, every matrix Q8_0 or Q4_0), so weights, KV cache and compute are
those of the real model. The values are random: the output is meaningless text, so use
these files only for speed with `ignore_eos` (decode, prefill, KV bytes, page moves), never
for quality. The quantized blocks are written directly (a random int8 or nibble per weight,
one f16 scale per tensor chosen for a weight standard deviation of 0.02), so an 8B-shape file
takes seconds to make and is the same bytes for the same arguments on every machine.

The tokenizer is the bundled tiers' SentencePiece vocabulary (3072 pieces, taken from
models/t1-q8_0.gguf) padded to the shape's vocabulary size with ordinary pieces (`▁r<id>`),
so prompts tokenize as they do for the bundled tiers and every sampled token has text.
Files are made at benchmark time and never committed (a 1B Q8_0 is 1.3 GB).

Needs numpy only. Exit status 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
import zlib
from dataclasses import dataclass

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "models", "recipe"))
import ggufw  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """Hyper-parameters of a llama-, qwen2- or qwen3moe-architecture model, as in its
    published config.json (qwen2 is llama's graph with biases on the q, k and v projections;
    qwen3moe has no biases, norms on q and k, and a mixture of experts in place of each
    layer's feed-forward matrices)."""

    source: str  # the model whose shape this is
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    ctx: int
    rope_base: float
    eps: float
    tied: bool  # output projection shares token_embd (no output.weight)
    arch: str = "llama"  # llama.cpp's architecture name: "llama", "qwen2" or "qwen3moe"
    head_dim: int = 0  # width of an attention head; 0: dim // heads
    experts: int = 0  # experts per layer (qwen3moe)
    experts_used: int = 0  # experts each token goes through
    expert_ffn: int = 0  # feed-forward width of one expert

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.heads

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2"

    def biases(self, layers: int) -> list[tuple[str, int]]:
        """(name, length) of every bias vector (qwen2: q, k and v)."""
        if not self.qkv_bias:
            return []
        hd = self.hd
        return [(f"blk.{i}.{p}.bias", n * hd) for i in range(layers)
                for p, n in (("attn_q", self.heads), ("attn_k", self.kv_heads), ("attn_v", self.kv_heads))]

    def matrices(self, layers: int) -> list[tuple[str, tuple[int, ...]]]:
        """(name, numpy shape) of every quantized matrix, in llama.cpp's order: (rows, cols),
        or (experts, rows, cols) for a layer's stacked experts."""
        hd = self.hd
        out = [("token_embd.weight", (self.vocab, self.dim))]
        if not self.tied:
            out.append(("output.weight", (self.vocab, self.dim)))
        for i in range(layers):
            out += [
                (f"blk.{i}.attn_q.weight", (self.heads * hd, self.dim)),
                (f"blk.{i}.attn_k.weight", (self.kv_heads * hd, self.dim)),
                (f"blk.{i}.attn_v.weight", (self.kv_heads * hd, self.dim)),
                (f"blk.{i}.attn_output.weight", (self.dim, self.heads * hd)),
            ]
            if self.moe:
                e, f = self.experts, self.expert_ffn
                out += [
                    (f"blk.{i}.ffn_gate_exps.weight", (e, f, self.dim)),
                    (f"blk.{i}.ffn_down_exps.weight", (e, self.dim, f)),
                    (f"blk.{i}.ffn_up_exps.weight", (e, f, self.dim)),
                ]
            else:
                out += [
                    (f"blk.{i}.ffn_gate.weight", (self.ffn, self.dim)),
                    (f"blk.{i}.ffn_up.weight", (self.ffn, self.dim)),
                    (f"blk.{i}.ffn_down.weight", (self.dim, self.ffn)),
                ]
        return out

    def vectors(self, layers: int) -> list[tuple[str, tuple[int, ...]]]:
        """(name, numpy shape) of every F32 tensor but the biases: norms, and each MoE
        layer's router (llama.cpp's conversions keep it unquantized)."""
        out = [("output_norm.weight", (self.dim,))]
        for i in range(layers):
            out += [(f"blk.{i}.attn_norm.weight", (self.dim,)), (f"blk.{i}.ffn_norm.weight", (self.dim,))]
            if self.moe:
                out += [(f"blk.{i}.attn_q_norm.weight", (self.hd,)), (f"blk.{i}.attn_k_norm.weight", (self.hd,)),
                        (f"blk.{i}.ffn_gate_inp.weight", (self.experts, self.dim))]
        return out

    def params(self, layers: int) -> int:
        """Parameter count with `layers` blocks (norm vectors included)."""
        n = sum(int(np.prod(s)) for _, s in self.matrices(layers) + self.vectors(layers))
        return n + sum(n for _, n in self.biases(layers))


# From each model's config.json on its publisher's page (Meta's Llama 3.x releases, Qwen's
# Qwen2.5-Coder Instruct releases, whose 0.5B and 1.5B are the pack's real pair; their
# published GGUFs carry output.weight although the models tie it, so these do too, and
# llama.cpp counts the same parameters: 630,167,424 and 1,777,088,000).
SHAPES = {
    "qwen2.5-0.5b": Shape("Qwen/Qwen2.5-Coder-0.5B-Instruct", 151936, 896, 24, 14, 2, 4864, 32768, 1000000.0, 1e-6, False, "qwen2"),
    "qwen2.5-1.5b": Shape("Qwen/Qwen2.5-Coder-1.5B-Instruct", 151936, 1536, 28, 12, 2, 8960, 32768, 1000000.0, 1e-6, False, "qwen2"),
    "llama-3.2-1b": Shape("meta-llama/Llama-3.2-1B", 128256, 2048, 16, 32, 8, 8192, 131072, 500000.0, 1e-5, True),
    "llama-3.2-3b": Shape("meta-llama/Llama-3.2-3B", 128256, 3072, 28, 24, 8, 8192, 131072, 500000.0, 1e-5, True),
    "llama-3.1-8b": Shape("meta-llama/Llama-3.1-8B", 128256, 4096, 32, 32, 8, 14336, 131072, 500000.0, 1e-5, False),
    # A mixture of experts: 128 experts of width 768 per layer, 8 per token (3.3 B of its
    # 30.5 B parameters active); ffn is the config's dense intermediate_size, unused by the
    # graph but written as Qwen's conversion writes it.
    "qwen3-30b-a3b": Shape("Qwen/Qwen3-30B-A3B", 151936, 2048, 48, 32, 4, 6144, 40960, 1000000.0, 1e-6, False,
                           "qwen3moe", head_dim=128, experts=128, experts_used=8, expert_ffn=768),
    # Not a published model: the smallest qwen3moe file the tests load (the bundled tiers'
    # vocabulary, 2 layers of 8 experts), a few MiB.
    "moe-test": Shape("mesh's tests (qwen3moe layout)", 3072, 256, 2, 4, 2, 512, 4096, 10000.0, 1e-6, False,
                      "qwen3moe", head_dim=64, experts=8, experts_used=2, expert_ffn=128),
}

TYPES = {"q8_0": (ggufw.GGML_Q8_0, ggufw.FTYPE_Q8_0), "q4_0": (ggufw.GGML_Q4_0, ggufw.FTYPE_Q4_0)}

# Standard deviation of the weights (a common initialisation scale).
WEIGHT_STD = 0.02
# Standard deviation of a uniform random int8 (Q8_0) and of a nibble minus 8 (Q4_0).
Q_STD = {ggufw.GGML_Q8_0: np.sqrt((256**2 - 1) / 12), ggufw.GGML_Q4_0: np.sqrt((16**2 - 1) / 12)}


def random_blocks(seed: int, name: str, shape: tuple[int, ...], ggml_type: int) -> bytes:
    """Quantized blocks of one matrix: a fixed f16 scale and random quants.

    The generator is seeded by (seed, CRC-32 of the tensor's name), so each tensor's bytes
    depend only on those and the same file comes out whatever order or machine.
    """
    rng = np.random.Generator(np.random.PCG64([seed, zlib.crc32(name.encode())]))
    n_blocks = int(np.prod(shape)) // 32
    per = ggufw.BLOCK_BYTES[ggml_type]
    out = np.empty((n_blocks, per), dtype=np.uint8)
    d = np.float16(WEIGHT_STD / Q_STD[ggml_type])
    out[:, :2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
    out[:, 2:] = np.frombuffer(rng.bytes(n_blocks * (per - 2)), dtype=np.uint8).reshape(n_blocks, per - 2)
    return out.tobytes()


def tokenizer_from(path: str, vocab: int) -> list[tuple[str, int, object, int | None]]:
    """The tokenizer keys of `path`, its vocabulary padded to `vocab` entries."""
    meta, _ = ggufw.read_header(path)
    tokens = list(meta["tokenizer.ggml.tokens"])
    if len(tokens) > vocab:
        raise SystemExit(f"shape-gguf: {path} has {len(tokens)} tokens, more than the shape's {vocab}")
    scores = list(meta["tokenizer.ggml.scores"])
    types = list(meta["tokenizer.ggml.token_type"])
    lowest = min(scores)
    for i in range(len(tokens), vocab):
        tokens.append(f"\u2581r{i}")
        scores.append(lowest - 1.0)
        types.append(1)  # normal: every sampled token prints text, as TTFT needs
    kv: list[tuple[str, int, object, int | None]] = [
        ("tokenizer.ggml.tokens", ggufw.T_ARRAY, tokens, ggufw.T_STRING),
        ("tokenizer.ggml.scores", ggufw.T_ARRAY, scores, ggufw.T_FLOAT32),
        ("tokenizer.ggml.token_type", ggufw.T_ARRAY, types, ggufw.T_INT32),
    ]
    for key in sorted(meta):
        if key.startswith("tokenizer.") and key not in {k for k, *_ in kv}:
            v = meta[key]
            vtype = ggufw.T_BOOL if isinstance(v, bool) else ggufw.T_UINT32 if isinstance(v, int) else ggufw.T_STRING
            kv.append((key, vtype, v, None))
    return kv


def write(shape_name: str, qtype: str, seed: int, layers: int | None, tokenizer: str, out: str) -> int:
    """Writes the file; returns its size in bytes."""
    shape = SHAPES[shape_name]
    n_layers = shape.layers if layers is None else layers
    gtype, ftype = TYPES[qtype]
    hd = shape.hd
    w = ggufw.GGUFWriter()
    arch = shape.arch
    w.add_str("general.architecture", arch)
    label = shape_name if n_layers == shape.layers else f"{shape_name} ({n_layers} of {shape.layers} layers)"
    w.add_str("general.name", f"random weights, shape of {label}, seed {seed}")
    w.add_str("general.description", f"random weights in the shape of {shape.source}; meaningless output, for speed only")
    w.add_u32("general.file_type", ftype)
    w.add_u32("general.quantization_version", 2)
    w.add_u32(f"{arch}.context_length", shape.ctx)
    w.add_u32(f"{arch}.embedding_length", shape.dim)
    w.add_u32(f"{arch}.block_count", n_layers)
    w.add_u32(f"{arch}.feed_forward_length", shape.ffn)
    w.add_u32(f"{arch}.attention.head_count", shape.heads)
    w.add_u32(f"{arch}.attention.head_count_kv", shape.kv_heads)
    w.add_f32(f"{arch}.rope.freq_base", shape.rope_base)
    w.add_u32(f"{arch}.rope.dimension_count", hd)
    w.add_f32(f"{arch}.attention.layer_norm_rms_epsilon", shape.eps)
    w.add_u32(f"{arch}.vocab_size", shape.vocab)
    if shape.head_dim:
        w.add_u32(f"{arch}.attention.key_length", hd)
        w.add_u32(f"{arch}.attention.value_length", hd)
    if shape.moe:
        w.add_u32(f"{arch}.expert_count", shape.experts)
        w.add_u32(f"{arch}.expert_used_count", shape.experts_used)
        w.add_u32(f"{arch}.expert_feed_forward_length", shape.expert_ffn)
    for key, vtype, value, elem in tokenizer_from(tokenizer, shape.vocab):
        w.add(key, vtype, value, elem)
    mats = dict(shape.matrices(n_layers))
    w.add_tensor_bytes("token_embd.weight", mats["token_embd.weight"], gtype,
                       lambda: random_blocks(seed, "token_embd.weight", mats["token_embd.weight"], gtype))
    if not shape.tied:
        w.add_tensor_bytes("output.weight", mats["output.weight"], gtype,
                           lambda: random_blocks(seed, "output.weight", mats["output.weight"], gtype))
    for name, dims in shape.vectors(n_layers):
        if name.endswith("ffn_gate_inp.weight"):
            # The router: random, so that tokens spread over the experts.
            rng = np.random.Generator(np.random.PCG64([seed, zlib.crc32(name.encode())]))
            w.add_tensor(name, rng.normal(0.0, WEIGHT_STD, dims).astype(np.float32), ggufw.GGML_F32)
        else:
            w.add_tensor(name, np.ones(dims, dtype=np.float32), ggufw.GGML_F32)
    for name, dims in mats.items():
        if name.startswith("blk."):
            w.add_tensor_bytes(name, dims, gtype, lambda name=name: random_blocks(seed, name, mats[name], gtype))
    for name, n in shape.biases(n_layers):
        w.add_tensor(name, np.zeros(n, dtype=np.float32), ggufw.GGML_F32)
    tmp = out + ".part"
    w.write(tmp)
    os.replace(tmp, out)
    return os.path.getsize(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), help="public model whose shape to copy")
    ap.add_argument("--type", default="q8_0", choices=sorted(TYPES), help="quantization of every matrix (default q8_0)")
    ap.add_argument("--seed", type=int, default=1, help="random seed (default 1); same seed, same bytes")
    ap.add_argument("--layers", type=int, help="write only the first N blocks (default: all; for tests)")
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "models", "t1-q8_0.gguf"),
                    help="GGUF whose tokenizer to copy (default: the bundled t1)")
    ap.add_argument("--out", help="GGUF to write (replaced when it exists)")
    ap.add_argument("--list", action="store_true", help="print the shapes with parameter counts and sizes")
    a = ap.parse_args()
    if a.list:
        for name, s in sorted(SHAPES.items()):
            n = s.params(s.layers)
            sizes = ", ".join(f"{t} {estimate(s, TYPES[t][0]) / 2**30:.2f} GiB" for t in sorted(TYPES))
            print(f"{name:14} {n / 1e9:.2f} B parameters ({s.source}); {sizes}")
        return 0
    if not a.shape or not a.out:
        ap.error("--shape and --out are needed (or --list)")
    shape = SHAPES[a.shape]
    if a.layers is not None and not 1 <= a.layers <= shape.layers:
        ap.error(f"--layers must be 1..{shape.layers} for {a.shape}, got {a.layers}")
    if a.seed < 0:
        ap.error("--seed must be 0 or more")
    if not os.path.isfile(a.tokenizer):
        ap.error(f"--tokenizer {a.tokenizer}: no such file")
    parent = os.path.dirname(os.path.abspath(a.out))
    if not os.path.isdir(parent):
        ap.error(f"--out {a.out}: folder {parent} does not exist")
    size = write(a.shape, a.type, a.seed, a.layers, a.tokenizer, a.out)
    layers = shape.layers if a.layers is None else a.layers
    print(f"shape-gguf: wrote {a.out}: {a.shape} {a.type}, {layers} layers, "
          f"{shape.params(layers) / 1e9:.3f} B parameters, {size / 2**20:.1f} MiB, seed {a.seed}")
    return 0


def estimate(shape: Shape, gtype: int) -> int:
    """Tensor bytes of the whole shape (without the header)."""
    mats = sum(ggufw.tensor_nbytes(s, gtype) for _, s in shape.matrices(shape.layers))
    vecs = sum(int(np.prod(s)) for _, s in shape.vectors(shape.layers))
    return mats + 4 * (vecs + sum(n for _, n in shape.biases(shape.layers)))


if __name__ == "__main__":
    sys.exit(main())
