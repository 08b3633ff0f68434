//! The sidecar's data plane: accept, decide, forward, stream back; drain on shutdown.
//!
//! Owns the client listener (shared by the worker threads, each with its own current-thread runtime
//! and upstream connections, so a request never hops threads once accepted), the client connections
//! (HTTP/1 served by our own code, `http1`; HTTP/2 with prior knowledge by hyper's server on the
//! same port, `http2`), the request path, and the shutdown sequence. Must never: hold a snapshot
//! guard or any lock across an `.await`, buffer a body (beyond a small one already read with its
//! head), log per request above debug.
//!
//! Layers, each importing only those below it (`tests/modules.rs` fails on an import against
//! them): this file wires them (shared state, workers, timers); `connection` owns a client
//! connection from accept to end and tells which protocol it speaks; the protocol servers
//! (`http1`'s server side, `http2`) are handed the request path as a `protocol::Handler` and
//! import neither it nor each other; the request path (`request`: hygiene, decision,
//! refusals) calls the forward (`forward`, `forwarded`, `affine` and `http1`'s client side).
//!
//! Cost of the request path beyond the server side's own work (`http1`'s, or hyper's): one pass
//! over the request's fields (`Hygiene`: head size, `Host`, client claims) and one over its path
//! (already canonical: no allocation), the client address by policy, one `ArcSwap` load,
//! [`RuleSet::check`] (see its cost), the header rewrite for the hop (one allocation for
//! `X-Forwarded-For`), two clock reads and one histogram observation; for an HTTP/1 client, the
//! exchange on its own upstream connection in the same task (`affine`: two uncontended locks, no
//! trip through the runtime's queue); the header-read and response deadlines as slots of the
//! worker's `coarse` timers (an uncontended lock to arm and one to disarm each, not tokio's timer
//! wheel).

mod accept;
mod admin;
mod affine;
mod body;
mod clients;
mod coarse;
mod connection;
mod failure;
pub mod forward;
mod forwarded;
pub(crate) mod http1;
mod http2;
mod protocol;
pub mod reload;
mod request;
pub mod respond;

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinHandle;

use crate::config::{Config, ConfigError};
use crate::control::reporter::Reporter;
use crate::fds;
use crate::gate;
use crate::hygiene::{Hygiene, MISDIRECTED, TOO_LARGE};
use crate::key::{self, RequestView};
use crate::limit::{AnyClock, Clock};
use crate::metrics::{Metrics, Outcome};
use crate::rules::DropRatios;
use crate::rules::RuleSet;
use forward::ReqBody;
use request::*;
use respond::Body;

/// How often idle keys are swept from the per-rule stores.
const SWEEP_EVERY: Duration = Duration::from_secs(5);
/// How often adaptive limits are asked to close a window no completion closed.
const ADAPTIVE_TICK: Duration = Duration::from_millis(250);

/// State shared by every connection of one proxy.
pub struct Shared {
    /// Rules, matchers and their metric handles, swapped whole on reload.
    pub rules: Arc<ArcSwap<RuleSet>>,
    /// The control plane's drop ratios, published by the reporter, read by global rules.
    pub ratios: Arc<ArcSwap<DropRatios>>,
    pub config: ArcSwap<Config>,
    upstream: http::uri::Authority,
    /// The same with its connect and idle timeouts, for every upstream connection.
    affine_upstream: affine::Dial,
    upstream_h2: bool,
    /// `limits.max_upstream_connections`, shared by every worker.
    upstream_cap: Arc<affine::Cap>,
    /// `limits.max_upstream_per_client`.
    upstream_per_client: usize,
    /// `limits.max_response_buffer` and its per-connection part, for HTTP/2 responses.
    h2_budget: Arc<http2::held::Budget>,
    /// `limits.max_connections_per_client`.
    per_client: Arc<clients::PerClient>,
    /// Each worker's idle kept-alive connections, one closed for a new client at the cap.
    idles: clients::Idles,
    pub clock: AnyClock,
    pub metrics: Arc<Metrics>,
    /// Who the client is, and whose forwarded fields and costs are believed.
    client_ip: key::ClientIpPolicy,
    /// What is done to a request's target and headers before the rules see it.
    hygiene: Hygiene,
    response_timeout: Duration,
    /// `timeouts.send` and `timeouts.client_body_idle`, for a body still coming upstream.
    upload_timeouts: (Duration, Duration),
    // Relaxed: a flag read by /readyz; nothing else is published through it.
    pub draining: AtomicBool,
    /// Redis of `scope: redis` rules, kept across reloads while its section is unchanged.
    #[cfg(feature = "redis")]
    exact: arc_swap::ArcSwapOption<crate::exact::Exact>,
    /// The active configuration's version, for `/config`.
    pub loaded: ArcSwap<reload::Loaded>,
    reload_lock: tokio::sync::Mutex<()>,
}

/// A running proxy: its bound addresses and the handle to stop it.
pub struct Sidecar {
    addr: SocketAddr,
    admin_addr: SocketAddr,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
    shared: Arc<Shared>,
}

impl Sidecar {
    /// Binds the listeners of `config` (port 0 picks a free port) and starts serving.
    pub async fn start(config: Config) -> std::io::Result<Sidecar> {
        Self::start_with_clock(config, AnyClock::default()).await
    }

    /// As [`start`](Self::start), with the limiters reading `clock`.
    pub async fn start_with_clock(config: Config, clock: AnyClock) -> std::io::Result<Sidecar> {
        let workers = config
            .workers
            .map(|n| n.get() as usize)
            .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
            .unwrap_or(1);
        let listeners = bind_shared(config.listen, workers).map_err(|e| {
            std::io::Error::new(e.kind(), format!("cannot listen on {}: {e}", config.listen))
        })?;
        let admin_listener = TcpListener::bind(config.admin).await.map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("cannot listen on admin {}: {e}", config.admin),
            )
        })?;
        if config.timeouts.idle.is_some() {
            tracing::warn!(
                "timeouts.idle is now timeouts.upstream_idle (the old name still works for now)"
            );
        }
        let needed = fds::needed(
            config.limits.max_connections.get(),
            config.limits.upstream_connections(),
        );
        match fds::prepare(needed, std::os::fd::AsFd::as_fd(&listeners[0])) {
            Ok(room) if room.limit < room.needed => tracing::warn!(
                limit = room.limit,
                needed = room.needed,
                "the open-files limit is below what limits.max_connections and \
                 max_upstream_connections need: raise it (ulimit -n) or lower them"
            ),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "cannot read the open-files limit"),
        }
        let addr = listeners[0].local_addr()?;
        let admin_addr = admin_listener.local_addr()?;
        let metrics = Arc::new(Metrics::for_service(&config.service.0));
        // Ratios count as fresh from start-up, so a control plane that never answers makes
        // the proxy stale (fail open, or the fallback limits) after `stale_after`.
        let ratios = Arc::new(ArcSwap::from_pointee(DropRatios::empty(clock.now())));
        let secret = crate::digest::Secret::of(config.key_secret_file.as_deref())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        for warning in config.warnings() {
            tracing::warn!("{warning}");
        }
        #[cfg(feature = "redis")]
        let exact = match &config.redis {
            Some(redis) => {
                let exact = crate::exact::Exact::new(
                    redis,
                    &config.service.0,
                    &secret,
                    metrics.redis.clone(),
                    clock.clone(),
                )
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
                exact.start().await;
                Some(exact)
            }
            None => None,
        };
        let rules =
            RuleSet::build_with_ratios(&config, &metrics, ratios.clone()).with_secret(secret);
        #[cfg(feature = "redis")]
        let rules = rules.with_store(crate::exact::store(&exact));
        let (stop, stopped) = watch::channel(false);
        let reporter = match &config.control_plane {
            Some(cp) => Some(Reporter::new(
                &config.service.0,
                cp,
                &ratios,
                &clock,
                &metrics,
                stop.subscribe(),
            )?),
            None => None,
        };
        let t = &config.timeouts;
        let shared = Arc::new(Shared {
            rules: Arc::new(ArcSwap::from_pointee(rules)),
            ratios,
            upstream: config.upstream.authority.clone(),
            affine_upstream: affine::Dial {
                address: format!(
                    "{}:{}",
                    config.upstream.authority.host(),
                    config.upstream.authority.port_u16().unwrap_or(80)
                ),
                connect_timeout: t.upstream_connect.0,
                idle: t.upstream_idle().as_nanos() as u64,
            },
            upstream_h2: config.upstream.h2,
            upstream_cap: affine::Cap::new(
                config.limits.upstream_connections() as usize,
                metrics.upstream_waiters.clone(),
            ),
            upstream_per_client: config.limits.max_upstream_per_client.get() as usize,
            h2_budget: http2::held::Budget::new(
                config.limits.max_response_buffer.0,
                config.limits.max_response_buffer_per_connection.0,
                metrics.h2_held.clone(),
                metrics.h2_shed.clone(),
            ),
            per_client: clients::PerClient::new(
                config.limits.max_connections_per_client.get(),
                config.per_client_exempt(),
            ),
            idles: clients::Idles::default(),
            clock,
            metrics,
            client_ip: config.client_ip.policy(),
            hygiene: Hygiene::of(&config),
            response_timeout: t.upstream_response.0,
            upload_timeouts: (t.send.0, t.client_body_idle.0),
            draining: AtomicBool::new(false),
            #[cfg(feature = "redis")]
            exact: arc_swap::ArcSwapOption::new(exact),
            loaded: ArcSwap::from_pointee(reload::Loaded::new(
                crate::watch::version_of(&config_json_text(&config)),
                None,
            )),
            reload_lock: tokio::sync::Mutex::new(()),
            config: ArcSwap::from_pointee(config),
        });
        shared
            .metrics
            .config_loaded_at
            .set(shared.loaded.load().loaded_at);
        let task = tokio::spawn(serve(
            listeners,
            admin_listener,
            shared.clone(),
            stopped,
            reporter,
        ));
        Ok(Sidecar {
            addr,
            admin_addr,
            stop,
            task,
            shared,
        })
    }

    /// Records `text` (the file the configuration came from) as the active version, and
    /// reloads whenever `path` changes (directory events, so a ConfigMap's symlink swap
    /// counts) or the process gets SIGHUP, until shutdown.
    pub fn watch_file(&self, path: PathBuf, text: &str) -> std::io::Result<()> {
        self.shared.loaded.store(Arc::new(reload::Loaded::new(
            crate::watch::version_of(text),
            Some(path.clone()),
        )));
        let shared = self.shared.clone();
        crate::watch::spawn(&path.clone(), self.stop.subscribe(), move |trigger| {
            let (shared, path) = (shared.clone(), path.clone());
            async move { reload::reload_and_log(&shared, &path, trigger).await }
        })?;
        Ok(())
    }

    /// Reloads from `path` now (what SIGHUP does), returning what changed or why nothing did.
    pub async fn reload_file(&self, path: &Path) -> Result<reload::Reloaded, ConfigError> {
        let result = reload::reload(&self.shared, path, crate::watch::Trigger::Signal).await;
        self.shared.metrics.reloaded(result.is_ok());
        result.map(|r| r.expect("a signal-triggered reload always reloads"))
    }

    /// The active configuration's version and load time.
    pub fn loaded(&self) -> Arc<reload::Loaded> {
        self.shared.loaded.load_full()
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// Starts the shutdown: not ready, stop accepting, drain in-flight requests.
    pub fn shutdown(&self) {
        let _ = self.stop.send(true);
    }

    /// Waits until the proxy has drained and stopped.
    pub async fn wait(self) {
        let _ = self.task.await;
    }

    /// Serves until `signal` completes, then drains and returns.
    pub async fn run_until(self, signal: impl Future<Output = ()>) {
        signal.await;
        self.shutdown();
        self.wait().await;
    }
}

/// Binds `addr` once and gives each of `n` workers its own handle (a dup of the socket) to
/// register with its own runtime. Every worker is woken for a new connection; the first worker
/// takes it, the others only while the first is busy or when it leaves one waiting
/// ([`accept`]), so a busy worker never queues connections an idle one could take, and a light
/// load stays on one worker.
///
/// Rather than one `SO_REUSEPORT` listener per worker, which hashes connections to workers
/// whatever their load (docs/measurements.md, "One shared listener"). A port already in use
/// fails with "address in use", never shares silently.
fn bind_shared(addr: SocketAddr, n: usize) -> std::io::Result<Vec<std::net::TcpListener>> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    // Set once here, inherited by every accepted connection: a client that vanished without a
    // FIN (a node gone, a NAT that forgot it) is found out within about two minutes, instead
    // of holding its connection slot until a timeout of ours notices.
    socket2::SockRef::from(&socket).set_tcp_keepalive(&client_keepalive())?;
    socket.bind(addr)?;
    let first = socket.listen(4096)?.into_std()?;
    let mut out = Vec::with_capacity(n.max(1));
    for _ in 1..n.max(1) {
        out.push(first.try_clone()?);
    }
    out.insert(0, first);
    Ok(out)
}

/// TCP keepalive on client connections: first probe after a minute of silence, then every
/// 10 s, given up after 6 unanswered.
fn client_keepalive() -> socket2::TcpKeepalive {
    socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(60))
        .with_interval(Duration::from_secs(10))
        .with_retries(6)
}

async fn serve(
    listeners: Vec<std::net::TcpListener>,
    admin_listener: TcpListener,
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
    reporter: Option<Reporter>,
) {
    let (admin_stop_tx, admin_stop) = watch::channel(false);
    let admin_task = tokio::spawn(admin::serve(admin_listener, shared.clone(), admin_stop));
    let sweeper = tokio::spawn(sweep_loop(shared.clone()));
    let (report_stop_tx, report_stop) = watch::channel(false);
    let reporter = reporter.map(|r| tokio::spawn(r.run(shared.rules.clone(), report_stop)));

    // The data plane: one thread per worker, each with its own current-thread runtime, its own
    // handle on the listener and its own upstream connections, so a request never hops between
    // threads (nginx's shape). Only the connection cap is shared; tokio's semaphore works
    // across runtimes.
    let max_connections = shared.config.load().limits.max_connections.get() as usize;
    let slots = Arc::new(Semaphore::new(max_connections));
    let mut workers = Vec::new();
    // Each worker says when its listener is closed, so that /readyz turns 503 only once no
    // new connection can be accepted.
    let (closed_tx, mut closed) = tokio::sync::mpsc::channel::<()>(listeners.len().max(1));
    let first = Arc::new(accept::FirstLoad::default());
    for (i, listener) in listeners.into_iter().enumerate() {
        let (done_tx, done) = tokio::sync::oneshot::channel::<()>();
        let (shared, stop, slots) = (shared.clone(), stop.clone(), slots.clone());
        let (closed_tx, first) = (closed_tx.clone(), first.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("spillway-worker-{i}"))
            .spawn(move || {
                match worker_runtime() {
                    Ok(rt) => {
                        rt.block_on(worker(i, listener, shared, stop, slots, closed_tx, first))
                    }
                    Err(e) => tracing::error!(error = %e, "cannot start a worker runtime"),
                }
                let _ = done_tx.send(());
            });
        match spawned {
            Ok(_) => workers.push(done),
            Err(e) => tracing::error!(error = %e, "cannot start a worker thread"),
        }
    }

    drop(closed_tx);
    // Shutdown: stop accepting, not ready, let in-flight requests finish within `drain`.
    let _ = stop.wait_for(|stopped| *stopped).await;
    while closed.recv().await.is_some() {}
    shared.draining.store(true, Ordering::Relaxed);
    shared.metrics.draining.set(1);
    let drain = shared.config.load().timeouts.drain.0;
    tracing::info!(?drain, "draining");
    for done in workers {
        let _ = done.await;
    }
    sweeper.abort();
    // The reporter sends the counts of the drain, then stops.
    let _ = report_stop_tx.send(true);
    if let Some(r) = reporter {
        let _ = r.await;
    }
    let _ = admin_stop_tx.send(true);
    let _ = admin_task.await;
}

/// A data-plane worker's runtime: one thread, told when it wakes from waiting for events
/// ([`http1::client::woke`]).
pub(crate) fn worker_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .on_thread_unpark(http1::client::woke)
        .build()
}

/// One data-plane worker: accepts on its own listener until `stop`, then drains.
async fn worker(
    index: usize,
    listener: std::net::TcpListener,
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
    slots: Arc<Semaphore>,
    closed: tokio::sync::mpsc::Sender<()>,
    first: Arc<accept::FirstLoad>,
) {
    let mut listener = match accept::Acceptor::for_worker(listener, index, &first) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "cannot use the listener");
            return;
        }
    };
    let up = &shared.affine_upstream;
    let client = Arc::new(forward::client(
        up.connect_timeout,
        Duration::from_nanos(up.idle),
        shared.upstream_cap.clone(),
    ));
    let config = shared.config.load_full();
    let timers = Arc::new(coarse::Timers::default());
    // A partial request head this long is answered 431 as it is read; below it, the request
    // path answers 431 at `max_header_bytes`.
    let max_head = (config.limits.max_header_bytes.0 * 2).max(8192 + 1024);
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .max_concurrent_streams(config.limits.max_h2_streams.get())
        .max_send_buf_size(shared.h2_budget.per_stream())
        .max_header_list_size(config.limits.max_header_bytes.0 as u32)
        .max_pending_accept_reset_streams(64)
        .keep_alive_interval(Some(config.timeouts.upstream_idle()))
        .keep_alive_timeout(config.timeouts.header_read.0);
    // Tells this worker's connections that it drains; each holds `alive` until it ends.
    let (drain_tx, draining) = watch::channel(false);
    let (alive, mut all_ended) = tokio::sync::mpsc::channel::<()>(1);
    let body_idle_errors = shared
        .metrics
        .upstream_error(crate::metrics::UpstreamError::BodyIdle)
        .clone();
    let stalls = Arc::new(http2::stalls::Stalls::new(
        (config.timeouts.send.0, shared.metrics.send_timeouts.clone()),
        (
            config.timeouts.upstream_body_idle.0,
            body_idle_errors.clone(),
        ),
        anchor_period(&config),
    ));
    shared.idles.add(&timers);
    let lane = Arc::new(protocol::Lane {
        hyper: builder,
        max_head,
        header_read: config.timeouts.header_read.0,
        client_idle: config.timeouts.client_idle.0,
        send: config.timeouts.send.0,
        body_idle: config.timeouts.upstream_body_idle.0,
        body_idle_errors,
        timers: timers.clone(),
        stalls: stalls.clone(),
        h2_budget: shared.h2_budget.clone(),
        draining,
    });
    let idle = Arc::new(affine::Idle::new(
        shared.metrics.upstream_discards.clone(),
        shared.upstream_cap.clone(),
    ));
    // Ends with this worker's runtime.
    tokio::spawn(anchor_timer(
        anchor_period(&config),
        idle.clone(),
        stalls,
        timers.clone(),
        shared.clone(),
        (index == 0).then(|| accept::Sampler::new(first)),
    ));

    loop {
        // Take a connection slot before accepting, so at the cap new clients wait in the
        // kernel's backlog instead of being accepted and starved; unless an idle kept-alive
        // connection can be closed for the client that comes.
        let permit = match slots.clone().try_acquire_owned() {
            Ok(p) => Some(p),
            Err(_) => tokio::select! {
                _ = stop.wait_for(|stopped| *stopped) => break,
                p = slots.clone().acquire_owned() => match p { Ok(p) => Some(p), Err(_) => break },
                () = shared.idles.some_idle() => None,
            },
        };
        let (stream, peer) = tokio::select! {
            _ = stop.wait_for(|stopped| *stopped) => break,
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    // EMFILE and friends: back off briefly instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let Some(place) = shared.per_client.admit(peer.ip()) else {
            shared.metrics.refused_per_client.inc();
            shared.per_client.refuse(stream);
            continue;
        };
        let permit = match permit {
            Some(p) => p,
            None => {
                if shared.idles.close_one() {
                    shared.metrics.closed_for_room.inc();
                }
                tokio::select! {
                    _ = stop.wait_for(|stopped| *stopped) => break,
                    p = slots.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
                }
            }
        };
        let conn = Arc::new(Conn {
            abandoned: connection::Abandoned::default(),
            shared: shared.clone(),
            client: client.clone(),
            affine: affine::Affine::new(idle.clone()),
            streams: std::sync::OnceLock::new(),
            timers: timers.clone(),
            peer,
        });
        let (lane, alive) = (lane.clone(), alive.clone());
        let metrics = shared.metrics.clone();
        metrics.connections.inc();
        tokio::spawn(async move {
            let _alive = alive;
            let served = std::pin::pin!(connection::serve(stream, conn.clone(), lane));
            match affine::drive(served, &conn.affine).await {
                Some(Ok(())) => {}
                Some(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "connection ended with an error");
                }
                None => {
                    // Dropping the connection closes it, with every stream on it.
                    metrics.rapid_reset.inc();
                    tracing::warn!(%peer, "closed a connection that abandoned requests faster than {}/s (rapid reset)", connection::ABANDON_BUDGET);
                }
            }
            metrics.connections.dec();
            drop(place);
            drop(permit);
        });
    }
    drop(listener);
    drop(closed);
    let _ = drain_tx.send(true);
    drop(alive);
    tokio::select! {
        _ = all_ended.recv() => tracing::debug!("worker drained"),
        _ = tokio::time::sleep(config.timeouts.drain.0) => tracing::warn!("drain timed out; closing the remaining connections"),
    }
}

/// The worker's tick: fires its [`coarse::Timers`] (each request's header-read, upstream
/// response and send deadlines), drops the HTTP/2 responses whose client has left their
/// window shut for `timeouts.send` ([`http2::stalls::Stalls`]), and closes its idle upstream connections unused for `timeouts.upstream_idle` or
/// closed by the upstream meanwhile. On the first worker, also measures its load for the
/// others' accept loops ([`accept::Sampler`]).
///
/// Also the one timer on tokio's wheel that is always pending, so that the few a request may
/// still arm there (a delayed request, a connect) do not each make tokio write its own eventfd:
/// tokio wakes its I/O driver whenever a timer is registered while no earlier one is pending,
/// even from the runtime's own thread while it is busy (tokio-rs/tokio#5207;
/// docs/measurements.md, "The anchor timer").
async fn anchor_timer(
    period: Duration,
    idle: Arc<affine::Idle>,
    stalls: Arc<http2::stalls::Stalls>,
    timers: Arc<coarse::Timers>,
    shared: Arc<Shared>,
    mut load: Option<accept::Sampler>,
) {
    loop {
        tokio::time::sleep(period).await;
        timers.fire(coarse::Timers::now());
        stalls.tick();
        idle.prune(shared.clock.now(), shared.affine_upstream.idle);
        if let Some(load) = &mut load {
            load.sample(tokio::time::Instant::now());
            // Once per process (the first worker's tick).
            shared.h2_budget.settle();
        }
    }
}

/// Half the shortest per-request timer, a rule's `upstream_body_idle` at start included, at
/// most a second (a shorter one a reload brings fires up to a second late).
fn anchor_period(config: &Config) -> Duration {
    let t = &config.timeouts;
    let rules = config.rules.iter().filter_map(|r| r.upstream_body_idle);
    (rules.fold(
        t.header_read
            .0
            .min(t.upstream_response.0)
            .min(t.send.0)
            .min(t.upstream_body_idle.0)
            .min(t.client_body_idle.0),
        |shortest, d| shortest.min(d.0),
    ) / 2)
        .clamp(Duration::from_millis(1), Duration::from_secs(1))
}

/// Forgets idle keys in the background (the sweep locks one shard at a time), and closes
/// adaptive limits' windows that no completion closed.
async fn sweep_loop(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(ADAPTIVE_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let sweep_every = (SWEEP_EVERY.as_millis() / ADAPTIVE_TICK.as_millis()) as u64;
    for n in 0u64.. {
        tick.tick().await;
        let rules = shared.rules.load_full();
        rules.tick_adaptive();
        if n % sweep_every == sweep_every - 1 {
            let removed = rules.sweep(shared.clock.now());
            if removed > 0 {
                tracing::debug!(removed, "swept idle keys");
            }
        }
    }
}

/// The effective configuration as JSON, for `/config`, with its version and load time.
pub fn config_json(config: &Config, loaded: &reload::Loaded) -> Bytes {
    let mut doc = serde_json::to_value(config).unwrap_or_default();
    if let (serde_json::Value::Object(map), Ok(serde_json::Value::Object(meta))) =
        (&mut doc, serde_json::to_value(loaded))
    {
        map.extend(meta);
    }
    serde_json::to_vec_pretty(&doc)
        .map(Bytes::from)
        .unwrap_or_else(|e| Bytes::from(format!("{{\"error\":\"{e}\"}}")))
}

/// A stable text of `config`, for the version of a configuration that came from no file.
fn config_json_text(config: &Config) -> String {
    serde_json::to_string(config).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_anchor_ticks_at_half_the_shortest_timer_a_rules_included() {
        let yaml = "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nrules:\n  - name: feeds\n    key: []\n    limit: { rate: 10/s }\n    upstream_body_idle: 600ms\n";
        let config = Config::from_yaml(yaml, "t").unwrap();
        assert_eq!(anchor_period(&config), Duration::from_millis(300));
        let config =
            Config::from_yaml(&yaml.replace("    upstream_body_idle: 600ms\n", ""), "t").unwrap();
        assert_eq!(anchor_period(&config), Duration::from_secs(1));
    }

    #[tokio::test]
    async fn accepted_client_connections_inherit_tcp_keepalive() {
        let listeners = bind_shared("127.0.0.1:0".parse().unwrap(), 1).unwrap();
        let addr = listeners[0].local_addr().unwrap();
        let _client = std::net::TcpStream::connect(addr).unwrap();
        let (accepted, _) = listeners[0].accept().unwrap();
        let sock = socket2::SockRef::from(&accepted);
        assert!(sock.keepalive().unwrap());
        assert_eq!(sock.tcp_keepalive_time().unwrap(), Duration::from_secs(60));
        assert_eq!(
            sock.tcp_keepalive_interval().unwrap(),
            Duration::from_secs(10)
        );
        assert_eq!(sock.tcp_keepalive_retries().unwrap(), 6);
    }
}
