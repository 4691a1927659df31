//! Accelerators: ggml backend modules loaded at run time, and the devices they bring.
//!
//! llama.cpp is linked into mesh statically with its CPU backend only, so one binary runs on
//! every CPU machine. A GPU node adds a backend module built from the same vendored source
//! (`scripts/build-cuda-module.sh` writes `libggml-cuda.so` beside the binary): at the first
//! use of llama.cpp the node loads every `libggml-<name>.so` found in `MESH_BACKENDS_DIR`
//! (default: the executable's folder), and the module resolves ggml's functions from the
//! executable, which exports them (`mesh/build.rs`). Without a module nothing changes: the
//! CPU backend is the only device and every tier runs on it.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

/// Environment variable naming the folder backend modules are loaded from.
pub const BACKENDS_DIR_ENV: &str = "MESH_BACKENDS_DIR";

/// What happened to one module file.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ModuleLoad {
    /// The file.
    pub path: PathBuf,
    /// The backend it registered (e.g. `CUDA`), or why it did not.
    pub outcome: Result<String, String>,
}

/// A device llama.cpp can place layers and KV on.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Device {
    /// ggml's device index (what llama.cpp's device list takes).
    pub index: usize,
    /// Device name, e.g. `CUDA0`.
    pub name: String,
    /// Description, e.g. `NVIDIA H200`.
    pub description: String,
    /// Backend, e.g. `CUDA` or `CPU`.
    pub backend: String,
    /// `gpu`, `igpu`, `accel` or `cpu`.
    pub kind: String,
    /// Total memory in bytes.
    pub memory_total: u64,
    /// Free memory in bytes when listed.
    pub memory_free: u64,
}

impl Device {
    /// Whether layers can be offloaded to it (a discrete or integrated GPU).
    pub fn is_gpu(&self) -> bool {
        self.kind == "gpu" || self.kind == "igpu"
    }
}

/// Module files among `names` (a folder's entries): `libggml-<name>.so`, but not the CPU
/// backends or ggml's base library, which are linked into the binary already.
pub fn module_names(names: &[String]) -> Vec<String> {
    let mut v: Vec<String> = names
        .iter()
        .filter(|n| {
            n.strip_prefix("libggml-")
                .and_then(|r| r.strip_suffix(".so"))
                .is_some_and(|b| !b.is_empty() && b != "base" && !b.starts_with("cpu"))
        })
        .cloned()
        .collect();
    v.sort();
    v
}

/// The folder modules are loaded from: `MESH_BACKENDS_DIR`, else the executable's folder.
pub fn modules_dir() -> Option<PathBuf> {
    match std::env::var_os(BACKENDS_DIR_ENV) {
        Some(d) if !d.is_empty() => Some(PathBuf::from(d)),
        _ => std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(Path::to_path_buf)),
    }
}

/// Loads the modules of [`modules_dir`] once per process (the engine's backend does this
/// before any model loads) and returns what happened to each.
pub fn load_modules() -> &'static [ModuleLoad] {
    static LOADS: OnceLock<Vec<ModuleLoad>> = OnceLock::new();
    LOADS.get_or_init(|| {
        let Some(dir) = modules_dir() else {
            return Vec::new();
        };
        let names: Vec<String> = std::fs::read_dir(&dir)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        module_names(&names)
            .into_iter()
            .map(|n| {
                let path = dir.join(n);
                let outcome = load_module(&path);
                match &outcome {
                    Ok(b) => tracing::info!(module = %path.display(), backend = %b, "ggml backend loaded"),
                    Err(e) => tracing::warn!(module = %path.display(), error = %e, "ggml backend not loaded; tiers run on the devices that are"),
                }
                ModuleLoad { path, outcome }
            })
            .collect()
    })
}

/// Loads one module into llama.cpp's backend registry.
fn load_module(path: &Path) -> Result<String, String> {
    // dlopen it first for the loader's own message (llama.cpp logs its reason, and mesh
    // silences llama.cpp's logs unless MESH_LLAMA_LOGS=1).
    // SAFETY: loading a shared object runs its initialisers; the file is a ggml backend
    // module the operator placed in the backends folder, the same file llama.cpp loads next.
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| e.to_string())?;
    let cpath = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| "path holds a NUL byte".to_owned())?;
    // SAFETY: a valid C string; ggml copies what it keeps.
    let reg = unsafe { llama_cpp_sys_2::ggml_backend_load(cpath.as_ptr()) };
    drop(lib);
    if reg.is_null() {
        return Err(
            "llama.cpp refused the module: it finds no device it supports here, \
                    or it was built from another llama.cpp source (MESH_LLAMA_LOGS=1 prints \
                    llama.cpp's reason)"
                .into(),
        );
    }
    // SAFETY: a registered backend's name is a static C string.
    let name = unsafe { std::ffi::CStr::from_ptr(llama_cpp_sys_2::ggml_backend_reg_name(reg)) };
    Ok(name.to_string_lossy().into_owned())
}

/// The devices llama.cpp has (after [`load_modules`]), with their memory now.
pub fn devices() -> Vec<Device> {
    crate::backend();
    llama_cpp_2::list_llama_ggml_backend_devices()
        .into_iter()
        .map(|d| Device {
            index: d.index,
            name: d.name,
            description: d.description,
            backend: d.backend,
            kind: match d.device_type {
                llama_cpp_2::LlamaBackendDeviceType::Gpu => "gpu",
                llama_cpp_2::LlamaBackendDeviceType::IntegratedGpu => "igpu",
                llama_cpp_2::LlamaBackendDeviceType::Accelerator => "accel",
                _ => "cpu",
            }
            .into(),
            memory_total: d.memory_total as u64,
            memory_free: d.memory_free as u64,
        })
        .collect()
}

/// The GPUs among [`devices`] (none, without listing, when no module was loaded).
pub fn gpus() -> Vec<Device> {
    crate::backend();
    if !load_modules().iter().any(|m| m.outcome.is_ok()) {
        return Vec::new();
    }
    devices().into_iter().filter(Device::is_gpu).collect()
}

/// The ggml device index of GPU number `gpu` (0 = the first GPU) among `devices`, or an error
/// naming the GPUs there are.
pub fn gpu_device_index(devices: &[Device], gpu: usize) -> Result<usize, String> {
    let gpus: Vec<&Device> = devices.iter().filter(|d| d.is_gpu()).collect();
    match gpus.get(gpu) {
        Some(d) => Ok(d.index),
        None if gpus.is_empty() => Err(format!(
            "gpu {gpu} asked for, but llama.cpp has no GPU here (no backend module in {}; \
             scripts/build-cuda-module.sh builds one)",
            modules_dir().map_or_else(|| "-".into(), |d| d.display().to_string())
        )),
        None => Err(format!(
            "gpu {gpu} asked for, but there {}: {}",
            if gpus.len() == 1 {
                "is 1 GPU".to_owned()
            } else {
                format!("are {} GPUs", gpus.len())
            },
            gpus.iter()
                .map(|d| format!("{} ({})", d.name, d.description))
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

/// One line per GPU: `gpu 0  CUDA0  NVIDIA H200  139.8 GiB (139.1 GiB free)`, or a line
/// saying there is none.
pub fn render(gpus: &[Device]) -> String {
    if gpus.is_empty() {
        return "gpus       none (tiers run on the CPU)\n".into();
    }
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    gpus.iter()
        .enumerate()
        .map(|(i, d)| {
            format!(
                "gpu {i}      {}  {}  {:.1} GiB ({:.1} GiB free)\n",
                d.name,
                d.description,
                gib(d.memory_total),
                gib(d.memory_free)
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn module_names_keep_accelerator_modules_and_skip_cpu_and_base() {
        let got = module_names(&names(&[
            "mesh",
            "libggml-cuda.so",
            "libggml-base.so",
            "libggml-cpu-haswell.so",
            "libggml-cpu.so",
            "libggml-vulkan.so",
            "libggml-.so",
            "libggml-cuda.so.0",
            "libllama.so",
        ]));
        assert_eq!(got, names(&["libggml-cuda.so", "libggml-vulkan.so"]));
    }

    fn dev(index: usize, kind: &str, name: &str) -> Device {
        Device {
            index,
            name: name.into(),
            description: format!("{name} card"),
            backend: "X".into(),
            kind: kind.into(),
            memory_total: 0,
            memory_free: 0,
        }
    }

    #[test]
    fn gpu_numbers_count_gpus_only() {
        let d = [
            dev(0, "gpu", "CUDA0"),
            dev(1, "gpu", "CUDA1"),
            dev(2, "cpu", "CPU"),
        ];
        assert_eq!(gpu_device_index(&d, 1), Ok(1));
        let d = [dev(0, "cpu", "CPU"), dev(1, "gpu", "CUDA0")];
        assert_eq!(gpu_device_index(&d, 0), Ok(1));
    }

    #[test]
    fn a_gpu_past_the_last_is_refused_with_the_gpus_named() {
        let d = [dev(0, "gpu", "CUDA0"), dev(1, "cpu", "CPU")];
        let e = gpu_device_index(&d, 1).unwrap_err();
        assert!(e.contains("there is 1 GPU: CUDA0 (CUDA0 card)"), "{e}");
    }

    #[test]
    fn a_gpu_on_a_cpu_only_machine_is_refused_with_the_way_to_get_one() {
        let e = gpu_device_index(&[dev(0, "cpu", "CPU")], 0).unwrap_err();
        assert!(
            e.contains("no GPU here") && e.contains("build-cuda-module.sh"),
            "{e}"
        );
    }
}
