#!/usr/bin/env bash
# User-space instructions per request of Spillway, nginx and HAProxy, counted by callgrind: a figure
# that does not move with the machine's noise, for A/B of small changes (see BENCHMARKS.md).
# Installs what it needs from Debian when missing (valgrind, nginx, haproxy, h2load).
#   bench/instructions.sh [--requests N] [--conns N] [--baseline /path/to/other/spillway]
#     [--only NAME-PART | =NAME] [--extra YAML-for-this-build-only] [--no-haproxy]
set -euo pipefail
cd "$(dirname "$0")/.."

source bench/lib.sh
install_missing valgrind=valgrind nginx=nginx-light haproxy=haproxy h2load=nghttp2-client python3=python3

cargo build --locked --release --quiet
exec python3 bench/instructions.py "$@"
