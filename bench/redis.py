#!/usr/bin/env python3
"""Redis mode through the proxy: added latency against a local rule, decisions/s, and what the
refused-key cache saves under an abusive client. Same machine, same run, alternating rounds,
medians. Everything on loopback; every process started here is stopped by its PID.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare as c  # noqa: E402

ONE_KEY_SCRIPT = r"""
request = function()
  return wrk.format(nil, nil, {["x-client"] = "abuser"})
end
""" + c.WRK_DONE


def start_redis(port, d):
    proc = c.Proc(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no", "--dir", d], ready_line=False)
    c.wait_port(port)
    return proc


def yaml(port, up_port, redis_port, scope, rate, algorithm, cache=True, timeout="50ms"):
    section = (f"redis: {{ url: 'redis://127.0.0.1:{redis_port}', timeout: {timeout}, "
               f"cache_refusals: {'true' if cache else 'false'} }}")
    rules = f"""rules:
  - name: r
    key: [header:x-client]
    limit: {{ rate: {rate}, algorithm: {algorithm} }}
    scope: {scope}
"""
    return c.spillway_yaml(port, up_port, rules, section)


def redis_metric(proc, pattern):
    m = re.search(r"\(admin ([^)]+)\)", proc.line)
    text = urllib.request.urlopen(f"http://{m.group(1)}/metrics").read().decode()
    m = re.search(pattern, text, re.M)
    return float(m.group(1)) if m else 0.0


def redis_round_trips(proc):
    return redis_metric(proc, r"^spillway_redis_duration_seconds_count(?:\{[^}]*\})? (\S+)")


def redis_failures(proc):
    """Decisions Redis did not answer in time, and times the breaker opened."""
    timeouts = redis_metric(proc, r'^spillway_redis_errors_total\{[^}]*kind="timeout"[^}]*\} (\S+)')
    opened = redis_metric(proc, r"^spillway_redis_breaker_opened_total(?:\{[^}]*\})? (\S+)")
    return timeouts, opened


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conns", type=int, default=16)
    ap.add_argument("--algorithm", default="gcra")
    ap.add_argument("--timeout", default="50ms", help="redis.timeout of the proxies")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="spillway-bench-redis-")
    keys_script = os.path.join(tmp, "keys.lua")
    with open(keys_script, "w") as f:
        f.write(c.WRK_SCRIPT)
    abuse_script = os.path.join(tmp, "abuse.lua")
    with open(abuse_script, "w") as f:
        f.write(ONE_KEY_SCRIPT)

    redis_port = c.free_port()
    up_port, upstream = c.start_upstream()
    redis = start_redis(redis_port, tmp)
    alg = args.algorithm
    scenarios = [
        ("local rule, admits all", "local", "1000000000/s", keys_script, True),
        ("redis rule, admits all", "redis", "1000000000/s", keys_script, True),
        ("abusive client, local rule", "local", "10/h", abuse_script, True),
        ("abusive client, redis rule, refusal cache on", "redis", "10/h", abuse_script, True),
        ("abusive client, redis rule, refusal cache off", "redis", "10/h", abuse_script, False),
    ]
    results = {s[0]: [] for s in scenarios}
    try:
        for rnd in range(args.rounds):
            for name, scope, rate, script, cache in scenarios:
                subprocess.run(["redis-cli", "-p", str(redis_port), "flushall"], capture_output=True)
                port = c.free_port()
                proxy = c.start_spillway(
                    yaml(port, up_port, redis_port, scope, rate, alg, cache, args.timeout), port)
                try:
                    before = redis_round_trips(proxy)
                    r = c.wrk(port, args.conns, args.seconds, script)
                    r["redis_per_s"] = (redis_round_trips(proxy) - before) / args.seconds
                    r["timeouts"], r["opened"] = redis_failures(proxy)
                    results[name].append(r)
                    print(f"round {rnd + 1}: {name}: {r['rps']:.0f} req/s", file=sys.stderr)
                finally:
                    proxy.stop()
    finally:
        redis.stop()
        upstream.stop()

    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    print(f"\n{args.rounds} rounds x {args.seconds} s, medians; wrk -t1 -c{args.conns}, keep-alive; "
          f"algorithm {alg}; Redis {redis_version()} on loopback, redis.timeout {args.timeout}.\n")
    print("| scenario | req/s | 2xx/s | p50 ms | p99 ms | p99.9 ms | Redis round trips/s | timeouts | breaker opened |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, *_ in scenarios:
        rs = results[name]
        print(f"| {name} | {med(rs, 'rps'):.0f} | {med(rs, 'ok_rps'):.0f} | {med(rs, 'p50'):.2f} | "
              f"{med(rs, 'p99'):.2f} | {med(rs, 'p999'):.2f} | {med(rs, 'redis_per_s'):.0f} | "
              f"{med(rs, 'timeouts'):.0f} | {med(rs, 'opened'):.0f} |")
    local, remote = results["local rule, admits all"], results["redis rule, admits all"]
    print(f"\nAdded by the Redis round trip: p50 {med(remote, 'p50') - med(local, 'p50'):+.2f} ms, "
          f"p99 {med(remote, 'p99') - med(local, 'p99'):+.2f} ms.")


def redis_version():
    out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout
    m = re.search(r"v=(\S+)", out)
    return m.group(1) if m else "?"


if __name__ == "__main__":
    main()
