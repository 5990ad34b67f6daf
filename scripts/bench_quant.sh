#!/usr/bin/env bash
# K-quant files, Bulkhead's engine against llama.cpp on the same files,
# alternated in one run (BENCHMARKS.md, "The GGUF models people run").
#
#   scripts/llama_cpp.sh && python3 scripts/llama_fixtures.py   # llama.cpp, the SmolLM2 files
#   cargo build --release -p bulkhead
#   scripts/bench_quant.sh [MODEL.gguf ...]
#
# Default models: SmolLM2-135M re-quantized by llama-quantize to Q4_K_M and
# Q6_K, and a random-weight model of Llama-3.2-1B's shape (Q4_K matrices, Q6_K
# embedding; kernels/examples/random_model.rs, about 0.8 GB, written once into
# .cache/models/).
#
# Per model and round, each of these in turn (both engines, 2 threads, f16 KV):
#   prefill 512:  `bulkhead bench engine --prefill-tokens 512`,  `llama-bench -p 512 -n 0`
#   decode b1:    64 tokens after a 16-token prompt,             `llama-bench -p 0 -n 64`
#   decode b8:    8 sequences x 64 tokens, aggregate,            `llama-batched-bench
#                 -npp 16 -ntg 64 -npl 8` (S_TG)
# Each figure is the median of ROUNDS (default 3) rounds, the range in brackets.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin="$root/.cache/llama.cpp/bin"
bulkhead="$root/target/release/bulkhead"
rounds=${ROUNDS:-3}
threads=2
models=("$@")
if [ ${#models[@]} -eq 0 ]; then
    one_b="$root/.cache/models/random-llama-3.2-1b.Q4_K_M.gguf"
    if [ ! -f "$one_b" ]; then
        (cd "$root" && cargo run --release --locked -q -p bulkhead-kernels \
            --example random_model -- llama-3.2-1b "$one_b")
    fi
    models=("$root/.cache/models/SmolLM2-135M-Instruct.Q4_K_M.gguf"
        "$root/.cache/models/SmolLM2-135M-Instruct.Q6_K.gguf" "$one_b")
fi

llama_rate() { grep -F " $1 |" | awk -F'|' '{print $(NF-1)}' | awk '{print $1}'; }
# S_TG t/s of llama-batched-bench's row for PP=16, TG=64, B=8.
batched_rate() { awk -F'|' '$2+0 == 16 && $3+0 == 64 && $4+0 == 8 {print $9+0}'; }
summary() {
    sort -g | awk '{ v[NR] = $1 } END { printf "%s [%s-%s]", v[int((NR + 1) / 2)], v[1], v[NR] }'
}
ratio() { awk -v a="${1%% *}" -v b="${2%% *}" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }'; }

printf '| model | prefill 512 Bulkhead | llama.cpp | ratio | decode b1 Bulkhead | llama.cpp | ratio | decode b8 Bulkhead | llama.cpp | ratio |\n'
printf '|---|---|---|---|---|---|---|---|---|---|\n'
for model in "${models[@]}"; do
    op=() tp=() o1=() t1=() o8=() t8=()
    for _ in $(seq "$rounds"); do
        ours=$("$bulkhead" bench engine --model "$model" --threads "$threads" --prefill-tokens 512 \
            --decode-tokens 64 --batches 1,8 --repeats 1)
        op+=("$(sed -n 's/^prefill .*: \([0-9.]*\) tok\/s$/\1/p' <<<"$ours")")
        o1+=("$(sed -n 's/^decode batch *1 .*: \([0-9.]*\) tok\/s.*/\1/p' <<<"$ours")")
        o8+=("$(sed -n 's/^decode batch *8 .*: \([0-9.]*\) tok\/s.*/\1/p' <<<"$ours")")
        theirs=$("$bin/llama-bench" -m "$model" -t "$threads" -p 512 -n 64 -r 1 -o md 2>/dev/null)
        tp+=("$(llama_rate pp512 <<<"$theirs")")
        t1+=("$(llama_rate tg64 <<<"$theirs")")
        t8+=("$("$bin/llama-batched-bench" -m "$model" -t "$threads" -c 1024 -b 512 -ub 512 \
            -npp 16 -ntg 64 -npl 8 2>/dev/null | batched_rate)")
    done
    row=()
    for pair in "op tp" "o1 t1" "o8 t8"; do
        set -- $pair
        declare -n a=$1 b=$2
        sa=$(printf '%s\n' "${a[@]}" | summary)
        sb=$(printf '%s\n' "${b[@]}" | summary)
        row+=("$sa" "$sb" "$(ratio "$sa" "$sb")×")
        unset -n a b
    done
    printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' "$(basename "$model")" "${row[@]}"
done
