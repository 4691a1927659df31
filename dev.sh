#!/usr/bin/env bash
# Project entry points.
#
#   ./dev.sh demo [ARGS]     set up, build only the demo, run it; ARGS go to agent_demo
#   ./dev.sh test [ARGS]     set up, build (x86 and, with scripts/build-arm64.sh, arm64),
#                            pull the pack model qwen2.5-coder-0.5b-instruct with the built
#                            mesh, run the whole test suite (release profile); ARGS go to
#                            `cargo test`
#   ./dev.sh bench [ARGS]    set up, build llama.cpp's llama-server, run mesh-bench;
#                            ARGS go to mesh-bench
#   ./dev.sh image [ARGS]    set up, build, write the container image (OCI archive) with
#                            scripts/image.py; ARGS go to it (docs/fleet.md)
#   ./dev.sh arm64 [--cpu C] set up, build mesh for arm64 with scripts/build-arm64.sh
#                            (C: n1, v1 or v2), then only the tests that run it under
#                            qemu: `mesh up` with t1 answers as the x86 build does
#
# Everything is built with the release profile, so the llama.cpp build is done
# once and shared by the build, the tests and the benchmarks.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }

export MESH_PYTHON="$ROOT/.venv/bin/python"
export MESH_LLAMA_SERVER="$ROOT/.cache/llama-server/bin/llama-server"
# A rustup toolchain comes first, also when Debian's cargo-web (arm64 builds) is in /usr/bin.
if [[ -x "$HOME/.cargo/bin/cargo" ]]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi

# Exit 0 when the `mesh` package has an example target named agent_demo, 1 when
# it has none, 2 when that cannot be told (no cargo/python3 yet, manifest errors).
agent_demo_status() {
    command -v cargo >/dev/null 2>&1 && command -v python3 >/dev/null 2>&1 || return 2
    local meta
    meta="$(cargo metadata --no-deps --format-version 1 --offline 2>/dev/null)" || return 2
    python3 -c '
import json, sys
meta = json.load(sys.stdin)
sys.exit(0 if any(
    t["name"] == "agent_demo" and "example" in t["kind"]
    for p in meta["packages"] if p["name"] == "mesh"
    for t in p["targets"]
) else 1)' <<<"$meta"
}

cmd_demo() {
    # The demo prints the time from here to its first agent answer.
    MESH_DEMO_STARTED="$(date +%s.%N)"
    export MESH_DEMO_STARTED
    local st=0 t set_up=0
    agent_demo_status || st=$?
    if ((st == 2)); then
        # Fresh machine: install the tools first, then look again.
        scripts/setup.sh --demo
        set_up=1
        st=0
        agent_demo_status || st=$?
    fi
    if ((st == 1)); then
        echo "dev.sh: the mesh package has no example 'agent_demo' (expected examples/agent_demo.rs)" >&2
        exit 1
    fi
    # Only what the demo needs; `./dev.sh test` installs the rest.
    ((set_up)) || scripts/setup.sh --demo
    echo "[demo] set-up done, $(since "$MESH_DEMO_STARTED") since ./dev.sh demo started"
    # Only what the demo needs. --workspace resolves features as the full build does, so
    # `./dev.sh test` later reuses all of it (llama.cpp included) and builds the rest.
    echo "[demo] cargo build --release --workspace --example agent_demo --timings (the first time it compiles llama.cpp and every crate: most of a first demo's time; cargo shows how far it is)"
    t="$(date +%s.%N)"
    cargo build --release --workspace --example agent_demo --timings
    echo "[demo] build done in $(since "$t")"
    echo "[demo] running target/release/examples/agent_demo $*"
    exec "$ROOT/target/release/examples/agent_demo" "$@"
}

# "M min S s" since a `date +%s.%N` stamp.
since() {
    awk -v t0="$1" -v t1="$(date +%s.%N)" 'BEGIN { s = int(t1 - t0); printf "%d min %02d s", s / 60, s % 60 }'
}

cmd_test() {
    scripts/setup.sh --arm64 --build --models
    # tests/tests/arm64.rs runs it under qemu; the smoke profile builds in less time.
    scripts/build-arm64.sh --profile arm64-smoke
    export MESH_ARM64_BIN="$ROOT/target/aarch64-v1/aarch64-unknown-linux-gnu/arm64-smoke/mesh"
    local rc
    TEST_LOG="$(mktemp "${TMPDIR:-/tmp}/mesh-test.XXXXXX")"
    trap 'rm -f "$TEST_LOG"' EXIT
    set +e
    # With no arguments: the whole workspace. With arguments (e.g. `-p mesh-tiers`,
    # a test name filter) they go to cargo test as given; the workspace is
    # virtual, so its default is still every member.
    local scope=(--workspace)
    (($#)) && scope=()
    cargo test --release "${scope[@]}" --no-fail-fast "$@" 2>&1 | tee "$TEST_LOG"
    rc=${PIPESTATUS[0]}
    set -e
    # Sum every "test result: ok. N passed; M failed; ..." line (unit, integration, doc tests).
    local summary passed failed
    summary="$(awk '
        /^test result: / {
            for (i = 1; i <= NF; i++) {
                if ($(i + 1) ~ /^passed;?$/) p += $i
                if ($(i + 1) ~ /^failed;?$/) f += $i
            }
        }
        END { printf "%d %d\n", p, f }' "$TEST_LOG")"
    read -r passed failed <<<"$summary"
    echo "${passed} passed, ${failed} failed"
    if ((rc != 0)); then
        exit "$rc"
    fi
    if ((failed > 0)); then
        exit 1
    fi
}

cmd_bench() {
    scripts/setup.sh --build   # the drivers start target/release/mesh
    scripts/build-llama-server.sh
    exec cargo run --release -p mesh-bench -- "$@"
}

cmd_image() {
    scripts/setup.sh --build
    exec "$ROOT/.venv/bin/python" scripts/image.py "$@"
}

cmd_arm64() {
    local cpu=v1
    case "${1:-}" in
        --cpu) cpu="${2:-}" ;;
        --cpu=*) cpu="${1#--cpu=}" ;;
    esac
    scripts/setup.sh --arm64 --build   # the x86 build is what the smoke test compares with
    scripts/build-arm64.sh "$@"
    # qemu emulates the core the build is for: Graviton2's, or one with SVE (256-bit).
    local qemu_cpu="max,sve-default-vector-length=32"
    [[ $cpu == n1 ]] && qemu_cpu=neoverse-n1
    MESH_ARM64_CPU="$cpu" MESH_QEMU_CPU="$qemu_cpu" \
        MESH_ARM64_BIN="$ROOT/target/aarch64-$cpu/aarch64-unknown-linux-gnu/release/mesh" \
        cargo test --release --workspace --test integration arm64::
}

case "${1:-}" in
    demo) shift; cmd_demo "$@" ;;
    test) shift; cmd_test "$@" ;;
    bench) shift; cmd_bench "$@" ;;
    image) shift; cmd_image "$@" ;;
    arm64) shift; cmd_arm64 "$@" ;;
    -h|--help|help) usage ;;
    *) usage >&2; exit 2 ;;
esac
