//! Deployment files: Kubernetes manifests for a mesh cluster (`mesh deploy k8s`).
//!
//! Everything here is a pure function of a [`K8sPlan`] (the CLI reads models, certificates
//! and key files and fills it in), so the manifests are tested without a cluster:
//!
//! - one StatefulSet per node pool (`<name>-<pool>`, pods `<name>-<pool>-<i>`), every pod
//!   a `mesh join` node named after its pod, with its own certificate;
//! - a headless Service `<name>-peers` (QUIC, UDP) that gives each pod a DNS name and
//!   publishes pods before they are ready, so that nodes find their seeds while they load;
//! - a Service `<name>` for clients (HTTP; only ready pods);
//! - a Secret with the cluster CA certificate and every pod's certificate and key, a
//!   Secret with the API key file, a ConfigMap with the node config;
//! - a PodDisruptionBudget per pool, Prometheus scrape annotations, probes on `/ready`
//!   and `/health`, resources from the tier sizes, `kubernetes.io/arch` node selection.
//!
//! Seeds: pod 0 of every pool. A pod 0 finds itself in that list and skips it
//! (`mesh_actors::seeds`), so it starts (or later rejoins) the cluster with whatever
//! other seeds answer; other pods need one seed to answer and restart until one does.

use serde_json::{json, Value};

/// The label every object carries.
pub const APP_LABEL: &str = "app.kubernetes.io/name";
/// The label that tells pools apart.
pub const POOL_LABEL: &str = "mesh.dev/pool";
/// The user and group the container runs as (the image has no `/etc/passwd`).
pub const RUN_AS: u64 = 65532;
/// Memory a node needs beside its tiers: gateway, router embedder, page store index.
pub const NODE_OVERHEAD_BYTES: u64 = 256 << 20;
/// CPU (millicores) a node needs beside its tiers' threads: gateway, router, QUIC.
pub const NODE_OVERHEAD_MILLI: u64 = 250;

/// A group of identical nodes: one StatefulSet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pool {
    /// DNS label; the StatefulSet is `<name>-<pool>`.
    pub name: String,
    /// Tiers every node of the pool hosts.
    pub tiers: Vec<String>,
    /// Nodes in the pool.
    pub replicas: u32,
}

impl Pool {
    /// Parses `NAME=TIER[+TIER..][:REPLICAS]` (`large=t3:2`, `small=t1+t2`).
    pub fn parse(s: &str) -> Result<Pool, String> {
        let (name, rest) = s
            .split_once('=')
            .ok_or_else(|| format!("--pool expects NAME=TIER[+TIER..][:REPLICAS], got `{s}`"))?;
        let (tiers, replicas) = match rest.rsplit_once(':') {
            Some((t, r)) => (
                t,
                r.parse::<u32>()
                    .map_err(|_| format!("--pool `{s}`: replicas `{r}` is not a number"))?,
            ),
            None => (rest, 1),
        };
        let tiers: Vec<String> = tiers
            .split('+')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(str::to_owned)
            .collect();
        if tiers.is_empty() {
            return Err(format!("--pool `{s}` names no tier"));
        }
        Ok(Pool {
            name: name.trim().to_owned(),
            tiers,
            replicas,
        })
    }
}

/// What one tier needs on a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierNeeds {
    /// Tier name.
    pub name: String,
    /// Bytes: weights, KV cache, page budget, buffers (`mesh_tiers::tier_memory_bytes`).
    pub memory_bytes: u64,
    /// llama.cpp threads, one core each.
    pub threads: u32,
}

/// Everything the manifests are made from.
#[derive(Debug, Clone)]
pub struct K8sPlan {
    /// Prefix of every object's name, and the `app.kubernetes.io/name` label.
    pub name: String,
    /// Namespace written into every object (none: the one `kubectl` uses).
    pub namespace: Option<String>,
    /// Container image.
    pub image: String,
    /// `kubernetes.io/arch` of the nodes to run on (`amd64`, `arm64`).
    pub arch: String,
    /// Node pools.
    pub pools: Vec<Pool>,
    /// Needs of every tier a pool names.
    pub tiers: Vec<TierNeeds>,
    /// The node config file (TOML) every node reads.
    pub node_toml: String,
    /// Files of the certificate Secret: `ca.pem`, `<pod>.pem`, `<pod>.key`.
    pub cert_files: Vec<(String, String)>,
    /// The API key file; `None` runs the nodes with `--insecure-no-auth`.
    pub keys_json: Option<String>,
    /// Gateway port.
    pub http_port: u16,
    /// QUIC port.
    pub quic_port: u16,
}

/// Whether `s` is a DNS-1123 label (what Kubernetes names and our pod names need).
fn dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// The StatefulSet name of a pool.
pub fn statefulset_name(name: &str, pool: &Pool) -> String {
    format!("{name}-{}", pool.name)
}

/// Every pod's name (and so its node name and certificate), pool by pool.
pub fn pod_names(name: &str, pools: &[Pool]) -> Vec<String> {
    pools
        .iter()
        .flat_map(|p| {
            let sts = statefulset_name(name, p);
            (0..p.replicas).map(move |i| format!("{sts}-{i}"))
        })
        .collect()
}

/// The seeds every node gets: pod 0 of each pool, by its name under the headless Service.
pub fn seeds(name: &str, pools: &[Pool], quic_port: u16) -> Vec<String> {
    pools
        .iter()
        .filter(|p| p.replicas > 0)
        .map(|p| format!("{}-0.{name}-peers:{quic_port}", statefulset_name(name, p)))
        .collect()
}

/// CPU (millicores) and memory (bytes) a node of `pool` requests: its tiers' threads and
/// memory plus the node's own share.
pub fn pool_requests(pool: &Pool, tiers: &[TierNeeds]) -> Result<(u64, u64), String> {
    let mut milli = NODE_OVERHEAD_MILLI;
    let mut bytes = NODE_OVERHEAD_BYTES;
    for t in &pool.tiers {
        let n = tiers
            .iter()
            .find(|n| &n.name == t)
            .ok_or_else(|| format!("pool `{}`: tier `{t}` is not configured", pool.name))?;
        milli += u64::from(n.threads.max(1)) * 1000;
        bytes += n.memory_bytes;
    }
    Ok((milli, bytes))
}

/// Bytes as a Kubernetes quantity in whole MiB, rounded up.
fn mib(bytes: u64) -> String {
    format!("{}Mi", bytes.div_ceil(1 << 20))
}

fn check(plan: &K8sPlan) -> Result<(), String> {
    if !dns_label(&plan.name) {
        return Err(format!(
            "name `{}` must be a DNS label: lower-case letters, digits and `-`",
            plan.name
        ));
    }
    if !matches!(plan.arch.as_str(), "amd64" | "arm64") {
        return Err(format!("--arch `{}`: use amd64 or arm64", plan.arch));
    }
    if plan.pools.is_empty() {
        return Err("no node pool: give --tiers or --pool".into());
    }
    let mut seen = std::collections::HashSet::new();
    for p in &plan.pools {
        if !dns_label(&p.name) {
            return Err(format!(
                "pool `{}` must be a DNS label: lower-case letters, digits and `-`",
                p.name
            ));
        }
        if !seen.insert(&p.name) {
            return Err(format!("pool `{}` is given twice", p.name));
        }
        if p.replicas == 0 {
            return Err(format!("pool `{}` has no replicas", p.name));
        }
    }
    for pod in pod_names(&plan.name, &plan.pools) {
        // Pod names are node names and certificate names; StatefulSet pods also carry
        // a `controller-revision-hash` label of the name plus 11 characters (<= 63).
        if pod.len() > 52 {
            return Err(format!(
                "pod name `{pod}` is too long: shorten --name or the pool names"
            ));
        }
    }
    Ok(())
}

fn meta(plan: &K8sPlan, name: &str, component: &str) -> Value {
    let mut m = json!({
        "name": name,
        "labels": {
            APP_LABEL: plan.name,
            "app.kubernetes.io/component": component,
            "app.kubernetes.io/managed-by": "mesh-deploy",
        },
    });
    if let Some(ns) = &plan.namespace {
        m["namespace"] = json!(ns);
    }
    m
}

/// The `mesh join` arguments of a pool's nodes.
pub fn node_args(plan: &K8sPlan, pool: &Pool) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "join".into(),
        "--name".into(),
        "$(POD_NAME)".into(),
        "--config".into(),
        "/etc/mesh/config/node.toml".into(),
        "--tiers".into(),
        pool.tiers.join(","),
        "--quic".into(),
        format!("0.0.0.0:{}", plan.quic_port),
        "--advertise".into(),
        format!("$(POD_IP):{}", plan.quic_port),
        "--listen".into(),
        format!("0.0.0.0:{}", plan.http_port),
        "--cert-dir".into(),
        "/etc/mesh/certs".into(),
    ];
    match plan.keys_json {
        Some(_) => args.extend(["--keys".into(), "/etc/mesh/keys/keys.json".into()]),
        None => args.push("--insecure-no-auth".into()),
    }
    args.push("--seeds".into());
    args.push(seeds(&plan.name, &plan.pools, plan.quic_port).join(","));
    args
}

/// A hash of what the pods read from the ConfigMap and Secrets: a change rolls the pods.
fn config_hash(plan: &K8sPlan) -> String {
    let mut h = blake3::Hasher::new();
    h.update(plan.node_toml.as_bytes());
    for (k, v) in &plan.cert_files {
        h.update(k.as_bytes());
        h.update(v.as_bytes());
    }
    if let Some(k) = &plan.keys_json {
        h.update(k.as_bytes());
    }
    h.finalize().to_hex()[..16].to_owned()
}

fn statefulset(plan: &K8sPlan, pool: &Pool) -> Result<Value, String> {
    let sts = statefulset_name(&plan.name, pool);
    let (milli, bytes) = pool_requests(pool, &plan.tiers)?;
    let labels = json!({ APP_LABEL: plan.name, POOL_LABEL: pool.name });
    let mut volumes = vec![
        json!({"name": "config", "configMap": {"name": format!("{}-config", plan.name)}}),
        json!({"name": "certs", "secret": {"secretName": format!("{}-certs", plan.name), "defaultMode": 0o440}}),
        json!({"name": "tmp", "emptyDir": {}}),
    ];
    let mut mounts = vec![
        json!({"name": "config", "mountPath": "/etc/mesh/config", "readOnly": true}),
        json!({"name": "certs", "mountPath": "/etc/mesh/certs", "readOnly": true}),
        json!({"name": "tmp", "mountPath": "/tmp"}),
    ];
    if plan.keys_json.is_some() {
        volumes.push(json!({"name": "keys", "secret": {"secretName": format!("{}-keys", plan.name), "defaultMode": 0o440}}));
        mounts.push(json!({"name": "keys", "mountPath": "/etc/mesh/keys", "readOnly": true}));
    }
    let mut m = meta(plan, &sts, "node");
    m["labels"][POOL_LABEL] = json!(pool.name);
    Ok(json!({
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": m,
        "spec": {
            "serviceName": format!("{}-peers", plan.name),
            "replicas": pool.replicas,
            "podManagementPolicy": "OrderedReady",
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": plan.http_port.to_string(),
                        "prometheus.io/path": "/metrics",
                        "mesh.dev/config-hash": config_hash(plan),
                    },
                },
                "spec": {
                    "nodeSelector": {"kubernetes.io/arch": plan.arch, "kubernetes.io/os": "linux"},
                    "terminationGracePeriodSeconds": 60,
                    "securityContext": {
                        "runAsNonRoot": true,
                        "runAsUser": RUN_AS,
                        "runAsGroup": RUN_AS,
                        "fsGroup": RUN_AS,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [{
                        "name": "mesh",
                        "image": plan.image,
                        "imagePullPolicy": "IfNotPresent",
                        "args": node_args(plan, pool),
                        "env": [
                            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                            {"name": "MESH_MODELS_DIR", "value": "/models"},
                            {"name": "RUST_LOG", "value": "info"},
                        ],
                        "ports": [
                            {"name": "http", "containerPort": plan.http_port, "protocol": "TCP"},
                            {"name": "quic", "containerPort": plan.quic_port, "protocol": "UDP"},
                        ],
                        "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "failureThreshold": 120},
                        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5, "failureThreshold": 2},
                        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3},
                        "resources": {
                            "requests": {"cpu": format!("{milli}m"), "memory": mib(bytes)},
                            "limits": {"memory": mib(bytes + bytes / 2)},
                        },
                        "securityContext": {
                            "allowPrivilegeEscalation": false,
                            "readOnlyRootFilesystem": true,
                            "capabilities": {"drop": ["ALL"]},
                        },
                        "volumeMounts": mounts,
                    }],
                    "volumes": volumes,
                },
            },
        },
    }))
}

/// The manifests, in the order `kubectl apply` should create them.
pub fn manifests(plan: &K8sPlan) -> Result<Vec<Value>, String> {
    check(plan)?;
    let mut docs = vec![];
    let mut cfg = meta(plan, &format!("{}-config", plan.name), "config");
    cfg["labels"]["app.kubernetes.io/part-of"] = json!(plan.name);
    docs.push(json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": cfg,
        "data": {"node.toml": plan.node_toml},
    }));
    let certs: serde_json::Map<String, Value> = plan
        .cert_files
        .iter()
        .map(|(k, v)| (k.clone(), json!(v)))
        .collect();
    docs.push(json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta(plan, &format!("{}-certs", plan.name), "certs"),
        "type": "Opaque",
        "stringData": certs,
    }));
    if let Some(k) = &plan.keys_json {
        docs.push(json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": meta(plan, &format!("{}-keys", plan.name), "keys"),
            "type": "Opaque",
            "stringData": {"keys.json": k},
        }));
    }
    let selector = json!({ APP_LABEL: plan.name });
    docs.push(json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(plan, &format!("{}-peers", plan.name), "peers"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": true,
            "selector": selector,
            "ports": [{"name": "quic", "port": plan.quic_port, "targetPort": "quic", "protocol": "UDP"}],
        },
    }));
    docs.push(json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(plan, &plan.name, "gateway"),
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{"name": "http", "port": plan.http_port, "targetPort": "http", "protocol": "TCP"}],
        },
    }));
    for pool in &plan.pools {
        docs.push(statefulset(plan, pool)?);
        let mut m = meta(plan, &statefulset_name(&plan.name, pool), "node");
        m["labels"][POOL_LABEL] = json!(pool.name);
        docs.push(json!({
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": m,
            "spec": {
                "maxUnavailable": 1,
                "selector": {"matchLabels": { APP_LABEL: plan.name, POOL_LABEL: pool.name }},
            },
        }));
    }
    Ok(docs)
}

/// Where the image keeps the bundled models (`MESH_MODELS_DIR` in the container).
pub const IMAGE_MODELS_DIR: &str = "/models";

/// A model path as the container sees it: files under the local models folder are in
/// the image's [`IMAGE_MODELS_DIR`]; other paths are kept (the operator mounts them).
pub fn image_model_path(
    path: &std::path::Path,
    models_dir: &std::path::Path,
) -> std::path::PathBuf {
    match path.strip_prefix(models_dir) {
        Ok(rel) => std::path::Path::new(IMAGE_MODELS_DIR).join(rel),
        Err(_) => path.to_owned(),
    }
}

/// The node config file of the ConfigMap: `base` (an operator's TOML, or nothing) with
/// its `tiers` replaced by `tiers` at their image paths, and `listen` / `cluster` left out
/// (the pod's flags set them). Checked by parsing it back as a node config.
pub fn node_toml(
    base: Option<&str>,
    tiers: &[mesh_tiers::EngineConfig],
    models_dir: &std::path::Path,
) -> Result<String, String> {
    let mut table: toml::Table = match base {
        Some(t) => toml::from_str(t).map_err(|e| format!("node config: {e}"))?,
        None => toml::Table::new(),
    };
    table.remove("listen");
    table.remove("cluster");
    let mut arr = vec![];
    for t in tiers {
        let mut t = t.clone();
        t.model = image_model_path(&t.model, models_dir);
        if let Some(d) = &mut t.draft {
            d.model = image_model_path(&d.model, models_dir);
        }
        if let Some(dir) = &t.kv_pages.disk_dir {
            return Err(format!(
                "tier `{}` keeps pages on disk ({}): give its pods a volume first; \
                 deploy without `kv_pages.disk_dir`",
                t.name,
                dir.display()
            ));
        }
        arr.push(toml::Value::try_from(&t).map_err(|e| format!("tier `{}`: {e}", t.name))?);
    }
    table.insert("tiers".into(), toml::Value::Array(arr));
    let text = toml::to_string(&table).map_err(|e| e.to_string())?;
    toml::from_str::<crate::config::NodeConfig>(&text)
        .map_err(|e| format!("the node config written for the pods does not parse: {e}"))?;
    Ok(format!(
        "# Node config of every pod (docs/architecture.md); the pod's flags set listen and cluster.\n{text}"
    ))
}

/// Documents as one multi-document YAML stream, after a comment `header`.
pub fn to_yaml(header: &str, docs: &[Value]) -> Result<String, String> {
    let mut out = String::new();
    for line in header.lines() {
        out.push_str("# ");
        out.push_str(line);
        out.push('\n');
    }
    for d in docs {
        out.push_str("---\n");
        out.push_str(&serde_norway::to_string(d).map_err(|e| e.to_string())?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> K8sPlan {
        K8sPlan {
            name: "mesh".into(),
            namespace: None,
            image: "mesh:0.1.0".into(),
            arch: "arm64".into(),
            pools: vec![
                Pool::parse("small=t1+t2:3").unwrap(),
                Pool::parse("large=t3:2").unwrap(),
            ],
            tiers: ["t1", "t2", "t3"]
                .iter()
                .map(|t| TierNeeds {
                    name: (*t).into(),
                    memory_bytes: 100 << 20,
                    threads: 2,
                })
                .collect(),
            node_toml: "max_concurrent = 64\n".into(),
            cert_files: vec![("ca.pem".into(), "PEM".into())],
            keys_json: Some("{}".into()),
            http_port: 8080,
            quic_port: 7070,
        }
    }

    fn kinds(docs: &[Value], kind: &str) -> Vec<Value> {
        docs.iter().filter(|d| d["kind"] == kind).cloned().collect()
    }

    #[test]
    fn a_pool_parses_with_tiers_and_replicas() {
        assert_eq!(
            Pool::parse("small=t1+t2:3").unwrap(),
            Pool {
                name: "small".into(),
                tiers: vec!["t1".into(), "t2".into()],
                replicas: 3
            }
        );
        assert_eq!(Pool::parse("large=t3").unwrap().replicas, 1);
    }

    #[test]
    fn a_pool_without_tiers_or_with_bad_replicas_is_refused() {
        assert!(Pool::parse("small=").is_err());
        assert!(Pool::parse("small=t1:x").is_err());
        assert!(Pool::parse("t1").is_err());
    }

    #[test]
    fn pods_are_named_per_pool_and_ordinal() {
        let p = plan();
        assert_eq!(
            pod_names(&p.name, &p.pools),
            [
                "mesh-small-0",
                "mesh-small-1",
                "mesh-small-2",
                "mesh-large-0",
                "mesh-large-1"
            ]
        );
    }

    #[test]
    fn seeds_are_pod_zero_of_each_pool_under_the_headless_service() {
        let p = plan();
        assert_eq!(
            seeds(&p.name, &p.pools, 7070),
            [
                "mesh-small-0.mesh-peers:7070",
                "mesh-large-0.mesh-peers:7070"
            ]
        );
    }

    #[test]
    fn requests_add_tier_needs_to_the_node_share() {
        let p = plan();
        let (milli, bytes) = pool_requests(&p.pools[0], &p.tiers).unwrap();
        assert_eq!(milli, NODE_OVERHEAD_MILLI + 4000);
        assert_eq!(bytes, NODE_OVERHEAD_BYTES + (200 << 20));
    }

    #[test]
    fn a_pool_naming_an_unconfigured_tier_is_refused() {
        let mut p = plan();
        p.pools[0].tiers.push("t9".into());
        assert!(manifests(&p).unwrap_err().contains("t9"));
    }

    #[test]
    fn every_pool_gets_a_statefulset_and_a_disruption_budget() {
        let docs = manifests(&plan()).unwrap();
        assert_eq!(kinds(&docs, "StatefulSet").len(), 2);
        assert_eq!(kinds(&docs, "PodDisruptionBudget").len(), 2);
        assert_eq!(kinds(&docs, "Service").len(), 2);
    }

    #[test]
    fn pods_run_on_the_asked_architecture() {
        let docs = manifests(&plan()).unwrap();
        for s in kinds(&docs, "StatefulSet") {
            assert_eq!(
                s["spec"]["template"]["spec"]["nodeSelector"]["kubernetes.io/arch"],
                "arm64"
            );
        }
    }

    #[test]
    fn nodes_advertise_their_pod_address_and_use_the_key_file() {
        let p = plan();
        let args = node_args(&p, &p.pools[1]);
        let after = |flag: &str| {
            let i = args.iter().position(|a| a == flag).unwrap();
            args[i + 1].clone()
        };
        assert_eq!(after("--advertise"), "$(POD_IP):7070");
        assert_eq!(after("--name"), "$(POD_NAME)");
        assert_eq!(after("--tiers"), "t3");
        assert_eq!(after("--keys"), "/etc/mesh/keys/keys.json");
        assert!(!args.contains(&"--insecure-no-auth".to_owned()));
    }

    #[test]
    fn without_a_key_file_nodes_run_without_auth_and_no_key_secret_is_made() {
        let mut p = plan();
        p.keys_json = None;
        assert!(node_args(&p, &p.pools[0]).contains(&"--insecure-no-auth".to_owned()));
        let docs = manifests(&p).unwrap();
        assert_eq!(kinds(&docs, "Secret").len(), 1);
    }

    #[test]
    fn the_peer_service_publishes_pods_before_they_are_ready() {
        let docs = manifests(&plan()).unwrap();
        let peers = docs
            .iter()
            .find(|d| d["metadata"]["name"] == "mesh-peers")
            .unwrap();
        assert_eq!(peers["spec"]["clusterIP"], "None");
        assert_eq!(peers["spec"]["publishNotReadyAddresses"], true);
    }

    #[test]
    fn a_config_change_changes_the_pod_template() {
        let a = manifests(&plan()).unwrap();
        let mut p = plan();
        p.node_toml.push_str("default_max_tokens = 128\n");
        let b = manifests(&p).unwrap();
        let hash = |docs: &[Value]| {
            kinds(docs, "StatefulSet")[0]["spec"]["template"]["metadata"]["annotations"]
                ["mesh.dev/config-hash"]
                .clone()
        };
        assert_ne!(hash(&a), hash(&b));
    }

    #[test]
    fn names_that_are_not_dns_labels_are_refused() {
        let mut p = plan();
        p.pools[0].name = "Small".into();
        assert!(manifests(&p).is_err());
        let mut p = plan();
        p.arch = "riscv".into();
        assert!(manifests(&p).is_err());
    }

    #[test]
    fn bundled_model_paths_become_image_paths() {
        let p = image_model_path(
            std::path::Path::new("models/t1-q8_0.gguf"),
            std::path::Path::new("models"),
        );
        assert_eq!(p, std::path::Path::new("/models/t1-q8_0.gguf"));
        let q = image_model_path(
            std::path::Path::new("/data/big.gguf"),
            std::path::Path::new("models"),
        );
        assert_eq!(q, std::path::Path::new("/data/big.gguf"));
    }

    #[test]
    fn the_node_config_keeps_the_operators_settings_and_drops_listen() {
        let tiers = crate::config::bundled_tiers(std::path::Path::new("models"));
        let text = node_toml(
            Some("listen = \"127.0.0.1:9\"\ndefault_max_tokens = 77\n"),
            &tiers[..1],
            std::path::Path::new("models"),
        )
        .unwrap();
        let cfg: crate::config::NodeConfig = toml::from_str(&text).unwrap();
        assert_eq!(cfg.default_max_tokens, 77);
        assert_eq!(cfg.listen, crate::config::NodeConfig::default().listen);
        assert_eq!(cfg.tiers.len(), 1);
        assert_eq!(
            cfg.tiers[0].model,
            std::path::Path::new("/models/t1-q8_0.gguf")
        );
    }

    #[test]
    fn a_tier_with_a_disk_page_folder_is_refused() {
        let mut tiers = crate::config::bundled_tiers(std::path::Path::new("models"));
        tiers[0].kv_pages.disk_dir = Some("/var/kv".into());
        assert!(node_toml(None, &tiers[..1], std::path::Path::new("models"))
            .unwrap_err()
            .contains("disk"));
    }

    #[test]
    fn the_yaml_stream_has_one_document_per_manifest() {
        let docs = manifests(&plan()).unwrap();
        let y = to_yaml("mesh deploy k8s", &docs).unwrap();
        assert!(y.starts_with("# mesh deploy k8s\n"));
        assert_eq!(y.lines().filter(|l| *l == "---").count(), docs.len());
    }
}
