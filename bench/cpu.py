#!/usr/bin/env python3
"""CPU time per request, user and kernel, of Spillway beside nginx and HAProxy; and syscalls per request.

Where instructions.py counts the proxy's user space only, this reads what the proxy's process
spent in all (`/proc/PID/stat` utime and stime): each proxy with one worker, h2load sending N
requests over 16 keep-alive HTTP/1.1 connections with one key after a warm-up, rounds
alternating the proxies, medians. The paths of instructions.py: every request forwarded, every
request refused, every request forwarded from an HTTP/2 client, every request a 1 KiB POST
forwarded (from HTTP/1.1 and from HTTP/2 clients), every request a 64 KiB POST forwarded (a
body the proxy streams); and every request forwarded to an app that
answers in chunks (three chunks and the end, written at once, by a small threaded server here
instead of the nginx upstream: it is slower, so that path runs at a lower rate). With
`--syscalls`, one more run per proxy and path under `strace -c` counts the system calls per
request (strace slows the proxy; only the counts are used).

Everything listens on 127.0.0.1 and every process started here is stopped by its PID.
"""

import argparse
import os
import shutil
import signal
import socket
import socketserver
import statistics
import subprocess
import sys
import tempfile
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare as C  # noqa: E402
import instructions as I  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
CHUNKED = "forwarded, chunked response"
CHUNKED_RESPONSE = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                    b"5\r\nhello\r\n6\r\n world\r\n2\r\n!\n\r\n0\r\n\r\n")


class ChunkedApp(socketserver.ThreadingTCPServer):
    """An app on 127.0.0.1 that answers every request on a keep-alive connection with
    CHUNKED_RESPONSE in one write."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), ChunkedApp.Handler)
        self.port = self.server_address[1]
        threading.Thread(target=self.serve_forever, daemon=True).start()

    class Handler(socketserver.BaseRequestHandler):
        def handle(self):
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            buf = b""
            while True:
                more = self.request.recv(65536)
                if not more:
                    return
                buf += more
                while b"\r\n\r\n" in buf:
                    _, buf = buf.split(b"\r\n\r\n", 1)
                    self.request.sendall(CHUNKED_RESPONSE)

    def stop(self):
        self.shutdown()
        self.server_close()


def cpu_seconds(pid):
    """(user, kernel) seconds the process has used, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def load(port, requests, conns, h2, body):
    subprocess.run(I.h2load(port, conns, h2, body) + ["-n", str(requests)], capture_output=True,
                   check=True)


def measured(cmd, port, requests, conns, h2, body, syscalls_to=None):
    """Runs `cmd` (a proxy in the foreground) and returns its (user, kernel) microseconds per
    request; with `syscalls_to`, counts its system calls into that file instead."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        C.wait_port(port, timeout=30)
        load(port, 5000, conns, h2, body)
        if syscalls_to:
            strace = subprocess.Popen(["strace", "-f", "-c", "-o", syscalls_to, "-p", str(proc.pid)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            # strace says it attached on stderr: wait for that, not for a while.
            strace.stderr.readline()
            load(port, requests, conns, h2, body)
            strace.send_signal(signal.SIGINT)
            strace.wait(timeout=30)
            return None
        (u0, k0) = cpu_seconds(proc.pid)
        load(port, requests, conns, h2, body)
        (u1, k1) = cpu_seconds(proc.pid)
        return (u1 - u0) * 1e6 / requests, (k1 - k0) * 1e6 / requests
    finally:
        C.stop(proc, 30)


def syscalls_per_request(path, requests):
    """{syscall: calls per request} from an `strace -c` summary, the rare ones left out."""
    out = {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
                out[parts[-1]] = int(parts[3]) / requests
    return {k: v for k, v in out.items() if v >= 0.01}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100000)
    ap.add_argument("--conns", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--baseline", help="another spillway binary to measure beside this one")
    ap.add_argument("--syscalls", action="store_true", help="also count syscalls (needs strace)")
    ap.add_argument("--only", help="measure only the paths whose name contains this (=NAME: only NAME)")
    ap.add_argument("--no-haproxy", action="store_true", help="measure Spillway and nginx only")
    args = ap.parse_args()
    if args.syscalls and not shutil.which("strace"):
        sys.exit("--syscalls needs strace (apt-get install strace)")

    proxies = I.proxies(args.baseline, not args.no_haproxy)
    up_port, upstream = C.start_upstream()
    chunked = ChunkedApp()
    results = {}
    calls = {}
    try:
        for path_name, limit, h2, size in I.PATHS + [(CHUNKED, None, False, 0)]:
            if not I.chosen(path_name, args.only):
                continue
            app = chunked.port if path_name == CHUNKED else up_port
            for r in range(args.rounds):
                for name, binary in proxies:
                    d = tempfile.mkdtemp(prefix="spillway-bench-cpu-")
                    port = C.free_port()
                    cmd = I.proxy_cmd(binary, port, app, limit, d, h2)
                    user, kernel = measured(cmd, port, args.requests, args.conns, h2,
                                            I.body_file(d, size))
                    results.setdefault((name, path_name), []).append((user, kernel))
                    print(f"round {r + 1}: {name}, {path_name}: user {user:.2f} us, kernel "
                          f"{kernel:.2f} us per request", file=sys.stderr, flush=True)
            if args.syscalls:
                for name, binary in proxies:
                    d = tempfile.mkdtemp(prefix="spillway-bench-cpu-")
                    port = C.free_port()
                    cmd = I.proxy_cmd(binary, port, app, limit, d, h2)
                    out = os.path.join(d, "strace.txt")
                    measured(cmd, port, args.requests // 5, args.conns, h2, I.body_file(d, size),
                             syscalls_to=out)
                    calls[(name, path_name)] = syscalls_per_request(out, args.requests // 5)
    finally:
        upstream.stop()
        chunked.stop()

    print(f"\n{args.rounds} rounds x {args.requests} requests, h2load --h1 -c {args.conns} (HTTP/2: -m 10), one key, "
          "one worker; CPU of the proxy's process per request (medians).\n")
    print("| proxy | path | user us | kernel us | total us | total vs nginx | total vs haproxy |")
    print("|---|---|---|---|---|---|---|")
    med = {k: (statistics.median(u for u, _ in v), statistics.median(k_ for _, k_ in v),
               statistics.median(u + k_ for u, k_ in v)) for k, v in results.items()}
    for (name, path_name), (u, k, t) in med.items():
        haproxy = med.get(("haproxy", path_name))
        vs_h = f"{t / haproxy[2]:.2f}x" if haproxy else "—"
        print(f"| {name} | {path_name} | {u:.2f} | {k:.2f} | {t:.2f} | "
              f"{t / med[('nginx', path_name)][2]:.2f}x | {vs_h} |")
    if calls:
        print("\nSystem calls per request (strace -c, one run each):\n")
        print("| proxy | path | calls per request |")
        print("|---|---|---|")
        for (name, path_name), c in calls.items():
            listed = ", ".join(f"{k} {v:.2f}" for k, v in sorted(c.items(), key=lambda kv: -kv[1]))
            print(f"| {name} | {path_name} | {sum(c.values()):.2f}: {listed} |")


if __name__ == "__main__":
    main()
