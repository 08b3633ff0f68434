#!/usr/bin/env bash
# Spillway side by side with nginx and with no proxy at all, on loopback, same upstream.
# Installs what it needs from Debian when missing (nginx, wrk, h2load), builds the release
# binary, then runs bench/compare.py, which prints a Markdown table (see BENCHMARKS.md).
#   bench/compare.sh [--seconds N] [--rounds N] [--conns 16,128]
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing+=(nginx-light)
command -v wrk >/dev/null 2>&1 || missing+=(wrk)
command -v h2load >/dev/null 2>&1 || missing+=(nghttp2-client)
command -v python3 >/dev/null 2>&1 || missing+=(python3)
if ((${#missing[@]})); then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
    else
        echo "error: missing ${missing[*]}; install them (apt-get install ${missing[*]})" >&2
        exit 1
    fi
fi

cargo build --locked --release --quiet
exec python3 bench/compare.py "$@"
