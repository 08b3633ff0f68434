//! HTTP plumbing shared by the aggregator, the controller and the proxy's admin listener: a
//! small HTTP/1.1 server (plain or TLS), JSON in and out with a size limit, taking a report in
//! (who sent it, whether it may, its bounds), and the refusal to serve a non-loopback address
//! without a token.

// The errors here are the HTTP responses themselves, built once per refused request.
#![allow(clippy::result_large_err)]

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::auth::{Credentials, Principal};
use tokio::net::TcpListener;
use tokio::sync::watch;

use super::MAX_BODY;

pub type Body = Full<Bytes>;

/// The address a request came from, in its extensions: who may ask what the admin
/// listener keeps for loopback.
#[derive(Debug, Clone, Copy)]
pub struct Peer(pub std::net::IpAddr);

/// Serves `handler` on `listener` (over TLS with `tls`) until `stop` turns true. Each
/// connection gets a handshake and a header-read timeout, so a slow client cannot hold a task
/// forever.
pub async fn serve<H, F>(
    listener: TcpListener,
    mut stop: watch::Receiver<bool>,
    tls: Option<super::tls::ServerTls>,
    handler: H,
) where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let open = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let by_address: Arc<dashmap::DashMap<std::net::IpAddr, usize>> = Arc::default();
    loop {
        let (stream, peer) = tokio::select! {
            _ = stop.changed() => return,
            accepted = listener.accept() => match accepted {
                Ok((s, peer)) => (s, peer.ip()),
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // Past the cap a connection is closed at once: each one may buffer a body.
        let Ok(permit) = open.clone().try_acquire_owned() else {
            drop(stream);
            continue;
        };
        // And past one address's share: a pod's idle connections cannot take every place.
        let Some(_share) = AddressShare::take(&by_address, peer) else {
            drop(stream);
            continue;
        };
        let handler = handler.clone();
        let tls = tls.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let _share = _share;
            // A connection that says nothing is closed: it would hold its place for nothing.
            if tls.is_none()
                && !matches!(
                    tokio::time::timeout(FIRST_BYTE, stream.readable()).await,
                    Ok(Ok(()))
                )
            {
                return;
            }
            let service = service_fn(move |mut req: Request<Incoming>| {
                req.extensions_mut().insert(Peer(peer));
                let handler = handler.clone();
                async move { Ok::<_, Infallible>(handler(req).await) }
            });
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(10));
            match tls {
                None => {
                    let conn = http.serve_connection(TokioIo::new(stream), service);
                    until_stopped(conn, stop).await;
                }
                Some(tls) => {
                    let handshake =
                        tokio::time::timeout(super::tls::HANDSHAKE_TIMEOUT, tls.accept(stream));
                    match handshake.await {
                        Ok(Ok(tls)) => {
                            let conn = http.serve_connection(TokioIo::new(tls), service);
                            until_stopped(conn, stop).await;
                        }
                        Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!("TLS handshake timed out"),
                    }
                }
            }
        });
    }
}

/// Serves `conn` until it ends or the server stops; then its request in flight is answered
/// and it closes: a kept-alive connection must not keep reaching a stopped replica (whose
/// relayed ratios only age) while a new one serves its address.
async fn until_stopped<I, S>(
    conn: hyper::server::conn::http1::Connection<I, S>,
    mut stop: watch::Receiver<bool>,
) where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + 'static,
    S: hyper::service::HttpService<Incoming>,
    S::ResBody: 'static,
    <S::ResBody as hyper::body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    tokio::pin!(conn);
    if !*stop.borrow_and_update() {
        tokio::select! {
            _ = conn.as_mut() => return,
            _ = stop.changed() => {}
        }
    }
    conn.as_mut().graceful_shutdown();
    let _ = conn.await;
}

/// Connections one control-plane listener holds at once (pooled proxy connections stay open:
/// this is well above what one replica serves, and below the file-descriptor limit).
pub const MAX_CONNECTIONS: usize = 32_768;

/// Of those, what one address holds at once: a proxy or an aggregator keeps a few pooled
/// connections; a pod opening idle ones by the thousand is cut off at this.
pub const MAX_PER_ADDRESS: usize = 512;

/// A new plain-text connection must send its first byte within this (TLS: the handshake's own
/// timeout).
pub const FIRST_BYTE: Duration = Duration::from_secs(5);

/// One connection's place in its address's share; given back when dropped.
struct AddressShare {
    map: Arc<dashmap::DashMap<std::net::IpAddr, usize>>,
    peer: std::net::IpAddr,
}

impl AddressShare {
    fn take(
        map: &Arc<dashmap::DashMap<std::net::IpAddr, usize>>,
        peer: std::net::IpAddr,
    ) -> Option<Self> {
        let mut held = map.entry(peer).or_insert(0);
        if *held >= MAX_PER_ADDRESS {
            return None;
        }
        *held += 1;
        drop(held);
        Some(AddressShare {
            map: map.clone(),
            peer,
        })
    }
}

impl Drop for AddressShare {
    fn drop(&mut self) {
        // The last connection of an address takes its entry with it.
        self.map.remove_if_mut(&self.peer, |_, held| {
            *held -= 1;
            *held == 0
        });
    }
}

/// Large request bodies are read within a budget of bytes, in units of [`BODY_UNIT`]: a body
/// takes as many as its `Content-Length` announces (one of unknown length, [`MAX_BODY`]'s),
/// before its first byte is read. A body in flight costs about three times its size (its bytes
/// and what they parse into), so the process holds at most 3 x 16 MiB for them, whatever the
/// number of connections.
pub const BODY_UNIT: usize = 64 << 10;
pub const BODY_BUDGET: usize = 16 << 20;
static BODIES: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(BODY_BUDGET / BODY_UNIT);

/// Of that budget, what one principal (a service's token, the aggregators', the admin's, the
/// shared one) may hold at once: half, and at most [`BODIES_PER_PRINCIPAL`] bodies; one
/// tenant's slow or huge bodies never take every turn.
pub const BODIES_PER_PRINCIPAL: usize = 4;
const PRINCIPAL_BUDGET: usize = BODY_BUDGET / 2;

/// A body longer than this is parsed on a blocking thread.
const PARSE_APART: usize = 1 << 20;

/// A body announced at most this long takes a small turn, of which there are many: its memory
/// is small, and the reports of a healthy fleet never wait behind a tenant's large ones.
pub const SMALL_BODY: u64 = 64 << 10;

/// The longest a report waits for a turn to have its body read (not charged to its sender's
/// body clock): then 503 with `Retry-After`.
pub const TURN_WAIT: Duration = Duration::from_secs(5);

/// A body must arrive at least this fast (bytes a second) once [`BODY_GRACE`] has passed...
pub const MIN_BODY_RATE: u64 = 64 << 10;
/// ...and within this however fast it comes.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(10);
/// What a body may take before its rate counts.
pub const BODY_GRACE: Duration = Duration::from_secs(1);

/// Each principal's turns and bytes, made when it first sends a large body (principals are the
/// configured tokens: a bounded set).
static TURNS: std::sync::LazyLock<dashmap::DashMap<String, Budget>> =
    std::sync::LazyLock::new(dashmap::DashMap::new);

/// One principal's large-body turns and bytes.
#[derive(Clone)]
struct Budget {
    turns: Arc<tokio::sync::Semaphore>,
    bytes: Arc<tokio::sync::Semaphore>,
}

/// What a body being read holds until it is parsed (dropped: given back).
enum Turn {
    Small(
        #[allow(dead_code)] tokio::sync::OwnedSemaphorePermit,
        #[allow(dead_code)] tokio::sync::SemaphorePermit<'static>,
    ),
    Large(
        #[allow(dead_code)] tokio::sync::OwnedSemaphorePermit,
        #[allow(dead_code)] tokio::sync::OwnedSemaphorePermit,
        #[allow(dead_code)] tokio::sync::SemaphorePermit<'static>,
    ),
}

/// A body's turn, held by what it parsed into (see [`read_json`]).
pub struct BodyTurn(#[allow(dead_code)] Turn);

/// Small bodies read at once, per process (16 MiB at most) and per principal (4 MiB): they
/// need no byte count, but a tenant's thousands of connections must not hold one each.
static SMALL_BODIES: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(256);
pub const SMALL_PER_PRINCIPAL: usize = 64;
static SMALL_TURNS: std::sync::LazyLock<dashmap::DashMap<String, Arc<tokio::sync::Semaphore>>> =
    std::sync::LazyLock::new(dashmap::DashMap::new);

/// Raises the soft open-files limit to what a server's two listeners may hold
/// ([`MAX_CONNECTIONS`] each), as the proxy does for its own: container runtimes start
/// processes at 1 024, which idle connections would fill long before the cap.
pub fn room_for_connections(listener: &TcpListener, what: &str) {
    let needed = 2 * MAX_CONNECTIONS as u64 + 256;
    match crate::fds::prepare(needed, std::os::fd::AsFd::as_fd(listener)) {
        Ok(room) if room.limit < room.needed => tracing::warn!(
            limit = room.limit,
            needed = room.needed,
            "the {what}'s open-files limit is below what its connections may need: raise it (ulimit -n)"
        ),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot read the open-files limit"),
    }
}

/// Binds `addr` with a message that names it when that fails.
pub async fn bind(addr: SocketAddr, what: &str) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen on {what} {addr}: {e}")))
}

/// A JSON response.
pub fn json<T: Serialize>(status: StatusCode, value: &T) -> Response<Body> {
    let body = serde_json::to_vec(value).unwrap_or_else(|_| b"{}".to_vec());
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    resp
}

/// Whether a request's sender reads the fields past version 1 ([`super::WIRE_HEADER`]).
pub fn speaks_wire2<B>(req: &Request<B>) -> bool {
    req.headers()
        .get(super::WIRE_HEADER)
        .is_some_and(|v| v.as_bytes() == super::WIRE.as_bytes())
}

/// A reply to a report: whole to a sender that reads the fields past version 1 (and saying
/// that this side takes them), else as version 1.
pub fn reply(mut reply: super::Reply, wire2: bool) -> Response<Body> {
    if !wire2 {
        reply.downgrade();
    }
    let mut resp = json(StatusCode::OK, &reply);
    resp.headers_mut().insert(
        super::WIRE_HEADER,
        http::HeaderValue::from_static(super::WIRE),
    );
    resp
}

/// Marks `resp` as a reply whose ratios are not authoritative yet ([`super::WARMING_HEADER`]).
pub fn warming(mut resp: Response<Body>, warming: bool) -> Response<Body> {
    if warming {
        resp.headers_mut()
            .insert(super::WARMING_HEADER, http::HeaderValue::from_static("1"));
    }
    resp
}

/// What a sender that cannot read [`warming`]'s header gets instead of ratios that are not
/// authoritative yet: 503 with `Retry-After`, counted and held as any failed report.
pub fn warming_refused() -> Response<Body> {
    let mut resp = error(
        StatusCode::SERVICE_UNAVAILABLE,
        "warming up: no authoritative ratios yet",
    );
    resp.headers_mut().insert(
        http::header::RETRY_AFTER,
        http::HeaderValue::from_static("1"),
    );
    warming(resp, true)
}

/// A response of JSON already serialized.
pub fn json_bytes(status: StatusCode, body: Bytes) -> Response<Body> {
    let mut resp = Response::new(Full::new(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    resp
}

/// A JSON error: `{"error": "..."}`.
pub fn error(status: StatusCode, message: &str) -> Response<Body> {
    json(status, &serde_json::json!({ "error": message }))
}

/// Reads a JSON body of `who`'s of at most [`MAX_BODY`] bytes: 413 past it, 400 when it is
/// not `T`, 408 when it comes slower than [`MIN_BODY_RATE`] (after [`BODY_GRACE`]) or takes
/// longer than [`BODY_TIMEOUT`], 503 when no turn comes within [`TURN_WAIT`]. A body announced
/// at most [`SMALL_BODY`] long takes one of `who`'s [`SMALL_PER_PRINCIPAL`] small turns and
/// one of the process's 256; a larger one (or one of unknown length) one of `who`'s
/// [`BODIES_PER_PRINCIPAL`] turns and its bytes of `who`'s half of [`BODY_BUDGET`] and of the
/// process's; before its clock starts. The turn comes back with the body parsed: what it
/// parsed into is held until the caller lets the turn go (a report waiting to be recorded
/// holds the memory its turn stands for).
pub async fn read_json<T: DeserializeOwned + Send + 'static>(
    req: Request<Incoming>,
    who: &str,
) -> Result<(T, BodyTurn), Response<Body>> {
    let announced = req
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if announced.is_some_and(|n| n > MAX_BODY as u64) {
        return Err(too_large());
    }
    let busy = || {
        let mut resp = error(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many report bodies are being read; retry",
        );
        resp.headers_mut().insert(
            http::header::RETRY_AFTER,
            http::HeaderValue::from_static("1"),
        );
        resp
    };
    let turn = if announced.is_some_and(|n| n <= SMALL_BODY) {
        let own = SMALL_TURNS
            .entry(who.to_string())
            .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(SMALL_PER_PRINCIPAL)))
            .clone();
        tokio::time::timeout(TURN_WAIT, async {
            let own = own.acquire_owned().await.ok()?;
            let any = SMALL_BODIES.acquire().await.ok()?;
            Some(Turn::Small(own, any))
        })
        .await
    } else {
        let units = announced
            .map_or(MAX_BODY, |n| n as usize)
            .div_ceil(BODY_UNIT) as u32;
        let own = TURNS
            .entry(who.to_string())
            .or_insert_with(|| Budget {
                turns: Arc::new(tokio::sync::Semaphore::new(BODIES_PER_PRINCIPAL)),
                bytes: Arc::new(tokio::sync::Semaphore::new(PRINCIPAL_BUDGET / BODY_UNIT)),
            })
            .clone();
        tokio::time::timeout(TURN_WAIT, async {
            let turn = own.turns.acquire_owned().await.ok()?;
            let bytes = own.bytes.acquire_many_owned(units).await.ok()?;
            let any = BODIES.acquire_many(units).await.ok()?;
            Some(Turn::Large(turn, bytes, any))
        })
        .await
    };
    let turn = match turn {
        Ok(Some(t)) => t,
        _ => return Err(busy()),
    };
    let capacity = announced.map_or(0, |n| n as usize);
    let bytes = match timely_body(req.into_body(), capacity).await {
        Ok(bytes) => bytes,
        Err(resp) => return Err(resp),
    };
    let malformed =
        |e: serde_json::Error| error(StatusCode::BAD_REQUEST, &format!("malformed body: {e}"));
    if bytes.len() <= PARSE_APART {
        return serde_json::from_slice(&bytes)
            .map(|t| (t, BodyTurn(turn)))
            .map_err(malformed);
    }
    // A large body parses off the runtime: a tenant's 8 MiB reports must not hold the threads
    // that answer everyone else's (smaller ones parse faster than a hand-off costs).
    // The turn goes with the parse: a sender that leaves meanwhile frees no room the parse
    // still holds.
    let parse = move || serde_json::from_slice::<T>(&bytes).map(|t| (t, BodyTurn(turn)));
    match tokio::task::spawn_blocking(parse).await {
        Ok(parsed) => parsed.map_err(malformed),
        Err(_) => Err(error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the body's parse failed",
        )),
    }
}

fn too_large() -> Response<Body> {
    error(StatusCode::PAYLOAD_TOO_LARGE, "body larger than 8 MiB")
}

/// Collects `body` within the size, rate and time bounds of [`read_json`].
/// `capacity`: what the body announced (held in one allocation, not grown by doubling).
async fn timely_body(mut body: Incoming, capacity: usize) -> Result<bytes::Bytes, Response<Body>> {
    let start = tokio::time::Instant::now();
    let deadline = start + BODY_TIMEOUT;
    let mut out = bytes::BytesMut::with_capacity(capacity.min(MAX_BODY));
    let slow = || {
        error(
            StatusCode::REQUEST_TIMEOUT,
            "the body came too slowly (at least 64 KiB/s after 1 s, all within 10 s)",
        )
    };
    loop {
        // The rate's next check: when what has come so far stops being enough.
        let due =
            start + BODY_GRACE + Duration::from_secs_f64(out.len() as f64 / MIN_BODY_RATE as f64);
        let frame = match tokio::time::timeout_at(due.min(deadline), body.frame()).await {
            Err(_) => return Err(slow()),
            Ok(None) => return Ok(out.freeze()),
            Ok(Some(Err(_))) => {
                return Err(error(StatusCode::BAD_REQUEST, "body could not be read"))
            }
            Ok(Some(Ok(frame))) => frame,
        };
        if let Ok(data) = frame.into_data() {
            if out.len() + data.len() > MAX_BODY {
                return Err(too_large());
            }
            out.extend_from_slice(&data);
        }
    }
}

/// The answer to a report whose source was refused: 429 (a flood of new sources, or a source
/// past one report per interval; retry) or
/// 403 (a host reporting for a service that is not its own), counted by kind. A duplicate is
/// not answered here: its sender gets the usual reply.
pub fn source_refused(
    refusal: &crate::control::SourceRefusal,
    reports: &prometheus::IntCounterVec,
) -> Response<Body> {
    match refusal {
        crate::control::SourceRefusal::Flood | crate::control::SourceRefusal::TooSoon => {
            let label = if matches!(refusal, crate::control::SourceRefusal::Flood) {
                "throttled"
            } else {
                "too_soon"
            };
            reports.with_label_values(&[label]).inc();
            let mut resp = error(StatusCode::TOO_MANY_REQUESTS, &refusal.to_string());
            resp.headers_mut().insert(
                http::header::RETRY_AFTER,
                http::HeaderValue::from_static("1"),
            );
            resp
        }
        crate::control::SourceRefusal::Foreign(..) => {
            reports.with_label_values(&["foreign"]).inc();
            error(StatusCode::FORBIDDEN, &refusal.to_string())
        }
        crate::control::SourceRefusal::Duplicate(_) => {
            reports.with_label_values(&["duplicate"]).inc();
            error(StatusCode::CONFLICT, &refusal.to_string())
        }
        crate::control::SourceRefusal::Held => {
            reports.with_label_values(&["held"]).inc();
            error(StatusCode::CONFLICT, &refusal.to_string())
        }
    }
}

/// A plain-text response.
pub fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Body> {
    let mut resp = Response::new(Full::new(body.into()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    resp
}

/// A running control-plane process: its addresses and the handle to stop it.
pub struct Running {
    pub addr: SocketAddr,
    pub admin_addr: SocketAddr,
    stop: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Running {
    pub fn new(
        addr: SocketAddr,
        admin_addr: SocketAddr,
        stop: watch::Sender<bool>,
        tasks: Vec<tokio::task::JoinHandle<()>>,
    ) -> Self {
        Running {
            addr,
            admin_addr,
            stop,
            tasks,
        }
    }

    /// Stops accepting and ends the background loops.
    pub fn shutdown(&self) {
        let _ = self.stop.send(true);
    }

    /// Waits until every task has ended.
    pub async fn wait(self) {
        for t in self.tasks {
            let _ = t.await;
        }
    }

    /// Serves until `signal` completes, then stops.
    pub async fn run_until(self, signal: impl Future<Output = ()>) {
        signal.await;
        self.shutdown();
        self.wait().await;
    }
}

/// The admin endpoints of a control-plane process: `/metrics`, `/healthz`, `/readyz`.
pub fn admin_route(path: &str, metrics: impl FnOnce() -> Vec<u8>) -> Response<Body> {
    match path {
        "/metrics" => text(StatusCode::OK, metrics()),
        "/healthz" => text(StatusCode::OK, "ok\n"),
        "/readyz" => text(StatusCode::OK, "ready\n"),
        _ => text(
            StatusCode::NOT_FOUND,
            "not found; try /metrics /healthz /readyz\n",
        ),
    }
}

/// Renders a registry in Prometheus text format.
pub fn render(registry: &prometheus::Registry) -> Vec<u8> {
    use prometheus::Encoder;
    let mut out = Vec::new();
    let _ = prometheus::TextEncoder::new().encode(&registry.gather(), &mut out);
    out
}

/// Who sent `req`, or the 401 to answer (counted in `counter` as `unauthorized`).
pub fn authenticate<B>(
    req: &Request<B>,
    creds: &Credentials,
    counter: &prometheus::IntCounterVec,
) -> Result<Principal, Response<Body>> {
    creds.authenticate(req.headers()).ok_or_else(|| {
        counter.with_label_values(&["unauthorized"]).inc();
        error(StatusCode::UNAUTHORIZED, "missing or wrong bearer token")
    })
}

/// Takes a report off `req`: who sent it, a JSON body within the size limit, the checks JSON
/// cannot make, and whether the sender may report it. A refusal is counted in `reports`
/// (unauthorized, malformed, invalid, forbidden) and is the response to send. The body's turn
/// comes with it: let it go once the report is recorded.
pub async fn receive_report(
    req: Request<Incoming>,
    creds: &Credentials,
    reports: &prometheus::IntCounterVec,
) -> Result<(super::Report, Principal, BodyTurn), Response<Body>> {
    let refuse = |result: &str, resp| {
        reports.with_label_values(&[result]).inc();
        Err(resp)
    };
    let principal = authenticate(&req, creds, reports)?;
    let instance = req
        .headers()
        .get(super::INSTANCE_HEADER)
        .and_then(|v| u64::from_str_radix(v.to_str().ok()?, 16).ok());
    let (mut report, turn): (super::Report, _) = match read_json(req, &principal.id()).await {
        Ok(r) => r,
        Err(resp) => return refuse("malformed", resp),
    };
    report.instance = instance;
    // One bad entry (a proxy's odd key) must not switch off every rule of the report.
    let dropped = report.drop_invalid();
    if dropped > 0 {
        reports
            .with_label_values(&["entries_dropped"])
            .inc_by(dropped as u64);
    }
    if let Err(e) = report.validate() {
        return refuse("invalid", error(StatusCode::BAD_REQUEST, &e.to_string()));
    }
    if matches!(principal, Principal::Admin | Principal::Metrics)
        || (matches!(principal, Principal::Aggregator) && !report.source.starts_with("zone:"))
    {
        return refuse(
            "forbidden",
            error(
                StatusCode::FORBIDDEN,
                "the admin and metrics tokens report nothing; the aggregators' token sends zone sums only",
            ),
        );
    }
    if report.source.starts_with("zone:") && !principal.may_send_zone_sums() {
        return refuse(
            "forbidden",
            error(
                StatusCode::FORBIDDEN,
                "only the aggregators' token may send zone sums",
            ),
        );
    }
    if let Some(e) = report
        .entries
        .iter()
        .find(|e| !principal.may_report(&e.service))
    {
        let msg = format!("this token may not report for service {}", e.service);
        return refuse("forbidden", error(StatusCode::FORBIDDEN, &msg));
    }
    // A service's token names sources in its own space: it cannot take over another service's
    // host name (an empty report under it would erase that host's counts, a huge `seq` would
    // make its next reports look already counted).
    if let Some(service) = principal.service() {
        report.source = format!("{service}/{}", report.source);
    }
    Ok((report, principal, turn))
}

/// The services whose ratios a reply to `report` from `principal` carries: a service token's
/// own; everything, for an aggregator's zone sums (its hosts may be of any service, even ones
/// absent from this forward); else the services the report names.
pub fn reply_services<'a>(
    report: &'a super::Report,
    principal: &'a Principal,
) -> Option<Vec<&'a str>> {
    if let Some(s) = principal.service() {
        return Some(vec![s]);
    }
    if report.source.starts_with("zone:") {
        // Every part of a forward gets the same ratios: only the first part's reply has them.
        if report.source.contains('#') {
            return Some(Vec::new());
        }
        return None;
    }
    let mut services: Vec<&str> = report.entries.iter().map(|e| e.service.as_str()).collect();
    services.sort_unstable();
    services.dedup();
    Some(services)
}

/// Registers `spillway_<role>_insecure` in `registry`: 1 when serving beyond loopback with no
/// token ([`check_exposure`] said so).
pub fn insecure_gauge(registry: &prometheus::Registry, role: &str, insecure: bool) {
    let gauge = prometheus::IntGauge::new(
        format!("spillway_{role}_insecure"),
        "1 when serving beyond loopback with no token (--insecure).",
    )
    .expect("valid metric");
    gauge.set(i64::from(insecure));
    registry.register(Box::new(gauge)).expect("unique");
}

/// Refuses to serve `addr` beyond loopback without a token, unless `insecure`; returns whether
/// it is serving insecurely (to log and to show in a metric).
pub fn check_exposure(
    role: &str,
    addrs: &[SocketAddr],
    creds: &Credentials,
    insecure: bool,
) -> std::io::Result<bool> {
    let exposed: Vec<&SocketAddr> = addrs.iter().filter(|a| !a.ip().is_loopback()).collect();
    if exposed.is_empty() || !creds.is_open() {
        return Ok(false);
    }
    if !insecure {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "the {role} would accept reports from anyone on {}: give --tokens DIR or --token-file FILE, listen on 127.0.0.1, or pass --insecure",
                exposed[0]
            ),
        ));
    }
    tracing::warn!(
        "INSECURE: the {role} listens on {} with no token: anyone who can reach it can change every service's limits and read their keys",
        exposed[0]
    );
    Ok(true)
}
