#!/usr/bin/env bash
# Quick start: fetch the default model (once) and generate a chat reply with it.
#   scripts/demo.sh ["your message"]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

scripts/setup.sh
cargo build --release --locked -p bulkhead
exec target/release/bulkhead generate \
    --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf \
    --chat "${1:-Name three primary colors.}" --max-tokens 128
