"""Seeded, deterministic synthetic agent corpus for the bundled tier models.

The corpus is built from a generated tool catalog (>= 200 tools over >= 10
domains, each with a JSON-schema parameter block) and four task kinds:

  call      one tool call whose arguments are copied from the request
  hard      a short reasoning trace in <think>...</think> first: multi-digit
            arithmetic on an argument (worked steps), a unit conversion from
            mixed units, picking between two similar tools by a stated (or
            computed) constraint, or a two-call plan
  none      no offered tool fits: a fixed refusal
  result    the turn after a tool result: answer from the result's fields

Everything is a pure function of (seed, split): `python3 corpus.py --help`.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, field

# ---------------------------------------------------------------------------
# Chat format. Each marker is a single token in the bundled tokenizer.
BOS = "<s>"
SYS, USR, AST, TOOL, END = "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"
THINK, ETHINK = "<think>", "</think>"
CALL, ECALL = "<tool_call>", "</tool_call>"
TOOLS, ETOOLS = "<tools>", "</tools>"
SPECIAL_TOKENS = [SYS, USR, AST, TOOL, END, THINK, ETHINK, CALL, ECALL, TOOLS, ETOOLS]

SYSTEM_PROMPT = "You are a helpful agent. Call a tool when one fits the request, otherwise answer directly."
REFUSAL = "None of the available tools can do that."

# ---------------------------------------------------------------------------
# Parameter kinds: JSON schema, value generator and how a request phrases them.

CITIES = ["Paris", "Berlin", "Tokyo", "Lima", "Cairo", "Oslo", "Austin", "Denver", "Madrid", "Rome",
          "Seoul", "Dublin", "Zurich", "Nairobi", "Sydney", "Toronto", "Boston", "Lisbon", "Prague",
          "Vienna", "Mumbai", "Bangkok", "Quito", "Havana", "Athens", "Helsinki", "Warsaw", "Porto",
          "Kyoto", "Denpasar", "Santiago", "Montreal", "Chicago", "Seattle", "Miami", "Phoenix"]
PEOPLE = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy", "Mallory",
          "Niaj", "Olivia", "Peggy", "Rupert", "Sybil", "Trent", "Victor", "Walter", "Yara", "Zoe",
          "Omar", "Priya", "Chen", "Lucas", "Mia", "Noah", "Emma", "Liam", "Sofia"]
WORDS = ["invoice", "backup", "holiday", "report", "budget", "launch", "meeting", "draft", "refund",
         "roadmap", "outage", "release", "contract", "survey", "training", "audit", "migration",
         "payroll", "deadline", "feedback", "pricing", "shipping", "security", "onboarding"]
TICKERS = ["AAPL", "MSFT", "NVDA", "AMZN", "GOOG", "TSLA", "META", "ARM", "INTC", "AMD", "ORCL", "IBM"]
CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "SEK"]
LANGS = ["en", "fr", "de", "es", "ja", "it", "pt"]
PRIORITIES = ["low", "medium", "high"]
GENRES = ["jazz", "rock", "pop", "classical", "hiphop", "ambient", "folk"]
COLORS = ["red", "blue", "green", "white", "warm", "cool"]
ROOMS = ["kitchen", "bedroom", "office", "garage", "hallway", "living room"]
SERVICES = ["api", "billing", "search", "auth", "gateway", "worker", "scheduler", "frontend"]
ENVS = ["dev", "staging", "prod"]
FORMATS = ["pdf", "csv", "json", "xlsx"]


def _date(r: random.Random) -> str:
    return f"2026-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"


def _time(r: random.Random) -> str:
    return f"{r.randint(6, 21):02d}:{r.choice(['00', '15', '30', '45'])}"


def _id(prefix: str):
    return lambda r: f"{prefix}-{r.randint(1000, 9999)}"


@dataclass(frozen=True)
class ParamKind:
    """A reusable parameter: schema fragment, value generator, request phrases."""

    name: str
    schema: dict
    gen: object  # Callable[[random.Random], value]
    phrases: tuple[str, ...]  # each contains "{v}"


def _enum(name, values, desc, phrases):
    return ParamKind(name, {"type": "string", "enum": values, "description": desc},
                     lambda r, v=values: r.choice(v), phrases)


PARAMS: dict[str, ParamKind] = {p.name: p for p in [
    ParamKind("city", {"type": "string", "description": "City name"}, lambda r: r.choice(CITIES),
              ("in {v}", "for {v}")),
    ParamKind("date", {"type": "string", "description": "Date as YYYY-MM-DD"}, _date,
              ("on {v}", "for {v}")),
    ParamKind("time", {"type": "string", "description": "Time as HH:MM"}, _time, ("at {v}",)),
    ParamKind("person", {"type": "string", "description": "Person name"}, lambda r: r.choice(PEOPLE),
              ("for {v}", "with {v}")),
    ParamKind("recipient", {"type": "string", "description": "Recipient name"}, lambda r: r.choice(PEOPLE),
              ("to {v}",)),
    ParamKind("query", {"type": "string", "description": "Search keywords"}, lambda r: r.choice(WORDS),
              ("about {v}", "matching {v}")),
    ParamKind("topic", {"type": "string", "description": "Topic or title"}, lambda r: r.choice(WORDS),
              ("titled {v}", "called {v}")),
    ParamKind("ticker", {"type": "string", "description": "Stock ticker symbol"}, lambda r: r.choice(TICKERS),
              ("for {v}",)),
    ParamKind("currency", {"type": "string", "enum": CURRENCIES, "description": "ISO currency code"},
              lambda r: r.choice(CURRENCIES), ("in {v}",)),
    ParamKind("amount", {"type": "integer", "description": "Amount in whole units"},
              lambda r: r.randint(5, 900), ("of {v}", "for {v}")),
    ParamKind("limit", {"type": "integer", "description": "Maximum number of results"},
              lambda r: r.randint(1, 10), ("limit {v}", "top {v}")),
    ParamKind("count", {"type": "integer", "description": "How many"}, lambda r: r.randint(1, 9),
              ("count {v}", "quantity {v}")),
    ParamKind("order_id", {"type": "string", "description": "Order identifier"}, _id("ORD"), ("for order {v}",)),
    ParamKind("account_id", {"type": "string", "description": "Account identifier"}, _id("ACC"),
              ("for account {v}",)),
    ParamKind("ticket_id", {"type": "string", "description": "Ticket identifier"}, _id("TCK"),
              ("for ticket {v}",)),
    ParamKind("path", {"type": "string", "description": "File path"},
              lambda r: f"/data/{r.choice(WORDS)}/{r.choice(WORDS)}.{r.choice(FORMATS)}", ("at {v}",)),
    ParamKind("language", {"type": "string", "enum": LANGS, "description": "Language code"},
              lambda r: r.choice(LANGS), ("in language {v}",)),
    ParamKind("priority", {"type": "string", "enum": PRIORITIES, "description": "Priority level"},
              lambda r: r.choice(PRIORITIES), ("with {v} priority",)),
    ParamKind("genre", {"type": "string", "enum": GENRES, "description": "Music genre"},
              lambda r: r.choice(GENRES), ("in the {v} genre",)),
    ParamKind("room", {"type": "string", "enum": ROOMS, "description": "Room in the home"},
              lambda r: r.choice(ROOMS), ("in the {v}",)),
    ParamKind("color", {"type": "string", "enum": COLORS, "description": "Light color"},
              lambda r: r.choice(COLORS), ("to {v} light",)),
    ParamKind("service", {"type": "string", "enum": SERVICES, "description": "Service name"},
              lambda r: r.choice(SERVICES), ("for the {v} service",)),
    ParamKind("env", {"type": "string", "enum": ENVS, "description": "Deployment environment"},
              lambda r: r.choice(ENVS), ("in {v}",)),
    ParamKind("format", {"type": "string", "enum": FORMATS, "description": "Output format"},
              lambda r: r.choice(FORMATS), ("as {v}",)),
    ParamKind("flag", {"type": "boolean", "description": "Include archived items"},
              lambda r: True, ("including archived items",)),
    # Unit-bearing parameters: hard tasks state them in another unit.
    ParamKind("minutes", {"type": "integer", "description": "Duration in minutes"},
              lambda r: r.randint(5, 180), ("for {v} minutes",)),
    ParamKind("celsius", {"type": "integer", "description": "Temperature in degrees Celsius"},
              lambda r: r.randint(5, 30), ("to {v} C",)),
    ParamKind("grams", {"type": "integer", "description": "Weight in grams"},
              lambda r: r.randint(50, 5000), ("of {v} grams",)),
    ParamKind("hours", {"type": "integer", "description": "Duration in hours"},
              lambda r: r.randint(1, 96), ("for {v} hours",)),
]}

# Parameters that hard tasks state in another unit (`convert_problem` does the
# conversion): param -> (other unit phrase, to_other, think template)
CONVERSIONS = {
    "minutes": ("hours", lambda v: v // 60 if v % 60 == 0 else None, "{o} hours * 60 = {v} minutes"),
    "hours": ("days", lambda v: v // 24 if v % 24 == 0 else None, "{o} days * 24 = {v} hours"),
    "grams": ("kilograms", lambda v: v // 1000 if v % 1000 == 0 else None, "{o} kg * 1000 = {v} grams"),
    "celsius": ("F", lambda v: v * 9 // 5 + 32 if v % 5 == 0 else None, "({o} F - 32) * 5 / 9 = {v} C"),
}

# ---------------------------------------------------------------------------
# Domains: entities with the parameters their tools take. Tools are
# {domain}_{action}_{entity}; every domain also gets a limited search and a bulk
# search of one entity (deliberately similar tools told apart by a constraint).

ACTIONS = {
    "get": ("Get", ["What is the {e} {p}?", "Get the {e} {p}.", "Show me the {e} {p}.", "I need the {e} {p}."]),
    "list": ("List", ["List the {e}s {p}.", "Show all {e}s {p}.", "Which {e}s are there {p}?"]),
    "create": ("Create", ["Create a {e} {p}.", "Please add a new {e} {p}.", "Make a {e} {p}."]),
    "update": ("Update", ["Update the {e} {p}.", "Change the {e} {p}.", "Modify the {e} {p}."]),
    "delete": ("Delete", ["Delete the {e} {p}.", "Remove the {e} {p}.", "Cancel the {e} {p}."]),
    "send": ("Send", ["Send a {e} {p}.", "Please send the {e} {p}."]),
    "check": ("Check", ["Check the {e} {p}.", "Can you check the {e} {p}?"]),
    "book": ("Book", ["Book a {e} {p}.", "Reserve a {e} {p}."]),
    "set": ("Set", ["Set the {e} {p}.", "Adjust the {e} {p}."]),
    "start": ("Start", ["Start a {e} {p}.", "Begin a {e} {p}."]),
    "search": ("Search", ["Search {e}s {p}.", "Find {e}s {p}."]),
    "bulk_search": ("Search", ["Search {e}s {p}.", "Find {e}s {p}."]),
}
READ_ONLY_ACTIONS = {"get", "list", "check", "search", "bulk_search"}

DOMAINS: dict[str, list[tuple[str, list[str], list[str], list[str]]]] = {
    # domain: [(entity, actions, required params, optional params)]
    "weather": [
        ("current weather", ["get"], ["city"], []),
        ("forecast", ["get"], ["city", "date"], []),
        ("air quality", ["get", "check"], ["city"], ["date"]),
        ("rain alert", ["create", "delete"], ["city"], ["time"]),
        ("uv index", ["get"], ["city"], ["date"]),
        ("storm warning", ["list", "get"], ["city"], ["limit"]),
        ("pollen count", ["get", "check"], ["city"], ["date"]),
    ],
    "finance": [
        ("stock quote", ["get"], ["ticker"], ["currency"]),
        ("account balance", ["get", "check"], ["account_id"], ["currency"]),
        ("payment", ["send", "list"], ["recipient", "amount"], ["currency"]),
        ("invoice", ["create", "get", "delete"], ["account_id", "amount"], ["date"]),
        ("exchange rate", ["get"], ["currency"], ["date"]),
        ("budget", ["set", "get"], ["amount"], ["currency"]),
    ],
    "travel": [
        ("flight", ["book", "list", "delete"], ["city", "date"], ["count"]),
        ("hotel", ["book", "list"], ["city", "date"], ["count"]),
        ("train ticket", ["book", "check"], ["city", "date"], ["time"]),
        ("car rental", ["book", "delete"], ["city", "date"], ["hours"]),
        ("visa requirement", ["check"], ["city"], ["language"]),
    ],
    "calendar": [
        ("meeting", ["create", "delete", "update", "list"], ["person", "date"], ["time", "minutes"]),
        ("reminder", ["create", "delete", "list"], ["topic", "date"], ["time"]),
        ("event", ["create", "get"], ["topic", "date"], ["city"]),
        ("availability", ["check"], ["person", "date"], []),
        ("timer", ["start", "delete"], ["minutes"], ["topic"]),
    ],
    "email": [
        ("email", ["send", "list", "delete"], ["recipient", "topic"], ["priority"]),
        ("draft", ["create", "update"], ["recipient", "topic"], []),
        ("inbox summary", ["get"], ["person"], ["limit"]),
        ("mailing list", ["create", "delete"], ["topic"], ["person"]),
    ],
    "files": [
        ("file", ["get", "delete"], ["path"], ["format"]),
        ("folder listing", ["get"], ["path"], ["flag", "limit"]),
        ("file export", ["create"], ["path", "format"], []),
        ("file share", ["create", "delete"], ["path", "person"], []),
        ("backup", ["start", "check", "list"], ["path"], ["hours"]),
    ],
    "shopping": [
        ("order", ["get", "delete", "list"], ["order_id"], ["flag"]),
        ("cart item", ["create", "delete"], ["query", "count"], []),
        ("product price", ["get", "check"], ["query"], ["currency"]),
        ("shipment", ["get", "check"], ["order_id"], []),
        ("parcel", ["send"], ["recipient", "grams"], ["priority"]),
        ("coupon", ["check"], ["query"], ["amount"]),
    ],
    "music": [
        ("playlist", ["create", "delete", "get"], ["topic"], ["genre"]),
        ("song", ["start", "get"], ["query"], ["genre"]),
        ("radio station", ["start"], ["genre"], ["city"]),
        ("sleep timer", ["set"], ["minutes"], []),
    ],
    "maps": [
        ("route", ["get"], ["city"], ["time"]),
        ("travel time", ["get", "check"], ["city"], ["time"]),
        ("parking spot", ["book", "list"], ["city", "hours"], []),
        ("nearby restaurant", ["list", "book"], ["city", "count"], ["time"]),
        ("traffic report", ["get"], ["city"], []),
    ],
    "smart_home": [
        ("thermostat", ["set", "get"], ["room", "celsius"], []),
        ("light", ["set"], ["room", "color"], []),
        ("door lock", ["check", "set"], ["room"], []),
        ("vacuum run", ["start"], ["room", "minutes"], []),
        ("camera clip", ["list", "delete"], ["room", "date"], ["limit"]),
        ("oven", ["set", "start"], ["celsius", "minutes"], []),
    ],
    "health": [
        ("appointment", ["book", "delete", "list"], ["person", "date"], ["time"]),
        ("prescription", ["get", "check"], ["person"], []),
        ("step count", ["get"], ["person", "date"], []),
        ("meal log", ["create"], ["topic", "grams"], ["date"]),
        ("sleep report", ["get"], ["person", "date"], []),
    ],
    "devops": [
        ("deployment", ["start", "check", "list"], ["service", "env"], ["priority"]),
        ("log", ["get", "list"], ["service", "env"], ["limit"]),
        ("alert", ["create", "delete", "list"], ["service", "priority"], ["env"]),
        ("scale setting", ["set"], ["service", "count"], ["env"]),
        ("incident", ["create", "update", "get"], ["ticket_id", "service"], ["priority"]),
        ("maintenance window", ["book"], ["service", "hours"], ["date"]),
    ],
    "support": [
        ("ticket", ["create", "update", "delete", "get"], ["ticket_id", "topic"], ["priority"]),
        ("customer profile", ["get", "update"], ["account_id"], ["language"]),
        ("refund", ["create", "check"], ["order_id", "amount"], ["currency"]),
        ("callback", ["book"], ["person", "time"], ["date"]),
    ],
    "database": [
        ("table", ["create", "delete", "list"], ["topic", "env"], []),
        ("query plan", ["get", "check"], ["topic", "env"], []),
        ("snapshot", ["create", "delete", "list"], ["service", "env"], ["date"]),
        ("replica", ["set", "check"], ["service", "count"], ["env"]),
        ("index", ["create", "delete"], ["topic"], ["env"]),
    ],
    "hr": [
        ("leave request", ["create", "delete", "check"], ["person", "date"], ["hours"]),
        ("payslip", ["get", "send"], ["person"], ["format"]),
        ("job posting", ["create", "update", "list"], ["topic", "city"], ["count"]),
        ("interview", ["book", "delete"], ["person", "date"], ["time", "minutes"]),
        ("team roster", ["get"], ["topic"], ["limit"]),
    ],
    "kitchen": [
        ("recipe", ["get", "list"], ["query"], ["count", "language"]),
        ("grocery item", ["create", "delete"], ["query", "grams"], []),
        ("cooking timer", ["start", "delete"], ["minutes"], ["topic"]),
        ("meal plan", ["create", "get"], ["person", "date"], []),
        ("pantry stock", ["check", "update"], ["query"], ["count"]),
    ],
    "news": [
        ("headline", ["list", "get"], ["query"], ["limit", "language"]),
        ("news digest", ["create", "send"], ["topic", "recipient"], ["language"]),
        ("article translation", ["create"], ["topic", "language"], []),
        ("sports score", ["get"], ["city"], ["date"]),
    ],
}

SEARCH_ENTITY = {  # domain -> entity searched by the similar pair
    "weather": ("station", "city"), "finance": ("transaction", "query"), "travel": ("deal", "city"),
    "calendar": ("note", "query"), "email": ("message", "query"), "files": ("document", "query"),
    "shopping": ("product", "query"), "music": ("track", "query"), "maps": ("place", "city"),
    "smart_home": ("device", "room"), "health": ("record", "person"), "devops": ("metric", "service"),
    "support": ("case", "query"), "news": ("story", "query"), "database": ("row", "query"),
    "hr": ("employee", "person"), "kitchen": ("ingredient", "query"),
}
SEARCH_CAP = 10


@dataclass
class Tool:
    """One tool of the catalog."""

    name: str
    domain: str
    action: str
    entity: str
    required: list[str]
    optional: list[str]
    description: str
    read_only: bool
    bulk: bool = False
    similar: list[str] = field(default_factory=list)

    def schema(self) -> dict:
        props = {p: dict(PARAMS[p].schema) for p in self.required + self.optional}
        if self.bulk:
            props["limit"] = {"type": "integer", "description": f"Number of results, more than {SEARCH_CAP}"}
        elif self.action == "search":
            props["limit"] = {"type": "integer", "description": f"Number of results, at most {SEARCH_CAP}"}
        req = list(self.required) + (["limit"] if self.action in ("search", "bulk_search") else [])
        return {"name": self.name, "description": self.description,
                "parameters": {"type": "object", "properties": props, "required": req}}

    def schema_text(self) -> str:
        return json.dumps(self.schema(), separators=(", ", ": "))


def build_catalog() -> list[Tool]:
    """The full, fixed tool catalog (order is stable)."""
    tools: list[Tool] = []
    for domain, entities in DOMAINS.items():
        for entity, actions, req, opt in entities:
            for action in actions:
                verb = ACTIONS[action][0]
                slug = entity.replace(" ", "_")
                name = f"{domain}_{action}_{slug}"
                where = " and ".join(p.replace("_", " ") for p in req)
                desc = f"{verb} the {entity} by {where}."
                tools.append(Tool(name, domain, action, entity, list(req), list(opt), desc,
                                  action in READ_ONLY_ACTIONS))
        ent, key = SEARCH_ENTITY[domain]
        a = Tool(f"{domain}_search_{ent}s", domain, "search", ent, [key], [],
                 f"Search {ent}s by {key}. Returns at most {SEARCH_CAP} results.", True)
        b = Tool(f"{domain}_bulk_search_{ent}s", domain, "bulk_search", ent, [key], [],
                 f"Search {ent}s by {key} in bulk. Use for more than {SEARCH_CAP} results.", True, bulk=True)
        a.similar, b.similar = [b.name], [a.name]
        tools += [a, b]
    by_entity: dict[tuple[str, str], list[Tool]] = {}
    for t in tools:
        by_entity.setdefault((t.domain, t.entity), []).append(t)
    for group in by_entity.values():
        for t in group:
            t.similar = sorted({*t.similar, *(o.name for o in group if o is not t)})
    return tools


def heldout_tool_names(tools: list[Tool], seed: int = 7) -> set[str]:
    """About 8% of tools (never a search pair) are never shown in training."""
    r = random.Random(seed)
    pool = [t.name for t in tools if t.action not in ("search", "bulk_search")]
    return set(r.sample(pool, k=len(tools) * 8 // 100))


# ---------------------------------------------------------------------------
# Example rendering.

def render_system(tools: list[Tool]) -> str:
    lines = "\n".join(t.schema_text() for t in tools)
    return f"{SYS}{SYSTEM_PROMPT}\n{TOOLS}\n{lines}\n{ETOOLS}{END}"


def render_call(name: str, args: dict) -> str:
    return f"{CALL}{json.dumps({'name': name, 'arguments': args}, separators=(', ', ': '))}{ECALL}"


def phrase_request(r: random.Random, tool: Tool, args: dict, override: dict | None = None) -> str:
    """A user request that states every argument (override replaces a phrase)."""
    override = override or {}
    parts = []
    for p in args:
        if p == "limit" and tool.action in ("search", "bulk_search"):
            continue
        parts.append(override.get(p) or r.choice(PARAMS[p].phrases).format(v=_fmt(args[p])))
    r.shuffle(parts)
    tmpl = r.choice(ACTIONS[tool.action][1]) if tool.action in ACTIONS else "{p}"
    text = tmpl.format(e=tool.entity, p=" ".join(parts))
    for vowel in "aeiou":
        text = text.replace(f" a {vowel}", f" an {vowel}")
    return text.replace("  ", " ").replace(" .", ".").replace(" ?", "?")


def _fmt(v) -> str:
    return "true" if v is True else str(v)


def gen_args(r: random.Random, tool: Tool) -> dict:
    args = {p: PARAMS[p].gen(r) for p in tool.required}
    for p in tool.optional:
        if r.random() < 0.4:
            args[p] = PARAMS[p].gen(r)
    return args


def offered_tools(r: random.Random, target: Tool | None, pool: list[Tool], by_name: dict[str, Tool],
                  must: list[Tool] = ()) -> list[Tool]:
    """Target plus similar tools plus random distractors, shuffled (3-7 tools)."""
    chosen = {t.name: t for t in must}
    if target is not None:
        chosen[target.name] = target
        for s in target.similar:
            if s in by_name and r.random() < 0.6:
                chosen[s] = by_name[s]
    want = r.randint(3, 7)
    while len(chosen) < want:
        t = r.choice(pool)
        chosen.setdefault(t.name, t)
    out = list(chosen.values())
    r.shuffle(out)
    return out


def result_for(r: random.Random, tool: Tool, args: dict) -> dict:
    """A plausible tool result with 2-3 fields."""
    fields = {"status": r.choice(["ok", "done", "pending", "confirmed"])}
    if tool.action in ("get", "check", "list", "search", "bulk_search"):
        fields["value"] = r.randint(1, 999)
        fields["items"] = r.randint(0, 40)
    else:
        fields["id"] = f"{tool.domain[:3].upper()}-{r.randint(100, 999)}"
    return fields


@dataclass
class Example:
    """One chat example: prompt (ends with the assistant marker) and completion."""

    kind: str
    sub: str
    prompt: str
    completion: str
    tool: str | None = None

    def text(self) -> str:
        return self.prompt + self.completion

    def to_json(self) -> dict:
        return {"kind": self.kind, "sub": self.sub, "tool": self.tool,
                "prompt": self.prompt, "completion": self.completion}


def make_call(r, tool, pool, by_name) -> Example:
    args = gen_args(r, tool)
    req = phrase_request(r, tool, args)
    if tool.action == "search":
        args["limit"] = r.randint(1, SEARCH_CAP)
        req = req.rstrip(".?") + f", {args['limit']} results."
    elif tool.action == "bulk_search":
        args["limit"] = r.randint(SEARCH_CAP + 1, 60)
        req = req.rstrip(".?") + f", {args['limit']} results."
    prompt = render_system(offered_tools(r, tool, pool, by_name)) + f"{USR}{req}{END}{AST}"
    return Example("call", "single", prompt, render_call(tool.name, args) + END, tool.name)


def hard_subs(tool: Tool) -> list[str]:
    """Hard sub-kinds a tool supports."""
    subs = []
    if any(PARAMS[p].schema["type"] == "integer" and p not in CONVERSIONS for p in tool.required + tool.optional):
        subs.append("arith")
    if any(p in CONVERSIONS for p in tool.required + tool.optional):
        subs.append("convert")
    if tool.action in ("search", "bulk_search"):
        subs.append("choose")
    else:
        subs.append("plan")
    return subs


def arith_problem(r: random.Random) -> tuple[int, str, str]:
    """(value, how the request says it, the worked steps ending in the value).

    Four-digit sums and differences, three-digit by two-digit products split
    by place value (each partial product still done in one step) and
    two-operation chains. Every carry has to be worked out before the first
    digit of the result is written, which takes depth and width a small
    model lacks: the easy forms are within every tier's reach, the long ones
    separate the tiers, which is what a cascade needs to see."""
    form = r.choice(["add", "sub", "mul", "mul", "chain"])
    if form == "add":
        a, b = r.randint(1000, 8999), r.randint(100, 8999)
        v = a + b
        return v, f"{a} plus {b}", f"{a} + {b} = {v}"
    if form == "sub":
        a = r.randint(1500, 9999)
        b = r.randint(100, a - 100)
        v = a - b
        return v, f"{a} minus {b}", f"{a} - {b} = {v}"
    if form == "mul":
        a, b = r.randint(102, 999), r.randint(12, 99)
        v = a * b
        hi, lo = b - b % 10, b % 10
        if lo == 0:
            return v, f"{a} times {b}", f"{a} * {b} = {v}"
        return v, f"{a} times {b}", f"{a} * {b} = {a} * {hi} + {a} * {lo} = {a * hi} + {a * lo} = {v}"
    a, b, c = r.randint(12, 99), r.randint(3, 9), r.randint(10, 999)
    if r.random() < 0.5:
        v = a * b + c
        return v, f"{a} times {b} plus {c}", f"{a} * {b} = {a * b}, {a * b} + {c} = {v}"
    c = r.randint(1, a * b - 1)
    v = a * b - c
    return v, f"{a} times {b} minus {c}", f"{a} * {b} = {a * b}, {a * b} - {c} = {v}"


def convert_problem(r: random.Random, p: str) -> tuple[int, str, str]:
    """(value in the parameter's unit, how the request says it, the worked steps).

    Two-digit multipliers (up to 30 days, 12 hours, 40 kg) and odd remainders,
    so the product is not a memorised table entry."""
    if p == "minutes":
        h = r.randint(1, 12)
        form = r.choice(["whole", "mixed", "half"])
        if form == "whole":
            v = 60 * h
            return v, f"for {h} hours", f"{h} hours * 60 = {v} minutes"
        if form == "half":
            v = 60 * h + 30
            return v, f"for {h}.5 hours", f"{h}.5 hours * 60 = {v} minutes"
        m = r.randint(1, 59)
        v = 60 * h + m
        return v, f"for {h} hours {m} minutes", f"{h} * 60 + {m} = {v} minutes"
    if p == "hours":
        d = r.randint(1, 30)
        if r.random() < 0.4:
            v = 24 * d
            return v, f"for {d} days", f"{d} days * 24 = {v} hours"
        h = r.randint(1, 23)
        v = 24 * d + h
        return v, f"for {d} days {h} hours", f"{d} * 24 + {h} = {v} hours"
    if p == "grams":
        kg = r.randint(1, 40)
        form = r.choice(["whole", "decimal", "mixed"])
        if form == "whole":
            v = 1000 * kg
            return v, f"of {kg} kg", f"{kg} kg * 1000 = {v} grams"
        if form == "decimal":
            t = r.randint(1, 9)
            v = 1000 * kg + 100 * t
            return v, f"of {kg}.{t} kg", f"{kg}.{t} kg * 1000 = {v} grams"
        g = r.randint(1, 999)
        v = 1000 * kg + g
        return v, f"of {kg} kg {g} g", f"{kg} * 1000 + {g} = {v} grams"
    # celsius from Fahrenheit: (F - 32) * 5 / 9
    c = 5 * r.randint(1, 20)
    f = c * 9 // 5 + 32
    return c, f"to {f} F", f"({f} F - 32) * 5 / 9 = {f - 32} * 5 / 9 = {c} C"


HARD_SUBS = ["arith", "convert", "choose", "plan"]


def make_hard(r, tool, pool, by_name, sub: str | None = None) -> Example | None:
    subs = []
    ints = [p for p in tool.required + tool.optional if PARAMS[p].schema["type"] == "integer" and p not in CONVERSIONS]
    convs = [p for p in tool.required + tool.optional if p in CONVERSIONS]
    if ints:
        subs.append("arith")
    if convs:
        subs.append("convert")
    if tool.action in ("search", "bulk_search"):
        subs.append("choose")
    subs.append("plan")
    sub = sub if sub in subs else r.choice(subs)
    args = gen_args(r, tool)
    if sub == "arith":
        p = r.choice(ints)
        v, said, think = arith_problem(r)
        args[p] = v
        say = r.choice(PARAMS[p].phrases).format(v=said)
        req = phrase_request(r, tool, args, {p: say})
        think = f"{p} = {think}"
    elif sub == "convert":
        p = r.choice(convs)
        v, say, think = convert_problem(r, p)
        args[p] = v
        req = phrase_request(r, tool, args, {p: say})
    elif sub == "choose":
        if r.random() < 0.5:
            n = r.choice([r.randint(1, SEARCH_CAP), r.randint(SEARCH_CAP + 1, 60)])
            said, calc = str(n), ""
        else:  # stated as pages of results: the count must be computed first
            k, m = r.randint(2, 9), r.randint(2, 25)
            n = k * m
            said, calc = f"{k} pages of {m}", f"{k} * {m} = {n}, "
        base = tool if tool.action == "search" else by_name[tool.similar[0]]
        bulk = by_name[base.similar[0]]
        pick = bulk if n > SEARCH_CAP else base
        args = {k: v for k, v in args.items() if k != "limit"}
        req = phrase_request(r, pick, args).rstrip(".?")
        req = f"{req}, I want {said} results." if r.random() < 0.5 else f"Find {said} " + req.split(" ", 1)[1] + "."
        cmp = f"{n} > {SEARCH_CAP}" if n > SEARCH_CAP else f"{n} <= {SEARCH_CAP}"
        think = f"{calc}{n} results and {cmp}, so use {pick.name}"
        args["limit"] = n
        offered = offered_tools(r, pick, pool, by_name, must=[base, bulk])
        prompt = render_system(offered) + f"{USR}{req}{END}{AST}"
        comp = f"{THINK}{think}{ETHINK}" + render_call(pick.name, args) + END
        return Example("hard", sub, prompt, comp, pick.name)
    else:  # plan: two independent calls in one turn
        other = r.choice([t for t in pool if t.name != tool.name and t.action not in ("search", "bulk_search")])
        if tool.action in ("search", "bulk_search"):
            return None
        args2 = gen_args(r, other)
        second = phrase_request(r, other, args2)
        req = phrase_request(r, tool, args).rstrip(".?") + ", and also " + second[0].lower() + second[1:]
        think = f"two steps: {tool.name} then {other.name}"
        offered = offered_tools(r, tool, pool, by_name, must=[other])
        prompt = render_system(offered) + f"{USR}{req}{END}{AST}"
        comp = f"{THINK}{think}{ETHINK}" + render_call(tool.name, args) + render_call(other.name, args2) + END
        return Example("hard", sub, prompt, comp, tool.name)
    prompt = render_system(offered_tools(r, tool, pool, by_name)) + f"{USR}{req}{END}{AST}"
    comp = f"{THINK}{think}{ETHINK}" + render_call(tool.name, args) + END
    return Example("hard", sub, prompt, comp, tool.name)


CHITCHAT = [
    ("Hello!", "Hello! How can I help you today?"),
    ("Thanks, that is all.", "You are welcome. Have a good day!"),
    ("Who are you?", "I am an agent that can call the tools listed above."),
    ("Good morning", "Good morning! What can I do for you?"),
]


def make_none(r, tool, pool, by_name) -> Example:
    """The request needs `tool`, which is not offered (nor any tool of its entity)."""
    if r.random() < 0.15:
        q, a = r.choice(CHITCHAT)
        offered = offered_tools(r, None, pool, by_name)
        prompt = render_system(offered) + f"{USR}{q}{END}{AST}"
        return Example("none", "chitchat", prompt, a + END, None)
    args = gen_args(r, tool)
    req = phrase_request(r, tool, args)
    others = [t for t in pool if t.entity != tool.entity]
    offered = offered_tools(r, None, others, by_name)
    prompt = render_system(offered) + f"{USR}{req}{END}{AST}"
    return Example("none", "refuse", prompt, REFUSAL + END, None)


def make_result(r, tool, pool, by_name) -> Example:
    args = gen_args(r, tool)
    req = phrase_request(r, tool, args)
    res = result_for(r, tool, args)
    offered = offered_tools(r, tool, pool, by_name)
    prompt = (render_system(offered) + f"{USR}{req}{END}{AST}" + render_call(tool.name, args) + END +
              f"{TOOL}{json.dumps(res, separators=(', ', ': '))}{END}{AST}")
    facts = ", ".join(f"{k} is {v}" for k, v in res.items())
    comp = f"{tool.name} returned: {facts}." + END
    return Example("result", "answer", prompt, comp, tool.name)


KINDS = [("call", 0.35), ("hard", 0.40), ("none", 0.10), ("result", 0.15)]


def generate(seed: int, n: int, split: str = "train") -> list[Example]:
    """`n` examples. split=train draws from the training tools; split=heldout_requests
    uses the same tools with a disjoint seed stream; split=heldout_tools uses only
    the held-out tools (with training tools as distractors)."""
    tools = build_catalog()
    by_name = {t.name: t for t in tools}
    held = heldout_tool_names(tools)
    train_tools = [t for t in tools if t.name not in held]
    stream = {"train": 0, "heldout_requests": 1, "heldout_tools": 2}[split]
    r = random.Random(f"{seed}/{stream}")
    targets = [t for t in tools if t.name in held] if split == "heldout_tools" else train_tools
    pool = train_tools if split == "train" else train_tools
    by_visible = {k: v for k, v in by_name.items() if split != "train" or k not in held}
    out: list[Example] = []
    kinds, weights = zip(*KINDS)
    while len(out) < n:
        kind = r.choices(kinds, weights)[0]
        tool = r.choice(targets)
        if kind == "call":
            ex = make_call(r, tool, pool, by_visible)
        elif kind == "hard":
            sub = r.choice(HARD_SUBS)
            fitting = [t for t in targets if sub in hard_subs(t)] or \
                [t for t in train_tools if sub in hard_subs(t)]
            ex = make_hard(r, r.choice(fitting), pool, by_visible, sub)
        elif kind == "none":
            ex = make_none(r, tool, pool, by_visible)
        else:
            ex = make_result(r, tool, pool, by_visible)
        if ex is not None:
            out.append(ex)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--split", default="train", choices=["train", "heldout_requests", "heldout_tools"])
    ap.add_argument("--catalog", action="store_true", help="print the tool catalog as JSON lines")
    ap.add_argument("--stats", action="store_true", help="print catalog statistics")
    ap.add_argument("--tasks", action="store_true",
                    help="print examples as agent tasks (user text, offered tool schemas, expected calls)")
    a = ap.parse_args()
    if a.catalog:
        held = heldout_tool_names(build_catalog())
        for t in build_catalog():
            print(json.dumps({**t.schema(), "domain": t.domain, "read_only": t.read_only,
                              "heldout": t.name in held}))
        return
    if a.stats:
        tools = build_catalog()
        print(f"tools={len(tools)} domains={len({t.domain for t in tools})} "
              f"heldout={len(heldout_tool_names(tools))}")
        return
    for i, ex in enumerate(generate(a.seed, a.n, a.split)):
        if a.tasks:
            if ex.kind == "result":
                continue
            block = ex.prompt.split(TOOLS + "\n", 1)[1].split("\n" + ETOOLS, 1)[0]
            user = ex.prompt.split(USR, 1)[1].split(END, 1)[0]
            calls = [json.loads(c.split(ECALL)[0]) for c in ex.completion.split(CALL)[1:]]
            answer = None if calls else ex.completion.split(ETHINK)[-1].replace(END, "")
            print(json.dumps({"id": i, "kind": ex.kind, "sub": ex.sub, "split": a.split, "user": user,
                              "tools": [json.loads(line) for line in block.split("\n")],
                              "expected": calls, "answer": answer}))
        else:
            print(json.dumps(ex.to_json()))


if __name__ == "__main__":
    main()
