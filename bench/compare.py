#!/usr/bin/env python3
"""Spillway against nginx, HAProxy and no proxy, on loopback, with the same upstream.

Each scenario runs wrk (HTTP/1.1, keep-alive) for a few seconds per connection count; rounds
alternate the scenarios (A B C ... A B C ...) and the table reports medians, since the machine is
shared and noisy. CPU seconds and peak RSS are read from /proc for the proxy's processes only.
Everything listens on 127.0.0.1 and every process started here is stopped by its PID.
"""

import argparse
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# SPILLWAY_BENCH_BIN: another build of Spillway (bench/profile.sh gives one with line tables).
SPILLWAY = os.path.abspath(os.environ.get("SPILLWAY_BENCH_BIN") or
                           os.path.join(ROOT, "target", "release", "spillway"))
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
KEYS = 100  # distinct x-client values the load spreads over
H2_ALL = 1000000  # the HTTP/2 runs' per-key limit for nginx and HAProxy: a rule that admits all

# The end of every wrk script here: one RESULT line that `wrk()` below parses.
WRK_DONE = r"""
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT %d %d %d %d %d %d %d\n",
    summary.requests, summary.duration, e.status, e.connect + e.read + e.write + e.timeout,
    latency:percentile(50), latency:percentile(99), latency:percentile(99.9)))
end
"""

WRK_SCRIPT = r"""
local keys = %d
request = function()
  return wrk.format(nil, nil, {["x-client"] = "c" .. math.random(keys)})
end
""" % KEYS + WRK_DONE


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, timeout=10.0):
    end = time.time() + timeout
    while time.time() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def children(pid):
    """pid and its descendants (nginx workers)."""
    out = [pid]
    try:
        kids = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    except FileNotFoundError:
        kids = []
    for k in kids:
        out += children(int(k))
    return out


def tasks(pids):
    """(pid, tid) of every thread of `pids` that still runs."""
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            continue
        for tid in tids:
            yield pid, tid


def pin(pids, cpu):
    """Puts every thread of `pids` on CPU `cpu` (threads they start later inherit it)."""
    for _, tid in tasks(pids):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except OSError:
            pass


def cpu_seconds(pids):
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except OSError:
            pass
    return total / tick


def peak_rss_mib(pids):
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                m = re.search(r"VmHWM:\s+(\d+) kB", f.read())
            total += int(m.group(1)) if m else 0
        except OSError:
            pass
    return total / 1024


class Proc:
    """A process started here, stopped by its PID."""

    def __init__(self, args, ready_line=False, **kw):
        self.p = subprocess.Popen(args, stdout=subprocess.PIPE if ready_line else subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, text=True, **kw)
        self.line = self.p.stdout.readline() if ready_line else ""

    def pids(self):
        return children(self.p.pid)

    def stop(self):
        stop(self.p)


def stop(p, timeout=10):
    """Stops `p`, a process started here: SIGTERM, then SIGKILL after `timeout` seconds."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def nginx_conf(dir, body, workers):
    conf = f"""
worker_processes {workers};
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log error;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  client_body_temp_path {dir}/cbt; proxy_temp_path {dir}/pt; fastcgi_temp_path {dir}/ft;
  uwsgi_temp_path {dir}/ut; scgi_temp_path {dir}/st;
  keepalive_requests 1000000;
  {body}
}}
"""
    path = os.path.join(dir, "nginx.conf")
    with open(path, "w") as f:
        f.write(conf)
    return path


def start_nginx(body, workers, port):
    d = tempfile.mkdtemp(prefix="spillway-bench-nginx-")
    proc = Proc([NGINX, "-p", d, "-c", nginx_conf(d, body, workers), "-e", f"{d}/error.log"])
    wait_port(port)
    return proc


def start_upstream():
    """The static upstream every proxy forwards to (nginx, one worker): (port, process)."""
    port = free_port()
    body = f'server {{ listen 127.0.0.1:{port}; location / {{ return 200 "ok\\n"; }} }}'
    return port, start_nginx(body, 1, port)


def start_spillway(yaml, port, extra_wait=0.0, binary=None):
    d = tempfile.mkdtemp(prefix="spillway-bench-")
    path = os.path.join(d, "spillway.yaml")
    with open(path, "w") as f:
        f.write(yaml)
    proc = Proc([binary or SPILLWAY, "proxy", "--config", path], ready_line=True)
    if "listening on" not in proc.line:
        raise RuntimeError(f"spillway did not start: {proc.line!r}")
    wait_port(port)
    time.sleep(extra_wait)
    return proc


def wrk(port, conns, seconds, script, cpu=None):
    """One wrk run; on CPU `cpu` alone when given (taskset)."""
    pinned = ["taskset", "-c", str(cpu)] if cpu is not None else []
    out = subprocess.run(pinned + ["wrk", "-t1", f"-c{conns}", f"-d{seconds}s", "--timeout", "5s", "-s", script,
                                   f"http://127.0.0.1:{port}/api/x"], capture_output=True, text=True).stdout
    m = re.search(r"RESULT (\d+) (\d+) (\d+) (\d+) (\d+) (\d+) (\d+)", out)
    if not m:
        raise RuntimeError(f"wrk said: {out}")
    n, dur_us, non2xx, errors, p50, p99, p999 = map(int, m.groups())
    return {"rps": n / (dur_us / 1e6), "ok_rps": (n - non2xx) / (dur_us / 1e6), "requests": n,
            "errors": errors, "p50": p50 / 1000, "p99": p99 / 1000, "p999": p999 / 1000}


def h2load(port, conns, seconds):
    out = subprocess.run(["h2load", "-c", str(conns), "-m", "10", "-D", str(seconds), "-t", "1",
                          "-H", "x-client: c1", f"http://127.0.0.1:{port}/api/x"],
                         capture_output=True, text=True).stdout
    m = re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", out)
    return float(m.group(1)) if m else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--conns", default="16,128")
    ap.add_argument("--only", default="", help="comma-separated substrings; run only scenarios naming one")
    ap.add_argument("--baseline", default="", help="another spillway binary, run beside this one (A/B)")
    ap.add_argument("--no-h2", action="store_true", help="skip the HTTP/2 runs")
    args = ap.parse_args()
    conns = [int(c) for c in args.conns.split(",")]
    script = os.path.join(tempfile.mkdtemp(prefix="spillway-bench-"), "keys.lua")
    with open(script, "w") as f:
        f.write(WRK_SCRIPT)

    up_port, upstream = start_upstream()
    procs = [upstream]
    try:
        # The half-rejecting limits are set from what the bare proxy does, per key.
        port = free_port()
        probe = start_spillway(spillway_yaml(port, up_port, ""), port)
        baseline = wrk(port, conns[0], 2, script)["rps"]
        probe.stop()
        half_per_key = max(1, int(baseline / 2 / KEYS))

        scenarios = [
            ("direct (no proxy)", None),
            ("spillway, no rules", lambda p: start_spillway(spillway_yaml(p, up_port, ""), p)),
            ("spillway, local rule admitting all", lambda p: start_spillway(spillway_yaml(p, up_port, rule("1000000000/s")), p)),
            ("spillway, local rule rejecting ~half", lambda p: start_spillway(spillway_yaml(p, up_port, rule(f"{half_per_key}/s")), p)),
            ("spillway, global rule (drop ratio)", "global"),
            ("nginx proxy_pass, keep-alive", lambda p: start_nginx(nginx_proxy(p, up_port, None), 2, p)),
            ("nginx limit_req rejecting ~half", lambda p: start_nginx(nginx_proxy(p, up_port, half_per_key), 2, p)),
            ("haproxy, keep-alive", lambda p: start_haproxy(p, up_port, None)),
            ("haproxy stick-table rejecting ~half", lambda p: start_haproxy(p, up_port, half_per_key)),
        ]
        if args.baseline:
            base = os.path.abspath(args.baseline)
            scenarios += [
                ("baseline, local rule admitting all", lambda p: start_spillway(spillway_yaml(p, up_port, rule("1000000000/s")), p, binary=base)),
                ("baseline, local rule rejecting ~half", lambda p: start_spillway(spillway_yaml(p, up_port, rule(f"{half_per_key}/s")), p, binary=base)),
            ]
        if args.only:
            wanted = [w.strip() for w in args.only.split(",") if w.strip()]
            scenarios = [s for s in scenarios if any(w in s[0] for w in wanted)]
        results = {(name, c): [] for name, _ in scenarios for c in conns}
        for rnd in range(args.rounds):
            for name, start in scenarios:
                for c in conns:
                    port, extra = free_port(), []
                    if start is None:
                        proxy, port = None, up_port
                    elif start == "global":
                        proxy, extra = start_global(port, up_port, half_per_key, script)
                    else:
                        proxy = start(port)
                    try:
                        pids = proxy.pids() if proxy else []
                        cpu0 = cpu_seconds(pids)
                        r = wrk(port, c, args.seconds, script)
                        r["cpu_per_100k"] = (cpu_seconds(pids) - cpu0) / max(r["requests"], 1) * 1e5 if proxy else float("nan")
                        r["rss"] = peak_rss_mib(pids) if proxy else float("nan")
                        results[(name, c)].append(r)
                        print(f"round {rnd + 1}: {name}, {c} conns: {r['rps']:.0f} req/s", file=sys.stderr)
                    finally:
                        for p in [proxy] + extra:
                            if p:
                                p.stop()
        # HTTP/2: the same rounds, alternating the proxies, each with a limiting rule that admits
        # all (so that each evaluates one); each run's figure is kept, since how a burst of
        # connections splits over the workers makes them vary by up to 2x.
        h2 = {}
        h2_proxies = [
            ("spillway", lambda p: start_spillway(spillway_yaml(p, up_port, rule("1000000000/s")), p)),
            ("nginx", lambda p: start_nginx(nginx_proxy(p, up_port, H2_ALL, h2=True), 2, p)),
            ("haproxy", lambda p: start_haproxy(p, up_port, H2_ALL, h2=True)),
        ]
        if args.baseline:
            h2_proxies.insert(1, ("baseline", lambda p: start_spillway(
                spillway_yaml(p, up_port, rule("1000000000/s")), p, binary=base)))
        for rnd in range(0 if args.no_h2 else args.rounds):
            for c in conns:
                for who, start in h2_proxies:
                    port = free_port()
                    p = start(port)
                    try:
                        h2.setdefault((who, c), []).append(h2load(port, c, args.seconds))
                    finally:
                        p.stop()
        report(results, scenarios, conns, h2, half_per_key, args)
    finally:
        for p in procs:
            p.stop()


def rule(rate, scope="local", extra=""):
    return f"""rules:
  - name: per-client
    key: [header:x-client]
    limit: {{ rate: {rate} }}
    scope: {scope}
    max_keys: 1000
{extra}"""


def spillway_yaml(port, up_port, rules, control=""):
    return f"""service: bench
listen: 127.0.0.1:{port}
upstream: http://127.0.0.1:{up_port}
admin: 127.0.0.1:0
{control}
{rules or "rules: []"}
"""


def start_global(port, up_port, per_key, script):
    ctl_port = free_port()
    ctl = Proc([SPILLWAY, "controller", "--listen", f"127.0.0.1:{ctl_port}", "--admin", "127.0.0.1:0"], ready_line=True)
    control = f"control_plane: {{ url: 'http://127.0.0.1:{ctl_port}', report_interval: 250ms, stale_after: 5s }}"
    proxy = start_spillway(spillway_yaml(port, up_port, rule(f"{per_key}/s", "global"), control), port)
    # Let the drop ratios settle under load before measuring.
    wrk(port, 16, 2, script)
    return proxy, [ctl]


def nginx_proxy(port, up_port, per_key, h2=False, forwarded=True):
    limit_zone = f"limit_req_zone $http_x_client zone=per:10m rate={per_key}r/s;" if per_key else ""
    # Refusals are logged at `info`, below the error log's level: nginx would otherwise write
    # a line per refused request (its default is `error`), which Spillway does not do.
    limit = (f"limit_req zone=per burst={per_key} nodelay; limit_req_status 429; "
             "limit_req_log_level info;") if per_key else ""
    listen = f"listen 127.0.0.1:{port} http2;" if h2 else f"listen 127.0.0.1:{port};"
    # What Spillway does to every request it forwards (docs/clients.md, "What the proxy does to
    # forwarded requests"): the client's Host kept, X-Forwarded-For/-Proto/-Host set. Without
    # these nginx sends the app `Host: app` and the client's fields only, a shorter request to
    # write and for the app to parse (47 bytes against 155 for wrk's GET).
    fwd = ("proxy_set_header Host $http_host; "
           "proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for; "
           "proxy_set_header X-Forwarded-Proto $scheme; "
           "proxy_set_header X-Forwarded-Host $http_host;") if forwarded else ""
    # Idle upstream connections kept per worker: 256, as Spillway keeps (affine.rs MAX_IDLE).
    # With 64, nginx closed and reopened one upstream connection per five HTTP/2 requests
    # (160 streams at once) and would under 128 HTTP/1 connections on one worker.
    return f"""
  upstream app {{ server 127.0.0.1:{up_port}; keepalive 256; }}
  {limit_zone}
  server {{
    {listen}
    location / {{
      {limit}
      proxy_pass http://app;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      {fwd}
    }}
  }}"""


def haproxy_conf(port, up_port, per_key, threads=2, h2=False):
    """HAProxy's configuration: `threads` threads (two here, as nginx has two workers). The
    limit counts admitted requests per x-client in a stick table (gpc0 rate over 1 s), so that,
    as with nginx and Spillway, about `per_key`/s of each key pass and the rest get 429; `h2`:
    the listener takes HTTP/2 with prior knowledge, as Spillway's and nginx's do."""
    limit = (f"""  stick-table type string len 64 size 100k expire 10s store gpc0_rate(1s)
  http-request track-sc0 req.hdr(x-client)
  http-request deny deny_status 429 if {{ sc_gpc0_rate(0) ge {per_key} }}
  http-request sc-inc-gpc0(0)
""" if per_key else "")
    proto = " proto h2" if h2 else ""
    return f"""global
  nbthread {threads}
  maxconn 8000
defaults
  mode http
  timeout connect 5s
  timeout client 30s
  timeout server 30s
  option http-keep-alive
  http-reuse always
frontend fe
  bind 127.0.0.1:{port}{proto}
{limit}  default_backend app
backend app
  option forwardfor
  http-request set-header X-Forwarded-Proto http
  http-request set-header X-Forwarded-Host %[req.hdr(host)]
  server app 127.0.0.1:{up_port}
"""


def start_haproxy(port, up_port, per_key, h2=False):
    """HAProxy (Debian's 2.6) with two threads and the stick table of `haproxy_conf`."""
    d = tempfile.mkdtemp(prefix="spillway-bench-haproxy-")
    path = os.path.join(d, "haproxy.cfg")
    with open(path, "w") as f:
        f.write(haproxy_conf(port, up_port, per_key, h2=h2))
    proc = Proc([HAPROXY, "-db", "-f", path])
    wait_port(port)
    return proc


def med(rs, k):
    return statistics.median(r[k] for r in rs)


def vs(rps, ref):
    """`rps` as a multiple of `ref`, or a dash when the reference was not run (`--only`)."""
    return "—" if math.isnan(ref) else f"{rps / ref:.2f}x"


def report(results, scenarios, conns, h2, per_key, args):
    print(f"\n{args.rounds} rounds x {args.seconds} s per run, medians; wrk -t1, keep-alive, "
          f"{KEYS} x-client keys; 'rejecting ~half' limits each key to {per_key}/s.\n")
    print("| scenario | conns | req/s | 2xx/s | p50 ms | p99 ms | p99.9 ms | CPU s / 100k req | peak RSS MiB | vs nginx | vs haproxy | vs direct |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in conns:
        nginx = med(results.get(("nginx proxy_pass, keep-alive", c)) or [{"rps": float("nan")}], "rps")
        direct = med(results.get(("direct (no proxy)", c)) or [{"rps": float("nan")}], "rps")
        haproxy = med(results.get(("haproxy, keep-alive", c)) or [{"rps": float("nan")}], "rps")
        for name, _ in scenarios:
            rs = results[(name, c)]
            rps = med(rs, "rps")
            print(f"| {name} | {c} | {rps:.0f} | {med(rs, 'ok_rps'):.0f} | {med(rs, 'p50'):.2f} | {med(rs, 'p99'):.2f} | "
                  f"{med(rs, 'p999'):.2f} | {med(rs, 'cpu_per_100k'):.2f} | {med(rs, 'rss'):.1f} | "
                  f"{vs(rps, nginx)} | {vs(rps, haproxy)} | {vs(rps, direct)} |")
    if not h2:
        return
    print("\nHTTP/2 (h2load -m 10, prior knowledge, one key, a limit that admits all; median and each round):\n")
    print("| proxy | conns | req/s | rounds | vs nginx | vs haproxy |")
    print("|---|---|---|---|---|---|")
    for (who, c), runs in sorted(h2.items()):
        each = " ".join(f"{r:.0f}" for r in runs)
        m = statistics.median(runs)
        ref = {p: statistics.median(h2.get((p, c)) or [float("nan")]) for p in ("nginx", "haproxy")}
        print(f"| {who} | {c} | {m:.0f} | {each} | {vs(m, ref['nginx'])} | {vs(m, ref['haproxy'])} |")


if __name__ == "__main__":
    main()
