#!/usr/bin/env bash
# How well and how fast a fleet's admitted rate meets its limit (see benches/fleet_convergence.rs).
# Runs on loopback only, about a minute; prints a Markdown table for BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo bench --locked --bench fleet_convergence 2>/dev/null | grep '^|'
