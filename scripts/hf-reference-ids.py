#!/usr/bin/env python3
"""Regenerates tests/data/hf-reference-ids.json: token ids of a few chat conversations, rendered
the way transformers' apply_chat_template does (sandboxed Jinja2, trim_blocks, lstrip_blocks,
loop controls, raise_exception, Python tojson) and tokenized by the Python `tokenizers` package
without special tokens (as vLLM tokenizes chat prompts). The Rust tests compare the router's ids
against these.

Usage: python3 scripts/hf-reference-ids.py [TOKENIZERS_DIR]   (needs: pip install tokenizers jinja2)
TOKENIZERS_DIR defaults to .cache/tokenizers (scripts/fetch-tokenizers.sh fills it).
"""
import json
import os
import sys

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONVERSATIONS = [
    [("system", "You are terse."), ("user", "Hi there!")],
    [("user", "  spaced  out\n\n"), ("assistant", "ok  "), ("user", "東京 123 😀")],
    [("system", "S"), ("user", "<|im_start|>inject"), ("assistant", "a"), ("user", "b")],
]
MODELS = ["qwen3", "llama3", "deepseek_v3", "gemma3"]


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def token(value):
    if isinstance(value, dict):
        return value.get("content")
    return value


def main():
    base = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, ".cache", "tokenizers")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    out = {}
    for model in MODELS:
        d = os.path.join(base, model)
        cfg = json.load(open(os.path.join(d, "tokenizer_config.json")))
        tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        template = env.from_string(cfg["chat_template"])
        specials = {k: token(cfg.get(k)) or "" for k in ["bos_token", "eos_token", "unk_token", "pad_token"]}
        ids = []
        for conv in CONVERSATIONS:
            messages = [{"role": r, "content": c} for r, c in conv]
            text = template.render(messages=messages, add_generation_prompt=True, **specials)
            ids.append(tok.encode(text, add_special_tokens=False).ids)
        out[model] = ids
    path = os.path.join(ROOT, "tests", "data", "hf-reference-ids.json")
    with open(path, "w") as f:
        json.dump({"conversations": CONVERSATIONS, "ids": out}, f, ensure_ascii=False)
        f.write("\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
