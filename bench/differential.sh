#!/usr/bin/env bash
# A longer run of the differential tests of the hand-written HTTP/1 parsers against hyper
# (src/proxy/http1/tests.rs): CASES generated cases per target (default 200 000; the test
# command runs 10 000). Loopback only. A difference found is kept in
# src/proxy/http1/tests.regressions and replayed by every later run.
#   bench/differential.sh [CASES]
set -euo pipefail
cd "$(dirname "$0")/.."
cases="${1:-200000}"
SPILLWAY_DIFF_CASES="$cases" cargo test --locked --release --lib http1::tests -- --nocapture
