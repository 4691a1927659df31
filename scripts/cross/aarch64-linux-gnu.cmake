# CMake toolchain for building llama.cpp (through llama-cpp-sys-2) for arm64 Linux on an
# x86-64 Debian machine with Debian's cross compilers (gcc-aarch64-linux-gnu) and multiarch
# arm64 libraries. scripts/build-arm64.sh points cmake-rs at this file through
# CMAKE_TOOLCHAIN_FILE_aarch64_unknown_linux_gnu.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu /usr/lib/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

# llama-cpp-sys-2 pins ggml-cpu to plain armv8-a (-DGGML_CPU_ARM_ARCH=armv8-a) for every
# non-native aarch64 Linux build, which leaves out the int8 dot-product and matrix-multiply
# kernels that make quantized models fast on Neoverse. The cache entry set here, FORCE'd,
# replaces that value before ggml reads it. MESH_ARM_ARCH (scripts/build-arm64.sh) chooses it.
if(DEFINED ENV{MESH_ARM_ARCH} AND NOT "$ENV{MESH_ARM_ARCH}" STREQUAL "")
    set(GGML_CPU_ARM_ARCH "$ENV{MESH_ARM_ARCH}" CACHE STRING "ggml-cpu -march for arm64" FORCE)
endif()

# Nothing in the library needs OpenSSL, and the x86 one must not be found.
set(CMAKE_DISABLE_FIND_PACKAGE_OpenSSL TRUE)
