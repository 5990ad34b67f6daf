#!/usr/bin/env bash
# Long contexts, Bulkhead's engine against llama.cpp, alternated in one run on
# the same machine and thread count (BENCHMARKS.md, "Long contexts").
#
#   scripts/bench_long.sh LLAMA_BENCH [DEPTHS]
#
# For each depth N (default 512 2048 4096 8192):
#   prefill: `bulkhead bench engine --prefill-tokens N` (512-token chunks, as
#            the server runs them) and `llama-bench -p N -n 0`;
#   decode:  64 tokens at depth N, `bulkhead bench engine --decode-context N`
#            and `llama-bench -p 0 -n 64 -d N`; at 8192 the depth is 8128 so
#            depth plus tokens fit the model's 8,192-token context.
# Both keep KV in f16 (llama.cpp's default; Bulkhead's default). Each figure
# is the median of ROUNDS (default 3) rounds, each round one run of each of
# the four in turn, so both engines see the same moments of a shared
# machine's load; the range over the rounds follows in brackets. Compare the
# ratio within a row, not rows across runs.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
llama_bench=${1:?usage: scripts/bench_long.sh LLAMA_BENCH [DEPTHS]}
shift
depths=${*:-512 2048 4096 8192}
rounds=${ROUNDS:-3}
model="$root/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
bulkhead="$root/target/release/bulkhead"
threads=2
(cd "$root" && cargo build --release --locked -p bulkhead 2>/dev/null)

# The tokens/s figure of llama-bench's markdown row for test $1 ("pp512", "tg64 @ d512").
llama_rate() {
    grep -F " $1 |" | awk -F'|' '{print $(NF-1)}' | awk '{print $1}'
}
# "median [min-max]" of the numbers on stdin.
summary() {
    sort -g | awk '{ v[NR] = $1 } END { printf "%s [%s-%s]", v[int((NR + 1) / 2)], v[1], v[NR] }'
}
ratio() { awk -v a="${1%% *}" -v b="${2%% *}" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }'; }

printf '| depth | prefill Bulkhead | prefill llama.cpp | ratio | decode Bulkhead | decode llama.cpp | ratio |\n'
printf '|---|---|---|---|---|---|---|\n'
for n in $depths; do
    depth=$n
    if [ "$n" -ge 8192 ]; then depth=$((n - 64)); fi
    ours_prefill=() ours_decode=() theirs_prefill=() theirs_decode=()
    for _ in $(seq "$rounds"); do
        ours=$("$bulkhead" bench engine --model "$model" --threads "$threads" --prefill-tokens "$n" \
            --decode-context "$depth" --decode-tokens 64 --batches 1 --repeats 1)
        ours_prefill+=("$(sed -n 's/^prefill .*: \([0-9.]*\) tok\/s$/\1/p' <<<"$ours")")
        ours_decode+=("$(sed -n 's/^decode batch *1 .*: \([0-9.]*\) tok\/s.*/\1/p' <<<"$ours")")
        theirs_prefill+=("$("$llama_bench" -m "$model" -t "$threads" -p "$n" -n 0 -r 1 -o md 2>/dev/null |
            llama_rate "pp$n")")
        theirs_decode+=("$("$llama_bench" -m "$model" -t "$threads" -p 0 -n 64 -d "$depth" -r 1 -o md 2>/dev/null |
            llama_rate "tg64 @ d$depth")")
    done
    op=$(printf '%s\n' "${ours_prefill[@]}" | summary)
    tp=$(printf '%s\n' "${theirs_prefill[@]}" | summary)
    od=$(printf '%s\n' "${ours_decode[@]}" | summary)
    td=$(printf '%s\n' "${theirs_decode[@]}" | summary)
    printf '| %s | %s | %s | %s× | %s | %s | %s× |\n' "$n" "$op" "$tp" "$(ratio "$op" "$tp")" \
        "$od" "$td" "$(ratio "$od" "$td")"
done
