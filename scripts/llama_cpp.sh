#!/usr/bin/env bash
# Builds the llama.cpp this project compares itself with: the sources vendored
# in PyPI's llama-cpp-python 0.3.36 sdist (pinned by hash), CPU only, static,
# tuned for this CPU. Installs into .cache/llama.cpp/bin:
#
#   llama-quantize     llama.cpp's own quantizer (K-quant files whose block
#                      layouts are someone else's, not ours)
#   llama-bench        the benchmark BENCHMARKS.md compares against
#   llama-batched-bench  its batched decode (several sequences per step)
#   llama-reference    scripts/llama_reference.cpp: llama.cpp's token ids, top
#                      logits and greedy continuations for the conformance
#                      fixtures (scripts/llama_fixtures.py)
#
# About 10 minutes of two cores; not part of CI (the fixtures it produces are
# committed). Needs a C++ compiler and network access to PyPI;
# cmake comes from PyPI when the system has none. The sdist comes from
# PyPI's simple index (no pip metadata step: that wants CMake too).
#
#   scripts/llama_cpp.sh --vocab   only llama.cpp's tokenizer test vocabularies
#                                  (models/ggml-vocab-*.gguf with their .inp and
#                                  .out) into .cache/llama.cpp/vocab/, for
#                                  kernels/tests/tokenizer_llamacpp.rs; nothing
#                                  is built (scripts/setup.sh runs this)
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
CACHE=.cache/llama.cpp
SRC="$CACHE/src"
mkdir -p "$CACHE"

SDIST="$CACHE/llama_cpp_python-$VERSION.tar.gz"
VOCABS="llama-bpe qwen2 phi-3 llama-spm"
if [ "${1:-}" = "--vocab" ] && [ -f "$CACHE/vocab/ggml-vocab-llama-spm.gguf.out" ]; then
    exit 0
fi
if [ ! -f "$SDIST" ]; then
    # Straight from PyPI's simple index: `pip download` of an sdist prepares
    # its metadata, which needs scikit-build-core and, with its 1.1.2
    # (current in December 2026), CMake too, only to read a version we pin
    # anyway. The hash below is checked either way.
    python3 - "llama-cpp-python" "$(basename "$SDIST")" "$SDIST" <<'PY'
import re, sys, urllib.request
project, filename, dest = sys.argv[1:4]
index = urllib.request.urlopen(f"https://pypi.org/simple/{project}/", timeout=60).read().decode()
links = re.findall(r'href="([^"#]*/' + re.escape(filename) + r')[#"]', index)
if not links:
    sys.exit(f"llama_cpp.sh: {filename} is not in PyPI's index for {project}")
with urllib.request.urlopen(links[0], timeout=600) as response, open(dest + ".partial", "wb") as out:
    while chunk := response.read(1 << 20):
        out.write(chunk)
PY
    mv "$SDIST.partial" "$SDIST"
fi
if ! echo "$SHA256  $SDIST" | sha256sum --check --quiet; then
    rm -f "$SDIST"
    echo "llama_cpp.sh: sha256 mismatch for $SDIST; removed it" >&2
    exit 1
fi
if [ "${1:-}" = "--vocab" ]; then
    members=()
    for name in $VOCABS; do
        for suffix in "" .inp .out; do
            members+=("llama_cpp_python-$VERSION/vendor/llama.cpp/models/ggml-vocab-$name.gguf$suffix")
        done
    done
    tmp=$(mktemp -d)
    tar -xzf "$SDIST" -C "$tmp" "${members[@]}"
    mkdir -p "$CACHE/vocab"
    mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp/models/"* "$CACHE/vocab/"
    rm -rf "$tmp" "$SDIST"
    echo "llama.cpp's tokenizer vocabularies in $CACHE/vocab"
    exit 0
fi
if [ ! -d "$SRC" ]; then
    tar -xzf "$SDIST" -C "$CACHE"
    mv "$CACHE/llama_cpp_python-$VERSION/vendor/llama.cpp" "$SRC"
    rm -rf "$CACHE/llama_cpp_python-$VERSION"
fi

if ! command -v cmake >/dev/null; then
    python3 -m pip install --quiet cmake
fi
cmake -S "$SRC" -B "$CACHE/build" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    >/dev/null
cmake --build "$CACHE/build" -j "$(nproc)" --target llama-quantize llama-bench llama-batched-bench llama
mkdir -p "$CACHE/bin"
cp "$CACHE/build/bin/llama-quantize" "$CACHE/build/bin/llama-bench" \
    "$CACHE/build/bin/llama-batched-bench" "$CACHE/bin/"

# The reference tool, linked against the static libraries just built.
mapfile -t LIBS < <(find "$CACHE/build" -name 'lib*.a' | sort)
g++ -O2 -std=c++17 -fopenmp -I "$SRC/include" -I "$SRC/ggml/include" \
    scripts/llama_reference.cpp -Wl,--start-group "${LIBS[@]}" -Wl,--end-group \
    -lpthread -ldl -o "$CACHE/bin/llama-reference"
echo "llama.cpp $VERSION built into $CACHE/bin"
