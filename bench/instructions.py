#!/usr/bin/env python3
"""User-space instructions per request, Spillway beside nginx and HAProxy, counted by callgrind.

Wall-clock figures on a shared 2-core VM move by 10-15 % between runs of the same build, so a
change worth 3 % cannot be seen in them. Instructions executed in the proxy's own process are
nearly deterministic: this runs each proxy under valgrind's callgrind with one worker, sends a
warm-up, zeroes the counters, sends N requests with h2load (HTTP/1.1, 16 keep-alive connections,
one key), dumps the counters and divides. Eight paths: every request forwarded (no limit
reached), every request refused (a limit of 1/s), every request forwarded from an HTTP/2 client
(h2c with prior knowledge, 10 streams per connection), every request a POST with a 1 KiB body,
forwarded, from an HTTP/1.1 client and from an HTTP/2 one, a POST with a 64 KiB body (one the
proxy streams, over HTTP/1.1), the 1 KiB POST with its body
written 0.3 ms after its head (by a small client here: h2load writes the two together), as a
client's second write or a second TCP segment brings it; and GETs on connections that each
began with a POST whose body came in chunks (which the proxy streams). Two more paths are Spillway's
alone: a `scope: global` rule decided by the drop ratio of a real controller on loopback, at a
limit the load stays under (admitted) and at 1/s (nearly every request refused). Kernel time is
not counted: it is the same syscalls for both proxies (see BENCHMARKS.md).

Everything listens on 127.0.0.1 and every process started here is stopped by its PID.
"""

import argparse
import glob
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare as C  # noqa: E402

CALLGRIND = ["valgrind", "--tool=callgrind", "--compress-strings=no", "--compress-pos=no"]
# (path, per-key limit, HTTP/2 client, request body bytes): the paths h2load drives (cpu.py too)
PATHS = [("forwarded", None, False, 0), ("refused (429)", 1, False, 0),
         ("forwarded, HTTP/2", None, True, 0), ("forwarded, 1 KiB POST", None, False, 1024),
         ("forwarded, HTTP/2 1 KiB POST", None, True, 1024), ("forwarded, 64 KiB POST", None, False, 65536)]
SPLIT = "forwarded, 1 KiB POST, body after head"
# (path, the global rule's limit): decided by a controller's drop ratio; Spillway only
GLOBAL = [("global rule, admitted", 1000000000), ("global rule, refused (429)", 1)]
AFTER = "forwarded, after a chunked POST"


def h2load(port, conns, h2, body=None):
    """h2load's command for one path: HTTP/1.1, or HTTP/2 with 10 streams per connection;
    `body`, a file each request POSTs."""
    protocol = ["-m", "10"] if h2 else ["--h1"]
    data = ["-d", body] if body else []
    return ["h2load", *protocol, *data, "-c", str(conns), "-H", "x-client: c1",
            f"http://127.0.0.1:{port}/api/x"]


def body_file(d, size):
    """A file of `size` bytes in `d` for h2load to POST, or None for no body."""
    if not size:
        return None
    path = os.path.join(d, "body")
    with open(path, "wb") as f:
        f.write(b"x" * size)
    return path


class Serial:
    """`conns` keep-alive connections to `port`, a request at a time: each sent on the next
    connection in turn and its answer read before the next."""

    def __init__(self, port, conns):
        self.socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(conns)]
        self.pending = [b""] * conns
        self.sent = 0
        for s in self.socks:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def ask(self, *parts, gap=0.0):
        """Sends a request in `parts`, `gap` seconds apart; whether its answer was a 200."""
        k = self.sent % len(self.socks)
        self.sent += 1
        for i, part in enumerate(parts):
            if i:
                time.sleep(gap)
            self.socks[k].sendall(part)
        buf = self.pending[k]
        while True:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                m = re.search(rb"\r\ncontent-length: *(\d+)", buf[:end], re.I)
                whole = end + 4 + int(m.group(1))
                if len(buf) >= whole:
                    self.pending[k] = buf[whole:]
                    return buf.startswith(b"HTTP/1.1 200 ")
            more = self.socks[k].recv(65536)
            if not more:
                raise RuntimeError("the proxy closed a connection")
            buf += more

    def close(self):
        for s in self.socks:
            s.close()


def split_posts(port, requests, conns, size=1024, gap=0.0003):
    """`requests` POSTs of `size` bytes over `conns` keep-alive connections in turn, one at a
    time, each body written `gap` seconds after its head; a status line like h2load's."""
    head = (f"POST /api/x HTTP/1.1\r\nhost: app\r\nx-client: c1\r\n"
            f"content-length: {size}\r\n\r\n").encode()
    body = b"x" * size
    serial = Serial(port, conns)
    try:
        ok = sum(serial.ask(head, body, gap=gap) for _ in range(requests))
    finally:
        serial.close()
    return f"status codes: {ok} 2xx of {requests}"


class AfterChunked:
    """GETs over `conns` keep-alive connections in turn, one at a time, each connection having
    begun with a POST whose body came in chunks: the warm-up sends those, the measured load
    GETs only, on the same connections."""

    POST = (b"POST /api/x HTTP/1.1\r\nhost: app\r\nx-client: c1\r\ntransfer-encoding: chunked\r\n\r\n"
            b"400\r\n" + b"x" * 1024 + b"\r\n0\r\n\r\n")
    GET = b"GET /api/x HTTP/1.1\r\nhost: app\r\nx-client: c1\r\n\r\n"

    def __init__(self, port, conns):
        self.port, self.conns, self.serial = port, conns, None

    def __call__(self, requests):
        if self.serial is None:
            self.serial = Serial(self.port, self.conns)
            if not all(self.serial.ask(self.POST) for _ in range(self.conns)):
                raise RuntimeError("a chunked POST was not answered 200")
        ok = sum(self.serial.ask(self.GET) for _ in range(requests))
        return f"status codes: {ok} 2xx of {requests}"

    def close(self):
        if self.serial:
            self.serial.close()


def answered(admin):
    """Reports the proxy with admin port `admin` has had answered."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=10).read().decode()
    m = re.search(r'^spillway_reports_total\{result="ok"[^}]*\} (\d+)', text, re.M)
    return int(m.group(1)) if m else 0


def counted(cmd, port, out_dir, requests, load, admin=None):
    """Runs `cmd` under callgrind and returns its instructions per request and the load's
    status line; `load(n)` sends n requests and returns that line. With `admin` (a global
    rule's proxy), the warm-up goes on until two reports were answered, so that the measured
    requests are decided by a controller's ratio."""
    proc = subprocess.Popen(CALLGRIND + [f"--callgrind-out-file={out_dir}/cg.%p"] + cmd,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        C.wait_port(port, timeout=120)
        load(2000)
        for _ in range(200):
            if admin is None or answered(admin) >= 2:
                break
            load(500)
        else:
            raise RuntimeError("the controller answered no report")
        load(2000)
        subprocess.run(["callgrind_control", "-z", str(proc.pid)], capture_output=True, check=True)
        out = load(requests)
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], capture_output=True, check=True)
    finally:
        C.stop(proc, 60)
    total = 0
    for path in glob.glob(f"{out_dir}/cg.{proc.pid}.1"):
        with open(path) as f:
            for line in f:
                if line.startswith(("summary:", "totals:")):
                    total = max(total, int(line.split()[1]))
    if total == 0:
        raise RuntimeError(f"no callgrind dump for {cmd[0]}")
    status = next((l.strip() for l in out.splitlines() if "status codes" in l), "")
    return total / requests, status


def spillway_cmd(binary, port, up, limit, d, control=None, extra=""):
    """`control`: (controller port, admin port) for a global rule, else a local one; `extra`:
    YAML added to the configuration."""
    rate = f"{limit}/s" if limit else "1000000000/s"
    if control:
        ctl, admin = control
        yaml = "workers: 1\n" + C.spillway_yaml(port, up, C.rule(rate, "global"), (
            f"control_plane: {{ url: 'http://127.0.0.1:{ctl}', report_interval: 250ms, stale_after: 1h }}"))
        yaml = yaml.replace("admin: 127.0.0.1:0", f"admin: 127.0.0.1:{admin}")
    else:
        yaml = "workers: 1\n" + C.spillway_yaml(port, up, C.rule(rate))
    if extra:
        yaml = extra.rstrip("\n") + "\n" + yaml
    path = os.path.join(d, f"spillway-{port}.yaml")
    with open(path, "w") as f:
        f.write(yaml)
    return [binary, "proxy", "--config", path]


def nginx_cmd(port, up, limit, d, h2=False):
    conf = C.nginx_conf(d, C.nginx_proxy(port, up, limit, h2=h2), 1)
    with open(conf) as f:
        text = f.read().replace("daemon off;", "daemon off;\nmaster_process off;")
    with open(conf, "w") as f:
        f.write(text)
    return [C.NGINX, "-p", d, "-c", conf, "-e", f"{d}/error.log"]


def haproxy_cmd(port, up, limit, d, h2=False):
    """HAProxy with one thread, as the others have one worker: compare.py's configuration
    (its stick table for a limit; `h2`: a listener that takes HTTP/2 with prior knowledge)."""
    path = os.path.join(d, "haproxy.cfg")
    with open(path, "w") as f:
        f.write(C.haproxy_conf(port, up, limit, threads=1, h2=h2))
    return [C.HAPROXY, "-db", "-f", path]


# The binary `proxies` names HAProxy by; `None` names nginx.
HAPROXY = "haproxy"


def proxy_cmd(binary, port, up, limit, d, h2=False, extra=""):
    """The command of a proxy in the foreground: Spillway's `binary`, nginx for `None`, HAProxy
    for `HAPROXY` (`h2`: nginx and HAProxy take HTTP/2 with prior knowledge; Spillway always
    does)."""
    if binary is None:
        return nginx_cmd(port, up, limit, d, h2)
    if binary == HAPROXY:
        return haproxy_cmd(port, up, limit, d, h2)
    return spillway_cmd(binary, port, up, limit, d, extra=extra)


def chosen(name, only):
    """Whether the path `name` is measured under `--only`: its name contains `only`, or is
    `only` without its leading `=`; every path without it."""
    if not only:
        return True
    if only.startswith("="):
        return name == only[1:]
    return only in name


def proxies(baseline, haproxy=True):
    """(name, binary) of the proxies measured: this build, `baseline` if given, nginx (None),
    HAProxy (`HAPROXY`) unless left out."""
    out = [("spillway", C.SPILLWAY)]
    if baseline:
        out.append(("baseline", os.path.abspath(baseline)))
    out.append(("nginx", None))
    if haproxy:
        out.append(("haproxy", HAPROXY))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--conns", type=int, default=16)
    ap.add_argument("--baseline", help="another spillway binary to count beside this one")
    ap.add_argument("--no-haproxy", action="store_true", help="count Spillway and nginx only")
    ap.add_argument("--keep", metavar="DIR",
                    help="count this build only, and keep each path's callgrind file in DIR "
                         "(for bench/profile.py)")
    ap.add_argument("--only", help="count only the paths whose name contains this (=NAME: only NAME)")
    ap.add_argument("--extra", default="",
                    help="YAML appended to this build's configuration only (e.g. an access log), "
                         "to count its cost against --baseline (which may be the same binary)")
    args = ap.parse_args()
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    print(f"spillway: {C.SPILLWAY}", file=sys.stderr)

    up_port, upstream = C.start_upstream()
    ctl = None
    rows = []
    try:
        paths = PATHS + [(SPLIT, None, False, 1024), (AFTER, None, False, 0)]
        paths += [(p, limit, False, 0) for p, limit in GLOBAL]
        paths = [p for p in paths if chosen(p[0], args.only)]
        if any(p[0] in dict(GLOBAL) for p in paths):
            ctl_port = C.free_port()
            ctl = C.Proc([C.SPILLWAY, "controller", "--listen", f"127.0.0.1:{ctl_port}",
                          "--admin", "127.0.0.1:0"], ready_line=True)
        for path_name, limit, h2, size in paths:
            is_global = path_name in dict(GLOBAL)
            for name, binary in proxies(args.baseline, not args.no_haproxy):
                if is_global and binary in (None, HAPROXY) or args.keep and name != "spillway":
                    continue
                d = tempfile.mkdtemp(prefix="spillway-bench-cg-")
                port = C.free_port()
                admin = C.free_port() if is_global else None
                extra = args.extra if name == "spillway" else ""
                if is_global:
                    cmd = spillway_cmd(binary, port, up_port, limit, d, (ctl_port, admin), extra)
                else:
                    cmd = proxy_cmd(binary, port, up_port, limit, d, h2, extra)
                after = AfterChunked(port, args.conns) if path_name == AFTER else None
                if after:
                    load = after
                elif path_name == SPLIT:
                    def load(n, port=port):
                        return split_posts(port, n, args.conns)
                else:
                    body = body_file(d, size)

                    def load(n, port=port, h2=h2, body=body):
                        return subprocess.run(
                            h2load(port, args.conns, h2, body) + ["-n", str(n)],
                            capture_output=True, text=True, check=True).stdout
                try:
                    per, status = counted(cmd, port, d, args.requests, load, admin)
                finally:
                    if after:
                        after.close()
                if args.keep:
                    kept = os.path.join(args.keep, re.sub(r"\W+", "-", path_name).strip("-"))
                    for f in glob.glob(f"{d}/cg.*.1"):
                        shutil.copy(f, kept + ".callgrind")
                print(f"{name}, {path_name}: {per:.0f} instructions per request ({status})",
                      file=sys.stderr, flush=True)
                rows.append((name, path_name, per))
    finally:
        upstream.stop()
        if ctl:
            ctl.stop()

    print(f"\n{args.requests} requests, h2load --h1 -c {args.conns} (HTTP/2: -m 10; body after head, after a "
          f"chunked POST: {args.conns} connections, one request at a time), one key, one worker; "
          "user-space instructions of the proxy's process per request (callgrind).\n")
    print("| proxy | path | instructions per request | vs nginx | vs haproxy |")
    print("|---|---|---|---|---|")
    nginx = {p: v for n, p, v in rows if n == "nginx"}
    haproxy = {p: v for n, p, v in rows if n == "haproxy"}
    for name, path_name, per in rows:
        vs = f"{per / nginx[path_name]:.2f}x" if path_name in nginx else "—"
        vs_h = f"{per / haproxy[path_name]:.2f}x" if path_name in haproxy else "—"
        print(f"| {name} | {path_name} | {per:.0f} | {vs} | {vs_h} |")


if __name__ == "__main__":
    main()
