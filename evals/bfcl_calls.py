"""Tool-call accuracy on the Berkeley Function-Calling Leaderboard (BFCL) through
OpenAI-compatible servers, graded by BFCL's own AST checker, side by side.

    python evals/bfcl_calls.py --bfcl DIR --server mesh=http://127.0.0.1:8080,qwen05 \
        --server llama-server=http://127.0.0.1:8081,qwen05 --per-category 100 --out OUT.json

DIR is the unpacked `bfcl-eval` wheel (`scripts/fetch-bfcl.sh` prints its data folder; pass
the folder holding `bfcl_eval/`). Categories: BFCL's `simple_python` (simple), `multiple`
and `parallel`, Python, single turn. Each question goes to every server as one chat request
with the question's functions as tools (names with `.` written with `_`, BFCL's types mapped
to JSON schema's, as BFCL's OpenAI handler does), `tool_choice` auto, greedy, 512 tokens at
most. The calls a server returns are graded with `bfcl_eval.eval_checker.ast_eval.ast_checker`,
unmodified (imported from the wheel; its model table and the Java/JavaScript parsers it
imports are stubbed, the Python path never uses them). A reply without tool calls scores 0.

Also written, per question and server: the prompt and completion tokens the server counted
(usage), so the same request's prompt can be compared across servers, and mesh's own `mesh`
field of the reply when there is one (a cascade's steps, verdicts and margins).

The sample: the first question of each category and then every k-th (k = size / n), the same
questions on every server and every run. `--split tune` keeps the sample's even positions
(0, 2, ...), `--split heldout` its odd ones: two disjoint halves for choosing thresholds on one
and reporting them on the other (`evals/cascade_split.py`).
"""

import argparse
import json
import os
import sys
import time
import types
import urllib.request

TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": "string", "list": "array",
         "bool": "boolean", "byte": "integer", "short": "integer", "long": "integer",
         "double": "number", "char": "string"}
CATEGORIES = {"simple": "simple_python", "multiple": "multiple", "parallel": "parallel"}


def load_checker(root):
    sys.path.insert(0, root)

    def stub(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m

    class Config:  # every OpenAI-style model: function names' `.` were sent as `_`
        underscore_to_dot = True

    class Table(dict):
        def __getitem__(self, _):
            return Config()

    class Inert:
        def __init__(self, *a, **k):
            pass

        def __getattr__(self, _):
            return lambda *a, **k: None

    stub("bfcl_eval.constants.model_config", MODEL_CONFIG_MAPPING=Table())
    stub("tree_sitter", Language=Inert, Parser=Inert)
    stub("tree_sitter_java", language=lambda: None)
    stub("tree_sitter_javascript", language=lambda: None)
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
    return ast_checker, Language.PYTHON


def schema(p):
    p = json.loads(json.dumps(p))
    if isinstance(p, dict):
        if isinstance(p.get("type"), str):
            p["type"] = TYPES.get(p["type"], p["type"])
        for k in ("properties",):
            if isinstance(p.get(k), dict):
                p[k] = {n: schema(v) for n, v in p[k].items()}
        if isinstance(p.get("items"), dict):
            p["items"] = schema(p["items"])
    return p


def tools_of(functions):
    out = []
    for f in functions:
        params = schema(f["parameters"])
        params["type"] = "object"
        out.append({"type": "function", "function": {
            "name": f["name"].replace(".", "_"), "description": f.get("description", ""),
            "parameters": params}})
    return out


def load(data, cat):
    name = CATEGORIES[cat]
    with open(os.path.join(data, f"BFCL_v4_{name}.json")) as f:
        qs = [json.loads(l) for l in f]
    with open(os.path.join(data, "possible_answer", f"BFCL_v4_{name}.json")) as f:
        answers = {a["id"]: a["ground_truth"] for a in map(json.loads, f)}
    return [(q, answers[q["id"]]) for q in qs]


def sample(items, n):
    if n <= 0 or n >= len(items):
        return items
    step = len(items) / n
    return [items[int(i * step)] for i in range(n)]


def ask(url, model, q, timeout, logprobs=False):
    body = {"model": model, "messages": q["question"][0], "tools": tools_of(q["function"]),
            "temperature": 0, "max_tokens": 512}
    if logprobs:
        body.update(logprobs=True, top_logprobs=2)
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json", "authorization": "Bearer none"})
    t0 = time.time()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        resp = json.load(r)
    return resp, time.time() - t0


def decoded(resp):
    calls = []
    for c in resp["choices"][0]["message"].get("tool_calls") or []:
        try:
            args = json.loads(c["function"]["arguments"])
        except (json.JSONDecodeError, TypeError):
            return None
        calls.append({c["function"]["name"]: args})
    return calls


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bfcl", required=True, help="folder holding bfcl_eval/ (the unpacked wheel)")
    ap.add_argument("--server", action="append", required=True, help="NAME=URL,MODEL (repeatable)")
    ap.add_argument("--categories", default="simple,multiple,parallel")
    ap.add_argument("--per-category", type=int, default=100, help="questions per category (0: all)")
    ap.add_argument("--split", choices=["all", "tune", "heldout"], default="all",
                    help="the sample's even (tune) or odd (heldout) positions")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--logprobs", action="store_true",
                    help="ask for each token's two likeliest and keep them (token, logprob, runner-up's)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    checker, python = load_checker(args.bfcl)
    data = os.path.join(args.bfcl, "bfcl_eval", "data")
    servers = []
    for s in args.server:
        name, rest = s.split("=", 1)
        url, model = rest.rsplit(",", 1)
        servers.append((name, url.rstrip("/"), model))
    rows = []
    for cat in args.categories.split(","):
        items = sample(load(data, cat), args.per_category)
        if args.split != "all":
            items = items[(args.split == "heldout")::2]
        for i, (q, truth) in enumerate(items):
            row = {"id": q["id"], "category": cat, "servers": {}}
            for name, url, model in servers:
                try:
                    resp, secs = ask(url, model, q, args.timeout, args.logprobs)
                    calls = decoded(resp)
                    if calls is None or not calls:
                        ok, why = False, "no parsable tool call"
                    else:
                        r = checker(q["function"], calls, truth, python, CATEGORIES[cat], "mesh_eval")
                        ok, why = r["valid"], ";".join(r.get("error", []))[:200]
                    row["servers"][name] = {
                        "ok": ok, "why": why, "calls": calls, "seconds": round(secs, 2),
                        "prompt_tokens": resp.get("usage", {}).get("prompt_tokens"),
                        "completion_tokens": resp.get("usage", {}).get("completion_tokens"),
                        "mesh": resp.get("mesh"),
                        "logprobs": [[t["token"], t["logprob"],
                                      (t.get("top_logprobs") or [{}, {}])[1:2][0].get("logprob")
                                      if len(t.get("top_logprobs") or []) > 1 else None]
                                     for t in ((resp["choices"][0].get("logprobs") or {}).get("content") or [])]
                        if args.logprobs else None,
                        "content": (resp["choices"][0]["message"].get("content") or "")[:200]}
                except Exception as e:  # a failed request scores 0 and is noted
                    row["servers"][name] = {"ok": False, "why": f"{type(e).__name__}: {e}"[:200]}
            rows.append(row)
            marks = " ".join(f"{n}:{'ok' if row['servers'][n]['ok'] else '--'}" for n, _, _ in servers)
            print(f"{cat:<9} {i + 1:>3}/{len(items)} {q['id']:<22} {marks}", flush=True)
    summary = {}
    for name, _, _ in servers:
        per = {}
        for cat in args.categories.split(","):
            rs = [r["servers"][name] for r in rows if r["category"] == cat]
            per[cat] = {"n": len(rs), "correct": sum(r["ok"] for r in rs),
                        "accuracy": round(sum(r["ok"] for r in rs) / max(1, len(rs)), 4)}
        summary[name] = per
    same = [r for r in rows if len(servers) > 1 and len({str(r["servers"][n].get("prompt_tokens")) for n, _, _ in servers}) == 1]
    result = {"servers": [{"name": n, "url": u, "model": m} for n, u, m in servers],
              "per_category": args.per_category, "split": args.split, "summary": summary,
              "same_prompt_tokens": f"{len(same)} of {len(rows)}", "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for name, per in summary.items():
        print(name, " ".join(f"{c} {v['correct']}/{v['n']} ({v['accuracy']:.1%})" for c, v in per.items()))
    if len(servers) > 1:
        print("same prompt token count:", result["same_prompt_tokens"])


if __name__ == "__main__":
    main()
