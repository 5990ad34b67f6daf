#!/usr/bin/env bash
# What scoring a prompt costs (BENCHMARKS.md, "Scoring a prompt"): one
# server on the demo policy (tenant alpha), requests of a ~1,000-token prompt
# each (a distinct first sentence, so no request finds another's pages), one
# at a time; the wall time of each for a completion of one token, and for
# the same prompt scored (`echo`, `max_tokens` 0) with 1 and with 5
# alternatives a token.
#
#   cargo build --release -p bulkhead
#   scripts/bench_echo.sh [BINARY] [REQUESTS]
set -euo pipefail
cd "$(dirname "$0")/.."
B=${1:-target/release/bulkhead}
REQUESTS=${2:-5}
source scripts/bench_server.sh
bench_serve "$B"
body() { # NONCE MODE
  python3 -c '
import json, sys
nonce, mode = sys.argv[1], sys.argv[2]
text = "Request " + nonce + " begins here. " + " ".join(
    "Sentence %d of the long prompt talks about the weather in a town by the sea." % i for i in range(60))
body = {"model": "smollm2-135m-instruct", "prompt": text, "temperature": 0}
if mode == "complete":
    body["max_tokens"] = 1
else:
    body.update({"max_tokens": 0, "echo": True, "logprobs": int(mode[len("score"):])})
print(json.dumps(body))' "$1" "$2"
}
for mode in complete score1 score5 complete score1 score5; do
  total=0
  for i in $(seq 1 "$REQUESTS"); do
    body "$mode-$i-$RANDOM" "$mode" >"$work/body.json"
    t=$( { /usr/bin/time -f %e curl -sf http://127.0.0.1:18080/v1/completions \
        -H "Authorization: Bearer $BULKHEAD_KEY_ALPHA" -H 'Content-Type: application/json' \
        --data @"$work/body.json" -o "$work/out.json"; } 2>&1 )
    counts=$(python3 -c '
import json, sys
v = json.load(open(sys.argv[1])); u = v["usage"]; lp = v["choices"][0]["logprobs"]
print(u["prompt_tokens"], u["completion_tokens"], len(lp["tokens"]) if lp else 0)' "$work/out.json")
    total=$(python3 -c "print($total + $t)")
  done
  echo "$mode: $REQUESTS requests, mean $(python3 -c "print(round($total / $REQUESTS, 2))") s (prompt tokens, completion tokens, logprobs entries of the last: $counts)"
done
