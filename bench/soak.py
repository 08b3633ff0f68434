#!/usr/bin/env python3
"""Soak: mixed traffic through one proxy for a long while, sampling its RSS, open file
descriptors and the p99 latency every 10 s, to show they stay flat. Everything on loopback:
an nginx upstream, a controller for the global rule, the proxy, wrk in 10-second slices.
Every process started here is stopped by its PID.

Traffic (one wrk Lua script, per request at random): 50 % GET /api over 200 client keys under
a local limit that refuses about half; 30 % GET /global over 50 API keys under a fleet-wide
limit enforced by drop ratios; 20 % POST /upload with a 64 KiB body (streamed to the app).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare as c  # noqa: E402

SCRIPT = r"""
local body = string.rep("x", 65536)
request = function()
  local r = math.random(100)
  if r <= 50 then
    return wrk.format("GET", "/api/x", {["x-client"] = "c" .. math.random(200)})
  elseif r <= 80 then
    return wrk.format("GET", "/global/x", {["x-api-key"] = "k" .. math.random(50)})
  else
    return wrk.format("POST", "/upload", {["x-client"] = "u" .. math.random(20), ["content-type"] = "application/octet-stream"}, body)
  end
end
""" + c.WRK_DONE


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--conns", type=int, default=32)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="spillway-soak-")
    script = os.path.join(tmp, "mixed.lua")
    with open(script, "w") as f:
        f.write(SCRIPT)
    up_port, ctl_port, port = c.free_port(), c.free_port(), c.free_port()
    upstream = c.start_nginx(
        f'server {{ listen 127.0.0.1:{up_port}; client_max_body_size 1m; '
        f'location / {{ return 200 "ok\\n"; }} }}', 1, up_port)
    ctl = c.Proc([c.SPILLWAY, "controller", "--listen", f"127.0.0.1:{ctl_port}", "--admin", "127.0.0.1:0"],
                 ready_line=True)
    yaml = f"""service: soak
listen: 127.0.0.1:{port}
upstream: http://127.0.0.1:{up_port}
admin: 127.0.0.1:0
control_plane: {{ url: 'http://127.0.0.1:{ctl_port}', report_interval: 500ms }}
rules:
  - name: per-client
    match: {{ path_prefix: /api/ }}
    key: [header:x-client]
    limit: {{ rate: 100/s }}
  - name: per-key
    match: {{ path_prefix: /global/ }}
    key: [header:x-api-key]
    limit: {{ rate: 100/s }}
    scope: global
  - name: uploads
    match: {{ path: /upload }}
    key: [header:x-client]
    limit: {{ concurrency: 4 }}
"""
    proxy = c.start_spillway(yaml, port)
    pid = proxy.p.pid
    samples = []
    try:
        end = time.time() + args.minutes * 60
        print("| t (s) | req/s | non-2xx/s | errors | p99 ms | RSS MiB | open fds |", flush=True)
        print("|---|---|---|---|---|---|---|", flush=True)
        start = time.time()
        while time.time() < end:
            r = c.wrk(port, args.conns, 10, script)
            s = {"t": time.time() - start, "rps": r["rps"], "non2xx": (r["rps"] - r["ok_rps"]),
                 "errors": r["errors"], "p99": r["p99"], "rss": rss_kib(pid) / 1024, "fds": fds(pid)}
            samples.append(s)
            print(f"| {s['t']:.0f} | {s['rps']:.0f} | {s['non2xx']:.0f} | {s['errors']} | {s['p99']:.2f} | "
                  f"{s['rss']:.1f} | {s['fds']} |", flush=True)
    finally:
        for p in (proxy, ctl, upstream):
            p.stop()
    # Flat: the last third against the first third (after the first sample's warm-up).
    body = samples[1:] or samples
    third = max(1, len(body) // 3)
    first, last = body[:third], body[-third:]
    med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
    print(f"\n{len(samples)} samples of 10 s, {args.conns} connections.")
    for k, unit in (("rss", "MiB"), ("fds", ""), ("p99", "ms")):
        a, b = med(first, k), med(last, k)
        print(f"- {k}: first third median {a:.2f} {unit}, last third {b:.2f} {unit} "
              f"({(b - a) / a * 100 if a else 0:+.1f} %); max {max(x[k] for x in samples):.2f}")
    print(f"- connection errors seen by wrk: {sum(s['errors'] for s in samples)}")


if __name__ == "__main__":
    main()
