#!/usr/bin/env bash
# Idempotent: derives the models the project builds itself from the downloaded
# one (scripts/setup.sh) with the project's own binary, and verifies them. A
# second run converts nothing.
#
#   scripts/models.sh target/debug/bulkhead      # any built bulkhead binary
#
# The conversion is deterministic, so its output is pinned by sha256 like a
# download. A mismatch means the quantizer (or the source model) changed: if on
# purpose, pin the new digest here and in tests/tests/cli.rs, and regenerate the
# golden fixture (scripts/golden_logits.py, see its docstring).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
models="$root/.cache/models"
source_file="SmolLM2-135M-Instruct.Q4_1.gguf"
q8_file="SmolLM2-135M-Instruct.Q8_0.gguf"
q8_sha256="0c1d3326cd9793cfb7296113c063dd5c24e2bd734b48ec1a3d01b7158eca9387"

if [ $# -ne 1 ]; then
    echo "usage: scripts/models.sh PATH/TO/bulkhead" >&2
    exit 2
fi
bulkhead=$1
source="$models/$source_file"
q8="$models/$q8_file"

verify() {
    echo "$2  $1" | sha256sum --check --status
}

if [ -f "$q8" ] && verify "$q8" "$q8_sha256"; then
    echo "models: present and verified: $q8"
    exit 0
fi
if [ ! -f "$source" ]; then
    echo "models: $source is missing; run scripts/setup.sh first" >&2
    exit 1
fi
# Convert under a name the tests never read, verify, then install.
unverified="$q8.unverified"
"$bulkhead" quantize --to q8_0 "$source" "$unverified"
if ! verify "$unverified" "$q8_sha256"; then
    actual=$(sha256sum "$unverified" | cut -d' ' -f1)
    rm -f "$unverified"
    echo "models: $q8_file has sha256 $actual, expected $q8_sha256; refusing to install it" >&2
    exit 1
fi
mv "$unverified" "$q8"
echo "models: derived and verified: $q8"
