//! Test harness: an in-test upstream app, the sidecar in front of it, and clients.
#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::{TokioExecutor, TokioIo};
use spillway::internal::limit::{AnyClock, ManualClock};
use spillway::{Config, Sidecar};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Notify};

pub type TestBody = BoxBody<Bytes, std::io::Error>;

/// What the upstream tells the test from inside its handlers.
#[derive(Default)]
pub struct Signals {
    /// `/hold` waits for this before answering.
    pub release: Notify,
    /// `/hold` reports here when a request has arrived.
    pub held: Notify,
    /// `/upload` reports here the first time it sees body bytes.
    pub first_bytes: Notify,
    /// `/upload` reports here when a request's head has arrived.
    pub upload_head: Notify,
    /// `/early` reports here when it has read a request's body to its end.
    pub drained: Notify,
    /// Request heads the app has seen.
    pub requests: std::sync::atomic::AtomicUsize,
}

/// An app on loopback:
/// - `/echo`: 200, body = JSON of method, uri, request headers, body and the proxy's end of
///   the connection it came on;
/// - `/slow`: answers after 10 s;
/// - `/hold`: answers when the test releases it;
/// - `/upload`: streams the body and answers with the byte count;
/// - `/early`: answers "early" at once, then reads the body to its end;
/// - `/ws`: accepts an upgrade and echoes bytes;
/// - anything else: 200 "ok".
pub struct Upstream {
    pub addr: SocketAddr,
    pub signals: Arc<Signals>,
}

pub async fn upstream() -> Upstream {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let signals = Arc::new(Signals::default());
    let s = signals.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, peer)) = listener.accept().await else {
                return;
            };
            let s = s.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| app(req, s.clone(), peer));
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .with_upgrades()
                    .await;
            });
        }
    });
    Upstream { addr, signals }
}

async fn app(
    mut req: Request<Incoming>,
    signals: Arc<Signals>,
    peer: SocketAddr,
) -> Result<Response<Full<Bytes>>, Infallible> {
    signals
        .requests
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let body = match req.uri().path() {
        "/echo" => {
            let headers: serde_json::Map<String, serde_json::Value> = req
                .headers()
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("?").into()))
                .collect();
            let (method, uri, version) = (req.method().clone(), req.uri().clone(), req.version());
            let body = req.into_body().collect().await.map(|b| b.to_bytes());
            serde_json::json!({
                "method": method.as_str(),
                "uri": uri.to_string(),
                "version": format!("{version:?}"),
                "headers": headers,
                "body": String::from_utf8_lossy(&body.unwrap_or_default()),
                // The proxy's end of the upstream connection the request came on.
                "peer": peer.to_string(),
            })
            .to_string()
        }
        // Larger than any socket buffer: a client that never reads holds the response.
        "/big" => return Ok(Response::new(Full::new(Bytes::from(vec![b'x'; 32 << 20])))),
        "/slow" => {
            tokio::time::sleep(Duration::from_secs(10)).await;
            "slow".into()
        }
        "/hold" => {
            signals.held.notify_one();
            signals.release.notified().await;
            "released".into()
        }
        "/upload" => {
            signals.upload_head.notify_one();
            let mut n = 0u64;
            let mut body = req.into_body();
            while let Some(frame) = body.frame().await {
                let Ok(frame) = frame else { break };
                if let Some(data) = frame.data_ref() {
                    if n == 0 && !data.is_empty() {
                        signals.first_bytes.notify_one();
                    }
                    n += data.len() as u64;
                }
            }
            n.to_string()
        }
        "/early" => {
            let mut body = req.into_body();
            tokio::spawn(async move {
                while let Some(Ok(_)) = body.frame().await {}
                signals.drained.notify_one();
            });
            "early".into()
        }
        "/ws" => {
            let on_upgrade = hyper::upgrade::on(&mut req);
            tokio::spawn(async move {
                if let Ok(upgraded) = on_upgrade.await {
                    let mut io = TokioIo::new(upgraded);
                    let (mut r, mut w) = tokio::io::split(&mut io);
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                }
            });
            let mut resp = Response::new(Full::new(Bytes::new()));
            *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
            resp.headers_mut()
                .insert("upgrade", "websocket".parse().unwrap());
            resp.headers_mut()
                .insert("connection", "upgrade".parse().unwrap());
            return Ok(resp);
        }
        _ => "ok".into(),
    };
    Ok(Response::new(Full::new(Bytes::from(body))))
}

/// Config YAML with `{upstream}` replaced and loopback listeners on free ports.
pub fn config(upstream: SocketAddr, rest: &str) -> Config {
    let yaml = format!(
        "service: test\nlisten: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://{upstream}\n{rest}"
    );
    Config::from_yaml(&yaml, "test.yaml").unwrap_or_else(|e| panic!("{e}"))
}

/// A controller with its defaults, in this process, on loopback.
pub async fn controller_in_process() -> spillway::internal::control::server::Running {
    let any = "127.0.0.1:0".parse().unwrap();
    let options = spillway::internal::control::controller::ControllerOptions::new(any, any);
    spillway::internal::control::controller::start(options)
        .await
        .unwrap()
}

/// A `control_plane:` section reporting to `controller` every 100ms, and one global rule,
/// `fleet-wide`, of 5/s per `x-api-key`.
pub fn global_rule(controller: SocketAddr) -> String {
    format!(
        r#"control_plane: {{ url: "http://{controller}", report_interval: 100ms, stale_after: 5s }}
rules:
  - name: fleet-wide
    key: [header:x-api-key]
    limit: {{ rate: 5/s }}
    scope: global
"#
    )
}

/// The sidecar in front of a fresh upstream, on the real clock.
pub async fn sidecar(rest: &str) -> (Sidecar, Upstream) {
    let up = upstream().await;
    let sc = Sidecar::start(config(up.addr, rest)).await.unwrap();
    (sc, up)
}

/// The sidecar in front of a fresh upstream, its limiters on a manual clock.
pub async fn sidecar_with_clock(rest: &str) -> (Sidecar, Upstream, ManualClock) {
    let up = upstream().await;
    let clock = ManualClock::new(1_000_000_000);
    let sc = Sidecar::start_with_clock(config(up.addr, rest), AnyClock::Manual(clock.clone()))
        .await
        .unwrap();
    (sc, up, clock)
}

pub fn client() -> Client<HttpConnector, TestBody> {
    Client::builder(TokioExecutor::new()).build_http()
}

pub fn h2_client() -> Client<HttpConnector, TestBody> {
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http()
}

pub fn empty() -> TestBody {
    Empty::new().map_err(|never| match never {}).boxed()
}

/// A GET through the proxy with `headers`; returns status, headers and body text.
pub async fn get(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> (StatusCode, http::HeaderMap, String) {
    send(&client(), addr, "GET", path, headers).await
}

pub async fn send(
    client: &Client<HttpConnector, TestBody>,
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> (StatusCode, http::HeaderMap, String) {
    let mut req = Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = client.request(req.body(empty()).unwrap()).await.unwrap();
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (
        parts.status,
        parts.headers,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

/// The admin endpoint's body at `path`.
pub async fn admin(sc: &Sidecar, path: &str) -> (StatusCode, String) {
    let (s, _, b) = get(sc.admin_addr(), path, &[]).await;
    (s, b)
}

/// The value of one sample in the Prometheus text, e.g.
/// `spillway_requests_total{decision="allowed",rule="r"}`.
///
/// The proxy's `spillway_service` label (on every series) is left out of the comparison.
pub fn metric(text: &str, sample: &str) -> Option<f64> {
    text.lines()
        .map(without_service_label)
        .find_map(|l| l.strip_prefix(sample)?.trim().parse().ok())
}

/// A sample line without its `spillway_service="..."` label.
pub fn without_service_label(line: &str) -> String {
    let Some(at) = line.find("spillway_service=\"") else {
        return line.to_string();
    };
    let end = at
        + line[at + 18..]
            .find('"')
            .map_or(line.len() - at, |e| e + 19);
    let (mut head, mut tail) = (line[..at].to_string(), line[end..].to_string());
    if head.ends_with(',') {
        head.pop();
    } else if tail.starts_with(',') {
        tail.remove(0);
    }
    let joined = format!("{head}{tail}");
    joined.replace("{}", "")
}

/// A channel-fed request body.
pub fn channel_body() -> (mpsc::Sender<Bytes>, TestBody) {
    let (tx, rx) = mpsc::channel::<Bytes>(4);
    let stream = futures_stream(rx);
    (tx, stream)
}

fn futures_stream(mut rx: mpsc::Receiver<Bytes>) -> TestBody {
    let body = http_body_util::StreamBody::new(async_stream(move |cx| {
        rx.poll_recv(cx)
            .map(|o| o.map(|b| Ok::<_, std::io::Error>(hyper::body::Frame::data(b))))
    }));
    body.boxed()
}

/// A `Stream` from a poll function, to avoid a dependency on futures for one adapter.
fn async_stream<T, F>(f: F) -> PollStream<F>
where
    F: FnMut(&mut std::task::Context<'_>) -> std::task::Poll<Option<T>>,
{
    PollStream(f)
}

pub struct PollStream<F>(F);

impl<T, F> futures_core::Stream for PollStream<F>
where
    F: FnMut(&mut std::task::Context<'_>) -> std::task::Poll<Option<T>> + Unpin,
{
    type Item = T;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<T>> {
        (self.0)(cx)
    }
}

/// Writes `text` to `name` in a directory of this test process's own, and returns its path.
pub fn temp_file(name: &str, text: &str) -> std::path::PathBuf {
    use std::io::Write;
    let dir = std::env::temp_dir().join(format!("spillway-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::File::create(&path)
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    path
}

/// The built `spillway` binary.
pub const BIN: &str = env!("CARGO_BIN_EXE_spillway");

/// A process of ours; killed (by its own PID) when dropped.
pub struct Proc {
    pub child: std::process::Child,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
}

impl Proc {
    /// Starts `spillway args...` and waits for its readiness line.
    pub fn spawn(args: &[&str]) -> Proc {
        Proc::spawn_bin(BIN, args)
    }

    /// Starts `bin args...` (another release's binary) and waits for its readiness line.
    pub fn spawn_bin(bin: &str, args: &[&str]) -> Proc {
        let mut child = std::process::Command::new(bin)
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        // "spillway <role> listening on ADDR (admin ADDR)"
        let addr = line
            .split("listening on ")
            .nth(1)
            .and_then(|r| r.split(' ').next());
        let admin = line
            .split("(admin ")
            .nth(1)
            .map(|r| r.trim_end_matches([')', '\n']));
        let (Some(addr), Some(admin)) = (addr, admin) else {
            let _ = child.kill();
            panic!("no readiness line from {args:?}: {line:?}");
        };
        Proc {
            addr: addr.parse().unwrap(),
            admin: admin.parse().unwrap(),
            child,
        }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Stops it as Kubernetes does (SIGTERM) and waits for it to exit, its drain done.
    pub fn terminate(&mut self) {
        // SAFETY: a signal to our own child, by its PID.
        #[allow(unsafe_code)]
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM)
        };
        let _ = self.child.wait();
    }
}

/// A controller process on loopback ports of its own choosing, no token.
pub fn controller() -> Proc {
    controller_with(&[])
}

/// A controller on loopback with `extra` arguments.
pub fn controller_with(extra: &[&str]) -> Proc {
    let mut args = vec![
        "controller",
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
    ];
    args.extend_from_slice(extra);
    Proc::spawn(&args)
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A real `redis-server` of this test's own on a free loopback port, killed (by its PID) when
/// dropped. `scripts/test` installs redis-server when it is missing.
pub struct RedisServer {
    child: Option<std::process::Child>,
    pub port: u16,
    dir: std::path::PathBuf,
    extra: Vec<String>,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        Self::start_with(&[])
    }

    /// As [`start`](Self::start), with extra `redis-server` arguments (kept across restarts).
    pub fn start_with(extra: &[&str]) -> RedisServer {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir =
            std::env::temp_dir().join(format!("spillway-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut server = RedisServer {
            child: None,
            port,
            dir,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        server.restart();
        server
    }

    /// A Redis that speaks only TLS, with a certificate for 127.0.0.1 signed by a CA of its own
    /// (made with the `openssl` command); returns the server and the CA's PEM file.
    pub fn start_tls() -> (RedisServer, std::path::PathBuf) {
        let dir = test_ca("redis");
        let file = |name: &str| dir.join(name).to_str().unwrap().to_string();
        let server = RedisServer::start_with(&[
            "--tls-port",
            "{port}",
            "--tls-cert-file",
            &file("server.crt"),
            "--tls-key-file",
            &file("server.key"),
            "--tls-ca-cert-file",
            &file("ca.crt"),
            "--tls-auth-clients",
            "no",
        ]);
        (server, dir.join("ca.crt"))
    }

    /// Starts (again) on the same port, empty: no keys, no scripts. Waits for its readiness line.
    pub fn restart(&mut self) {
        self.stop();
        // A TLS server takes its port from `--tls-port {port}` and turns plain TCP off.
        let tls = self.extra.iter().any(|a| a == "--tls-port");
        let extra: Vec<String> = self
            .extra
            .iter()
            .map(|a| a.replace("{port}", &self.port.to_string()))
            .collect();
        let plain_port = if tls {
            "0".to_string()
        } else {
            self.port.to_string()
        };
        let mut child = std::process::Command::new("redis-server")
            .args([
                "--port",
                &plain_port,
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir.to_str().unwrap(),
            ])
            .args(&extra)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start redis-server ({e}); scripts/test installs it (apt-get install redis-server)")
            });
        let out = std::io::BufReader::new(child.stdout.take().unwrap());
        for line in std::io::BufRead::lines(out) {
            let line = line.unwrap();
            if line.contains("Ready to accept connections") {
                self.child = Some(child);
                return;
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!(
            "redis-server on port {} exited before it was ready",
            self.port
        );
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Freezes (SIGSTOP) or thaws (SIGCONT) the server: connections stay open, nothing answers.
    pub fn signal(&self, sig: &str) {
        if let Some(pid) = self.pid() {
            let ok = std::process::Command::new("kill")
                .args([sig, &pid.to_string()])
                .status()
                .unwrap()
                .success();
            assert!(ok, "kill {sig} {pid}");
        }
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// A plain connection for the test's own look at the keys.
    #[cfg(feature = "redis")]
    pub async fn conn(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.signal("-CONT");
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A real three-node Redis Cluster on loopback (no replicas), made with `redis-cli --cluster
/// create`; every node is killed when dropped.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        let nodes: Vec<RedisServer> = (0..3)
            .map(|_| {
                RedisServer::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                ])
            })
            .collect();
        let mut args = vec!["--cluster".to_string(), "create".to_string()];
        args.extend(nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)));
        args.extend(["--cluster-replicas", "0", "--cluster-yes"].map(String::from));
        let out = std::process::Command::new("redis-cli")
            .args(&args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "redis-cli --cluster create: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        // Ready when every node says the cluster is ok (bounded: 10 s).
        for n in &nodes {
            let mut ok = false;
            for _ in 0..200 {
                let info = std::process::Command::new("redis-cli")
                    .args(["-p", &n.port.to_string(), "cluster", "info"])
                    .output()
                    .unwrap();
                if String::from_utf8_lossy(&info.stdout).contains("cluster_state:ok") {
                    ok = true;
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            assert!(
                ok,
                "cluster node {} never reported cluster_state:ok",
                n.port
            );
        }
        RedisCluster { nodes }
    }

    /// `url:` as a YAML flow list of the nodes.
    pub fn urls(&self) -> String {
        let urls: Vec<String> = self.nodes.iter().map(|n| n.url()).collect();
        format!("[{}]", urls.join(", "))
    }
}

/// A response read off the wire: status line, lower-cased head, body (by its length).
pub struct Answer {
    pub status: String,
    pub head: String,
    pub body: String,
}

/// Reads one response from a raw HTTP/1 connection.
pub async fn read_answer(s: &mut tokio::io::BufReader<tokio::net::TcpStream>) -> Answer {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt};
    let mut status = String::new();
    s.read_line(&mut status).await.unwrap();
    let mut head = String::new();
    let mut len = 0usize;
    loop {
        let mut line = String::new();
        s.read_line(&mut line).await.unwrap();
        if line == "\r\n" || line.is_empty() {
            break;
        }
        let lower = line.to_ascii_lowercase();
        if let Some(v) = lower.strip_prefix("content-length:") {
            len = v.trim().parse().unwrap();
        }
        head.push_str(&lower);
    }
    let mut body = vec![0; len];
    s.read_exact(&mut body).await.unwrap();
    Answer {
        status: status.trim_end().to_string(),
        head,
        body: String::from_utf8(body).unwrap(),
    }
}

/// Sends `text` on a raw HTTP/1 connection and reads one answer.
pub async fn ask(c: &mut tokio::io::BufReader<tokio::net::TcpStream>, text: &str) -> Answer {
    use tokio::io::AsyncWriteExt;
    c.get_mut().write_all(text.as_bytes()).await.unwrap();
    read_answer(c).await
}

/// A per-request round-robin HTTP/1 balancer on loopback in front of `backends`: what a mesh
/// or an L7 Service does, so that consecutive reports of one proxy reach different replicas.
/// A backend that refuses the connection is skipped; [`Balancer::set`] changes the set.
pub struct Balancer {
    pub addr: SocketAddr,
    backends: Arc<arc_swap::ArcSwap<Vec<SocketAddr>>>,
}

impl Balancer {
    pub async fn start(backends: Vec<SocketAddr>) -> Balancer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let backends = Arc::new(arc_swap::ArcSwap::from_pointee(backends));
        let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let client: Client<HttpConnector, Full<Bytes>> =
            Client::builder(TokioExecutor::new()).build_http();
        let b = backends.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (b, next, client) = (b.clone(), next.clone(), client.clone());
                tokio::spawn(async move {
                    let service = service_fn(move |req: Request<Incoming>| {
                        let (b, next, client) = (b.clone(), next.clone(), client.clone());
                        async move {
                            let (parts, body) = req.into_parts();
                            let body = body.collect().await.unwrap().to_bytes();
                            let all = b.load_full();
                            for _ in 0..all.len().max(1) {
                                let Some(to) = all.get(
                                    next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                                        % all.len().max(1),
                                ) else {
                                    break;
                                };
                                let mut out = Request::builder()
                                    .method(parts.method.clone())
                                    .uri(format!("http://{to}{}", parts.uri));
                                for (k, v) in &parts.headers {
                                    out = out.header(k, v);
                                }
                                let out = out.body(Full::new(body.clone())).unwrap();
                                if let Ok(resp) = client.request(out).await {
                                    let (p, body) = resp.into_parts();
                                    let body = body.collect().await.unwrap().to_bytes();
                                    return Ok::<_, Infallible>(Response::from_parts(
                                        p,
                                        Full::new(body),
                                    ));
                                }
                            }
                            let mut resp = Response::new(Full::new(Bytes::from("no backend")));
                            *resp.status_mut() = StatusCode::BAD_GATEWAY;
                            Ok(resp)
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Balancer { addr, backends }
    }

    pub fn set(&self, backends: Vec<SocketAddr>) {
        self.backends.store(Arc::new(backends));
    }
}

/// A CA made by `openssl` for this test, and a server certificate it signed for 127.0.0.1:
/// `ca.crt`, `server.crt` and `server.key` in the returned directory.
pub fn test_ca(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("spillway-tls-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let openssl = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .current_dir(&dir)
            .args(args)
            .output()
            .expect("openssl (scripts/test installs it)");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=spillway test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
    ]);
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    ]);
    std::fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "san.ext",
        "-out",
        "server.crt",
    ]);
    dir
}

/// A raw TCP server on loopback: each accepted connection is handed to `serve` in a task of
/// its own. For upstreams that must write what no HTTP library would.
pub async fn raw_server<F, Fut>(serve: F) -> SocketAddr
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            tokio::spawn(serve(s));
        }
    });
    addr
}

/// One request head read from `s`, up to and with its blank line (a raw app's requests carry
/// no body); `None` once the connection ends or fails first.
pub async fn read_head<R: tokio::io::AsyncBufRead + Unpin>(s: &mut R) -> Option<String> {
    use tokio::io::AsyncBufReadExt;
    let mut head = String::new();
    loop {
        let at = head.len();
        match s.read_line(&mut head).await {
            Ok(0) | Err(_) => return None,
            Ok(_) if &head[at..] == "\r\n" => return Some(head),
            Ok(_) => {}
        }
    }
}

/// A raw HTTP/1 app on loopback that answers every request head on a connection (requests
/// without a body) with `answer`, as written.
pub async fn answering(answer: &str) -> SocketAddr {
    use tokio::io::AsyncWriteExt;
    let answer: Arc<str> = answer.into();
    raw_server(move |s| {
        let answer = answer.clone();
        async move {
            let mut s = tokio::io::BufReader::new(s);
            while read_head(&mut s).await.is_some() {
                if s.get_mut().write_all(answer.as_bytes()).await.is_err() {
                    return;
                }
            }
        }
    })
    .await
}

/// Whether the proxy closes `s` (an end of stream with nothing more) within 10 s.
pub async fn at_end(s: &mut tokio::io::BufReader<tokio::net::TcpStream>) -> bool {
    use tokio::io::AsyncReadExt;
    let mut rest = Vec::new();
    matches!(
        tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest)).await,
        Ok(Ok(0))
    )
}

// The control plane as a tenant sees it (tests/tenant.rs, tests/fleet.rs).

/// A `--tokens` directory: `shop-t`, `books-t`, `maps-t`, `agg-t` (the aggregators),
/// `admin-t`, `metrics-t`.
pub fn tokens_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "spillway-tenant-{}-{}",
        std::process::id(),
        fastrand::u32(..)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, token) in [
        ("shop", "shop-t"),
        ("books", "books-t"),
        ("maps", "maps-t"),
        ("_aggregators", "agg-t"),
        ("_admin", "admin-t"),
        ("_metrics", "metrics-t"),
    ] {
        std::fs::write(dir.join(name), token).unwrap();
    }
    dir
}

/// POSTs a report with `token`, as this release's reporters do.
pub async fn report(addr: SocketAddr, token: &str, body: String) -> StatusCode {
    let req = http::Request::post(format!("http://{addr}/v1/report"))
        .header("spillway-wire", "2")
        .header("authorization", format!("Bearer {token}"))
        .body(
            http_body_util::Full::new(bytes::Bytes::from(body))
                .map_err(|never| match never {})
                .boxed(),
        )
        .unwrap();
    let resp = client().request(req).await.unwrap();
    let status = resp.status();
    let _ = resp.into_body().collect().await;
    status
}

/// A report of `keys` keys of `service`'s rule `r` (key `k<i>` offered `i + 1`).
pub fn many_keys(source: &str, service: &str, keys: usize) -> String {
    let entries: Vec<String> = (0..keys)
        .map(|i| {
            format!(
                r#"{{"service":"{service}","rule":"r","limit":{{"count":10,"period_ms":1000}},"key":"k{i}","offered":{},"admitted":1}}"#,
                i + 1
            )
        })
        .collect();
    format!(
        r#"{{"version":1,"source":"{source}","zone":"z","interval_ms":1000,"entries":[{}]}}"#,
        entries.join(",")
    )
}

/// A report as large as a body may be (8 MiB), of keys of about 90 bytes that no other source
/// reports.
pub fn maximal_report(source: &str, service: &str) -> String {
    let pad = "x".repeat(80);
    let mut entries = Vec::new();
    let mut len = 0;
    for i in 0.. {
        let e = format!(
            r#"{{"service":"{service}","rule":"r","limit":{{"count":10,"period_ms":1000}},"key":"{source}-{pad}-{i}","offered":2,"admitted":1}}"#
        );
        len += e.len() + 1;
        if len > (8 << 20) - 200 {
            break;
        }
        entries.push(e);
    }
    format!(
        r#"{{"version":1,"source":"{source}","zone":"z","interval_ms":1000,"entries":[{}]}}"#,
        entries.join(",")
    )
}
