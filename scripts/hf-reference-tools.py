#!/usr/bin/env python3
"""Regenerates tests/data/hf-reference-tools.json: chat requests with tools, tool calls, tool
results, documents, template kwargs, a developer message and reasoning, and the prompt text
Hugging Face's own `apply_chat_template` (transformers) renders for each, after the message
preparation vLLM 0.32 does before calling it (renderers/chat_utils.py `_parse_chat_message_content`
and `_postprocess_messages`; renderers/hf.py `safe_apply_chat_template`; the chat request's
`build_chat_params`). The Rust test (`src/prefix/tests.rs`,
`real_templates_render_tools_like_hf`) parses each request as kvrouter does and compares its
rendering with this text.

Usage: python3 scripts/hf-reference-tools.py [TOKENIZERS_DIR]
  (needs: pip install transformers jinja2; TOKENIZERS_DIR defaults to .cache/tokenizers)
"""
import copy
import json
import os
import sys

from transformers import PreTrainedTokenizerFast

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ["qwen3", "llama3", "deepseek_v3"]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"unit\": \"c\", \"city\": \"Paris\"}"}}

REQUESTS = [
    {"messages": [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "Weather in Paris?"}],
     "tools": [WEATHER]},
    {"messages": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [CALL]},
                  {"role": "tool", "tool_call_id": "call_1",
                   "content": [{"type": "text", "text": "18 C"}, {"type": "text", "text": "sunny"}]},
                  {"role": "user", "content": "And tomorrow?"}],
     "tools": [WEATHER]},
    {"messages": [{"role": "user", "content": "x"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}}]},
                  {"role": "tool", "tool_call_id": "c", "content": "error"},
                  {"role": "assistant", "content": "Sorry.", "tool_calls": []},
                  {"role": "user", "content": "ok"}],
     "tools": [WEATHER]},
    {"messages": [{"role": "developer", "content": "Answer in French."},
                  {"role": "user", "content": "Hello", "name": "ann"}]},
    {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                  {"role": "assistant", "content": "A", "reasoning": "thought about it"},
                  {"role": "user", "content": "Q2"}],
     "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": [{"role": "user", "content": "Q"}], "reasoning_effort": "none"},
    {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "partial"}],
     "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "Summarize."}],
     "documents": [{"title": "a", "text": "Doc one."}]},
    # The request's add_generation_prompt (default true) wins over the kwargs'; the kwargs'
    # documents stand when the request has none.
    {"messages": [{"role": "user", "content": "Q"}],
     "chat_template_kwargs": {"add_generation_prompt": False,
                              "documents": [{"title": "k", "text": "From kwargs."}]}},
]


def conversation(request):
    """vLLM 0.32's preparation of `messages` for a template whose content format is "string"
    (text parts joined with newlines)."""
    out = []
    for m in request["messages"]:
        content = m.get("content")
        if content is None:
            content = []
        elif isinstance(content, str):
            content = [{"type": "text", "text": content}]
        msg = {"role": m["role"], "content": "\n".join(p["text"] for p in content)}
        if m["role"] == "assistant":
            if m.get("tool_calls") is not None:
                msg["tool_calls"] = copy.deepcopy(list(m["tool_calls"]))
            if m.get("reasoning") is not None:
                msg["reasoning"] = m["reasoning"]
                msg["reasoning_content"] = m["reasoning"]
        elif m["role"] == "tool":
            if "tool_call_id" in m:
                msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    for msg in out:  # _postprocess_messages
        if msg["role"] == "assistant" and "tool_calls" in msg:
            calls = msg["tool_calls"]
            if len(calls) == 0:
                msg.pop("tool_calls")
                continue
            for item in calls:
                function = item["function"]
                content = function.get("arguments")
                if content:
                    if isinstance(content, dict):
                        parsed = content
                    else:
                        try:
                            parsed = json.loads(content)
                        except json.JSONDecodeError:
                            parsed = None
                        if not isinstance(parsed, dict):
                            parsed = {}
                    function["arguments"] = parsed
                else:
                    function["arguments"] = {}
    return out


def developer_to_system(template, conv):
    if not any(m["role"] == "developer" for m in conv):
        return conv
    if '"developer"' in template or "'developer'" in template:
        return conv
    conv = [dict(m, role="system") if m["role"] == "developer" else m for m in conv]
    systems, rest, needs = [], [], False
    for i, m in enumerate(conv):
        if m["role"] == "system":
            if i > 0 or systems:
                needs = True
            if m.get("content"):
                systems.append(m["content"])
        else:
            rest.append(m)
    if not needs:
        return conv
    return [{"role": "system", "content": "\n\n".join(systems)}, *rest]


def main():
    base = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, ".cache", "tokenizers")
    out = {"requests": REQUESTS, "rendered": {}}
    for model in MODELS:
        tok = PreTrainedTokenizerFast.from_pretrained(os.path.join(base, model))
        template = tok.chat_template
        rendered = []
        for request in REQUESTS:
            conv = developer_to_system(template, conversation(request))
            # build_chat_params, then merge_kwargs (None and "auto" do not override).
            user = request.get("chat_template_kwargs") or {}
            extra = {
                "add_generation_prompt": request.get("add_generation_prompt", True),
                "continue_final_message": False,
                "documents": request.get("documents"),
                "reasoning_effort": request.get("reasoning_effort"),
            }
            effort = request.get("reasoning_effort")
            if effort is not None and "enable_thinking" not in user:
                extra["enable_thinking"] = effort != "none"
            kwargs = dict(user) | {k: v for k, v in extra.items() if v is not None and v != "auto"}
            try:
                text = tok.apply_chat_template(
                    conv, tools=request.get("tools"), tokenize=False, **kwargs
                )
            except Exception as e:  # the template refuses: kvrouter must fail to render too
                text = None
                print(model, "refuses a request:", type(e).__name__, e)
            rendered.append(text)
        out["rendered"][model] = rendered
    path = os.path.join(ROOT, "tests", "data", "hf-reference-tools.json")
    with open(path, "w") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
