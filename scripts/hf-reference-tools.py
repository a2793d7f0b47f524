#!/usr/bin/env python3
"""Regenerates tests/data/hf-reference-tools.json: chat requests with tools, tool calls, tool
results, documents, template kwargs, a developer message and reasoning, and the prompt text
Hugging Face's own `apply_chat_template` (transformers) renders for each, after the message
preparation vLLM 0.32 does before calling it (renderers/chat_utils.py `_parse_chat_message_content`
and `_postprocess_messages`; renderers/hf.py `safe_apply_chat_template`; the chat request's
`build_chat_params`). The Rust test (`src/prefix/tests.rs`,
`real_templates_render_tools_like_hf`) parses each request as kvrouter does and compares its
rendering with this text.

Besides the real templates, a `probe` template prints every variable and message field with
`tojson`, so fields the real templates do not read (documents, name, tool_call_id, kwargs) are
compared too; it is rendered with Qwen3's tokenizer and special tokens.

Usage: python3 scripts/hf-reference-tools.py [TOKENIZERS_DIR]
  (needs: pip install "transformers>=5.16.1,<5.20" jinja2, the range vLLM 0.32 requires;
  TOKENIZERS_DIR defaults to .cache/tokenizers)
"""
import copy
import json
import os
import sys

from transformers import PreTrainedTokenizerFast

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ["qwen3", "llama3", "deepseek_v3", "probe"]
PROBE = (
    "{% for m in messages %}{{ m | tojson }}\n{% endfor %}"
    "tools={{ tools | tojson }}\ndocuments={{ documents | tojson }}\n"
    "agp={{ add_generation_prompt | tojson }}\n"
    "{% if enable_thinking is defined %}thinking={{ enable_thinking | tojson }}\n{% endif %}"
    "{% if reasoning_effort is defined %}effort={{ reasoning_effort | tojson }}\n{% endif %}"
    "{% if custom is defined %}custom={{ custom | tojson }}\n{% endif %}"
    "{{ bos_token }}|{{ eos_token }}"
)

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
    # Tools as clients send them: no description or parameters, keys in another order, keys
    # vLLM's model drops, defer_loading on the tool; kwargs that are null or "auto" (not
    # passed), and a kwargs `tools` over the request's.
    {"messages": [{"role": "user", "content": "Q"}],
     "tools": [{"function": {"parameters": {"type": "object"}, "name": "ping"}, "type": "function",
                "cache_control": {"type": "ephemeral"}},
               {"type": "function", "defer_loading": True,
                "function": {"name": "later", "strict": True, "x": 1}}],
     "chat_template_kwargs": {"custom": None, "enable_thinking": "auto"}},
    {"messages": [{"role": "user", "content": "Q"}],
     "tools": [WEATHER],
     "chat_template_kwargs": {"tools": [{"anything": "as sent"}], "custom": [1, "x"]}},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "b"},
                                               {"type": "text", "text": ""}, {"type": "text", "text": "c"}]}]},
]


def dumped_tools(tools):
    """vLLM 0.32's `[tool.model_dump() for tool in request.tools]` (ChatCompletionToolsParam,
    FunctionDefinition and their model serializers)."""
    if tools is None:
        return None
    out = []
    for tool in tools:
        f = tool["function"]
        tool_defer = tool.get("defer_loading")
        function = {"name": f["name"], "description": f.get("description"),
                    "parameters": f.get("parameters")}
        if f.get("strict") is not None:
            function["strict"] = f["strict"]
        defer = f.get("defer_loading")
        if defer is None:
            defer = tool_defer
        if defer is not None:
            function["defer_loading"] = defer
        dumped = {"type": tool.get("type", "function"), "function": function}
        if tool_defer is not None:
            dumped["defer_loading"] = tool_defer
        out.append(dumped)
    return out


def merge_kwargs(defaults, overrides):
    """vLLM 0.32's renderers/params.py merge_kwargs."""
    return dict(defaults or {}) | {k: v for k, v in (overrides or {}).items() if v not in (None, "auto")}


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
        # An empty text part is left out (`if parse_res:`).
        msg = {"role": m["role"], "content": "\n".join(p["text"] for p in content if p["text"])}
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
    import transformers
    assert "5.16.1" <= transformers.__version__ < "5.20", transformers.__version__
    out["transformers"] = transformers.__version__
    out["probe_template"] = PROBE
    for model in MODELS:
        tok = PreTrainedTokenizerFast.from_pretrained(
            os.path.join(base, "qwen3" if model == "probe" else model))
        template = PROBE if model == "probe" else tok.chat_template
        rendered = []
        for request in REQUESTS:
            conv = developer_to_system(template, conversation(request))
            # preprocess_chat's defaults, build_chat_params, then with_defaults.
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
            defaults = merge_kwargs({}, {"tools": dumped_tools(request.get("tools")), "tokenize": False})
            kwargs = merge_kwargs(defaults, merge_kwargs(user, extra))
            kwargs.pop("continue_final_message")
            tools = kwargs.pop("tools", None)
            kwargs.pop("tokenize")
            try:
                text = tok.apply_chat_template(
                    conv, tools=tools, chat_template=template, tokenize=False, **kwargs
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
