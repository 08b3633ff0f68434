//! `spillway demo`: the whole sidecar on loopback, with no files and no flags.
//!
//! Starts an in-process upstream, the proxy in front of it with one per-client rule, and a
//! load generator that offers three clients about 3x their limit, then prints once a second
//! what was offered, allowed and rejected, and finally one 429 as a client sees it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

use crate::{Config, Sidecar};

const CLIENTS: [&str; 3] = ["alice", "bob", "carol"];
const LIMIT_PER_CLIENT: u64 = 20;
const OFFERED_PER_CLIENT: u64 = 60;

fn demo_config(upstream: std::net::SocketAddr) -> String {
    format!(
        r#"
service: demo
listen: 127.0.0.1:0
upstream: http://{upstream}
admin: 127.0.0.1:0
headers: on_reject
# A handful of clients: no need to ask the system for descriptors for 10 000.
limits: {{ max_connections: 100 }}
rules:
  - name: per-client
    match: {{ path_prefix: /api/ }}
    key: [header:x-client]
    limit: {{ rate: {LIMIT_PER_CLIENT}/s, burst: {LIMIT_PER_CLIENT} }}
"#
    )
}

/// Answers counted by a load generator.
#[derive(Default)]
pub struct Tally {
    pub offered: AtomicU64,
    pub allowed: AtomicU64,
    pub rejected: AtomicU64,
    pub other: AtomicU64,
}

impl Tally {
    /// (offered, allowed, rejected) since the last call.
    pub fn take(&self) -> (u64, u64, u64) {
        (
            self.offered.swap(0, Ordering::Relaxed),
            self.allowed.swap(0, Ordering::Relaxed),
            self.rejected.swap(0, Ordering::Relaxed),
        )
    }
}

/// Runs the demo for `duration` of load, printing a table once a second.
pub async fn run(duration: Duration) -> anyhow::Result<()> {
    let upstream = start_upstream().await?;
    let yaml = demo_config(upstream);
    let config = Config::from_yaml(&yaml, "<demo>").context("the demo's own config")?;
    let sidecar = Sidecar::start(config).await?;
    let proxy = sidecar.addr();
    println!("Spillway demo: an app on {upstream}, the sidecar in front of it on {proxy}");
    println!(
        "(metrics on http://{}/metrics while it runs)",
        sidecar.admin_addr()
    );
    println!(
        "Rule per-client: {LIMIT_PER_CLIENT} req/s per x-client header, burst {LIMIT_PER_CLIENT}; \
         {} clients each offer {OFFERED_PER_CLIENT} req/s for {} s.\n",
        CLIENTS.len(),
        duration.as_secs()
    );
    println!(" second | offered/s | allowed/s | rejected/s | limit/s");
    println!("--------+-----------+-----------+------------+--------");

    let client: Client<HttpConnector, Empty<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let tally = Arc::new(Tally::default());
    let deadline = tokio::time::Instant::now() + duration;
    let mut generators = Vec::new();
    let uri: http::Uri = format!("http://{proxy}/api/orders").parse()?;
    for name in CLIENTS {
        generators.push(tokio::spawn(offer(
            client.clone(),
            uri.clone(),
            vec![("x-client", name.to_string())],
            |_| OFFERED_PER_CLIENT,
            tally.clone(),
            deadline,
        )));
    }

    let mut second = 0;
    let mut totals = [0u64; 3];
    let mut tick = tokio::time::interval_at(
        tokio::time::Instant::now() + Duration::from_secs(1),
        Duration::from_secs(1),
    );
    for _ in 0..duration.as_secs() {
        tick.tick().await;
        second += 1;
        let (offered, allowed, rejected) = tally.take();
        totals[0] += offered;
        totals[1] += allowed;
        totals[2] += rejected;
        println!(
            " {second:>6} | {offered:>9} | {allowed:>9} | {rejected:>10} | {:>6}",
            LIMIT_PER_CLIENT * CLIENTS.len() as u64
        );
    }
    // The last requests may still be in flight: count them in the totals.
    for g in generators {
        let _ = g.await;
    }
    let (offered, allowed, rejected) = tally.take();
    totals[0] += offered;
    totals[1] += allowed;
    totals[2] += rejected;
    let other = tally.other.load(Ordering::Relaxed);
    println!(
        "\nTotal: {} offered, {} allowed, {} rejected{}.",
        totals[0],
        totals[1],
        totals[2],
        if other > 0 {
            format!(", {other} other outcomes")
        } else {
            String::new()
        }
    );
    println!(
        "Expected allowed at most: burst {} + {} req/s x {} s = {}.",
        LIMIT_PER_CLIENT * CLIENTS.len() as u64,
        LIMIT_PER_CLIENT * CLIENTS.len() as u64,
        duration.as_secs(),
        LIMIT_PER_CLIENT * CLIENTS.len() as u64 * (1 + duration.as_secs())
    );

    show_one_rejection(&client, proxy).await?;
    sidecar.shutdown();
    sidecar.wait().await;
    Ok(())
}

/// Offers `rate(elapsed)` requests per second of GET `uri` with `headers` until `deadline`,
/// each in its own task so that slow answers never slow the offer, and tallies the answers.
pub async fn offer(
    client: Client<HttpConnector, Empty<Bytes>>,
    uri: http::Uri,
    headers: Vec<(&'static str, String)>,
    rate: impl Fn(Duration) -> u64,
    tally: Arc<Tally>,
    deadline: tokio::time::Instant,
) {
    let start = tokio::time::Instant::now();
    let mut next = start;
    let mut inflight = tokio::task::JoinSet::new();
    while next < deadline {
        tokio::time::sleep_until(next).await;
        let per_sec = rate(next - start).max(1);
        next += Duration::from_nanos(1_000_000_000 / per_sec);
        let mut req = Request::get(uri.clone());
        for (k, v) in &headers {
            req = req.header(*k, v.as_str());
        }
        let req = req.body(Empty::new()).expect("a valid request");
        let (client, tally) = (client.clone(), tally.clone());
        inflight.spawn(async move { send_counted(&client, req, &tally).await });
        while inflight.try_join_next().is_some() {}
    }
    while inflight.join_next().await.is_some() {}
}

/// Sends `req` and counts it as offered, then by its answer.
async fn send_counted(
    client: &Client<HttpConnector, Empty<Bytes>>,
    req: Request<Empty<Bytes>>,
    tally: &Tally,
) {
    tally.offered.fetch_add(1, Ordering::Relaxed);
    let counter = match client.request(req).await {
        Ok(resp) => {
            let status = resp.status();
            let _ = resp.into_body().collect().await;
            match status.as_u16() {
                200 => &tally.allowed,
                429 => &tally.rejected,
                _ => &tally.other,
            }
        }
        Err(_) => &tally.other,
    };
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Closed-loop load: `conns` clients, each sending its next request as soon as it has the
/// answer to the last, until `deadline` (what real clients, and retry loops, do).
pub(crate) async fn offer_closed(
    client: Client<HttpConnector, Empty<Bytes>>,
    uri: http::Uri,
    headers: Vec<(&'static str, String)>,
    conns: usize,
    tally: Arc<Tally>,
    deadline: tokio::time::Instant,
) {
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..conns {
        let (client, uri, headers, tally) =
            (client.clone(), uri.clone(), headers.clone(), tally.clone());
        clients.spawn(async move {
            while tokio::time::Instant::now() < deadline {
                let mut req = Request::get(uri.clone());
                for (k, v) in &headers {
                    req = req.header(*k, v.as_str());
                }
                let req = req.body(Empty::new()).expect("a valid request");
                send_counted(&client, req, &tally).await;
            }
        });
    }
    while clients.join_next().await.is_some() {}
}

async fn show_one_rejection(
    client: &Client<HttpConnector, Empty<Bytes>>,
    proxy: std::net::SocketAddr,
) -> anyhow::Result<()> {
    // Spend one client's bucket, then show the refusal it gets.
    for _ in 0..=LIMIT_PER_CLIENT {
        let req = Request::get(format!("http://{proxy}/api/orders"))
            .header("x-client", "dave")
            .body(Empty::new())?;
        let resp = client.request(req).await?;
        if resp.status() == 429 {
            println!(
                "\nWhat a rejected client sees:\n  HTTP/1.1 {}",
                resp.status()
            );
            for name in [
                "retry-after",
                "ratelimit-policy",
                "ratelimit",
                "content-type",
            ] {
                if let Some(v) = resp.headers().get(name) {
                    println!("  {name}: {}", v.to_str().unwrap_or("?"));
                }
            }
            let body = resp.into_body().collect().await?.to_bytes();
            println!("\n  {}", String::from_utf8_lossy(&body).trim());
            return Ok(());
        }
        let _ = resp.into_body().collect().await;
    }
    anyhow::bail!("the demo rule never rejected: something is wrong")
}

/// A tiny app: answers every request with 200 and a short body.
pub async fn start_upstream() -> anyhow::Result<std::net::SocketAddr> {
    serve_app(service_fn(|_req: Request<Incoming>| async {
        Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from_static(
            b"hello from the app\n",
        ))))
    }))
    .await
}

/// Serves `service` over HTTP/1 on a loopback port of its own, each connection in a task.
pub(crate) async fn serve_app<S, B>(service: S) -> anyhow::Result<std::net::SocketAddr>
where
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let service = service.clone();
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(addr)
}

pub mod fleet;
pub mod tokens;

/// `spillway demo --fleet`: a controller, three aggregators (two replicas for one zone), three
/// proxies and an uneven load (6:2:1 across the proxies, 1x the limit then 3x), with a table
/// once a second.
pub async fn fleet() -> anyhow::Result<()> {
    fleet::run().await
}
