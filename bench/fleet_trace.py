#!/usr/bin/env python3
"""What the proxies of a fleet were allowed, report by report, against a global rule's limit.

Reads the `spillway::fleet` trace (one event per key and report that counts it; see
`FLEET_TRACE` in src/rules/global.rs) from the proxies' text logs (several files, or stdin),
e.g.

    RUST_LOG=spillway::fleet=trace SPILLWAY_BENCH_WINDOWS=1 cargo bench --locked \
        --bench fleet_convergence -- "closed loop, 16 clients per proxy, 300" 2> trace.log
    python3 bench/fleet_trace.py --limit 300 trace.log

and prints, for each key and each report interval (the proxies' reports that fall in it), what
they were offered and admitted, the allowances they were held to until their report summed
(before the guard's headroom; only where every proxy reporting the key is in the interval,
named, with a fresh share) and the fleet's offered rate the reply's share stands for
(limit / keep); then how far the summed allowances were from the limit (root mean square and
worst). The allowances sum to the limit only as far as the controller's sums and the proxies'
own smoothed rates agree.
"""

import argparse
import collections
import datetime
import fileinput
import re
import sys

ANSI = re.compile(r"\x1b\[[0-9;]*m")
TIME = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?Z")
FIELD = re.compile(r"(\w+)=(\"[^\"]*\"|\S+)")


def events(lines):
    """(seconds, source, fields) of each `drained` event."""
    for line in lines:
        line = ANSI.sub("", line)
        if "spillway::fleet" not in line or " drained " not in line:
            continue
        # The proxy's own time stamp, wherever a log collector's prefix puts it.
        t = TIME.search(line)
        if not t:
            continue
        whole = datetime.datetime.fromisoformat(t.group(1)).replace(tzinfo=datetime.timezone.utc)
        secs = whole.timestamp() + float(t.group(2) or 0)
        source = re.search(r"report\{source=([^}]*)\}", line)
        rest = line.split(" drained ", 1)[1]
        # A key of several parts joins them with a control character: up to the next field.
        key = re.search(r"\bkey=(.*?) seq=", rest)
        fields = {k: v.strip('"') for k, v in FIELD.findall(rest)}
        if key:
            fields["key"] = key.group(1)
        yield secs, source.group(1) if source else "?", fields


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=float, required=True, help="the rule's limit, units/s")
    ap.add_argument("--interval", type=float, default=1.0, help="report interval, seconds")
    ap.add_argument("traces", nargs="*", help="the proxies' logs (default: stdin)")
    args = ap.parse_args()
    lines = fileinput.input(args.traces, openhook=fileinput.hook_encoded("utf-8", "replace"))
    seen = list(events(lines))
    if not seen:
        sys.exit("no spillway::fleet events: run with RUST_LOG=info,spillway::fleet=trace")
    start = min(secs for secs, _, _ in seen)
    rounds = collections.defaultdict(list)
    for secs, source, f in seen:
        slot = int((secs - start) / args.interval + 0.5)
        rounds[(f["rule"], f["key"], slot)].append((source, f))
    keys = sorted({(r, k) for r, k, _ in rounds})
    sources = collections.defaultdict(set)
    for (r, k, _), these in rounds.items():
        sources[(r, k)].update(source for source, _ in these)
    for rule, key in keys:
        print(f"rule {rule}, key {key}")
        print("interval | proxies | offered/s | admitted/s | allowed/s (sum) | limit/keep | allowed vs limit")
        errors = []
        for (r, k, slot) in sorted(x for x in rounds if x[:2] == (rule, key)):
            these = rounds[(r, k, slot)]
            offered = sum(float(f["offered"]) for _, f in these) / args.interval
            admitted = sum(float(f["admitted"]) for _, f in these) / args.interval
            # Summed only where the allowance is what held the key: named by the report the
            # reply answers, a share from it, fresh ratios.
            bounded = [(float(f["allowance"]), float(f["keep"])) for _, f in these
                       if float(f["keep"]) > 0 and f.get("named", "true") == "true"
                       and f.get("stale", "false") == "false"]
            # Every proxy that reports the key, once (a proxy's last report as it stops comes
            # right after its interval's own; one that saw nothing of the key is not in it).
            whole = sorted(source for source, _ in these) == sorted(sources[(rule, key)])
            if whole and len(bounded) == len(these):
                allowed = sum(a for a, _ in bounded)
                fleet = sorted(args.limit / keep for _, keep in bounded)
                error = allowed / args.limit - 1
                errors.append(error)
                shown = f"{allowed:.1f} | {fleet[0]:.0f}..{fleet[-1]:.0f} | {error * 100:+.1f} %"
            else:
                shown = "- | - | -"
            print(f"{slot} | {len(these)} | {offered:.0f} | {admitted:.0f} | {shown}")
        if errors:
            rms = (sum(e * e for e in errors) / len(errors)) ** 0.5
            worst = max(errors, key=abs)
            print(f"allowed vs limit over {len(errors)} intervals: rms {rms * 100:.1f} %, "
                  f"worst {worst * 100:+.1f} %\n")


if __name__ == "__main__":
    main()
