#!/usr/bin/env bash
# Soak (see bench/soak.py): 10 minutes of mixed traffic, RSS / fds / p99 every 10 s.
# Runs on demand, not in CI. Installs what it needs from Debian when missing.
#   bench/soak.sh [--minutes N] [--conns N]
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing+=(nginx-light)
command -v wrk >/dev/null 2>&1 || missing+=(wrk)
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
exec python3 bench/soak.py "$@"
