#!/usr/bin/env bash
# What `n` choices cost (BENCHMARKS.md, "Several choices"): one server on the
# demo policy (tenant alpha, its prefix cache on), requests of a ~1,000-token
# prompt each (a distinct first sentence, so no request finds another's
# pages), 16 tokens generated per choice at temperature 1, one request at a
# time; the wall time of each, at n = 1 and n = 4.
#
#   cargo build --release -p bulkhead
#   scripts/bench_choices.sh [BINARY] [REQUESTS]
set -euo pipefail
cd "$(dirname "$0")/.."
B=${1:-target/release/bulkhead}
REQUESTS=${2:-5}
source scripts/bench_server.sh
bench_serve "$B"
body() { # NONCE N
  python3 -c '
import json, sys
nonce, n = sys.argv[1], int(sys.argv[2])
text = "Request " + nonce + " begins here. " + " ".join(
    "Sentence %d of the long prompt talks about the weather in a town by the sea." % i for i in range(60))
print(json.dumps({"model": "smollm2-135m-instruct", "prompt": text, "max_tokens": 16,
                  "temperature": 1, "seed": 1, "ignore_eos": True, "n": n}))' "$1" "$2"
}
for n in 1 4 1 4; do
  total=0
  for i in $(seq 1 "$REQUESTS"); do
    body "$n-$i-$RANDOM" "$n" >"$work/body.json"
    t=$( { /usr/bin/time -f %e curl -sf http://127.0.0.1:18080/v1/completions \
        -H "Authorization: Bearer $BULKHEAD_KEY_ALPHA" -H 'Content-Type: application/json' \
        --data @"$work/body.json" -o "$work/out.json"; } 2>&1 )
    prompt=$(python3 -c 'import json,sys; u=json.load(open(sys.argv[1]))["usage"]; print(u["prompt_tokens"], u["completion_tokens"])' "$work/out.json")
    total=$(python3 -c "print($total + $t)")
  done
  echo "n=$n: $REQUESTS requests, mean $(python3 -c "print(round($total / $REQUESTS, 2))") s (prompt and completion tokens of the last: $prompt)"
done
curl -s http://127.0.0.1:18081/metrics -H "Authorization: Bearer $BULKHEAD_ADMIN_TOKEN" \
  | grep -E '^bulkhead_(prefix_cache|cached)[a-z_]*tokens' | head -4 || true
