#!/usr/bin/env python3
"""Builds mesh's container image as an OCI archive, with no registry and no base image.

    scripts/image.py [--arch amd64|arm64] [--bin PATH] [--sysroot DIR] [--out FILE]

The image is one layer written from scratch:
  /usr/local/bin/mesh           the binary (debug info stripped)
  /lib*/..., /usr/lib/...       its shared libraries and ELF interpreter, found by
                                reading ELF headers (readelf) under --sysroot, so an arm64
                                image is built on x86 from a sysroot of arm64 libraries
  /models/                      the bundled tiers, embedder, tokenizer and fixtures
  /etc/passwd, /etc/group       the user 65532 the image runs as
  /tmp                          mode 1777

The archive is an OCI image layout (index.json, oci-layout, blobs/sha256/...) that
`podman load` reads, plus Docker's manifest.json so `docker load` reads it too. The
image is named mesh:VERSION-ARCH, as `mesh deploy k8s` expects. Everything is
deterministic (sorted entries, zero times and owners), so the same inputs give the
same digests.
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Debian's multiarch library folders, per image architecture.
ARCHES = {
    "amd64": {"triple": "x86_64-linux-gnu", "machine": "X86-64", "strip": ["strip", "x86_64-linux-gnu-strip"]},
    "arm64": {"triple": "aarch64-linux-gnu", "machine": "AArch64", "strip": ["aarch64-linux-gnu-strip"]},
}
# Model files that are build recipes, not runtime data.
MODEL_SKIP = {"recipe"}


def die(msg):
    print(f"image.py: {msg}", file=sys.stderr)
    sys.exit(1)


def readelf(args, path):
    out = subprocess.run(["readelf", *args, path], capture_output=True, text=True)
    if out.returncode != 0:
        die(f"readelf {' '.join(args)} {path}: {out.stderr.strip()}")
    return out.stdout


def elf_machine(path):
    m = re.search(r"Machine:\s+(.*)", readelf(["-h"], path))
    return m.group(1).strip() if m else "?"


def needed(path):
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", readelf(["-d"], path))


def interpreter(path):
    m = re.search(r"Requesting program interpreter: ([^\]]+)\]", readelf(["-l"], path))
    return m.group(1) if m else None


def lib_dirs(triple):
    return [f"lib/{triple}", f"usr/lib/{triple}", "lib64", "lib", "usr/lib64", "usr/lib"]


def find_lib(sysroot, triple, name):
    for d in lib_dirs(triple):
        p = os.path.join(sysroot, d, name)
        if os.path.exists(p):
            return "/" + d + "/" + name, p
    return None


def closure(binary, sysroot, triple):
    """Every shared library `binary` loads, as (path in the image, file on this machine)."""
    found, todo, seen = [], list(needed(binary)), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        hit = find_lib(sysroot, triple, name)
        if hit is None:
            die(f"{name} (needed by the binary) not found under {sysroot} in {lib_dirs(triple)}")
        found.append(hit)
        todo.extend(needed(os.path.realpath(hit[1])))
    interp = interpreter(binary)
    if interp is None:
        die(f"{binary} has no ELF interpreter (a static binary needs no image libraries; not supported)")
    src = os.path.join(sysroot, interp.lstrip("/"))
    if not os.path.exists(src):
        die(f"the ELF interpreter {interp} is not under {sysroot}")
    found.append((interp, src))
    return sorted(set(found))


class Layer:
    """A deterministic tar: entries sorted by path, owner root, time zero."""

    def __init__(self):
        self.entries = {}

    def dir(self, path, mode=0o755):
        self.entries[path.strip("/")] = ("dir", mode, None)

    def file(self, path, data, mode=0o644):
        parts = path.strip("/").split("/")
        for i in range(1, len(parts)):
            self.entries.setdefault("/".join(parts[:i]), ("dir", 0o755, None))
        self.entries[path.strip("/")] = ("file", mode, data)

    def tar(self):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
            for path in sorted(self.entries):
                kind, mode, data = self.entries[path]
                info = tarfile.TarInfo(path)
                info.mode, info.mtime, info.uid, info.gid = mode, 0, 0, 0
                if kind == "dir":
                    info.type = tarfile.DIRTYPE
                    t.addfile(info)
                else:
                    info.size = len(data)
                    t.addfile(info, io.BytesIO(data))
        return buf.getvalue()


def stripped(binary, tools):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "mesh")
        for tool in tools:
            if shutil.which(tool) and subprocess.run(
                [tool, "--strip-debug", "-o", out, binary], capture_output=True
            ).returncode == 0:
                with open(out, "rb") as f:
                    return f.read()
    print("image.py: no strip tool for this architecture; the binary keeps its debug info", file=sys.stderr)
    with open(binary, "rb") as f:
        return f.read()


def blob(blobs, data):
    digest = hashlib.sha256(data).hexdigest()
    with open(os.path.join(blobs, digest), "wb") as f:
        f.write(data)
    return "sha256:" + digest


def version():
    with open(os.path.join(ROOT, "Cargo.toml")) as f:
        m = re.search(r'^\[workspace\.package\][^\[]*?^version\s*=\s*"([^"]+)"', f.read(), re.M | re.S)
    if not m:
        die("no [workspace.package] version in Cargo.toml")
    return m.group(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--arch", choices=sorted(ARCHES), default="amd64")
    ap.add_argument("--bin", help="the mesh binary (default target/release/mesh, or "
                    "target/aarch64-v1/aarch64-unknown-linux-gnu/release/mesh for arm64)")
    ap.add_argument("--sysroot", default="/", help="where the binary's libraries are (default /)")
    ap.add_argument("--models", default=os.path.join(ROOT, "models"))
    ap.add_argument("--out", help="archive path (default target/image/mesh-VERSION-ARCH.oci.tar)")
    a = ap.parse_args()
    arch = ARCHES[a.arch]
    ver = version()
    tag = f"mesh:{ver}-{a.arch}"
    binary = a.bin or os.path.join(
        ROOT, "target", "release" if a.arch == "amd64" else "aarch64-v1/aarch64-unknown-linux-gnu/release", "mesh")
    if not os.path.exists(binary):
        die(f"{binary} not found: build it first (cargo build --release, or scripts/build-arm64.sh for arm64)")
    machine = elf_machine(binary)
    if machine.replace("Advanced Micro Devices ", "") != arch["machine"]:
        die(f"{binary} is built for {machine}, not {a.arch}")
    out = a.out or os.path.join(ROOT, "target", "image", f"mesh-{ver}-{a.arch}.oci.tar")

    layer = Layer()
    for d in ["etc", "tmp", "usr/local/bin", "models"]:
        layer.dir(d, 0o1777 if d == "tmp" else 0o755)
    layer.file("usr/local/bin/mesh", stripped(binary, arch["strip"]), 0o755)
    libs = closure(binary, a.sysroot, arch["triple"])
    for dest, src in libs:
        with open(os.path.realpath(src), "rb") as f:
            layer.file(dest, f.read(), 0o755)
    layer.file("etc/passwd", b"root:x:0:0:root:/root:/sbin/nologin\nmesh:x:65532:65532:mesh:/tmp:/sbin/nologin\n")
    layer.file("etc/group", b"root:x:0:\nmesh:x:65532:\n")
    models = 0
    for dirpath, dirnames, filenames in os.walk(a.models):
        dirnames[:] = sorted(d for d in dirnames if d not in MODEL_SKIP)
        for name in sorted(filenames):
            src = os.path.join(dirpath, name)
            rel = os.path.relpath(src, a.models)
            with open(src, "rb") as f:
                data = f.read()
            if data.startswith(b"version https://git-lfs"):
                die(f"{src} is a Git LFS pointer, not the model: fetch the models first")
            layer.file("models/" + rel, data)
            models += 1

    raw = layer.tar()
    diff_id = "sha256:" + hashlib.sha256(raw).hexdigest()
    gz = gzip.compress(raw, compresslevel=6, mtime=0)
    with tempfile.TemporaryDirectory() as tmp:
        blobs = os.path.join(tmp, "blobs", "sha256")
        os.makedirs(blobs)
        layer_digest = blob(blobs, gz)
        config = {
            "architecture": a.arch,
            "os": "linux",
            "created": "1970-01-01T00:00:00Z",
            "config": {
                "User": "65532:65532",
                "Entrypoint": ["/usr/local/bin/mesh"],
                "Cmd": ["--help"],
                "Env": ["PATH=/usr/local/bin", "MESH_MODELS_DIR=/models"],
                "WorkingDir": "/",
                "ExposedPorts": {"8080/tcp": {}, "7070/udp": {}},
                "Labels": {
                    "org.opencontainers.image.title": "mesh",
                    "org.opencontainers.image.version": ver,
                },
            },
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
            "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "scripts/image.py"}],
        }
        cfg = json.dumps(config, sort_keys=True).encode()
        cfg_digest = blob(blobs, cfg)
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": cfg_digest, "size": len(cfg)},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                        "digest": layer_digest, "size": len(gz)}],
        }
        man = json.dumps(manifest, sort_keys=True).encode()
        man_digest = blob(blobs, man)
        index = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [{
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": man_digest, "size": len(man),
                "platform": {"architecture": a.arch, "os": "linux"},
                "annotations": {
                    "org.opencontainers.image.ref.name": tag,
                    "io.containerd.image.name": f"docker.io/library/{tag}",
                },
            }],
        }
        with open(os.path.join(tmp, "index.json"), "w") as f:
            json.dump(index, f, sort_keys=True)
        with open(os.path.join(tmp, "oci-layout"), "w") as f:
            json.dump({"imageLayoutVersion": "1.0.0"}, f)
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump([{
                "Config": "blobs/sha256/" + cfg_digest.split(":")[1],
                "RepoTags": [tag],
                "Layers": ["blobs/sha256/" + layer_digest.split(":")[1]],
            }], f)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as t:
            for name in ["oci-layout", "index.json", "manifest.json", "blobs"]:
                t.add(os.path.join(tmp, name), name, filter=lambda i: (
                    setattr(i, "mtime", 0) or setattr(i, "uid", 0) or setattr(i, "gid", 0)
                    or setattr(i, "uname", "") or setattr(i, "gname", "") or i))
    size = os.path.getsize(out)
    print(f"{tag}: {out} ({size / 2**20:.1f} MiB; {len(libs)} libraries, {models} model files; "
          f"manifest {man_digest})")


if __name__ == "__main__":
    main()
