#!/usr/bin/env python3
"""A soak of the real server: mixed traffic from four tenants for MINUTES
while the server's RSS, open files, threads, store size and every model
pool's audit are sampled each minute, then drawn as a chart and checked for
growth without bound.

Traffic (each tenant its own client threads):
  alpha  streamed chats, some cancelled mid-stream (the client leaves)
  beta   plain completions and oversized prompts (refused by size)
  gamma  requests through its policy plugin (the probe), a tenth of them
         faulting (a trap: 503, counted toward disabling; re-enabled by the
         admin loop), and on-complete calls
  delta  self-service: keys issued and revoked, usage read; completions on
         the model the admin loop adds and removes (404 while it is gone)
  admin  a quota changed every 10 s; a model added and removed every 2 min

Usage: scripts/soak.py --bin target/release/bulkhead --minutes 30 --out docs/soak
(scripts/soak.sh builds and runs it). Prints the samples, writes
<out>.csv and <out>.png, and exits non-zero if a resource grows without bound
(the last third of the run above the middle third by more than its slack) or
a pool audit finds a broken invariant or a dirty free page.
"""

import argparse
import csv
import http.client
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
KEYS = {t: f"soak-key-{t}-0123456789abcdef" for t in ("alpha", "beta", "gamma", "delta")}
ADMIN = "soak-admin-token-0123456789abcdef0123"
MODEL = "smollm2"
EXTRA = "smollm2-extra"

POLICY = """
[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
body_bytes_max = 262144
request_timeout_ms = 120000
drain_timeout_ms = 5000

[store]
path = "state"
usage_flush_ms = 1000
# Small enough that the soak reaches it: the audit log then stays at its cap
# (the default, 1,000,000 records, is some hundreds of MiB).
audit_records_max = 5000

[plugins]
faults_max = 50
fault_window_ms = 60000

[[models]]
id = "{model}"
path = "{path}"
context_tokens = 2048
threads = {threads}
page_tokens = 16
pool_pages = 512
seq_pages_max = 128
step_tokens_max = 256
step_seqs_max = 8

[tenants.alpha]
pages_reserved = 128
pages_max = 256
key_env = "SOAK_KEY_ALPHA"

[tenants.beta]
pages_reserved = 128
pages_max = 256
key_env = "SOAK_KEY_BETA"

[tenants.gamma]
pages_reserved = 128
pages_max = 256
key_env = "SOAK_KEY_GAMMA"

[tenants.delta]
pages_reserved = 128
pages_max = 256
key_env = "SOAK_KEY_DELTA"
"""


class Server:
    def __init__(self, binary, model_path, workdir, threads):
        self.dir = workdir
        with open(os.path.join(workdir, "policy.toml"), "w") as f:
            f.write(POLICY.format(model=MODEL, path=model_path, threads=threads))
        env = dict(os.environ)
        env.update({f"SOAK_KEY_{t.upper()}": k for t, k in KEYS.items()})
        env["BULKHEAD_ADMIN_TOKEN"] = ADMIN
        env["RUST_LOG"] = "warn"
        self.log = open(os.path.join(workdir, "server.log"), "w")
        # The server names its listeners on stderr (`listening: <name> <url>`);
        # the rest of stderr and all of stdout go to the log.
        self.proc = subprocess.Popen(
            [binary, "serve", "--config", os.path.join(workdir, "policy.toml")],
            stdout=self.log, stderr=subprocess.PIPE, text=True, env=env, cwd=workdir)
        self.inference = self.admin = None
        while not (self.inference and self.admin):
            line = self.proc.stderr.readline()
            if not line:
                raise SystemExit("the server exited at start; see " + self.log.name)
            self.log.write(line)
            m = re.match(r"listening: (\w+) http://(\S+)", line.strip())
            if m:
                setattr(self, m.group(1), m.group(2))
        self.log.flush()

        def drain():
            for line in self.proc.stderr:
                self.log.write(line)
            self.log.flush()

        threading.Thread(target=drain, daemon=True).start()

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def call(addr, method, path, key=None, body=None, timeout=120):
    conn = http.client.HTTPConnection(addr, timeout=timeout)
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body)
    try:
        conn.request(method, path, body=data, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


class Counts:
    def __init__(self):
        self.lock = threading.Lock()
        self.by = {}

    def add(self, what):
        with self.lock:
            self.by[what] = self.by.get(what, 0) + 1


def alpha(server, stop, counts):
    rng = random.Random(1)
    while not stop.is_set():
        body = {"model": MODEL, "stream": True, "max_tokens": rng.choice([8, 32, 96]),
                "messages": [{"role": "user", "content": "Tell me about lighthouses."}]}
        conn = http.client.HTTPConnection(server.inference, timeout=120)
        try:
            conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                         headers={"authorization": f"Bearer {KEYS['alpha']}",
                                  "content-type": "application/json"})
            r = conn.getresponse()
            if rng.random() < 0.3:
                r.read(200)  # a few events, then the client leaves
                counts.add("alpha cancel")
            else:
                r.read()
                counts.add(f"alpha {r.status}")
        except OSError:
            counts.add("alpha error")
        finally:
            conn.close()


def beta(server, stop, counts):
    rng = random.Random(2)
    while not stop.is_set():
        if rng.random() < 0.3:
            prompt = "word " * 20000  # refused by its size
        else:
            prompt = "Once upon a time"
        status, _ = call(server.inference, "POST", "/v1/completions", KEYS["beta"],
                         {"model": MODEL, "prompt": prompt, "max_tokens": 16})
        counts.add(f"beta {status}")


def gamma(server, stop, counts):
    rng = random.Random(3)
    while not stop.is_set():
        headers = {"authorization": f"Bearer {KEYS['gamma']}", "content-type": "application/json"}
        if rng.random() < 0.1:
            headers["x-probe"] = "trap"
        conn = http.client.HTTPConnection(server.inference, timeout=120)
        try:
            conn.request("POST", "/v1/completions", headers=headers,
                         body=json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 8}))
            r = conn.getresponse()
            r.read()
            counts.add(f"gamma {r.status}")
        except OSError:
            counts.add("gamma error")
        finally:
            conn.close()


def delta(server, stop, counts):
    while not stop.is_set():
        status, body = call(server.inference, "POST", "/v1/tenant/keys", KEYS["delta"])
        counts.add(f"delta key {status}")
        if status == 201:
            key_id = json.loads(body)["key"]["id"]
            status, _ = call(server.inference, "DELETE", f"/v1/tenant/keys/{key_id}", KEYS["delta"])
            counts.add(f"delta revoke {status}")
        call(server.inference, "GET", "/v1/tenant/usage", KEYS["delta"])
        # The model the admin loop adds and removes: 200 while it serves, 404
        # while it is gone.
        status, _ = call(server.inference, "POST", "/v1/completions", KEYS["delta"],
                         {"model": EXTRA, "prompt": "Hello", "max_tokens": 4})
        counts.add(f"delta extra-model {status}")
        time.sleep(0.5)


def admin(server, stop, counts, model_path):
    tick = 0
    while not stop.wait(10):
        tick += 1
        status, _ = call(server.admin, "PATCH", "/admin/v1/tenants/delta", ADMIN,
                         {"weight": 1 + tick % 3})
        counts.add(f"admin quota {status}")
        # The probe faults on a tenth of gamma's requests: enabled again if tripped.
        call(server.admin, "POST", "/admin/v1/tenants/gamma/plugins/probe/enable", ADMIN)
        if tick % 12 == 3:
            status, body = call(server.admin, "POST", "/admin/v1/models", ADMIN, {
                "id": EXTRA, "path": model_path, "context_tokens": 1024, "threads": 1,
                "page_tokens": 16, "pool_pages": 640, "seq_pages_max": 64,
                "step_tokens_max": 256, "step_seqs_max": 4})
            counts.add(f"admin model add {status}")
            if status != 201:
                print(f"adding {EXTRA}: {status} {body[:400]!r}", file=sys.stderr, flush=True)
        if tick % 12 == 9:
            status, _ = call(server.admin, "DELETE", f"/admin/v1/models/{EXTRA}?drain_ms=2000", ADMIN)
            counts.add(f"admin model remove {status}")


def sample(server):
    pid = server.proc.pid
    with open(f"/proc/{pid}/status") as f:
        status = f.read()
    rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) * 1024
    threads = int(re.search(r"Threads:\s+(\d+)", status).group(1))
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    store = 0
    for base, _, files in os.walk(os.path.join(server.dir, "state")):
        for name in files:
            try:
                store += os.path.getsize(os.path.join(base, name))
            except OSError:
                pass
    broken = 0
    _, body = call(server.admin, "GET", "/admin/v1/models", ADMIN)
    for model in json.loads(body)["data"]:
        status, audit = call(server.admin, "GET", f"/admin/v1/models/{model['spec']['id']}/pool", ADMIN)
        if status == 200:
            audit = json.loads(audit)
            if audit.get("invariants") != "ok" or audit.get("free_pages_dirty"):
                broken += 1
    return {"rss_mib": rss / 2**20, "threads": threads, "fds": fds,
            "store_mib": store / 2**20, "pools_broken": broken}


def chart(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    minutes = [r["minute"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(10, 6), sharex=True)
    for ax, (key, label) in zip(axes.flat, [("rss_mib", "RSS (MiB)"), ("threads", "threads"),
                                             ("fds", "open files"), ("store_mib", "store (MiB)")]):
        ax.plot(minutes, [r[key] for r in rows], marker="o", markersize=3)
        ax.set_title(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("minute")
    fig.suptitle(f"scripts/soak.sh: {len(rows) - 1} minutes of mixed traffic, four tenants")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def unbounded(rows):
    """Resources whose last third is above the middle third by more than slack."""
    n = len(rows)
    if n < 6:
        return []
    mid = rows[n // 3: 2 * n // 3]
    last = rows[2 * n // 3:]
    slack = {"rss_mib": 0.15, "threads": 0.25, "fds": 0.25, "store_mib": 0.5}
    grew = []
    for key, frac in slack.items():
        a = max(r[key] for r in mid)
        b = max(r[key] for r in last)
        if b > a * (1 + frac) + (2 if key != "rss_mib" else 8):
            grew.append(f"{key}: {a:.1f} -> {b:.1f}")
    return grew


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", default=os.path.join(ROOT, ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--probe", default=os.path.join(ROOT, "plugins/target/wasm32-wasip2/release/probe.wasm"))
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs/soak"))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    workdir = tempfile.mkdtemp(prefix="bulkhead-soak-")
    server = Server(os.path.abspath(args.bin), args.model, workdir, args.threads)
    with open(args.probe, "rb") as f:
        status, body = call(server.admin, "PUT", "/admin/v1/tenants/gamma/plugins/probe", ADMIN, f.read())
    if status != 200:
        raise SystemExit(f"uploading the probe: {status} {body[:200]}")
    stop, counts = threading.Event(), Counts()
    workers = [threading.Thread(target=f, args=(server, stop, counts), daemon=True)
               for f in (alpha, alpha, beta, gamma, gamma, delta)]
    workers.append(threading.Thread(target=admin, args=(server, stop, counts, args.model), daemon=True))
    for w in workers:
        w.start()
    rows, started = [], time.time()
    try:
        while True:
            row = {"minute": round((time.time() - started) / 60, 2), **sample(server)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if row["minute"] >= args.minutes:
                break
            time.sleep(max(0, 60 - (time.time() - started) % 60))
    finally:
        stop.set()
        time.sleep(2)
        server.stop()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    chart(rows, args.out + ".png")
    print("requests:", json.dumps(dict(sorted(counts.by.items()))))
    grew = unbounded(rows)
    broken = sum(r["pools_broken"] for r in rows)
    print(f"wrote {args.out}.csv and {args.out}.png; grew: {grew or 'nothing'}; pool audits broken: {broken}")
    shutil.rmtree(workdir, ignore_errors=True)
    if grew or broken:
        sys.exit(1)


if __name__ == "__main__":
    main()
