#!/usr/bin/env bash
# Throughput of each model of the demo policy alone, then of both at once, on
# one server in one run (BENCHMARKS.md, "Several models"). Beta (who may use
# only the Q4_1 model) loads it and alpha loads the Q8_0 one, so the two loads
# are two tenants, as they would be in production.
#
#   scripts/setup.sh && scripts/models.sh && cargo build --release -p bulkhead
#   scripts/bench_models.sh
set -euo pipefail
cd "$(dirname "$0")/.."
B=target/release/bulkhead
export BULKHEAD_KEY_ALPHA=$(openssl rand -hex 24)
export BULKHEAD_KEY_BETA=$(openssl rand -hex 24)
export BULKHEAD_ADMIN_TOKEN=$(openssl rand -hex 24)
store=$(mktemp -d)
log="$store/serve.err"
$B serve --config policies/demo.toml --store "$store/state" --listen 127.0.0.1:18080 \
    --admin-listen 127.0.0.1:18081 >/dev/null 2>"$log" &
pid=$!
trap 'kill $pid; wait $pid || true; rm -rf "$store"' EXIT
for _ in $(seq 1 100); do grep -q "listening: admin" "$log" && break; sleep 0.2; done
q4=smollm2-135m-instruct; q8=smollm2-135m-instruct-q8
key_of() { if [ "$1" = smollm2-135m-instruct ]; then echo $BULKHEAD_KEY_BETA; else echo $BULKHEAD_KEY_ALPHA; fi; }
run() { $B bench http --url http://127.0.0.1:18080 --key $(key_of "$1") --model "$1" --concurrency "$2" --requests "$3" --distinct-prompts --pid $pid; }
echo "== warm-up"; run $q4 4 8 >/dev/null; run $q8 4 8 >/dev/null
for c in 1 8; do
  n=$((c == 1 ? 16 : 32))
  echo "== $q4 alone, c=$c"; run $q4 $c $n
  echo "== $q8 alone, c=$c"; run $q8 $c $n
  echo "== both at once, c=$c each"
  run $q4 $c $n > "$store/both-q4.txt" & a=$!
  run $q8 $c $n > "$store/both-q8.txt" & b=$!
  wait $a $b
  echo "-- $q4:"; cat "$store/both-q4.txt"; echo "-- $q8:"; cat "$store/both-q8.txt"
done
