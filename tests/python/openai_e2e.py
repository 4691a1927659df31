"""Drives a running mesh node with the official `openai` Python client.

    python tests/python/openai_e2e.py --base-url http://127.0.0.1:PORT/v1

Exits non-zero with a message on the first behaviour that differs from what
an OpenAI client expects: plain chat, streaming chat, a tool call, errors.
"""

import argparse
import json
import sys

import openai
from openai import OpenAI

TOOLS = [
    {"type": "function", "function": {
        "name": "weather_get_forecast", "description": "Get the forecast by city and date.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "date": {"type": "string", "description": "Date as YYYY-MM-DD"}}, "required": ["city", "date"]}}},
    {"type": "function", "function": {
        "name": "finance_get_stock_quote", "description": "Get the stock quote by ticker.",
        "parameters": {"type": "object", "properties": {
            "ticker": {"type": "string", "description": "Stock ticker symbol"}}, "required": ["ticker"]}}},
]


def check(cond, msg):
    if not cond:
        print(f"FAIL: {msg}", file=sys.stderr)
        sys.exit(1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", default="t1")
    a = ap.parse_args()
    client = OpenAI(base_url=a.base_url, api_key="unused", max_retries=0, timeout=120)

    models = [m.id for m in client.models.list().data]
    check(a.model in models, f"{a.model} not in {models}")

    # Plain chat.
    r = client.chat.completions.create(model=a.model, temperature=0, max_tokens=32,
                                       messages=[{"role": "user", "content": "Hello!"}])
    check(r.object == "chat.completion", r.object)
    check(r.choices[0].message.role == "assistant", "role")
    check(isinstance(r.choices[0].message.content, str) and r.choices[0].message.content, "plain answer text")
    check(r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, "usage sums")
    print("plain:", repr(r.choices[0].message.content), r.usage.completion_tokens, "tokens")

    # Streaming chat: concatenated deltas equal the non-streamed answer (greedy).
    stream = client.chat.completions.create(model=a.model, temperature=0, max_tokens=32, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": "Hello!"}])
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    check(text.strip() == r.choices[0].message.content, f"stream {text!r} != {r.choices[0].message.content!r}")
    check(finish == r.choices[0].finish_reason, f"finish {finish}")
    check(usage is not None and usage.completion_tokens == r.usage.completion_tokens, "stream usage")
    print("stream: same text, finish", finish)

    # Tool call.
    r = client.chat.completions.create(model=a.model, temperature=0, tools=TOOLS,
                                       messages=[{"role": "user", "content": "What is the forecast in Lima on 2026-03-02?"}])
    msg = r.choices[0].message
    check(r.choices[0].finish_reason == "tool_calls", f"finish {r.choices[0].finish_reason}")
    check(msg.tool_calls and msg.tool_calls[0].function.name == "weather_get_forecast", f"tool {msg.tool_calls}")
    args = json.loads(msg.tool_calls[0].function.arguments)
    check(args == {"city": "Lima", "date": "2026-03-02"}, f"args {args}")
    print("tool call:", msg.tool_calls[0].function.name, args)

    # Streamed tool call.
    stream = client.chat.completions.create(model=a.model, temperature=0, tools=TOOLS, stream=True,
                                            messages=[{"role": "user", "content": "What is the forecast in Lima on 2026-03-02?"}])
    calls = [tc for chunk in stream for ch in chunk.choices for tc in (ch.delta.tool_calls or [])]
    check(len(calls) == 1 and calls[0].function.name == "weather_get_forecast", f"streamed calls {calls}")
    check(json.loads(calls[0].function.arguments) == args, "streamed args")

    # Errors map to the client's exception types.
    try:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
        check(False, "unknown model accepted")
    except openai.NotFoundError as e:
        check(e.status_code == 404, str(e))
    try:
        client.chat.completions.create(model=a.model, messages=[{"role": "user", "content": "x " * 4000}])
        check(False, "oversized prompt accepted")
    except openai.BadRequestError as e:
        check("maximum context length" in str(e), str(e))
    print("errors: 404 and 400 as expected")
    print("openai client e2e: all checks passed")


if __name__ == "__main__":
    main()
