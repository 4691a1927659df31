"""Drives a running mesh node with the official `anthropic` Python client.

    python tests/python/anthropic_e2e.py --base-url http://127.0.0.1:PORT --check NAME

Each check is one behaviour an Anthropic client expects (see CHECKS); the script exits
non-zero with a message when the node's answer differs.
"""

import argparse
import sys

import anthropic
from anthropic import Anthropic

TOOLS = [
    {"name": "weather_get_forecast", "description": "Get the forecast by city and date.",
     "input_schema": {"type": "object", "properties": {
         "city": {"type": "string", "description": "City name"},
         "date": {"type": "string", "description": "Date as YYYY-MM-DD"}}, "required": ["city", "date"]}},
    {"name": "finance_get_stock_quote", "description": "Get the stock quote by ticker.",
     "input_schema": {"type": "object", "properties": {
         "ticker": {"type": "string", "description": "Stock ticker symbol"}}, "required": ["ticker"]}},
]
ASK_WEATHER = [{"role": "user", "content": "What is the forecast in Lima on 2026-03-02?"}]
HELLO = [{"role": "user", "content": "Hello!"}]


def check(cond, msg):
    if not cond:
        print(f"FAIL: {msg}", file=sys.stderr)
        sys.exit(1)


def texts(message):
    return "".join(b.text for b in message.content if b.type == "text")


def plain(c, model):
    m = c.messages.create(model=model, max_tokens=32, messages=HELLO,
                          system="You are a helpful assistant.")
    check(m.type == "message" and m.role == "assistant", f"{m.type} {m.role}")
    check(m.id.startswith("msg_"), m.id)
    check(texts(m), f"answer text {m.content}")
    check(m.stop_reason in ("end_turn", "max_tokens"), m.stop_reason)
    check(m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 0, f"usage {m.usage}")
    check(m.usage.output_tokens > 0, f"usage {m.usage}")
    print("plain:", repr(texts(m)), m.stop_reason, m.usage)


def streaming(c, model):
    whole = c.messages.create(model=model, max_tokens=32, messages=HELLO)
    kinds = []
    with c.messages.stream(model=model, max_tokens=32, messages=HELLO) as s:
        for ev in s:
            kinds.append(ev.type)
        final = s.get_final_message()
    check(kinds[0] == "message_start", f"first event {kinds[:3]}")
    check(kinds[-1] == "message_stop", f"last event {kinds[-3:]}")
    check("content_block_start" in kinds and "content_block_stop" in kinds, f"events {kinds}")
    check(texts(final) == texts(whole), f"stream {texts(final)!r} != {texts(whole)!r}")
    check(final.stop_reason == whole.stop_reason, f"stop {final.stop_reason} != {whole.stop_reason}")
    check(final.usage.output_tokens == whole.usage.output_tokens, f"usage {final.usage} vs {whole.usage}")
    print("stream: same text,", final.stop_reason, len(kinds), "events")


def stop_sequence(c, model):
    whole = texts(c.messages.create(model=model, max_tokens=32, messages=HELLO))
    words = whole.split()
    check(len(words) >= 3, f"a reply long enough to cut: {whole!r}")
    stop = words[2]
    m = c.messages.create(model=model, max_tokens=32, messages=HELLO, stop_sequences=["never-said", stop])
    check(m.stop_reason == "stop_sequence" and m.stop_sequence == stop, f"{m.stop_reason} {m.stop_sequence!r}")
    check(texts(m).strip() == whole[:whole.index(stop)].strip(), f"cut before the stop: {texts(m)!r}")
    print("stop sequence:", repr(stop), repr(texts(m)))


def tool_call(c, model):
    m = c.messages.create(model=model, max_tokens=64, tools=TOOLS, messages=ASK_WEATHER)
    uses = [b for b in m.content if b.type == "tool_use"]
    check(m.stop_reason == "tool_use", f"stop {m.stop_reason}: {m.content}")
    check(len(uses) == 1 and uses[0].name == "weather_get_forecast", f"tool_use {uses}")
    check(isinstance(uses[0].input, dict), f"input {uses[0].input!r}")
    check(uses[0].input == {"city": "Lima", "date": "2026-03-02"}, f"input {uses[0].input}")
    check(uses[0].id.startswith("toolu_"), uses[0].id)
    print("tool call:", uses[0].name, uses[0].input)


def streamed_tool_call(c, model):
    with c.messages.stream(model=model, max_tokens=64, tools=TOOLS,
                           messages=ASK_WEATHER) as s:
        deltas = [ev.delta.type for ev in s if ev.type == "content_block_delta"]
        final = s.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    check("input_json_delta" in deltas, f"deltas {deltas}")
    check(final.stop_reason == "tool_use", f"stop {final.stop_reason}")
    check(len(uses) == 1 and uses[0].input == {"city": "Lima", "date": "2026-03-02"}, f"tool_use {uses}")
    print("streamed tool call:", uses[0].name, uses[0].input)


def tool_result(c, model):
    first = c.messages.create(model=model, max_tokens=64, tools=TOOLS, messages=ASK_WEATHER)
    use = next(b for b in first.content if b.type == "tool_use")
    history = ASK_WEATHER + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": '{"status": "ok", "value": 17, "items": 3}'}]},
    ]
    m = c.messages.create(model=model, max_tokens=48, tools=TOOLS, messages=history)
    check(m.stop_reason in ("end_turn", "max_tokens"), f"stop {m.stop_reason}: {m.content}")
    check("17" in texts(m), f"the answer uses the tool result: {m.content}")
    check(m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
          > first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0),
          "the tool result is part of the prompt")
    print("tool result turn:", repr(texts(m)))


def forced_tool(c, model):
    m = c.messages.create(model=model, max_tokens=64, tools=TOOLS, messages=ASK_WEATHER,
                          tool_choice={"type": "tool", "name": "finance_get_stock_quote"})
    uses = [b for b in m.content if b.type == "tool_use"]
    check(len(uses) == 1 and uses[0].name == "finance_get_stock_quote", f"tool_use {m.content}")
    check(isinstance(uses[0].input, dict) and isinstance(uses[0].input.get("ticker"), str),
          f"input {uses[0].input!r}")
    check(m.stop_reason == "tool_use", m.stop_reason)
    print("forced tool:", uses[0].name, uses[0].input)


def unknown_model(c, model):
    try:
        c.messages.create(model="no-such-model", max_tokens=8, messages=HELLO)
        check(False, "unknown model accepted")
    except anthropic.NotFoundError as e:
        check(e.status_code == 404, str(e))
        check(e.body["type"] == "error" and e.body["error"]["type"] == "not_found_error", f"body {e.body}")
        print("unknown model: 404", e.body["error"]["message"])


def bad_request(c, model):
    try:
        c.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
        check(False, "an image block accepted")
    except anthropic.BadRequestError as e:
        check(e.body["error"]["type"] == "invalid_request_error", f"body {e.body}")
        check("messages[0].content[0]" in e.body["error"]["message"], f"names the block: {e.body}")
        print("bad request: 400", e.body["error"]["message"])


PANTRY = {"name": "kitchen_check_pantry_stock", "description": "Check the pantry stock by query.",
          "input_schema": {"type": "object", "properties": {
              "query": {"type": "string", "description": "Search keywords"},
              "count": {"type": "integer", "description": "How many"}}, "required": ["query"]}}
ASK_PANTRY = [{"role": "user", "content": "Check the pantry stock quantity 47 times 17 matching contract."}]


def thinking(c, model):
    budget = {"type": "enabled", "budget_tokens": 2}
    m = c.messages.create(model=model, max_tokens=96, tools=[PANTRY], messages=ASK_PANTRY, thinking=budget)
    kinds = [b.type for b in m.content]
    check(kinds and kinds[0] == "thinking" and m.content[0].thinking, f"blocks {m.content}")
    mesh = (m.model_extra or {}).get("mesh", {})
    check(mesh.get("reasoning_capped") is True, f"the governor closed the think block: {mesh}")
    check("tool_use" in kinds and m.stop_reason == "tool_use", f"the model still calls the tool: {m.content}")
    with c.messages.stream(model=model, max_tokens=96, tools=[PANTRY], messages=ASK_PANTRY, thinking=budget) as s:
        deltas = [ev.delta.type for ev in s if ev.type == "content_block_delta"]
        streamed = s.get_final_message()
    check("thinking_delta" in deltas, f"deltas {deltas}")
    check(streamed.content[0].thinking == m.content[0].thinking, "the streamed thinking equals the message's")
    print("thinking:", repr(m.content[0].thinking), kinds)


def key_refused(c, model):
    try:
        c.messages.create(model=model, max_tokens=8, messages=HELLO)
        check(False, "a request with a wrong key was served")
    except anthropic.AuthenticationError as e:
        check(e.status_code == 401, str(e))
        check(e.body["error"]["type"] == "authentication_error", f"body {e.body}")
        print("wrong key: 401", e.body["error"]["message"])


def count_tokens(c, model):
    n = c.messages.count_tokens(model=model, messages=ASK_WEATHER, tools=TOOLS)
    m = c.messages.create(model=model, max_tokens=8, messages=ASK_WEATHER, tools=TOOLS)
    used = m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    check(n.input_tokens == used, f"count_tokens {n.input_tokens} != prompt of the reply {used}")
    print("count_tokens:", n.input_tokens)


def cached_tokens(c, model):
    long = [{"role": "user", "content": "Here is the report. " + "The quarterly numbers rose. " * 40
             + "Summarize it."}]
    first = c.messages.create(model=model, max_tokens=4, messages=long)
    second = c.messages.create(model=model, max_tokens=4, messages=long)
    total = second.usage.input_tokens + second.usage.cache_read_input_tokens
    check(total == first.usage.input_tokens + first.usage.cache_read_input_tokens, "same prompt, same size")
    check(second.usage.cache_read_input_tokens > total // 2,
          f"the repeated prompt was mostly reused: {second.usage}")
    print("cached tokens: first", first.usage, "second", second.usage)


def cascade(c, model):
    m = c.messages.create(model="cascade", max_tokens=64, tools=TOOLS, messages=ASK_WEATHER)
    uses = [b for b in m.content if b.type == "tool_use"]
    check(m.model == "cascade", m.model)
    check(len(uses) == 1 and uses[0].name == "weather_get_forecast", f"tool_use {m.content}")
    print("cascade:", uses[0].name, uses[0].input)


CHECKS = {f.__name__: f for f in [plain, streaming, stop_sequence, tool_call, streamed_tool_call, tool_result,
                                  forced_tool, unknown_model, bad_request, thinking, key_refused, count_tokens,
                                  cached_tokens, cascade]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True, help="the node, e.g. http://127.0.0.1:8080 (no /v1)")
    ap.add_argument("--model", default="t1")
    ap.add_argument("--api-key", default="unused")
    ap.add_argument("--check", action="append", choices=sorted(CHECKS),
                    help="default: all but key_refused and cascade (they need a node with keys, or t2)")
    a = ap.parse_args()
    client = Anthropic(base_url=a.base_url, api_key=a.api_key, max_retries=0, timeout=120)
    for name in a.check or sorted(set(CHECKS) - {"key_refused", "cascade"}):
        CHECKS[name](client, a.model)
    print("anthropic client e2e: passed")


if __name__ == "__main__":
    main()
