//! The built-in status page (`/ui` on the admin port of the controller and of each proxy).
//!
//! One self-contained HTML file (no build step, nothing loaded from elsewhere, works offline)
//! that polls `/ui/state.json` once a second: every rule's offered and admitted rate against
//! its limit with two minutes of history, the drop ratio, the heaviest keys (controller), and
//! who is reporting and how stale they are. The state document is built by each role.

use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE};
use http::{HeaderValue, Response};
use http_body_util::Full;

const PAGE: &str = include_str!("ui/status.html");

/// The page itself.
pub fn page() -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from_static(PAGE.as_bytes())));
    let h = resp.headers_mut();
    h.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Everything is inline: nothing else may be loaded.
    h.insert(
        http::header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:",
        ),
    );
    resp
}
