#!/usr/bin/env bash
# Quick start: fetch the default model (once), build, and serve the demo policy
# (tenants alpha and beta) on 127.0.0.1:8080 (inference) and :8081 (admin).
# Keys: BULKHEAD_KEY_ALPHA / BULKHEAD_KEY_BETA / BULKHEAD_ADMIN_TOKEN when set;
# otherwise the first start generates them and prints each once, to stdout
# (the log stream is stderr). State lives in .cache/state/demo.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

scripts/setup.sh
cargo build --release --locked -p bulkhead
bulkhead="${CARGO_TARGET_DIR:-target}/release/bulkhead"
# Models the project derives itself (the Q8_0 SmolLM2); idempotent.
scripts/models.sh "$bulkhead"
exec "$bulkhead" serve --config policies/demo.toml "$@"
