"""Write the held-out evaluation set used by the model card.

For each held-out split (`heldout_requests`: training tools, unseen requests;
`heldout_tools`: tools never shown in training) it draws N examples from
`corpus.generate(seed, N, split)` and writes one JSON object per line:

    {"kind": "call|hard|none|result", "sub": ..., "split": ...,
     "prompt": "...<|assistant|>", "completion": "...<|end|>"}

The default seed (2025) is distinct from the seeds used during training
(777 for train.py's quick eval, 4242 for the greedy references).

    python3 models/recipe/evalset.py --n 100 --out models/fixtures/eval-heldout.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402

SPLITS = ("heldout_requests", "heldout_tools")


def eval_set(n: int, seed: int = 2025) -> list[dict]:
    """N examples of each held-out split, in a fixed order."""
    rows = []
    for split in SPLITS:
        for ex in corpus.generate(seed, n, split):
            assert ex.prompt.endswith(corpus.AST) and ex.completion.endswith(corpus.END)
            rows.append({"kind": ex.kind, "sub": ex.sub, "split": split,
                         "prompt": ex.prompt, "completion": ex.completion})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100, help="examples per split")
    ap.add_argument("--seed", type=int, default=2025)
    ap.add_argument("--out", default="models/fixtures/eval-heldout.jsonl")
    a = ap.parse_args()
    rows = eval_set(a.n, a.seed)
    with open(a.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    counts: dict[str, int] = {}
    for r in rows:
        key = f"{r['split']}/{r['kind']}" + (f"/{r['sub']}" if r["kind"] == "hard" else "")
        counts[key] = counts.get(key, 0) + 1
    print(f"{len(rows)} examples -> {a.out}")
    for k in sorted(counts):
        print(f"  {k}: {counts[k]}")


if __name__ == "__main__":
    main()
