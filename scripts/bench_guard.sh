#!/usr/bin/env bash
# The runtime canary guard's throughput cost (BENCHMARKS.md, "Canary guard"):
# the demo policy served twice from fresh stores, the guard off and on,
# alternated ROUNDS times. Tenant beta has 32 registered canaries of 64 bytes
# (the most a tenant may have, a quarter of the longest allowed), so every
# response of alpha's is scanned against all of them and a stream holds back
# 63 bytes. Alpha's load: `bulkhead bench http --distinct-prompts`.
#
#   scripts/bench_guard.sh [ROUNDS] [CONCURRENCY]     (default 2, "1,8")
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${1:-2}
levels=${2:-1,8}
bulkhead="$root/target/release/bulkhead"
(cd "$root" && cargo build --release --locked -p bulkhead 2>/dev/null)
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work" "$root"/policies/guard-bench-*.toml' EXIT
export BULKHEAD_KEY_ALPHA=bench-guard-alpha-0123456789abcdef
export BULKHEAD_KEY_BETA=bench-guard-beta-0123456789abcdef
export BULKHEAD_ADMIN_TOKEN=bench-guard-admin-0123456789abcdef
canaries=$(python3 -c 'import json; print(json.dumps({"canaries": ["canary-%02d-" % i + "x" * 54 for i in range(32)]}))')

run() { # $1: true|false
    local policy="$root/policies/guard-bench-$1.toml"
    sed "s/^canary_guard = false/canary_guard = $1/" "$root/policies/demo.toml" >"$policy"
    rm -rf "$work/store"
    "$bulkhead" serve --config "$policy" --store "$work/store" --listen 127.0.0.1:18180 \
        --admin-listen 127.0.0.1:18181 2>"$work/log" &
    local pid=$!
    for _ in $(seq 600); do
        curl -sf http://127.0.0.1:18181/readyz >/dev/null && break
        sleep 0.1
    done
    curl -sf -X PUT -H "Authorization: Bearer $BULKHEAD_ADMIN_TOKEN" -d "$canaries" \
        http://127.0.0.1:18181/admin/v1/tenants/beta/canaries >/dev/null
    echo "== canary_guard = $1"
    "$bulkhead" bench http --url http://127.0.0.1:18180 --key "$BULKHEAD_KEY_ALPHA" \
        --concurrency "$levels" --requests 16 --distinct-prompts
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    rm -f "$policy"
}

for _ in $(seq "$rounds"); do
    run false
    run true
done
