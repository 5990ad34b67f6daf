#!/usr/bin/env bash
# Builds the policy plugins in plugins/ (example and test components) for
# wasm32-wasip2: plugins/target/wasm32-wasip2/release/*.wasm. Idempotent.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rustup target add wasm32-wasip2 >/dev/null
cd "$root/plugins"
cargo build --locked --target wasm32-wasip2 --release "$@"
