//! Exports ggml's functions from the `mesh` executable, so that a GPU backend module loaded
//! at run time (`libggml-cuda.so`, see `mesh_tiers::gpu`) resolves them from the llama.cpp
//! linked into it rather than from a second copy.

fn main() {
    let target = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if target == "linux" {
        println!("cargo:rustc-link-arg-bins=-Wl,--export-dynamic-symbol=ggml_*");
        println!("cargo:rustc-link-arg-bins=-Wl,--export-dynamic-symbol=gguf_*");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
