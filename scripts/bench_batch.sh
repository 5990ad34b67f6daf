#!/usr/bin/env bash
# What a batch of prompts saves (BENCHMARKS.md, "A batch of prompts"): one
# server on the demo policy (tenant alpha), PROMPTS prompts of ~160 tokens
# (each distinct, so none finds another's pages), as lm-evaluation-harness
# sends them: MODE `score` (a multiple-choice task: `echo`, `logprobs` 1,
# `max_tokens` 0) or `generate` (32 tokens each, greedy, `ignore_eos`). Sent
# three ways: one request at a time, CONCURRENCY requests at once, and one
# request holding them all (`"prompt": [...]`). The wall time of each way,
# twice.
#
#   cargo build --release -p bulkhead
#   scripts/bench_batch.sh [BINARY] [PROMPTS] [CONCURRENCY] [MODE]
set -euo pipefail
cd "$(dirname "$0")/.."
B=${1:-target/release/bulkhead}
PROMPTS=${2:-16}
CONCURRENCY=${3:-8}
MODE=${4:-score}
source scripts/bench_server.sh
bench_serve "$B"
bodies() { # NONCE: $work/one-<i>.json for each prompt, $work/batch.json for all
  python3 -c '
import json, sys
nonce, prompts, work, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
texts = ["Question %s-%d: " % (nonce, i) + " ".join(
    "Clue %d says the answer is about the weather in a town by the sea." % j for j in range(8))
    + " Answer: the sea" for i in range(prompts)]
common = {"model": "smollm2-135m-instruct", "echo": True, "logprobs": 1, "max_tokens": 0}
if mode == "generate":
    common = {"model": "smollm2-135m-instruct", "max_tokens": 32, "temperature": 0,
              "ignore_eos": True}
for i, text in enumerate(texts):
    json.dump(dict(common, prompt=text), open("%s/one-%d.json" % (work, i), "w"))
json.dump(dict(common, prompt=texts), open(work + "/batch.json", "w"))' "$1" "$PROMPTS" "$work" "$MODE"
}
post() { # BODY OUT
  curl -sf http://127.0.0.1:18080/v1/completions -H "Authorization: Bearer $BULKHEAD_KEY_ALPHA" \
      -H 'Content-Type: application/json' --data @"$1" -o "$2"
}
export -f post
export BULKHEAD_KEY_ALPHA
seconds() { python3 -c "import time; print(time.monotonic())"; }
for round in 1 2; do
  for way in sequential concurrent batch; do
    bodies "$way-$round-$RANDOM"
    start=$(seconds)
    case $way in
      sequential) for i in $(seq 0 $((PROMPTS - 1))); do post "$work/one-$i.json" "$work/out-$i.json"; done ;;
      concurrent) seq 0 $((PROMPTS - 1)) | xargs -P "$CONCURRENCY" -I{} \
                    bash -c 'post "$0/one-$1.json" "$0/out-$1.json"' "$work" {} ;;
      batch) post "$work/batch.json" "$work/out-batch.json" ;;
    esac
    took=$(python3 -c "print(round($(seconds) - $start, 2))")
    entries=$(python3 -c '
import glob, json, sys
way, work = sys.argv[1], sys.argv[2]
outs = [work + "/out-batch.json"] if way == "batch" else glob.glob(work + "/out-[0-9]*.json")
print(sum(json.load(open(o))["usage"]["completion_tokens"] for o in outs),
      sum(len(c["logprobs"]["tokens"]) if c["logprobs"] else 0
          for o in outs for c in json.load(open(o))["choices"]))' "$way" "$work")
    rm -f "$work"/out-*.json
    echo "round $round, $MODE, $way: $PROMPTS prompts in $took s (generated and scored tokens: $entries)"
  done
done
