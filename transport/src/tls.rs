//! Cluster identities: a cluster CA, node certificates it issues, and the
//! rustls configurations that make every connection mutually authenticated.
//!
//! Files (all PEM) in one folder, by default `~/.mesh/certs`:
//!
//! | file | what | mode |
//! |---|---|---|
//! | `ca.pem` | cluster CA certificate, copied to every node | 0644 |
//! | `ca.key` | CA private key; keep it on the machine that issues certificates | 0600 |
//! | `NAME.pem` | node certificate (CN = node name, SAN = name and `mesh-node`) | 0644 |
//! | `NAME.key` | node private key | 0600 |
//!
//! Private keys are created with mode 0600 in a folder created with 0700, and
//! never overwritten: issuing a name twice is an error, so a running node's key
//! cannot be replaced by accident.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::TransportError;

/// Name every node certificate carries as a SAN; clients verify servers against it
/// (a dialing node does not know a seed's node name yet; the CN is read after the handshake).
pub const CLUSTER_SAN: &str = "mesh-node";

/// Paths of the files of one node identity.
#[derive(Debug, Clone)]
pub struct IdentityPaths {
    /// Cluster CA certificate.
    pub ca: PathBuf,
    /// This node's certificate.
    pub cert: PathBuf,
    /// This node's private key.
    pub key: PathBuf,
}

impl IdentityPaths {
    /// The standard layout in `dir` for node `name`.
    pub fn in_dir(dir: &Path, name: &str) -> Self {
        Self {
            ca: dir.join("ca.pem"),
            cert: dir.join(format!("{name}.pem")),
            key: dir.join(format!("{name}.key")),
        }
    }
}

fn tls_err(what: &str, e: impl std::fmt::Display) -> TransportError {
    TransportError::Tls(format!("{what}: {e}"))
}

fn write_new(path: &Path, data: &str, mode: u32) -> Result<(), TransportError> {
    let mut opts = fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(mode);
    }
    #[cfg(not(unix))]
    let _ = mode;
    let mut f = opts.open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::AlreadyExists => TransportError::Tls(format!(
            "{} already exists; refusing to overwrite it",
            path.display()
        )),
        _ => tls_err(&path.display().to_string(), e),
    })?;
    f.write_all(data.as_bytes())
        .map_err(|e| tls_err(&path.display().to_string(), e))
}

fn ensure_dir(dir: &Path) -> Result<(), TransportError> {
    let mut b = fs::DirBuilder::new();
    b.recursive(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::DirBuilderExt;
        b.mode(0o700);
    }
    b.create(dir)
        .map_err(|e| tls_err(&dir.display().to_string(), e))
}

/// Valid node names: DNS-label characters, 1-63 long.
pub fn check_name(name: &str) -> Result<(), TransportError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        && name != "ca";
    if ok {
        Ok(())
    } else {
        Err(TransportError::Tls(format!(
            "invalid node name `{name}`: use 1-63 letters, digits, `-` or `_` (not `ca`)"
        )))
    }
}

/// Creates a cluster CA (`ca.pem`, `ca.key`) in `dir`.
pub fn init_ca(dir: &Path, cluster: &str) -> Result<PathBuf, TransportError> {
    ensure_dir(dir)?;
    let key = KeyPair::generate().map_err(|e| tls_err("generating CA key", e))?;
    let mut params =
        CertificateParams::new(Vec::<String>::new()).map_err(|e| tls_err("CA parameters", e))?;
    params
        .distinguished_name
        .push(DnType::CommonName, format!("{cluster} mesh cluster CA"));
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_after = rcgen::date_time_ymd(2036, 1, 1);
    let cert = params
        .self_signed(&key)
        .map_err(|e| tls_err("signing CA", e))?;
    let ca_key = dir.join("ca.key");
    let ca_pem = dir.join("ca.pem");
    if ca_key.exists() || ca_pem.exists() {
        return Err(TransportError::Tls(format!(
            "a cluster CA already exists in {}; refusing to overwrite it",
            dir.display()
        )));
    }
    write_new(&ca_key, &key.serialize_pem(), 0o600)?;
    write_new(&ca_pem, &cert.pem(), 0o644)?;
    Ok(ca_pem)
}

/// Issues a node certificate `NAME.pem` / `NAME.key` in `dir`, signed by the CA there.
pub fn issue(dir: &Path, name: &str) -> Result<IdentityPaths, TransportError> {
    check_name(name)?;
    let paths = IdentityPaths::in_dir(dir, name);
    let ca_pem = fs::read_to_string(&paths.ca).map_err(|e| {
        tls_err(
            &format!("{} (run `mesh cert init` first)", paths.ca.display()),
            e,
        )
    })?;
    let ca_key_path = dir.join("ca.key");
    let ca_key_pem = fs::read_to_string(&ca_key_path)
        .map_err(|e| tls_err(&ca_key_path.display().to_string(), e))?;
    let ca_key = KeyPair::from_pem(&ca_key_pem).map_err(|e| tls_err("CA key", e))?;
    let issuer = Issuer::from_ca_cert_pem(&ca_pem, ca_key).map_err(|e| tls_err("CA cert", e))?;
    let key = KeyPair::generate().map_err(|e| tls_err("generating node key", e))?;
    let mut params = CertificateParams::new(vec![name.to_owned(), CLUSTER_SAN.to_owned()])
        .map_err(|e| tls_err("node parameters", e))?;
    params.distinguished_name.push(DnType::CommonName, name);
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.not_after = rcgen::date_time_ymd(2036, 1, 1);
    let cert = params
        .signed_by(&key, &issuer)
        .map_err(|e| tls_err("signing node certificate", e))?;
    write_new(&paths.key, &key.serialize_pem(), 0o600)?;
    write_new(&paths.cert, &cert.pem(), 0o644)?;
    Ok(paths)
}

/// The common name of a certificate (a node's name).
pub fn common_name(cert: &CertificateDer<'_>) -> Result<String, TransportError> {
    let (_, x509) =
        x509_parser::parse_x509_certificate(cert).map_err(|e| tls_err("peer certificate", e))?;
    let cn = x509
        .subject()
        .iter_common_name()
        .next()
        .ok_or_else(|| TransportError::Tls("peer certificate has no common name".into()))?;
    cn.as_str()
        .map(str::to_owned)
        .map_err(|e| tls_err("peer certificate common name", e))
}

/// A loaded node identity: what it takes to dial and accept cluster connections.
#[derive(Debug, Clone)]
pub struct Identity {
    /// This node's name (the certificate's CN).
    pub name: String,
    pub(crate) server: Arc<rustls::ServerConfig>,
    pub(crate) client: Arc<rustls::ClientConfig>,
}

/// Installs ring as the process-wide rustls provider (another one may be linked in).
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

impl Identity {
    /// Loads the CA, certificate and key and builds the mutual-TLS configurations.
    pub fn load(paths: &IdentityPaths) -> Result<Self, TransportError> {
        install_crypto_provider();
        let read_certs = |p: &Path| -> Result<Vec<CertificateDer<'static>>, TransportError> {
            let certs = CertificateDer::pem_file_iter(p)
                .map_err(|e| tls_err(&p.display().to_string(), e))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| tls_err(&p.display().to_string(), e))?;
            if certs.is_empty() {
                return Err(TransportError::Tls(format!(
                    "{}: no certificate",
                    p.display()
                )));
            }
            Ok(certs)
        };
        let ca = read_certs(&paths.ca)?;
        let chain = read_certs(&paths.cert)?;
        let key = PrivateKeyDer::from_pem_file(&paths.key)
            .map_err(|e| tls_err(&paths.key.display().to_string(), e))?;
        let name = common_name(&chain[0])?;
        let mut roots = rustls::RootCertStore::empty();
        for c in ca {
            roots.add(c).map_err(|e| tls_err("CA certificate", e))?;
        }
        let roots = Arc::new(roots);
        let verifier = rustls::server::WebPkiClientVerifier::builder(roots.clone())
            .build()
            .map_err(|e| tls_err("client verifier", e))?;
        let mut server = rustls::ServerConfig::builder()
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(|e| tls_err("server identity", e))?;
        // One ALPN name per wire version, newest first: the server takes the first of its
        // own that the client offers, so a connection speaks the newest common version.
        let alpn: Vec<Vec<u8>> = crate::frame::spoken_versions()
            .into_iter()
            .map(crate::frame::alpn)
            .collect();
        server.alpn_protocols = alpn.clone();
        let mut client = rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(|e| tls_err("client identity", e))?;
        client.alpn_protocols = alpn;
        Ok(Self {
            name,
            server: Arc::new(server),
            client: Arc::new(client),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issue_and_load_roundtrip() {
        let dir = tempfile::tempdir().unwrap();
        init_ca(dir.path(), "test").unwrap();
        let p = issue(dir.path(), "node-a").unwrap();
        let id = Identity::load(&p).unwrap();
        assert_eq!(id.name, "node-a");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(&p.key).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600);
        }
        // Never overwrite keys.
        assert!(issue(dir.path(), "node-a").is_err());
        assert!(init_ca(dir.path(), "test").is_err());
        assert!(issue(dir.path(), "bad name").is_err());
    }
}
