//! TLS for the NBD handshake's `NBD_OPT_STARTTLS` (rustls; no crypto of
//! our own): the server's credentials, loaded from a directory laid out as
//! nbdkit's `--tls-certificates` and qemu's `tls-creds-x509` expect, and
//! reloaded on demand (the CLI does it on SIGHUP).
//!
//! * `ca-cert.pem`: the certificate authority. With `verify_peer` clients
//!   must present a certificate it signed (expired or foreign ones are
//!   refused by the handshake); without, it is not needed.
//! * `server-cert.pem`: the server's certificate chain (leaf first).
//! * `server-key.pem`: its private key (PKCS#8, PKCS#1 or SEC1 PEM).
//!
//! TLS-PSK (nbdkit's `--tls-psk`) is not offered: rustls has no external
//! pre-shared-key support on the server side.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use rustls::pki_types::pem;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{VerifierBuilderError, WebPkiClientVerifier};

/// Whether clients may, or must, use TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsMode {
    /// `NBD_OPT_STARTTLS` is accepted; clients may also go without.
    On,
    /// Every option but `STARTTLS` and `ABORT` gets `NBD_REP_ERR_TLS_REQD`
    /// before TLS, `NBD_OPT_EXPORT_NAME` ends the connection: nothing is
    /// listed or served in the clear.
    Require,
}

/// The server's TLS settings: the mode and the current credentials.
#[derive(Debug, Clone)]
pub struct TlsSettings {
    pub mode: TlsMode,
    pub credentials: Arc<TlsCredentials>,
}

/// Why credentials could not be loaded; the message names the file and
/// what is wrong with it.
#[derive(Debug)]
pub enum TlsError {
    /// The credentials directory is not a directory.
    NotADirectory(PathBuf),
    /// A PEM file that cannot be read, or holds no item of the kind wanted.
    Pem { path: PathBuf, error: pem::Error },
    /// A certificate file without a PEM certificate in it.
    NoCertificate(PathBuf),
    /// The CA certificate is not a usable trust anchor.
    CaCertificate { path: PathBuf, error: rustls::Error },
    /// No client verifier could be built from the CA certificate.
    ClientVerifier {
        path: PathBuf,
        error: VerifierBuilderError,
    },
    /// The crypto provider offers no safe protocol version.
    Protocols(rustls::Error),
    /// The certificate chain and key do not make a server identity (a key
    /// that does not match the certificate, say).
    Identity {
        cert: PathBuf,
        key: PathBuf,
        error: rustls::Error,
    },
}

impl fmt::Display for TlsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TlsError::NotADirectory(dir) => write!(
                f,
                "{}: not a directory (expected one holding ca-cert.pem, server-cert.pem and server-key.pem)",
                dir.display()
            ),
            TlsError::Pem { path, error } => write!(f, "{}: {}", path.display(), pem_error(error)),
            TlsError::NoCertificate(path) => {
                write!(f, "{}: no PEM certificate in it", path.display())
            }
            TlsError::CaCertificate { path, error } => write!(f, "{}: {error}", path.display()),
            TlsError::ClientVerifier { path, error } => write!(f, "{}: {error}", path.display()),
            TlsError::Protocols(error) => write!(f, "TLS: {error}"),
            TlsError::Identity { cert, key, error } => {
                write!(f, "{} and {}: {error}", cert.display(), key.display())
            }
        }
    }
}

impl std::error::Error for TlsError {}

/// Certificates and key from a directory; [`TlsCredentials::reload`]
/// swaps in a fresh copy for new connections (open ones keep theirs).
pub struct TlsCredentials {
    dir: PathBuf,
    verify_peer: bool,
    current: RwLock<Arc<rustls::ServerConfig>>,
}

impl fmt::Debug for TlsCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsCredentials")
            .field("dir", &self.dir)
            .field("verify_peer", &self.verify_peer)
            .finish_non_exhaustive()
    }
}

impl TlsCredentials {
    /// Loads `dir`; the error names the file and what is wrong with it.
    pub fn load(dir: &Path, verify_peer: bool) -> Result<TlsCredentials, TlsError> {
        let config = build_config(dir, verify_peer)?;
        Ok(TlsCredentials {
            dir: dir.to_path_buf(),
            verify_peer,
            current: RwLock::new(Arc::new(config)),
        })
    }

    /// Reads the directory again. On error the credentials in use stay.
    pub fn reload(&self) -> Result<(), TlsError> {
        let config = build_config(&self.dir, self.verify_peer)?;
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(config);
        Ok(())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn verify_peer(&self) -> bool {
        self.verify_peer
    }

    /// The configuration a new connection uses.
    pub(crate) fn current(&self) -> Arc<rustls::ServerConfig> {
        Arc::clone(&self.current.read().unwrap_or_else(|e| e.into_inner()))
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|error| TlsError::Pem {
            path: path.to_path_buf(),
            error,
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate(path.to_path_buf()));
    }
    Ok(certs)
}

fn pem_error(e: &pem::Error) -> String {
    match e {
        pem::Error::Io(io) => io.to_string(),
        pem::Error::NoItemsFound => "no PEM item of the expected kind".into(),
        other => format!("not valid PEM ({other:?})"),
    }
}

fn build_config(dir: &Path, verify_peer: bool) -> Result<rustls::ServerConfig, TlsError> {
    if !dir.is_dir() {
        return Err(TlsError::NotADirectory(dir.to_path_buf()));
    }
    let cert_path = dir.join("server-cert.pem");
    let key_path = dir.join("server-key.pem");
    let chain = read_certs(&cert_path)?;
    let key = PrivateKeyDer::from_pem_file(&key_path).map_err(|error| TlsError::Pem {
        path: key_path.clone(),
        error,
    })?;
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Protocols)?;
    let builder = if verify_peer {
        let ca_path = dir.join("ca-cert.pem");
        let mut roots = rustls::RootCertStore::empty();
        for cert in read_certs(&ca_path)? {
            roots.add(cert).map_err(|error| TlsError::CaCertificate {
                path: ca_path.clone(),
                error,
            })?;
        }
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
            .build()
            .map_err(|error| TlsError::ClientVerifier {
                path: ca_path.clone(),
                error,
            })?;
        builder.with_client_cert_verifier(verifier)
    } else {
        builder.with_no_client_auth()
    };
    builder
        .with_single_cert(chain, key)
        .map_err(|error| TlsError::Identity {
            cert: cert_path,
            key: key_path,
            error,
        })
}
