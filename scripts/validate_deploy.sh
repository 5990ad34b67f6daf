#!/usr/bin/env bash
# Validates the Kubernetes manifests under deploy/: every core object against
# the Kubernetes schemas of one version (1.33, kubernetes-validate, strict),
# every custom resource against the CRDs vendored in deploy/crds/, the
# endpoint picker's config against the llm-d router's plugin types, and the
# deployment's own consistency (scripts/validate_deploy.py says what exactly).
# Then --selftest: broken copies of deploy/ must each be refused, for the
# reason expected, or this fails too.
#
# Idempotent: the first run makes a virtual environment with the pinned
# packages of scripts/requirements-deploy.txt (.cache/deploy-venv, or
# $BULKHEAD_DEPLOY_VENV); later runs reuse it while the pins are unchanged.
# Needs python3 (3.11+, for tomllib) with venv, and PyPI for the first run.
#
#   scripts/validate_deploy.sh                 # validate, then the self-test
#   scripts/validate_deploy.sh --no-selftest   # validate only
#   BULKHEAD_BIN=target/debug/bulkhead scripts/validate_deploy.sh
#       # also `bulkhead check` each role's policy (model files from .cache/models)
# Other arguments go to scripts/validate_deploy.py (e.g. --kubernetes-version 1.34).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

venv=${BULKHEAD_DEPLOY_VENV:-$root/.cache/deploy-venv}
requirements=scripts/requirements-deploy.txt
stamp=$venv/.bulkhead-requirements
if [ ! -x "$venv/bin/python" ] || ! cmp -s "$requirements" "$stamp"; then
    echo "validate_deploy: installing $requirements into $venv" >&2
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        --no-input -r "$requirements"
    cp "$requirements" "$stamp"
fi

selftest=1
args=()
for arg in "$@"; do
    case "$arg" in
        --no-selftest) selftest=0 ;;
        *) args+=("$arg") ;;
    esac
done
if [ -n "${BULKHEAD_BIN:-}" ]; then
    args+=(--bulkhead "$BULKHEAD_BIN")
fi

"$venv/bin/python" scripts/validate_deploy.py "${args[@]+"${args[@]}"}"
if [ "$selftest" = 1 ]; then
    "$venv/bin/python" scripts/validate_deploy.py --selftest
fi
