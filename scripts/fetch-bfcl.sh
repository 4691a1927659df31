#!/usr/bin/env bash
# Fetch the Berkeley Function-Calling Leaderboard data for the tool-router evaluation
# (evals/examples/bfcl_router.rs) and print the data folder on stdout.
#
#   bash scripts/fetch-bfcl.sh
#
# Downloads only the bfcl-eval wheel from PyPI (no dependencies, nothing installed) and
# unpacks it into $MESH_BFCL_DIR (default target/bfcl/). Safe to re-run: an unpacked
# copy is reused. MESH_BFCL_VERSION picks another release (default 2026.3.23, the one
# docs/tool-router.md was measured on).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${MESH_BFCL_DIR:-$ROOT/target/bfcl}"
VERSION="${MESH_BFCL_VERSION:-2026.3.23}"
bash "$ROOT/scripts/fetch-wheel.sh" bfcl-eval "$VERSION" "$DIR" \
    "bfcl_eval/data/BFCL_v*_live_multiple.json"
DATA="$DIR/bfcl_eval-$VERSION/bfcl_eval/data"
printf '[fetch-bfcl] data: %s\n' "$DATA" >&2
printf '%s\n' "$DATA"
