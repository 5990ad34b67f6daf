# Sourced by the bench scripts: `bench_serve BINARY` starts BINARY on the
# demo policy (tenants alpha and beta, fresh keys, a fresh store in $work)
# on 127.0.0.1:18080 (inference) and :18081 (admin), waits until it listens,
# and stops it and removes $work when the script exits.
bench_serve() {
  export BULKHEAD_KEY_ALPHA=$(openssl rand -hex 24)
  export BULKHEAD_KEY_BETA=$(openssl rand -hex 24)
  export BULKHEAD_ADMIN_TOKEN=$(openssl rand -hex 24)
  work=$(mktemp -d)
  pid=
  trap 'bench_stop' EXIT
  "$1" serve --config policies/demo.toml --store "$work/state" --listen 127.0.0.1:18080 \
      --admin-listen 127.0.0.1:18081 >/dev/null 2>"$work/err" &
  pid=$!
  for _ in $(seq 1 150); do grep -q "listening: admin" "$work/err" && return; sleep 0.2; done
  echo "the server did not start:" >&2
  tail -5 "$work/err" >&2
  exit 1
}

bench_stop() {
  [ -n "$pid" ] && { kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; }
  rm -rf "$work"
}
