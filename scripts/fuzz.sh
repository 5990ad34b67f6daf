#!/usr/bin/env bash
# Fuzzes every parser of outside bytes (fuzz/: cargo-fuzz with libFuzzer) for
# SECONDS each (default 60), one target after another, niced and on one core,
# so a machine shared with a build stays usable:
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]     # every target when none is named
#
# New inputs that reach new code are kept in fuzz/corpus/<target>/; an input
# that panics, runs out of memory or time is written to fuzz/artifacts/<target>/
# and the script stops with the command that reproduces it. Minimize a corpus
# before committing it (fuzz/README.md): cargo fuzz cmin <target>.
#
# Stable Rust (1.95): cargo-fuzz builds with AddressSanitizer by default, which
# needs `-Zsanitizer=address`, a nightly-only flag. RUSTC_BOOTSTRAP=1 makes the
# stable compiler accept it, and the stable toolchain ships the sanitizer
# runtimes (librustc-stable_rt.asan.a), so nothing nightly is needed; it is set
# here for this build only. The sanitizer is what makes libFuzzer's
# -malloc_limit_mb work (its malloc hooks come from the sanitizer runtime), so
# a single huge allocation is caught at once rather than only once RSS grows.
# FUZZ_SANITIZER=none builds without any sanitizer (`cargo fuzz build -s none`,
# no RUSTC_BOOTSTRAP needed, about twice the executions per second, but only
# -rss_limit_mb guards memory). Both builds instrument coverage with stable
# -C flags (-Cpasses=sancov-module, -Cllvm-args=-sanitizer-coverage-*).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
seconds=${1:-60}
shift || true
sanitizer=${FUZZ_SANITIZER:-address}

if ! command -v cargo-fuzz >/dev/null; then
    cargo install cargo-fuzz --locked
fi
if [ "$sanitizer" != none ]; then
    export RUSTC_BOOTSTRAP=1
fi

cd "$root/fuzz"
if [ $# -gt 0 ]; then
    targets=("$@")
else
    mapfile -t targets < <(cargo fuzz list)
fi

# One build for every target (a second `cargo fuzz build` with other flags
# would rebuild the whole dependency tree); the runs then start the built
# binaries themselves, so a source edited during a long run is not rebuilt
# into the targets still to come.
nice -n 10 cargo fuzz build --sanitizer "$sanitizer"
bin=target/x86_64-unknown-linux-gnu/release

mkdir -p logs
for target in "${targets[@]}"; do
    corpora=("corpus/$target")
    if [ -d "regressions/$target" ]; then
        # Read, never written: libFuzzer adds new inputs to the first folder only.
        corpora+=("regressions/$target")
    fi
    mkdir -p "corpus/$target" "artifacts/$target"
    echo "fuzz: $target for ${seconds}s"
    # -jobs=1 -workers=1: one process on one core; libFuzzer then writes the
    # run's output to fuzz-0.log, kept as logs/<target>.log.
    # An input taking longer than this is a finding (`timeout-…`). Compiling
    # a real plugin under the sanitizer takes seconds, three times per input
    # (compile, reload from the sealed form, recompile a tampered one), so
    # `upload` gets longer; the server bounds a compile itself
    # (`plugins.compile_timeout_ms`).
    timeout=10
    if [ "$target" = upload ]; then
        timeout=60
    fi
    status=0
    nice -n 10 "$bin/$target" -artifact_prefix="artifacts/$target/" \
        -max_total_time="$seconds" -jobs=1 -workers=1 \
        -timeout="$timeout" -rss_limit_mb=2048 -malloc_limit_mb=512 \
        -print_final_stats=1 "${corpora[@]}" >/dev/null 2>&1 || status=$?
    mv -f fuzz-0.log "logs/$target.log" 2>/dev/null || true
    # The last status line: executions, coverage (cov), features (ft), corpus.
    grep -E '^#[0-9]+' "logs/$target.log" | tail -1 || true
    grep -E '^(stat::number_of_executed_units|stat::average_exec_per_sec)' "logs/$target.log" || true
    if [ "$status" -ne 0 ] || grep -qE '^(==[0-9]+==ERROR|SUMMARY|.*panicked at)' "logs/$target.log"; then
        echo "fuzz: $target found a failure (fuzz/logs/$target.log, fuzz/artifacts/$target/)" >&2
        echo "reproduce: cd fuzz && cargo fuzz run --sanitizer $sanitizer $target artifacts/$target/<input>" >&2
        exit 1
    fi
done
