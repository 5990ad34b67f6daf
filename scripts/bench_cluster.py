#!/usr/bin/env python3
"""Many servers on one control plane (BENCHMARKS.md, "Control plane on etcd").

Starts a real etcd (Debian's etcd-server) on loopback and Bulkhead servers on
the demo policy, then measures, in one run:

1. admin write latency (PATCH a tenant's weight, one at a time) on a server
   with the sled store against one on etcd: p50/p99;
2. change propagation: a write through server A, polled on B and C until they
   show it: p50/p99/max from the write's 2xx (and from its start) over N
   changes;
3. plugin propagation: a plugin uploaded through A (alternately size-cap and
   allow-list under one name), probed on B and C by a request only the
   version installed there refuses as it does (400 or 403): p50/max from the
   upload's 2xx over PLUGIN_UPLOADS uploads, each server compiling it itself
   (the first upload is reported apart: until it applies, a probe is served
   in full, a prefill of 300 tokens, so its figure is coarse);
4. inference throughput on A (chat completions, CLIENTS at once) with no
   changes against 10 changes a second made through B, alternated.

Needs the plugins (scripts/plugins.sh) for 3.

    scripts/bench_cluster.py BULKHEAD_BIN [CHANGES] [PHASE_SECONDS] [PHASES]

Standard library only. Every process it starts is stopped when it ends.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADMIN = "bench-cluster-admin-0123456789abcdef"
KEY_ALPHA = "bench-cluster-alpha-0123456789abcdef"
CLIENTS = 4
# At most the default plugins.uploads_per_minute: none waits for the limit.
PLUGIN_UPLOADS = 20
PLUGINS = os.path.join(ROOT, "plugins", "target", "wasm32-wasip2", "release")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(method, url, body=None, token=ADMIN, timeout=60):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("authorization", f"Bearer {token}")
    if data is not None:
        request.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def pct(values, p):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


class Processes:
    def __init__(self):
        self.children = []
        self.work = tempfile.mkdtemp(prefix="bench-cluster-")

    def start(self, args, env=None, log=None):
        out = open(os.path.join(self.work, log or f"p{len(self.children)}.log"), "w")
        child = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL)
        self.children.append(child)
        return child

    def stop(self):
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in self.children:
            try:
                child.wait(timeout=20)
            except subprocess.TimeoutExpired:
                child.kill()
        shutil.rmtree(self.work, ignore_errors=True)


def start_etcd(procs):
    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    procs.start([
        "etcd", "--name", "bench", "--data-dir", os.path.join(procs.work, "etcd"),
        "--listen-client-urls", url, "--advertise-client-urls", url,
        "--listen-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"bench=http://127.0.0.1:{peer}",
        "--max-txn-ops", "1024", "--log-level", "error",
    ], log="etcd.log")
    wait(f"{url}/health")
    return url


def wait(url, seconds=120):
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.05)
    raise SystemExit(f"not ready: {url}")


def policy(procs, name, store_toml):
    """The demo policy with this server's own ports and store."""
    with open(os.path.join(ROOT, "policies", "demo.toml")) as f:
        text = f.read()
    inference, admin = free_port(), free_port()
    text = text.replace('listen = "127.0.0.1:8080"', f'listen = "127.0.0.1:{inference}"')
    text = text.replace('admin_listen = "127.0.0.1:8081"', f'admin_listen = "127.0.0.1:{admin}"')
    text = text.replace("summary_interval_ms = 10000", "summary_interval_ms = 0")
    head, rest = text.split("[store]\n", 1)
    rest = rest.split("\n[", 1)[1]
    models = os.path.join(ROOT, ".cache", "models")
    text = head + "[store]\n" + store_toml + "\n[" + rest
    text = text.replace('"../.cache/models', f'"{models}')
    path = os.path.join(procs.work, f"{name}.toml")
    with open(path, "w") as f:
        f.write(text)
    return path, f"http://127.0.0.1:{inference}", f"http://127.0.0.1:{admin}"


def server(procs, bulkhead, name, store_toml):
    path, inference, admin = policy(procs, name, store_toml)
    env = dict(os.environ, BULKHEAD_ADMIN_TOKEN=ADMIN, BULKHEAD_KEY_ALPHA=KEY_ALPHA,
               BULKHEAD_SERVER_NAME=name, RUST_LOG="warn")
    for var in ("BULKHEAD_KEY_BETA", "BULKHEAD_KEY_GAMMA"):
        env.setdefault(var, f"bench-cluster-{var.lower()}-0123456789abcdef")
    procs.start([bulkhead, "serve", "--config", path, "--log-format", "json"], env=env,
                log=f"{name}.log")
    wait(f"{inference}/readyz")
    return inference, admin


def weight(admin, tenant="beta"):
    status, body = call("GET", f"{admin}/admin/v1/tenants/{tenant}")
    assert status == 200, body
    return json.loads(body)["quota"]["weight"]


def write_latency(admin, n, base):
    times = []
    for i in range(n):
        started = time.perf_counter()
        status, body = call("PATCH", f"{admin}/admin/v1/tenants/beta", {"weight": base + i % 50})
        times.append((time.perf_counter() - started) * 1000)
        assert status == 200, body
    return times


def propagation(writer, readers, n):
    after_ack, after_start = [], []
    for i in range(n):
        target = 1000 + i
        started = time.perf_counter()
        status, body = call("PATCH", f"{writer}/admin/v1/tenants/alpha", {"weight": 1 + target % 999})
        acked = time.perf_counter()
        assert status == 200, body
        pending = set(readers)
        while pending:
            for reader in list(pending):
                if weight(reader, "alpha") == 1 + target % 999:
                    pending.discard(reader)
                    now = time.perf_counter()
                    after_ack.append((now - acked) * 1000)
                    after_start.append((now - started) * 1000)
            if time.perf_counter() - started > 10:
                raise SystemExit(f"change {i} did not propagate in 10 s")
    return after_ack, after_start


def refusal(inference):
    """The status a long prompt without x-team gets: 400 from size-cap, 403
    from allow-list."""
    body = {"model": "smollm2-135m-instruct", "prompt": "word " * 300, "max_tokens": 1}
    status, _ = call("POST", f"{inference}/v1/completions", body, token=KEY_ALPHA)
    return status


def plugin_propagation(writer, readers):
    codes = {}
    for name, status in (("size_cap", 400), ("allow_list", 403)):
        with open(os.path.join(PLUGINS, f"{name}.wasm"), "rb") as f:
            codes[status] = f.read()
    started = time.perf_counter()
    assert refusal(readers[0]) == 200
    print(f"a probe served in full (no plugin yet): {(time.perf_counter() - started) * 1000:.0f} ms")
    after_ack = []
    for i in range(PLUGIN_UPLOADS):
        expect = 400 if i % 2 == 0 else 403
        request = urllib.request.Request(f"{writer}/admin/v1/tenants/alpha/plugins/probe",
                                         data=codes[expect], method="PUT")
        request.add_header("authorization", f"Bearer {ADMIN}")
        request.add_header("content-type", "application/wasm")
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
        acked = time.perf_counter()
        pending = set(readers)
        while pending:
            for reader in list(pending):
                if refusal(reader) == expect:
                    pending.discard(reader)
                    after_ack.append((time.perf_counter() - acked) * 1000)
            if time.perf_counter() - acked > 10:
                raise SystemExit(f"upload {i} did not apply in 10 s")
    status, body = call("DELETE", f"{writer}/admin/v1/tenants/alpha/plugins/probe")
    assert status == 204, body
    return after_ack


def throughput(inference, seconds, changer=None):
    done = [0]
    tokens = [0]
    stop = time.time() + seconds
    lock = threading.Lock()
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Count to twenty."}],
            "max_tokens": 24, "temperature": 0}

    def client():
        while time.time() < stop:
            status, reply = call("POST", f"{inference}/v1/chat/completions", body, token=KEY_ALPHA)
            if status == 200:
                with lock:
                    done[0] += 1
                    tokens[0] += json.loads(reply)["usage"]["completion_tokens"]

    changes = [0]

    def change():
        i = 0
        while time.time() < stop:
            tick = time.time()
            status, _ = call("PATCH", f"{changer}/admin/v1/tenants/beta", {"weight": 1 + i % 9})
            if status == 200:
                changes[0] += 1
            i += 1
            time.sleep(max(0.0, 0.1 - (time.time() - tick)))

    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    if changer:
        threads.append(threading.Thread(target=change))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done[0] / seconds, tokens[0] / seconds, changes[0] / seconds


def main():
    bulkhead = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    phase = float(sys.argv[3]) if len(sys.argv) > 3 else 20
    phases = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    procs = Processes()
    try:
        etcd = start_etcd(procs)
        etcd_toml = (f'backend = "etcd"\npath = "{procs.work}/%s"\n[store.etcd]\n'
                     f'endpoints = ["{etcd}"]\nprefix = "bench/"\ntxn_ops_max = 1024\n')
        sled = server(procs, bulkhead, "sled", f'path = "{procs.work}/sled-store"\n')
        a = server(procs, bulkhead, "a", etcd_toml % "a")
        b = server(procs, bulkhead, "b", etcd_toml % "b")
        c = server(procs, bulkhead, "c", etcd_toml % "c")
        print(f"# {time.strftime('%Y-%m-%d %H:%M:%S')}  {n} changes, phases of {phase:.0f} s")
        for label, admin in (("sled", sled[1]), ("etcd", a[1])):
            write_latency(admin, 20, 10)  # warm
        rows = []
        for rnd in range(2):  # alternated: sled, etcd, sled, etcd
            for label, admin in (("sled", sled[1]), ("etcd", a[1])):
                rows.append((label, write_latency(admin, n // 2, 10)))
        for label in ("sled", "etcd"):
            t = [x for l, ts in rows if l == label for x in ts]
            print(f"admin write ({label}): n={len(t)} p50 {pct(t, 50):.2f} ms  p99 {pct(t, 99):.2f} ms")
        ack, start = propagation(a[1], [b[1], c[1]], n)
        print(f"propagation A -> B, C over {n} changes ({len(ack)} observations):"
              f" from 2xx p50 {pct(ack, 50):.1f} ms p99 {pct(ack, 99):.1f} ms max {max(ack):.1f} ms;"
              f" from the write's start p50 {pct(start, 50):.1f} ms p99 {pct(start, 99):.1f} ms"
              f" max {max(start):.1f} ms")
        if os.path.exists(os.path.join(PLUGINS, "size_cap.wasm")):
            up = plugin_propagation(a[1], [b[0], c[0]])
            first, up = up[:2], up[2:]
            print(f"plugin first upload A -> B, C: {first[0]:.0f} ms, {first[1]:.0f} ms")
            print(f"plugin upload A -> B, C over {PLUGIN_UPLOADS - 1} more uploads ({len(up)} observations):"
                  f" from 2xx p50 {pct(up, 50):.1f} ms p90 {pct(up, 90):.1f} ms max {max(up):.1f} ms;"
                  f" in order: {' '.join(f'{x:.0f}' for x in up)}")
        else:
            print("plugin propagation: skipped (run scripts/plugins.sh)")
        throughput(a[0], 5)  # warm
        for i in range(phases):
            changing = i % 2 == 1
            rps, tps, cps = throughput(a[0], phase, b[1] if changing else None)
            label = f"{cps:.1f} changes/s" if changing else "no changes"
            print(f"inference on A, {CLIENTS} clients, {label}: {rps:.2f} req/s, {tps:.1f} tok/s")
    finally:
        procs.stop()


if __name__ == "__main__":
    main()
