#!/usr/bin/env bash
# The isolation suite's report (tests/tests/isolation.rs at a larger scale):
# every failure path, two or more tenants, canaries in every prompt; prints
# the table the README's security section quotes — path, trials, responses
# checked, leaks (must be 0), pools at baseline.
#
#   scripts/isolation_report.sh [SCALE]     # default 24: > 10,000 responses
#
# The binary is the test build (debug, with the `fault-injection` feature the
# engine-fault path needs: release builds cannot be made to panic).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scale=${1:-24}

scripts/setup.sh
scripts/plugins.sh
cargo build --locked -p bulkhead --features fault-injection
report="${CARGO_TARGET_DIR:-$root/target}/isolation-report.md"
rm -f "$report"
BULKHEAD_REQUIRE_MODEL=1 BULKHEAD_ISOLATION_SCALE="$scale" BULKHEAD_ISOLATION_REPORT="$report" \
    cargo test --locked -p bulkhead-tests --test isolation -- --nocapture
echo
echo "scripts/isolation_report.sh $scale ($(date -u +%Y-%m-%d)):"
echo
cat "$report"
