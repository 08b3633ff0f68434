//! A build without the `tls` feature: no TLS anywhere. Every place that would speak it (an
//! `https://` URL, `--tls-cert`, `rediss://`) fails with an error naming the feature, before
//! anything is served. Must never: fall back to plain text when TLS was asked for.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::net::TcpStream;

/// Kept for the callers' shape: no handshake ever starts.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The error every TLS request gets in this build.
pub fn off() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "TLS needs the `tls` feature, which this build of spillway lacks",
    )
}

/// No server configuration can exist.
#[derive(Clone)]
pub enum ServerTls {}

impl ServerTls {
    /// Always the error naming the feature.
    pub fn load(
        _cert: PathBuf,
        _key: PathBuf,
        _stop: tokio::sync::watch::Receiver<bool>,
    ) -> std::io::Result<ServerTls> {
        Err(off())
    }

    /// Unreachable: there is no value to call it on.
    pub async fn accept(&self, _stream: TcpStream) -> std::io::Result<TcpStream> {
        match *self {}
    }
}

/// No client configuration can exist.
pub enum ClientConfig {}

/// Always the error naming the feature.
pub fn client_config(_ca_file: Option<&Path>) -> std::io::Result<ClientConfig> {
    Err(off())
}
