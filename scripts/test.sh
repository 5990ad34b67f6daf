#!/usr/bin/env bash
# The whole test suite, as CI runs it: set-up (idempotent), formatting, lints,
# then every test in the workspace. Extra arguments go to `cargo test`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

scripts/setup.sh
# NVRTC from setup.sh: every CUDA kernel compiles for sm_90 in the tests, and
# a missing NVRTC fails them rather than skip.
export LD_LIBRARY_PATH="$root/.cache/cuda/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export BULKHEAD_REQUIRE_NVRTC=1
# The official OpenAI Python client (tests/tests/openai_client.rs),
# jsonschema (the admin API's OpenAPI check, tests/tests/admin.rs) and
# Playwright (the console in Chromium, tests/tests/console.rs, which fails
# rather than skip when the browser is missing).
python3 -m pip install --quiet --disable-pip-version-check \
    "$(grep '^openai==' scripts/requirements.txt)" "$(grep '^jsonschema==' scripts/requirements.txt)" \
    "$(grep '^playwright==' scripts/requirements.txt)"
export BULKHEAD_REQUIRE_BROWSER=1
# curl: tests/tests/readme.rs runs the README's examples as written.
if ! command -v curl >/dev/null; then
    sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q curl >/dev/null
fi
# The policy plugins the end-to-end tests upload (tests/tests/plugins.rs).
scripts/plugins.sh
cargo fmt --all -- --check
(cd plugins && cargo fmt --all -- --check)
cargo clippy --workspace --all-targets --locked -- -D warnings
# Every doc link resolves, private items' too (rustdoc alone: the
# dependencies' metadata is clippy's, so this costs seconds).
RUSTDOCFLAGS="--document-private-items -D warnings" cargo doc --workspace --no-deps --locked --quiet
# End-to-end tests run the real binary (target/debug/bulkhead). Build it, and
# every test, with `cargo test --no-run`: the workspace's dev-dependencies
# change the features of shared dependencies, so a separate `cargo build -p
# bulkhead` compiled the whole dependency tree a second time (10 of CI's 42
# minutes, stop 51). The binary built for the host's own integration tests has
# the features the test run unifies, fault-injection among them (the
# simulation's hooks, unreachable from any input, and the admin-token-only
# route that panics an engine, which the end-to-end tests use). Release builds
# never have them.
cargo test --workspace --locked --no-run
# The Q8_0 model (model_golden.rs), derived by that binary; idempotent.
scripts/models.sh "${CARGO_TARGET_DIR:-target}/debug/bulkhead"
# The Kubernetes manifests (deploy/) against the Kubernetes and CRD schemas,
# each role's policy through `bulkhead check`, and the validator's self-test.
BULKHEAD_BIN="${CARGO_TARGET_DIR:-target}/debug/bulkhead" scripts/validate_deploy.sh
# Model-dependent tests fail (rather than skip) if the model is missing.
BULKHEAD_REQUIRE_MODEL=1 cargo test --workspace --locked "$@"
