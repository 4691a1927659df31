//! API keys: what a key may do (scopes, tools), the key file, and the pure decisions the
//! HTTP layer enforces (which scope a route needs, which tools a key may run).
//!
//! A key reads `msk_<id>_<secret>`: `id` (8 hex digits) names it in the file and in logs,
//! `secret` (48 hex digits, 192 random bits) is kept only as its blake3 hash. Keys are
//! made by `mesh keys create` and shown once; a node started with `--keys FILE` (or
//! `[auth] keys_file`) asks every `/v1` request for `Authorization: Bearer <key>`.
//!
//! ```json
//! {"keys": [{"id": "1a2b3c4d", "name": "ci", "hash": "<blake3 hex>",
//!            "scopes": ["inference", "agent"], "tools": ["search", "send_email"],
//!            "created_unix_s": 1764680000}]}
//! ```

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// What a key may do. A key holds one or more; none implies another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Completions, models, the cluster view.
    Inference,
    /// Agent tasks and the tool list.
    Agent,
    /// The live policy and the tuner.
    Control,
}

impl Scope {
    /// As flags and the file write it.
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Inference => "inference",
            Scope::Agent => "agent",
            Scope::Control => "control",
        }
    }

    /// The scope named `s`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "inference" => Ok(Scope::Inference),
            "agent" => Ok(Scope::Agent),
            "control" => Ok(Scope::Control),
            other => Err(format!(
                "unknown scope `{other}` (inference, agent, control)"
            )),
        }
    }
}

/// The scope a request to `path` needs; `None` for routes that stay open (health, readiness,
/// metrics, and fault injection, which has its own token).
pub fn required_scope(path: &str) -> Option<Scope> {
    let p = path.trim_end_matches('/');
    if !(p == "/v1" || p.starts_with("/v1/")) || p == "/v1/debug/crash" {
        return None;
    }
    Some(if p.starts_with("/v1/control") {
        Scope::Control
    } else if p.starts_with("/v1/agent") || p == "/v1/tools" {
        Scope::Agent
    } else {
        Scope::Inference
    })
}

/// Whether a node must refuse to start: it would serve `ip`, which other hosts can reach,
/// without keys and without the operator's explicit `--insecure-no-auth`.
pub fn refuse_open_listen(ip: std::net::IpAddr, have_keys: bool, insecure_no_auth: bool) -> bool {
    !ip.is_loopback() && !have_keys && !insecure_no_auth
}

/// A key as the node knows it once it has checked the secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// The key's id.
    pub id: String,
    /// Its scopes.
    pub scopes: Vec<Scope>,
    /// Tools it may run in agent tasks: `None` = every tool without side effects; a list =
    /// exactly those (a tool with side effects runs only when listed).
    pub tools: Option<Vec<String>>,
    /// Its own rate and concurrency limits, over the node's defaults.
    pub limits: KeyLimits,
}

/// A key's own limits (`mesh keys create --rpm N --concurrency N`); unset: the node's
/// `[limits]` defaults apply.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyLimits {
    /// Requests per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rpm: Option<u32>,
    /// Requests in flight at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u32>,
}

impl KeyLimits {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

impl Principal {
    /// Whether the key holds `scope`.
    pub fn has(&self, scope: Scope) -> bool {
        self.scopes.contains(&scope)
    }

    /// Whether the key may run the tool `name` in an agent task; `read_only` says whether
    /// the tool is known to have no side effects.
    pub fn may_run(&self, name: &str, read_only: bool) -> bool {
        match &self.tools {
            Some(list) => list.iter().any(|t| t == name),
            None => read_only,
        }
    }
}

/// One key in the file.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct KeyRecord {
    /// 8 hex digits, unique in the file.
    pub id: String,
    /// A label for people (`--name`).
    #[serde(default)]
    pub name: String,
    /// blake3 of the secret, hex.
    pub hash: String,
    /// Scopes.
    pub scopes: Vec<Scope>,
    /// Allowed tools (see [`Principal::tools`]).
    #[serde(default)]
    pub tools: Option<Vec<String>>,
    /// When it was made.
    #[serde(default)]
    pub created_unix_s: u64,
    /// Its own limits.
    #[serde(default, skip_serializing_if = "KeyLimits::is_default")]
    pub limits: KeyLimits,
}

/// The key file.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct KeyFile {
    /// Keys, in the order they were made.
    pub keys: Vec<KeyRecord>,
}

/// The checked keys a node serves with.
#[derive(Debug, Clone, Default)]
pub struct Keys {
    records: Vec<KeyRecord>,
}

/// Why a bearer token was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No `Authorization: Bearer` header.
    Missing,
    /// Not a key of this node (malformed, unknown id, or wrong secret).
    Invalid,
}

fn hash_hex(secret: &str) -> String {
    blake3::hash(secret.as_bytes()).to_hex().to_string()
}

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Splits `msk_<id>_<secret>`.
fn split_key(key: &str) -> Option<(&str, &str)> {
    let rest = key.strip_prefix("msk_")?;
    let (id, secret) = rest.split_once('_')?;
    (is_hex(id, 8) && is_hex(secret, 48)).then_some((id, secret))
}

impl Keys {
    /// Keys from a parsed file, checked: ids unique and well formed, hashes well formed,
    /// each key with at least one scope.
    pub fn new(file: KeyFile) -> Result<Self, String> {
        let mut seen = std::collections::HashSet::new();
        for k in &file.keys {
            if !is_hex(&k.id, 8) {
                return Err(format!("key id `{}` is not 8 hex digits", k.id));
            }
            if !seen.insert(k.id.as_str()) {
                return Err(format!("key id `{}` appears twice", k.id));
            }
            if !is_hex(&k.hash, 64) {
                return Err(format!("key `{}`: hash is not 64 hex digits", k.id));
            }
            if k.scopes.is_empty() {
                return Err(format!("key `{}` has no scope", k.id));
            }
        }
        Ok(Self { records: file.keys })
    }

    /// Reads and checks a key file.
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let file: KeyFile =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        Self::new(file).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// How many keys.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The key an `Authorization` header value names.
    pub fn check(&self, authorization: Option<&str>) -> Result<Principal, Refusal> {
        let token = authorization
            .and_then(|v| {
                let (scheme, rest) = v.trim().split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then_some(rest.trim())
            })
            .ok_or(Refusal::Missing)?;
        let (id, secret) = split_key(token).ok_or(Refusal::Invalid)?;
        let rec = self
            .records
            .iter()
            .find(|k| k.id == id)
            .ok_or(Refusal::Invalid)?;
        // blake3's Hash compares in constant time.
        let want = blake3::Hash::from_hex(&rec.hash).map_err(|_| Refusal::Invalid)?;
        if blake3::hash(secret.as_bytes()) != want {
            return Err(Refusal::Invalid);
        }
        Ok(Principal {
            id: rec.id.clone(),
            scopes: rec.scopes.clone(),
            tools: rec.tools.clone(),
            limits: rec.limits,
        })
    }
}

/// Default key file: `$MESH_KEYS_FILE`, else `~/.mesh/keys.json`.
pub fn default_keys_file() -> PathBuf {
    if let Ok(p) = std::env::var(crate::env::KEYS_FILE) {
        return PathBuf::from(p);
    }
    std::env::var("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from("."))
        .join(".mesh")
        .join("keys.json")
}

fn random_hex(bytes: usize) -> Result<String, String> {
    let mut buf = vec![0u8; bytes];
    getrandom::fill(&mut buf).map_err(|e| format!("no random numbers from the OS: {e}"))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// A new key for `scopes` and `tools` added to the file at `path` (made, mode 0600, when
/// missing); returns the key, which is stored only as its hash.
pub fn create(
    path: &Path,
    name: &str,
    scopes: Vec<Scope>,
    tools: Option<Vec<String>>,
    limits: KeyLimits,
) -> Result<(KeyRecord, String), String> {
    if scopes.is_empty() {
        return Err("give at least one --scope (inference, agent, control)".into());
    }
    if let Some(t) = &tools {
        if t.is_empty() || t.iter().any(|n| n.trim().is_empty()) {
            return Err("--tools needs tool names, comma-separated".into());
        }
        if !scopes.contains(&Scope::Agent) {
            return Err("--tools only matters with --scope agent".into());
        }
    }
    let mut file = match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str::<KeyFile>(&text)
            .map_err(|e| format!("{}: {e}", path.display()))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => KeyFile::default(),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    let mut id = random_hex(4)?;
    while file.keys.iter().any(|k| k.id == id) {
        id = random_hex(4)?;
    }
    let secret = random_hex(24)?;
    if limits.rpm == Some(0) || limits.concurrency == Some(0) {
        return Err(
            "--rpm and --concurrency must be at least 1 (leave them out for the node's defaults)"
                .into(),
        );
    }
    let mut unique: Vec<Scope> = Vec::new();
    for s in scopes {
        if !unique.contains(&s) {
            unique.push(s);
        }
    }
    let scopes = unique;
    let rec = KeyRecord {
        id: id.clone(),
        name: name.to_owned(),
        hash: hash_hex(&secret),
        scopes,
        tools,
        limits,
        created_unix_s: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    };
    file.keys.push(rec.clone());
    write_file(path, &file)?;
    Ok((rec, format!("msk_{id}_{secret}")))
}

/// Removes the key `id` from the file; `Err` when it holds none.
pub fn revoke(path: &Path, id: &str) -> Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut file: KeyFile =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let before = file.keys.len();
    file.keys.retain(|k| k.id != id);
    if file.keys.len() == before {
        return Err(format!("{} holds no key `{id}`", path.display()));
    }
    write_file(path, &file)
}

/// Writes the file whole (temp file, then rename), mode 0600.
fn write_file(path: &Path, file: &KeyFile) -> Result<(), String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let tmp = path.with_extension("json.tmp");
    let text = serde_json::to_string_pretty(file).map_err(|e| e.to_string())?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| format!("{}: {e}", tmp.display()))?;
    f.write_all(text.as_bytes())
        .and_then(|_| f.sync_all())
        .map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys_with(scopes: Vec<Scope>, tools: Option<Vec<String>>) -> (Keys, String) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.json");
        let (_, key) = create(&path, "t", scopes, tools, KeyLimits::default()).unwrap();
        (Keys::load(&path).unwrap(), key)
    }

    #[test]
    fn a_created_key_is_accepted_with_its_scopes() {
        let (keys, key) = keys_with(vec![Scope::Inference, Scope::Agent], None);
        let p = keys.check(Some(&format!("Bearer {key}"))).unwrap();
        assert!(p.has(Scope::Inference) && p.has(Scope::Agent) && !p.has(Scope::Control));
    }

    #[test]
    fn the_file_holds_no_secret() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.json");
        let (_, key) = create(
            &path,
            "t",
            vec![Scope::Inference],
            None,
            KeyLimits::default(),
        )
        .unwrap();
        let secret = key.rsplit('_').next().unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains(secret));
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn a_wrong_secret_is_refused() {
        let (keys, key) = keys_with(vec![Scope::Inference], None);
        let mut bad = key.clone();
        let last = bad.pop().unwrap();
        bad.push(if last == '0' { '1' } else { '0' });
        assert_eq!(
            keys.check(Some(&format!("Bearer {bad}"))),
            Err(Refusal::Invalid)
        );
    }

    #[test]
    fn missing_and_malformed_headers_are_told_apart() {
        let (keys, key) = keys_with(vec![Scope::Inference], None);
        assert_eq!(keys.check(None), Err(Refusal::Missing));
        assert_eq!(
            keys.check(Some(&format!("Basic {key}"))),
            Err(Refusal::Missing)
        );
        assert_eq!(
            keys.check(Some("Bearer sk-not-ours")),
            Err(Refusal::Invalid)
        );
        assert!(keys.check(Some(&format!("bearer  {key} "))).is_ok());
    }

    #[test]
    fn a_revoked_key_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.json");
        let (rec, key) = create(
            &path,
            "t",
            vec![Scope::Inference],
            None,
            KeyLimits::default(),
        )
        .unwrap();
        let (_, other) =
            create(&path, "u", vec![Scope::Control], None, KeyLimits::default()).unwrap();
        revoke(&path, &rec.id).unwrap();
        let keys = Keys::load(&path).unwrap();
        assert_eq!(
            keys.check(Some(&format!("Bearer {key}"))),
            Err(Refusal::Invalid)
        );
        assert!(keys.check(Some(&format!("Bearer {other}"))).is_ok());
        assert!(revoke(&path, &rec.id).is_err());
    }

    #[test]
    fn an_open_address_without_keys_is_refused_unless_insecure() {
        let any: std::net::IpAddr = "0.0.0.0".parse().unwrap();
        let lo: std::net::IpAddr = "127.0.0.1".parse().unwrap();
        let lo6: std::net::IpAddr = "::1".parse().unwrap();
        assert!(refuse_open_listen(any, false, false));
        assert!(!refuse_open_listen(any, true, false));
        assert!(!refuse_open_listen(any, false, true));
        assert!(!refuse_open_listen(lo, false, false));
        assert!(!refuse_open_listen(lo6, false, false));
    }

    #[test]
    fn routes_need_the_scope_of_what_they_do() {
        assert_eq!(
            required_scope("/v1/chat/completions"),
            Some(Scope::Inference)
        );
        assert_eq!(required_scope("/v1/completions"), Some(Scope::Inference));
        assert_eq!(required_scope("/v1/models"), Some(Scope::Inference));
        assert_eq!(required_scope("/v1/cluster"), Some(Scope::Inference));
        assert_eq!(required_scope("/v1/agent/tasks"), Some(Scope::Agent));
        assert_eq!(required_scope("/v1/tools"), Some(Scope::Agent));
        assert_eq!(required_scope("/v1/control/policy"), Some(Scope::Control));
        assert_eq!(required_scope("/v1/control/tune/"), Some(Scope::Control));
        assert_eq!(required_scope("/v1/unknown"), Some(Scope::Inference));
        for open in ["/health", "/ready", "/metrics", "/v1/debug/crash", "/v1x"] {
            assert_eq!(required_scope(open), None, "{open}");
        }
    }

    #[test]
    fn without_a_tool_list_only_tools_without_side_effects_run() {
        let p = Principal {
            id: "00000000".into(),
            scopes: vec![Scope::Agent],
            tools: None,
            limits: KeyLimits::default(),
        };
        assert!(p.may_run("search", true));
        assert!(!p.may_run("send_email", false));
    }

    #[test]
    fn a_tool_list_allows_exactly_its_tools() {
        let p = Principal {
            id: "00000000".into(),
            scopes: vec![Scope::Agent],
            tools: Some(vec!["send_email".into()]),
            limits: KeyLimits::default(),
        };
        assert!(p.may_run("send_email", false));
        assert!(!p.may_run("search", true));
    }

    #[test]
    fn a_zero_limit_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.json");
        let zero = KeyLimits {
            rpm: Some(0),
            concurrency: None,
        };
        assert!(create(&path, "t", vec![Scope::Inference], None, zero).is_err());
    }

    #[test]
    fn repeated_scopes_are_kept_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.json");
        let scopes = vec![Scope::Inference, Scope::Agent, Scope::Inference];
        let (rec, _) = create(&path, "t", scopes, None, KeyLimits::default()).unwrap();
        assert_eq!(rec.scopes, vec![Scope::Inference, Scope::Agent]);
    }

    #[test]
    fn a_keys_limits_survive_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.json");
        let limits = KeyLimits {
            rpm: Some(30),
            concurrency: Some(2),
        };
        let (_, key) = create(&path, "t", vec![Scope::Inference], None, limits).unwrap();
        let keys = Keys::load(&path).unwrap();
        let p = keys.check(Some(&format!("Bearer {key}"))).unwrap();
        assert_eq!(p.limits, limits);
    }

    #[test]
    fn a_key_without_scopes_or_with_tools_but_no_agent_scope_is_not_made() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.json");
        assert!(create(&path, "t", vec![], None, KeyLimits::default()).is_err());
        assert!(create(
            &path,
            "t",
            vec![Scope::Inference],
            Some(vec!["a".into()]),
            KeyLimits::default()
        )
        .is_err());
        assert!(!path.exists());
    }

    #[test]
    fn a_damaged_file_is_refused_with_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.json");
        std::fs::write(
            &path,
            r#"{"keys": [{"id": "zz", "hash": "00", "scopes": []}]}"#,
        )
        .unwrap();
        let e = Keys::load(&path).unwrap_err();
        assert!(e.contains("keys.json") && e.contains("8 hex digits"), "{e}");
    }
}
