//! TLS for the control plane (rustls with ring): the server side of a controller or aggregator
//! (`--tls-cert`/`--tls-key`, re-read when the files change so that a renewed certificate needs
//! no restart) and the client side of proxies and aggregators (`https://` URLs, trusting
//! `ca_file` or else the system's roots). Must never: fall back to plain text when TLS was
//! asked for, or let a slow handshake hold a task for longer than [`HANDSHAKE_TIMEOUT`].

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// A client or server that has not finished its handshake by then is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn invalid(what: &Path, e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!("{}: {e}", what.display()),
    )
}

/// A server configuration read from PEM files: a certificate chain and its private key.
pub fn server_config(cert: &Path, key: &Path) -> std::io::Result<Arc<rustls::ServerConfig>> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| invalid(cert, e))?
        .collect::<Result<_, _>>()
        .map_err(|e| invalid(cert, e))?;
    if chain.is_empty() {
        return Err(invalid(cert, "no certificate in the file"));
    }
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| invalid(key, e))?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(std::io::Error::other)?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| invalid(cert, e))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A server's TLS configuration, swapped when its files change.
#[derive(Clone)]
pub struct ServerTls(Arc<ArcSwap<rustls::ServerConfig>>);

impl ServerTls {
    /// Reads `cert` and `key` now (an error stops start-up) and again whenever they change or
    /// on SIGHUP, until `stop`; a bad pair keeps the old one.
    pub fn load(
        cert: PathBuf,
        key: PathBuf,
        stop: tokio::sync::watch::Receiver<bool>,
    ) -> std::io::Result<ServerTls> {
        let tls = ServerTls(Arc::new(ArcSwap::new(server_config(&cert, &key)?)));
        // What the files held when last loaded: an event that changed nothing reloads nothing.
        let loaded = Arc::new(ArcSwap::from_pointee(contents(&cert, &key)));
        for path in [cert.clone(), key.clone()] {
            let (t, cert, key, loaded) = (tls.clone(), cert.clone(), key.clone(), loaded.clone());
            let watching = crate::watch::spawn(&path, stop.clone(), move |_| {
                let (t, cert, key, loaded) = (t.clone(), cert.clone(), key.clone(), loaded.clone());
                async move {
                    let now = contents(&cert, &key);
                    if now == **loaded.load() {
                        return;
                    }
                    match server_config(&cert, &key) {
                        Ok(c) => {
                            loaded.store(Arc::new(now));
                            t.0.store(c);
                            tracing::info!(cert = %cert.display(), "TLS certificate reloaded");
                        }
                        Err(e) => tracing::error!(
                            "cannot reload the TLS certificate, the previous one stays: {e}"
                        ),
                    }
                }
            });
            if let Err(e) = watching {
                tracing::warn!("the TLS certificate will not reload: {e}");
            }
        }
        Ok(tls)
    }

    /// The handshake of one accepted connection, with the configuration loaded now.
    pub async fn accept(
        &self,
        stream: tokio::net::TcpStream,
    ) -> std::io::Result<tokio_rustls::server::TlsStream<tokio::net::TcpStream>> {
        tokio_rustls::TlsAcceptor::from(self.0.load_full())
            .accept(stream)
            .await
    }
}

/// The bytes of a certificate and key file, to tell a real change from a touch.
fn contents(cert: &Path, key: &Path) -> (Vec<u8>, Vec<u8>) {
    (
        std::fs::read(cert).unwrap_or_default(),
        std::fs::read(key).unwrap_or_default(),
    )
}

/// What a client speaks TLS with.
pub type ClientConfig = rustls::ClientConfig;

/// A client configuration trusting the CA certificates in `ca_file`, or the system's roots.
pub fn client_config(ca_file: Option<&Path>) -> std::io::Result<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            for cert in CertificateDer::pem_file_iter(path).map_err(|e| invalid(path, e))? {
                roots
                    .add(cert.map_err(|e| invalid(path, e))?)
                    .map_err(|e| invalid(path, e))?;
            }
            if roots.is_empty() {
                return Err(invalid(path, "no CA certificate in the file"));
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            for cert in found.certs {
                let _ = roots.add(cert);
            }
            if roots.is_empty() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no CA certificates on this system: give ca_file",
                ));
            }
        }
    }
    Ok(rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(std::io::Error::other)?
        .with_root_certificates(roots)
        .with_no_client_auth())
}
