#!/usr/bin/env bash
# CPU per request (user and kernel) of Spillway beside nginx and HAProxy, and syscalls per request: where a
# request's cost lies, beside instructions.sh's user-space count (see BENCHMARKS.md).
# Installs what it needs from Debian when missing (nginx, haproxy, h2load, strace).
#   bench/cpu.sh [--requests N] [--rounds N] [--syscalls] [--baseline /path/to/other/spillway]
set -euo pipefail
cd "$(dirname "$0")/.."

source bench/lib.sh
install_missing nginx=nginx-light haproxy=haproxy h2load=nghttp2-client strace=strace python3=python3

cargo build --locked --release --quiet
exec python3 bench/cpu.py "$@"
