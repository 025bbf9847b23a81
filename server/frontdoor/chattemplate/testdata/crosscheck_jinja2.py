#!/usr/bin/env python3
"""crosscheck_jinja2.py renders the chat template goldens with Python's jinja2, in the environment
transformers' apply_chat_template builds (transformers/utils/chat_template_utils.py:
ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and loopcontrols; its tojson,
raise_exception and strftime_now), which is what vLLM renders with. It is never run by the tests.

1. It checks that every case of llama-3.1.golden.json and qwen3.golden.json, which
   scripts/goldens/gen-chat-goldens.mjs wrote with Hugging Face's JavaScript library, renders the
   same in Python: the goldens hold no case where the two disagree.
2. It writes python.golden.json: cases where @huggingface/jinja and jinja2 disagree (str.strip
   with an argument, the whitespace of trim and strip, floats and U+2028 in tojson, tojson's
   options), with jinja2's output, which the Go package must match.

Run from the repository root after scripts/models.sh, with jinja2 >= 3.1 importable:

    python3 server/frontdoor/chattemplate/testdata/crosscheck_jinja2.py

The request-to-template conversion below is vLLM's, as in the JavaScript generator and values.go.
"""
import datetime
import hashlib
import json
import os
import sys

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "../../../.."))
MODELS = os.environ.get("KVROUTER_MODELS") or os.path.join(REPO, ".tmp/models")

# The clock of strftime_now in the cases below (the Go test passes the same to Options.Now).
FIXED_NOW = datetime.datetime(2024, 7, 9, 5, 4, 3)


def environment(now=None):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return (now or datetime.datetime.now()).strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def specials(config):
    out = {}
    for key in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        v = config.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if v:
            out[key] = v
    return out


SYNTH_WORDS = [
    "alpha", "héllo", "wörld", "世界", "你好", "🙂", "👩\u200d👩\u200d👧", "e\u0301", "naïve", "Ω",
    "{{ x }}", "{% if y %}", 'quote"d', "back\\slash", "tab\there", "<b>&amp;</b>",
]


def synth_text(seed, lines):
    out = []
    for i in range(lines):
        a = SYNTH_WORDS[(i * 7 + seed) % len(SYNTH_WORDS)]
        b = SYNTH_WORDS[(i * 3 + seed * 5) % len(SYNTH_WORDS)]
        out.append(f"{seed}.{i} {a} lorem ipsum dolor sit amet {b} consectetur\n")
    return "".join(out)


def synth_messages(spec):
    msgs = []
    if spec["system"]:
        msgs.append({"role": "system", "content": synth_text(0, spec["lines"])})
    for t in range(spec["turns"]):
        msgs.append({"role": "user" if t % 2 == 0 else "assistant", "content": synth_text(t + 1, spec["lines"])})
    return msgs


def content_text(content):
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(p.get("text") or p.get("refusal") or p.get("thinking") or "" for p in content)


def conversation(messages):
    out = []
    for m in messages:
        msg = {"role": m["role"], "content": content_text(m.get("content"))}
        if m["role"] == "assistant":
            if m.get("tool_calls"):
                calls = []
                for tc in m["tool_calls"]:
                    args = tc["function"].get("arguments")
                    if isinstance(args, str):
                        try:
                            args = json.loads(args)
                        except json.JSONDecodeError:
                            args = {}
                    elif not isinstance(args, (dict, list)):
                        args = {}
                    call = {}
                    if "id" in tc:
                        call["id"] = tc["id"]
                    call["type"] = tc.get("type", "function")
                    call["function"] = {"name": tc["function"]["name"], "arguments": args}
                    calls.append(call)
                msg["tool_calls"] = calls
            reasoning = m.get("reasoning") or m.get("reasoning_content")
            if reasoning:
                msg["reasoning"] = reasoning
                msg["reasoning_content"] = reasoning
        if m["role"] == "tool" and "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str) and m["name"]:
            msg["name"] = m["name"]
        out.append(msg)
    return out


def tool(t):
    t = dict(t)
    typ = t.pop("type", "function")
    f = dict(t.pop("function"))
    fn = {"name": f.pop("name"), "description": f.pop("description", None), "parameters": f.pop("parameters", None)}
    fn.update(f)
    out = {"type": typ, "function": fn}
    out.update(t)
    return out


def render(template, special, request, messages=None, now=None):
    env = environment(now)
    tmpl = env.from_string(template)
    req = dict(request or {})
    msgs = (messages or []) + req.get("messages", [])
    tools = [tool(t) for t in req["tools"]] if req.get("tools") else None
    kwargs = dict(special)
    kwargs.update(req.get("chat_template_kwargs") or {})
    return tmpl.render(
        messages=conversation(msgs),
        tools=tools,
        documents=None,
        add_generation_prompt=req.get("add_generation_prompt", True),
        **kwargs,
    )


def model_template(model):
    with open(os.path.join(MODELS, model, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    return config["chat_template"], specials(config)


def check_goldens():
    bad = 0
    for model in ("llama-3.1", "qwen3"):
        template, special = model_template(model)
        with open(os.path.join(HERE, f"{model}.golden.json"), encoding="utf-8") as f:
            golden = json.load(f)
        for case in golden["cases"]:
            synth = synth_messages(case["synthetic"]) if case.get("synthetic") else None
            got = render(template, special, case.get("request"), synth)
            if "want" in case:
                ok = got == case["want"]
            else:
                data = got.encode("utf-8")
                ok = hashlib.sha256(data).hexdigest() == case["want_sha256"] and len(data) == case["want_len"]
            if not ok:
                bad += 1
                print(f"{model}/{case['name']}: jinja2 renders differently from {golden['renderer']}")
        print(f"{model}: {len(golden['cases'])} cases checked")
    return bad


# Cases where @huggingface/jinja and jinja2 disagree; jinja2 (vLLM's) is the one to match.
PYTHON_CASES = [
    {
        "name": "qwen3_strip_with_argument_keeps_spaces",
        "model": "qwen3",
        "request": {
            "messages": [
                {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "\n  indented answer", "reasoning_content": "\n  spaced reasoning  \n"},
            ],
            "add_generation_prompt": False,
        },
    },
    {
        "name": "qwen3_tool_call_float_arguments",
        "model": "qwen3",
        "request": {
            "messages": [
                {"role": "user", "content": "Pay"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c", "type": "function",
                         "function": {"name": "pay", "arguments": '{"amount": 10.0, "rate": 1e-05, "big": 1e16, "max": 1e15, "n": 3}'}},
                    ],
                },
            ],
            "add_generation_prompt": False,
        },
    },
    {
        "name": "llama_trim_python_whitespace",
        "model": "llama-3.1",
        "request": {
            "messages": [
                {"role": "user", "content": "\ufeffbom kept, separator stripped\x1c"},
                {"role": "assistant", "content": "\x85\u3000\u2028nel and ideographic space stripped\u00a0\x0b"},
            ],
        },
    },
    {
        "name": "tojson_floats_and_escapes",
        "template": "{{ x | tojson }}",
        "request": {"chat_template_kwargs": {"x": {
            "one": 1.0, "e16": 1e16, "e15": 1e15, "small": 0.0001, "smaller": 1e-05, "negzero": -0.0,
            "n": 123456789.0, "tenth": 0.1, "huge": 1.5e300, "third": 1 / 3, "int": -7,
            "s": "a\u2028b\u2029c\x7fd\x1fe\"f\\g/h<i>&j'k\tl\nm\bn\fo", "u": "é😀中",
        }}},
    },
    {
        "name": "tojson_options",
        "template": (
            "{{ x | tojson(ensure_ascii=True) }}\n{{ x | tojson(indent=2) }}\n{{ x | tojson(indent='\\t', sort_keys=True) }}\n"
            "{{ x | tojson(separators=(',', ':')) }}\n{{ x | tojson(sort_keys=True) }}\n{{ [] | tojson(indent=2) }} {{ {} | tojson(indent=2) }}"
        ),
        "request": {"chat_template_kwargs": {"x": {"z": [1, {"b": None, "a": True}], "é": "😀\x7f", "a": [], "m": {}}}},
    },
    {
        "name": "string_methods_python_whitespace",
        "template": "[{{ s.strip() }}][{{ s.lstrip() }}][{{ s.rstrip() }}][{{ s.strip('\\v') }}][{{ s | trim }}][{{ s | trim(' \\v') }}]",
        "request": {"chat_template_kwargs": {"s": "\x0b\x0c\u00a0 x y \u2003\x1c\x0b"}},
    },
    {
        "name": "string_literal_escapes",
        "template": "{{ 'a\\x41\\u00e9\\101\\U0001F600\\q\\'\"\\v|' }}{{ \"tab\\there\\\\ \\\"q\\\" }}\" }}{{ '}}' ~ '%}' }}",
    },
    {
        "name": "whitespace_control",
        "template": (
            "{% for m in messages %}{{ m.role }}\n{% endfor %}|  {% if true %}\n  x\n  {% endif %}\n"
            "|{%- if true -%}  y  {%- endif -%}  |{%+ if true +%}\n z{% endif %}\n{# c #}\n  {# d -#}  \n"
            "w{{- ' v ' -}}  u\n\t{% raw %}  {{ r }}\n{%- endraw %}\nq\r\n  {%- raw -%} \n s {%+ endraw -%} \u3000 t"
            "\n{% macro f(a) %}\n  [{{ a }}]\n{% endmacro %}\n{{ f(1) }}{% set b %}\n  in set\n{% endset %}{{ b }}\n"
            "{% for i in [1, 2] %}\n    {{ i }}\n{% endfor %}\nend\n"
        ),
        "request": {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
    },
    {
        "name": "brackets_inside_tags",
        "template": "{{ {'a': {'b': 1}} | tojson }}|{% set d = {'k': {'x': [1, {'y': 2}]}} %}{{ d.k.x[1].y }}|{{ '}}' }}{{ \"%}\" }}",
    },
    {
        "name": "printing_values",
        "template": (
            "{{ none }}|{{ 1.0 }}|{{ [1, 'a', None, {'k': \"it's\"}, true, 0.5] }}|{{ x }}|{{ 2.5e-7 }}|{{ true }}"
            "|{{ 'a' ~ 1 }}|{{ 1.0 | string }}|{{ undefined_var }}|{{ -0.0 }}|{{ x.s }}|{{ [x.s] }}"
        ),
        "request": {"chat_template_kwargs": {"x": {"b": 2, "a": [1.5, None], "s": "tab\there \u00e9\u200b\x00'\"\\"}}},
    },
    {
        "name": "range",
        "template": "{% for i in range(3) %}{{ i }},{% endfor %}|{% for i in range(5, 0, -2) %}{{ i }},{% endfor %}|{{ range(2, 4) | list | length }}",
    },
    {
        "name": "strftime_now",
        "template": "{{ strftime_now('%d %b %Y %H:%M:%S %j %a %A %B %I%p %y %-d %m %%') }}",
    },
    {
        "name": "loop_controls_and_namespace",
        "template": (
            "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
            "{% set ns.n = ns.n + 1 %}{{ loop.index0 }}:{{ m['role'] }}{{ ',' if not loop.last }}"
            "{% if ns.n >= 2 %}{% break %}{% endif %}{% endfor %}|{{ ns.n }}|{{ messages[::-1][0].content }}"
            "|{{ messages | selectattr('role', 'equalto', 'user') | list | length }}"
        ),
        "request": {"messages": [
            {"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
        ]},
    },
]


def python_goldens():
    out = []
    for case in PYTHON_CASES:
        if "model" in case:
            template, special = model_template(case["model"])
        else:
            template, special = case["template"], {}
        got = render(template, special, case.get("request"), now=FIXED_NOW)
        out.append({**case, "want": got})
    doc = {
        "comment": "Written by testdata/crosscheck_jinja2.py; do not edit.",
        "renderer": f"jinja2 {jinja2.__version__} in transformers' chat template environment (Python {sys.version.split()[0]})",
        "now": FIXED_NOW.isoformat(),
        "cases": out,
    }
    path = os.path.join(HERE, "python.golden.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"{os.path.relpath(path, REPO)}: {len(out)} cases")


if __name__ == "__main__":
    bad = check_goldens()
    python_goldens()
    sys.exit(1 if bad else 0)
