#!/usr/bin/env bash
# Builds the `mesh` binary for arm64 Linux (AWS Graviton and other Neoverse machines) on
# this x86-64 Debian machine, with Debian's packages only (scripts/setup.sh --arm64
# installs them): rustc-web/cargo-web with libstd-rust-web-dev:arm64, the aarch64 cross
# gcc/g++, and the arm64 hwloc libraries.
#
#   scripts/build-arm64.sh [--cpu n1|v1|v2] [--profile release|arm64-smoke]
#
# --cpu picks the Neoverse core llama.cpp's CPU kernels are compiled for (default v1):
#   n1  Graviton2  armv8.2-a+dotprod+fp16
#   v1  Graviton3  armv8.4-a+sve+i8mm+bf16+fp16      (also runs on Graviton4)
#   v2  Graviton4  armv9-a+sve2+i8mm+bf16
# A binary built for one core runs on the later ones, not on the earlier ones (it stops
# with SIGILL there).
#
# --profile picks the cargo profile (default release: the binary for Graviton machines and
# the image). arm64-smoke (Cargo.toml) is the quicker build the qemu smoke tests of
# `./dev.sh test` run: Rust code unoptimised (opt-level 0) without line tables, llama.cpp as
# in release.
#
# Output: target/aarch64-CPU/aarch64-unknown-linux-gnu/PROFILE/mesh. Each --cpu has its own
# target folder, which also keeps the x86 build that tests and benches share undisturbed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

CPU=v1
PROFILE=release
while (($#)); do
    case "$1" in
        --cpu) CPU="${2:-}"; shift 2 ;;
        --cpu=*) CPU="${1#--cpu=}"; shift ;;
        --profile) PROFILE="${2:-}"; shift 2 ;;
        --profile=*) PROFILE="${1#--profile=}"; shift ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) printf 'build-arm64.sh: unknown argument: %s\n' "$1" >&2; exit 2 ;;
    esac
done
case "$CPU" in
    n1) ARCH="armv8.2-a+dotprod+fp16" ;;
    v1) ARCH="armv8.4-a+sve+i8mm+bf16+fp16" ;;
    v2) ARCH="armv9-a+sve2+i8mm+bf16" ;;
    *) printf 'build-arm64.sh: --cpu must be n1, v1 or v2, not %s\n' "$CPU" >&2; exit 2 ;;
esac
case "$PROFILE" in
    release|arm64-smoke) ;;
    *) printf 'build-arm64.sh: --profile must be release or arm64-smoke, not %s\n' "$PROFILE" >&2; exit 2 ;;
esac

TRIPLE=aarch64-unknown-linux-gnu
T=aarch64_unknown_linux_gnu
for tool in /usr/bin/cargo /usr/bin/rustc aarch64-linux-gnu-gcc aarch64-linux-gnu-g++; do
    command -v "$tool" >/dev/null 2>&1 || {
        printf 'build-arm64.sh: %s not found; run scripts/setup.sh --arm64 first\n' "$tool" >&2
        exit 1
    }
done
[[ -d /usr/lib/rustlib/$TRIPLE ]] || {
    printf 'build-arm64.sh: no Rust standard library for %s (libstd-rust-web-dev:arm64); run scripts/setup.sh --arm64\n' "$TRIPLE" >&2
    exit 1
}

# Debian's toolchain, not a rustup one that may be first on PATH: it is the one with the
# arm64 standard library.
export RUSTC=/usr/bin/rustc RUSTDOC=/usr/bin/rustdoc
export CARGO_TARGET_DIR="$ROOT/target/aarch64-$CPU"
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export "CC_$T=aarch64-linux-gnu-gcc" "CXX_$T=aarch64-linux-gnu-g++" "AR_$T=aarch64-linux-gnu-ar"
export "CMAKE_TOOLCHAIN_FILE_$T=$ROOT/scripts/cross/aarch64-linux-gnu.cmake"
export MESH_ARM_ARCH="$ARCH"
export "PKG_CONFIG_ALLOW_CROSS_$T=1"
export "PKG_CONFIG_LIBDIR_$T=/usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig"
export "BINDGEN_EXTRA_CLANG_ARGS_$T=--target=$TRIPLE -I/usr/aarch64-linux-gnu/include"

echo "build-arm64.sh: mesh for $TRIPLE ($PROFILE profile), llama.cpp CPU kernels for Neoverse-$CPU ($ARCH)"
start=$(date +%s)
/usr/bin/cargo build --profile "$PROFILE" --target "$TRIPLE" -p mesh --bin mesh
bin="$CARGO_TARGET_DIR/$TRIPLE/$PROFILE/mesh"
echo "build-arm64.sh: $bin ($(( $(date +%s) - start )) s)"
