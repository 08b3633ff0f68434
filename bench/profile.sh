#!/usr/bin/env bash
# Where one path's user-space instructions go, by owner (h2, hyper, tokio and Spillway's parts):
# a build with line tables in target/profile (the same code, debug information added, so that
# callgrind knows each inlined instruction's source file), the path counted as
# bench/instructions.sh counts it, and its callgrind file split by bench/profile.py.
#   bench/profile.sh [PATH (default: "forwarded, HTTP/2")] [--requests N] [--top K]
set -euo pipefail
cd "$(dirname "$0")/.."

source bench/lib.sh
install_missing valgrind=valgrind h2load=nghttp2-client python3=python3

path="forwarded, HTTP/2"
if (($#)) && [[ $1 != --* ]]; then path=$1; shift; fi
requests=5000 top=4
while (($#)); do
    case $1 in
        --requests) requests=$2; shift 2 ;;
        --top) top=$2; shift 2 ;;
        *) echo "usage: bench/profile.sh [PATH] [--requests N] [--top K]" >&2; exit 2 ;;
    esac
done

CARGO_PROFILE_RELEASE_DEBUG=line-tables-only CARGO_TARGET_DIR=target/profile \
    cargo build --locked --release --quiet
out=$(mktemp -d /tmp/spillway-profile-XXXXXX)
SPILLWAY_BENCH_BIN=target/profile/release/spillway \
    python3 bench/instructions.py --only "=$path" --requests "$requests" --keep "$out" >&2
file=$(ls "$out"/*.callgrind)
echo "callgrind file: $file" >&2
exec python3 bench/profile.py "$file" --requests "$requests" --top "$top"
