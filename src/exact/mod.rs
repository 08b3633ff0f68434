//! Exact fleet-wide limits through Redis (`scope: redis`): one atomic Lua script per decision.
//!
//! Owns the connection to Redis (one multiplexed connection, or a cluster connection that keeps
//! one per node), the scripts, the per-decision timeout and the circuit breaker. The rule
//! set decides what to ask and what to do with a failure (`on_error`); this module only asks.
//!
//! What the scripts guarantee (see `lua/`): time comes from Redis (`TIME`), never from a proxy,
//! so proxies with skewed clocks agree; the read, the increment and the expiry happen in one
//! script, so there is no read-then-increment race and no counter without a TTL; the members of
//! a sliding log are unique per unit; every key of a decision shares one hash tag
//! (`{service:rule:key}`), so Redis Cluster routes the script to one node.
//!
//! Cost per decision: the key written into a fresh buffer, an `ArcSwap` load of the connection,
//! one `EVALSHA` round trip (the script is loaded once per connection; a `NOSCRIPT` after a
//! Redis restart loads it again and retries), bounded by `timeout`. While the breaker is open
//! nothing is sent and the caller applies `on_error` at once. A server that says it is not the
//! primary (`READONLY`, `MASTERDOWN`, `LOADING`), a broken connection or a failed probe drops
//! the connection; a new one is made only to a server whose `ROLE` is master. Must never:
//! keep asking a demoted primary.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use redis::aio::MultiplexedConnection;
use redis::cluster_async::ClusterConnection;
use redis::Script;

use crate::config::{OnError, RedisConfig};
use crate::limit::{Algorithm, AnyClock, Clock, Nanos, Quota};
use crate::metrics::{RedisError, RedisMetrics};
use crate::rules::{Question, RemoteStore};

/// The rule set's store for `scope: redis` rules.
impl RemoteStore for Arc<Exact> {
    fn decide<'a>(
        &'a self,
        q: Question<'a>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Option<Answer>> + Send + 'a>> {
        Box::pin(async move {
            Exact::decide(self, q.rule, q.key, q.algorithm, q.quota, q.cost)
                .await
                .ok()
        })
    }

    fn peek<'a>(
        &'a self,
        q: Question<'a>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Option<Answer>> + Send + 'a>> {
        Box::pin(async move {
            Exact::peek(self, q.rule, q.key, q.algorithm, q.quota, q.cost)
                .await
                .ok()
        })
    }

    fn owe(
        &self,
        rule: Arc<str>,
        key: Box<[u8]>,
        quota: Quota,
        units: i64,
        lost: prometheus::IntCounter,
    ) {
        let owed = units.max(0) as u64;
        // Off the request's path: a task of the runtime the response was served on.
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            lost.inc_by(owed);
            return;
        };
        let exact = self.clone();
        rt.spawn(async move {
            if exact.owe(&rule, &key, &quota, units).await.is_err() {
                lost.inc_by(owed);
            }
        });
    }

    fn on_error(&self) -> OnError {
        Exact::on_error(self)
    }

    fn cache_refusals(&self) -> bool {
        Exact::cache_refusals(self)
    }

    fn retry_hint(&self) -> Nanos {
        Exact::retry_hint(self)
    }

    fn metrics(&self) -> &RedisMetrics {
        Exact::metrics(self)
    }
}

/// `exact` as the rule set's store.
pub fn store(exact: &Option<Arc<Exact>>) -> Option<Arc<dyn RemoteStore>> {
    exact.clone().map(|e| Arc::new(e) as Arc<dyn RemoteStore>)
}

#[cfg(test)]
mod tests;

/// How long one connection attempt may take before the connector backs off and tries again.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Back-off between connection attempts, doubling up to the second value.
const RECONNECT_BACKOFF: (Duration, Duration) = (Duration::from_millis(50), Duration::from_secs(1));

/// The answer of a script.
pub use crate::rules::StoreAnswer as Answer;

/// Why Redis gave no answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The breaker is open: Redis was not asked.
    BreakerOpen,
    /// No connection (never made, or lost and not yet made again).
    NotConnected,
    /// The decision's budget ran out.
    Timeout,
    /// The connection broke during the call.
    Connection,
    /// Redis answered with an error about its own state (out of memory, read-only, busy,
    /// loading, cluster down): it counts toward the breaker.
    Server,
    /// A script or its arguments failed, or its answer was not understood: Redis is up, so
    /// this never opens the breaker; `on_error` still decides the request.
    Script,
}

/// Error codes of a server that is not (or not yet) the primary: after a failover behind a
/// name or a Service that now points elsewhere, the connection is dropped and made again, so
/// that the proxy follows the primary rather than ask the old one until it restarts.
const NOT_PRIMARY: [&str; 3] = ["READONLY", "MASTERDOWN", "LOADING"];

/// Error codes that say Redis itself cannot serve now (as opposed to a script's mistake).
const SERVER_STATE: [&str; 9] = [
    "OOM",
    "READONLY",
    "BUSY",
    "LOADING",
    "CLUSTERDOWN",
    "MASTERDOWN",
    "TRYAGAIN",
    "NOREPLICAS",
    "MISCONF",
];

#[derive(Clone)]
enum Conn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

// One per proxy: the size difference costs nothing.
#[allow(clippy::large_enum_variant)]
enum Client {
    Single(redis::Client),
    Cluster(redis::cluster::ClusterClient),
}

/// The scripts, one per algorithm family (token bucket and GCRA share one).
struct Scripts {
    fixed_window: Script,
    sliding_window_log: Script,
    sliding_window_counter: Script,
    gcra: Script,
    /// A response's units charged after it to a `gcra` key.
    owe: Script,
    /// What each of the four would answer, read only (`explain`).
    peek_fixed_window: Script,
    peek_sliding_window_log: Script,
    peek_sliding_window_counter: Script,
    peek_gcra: Script,
}

/// A script: the shebang first (Redis 7: a script with one is refused whole, `OOM`, while
/// Redis is past `maxmemory`, whatever its first command; without one, a script whose first
/// write is not a deny-OOM command wrote past the limit), then the prelude and `body`.
fn script(body: &str) -> Script {
    Script::new(&format!(
        "#!lua\n{}\n{body}",
        include_str!("lua/prelude.lua")
    ))
}

/// A script that Redis refuses to let write (Redis 7's `no-writes` flag): it runs on a
/// replica, under a read-only user, and past `maxmemory`.
fn read_only(body: &str) -> Script {
    Script::new(&format!(
        "#!lua flags=no-writes\n{}\n{body}",
        include_str!("lua/prelude.lua")
    ))
}

impl Scripts {
    fn new() -> Self {
        Scripts {
            fixed_window: script(include_str!("lua/fixed_window.lua")),
            sliding_window_log: script(include_str!("lua/sliding_window_log.lua")),
            sliding_window_counter: script(include_str!("lua/sliding_window_counter.lua")),
            gcra: script(include_str!("lua/gcra.lua")),
            owe: script(include_str!("lua/owe.lua")),
            peek_fixed_window: read_only(include_str!("lua/peek_fixed_window.lua")),
            peek_sliding_window_log: read_only(include_str!("lua/peek_sliding_window_log.lua")),
            peek_sliding_window_counter: read_only(include_str!(
                "lua/peek_sliding_window_counter.lua"
            )),
            peek_gcra: read_only(include_str!("lua/peek_gcra.lua")),
        }
    }

    fn all(&self) -> [&Script; 5] {
        [
            &self.fixed_window,
            &self.sliding_window_log,
            &self.sliding_window_counter,
            &self.gcra,
            &self.owe,
        ]
    }
}

/// The Redis side of a proxy: shared by every worker and kept across reloads.
pub struct Exact {
    service: String,
    /// The service's key secret: Redis key names hold the keyed digest of a client's key.
    secret: crate::digest::Secret,
    client: Client,
    conn: ArcSwapOption<Conn>,
    /// True while a connector task runs, so that failures start at most one.
    connecting: AtomicBool,
    scripts: Scripts,
    timeout: Duration,
    on_error: OnError,
    cache_refusals: bool,
    breaker: Breaker,
    metrics: RedisMetrics,
    clock: AnyClock,
}

impl Exact {
    /// Checks `config` and prepares the client; nothing is connected until [`start`](Self::start).
    pub fn new(
        config: &RedisConfig,
        service: &str,
        secret: &crate::digest::Secret,
        metrics: RedisMetrics,
        clock: AnyClock,
    ) -> Result<Arc<Exact>, String> {
        // rediss:// needs a crypto provider; ring is the one built in. Installing twice (a second
        // proxy in one process) is refused harmlessly.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let certs = match &config.ca_file {
            Some(path) => Some(redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(
                    std::fs::read(path)
                        .map_err(|e| format!("redis.ca_file {}: {e}", path.display()))?,
                ),
            }),
            None => None,
        };
        let client = if config.url.is_cluster() {
            let mut builder = redis::cluster::ClusterClient::builder(config.url.0.clone())
                .connection_timeout(CONNECT_TIMEOUT)
                .response_timeout(config.timeout.0.max(Duration::from_millis(1)) * 4);
            if let Some(certs) = certs {
                builder = builder.certs(certs);
            }
            builder.build().map(Client::Cluster)
        } else {
            let url = config.url.0[0].as_str();
            match certs {
                Some(certs) => redis::Client::build_with_tls(url, certs),
                None => redis::Client::open(url),
            }
            .map(Client::Single)
        }
        .map_err(|e| format!("redis.url: {e}"))?;
        metrics.breaker_state.set(0);
        Ok(Arc::new(Exact {
            service: service.to_string(),
            secret: secret.clone(),
            client,
            conn: ArcSwapOption::empty(),
            connecting: AtomicBool::new(false),
            scripts: Scripts::new(),
            timeout: config.timeout.0,
            on_error: config.on_error,
            cache_refusals: config.cache_refusals,
            breaker: Breaker {
                failures: AtomicU32::new(0),
                open_until: AtomicU64::new(0),
                probing: AtomicBool::new(false),
                threshold: config.breaker.failures.get(),
                cooldown: config.breaker.cooldown.0.as_nanos() as Nanos,
            },
            metrics,
            clock,
        }))
    }

    /// Connects (waiting at most a second, so the first requests find Redis ready); if that
    /// fails, keeps trying in the background on the current runtime, and decisions meanwhile
    /// are failures answered by `on_error`.
    pub async fn start(self: &Arc<Self>) {
        match tokio::time::timeout(CONNECT_TIMEOUT, self.connect()).await {
            Ok(Ok(conn)) => self.connected(conn),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "cannot connect to redis; on_error applies until it answers");
                self.reconnect();
            }
            Err(_) => {
                tracing::warn!("redis did not answer within 1s; on_error applies until it does");
                self.reconnect();
            }
        }
    }

    fn connected(&self, conn: Conn) {
        self.conn.store(Some(Arc::new(conn)));
        self.metrics.connected.set(1);
        tracing::info!("connected to redis; scripts loaded");
    }

    pub fn metrics(&self) -> &RedisMetrics {
        &self.metrics
    }

    /// Whether refusals are remembered until their retry time (`redis.cache_refusals`).
    pub fn cache_refusals(&self) -> bool {
        self.cache_refusals
    }

    pub fn on_error(&self) -> OnError {
        self.on_error
    }

    /// The retry hint of a refusal made without Redis (`on_error: deny`): the breaker's
    /// cool-down, the soonest Redis will be asked again.
    pub fn retry_hint(&self) -> Nanos {
        self.breaker.cooldown.max(1)
    }

    /// True once a connection is up (for tests and readiness).
    pub fn is_connected(&self) -> bool {
        self.conn.load().is_some()
    }

    /// Asks Redis to decide `cost` units for `key` of `rule` under `algorithm` and `quota`.
    pub async fn decide(
        self: &Arc<Self>,
        rule: &str,
        key: &[u8],
        algorithm: Algorithm,
        quota: &Quota,
        cost: u32,
    ) -> Result<Answer, Failure> {
        let (script, args) = self.invocation(algorithm, quota, cost);
        let v = self.run(rule, key, script, &args).await?;
        Ok(parse_answer(&v).expect("run checked the answer's shape"))
    }

    /// What [`Self::decide`] would answer now, by a script that cannot write (`explain`).
    pub async fn peek(
        self: &Arc<Self>,
        rule: &str,
        key: &[u8],
        algorithm: Algorithm,
        quota: &Quota,
        cost: u32,
    ) -> Result<Answer, Failure> {
        let (script, args) = self.invocation(algorithm, quota, cost);
        let s = &self.scripts;
        let peek = if std::ptr::eq(script, &s.fixed_window) {
            &s.peek_fixed_window
        } else if std::ptr::eq(script, &s.sliding_window_log) {
            &s.peek_sliding_window_log
        } else if std::ptr::eq(script, &s.sliding_window_counter) {
            &s.peek_sliding_window_counter
        } else {
            &s.peek_gcra
        };
        self.read(rule, key, peek, &args).await
    }

    /// Runs a read-only `script` for `explain` apart from the decisions: nothing while the
    /// breaker is not closed (its probe is a decision's), and neither its failures nor its
    /// time are counted (an operator's question must not open the breaker or move the
    /// latency the alerts read).
    async fn read(
        self: &Arc<Self>,
        rule: &str,
        key: &[u8],
        script: &Script,
        args: &[String],
    ) -> Result<Answer, Failure> {
        if self.breaker.open_until.load(Ordering::Relaxed) != 0 {
            return Err(Failure::BreakerOpen);
        }
        let conn = self.conn.load_full().ok_or(Failure::NotConnected)?;
        let mut call = script.key(redis_key(&self.secret, &self.service, rule, key));
        for a in args {
            call.arg(a.as_str());
        }
        let mut conn = (*conn).clone();
        let answer = tokio::time::timeout(self.timeout, async {
            match &mut conn {
                Conn::Single(c) => call.invoke_async::<Vec<i64>>(c).await,
                Conn::Cluster(c) => call.invoke_async::<Vec<i64>>(c).await,
            }
        })
        .await;
        match answer {
            Ok(Ok(v)) => parse_answer(&v).ok_or(Failure::Script),
            Ok(Err(_)) => Err(Failure::Connection),
            Err(_) => Err(Failure::Timeout),
        }
    }

    /// Charges `units` (given back when negative) to `key` of `rule`'s bucket (`gcra` or
    /// `token_bucket`) after the response that said them, under the breaker's rules as any
    /// decision: nothing is sent while it is open.
    pub async fn owe(
        self: &Arc<Self>,
        rule: &str,
        key: &[u8],
        quota: &Quota,
        units: i64,
    ) -> Result<(), Failure> {
        let args = [
            "0".to_string(),
            units.to_string(),
            format!("{:.3}", quota.emission() as f64 / 1000.0),
            format!("{:.3}", quota.refill_time() as f64 / 1000.0),
        ];
        self.run(rule, key, &self.scripts.owe, &args)
            .await
            .map(drop)
    }

    /// Runs `script` on `key` of `rule` with `args`: its answer (four integers, as every
    /// script answers), under the breaker and the timeout, failures counted.
    async fn run(
        self: &Arc<Self>,
        rule: &str,
        key: &[u8],
        script: &Script,
        args: &[String],
    ) -> Result<Vec<i64>, Failure> {
        let now = self.clock.now();
        let probe = match self.breaker.admit(now) {
            Admit::Call => false,
            Admit::Probe => {
                self.metrics.breaker_state.set(2);
                true
            }
            Admit::Skip => return Err(Failure::BreakerOpen),
        };
        let Some(conn) = self.conn.load_full() else {
            self.reconnect();
            self.failed(Failure::NotConnected, probe);
            return Err(Failure::NotConnected);
        };
        let redis_key = redis_key(&self.secret, &self.service, rule, key);
        let mut call = script.key(redis_key);
        for a in args {
            call.arg(a.as_str());
        }
        let start = tokio::time::Instant::now();
        let mut conn_now = (*conn).clone();
        let result = tokio::time::timeout(self.timeout, async {
            match &mut conn_now {
                Conn::Single(c) => call.invoke_async::<Vec<i64>>(c).await,
                Conn::Cluster(c) => call.invoke_async::<Vec<i64>>(c).await,
            }
        })
        .await;
        self.metrics.duration.observe(start.elapsed().as_secs_f64());
        match result {
            Ok(Ok(v)) => match parse_answer(&v) {
                Some(_) => {
                    self.succeeded();
                    Ok(v)
                }
                None => {
                    self.failed(Failure::Script, probe);
                    Err(Failure::Script)
                }
            },
            Ok(Err(e)) => {
                let kind = if e.is_io_error()
                    || e.is_connection_dropped()
                    || e.is_connection_refusal()
                    || e.is_unrecoverable_error()
                {
                    // The connection is gone: forget it and make another in the background.
                    self.drop_connection(&conn, "the connection to redis broke");
                    Failure::Connection
                } else if e.is_timeout() {
                    Failure::Timeout
                } else if e.code().is_some_and(|c| SERVER_STATE.contains(&c)) {
                    tracing::debug!(error = %e, "redis cannot serve now");
                    if e.code().is_some_and(|c| NOT_PRIMARY.contains(&c)) {
                        self.drop_connection(&conn, "redis is not the primary now");
                    }
                    Failure::Server
                } else {
                    tracing::warn!(error = %e, "a redis script failed");
                    Failure::Script
                };
                self.failed(kind, probe);
                Err(kind)
            }
            Err(_) => {
                // The probe after a cool-down found no answer either: the server may be gone
                // for good behind its name; a fresh connection looks it up again.
                if probe {
                    self.drop_connection(&conn, "redis did not answer the breaker's probe");
                }
                self.failed(Failure::Timeout, probe);
                Err(Failure::Timeout)
            }
        }
    }

    /// Forgets `conn` (unless another has replaced it already) and makes a new connection in
    /// the background.
    fn drop_connection(self: &Arc<Self>, conn: &Arc<Conn>, why: &str) {
        let current = self.conn.load();
        if current.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn)) {
            tracing::info!("{why}; connecting again");
            self.conn.store(None);
            self.metrics.connected.set(0);
        }
        self.reconnect();
    }

    /// The script and its arguments (after the cost) for `algorithm`.
    fn invocation(&self, algorithm: Algorithm, quota: &Quota, cost: u32) -> (&Script, Vec<String>) {
        let window_us = quota.window().div_ceil(1000).max(1);
        let limit = quota.burst();
        match algorithm {
            Algorithm::FixedWindow => (
                &self.scripts.fixed_window,
                vec![cost.to_string(), limit.to_string(), window_us.to_string()],
            ),
            Algorithm::SlidingWindowLog => (
                &self.scripts.sliding_window_log,
                vec![cost.to_string(), limit.to_string(), window_us.to_string()],
            ),
            Algorithm::SlidingWindowCounter => (
                &self.scripts.sliding_window_counter,
                vec![cost.to_string(), limit.to_string(), window_us.to_string()],
            ),
            // Refused by the config for redis rules; the same bucket without the shaping wait.
            Algorithm::TokenBucket | Algorithm::Gcra | Algorithm::LeakyBucket => (
                &self.scripts.gcra,
                vec![
                    cost.to_string(),
                    format!("{:.3}", quota.emission() as f64 / 1000.0),
                    format!("{:.3}", quota.refill_time() as f64 / 1000.0),
                    limit.to_string(),
                ],
            ),
        }
    }

    fn succeeded(&self) {
        if self.breaker.success() {
            tracing::info!("redis answers again; circuit breaker closed");
        }
        self.metrics.breaker_state.set(0);
    }

    fn failed(&self, kind: Failure, probe: bool) {
        let label = match kind {
            Failure::BreakerOpen => return,
            Failure::NotConnected | Failure::Connection => RedisError::Connection,
            Failure::Timeout => RedisError::Timeout,
            Failure::Server => RedisError::Server,
            Failure::Script => {
                // Redis answered: it is up, whatever the script did.
                self.metrics.error(RedisError::Script).inc();
                self.succeeded();
                return;
            }
        };
        self.metrics.error(label).inc();
        if self.breaker.failure(self.clock.now(), probe) {
            self.metrics.breaker_opened.inc();
            self.metrics.breaker_state.set(1);
            tracing::warn!(
                failures = self.breaker.threshold,
                cooldown_ms = self.breaker.cooldown / 1_000_000,
                "redis keeps failing; circuit breaker open, on_error applies without asking it"
            );
        } else if probe {
            self.metrics.breaker_state.set(1);
        }
    }

    /// Starts the connector unless one runs. It tries until a connection is up, backing off,
    /// and stops by itself when the proxy has dropped this `Exact`.
    fn reconnect(self: &Arc<Self>) {
        if self.connecting.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            self.connecting.store(false, Ordering::Release);
            return;
        };
        rt.spawn(connector(Arc::downgrade(self)));
    }

    async fn connect(&self) -> redis::RedisResult<Conn> {
        let mut conn = match &self.client {
            Client::Single(c) => Conn::Single(
                c.get_multiplexed_async_connection_with_config(
                    &redis::AsyncConnectionConfig::new()
                        .set_connection_timeout(Some(CONNECT_TIMEOUT)),
                )
                .await?,
            ),
            Client::Cluster(c) => Conn::Cluster(c.get_async_connection().await?),
        };
        // A server that is a replica now (a failover the name has not caught up with) is no
        // connection: the connector tries again until the name leads to the primary.
        if let Conn::Single(c) = &mut conn {
            // The scripts' shebang needs Redis 7: say so rather than fail to load them forever.
            // A user without INFO or ROLE (a managed Redis, a narrow ACL) skips the check.
            let info: Option<String> = checked(
                redis::cmd("INFO").arg("server").query_async(c).await,
                "INFO",
            )?;
            let major = info
                .as_deref()
                .unwrap_or("")
                .lines()
                .find_map(|l| l.strip_prefix("redis_version:"))
                .and_then(|v| v.split('.').next()?.trim().parse::<u32>().ok());
            if major.is_some_and(|m| m < 7) {
                tracing::error!(
                    "redis {} is too old: Spillway's scripts need Redis 7.0 or later",
                    major.unwrap_or(0)
                );
                return Err(redis::RedisError::from((
                    redis::ErrorKind::Client,
                    "the server is older than Redis 7.0",
                )));
            }
            let role: Option<Vec<redis::Value>> =
                checked(redis::cmd("ROLE").query_async(c).await, "ROLE")?;
            if let Some(redis::Value::BulkString(r)) = role.as_deref().and_then(|r| r.first()) {
                if r.as_slice() != b"master" {
                    tracing::warn!("the redis server behind redis.url is a replica now; connecting again until it leads to the primary");
                    return Err(redis::RedisError::from((
                        redis::ErrorKind::Client,
                        "the server is a replica",
                    )));
                }
            }
        }
        // Load every script now, so the first decisions are one EVALSHA each.
        for s in self.scripts.all() {
            let load = s.prepare_invoke();
            let _: String = match &mut conn {
                Conn::Single(c) => load.load_async(c).await?,
                Conn::Cluster(c) => load.load_async(c).await?,
            };
        }
        Ok(conn)
    }
}

/// A check's answer, or `None` when the server refused the command itself (no permission, an
/// unknown command): the check is skipped, with a warning. A broken connection is an error.
fn checked<T>(answer: redis::RedisResult<T>, what: &str) -> redis::RedisResult<Option<T>> {
    match answer {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.is_io_error() || e.is_connection_dropped() || e.is_timeout() => Err(e),
        Err(e) => {
            tracing::warn!(error = %e, "redis refuses {what}: its check is skipped (docs/redis.md: the user needs +info +role)");
            Ok(None)
        }
    }
}

async fn connector(exact: Weak<Exact>) {
    let mut backoff = RECONNECT_BACKOFF.0;
    loop {
        let Some(e) = exact.upgrade() else { return };
        match tokio::time::timeout(CONNECT_TIMEOUT, e.connect()).await {
            Ok(Ok(conn)) => {
                e.connected(conn);
                e.connecting.store(false, Ordering::Release);
                return;
            }
            Ok(Err(err)) => tracing::debug!(error = %err, "cannot connect to redis yet"),
            Err(_) => tracing::debug!("connecting to redis timed out"),
        }
        drop(e);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(RECONNECT_BACKOFF.1);
    }
}

/// `{service:rule:~<digest>}`: the braces make the whole name the hash tag, so every key a
/// script derives from it (`:log`, `:fw:<window>`...) lives on the same cluster node. The
/// client's part is the keyed digest of its key under the service's `key_secret_file`
/// ([`crate::digest`]): every Redis key has one size whatever the client sent, no `{` or `}`
/// of a client's can move the tag (service and rule names hold neither), and another service
/// sharing the Redis cannot compute which name a client's key has.
pub fn redis_key(secret: &crate::digest::Secret, service: &str, rule: &str, key: &[u8]) -> Vec<u8> {
    let mut out = crate::key::KeyBuf::new();
    out.push(b'{');
    out.extend_from_slice(service.as_bytes());
    out.push(b':');
    out.extend_from_slice(rule.as_bytes());
    out.push(b':');
    secret.push(key, &mut out);
    out.push(b'}');
    out.to_vec()
}

fn parse_answer(v: &[i64]) -> Option<Answer> {
    let [admitted, remaining, retry_us, reset_us] = *v else {
        return None;
    };
    let ns = |us: i64| (us.max(0) as u64).saturating_mul(1000);
    Some(Answer {
        admitted: admitted == 1,
        remaining: remaining.clamp(0, i64::from(u32::MAX)) as u32,
        retry_after: (retry_us >= 0).then(|| ns(retry_us)),
        reset_after: ns(reset_us),
    })
}

/// What the breaker lets a decision do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Admit {
    Call,
    /// The cool-down is over and this decision is the one probe.
    Probe,
    Skip,
}

/// Closed → (threshold consecutive failures) → open for `cooldown` → one probe: success closes,
/// failure opens again. Lock-free: three atomics, read on every decision.
struct Breaker {
    // Relaxed throughout: the breaker is advisory, a race costs one extra call or skip.
    failures: AtomicU32,
    /// 0 while closed; else the clock time the cool-down ends.
    open_until: AtomicU64,
    probing: AtomicBool,
    threshold: u32,
    cooldown: Nanos,
}

impl Breaker {
    fn admit(&self, now: Nanos) -> Admit {
        let until = self.open_until.load(Ordering::Relaxed);
        if until == 0 {
            Admit::Call
        } else if now < until {
            Admit::Skip
        } else if self
            .probing
            .compare_exchange(false, true, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            Admit::Probe
        } else {
            Admit::Skip
        }
    }

    /// Returns true when this success closed an open breaker.
    fn success(&self) -> bool {
        self.failures.store(0, Ordering::Relaxed);
        self.probing.store(false, Ordering::Relaxed);
        self.open_until.swap(0, Ordering::Relaxed) != 0
    }

    /// Returns true when this failure opened the breaker.
    fn failure(&self, now: Nanos, probe: bool) -> bool {
        if probe {
            self.open_until
                .store((now + self.cooldown).max(1), Ordering::Relaxed);
            self.probing.store(false, Ordering::Relaxed);
            return false;
        }
        let n = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if n >= self.threshold && self.open_until.load(Ordering::Relaxed) == 0 {
            self.open_until
                .store((now + self.cooldown).max(1), Ordering::Relaxed);
            return true;
        }
        false
    }
}
