// An MCP server (stdio) offering the bundled models' tool catalog
// (models/fixtures/catalog.jsonl) with deterministic stand-in results, so the
// bundled tiers can drive real MCP tool calls in the demo and benchmarks.
// Tools the catalog marks read-only carry readOnlyHint: true.
//
//   node .cache/mcp/catalog-server.mjs models/fixtures/catalog.jsonl [latency_ms]
//
// Each call waits latency_ms (default 150) before answering, as a networked tool
// would; the result is derived from a hash of the tool name and arguments. With
// CATALOG_CALL_LOG set, every executed call is appended to that file as a JSON line
// (tests count how often a tool with side effects ran).
import { appendFileSync, readFileSync } from "node:fs";
import { Server } from "@modelcontextprotocol/sdk/server/index.js";
import { StdioServerTransport } from "@modelcontextprotocol/sdk/server/stdio.js";
import { CallToolRequestSchema, ListToolsRequestSchema } from "@modelcontextprotocol/sdk/types.js";

const [catalogPath, latencyArg] = process.argv.slice(2);
if (!catalogPath) {
  console.error("usage: catalog-server.mjs CATALOG.jsonl [latency_ms]");
  process.exit(2);
}
const latency = Number(latencyArg ?? 150);
const tools = readFileSync(catalogPath, "utf8")
  .split("\n")
  .filter((l) => l.trim())
  .map((l) => JSON.parse(l));
const byName = new Map(tools.map((t) => [t.name, t]));

// FNV-1a over the call, for stable stand-in values.
function hash(s) {
  let h = 0x811c9dc5;
  for (let i = 0; i < s.length; i++) {
    h ^= s.charCodeAt(i);
    h = Math.imul(h, 0x01000193) >>> 0;
  }
  return h;
}

function canonical(v) {
  if (Array.isArray(v)) return `[${v.map(canonical).join(",")}]`;
  if (v && typeof v === "object") {
    return `{${Object.keys(v).sort().map((k) => `${JSON.stringify(k)}:${canonical(v[k])}`).join(",")}}`;
  }
  return JSON.stringify(v);
}

const server = new Server({ name: "mesh-catalog", version: "1.0.0" }, { capabilities: { tools: {} } });

server.setRequestHandler(ListToolsRequestSchema, async () => ({
  tools: tools.map((t) => ({
    name: t.name,
    description: t.description,
    inputSchema: t.parameters,
    annotations: { readOnlyHint: !!t.read_only },
  })),
}));

server.setRequestHandler(CallToolRequestSchema, async (req) => {
  const t = byName.get(req.params.name);
  if (!t) {
    return { content: [{ type: "text", text: `unknown tool ${req.params.name}` }], isError: true };
  }
  const args = req.params.arguments ?? {};
  const missing = (t.parameters.required ?? []).filter((k) => !(k in args));
  if (missing.length) {
    return { content: [{ type: "text", text: `missing required argument(s): ${missing.join(", ")}` }], isError: true };
  }
  if (process.env.CATALOG_CALL_LOG) {
    appendFileSync(process.env.CATALOG_CALL_LOG, JSON.stringify({ name: t.name, arguments: args }) + "\n");
  }
  await new Promise((r) => setTimeout(r, latency));
  const h = hash(t.name + canonical(args));
  const result = { status: "ok", value: h % 1000, items: (h >>> 10) % 40 };
  return { content: [{ type: "text", text: JSON.stringify(result) }] };
});

await server.connect(new StdioServerTransport());
