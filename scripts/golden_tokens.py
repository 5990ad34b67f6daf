#!/usr/bin/env python3
"""Golden tokenizer fixture for SmolLM2 from an independent reference (HF `tokenizers`).

Regenerate with:

    scripts/setup.sh --python && python3 scripts/golden_tokens.py

Reads the vocabulary straight out of the GGUF model with the `gguf` package, builds a
HuggingFace `tokenizers` BPE tokenizer from it (reference_tokenizer.py) with SmolLM2's
own pre-tokenizer (Digits(individual_digits=True) then
ByteLevel(add_prefix_space=False, use_regex=True)), and writes
kernels/tests/fixtures/tokens_smollm2.json: texts -> expected ids with special tokens
NOT parsed, one chat-template rendering -> expected ids with special tokens parsed,
HF's decode of every id list, and HF's pre-token splits for each pre-tokenizer.

Nothing here is shared with the Rust implementation: the expected ids come from HF's
BPE, pre-tokenizer and added-token splitting.
"""

import json
import sys
from pathlib import Path

from tokenizers import Regex, pre_tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_tokenizer import build_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
FIXTURE = ROOT / "kernels/tests/fixtures/tokens_smollm2.json"
FIXTURE_BYTES_MAX = 50_000


TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n\n\nclass Foo:\n\tpass\n",
    "    indented    with     runs of   spaces   ",
    "numbers: 1234567 and 3.14159, -42, 1e10, 0x1F, 2024-06-01",
    "I'm sure you're right, they've said we'll see, she'd go, it's 'quoted'.",
    "CamelCaseIdentifiers and SHOUTING and MiXeD cAsE",
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷🇯🇵 ❤️",
    "中文分词测试：你好，世界！日本語のテキスト。한국어 문장.",
    "العربية: مرحبا بالعالم",
    "tabs\tand\ttabs\t\t\tand newlines\n\n\n\nend",
    "trailing spaces   ",
    "\n\n  \t \n",
    " leading space and double  space",
    "Pneumonoultramicroscopicsilicovolcanoconiosis antidisestablishmentarianism",
    "<|im_start|>user\nthis is literal text, not a special token<|im_end|>",
    "<|endoftext|> <repo_name> <file_sep>",
    "naïve café résumé Ünïcödé ß ﬁ Ⅻ ½ ²",
    "math: ∑_{i=1}^{n} i² = n(n+1)/2 ≈ ∞",
    "URL https://example.com/path?q=1&r=two#frag and email a.b@c.de",
    "a",
    "",
    "   ",
    "'s's 'S 'LL ''",
    "x" * 300,
    # SmolLM2 has no token for byte 0x04: HF (and llama.cpp) drop it, so this case does
    # not round-trip and the fixture says so.
    "control\x04byte\x07bell\x00nul",
    "fn main() {\n    let v: Vec<u32> = (0..10).collect();\n    println!(\"{v:?}\");\n}\n",
]

CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is 2+2? Say <|im_end|> twice.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


# The patterns as the models' tokenizer.json files spell them (look-ahead included), for
# the pre-tokenizer names we implement without a model file to test against.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {
    "gpt2": [GPT2_PATTERN],
    "smollm": [r"\p{N}", GPT2_PATTERN],
    "llama-bpe": [LLAMA3_PATTERN],
    "qwen2": [QWEN2_PATTERN],
}


def pre_tokenize(patterns, text):
    """HF (Oniguruma) splitting: every pattern splits every piece, keeping gaps."""
    pre = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
    )
    return [piece for piece, _ in pre.pre_tokenize_str(text)]


def main():
    plain = build_tokenizer(MODEL, specials=False)
    special = build_tokenizer(MODEL, specials=True)

    cases = []
    for text in TEXTS:
        ids = plain.encode(text, add_special_tokens=False).ids
        decoded = plain.decode(ids, skip_special_tokens=False)
        cases.append({"text": text, "ids": ids, "decoded": decoded})

    chat_ids = special.encode(CHAT, add_special_tokens=False).ids
    chat = {
        "text": CHAT,
        "ids": chat_ids,
        "decoded_with_specials": special.decode(chat_ids, skip_special_tokens=False),
        "decoded_without_specials": special.decode(chat_ids, skip_special_tokens=True),
    }

    splits = {
        name: [pre_tokenize(patterns, text) for text in TEXTS]
        for name, patterns in PRE_TOKENIZERS.items()
    }

    fixture = {
        "generator": "scripts/golden_tokens.py (HF tokenizers %s)" % sys.modules["tokenizers"].__version__,
        "model": MODEL.name,
        "vocab_len": plain.get_vocab_size(),
        "cases": cases,
        "chat": chat,
        "pre_tokenized": splits,
    }
    body = json.dumps(fixture, ensure_ascii=False, indent=None, separators=(",", ":"))
    assert len(body.encode()) < FIXTURE_BYTES_MAX, len(body.encode())
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(body + "\n")
    print(f"wrote {FIXTURE} ({len(body.encode())} bytes, {len(cases)} cases)")


if __name__ == "__main__":
    main()
