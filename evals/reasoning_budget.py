"""The reasoning governor on a model that thinks: the same questions at several
`reasoning_budget`s, with the tokens spent inside the think span, whether the governor
closed it, the answer's accuracy and the time per reply.

    python evals/reasoning_budget.py --base http://127.0.0.1:8093 --model qwen05 \
        [--budgets none,16,32,64] [--n 24] [--max-tokens 256] [--out OUT.json]

The questions are generated here with their answers, so nothing is fetched: multi-step
arithmetic ("17 boxes of 23 pens, 45 given away: how many are left?") and clock times
("leaves at 9:40, takes 2 h 35 min: when does it arrive?"), half each, seeded. A reply is
right when the text after its think span contains the answer (`412`, `12:15`). Requests are
greedy and one at a time.
"""

import argparse
import json
import random
import sys
import time
import urllib.request


def questions(n, seed=7):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            a, b = rng.randint(12, 49), rng.randint(12, 49)
            c = rng.randint(10, a * b // 2)
            out.append((f"A shop has {a} boxes of {b} pens and gives away {c} pens. "
                        f"How many pens are left? Think it through, then give the number.",
                        str(a * b - c)))
        else:
            h, m = rng.randint(6, 20), rng.randrange(0, 60, 5)
            dh, dm = rng.randint(1, 3), rng.randrange(5, 60, 5)
            t = (h * 60 + m + dh * 60 + dm) % (24 * 60)
            out.append((f"A train leaves at {h}:{m:02d} and the trip takes {dh} hours "
                        f"{dm} minutes. At what time (HH:MM, 24-hour clock) does it arrive? "
                        f"Think it through, then give the time.",
                        f"{t // 60}:{t % 60:02d}"))
    return out


def ask(base, model, q, budget, max_tokens):
    body = {"model": model, "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": q}]}
    if budget is not None:
        body["reasoning_budget"] = budget
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=600) as r:
        v = json.load(r)
    return v, time.monotonic() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--budgets", default="none,16,32,64")
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", default="bench-results/reasoning-budget.json")
    a = ap.parse_args()
    qs = questions(a.n)
    rows, runs = [], {}
    for b in a.budgets.split(","):
        budget = None if b == "none" else int(b)
        res = []
        for q, want in qs:
            v, s = ask(a.base, a.model, q, budget, a.max_tokens)
            m = v["choices"][0]["message"]
            u = v["usage"]
            content = (m.get("content") or "").replace(",", "")
            r = {"question": q, "answer": want, "content": m.get("content"),
                 "reasoning": m.get("reasoning_content"),
                 "reasoning_tokens": u["completion_tokens_details"]["reasoning_tokens"],
                 "completion_tokens": u["completion_tokens"],
                 "capped": bool(v.get("mesh", {}).get("reasoning_capped")),
                 "finish": v["choices"][0]["finish_reason"],
                 "right": want in content, "seconds": s}
            res.append(r)
            print(f"[budget {b}] {len(res)}/{len(qs)} think {r['reasoning_tokens']} "
                  f"{'right' if r['right'] else 'wrong'}", file=sys.stderr)
        n = len(res)
        runs[b] = res
        rows.append({
            "budget": b,
            "right": sum(r["right"] for r in res),
            "n": n,
            "think_mean": sum(r["reasoning_tokens"] for r in res) / n,
            "think_max": max(r["reasoning_tokens"] for r in res),
            "capped": sum(r["capped"] for r in res),
            "completion_mean": sum(r["completion_tokens"] for r in res) / n,
            "hit_max_tokens": sum(r["finish"] == "length" for r in res),
            "seconds_mean": sum(r["seconds"] for r in res) / n,
        })
    with open(a.out, "w") as f:
        json.dump({"model": a.model, "max_tokens": a.max_tokens, "summary": rows, "runs": runs},
                  f, indent=1)
    print(f"\n{a.n} questions, max_tokens {a.max_tokens}; data: {a.out}")
    print("| reasoning_budget | right | think tokens mean / max | capped | completion tokens mean "
          "| hit max_tokens | s / reply |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['budget']} | {r['right']}/{r['n']} | {r['think_mean']:.0f} / {r['think_max']} "
              f"| {r['capped']} | {r['completion_mean']:.0f} | {r['hit_max_tokens']} "
              f"| {r['seconds_mean']:.1f} |")


if __name__ == "__main__":
    main()
