#!/usr/bin/python3
"""Jinja2 references for the C++ chat-template interpreter (model/jinja/jinja.h).

Renders small templates, each exercising one part of the language real chat templates use, with
Jinja2 set up as transformers' apply_chat_template sets it up (ImmutableSandboxedEnvironment,
trim_blocks, lstrip_blocks, loopcontrols, raise_exception, strftime_now, and its tojson:
json.dumps(ensure_ascii=False)). A case whose template raises records the error instead of a
text. Needs Debian's python3-jinja2.

  /usr/bin/python3 tools/hf_reference/make_jinja_refs.py > tests/data/jinja/cases.json

Cases with their own "context" render with it, the others with the file's shared one.
"""
import json
import os
import sys
from datetime import datetime, timezone

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

NOW = 1733616000  # 2024-12-08 00:00:00 UTC: what strftime_now formats (the test runs in UTC)


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def strftime_now(fmt):
    return datetime.fromtimestamp(NOW, timezone.utc).strftime(fmt)


env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
env.filters["tojson"] = tojson
env.globals["raise_exception"] = raise_exception
env.globals["strftime_now"] = strftime_now

MSGS = [{"role": "system", "content": "  Be brief. "},
        {"role": "user", "content": "Hi, caf\u00e9 \U0001F600"},
        {"role": "assistant", "content": "Hello!", "tool_calls": [
            {"type": "function", "function": {"name": "get", "arguments": {"city": "Paris", "n": 2}}}]},
        {"role": "tool", "content": "{\"t\": 21.5}"},
        {"role": "user", "content": "And tomorrow?"}]
TOOLS = [{"type": "function", "function": {"name": "get", "description": "Weather.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CTX = {"messages": MSGS, "tools": TOOLS, "add_generation_prompt": True, "bos_token": "<s>",
       "eos_token": "</s>"}

CASES = [
    ("text and output", "Hello {{ bos_token }}!"),
    ("whitespace control", "a  {{- ' b ' -}}  c\n  {%- if true %}  d{% endif -%}\n e"),
    ("trim and lstrip blocks", "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\nend"),
    ("plus disables lstrip", "x\n    {%+ if true %}y{% endif %}"),
    ("comments", "a {# note #}b\n{#- strip -#}\n c"),
    ("loop variables", "{% for m in messages %}{{ loop.index0 }}/{{ loop.index }}/{{ loop.revindex }}{{ '!' if loop.first }}{{ '.' if loop.last }}{{ loop.length }} {% endfor %}"),
    ("loop filter and else", "{% for m in messages if m.role == 'user' %}{{ loop.index }}:{{ m.content }};{% else %}none{% endfor %}{% for x in [] %}x{% else %}empty{% endfor %}"),
    ("break and continue", "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i > 4 %}{% break %}{% endif %}{{ i }}{% endfor %}"),
    ("namespace", "{% set ns = namespace(found=false, n=0) %}{% for m in messages %}{% if m.role == 'tool' %}{% set ns.found = true %}{% endif %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.found }} {{ ns.n }}"),
    ("set scoping in loops", "{% set x = 1 %}{% for i in [1, 2] %}{% set x = x + i %}{{ x }}{% endfor %} {{ x }}"),
    ("set block", "{% set block %}A{{ 1 + 1 }}B{% endset %}[{{ block }}]"),
    ("slices", "{{ messages[1:]|length }} {{ messages[-1].content }} {{ 'abcdef'[1:4] }} {{ 'abcdef'[::-1] }} {{ [1,2,3,4][::2] }}"),
    ("tests", "{{ messages[2].tool_calls is defined }} {{ messages[0].tool_calls is defined }} {{ none is none }} {{ 'a' is string }} {{ 3 is number }} {{ {} is mapping }} {{ 4 is divisibleby 2 }} {{ 3 is odd }} {{ x is not defined }} {{ 2 is equalto 2 }}"),
    ("operators", "{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1 + 2 * 3 }} {{ 'a' ~ 1 ~ none }} {{ 'b' in 'abc' }} {{ 2 not in [1, 3] }} {{ 1 == 1.0 }} {{ 'a' < 'b' }} {{ not false and (true or false) }}"),
    ("python repr of values", "{{ none }} {{ true }} {{ [1, 'a', none, 2.5] }} {{ {'k': 'v'} }} {{ 1.0 }} {{ 0.1 + 0.2 }} {{ 1e20 }} {{ \"it's\" }} {{ ['it\\'s'] }}"),
    ("string methods", "{{ '  x y  '.strip() }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'Hello'.startswith('He') }}|{{ 'Hello'.endswith(('x', 'lo')) }}|{{ 'hello world'.title() }}|{{ 'ABC'.lower() }}|{{ 'a-b'.replace('-', '+') }}|{{ 'xxhixx'.strip('x') }}"),
    ("dict methods", "{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %} {{ {'a': 1}.get('a') }} {{ {'a': 1}.get('z', 'd') }} {{ {'a': 1}.keys()|list }}"),
    ("filters", "{{ '  t  '|trim }}|{{ messages|length }}|{{ [3,1,2]|sort }}|{{ [3,1,2]|sort(reverse=true) }}|{{ ['a','b']|join(', ') }}|{{ messages|map(attribute='role')|join(',') }}|{{ messages|selectattr('role', 'equalto', 'user')|list|length }}|{{ messages|rejectattr('role', 'equalto', 'user')|map(attribute='role')|list }}|{{ x|default('dflt') }}|{{ ''|default('e', true) }}|{{ 'abc'|upper }}|{{ 'hello WORLD'|capitalize }}|{{ [1,2]|first }}|{{ [1,2]|last }}|{{ 3.7|int }}|{{ '5'|int + 1 }}|{{ 2.456|round(1) }}|{{ [1,1,2]|unique|list }}|{{ [1,2,3]|sum }}|{{ 'a\\nb'|indent(2) }}|{{ 'x'|string }}"),
    ("tojson", "{{ tools|tojson }}\n{{ tools[0]|tojson(indent=4) }}\n{{ {'b': 1, 'a': [true, none, 'é', 1.5]}|tojson }}\n{{ 'quote \" and \\\\ and \\n'|tojson }}"),
    ("macros", "{% macro render(m, prefix='> ') %}{{ prefix }}{{ m.role }}: {{ m.content|trim }}{% endmacro %}{% for m in messages[:2] %}{{ render(m) }}\n{{ render(m, prefix='* ') }}\n{% endfor %}"),
    ("raise_exception", "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}ok"),
    ("strftime_now", "{{ strftime_now('%d %b %Y') }}"),
    ("ternary and inline if", "{{ 'yes' if messages else 'no' }} {{ 'a' if false }}| {{ (messages|length > 2) and 'long' or 'short' }}"),
    ("attribute of undefined is an error", "{{ missing.attribute }}"),
    ("mistral-style alternation", "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% endif %}{% endfor %}"),
    ("raw", "{% raw %}{{ not rendered }}{% endraw %}"),
]


# The real Llama-3.1 and Qwen2.5 templates of tests/data/chat with what the plain references there
# leave out: tools, a tool call and its result, content parts, a single user turn.
REAL_TEMPLATES = ["llama3.1", "qwen2.5"]
TOOL_CONTEXTS = {
    "tools": {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_123456789", "type": "function",
             "function": {"name": "get", "arguments": {"city": "Paris", "n": 2}}}]},
        {"role": "tool", "name": "get", "tool_call_id": "call_123456789", "content": "{\"t\": 21}"},
        {"role": "user", "content": "Thanks"}]},
    "parts": {"messages": [{"role": "user", "content": [{"type": "text", "text": " one "},
                                                         {"type": "text", "text": "two"}]}]},
    "user_only": {"messages": [{"role": "user", "content": "What is 2+2?"}]},
}


def render(case, template, context):
    try:
        case["text"] = env.from_string(template).render(**context)
    except Exception as e:  # the C++ side must fail too
        case["error"] = str(e)
    return case


def main():
    cases = [render({"name": name, "template": template}, template, CTX)
             for name, template in CASES]
    here = os.path.dirname(os.path.abspath(__file__))
    for model in REAL_TEMPLATES:
        path = os.path.join(here, "..", "..", "tests", "data", "chat", model, "tokenizer_config.json")
        template = json.load(open(path))["chat_template"]
        for name, ctx in TOOL_CONTEXTS.items():
            for generation in (True, False):
                context = dict(ctx, bos_token="<s>", eos_token="</s>",
                               add_generation_prompt=generation)
                cases.append(render({"name": f"{model} {name} {generation}", "template": template,
                                     "context": context}, template, context))
    json.dump({"jinja2_version": jinja2.__version__, "now": NOW, "context": CTX, "cases": cases},
              sys.stdout, ensure_ascii=False, indent=1)
    print()


if __name__ == "__main__":
    main()
