"""The prompt tokens mesh and llama.cpp's server make of the same chat request, token by
token.

    python evals/prompt_tokens.py --mesh http://127.0.0.1:8080 --llama http://127.0.0.1:8081 \
        --model qwen05 [--bfcl DIR --per-category N] --out OUT.json

mesh gives the ids its tier tokenized (`return_token_ids`, one generated token);
llama-server renders the same request with its `/apply-template` and tokenizes that text with
its `/tokenize` (special tokens parsed, BOS added as the model asks), which is what its chat
route does. The requests: the conversations of `tiers/tests/templates/cases.json` that use
only the weather tools (system prompts, tools, calls and results, parallel calls,
multi-turn) and, with `--bfcl`, BFCL questions with their functions as tools (the sample
`evals/bfcl_calls.py` uses).
"""

import argparse
import json
import os
import sys
import urllib.request

sys.path.insert(0, os.path.dirname(__file__))
import bfcl_calls  # noqa: E402  (the BFCL sample and tool conversion)


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def mesh_ids(base, model, messages, tools):
    body = {"model": model, "messages": messages, "max_tokens": 1, "temperature": 0,
            "return_token_ids": True}
    if tools:
        body["tools"] = tools
    return post(base + "/v1/chat/completions", body)["prompt_token_ids"]


def llama_ids(base, messages, tools):
    body = {"messages": messages}
    if tools:
        body["tools"] = tools
    prompt = post(base + "/apply-template", body)["prompt"]
    return post(base + "/tokenize", {"content": prompt, "add_special": True, "parse_special": True})["tokens"]


def requests_of(args):
    root = os.path.join(os.path.dirname(__file__), "..")
    with open(os.path.join(root, "tiers/tests/templates/cases.json")) as f:
        for c in json.load(f):
            if c.get("add_generation_prompt") is False or c.get("extra"):
                continue
            # OpenAI clients send arguments as JSON text.
            msgs = json.loads(json.dumps(c["messages"]))
            for m in msgs:
                for tc in m.get("tool_calls") or []:
                    if not isinstance(tc["function"]["arguments"], str):
                        tc["function"]["arguments"] = json.dumps(tc["function"]["arguments"])
            yield c["name"], msgs, c.get("tools")
    if args.bfcl:
        data = os.path.join(args.bfcl, "bfcl_eval", "data")
        for cat in ("simple", "multiple", "parallel"):
            for q, _ in bfcl_calls.sample(bfcl_calls.load(data, cat), args.per_category):
                yield q["id"], q["question"][0], bfcl_calls.tools_of(q["function"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mesh", required=True)
    ap.add_argument("--llama", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--bfcl")
    ap.add_argument("--per-category", type=int, default=30)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for name, msgs, tools in requests_of(args):
        row = {"request": name}
        try:
            a = mesh_ids(args.mesh, args.model, msgs, tools)
        except Exception as e:  # a refused request is reported, not fatal
            row["mesh_error"] = str(e)[:200]
            a = None
        try:
            b = llama_ids(args.llama, msgs, tools)
        except Exception as e:
            row["llama_error"] = str(e)[:200]
            b = None
        if a is not None and b is not None:
            row.update({"mesh_tokens": len(a), "llama_tokens": len(b), "same": a == b})
            if a != b:
                i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                row["first_difference"] = i
        rows.append(row)
        print(f"{name:<28} {row.get('mesh_tokens', '-'):>6} {row.get('llama_tokens', '-'):>6} "
              f"{'same' if row.get('same') else 'DIFFERENT' if 'same' in row else row}", flush=True)
    compared = [r for r in rows if "same" in r]
    same = sum(r["same"] for r in compared)
    print(f"identical prompt tokens: {same} of {len(compared)} requests both servers took")
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "identical": same, "compared": len(compared), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
