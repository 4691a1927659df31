//! MCP tool servers: the tools an agent task may call on the node's side.
//!
//! [`McpHub::connect`] starts every server of `[[mcp.servers]]`, either as a child
//! process spoken to over stdio or as a streamable-HTTP endpoint (both through `rmcp`,
//! the Model Context Protocol's Rust SDK), and lists their tools into one catalog.
//! [`McpHub::call`] runs one tool with a bounded wait.
//!
//! Failure model: a server that cannot start (bad command, no answer within
//! `connect_timeout_ms`) is reported in [`McpHub::servers`] and its tools are absent;
//! the node keeps serving. A call that gets no answer within `call_timeout_ms` fails
//! with [`McpError::Timeout`] (the request is cancelled on the server). A server that
//! exits or drops the connection fails its calls with [`McpError::Gone`] and is
//! started again on the next call. Calls are never retried by the hub: a tool with
//! side effects must not run twice because a connection broke.
//!
//! Read-only tools: a tool counts as read-only when the operator lists it in the
//! server's `read_only`, or when the server annotates it with `readOnlyHint: true` and
//! the server is trusted to say so (`trust_read_only_hint`, default on; MCP calls the
//! annotations hints, so turn it off for servers you do not control). Only read-only
//! tools are ever run speculatively or served from the result cache
//! ([`crate::spec_tools`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rmcp::model::{CallToolRequestParams, CallToolResult, ContentBlock};
use rmcp::service::{RoleClient, RunningService, ServiceError};
use rmcp::transport::{ConfigureCommandExt, StreamableHttpClientTransport, TokioChildProcess};
use rmcp::ServiceExt;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::Mutex;
use tracing::{info, warn};

/// One MCP server in the node configuration (`[[mcp.servers]]`). Exactly one of
/// `command` (stdio) and `url` (streamable HTTP) is set.
///
/// ```toml
/// [[mcp.servers]]
/// name = "fs"
/// command = "npx"
/// args = ["-y", "@modelcontextprotocol/server-filesystem", "/srv/docs"]
///
/// [[mcp.servers]]
/// name = "search"
/// url = "http://127.0.0.1:3001/mcp"
/// read_only = ["search"]
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpServerConfig {
    /// Name used in errors, metrics and to tell apart tools of the same name.
    pub name: String,
    /// Program to start; it speaks MCP on its stdin/stdout.
    #[serde(default)]
    pub command: Option<String>,
    /// Its arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// Extra environment variables for it.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Streamable-HTTP endpoint (e.g. `http://127.0.0.1:3001/mcp`).
    #[serde(default)]
    pub url: Option<String>,
    /// Tools of this server that have no side effects, whatever the server says.
    #[serde(default)]
    pub read_only: Vec<String>,
    /// Believe the server's `readOnlyHint` annotations.
    #[serde(default = "yes")]
    pub trust_read_only_hint: bool,
    /// A call of one of its tools with side effects drops every cached read-only
    /// result of this server (it may have changed what they read). Turn off for
    /// servers whose tools touch unrelated state.
    #[serde(default = "yes")]
    pub invalidate_on_write: bool,
    /// How long starting the server and the MCP handshake may take.
    #[serde(default = "default_connect_ms")]
    pub connect_timeout_ms: u64,
    /// How long one tool call may take.
    #[serde(default = "default_call_ms")]
    pub call_timeout_ms: u64,
}

fn yes() -> bool {
    true
}
fn default_connect_ms() -> u64 {
    20_000
}
fn default_call_ms() -> u64 {
    30_000
}

impl McpServerConfig {
    /// A stdio server: `command args...`.
    pub fn stdio(name: &str, command: &str, args: &[&str]) -> Self {
        Self {
            name: name.into(),
            command: Some(command.into()),
            args: args.iter().map(|a| (*a).to_owned()).collect(),
            env: BTreeMap::new(),
            url: None,
            read_only: vec![],
            trust_read_only_hint: true,
            invalidate_on_write: true,
            connect_timeout_ms: default_connect_ms(),
            call_timeout_ms: default_call_ms(),
        }
    }

    /// A streamable-HTTP server at `url`.
    pub fn http(name: &str, url: &str) -> Self {
        Self {
            command: None,
            url: Some(url.into()),
            ..Self::stdio(name, "", &[])
        }
    }

    /// Checks the fields that do not need the server running.
    pub fn validate(&self) -> Result<(), String> {
        if self.name.trim().is_empty() {
            return Err("mcp.servers: `name` must not be empty".into());
        }
        match (&self.command, &self.url) {
            (Some(c), None) if !c.trim().is_empty() => {}
            (None, Some(u)) if u.starts_with("http://") || u.starts_with("https://") => {}
            (None, Some(u)) => {
                return Err(format!(
                    "mcp.servers `{}`: url `{u}` must start with http:// or https://",
                    self.name
                ))
            }
            _ => {
                return Err(format!(
                    "mcp.servers `{}`: set exactly one of `command` (stdio) and `url` (streamable HTTP)",
                    self.name
                ))
            }
        }
        if self.connect_timeout_ms == 0 || self.call_timeout_ms == 0 {
            return Err(format!(
                "mcp.servers `{}`: timeouts must be at least 1 ms",
                self.name
            ));
        }
        Ok(())
    }
}

/// Errors of MCP tool servers.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum McpError {
    /// No connected server offers a tool of this name.
    #[error("unknown tool `{0}`: no connected MCP server offers it")]
    UnknownTool(String),
    /// Starting the server or its MCP handshake failed.
    #[error("MCP server `{server}` could not be started: {why}")]
    Connect {
        /// Server name.
        server: String,
        /// What went wrong.
        why: String,
    },
    /// The call got no answer in time; it was cancelled.
    #[error("MCP server `{server}` did not answer `{tool}` within {ms} ms")]
    Timeout {
        /// Server name.
        server: String,
        /// Tool name.
        tool: String,
        /// The limit.
        ms: u64,
    },
    /// The server exited or closed the connection during the call.
    #[error(
        "MCP server `{server}` went away during `{tool}` ({why}); it is restarted on the next call"
    )]
    Gone {
        /// Server name.
        server: String,
        /// Tool name.
        tool: String,
        /// What the transport said.
        why: String,
    },
    /// The server answered the call with a protocol error (unknown tool, bad arguments).
    #[error("MCP server `{server}` refused `{tool}`: {why}")]
    Refused {
        /// Server name.
        server: String,
        /// Tool name.
        tool: String,
        /// The server's message.
        why: String,
    },
    /// Tool arguments must be a JSON object.
    #[error("arguments of `{0}` must be a JSON object")]
    BadArguments(String),
}

/// A tool of a connected server.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct McpTool {
    /// Name in the catalog: the server's own name for it, or `server__name` when two
    /// servers offer the same name.
    pub name: String,
    /// The name the server knows it by.
    pub remote_name: String,
    /// Server name.
    pub server: String,
    /// Description shown to the model.
    pub description: String,
    /// JSON schema of the arguments.
    pub parameters: Value,
    /// Safe to run speculatively and to cache (see the module docs).
    pub read_only: bool,
    /// Its calls (when not read-only) drop the server's cached results.
    #[serde(skip)]
    pub invalidates: bool,
}

/// What a tool call returned.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolOutput {
    /// The text content blocks joined by newlines (other blocks are described, not
    /// inlined), or the structured content as JSON when there is no text.
    pub text: String,
    /// The server flagged the result as an error (the model should see it and react).
    pub is_error: bool,
    /// Wall time of the call.
    pub ms: u64,
}

impl ToolOutput {
    fn from_result(r: CallToolResult, ms: u64) -> Self {
        let mut parts = Vec::new();
        for block in &r.content {
            match block {
                ContentBlock::Text(t) => parts.push(t.text.clone()),
                ContentBlock::Image(i) => parts.push(format!("[image {}]", i.mime_type)),
                ContentBlock::Audio(a) => parts.push(format!("[audio {}]", a.mime_type)),
                ContentBlock::Resource(_) => parts.push("[embedded resource]".into()),
                ContentBlock::ResourceLink(l) => parts.push(format!("[resource {}]", l.uri)),
                _ => parts.push("[content]".into()),
            }
        }
        let mut text = parts.join("\n");
        if text.is_empty() {
            if let Some(s) = &r.structured_content {
                text = s.to_string();
            }
        }
        Self {
            text,
            is_error: r.is_error.unwrap_or(false),
            ms,
        }
    }
}

/// Connection state of one server, for `GET /v1/tools` and `mesh status`.
#[derive(Debug, Clone, Serialize)]
pub struct ServerStatus {
    /// Server name.
    pub name: String,
    /// `stdio` or `http`.
    pub transport: &'static str,
    /// Connected now.
    pub connected: bool,
    /// Tools it offers.
    pub tools: usize,
    /// Why it is not connected.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

type Client = RunningService<RoleClient, ()>;

struct Server {
    cfg: McpServerConfig,
    client: Mutex<Option<Arc<Client>>>,
    last_error: std::sync::Mutex<Option<String>>,
}

impl Server {
    async fn connect(&self) -> Result<Arc<Client>, McpError> {
        let cfg = &self.cfg;
        let err = |why: String| McpError::Connect {
            server: cfg.name.clone(),
            why,
        };
        let fut = async {
            if let Some(cmd) = &cfg.command {
                let command = tokio::process::Command::new(cmd).configure(|c| {
                    c.args(&cfg.args).envs(&cfg.env).kill_on_drop(true);
                });
                let (transport, _stderr) = TokioChildProcess::builder(command)
                    .stderr(std::process::Stdio::null())
                    .spawn()
                    .map_err(|e| err(format!("starting `{cmd}`: {e}")))?;
                ().serve(transport)
                    .await
                    .map_err(|e| err(format!("handshake: {e}")))
            } else {
                let url = cfg.url.clone().unwrap_or_default();
                // reqwest is built without a bundled TLS provider; use ring, as QUIC does.
                // (An error only means a provider is already installed.)
                let _ = rustls::crypto::ring::default_provider().install_default();
                let transport = StreamableHttpClientTransport::from_uri(url.as_str());
                ().serve(transport)
                    .await
                    .map_err(|e| err(format!("handshake with {url}: {e}")))
            }
        };
        let ms = cfg.connect_timeout_ms;
        let client = tokio::time::timeout(Duration::from_millis(ms), fut)
            .await
            .map_err(|_| err(format!("no MCP handshake within {ms} ms")))??;
        Ok(Arc::new(client))
    }

    /// The live client, connecting (again) if there is none.
    async fn client(&self) -> Result<Arc<Client>, McpError> {
        let mut slot = self.client.lock().await;
        if let Some(c) = slot.as_ref() {
            if !c.is_closed() {
                return Ok(c.clone());
            }
            warn!(server = %self.cfg.name, "MCP server connection closed; reconnecting");
        }
        *slot = None;
        match self.connect().await {
            Ok(c) => {
                *slot = Some(c.clone());
                *self.last_error.lock().expect("not poisoned") = None;
                Ok(c)
            }
            Err(e) => {
                *self.last_error.lock().expect("not poisoned") = Some(e.to_string());
                Err(e)
            }
        }
    }

    async fn forget(&self, why: &str) {
        *self.client.lock().await = None;
        *self.last_error.lock().expect("not poisoned") = Some(why.to_owned());
    }
}

/// Every configured MCP server and the catalog of their tools.
pub struct McpHub {
    servers: Vec<Arc<Server>>,
    tools: Vec<McpTool>,
    by_name: HashMap<String, usize>,
}

impl std::fmt::Debug for McpHub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpHub")
            .field("servers", &self.servers.len())
            .field("tools", &self.tools.len())
            .finish()
    }
}

impl McpHub {
    /// A hub with no servers (agent tasks then have no tools).
    pub fn empty() -> Self {
        Self {
            servers: vec![],
            tools: vec![],
            by_name: HashMap::new(),
        }
    }

    /// Starts every server (concurrently) and lists their tools. Servers that fail are
    /// logged and reported by [`Self::servers`]; they never fail the whole hub.
    pub async fn connect(configs: &[McpServerConfig]) -> Self {
        let servers: Vec<Arc<Server>> = configs
            .iter()
            .map(|c| {
                Arc::new(Server {
                    cfg: c.clone(),
                    client: Mutex::new(None),
                    last_error: std::sync::Mutex::new(None),
                })
            })
            .collect();
        let listed = futures_join(servers.iter().map(|s| {
            let s = s.clone();
            async move {
                if let Err(e) = s.cfg.validate() {
                    *s.last_error.lock().expect("not poisoned") = Some(e.clone());
                    return Err(e);
                }
                let client = s.client().await.map_err(|e| e.to_string())?;
                let limit = Duration::from_millis(s.cfg.call_timeout_ms);
                match tokio::time::timeout(limit, client.list_all_tools()).await {
                    Ok(Ok(tools)) => Ok(tools),
                    Ok(Err(e)) => Err(format!("tools/list: {e}")),
                    Err(_) => Err(format!(
                        "tools/list: no answer within {} ms",
                        limit.as_millis()
                    )),
                }
            }
        }))
        .await;
        let mut hub = Self {
            servers,
            tools: vec![],
            by_name: HashMap::new(),
        };
        let mut seen: HashMap<String, usize> = HashMap::new();
        for (i, res) in listed.into_iter().enumerate() {
            let server = hub.servers[i].clone();
            let tools = match res {
                Ok(t) => t,
                Err(e) => {
                    warn!(server = %server.cfg.name, error = %e, "MCP server unavailable; its tools are left out");
                    *server.last_error.lock().expect("not poisoned") = Some(e);
                    server.forget_sync();
                    continue;
                }
            };
            for t in tools {
                let remote = t.name.to_string();
                *seen.entry(remote.clone()).or_default() += 1;
                let hinted = t
                    .annotations
                    .as_ref()
                    .and_then(|a| a.read_only_hint)
                    .unwrap_or(false);
                hub.tools.push(McpTool {
                    name: remote.clone(),
                    remote_name: remote.clone(),
                    server: server.cfg.name.clone(),
                    description: t.description.as_deref().unwrap_or_default().to_owned(),
                    parameters: Value::Object((*t.input_schema).clone()),
                    read_only: server.cfg.read_only.contains(&remote)
                        || (server.cfg.trust_read_only_hint && hinted),
                    invalidates: server.cfg.invalidate_on_write,
                });
            }
            info!(server = %server.cfg.name, tools = hub.tools.iter().filter(|t| t.server == server.cfg.name).count(), "MCP server connected");
        }
        for t in &mut hub.tools {
            if seen[&t.remote_name] > 1 {
                t.name = format!("{}__{}", t.server, t.remote_name);
            }
        }
        hub.by_name = hub
            .tools
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        hub
    }

    /// The catalog.
    pub fn tools(&self) -> &[McpTool] {
        &self.tools
    }

    /// One tool of the catalog.
    pub fn tool(&self, name: &str) -> Option<&McpTool> {
        self.by_name.get(name).map(|&i| &self.tools[i])
    }

    /// State of every configured server.
    pub fn servers(&self) -> Vec<ServerStatus> {
        self.servers
            .iter()
            .map(|s| {
                let connected = s
                    .client
                    .try_lock()
                    .map(|c| c.as_ref().is_some_and(|c| !c.is_closed()))
                    .unwrap_or(true);
                ServerStatus {
                    name: s.cfg.name.clone(),
                    transport: if s.cfg.command.is_some() {
                        "stdio"
                    } else {
                        "http"
                    },
                    connected,
                    tools: self.tools.iter().filter(|t| t.server == s.cfg.name).count(),
                    error: if connected {
                        None
                    } else {
                        s.last_error.lock().expect("not poisoned").clone()
                    },
                }
            })
            .collect()
    }

    /// Calls tool `name` (a catalog name) with `args` (a JSON object, or null for none).
    pub async fn call(&self, name: &str, args: &Value) -> Result<ToolOutput, McpError> {
        let tool = self
            .tool(name)
            .ok_or_else(|| McpError::UnknownTool(name.to_owned()))?;
        let arguments = match args {
            Value::Object(m) => Some(m.clone()),
            Value::Null => None,
            _ => return Err(McpError::BadArguments(name.to_owned())),
        };
        let server = self
            .servers
            .iter()
            .find(|s| s.cfg.name == tool.server)
            .expect("catalog tools come from configured servers");
        let client = server.client().await?;
        let mut params = CallToolRequestParams::new(tool.remote_name.clone());
        params.arguments = arguments;
        let ms = server.cfg.call_timeout_ms;
        let t0 = Instant::now();
        let res = tokio::time::timeout(Duration::from_millis(ms), client.call_tool(params)).await;
        let elapsed = t0.elapsed().as_millis() as u64;
        match res {
            Err(_) => Err(McpError::Timeout {
                server: tool.server.clone(),
                tool: tool.remote_name.clone(),
                ms,
            }),
            Ok(Ok(r)) => Ok(ToolOutput::from_result(r, elapsed)),
            Ok(Err(ServiceError::McpError(e))) => Err(McpError::Refused {
                server: tool.server.clone(),
                tool: tool.remote_name.clone(),
                why: e.message.to_string(),
            }),
            Ok(Err(e)) => {
                let why = e.to_string();
                server.forget(&why).await;
                Err(McpError::Gone {
                    server: tool.server.clone(),
                    tool: tool.remote_name.clone(),
                    why,
                })
            }
        }
    }
}

impl Server {
    fn forget_sync(&self) {
        if let Ok(mut c) = self.client.try_lock() {
            *c = None;
        }
    }
}

/// Runs futures concurrently and returns their outputs in order.
async fn futures_join<T, F>(futs: impl Iterator<Item = F>) -> Vec<Result<T, String>>
where
    F: std::future::Future<Output = Result<T, String>> + Send + 'static,
    T: Send + 'static,
{
    let handles: Vec<_> = futs.map(tokio::spawn).collect();
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(
            h.await
                .unwrap_or_else(|e| Err(format!("connecting failed: {e}"))),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_needs_exactly_one_transport() {
        assert!(McpServerConfig::stdio("fs", "node", &["x.js"])
            .validate()
            .is_ok());
        assert!(McpServerConfig::http("h", "http://127.0.0.1:1/mcp")
            .validate()
            .is_ok());
        let mut both = McpServerConfig::stdio("b", "node", &[]);
        both.url = Some("http://x".into());
        assert!(both.validate().unwrap_err().contains("exactly one"));
        let neither = McpServerConfig {
            command: None,
            ..McpServerConfig::stdio("n", "", &[])
        };
        assert!(neither.validate().unwrap_err().contains("exactly one"));
        assert!(McpServerConfig::http("u", "ftp://x")
            .validate()
            .unwrap_err()
            .contains("http://"));
        let parsed: McpServerConfig =
            serde_json::from_value(serde_json::json!({"name": "fs", "command": "node"})).unwrap();
        assert!(parsed.trust_read_only_hint);
        assert_eq!(parsed.call_timeout_ms, 30_000);
    }

    #[tokio::test]
    async fn unknown_tool_and_bad_arguments_are_errors() {
        let hub = McpHub::empty();
        assert_eq!(
            hub.call("nope", &Value::Null).await.unwrap_err(),
            McpError::UnknownTool("nope".into())
        );
    }
}
