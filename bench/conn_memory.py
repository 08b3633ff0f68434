#!/usr/bin/env python3
"""RSS per keep-alive client connection, Spillway beside nginx.

Opens N connections to the proxy at once, sends R requests on each (all connections' first
requests, then all second ones...), keeps them open, and divides the growth of the proxy's RSS
(all its processes) by N. A warm-up of 50 connections comes first so that one-time allocations
are not counted. Four Spillway cases: every request refused (no upstream involved), and R = 1,
2 or 20 forwarded requests (a connection's first request goes through the worker's pool; later
ones through its own upstream connection); nginx with R = 2 and 20. Run after `cargo build --release`:

    python3 bench/conn_memory.py [--conns 1000]

Everything listens on 127.0.0.1 and every process started here is stopped by its PID.
"""

import argparse
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare as C  # noqa: E402


def rss_kib(pids):
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/status") as f:
            total += next(int(l.split()[1]) for l in f if l.startswith("VmRSS"))
    return total


def open_and_use(port, n, requests, one_key):
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
    for _ in range(requests):
        for i, s in enumerate(socks):
            key = "one" if one_key else f"c{i}"
            s.sendall(f"GET /api/x HTTP/1.1\r\nHost: app\r\nx-client: {key}\r\n\r\n".encode())
        for s in socks:
            # Both answers end with a newline: the app's "ok\n" and our problem document.
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(4096)
                if not chunk:
                    raise RuntimeError("the proxy closed a connection")
                buf += chunk
    return socks


def measure(start, port, n, requests, one_key=False):
    proc = start()
    try:
        warm = open_and_use(port, 50, requests, one_key)
        time.sleep(0.3)
        before = rss_kib(proc.pids())
        socks = open_and_use(port, n, requests, one_key)
        time.sleep(0.3)
        after = rss_kib(proc.pids())
        for s in socks + warm:
            s.close()
        return (after - before) / n
    finally:
        proc.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conns", type=int, default=1000)
    args = ap.parse_args()
    up, upstream = C.start_upstream()
    rows = []
    try:
        cases = [
            ("spillway, every request refused", "1/s", 2),
            ("spillway, 1 request forwarded", None, 1),
            ("spillway, 2 requests forwarded", None, 2),
            ("spillway, 20 requests forwarded", None, 20),
        ]
        for name, rate, requests in cases:
            port = C.free_port()
            yaml = C.spillway_yaml(port, up, C.rule(rate or "1000000000/s"))
            # Refused: one key for all, over its limit after the warm-up's first request.
            rows.append((name, measure(lambda: C.start_spillway(yaml, port), port, args.conns,
                                       requests, one_key=rate is not None)))
        for requests in (2, 20):
            port = C.free_port()
            rows.append((f"nginx, {requests} requests forwarded",
                         measure(lambda: C.start_nginx(C.nginx_proxy(port, up, None), 2, port), port,
                                 args.conns, requests)))
    finally:
        upstream.stop()
    print(f"\n{args.conns} keep-alive client connections opened at once, growth of the proxy's RSS.\n")
    print("| proxy, requests per connection | KiB per connection |")
    print("|---|---|")
    for name, kib in rows:
        print(f"| {name} | {kib:.1f} |")


if __name__ == "__main__":
    main()
