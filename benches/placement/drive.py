#!/usr/bin/env python3
"""Combined decode throughput of two tiers sharing one node, under steady load."""
import json, sys, threading, time, urllib.request

base, seconds = sys.argv[1], float(sys.argv[2])
prompts = [json.loads(line)["prompt"] for line in open("models/fixtures/eval-heldout.jsonl")][:64]
counts = {"t1": 0, "t3": 0}
reqs = {"t1": 0, "t3": 0}
lock = threading.Lock()
stop = time.time() + seconds

def worker(model, k):
    i = k
    while time.time() < stop:
        body = json.dumps({"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": 64,
                           "temperature": 0, "ignore_eos": True}).encode()
        r = urllib.request.urlopen(urllib.request.Request(base + "/v1/completions", body,
                                   {"content-type": "application/json"}), timeout=600)
        u = json.load(r)["usage"]["completion_tokens"]
        with lock:
            if time.time() <= stop:
                counts[model] += u
                reqs[model] += 1
        i += 7

ts = [threading.Thread(target=worker, args=(m, k)) for m in ("t1", "t3") for k in range(4)]
t0 = time.time()
for t in ts: t.start()
for t in ts: t.join()
print(json.dumps({"seconds": seconds, "tok_s": {m: counts[m] / seconds for m in counts},
                  "combined_tok_s": sum(counts.values()) / seconds, "requests": reqs}))
