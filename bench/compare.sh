#!/usr/bin/env bash
# Spillway side by side with nginx, HAProxy and no proxy at all, on loopback, same upstream.
# Installs what it needs from Debian when missing (nginx, haproxy, wrk, h2load), builds the release
# binary, then runs bench/compare.py, which prints a Markdown table (see BENCHMARKS.md).
#   bench/compare.sh [--seconds N] [--rounds N] [--conns 16,128]
set -euo pipefail
cd "$(dirname "$0")/.."

source bench/lib.sh
install_missing nginx=nginx-light haproxy=haproxy wrk=wrk h2load=nghttp2-client python3=python3

cargo build --locked --release --quiet
exec python3 bench/compare.py "$@"
