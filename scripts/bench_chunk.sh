#!/usr/bin/env bash
# The prefill chunk (a model's `step_tokens_max`) against prompt length
# (BENCHMARKS.md, "Long contexts": chunking policy).
#
#   scripts/bench_chunk.sh [LENGTHS] [-- CHUNKS]
#
# For each prompt length and chunk size: prefill tokens per second
# (`bulkhead bench engine --prefill-tokens N --chunk C`), and the mean step
# time C / rate, which is how long every other running sequence waits for its
# next token while the chunk is in the batch (decode tokens ride in the same
# step; a step costs about its tokens' worth of prefill time).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
lengths="512 2048 8192"
chunks="128 256 512 1024 2048"
if [ $# -gt 0 ]; then
    lengths=""
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do lengths="$lengths $1"; shift; done
    if [ "${1:-}" = "--" ]; then shift; chunks="$*"; fi
fi
model="$root/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
bulkhead="$root/target/release/bulkhead"
(cd "$root" && cargo build --release --locked -p bulkhead 2>/dev/null)

printf '| prompt | chunk | prefill tok/s | step time (ms) |\n|---|---|---|---|\n'
for n in $lengths; do
    for c in $chunks; do
        if [ "$c" -gt "$n" ]; then continue; fi
        rate=$("$bulkhead" bench engine --model "$model" --threads 2 --prefill-tokens "$n" \
            --chunk "$c" --decode-tokens 1 --batches 1 --repeats 1 |
            sed -n 's/^prefill .*: \([0-9.]*\) tok\/s$/\1/p')
        printf '| %s | %s | %s | %s |\n' "$n" "$c" "$rate" \
            "$(awk -v c="$c" -v r="$rate" 'BEGIN { printf "%.0f", 1000 * c / r }')"
    done
done
