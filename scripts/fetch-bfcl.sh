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
DATA="$DIR/bfcl_eval-$VERSION/bfcl_eval/data"

say() { printf '[fetch-bfcl] %s\n' "$*" >&2; }

if ! compgen -G "$DATA/BFCL_v*_live_multiple.json" >/dev/null; then
    mkdir -p "$DIR/wheels"
    say "downloading bfcl-eval==$VERSION (wheel only) into $DIR/wheels"
    python3 -m pip download --quiet --no-deps --only-binary=:all: \
        -d "$DIR/wheels" "bfcl-eval==$VERSION" >&2
    WHEEL="$(ls "$DIR"/wheels/bfcl_eval-"$VERSION"-*.whl | head -n1)"
    rm -rf "$DIR/bfcl_eval-$VERSION.tmp"
    # A wheel is a zip; python's zipfile avoids needing unzip.
    python3 -m zipfile -e "$WHEEL" "$DIR/bfcl_eval-$VERSION.tmp"
    rm -rf "$DIR/bfcl_eval-$VERSION"
    mv "$DIR/bfcl_eval-$VERSION.tmp" "$DIR/bfcl_eval-$VERSION"
    compgen -G "$DATA/BFCL_v*_live_multiple.json" >/dev/null \
        || { say "error: no BFCL_v*_live_multiple.json under $DATA"; exit 1; }
fi
say "data: $DATA"
printf '%s\n' "$DATA"
