//! Model output into answer text, reasoning and tool calls, streamed or whole.
//!
//! [`OutputParser`] takes the generated text piece by piece and gives [`Delta`]s as soon as
//! they are certain: text is held only while it may still begin a marker or a call. Calls are
//! recognised in every form the families write them, whatever the tier's [`ToolSyntax`]:
//!
//! - the family's own markers: `<tool_call>..</tool_call>` (and `<function=NAME>..</function>`),
//!   `[TOOL_CALLS][..]`, `<|python_tag|>{..}`, `<|tool_call|>[..]<|/tool_call|>`, DeepSeek's
//!   `<｜tool▁calls▁begin｜>..`;
//! - a JSON call in a ```` ```json ```` fence anywhere (small Qwen models write them);
//! - a bare JSON call at the start of the reply or of a line: `{"name": .., "arguments": ..}`
//!   (`"parameters"` for Llama 3), `{"function": {..}}`, `{"tool_calls": [..]}`, or a list.
//!
//! Calls are parsed only when tools were offered, and a call must name one of them; what
//! does not parse stays text (counted as malformed when it was inside the family's markers).
//! Reasoning is a marked span at the very start (or the whole start, when the prompt
//! opened it). Answer text is trimmed at both ends and around calls, so the streamed deltas
//! join to exactly the unstreamed answer.

use serde_json::{Map, Value};

use super::{ThinkMarkers, ToolSyntax};
use crate::chat::{ParsedOutput, ToolCall};

/// Which calls a reply may make.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ToolNames {
    /// No tools were offered: nothing is parsed as a call.
    #[default]
    None,
    /// Any name (the bundled tiers' evaluations).
    Any,
    /// Only these names.
    Only(Vec<String>),
}

impl ToolNames {
    fn allows(&self, name: &str) -> bool {
        match self {
            ToolNames::None => false,
            ToolNames::Any => true,
            ToolNames::Only(n) => n.iter().any(|x| x == name),
        }
    }
}

/// How to read one reply.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParseOptions {
    /// The family's call syntax.
    pub syntax: Option<ToolSyntax>,
    /// Reasoning markers.
    pub think: Option<ThinkMarkers>,
    /// The prompt opened a reasoning span: the reply starts inside it.
    pub thinking_open: bool,
    /// Which calls are parsed.
    pub tools: ToolNames,
}

/// A piece of parsed output.
#[derive(Debug, Clone, PartialEq)]
pub enum Delta {
    /// Answer text.
    Content(String),
    /// Reasoning text.
    Reasoning(String),
    /// A complete tool call.
    Call(ToolCall),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `open` JSON `close` (the close tag may also appear without valid JSON before it).
    Tagged { close: &'static str },
    /// A generic wrapper (`<tool>`, `<response>`, `<json>`..) that small models put around a
    /// JSON call: a call when it holds one, else plain text.
    Wrapped { close: &'static str },
    /// `<function=NAME>` or `<function name="NAME">`, JSON, `</function>`.
    FunctionTag,
    /// `open` then JSON (or Mistral's `NAME[ARGS]{..}`); ends where the JSON ends.
    Prefix,
    /// ```` ``` ```` or ```` ```json ```` fence around JSON.
    Fence,
    /// JSON at a line start.
    Bare,
    /// DeepSeek's calls block, up to its end marker.
    DeepSeek,
}

impl Kind {
    /// Inside the family's own markers: a failure there is a malformed call.
    fn native(self) -> bool {
        !matches!(self, Kind::Fence | Kind::Bare | Kind::Wrapped { .. })
    }
}

const DS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
/// A variant opener some DeepSeek outputs use.
const DS_BEGIN_ALT: &str = "<｜tool▁calls｜>";
const DS_END: &str = "<｜tool▁calls▁end｜>";
const DS_CALL: &str = "<｜tool▁call▁begin｜>";
const DS_SEP: &str = "<｜tool▁sep｜>";
const DS_CALL_END: &str = "<｜tool▁call▁end｜>";
const FENCE: &str = "```";

/// Keys a JSON call may start with.
const CALL_KEYS: [&str; 5] = ["name", "function", "tool_calls", "tool_call", "type"];
/// Wrappers around a JSON call (Hermes-style models write these too).
const WRAPPERS: [(&str, &str); 7] = [
    ("<function_call>", "</function_call>"),
    ("<tools>", "</tools>"),
    ("<tool>", "</tool>"),
    ("<response>", "</response>"),
    ("<json>", "</json>"),
    ("<JSON>", "</JSON>"),
    ("<xml>", "</xml>"),
];

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Text,
    Think,
    Region(Kind),
}

/// The streaming parser of one reply (see the module docs).
#[derive(Debug)]
pub struct OutputParser {
    opts: ParseOptions,
    openers: Vec<(&'static str, Kind)>,
    state: State,
    buf: String,
    /// The region's opener text (given back as text when the region is not a call).
    opener: String,
    /// Answer text was emitted (leading whitespace is dropped until then).
    text_started: bool,
    /// Anything was emitted or started (reasoning is recognised only at the start).
    started: bool,
    /// Whitespace held until more answer text follows (dropped before calls and at the end).
    ws: String,
    /// Reasoning whitespace held the same way.
    think_ws: String,
    reasoning_started: bool,
    /// A reasoning span was opened (its text may be empty).
    reasoned: bool,
    malformed: usize,
}

impl OutputParser {
    /// A parser for one reply.
    pub fn new(opts: ParseOptions) -> Self {
        let mut openers: Vec<(&'static str, Kind)> = vec![];
        if opts.tools != ToolNames::None {
            openers.push((
                "<tool_call>",
                Kind::Tagged {
                    close: "</tool_call>",
                },
            ));
            for (open, close) in WRAPPERS {
                openers.push((open, Kind::Wrapped { close }));
            }
            openers.push(("<function", Kind::FunctionTag));
            openers.push(("[TOOL_CALLS]", Kind::Prefix));
            openers.push(("<|python_tag|>", Kind::Prefix));
            openers.push((
                "<|tool_call|>",
                Kind::Tagged {
                    close: "<|/tool_call|>",
                },
            ));
            if opts.syntax == Some(ToolSyntax::Phi4) {
                openers.push(("functools", Kind::Prefix));
            }
            openers.push((DS_BEGIN, Kind::DeepSeek));
            openers.push((DS_BEGIN_ALT, Kind::DeepSeek));
            openers.push((FENCE, Kind::Fence));
        }
        let state = if opts.thinking_open && opts.think.is_some() {
            State::Think
        } else {
            State::Text
        };
        Self {
            started: state == State::Think,
            opts,
            openers,
            state,
            buf: String::new(),
            opener: String::new(),
            text_started: false,
            ws: String::new(),
            think_ws: String::new(),
            reasoning_started: false,
            reasoned: false,
            malformed: 0,
        }
    }

    /// Calls that were inside the family's markers but did not parse.
    pub fn malformed(&self) -> usize {
        self.malformed
    }

    /// Whether the reply opened a reasoning span (or its prompt did).
    pub fn reasoned(&self) -> bool {
        self.reasoned || self.opts.thinking_open && self.opts.think.is_some()
    }

    /// Whether the reply is inside its reasoning span now.
    pub fn in_reasoning(&self) -> bool {
        self.state == State::Think
    }

    /// Feeds generated text; the deltas now certain.
    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        self.buf.push_str(text);
        let mut out = vec![];
        while self.step(&mut out, false) {}
        out
    }

    /// End of the reply: everything still held.
    pub fn finish(&mut self) -> Vec<Delta> {
        let mut out = vec![];
        while self.step(&mut out, true) {}
        // Whatever is left (a held prefix, an unfinished region) is text.
        match std::mem::replace(&mut self.state, State::Text) {
            State::Think => {
                let rest = std::mem::take(&mut self.buf);
                self.reasoning(rest.trim_end(), &mut out);
            }
            State::Region(kind) => {
                if kind.native() {
                    self.malformed += 1;
                }
                let rest = std::mem::take(&mut self.opener) + &std::mem::take(&mut self.buf);
                self.text(&rest, &mut out);
            }
            State::Text => {
                let rest = std::mem::take(&mut self.buf);
                self.text(&rest, &mut out);
            }
        }
        out
    }

    /// One parsing step; whether another may make progress.
    fn step(&mut self, out: &mut Vec<Delta>, end: bool) -> bool {
        match self.state.clone() {
            State::Think => self.step_think(out),
            State::Text => self.step_text(out, end),
            State::Region(kind) => self.step_region(kind, out, end),
        }
    }

    fn step_think(&mut self, out: &mut Vec<Delta>) -> bool {
        let close = self
            .opts
            .think
            .as_ref()
            .expect("thinking needs markers")
            .close
            .clone();
        if let Some(i) = self.buf.find(&close) {
            let body: String = self.buf.drain(..i + close.len()).collect();
            self.reasoning(body[..i].trim_end(), out);
            self.think_ws.clear();
            self.state = State::Text;
            return true;
        }
        let keep = held_suffix(&self.buf, &[close.as_str()]);
        let cut = self.buf.len() - keep;
        if cut > 0 {
            let body: String = self.buf.drain(..cut).collect();
            self.reasoning(&body, out);
        }
        false
    }

    fn step_text(&mut self, out: &mut Vec<Delta>, end: bool) -> bool {
        if !self.started {
            if let Some(t) = self.opts.think.clone() {
                let trimmed = self.buf.trim_start();
                if let Some(rest) = trimmed.strip_prefix(&t.open) {
                    self.buf = rest.to_owned();
                    self.started = true;
                    self.reasoned = true;
                    self.state = State::Think;
                    return true;
                }
                if !end && !trimmed.is_empty() && t.open.starts_with(trimmed) {
                    return false; // may still open reasoning
                }
                if !end && trimmed.is_empty() {
                    return false;
                }
            }
            if !self.buf.trim_start().is_empty() {
                self.started = true;
            }
        }
        // The earliest opener: a marker or fence anywhere, or JSON at a line start.
        let mut best: Option<(usize, usize, Kind)> = None;
        for (m, kind) in &self.openers {
            if let Some(i) = self.buf.find(m) {
                // The earliest, and of two at one place the longer (`<function_call>`
                // before `<function`).
                if best.is_none_or(|b| i < b.0 || (i == b.0 && m.len() > b.1)) {
                    best = Some((i, m.len(), *kind));
                }
            }
        }
        if self.opts.tools != ToolNames::None {
            if let Some(i) = self.bare_start() {
                if best.is_none_or(|b| i < b.0) {
                    best = Some((i, 0, Kind::Bare));
                }
            }
        }
        if let Some((i, len, kind)) = best {
            let before: String = self.buf.drain(..i).collect();
            self.text(&before, out);
            self.opener = self.buf.drain(..len).collect();
            self.state = State::Region(kind);
            return true;
        }
        if end {
            return false;
        }
        let markers: Vec<&str> = self.openers.iter().map(|(m, _)| *m).collect();
        let mut keep = held_suffix(&self.buf, &markers);
        // A line start that may begin a bare JSON call: hold from the brace on.
        if self.opts.tools != ToolNames::None {
            if let Some(i) = self.line_start_brace_candidate() {
                keep = keep.max(self.buf.len() - i);
            }
        }
        let cut = self.buf.len() - keep;
        if cut > 0 {
            let t: String = self.buf.drain(..cut).collect();
            self.text(&t, out);
        }
        false
    }

    /// Where a bare JSON call certainly starts in `buf` (a line start whose JSON begins
    /// with a call key).
    fn bare_start(&self) -> Option<usize> {
        for i in self.line_starts() {
            if let Some(true) = self.may_be_call(&self.buf[i..]) {
                return Some(i);
            }
        }
        None
    }

    /// The first line start in `buf` whose text may still become a bare JSON call.
    fn line_start_brace_candidate(&self) -> Option<usize> {
        self.line_starts()
            .into_iter()
            .find(|&i| self.may_be_call(&self.buf[i..]).is_none())
    }

    /// [`could_be_call`], with the generic format's `{"response": ..}` too.
    fn may_be_call(&self, s: &str) -> Option<bool> {
        match could_be_call(s) {
            Some(false) if self.opts.syntax == Some(ToolSyntax::Json) => {
                could_be_keyed(s, &["response"])
            }
            r => r,
        }
    }

    /// Byte offsets in `buf` where a line's first non-blank character is `{` or `[`.
    fn line_starts(&self) -> Vec<usize> {
        let mut out = vec![];
        let b = self.buf.as_bytes();
        let mut at_line = !self.text_started || self.ws.contains('\n');
        for (i, &c) in b.iter().enumerate() {
            match c {
                b'\n' => at_line = true,
                b' ' | b'\t' | b'\r' => {}
                b'{' | b'[' if at_line => {
                    out.push(i);
                    at_line = false;
                }
                _ => at_line = false,
            }
        }
        out
    }

    fn step_region(&mut self, kind: Kind, out: &mut Vec<Delta>, end: bool) -> bool {
        let outcome = match kind {
            Kind::Tagged { close } | Kind::Wrapped { close } => self.tagged(close),
            Kind::FunctionTag => self.function_tag(),
            Kind::Prefix => self.prefix(end),
            Kind::Fence => self.fence(end),
            Kind::Bare => self.bare(end),
            Kind::DeepSeek => self.deepseek(end),
        };
        match outcome {
            Region::More => false,
            Region::Calls(calls, consumed) => {
                self.buf.drain(..consumed);
                self.opener.clear();
                self.ws.clear();
                for c in calls {
                    out.push(Delta::Call(c));
                }
                self.state = State::Text;
                true
            }
            Region::Answer(text, consumed) => {
                self.buf.drain(..consumed);
                self.opener.clear();
                self.state = State::Text;
                self.text(&text, out);
                true
            }
            Region::NotCall(consumed) => {
                if kind.native() {
                    self.malformed += 1;
                }
                let body: String = self.buf.drain(..consumed).collect();
                let t = std::mem::take(&mut self.opener) + &body;
                self.state = State::Text;
                self.text(&t, out);
                true
            }
        }
    }

    fn tagged(&self, close: &str) -> Region {
        let body = self.buf.trim_start();
        let lead = self.buf.len() - body.len();
        if let Scan::Done(n) = scan_json(body) {
            let after = &body[n..];
            let after_t = after.trim_start();
            if after_t.starts_with(close) {
                let consumed = lead + n + (after.len() - after_t.len()) + close.len();
                return match self.calls_in(&body[..n]) {
                    Some(c) => Region::Calls(c, consumed),
                    None => Region::NotCall(consumed),
                };
            }
            if after_t.len() < close.len() && close.starts_with(after_t) {
                return Region::More;
            }
        }
        match scan_json(body) {
            // The JSON is still open: a close tag now would be inside one of its strings.
            Scan::More => Region::More,
            _ => self.close_or_more(close),
        }
    }

    fn function_tag(&self) -> Region {
        const CLOSE: &str = "</function>";
        let Some(gt) = self.buf.find('>') else {
            return if self.buf.len() > 128 {
                Region::NotCall(0)
            } else {
                Region::More
            };
        };
        // `<function=NAME>` or `<function name="NAME">`.
        let head = &self.buf[..gt];
        let name = match (
            head.strip_prefix('='),
            head.trim_start().strip_prefix("name="),
        ) {
            (Some(n), _) => n.trim(),
            (None, Some(n)) => n.trim().trim_matches('"'),
            _ => return Region::NotCall(0),
        };
        let body = self.buf[gt + 1..].trim_start();
        let lead = self.buf.len() - body.len();
        match scan_json(body) {
            Scan::Done(n) => {
                let after = &body[n..];
                let after_t = after.trim_start();
                if after_t.starts_with(CLOSE) {
                    let consumed = lead + n + (after.len() - after_t.len()) + CLOSE.len();
                    let args: Option<Value> = serde_json::from_str(&body[..n]).ok();
                    return match args.filter(Value::is_object) {
                        Some(a) if self.opts.tools.allows(name) => {
                            Region::Calls(vec![ToolCall::new(name, a)], consumed)
                        }
                        _ => Region::NotCall(consumed),
                    };
                }
                if after_t.len() < CLOSE.len() && CLOSE.starts_with(after_t) {
                    return Region::More;
                }
                self.close_or_more(CLOSE)
            }
            Scan::More => Region::More,
            Scan::NotJson => self.close_or_more(CLOSE),
        }
    }

    fn close_or_more(&self, close: &str) -> Region {
        match self.buf.find(close) {
            Some(i) => Region::NotCall(i + close.len()),
            None => Region::More,
        }
    }

    fn prefix(&self, end: bool) -> Region {
        let body = self.buf.trim_start();
        let lead = self.buf.len() - body.len();
        match scan_json(body) {
            Scan::Done(n) => match self.calls_in(&body[..n]) {
                Some(c) => Region::Calls(c, lead + n),
                None => Region::NotCall(lead + n),
            },
            Scan::More if !end => Region::More,
            Scan::More => Region::NotCall(self.buf.len()),
            Scan::NotJson => {
                // Llama 3.1's built-in tools: `<|python_tag|>NAME.call(arg="..", ..)`.
                if let Some(r) = self.builtin_call(body, lead, end) {
                    return r;
                }
                // Mistral's newer form: `[TOOL_CALLS]NAME[ARGS]{..}`.
                const ARGS: &str = "[ARGS]";
                match body.find(ARGS) {
                    Some(a) => {
                        let name = body[..a].trim();
                        if body[..a].contains('\n') || a + ARGS.len() > 64 {
                            // A name is short and on one line (where a stream stops
                            // waiting for `[ARGS]`).
                            return Region::NotCall(0);
                        }
                        let args_text = &body[a + ARGS.len()..];
                        // Arguments are an object: anything else is text, read on from
                        // the marker (not swallowed up to the end of some JSON string).
                        match args_text.trim_start().chars().next() {
                            None if !end => return Region::More,
                            Some('{') => {}
                            _ => return Region::NotCall(0),
                        }
                        match scan_json(args_text) {
                            Scan::Done(n) => {
                                let consumed = lead + a + ARGS.len() + n;
                                let args: Option<Value> =
                                    serde_json::from_str(&args_text[..n]).ok();
                                match args.filter(Value::is_object) {
                                    Some(v) if self.opts.tools.allows(name) => {
                                        Region::Calls(vec![ToolCall::new(name, v)], consumed)
                                    }
                                    _ => Region::NotCall(consumed),
                                }
                            }
                            Scan::More if !end => Region::More,
                            _ => Region::NotCall(self.buf.len()),
                        }
                    }
                    None if !end && body.len() < 64 && !body.contains('\n') => Region::More,
                    None => Region::NotCall(0),
                }
            }
        }
    }

    fn fence(&self, end: bool) -> Region {
        let Some(nl) = self.buf.find('\n') else {
            return if end || self.buf.len() > 16 {
                Region::NotCall(0)
            } else {
                Region::More
            };
        };
        let info = self.buf[..nl].trim();
        if !(info.is_empty()
            || info.eq_ignore_ascii_case("json")
            || info.eq_ignore_ascii_case("xml"))
        {
            return Region::NotCall(0);
        }
        let body = &self.buf[nl + 1..];
        let mut trimmed = body.trim_start();
        // A wrapper tag inside the fence (`<response>`, `<function_call>`..).
        let mut wrapper_close = None;
        if let Some((open, close)) = WRAPPERS.iter().find(|(o, _)| trimmed.starts_with(o)) {
            trimmed = trimmed[open.len()..].trim_start();
            wrapper_close = Some(*close);
        } else if !end && trimmed.starts_with('<') && trimmed.len() < 16 && !trimmed.contains('>') {
            return Region::More;
        }
        match could_be_call(trimmed) {
            Some(false) => return Region::NotCall(0),
            None if end => return Region::NotCall(0),
            None => return Region::More,
            Some(true) => {}
        }
        match scan_json(trimmed) {
            Scan::Done(n) => {
                let after = &trimmed[n..];
                let mut after_t = after.trim_start();
                if let Some(close) = wrapper_close {
                    match after_t.strip_prefix(close) {
                        Some(rest) => after_t = rest.trim_start(),
                        None if !end && close.starts_with(after_t) => return Region::More,
                        None => return Region::NotCall(0),
                    }
                }
                if after_t.starts_with(FENCE) {
                    let consumed = self.buf.len() - after_t.len() + FENCE.len();
                    match self.calls_in(&trimmed[..n]) {
                        Some(c) => Region::Calls(c, consumed),
                        None => Region::NotCall(0),
                    }
                } else if !end && after_t.len() < FENCE.len() && FENCE.starts_with(after_t) {
                    Region::More
                } else {
                    Region::NotCall(0)
                }
            }
            Scan::More if !end => Region::More,
            _ => Region::NotCall(0),
        }
    }

    fn bare(&self, end: bool) -> Region {
        match scan_json(&self.buf) {
            Scan::Done(n) => match self.calls_in(&self.buf[..n]) {
                Some(c) => Region::Calls(c, n),
                None => match self.response_in(&self.buf[..n]) {
                    Some(text) => Region::Answer(text, n),
                    None => Region::NotCall(n),
                },
            },
            Scan::More if !end => Region::More,
            _ => Region::NotCall(self.buf.len()),
        }
    }

    fn deepseek(&self, end: bool) -> Region {
        let (inner, consumed) = match self.buf.find(DS_END) {
            Some(i) => (&self.buf[..i], i + DS_END.len()),
            None if end => (self.buf.as_str(), self.buf.len()),
            None => return Region::More,
        };
        let mut calls = vec![];
        let pieces: Vec<&str> = if inner.contains(DS_CALL) {
            inner.split(DS_CALL).skip(1).collect()
        } else {
            vec![inner]
        };
        for piece in pieces {
            let piece = piece.split(DS_CALL_END).next().unwrap_or(piece);
            let Some((_, rest)) = piece.split_once(DS_SEP) else {
                return Region::NotCall(consumed);
            };
            let (name, args) = rest.split_once('\n').unwrap_or((rest, ""));
            let args = args.trim();
            let args = args
                .strip_prefix("```json")
                .or_else(|| args.strip_prefix(FENCE))
                .unwrap_or(args)
                .trim_start();
            let value = match scan_json(args) {
                Scan::Done(n) => serde_json::from_str::<Value>(&args[..n]).ok(),
                _ => None,
            };
            match value.filter(Value::is_object) {
                Some(v) if self.opts.tools.allows(name.trim()) => {
                    calls.push(ToolCall::new(name.trim(), v))
                }
                _ => return Region::NotCall(consumed),
            }
        }
        if calls.is_empty() {
            Region::NotCall(consumed)
        } else {
            Region::Calls(calls, consumed)
        }
    }

    /// `NAME.call(key=value, ..)` (Llama 3.1's built-in tools) at the start of `body`.
    fn builtin_call(&self, body: &str, lead: usize, end: bool) -> Option<Region> {
        let dot = body.find(".call(")?;
        let name = &body[..dot];
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return None;
        }
        let args_start = dot + ".call(".len();
        let Some(len) = python_args_end(&body[args_start..]) else {
            return Some(if end {
                Region::NotCall(self.buf.len())
            } else {
                Region::More
            });
        };
        let consumed = lead + args_start + len + 1;
        Some(match python_kwargs(&body[args_start..args_start + len]) {
            Some(args) if self.opts.tools.allows(name) => {
                Region::Calls(vec![ToolCall::new(name, Value::Object(args))], consumed)
            }
            _ => Region::NotCall(consumed),
        })
    }

    /// The generic format's `{"response": ".."}`: the answer it holds.
    fn response_in(&self, json: &str) -> Option<String> {
        if self.opts.syntax != Some(ToolSyntax::Json) {
            return None;
        }
        let v: Value = serde_json::from_str(json).ok()?;
        let o = v.as_object()?;
        (o.len() == 1).then(|| o.get("response")?.as_str().map(str::to_owned))?
    }

    /// The calls a JSON text holds, every one naming an allowed tool.
    fn calls_in(&self, json: &str) -> Option<Vec<ToolCall>> {
        let v: Value = serde_json::from_str(json).ok()?;
        let calls = calls_of(&v)?;
        calls
            .iter()
            .all(|c| self.opts.tools.allows(&c.name))
            .then_some(calls)
    }

    /// Emits answer text: leading whitespace of the answer dropped, trailing whitespace held.
    fn text(&mut self, t: &str, out: &mut Vec<Delta>) {
        let t = if self.text_started { t } else { t.trim_start() };
        if t.is_empty() {
            return;
        }
        let body = t.trim_end();
        if body.is_empty() {
            self.ws.push_str(t);
            return;
        }
        let mut s = std::mem::take(&mut self.ws);
        s.push_str(body);
        self.ws = t[body.len()..].to_owned();
        self.text_started = true;
        self.started = true;
        push_delta(out, Delta::Content(s));
    }

    fn reasoning(&mut self, t: &str, out: &mut Vec<Delta>) {
        let t = if self.reasoning_started {
            t
        } else {
            t.trim_start()
        };
        if t.is_empty() {
            return;
        }
        let body = t.trim_end();
        if body.is_empty() {
            self.think_ws.push_str(t);
            return;
        }
        let mut s = std::mem::take(&mut self.think_ws);
        s.push_str(body);
        self.think_ws = t[body.len()..].to_owned();
        self.reasoning_started = true;
        push_delta(out, Delta::Reasoning(s));
    }
}

fn push_delta(out: &mut Vec<Delta>, d: Delta) {
    match (out.last_mut(), d) {
        (Some(Delta::Content(a)), Delta::Content(b)) => a.push_str(&b),
        (Some(Delta::Reasoning(a)), Delta::Reasoning(b)) => a.push_str(&b),
        (_, d) => out.push(d),
    }
}

enum Region {
    More,
    Calls(Vec<ToolCall>, usize),
    /// The generic format's `{"response": ".."}`: answer text.
    Answer(String, usize),
    NotCall(usize),
}

/// Parses a whole reply.
pub fn parse_all(text: &str, opts: ParseOptions) -> ParsedOutput {
    let mut p = OutputParser::new(opts);
    let mut deltas = p.push(text);
    let unclosed = p.in_reasoning();
    deltas.extend(p.finish());
    p.join(deltas, unclosed)
}

/// Parses a reply fed in pieces of `piece` characters, as a stream delivers it (it reads
/// as [`parse_all`] reads the whole reply).
pub fn parse_streamed(text: &str, piece: usize, opts: ParseOptions) -> ParsedOutput {
    let mut p = OutputParser::new(opts);
    let mut deltas = vec![];
    let chars: Vec<char> = text.chars().collect();
    for chunk in chars.chunks(piece.max(1)) {
        deltas.extend(p.push(&chunk.iter().collect::<String>()));
    }
    let unclosed = p.in_reasoning();
    deltas.extend(p.finish());
    p.join(deltas, unclosed)
}

impl OutputParser {
    /// A whole reply from all its deltas (`unclosed`: the parser was inside reasoning
    /// before [`OutputParser::finish`]).
    pub fn join(&self, deltas: Vec<Delta>, unclosed: bool) -> ParsedOutput {
        let mut out = ParsedOutput::default();
        for d in deltas {
            match d {
                Delta::Content(t) => out.content.push_str(&t),
                Delta::Reasoning(t) => out.reasoning.get_or_insert_with(String::new).push_str(&t),
                Delta::Call(c) => out.tool_calls.push(c),
            }
        }
        if out.reasoning.is_none() && self.reasoned() {
            out.reasoning = Some(String::new());
        }
        out.malformed_calls = self.malformed();
        out.unclosed_reasoning = unclosed;
        out
    }
}

/// The calls a JSON value holds: a call object (`{"name", "arguments" | "parameters"}`,
/// OpenAI's `{"function": {..}}`), `{"tool_calls": [..]}`, `{"tool_call": {..}}`, or a list
/// of calls. Arguments given as a JSON string are parsed.
pub fn calls_of(v: &Value) -> Option<Vec<ToolCall>> {
    match v {
        Value::Array(items) if !items.is_empty() => items.iter().map(one_call).collect(),
        Value::Object(o) => {
            if let Some(list) = o.get("tool_calls") {
                return calls_of(list);
            }
            if let Some(c) = o.get("tool_call") {
                return one_call(c).map(|c| vec![c]);
            }
            one_call(v).map(|c| vec![c])
        }
        _ => None,
    }
}

fn one_call(v: &Value) -> Option<ToolCall> {
    let o: &Map<String, Value> = v.as_object()?;
    let id = o.get("id").and_then(Value::as_str).map(str::to_owned);
    if let Some(f) = o.get("function").filter(|f| f.is_object()) {
        let mut c = one_call(f)?;
        c.id = c.id.or(id);
        return Some(c);
    }
    let name = o.get("name")?.as_str()?.to_owned();
    let args = o
        .get("arguments")
        .or_else(|| o.get("parameters"))
        .cloned()
        .unwrap_or_else(|| Value::Object(Map::new()));
    let args = match args {
        Value::String(s) => serde_json::from_str::<Value>(&s).ok()?,
        a => a,
    };
    args.is_object().then_some(ToolCall {
        name,
        arguments: args,
        id,
    })
}

/// Where a JSON object or array that starts `s` ends.
#[derive(Debug, PartialEq, Eq)]
enum Scan {
    /// It ends after this many bytes.
    Done(usize),
    /// It has not ended yet.
    More,
    /// `s` does not start with `{` or `[`.
    NotJson,
}

fn scan_json(s: &str) -> Scan {
    let b = s.as_bytes();
    if !matches!(b.first(), Some(b'{') | Some(b'[')) {
        return if b.is_empty() {
            Scan::More
        } else {
            Scan::NotJson
        };
    }
    let (mut depth, mut in_str, mut esc) = (0usize, false, false);
    for (i, &c) in b.iter().enumerate() {
        if in_str {
            match (esc, c) {
                (true, _) => esc = false,
                (false, b'\\') => esc = true,
                (false, b'"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match c {
            b'"' => in_str = true,
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                depth -= 1;
                if depth == 0 {
                    return Scan::Done(i + 1);
                }
            }
            _ => {}
        }
    }
    Scan::More
}

/// Whether JSON text starting `s` can be a call: `Some(true)` once its first key is a
/// call key, `Some(false)` once it cannot be, `None` while undecided.
fn could_be_call(s: &str) -> Option<bool> {
    could_be_keyed(s, &CALL_KEYS)
}

/// Whether JSON text starting `s` is an object (or list of objects) whose first key is
/// one of `keys` (`None` while undecided).
fn could_be_keyed(s: &str, keys: &[&str]) -> Option<bool> {
    let mut rest = s.trim_start();
    if let Some(r) = rest.strip_prefix('[') {
        rest = r.trim_start();
        if rest.is_empty() {
            return None;
        }
    }
    let Some(r) = rest.strip_prefix('{') else {
        return if rest.is_empty() { None } else { Some(false) };
    };
    let r = r.trim_start();
    if r.is_empty() {
        return None;
    }
    let Some(key) = r.strip_prefix('"') else {
        return Some(false);
    };
    match key.find('"') {
        Some(e) => Some(keys.contains(&&key[..e])),
        None => keys
            .iter()
            .any(|k| k.starts_with(key))
            .then_some(())
            .map_or(Some(false), |_| None),
    }
}

/// Where the argument list of a Python call ends (the index of its closing parenthesis).
fn python_args_end(s: &str) -> Option<usize> {
    let (mut depth, mut quote, mut esc) = (0usize, None::<char>, false);
    for (i, c) in s.char_indices() {
        if let Some(q) = quote {
            match (esc, c) {
                (true, _) => esc = false,
                (false, '\\') => esc = true,
                (false, c) if c == q => quote = None,
                _ => {}
            }
            continue;
        }
        match c {
            '"' | '\'' => quote = Some(c),
            '(' | '[' | '{' => depth += 1,
            ')' if depth == 0 => return Some(i),
            ')' | ']' | '}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    None
}

/// `key="value", n=1, flag=True` as a JSON object (string, number, boolean and None
/// literals; anything else gives `None`).
fn python_kwargs(s: &str) -> Option<Map<String, Value>> {
    let mut out = Map::new();
    let mut rest = s.trim();
    while !rest.is_empty() {
        let eq = rest.find('=')?;
        let key = rest[..eq].trim();
        if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return None;
        }
        rest = rest[eq + 1..].trim_start();
        let (value, len) = python_literal(rest)?;
        out.insert(key.to_owned(), value);
        rest = rest[len..].trim_start();
        rest = rest.strip_prefix(',').unwrap_or(rest).trim_start();
    }
    Some(out)
}

fn python_literal(s: &str) -> Option<(Value, usize)> {
    let q = s.chars().next()?;
    if q == '"' || q == '\'' {
        let mut out = String::new();
        let mut esc = false;
        for (i, c) in s.char_indices().skip(1) {
            match (esc, c) {
                (true, 'n') => {
                    out.push('\n');
                    esc = false;
                }
                (true, 't') => {
                    out.push('\t');
                    esc = false;
                }
                (true, c) => {
                    out.push(c);
                    esc = false;
                }
                (false, '\\') => esc = true,
                (false, c) if c == q => return Some((Value::String(out), i + 1)),
                (false, c) => out.push(c),
            }
        }
        return None;
    }
    let len = s
        .find(|c: char| c == ',' || c.is_whitespace())
        .unwrap_or(s.len());
    let word = &s[..len];
    let v = match word {
        "True" => Value::Bool(true),
        "False" => Value::Bool(false),
        "None" => Value::Null,
        w => serde_json::from_str::<serde_json::Number>(w)
            .ok()
            .map(Value::Number)?,
    };
    Some((v, len))
}

/// Length of the longest suffix of `buf` that is a proper prefix of one of `markers`.
fn held_suffix(buf: &str, markers: &[&str]) -> usize {
    markers
        .iter()
        .map(|m| {
            (1..m.len().min(buf.len() + 1))
                .rev()
                .find(|&n| {
                    buf.is_char_boundary(buf.len() - n) && m.starts_with(&buf[buf.len() - n..])
                })
                .unwrap_or(0)
        })
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn opts(tools: &[&str]) -> ParseOptions {
        ParseOptions {
            syntax: Some(ToolSyntax::Hermes),
            think: Some(ThinkMarkers::default()),
            thinking_open: false,
            tools: ToolNames::Only(tools.iter().map(|s| s.to_string()).collect()),
        }
    }

    /// Feeds `text` in pieces of `n` bytes (on char boundaries) and joins the deltas.
    fn streamed(text: &str, n: usize, o: ParseOptions) -> ParsedOutput {
        let mut p = OutputParser::new(o.clone());
        let mut deltas = vec![];
        let mut piece = String::new();
        for ch in text.chars() {
            piece.push(ch);
            if piece.len() >= n {
                deltas.extend(p.push(&piece));
                piece.clear();
            }
        }
        deltas.extend(p.push(&piece));
        let unclosed = p.in_reasoning();
        deltas.extend(p.finish());
        p.join(deltas, unclosed)
    }

    /// Whole and streamed (every piece size up to 7) parses agree; the whole one.
    fn parse(text: &str, o: ParseOptions) -> ParsedOutput {
        let whole = parse_all(text, o.clone());
        for n in 1..8 {
            assert_eq!(
                streamed(text, n, o.clone()),
                whole,
                "piece size {n}: {text:?}"
            );
        }
        whole
    }

    fn call(name: &str, args: Value) -> ToolCall {
        ToolCall::new(name, args)
    }

    #[test]
    fn hermes_calls_with_newlines_parse() {
        let p = parse(
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
            opts(&["get_weather"]),
        );
        assert_eq!(
            p.tool_calls,
            [call("get_weather", json!({"city": "Paris"}))]
        );
        assert_eq!(p.content, "");
    }

    #[test]
    fn parallel_calls_and_surrounding_text() {
        let p = parse(
            "Sure.\n<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": \"b\", \"arguments\": {\"x\": 1}}</tool_call>\nDone.",
            opts(&["a", "b"]),
        );
        assert_eq!(
            p.tool_calls,
            [call("a", json!({})), call("b", json!({"x": 1}))]
        );
        assert_eq!(p.content, "Sure.\nDone.");
    }

    #[test]
    fn a_json_fence_holding_a_call_is_a_call() {
        let p = parse(
            "```json\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n```",
            opts(&["get_weather"]),
        );
        assert_eq!(p.tool_calls.len(), 1);
        assert_eq!(p.content, "");
    }

    #[test]
    fn a_code_fence_that_is_not_a_call_stays_text() {
        let text = "Here:\n```python\nprint({\"name\": 1})\n```";
        let p = parse(text, opts(&["f"]));
        assert!(p.tool_calls.is_empty());
        assert_eq!(p.content, text);
    }

    #[test]
    fn bare_json_at_the_start_is_a_call() {
        let p = parse(
            "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
            opts(&["get_weather"]),
        );
        assert_eq!(
            p.tool_calls,
            [call("get_weather", json!({"city": "Paris"}))]
        );
    }

    #[test]
    fn llama3_parameters_and_python_tag_parse() {
        let mut o = opts(&["f"]);
        o.syntax = Some(ToolSyntax::Llama3);
        let p = parse(
            "{\"name\": \"f\", \"parameters\": {\"q\": \"x\"}}",
            o.clone(),
        );
        assert_eq!(p.tool_calls, [call("f", json!({"q": "x"}))]);
        let p = parse("<|python_tag|>{\"name\": \"f\", \"parameters\": {}}", o);
        assert_eq!(p.tool_calls, [call("f", json!({}))]);
    }

    #[test]
    fn mistral_calls_keep_their_ids() {
        let mut o = opts(&["f", "g"]);
        o.syntax = Some(ToolSyntax::Mistral);
        let p = parse(
            "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": 1}, \"id\": \"abcDEF123\"}, {\"name\": \"g\", \"arguments\": {}, \"id\": \"zzzzzzzzz\"}]",
            o.clone(),
        );
        assert_eq!(p.tool_calls.len(), 2);
        assert_eq!(p.tool_calls[0].id.as_deref(), Some("abcDEF123"));
        let p = parse("[TOOL_CALLS]f[ARGS]{\"a\": 2}", o);
        assert_eq!(p.tool_calls, [call("f", json!({"a": 2}))]);
    }

    #[test]
    fn deepseek_calls_parse() {
        let mut o = opts(&["get_weather"]);
        o.syntax = Some(ToolSyntax::DeepSeekR1);
        let p = parse(
            "<think>need weather</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            o,
        );
        assert_eq!(p.reasoning.as_deref(), Some("need weather"));
        assert_eq!(
            p.tool_calls,
            [call("get_weather", json!({"city": "Paris"}))]
        );
    }

    #[test]
    fn function_tags_parse() {
        let p = parse("<function=f>{\"x\": 1}</function>", opts(&["f"]));
        assert_eq!(p.tool_calls, [call("f", json!({"x": 1}))]);
    }

    #[test]
    fn without_tools_offered_nothing_is_a_call() {
        let mut o = opts(&[]);
        o.tools = ToolNames::None;
        let text = "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>";
        let p = parse(text, o);
        assert!(p.tool_calls.is_empty());
        assert_eq!(p.content, text);
    }

    #[test]
    fn a_call_to_a_tool_not_offered_is_malformed_text() {
        let text = "<tool_call>{\"name\": \"rm_rf\", \"arguments\": {}}</tool_call>";
        let p = parse(text, opts(&["f"]));
        assert!(p.tool_calls.is_empty());
        assert_eq!(p.malformed_calls, 1);
        assert_eq!(p.content, text);
    }

    #[test]
    fn prose_with_braces_is_not_held_as_a_call() {
        let text = "Use {braces} like this.\n{ not json";
        let p = parse(text, opts(&["f"]));
        assert_eq!(p.content, text);
    }

    #[test]
    fn reasoning_at_the_start_is_reasoning() {
        let p = parse("<think>\n2 * 3 = 6\n</think>\n\nSix.", opts(&[]));
        assert_eq!(p.reasoning.as_deref(), Some("2 * 3 = 6"));
        assert_eq!(p.content, "Six.");
    }

    #[test]
    fn a_prompt_that_opened_thinking_starts_in_reasoning() {
        let mut o = opts(&[]);
        o.thinking_open = true;
        let p = parse("hmm\n</think>\nAnswer", o);
        assert_eq!(p.reasoning.as_deref(), Some("hmm"));
        assert_eq!(p.content, "Answer");
    }

    #[test]
    fn unterminated_reasoning_is_all_reasoning() {
        let p = parse("<think>still thinking", opts(&[]));
        assert_eq!(p.reasoning.as_deref(), Some("still thinking"));
        assert_eq!(p.content, "");
    }

    #[test]
    fn an_unfinished_call_is_malformed_text() {
        let text = "<tool_call>{\"name\": \"f\", \"argu";
        let p = parse(text, opts(&["f"]));
        assert!(p.tool_calls.is_empty());
        assert_eq!(p.malformed_calls, 1);
        assert_eq!(p.content, text);
    }

    #[test]
    fn a_closing_tag_inside_a_string_does_not_end_the_call() {
        let p = parse(
            r#"<tool_call>{"name": "a", "arguments": {"q": "x</tool_call> y"}}</tool_call> done"#,
            opts(&["a"]),
        );
        assert_eq!(p.tool_calls[0].arguments, json!({"q": "x</tool_call> y"}));
        assert_eq!(p.content, "done");
    }

    #[test]
    fn string_arguments_and_openai_shaped_calls_parse() {
        let p = parse(
            r#"{"tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}"#,
            opts(&["f"]),
        );
        assert_eq!(p.tool_calls, [call("f", json!({"a": 1}))]);
    }

    #[test]
    fn a_json_answer_that_is_not_a_call_stays_text() {
        let text = "{\"name\": \"Ada\", \"age\": 36}";
        let p = parse(text, opts(&["f"]));
        assert!(p.tool_calls.is_empty());
        assert_eq!(p.content, text);
    }
}
