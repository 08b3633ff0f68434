#!/usr/bin/env bash
# How well and how fast a fleet's admitted rate meets its limit (benches/fleet_convergence.rs),
# and whether the sums behind the ratios hold with many keys, uneven intervals and weighted
# requests (benches/fleet_arithmetic.rs), and a rolling upgrade from the previous release
# with real processes (benches/fleet_upgrade.rs; scripts/previous builds that release once).
# Runs on loopback only, about twelve minutes; prints Markdown tables for BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo bench --locked --bench fleet_convergence 2>/dev/null | grep '^|'
echo
cargo bench --locked --bench fleet_arithmetic 2>/dev/null | grep '^|'
echo
SPILLWAY_PREVIOUS="$(scripts/previous)" cargo bench --locked --bench fleet_upgrade 2>/dev/null | grep '^|'
