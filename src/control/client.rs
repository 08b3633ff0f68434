//! The control plane's JSON client: how a report goes to its receivers (the reporter's to an
//! aggregator or to the controllers, an aggregator's forwards to the controllers), over HTTP
//! or HTTPS, with the wire version each receiver takes negotiated and a report that found no
//! answer sent again; `tune` reads with it too. Must never: know the decision's types
//! (`rules`), or wait for a receiver past the timeout it is given.

use std::time::Duration;

use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_TYPE};
use http::{Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;

use super::{Reply, Report, MAX_REPLY};

/// A client for the control plane's JSON endpoints, over HTTP or HTTPS.
#[cfg(feature = "tls")]
pub type JsonClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;
/// A client for the control plane's JSON endpoints, over HTTP (this build has no TLS).
#[cfg(not(feature = "tls"))]
pub type JsonClient = Client<HttpConnector, Full<Bytes>>;

/// A client that speaks TLS with `tls` to `https://` URLs; without it, plain HTTP only (an
/// `https://` URL then fails: nothing falls back to plain text).
pub fn json_client(tls: Option<super::tls::ClientConfig>) -> std::io::Result<JsonClient> {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    http.set_connect_timeout(Some(Duration::from_secs(1)));
    #[cfg(not(feature = "tls"))]
    {
        // An https:// URL is refused by the connector: never sent as plain text.
        if let Some(tls) = tls {
            match tls {}
        }
        Ok(Client::builder(TokioExecutor::new()).build(http))
    }
    #[cfg(feature = "tls")]
    {
        http.enforce_http(false);
        https(http, tls)
    }
}

#[cfg(feature = "tls")]
fn https(http: HttpConnector, tls: Option<rustls::ClientConfig>) -> std::io::Result<JsonClient> {
    let builder = hyper_rustls::HttpsConnectorBuilder::new();
    let connector = match tls {
        Some(tls) => builder
            .with_tls_config(tls)
            .https_only()
            .enable_http1()
            .wrap_connector(http),
        None => {
            // Trusts nothing: only ever used for http:// URLs.
            let none = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .map_err(std::io::Error::other)?
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
            builder
                .with_tls_config(none)
                .https_or_http()
                .enable_http1()
                .wrap_connector(http)
        }
    };
    Ok(Client::builder(TokioExecutor::new()).build(connector))
}

/// For a control-plane base URL of `scheme` (`http` or `https`), the TLS configuration
/// trusting `ca_file` (or the system's roots) for `https`, none for `http`.
fn client_tls(
    scheme: Option<&str>,
    ca_file: Option<&std::path::Path>,
) -> Result<Option<super::tls::ClientConfig>, String> {
    match scheme {
        Some("http") => match ca_file {
            Some(_) => Err("ca_file is given but the URL is http://; use https://".into()),
            None => Ok(None),
        },
        Some("https") => Ok(Some(
            super::tls::client_config(ca_file).map_err(|e| e.to_string())?,
        )),
        _ => Err("expected http://host:port or https://host:port".into()),
    }
}

/// `<base>/v1/report`.
fn report_url(base: &Uri) -> Result<Uri, String> {
    let expected = "expected http://host:port or https://host:port";
    let authority = base.authority().ok_or(expected)?;
    let scheme = match base.scheme_str() {
        Some(s @ ("http" | "https")) => s,
        _ => return Err(expected.into()),
    };
    format!("{scheme}://{authority}/v1/report")
        .parse()
        .map_err(|e| format!("{e}"))
}

/// Why a post got no reply to use: the status the receiver answered, if it answered.
#[derive(Debug)]
pub struct PostError {
    pub status: Option<StatusCode>,
    pub message: String,
}

impl std::fmt::Display for PostError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl PostError {
    fn other(e: impl std::fmt::Display) -> Self {
        PostError {
            status: None,
            message: e.to_string(),
        }
    }
}

/// Posts `report` to `url` (`.../v1/report`) and returns the reply, its size and whether the
/// receiver takes the fields past version 1 ([`super::WIRE_HEADER`]), within `timeout`.
pub async fn post_report(
    client: &JsonClient,
    url: &Uri,
    token: Option<&[u8]>,
    report: &Report,
    timeout: Duration,
) -> Result<(Reply, usize, bool), PostError> {
    let serialize = || serde_json::to_vec(report).map_err(PostError::other);
    let body = if report.entries.len() > super::HEAVY_ENTRIES {
        super::off_workers(serialize)?
    } else {
        serialize()?
    };
    let size = body.len();
    let mut req = Request::post(url.clone())
        .header(CONTENT_TYPE, "application/json")
        .header(super::WIRE_HEADER, super::WIRE)
        .header(super::INSTANCE_HEADER, super::instance());
    if let Some(t) = token {
        let mut value = b"Bearer ".to_vec();
        value.extend_from_slice(t);
        req = req.header(AUTHORIZATION, value);
    }
    let req = req
        .body(Full::new(Bytes::from(body)))
        .map_err(PostError::other)?;
    let exchange = async {
        let resp = client.request(req).await.map_err(PostError::other)?;
        let status = resp.status();
        let wire2 = resp
            .headers()
            .get(super::WIRE_HEADER)
            .is_some_and(|v| v.as_bytes() == super::WIRE.as_bytes());
        let warming = resp.headers().contains_key(super::WARMING_HEADER);
        let bytes = Limited::new(resp.into_body(), MAX_REPLY)
            .collect()
            .await
            .map_err(PostError::other)?
            .to_bytes();
        if status != StatusCode::OK {
            return Err(PostError {
                status: Some(status),
                message: format!(
                    "{status}: {}",
                    String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
                ),
            });
        }
        let mut reply = serde_json::from_slice::<Reply>(&bytes)
            .map_err(|e| PostError::other(format!("malformed reply: {e}")))?;
        reply.warming = warming;
        Ok((reply, wire2))
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(Ok((reply, wire2))) => Ok((reply, size, wire2)),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(PostError::other(format!("no reply within {timeout:?}"))),
    }
}

/// Posts `report` with the fields past version 1 if the receiver took them last time
/// (`wire2`, which the reply updates), else as version 1. A receiver that refuses them (400:
/// a rollback to a release that does not know them) gets the same report again as version 1
/// at once, so that no interval is lost; one that gave no answer at once (stopping or replaced
/// as the report came) gets it again shortly, under the same sequence number.
pub async fn post_negotiated(
    client: &JsonClient,
    url: &Uri,
    token: Option<&[u8]>,
    mut report: Report,
    timeout: Duration,
    wire2: &std::sync::atomic::AtomicBool,
) -> Result<(Reply, usize), PostError> {
    use std::sync::atomic::Ordering::Relaxed;
    let full = wire2.load(Relaxed);
    if !full {
        report.downgrade();
    }
    let started = tokio::time::Instant::now();
    let mut answer = post_report(client, url, token, &report, timeout).await;
    if matches!(&answer, Err(e) if e.status.is_none()) && started.elapsed() < timeout / 2 {
        // No answer, and at once: a receiver stopping or being replaced as the report came
        // (a rolling update). Sent again shortly under the same number (a receiver that did
        // count it counts it once), or its counts would be lost to the sums.
        let pause = timeout / 8;
        tokio::time::sleep(pause).await;
        let left = timeout.saturating_sub(started.elapsed());
        answer = post_report(client, url, token, &report, left).await;
    }
    if full && matches!(&answer, Err(e) if e.status == Some(StatusCode::BAD_REQUEST)) {
        report.downgrade();
        answer = post_report(client, url, token, &report, timeout).await;
    }
    let (reply, size, said) = answer.inspect_err(|e| {
        if e.status == Some(StatusCode::BAD_REQUEST) {
            wire2.store(false, Relaxed);
        }
    })?;
    wire2.store(said, Relaxed);
    Ok((reply, size))
}

/// Where reports go: one aggregator Service, or each of the controllers that serve at once
/// (active-active), each with whether it took the fields past version 1 last time. Every
/// report goes to every target (a controller computes ratios on what it is sent, so each must
/// see the whole fleet), and the answer taken is [`Targets::pick`]'s.
pub struct Targets {
    targets: Vec<(Uri, std::sync::atomic::AtomicBool)>,
    /// Whose authoritative answer was taken last (see [`Targets::pick`]).
    taken: std::sync::atomic::AtomicUsize,
}

impl Targets {
    /// `<base>/v1/report` of each of `bases`, all `http://` or all `https://` (one client
    /// speaks to them), and for `https://` the TLS configuration trusting `ca_file`.
    pub fn new(
        bases: &[Uri],
        ca_file: Option<&std::path::Path>,
    ) -> Result<(Targets, Option<super::tls::ClientConfig>), String> {
        let Some(first) = bases.first() else {
            return Err("no URL given".into());
        };
        if bases.iter().any(|b| b.scheme() != first.scheme()) {
            return Err("mixes http:// and https:// URLs".into());
        }
        let tls = client_tls(first.scheme_str(), ca_file)?;
        let mut targets = Vec::with_capacity(bases.len());
        for base in bases {
            let url = report_url(base)?;
            if targets.iter().any(|(u, _)| *u == url) {
                return Err(format!("{base} is given twice"));
            }
            targets.push((url, Default::default()));
        }
        Ok((
            Targets {
                targets,
                taken: Default::default(),
            },
            tls,
        ))
    }

    /// The targets' report URLs, in the order given.
    pub fn urls(&self) -> impl Iterator<Item = &Uri> {
        self.targets.iter().map(|(u, _)| u)
    }

    /// Posts `report` to every target at once (see [`post_negotiated`]); the answers in the
    /// targets' order.
    pub async fn post_all(
        &self,
        client: &JsonClient,
        token: Option<&[u8]>,
        report: Report,
        timeout: Duration,
    ) -> Vec<Result<(Reply, usize), PostError>> {
        // The last target takes the report itself: one target, no copy.
        let mut reports: Vec<Report> = (1..self.targets.len()).map(|_| report.clone()).collect();
        reports.push(report);
        let posts = self
            .targets
            .iter()
            .zip(reports)
            .map(|((url, wire2), report)| {
                post_negotiated(client, url, token, report, timeout, wire2)
            });
        futures_util::future::join_all(posts).await
    }

    /// The answer to take from `answers` (in the targets' order): the authoritative one of
    /// the target taken last time, else the first authoritative one (taken from then on),
    /// else the first from a controller warming up (through which the receiver keeps its
    /// ratios), else the first failure. Sticking to one controller while it answers keeps the
    /// ratios of one set of sums: a controller back from a restart has sums younger than its
    /// peer's, and is taken only when its peer fails or warms up in turn.
    pub fn pick(
        &self,
        answers: Vec<Result<(Reply, usize), PostError>>,
    ) -> Option<Result<(Reply, usize), PostError>> {
        use std::sync::atomic::Ordering::Relaxed;
        let taken = self.taken.load(Relaxed);
        let authoritative =
            |a: &Result<(Reply, usize), PostError>| matches!(a, Ok(r) if !r.0.warming);
        let i = if answers.get(taken).is_some_and(authoritative) {
            Some(taken)
        } else {
            answers.iter().position(authoritative)
        };
        if let Some(i) = i {
            self.taken.store(i, Relaxed);
            return answers.into_iter().nth(i);
        }
        let mut failed = None;
        for answer in answers {
            match answer {
                Ok(a) => return Some(Ok(a)),
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        failed.map(Err)
    }
}

impl std::fmt::Display for Targets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, url) in self.urls().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{url}")?;
        }
        Ok(())
    }
}

/// A first sequence number that a restarted process has not used before: the wall clock in
/// milliseconds (a source sends at most one report per 100 ms).
pub fn first_seq() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn targets(n: usize) -> Targets {
        let bases: Vec<Uri> = (1..=n)
            .map(|i| format!("http://c{i}:7000").parse().unwrap())
            .collect();
        Targets::new(&bases, None).unwrap().0
    }

    /// An answer: authoritative or warming, told apart by its age.
    fn answer(warming: bool, age_ms: u64) -> Result<(Reply, usize), PostError> {
        Ok((
            Reply {
                version: crate::control::VERSION,
                age_ms,
                warming,
                ..Default::default()
            },
            0,
        ))
    }

    /// A receiver on loopback that closes its first connection unanswered (a replica stopping
    /// as the report came), then answers each request as a controller with no ratios would;
    /// the request bodies it read, in order.
    async fn closes_first_then_answers() -> (Uri, tokio::task::JoinHandle<Vec<Vec<u8>>>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1/report", listener.local_addr().unwrap())
            .parse()
            .unwrap();
        let task = tokio::spawn(async move {
            let (first, _) = listener.accept().await.unwrap();
            drop(first);
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut got = Vec::new();
            let mut buf = vec![0u8; 1 << 16];
            let body = loop {
                let n = conn.read(&mut buf).await.unwrap();
                assert!(n > 0, "closed before a whole request");
                got.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&got).to_lowercase();
                let Some(end) = text.find("\r\n\r\n") else {
                    continue;
                };
                let len: usize = text
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map(|v| v.trim().parse().unwrap())
                    .unwrap();
                if got.len() >= end + 4 + len {
                    break got[end + 4..end + 4 + len].to_vec();
                }
            };
            let reply = br#"{"version":1,"age_ms":0,"ratios":[]}"#;
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                reply.len()
            );
            conn.write_all(head.as_bytes()).await.unwrap();
            conn.write_all(reply).await.unwrap();
            vec![body]
        });
        (url, task)
    }

    #[tokio::test]
    async fn a_report_whose_receiver_closes_at_once_is_sent_again_under_its_number() {
        // Its counts would otherwise be lost: a replaced aggregator's zone went uncounted for a
        // second (the rolling restart's worst; BENCHMARKS.md).
        let (url, receiver) = closes_first_then_answers().await;
        let (targets, _) = Targets::new(&[url], None).unwrap();
        let client = json_client(None).unwrap();
        let mut report = crate::control::tests::report("h", Vec::new());
        report.seq = 41;
        let answers = targets
            .post_all(&client, None, report, Duration::from_secs(1))
            .await;
        assert!(answers[0].is_ok(), "{:?}", answers[0].as_ref().err());
        let bodies = receiver.await.unwrap();
        let sent: Report = serde_json::from_slice(&bodies[0]).unwrap();
        assert_eq!(sent.seq, 41, "the same report: the receiver counts it once");
    }

    fn failed() -> Result<(Reply, usize), PostError> {
        Err(PostError::other("connection refused"))
    }

    fn age(picked: Option<Result<(Reply, usize), PostError>>) -> Option<u64> {
        picked.and_then(Result::ok).map(|(r, _)| r.age_ms)
    }

    #[test]
    fn an_authoritative_controller_is_taken_and_kept_while_it_answers() {
        let t = targets(2);
        assert_eq!(
            t.urls().map(ToString::to_string).collect::<Vec<_>>(),
            ["http://c1:7000/v1/report", "http://c2:7000/v1/report"]
        );
        assert_eq!(
            age(t.pick(vec![answer(false, 1), answer(false, 2)])),
            Some(1)
        );
        // The first restarts: warming, then down; the second's answers are taken.
        assert_eq!(
            age(t.pick(vec![answer(true, 1), answer(false, 2)])),
            Some(2)
        );
        assert_eq!(age(t.pick(vec![failed(), answer(false, 2)])), Some(2));
        // Back and authoritative, it is not taken while the second answers.
        assert_eq!(
            age(t.pick(vec![answer(false, 1), answer(false, 2)])),
            Some(2)
        );
        // Only when the second fails or warms up in turn.
        assert_eq!(
            age(t.pick(vec![answer(false, 1), answer(true, 2)])),
            Some(1)
        );
        assert_eq!(
            age(t.pick(vec![answer(false, 1), answer(false, 2)])),
            Some(1)
        );
    }

    #[test]
    fn a_warming_answer_is_taken_only_when_none_is_authoritative_and_failures_last() {
        let t = targets(3);
        let picked = t.pick(vec![failed(), answer(true, 2), answer(true, 3)]);
        let (reply, _) = picked.unwrap().unwrap();
        assert!(reply.warming, "the receiver keeps its ratios through it");
        assert_eq!(reply.age_ms, 2);
        assert!(matches!(
            t.pick(vec![failed(), failed(), failed()]),
            Some(Err(_))
        ));
        assert_eq!(
            age(t.pick(vec![failed(), answer(true, 2), answer(false, 3)])),
            Some(3)
        );
    }

    #[test]
    fn targets_are_of_one_scheme_and_each_given_once() {
        let uri = |s: &str| -> Uri { s.parse().unwrap() };
        let e = |bases: &[Uri]| Targets::new(bases, None).err().unwrap();
        assert!(e(&[]).contains("no URL"));
        assert!(e(&[uri("http://a:1"), uri("https://b:1")]).contains("mixes"));
        assert!(e(&[uri("http://a:1"), uri("http://a:1/")]).contains("twice"));
    }
}
