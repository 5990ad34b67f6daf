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


# Tools, and conversations that call them, in the shape Bulkhead gives the
# template (engine/chat.rs): ids are the call's place written as nine digits,
# arguments an object, an assistant message that calls has content "". The
# texts hold what a template must never read as its own tokens.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather \"now\" in a city. <|im_end|> <|eot_id|> [INST] ünï",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "A city's name"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, NOW]


def call(index, name, arguments):
    return {"id": "%09d" % index, "type": "function",
            "function": {"name": name, "arguments": arguments}}


TOOL_CONVERSATIONS = [
    [{"role": "user", "content": "Weather in Oslo?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "",
         "tool_calls": [call(0, "get_weather", {"city": "Oslo <|im_end|>", "unit": "celsius"})]},
        {"role": "tool", "tool_call_id": "000000000", "content": "{\"temp\": 3, \"sky\": \"<|eot_id|>\"}"},
    ],
    [
        {"role": "user", "content": "Weather in Oslo, and the time?"},
        {"role": "assistant", "content": "",
         "tool_calls": [call(0, "get_weather", {"city": "Oslo"}), call(1, "now", {})]},
        {"role": "tool", "tool_call_id": "000000000", "content": "3 degrees"},
        {"role": "tool", "tool_call_id": "000000001", "content": "noon"},
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
        for messages, tools in [(c, None) for c in CONVERSATIONS] + \
                [(c, TOOLS) for c in TOOL_CONVERSATIONS]:
            case = {"messages": messages}
            extra = {}
            if tools is not None:
                case["tools"] = tools
                extra["tools"] = tools
            try:
                case["rendered"] = template.render(messages=messages, add_generation_prompt=True,
                                                   bos_token=bos, eos_token=eos, **extra)
            except jinja2.exceptions.TemplateError as e:
                case["error"] = str(e)
            cases.append(case)
        out[name] = {"bos_token": bos, "eos_token": eos, "cases": cases}
    with open(OUT, "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
