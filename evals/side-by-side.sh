#!/usr/bin/env bash
# mesh and llama.cpp's server on the same GGUF, side by side: the twelve everyday
# tool-calling checks through the official clients, the prompt tokens of the same
# requests, and BFCL tool-call accuracy (simple, multiple, parallel).
#
#   bash evals/side-by-side.sh MODEL [--per-category N] [--threads T] [--out DIR]
#
# MODEL is a pack name (`mesh models list`) or a GGUF path. Both servers get the same
# settings: T threads (default 2), 8192 KV cells, 2 sequences, greedy requests, and
# llama-server `--jinja` (its default) with the GGUF's template. They run one at a time,
# so each has the machine to itself. Results go to DIR (default bench-results/), one
# file per evaluation named after the model, and a summary is printed at the end.
#
# Needs: the release build (`cargo build --release --workspace --bins`), llama-server
# (`scripts/build-llama-server.sh`; MESH_LLAMA_SERVER overrides the path), the venv with
# the clients (`scripts/setup.sh`) and the BFCL data (`scripts/fetch-bfcl.sh`, fetched here
# when missing). CARGO_TARGET_DIR is honoured.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }

MODEL=""
PER_CATEGORY=100
THREADS=2
OUT="$ROOT/bench-results"
while (($#)); do
    case "$1" in
        --per-category) PER_CATEGORY="$2"; shift 2 ;;
        --threads) THREADS="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        -*) echo "side-by-side: unknown option $1" >&2; usage >&2; exit 2 ;;
        *) MODEL="$1"; shift ;;
    esac
done
[[ -n "$MODEL" ]] || { usage >&2; exit 2; }

TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
MESH="$TARGET/release/mesh"
LLAMA="${MESH_LLAMA_SERVER:-$ROOT/.cache/llama-server/bin/llama-server}"
PY="${MESH_PYTHON:-$ROOT/.venv/bin/python}"
for f in "$MESH" "$LLAMA" "$PY"; do
    [[ -x "$f" ]] || { echo "side-by-side: $f is missing (see the header of this script)" >&2; exit 1; }
done

if [[ -f "$MODEL" ]]; then
    GGUF="$MODEL"
else
    GGUF="$("$MESH" models path "$MODEL")" || {
        echo "side-by-side: $MODEL is neither a file nor a pulled pack model (mesh models pull $MODEL)" >&2
        exit 1
    }
fi
NAME="$(basename "$GGUF" .gguf)"
BFCL="$(bash scripts/fetch-bfcl.sh)"
BFCL="${BFCL%/bfcl_eval/data}"
mkdir -p "$OUT"

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

PID=""
stop() { [[ -n "$PID" ]] && kill "$PID" 2>/dev/null && wait "$PID" 2>/dev/null; PID=""; }
trap stop EXIT

wait_ready() { # URL LOG
    for _ in $(seq 600); do
        if curl -sf "$1/health" >/dev/null 2>&1; then return 0; fi
        kill -0 "$PID" 2>/dev/null || { echo "side-by-side: the server exited; its log: $2" >&2; exit 1; }
        sleep 0.5
    done
    echo "side-by-side: $1 not ready after 300 s; its log: $2" >&2
    exit 1
}

start() { # mesh|llama-server PORT
    local log="$OUT/$NAME.$1.log"
    if [[ "$1" == mesh ]]; then
        "$MESH" up --port "$2" --tier "m=$GGUF" --threads "$THREADS" --ctx 8192 --parallel 2 >"$log" 2>&1 &
    else
        "$LLAMA" -m "$GGUF" -a m -c 8192 -np 2 -t "$THREADS" -tb "$THREADS" --port "$2" --jinja --no-webui >"$log" 2>&1 &
    fi
    PID=$!
    wait_ready "http://127.0.0.1:$2" "$log"
}

# The two servers in turn for the checks and BFCL; both at once for the token comparison.
for server in mesh llama-server; do
    port="$(free_port)"
    start "$server" "$port"
    echo "== $server: everyday checks" >&2
    "$PY" tests/python/tool_checks.py --base-url "http://127.0.0.1:$port" --model m --all \
        --json "$OUT/$NAME.checks.$server.json" || true
    echo "== $server: BFCL, $PER_CATEGORY per category" >&2
    "$PY" evals/bfcl_calls.py --bfcl "$BFCL" --server "$server=http://127.0.0.1:$port,m" \
        --per-category "$PER_CATEGORY" --out "$OUT/$NAME.bfcl.$server.json"
    stop
done

echo "== prompt tokens" >&2
mport="$(free_port)"
start mesh "$mport"
MPID="$PID"; PID=""
lport="$(free_port)"
start llama-server "$lport" || { kill "$MPID"; exit 1; }
"$PY" evals/prompt_tokens.py --mesh "http://127.0.0.1:$mport" --llama "http://127.0.0.1:$lport" \
    --model m --bfcl "$BFCL" --per-category 30 --out "$OUT/$NAME.prompt-tokens.json" || true
stop
kill "$MPID" 2>/dev/null; wait "$MPID" 2>/dev/null || true

"$PY" - "$OUT" "$NAME" <<'EOF'
import json, os, sys
out, name = sys.argv[1], sys.argv[2]
def load(f):
    p = os.path.join(out, f)
    return json.load(open(p)) if os.path.exists(p) else None
print(f"model {name}")
for s in ("mesh", "llama-server"):
    c = load(f"{name}.checks.{s}.json")
    if c:
        print(f"  {s:13} everyday checks {c['score']}/{len(c['results'])}: failed "
              + (", ".join(r["check"] for r in c["results"] if not r["ok"]) or "none"))
    b = load(f"{name}.bfcl.{s}.json")
    if b:
        print(f"  {s:13} BFCL " + ", ".join(
            f"{cat} {v['correct']}/{v['n']}" for cat, v in b["summary"][s].items()))
t = load(f"{name}.prompt-tokens.json")
if t:
    print(f"  prompt tokens identical on {t['identical']} of {t['compared']} requests")
EOF
