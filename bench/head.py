#!/usr/bin/env python3
"""What a HEAD answer costs now that its upstream connection never goes back to the worker's
shared list (issue 40): GET against HEAD through Spillway (no rules) over HTTP/2, same upstream
(nginx, one worker, which announces a body in its HEAD answers), on loopback; h2load with 1 and
10 streams a connection. (wrk and h2load's HTTP/1 wait for the body a HEAD answer announces, so
HTTP/1 is not measured here: a kept-alive HTTP/1 client keeps its upstream connection from its
second request on, and one that opens a connection per HEAD pays one upstream connect each.)
Prints a Markdown table of medians; every process started here is stopped by its PID.
   cargo build --release && python3 bench/head.py [--seconds N] [--rounds N] [--conns N]
      [--binary OTHER]
"""

import argparse
import os
import re
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare  # noqa: E402  (its processes, ports and nginx upstream)


def h2load(port, conns, seconds, method, streams):
    out = subprocess.run(["h2load", "-c", str(conns), "-m", str(streams), "-D", str(seconds),
                          "-t", "1", "-H", f":method: {method}", f"http://127.0.0.1:{port}/api/x"],
                         capture_output=True, text=True).stdout
    m = re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", out)
    done = re.search(r"(\d+) succeeded", out)
    if not m or not done or int(done.group(1)) == 0:
        raise RuntimeError(f"h2load said: {out}")
    return float(m.group(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conns", type=int, default=16)
    ap.add_argument("--binary", default=None, help="another spillway binary (a baseline)")
    args = ap.parse_args()
    up_port, upstream = compare.start_upstream()
    procs = [upstream]
    try:
        port = compare.free_port()
        procs.append(compare.start_spillway(compare.spillway_yaml(port, up_port, ""), port,
                                            binary=args.binary))
        rows = {}
        for _ in range(args.rounds):
            for streams in (1, 10):
                for method in ("GET", "HEAD"):
                    rps = h2load(port, args.conns, args.seconds, method, streams)
                    rows.setdefault((streams, method), []).append(rps)
        print(f"| HTTP/2, {args.conns} connections | GET req/s | HEAD req/s | HEAD/GET |")
        print("|---|---|---|---|")
        for streams in (1, 10):
            get = statistics.median(rows[(streams, "GET")])
            head = statistics.median(rows[(streams, "HEAD")])
            print(f"| {streams} stream(s) a connection | {get:.0f} | {head:.0f} | {head / get:.2f} |")
    finally:
        for p in reversed(procs):
            p.stop()


if __name__ == "__main__":
    main()
