#!/usr/bin/env bash
# The GPU check (issue 25): the CUDA backend on a real NVIDIA GPU, against the
# CPU backend, in one table (kernels/examples/gpu_check.rs says what it checks
# and measures). Built on a development machine, run on the GPU machine, which
# needs its driver, CUDA 13's NVRTC and nothing else: no package registry, no
# model file (the check writes its own models), no Rust.
#
#   scripts/gpu-check.sh --build     # here: the x86-64 binary into .gpu/ (git-ignored)
#   scripts/gpu-check.sh [--quick]   # there: run it; --quick is a one-minute smoke test
#   scripts/gpu-check.sh --only speed   # a rerun of some parts (agreement, isolation,
#                                       # profile, speed; server: the server's part)
#
# The kernels' part stops beginning rows after GPU_CHECK_BUDGET seconds
# (default 420; `--budget N` overrides, 0 measures nothing): the rows left
# are listed as not measured, and the server's part (about a minute) still
# runs, so the whole check ends inside 10 minutes with a table.
#
# With the project's device tool: carry `.gpu`, run `scripts/gpu-check.sh`.
# Rows are printed as they are measured and saved to $OUT/gpu-check.txt when
# OUT is set, so a run cut short still brings back how far it got; a part
# that panics is a failed row and the rest still runs; the whole table comes last.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

if [ "${1:-}" = "--build" ]; then
    cargo build --locked --release -p bulkhead-kernels --example gpu_check --features fault-injection
    cargo build --locked --release -p bulkhead
    mkdir -p .gpu
    cp target/release/examples/gpu_check .gpu/gpu-check
    cp target/release/bulkhead .gpu/bulkhead
    strip --strip-debug .gpu/gpu-check .gpu/bulkhead 2>/dev/null || true
    ls -la .gpu/
    exit 0
fi

binary=.gpu/gpu-check
if [ ! -x "$binary" ]; then
    echo "gpu-check: $binary is missing: run scripts/gpu-check.sh --build first (on a machine with cargo)" >&2
    exit 2
fi

# The driver and NVRTC: the usual places, then wherever a CUDA 13 NVRTC is.
dirs=()
for dir in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu \
    /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib "$root/.cache/cuda/lib"; do
    [ -d "$dir" ] && dirs+=("$dir")
done
if ! ls "${dirs[@]/%//libnvrtc.so.13}" >/dev/null 2>&1; then
    found=$(find / -xdev -name 'libnvrtc.so.13' -not -path '*/proc/*' 2>/dev/null | head -n 1 || true)
    [ -n "$found" ] && dirs+=("$(dirname "$found")")
fi
LD_LIBRARY_PATH="$(IFS=:; echo "${dirs[*]}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
budget=()
[[ " $* " == *" --budget "* ]] || budget=(--budget "${GPU_CHECK_BUDGET:-420}")
status=0
if [ -n "${OUT:-}" ]; then
    "$binary" "${budget[@]}" "$@" 2>&1 | tee "$OUT/gpu-check.txt" || status=${PIPESTATUS[0]}
else
    "$binary" "${budget[@]}" "$@" || status=$?
fi

# The server on the GPU (scripts/gpu_server_check.py): with the full check or
# `--only server`, where `--build` put .gpu/bulkhead and python3 is there.
case " $* " in
    *" --only "*) [[ " $* " == *server* ]] || exit "$status" ;;
esac
if [ -x .gpu/bulkhead ] && command -v python3 >/dev/null; then
    server=0
    if [ -n "${OUT:-}" ]; then
        python3 scripts/gpu_server_check.py 2>&1 | tee "$OUT/gpu-server-check.txt" || server=${PIPESTATUS[0]}
    else
        python3 scripts/gpu_server_check.py || server=$?
    fi
    [ "$server" -eq 0 ] || status=1
else
    echo "gpu-check: the server's part skipped (no .gpu/bulkhead, or no python3)"
fi
exit "$status"
