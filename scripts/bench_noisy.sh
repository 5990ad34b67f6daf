#!/usr/bin/env bash
# The noisy-neighbour benchmark (BENCHMARKS.md, "Noisy neighbours"): the demo
# policy (alpha weight 2, beta weight 1) from a fresh store, then llama-server
# on the same machine under the same two-client load (it has no tenants: the
# two groups of clients are just clients). Three phases of SECONDS each:
# alpha alone at 1 client; alpha at 1 while beta floods at 8; both saturated
# at 24 clients each. Both tenants' running_max is raised to the model's 32
# sequence slots first, so in the last phase they contend for slots (the
# demo's 16 + 16 would fit side by side and leave weights nothing to decide).
#
#   scripts/bench_noisy.sh [LLAMA_SERVER] [SECONDS]    (default: no llama-server, 30)
#
# BULKHEAD_BIN=path runs that binary instead of building target/release/bulkhead
# (to compare two builds in one session); NOISY_WEIGHTS=A:B sets alpha's and
# beta's weights (default the demo's 2:1).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
llama_server=${1:-}
seconds=${2:-30}
bulkhead=${BULKHEAD_BIN:-$root/target/release/bulkhead}
model="$root/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -z "${BULKHEAD_BIN:-}" ]; then
    (cd "$root" && cargo build --release --locked -p bulkhead 2>/dev/null)
fi
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
export BULKHEAD_KEY_ALPHA=bench-noisy-alpha-0123456789abcdef
export BULKHEAD_KEY_BETA=bench-noisy-beta-0123456789abcdef
export BULKHEAD_ADMIN_TOKEN=bench-noisy-admin-0123456789abcdef

wait_ready() { # $1: URL that answers 200 when ready
    for _ in $(seq 1200); do
        curl -sf "$1" >/dev/null && return 0
        sleep 0.1
    done
    echo "not ready: $1" >&2
    return 1
}

echo "== bulkhead (demo policy)"
"$bulkhead" serve --config "$root/policies/demo.toml" --store "$work/store" \
    --listen 127.0.0.1:18280 --admin-listen 127.0.0.1:18281 2>"$work/bulkhead.log" &
pid=$!
wait_ready http://127.0.0.1:18281/readyz
weights=${NOISY_WEIGHTS:-2:1}
for tenant in alpha beta; do
    weight=${weights%%:*}
    [ "$tenant" = beta ] && weight=${weights##*:}
    "$bulkhead" admin --url http://127.0.0.1:18281 quota set "$tenant" --running-max 32 --pending-max 64 \
        --weight "$weight" >/dev/null
done
"$bulkhead" bench noisy --url http://127.0.0.1:18280 --alpha-key "$BULKHEAD_KEY_ALPHA" \
    --beta-key "$BULKHEAD_KEY_BETA" --weights "$weights" --saturate 24 --seconds "$seconds"
kill "$pid"
wait "$pid" 2>/dev/null || true

if [ -n "$llama_server" ]; then
    echo "== llama-server (--parallel 32, no prompt cache)"
    "$llama_server" -m "$model" -t 2 --parallel 32 -c 16384 --cache-ram 0 \
        --host 127.0.0.1 --port 18290 >"$work/llama.log" 2>&1 &
    pid=$!
    wait_ready http://127.0.0.1:18290/health
    "$bulkhead" bench noisy --url http://127.0.0.1:18290 --model smollm2 --weights 1:1 \
        --saturate 24 --seconds "$seconds" --extra '{"cache_prompt": false}'
    kill "$pid"
    wait "$pid" 2>/dev/null || true
fi
