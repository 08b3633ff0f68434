#!/usr/bin/env python3
"""A burst of new keep-alive clients, Spillway beside nginx: what a cold start costs.

Starts a fresh proxy (one worker each, no rules, the same nginx upstream as bench/compare.py),
then h2load opens N connections at once and sends R requests on each. Prints, as medians over
the repetitions: how long the whole run took, the slowest request, and the CPU time the proxy's
threads used (from /proc/<pid>/task/*/schedstat, nanoseconds). A fresh process per repetition:
what is measured is the first contact, the descriptors, connections and buffers a warm proxy
already has. Run after `cargo build --release`:

    python3 bench/burst.py [--conns 128] [--requests 2] [--reps 6] [--baseline OTHER_SPILLWAY]

Everything listens on 127.0.0.1 and every process started here is stopped by its PID.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare as C  # noqa: E402


def cpu_ms(pids):
    """CPU time used so far by every thread of `pids`, in milliseconds."""
    total = 0
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except OSError:
                pass  # a thread that ended meanwhile
    return total / 1e6


def to_ms(text):
    """h2load's '1.23ms' / '456us' / '1.2s' in milliseconds."""
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]


def one(name, binary, up, conns, requests):
    port = C.free_port()
    if name == "nginx":
        proc = C.start_nginx(C.nginx_proxy(port, up, None), 1, port)
    else:
        proc = C.start_spillway(C.spillway_yaml(port, up, None) + "workers: 1\n", port, binary=binary)
    try:
        pids = proc.pids()
        time.sleep(0.3)  # past start-up work, which is not what is measured
        before = cpu_ms(pids)
        out = subprocess.run(["h2load", "--h1", "-c", str(conns), "-n", str(conns * requests), "-t", "1",
                              f"http://127.0.0.1:{port}/api/x"], capture_output=True, text=True).stdout
        time.sleep(0.2)  # closes and the last writes
        used = cpu_ms(pids) - before
    finally:
        proc.stop()
    took = re.search(r"finished in ([\d.]+\w+),", out)
    slowest = re.search(r"time for request:\s+\S+\s+(\S+)", out)
    ok = re.search(r"status codes: (\d+) 2xx", out)
    if not (took and slowest and ok) or int(ok.group(1)) != conns * requests:
        raise RuntimeError(f"h2load against {name} said: {out}")
    return to_ms(took.group(1)), to_ms(slowest.group(1)), used


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--conns", type=int, default=128)
    ap.add_argument("--requests", type=int, default=2, help="requests on each connection")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--baseline", default="", help="another spillway binary, run beside this one")
    args = ap.parse_args()

    proxies = [("spillway", C.SPILLWAY), ("nginx", None)]
    if args.baseline:
        proxies.append(("baseline", args.baseline))
    up, upstream = C.start_upstream()
    results = {name: [] for name, _ in proxies}
    try:
        for _ in range(args.reps):
            for name, binary in proxies:
                results[name].append(one(name, binary, up, args.conns, args.requests))
    finally:
        upstream.stop()

    print(f"\n{args.conns} new connections at once, {args.requests} requests each, one worker, "
          f"fresh process; medians of {args.reps}.\n")
    print("| proxy | run ms | slowest request ms | proxy CPU ms |")
    print("|---|---|---|---|")
    for name, rs in results.items():
        med = [statistics.median(r[i] for r in rs) for i in range(3)]
        print(f"| {name} | {med[0]:.1f} | {med[1]:.1f} | {med[2]:.1f} |")


if __name__ == "__main__":
    main()
