#!/usr/bin/env bash
# How many reports one aggregator core and one controller core take (see
# benches/control_scale.rs). Loopback only, about a minute and a half; prints a Markdown table.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo bench --locked --bench control_scale 2>/dev/null | grep '^|'
