#!/usr/bin/env bash
# Start a 3-node local mesh with `mesh join`, send agent traffic through every
# gateway with the client SDK example, show `mesh status`, kill one node and
# show that traffic keeps flowing. Stops the nodes on exit.
#
#   examples/cluster.sh [--keep]      (--keep: leave the nodes running; Ctrl-C stops them)
#
# Needs a release build: scripts/setup.sh --build
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MESH="$ROOT/target/release/mesh"
SDK="$ROOT/target/release/examples/sdk_agent"
[[ -x "$MESH" ]] || { echo "build first: scripts/setup.sh --build" >&2; exit 1; }
if [[ ! -x "$SDK" ]]; then
    cargo build --release -p mesh --example sdk_agent
fi
KEEP=0
[[ "${1:-}" == "--keep" ]] && KEEP=1

WORK="$(mktemp -d "${TMPDIR:-/tmp}/mesh-cluster.XXXXXX")"
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    echo "logs were in $WORK (removed)"
    rm -rf "$WORK"
}
trap cleanup EXIT

"$MESH" cert init --dir "$WORK/certs" --cluster demo
for n in alpha beta gamma; do "$MESH" cert issue "$n" --dir "$WORK/certs"; done

start() { # name http-port quic-port tiers [seed]
    local seed_args=()
    [[ -n "${5:-}" ]] && seed_args=(--seeds "$5")
    "$MESH" join --name "$1" --port "$2" --quic "127.0.0.1:$3" --tiers "$4" \
        --threads 1 --ctx 4096 --parallel 4 --cert-dir "$WORK/certs" "${seed_args[@]}" \
        >"$WORK/$1.out" 2>"$WORK/$1.log" &
    PIDS+=($!)
    for _ in $(seq 1 100); do
        grep -q "mesh listening" "$WORK/$1.out" 2>/dev/null && return 0
        sleep 0.1
    done
    echo "$1 did not start:" >&2; cat "$WORK/$1.log" >&2; exit 1
}

start alpha 18080 17070 t1,t2
start beta  18081 17071 t1    127.0.0.1:17070
start gamma 18082 17072 none  127.0.0.1:17070   # gateway only: forwards everything
sleep 1
echo; echo "== mesh status"
"$MESH" status --gateway http://127.0.0.1:18082

echo; echo "== agent traffic through all three gateways (client SDK, failover list)"
"$SDK" --gateways http://127.0.0.1:18082,http://127.0.0.1:18081,http://127.0.0.1:18080 --model t1 --tasks 3

echo "== t2 lives only on alpha; gamma forwards it"
curl -s http://127.0.0.1:18082/v1/chat/completions -H 'content-type: application/json' \
    -d '{"model":"t2","messages":[{"role":"user","content":"Convert 5 miles to km."}],"max_tokens":48}' \
    | python3 -c 'import json,sys; r=json.load(sys.stdin); print(" ", r["choices"][0]["message"], r["usage"])'

echo; echo "== kill -9 beta, then more traffic"
kill -9 "${PIDS[1]}"
"$SDK" --gateways http://127.0.0.1:18082,http://127.0.0.1:18080 --model t1 --tasks 2
sleep 2
"$MESH" status --gateway http://127.0.0.1:18080

if ((KEEP)); then
    echo "nodes running (gateways :18080 :18081 :18082); Ctrl-C to stop"
    wait
fi
