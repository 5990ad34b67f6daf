#!/usr/bin/env python3
"""llama.cpp's logits for the conformance models: the committed fixture
kernels/tests/fixtures/conformance/llamacpp.json that kernels/tests/conformance.rs
holds the engine to.

1. Writes every conformance model (kernels/src/testing.rs, conformance_models)
   with the kernels crate's own generator into .cache/conformance/.
2. Quantizes the F32 one of width 256 with llama.cpp's own llama-quantize to
   Q4_K_M, Q5_K_M and Q6_K: block layouts written by someone else's code. These
   three files are committed next to the fixture (llama.cpp is not built in CI).
3. Runs llama-reference (scripts/llama_reference.cpp) on each file: llama.cpp's
   token ids for each prompt, its top-10 logits at every position, and a greedy
   continuation with the top-1/top-2 margin before each token.

4. Re-quantizes the real SmolLM2-135M (the Q4_1 file scripts/setup.sh fetches)
   with llama-quantize to Q4_K_M and Q6_K into .cache/models/ and writes
   llama.cpp's answers on them to smollm2.json. Those files are not committed
   (tens of MB): the test that reads them reports itself skipped where they are
   absent, as in CI.

5. Gemma's SentencePiece setting: llama.cpp's llama-spm test vocabulary with
   `tokenizer.ggml.add_space_prefix = false` (what Gemma's files say; no
   Gemma 2/3 vocabulary ships with llama.cpp's tests), and llama.cpp's ids for
   its test texts under it, to tokenizer/spm-no-space-prefix.json.

Regenerate (after scripts/llama_cpp.sh):
    python3 scripts/llama_fixtures.py            # both fixtures
    python3 scripts/llama_fixtures.py --generated  # llamacpp.json only
"""

import hashlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, ".cache/llama.cpp/bin")
MODELS = os.path.join(ROOT, ".cache/conformance")
FIXTURES = os.path.join(ROOT, "kernels/tests/fixtures/conformance")
QUANTIZED = ["Q4_K_M", "Q5_K_M", "Q6_K"]
GREEDY_COUNT = 32
REFERENCE = ("llama.cpp from llama-cpp-python 0.3.36 (scripts/llama_cpp.sh), "
             "scripts/llama_reference.cpp: one thread, f32 KV cache")
PROMPTS = [
    "hello world\n",
    "The quick brown fox jumps over the lazy dog.\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n",
]


def run(args, **kwargs):
    return subprocess.run(args, check=True, cwd=ROOT, **kwargs)


def generated_models():
    """Writes the models; returns {name: fingerprint}."""
    out = run(
        ["cargo", "run", "--quiet", "--release", "-p", "bulkhead-kernels",
         "--example", "conformance_models", "--", MODELS],
        capture_output=True, text=True,
    ).stdout
    return dict(line.split() for line in out.splitlines())


def quantize(source):
    names = {}
    os.makedirs(FIXTURES, exist_ok=True)
    for ftype in QUANTIZED:
        name = f"llamacpp-{ftype}"
        path = os.path.join(FIXTURES, f"{name}.gguf")
        run([os.path.join(BIN, "llama-quantize"), source, path, ftype, "1"],
            capture_output=True)
        names[name] = path
    return names


def reference(path):
    stdin = "".join(p.encode().hex() + "\n" for p in PROMPTS)
    out = run([os.path.join(BIN, "llama-reference"), path, str(GREEDY_COUNT)],
              input=stdin, capture_output=True, text=True).stdout
    answers = [json.loads(line) for line in out.splitlines()]
    assert len(answers) == len(PROMPTS)
    prompts = []
    for text, answer in zip(PROMPTS, answers):
        positions = [{"pos": pos, "top": top} for pos, top in enumerate(answer["top"])]
        prompts.append({"text": text, "ids": answer["ids"], "positions": positions})
    first = answers[0]
    greedy = {"text": PROMPTS[0], "ids": first["ids"],
              "continuation": first["greedy"], "top2_margins": first["margins"]}
    return {"prompts": prompts, "greedy": greedy}


def smollm2():
    """llama-quantize's SmolLM2 files and llama.cpp's answers on them."""
    source = os.path.join(ROOT, ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    models = {}
    for ftype in ["Q4_K_M", "Q6_K"]:
        name = f"SmolLM2-135M-Instruct.{ftype}.gguf"
        path = os.path.join(ROOT, ".cache/models", name)
        run([os.path.join(BIN, "llama-quantize"), "--allow-requantize", source, path,
             ftype, "2"], capture_output=True)
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        models[ftype] = {"file": os.path.relpath(path, ROOT), "sha256": digest,
                         "bytes_len": os.path.getsize(path),
                         **reference(path)}
        print(f"SmolLM2 {ftype}: {digest}", file=sys.stderr)
    with open(os.path.join(FIXTURES, "smollm2.json"), "w") as f:
        json.dump({"reference": REFERENCE, "models": models}, f, separators=(",", ":"))
        f.write("\n")


def spm_no_space_prefix():
    """llama.cpp's ids for its SentencePiece test texts without the space prefix."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata
    vocab = os.path.join(ROOT, ".cache/llama.cpp/vocab/ggml-vocab-llama-spm.gguf")
    variant = os.path.join(MODELS, "vocab-spm-no-space-prefix.gguf")
    os.makedirs(MODELS, exist_ok=True)
    reader = gguf.GGUFReader(vocab, "r")
    writer = gguf.GGUFWriter(variant, arch=reader.fields["general.architecture"].contents())
    copy_with_new_metadata(reader, writer, {
        "tokenizer.ggml.add_space_prefix": MetadataDetails(gguf.GGUFValueType.BOOL, False),
    }, [])
    with open(vocab + ".inp") as f:
        inp = f.read()
    if inp.endswith("\n__ggml_vocab_test__\n"):
        inp = inp[:-len("\n__ggml_vocab_test__\n")]
    texts = inp.split("\n__ggml_vocab_test__\n")
    stdin = "".join(t.encode().hex() + "\n" for t in texts)
    out = run([os.path.join(BIN, "llama-reference"), variant, "--tokenize"],
              input=stdin, capture_output=True, text=True).stdout
    ids = [json.loads(line)["ids"] for line in out.splitlines()]
    assert len(ids) == len(texts)
    path = os.path.join(ROOT, "kernels/tests/fixtures/tokenizer/spm-no-space-prefix.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    cases = ",\n".join(json.dumps({"text": t, "ids": i}, ensure_ascii=False)
                        for t, i in zip(texts, ids))
    with open(path, "w") as f:
        f.write('{"reference": %s,\n"vocab": %s,\n"cases": [\n%s\n]}\n' % (
            json.dumps(REFERENCE),
            json.dumps("ggml-vocab-llama-spm.gguf with tokenizer.ggml.add_space_prefix = false"),
            cases))
    print(f"spm without the space prefix: {len(texts)} texts", file=sys.stderr)


def main():
    spm_no_space_prefix()
    fingerprints = generated_models()
    models = {}
    for name, fingerprint in fingerprints.items():
        path = os.path.join(MODELS, f"{name}.gguf")
        models[name] = {"file": "generated", "fingerprint": fingerprint, **reference(path)}
        print(f"{name}: {len(models[name]['prompts'])} prompts", file=sys.stderr)
    for name, path in quantize(os.path.join(MODELS, "llama-f32-256.gguf")).items():
        models[name] = {"file": os.path.relpath(path, ROOT), **reference(path)}
        print(f"{name}: quantized by llama-quantize", file=sys.stderr)
    fixture = {"reference": REFERENCE, "models": models}
    with open(os.path.join(FIXTURES, "llamacpp.json"), "w") as f:
        json.dump(fixture, f, separators=(",", ":"))
        f.write("\n")
    if "--generated" not in sys.argv[1:]:
        smollm2()


if __name__ == "__main__":
    main()
