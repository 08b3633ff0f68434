#!/usr/bin/env bash
# Redis mode through the proxy (see bench/redis.py). Installs what it needs from Debian when
# missing (redis-server, nginx for the upstream, wrk), builds the release binary, runs.
#   bench/redis.sh [--seconds N] [--rounds N] [--conns N] [--algorithm NAME]
set -euo pipefail
cd "$(dirname "$0")/.."

source bench/lib.sh
install_missing redis-server=redis-server nginx=nginx-light wrk=wrk python3=python3

cargo build --locked --release --quiet
exec python3 bench/redis.py "$@"
