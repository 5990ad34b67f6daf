#!/usr/bin/env python3
"""Golden logits for a model file from an independent reference.

This is a plain NumPy Llama forward pass over tensors dequantized by the `gguf`
Python package (llama.cpp's own reference dequantizers), with full f32
activations and no KV paging: nothing here shares code with the Rust engine.
Prompts are tokenized by the HuggingFace `tokenizers` library built from the
GGUF vocabulary (see golden_tokens.py), so the fixture is independent of our
tokenizer as well.

Writes the fixture (default kernels/tests/fixtures/logits_smollm2.json for the
default model):
  prompts: [{text, ids, positions: [{pos, top: [[id, logit], ...10]}]}]
  greedy:  {text, ids, continuation: [ids...]}

Regenerate:  scripts/setup.sh --python && python3 scripts/golden_logits.py
A long prompt (LONG_TOKENS tokens; logits at several depths and a greedy
continuation through a KV cache), for long-context attention:
  python3 scripts/golden_logits.py --long \
      --out kernels/tests/fixtures/logits_smollm2_long.json
The Q8_0 model that scripts/models.sh derives with `bulkhead quantize` (reading
it here also proves, independently of our reader, that the file is valid GGUF):
  python3 scripts/golden_logits.py \
      --model .cache/models/SmolLM2-135M-Instruct.Q8_0.gguf \
      --out kernels/tests/fixtures/logits_smollm2_q8.json
"""

import argparse
import hashlib
import json
import os
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_tokenizer import build_tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
OUT = os.path.join(ROOT, "kernels/tests/fixtures/logits_smollm2.json")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "1, 2, 3, 4, 5, 6, 7,",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village nestled between two mountains, there lived",
]
GREEDY_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n"
)
GREEDY_TOKENS = 24
TOP = 10
LONG_TOKENS = 4100
LONG_GREEDY_TOKENS = 8


def long_text():
    """Varied, deterministic prose-like text: numbered facts, so no window of it
    repeats and attention has something to find far back."""
    colors = ["red", "green", "blue", "amber", "violet", "grey", "white", "black"]
    things = ["lamp", "river", "ledger", "kettle", "bridge", "garden", "signal", "harbor", "window"]
    lines = []
    for i in range(1, 2000):
        color = colors[(i * 7) % len(colors)]
        thing = things[(i * 5) % len(things)]
        lines.append(f"Note {i}: the {color} {thing} number {i * 37 % 1000} was checked on day {i % 31 + 1}.")
    return "<|im_start|>user\n" + " ".join(lines)


class Reference:
    def __init__(self, path):
        reader = GGUFReader(path)
        self.meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
        self.t = {}
        for tensor in reader.tensors:
            w = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            self.t[tensor.name] = w.reshape([int(x) for x in reversed(tensor.shape)]) if w.ndim > 1 else w
        m = self.meta
        self.layers = m["llama.block_count"]
        self.d = m["llama.embedding_length"]
        self.heads = m["llama.attention.head_count"]
        self.kv_heads = m["llama.attention.head_count_kv"]
        self.hd = self.d // self.heads
        self.eps = m["llama.attention.layer_norm_rms_epsilon"]
        self.base = m["llama.rope.freq_base"]
        self.embd = self.t["token_embd.weight"]  # [vocab][d]
        self.out = self.t.get("output.weight", self.embd)

    def rmsnorm(self, x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * g

    def rope(self, x, n, start=0):
        # x: [T][heads][hd]; llama.cpp "normal" RoPE rotates adjacent pairs.
        pos = np.arange(start, start + n, dtype=np.float64)[:, None]
        inv = self.base ** (-np.arange(0, self.hd, 2, dtype=np.float64) / self.hd)
        ang = pos * inv[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out

    def forward(self, ids, cache=None):
        """Logits of `ids`, which follow the positions already in `cache` (a
        list of per-layer (k, v) arrays, extended in place) when one is given."""
        n = len(ids)
        start = 0 if cache is None or not cache else cache[0][0].shape[0]
        x = self.embd[ids].astype(np.float64)
        group = self.heads // self.kv_heads
        mask = np.triu(np.full((n, start + n), -np.inf), k=start + 1)
        for i in range(self.layers):
            w = lambda part: self.t[f"blk.{i}.{part}.weight"]  # noqa: E731
            xn = self.rmsnorm(x, w("attn_norm"))
            q = (xn @ w("attn_q").T).reshape(n, self.heads, self.hd)
            k = (xn @ w("attn_k").T).reshape(n, self.kv_heads, self.hd)
            v = (xn @ w("attn_v").T).reshape(n, self.kv_heads, self.hd)
            q, k = self.rope(q, n, start), self.rope(k, n, start)
            if cache is not None:
                if len(cache) <= i:
                    cache.append((k, v))
                else:
                    k = np.concatenate([cache[i][0], k])
                    v = np.concatenate([cache[i][1], v])
                    cache[i] = (k, v)
            att = np.empty((n, self.heads, self.hd))
            for h in range(self.heads):
                kh = h // group
                s = q[:, h, :] @ k[:, kh, :].T / np.sqrt(self.hd) + mask
                s = np.exp(s - s.max(axis=1, keepdims=True))
                s /= s.sum(axis=1, keepdims=True)
                att[:, h, :] = s @ v[:, kh, :]
            x = x + att.reshape(n, self.d) @ w("attn_output").T
            xn = self.rmsnorm(x, w("ffn_norm"))
            g = xn @ w("ffn_gate").T
            u = xn @ w("ffn_up").T
            x = x + ((g / (1 + np.exp(-g))) * u) @ w("ffn_down").T
        return self.rmsnorm(x, self.t["output_norm.weight"]) @ self.out.T


def top(logits, count=TOP):
    order = np.argsort(-logits, kind="stable")[:count]
    return [[int(i), round(float(logits[i]), 5)] for i in order]


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", default=MODEL, help="GGUF model file (default: %(default)s)")
    parser.add_argument("--out", default=OUT, help="fixture to write (default: %(default)s)")
    parser.add_argument("--long", action="store_true", help=f"one prompt of {LONG_TOKENS} tokens")
    args = parser.parse_args()
    tokenizer = build_tokenizer(args.model)
    ref = Reference(args.model)
    if args.long:
        write(args, long_fixture(tokenizer, ref))
        return
    prompts = []
    for text in PROMPTS:
        ids = tokenizer.encode(text).ids
        logits = ref.forward(ids)
        positions = sorted({0, len(ids) // 2, len(ids) - 1})
        prompts.append(
            {"text": text, "ids": ids, "positions": [{"pos": p, "top": top(logits[p])} for p in positions]}
        )
        print(f"{len(ids):3} tokens, next={top(logits[-1], 1)}", file=sys.stderr)
    ids = tokenizer.encode(GREEDY_PROMPT).ids
    continuation, margins = [], []
    for _ in range(GREEDY_TOKENS):
        last = ref.forward(ids + continuation)[-1]
        best = top(last, 2)
        continuation.append(best[0][0])
        margins.append(round(best[0][1] - best[1][1], 5))
    print("greedy:", repr(tokenizer.decode(continuation)), file=sys.stderr)
    write(
        args,
        {
            "prompts": prompts,
            "greedy": {"text": GREEDY_PROMPT, "ids": ids, "continuation": continuation, "top2_margins": margins},
        },
    )


def long_fixture(tokenizer, ref):
    """One LONG_TOKENS prompt: top-10 logits at several depths, then a greedy
    continuation decoded through the reference's KV cache."""
    ids = tokenizer.encode(long_text()).ids[:LONG_TOKENS]
    assert len(ids) == LONG_TOKENS, len(ids)
    cache = []
    logits = ref.forward(ids, cache)
    positions = [511, 1023, 2047, 3071, LONG_TOKENS - 1]
    continuation, margins = [], []
    last = logits[-1]
    for _ in range(LONG_GREEDY_TOKENS):
        best = top(last, 2)
        continuation.append(best[0][0])
        margins.append(round(best[0][1] - best[1][1], 5))
        last = ref.forward([best[0][0]], cache)[-1]
    print(f"long: {len(ids)} tokens, greedy {tokenizer.decode(continuation)!r}", file=sys.stderr)
    return {
        "prompts": [{"ids": ids, "positions": [{"pos": p, "top": top(logits[p])} for p in positions]}],
        "greedy": {"ids": ids, "continuation": continuation, "top2_margins": margins},
    }


def write(args, body):
    fixture = {
        "model_sha256": sha256(args.model),
        "reference": "NumPy f64 forward over gguf-dequantized tensors (scripts/golden_logits.py)",
        **body,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(fixture, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
