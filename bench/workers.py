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

With --placement, each run also says how often the proxy's busiest thread had a CPU to itself:
every 50 ms from the second second on, the CPU each thread of the proxy, the app and wrk last
ran on (/proc/PID/task/TID/stat), and the share of those looks in which neither wrk nor the
app's busiest thread was on the busiest proxy thread's CPU. On two cores shared by the three,
where the scheduler puts a busy worker sets much of a round's figure.

With --costs, each run also counts what every process spent per request: the proxy's and the
app's CPU (/proc/PID/stat) and sleeps (voluntary context switches, /proc/PID/task/*/status), and
wrk's CPU and sleeps (getrusage of this process's children): how often each woke for its work.

With --baseline BINARY, another Spillway build (two workers) runs in every round too: an A/B of
a change in paired rounds, beside nginx. With --plain-nginx, nginx also runs without the
X-Forwarded headers that Spillway sets (the harness's nginx before commit 5420b8c).

Everything listens on 127.0.0.1 and every process started here is stopped by its PID.
"""

import argparse
import os
import resource
import statistics
import sys
import tempfile
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare as C  # noqa: E402


def threads(pids):
    """{tid: (CPU it last ran on, CPU ticks used)} of every thread of `pids`."""
    out = {}
    for pid, tid in C.tasks(pids):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[tid] = (int(fields[36]), int(fields[11]) + int(fields[12]))
    return out


def sleeps(pids):
    """Voluntary context switches of every thread of `pids` so far."""
    n = 0
    for pid, tid in C.tasks(pids):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                n += sum(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        except OSError:
            continue
    return n


class Costs:
    """CPU and sleeps of the proxy, the app and wrk over one run (--costs)."""

    def __init__(self, proxy, app):
        self.groups = {"proxy": proxy, "app": app}
        self.before = self.look()

    def look(self):
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        seen = {g: (C.cpu_seconds(p), sleeps(p)) for g, p in self.groups.items()}
        seen["wrk"] = (kids.ru_utime + kids.ru_stime, kids.ru_nvcsw)
        return seen

    def per_request(self, requests):
        """{process: (CPU us per request, sleeps per 1 000 requests)}."""
        after = self.look()
        return {g: ((after[g][0] - self.before[g][0]) / requests * 1e6,
                    (after[g][1] - self.before[g][1]) / requests * 1000) for g in after}


class Placement(threading.Thread):
    """Samples where the proxy's, the app's and wrk's threads run while wrk does (--placement)."""

    def __init__(self, proxy, app):
        super().__init__(daemon=True)
        self.groups = {"proxy": proxy, "app": app}
        self.done = threading.Event()
        self.looks = []

    def run(self):
        if self.done.wait(1.0):
            return
        wrk = []
        while not self.done.wait(0.05):
            # wrk is this process's child (taskset execs it); looked for until found.
            wrk = wrk or [p for p in os.listdir("/proc") if p.isdigit() and self.is_wrk(p)]
            self.looks.append({g: threads(p) for g, p in dict(self.groups, wrk=wrk).items()})

    @staticmethod
    def is_wrk(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                name, rest = f.read().rsplit(")", 1)
        except OSError:
            return False
        return name.endswith("(wrk") and int(rest.split()[1]) == os.getpid()

    def alone(self):
        """The share of looks in which the busiest proxy thread had its CPU to itself."""
        if len(self.looks) < 2:
            return float("nan")
        first, last = self.looks[0], self.looks[-1]

        def busiest(g):
            used = {t: v[1] - first[g].get(t, (0, v[1]))[1] for t, v in last[g].items()}
            return max(used, key=used.get) if used else None

        top = {g: busiest(g) for g in ("proxy", "app", "wrk")}
        alone = 0
        for look in self.looks:
            cpu = look["proxy"].get(top["proxy"], (None,))[0]
            others = {look[g].get(top[g], (None,))[0] for g in ("app", "wrk")}
            alone += cpu is not None and cpu not in others
        return alone / len(self.looks)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conns", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--rate", type=int, default=315, help="per-key limit (requests/s)")
    ap.add_argument("--pin", action="store_true",
                    help="proxy and app on one CPU, wrk alone on another")
    ap.add_argument("--placement", action="store_true",
                    help="say how often the proxy's busiest thread had a CPU to itself")
    ap.add_argument("--plain-nginx", action="store_true",
                    help="also run nginx without the X-Forwarded headers Spillway sets (the harness before 5420b8c)")
    ap.add_argument("--costs", action="store_true",
                    help="say each process's CPU per request and how often it slept")
    ap.add_argument("--baseline", help="another spillway binary, run with 2 workers in every round too")
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
    if args.baseline:
        binary = os.path.abspath(args.baseline)
        variants.append(("baseline, 2 workers", lambda p: C.start_spillway(
            "workers: 2\n" + C.spillway_yaml(p, up_port, rule), p, binary=binary)))
    if args.plain_nginx:
        variants.append(("nginx, 2 workers, plain",
                         lambda p: C.start_nginx(C.nginx_proxy(p, up_port, args.rate, forwarded=False), 2, p)))
    results = {name: [] for name, _ in variants}
    try:
        for r in range(args.rounds):
            line = []
            for name, start in variants:
                port = C.free_port()
                proc = start(port)
                looks = Placement(proc.pids(), upstream.pids()) if args.placement else None
                try:
                    if args.pin:
                        C.pin(proc.pids(), shared_cpu)
                    if looks:
                        looks.start()
                    costs = Costs(proc.pids(), upstream.pids()) if args.costs else None
                    res = C.wrk(port, args.conns, args.seconds, script, cpu=wrk_cpu)
                    if costs:
                        res["costs"] = costs.per_request(res["requests"])
                finally:
                    if looks:
                        looks.done.set()
                        looks.join()
                    proc.stop()
                res["alone"] = looks.alone() if looks else float("nan")
                results[name].append(res)
                alone = f" alone {res['alone']:.2f}" if looks else ""
                line.append(f"{name}: {res['rps']:.0f} req/s p99 {res['p99']:.2f}{alone}")
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
    if args.baseline:
        base = results["baseline, 2 workers"]
        faster = sum(a["rps"] > b["rps"] for a, b in zip(two, base))
        lower = sum(a["p99"] < b["p99"] for a, b in zip(two, base))
        print(f"spillway, 2 workers against baseline: more req/s in {faster}, lower p99 in {lower} "
              f"of {args.rounds} rounds.")
    for other in [n for n in results if n.startswith("nginx")]:
        against = "nginx" if other == "nginx, 2 workers" else other
        for name in [n for n in results if not n.startswith("nginx")]:
            rs, nginx = results[name], results[other]
            faster = sum(a["rps"] > b["rps"] for a, b in zip(rs, nginx))
            lower = sum(a["p99"] < b["p99"] for a, b in zip(rs, nginx))
            print(f"{name} against {against}: more req/s in {faster}, lower p99 in {lower} of {args.rounds} rounds.")
    if args.costs:
        def costs(rs):
            cell = lambda g, i: statistics.median(x["costs"][g][i] for x in rs)
            return [f"{cell(g, 0):.2f} | {cell(g, 1):.0f}" for g in ("proxy", "app", "wrk")]
        table(results, costs, ["proxy CPU | proxy sleeps", "app CPU | app sleeps", "wrk CPU | wrk sleeps"],
              "What each process spent per request (medians): CPU in us, and sleeps (voluntary\n"
              "context switches) per 1 000 requests:")
    if args.placement:
        def placement(rs):
            hi = [x["rps"] for x in rs if x["alone"] >= 0.8]
            lo = [x["rps"] for x in rs if not x["alone"] >= 0.8]
            cell = lambda v: f"{statistics.median(v):.0f} ({len(v)})" if v else "-"
            return [" ".join(f"{x['alone']:.2f}" for x in rs), cell(hi), cell(lo)]
        table(results, placement, ["share, each round", "req/s, alone >= 0.8", "req/s, others"],
              "The busiest proxy thread with a CPU to itself (share of looks), and the median req/s of\n"
              "the rounds where it was for at least 0.8 of them and of the others:")


def table(results, cells, columns, intro):
    """A Markdown table after `intro`: a row per variant, its `cells(rounds)` under `columns`."""
    print(f"\n{intro}\n")
    head = " | ".join(columns)
    print(f"| proxy | {head} |")
    print("|---" * (head.count("|") + 2) + "|")
    for name, rs in results.items():
        print(f"| {name} | " + " | ".join(cells(rs)) + " |")


if __name__ == "__main__":
    main()
