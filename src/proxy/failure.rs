//! Why a request got no response from the upstream, and which `UpstreamError` (the metric's
//! kind, and through `respond::Refused::upstream` the answer) each is. Must never: blame the
//! upstream for the client's own cut body.

use std::error::Error as _;

use crate::metrics::UpstreamError;

/// Why a request got no response from the upstream.
#[derive(Debug)]
pub enum Failure {
    Connect(std::io::Error),
    ConnectTimeout,
    /// The exchange on an upstream connection of our own failed.
    UpstreamConn(std::io::Error),
    /// The client's streamed body broke (malformed, cut off) while it went upstream.
    ClientBody,
    /// The pooled (HTTP/2) client failed.
    Pooled(hyper_util::client::legacy::Error),
    /// No upstream connection came free in time under the caps.
    Saturated,
}

/// No upstream connection came free within `timeouts.upstream_connect`.
#[derive(Debug)]
pub struct Saturated;

impl std::fmt::Display for Saturated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("no upstream connection came free in time")
    }
}

impl std::error::Error for Saturated {}

impl Failure {
    /// True when sending failed because reading the client's request body failed (hyper
    /// reports the body stream's error as a user error, caused by the incoming body's own
    /// error: hyper's, or our HTTP/1 server side's).
    pub(super) fn client_body_failed(&self) -> bool {
        let mut source: Option<&(dyn std::error::Error + 'static)> = match self {
            Failure::Pooled(e) => Some(e),
            Failure::ClientBody => return true,
            Failure::UpstreamConn(_)
            | Failure::Connect(_)
            | Failure::ConnectTimeout
            | Failure::Saturated => None,
        };
        while let Some(s) = source {
            if let Some(h) = s.downcast_ref::<hyper::Error>() {
                let client = |inner: &(dyn std::error::Error + 'static)| {
                    inner.is::<hyper::Error>() || inner.is::<super::body::ClientBodyError>()
                };
                if h.is_user() && h.source().is_some_and(client) {
                    return true;
                }
            }
            source = s.source();
        }
        false
    }

    pub(super) fn classify(&self) -> UpstreamError {
        match self {
            Failure::Connect(_) => UpstreamError::Connect,
            Failure::ConnectTimeout => UpstreamError::ConnectTimeout,
            Failure::Saturated => UpstreamError::Saturated,
            Failure::UpstreamConn(_) | Failure::ClientBody => UpstreamError::Protocol,
            Failure::Pooled(e) if !e.is_connect() => UpstreamError::Protocol,
            Failure::Pooled(e) => {
                let mut source = std::error::Error::source(e);
                while let Some(s) = source {
                    if s.is::<Saturated>() {
                        return UpstreamError::Saturated;
                    }
                    if let Some(io) = s.downcast_ref::<std::io::Error>() {
                        if io.kind() == std::io::ErrorKind::TimedOut {
                            return UpstreamError::ConnectTimeout;
                        }
                    }
                    source = s.source();
                }
                UpstreamError::Connect
            }
        }
    }
}
