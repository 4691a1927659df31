#!/usr/bin/env python3
"""Greedy references for the bundled tiers, recomputed from the committed GGUFs.

The fp32 PyTorch checkpoints are gone, but every weight the runtime uses is in
`models/<tier>-q8_0.gguf`. This script reads a GGUF, rebuilds the PyTorch model
of `train.py` with the dequantized weights and adds two greedy continuations
to each case of `models/fixtures/greedy-<tier>.json` (the existing "fp32" and
"q8" fields are kept as they are):

* "q8w":  plain fp32 PyTorch on the q8_0 weights (`train.greedy`).
* "ggml": the same weights with the arithmetic of llama.cpp's CPU backend as
  the Rust test runs it (llama-cpp-sys-2 0.1.161, x86-64 AVX2/FMA/F16C build,
  flash attention, f16 KV cache, n_ubatch 512, 2 threads), reproduced op for
  op so that the logits come out bit-identical:
  - q8_0 matmuls quantize their f32 input rows like the AVX2
    `quantize_row_q8_0` (blocks of 32, d = f16(amax/127), q = round-half-even
    of x * (127/amax)) and accumulate like `ggml_vec_dot_q8_0_q8_0` and
    llamafile's tinyBLAS_Q0_AVX: eight f32 lanes of four products each, one
    fma per block with scale dw*dx, then the hsum_float_8 tree;
  - K and V are rounded to f16 when they enter the cache;
  - flash attention follows `ggml_compute_forward_flash_attn_ext_f16`: the
    tiled f32 kernel for ubatches of >= 64 rows (fma chains of simd_gemm,
    per-64-key online softmax with ggml_v_expf), the one-row kernel
    otherwise (Q rounded to f16, ggml_vec_dot_f16's lane order, the V
    accumulator stored in f16 after every step, libm expf) and, for
    single-token decodes over >= 512 cells, its split of the KV range over
    the threads and the f32 merge of the partial results; which kernel runs
    and over how many cells depends on the ubatch split of the prompt and on
    the cache padding (256 cells), both mirrored here;
  - RMSNorm (double sum), RoPE (angles by repeated f32 products, libm
    cosf/sinf, fused multiply-adds) and SwiGLU (ggml_v_expf) as the ggml ops.
  libm is glibc's: expf is reimplemented from glibc's algorithm, cosf/sinf
  are called through ctypes.
  "ggml_gap" holds, per generated token, the emulated top-1 minus top-2 logit.

    python3 models/recipe/reference.py                 # all tiers
    python3 models/recipe/reference.py --tier t1
    python3 models/recipe/reference.py --tier t2 --cases 3,17 --no-write

Runs on CPU (one torch thread by default) and is deterministic; the "ggml"
results do not depend on the thread count. The exact emulation is slow: about
4 s per case for t1, 9 s for t2 and 25 s for t3 on one core.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ggufw  # noqa: E402
from train import TIERS, TierConfig, build_model, greedy  # noqa: E402

MODELS = os.path.join(HERE, "..")
FIXTURES = os.path.join(HERE, "..", "fixtures")

# llama.cpp context parameters used by tiers/tests/bundled_models.rs.
N_UBATCH = 512
N_THREADS = 2
N_CTX = 2048
KV_PAD = 256  # llama_kv_cache::get_n_kv pads the used cells to a multiple of 256
FA_TILE_Q = 64  # GGML_FA_TILE_Q
FA_TILE_KV = 64  # GGML_FA_TILE_KV
FA_SPLIT_KV_MIN = 512  # single-token decodes over >= 512 cells split the KV range per thread

# ---------------------------------------------------------------------------
# GGUF -> PyTorch


def tier_config(meta: dict) -> TierConfig:
    """The TierConfig described by a GGUF's llama.* metadata."""
    name = str(meta.get("general.name", "")).removeprefix("mesh-")
    known = TIERS.get(name)
    dim = int(meta["llama.embedding_length"])
    heads = int(meta["llama.attention.head_count"])
    cfg = TierConfig(
        name=name,
        dim=dim,
        layers=int(meta["llama.block_count"]),
        heads=heads,
        kv_heads=int(meta["llama.attention.head_count_kv"]),
        ffn=int(meta["llama.feed_forward_length"]),
        lr=known.lr if known else 0.0,
        batch=known.batch if known else 0,
        vocab=int(meta.get("llama.vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        ctx=int(meta["llama.context_length"]),
        rope_base=float(meta["llama.rope.freq_base"]),
        eps=float(meta["llama.attention.layer_norm_rms_epsilon"]),
    )
    if int(meta.get("llama.rope.dimension_count", dim // heads)) != dim // heads:
        raise ValueError("partial rotary embeddings are not supported")
    return cfg


# train.gguf_tensors, inverted: GGUF name suffix -> state_dict name suffix.
_BLOCK_NAMES = {
    "attn_norm.weight": "attn_norm.weight", "attn_q.weight": "wq.weight", "attn_k.weight": "wk.weight",
    "attn_v.weight": "wv.weight", "attn_output.weight": "wo.weight", "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate.weight": "w_gate.weight", "ffn_up.weight": "w_up.weight", "ffn_down.weight": "w_down.weight",
}


def state_dict_from_gguf(tensors: dict) -> dict:
    import torch

    sd = {}
    for name, (arr, _) in tensors.items():
        if name == "token_embd.weight":
            key = "tok.weight"
        elif name == "output_norm.weight":
            key = "norm.weight"
        elif name.startswith("blk."):
            _, i, rest = name.split(".", 2)
            key = f"blocks.{int(i)}.{_BLOCK_NAMES[rest]}"
        else:
            raise ValueError(f"unexpected tensor {name}")
        sd[key] = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
    return sd


def load_model(path: str):
    """(model, cfg, metadata) for a GGUF written by train.export_gguf."""
    import torch

    meta, tensors = ggufw.read_gguf(path)
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"{path}: not a llama GGUF")
    cfg = tier_config(meta)
    model = build_model(cfg)
    model.load_state_dict(state_dict_from_gguf(tensors), strict=True)
    model.eval()
    with torch.no_grad():
        for p in model.parameters():
            p.requires_grad_(False)
    return model, cfg, meta


# ---------------------------------------------------------------------------
# ggml arithmetic helpers (torch tensors, float32 unless noted)


def _recip(x, num: float = 1.0):
    """num / x in f32 with IEEE division (torch's `scalar / tensor` is not always correctly rounded)."""
    import torch

    return torch.full_like(x, num) / x


def _f16(x):
    """Round float32 values to f16 (round to nearest even, as F16C does)."""
    import torch

    return x.to(torch.float16).to(torch.float32)


def _fma(a, b, c):
    """f32 fused multiply-add: exact product in float64, sum rounded to float64 then to f32.

    (The double rounding can differ from a true fma only when the float64 sum
    lands exactly on a float32 midpoint after rounding, which needs the exact
    sum to carry more than 53 significant bits.)"""
    import torch

    a = a.double() if isinstance(a, torch.Tensor) else float(a)
    b = b.double() if isinstance(b, torch.Tensor) else float(b)
    c = c.double() if isinstance(c, torch.Tensor) else float(c)
    return (a * b + c).float()


def _libm():
    """The C library's libm (the one llama.cpp's CPU backend calls for expf/cosf/sinf), or None."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("m")
    if not name:
        return None
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    for fn in ("expf", "cosf", "sinf"):
        f = getattr(lib, fn)
        f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float]
    return lib


LIBM = _libm()


def libm_f32(fn: str, x: np.ndarray) -> np.ndarray:
    """Apply libm's float function `fn` element by element (float64 then rounded if libm is missing)."""
    x = np.asarray(x, dtype=np.float32)
    if LIBM is None:
        return getattr(np, {"expf": "exp", "cosf": "cos", "sinf": "sin"}[fn])(x.astype(np.float64)).astype(np.float32)
    f = getattr(LIBM, fn)
    return np.array([f(float(v)) for v in x.ravel()], dtype=np.float32).reshape(x.shape)


# glibc's expf (sysdeps/ieee754/flt-32/e_expf.c with __exp2f_data, EXP2F_TABLE_BITS = 5),
# the scalar expf llama.cpp's flash attention calls on Linux. Double-precision
# intermediates; whether the compiler fused its three multiply-adds changes y
# by a double ulp at most, which does not reach the float result.
_EXP2F_TAB = np.array([
    0x3FF0000000000000, 0x3FEFD9B0D3158574, 0x3FEFB5586CF9890F, 0x3FEF9301D0125B51,
    0x3FEF72B83C7D517B, 0x3FEF54873168B9AA, 0x3FEF387A6E756238, 0x3FEF1E9DF51FDEE1,
    0x3FEF06FE0A31B715, 0x3FEEF1A7373AA9CB, 0x3FEEDEA64C123422, 0x3FEECE086061892D,
    0x3FEEBFDAD5362A27, 0x3FEEB42B569D4F82, 0x3FEEAB07DD485429, 0x3FEEA47EB03A5585,
    0x3FEEA09E667F3BCD, 0x3FEE9F75E8EC5F74, 0x3FEEA11473EB0187, 0x3FEEA589994CCE13,
    0x3FEEACE5422AA0DB, 0x3FEEB737B0CDC5E5, 0x3FEEC49182A3F090, 0x3FEED503B23E255D,
    0x3FEEE89F995AD3AD, 0x3FEEFF76F2FB5E47, 0x3FEF199BDD85529C, 0x3FEF3720DCEF9069,
    0x3FEF5818DCFBA487, 0x3FEF7C97337B9B5F, 0x3FEFA4AFA2A490DA, 0x3FEFD0765B6E4540,
], dtype=np.uint64)
_EXP2F_N = 32
_EXPF_INVLN2N = float.fromhex("0x1.71547652b82fep+0") * _EXP2F_N
_EXPF_SHIFT = float.fromhex("0x1.8p+52")
_EXPF_C = (float.fromhex("0x1.c6af84b912394p-5") / _EXP2F_N**3, float.fromhex("0x1.ebfce50fac4f3p-3") / _EXP2F_N**2,
           float.fromhex("0x1.62e42ff0c52d6p-1") / _EXP2F_N)


def glibc_expf(x: np.ndarray) -> np.ndarray:
    """glibc expf, element for element, on a float32 array (not correctly rounded: up to ~0.55 ulp)."""
    x = np.asarray(x, dtype=np.float32)
    xd = x.astype(np.float64)
    with np.errstate(all="ignore"):
        z = _EXPF_INVLN2N * xd
        kd = z + _EXPF_SHIFT
        ki = kd.view(np.uint64)
        kd = kd - _EXPF_SHIFT
        r = z - kd
        t = _EXP2F_TAB[ki % np.uint64(_EXP2F_N)] + (ki << np.uint64(52 - 5))
        s = t.view(np.float64)
        c0, c1, c2 = _EXPF_C
        zz = c0 * r + c1
        y = c2 * r + 1.0
        y = zz * (r * r) + y
        out = (y * s).astype(np.float32)
        out = np.where(x > np.float32(float.fromhex("0x1.62e42ep6")), np.float32(np.inf), out)
        out = np.where(x < np.float32(-float.fromhex("0x1.9fe368p6")), np.float32(0.0), out)
    return np.where(np.isnan(x), x, out).astype(np.float32)


def _expf(x):
    """libm expf of a float32 tensor (glibc's algorithm)."""
    import torch

    return torch.from_numpy(glibc_expf(x.detach().numpy()))


def check_libm(n: int = 20000) -> str:
    """Compare glibc_expf with this machine's libm expf; a note for the log."""
    if LIBM is None:
        return "libm not found: cosf/sinf rounded from float64, expf from the glibc algorithm"
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(-4, 8, n), -rng.exponential(0.05, n)]).astype(np.float32)
    bad = int((glibc_expf(x) != libm_f32("expf", x)).sum())
    return f"libm expf vs glibc algorithm: {bad}/{len(x)} differ" + ("" if bad == 0 else " (not glibc?)")


def _bits(x):
    import torch

    return x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _from_bits(u):
    import torch

    u = u & 0xFFFFFFFF
    return torch.where(u >= 2**31, u - 2**32, u).to(torch.int32).view(torch.float32)


def _c(h: str):
    import torch

    return torch.tensor(float.fromhex(h), dtype=torch.float32)


def v_expf(x):
    """ggml_v_expf (AVX2 + FMA), element for element."""
    import torch

    r = _c("0x1.8p23")
    z = _fma(x, _c("0x1.715476p+0"), r)
    n = z - r
    b = _fma(-n, _c("0x1.7f7d1cp-20"), _fma(-n, _c("0x1.62e4p-1"), x))
    e = (_bits(z) << 23) & 0xFFFFFFFF
    k = _from_bits(e + 0x3F800000)
    c = n.abs() > 126
    u = b * b
    j = _fma(_fma(_fma(_c("0x1.0e4020p-7"), b, _c("0x1.573e2ep-5")), u,
                  _fma(_c("0x1.555e66p-3"), b, _c("0x1.fffdb6p-2"))),
             u, _c("0x1.ffffecp-1") * b)
    normal = _fma(j, k, k)
    if not bool(c.any()):
        return normal
    g = torch.where(n <= 0, torch.tensor(0x82000000, dtype=torch.int64), torch.tensor(0, dtype=torch.int64))
    s1 = _from_bits(g + 0x7F000000)
    s2 = _from_bits(e - g)
    d = n.abs() > 192
    return torch.where(d, s1 * s1, torch.where(c, _fma(s2, j, s2) * s1, normal))


def silu_mul(gate, up):
    """ggml_vec_swiglu_f32: x / (1 + expf(-x)) * g with the vectorized expf."""
    return gate / (v_expf(-gate) + 1.0) * up


def rms_norm(x, w, eps: float):
    """ggml_compute_forward_rms_norm_f32 (+ the weight multiply)."""
    import torch

    sq = (x * x).double().numpy()
    total = np.cumsum(sq, axis=-1)[..., -1:]  # sequential double sum, as ggml loops
    mean = (total / x.shape[-1]).astype(np.float32)
    # numpy's f32 sqrt is IEEE; torch's vectorized one is not always correctly rounded.
    scale = np.float32(1.0) / np.sqrt(mean + np.float32(eps))
    return x * torch.from_numpy(scale) * w


def quantize_act_q8_0(x):
    """quantize_row_q8_0 (x86 AVX2) on the rows of x (T, K): (q (T, K/32, 32) f32 integers, d (T, K/32) f32)."""
    import torch

    T, K = x.shape
    blocks = x.reshape(T, K // ggufw.QK8_0, ggufw.QK8_0)
    amax = blocks.abs().amax(-1)
    d = _f16(amax / 127.0)  # y[i].d = GGML_CPU_FP32_TO_FP16(maxScalar / 127.f)
    idm = torch.where(amax != 0, _recip(torch.where(amax != 0, amax, torch.ones_like(amax)), 127.0),
                      torch.zeros_like(amax))  # id = 127.f / maxScalar
    q = torch.round(blocks * idm[..., None])  # _mm256_round_ps(_MM_ROUND_NEAREST): ties to even
    return q, d


class Q8Weight:
    """A q8_0 weight matrix (N, K) as its int8 values and f16 block scales, for exact ggml dot products."""

    def __init__(self, w):
        import torch

        N, K = w.shape
        nb = K // ggufw.QK8_0
        blocks = w.float().reshape(N, nb, ggufw.QK8_0)
        d = _f16(blocks.abs().amax(-1) / 127.0)
        q = torch.round(blocks / torch.where(d > 0, d, torch.ones_like(d))[..., None])
        if not bool((q * d[..., None] == blocks).all()) or bool((q.abs() > 127).any()):
            raise ValueError("weight is not a dequantized q8_0 tensor")
        self.N, self.K, self.nb = N, K, nb
        # (K/4 groups of 4 consecutive inputs, 4, N): one AVX2 lane of one block per group.
        self.qg = q.reshape(N, nb * 8, 4).permute(1, 2, 0).contiguous()
        self.d = d.T.contiguous()  # (nb, N)

    def matmul(self, x, rows: int = 16):
        """ggml mul_mat of this weight with f32 activations x (T, K) -> (T, N), bit-exact.

        Activations are quantized with quantize_row_q8_0. ggml_vec_dot_q8_0_q8_0
        (AVX2) and llamafile's tinyBLAS_Q0_AVX both keep 8 f32 lanes, lane l
        summing inputs 4l..4l+3 of each block: acc_l = fma(dw*dx, isum_l, acc_l)
        block after block, then hsum_float_8. The integer lane sums are exact in
        f32; the fma is done in float64 (exact product) and rounded to f32.
        """
        import torch

        T = x.shape[0]
        qx, dx = quantize_act_q8_0(x)
        out = torch.empty((T, self.N), dtype=torch.float32)
        for t0 in range(0, T, rows):
            n = min(rows, T - t0)
            xg = qx[t0:t0 + n].reshape(n, self.nb * 8, 4).permute(1, 0, 2)
            isum = torch.bmm(xg, self.qg).view(self.nb, 8, n, self.N)
            dd = (dx[t0:t0 + n].T[:, :, None] * self.d[:, None, :]).double()  # (nb, n, N), exact
            acc = torch.zeros((8, n, self.N), dtype=torch.float64)
            buf = torch.empty((8, n, self.N), dtype=torch.float32)
            for b in range(self.nb):
                acc.addcmul_(isum[b].double(), dd[b][None])
                buf.copy_(acc)
                acc.copy_(buf)
            r = buf[4:] + buf[:4]
            out[t0:t0 + n] = (r[0] + r[2]) + (r[1] + r[3])
        return out


def vec_dot_f16(q, k):
    """ggml_vec_dot_f16 (AVX2 + F16C) of f16-valued rows: q (..., D) against k (..., D).

    Four accumulators of eight f32 lanes, FMA over D/32 steps, then ggml's
    reduction tree. Products of two f16 values are exact in f32.
    """
    D = q.shape[-1]
    assert D % 32 == 0, D
    p = q * k
    p = p.reshape(*p.shape[:-1], D // 32, 4, 8)
    acc = p[..., 0, :, :]
    for it in range(1, D // 32):
        acc = acc + p[..., it, :, :]
    x0 = acc[..., 0, :] + acc[..., 2, :]
    x1 = acc[..., 1, :] + acc[..., 3, :]
    x0 = x0 + x1
    t0 = x0[..., :4] + x0[..., 4:]
    return (t0[..., 0] + t0[..., 1]) + (t0[..., 2] + t0[..., 3])


def online_softmax_f16(s, V):
    """The per-row kernel of ggml's CPU flash attention with an F16 V cache.

    s: (B, L) f32 scores (already scaled; -inf = masked, skipped), V: (B, L, D)
    f16-valued rows. Walks the keys in order like
    ggml_compute_forward_flash_attn_ext_f16_one_chunk: running max M, sum S
    (f32) and a V accumulator stored in f16 after every scale and every
    multiply-add. Returns (M, S, VKQ) as numpy float32 arrays.
    """
    import torch

    B, L = s.shape
    D = V.shape[-1]
    neg = torch.full((B, 1), float("-inf"))
    mprev = torch.cat([neg, torch.cummax(s, dim=1).values[:, :-1]], 1)
    valid = s > float("-inf")
    new = s > mprev
    ms = torch.where(new, _expf(mprev - s), torch.ones_like(s))
    safe = torch.where(valid & ~new, s - mprev, torch.zeros_like(s))
    vs = torch.where(new, torch.ones_like(s), torch.where(valid, _expf(safe), torch.zeros_like(s)))
    ms_n, vs_n = ms.double().numpy(), vs.double().numpy()
    any_new = new.any(0).numpy()
    any_valid = valid.any(0).numpy()
    Vn = V.double().numpy()
    y = np.zeros((B, D), dtype=np.float64)
    S = np.zeros(B, dtype=np.float64)
    for i in range(L):
        if not any_valid[i]:
            continue
        if any_new[i]:
            y = (y * ms_n[:, i, None]).astype(np.float32).astype(np.float16).astype(np.float64)
        y = (Vn[:, i] * vs_n[:, i, None] + y).astype(np.float32).astype(np.float16).astype(np.float64)
        S = (S * ms_n[:, i] + vs_n[:, i]).astype(np.float32).astype(np.float64)
    M = torch.where(valid.any(1), s.max(1).values, torch.full((B,), float("-inf"))).numpy()
    return M.astype(np.float32), S.astype(np.float32), y.astype(np.float32)


# ---------------------------------------------------------------------------
# llama.cpp CPU emulation


class GgmlCpu:
    """Greedy decoding of the tier model with llama.cpp's CPU arithmetic (see module docstring)."""

    def __init__(self, model, cfg: TierConfig, n_ubatch: int = N_UBATCH, n_threads: int = N_THREADS,
                 n_ctx: int = N_CTX):
        import torch

        self.cfg = cfg
        self.hd = cfg.dim // cfg.heads
        self.n_ubatch, self.n_threads, self.n_ctx = n_ubatch, n_threads, n_ctx
        sd = model.state_dict()
        self.tok = sd["tok.weight"].float()
        self.output = Q8Weight(self.tok)  # tied: llama.cpp reuses token_embd as the output matrix
        self.norm = sd["norm.weight"].float()
        self.layers = []
        for i in range(cfg.layers):
            g = lambda n: sd[f"blocks.{i}.{n}"]  # noqa: E731
            self.layers.append({
                "attn_norm": g("attn_norm.weight").float(), "ffn_norm": g("ffn_norm.weight").float(),
                **{n: Q8Weight(g(f"{n}.weight")) for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")},
            })
        self.eps = float(np.float32(cfg.eps))
        self.scale = float(np.float32(1.0) / np.sqrt(np.float32(self.hd)))
        # ggml_rope_cache_init: theta_scale = powf(freq_base, -2/n_dims), theta *= theta_scale per pair.
        self.theta_scale = np.float32(np.float64(np.float32(cfg.rope_base))
                                      ** np.float64(np.float32(-2.0) / np.float32(self.hd)))
        cos, sin = self.rope_cache(n_ctx)
        self.cos, self.sin = torch.from_numpy(cos), torch.from_numpy(sin)

    # --- ops ----------------------------------------------------------------
    @staticmethod
    def mm(x, w: "Q8Weight"):
        return w.matmul(x)

    def rope_cache(self, n: int):
        """ggml_rope_cache_init for positions 0..n-1: theta = p * theta_scale^i by repeated f32 products, libm cosf/sinf."""
        theta = np.arange(n, dtype=np.float32)
        ts = np.float32(self.theta_scale)
        thetas = []
        for _ in range(self.hd // 2):
            thetas.append(theta)
            theta = (theta * ts).astype(np.float32)
        th = np.stack(thetas, -1)
        return libm_f32("cosf", th), libm_f32("sinf", th)

    def rope(self, x, pos):
        """ggml rope, normal mode (adjacent pairs), x: (T, H, D), pos: (T,) int.

        rotate_pairs computes x0*cos - x1*sin and x0*sin + x1*cos; the compiler
        contracts each into one fma with the other product rounded first.
        """
        import torch

        cos = self.cos[pos][:, None, :]
        sin = self.sin[pos][:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = torch.stack([_fma(x0, cos, -(x1 * sin)), _fma(x0, sin, x1 * cos)], -1)
        return out.reshape(x.shape)

    def n_kv(self, used: int) -> int:
        return min(self.n_ctx, max(KV_PAD, (used + KV_PAD - 1) // KV_PAD * KV_PAD))

    def attn_tiled(self, q, K, V, pos, n_kv):
        """ggml_compute_forward_flash_attn_ext_tiled: q (R, H, D) f32, K/V (n_ctx, Hkv, D) f16-valued.

        Per 64-key tile: KQ by simd_gemm (an f32 fma chain over the head
        dimension, starting from 0), scaled and masked; online softmax with
        ggml_v_expf and ggml_vec_soft_max_f32's summation; VKQ += P V by
        simd_gemm (an fma chain over the tile's keys, in key order).
        """
        import torch

        rep = self.cfg.heads // self.cfg.kv_heads
        R, H, D = q.shape
        nk = min(n_kv, int(pos.max()) + 1)  # later cells are masked for every row
        nk_pad = (nk + FA_TILE_KV - 1) // FA_TILE_KV * FA_TILE_KV
        Kh = K[:nk].transpose(0, 1).repeat_interleave(rep, 0).double()  # (H, nk, D)
        Vh = V[:nk].transpose(0, 1).repeat_interleave(rep, 0).double()
        qh = q.transpose(0, 1).double()  # (H, R, D)
        acc = torch.zeros((H, R, nk), dtype=torch.float64)
        buf = torch.empty((H, R, nk), dtype=torch.float32)
        for d in range(D):
            acc.addcmul_(qh[:, :, d, None], Kh[:, None, :, d])
            buf.copy_(acc)
            acc.copy_(buf)
        kq = buf * self.scale
        visible = torch.arange(nk)[None, :] <= pos[:, None]  # causal mask (0 or -inf)
        kq = kq.masked_fill(~visible[None], float("-inf"))
        if nk_pad > nk:
            kq = torch.nn.functional.pad(kq, (0, nk_pad - nk), value=float("-inf"))
            Vh = torch.nn.functional.pad(Vh, (0, 0, 0, nk_pad - nk))
        M = torch.full((H, R), float("-inf"))
        S = torch.zeros((H, R))
        vkq = torch.zeros((H, R, D), dtype=torch.float64)
        vbuf = torch.zeros((H, R, D), dtype=torch.float32)
        for t0 in range(0, nk_pad, FA_TILE_KV):
            t = kq[:, :, t0:t0 + FA_TILE_KV]
            tmax = t.amax(-1)
            skip = tmax == float("-inf")
            if bool(skip.all()):
                continue
            mnew = torch.maximum(M, tmax)
            upd = (mnew > M) & ~skip
            if bool(upd.any()):
                ms = _expf(torch.where(upd, M - mnew, torch.zeros_like(M)))
                vbuf = torch.where(upd[..., None], vbuf * ms[..., None], vbuf)
                S = torch.where(upd, S * ms, S)
            M = torch.where(skip, M, mnew)
            p = v_expf(t - torch.where(skip, torch.zeros_like(M), M)[..., None])
            p = torch.where(skip[..., None], torch.zeros_like(p), p)
            g = p.reshape(H, R, FA_TILE_KV // 8, 8)
            a = g[..., 4:] + g[..., :4]
            part = ((a[..., 0] + a[..., 2]) + (a[..., 1] + a[..., 3])).double()
            tot = torch.zeros((H, R), dtype=torch.float64)
            for j in range(FA_TILE_KV // 8):
                tot = tot + part[..., j]
            S = torch.where(skip, S, (S.double() + tot).float())
            p64 = p.double()
            vkq.copy_(vbuf)
            for kk in range(FA_TILE_KV):
                vkq.addcmul_(p64[:, :, kk, None], Vh[:, None, t0 + kk, :])
                vbuf.copy_(vkq)
                vkq.copy_(vbuf)
        inv = torch.where(S == 0, torch.zeros_like(S), _recip(S))
        return (vbuf * inv[..., None]).transpose(0, 1)  # (R, H, D)

    def _chunk_streams(self, q, K, V, pos, lo, hi):
        """Scores and V rows of the one-row kernel for keys [lo, hi): (R*H, hi-lo) and (R*H, hi-lo, D)."""
        import torch

        rep = self.cfg.heads // self.cfg.kv_heads
        R, H, D = q.shape
        qh = _f16(q)  # Q converted to the K type (F16)
        Kc = K[lo:hi].transpose(0, 1).repeat_interleave(rep, 0)  # (H, L, D)
        Vc = V[lo:hi].transpose(0, 1).repeat_interleave(rep, 0)
        s = vec_dot_f16(qh.transpose(0, 1)[:, :, None, :], Kc[:, None, :, :]) * self.scale  # (H, R, L)
        visible = torch.arange(lo, hi)[None, :] <= pos[:, None]  # (R, L)
        s = s.masked_fill(~visible[None], float("-inf"))
        L = hi - lo
        return s.reshape(H * R, L), Vc[:, None].expand(H, R, L, D).reshape(H * R, L, D)

    def attn_one_chunk(self, q, K, V, pos, n_kv):
        """ggml_compute_forward_flash_attn_ext_f16_one_chunk over all keys, normalized: (R, H, D)."""
        import torch

        R, H, D = q.shape
        outs = []
        step = 8
        for r0 in range(0, R, step):
            qs, ps = q[r0:r0 + step], pos[r0:r0 + step]
            hi = min(n_kv, int(ps.max()) + 1)
            s, v = self._chunk_streams(qs, K, V, ps, 0, hi)
            _, S, y = online_softmax_f16(s, v)
            y = torch.from_numpy(y)
            S = torch.from_numpy(S)
            inv = torch.where(S == 0, torch.zeros_like(S), _recip(S))
            outs.append((y * inv[:, None]).reshape(H, -1, D).transpose(0, 1))
        return torch.cat(outs, 0)

    def attn_split(self, q, K, V, pos, n_kv):
        """Single-token decode over >= 512 cells: per-thread KV chunks, then ggml_flash_attn_ext_reduce_partials."""
        import torch

        R, H, D = q.shape
        assert R == 1
        cs = (n_kv + self.n_threads - 1) // self.n_threads
        used = int(pos.max()) + 1
        chunks = [(lo, min(lo + cs, n_kv)) for lo in range(0, n_kv, cs)]
        chunks = [(lo, min(hi, used)) for lo, hi in chunks if lo < used]
        L = max(hi - lo for lo, hi in chunks)
        ss, vv = [], []
        for lo, hi in chunks:
            s, v = self._chunk_streams(q, K, V, pos, lo, hi)
            if hi - lo < L:
                s = torch.nn.functional.pad(s, (0, L - (hi - lo)), value=float("-inf"))
                v = torch.nn.functional.pad(v, (0, 0, 0, L - (hi - lo)))
            ss.append(s)
            vv.append(v)
        M, S, y = online_softmax_f16(torch.cat(ss, 0), torch.cat(vv, 0))
        B = H * R
        Mf = np.full(B, -np.inf, dtype=np.float32)
        Sf = np.zeros(B, dtype=np.float32)
        yf = np.zeros((B, D), dtype=np.float32)
        for c in range(len(chunks)):
            Mc, Sc, yc = M[c * B:(c + 1) * B], S[c * B:(c + 1) * B], y[c * B:(c + 1) * B]
            live = Sc != 0
            mnew = np.maximum(Mf, Mc)
            with np.errstate(invalid="ignore"):
                so = glibc_expf(np.where(live, Mf - mnew, np.float32(0.0)))  # expf(-inf) = 0 for the first
                sn = glibc_expf(np.where(live, Mc - mnew, np.float32(0.0)))
            # VKQ = VKQ*scale_old + VKQ_chunk*scale_new, contracted to fma(VKQ, scale_old, VKQ_chunk*scale_new)
            ynew = (yf.astype(np.float64) * so[:, None] + (yc * sn[:, None]).astype(np.float64)).astype(np.float32)
            snew = (Sf.astype(np.float64) * so + (Sc * sn).astype(np.float64)).astype(np.float32)
            yf = np.where(live[:, None], ynew, yf)
            Sf = np.where(live, snew, Sf)
            Mf = np.where(live, mnew, Mf)
        inv = np.where(Sf != 0, np.float32(1.0) / np.where(Sf != 0, Sf, np.float32(1.0)), np.float32(0.0))
        out = yf * inv[:, None]
        return torch.from_numpy(out.astype(np.float32)).reshape(H, R, D).transpose(0, 1)

    def attention(self, q, K, V, pos, used, R: int):
        """Flash attention of the ubatch's rows q (a subset of its R rows) over cells [0, used)."""
        n_kv = self.n_kv(used)
        if R == 1 and n_kv >= FA_SPLIT_KV_MIN:
            return self.attn_split(q, K, V, pos, n_kv)
        if R >= FA_TILE_Q:
            return self.attn_tiled(q, K, V, pos, n_kv)
        return self.attn_one_chunk(q, K, V, pos, n_kv)

    # --- model ----------------------------------------------------------------
    def new_cache(self):
        import torch

        shape = (self.n_ctx, self.cfg.kv_heads, self.hd)
        return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(self.cfg.layers)]

    def ubatch(self, cache, ids, start: int, want_logits: bool):
        """One llama_decode ubatch at positions start.. ; logits of its last token (or None)."""
        import torch

        cfg, hd = self.cfg, self.hd
        T = len(ids)
        pos = torch.arange(start, start + T)
        x = self.tok[torch.tensor(ids)]
        for li, L in enumerate(self.layers):
            h = rms_norm(x, L["attn_norm"], self.eps)
            k = self.rope(self.mm(h, L["wk"]).view(T, cfg.kv_heads, hd), pos)
            v = self.mm(h, L["wv"]).view(T, cfg.kv_heads, hd)
            K, V = cache[li]
            K[start:start + T] = _f16(k)  # the cache is F16
            V[start:start + T] = _f16(v)
            rows = slice(None)
            if li == cfg.layers - 1:
                # llama.cpp keeps only the output row after the last attention; every
                # op here is row-wise, so only that row is computed (with the kernel
                # choice of the whole ubatch).
                if not want_logits:
                    return None
                rows = slice(T - 1, T)
                x, h = x[rows], h[rows]
            q = self.rope(self.mm(h, L["wq"]).view(-1, cfg.heads, hd), pos[rows])
            a = self.attention(q, K, V, pos[rows], start + T, T)
            x = x + self.mm(a.reshape(a.shape[0], -1), L["wo"])
            h = rms_norm(x, L["ffn_norm"], self.eps)
            x = x + self.mm(silu_mul(self.mm(h, L["w_gate"]), self.mm(h, L["w_up"])), L["w_down"])
        h = rms_norm(x, self.norm, self.eps)
        return self.mm(h, self.output)[-1]

    def prefill(self, cache, ids):
        logits = None
        for s0 in range(0, len(ids), self.n_ubatch):
            chunk = ids[s0:s0 + self.n_ubatch]
            logits = self.ubatch(cache, chunk, s0, s0 + len(chunk) == len(ids))
        return logits

    def greedy(self, prompt_ids, end_id: int, max_new: int):
        """(tokens, top-1 minus top-2 logit gap per token)."""
        cache = self.new_cache()
        logits = self.prefill(cache, list(prompt_ids))
        out, gaps = [], []
        pos = len(prompt_ids)
        for _ in range(max_new):
            top = logits.topk(2)
            t = int(logits.argmax())
            out.append(t)
            gaps.append(float(top.values[0] - top.values[1]))
            if t == end_id or pos >= self.n_ctx:
                break
            logits = self.ubatch(cache, [t], pos, True)
            pos += 1
        return out, gaps


# ---------------------------------------------------------------------------


def run_tier(tier: str, models: str, fixtures: str, modes: list[str], cases: list[int] | None,
             write: bool, shard: tuple[int, int] | None = None, shard_out: str | None = None) -> None:
    import torch

    path = os.path.join(fixtures, f"greedy-{tier}.json")
    with open(path) as f:
        fx = json.load(f)
    model, cfg, meta = load_model(os.path.join(models, f"{tier}-q8_0.gguf"))
    end_id = int(meta["tokenizer.ggml.eos_token_id"])
    max_new = int(fx["max_new"])
    emu = GgmlCpu(model, cfg)
    idx = cases if cases is not None else list(range(len(fx["cases"])))
    if shard is not None:
        idx = [i for i in idx if i % shard[1] == shard[0]]
    done: dict[str, dict] = {}
    t0 = time.time()
    agree = {m: 0 for m in modes}
    for n, i in enumerate(idx):
        case = fx["cases"][i]
        ids = case["prompt_ids"]
        if "q8w" in modes:
            case["q8w"] = greedy(model, ids, torch.device("cpu"), end_id, max_new)
        if "ggml" in modes:
            toks, gaps = emu.greedy(ids, end_id, max_new)
            case["ggml"] = toks
            case["ggml_gap"] = [round(g, 6) for g in gaps]
        for m in modes:
            agree[m] += case[m] == case["fp32"]
        line = f"[{tier}] case {i} ({n + 1}/{len(idx)}, {time.time() - t0:.0f}s)"
        for m in modes:
            line += f" {m}{'=' if case[m] == case['fp32'] else '!'}fp32"
        if "ggml" in modes:
            line += f" min-gap {min(case['ggml_gap']):.4g}"
        print(line, flush=True)
        if shard_out:
            # Rewritten after every case, so a run cut short keeps what it finished.
            done[str(i)] = {k: case[k] for k in ("q8w", "ggml", "ggml_gap") if k in case}
            with open(shard_out + ".tmp", "w") as f:
                json.dump({"tier": tier, "cases": done}, f, separators=(",", ":"))
            os.replace(shard_out + ".tmp", shard_out)
    summary = ", ".join(f"{m} == fp32 on {agree[m]}/{len(idx)}" for m in modes)
    if "ggml" in modes and "q8w" in modes:
        summary += f", ggml == q8w on {sum(fx['cases'][i]['ggml'] == fx['cases'][i]['q8w'] for i in idx)}/{len(idx)}"
    print(f"[{tier}] {summary}", flush=True)
    if shard_out:
        return
    if write:
        if cases is not None:
            print(f"[{tier}] --cases given: {path} not written", flush=True)
            return
        with open(path, "w") as f:
            json.dump(fx, f, separators=(",", ":"))
        print(f"[{tier}] wrote {path}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tier", action="append", choices=sorted(TIERS), help="tier(s) to process (default: all)")
    ap.add_argument("--models", default=MODELS, help="folder with <tier>-q8_0.gguf")
    ap.add_argument("--fixtures", default=FIXTURES, help="folder with greedy-<tier>.json")
    ap.add_argument("--modes", default="ggml,q8w", help="comma-separated subset of ggml,q8w")
    ap.add_argument("--cases", default=None, help="comma-separated case indices (implies no write)")
    ap.add_argument("--no-write", action="store_true", help="print agreement only, leave the fixtures alone")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--shard", default=None, help="K/N: only cases with index %% N == K (parallel runs)")
    ap.add_argument("--shard-out", default=None, help="write this shard's references to FILE instead of the fixture")
    ap.add_argument("--merge", nargs="+", default=None, help="shard files to merge into the fixtures, then exit")
    a = ap.parse_args()
    if a.merge:
        merge_shards(a.merge, a.fixtures)
        return
    import torch

    torch.set_num_threads(a.threads)
    torch.use_deterministic_algorithms(True)
    modes = [m for m in a.modes.split(",") if m]
    for m in modes:
        if m not in ("ggml", "q8w"):
            ap.error(f"unknown mode {m}")
    cases = [int(c) for c in a.cases.split(",")] if a.cases else None
    if "ggml" in modes:
        print(check_libm(), flush=True)
    shard = tuple(int(x) for x in a.shard.split("/")) if a.shard else None
    for tier in a.tier or sorted(TIERS):
        run_tier(tier, a.models, a.fixtures, modes, cases, not a.no_write, shard, a.shard_out)


def merge_shards(files: list[str], fixtures: str) -> None:
    """Adds the references of `--shard-out` files to the fixtures they belong to."""
    by_tier: dict[str, dict[str, dict]] = {}
    for p in files:
        with open(p) as f:
            d = json.load(f)
        by_tier.setdefault(d["tier"], {}).update(d["cases"])
    for tier, cases in sorted(by_tier.items()):
        path = os.path.join(fixtures, f"greedy-{tier}.json")
        with open(path) as f:
            fx = json.load(f)
        for i, fields in cases.items():
            fx["cases"][int(i)].update(fields)
        with open(path, "w") as f:
            json.dump(fx, f, separators=(",", ":"))
        print(f"[{tier}] merged {len(cases)}/{len(fx['cases'])} cases into {path}", flush=True)


if __name__ == "__main__":
    main()
