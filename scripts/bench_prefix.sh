#!/usr/bin/env bash
# The prefix cache and reclaim (BENCHMARKS.md, "Prefix cache and reclaim").
#
# 1. Bulkhead (demo policy, tenant alpha, its prefix cache on) and llama-server
#    (its prompt cache on: the default `cache_prompt: true`) side by side, each
#    workload on one then the other, at concurrency 1/4/8/32: every prompt
#    identical, then a shared ~400-token prefix with a distinct end.
# 2. Reclaim: tenant beta floods a small pool with 8 clients, alone, then while
#    tenant alpha sends full-context requests its reservation cannot hold, so
#    each of them takes loaned pages back from beta (preemption).
#
#   scripts/setup.sh && cargo build --release -p bulkhead
#   scripts/bench_prefix.sh /path/to/llama-server     # part 1 and 2
#   scripts/bench_prefix.sh                           # part 2 only
#   LEVELS=1 RECLAIM=0 scripts/bench_prefix.sh /path/to/llama-server
#                                 # part 1 at concurrency 1 only, no part 2
set -euo pipefail
LEVELS=${LEVELS:-1,4,8,32}
RECLAIM=${RECLAIM:-1}
cd "$(dirname "$0")/.."
B=target/release/bulkhead
LLAMA=${1:-}
MODEL=$PWD/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
export BULKHEAD_KEY_ALPHA=$(openssl rand -hex 24)
export BULKHEAD_KEY_BETA=$(openssl rand -hex 24)
export BULKHEAD_ADMIN_TOKEN=$(openssl rand -hex 24)
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

# serve POLICY NAME: starts Bulkhead on 18080/18081; sets $pid.
serve() {
  local log="$work/$2.err"
  $B serve --config "$1" --store "$work/$2-state" --listen 127.0.0.1:18080 \
      --admin-listen 127.0.0.1:18081 >/dev/null 2>"$log" &
  pid=$!
  pids+=("$pid")
  for _ in $(seq 1 150); do grep -q "listening: admin" "$log" && return; sleep 0.2; done
  echo "bulkhead did not start:"; cat "$log"; exit 1
}
stop() { kill "$1"; wait "$1" 2>/dev/null || true; }
bench() { $B bench http --prompt-sentences 32 "$@"; }
metric() { curl -s http://127.0.0.1:18081/metrics | grep "^$1" || true; }

if [ -n "$LLAMA" ]; then
  serve policies/demo.toml demo
  bulkhead=$pid
  # 32 clients at once: alpha's pending_max (8 in the demo, a limit on work
  # before admission) would refuse most of them with 429 before they queue.
  $B admin --url http://127.0.0.1:18081 quota set alpha --pending-max 64 >/dev/null
  "$LLAMA" -m "$MODEL" -t 2 --parallel 8 --port 18090 >"$work/llama.log" 2>&1 &
  llama=$!
  pids+=("$llama")
  for _ in $(seq 1 150); do curl -sf http://127.0.0.1:18090/health >/dev/null && break; sleep 0.2; done
  for layout in identical shared-prefix; do
    flag=(); [ "$layout" = shared-prefix ] && flag=(--shared-prefix)
    echo "== $layout prompts: bulkhead"
    bench --url http://127.0.0.1:18080 --key "$BULKHEAD_KEY_ALPHA" --pid "$bulkhead" "${flag[@]}" \
        --concurrency "$LEVELS" --requests 32
    echo "== $layout prompts: llama-server"
    bench --url http://127.0.0.1:18090 --model smollm2 --pid "$llama" "${flag[@]}" \
        --concurrency "$LEVELS" --requests 32
  done
  echo "== cold reference (distinct prompts, no prefix in common): bulkhead"
  bench --url http://127.0.0.1:18080 --key "$BULKHEAD_KEY_ALPHA" --pid "$bulkhead" --distinct-prompts \
      --concurrency 1 --requests 8
  echo "== cold reference: llama-server"
  bench --url http://127.0.0.1:18090 --model smollm2 --pid "$llama" --distinct-prompts \
      --concurrency 1 --requests 8
  stop "$llama"; stop "$bulkhead"
fi

[ "$RECLAIM" = 1 ] || exit 0

# Part 2: a 256-page pool; alpha reserves 64, beta 32, each may hold 192.
cat >"$work/reclaim.toml" <<EOF
[[models]]
id = "smollm2-135m-instruct"
path = "$MODEL"
context_tokens = 2048
threads = 2
page_tokens = 16
pool_pages = 256
seq_pages_max = 128
step_tokens_max = 512
step_seqs_max = 16

[tenants.alpha]
pages_reserved = 64
pages_max = 192
key_env = "BULKHEAD_KEY_ALPHA"

[tenants.beta]
pages_reserved = 32
pages_max = 192
key_env = "BULKHEAD_KEY_BETA"
EOF
serve "$work/reclaim.toml" reclaim
# Beta: ~430-token prompts + 64 = 31 pages each; six run in its 192, two wait.
flood() { $B bench http --url http://127.0.0.1:18080 --key "$BULKHEAD_KEY_BETA" --concurrency 8 \
    --requests 64 --prompt-sentences 32 --distinct-prompts --pid "$pid"; }
echo "== reclaim: beta alone"
flood
echo "== reclaim: beta, while alpha sends 1,900-token prompts (~120 pages, 64 reserved)"
$B bench http --url http://127.0.0.1:18080 --key "$BULKHEAD_KEY_ALPHA" --concurrency 1 \
    --requests 4 --prompt-sentences 150 --distinct-prompts >"$work/alpha.txt" &
alpha=$!
flood
wait $alpha
echo "-- alpha:"; cat "$work/alpha.txt"
metric bulkhead_preempted_total
stop "$pid"
