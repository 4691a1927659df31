//! Running mesh as a fleet: nodes that listen on every address and advertise one,
//! Kubernetes manifests (`mesh deploy k8s`) checked against Kubernetes' own schemas, and the
//! container image (`scripts/image.py`) unpacked and run from its own root filesystem.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use mesh_tests::{certs, greedy_reply, members, mesh, mesh_bin, root, Node};
use serde_json::{json, Value};

fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .expect("a free UDP port")
        .port()
}

/// `mesh join` arguments with `--quic` set to `quic` instead of the helper's default.
fn join_args(name: &str, certs: &Path, seeds: &[&str], quic: &str, extra: &[&str]) -> Vec<String> {
    let mut args = Node::join_args(name, certs, seeds, "t1", extra);
    let i = args.iter().position(|a| a == "--quic").expect("--quic");
    args[i + 1] = quic.to_owned();
    args
}

#[test]
fn a_node_listening_on_every_address_without_an_advertised_one_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let certs = certs(dir.path(), &["a"]);
    let args = join_args("a", &certs, &[], "0.0.0.0:0", &[]);
    let log = dir.path().join("a.log");
    let err = match Node::spawn(&mesh_bin(), &args, &log, &[]) {
        Ok(_) => panic!("a node on 0.0.0.0 without --advertise started"),
        Err(log) => log,
    };
    assert!(err.contains("--advertise"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_dial_the_advertised_address_and_a_node_skips_itself_among_its_seeds() {
    let dir = tempfile::tempdir().unwrap();
    let certs = certs(dir.path(), &["a", "b"]);
    let (pa, pb) = (free_udp_port(), free_udp_port());
    let (adv_a, adv_b) = (format!("127.0.0.1:{pa}"), format!("127.0.0.1:{pb}"));
    // The same seed list for both, as a StatefulSet gives every pod: `a` is its own seed.
    let seeds = [adv_a.as_str()];
    let args_a = join_args(
        "a",
        &certs,
        &seeds,
        &format!("0.0.0.0:{pa}"),
        &["--advertise", &adv_a],
    );
    let a = Node::spawn(&mesh_bin(), &args_a, &dir.path().join("a.log"), &[]).expect("a starts");
    let args_b = join_args(
        "b",
        &certs,
        &seeds,
        &format!("0.0.0.0:{pb}"),
        &["--advertise", &adv_b],
    );
    let b = Node::spawn(&mesh_bin(), &args_b, &dir.path().join("b.log"), &[]).expect("b starts");
    let t0 = Instant::now();
    loop {
        let ms = members(&a.http).await;
        let seen_b = ms
            .iter()
            .find(|m| m["node"] == "b")
            .map(|m| (m["state"].clone(), m["quic_addr"].clone()));
        if seen_b == Some((json!("alive"), json!(adv_b))) {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "a never saw b alive at {adv_b}: {ms:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let from_b = members(&b.http).await;
    let a_seen = from_b.iter().find(|m| m["node"] == "a").expect("b lists a");
    assert_eq!(a_seen["quic_addr"], json!(adv_a));
}

/// A cluster CA and a key file in a temp dir, for `mesh deploy k8s`.
struct DeployInputs {
    dir: tempfile::TempDir,
}

impl DeployInputs {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("certs");
        assert!(mesh(&["cert", "init", "--dir", d.to_str().unwrap()])
            .status
            .success());
        let keys = dir.path().join("keys.json");
        assert!(mesh(&[
            "keys",
            "create",
            "--scope",
            "inference",
            "--file",
            keys.to_str().unwrap()
        ])
        .status
        .success());
        Self { dir }
    }

    fn certs(&self) -> PathBuf {
        self.dir.path().join("certs")
    }

    /// Runs `mesh deploy k8s` with two pools on arm64 and returns the manifest file.
    fn deploy(&self) -> PathBuf {
        let out = self.dir.path().join("mesh.yaml");
        let o = mesh(&[
            "deploy",
            "k8s",
            "--pool",
            "small=t1+t2:3",
            "--pool",
            "large=t3:2",
            "--arch",
            "arm64",
            "--cert-dir",
            self.certs().to_str().unwrap(),
            "--keys",
            self.dir.path().join("keys.json").to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(
            o.status.success(),
            "mesh deploy k8s failed: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        out
    }
}

fn documents(file: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(file).unwrap();
    text.split("\n---\n")
        .skip(1)
        .map(|d| serde_norway::from_str::<Value>(d).expect("a YAML document"))
        .collect()
}

fn python_tool(name: &str) -> PathBuf {
    // The virtualenv's scripts sit beside its python.
    let python = std::env::var("MESH_PYTHON").unwrap_or_else(|_| "python3".into());
    let bin = Path::new(&python).parent().map(|p| p.join(name));
    match bin {
        Some(b) if b.exists() => b,
        _ => PathBuf::from(name),
    }
}

#[test]
fn deploy_k8s_manifests_pass_the_schemas_of_two_kubernetes_versions() {
    let inputs = DeployInputs::new();
    let file = inputs.deploy();
    for version in ["1.30.0", "1.37.0"] {
        let out = Command::new(python_tool("kubernetes-validate"))
            .args(["--strict", "-k", version])
            .arg(&file)
            .output()
            .expect("kubernetes-validate runs (scripts/setup.sh installs it)");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "Kubernetes {version}: {text}");
        // Kinds it has no schema for are only warnings with exit 0.
        assert!(
            !text
                .lines()
                .any(|l| l.starts_with("WARN") || l.starts_with("ERROR")),
            "Kubernetes {version}: {text}"
        );
        assert_eq!(
            text.lines().filter(|l| l.starts_with("INFO")).count(),
            documents(&file).len(),
            "every document validated against {version}: {text}"
        );
    }
}

#[test]
fn deploy_k8s_puts_every_pods_certificate_but_not_the_ca_key_in_the_secret() {
    let inputs = DeployInputs::new();
    let docs = documents(&inputs.deploy());
    let secret = docs
        .iter()
        .find(|d| d["kind"] == "Secret" && d["metadata"]["name"] == "mesh-certs")
        .expect("the certificate Secret");
    let mut files: Vec<String> = secret["stringData"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    files.sort();
    let mut want = vec!["ca.pem".to_owned()];
    for pod in [
        "mesh-large-0",
        "mesh-large-1",
        "mesh-small-0",
        "mesh-small-1",
        "mesh-small-2",
    ] {
        want.push(format!("{pod}.key"));
        want.push(format!("{pod}.pem"));
    }
    want.sort();
    assert_eq!(files, want);
}

#[test]
fn deploy_k8s_without_a_key_file_or_the_insecure_flag_is_refused() {
    let inputs = DeployInputs::new();
    let o = mesh(&[
        "deploy",
        "k8s",
        "--cert-dir",
        inputs.certs().to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--keys"), "{err}");
}

#[test]
fn deploy_k8s_with_a_key_file_holding_no_key_is_refused() {
    let inputs = DeployInputs::new();
    let empty = inputs.dir.path().join("empty.json");
    std::fs::write(&empty, r#"{"keys": []}"#).unwrap();
    let o = mesh(&[
        "deploy",
        "k8s",
        "--cert-dir",
        inputs.certs().to_str().unwrap(),
        "--keys",
        empty.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("holds no key"), "{err}");
}

#[test]
fn deploy_k8s_with_a_pool_naming_an_unknown_tier_is_refused() {
    let inputs = DeployInputs::new();
    let o = mesh(&[
        "deploy",
        "k8s",
        "--pool",
        "big=t9:2",
        "--cert-dir",
        inputs.certs().to_str().unwrap(),
        "--keys",
        inputs.dir.path().join("keys.json").to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("unknown tier") && err.contains("t9"), "{err}");
}

#[test]
fn deploy_k8s_without_a_cluster_ca_says_how_to_make_one() {
    let dir = tempfile::tempdir().unwrap();
    let o = mesh(&[
        "deploy",
        "k8s",
        "--insecure-no-auth",
        "--cert-dir",
        dir.path().join("none").to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("mesh cert init"), "{err}");
}

/// The image built once for this test binary from the `mesh` binary under test, and its
/// root filesystem unpacked the way a container runtime does (index → manifest → layers).
struct Image {
    _dir: tempfile::TempDir,
    archive: PathBuf,
    rootfs: PathBuf,
}

fn image() -> &'static Image {
    static IMAGE: OnceLock<Image> = OnceLock::new();
    IMAGE.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let archive = dir.path().join("mesh.oci.tar");
        let python = std::env::var("MESH_PYTHON").unwrap_or_else(|_| "python3".into());
        let o = Command::new(python)
            .arg(root().join("scripts/image.py"))
            .args(["--arch", "amd64", "--bin"])
            .arg(mesh_bin())
            .arg("--out")
            .arg(&archive)
            .output()
            .expect("scripts/image.py runs");
        assert!(
            o.status.success(),
            "image.py failed: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let layout = dir.path().join("layout");
        let rootfs = dir.path().join("rootfs");
        std::fs::create_dir_all(&layout).unwrap();
        std::fs::create_dir_all(&rootfs).unwrap();
        let untar = |args: &[&str], file: &Path, into: &Path| {
            let ok = Command::new("tar")
                .args(args)
                .arg(file)
                .arg("-C")
                .arg(into)
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "tar {args:?} {}", file.display());
        };
        untar(&["-xf"], &archive, &layout);
        let read =
            |p: PathBuf| -> Value { serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap() };
        let blob = |digest: &Value| {
            let d = digest.as_str().unwrap().strip_prefix("sha256:").unwrap();
            layout.join("blobs/sha256").join(d)
        };
        let index = read(layout.join("index.json"));
        let manifest = read(blob(&index["manifests"][0]["digest"]));
        for layer in manifest["layers"].as_array().unwrap() {
            untar(&["-xzf"], &blob(&layer["digest"]), &rootfs);
        }
        Image {
            _dir: dir,
            archive,
            rootfs,
        }
    })
}

/// `chroot ROOTFS /usr/local/bin/mesh ARGS` as the image's user.
fn in_image(args: &[&str]) -> Vec<String> {
    let mut v = vec![
        "--userspec=65532:65532".to_owned(),
        image().rootfs.display().to_string(),
        "/usr/local/bin/mesh".to_owned(),
    ];
    v.extend(args.iter().map(|s| s.to_string()));
    v
}

#[test]
fn the_image_runs_mesh_version_from_its_own_root_filesystem() {
    let out = Command::new("chroot")
        .args(in_image(&["--version"]))
        .output()
        .expect("chroot runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let host = mesh(&["--version"]);
    assert_eq!(out.stdout, host.stdout);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_answers_a_chat_as_the_host_binary_does() {
    let dir = tempfile::tempdir().unwrap();
    let node_args = ["up", "--port", "0", "--only", "t1", "--threads", "1"];
    let mut args = in_image(&node_args[..1]);
    args.extend(node_args[1..].iter().map(|s| s.to_string()));
    let contained = Node::spawn(
        Path::new("chroot"),
        &args,
        &dir.path().join("image.log"),
        &[("MESH_MODELS_DIR", "/models")],
    )
    .expect("mesh up runs from the image");
    let from_image = greedy_reply(&contained.http).await;
    drop(contained);
    let host = Node::up(dir.path(), &["--only", "t1", "--threads", "1"]).expect("host node");
    let from_host = greedy_reply(&host.http).await;
    assert!(!from_image.is_empty());
    assert_eq!(from_image, from_host);
}

#[test]
fn podman_loads_the_image_archive_under_its_name_and_architecture() {
    let store = tempfile::tempdir().unwrap();
    let podman = |args: &[&str]| {
        Command::new("podman")
            .arg("--root")
            .arg(store.path().join("root"))
            .arg("--runroot")
            .arg(store.path().join("run"))
            .args(["--storage-driver", "vfs"])
            .args(args)
            .output()
            .expect("podman runs (scripts/setup.sh installs it)")
    };
    let load = podman(&["load", "-i", image().archive.to_str().unwrap()]);
    assert!(
        load.status.success(),
        "{}",
        String::from_utf8_lossy(&load.stderr)
    );
    let tag = format!("mesh:{}-amd64", env!("CARGO_PKG_VERSION"));
    let inspect = podman(&[
        "image",
        "inspect",
        &tag,
        "--format",
        "{{.Architecture}} {{.Os}} {{.Config.User}} {{index .Config.Entrypoint 0}}",
    ]);
    assert_eq!(
        String::from_utf8_lossy(&inspect.stdout).trim(),
        "amd64 linux 65532:65532 /usr/local/bin/mesh",
        "{}",
        String::from_utf8_lossy(&inspect.stderr)
    );
}

/// `scripts/image.py ARGS` (it writes nothing before its checks pass).
fn image_py(args: &[&str]) -> std::process::Output {
    let python = std::env::var("MESH_PYTHON").unwrap_or_else(|_| "python3".into());
    Command::new(python)
        .arg(root().join("scripts/image.py"))
        .args(args)
        .output()
        .expect("scripts/image.py runs")
}

#[test]
fn image_py_refuses_a_binary_built_for_another_architecture() {
    let bin = mesh_bin();
    let o = image_py(&["--arch", "arm64", "--bin", bin.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("is built for") && err.contains("not arm64"),
        "{err}"
    );
}

#[test]
fn image_py_refuses_a_binary_that_is_not_there() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("mesh");
    let o = image_py(&["--arch", "amd64", "--bin", missing.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("not found: build it first"), "{err}");
}
