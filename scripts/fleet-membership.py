#!/usr/bin/env python3
"""Membership of a fleet of real `mesh join` processes on one host: how long N nodes take
to see each other, the control traffic each node sends and receives at rest, how long until
every node sees a killed node as dead, and whether any node is ever wrongly declared dead.

    scripts/fleet-membership.py --nodes 32 --out fleet-membership-32.json
    scripts/fleet-membership.py --nodes 8 --bin target/release/mesh --quiet-s 20

Nodes run the `store` role with no tiers (no model is loaded), on 127.0.0.1 with the
production heartbeat (250 ms) and failure timeout (2 s) unless told otherwise; node n0 is
every other node's seed. Traffic is the UDP bytes of each node's peer connections
(`udp_tx_bytes` / `udp_rx_bytes` in `/v1/cluster`), read twice `--quiet-s` apart. Every
node's `/v1/cluster` is polled throughout; a peer other than the killed one seen in any
state but `alive` after the fleet formed is a false death.

Needs Python 3 only. Exit status 0 when the run completed (whatever it measured), 1 when
the fleet did not form or the killed node was not seen dead in time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cluster(http: str) -> list[dict]:
    with urllib.request.urlopen(f"{http}/v1/cluster", timeout=5) as r:
        return json.load(r)["members"]


class Node:
    def __init__(self, name: str, proc: subprocess.Popen, http: str, quic: str):
        self.name, self.proc, self.http, self.quic = name, proc, http, quic

    def rss_mib(self) -> float:
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def cpu_s(self) -> float:
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            return 0.0


def start(bin_: str, work: str, name: str, seed: str | None, a: argparse.Namespace) -> Node:
    args = [bin_, "join", "--name", name, "--quic", "127.0.0.1:0", "--port", "0",
            "--tiers", "none", "--roles", "store", "--kv-dir", os.path.join(work, "kv", name),
            "--cert-dir", os.path.join(work, "certs"),
            "--heartbeat-ms", str(a.heartbeat_ms), "--failure-timeout-ms", str(a.failure_timeout_ms)]
    if seed:
        args += ["--seeds", seed]
    log = open(os.path.join(work, f"{name}.log"), "w")
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT,
                         env={**os.environ, "RUST_LOG": "warn"})
    quic = ""
    for line in p.stdout:
        m = re.search(r" quic on (\S+)", line)
        if m:
            quic = m.group(1)
        if line.startswith("mesh listening on "):
            http = line.strip().removeprefix("mesh listening on ")
            threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
            return Node(name, p, http, quic)
    raise SystemExit(f"{name} exited before listening; log: {os.path.join(work, name + '.log')}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "mesh"))
    ap.add_argument("--heartbeat-ms", type=int, default=250)
    ap.add_argument("--failure-timeout-ms", type=int, default=2000)
    ap.add_argument("--quiet-s", type=float, default=60.0, help="steady-state window (traffic, false deaths)")
    ap.add_argument("--out", help="JSON results")
    a = ap.parse_args()
    if a.nodes < 3:
        print("--nodes must be at least 3", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="fleet-membership-")
    names = [f"n{i}" for i in range(a.nodes)]
    certs = os.path.join(work, "certs")
    subprocess.run([a.bin, "cert", "init", "--dir", certs], check=True, capture_output=True)
    for n in names:
        subprocess.run([a.bin, "cert", "issue", n, "--dir", certs], check=True, capture_output=True)
    nodes: list[Node] = []
    out: dict = {"nodes": a.nodes, "heartbeat_ms": a.heartbeat_ms,
                 "failure_timeout_ms": a.failure_timeout_ms, "quiet_s": a.quiet_s,
                 "host": {"nproc": os.cpu_count()}, "command": " ".join(sys.argv)}
    try:
        t0 = time.monotonic()
        nodes.append(start(a.bin, work, names[0], None, a))
        for n in names[1:]:
            nodes.append(start(a.bin, work, n, nodes[0].quic, a))
        started = time.monotonic()
        out["start_s"] = round(started - t0, 2)

        def alive_counts(ns: list[Node]) -> list[int]:
            return [sum(m["state"] == "alive" for m in cluster(n.http)) for n in ns]

        while min(alive_counts(nodes)) < a.nodes:
            if time.monotonic() - started > 120:
                print(f"the fleet did not form in 120 s: {alive_counts(nodes)}", file=sys.stderr)
                return 1
            time.sleep(0.1)
        out["formed_s"] = round(time.monotonic() - started, 2)
        print(f"{a.nodes} nodes see each other {out['formed_s']} s after the last started", flush=True)

        # Steady state: traffic and false deaths.
        def traffic() -> list[tuple[int, int]]:
            res = []
            for n in nodes:
                ms = cluster(n.http)
                res.append((sum(m.get("udp_tx_bytes", 0) for m in ms), sum(m.get("udp_rx_bytes", 0) for m in ms)))
            return res

        false_deaths: set[tuple[str, str]] = set()

        def watch(until: float, spare: str | None) -> None:
            while time.monotonic() < until:
                for n in nodes:
                    if n.name == spare:
                        continue
                    for m in cluster(n.http):
                        if m["node"] != spare and m["state"] != "alive":
                            false_deaths.add((n.name, m["node"]))
                time.sleep(0.25)

        cpu0 = [n.cpu_s() for n in nodes]
        b0, tb0 = traffic(), time.monotonic()
        watch(tb0 + a.quiet_s, None)
        b1, tb1 = traffic(), time.monotonic()
        cpu1 = [n.cpu_s() for n in nodes]
        dt = tb1 - tb0
        tx = sorted((x1 - x0) / dt for (x0, _), (x1, _) in zip(b0, b1))
        rx = sorted((y1 - y0) / dt for (_, y0), (_, y1) in zip(b0, b1))
        cpu = sorted((c1 - c0) / dt for c0, c1 in zip(cpu0, cpu1))
        med = lambda v: v[len(v) // 2]  # noqa: E731
        out["control_bytes_per_node_s"] = {"tx_median": round(med(tx)), "tx_max": round(tx[-1]),
                                           "rx_median": round(med(rx)), "rx_max": round(rx[-1])}
        out["cpu_cores_per_node"] = {"median": round(med(cpu), 4), "max": round(cpu[-1], 4)}
        out["rss_mib_per_node"] = {"median": round(sorted(n.rss_mib() for n in nodes)[a.nodes // 2], 1)}
        print(f"at rest over {dt:.1f} s: each node sends {med(tx):.0f} B/s (max {tx[-1]:.0f}) and receives "
              f"{med(rx):.0f} B/s; CPU {med(cpu):.4f} cores; RSS {out['rss_mib_per_node']['median']} MiB", flush=True)

        # Failure: kill the last node, time until every other node sees it dead.
        victim = nodes[-1]
        others = nodes[:-1]
        victim.proc.send_signal(signal.SIGKILL)
        tk = time.monotonic()
        seen: dict[str, float] = {}
        while len(seen) < len(others):
            for n in others:
                if n.name in seen:
                    continue
                st = next((m["state"] for m in cluster(n.http) if m["node"] == victim.name), "absent")
                if st != "alive":
                    seen[n.name] = time.monotonic() - tk
            if time.monotonic() - tk > 60:
                print(f"{victim.name} not seen dead by all in 60 s ({len(seen)} of {len(others)})", file=sys.stderr)
                return 1
            time.sleep(0.02)
        ts = sorted(seen.values())
        out["failure_seen_s"] = {"first": round(ts[0], 3), "median": round(med(ts), 3), "all": round(ts[-1], 3)}
        print(f"{victim.name} killed: first saw it dead after {ts[0]:.2f} s, all {len(others)} after {ts[-1]:.2f} s", flush=True)
        watch(time.monotonic() + 5, victim.name)
        out["false_deaths"] = sorted(f"{a_} saw {b_}" for a_, b_ in false_deaths)
        print(f"false deaths: {len(false_deaths)}", flush=True)
    finally:
        for n in nodes:
            if n.proc.poll() is None:
                n.proc.send_signal(signal.SIGKILL)
        for n in nodes:
            n.proc.wait()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
