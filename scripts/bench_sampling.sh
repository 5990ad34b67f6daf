#!/usr/bin/env bash
# What the per-request sampling options cost (BENCHMARKS.md, "Sampling
# options"): one server on the demo policy, alpha's load from `bulkhead bench
# http --distinct-prompts` with each option set in turn, alternated ROUNDS
# times: plain sampling; log probabilities with 5 alternatives; presence and
# frequency penalties with a logit bias; JSON mode. Each request asks for
# 64 tokens at temperature 1 (JSON mode may end earlier: an object closed).
#
#   scripts/bench_sampling.sh [ROUNDS] [CONCURRENCY]     (default 2, "1,8")
#
# BULKHEAD_BIN runs that binary instead of building this tree's (to compare
# two builds on one machine).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${1:-2}
levels=${2:-1,8}
if [ -n "${BULKHEAD_BIN:-}" ]; then
    bulkhead=$BULKHEAD_BIN
else
    bulkhead="$root/target/release/bulkhead"
    (cd "$root" && cargo build --release --locked -p bulkhead 2>/dev/null)
fi
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
export BULKHEAD_KEY_ALPHA=bench-sampling-alpha-0123456789abcdef
export BULKHEAD_KEY_BETA=bench-sampling-beta-0123456789abcdef
export BULKHEAD_ADMIN_TOKEN=bench-sampling-admin-0123456789abcdef

"$bulkhead" serve --config "$root/policies/demo.toml" --store "$work/store" \
    --listen 127.0.0.1:18190 --admin-listen 127.0.0.1:18191 2>"$work/log" &
pid=$!
for _ in $(seq 600); do
    curl -sf http://127.0.0.1:18191/readyz >/dev/null && break
    sleep 0.1
done

options=(
    'plain|{"temperature":1}'
    'logprobs|{"temperature":1,"logprobs":5}'
    'penalties|{"temperature":1,"presence_penalty":0.5,"frequency_penalty":0.5,"logit_bias":{"28":-5,"30":2}}'
    'json_object|{"temperature":1,"response_format":{"type":"json_object"}}'
)
first=0
for _ in $(seq "$rounds"); do
    for option in "${options[@]}"; do
        echo "== ${option%%|*}"
        "$bulkhead" bench http --url http://127.0.0.1:18190 --key "$BULKHEAD_KEY_ALPHA" \
            --concurrency "$levels" --requests 16 --distinct-prompts --first-request "$first" \
            --extra "${option#*|}"
        first=$((first + 1000))
    done
done
