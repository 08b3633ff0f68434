#!/usr/bin/env bash
# Soak (see bench/soak.py): 10 minutes of mixed traffic, RSS / fds / p99 every 10 s.
# Runs on demand, not in CI. Installs what it needs from Debian when missing.
#   bench/soak.sh [--minutes N] [--conns N]
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh
install_missing nginx=nginx-light wrk=wrk python3=python3
cargo build --locked --release --quiet
exec python3 bench/soak.py "$@"
