#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` for side-by-side benchmarks.
#
# Source: the llama-cpp-python 0.3.36 sdist from PyPI, which carries the full
# llama.cpp tree under vendor/llama.cpp (tools/server included).
# Result: .cache/llama-server/bin/llama-server, its `--version` output in
# .cache/llama-server/VERSION. Skipped when the binary is already there.
#
# Environment:
#   MESH_LLAMA_SERVER_JOBS   parallel build jobs (default 2)
#   MESH_LLAMA_SDIST         path to a llama_cpp_python-0.3.36.tar.gz to use
#                            instead of downloading one
#   MESH_LLAMA_SERVER_CUDA   1: build with CUDA (needs nvcc) into .cache/llama-server-cuda,
#                            for the GPU side-by-side (docs/gpu.md)
#   MESH_CUDA_ARCH           CUDA architectures for that build (default 90: H100/H200)
#   MESH_LLAMA_SERVER_ENGINE pinned (default): the sdist's llama.cpp as it is.
#                            mesh: the sdist's server and common/ around the ggml/, src/
#                            and include/ that mesh links (llama-cpp-sys-2's vendored
#                            llama.cpp, which ships without the server), so both sides of a
#                            comparison run the same kernels; built into a folder of its own
#                            (.cache/llama-server[-cuda]-mesh-engine)
#   MESH_LLAMA_SERVER_DL     1: shared libraries and backends loaded at run time
#                            (GGML_BACKEND_DL, as mesh does), into a folder of its own
#                            (.cache/llama-server[-cuda][-mesh-engine]-dl); bin/ holds the
#                            binary and its libraries, and llama-server loads every
#                            libggml-<name>.so in bin/ at start. A CUDA module copied there
#                            (scripts/build-cuda-module.sh's, from the same ggml source)
#                            gives llama-server exactly the GPU kernels mesh runs (docs/gpu.md)
#   MESH_LLAMA_SERVER_SRC    a llama.cpp tree to build instead (skips the sdist and the
#                            mixing), e.g. .cache/llama-server-mesh-engine/src copied to a
#                            GPU machine that has no cargo
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VERSION_PIN="0.3.36"
SDIST_NAME="llama_cpp_python-${VERSION_PIN}.tar.gz"
SDIST_SHA256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SRC_DIR="$ROOT/.cache/src"
SDIST="$SRC_DIR/$SDIST_NAME"
TREE="$SRC_DIR/llama_cpp_python-${VERSION_PIN}/vendor/llama.cpp"
CUDA="${MESH_LLAMA_SERVER_CUDA:-0}"
CUDA_ARCH="${MESH_CUDA_ARCH:-90}"
ENGINE="${MESH_LLAMA_SERVER_ENGINE:-pinned}"
if [[ "$CUDA" == 1 ]]; then
    OUT_DIR="$ROOT/.cache/llama-server-cuda"
else
    OUT_DIR="$ROOT/.cache/llama-server"
fi
case "$ENGINE" in
    pinned) ;;
    mesh) OUT_DIR="$OUT_DIR-mesh-engine" ;;
    *) printf '[llama-server] error: MESH_LLAMA_SERVER_ENGINE must be pinned or mesh, not %s\n' "$ENGINE" >&2; exit 2 ;;
esac
DL="${MESH_LLAMA_SERVER_DL:-0}"
LINK_FLAGS=(-DBUILD_SHARED_LIBS=OFF)
TARGETS=(llama-server)
if [[ "$DL" == 1 ]]; then
    OUT_DIR="$OUT_DIR-dl"
    # ggml's CPU backend is then a module of its own, not a dependency of the binary.
    LINK_FLAGS=(-DBUILD_SHARED_LIBS=ON -DGGML_BACKEND_DL=ON "-DCMAKE_BUILD_RPATH=\$ORIGIN")
    TARGETS=(llama-server ggml-cpu)
fi
BUILD_DIR="$OUT_DIR/build"
BIN="$OUT_DIR/bin/llama-server"
JOBS="${MESH_LLAMA_SERVER_JOBS:-2}"

say() { printf '[llama-server] %s\n' "$*"; }
die() { printf '[llama-server] error: %s\n' "$*" >&2; exit 1; }

write_version() {
    # llama-server prints its version on stderr.
    "$BIN" --version >"$OUT_DIR/VERSION.tmp" 2>&1 || true
    mv "$OUT_DIR/VERSION.tmp" "$OUT_DIR/VERSION"
}

# Bump when the cmake flags below change, so a cached binary built differently is rebuilt.
FLAGS_STAMP="cpu:avx2-fma-f16c-bmi2,native-off"
CUDA_FLAGS=()
if [[ "$CUDA" == 1 ]]; then
    command -v nvcc >/dev/null 2>&1 || die "MESH_LLAMA_SERVER_CUDA=1 needs nvcc (the CUDA toolkit) on PATH"
    FLAGS_STAMP="$FLAGS_STAMP,cuda:$CUDA_ARCH"
    CUDA_FLAGS=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH")
fi
[[ "$ENGINE" == mesh ]] && FLAGS_STAMP="$FLAGS_STAMP,engine:mesh"
[[ "$DL" == 1 ]] && FLAGS_STAMP="$FLAGS_STAMP,dl"
if [[ -x "$BIN" && "$(cat "$OUT_DIR/FLAGS" 2>/dev/null)" == "$FLAGS_STAMP" ]]; then
    [[ -s "$OUT_DIR/VERSION" ]] || write_version
    say "cached: $BIN ($(grep -m1 -i version "$OUT_DIR/VERSION" || echo 'version unknown'))"
    exit 0
fi

for tool in cmake c++ tar; do
    command -v "$tool" >/dev/null 2>&1 || die "'$tool' not found (run scripts/setup.sh first)"
done

if [[ -n "${MESH_LLAMA_SERVER_SRC:-}" ]]; then
    # A tree prepared elsewhere (e.g. the mixed tree, copied to a machine without cargo).
    TREE="$MESH_LLAMA_SERVER_SRC"
    [[ -f "$TREE/CMakeLists.txt" && -d "$TREE/tools/server" ]] || die "MESH_LLAMA_SERVER_SRC=$TREE is not a llama.cpp tree with tools/server"
    mkdir -p "$OUT_DIR"
    say "building the tree $TREE"
else
    # 1. The sdist (not needed when its llama.cpp tree is unpacked already).
    mkdir -p "$SRC_DIR"
    if [[ -f "$TREE/CMakeLists.txt" ]]; then
        say "using the unpacked tree ${TREE#"$ROOT"/}"
    elif [[ ! -s "$SDIST" ]]; then
        local_copy="${MESH_LLAMA_SDIST:-/tmp/dl/$SDIST_NAME}"
        if [[ -s "$local_copy" ]]; then
            say "using local sdist $local_copy"
            cp "$local_copy" "$SDIST.tmp"
            mv "$SDIST.tmp" "$SDIST"
        else
            if [[ -x "$ROOT/.venv/bin/pip" ]]; then
                PIP=("$ROOT/.venv/bin/pip")
            else
                PIP=(python3 -m pip)
            fi
            say "downloading llama-cpp-python==${VERSION_PIN} sdist from PyPI"
            # `--no-binary llama-cpp-python`, not `:all:`: pip builds the sdist's
            # metadata, and `:all:` would also force its build requirements
            # (scikit-build-core, and cmake/ninja where the system's are unusable)
            # to be compiled from source.
            "${PIP[@]}" download -q --no-deps --no-binary llama-cpp-python \
                "llama-cpp-python==${VERSION_PIN}" -d "$SRC_DIR"
            [[ -s "$SDIST" ]] || die "download did not produce $SDIST"
        fi
    fi

    if [[ ! -f "$TREE/CMakeLists.txt" ]]; then
        got_sha="$(sha256sum "$SDIST" | cut -d' ' -f1)"
        if [[ "$got_sha" != "$SDIST_SHA256" ]]; then
            rm -f "$SDIST"
            die "sdist sha256 $got_sha is not the expected $SDIST_SHA256 (removed; run again to download)"
        fi
    fi

    # 2. The llama.cpp tree (only vendor/llama.cpp is unpacked).
    if [[ ! -f "$TREE/CMakeLists.txt" ]]; then
        say "unpacking vendor/llama.cpp"
        tar -xzf "$SDIST" -C "$SRC_DIR" "llama_cpp_python-${VERSION_PIN}/vendor/llama.cpp"
    fi
    [[ -d "$TREE/tools/server" ]] || die "no tools/server in $TREE"

    mkdir -p "$OUT_DIR"

    # 2b. With the mesh engine: a copy of the tree whose ggml/, src/ and include/ are the ones
    #     llama-cpp-sys-2 vendors (found with cargo metadata, as scripts/build-cuda-module.sh does).
    if [[ "$ENGINE" == mesh ]]; then
        command -v cargo >/dev/null 2>&1 || die "MESH_LLAMA_SERVER_ENGINE=mesh needs cargo (to find llama-cpp-sys-2's source)"
        manifest="$(cargo metadata --format-version 1 --locked 2>/dev/null \
            | python3 -c 'import json,sys; print(next(p["manifest_path"] for p in json.load(sys.stdin)["packages"] if p["name"]=="llama-cpp-sys-2"))')" \
            || die "llama-cpp-sys-2 is not in this workspace's dependencies"
        VENDORED="$(dirname "$manifest")/llama.cpp"
        [[ -f "$VENDORED/ggml/CMakeLists.txt" && -f "$VENDORED/include/llama.h" ]] || die "$VENDORED is not a llama.cpp tree"
        MIXED="$OUT_DIR/src"
        if [[ "$(cat "$MIXED/SOURCE" 2>/dev/null)" != "$VENDORED" ]]; then
            say "server of ${TREE#"$ROOT"/} around the engine of $VENDORED"
            rm -rf "$MIXED"
            cp -r "$TREE" "$MIXED"
            for part in ggml src include; do
                rm -rf "${MIXED:?}/$part"
                cp -r "$VENDORED/$part" "$MIXED/$part"
            done
            # The crate ships ggml/ without ggml.pc.in, which ggml's CMakeLists configures.
            [[ -f "$MIXED/ggml/ggml.pc.in" ]] || printf 'Name: ggml\nDescription: ggml\nVersion: @GGML_VERSION@\n' >"$MIXED/ggml/ggml.pc.in"
            printf '%s\n' "$VENDORED" >"$MIXED/SOURCE"
        fi
        TREE="$MIXED"
    fi
fi

# 3. Configure and build. Static libraries so the binary can be copied out of
#    the build tree on its own (with MESH_LLAMA_SERVER_DL, its libraries go with it). The CPU features match what llama-cpp-sys-2 builds
#    for mesh (no -march=native: same kernels on both sides of a comparison, and no
#    AMX/AVX-512 code paths that trap on VMs which advertise but do not enable them).
say "configuring (cmake, Release) in ${BUILD_DIR#"$ROOT"/}"
cmake -S "$TREE" -B "$BUILD_DIR" \
    -DCMAKE_BUILD_TYPE=Release \
    "${LINK_FLAGS[@]}" \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_CURL=OFF \
    -DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
    -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    "${CUDA_FLAGS[@]}" >"$OUT_DIR/cmake-configure.log" 2>&1 \
    || { tail -n 30 "$OUT_DIR/cmake-configure.log" >&2; die "cmake configure failed (log: $OUT_DIR/cmake-configure.log)"; }

say "building ${TARGETS[*]} with -j${JOBS} (about 7 minutes on 2 cores)"
cmake --build "$BUILD_DIR" --target "${TARGETS[@]}" -j"$JOBS" >"$OUT_DIR/cmake-build.log" 2>&1 \
    || { tail -n 40 "$OUT_DIR/cmake-build.log" >&2; die "build failed (log: $OUT_DIR/cmake-build.log)"; }

built="$BUILD_DIR/bin/llama-server"
[[ -x "$built" ]] || die "build finished but $built is missing"
mkdir -p "$OUT_DIR/bin"
if [[ "$DL" == 1 ]]; then
    cp -a "$BUILD_DIR"/bin/*.so* "$OUT_DIR/bin/"
fi
cp "$built" "$BIN.tmp"
mv "$BIN.tmp" "$BIN"
printf '%s\n' "$FLAGS_STAMP" >"$OUT_DIR/FLAGS"
write_version
say "built: $BIN"
sed 's/^/[llama-server]   /' "$OUT_DIR/VERSION"
