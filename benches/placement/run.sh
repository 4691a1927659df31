#!/bin/bash
# Placement vs llama.cpp's default threading for two tiers sharing one node (docs/tuner.md).
#
#   bash benches/placement/run.sh [MESH_BIN] [SECONDS] [REPS]
#
# One node hosts t1 and t3, each configured with as many threads as the host has cores
# (llama.cpp's default: every tier on every core). Four streams per tier send completions
# of 64 tokens (ignore_eos, greedy) for SECONDS; the combined generated tok/s is printed per
# repetition for three set-ups:
#   default  [placement] mode = "off": both tiers on all cores, unbound (oversubscribed 2x)
#   placed   [placement] mode = "bind": the planner splits the cores, each tier bound to its set
#   split    mode "off" with half the cores' threads per tier, unbound (thread counts alone)
# Run from the repository root after `cargo build --release --workspace --bins`, on a host with
# spare cores (the figures in docs/tuner.md come from a 16-core host).
set -euo pipefail
MESH="${1:-target/release/mesh}"
SECONDS_PER_REP="${2:-20}"
REPS="${3:-3}"
PORT="${MESH_BENCH_PORT:-8090}"
CORES="$(nproc)"
HALF=$(( CORES / 2 > 0 ? CORES / 2 : 1 ))
DIR="$(mktemp -d)"
trap 'rm -rf "$DIR"' EXIT
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

run() { # name mode t1_threads t3_threads
    cat >"$DIR/$1.toml" <<CFG
listen = "127.0.0.1:$PORT"
[[tiers]]
name = "t1"
model = "models/t1-q8_0.gguf"
threads = $3
n_seq_max = 4
n_ctx = 8192
[[tiers]]
name = "t3"
model = "models/t3-q8_0.gguf"
threads = $4
n_seq_max = 4
n_ctx = 8192
[placement]
mode = "$2"
CFG
    "$MESH" up --config "$DIR/$1.toml" >"$DIR/$1.log" 2>&1 &
    local pid=$!
    for _ in $(seq 1 240); do
        curl -sf "127.0.0.1:$PORT/health" >/dev/null && break
        kill -0 "$pid" 2>/dev/null || { cat "$DIR/$1.log" >&2; exit 1; }
        sleep 0.5
    done
    python3 "$here/drive.py" "http://127.0.0.1:$PORT" 5 >/dev/null # warm-up
    for rep in $(seq 1 "$REPS"); do
        echo "$1 rep $rep $(python3 "$here/drive.py" "http://127.0.0.1:$PORT" "$SECONDS_PER_REP")"
    done
    kill "$pid"
    wait "$pid" 2>/dev/null || true
}

echo "host: $CORES cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs))"
for round in a b; do
    run "default-$round" off "$CORES" "$CORES"
    run "placed-$round" bind "$CORES" "$CORES"
done
run split off "$HALF" "$HALF"
