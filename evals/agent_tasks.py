"""Agent tasks end to end on a real model: mesh's node-side agent loop (tool router,
speculative tool calls) against llama.cpp's server given every tool schema, on the same
tasks, the same tools and the same MCP server.

    python evals/agent_tasks.py --target qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct [--tasks N] [--threads T] [--out OUT.json]

The tools: the bundled catalog (`models/fixtures/catalog.jsonl`, 200 tools in 20 domains)
served over MCP (stdio) by `scripts/mcp/catalog-server.mjs`, whose every call answers
after 150 ms. The tasks: the tool-calling tasks of `models/fixtures/agent_tasks.jsonl`
(single calls, two-call plans, arithmetic, unit conversion, choosing between a tool and
its bulk variant); its refusal tasks are left out, because with the whole catalog offered
a tool does exist for most of them. A task succeeds ("exact calls") when the calls made
over all its turns are exactly the expected ones (names and arguments, in any order);
"first turn right" asks only that the first turn that called tools called exactly those
(a model that repeats a call after its result, or adds one, still passes).

Three runs, one at a time so each has the machine to itself:

- `mesh`: `POST /v1/agent/tasks` with the target model and no `tools` (every catalog
  tool): the node routes each turn to `top_k` tools, runs the calls on the MCP server, and
  the draft model predicts each turn's call so a read-only tool starts early. Both models
  get T threads (`[placement] mode = "off"`), so the draft competes with the target.
- `mesh-nospec`: the same with `speculate: false`.
- `llama-server`: `--jinja`, the client loop here, all 200 tool schemas in every request
  (what an agent does without a router), the same MCP server called from here.

Every run: greedy, at most 3 turns and 160 tokens a turn, one task at a time. One task
outside the measured set warms each server first (llama-server prefills the tool schemas
then and reuses them after; mesh embeds the catalog). Reported per run: success, prompt
tokens per task (what the model was shown) and those that were prefilled (not reused
from KV), completion tokens, wall time per task.

Needs the release build, llama-server (`scripts/build-llama-server.sh`, or
MESH_LLAMA_SERVER), node and `.cache/mcp` (`scripts/setup.sh`), and both models pulled
(`mesh models pull NAME`). CARGO_TARGET_DIR is honoured.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CATALOG = os.path.join(ROOT, "models/fixtures/catalog.jsonl")
TASKS = os.path.join(ROOT, "models/fixtures/agent_tasks.jsonl")
SERVER = os.path.join(ROOT, ".cache/mcp/catalog-server.mjs")
MAX_TURNS = 3
MAX_TOKENS = 160


def post(url, body, timeout=1800):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read().decode()[:500]}") from None


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_ready(base, proc, log):
    for _ in range(1200):
        if proc.poll() is not None:
            sys.exit(f"agent_tasks: the server exited; its log: {log}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    sys.exit(f"agent_tasks: {base} not ready after 600 s; its log: {log}")


class Mcp:
    """A minimal MCP client over stdio (JSON-RPC, one message a line)."""

    def __init__(self, argv):
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, bufsize=1)
        self.next_id = 0
        self.request("initialize", {"protocolVersion": "2025-03-26", "capabilities": {},
                                    "clientInfo": {"name": "agent_tasks", "version": "1"}})
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})

    def send(self, msg):
        self.p.stdin.write(json.dumps(msg) + "\n")
        self.p.stdin.flush()

    def request(self, method, params):
        self.next_id += 1
        self.send({"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params})
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError("the MCP server went away")
            msg = json.loads(line)
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"MCP {method}: {msg['error']}")
                return msg["result"]

    def call(self, name, arguments):
        try:
            r = self.request("tools/call", {"name": name, "arguments": arguments})
        except RuntimeError as e:
            return f"error: {e}"
        text = "".join(c.get("text", "") for c in r.get("content", []))
        return f"error: {text}" if r.get("isError") else text

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=10)


def canonical(calls):
    return sorted(json.dumps({"name": c["name"], "arguments": c["arguments"]}, sort_keys=True)
                  for c in calls)


def parse_args_json(s):
    try:
        v = json.loads(s) if isinstance(s, str) else s
    except json.JSONDecodeError:
        return {"__unparsed__": s}
    return v if isinstance(v, dict) else {"__unparsed__": s}


def run_llama(base, tools, task, mcp):
    messages = [{"role": "user", "content": task["user"]}]
    calls, per_turn, prompt, prefilled, completion, turns = [], [], 0, 0, 0, 0
    t0 = time.monotonic()
    while True:
        turns += 1
        r = post(base + "/v1/chat/completions",
                 {"messages": messages, "tools": tools, "temperature": 0,
                  "max_tokens": MAX_TOKENS})
        prompt += r["usage"]["prompt_tokens"]
        completion += r["usage"]["completion_tokens"]
        # llama-server's timings: prompt_n tokens were prefilled, cache_n reused.
        prefilled += r.get("timings", {}).get("prompt_n", r["usage"]["prompt_tokens"])
        msg = r["choices"][0]["message"]
        made = msg.get("tool_calls") or []
        if not made or turns >= MAX_TURNS:
            break
        messages.append({"role": "assistant", "content": msg.get("content") or "",
                         "tool_calls": made})
        per_turn.append([])
        for c in made:
            args = parse_args_json(c["function"]["arguments"])
            calls.append({"name": c["function"]["name"], "arguments": args})
            per_turn[-1].append(calls[-1])
            result = mcp.call(c["function"]["name"], args)
            messages.append({"role": "tool", "tool_call_id": c.get("id", ""), "content": result})
    return {"calls": calls, "turn_calls": per_turn, "output": msg.get("content"),
            "turns": turns, "prompt_tokens": prompt,
            "prefilled_tokens": prefilled, "completion_tokens": completion,
            "wall_s": time.monotonic() - t0, "status": "completed"}


def run_mesh(base, model, task, speculate):
    t0 = time.monotonic()
    r = post(base + "/v1/agent/tasks",
             {"model": model, "input": task["user"], "max_turns": MAX_TURNS,
              "max_tokens": MAX_TOKENS, "speculate": speculate})
    wall = time.monotonic() - t0
    if "turns" not in r:
        raise RuntimeError(f"agent task refused: {r}")
    calls, per_turn, sources, shown = [], [], [], []
    for t in r["turns"]:
        shown.append(len(t.get("tools_shown") or []))
        if t.get("tool_calls"):
            per_turn.append([])
        for c in t.get("tool_calls") or []:
            calls.append({"name": c["name"], "arguments": c["arguments"]})
            per_turn[-1].append(calls[-1])
            sources.append(c.get("source"))
    u = r["usage"]
    cached = u.get("prompt_tokens_details", {}).get("cached_tokens", u.get("cached_tokens", 0))
    return {"calls": calls, "turn_calls": per_turn, "output": r.get("output"),
            "turns": len(r["turns"]), "prompt_tokens": u["prompt_tokens"],
            "prefilled_tokens": u["prompt_tokens"] - cached,
            "completion_tokens": u["completion_tokens"], "wall_s": wall,
            "status": r["status"], "sources": sources, "tools_shown": shown}


def metric_sum(base, prefix):
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def summarize(name, results, tasks):
    n = len(results)
    ok = sum(r["success"] for r in results)
    first = sum(r["first_turn_right"] for r in results)
    mean = lambda k: sum(r[k] for r in results) / n  # noqa: E731
    return {"run": name, "tasks": n, "succeeded": ok, "success": ok / n,
            "first_turn_right": first,
            "prompt_tokens_per_task": mean("prompt_tokens"),
            "prefilled_tokens_per_task": mean("prefilled_tokens"),
            "completion_tokens_per_task": mean("completion_tokens"),
            "wall_s_per_task": mean("wall_s"),
            "wall_s_total": sum(r["wall_s"] for r in results),
            "by_kind": {k: sum(r["success"] for r, t in zip(results, tasks)
                               if f"{t['kind']}/{t['sub']}" == k)
                        for k in sorted({f"{t['kind']}/{t['sub']}" for t in tasks})}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="pack name or GGUF of the answering model")
    ap.add_argument("--draft", required=True, help="pack name or GGUF of the drafting model")
    ap.add_argument("--tasks", type=int, default=0, help="first N measured tasks (0: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", default="mesh,mesh-nospec,llama-server")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench-results/agent-tasks.json"))
    a = ap.parse_args()

    target_dir = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    mesh = os.path.join(target_dir, "release/mesh")
    llama = os.environ.get("MESH_LLAMA_SERVER", os.path.join(ROOT, ".cache/llama-server/bin/llama-server"))
    for f in (mesh, llama, SERVER):
        if not os.path.exists(f):
            sys.exit(f"agent_tasks: {f} is missing (see this script's docstring)")

    def gguf(model):
        if os.path.isfile(model):
            return os.path.abspath(model)
        p = subprocess.run([mesh, "models", "path", model], capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"agent_tasks: {model} is neither a file nor a pulled pack model")
        return p.stdout.strip()

    target, draft = gguf(a.target), gguf(a.draft)
    catalog = [json.loads(l) for l in open(CATALOG) if l.strip()]
    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
             for t in catalog]
    every = [json.loads(l) for l in open(TASKS) if l.strip()]
    measured = [t for t in every if t["kind"] != "none"]
    warm = measured.pop(0)
    if a.tasks:
        measured = measured[:a.tasks]
    server_argv = ["node", SERVER, CATALOG, "150"]
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    work = tempfile.mkdtemp(prefix="agent-tasks-")
    report = {"target": target, "draft": draft, "threads": a.threads, "tasks": len(measured),
              "warmup_task": warm["user"], "runs": {}}

    for run in a.runs.split(","):
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        log = os.path.join(work, f"{run}.log")
        if run.startswith("mesh"):
            cfg = os.path.join(work, "node.toml")
            tiers = "".join(f"""
[[tiers]]
name = "{name}"
model = "{path}"
threads = {a.threads}
n_ctx = 8192
n_seq_max = 1
""" for name, path in (("target", target), ("draft", draft)))
            with open(cfg, "w") as f:
                f.write(f"""listen = "127.0.0.1:{port}"
{tiers}
[[mcp.servers]]
name = "catalog"
command = "node"
args = {json.dumps(server_argv[1:])}

[placement]
# Both tiers keep their threads, as llama-server does: the draft runs beside the target.
mode = "off"

[agent]
draft_model = "draft"
cache_ttl_s = 0
""")
            argv = [mesh, "up", "--config", cfg]
        else:
            argv = [llama, "-m", target, "-c", "32768", "-np", "1", "-t", str(a.threads),
                    "-tb", str(a.threads), "--port", str(port), "--jinja", "--no-webui"]
        with open(log, "w") as lf:
            proc = subprocess.Popen(argv, stdout=lf, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            wait_ready(base, proc, log)
            mcp = None if run.startswith("mesh") else Mcp(server_argv)
            speculate = run == "mesh"

            def one(task):
                if mcp is None:
                    return run_mesh(base, "target", task, speculate)
                return run_llama(base, tools, task, mcp)

            t0 = time.monotonic()
            one(warm)
            warm_s = time.monotonic() - t0
            before = metric_sum(base, "mesh_spec_tool_calls_total") if mcp is None else {}
            results = []
            for i, task in enumerate(measured):
                r = one(task)
                want = canonical(task["expected"])
                r["success"] = canonical(r["calls"]) == want
                # The first turn that called tools called exactly the expected ones (later
                # turns may have repeated or added calls).
                r["first_turn_right"] = bool(r["turn_calls"]) and canonical(r["turn_calls"][0]) == want
                r["task"] = task["user"]
                results.append(r)
                print(f"[{run}] {i + 1}/{len(measured)} {'ok ' if r['success'] else 'bad'} "
                      f"{r['wall_s']:.1f}s prompt {r['prompt_tokens']} {task['user'][:60]}",
                      file=sys.stderr)
            summary = summarize(run, results, measured)
            summary["warmup_s"] = warm_s
            if mcp is None:
                after = metric_sum(base, "mesh_spec_tool_calls_total")
                summary["spec_tool_calls"] = {k: after[k] - before.get(k, 0) for k in after}
            else:
                mcp.close()
            report["runs"][run] = {"summary": summary, "tasks": results}
        finally:
            proc.terminate()
            proc.wait(timeout=60)

    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\n{len(measured)} tasks, {os.path.basename(target)}, {a.threads} threads; data: {a.out}")
    print("| run | exact calls | first turn right | prompt tokens/task | prefilled/task | completion/task | wall s/task | warm-up s |")
    print("|---|---|---|---|---|---|---|---|")
    for run, r in report["runs"].items():
        s = r["summary"]
        print(f"| {run} | {s['succeeded']}/{s['tasks']} | {s['first_turn_right']}/{s['tasks']} | {s['prompt_tokens_per_task']:.0f} | "
              f"{s['prefilled_tokens_per_task']:.0f} | {s['completion_tokens_per_task']:.0f} | "
              f"{s['wall_s_per_task']:.2f} | {s['warmup_s']:.1f} |")
        if "spec_tool_calls" in s:
            print(f"  speculative tool calls: {json.dumps(s['spec_tool_calls'])}")


if __name__ == "__main__":
    main()
