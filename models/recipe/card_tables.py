#!/usr/bin/env python3
"""Markdown tables for models/CARD.md from the JSON the model_card example writes.

    python3 models/recipe/card_tables.py models/card.json [--section exact|json|offered|names|tokens|all]
"""

from __future__ import annotations

import argparse
import json

SPLITS = ["heldout_requests", "heldout_tools"]
KINDS = ["call", "hard", "hard/arith", "hard/convert", "hard/choose", "hard/plan", "none", "result"]


def rows(card: dict):
    tiers = list(card["tiers"])
    for split in SPLITS + ["all"]:
        kinds = KINDS + [None] if split != "all" else [None]
        for kind in kinds:
            key = split if kind is None else f"{split}/{kind}"
            label_split = "both" if split == "all" else split
            label_kind = "**all**" if kind is None else ("&nbsp;&nbsp;" + kind if kind.startswith("hard/") else kind)
            groups = [card["tiers"][t]["groups"].get(key) for t in tiers]
            if all(g is None for g in groups):
                continue
            yield label_split, label_kind, groups


def pct(a, b):
    return "–" if not b else f"{a}/{b} ({100 * a / b:.0f}%)"


def exact_table(card):
    tiers = list(card["tiers"])
    out = ["| split | kind | n | " + " | ".join(tiers) + " |", "|---|---|---:|" + "---:|" * len(tiers)]
    for s, k, gs in rows(card):
        n = next(g["n"] for g in gs if g)
        cells = [f"{g['exact']} ({100 * g['exact'] / g['n']:.0f}%)" if g else "–" for g in gs]
        out.append(f"| {s} | {k} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def split_table(card, num, den):
    tiers = list(card["tiers"])
    out = ["| tier | heldout_requests | heldout_tools | all |", "|---|---:|---:|---:|"]
    for t in tiers:
        g = card["tiers"][t]["groups"]
        out.append(f"| {t} | " + " | ".join(pct(g[k][num], g[k][den]) for k in SPLITS + ["all"]) + " |")
    return "\n".join(out)


def names_table(card):
    tiers = list(card["tiers"])
    head = "| split | kind | " + " | ".join(f"{t} tool name | {t} calls at all" for t in tiers) + " |"
    out = [head, "|---|---|" + "---:|---:|" * len(tiers)]
    for s, k, gs in rows(card):
        if "result" in k:
            continue
        cells = []
        for g in gs:
            name = "–" if not g or not g["expects_call"] else f"{100 * g['tool_name_right'] / g['expects_call']:.0f}%"
            calls = "–" if not g else f"{100 * g['turns_with_call'] / g['n']:.0f}%"
            cells += [name, calls]
        out.append(f"| {s} | {k} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def tokens_table(card):
    tiers = list(card["tiers"])
    head = "| split | kind | " + " | ".join(f"{t} gen | {t} think" for t in tiers) + " |"
    out = [head, "|---|---|" + "---:|---:|" * len(tiers)]
    for s, k, gs in rows(card):
        cells = []
        for g in gs:
            cells += ["–", "–"] if not g else [f"{g['mean_generated_tokens']:.1f}", f"{g['mean_thinking_tokens']:.1f}"]
        out.append(f"| {s} | {k} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("card")
    ap.add_argument("--section", default="all", choices=["exact", "json", "offered", "names", "tokens", "all"])
    a = ap.parse_args()
    card = json.load(open(a.card))
    sections = {
        "exact": lambda: exact_table(card),
        "json": lambda: split_table(card, "calls_valid_json", "calls_emitted"),
        "offered": lambda: split_table(card, "calls_not_offered", "calls_valid_json"),
        "names": lambda: names_table(card),
        "tokens": lambda: tokens_table(card),
    }
    for name, f in sections.items():
        if a.section in (name, "all"):
            print(f())
            print()


if __name__ == "__main__":
    main()
