#!/usr/bin/env bash
# Prefill/decode disaggregation's overhead (BENCHMARKS.md, "Disaggregation"):
# time to first token and streamed throughput of `--role prefill` +
# `--role decode` (two processes on loopback TCP, one seeded demo policy)
# against `--role both`, alternated in one run, at prompts of ~512, ~2k and
# ~8k tokens and concurrency 1 and 8. Both processes share this machine's
# cores, so this measures the protocol's cost (copying the pages out,
# framing, hashing, the page book's checks), not disaggregation's gain.
#
#   scripts/bench_disagg.sh [ROUNDS] [REQUESTS]     (default 1 round; 3 requests one at
#                                                    a time, then 8 at once, a level)
#
# An 8k-token prompt takes 30-90 s to prefill on 2 cores: one round is ~30 min.
# BENCH_SETUPS="split" BENCH_CONCURRENCY="1" measures only the transfers
# (their table below; ~6 min).
#
# BULKHEAD_BIN=path runs that binary instead of building target/release/bulkhead.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${1:-1}
requests=${2:-3}
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
# 8,192-token context with the 32 generated). Every prompt in the run is
# distinct (numbered from `first`): no prefix cache helps either setup.
first=0
for round in $(seq "$rounds"); do
    for sentences in 41 168 610; do
        for setup in ${BENCH_SETUPS:-both split}; do
            port=18380
            [ "$setup" = split ] && port=18390
            echo "== round $round, $setup, $sentences sentences"
            for concurrency in ${BENCH_CONCURRENCY:-1 8}; do
                n=$requests
                [ "$concurrency" = 8 ] && n=8
                "$bulkhead" bench http --url "http://127.0.0.1:$port" --key "$BULKHEAD_KEY_ALPHA" \
                    --concurrency "$concurrency" --requests "$n" --max-tokens 32 \
                    --prompt-sentences "$sentences" --distinct-prompts --first-request "$first"
                first=$((first + n))
            done
        done
    done
done

# What the transfers cost, from both sides' logs, per prompt size: bytes;
# the sender's time from header to trailer, its helper thread's hashing of
# every page, and how long the socket writes waited for that hashing
# (`transfer sent`); the pages on the wire at the receiver, header to
# trailer, and its hashing of each page as it arrived (`transfer
# received`); and the page book's import there — the copy into the
# reserved pages and the comparison of every page as stored with the bytes
# that hashed to its digest, on the engine thread (`transfer verified`).
python3 - "$work/decode.log" "$work/prefill.log" <<'EOF'
import json, sys, statistics
def events(path, message):
    for line in open(path):
        try:
            event = json.loads(line)
        except ValueError:
            continue
        fields = event.get("fields", event)
        if fields.get("message") == message:
            yield fields
received = [f for f in events(sys.argv[1], "transfer received") if f.get("result") == "ok"]
verified = {int(f["request_id"]): int(f["verify_us"]) / 1000 for f in events(sys.argv[1], "transfer verified")}
sent = [f for f in events(sys.argv[2], "transfer sent") if f.get("ok") in (True, "true")]
for lo, hi in [(0, 1024), (1024, 4096), (4096, 1 << 20)]:
    r = [f for f in received if lo <= int(f["tokens"]) < hi]
    s = [f for f in sent if lo <= int(f["tokens"]) < hi]
    if not r or not s:
        continue
    med = lambda rows, key, scale=1: statistics.median(int(f[key]) / scale for f in rows)
    imports = [verified[int(f["request_id"])] for f in r if int(f["request_id"]) in verified]
    send_ms, hash_ms = med(s, "send_us", 1000), med(s, "hash_us", 1000)
    wait_ms = med(s, "hash_wait_us", 1000)
    wire_ms, import_ms = med(r, "wire_us", 1000), statistics.median(imports)
    arrive_ms = med(r, "hash_us", 1000)
    print(f"~{med(r, 'tokens'):.0f} tokens, {med(r, 'bytes', 2**20):.1f} MiB "
          f"({med(r, 'bytes') / med(r, 'tokens') / 1024:.1f} KiB a prompt token), {len(r)} transfers, medians: "
          f"sender {send_ms:.1f} ms header to trailer, hashing {hash_ms:.1f} ms on its helper, "
          f"{wait_ms:.1f} ms waited for ({100 * wait_ms / send_ms:.1f} %); "
          f"receiver {wire_ms:.1f} ms on the wire, {arrive_ms:.1f} ms of it hashing on arrival "
          f"({100 * arrive_ms / wire_ms:.1f} %), import {import_ms:.1f} ms (copy and compare); "
          f"transfer header to decodable {wire_ms + import_ms:.1f} ms")
EOF
# XXH64's and a copy's speed here: the digest's part of the import above.
"$bulkhead" bench digest --rounds 3
