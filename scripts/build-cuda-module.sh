#!/usr/bin/env bash
# Build llama.cpp's CUDA backend as a module, libggml-cuda.so, from the llama.cpp source mesh
# is built with (llama-cpp-sys-2's vendored ggml/), and place it beside the mesh binary.
#
# mesh links llama.cpp statically with its CPU backend only; at start it loads every
# libggml-<name>.so in MESH_BACKENDS_DIR (default: the binary's folder), and the module takes
# ggml's functions from the binary (mesh/build.rs exports them). CPU machines need nothing of
# this. See docs/gpu.md.
#
# Usage: scripts/build-cuda-module.sh [OUT_DIR]     (default: target/release)
#
# Environment:
#   MESH_CUDA_ARCH   CUDA architectures (default 90: H100/H200; e.g. "80;86;89;90")
#   MESH_CUDA_JOBS   parallel build jobs (default: all cores)
#   MESH_GGML_SRC    the vendored ggml/ folder to build (default: llama-cpp-sys-2's, found
#                    with cargo metadata); it must be the source mesh was built from
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${1:-$ROOT/target/release}"
ARCH="${MESH_CUDA_ARCH:-90}"
JOBS="${MESH_CUDA_JOBS:-$(nproc)}"
WORK="$ROOT/.cache/ggml-cuda"

say() { printf '[cuda-module] %s\n' "$*"; }
die() { printf '[cuda-module] error: %s\n' "$*" >&2; exit 1; }

for tool in cmake c++ nvcc; do
    command -v "$tool" >/dev/null 2>&1 || die "'$tool' not found (nvcc comes with the CUDA toolkit; cmake and c++ with scripts/setup.sh)"
done

SRC="${MESH_GGML_SRC:-}"
if [[ -z "$SRC" ]]; then
    command -v cargo >/dev/null 2>&1 || die "cargo not found: set MESH_GGML_SRC to llama-cpp-sys-2's llama.cpp/ggml folder"
    manifest="$(cargo metadata --format-version 1 --locked 2>/dev/null \
        | python3 -c 'import json,sys; print(next(p["manifest_path"] for p in json.load(sys.stdin)["packages"] if p["name"]=="llama-cpp-sys-2"))')" \
        || die "llama-cpp-sys-2 is not in this workspace's dependencies"
    SRC="$(dirname "$manifest")/llama.cpp/ggml"
fi
[[ -f "$SRC/CMakeLists.txt" && -d "$SRC/src/ggml-cuda" ]] || die "$SRC is not a ggml source folder with ggml-cuda"

# CUDA graphs (one launch for a whole decode step instead of one per kernel) are on in
# llama.cpp's own builds: its top-level CMakeLists turns them on, and ggml built on its own
# leaves them off. They are set here, so the module decodes as llama-server does.
#
# The crate ships ggml/ without ggml.pc.in, which ggml's CMakeLists configures: build from a
# copy that has a stub of it.
mkdir -p "$WORK"
if [[ ! -f "$WORK/src/CMakeLists.txt" || "$(cat "$WORK/SOURCE" 2>/dev/null)" != "$SRC" ]]; then
    say "copying $SRC"
    rm -rf "$WORK/src"
    cp -r "$SRC" "$WORK/src"
    printf '%s\n' "$SRC" >"$WORK/SOURCE"
fi
[[ -f "$WORK/src/ggml.pc.in" ]] || printf 'Name: ggml\nDescription: ggml\nVersion: @GGML_VERSION@\n' >"$WORK/src/ggml.pc.in"

say "configuring (CUDA architectures $ARCH)"
cmake -S "$WORK/src" -B "$WORK/build" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=ON \
    -DGGML_BACKEND_DL=ON \
    -DGGML_CUDA=ON \
    -DGGML_NATIVE=OFF \
    -DGGML_CUDA_GRAPHS=ON \
    -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF \
    -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
    -DCMAKE_BUILD_RPATH='$ORIGIN' >"$WORK/configure.log" 2>&1 \
    || { tail -n 30 "$WORK/configure.log" >&2; die "cmake configure failed (log: $WORK/configure.log)"; }

say "building ggml-cuda with -j$JOBS (about 4 minutes on 16 cores for one architecture)"
cmake --build "$WORK/build" --target ggml-cuda -j"$JOBS" >"$WORK/build.log" 2>&1 \
    || { tail -n 40 "$WORK/build.log" >&2; die "build failed (log: $WORK/build.log)"; }

module="$(find "$WORK/build" -name 'libggml-cuda.so' -print -quit)"
[[ -n "$module" ]] || die "the build finished without libggml-cuda.so"
base="$(find "$WORK/build" -name 'libggml-base.so.0*' -print -quit)"

mkdir -p "$OUT"
cp "$module" "$OUT/libggml-cuda.so.tmp"
mv "$OUT/libggml-cuda.so.tmp" "$OUT/libggml-cuda.so"
# The module names ggml's base library as a dependency. mesh already holds it, so the
# dependency is dropped where patchelf is there; else the library goes beside the module
# (its functions are still taken from mesh, which comes first in symbol lookup).
if command -v patchelf >/dev/null 2>&1; then
    for need in $(patchelf --print-needed "$OUT/libggml-cuda.so" | grep '^libggml-base'); do
        patchelf --remove-needed "$need" "$OUT/libggml-cuda.so"
    done
    say "dropped the libggml-base dependency (patchelf)"
elif [[ -n "$base" ]]; then
    cp -L "$base" "$OUT/$(basename "$base" | sed 's/\(\.so\.[0-9]*\).*/\1/')"
    say "copied $(basename "$base") beside it (no patchelf)"
fi
say "built: $OUT/libggml-cuda.so ($(du -h "$OUT/libggml-cuda.so" | cut -f1)); mesh loads it at start (mesh topology lists the GPUs)"
