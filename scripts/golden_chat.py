#!/usr/bin/env python3
"""Reference renderings of real chat templates, for host/src/engine/chat.rs.

The templates in host/tests/fixtures/chat_templates/ are the ones the families'
GGUF files carry (copied from llama.cpp's models/templates, which keeps them as
the model repositories publish them). Each is rendered here exactly as
HuggingFace transformers' `apply_chat_template` renders it: Jinja2's sandboxed
environment with trim_blocks and lstrip_blocks, the loop-controls extension,
`raise_exception` and a `tojson` that keeps non-ASCII text. `strftime_now` is
left undefined, as in Bulkhead (templates that use it fall back to their own
fixed date). The output, host/tests/fixtures/chat_templates.json, is what
host/tests/chat_templates.rs holds our minijinja rendering to, text for text.

Regenerate:  python3 scripts/golden_chat.py   (needs jinja2)
"""

import glob
import json
import os

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIR = os.path.join(ROOT, "host/tests/fixtures/chat_templates")
OUT = os.path.join(ROOT, "host/tests/fixtures/chat_templates.json")

# BOS and EOS spellings of each family's tokenizer.
TOKENS = {
    "meta-llama": ("<|begin_of_text|>", "<|eot_id|>"),
    "Qwen": ("", "<|im_end|>"),
    "google-gemma": ("<bos>", "<eos>"),
    "microsoft-Phi": ("<s>", "<|endoftext|>"),
    "mistralai": ("<s>", "</s>"),
    "HuggingFaceTB": ("", "<|im_end|>"),
    "deepseek-ai": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
}

CONVERSATIONS = [
    [{"role": "user", "content": "Name three primary colors."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
    ],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "And then?"},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "  Spaces, <|im_end|>, <|eot_id|>\nand ünïcödé  "},
    ],
]


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def environment():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def main():
    env = environment()
    out = {}
    for path in sorted(glob.glob(os.path.join(DIR, "*.jinja"))):
        name = os.path.basename(path)[:-len(".jinja")]
        bos, eos = next(v for k, v in TOKENS.items() if name.startswith(k))
        with open(path) as f:
            template = env.from_string(f.read())
        cases = []
        for messages in CONVERSATIONS:
            try:
                rendered = template.render(messages=messages, add_generation_prompt=True,
                                           bos_token=bos, eos_token=eos)
                cases.append({"messages": messages, "rendered": rendered})
            except jinja2.exceptions.TemplateError as e:
                cases.append({"messages": messages, "error": str(e)})
        out[name] = {"bos_token": bos, "eos_token": eos, "cases": cases}
    with open(OUT, "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
