//! The data plane's workers: one thread each, with its own current-thread runtime, its own
//! handle on the shared listener and its own upstream connections and timers, so that a
//! request never hops threads once accepted (nginx's shape); their start, their tick, the
//! background sweep of idle keys, and the shutdown sequence (stop accepting, drain, stop the
//! reporter and the admin listener). Each worker derives its connections' settings
//! (`settings::conn_settings`) from the configuration once. Must never: share a connection, a timer or an
//! upstream connection between workers (only the connection cap and the upstream cap are
//! shared).

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use super::request::Conn;
use super::settings::{self, anchor_period};
use super::shared::Shared;
use super::{accept, admin, connection, deadlines, forward, http1, http2, upstream_pool};
use crate::control::reporter::Reporter;
use crate::limit::Clock;

/// How often idle keys are swept from the per-rule stores.
const SWEEP_EVERY: Duration = Duration::from_secs(5);
/// How often adaptive limits are asked to close a window no completion closed.
const ADAPTIVE_TICK: Duration = Duration::from_millis(250);

/// Binds `addr` once and gives each of `n` workers its own handle (a dup of the socket) to
/// register with its own runtime. Every worker is woken for a new connection; the first worker
/// takes it, the others only while the first is busy or when it leaves one waiting
/// ([`accept`]), so a busy worker never queues connections an idle one could take, and a light
/// load stays on one worker.
///
/// Rather than one `SO_REUSEPORT` listener per worker, which hashes connections to workers
/// whatever their load (docs/measurements.md, "One shared listener"). A port already in use
/// fails with "address in use", never shares silently.
pub(super) fn bind_shared(
    addr: SocketAddr,
    n: usize,
) -> std::io::Result<Vec<std::net::TcpListener>> {
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

pub(super) async fn serve(
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
    let timers = Arc::new(deadlines::Timers::default());
    // Tells this worker's connections that it drains; each holds `alive` until it ends.
    let (drain_tx, draining) = watch::channel(false);
    let (alive, mut all_ended) = tokio::sync::mpsc::channel::<()>(1);
    let body_idle_errors = shared
        .metrics
        .upstream_error(crate::metrics::UpstreamError::BodyIdle)
        .clone();
    let stalls = Arc::new(http2::stalls::Stalls::new(
        (config.timeouts.send.0, shared.metrics.send_timeouts.clone()),
        (config.timeouts.upstream_body_idle.0, body_idle_errors),
        anchor_period(&config),
    ));
    shared.idles.add(&timers);
    let lane = Arc::new(settings::conn_settings(
        &config,
        (&shared.h2_budget, &shared.metrics),
        timers.clone(),
        stalls.clone(),
        draining,
    ));
    let idle = Arc::new(upstream_pool::Idle::new(
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
            affine: upstream_pool::ClientUpstream::new(idle.clone()),
            streams: std::sync::OnceLock::new(),
            timers: timers.clone(),
            peer,
        });
        let (lane, alive) = (lane.clone(), alive.clone());
        let metrics = shared.metrics.clone();
        metrics.connections.inc();
        tokio::spawn(async move {
            let _alive = alive;
            let mut drained = std::pin::pin!(connection::drained(&lane));
            let told = connection::told(stream, &lane, drained.as_mut()).await;
            let ended = match told {
                Ok(Some(told)) => {
                    let served = connection::serve(told, conn.clone(), &lane, drained);
                    let ended =
                        connection::until_tripped(std::pin::pin!(served), &conn.abandoned).await;
                    if ended.is_some() {
                        upstream_pool::park(&conn.affine);
                    }
                    ended
                }
                Ok(None) => Some(Ok(())),
                Err(e) => Some(Err(e.into())),
            };
            match ended {
                Some(Ok(())) => {}
                Some(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "connection ended with an error");
                }
                None => {
                    // Dropping the connection closes it, with every stream on it.
                    metrics.refused(crate::metrics::Reason::RapidReset).inc();
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

/// The worker's tick: fires its [`deadlines::Timers`] (each request's header-read, upstream
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
    idle: Arc<upstream_pool::Idle>,
    stalls: Arc<http2::stalls::Stalls>,
    timers: Arc<deadlines::Timers>,
    shared: Arc<Shared>,
    mut load: Option<accept::Sampler>,
) {
    loop {
        tokio::time::sleep(period).await;
        timers.fire(deadlines::Timers::now());
        stalls.tick();
        idle.prune(shared.clock.now(), shared.affine_upstream.idle);
        if let Some(load) = &mut load {
            load.sample(tokio::time::Instant::now());
            // Once per process (the first worker's tick).
            shared.h2_budget.settle();
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

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
