"""Everyday tool-calling checks with the official `openai` and `anthropic` clients, against
any server with OpenAI's (and, for the `anthropic_*` checks, Anthropic's) API: a mesh node or
llama.cpp's server.

    python tests/python/tool_checks.py --base-url http://127.0.0.1:PORT --model M --check NAME
    python tests/python/tool_checks.py --base-url ... --model M --all [--json OUT]

`--check` runs one check and exits non-zero with the reason when it fails (the tests);
`--all` runs the twelve everyday checks (EVERYDAY) and prints one line each and the score
(the side-by-side comparison in docs/models.md). Every request is greedy.
"""

import argparse
import json
import sys

import anthropic
import openai

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. Paris"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current local time in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. Tokyo"}}, "required": ["city"]}}}
TOOLS = [WEATHER, TIME]
ASK_WEATHER = "What is the weather in Paris right now?"
RESULT = '{"city": "Paris", "temperature_c": 18, "condition": "light rain"}'
MARKERS = ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<|end|>", "<|eot_id|>",
           "[TOOL_CALLS]", "<|python_tag|>", "```json")


class Failed(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise Failed(msg)


def no_markers(text):
    found = [m for m in MARKERS if m in (text or "")]
    check(not found, f"marker text {found} in the answer: {text!r}")


def in_words(text):
    """An answer, not a call written out as text."""
    no_markers(text)
    check('"arguments"' not in (text or "") and '{"name"' not in (text or ""),
          f"a call written as text: {text!r}")


def calls_of(msg):
    return [(c.function.name, json.loads(c.function.arguments)) for c in (msg.tool_calls or [])]


def city_is(args, city):
    return city.lower() in str(args.get("city", "")).lower()


def chat(c, model, messages, **kw):
    return c.chat.completions.create(model=model, messages=messages, temperature=0,
                                     max_tokens=kw.pop("max_tokens", 128), **kw)


# ---------------------------------------------------------------- OpenAI client

def plain_call(c, a, model):
    """A tool question gets a parsed call, not prose."""
    r = chat(c, model, [{"role": "user", "content": ASK_WEATHER}], tools=TOOLS)
    calls = calls_of(r.choices[0].message)
    check(len(calls) == 1, f"calls {calls}, content {r.choices[0].message.content!r}")
    check(calls[0][0] == "get_weather" and city_is(calls[0][1], "Paris"), f"call {calls}")
    check(r.choices[0].finish_reason == "tool_calls", r.choices[0].finish_reason)
    no_markers(r.choices[0].message.content)


def streamed_call(c, a, model):
    """The same question streamed: tool-call deltas that join to the call."""
    s = c.chat.completions.create(model=model, temperature=0, max_tokens=128, stream=True,
                                  messages=[{"role": "user", "content": ASK_WEATHER}], tools=TOOLS)
    calls, content, finish = {}, "", None
    for ch in s:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            e = calls.setdefault(tc.index, {"name": "", "args": ""})
            if tc.function and tc.function.name:
                e["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                e["args"] += tc.function.arguments
        finish = ch.choices[0].finish_reason or finish
    check(len(calls) == 1, f"streamed calls {calls}, content {content!r}")
    call = calls[min(calls)]
    check(call["name"] == "get_weather" and city_is(json.loads(call["args"]), "Paris"), f"{call}")
    check(finish == "tool_calls", f"finish_reason {finish}")
    no_markers(content)


def tool_result(c, a, model):
    """After the tool's result the model answers from it."""
    msgs = [{"role": "user", "content": ASK_WEATHER},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": RESULT}]
    r = chat(c, model, msgs, tools=TOOLS)
    m = r.choices[0].message
    check(not m.tool_calls, f"called again: {calls_of(m)}")
    text = (m.content or "").lower()
    check("18" in text or "rain" in text, f"answer does not use the result: {m.content!r}")
    in_words(m.content)


def required(c, a, model):
    """tool_choice `required`: a call even to a greeting."""
    r = chat(c, model, [{"role": "user", "content": "Hello there!"}], tools=TOOLS,
             tool_choice="required")
    calls = calls_of(r.choices[0].message)
    check(calls and all(n in ("get_weather", "get_time") and "city" in a for n, a in calls),
          f"calls {calls}, content {r.choices[0].message.content!r}")


def named(c, a, model):
    """tool_choice naming a function: that function is called."""
    r = chat(c, model, [{"role": "user", "content": "What's the weather like in Rome?"}], tools=TOOLS,
             tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = calls_of(r.choices[0].message)
    check(calls and calls[0][0] == "get_time", f"calls {calls}, content {r.choices[0].message.content!r}")


def choice_none(c, a, model):
    """tool_choice `none`: an answer in words, no call."""
    r = chat(c, model, [{"role": "user", "content": ASK_WEATHER}], tools=TOOLS, tool_choice="none")
    m = r.choices[0].message
    check(not m.tool_calls, f"called {calls_of(m)}")
    check((m.content or "").strip(), "empty answer")
    in_words(m.content)


def system_prompt(c, a, model):
    """The system prompt is followed."""
    r = chat(c, model, [{"role": "system", "content": "Your name is Zorblax. Always tell the user your name when asked."},
                        {"role": "user", "content": "What is your name?"}])
    check("zorblax" in (r.choices[0].message.content or "").lower(), repr(r.choices[0].message.content))
    no_markers(r.choices[0].message.content)


def plain_chat(c, a, model):
    """A chat without tools: text only, no marker text."""
    r = chat(c, model, [{"role": "user", "content": "Say hello in one short sentence."}])
    m = r.choices[0].message
    check((m.content or "").strip() and not m.tool_calls, repr(m.content))
    check(r.choices[0].finish_reason == "stop", r.choices[0].finish_reason)
    no_markers(m.content)


def parallel(c, a, model):
    """Two questions for two tools: both calls."""
    r = chat(c, model, [{"role": "user", "content":
                         "What is the weather in Paris, and what time is it in Tokyo?"}], tools=TOOLS)
    calls = calls_of(r.choices[0].message)
    names = sorted(n for n, _ in calls)
    check(names == ["get_time", "get_weather"], f"calls {calls}, content {r.choices[0].message.content!r}")


# ---------------------------------------------------------------- Anthropic client

A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]


def tool_uses(m):
    return [(b.name, b.input) for b in m.content if b.type == "tool_use"]


def anthropic_tool_use(c, a, model):
    """Anthropic's client gets a tool_use block for a tool question."""
    m = a.messages.create(model=model, max_tokens=128, extra_body={"temperature": 0}, tools=A_TOOLS,
                          messages=[{"role": "user", "content": ASK_WEATHER}])
    uses = tool_uses(m)
    check(len(uses) == 1 and uses[0][0] == "get_weather" and city_is(uses[0][1], "Paris"),
          f"content {m.content}")
    check(m.stop_reason == "tool_use", m.stop_reason)


def anthropic_stream(c, a, model):
    """The same, streamed: the final message holds the tool_use block."""
    with a.messages.stream(model=model, max_tokens=128, extra_body={"temperature": 0}, tools=A_TOOLS,
                           messages=[{"role": "user", "content": ASK_WEATHER}]) as s:
        for _ in s:
            pass
        m = s.get_final_message()
    uses = tool_uses(m)
    check(len(uses) == 1 and uses[0][0] == "get_weather" and city_is(uses[0][1], "Paris"),
          f"content {m.content}")
    check(m.stop_reason == "tool_use", m.stop_reason)


def anthropic_tool_result(c, a, model):
    """After a tool_result block the answer uses it."""
    msgs = [{"role": "user", "content": ASK_WEATHER},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": RESULT}]}]
    m = a.messages.create(model=model, max_tokens=128, extra_body={"temperature": 0}, tools=A_TOOLS, messages=msgs)
    text = "".join(b.text for b in m.content if b.type == "text")
    check(not tool_uses(m), f"called again: {tool_uses(m)}")
    check("18" in text or "rain" in text.lower(), f"answer does not use the result: {text!r}")
    in_words(text)


# ---------------------------------------------------------------- beyond the twelve

def json_schema(c, a, model):
    """response_format json_schema: the answer is JSON with the schema's fields."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    r = chat(c, model, [{"role": "user", "content": "Name the capital of Japan and its country as JSON."}],
             response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}})
    v = json.loads(r.choices[0].message.content)
    check(set(v) == {"city", "country"} and all(isinstance(x, str) for x in v.values()), repr(v))


def logprobs(c, a, model):
    """logprobs with top_logprobs: one entry per token, alternatives sorted, probabilities <= 1."""
    r = chat(c, model, [{"role": "user", "content": "Say hello."}], max_tokens=8, logprobs=True, top_logprobs=3)
    lp = r.choices[0].logprobs.content
    check(len(lp) == r.usage.completion_tokens or len(lp) == r.usage.completion_tokens - 1,
          f"{len(lp)} entries for {r.usage.completion_tokens} tokens")
    for e in lp:
        check(e.logprob <= 0 and len(e.top_logprobs) == 3, repr(e))
        tops = [t.logprob for t in e.top_logprobs]
        check(tops == sorted(tops, reverse=True) and e.logprob <= tops[0] + 1e-4, repr(e))
    # Greedy: each chosen token is the most likely one.
    check(all(e.token == e.top_logprobs[0].token for e in lp), "greedy token is not the top one")


EVERYDAY = [plain_call, streamed_call, tool_result, required, named, choice_none, system_prompt,
            plain_chat, parallel, anthropic_tool_use, anthropic_stream, anthropic_tool_result]
EXTRA = [json_schema, logprobs]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", required=True, help="http://HOST:PORT (no /v1)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--check", help="one check by name")
    ap.add_argument("--all", action="store_true", help="the twelve everyday checks")
    ap.add_argument("--json", help="with --all: write the results here")
    args = ap.parse_args()
    c = openai.OpenAI(base_url=args.base_url + "/v1", api_key="none", timeout=600, max_retries=0)
    a = anthropic.Anthropic(base_url=args.base_url, api_key="none", timeout=600, max_retries=0)
    by_name = {f.__name__: f for f in EVERYDAY + EXTRA}
    if args.check:
        f = by_name[args.check]
        try:
            f(c, a, args.model)
        except Failed as e:
            print(f"FAIL {f.__name__}: {e}", file=sys.stderr)
            sys.exit(1)
        print(f"ok {f.__name__}")
        return
    results = []
    for f in EVERYDAY:
        try:
            f(c, a, args.model)
            results.append({"check": f.__name__, "ok": True})
            print(f"pass  {f.__name__:<22} {f.__doc__}")
        except Exception as e:  # a server error or a refused request is a failed check too
            results.append({"check": f.__name__, "ok": False, "why": f"{type(e).__name__}: {e}"[:300]})
            print(f"FAIL  {f.__name__:<22} {type(e).__name__}: {str(e)[:200]}")
    score = sum(r["ok"] for r in results)
    print(f"{score} of {len(results)} passed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "base_url": args.base_url, "score": score, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
