#!/usr/bin/env bash
# Prefill/decode disaggregation's overhead (BENCHMARKS.md, "Disaggregation"):
# time to first token and streamed throughput of `--role prefill` +
# `--role decode` (two processes on loopback TCP, one seeded demo policy)
# against `--role both`, alternated in one run, at prompts of ~512, ~2k and
# ~8k tokens and concurrency 1 and 8. Both processes share this machine's
# cores, so this measures the protocol's cost (copying the pages out,
# framing, hashing, the page book's checks), not disaggregation's gain.
#
#   scripts/bench_disagg.sh [ROUNDS] [REQUESTS]     (default 2 rounds, 8 requests a level)
#
# BULKHEAD_BIN=path runs that binary instead of building target/release/bulkhead.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${1:-2}
requests=${2:-8}
bulkhead=${BULKHEAD_BIN:-$root/target/release/bulkhead}
if [ -z "${BULKHEAD_BIN:-}" ]; then
    (cd "$root" && cargo build --release --locked -p bulkhead 2>/dev/null)
fi
"$root/scripts/models.sh" "$bulkhead" >/dev/null
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
export BULKHEAD_KEY_ALPHA=bench-disagg-alpha-0123456789abcdef
export BULKHEAD_KEY_BETA=bench-disagg-beta-0123456789abcdef
export BULKHEAD_ADMIN_TOKEN=bench-disagg-admin-0123456789abcdef
export BULKHEAD_TRANSFER_SECRET=bench-disagg-transfer-secret-0123456789
policy="$root/policies/demo.toml"

wait_ready() { # $1: URL that answers 200 when ready
    for _ in $(seq 1200); do
        curl -sf "$1" >/dev/null && return 0
        sleep 0.1
    done
    echo "not ready: $1" >&2
    return 1
}

# --role both on 18380, and prefill (transfer 18392) + decode on 18390.
"$bulkhead" serve --config "$policy" --store "$work/both" --log-format json \
    --listen 127.0.0.1:18380 --admin-listen 127.0.0.1:18381 2>"$work/both.log" &
"$bulkhead" serve --config "$policy" --store "$work/prefill" --log-format json --role prefill \
    --transfer-listen 127.0.0.1:18392 \
    --listen 127.0.0.1:18393 --admin-listen 127.0.0.1:18394 2>"$work/prefill.log" &
"$bulkhead" serve --config "$policy" --store "$work/decode" --log-format json --role decode \
    --prefill-peer 127.0.0.1:18392 \
    --listen 127.0.0.1:18390 --admin-listen 127.0.0.1:18391 2>"$work/decode.log" &
wait_ready http://127.0.0.1:18381/readyz
wait_ready http://127.0.0.1:18394/readyz
wait_ready http://127.0.0.1:18391/readyz

# ~12 tokens a sentence: ~512, ~2k and ~8k-token prompts (8k fits the demo's
# 8,192-token context with the 32 generated).
for round in $(seq "$rounds"); do
    for sentences in 41 168 670; do
        for setup in both split; do
            port=18380
            [ "$setup" = split ] && port=18390
            echo "== round $round, $setup, $sentences sentences"
            "$bulkhead" bench http --url "http://127.0.0.1:$port" --key "$BULKHEAD_KEY_ALPHA" \
                --concurrency 1,8 --requests "$requests" --max-tokens 32 \
                --prompt-sentences "$sentences" --distinct-prompts
        done
    done
done

# What the transfers cost, from the decode side's log: milliseconds and bytes
# per transfer (received and verified, handed to the engine).
python3 - "$work/decode.log" <<'EOF'
import json, sys, statistics
rows = []
for line in open(sys.argv[1]):
    try:
        event = json.loads(line)
    except ValueError:
        continue
    fields = event.get("fields", event)
    if fields.get("message") == "transfer received" and fields.get("result") == "ok":
        rows.append((int(fields["tokens"]), int(fields["bytes"]), int(fields["ms"])))
for lo, hi in [(0, 1024), (1024, 4096), (4096, 1 << 20)]:
    sel = [r for r in rows if lo <= r[0] < hi]
    if not sel:
        continue
    tokens = statistics.median(r[0] for r in sel)
    ms = statistics.median(r[2] for r in sel)
    per_token = statistics.median(r[1] / r[0] for r in sel)
    print(f"transfers of ~{tokens:.0f} tokens: {len(sel)}, median {ms:.0f} ms from job to verified, {per_token / 1024:.1f} KiB per prompt token")
EOF
