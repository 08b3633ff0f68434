//! The access log (`access_log:`): a line for every request Spillway refuses or answers
//! itself (up to `refusals_per_second`), and for one in `admitted_one_in` of those it
//! forwards, with the fields of nginx's and Envoy's default formats and the rule, the
//! decision and the request's id. Owns what a line holds and when one is written. Must
//! never: cost a request anything while the log is off (one branch), hold the request's
//! head, or write a query (a key's private part may be in it).

use std::net::SocketAddr;

use http::header::{HeaderValue, CONTENT_LENGTH, HOST, REFERER, USER_AGENT};
use http::{Method, Request, Uri, Version};

use crate::ids::IdText;
use crate::limit::NANOS_PER_SEC;

/// The access log as configured, and its budget of refusal and error lines this second.
pub struct AccessLog {
    one_in: u32,
    per_second: u32,
    // Relaxed: a bound, not an exact count (as the rejection log's budget).
    second: std::sync::atomic::AtomicU64,
    count: std::sync::atomic::AtomicU32,
}

impl AccessLog {
    pub(super) fn of(config: &crate::config::AccessLog) -> Self {
        AccessLog {
            one_in: config.admitted_one_in,
            per_second: config.refusals_per_second,
            second: Default::default(),
            count: Default::default(),
        }
    }

    /// Whether one more refusal or error line fits this second (`now` on the monotonic
    /// clock, nanoseconds).
    fn take(&self, now: u64) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let this = now / NANOS_PER_SEC;
        if self.second.load(Relaxed) != this {
            if self.second.swap(this, Relaxed) != this {
                self.count.store(0, Relaxed);
            }
        } else if self.count.load(Relaxed) >= self.per_second {
            // Read first: under a flood most refusals find the budget spent, and then write
            // nothing to a line every worker reads.
            return false;
        }
        self.count.fetch_add(1, Relaxed) < self.per_second
    }
}

/// The target an access line is logged under (`RUST_LOG` may name it).
pub const TARGET: &str = "spillway::access";

/// What a line says of the request, copied from its head before it goes upstream (each field
/// a reference count, not a copy of the text).
pub(super) struct Asked {
    method: Method,
    uri: Uri,
    version: Version,
    /// The fields a line shows besides: read only for a request whose line is sure (a
    /// refusal, or a forwarded request sampled); a forwarded request's error line goes
    /// without them. Boxed: the rest of the request's future does not carry them.
    fields: Option<Box<Fields>>,
    /// Whether a forwarded answer gets a line (refusals and errors always do).
    pub(super) sampled: bool,
    /// Its line took its place in the second's budget already.
    budgeted: bool,
}

#[derive(Default)]
struct Fields {
    host: Option<HeaderValue>,
    user_agent: Option<HeaderValue>,
    referer: Option<HeaderValue>,
    forwarded_for: Option<HeaderValue>,
    length: Option<HeaderValue>,
}

impl Asked {
    /// `req`'s part of a line, when the log is on: all of it if `sure` (a refusal's line,
    /// if the second's budget has room for it at `now()`: else nothing is copied, and the
    /// line is counted in `dropped`), else as sampling decides.
    #[inline(always)]
    pub(super) fn of<B>(
        req: &Request<B>,
        (log, now, dropped): (
            &Option<AccessLog>,
            impl FnOnce() -> u64,
            &prometheus::IntCounter,
        ),
        sure: bool,
    ) -> Option<Asked> {
        let log = log.as_ref()?;
        if sure && !log.take(now()) {
            dropped.inc();
            return None;
        }
        Some(Self::copied(req, log.one_in, sure))
    }

    #[cold]
    fn copied<B>(req: &Request<B>, one_in: u32, sure: bool) -> Asked {
        let sampled = one_in > 0 && fastrand::u32(..one_in) == 0;
        Asked {
            method: req.method().clone(),
            uri: req.uri().clone(),
            version: req.version(),
            fields: (sure || sampled).then(|| Box::new(Fields::of(req.headers()))),
            sampled,
            budgeted: sure,
        }
    }
}

impl Fields {
    fn of(headers: &http::HeaderMap) -> Fields {
        let mut f = Fields::default();
        // One pass over the fields, not a lookup (a hash) for each.
        for (name, value) in headers {
            let slot = if name == HOST {
                &mut f.host
            } else if name == USER_AGENT {
                &mut f.user_agent
            } else if name == REFERER {
                &mut f.referer
            } else if name == CONTENT_LENGTH {
                &mut f.length
            } else if name.as_str() == "x-forwarded-for" {
                &mut f.forwarded_for
            } else {
                continue;
            };
            if slot.is_none() {
                *slot = Some(value.clone());
            }
        }
        f
    }
}

/// How a request ended, for its line.
pub(super) struct Answered<'a> {
    pub(super) status: http::StatusCode,
    /// `forwarded`, `rejected` (a rule's 429 or 503) or `error` (an answer of ours).
    pub(super) decision: &'static str,
    /// The rule that refused it, or could not decide it.
    pub(super) rule: Option<&'a str>,
    pub(super) id: &'a IdText,
    /// The response's `Content-Length`, when it has one.
    pub(super) bytes_sent: Option<&'a [u8]>,
    pub(super) seconds: f64,
}

/// Writes `asked`'s line from `peer` (`client`: the address the rules keyed, `None` before
/// they did) as `answered` says at `now`, unless it is a forwarded request not sampled, or a
/// refusal or error past the second's budget (counted in `dropped`).
pub(super) fn log(
    (log, now, dropped): (&Option<AccessLog>, u64, &prometheus::IntCounter),
    asked: &Asked,
    peer: SocketAddr,
    client: Option<std::net::IpAddr>,
    answered: &Answered<'_>,
) {
    if answered.decision == "forwarded" {
        if !asked.sampled {
            return;
        }
    } else if !asked.budgeted && !log.as_ref().is_some_and(|l| l.take(now)) {
        dropped.inc();
        return;
    }
    let none = Fields::default();
    let fields = asked.fields.as_deref().unwrap_or(&none);
    let text = |v: &Option<HeaderValue>| {
        v.as_ref()
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .unwrap_or_default()
    };
    let number =
        |v: Option<&[u8]>| -> Option<u64> { std::str::from_utf8(v?).ok()?.trim().parse().ok() };
    tracing::info!(
        target: TARGET,
        request_id = %answered.id,
        client = %client.unwrap_or(peer.ip()),
        peer = %peer,
        method = %asked.method,
        // The path only: a query may hold a key's private part (`query:` keys).
        path = %asked.uri.path(),
        protocol = ?asked.version,
        authority = %text(&fields.host),
        status = answered.status.as_u16(),
        decision = answered.decision,
        rule = answered.rule.unwrap_or(""),
        bytes_received = number(fields.length.as_ref().map(HeaderValue::as_bytes)),
        bytes_sent = number(answered.bytes_sent),
        duration_ms = answered.seconds * 1e3,
        user_agent = %text(&fields.user_agent),
        referer = %text(&fields.referer),
        x_forwarded_for = %text(&fields.forwarded_for),
        "access"
    );
}
