//! The arm64 build (`scripts/build-arm64.sh`, `./dev.sh arm64`) run on this x86 machine under
//! `qemu-user-static`: it starts, serves t1 with llama.cpp's Neoverse kernels, and answers
//! exactly as the x86 build does.
//!
//! The binary is `MESH_ARM64_BIN` built for the core `MESH_ARM64_CPU` names (`n1`, `v1`, `v2`),
//! or else the newer of `target/aarch64-v1/aarch64-unknown-linux-gnu/{arm64-smoke,release}/mesh`
//! (`./dev.sh test` builds the first, `./dev.sh arm64` the second). qemu
//! emulates the core `MESH_QEMU_CPU` names, by default `max` with 256-bit SVE vectors as on
//! Graviton3 (`./dev.sh arm64 --cpu n1` sets `neoverse-n1`, Graviton2).

use std::path::{Path, PathBuf};
use std::process::Command;

use mesh_tests::{greedy_reply, mesh, root, Node};

const QEMU: &str = "qemu-aarch64-static";

fn arm64_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os("MESH_ARM64_BIN").map(PathBuf::from) {
        assert!(
            bin.exists(),
            "MESH_ARM64_BIN={} not found: build it with scripts/build-arm64.sh",
            bin.display()
        );
        return bin;
    }
    let dir = root().join("target/aarch64-v1/aarch64-unknown-linux-gnu");
    ["arm64-smoke", "release"]
        .iter()
        .map(|profile| dir.join(profile).join("mesh"))
        .filter_map(|bin| Some((bin.metadata().ok()?.modified().ok()?, bin)))
        .max()
        .map(|(_, bin)| bin)
        .unwrap_or_else(|| {
            panic!(
                "no arm64 build in {}: build it with scripts/build-arm64.sh \
                 (./dev.sh arm64 sets up and runs it)",
                dir.display()
            )
        })
}

fn qemu_cpu() -> String {
    std::env::var("MESH_QEMU_CPU").unwrap_or_else(|_| "max,sve-default-vector-length=32".into())
}

/// `mesh up --port 0 ARGS` from the arm64 binary under qemu.
fn up_under_qemu(dir: &Path, args: &[&str]) -> Node {
    let mut all = vec![
        arm64_bin().display().to_string(),
        "up".into(),
        "--port".into(),
        "0".into(),
    ];
    all.extend(args.iter().map(|s| s.to_string()));
    let cpu = qemu_cpu();
    Node::spawn(
        Path::new(QEMU),
        &all,
        &dir.join("arm64.log"),
        &[("QEMU_CPU", cpu.as_str())],
    )
    .unwrap_or_else(|log| panic!("the arm64 mesh up exited under qemu:\n{log}"))
}

#[test]
fn the_arm64_binary_under_qemu_prints_the_x86_builds_version() {
    let out = Command::new(QEMU)
        .arg(arm64_bin())
        .arg("--version")
        .env("QEMU_CPU", qemu_cpu())
        .output()
        .expect("qemu-aarch64-static runs (scripts/setup.sh --arm64 installs it)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout, mesh(&["--version"]).stdout);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_arm64_build_answers_a_chat_with_the_x86_builds_greedy_reply() {
    let dir = tempfile::tempdir().unwrap();
    let arm = up_under_qemu(dir.path(), &["--only", "t1", "--threads", "1"]);
    let from_arm = greedy_reply(&arm.http).await;
    drop(arm);
    let x86 = Node::up(dir.path(), &["--only", "t1", "--threads", "1"]).expect("x86 node");
    let from_x86 = greedy_reply(&x86.http).await;
    assert!(!from_arm.is_empty());
    assert_eq!(from_arm, from_x86);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_arm64_build_runs_llama_cpp_with_the_neoverse_kernels() {
    let dir = tempfile::tempdir().unwrap();
    let arm = up_under_qemu(dir.path(), &["--only", "t1", "--threads", "1"]);
    // The tier is loaded (and the backend's feature line logged) before the gateway listens.
    let log = std::fs::read_to_string(&arm.log).expect("node log");
    let line = log
        .lines()
        .find(|l| l.contains("llama.cpp backend"))
        .unwrap_or_else(|| panic!("no llama.cpp feature line in the log:\n{log}"));
    // What scripts/build-arm64.sh --cpu compiles in (and qemu's core has): n1 has the int8
    // dot product; v1 and v2 add the int8 matrix multiply and SVE.
    let features: &[&str] = match std::env::var("MESH_ARM64_CPU").as_deref() {
        Ok("n1") => &["NEON = 1", "DOTPROD = 1"],
        _ => &["NEON = 1", "DOTPROD = 1", "MATMUL_INT8 = 1", "SVE = 1"],
    };
    for feature in features {
        assert!(line.contains(feature), "{feature} missing: {line}");
    }
}

/// `scripts/build-arm64.sh ARGS`: its exit code and standard error.
fn build_script(args: &[&str]) -> (Option<i32>, String) {
    let o = Command::new("bash")
        .arg(root().join("scripts/build-arm64.sh"))
        .args(args)
        .output()
        .expect("bash runs");
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn the_build_script_refuses_a_cpu_it_has_no_flags_for() {
    let (code, err) = build_script(&["--cpu", "v9"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--cpu must be n1, v1 or v2, not v9"), "{err}");
}

#[test]
fn the_build_script_refuses_a_profile_it_does_not_know() {
    let (code, err) = build_script(&["--profile", "dev"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("--profile must be release or arm64-smoke, not dev"),
        "{err}"
    );
}
