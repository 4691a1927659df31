// The mesh console: a chat pane (Anthropic's Messages API, streamed), a cluster pane
// (GET /v1/cluster) and a policy pane (GET /v1/control/policy). Plain browser JavaScript,
// served from the node's binary; no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const state = {
  key: sessionStorage.getItem("mesh.key") || "",
  messages: [],
  busy: false,
  pane: "chat",
  timer: null,
};

const DEFAULT_TOOLS = [
  {
    name: "weather_get_forecast",
    description: "Get the forecast by city and date.",
    input_schema: {
      type: "object",
      properties: {
        city: { type: "string", description: "City name" },
        date: { type: "string", description: "Date as YYYY-MM-DD" },
      },
      required: ["city", "date"],
    },
  },
  {
    name: "finance_get_stock_quote",
    description: "Get the stock quote by ticker.",
    input_schema: {
      type: "object",
      properties: { ticker: { type: "string", description: "Stock ticker symbol" } },
      required: ["ticker"],
    },
  },
];

class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}

function authHeaders(json) {
  const h = {};
  if (json) h["content-type"] = "application/json";
  if (state.key) h["authorization"] = "Bearer " + state.key;
  return h;
}

async function errorMessage(r) {
  try {
    const v = await r.json();
    return (v.error && v.error.message) || JSON.stringify(v);
  } catch {
    return r.status + " " + r.statusText;
  }
}

// A request to the node; 401 opens the key dialog, other failures throw with the node's message.
async function api(path, opts = {}) {
  const r = await fetch(path, { ...opts, headers: authHeaders(Boolean(opts.body)) });
  if (r.ok) return r;
  const message = await errorMessage(r);
  if (r.status === 401) askKey(message);
  throw new HttpError(r.status, message);
}

function askKey(why) {
  $("key-why").textContent = why || "This node asks for an API key.";
  $("key-dialog").hidden = false;
  $("key-button").hidden = false;
  $("key-input").focus();
}

$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  state.key = $("key-input").value.trim();
  sessionStorage.setItem("mesh.key", state.key);
  $("key-dialog").hidden = true;
  $("key-input").value = "";
  start();
});
$("key-button").addEventListener("click", () => askKey("Use another API key."));

// ----------------------------------------------------------------------------- panes

function show(pane) {
  state.pane = pane;
  for (const t of document.querySelectorAll(".tab")) t.classList.toggle("active", t.dataset.pane === pane);
  for (const p of ["chat", "cluster", "policy"]) $("pane-" + p).hidden = p !== pane;
  clearInterval(state.timer);
  if (pane === "cluster") {
    refreshCluster();
    state.timer = setInterval(refreshCluster, 2000);
  } else if (pane === "policy") {
    refreshPolicy();
    state.timer = setInterval(refreshPolicy, 5000);
  }
}
for (const t of document.querySelectorAll(".tab")) t.addEventListener("click", () => show(t.dataset.pane));

// ----------------------------------------------------------------------------- chat

async function loadModels() {
  const r = await api("/v1/models");
  const v = await r.json();
  const select = $("model");
  const current = select.value;
  select.replaceChildren();
  // Embedding models answer /v1/embeddings, not chat.
  for (const m of v.data.filter((m) => !(m.meta && m.meta.embedding))) {
    const remote = m.meta && m.meta.remote ? " (peer)" : "";
    const cascade = m.meta && m.meta.cascade ? " (" + m.meta.cascade.join(" → ") + ")" : "";
    select.append(el("option", { value: m.id, text: m.id + remote + cascade }));
  }
  if (current) select.value = current;
}

function addTurn(role) {
  const turn = el("div", { class: "turn " + role });
  turn.append(el("div", { class: "who", text: role === "user" ? "you" : "assistant" }));
  $("log").append(turn);
  turn.scrollIntoView({ block: "end" });
  return turn;
}

function cascadePath(steps) {
  return steps
    .map((s) => s.tier + " " + s.verdict + (s.min_margin == null ? "" : " (margin " + s.min_margin.toFixed(2) + ")"))
    .join(" → ");
}

function metaRow(turn, mesh, usage, stopReason) {
  const meta = el("div", { class: "meta" });
  const item = (cls, label, value) => {
    const span = el("span", { class: cls }, label + " ");
    span.append(el("b", { text: value }));
    meta.append(span);
  };
  item("meta-tier", "tier", mesh.tier || "?");
  if (mesh.cascade && mesh.cascade.length) item("meta-cascade", "cascade", cascadePath(mesh.cascade));
  const prompt = (usage.input_tokens || 0) + (usage.cache_read_input_tokens || 0);
  item("meta-cached", "prompt tokens restored", (usage.cache_read_input_tokens || 0) + " / " + prompt);
  item("meta-output", "output tokens", String(usage.output_tokens || 0));
  item("meta-stop", "stop", stopReason || "?");
  if (mesh.speculative) item("meta-spec", "drafted / accepted", mesh.speculative.draft_tokens + " / " + mesh.speculative.accepted_tokens);
  item("meta-trace", "trace", mesh.trace_id || "not exported");
  turn.append(meta);
  turn.dataset.tier = mesh.tier || "";
  turn.dataset.cached = String(usage.cache_read_input_tokens || 0);
}

// Splits a fetch body into server-sent events: calls `on(name, data)` for each.
async function readEvents(body, on) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const raw = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      let name = "message";
      const data = [];
      for (const line of raw.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) on(name, JSON.parse(data.join("\n")));
    }
  }
}

function requestBody() {
  const body = {
    model: $("model").value,
    max_tokens: Number($("max-tokens").value) || 128,
    temperature: Number($("temperature").value) || 0,
    stream: true,
    messages: state.messages,
  };
  const thinking = $("thinking").value;
  if (thinking !== "") body.thinking = { type: "enabled", budget_tokens: Number(thinking) };
  if ($("use-tools").checked) body.tools = JSON.parse($("tools").value);
  return body;
}

async function send(text) {
  let body;
  try {
    state.messages.push({ role: "user", content: text });
    body = requestBody();
  } catch (e) {
    state.messages.pop();
    const t = addTurn("assistant");
    t.append(el("div", { class: "error", text: "The tools are not valid JSON: " + e.message }));
    return;
  }
  addTurn("user").append(text);
  const turn = addTurn("assistant");
  turn.dataset.state = "streaming";
  const blocks = [];
  const content = [];
  try {
    const r = await api("/v1/messages", { method: "POST", body: JSON.stringify(body) });
    await readEvents(r.body, (name, ev) => {
      if (name === "content_block_start") {
        const b = ev.content_block;
        let node;
        if (b.type === "thinking") node = el("div", { class: "reasoning" });
        else if (b.type === "tool_use") node = el("div", { class: "tool-call", text: b.name + "(…)" });
        else node = el("span", { class: "content" });
        turn.append(node);
        blocks[ev.index] = { ...b, node, json: "" };
      } else if (name === "content_block_delta") {
        const b = blocks[ev.index];
        const d = ev.delta;
        if (d.type === "text_delta") { b.text += d.text; b.node.textContent = b.text; }
        else if (d.type === "thinking_delta") { b.thinking += d.thinking; b.node.textContent = b.thinking; }
        else if (d.type === "input_json_delta") b.json += d.partial_json;
      } else if (name === "content_block_stop") {
        const b = blocks[ev.index];
        if (b.type === "tool_use") {
          b.input = b.json ? JSON.parse(b.json) : {};
          b.node.textContent = "tool call  " + b.name + " " + JSON.stringify(b.input);
          content.push({ type: "tool_use", id: b.id, name: b.name, input: b.input });
        } else if (b.type === "text" && b.text) {
          content.push({ type: "text", text: b.text });
        }
      } else if (name === "message_delta") {
        metaRow(turn, ev.mesh || {}, ev.usage || {}, ev.delta && ev.delta.stop_reason);
      } else if (name === "error") {
        turn.append(el("div", { class: "error", text: ev.error.message }));
      }
      turn.scrollIntoView({ block: "end" });
    });
    state.messages.push({ role: "assistant", content: content.length ? content : [{ type: "text", text: "" }] });
    turn.dataset.state = "done";
  } catch (e) {
    state.messages.pop();
    turn.append(el("div", { class: "error", text: e.message }));
    turn.dataset.state = "error";
  }
}

$("chat-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.busy) return;
  state.busy = true;
  $("send").disabled = true;
  $("prompt").value = "";
  try {
    await send(text);
  } finally {
    state.busy = false;
    $("send").disabled = false;
    $("prompt").focus();
  }
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) {
    ev.preventDefault();
    $("chat-form").requestSubmit();
  }
});
$("clear").addEventListener("click", () => {
  state.messages = [];
  $("log").replaceChildren();
});

// ----------------------------------------------------------------------------- cluster

function uptime(s) {
  if (s == null) return "";
  if (s < 120) return s + " s";
  if (s < 7200) return Math.round(s / 60) + " min";
  return (s / 3600).toFixed(1) + " h";
}

async function refreshCluster() {
  let v;
  try {
    v = await (await api("/v1/cluster")).json();
  } catch (e) {
    $("cluster-count").textContent = e.message;
    return;
  }
  const rows = v.members.map((m) => {
    const tiers = (m.tiers || []).map((t) => t.name + " " + t.active + " / " + t.queued + " / " + t.n_seq_max).join(", ");
    const pages = (m.tiers || []).reduce((n, t) => n + (t.pages || 0), 0) +
      Object.values(m.stored_pages || {}).reduce((n, c) => n + c, 0);
    const tr = el("tr", { "data-node": m.node },
      el("td", { text: m.node + (m.local ? " (this node)" : "") }),
      el("td", { class: "state-" + m.state, text: m.state }),
      el("td", { text: (m.roles || []).join(", ") }),
      el("td", { text: uptime(m.uptime_s) }),
      el("td", { text: tiers || "none" }),
      el("td", { text: String(pages) }));
    return tr;
  });
  $("members").tBodies[0].replaceChildren(...rows);
  $("cluster-count").textContent = v.members.length + (v.members.length === 1 ? " node" : " nodes");
  const levels = (v.page_levels || []).map((p) => el("tr", {},
    el("td", { text: p.namespace }),
    el("td", { text: String(p.pages.ram) }),
    el("td", { text: p.pages.far == null ? "none" : String(p.pages.far) }),
    el("td", { text: String(p.pages.disk) }),
    el("td", { text: String(p.bytes.ram + (p.bytes.far || 0) + p.bytes.disk) })));
  if (!levels.length) levels.push(el("tr", {}, el("td", { colspan: "5", class: "muted", text: "This node stores no KV pages (no tiers, not a store node)." })));
  $("page-levels").tBodies[0].replaceChildren(...levels);
  $("actors").textContent = (v.actors || [])
    .map((a) => a.name + (a.running ? "" : " (down)") + (a.restarts ? " ×" + a.restarts + " restarts" : ""))
    .join(" · ");
  const me = v.members.find((m) => m.local);
  $("node-status").textContent = me && v.clustered ? "node " + me.node : "standalone node";
}

// ----------------------------------------------------------------------------- policy

async function refreshPolicy() {
  let v;
  try {
    v = await (await api("/v1/control/policy")).json();
    $("policy-error").hidden = true;
  } catch (e) {
    $("policy-error").hidden = false;
    $("policy-error").textContent = e.status === 403 ? "This key lacks the control scope: " + e.message : e.message;
    return;
  }
  $("policy-version").textContent = "version " + v.version;
  $("policy").textContent = JSON.stringify(v.policy, null, 2);
  const decisions = (v.decisions || []).slice().reverse().map((d) => el("tr", {},
    el("td", { text: d.at }),
    el("td", { text: d.knob + ": " + d.before + " → " + d.after }),
    el("td", { text: d.verdict + " (" + d.rule + "): " + d.reason })));
  if (!decisions.length) decisions.push(el("tr", {}, el("td", { colspan: "3", class: "muted", text: "No decisions yet." })));
  $("decisions").tBodies[0].replaceChildren(...decisions);
  const c = v.periodic && v.periodic.cycles;
  $("tuner-state").textContent = "Tuner " + (v.enabled ? "enabled" : "disabled") +
    (c ? " · cycles ran " + c.ran + ", idle " + c.idle + ", busy " + c.busy : "");
}

// ----------------------------------------------------------------------------- start

async function start() {
  try {
    await loadModels();
    const me = await (await api("/v1/cluster")).json();
    const local = me.members.find((m) => m.local);
    $("node-status").textContent = local && me.clustered ? "node " + local.node : "standalone node";
    if (state.key) $("key-button").hidden = false;
  } catch (e) {
    $("node-status").textContent = e.message;
  }
  if (state.pane !== "chat") show(state.pane);
}

$("tools").value = JSON.stringify(DEFAULT_TOOLS, null, 2);
start();
