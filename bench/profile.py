#!/usr/bin/env python3
"""Where a request's user-space instructions go, by owner: a callgrind file split into hyper,
h2, tokio and the parts of Spillway (the rules, the upstream exchange and its heads, the stall
watch, the per-client permit, ...), and the functions that cost most within each.

A release build is one function where LTO inlined it, so a function's name says little; what
callgrind keeps of each instruction is its source file (`fi=`/`fe=` for inlined code, given a
build with line tables: bench/profile.sh makes one). Each instruction is charged to its file's
owner. Code no owner claims (the standard library, libc's malloc and memcpy, `http`, `bytes`)
is charged to whoever called it, in proportion to each call site's inclusive cost, up the
callers until an owner's call site takes it: a HeaderMap h2 fills is h2's, one the exchange
fills is the exchange's.

    bench/profile.sh ["forwarded, HTTP/2"]          # build with line tables, count, split
    python3 bench/profile.py CALLGRIND-FILE [--requests N] [--top K]
"""

import argparse
import collections
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + "/"
# (owner, a pattern of the path): a dependency's by its crate's directory, ours (rustc writes
# our files relative to the package, `src/...`, or under ROOT) by its module; the first match
# wins; no match (std, libc, `http`, `bytes`, ...): charged to the caller.
CRATES = [
    ("h2", r"/h2-\d"),
    ("hyper", r"/hyper-\d"),
    ("hyper-util", r"/hyper-util-\d"),
    ("tokio", r"/(tokio|mio|tokio-util)-\d"),
]
OURS = [
    ("spillway: rules and keys", r"^src/(rules|limit|key|gate|exact)(/|\.rs)"),
    ("spillway: stall watch and held bytes", r"^src/proxy/http2/(stalls|held)\.rs"),
    ("spillway: HTTP/2 service and socket", r"^src/proxy/http2/mod\.rs"),
    ("spillway: connections per client", r"^src/proxy/clients\.rs"),
    ("spillway: upstream exchange and its heads",
     r"^src/(proxy/(http1/client|http1/framing|http1/response_head|forward|forwarded|upstream_pool)|hop)"),
    # request.rs holds the per-client permit of an HTTP/2 stream (`Conn::stream_slot`) too.
    ("spillway: request path", r"^src/(proxy/(request|response|body|protocol)|target|hygiene|ids|usage)"),
    ("spillway: HTTP/1 server", r"^src/proxy/http1/"),
    ("spillway: connections and timers", r"^src/proxy/(worker|connection|accept|deadlines)\.rs"),
    ("spillway: metrics", r"^src/metrics"),
    ("spillway: other", r"^src/"),
]
CRATES = [(name, re.compile(p)) for name, p in CRATES]
OURS = [(name, re.compile(p)) for name, p in OURS]


def owner(path, cache={}):
    if path not in cache:
        rel = path[len(ROOT):] if path.startswith(ROOT) else path
        table = OURS if rel.startswith("src/") else CRATES
        cache[path] = next((name for name, p in table if p.search(rel)), None)
    return cache[path]


def parse(path):
    """(own, unowned, calls): `own[fn][owner]` instructions of `fn` in an owned file,
    `unowned[fn]` the rest, `calls[callee]` a list of (caller, call site's owner or None,
    inclusive cost)."""
    own = collections.defaultdict(collections.Counter)
    unowned = collections.Counter()
    calls = collections.defaultdict(list)
    fl = fi = fn = None
    callee = None
    pending_call = False
    with open(path) as f:
        for line in f:
            c = line[0]
            if c.isdigit() or c in "+-*":
                parts = line.split()
                if len(parts) < 2:
                    continue
                cost = int(parts[1])
                site = fi or fl
                who = owner(site) if site else None
                if pending_call:
                    calls[callee].append((fn, who, cost))
                    pending_call = False
                elif who:
                    own[fn][who] += cost
                else:
                    unowned[fn] += cost
                continue
            key, _, value = line.rstrip("\n").partition("=")
            if key == "fl":
                fl, fi = value, None
            elif key in ("fi", "fe"):
                fi = value
            elif key == "fn":
                fn, fi = value, None
            elif key == "cfn":
                callee = value
            elif key == "calls":
                pending_call = True
    return own, unowned, calls


def split(own, unowned, calls, passes=60):
    """(owner -> instructions, owner -> unowned function -> instructions it was charged), the
    unowned cost pushed up to the callers' sites."""
    total = collections.Counter()
    charged = collections.defaultdict(collections.Counter)
    for fn, by in own.items():
        total.update(by)
    # (function the cost sits in now, function it was spent in) -> instructions
    pending = collections.Counter({(fn, fn): cost for fn, cost in unowned.items()})
    into = {callee: sum(w for _, _, w in edges) for callee, edges in calls.items()}
    for _ in range(passes):
        moved = collections.Counter()
        for (fn, origin), cost in pending.items():
            edges = calls.get(fn)
            if not edges or not into[fn]:
                total["(no caller: start-up, runtime)"] += cost
                continue
            for caller, who, w in edges:
                share = cost * w / into[fn]
                if who:
                    total[who] += share
                    charged[who][origin] += share
                else:
                    moved[(caller, origin)] += share
        pending = moved
        if sum(pending.values()) < 1:
            break
    for cost in pending.values():
        total["(unresolved recursion)"] += cost
    return total, charged


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--top", type=int, default=4, help="functions shown per owner")
    args = ap.parse_args()
    own, unowned, calls = parse(args.file)
    total, charged = split(own, unowned, calls)
    whole = sum(total.values())
    print(f"| owner | instructions per request | share |")
    print("|---|---|---|")
    for who, cost in total.most_common():
        print(f"| {who} | {cost / args.requests:.0f} | {100 * cost / whole:.1f} % |")
    print(f"| all | {whole / args.requests:.0f} | 100 % |")
    if args.top:
        print("\nThe functions whose own instructions (in the owner's files) cost most, per owner:\n")
        by_owner = collections.defaultdict(list)
        for fn, by in own.items():
            for who, cost in by.items():
                by_owner[who].append((cost, fn))
        for who, _ in total.most_common():
            fns = sorted(by_owner.get(who, []), reverse=True)[: args.top]
            if fns:
                print(f"- {who}: " + "; ".join(
                    f"{short(fn)} {cost / args.requests:.0f}" for cost, fn in fns))
        print("\nWhat each owner's calls cost in code no owner claims (std, libc, http, bytes):\n")
        for who, _ in total.most_common():
            fns = charged[who].most_common(args.top)
            if fns:
                print(f"- {who}: " + "; ".join(
                    f"{short(fn)} {cost / args.requests:.0f}" for fn, cost in fns))


def short(fn):
    """A function's name without its generic arguments, cut to 90 characters."""
    out, depth = [], 0
    for ch in fn:
        if ch == "<":
            depth += 1
            if depth == 1:
                out.append("<..>")
        elif ch == ">" and depth:
            depth -= 1
        elif not depth:
            out.append(ch)
    s = "".join(out)
    return s if len(s) <= 90 else s[:87] + "..."


if __name__ == "__main__":
    sys.exit(main())
