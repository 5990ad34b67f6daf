#!/usr/bin/env python3
"""The server's part of the GPU check (issue 25): `bulkhead serve` on a GPU.

scripts/gpu-check.sh runs it after the kernels' check when `.gpu/bulkhead`
is there (`scripts/gpu-check.sh --build` puts it there). It serves the
SmolLM2-shaped random-weight model that `.gpu/gpu-check --write-model`
writes, once per backend named (default: auto, then cpu), each from a fresh
store on loopback ports, and checks, as rows of the check's table:

- the server starts, and with `auto` on a machine with a GPU says in its log
  that it chose cuda and in the admin listener's /readyz which GPU, with
  graphs, tensor cores and dependent launches on (their start-up probes
  agreed); `eager` is `--backend cuda` with all three turned off by the
  command line (`--enforce-eager --no-tensor-cores --no-dependent-launches`),
  which /readyz says;
- a greedy completion and a streamed chat completion come back whole
  (status 200, the tokens asked for, a finish reason), with their time, a
  greedy completion under penalties, biases and min_tokens (adjusted on the
  device on a GPU) too, one with log probabilities (computed on the device
  on a GPU), a seeded sampled completion twice the same (drawn on the
  device on a GPU), and the prompt scored (`echo`, `max_tokens` 0; each
  position's row scored on the device on a GPU);
- the greedy completions' texts, plain and adjusted, and the prompt's log
  probabilities on the GPU against the CPU's (the same random model; a
  difference is shown, not failed: a near tie may part them, and the
  kernels' agreement rows are the numeric check).

Each backend after the first has its texts compared with the first's.
Without a GPU, `auto` serves on the CPU and its first row fails, saying so,
and `eager` does not start; `cpu` alone runs the flow anywhere
(`scripts/gpu_server_check.py cpu`).
Standard library only: the GPU machine has no package registry.
"""

import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The binaries `scripts/gpu-check.sh --build` puts in .gpu/ (a test points
# these at its own builds).
BULKHEAD = os.environ.get("BULKHEAD_BIN") or os.path.join(ROOT, ".gpu", "bulkhead")
GPU_CHECK = os.environ.get("GPU_CHECK_BIN") or os.path.join(ROOT, ".gpu", "gpu-check")
MODEL_ID = "smollm2-shape"
KEY = "gpu-server-check-alpha-key-0123456789abcdef"
ADMIN = "gpu-server-check-admin-token-0123456789abcdef"
PROMPT = "The quick brown fox jumps over the lazy dog. Then the dog"
TOKENS = 32

rows = []


def row(check, result, passed):
    mark = {True: "pass", False: "FAIL", None: ""}[passed]
    line = f"| {check} | {result} | {mark} |"
    rows.append(line)
    print(line, flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# `eager`: every CUDA switch of the server off by its flags (each kernel
# launched on its own once the one before it has ended, products a warp a
# row), as `[engine.cuda]` `graphs`, `tensor_cores` and `dependent_launches`
# false would.
EAGER_FLAGS = [
    "--backend",
    "cuda",
    "--enforce-eager",
    "--no-tensor-cores",
    "--no-dependent-launches",
]


def policy(folder, backend_dir, listen, admin):
    return f"""
[server]
listen = "127.0.0.1:{listen}"
admin_listen = "127.0.0.1:{admin}"

[store]
path = "{backend_dir}/state"

[[models]]
id = "{MODEL_ID}"
path = "{folder}/model.gguf"
context_tokens = 4096
threads = 4
page_tokens = 16
pool_pages = 512
seq_pages_max = 256
step_tokens_max = 256
step_seqs_max = 8

[tenants.alpha]
pages_reserved = 256
pages_max = 512
key_env = "BULKHEAD_KEY_ALPHA"
"""


def call(port, path, body=None, key=None, timeout=120):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data)
    if data is not None:
        request.add_header("content-type", "application/json")
    if key:
        request.add_header("authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Server:
    def __init__(self, folder, backend):
        self.dir = os.path.join(folder, backend)
        os.makedirs(self.dir)
        self.port, self.admin = free_port(), free_port()
        config = os.path.join(self.dir, "policy.toml")
        with open(config, "w") as f:
            f.write(policy(folder, self.dir, self.port, self.admin))
        env = dict(os.environ, BULKHEAD_KEY_ALPHA=KEY, BULKHEAD_ADMIN_TOKEN=ADMIN)
        self.log = open(os.path.join(self.dir, "stderr.log"), "w+")
        self.process = subprocess.Popen(
            [BULKHEAD, "serve", "--config", config]
            + (EAGER_FLAGS if backend == "eager" else ["--backend", backend]),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
        )

    def stderr(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def ready(self, within=120):
        deadline = time.time() + within
        while time.time() < deadline:
            if self.process.poll() is not None:
                return None
            try:
                status, body = call(self.admin, "/readyz", timeout=5)
                if status == 200:
                    return json.loads(body)
            except OSError:
                pass
            time.sleep(0.5)
        return None

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def last_line(text):
    lines = [l for l in text.strip().splitlines() if l.strip()]
    return lines[-1][-300:].replace("|", "/") if lines else "(nothing logged)"


def serve(folder, backend):
    """Runs one server on `backend`; returns its greedy completions' texts
    (plain, adjusted), or None."""
    server = Server(folder, backend)
    try:
        started = time.time()
        ready = server.ready()
        log = server.stderr()
        starts = (
            "server --backend cuda, every CUDA switch off: starts"
            if backend == "eager"
            else f"server --backend {backend}: starts"
        )
        if ready is None:
            row(starts, f"did not become ready: {last_line(log)}", False)
            return None
        placed = ready.get("backends", {}).get(MODEL_ID, "?")
        if backend == "auto":
            chose = re.findall(r"backend auto chose [^\"]*", log)
            said = chose[0][:160] if chose else "no choice logged"
            row(
                "server --backend auto: chooses the GPU",
                f"/readyz backends: {placed!r}; log: {said}",
                placed.startswith("cuda")
                # "not used" on a device without tensor cores for these
                # products, "not supported" before compute capability 9.0.
                and re.search(
                    r": graphs on, tensor cores (on|not used), dependent launches (on|not supported)$",
                    placed,
                )
                is not None
                and said.startswith("backend auto chose cuda"),
            )
        elif backend == "eager":
            row(
                starts,
                f"ready in {time.time() - started:.1f} s; /readyz backends: {placed!r}",
                placed.startswith("cuda")
                and placed.endswith(": graphs off, tensor cores off, dependent launches off"),
            )
        else:
            row(
                starts,
                f"ready in {time.time() - started:.1f} s; /readyz backends: {placed!r}",
                placed.startswith(backend),
            )
        at = time.time()
        status, body = call(
            server.port,
            "/v1/completions",
            {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0},
            KEY,
        )
        took = time.time() - at
        text = None
        if status == 200:
            reply = json.loads(body)
            choice = reply["choices"][0]
            text = choice["text"]
            used = reply["usage"]["completion_tokens"]
            whole = used == TOKENS or choice["finish_reason"] == "stop"
            row(
                f"server ({placed}): greedy completion",
                f"{used} tokens in {took:.2f} s, finish {choice['finish_reason']!r}",
                whole and bool(choice["finish_reason"]),
            )
        else:
            row(f"server ({placed}): greedy completion", f"status {status}: {body[:200]}", False)
        # Greedy under every adjustment: on a GPU the pick kernel applies
        # them to the row where it lies. min_tokens holds the output to its
        # whole length.
        adjusted = {
            "model": MODEL_ID,
            "prompt": PROMPT,
            "max_tokens": TOKENS,
            "temperature": 0,
            "frequency_penalty": 0.8,
            "presence_penalty": 0.3,
            "repetition_penalty": 1.3,
            "logit_bias": {"5": 4.0, "17": -100},
            "min_tokens": TOKENS,
        }
        status, body = call(server.port, "/v1/completions", adjusted, KEY)
        adjusted_text = None
        if status == 200:
            reply = json.loads(body)
            adjusted_text = reply["choices"][0]["text"]
            used = reply["usage"]["completion_tokens"]
            row(
                f"server ({placed}): greedy completion under penalties, biases and min_tokens",
                f"{used} tokens, differs from the plain one: {adjusted_text != text}",
                used == TOKENS and adjusted_text != text,
            )
        else:
            row(
                f"server ({placed}): greedy completion under penalties, biases and min_tokens",
                f"status {status}: {body[:200]}",
                False,
            )
        # Greedy with log probabilities: on a GPU they come with each token,
        # computed where the row lies.
        status, body = call(
            server.port,
            "/v1/completions",
            {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "logprobs": 3},
            KEY,
        )
        scored = None
        if status == 200:
            reply = json.loads(body)
            choice = reply["choices"][0]
            lp = choice.get("logprobs") or {}
            tops = lp.get("top_logprobs") or []
            scored = lp.get("token_logprobs") or []
            whole = len(scored) == reply["usage"]["completion_tokens"] == TOKENS and all(len(t) == 3 for t in tops)
            row(
                f"server ({placed}): greedy completion with log probabilities",
                f"{len(scored)} tokens' log probabilities, {len(tops)} lists of alternatives; the text as without: {choice['text'] == text}",
                whole and len(tops) == TOKENS and choice["text"] == text,
            )
        else:
            row(f"server ({placed}): greedy completion with log probabilities", f"status {status}: {body[:200]}", False)
        # The prompt scored (echo, nothing generated): on a GPU each
        # position's row is scored for the prompt's next token where it lies,
        # and only its scores cross to the host.
        status, body = call(
            server.port,
            "/v1/completions",
            {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2},
            KEY,
        )
        prompt_scores = None
        if status == 200:
            reply = json.loads(body)
            lp = reply["choices"][0].get("logprobs") or {}
            scores = lp.get("token_logprobs") or []
            tops = lp.get("top_logprobs") or []
            prompt_tokens = reply["usage"]["prompt_tokens"]
            # The first token has no position before it to score it.
            rest, rest_tops = scores[1:], tops[1:]
            fine = (
                len(scores) == prompt_tokens > 1
                and scores[0] is None
                and all(isinstance(x, (int, float)) and math.isfinite(x) and x <= 0 for x in rest)
                # The two likeliest, and the prompt's token where it is not one.
                and all(2 <= len(t) <= 3 for t in rest_tops)
            )
            prompt_scores = rest
            row(
                f"server ({placed}): prompt scored (echo, max_tokens 0)",
                f"{len(rest)} of {prompt_tokens} prompt tokens scored, {len(rest_tops)} lists of alternatives",
                fine,
            )
        else:
            row(f"server ({placed}): prompt scored (echo, max_tokens 0)", f"status {status}: {body[:200]}", False)
        # A sampled completion, twice with one seed: on a GPU its tokens are
        # drawn on the device (temperature, top-p), and a seed repeats.
        sampled = {
            "model": MODEL_ID,
            "prompt": PROMPT,
            "max_tokens": TOKENS,
            "temperature": 0.9,
            "top_p": 0.95,
            "seed": 7,
        }
        replies = [call(server.port, "/v1/completions", sampled, KEY) for _ in range(2)]
        texts = [json.loads(b)["choices"][0]["text"] if st == 200 else None for st, b in replies]
        row(
            f"server ({placed}): a seeded sampled completion, twice",
            f"status {[st for st, _ in replies]}, {len(texts[0] or '')} characters, the same: {texts[0] == texts[1]}",
            all(st == 200 for st, _ in replies) and texts[0] == texts[1] and bool(texts[0]),
        )
        status, body = call(
            server.port,
            "/v1/chat/completions",
            {
                "model": MODEL_ID,
                "messages": [{"role": "user", "content": "Say something."}],
                "max_tokens": 16,
                "stream": True,
            },
            KEY,
        )
        events = [l for l in body.splitlines() if l.startswith("data: ")]
        done = bool(events) and events[-1] == "data: [DONE]"
        row(
            f"server ({placed}): streamed chat completion",
            f"status {status}, {len(events)} events, ends with [DONE]: {done}",
            status == 200 and done and len(events) >= 3,
        )
        if "panicked" in server.stderr():
            row(f"server ({placed}): log", "a panic was logged", False)
        if text is None or adjusted_text is None or prompt_scores is None:
            return None
        return (text, adjusted_text, prompt_scores)
    finally:
        server.stop()


def main():
    backends = sys.argv[1:] or ["auto", "cpu", "eager"]
    for path in (BULKHEAD, GPU_CHECK):
        if not os.access(path, os.X_OK):
            print(f"gpu_server_check: {path} is missing: run scripts/gpu-check.sh --build", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="bulkhead-gpu-server-") as folder:
        written = subprocess.run([GPU_CHECK, "--write-model", os.path.join(folder, "model.gguf")])
        if written.returncode != 0:
            row("server: the model file", "gpu-check --write-model failed", False)
            return 1
        texts = {backend: serve(folder, backend) for backend in backends}
    (a, ta), others = list(texts.items())[0], list(texts.items())[1:]
    for b, tb in others:
        if ta is None or tb is None:
            continue
        for kind, x, y in (("greedy", ta[0], tb[0]), ("adjusted greedy", ta[1], tb[1])):
            where = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            row(
                f"server: {kind} text, {a} against {b}",
                "the same" if x == y else f"parts at character {where} (a near tie, or a difference: see the agreement rows)",
                None,
            )
        worst = max((abs(x - y) for x, y in zip(ta[2], tb[2])), default=0.0)
        row(
            f"server: prompt log probabilities, {a} against {b}",
            f"{len(ta[2])} tokens, largest difference {worst:.2e}",
            None,
        )
    failed = sum(1 for r in rows if r.endswith("| FAIL |"))
    print()
    print(f"server: {failed} checks failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
