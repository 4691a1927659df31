"""Cascade thresholds for a real model pair, chosen on a tuning split and reported on a
held-out one, from one `evals/bfcl_calls.py` run (no new requests).

    python evals/cascade_split.py --run RUN.json --small qwen05 --always cascade-always \
        --params qwen05=494.03e6,qwen15=1543.71e6 --out OUT.json

RUN.json holds, per BFCL question, two servers' replies: `--small`, the cascade's first tier
alone, and `--always`, the cascade with a margin threshold no answer reaches (every question
goes on to the large tier; its reply is the large tier's answer, and its `mesh.cascade` steps
carry the first tier's verdict and smallest token margin). A cascade with threshold T keeps
the first tier's answer when its verdict was only the margin (well-formed output, no unknown
tool, not truncated) and its smallest margin is at least T; else the large tier answers.

Compute per question is (prompt + generated tokens) x parameters, summed over the tiers the
question visited (the cascade's own measure, docs/cascade.md).

The threshold: on the tuning half (the sample's even positions), the smallest T whose accuracy
is within `--slack` points of the large tier's on that half (fewest escalations that keep the
accuracy); then every figure is reported on the held-out half (odd positions).

With `--signals RUN2.json` (a `bfcl_calls.py --logprobs` run of the first tier alone, same
sample) other margin signals are compared the same way, each with its own threshold: the
smallest margin over every token (what mesh's cascade reads), over the tokens that are not
format (punctuation, quotes, braces, fences, end and marker tokens), over the function
names' tokens, and the first token's margin; and the oracle (keep exactly the first tier's
correct answers) as the bound.

With `--real RUN3.json --real-server NAME` (a `bfcl_calls.py --split heldout` run of a cascade
configured with the chosen signal and threshold) the served cascade's own held-out figures are
added: accuracy, compute from its `mesh.cascade` steps, the share the first tier answered.
"""

import re

import argparse
import json


def records(run, small, always, params):
    """Per question: first tier's correctness, tokens and signals; the large tier's answer."""
    tiers = None
    out = []
    for i, row in enumerate(run["rows"]):
        s, a = row["servers"][small], row["servers"][always]
        steps = (a.get("mesh") or {}).get("cascade") or []
        if len(steps) != 2 or "prompt_tokens" not in s:
            raise SystemExit(f"{row['id']}: needs both servers' replies and two cascade steps")
        tiers = tiers or [steps[0]["tier"], steps[1]["tier"]]
        out.append({
            "id": row["id"], "category": row["category"],
            "small_ok": s["ok"], "large_ok": a["ok"],
            "prompt": s["prompt_tokens"],
            "small_gen": steps[0]["completion_tokens"], "large_gen": steps[1]["completion_tokens"],
            "structural_ok": steps[0]["verdict"] == "low_margin",
            "verdict": steps[0]["verdict"],
            "margin": steps[0]["min_margin"] if steps[0]["min_margin"] is not None else float("inf"),
        })
    p = [params[t] for t in tiers]
    for r in out:
        r["small_cost"] = (r["prompt"] + r["small_gen"]) * p[0]
        r["large_cost"] = (r["prompt"] + r["large_gen"]) * p[1]
    return tiers, out


def cascade(rs, t):
    """Accuracy, compute and the first tier's share of a cascade with margin threshold t."""
    ok = cost = kept = 0
    for r in rs:
        keep = r["structural_ok"] and r["margin"] >= t
        kept += keep
        ok += r["small_ok"] if keep else r["large_ok"]
        cost += r["small_cost"] + (0 if keep else r["large_cost"])
    n = max(1, len(rs))
    return {"accuracy": ok / n, "compute": cost / n, "first_tier_share": kept / n}


def alone(rs, which):
    n = max(1, len(rs))
    return {"accuracy": sum(r[f"{which}_ok"] for r in rs) / n,
            "compute": sum(r[f"{which}_cost"] for r in rs) / n}


def choose(rs, slack):
    """The smallest threshold whose accuracy is within `slack` of the large tier's."""
    target = alone(rs, "large")["accuracy"] - slack
    candidates = sorted({0.0} | {r["margin"] for r in rs if r["margin"] != float("inf")} | {float("inf")})
    for t in candidates:
        if cascade(rs, t)["accuracy"] >= target - 1e-12:
            return t
    return float("inf")


FORMAT = re.compile(r"^[\s{}\[\]\"':,`]*$")


def margins(lp):
    """(token, margin) per generated token; the runner-up missing counts as a sure token."""
    return [(t, (a - b) if b is not None else float("inf")) for t, a, b in lp]


def signals(lp):
    """The margin signals of one reply's token logprobs."""
    ms = margins(lp)
    if not ms:
        return {"all": float("inf"), "content": float("inf"), "name": float("inf"), "first": float("inf")}
    text, spans = "", []
    for t, m in ms:
        spans.append((len(text), len(text) + len(t), m))
        text += t
    names = [(m.start(1), m.end(1)) for m in re.finditer(r'"name"\s*:\s*"([^"]+)"', text)]
    in_name = [m for a, b, m in spans if any(a < e and b > s for s, e in names)]
    content = [m for t, m in ms if not FORMAT.match(t) and not (t.startswith("<|") or t.startswith("<tool"))]
    inf = float("inf")
    return {"all": min(m for _, m in ms), "content": min(content, default=inf),
            "name": min(in_name, default=inf), "first": ms[0][1]}


def compare_signals(rs, run2, small, slack):
    """Each signal's threshold on the tuning half and its held-out figures."""
    by_id = {row["id"]: row["servers"][small] for row in run2["rows"]}
    for r in rs:
        lp = (by_id.get(r["id"]) or {}).get("logprobs") or []
        r["signals"] = signals(lp)
    out = {}
    for name in ["all", "content", "name", "first"]:
        for r in rs:
            r["margin"] = r["signals"][name]
        tune = [r for r in rs if r["position"] % 2 == 0]
        held = [r for r in rs if r["position"] % 2 == 1]
        t = choose(tune, slack)
        out[name] = {"threshold": t, "tuning": cascade(tune, t), "heldout": cascade(held, t)}
    held = [r for r in rs if r["position"] % 2 == 1]
    n = max(1, len(held))
    out["oracle"] = {"heldout": {
        "accuracy": sum(r["small_ok"] or r["large_ok"] for r in held) / n,
        "compute": sum(r["small_cost"] + (0 if r["small_ok"] else r["large_cost"]) for r in held) / n,
        "first_tier_share": sum(r["small_ok"] for r in held) / n}}
    return out


def served(run, name, params, tiers):
    """Accuracy, compute and first-tier share of a served cascade's replies."""
    ok = cost = first = 0
    rows = run["rows"]
    for row in rows:
        s = row["servers"][name]
        steps = [t for t in ((s.get("mesh") or {}).get("cascade") or []) if t["verdict"] != "unavailable"]
        ok += s["ok"]
        per_tier_prompt = (s.get("prompt_tokens") or 0) / max(1, len(steps))
        cost += sum((per_tier_prompt + t["completion_tokens"]) * params[t["tier"]] for t in steps)
        first += len(steps) == 1 and steps[0]["tier"] == tiers[0]
    n = max(1, len(rows))
    return {"n": len(rows), "accuracy": ok / n, "compute": cost / n, "first_tier_share": first / n}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", required=True)
    ap.add_argument("--small", required=True, help="server name of the first tier alone")
    ap.add_argument("--always", required=True, help="server name of the always-escalating cascade")
    ap.add_argument("--params", required=True, help="TIER=PARAMETERS,... for both tiers")
    ap.add_argument("--slack", type=float, default=0.01, help="accuracy points given up on the tuning half")
    ap.add_argument("--signals", help="a bfcl_calls.py --logprobs run of the first tier alone")
    ap.add_argument("--real", help="a bfcl_calls.py --split heldout run of a configured cascade")
    ap.add_argument("--real-server", default="cascade", help="its server name in that run")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    run = json.load(open(a.run))
    params = {k: float(v) for k, v in (p.split("=") for p in a.params.split(","))}
    # Positions within each category's sample: even = tuning, odd = held-out.
    seen = {}
    for row in run["rows"]:
        row["position"] = seen.get(row["category"], 0)
        seen[row["category"]] = row["position"] + 1
    tiers, rs = records(run, a.small, a.always, params)
    for r, row in zip(rs, run["rows"]):
        r["position"] = row["position"]
    tune = [r for r in rs if r["position"] % 2 == 0]
    held = [r for r in rs if r["position"] % 2 == 1]
    t = choose(tune, a.slack)
    result = {"tiers": tiers, "params": params, "slack": a.slack, "threshold": t,
              "tuning": {"n": len(tune), "small": alone(tune, "small"), "large": alone(tune, "large"),
                         "cascade": cascade(tune, t)},
              "heldout": {"n": len(held), "small": alone(held, "small"), "large": alone(held, "large"),
                          "cascade": cascade(held, t)},
              "per_category_heldout": {}}
    for cat in sorted({r["category"] for r in held}):
        rc = [r for r in held if r["category"] == cat]
        result["per_category_heldout"][cat] = {"n": len(rc), "small": alone(rc, "small"),
                                               "large": alone(rc, "large"), "cascade": cascade(rc, t)}
    verdicts = {}
    for r in rs:
        verdicts[r["verdict"]] = verdicts.get(r["verdict"], 0) + 1
    result["first_tier_verdicts_all"] = verdicts
    if a.signals:
        result["signals"] = compare_signals(rs, json.load(open(a.signals)), a.small, a.slack)
    if a.real:
        result["served"] = served(json.load(open(a.real)), a.real_server, params, tiers)
    json.dump(result, open(a.out, "w"), indent=1)
    h = result["heldout"]
    large = h["large"]["compute"]
    print(f"threshold {t} (chosen on {len(tune)} tuning questions, slack {a.slack:.0%})")
    print(f"held-out, {len(held)} questions:")
    print("| | accuracy | compute per task | vs large tier | first tier answered |")
    print("|---|---:|---:|---:|---:|")
    for name, v in [(f"{tiers[0]} alone", h["small"]), (f"{tiers[1]} alone", h["large"]),
                    ("cascade", h["cascade"])]:
        share = f"{v['first_tier_share']:.0%}" if "first_tier_share" in v else ""
        print(f"| {name} | {v['accuracy']:.1%} | {v['compute']:.3g} | {v['compute'] / large:.2f}x | {share} |")
    if a.real:
        v = result["served"]
        print(f"| served cascade ({v['n']} questions) | {v['accuracy']:.1%} | {v['compute']:.3g} | "
              f"{v['compute'] / large:.2f}x | {v['first_tier_share']:.0%} |")
    if a.signals:
        print()
        print("held-out, by escalation signal (threshold chosen on the tuning half):")
        print("| signal | threshold | accuracy | compute vs large tier | first tier answered |")
        print("|---|---:|---:|---:|---:|")
        for name, v in result["signals"].items():
            h = v["heldout"]
            print(f"| {name} | {v.get('threshold', '')} | {h['accuracy']:.1%} | "
                  f"{h['compute'] / large:.2f}x | {h['first_tier_share']:.0%} |")


if __name__ == "__main__":
    main()
