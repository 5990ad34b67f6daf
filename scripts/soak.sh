#!/usr/bin/env bash
# A soak of the release server: mixed traffic from four tenants (streams,
# cancels, oversized prompts, plugin faults, admin changes, a model added and
# removed) for MINUTES (default 30), with RSS, open files, threads, the store's
# size and every pool's audit sampled each minute; writes docs/soak.csv and
# docs/soak.png and exits non-zero on growth without bound or a broken pool.
#
#   scripts/soak.sh [MINUTES]          # BULKHEAD_BIN=... to soak another build
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
minutes=${1:-30}
scripts/setup.sh >/dev/null
scripts/plugins.sh >/dev/null
bin=${BULKHEAD_BIN:-}
if [ -z "$bin" ]; then
    cargo build --release --locked -p bulkhead
    bin=target/release/bulkhead
fi
python3 -c 'import matplotlib' 2>/dev/null ||
    python3 -m pip install --quiet --disable-pip-version-check "$(grep '^matplotlib==' scripts/requirements.txt)"
exec python3 -u scripts/soak.py --bin "$bin" --minutes "$minutes" --out "${SOAK_OUT:-docs/soak}"
