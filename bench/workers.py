#!/usr/bin/env python3
"""Spillway with one worker and with two, beside nginx with two: paired rounds of wrk.

The tail at 128 connections depends on how many of wrk's connections the second worker took
at its connect burst (see BENCHMARKS.md). Each round runs every variant once (a fresh proxy,
one 5 s wrk run like compare.py's, the 'rejecting ~half' limit given with --rate), so that a
slow period of the machine hits a round rather than a variant; prints each round and the
medians. Run after the README's set-up and `cargo build --release` (compare.sh installs wrk).

With --pin, the proxy and the app share one CPU and wrk runs alone on another (the first two
this process may use): a sidecar beside its app on one core, with the load generator out of
their way (the default lets the scheduler put the three anywhere on the machine's cores).

Everything listens on 127.0.0.1 and every process started here is stopped by its PID.
"""

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare as C  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conns", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--rate", type=int, default=315, help="per-key limit (requests/s)")
    ap.add_argument("--pin", action="store_true",
                    help="proxy and app on one CPU, wrk alone on another")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin and len(cpus) < 2:
        sys.exit("--pin needs two CPUs")
    shared_cpu, wrk_cpu = (cpus[0], cpus[1]) if args.pin else (None, None)
    script = os.path.join(tempfile.mkdtemp(prefix="spillway-bench-"), "keys.lua")
    with open(script, "w") as f:
        f.write(C.WRK_SCRIPT)

    up_port, upstream = C.start_upstream()
    if args.pin:
        C.pin(upstream.pids(), shared_cpu)
    rule = C.rule(f"{args.rate}/s")
    variants = [
        ("spillway, 1 worker", lambda p: C.start_spillway("workers: 1\n" + C.spillway_yaml(p, up_port, rule), p)),
        ("spillway, 2 workers", lambda p: C.start_spillway("workers: 2\n" + C.spillway_yaml(p, up_port, rule), p)),
        ("nginx, 2 workers", lambda p: C.start_nginx(C.nginx_proxy(p, up_port, args.rate), 2, p)),
    ]
    results = {name: [] for name, _ in variants}
    try:
        for r in range(args.rounds):
            line = []
            for name, start in variants:
                port = C.free_port()
                proc = start(port)
                try:
                    if args.pin:
                        C.pin(proc.pids(), shared_cpu)
                    res = C.wrk(port, args.conns, args.seconds, script, cpu=wrk_cpu)
                finally:
                    proc.stop()
                results[name].append(res)
                line.append(f"{name}: {res['rps']:.0f} req/s p99 {res['p99']:.2f}")
            print(f"round {r + 1}: " + "; ".join(line), file=sys.stderr, flush=True)
    finally:
        upstream.stop()

    print(f"\n{args.rounds} paired rounds x {args.seconds} s, {args.conns} connections, "
          f"limit {args.rate}/s per key over {C.KEYS} keys"
          f"{f'; proxy and app on CPU {shared_cpu}, wrk on CPU {wrk_cpu}' if args.pin else ''}; medians.\n")
    print("| proxy | req/s | p50 ms | p99 ms | p99.9 ms |")
    print("|---|---|---|---|---|")
    for name, rs in results.items():
        med = {k: statistics.median(x[k] for x in rs) for k in ("rps", "p50", "p99", "p999")}
        print(f"| {name} | {med['rps']:.0f} | {med['p50']:.2f} | {med['p99']:.2f} | {med['p999']:.2f} |")
    one, two = results["spillway, 1 worker"], results["spillway, 2 workers"]
    lower = sum(a["p99"] < b["p99"] for a, b in zip(one, two))
    print(f"\np99 lower with 1 worker than with 2 in {lower} of {args.rounds} rounds.")
    nginx = results["nginx, 2 workers"]
    for name in ("spillway, 1 worker", "spillway, 2 workers"):
        rs = results[name]
        faster = sum(a["rps"] > b["rps"] for a, b in zip(rs, nginx))
        lower = sum(a["p99"] < b["p99"] for a, b in zip(rs, nginx))
        print(f"{name} against nginx: more req/s in {faster}, lower p99 in {lower} of {args.rounds} rounds.")


if __name__ == "__main__":
    main()
