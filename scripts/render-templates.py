#!/usr/bin/env python3
"""Reference chat-template renderer: renders Hugging Face chat templates the way
`transformers` does, so the server's own renderer can be checked against it.

Usage:  render-templates.py [--transformers 5|4] CASES.json  > RESULTS.json

CASES.json is a JSON list of
    {"template": PATH, "messages": [...], "tools": [...] | null,
     "add_generation_prompt": bool, "bos_token": str, "eos_token": str,
     "extra": {...template kwargs...},
     "now": "2024-09-26T10:00:00"   # optional, test-only: freezes strftime_now
    }
and the output is a JSON list, in the same order, of {"ok": true, "text": ...}
or {"ok": false, "error": "ExceptionType: message"}.

What it mirrors (transformers wheels 5.25.0 and 4.57.1, no other dependency than jinja2):
  * transformers/utils/chat_template_utils.py `_cached_compile_jinja_template`
    (5.25.0 l.569-671; 4.57.1 `_compile_jinja_template` l.393-463): ImmutableSandboxedEnvironment with
    trim_blocks=True, lstrip_blocks=True, extensions [generation-tag tracker, jinja2.ext.loopcontrols];
    filter `tojson` replaced by json.dumps(x, ensure_ascii=False, indent=None, separators=None,
    sort_keys=False); globals raise_exception (raises TemplateError) and strftime_now
    (datetime.now().strftime); 5.x only: globals `dict` and `namespace` replaced by restricted versions.
    Other Environment options are Jinja defaults (Undefined, autoescape off, keep_trailing_newline=False).
  * `render_jinja_template` (5.25.0 l.764-891; 4.57.1 l.466-565): template.render(messages=chat,
    tools=tool_schemas, documents=documents, add_generation_prompt=..., **kwargs). `tools` and `documents`
    are ALWAYS passed, as None when absent, so `tools is defined` is true even with no tools.
    5.x only: the chat goes through `_alias_reasoning_fields` (l.678-688).
  * tokenization_utils_base.py `apply_chat_template` (5.25.0 l.3040-3186; 4.57.1 l.1546-1675):
    5.x only: `_normalize_chat_messages` drops every top-level message key whose value is None
    (l.3161, chat_template_utils.py l.712-725); kwargs = {**tokenizer.special_tokens_map, **kwargs}
    (5.25.0 l.3176; 4.57.1 l.1665), i.e. `extra` overrides bos_token/eos_token.
"""
import argparse
import json
import sys
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # 5.25.0 l.675
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Generation(jinja2.ext.Extension):
    # transformers' AssistantTracker: `{% generation %}...{% endgeneration %}` renders its body unchanged
    # (it only records assistant spans for return_assistant_tokens_mask, which we don't need).
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class TemplateDict:  # 5.x: `dict` global without attribute access to the dict type
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class TemplateNamespace(jinja2.utils.Namespace):  # 5.x: namespace() refusing "_"-prefixed attributes
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute."
            )


NOW = None  # set per case from the optional "now" field; None means the real clock, as transformers


def compile_template(source, major):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return (NOW or datetime.now()).strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    if major >= 5:
        env.globals["dict"] = TemplateDict()
        env.globals["namespace"] = TemplateNamespace
    return env.from_string(source)


def prepare_messages(messages, major):
    if major < 5:
        return messages
    # apply_chat_template: drop keys whose value is None (content: null disappears, it is not `none`)
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    # render_jinja_template: copy reasoning under `thinking` and `reasoning_content`
    out = []
    for m in messages:
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render_case(case, major):
    global NOW
    NOW = datetime.fromisoformat(case["now"]) if case.get("now") else None
    with open(case["template"], encoding="utf-8") as f:
        template = compile_template(f.read(), major)
    kwargs = {k: case[k] for k in SPECIAL_TOKENS if case.get(k) is not None}  # tokenizer.special_tokens_map
    kwargs.update(case.get("extra") or {})  # kwargs overwrite special tokens
    return template.render(
        messages=prepare_messages(case["messages"], major),
        tools=case.get("tools"),  # None when absent: passed anyway, like transformers
        documents=case.get("documents"),
        add_generation_prompt=bool(case.get("add_generation_prompt", False)),
        **kwargs,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--transformers", type=int, choices=(4, 5), default=5, help="major version to mirror")
    ap.add_argument("cases")
    args = ap.parse_args()
    with open(args.cases, encoding="utf-8") as f:
        cases = json.load(f)
    results = []
    for case in cases:
        try:
            results.append({"ok": True, "text": render_case(case, args.transformers)})
        except Exception as e:  # template errors are results, not crashes
            results.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
    json.dump(results, sys.stdout, ensure_ascii=False, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
