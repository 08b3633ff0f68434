//! A zone aggregator replica: adds up the counts its hosts reported since its last forward,
//! hands them to each controller every interval as this replica's (`zone:<zone>/<replica>`),
//! and answers hosts with an authoritative controller's last ratios for their own services
//! (never a warming one's to a host that cannot tell). A report whose rate stepped is
//! forwarded early (the last window's rates again, with the step) and answered with the reply
//! to that forward, so that a proxy's surge hold ends on sums that hold it (at most three
//! forwards per interval, whatever hosts send).
//!
//! Any number of replicas may serve a zone behind one Service, a host's reports landing on any
//! of them: a replica keeps no rate of a host past its next forward, so each host interval is
//! counted once, and the controller smooths after summing (see [`super::sum`]). Soft state
//! only: a replica can restart at any time. Replies say how old the relayed ratios are, so a
//! dead controller makes the proxies stale (and fail open) even while the replica answers.
//! The sums' mutex is taken once per report and once per forward, never across an await; a
//! forward, a large report, and any report that finds it held work off the runtime's workers.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use http::{Method, Request, StatusCode, Uri};
use hyper::body::Incoming;
use prometheus::{Histogram, HistogramOpts, IntCounterVec, IntGauge, Opts, Registry};
use tokio::sync::watch;

use super::auth::Credentials;
use super::client::{json_client, JsonClient, Targets};
use super::server::{self, Body, Running};
use super::zone::Step;
use super::{Entry, Reply, Report, Shared, SourceRefusal, ZoneSums, VERSION};

/// How to run an aggregator.
#[derive(Clone)]
pub struct AggregatorOptions {
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    /// The controllers' base URLs, `http://host:port` or `https://host:port`: every forward
    /// goes to each (they serve at once), and hosts get the first authoritative one's ratios.
    pub controllers: Vec<Uri>,
    pub zone: String,
    /// This replica's name in its zone (unique among the zone's replicas; default: the host
    /// name and a random suffix, so that a restart is a new replica).
    pub replica: Option<String>,
    /// How often the zone's sums are forwarded.
    pub interval: Duration,
    /// Who may report; the aggregators' (or shared) token is presented to the controller.
    pub credentials: Credentials,
    /// Serve HTTPS with this certificate.
    pub tls: Option<super::tls::ServerTls>,
    /// Trust these CA certificates for an `https://` controller (default: the system's).
    pub ca_file: Option<std::path::PathBuf>,
    /// Serve a non-loopback address without a token anyway.
    pub insecure: bool,
    /// The most entries its hosts' reports may hold at once (a key past 64 bytes counts as
    /// several), half of them for one service's hosts: what bounds its memory
    /// ([`DEFAULT_MAX_ENTRIES`]).
    pub max_entries: usize,
}

/// A host's report interval may be at most this many of the aggregator's forward intervals
/// (and 60 s whatever they are): a host is remembered for three of its intervals and its
/// values held for one, and a tenant's must not be held for tens of minutes.
pub const INTERVALS_HELD: u32 = 60;

/// The longest report interval an aggregator forwarding every `interval` takes.
pub fn longest_report_interval(interval: Duration) -> Duration {
    (interval * INTERVALS_HELD).max(Duration::from_secs(60))
}

/// Entries an aggregator holds by default: with its bodies' budget, within 256 MiB.
pub const DEFAULT_MAX_ENTRIES: usize = 150_000;

impl AggregatorOptions {
    /// Loopback-style defaults: no token, no TLS, 1 s interval.
    pub fn new(listen: SocketAddr, admin: SocketAddr, controller: Uri, zone: &str) -> Self {
        AggregatorOptions {
            listen,
            admin,
            controllers: vec![controller],
            zone: zone.to_string(),
            replica: None,
            interval: Duration::from_secs(1),
            credentials: Credentials::open(),
            tls: None,
            ca_file: None,
            insecure: false,
            max_entries: DEFAULT_MAX_ENTRIES,
        }
    }
}

/// How old relayed ratios are, `elapsed` since the forward behind them left: in whole
/// milliseconds rounded up, never 0, which says the sums hold the report a reply answers (a
/// proxy pairs its own rates by it, and the forward left before this report came).
fn relay_age_ms(elapsed: std::time::Duration) -> u64 {
    u64::try_from(elapsed.as_micros())
        .unwrap_or(u64::MAX)
        .div_ceil(1000)
        .max(1)
}

/// The controller's last reply, by service, and when it came.
struct Relayed {
    by_service: std::collections::HashMap<String, (Vec<super::Ratio>, Vec<super::RuleHint>)>,
    at: tokio::time::Instant,
    /// The controller said it is warming up: its ratios are relayed as not authoritative.
    warming: bool,
    /// The zone sums' take (see [`ZoneSums::takes`]) the forward behind them sent.
    take: u64,
}

impl Relayed {
    fn new(reply: Reply, at: tokio::time::Instant, take: u64) -> Self {
        let warming = reply.warming;
        let mut by_service: std::collections::HashMap<String, (Vec<_>, Vec<_>)> =
            Default::default();
        for r in reply.ratios {
            by_service.entry(r.service.clone()).or_default().0.push(r);
        }
        for h in reply.rules {
            by_service.entry(h.service.clone()).or_default().1.push(h);
        }
        Relayed {
            by_service,
            at,
            warming,
            take,
        }
    }
}

struct State {
    sums: Shared<ZoneSums>,
    /// None until the controller first answers.
    relayed: ArcSwap<Option<Relayed>>,
    /// How many parts the last forward had.
    parts: std::sync::atomic::AtomicUsize,
    /// Forwards in a row that needed fewer parts than that (see [`parts_now`]).
    fewer: std::sync::atomic::AtomicUsize,
    opts: AggregatorOptions,
    /// `zone:<zone>/<replica>`.
    source: String,
    /// Increases with every forward (starting from the wall clock, so across restarts too).
    seq: std::sync::atomic::AtomicU64,
    /// Each controller's `/v1/report`.
    targets: Targets,
    client: JsonClient,
    registry: Registry,
    reports: IntCounterVec,
    /// The minute (plus one) of the last warning about a host of another zone.
    warned: std::sync::atomic::AtomicU64,
    hosts: IntGauge,
    forwards: IntCounterVec,
    forward_seconds: Histogram,
    /// A report with a step came: forward early (see [`State::forward_loop`]).
    early: tokio::sync::Notify,
    /// A report with a step was recorded since the sums' steps were last taken.
    steps_waiting: std::sync::atomic::AtomicBool,
    /// The take of the last forward that is over (answered or failed).
    forwarded: watch::Sender<u64>,
}

/// An early forward with a window of its own (a stepped key the last window did not name)
/// comes at least this share of the interval (and [`EARLY_LEAST`]) after the last windowed
/// forward: the controller holds a forward's rates for two of its windows, so a window of
/// half an interval stands until the next tick's forward.
const EARLY_GAP: u32 = 2;
const EARLY_LEAST: Duration = Duration::from_millis(100);
/// Early forwards between two of the interval's, at most: forwards come at most three times
/// as often as the interval says, however often hosts step (steps that come meanwhile wait
/// for the next forward, and their hosts' replies for half their interval at most).
const EARLY_MOST: u32 = 2;
/// How long an early forward waits for more steps: hosts whose reports come together (the
/// two halves of load moving between them) are answered by one forward that holds both.
const EARLY_GATHER: Duration = Duration::from_millis(20);

impl State {
    async fn report(&self, req: Request<Incoming>) -> http::Response<Body> {
        // A wait below counts from here: time spent reading and recording the report (a
        // busy replica) comes out of it, not on top of it.
        let arrived = tokio::time::Instant::now();
        let wire2 = server::speaks_wire2(&req);
        let (report, principal, turn) =
            match server::receive_report(req, &self.opts.credentials, &self.reports).await {
                Ok(r) => r,
                Err(resp) => return resp,
            };
        if report.source.starts_with("zone:") {
            return server::error(
                StatusCode::BAD_REQUEST,
                "an aggregator takes host reports; zone sums go to the controller",
            );
        }
        let most = longest_report_interval(self.opts.interval);
        if report.interval_ms > most.as_millis() as u64 {
            self.reports.with_label_values(&["invalid"]).inc();
            let msg = format!(
                "interval_ms {} is longer than this aggregator takes ({} ms: {INTERVALS_HELD} of its forward intervals, at least 60 s); report more often",
                report.interval_ms,
                most.as_millis()
            );
            return server::error(StatusCode::BAD_REQUEST, &msg);
        }
        let owner = principal.owner(&report).to_string();
        let services: Vec<String> = server::reply_services(&report, &principal)
            .unwrap_or_default()
            .into_iter()
            .map(str::to_string)
            .collect();
        let (source, zone) = (report.source.clone(), report.zone.clone());
        // A host whose offered rate stepped (a surge, or load moving between proxies) holds
        // its new rate to what it had until a reply's sums hold this report: it waits for an
        // early forward's reply rather than one a whole interval later. Within half the host's
        // interval from its arrival, so that its report does not time out, and one of this
        // replica's (the early forward comes within half of one, and its reply soon after).
        let stepped = report.entries.iter().any(|e| e.jump != 0.0);
        let wait = Duration::from_millis(report.interval_ms / 2).min(self.opts.interval);
        let light = report.entries.len() <= super::HEAVY_ENTRIES;
        // The time read under the lock: a take that ran while this waited is before it.
        let (recorded, takes) = self.sums.with(light, |sums| {
            let recorded = sums.record(report, &owner, self.sums.now());
            (recorded, sums.takes())
        });
        // Recorded: what the report parsed into is gone, and its body's room with it.
        drop(turn);
        if stepped && recorded.is_ok() {
            let mut forwarded = self.forwarded.subscribe();
            self.steps_waiting
                .store(true, std::sync::atomic::Ordering::Release);
            self.early.notify_one();
            let until = arrived + wait;
            let _ = tokio::time::timeout_at(until, forwarded.wait_for(|&take| take > takes)).await;
        }
        match recorded {
            Ok(()) if !zone.is_empty() && zone != self.opts.zone => {
                self.reports.with_label_values(&["other_zone"]).inc();
                // At most once a minute: every report of that host would say the same.
                let minute = (self.sums.now() / 60.0) as u64 + 1;
                if self
                    .warned
                    .swap(minute, std::sync::atomic::Ordering::Relaxed)
                    != minute
                {
                    tracing::warn!(
                        // Debug-quoted: a name is the sender's, and must not forge log lines.
                        source = ?source,
                        zone = ?zone,
                        "a host of another zone reports here (counted): its control_plane.url names this zone's aggregators ({})",
                        self.opts.zone
                    );
                }
            }
            Ok(()) => self.reports.with_label_values(&["ok"]).inc(),
            Err(SourceRefusal::Duplicate(_)) => {
                self.reports.with_label_values(&["duplicate"]).inc()
            }
            Err(refusal) => return server::source_refused(&refusal, &self.reports),
        }
        let relayed = self.relayed.load();
        // Counted, but nothing to answer with yet: the proxy keeps the ratios it has (a new
        // replica must not hand out an empty set as if it were fresh).
        let Some(relayed) = relayed.as_ref() else {
            let mut resp = server::error(
                StatusCode::SERVICE_UNAVAILABLE,
                "no ratios from the controller yet",
            );
            resp.headers_mut().insert(
                http::header::RETRY_AFTER,
                http::HeaderValue::from_static("1"),
            );
            return resp;
        };
        if relayed.warming && !wire2 {
            // As the controller does (see `server::warming_refused`).
            return server::warming_refused();
        }
        // Age 0 says the sums behind the ratios hold this report (so a proxy pairs them with
        // its rate as of this report: see `DropRatios::own_lag`).
        let age_ms = if relayed.take > takes {
            0
        } else {
            relay_age_ms(relayed.at.elapsed())
        };
        let mut reply = Reply {
            version: VERSION,
            age_ms,
            ratios: Vec::new(),
            rules: Vec::new(),
            warming: false,
        };
        for (ratios, hints) in services.iter().filter_map(|s| relayed.by_service.get(s)) {
            reply.ratios.extend(ratios.iter().cloned());
            reply.rules.extend(hints.iter().cloned());
        }
        server::warming(server::reply(reply, wire2), relayed.warming)
    }

    /// Forwards the zone's sums and keeps the controller's reply, every interval; early when a
    /// host's report steps (see [`Self::forward_steps`]; at most [`EARLY_MOST`] between two of
    /// the interval's); once more, marked last, when stopping.
    async fn forward_loop(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let mut tick = tokio::time::interval(self.opts.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let gap = (self.opts.interval / EARLY_GAP).max(EARLY_LEAST);
        let mut last_window = tokio::time::Instant::now();
        let mut early = 0;
        let mut sent = Sent::default();
        loop {
            let mut ticked = false;
            let stopping = tokio::select! {
                _ = tick.tick() => {
                    ticked = true;
                    false
                }
                _ = stop.changed() => true,
                _ = self.early.notified(), if early < EARLY_MOST => {
                    // Taken by a forward since (the wake-up was for steps already sent).
                    if !self.steps_waiting.load(std::sync::atomic::Ordering::Acquire) {
                        continue;
                    }
                    // Counted whatever it finds: each looks over the zone's sums.
                    early += 1;
                    // Steps that come together (two hosts' halves of a move) go in one.
                    let stopping = tokio::select! {
                        _ = tokio::time::sleep(EARLY_GATHER) => false,
                        _ = stop.changed() => true,
                    };
                    if !stopping {
                        match self.forward_steps(&sent).await {
                            Steps::None | Steps::Sent => continue,
                            Steps::Unknown => {}
                        }
                    }
                    // A key the last window did not name stepped: a window of its own, long
                    // enough that the controller holds its rates until the next tick's.
                    let stopping = stopping || tokio::select! {
                        _ = tokio::time::sleep_until(last_window + gap) => false,
                        _ = stop.changed() => true,
                    };
                    tick.reset();
                    stopping
                }
            };
            last_window = tokio::time::Instant::now();
            if ticked {
                early = 0;
            }
            sent = self.forward(stopping).await;
            if stopping {
                return;
            }
        }
    }

    /// An early forward: the last window's parts again, with the hosts' steps since (the
    /// controller replaces a source's rates, so nothing is counted twice, and its hold of
    /// them starts over, so no window is left short). Only the parts that hold a stepped key,
    /// and the first (whose reply carries the ratios); [`Steps::Unknown`] if a stepped key is
    /// in none of them.
    async fn forward_steps(&self, sent: &Sent) -> Steps {
        // Each named key's part and place in it.
        let index: std::collections::HashMap<(&str, &str, &str), (usize, usize)> = sent
            .parts
            .iter()
            .enumerate()
            .flat_map(|(n, part)| {
                part.iter().enumerate().filter_map(move |(i, e)| {
                    Some(((&*e.service, &*e.rule, e.key.as_deref()?), (n, i)))
                })
            })
            .collect();
        self.steps_waiting
            .store(false, std::sync::atomic::Ordering::Release);
        let taken = self.sums.with(false, |sums| {
            sums.take_steps(|s, r, k| index.contains_key(&(s, r, k)))
                .map(|steps| (steps, sums.takes()))
        });
        let Some((steps, take)) = taken else {
            return Steps::Unknown;
        };
        if steps.is_empty() {
            return Steps::None;
        }
        // The parts again, their steps (sent then) taken out and the new ones put in.
        let mut resend: std::collections::BTreeMap<usize, Vec<Entry>> = Default::default();
        let at = |(s, r, k, _): &Step| index.get(&(&**s, &**r, &**k)).copied();
        for n in std::iter::once(0).chain(steps.iter().filter_map(at).map(|(n, _)| n)) {
            if let Some(part) = sent.parts.get(n) {
                resend.entry(n).or_insert_with(|| {
                    part.iter()
                        .map(|e| Entry {
                            jump: 0.0,
                            ..e.clone()
                        })
                        .collect()
                });
            }
        }
        for step in &steps {
            if let Some(e) = at(step).and_then(|(n, i)| resend.get_mut(&n)?.get_mut(i)) {
                e.jump = step.3;
            }
        }
        for (n, entries) in resend.into_iter().rev() {
            self.send_part(n, entries, sent.interval_ms, false, take)
                .await;
        }
        self.forwarded.send_replace(take);
        Steps::Sent
    }

    /// One forward: the sums since the last one, in parts small enough for the controller to
    /// take, each part the source `<replica>` or `<replica>#<n>`. A part the previous forward
    /// had and this one does not is sent empty, so that its values leave the controller now.
    /// Returns what it sent, for early forwards to send again.
    async fn forward(&self, last: bool) -> Sent {
        self.steps_waiting
            .store(false, std::sync::atomic::Ordering::Release);
        let ((entries, interval_ms), hosts, take) = self.sums.with(false, |sums| {
            let taken = sums.take(self.sums.now(), last);
            (taken, sums.hosts(), sums.takes())
        });
        self.hosts.set(hosts as i64);
        // A key keeps its part from one forward to the next, so one part lost in transit loses
        // its own keys and counts no other's twice; the parts shrink back only after
        // [`SHRINK_AFTER`] forwards in a row needed fewer, and the parts dropped then are sent
        // empty, so that their values leave the controller in the same forward.
        use std::sync::atomic::Ordering::Relaxed;
        let before = self.parts.load(Relaxed);
        let heavy = entries.len() > super::HEAVY_ENTRIES;
        let (count, fewer) = parts_now(before, needed_parts(&entries), self.fewer.load(Relaxed));
        self.fewer.store(fewer, Relaxed);
        let split_up = || {
            let mut parts = split(entries, count);
            let made = parts.len();
            parts.resize_with(made.max(before), Vec::new);
            // Kept for early forwards to send again; a forward too large to copy every
            // interval is not (its early forwards take a window of their own).
            let kept = Sent {
                parts: if parts.iter().map(Vec::len).sum::<usize>() <= RESEND_MOST_ENTRIES {
                    parts.clone()
                } else {
                    Vec::new()
                },
                interval_ms,
            };
            (made, parts, kept)
        };
        let (made, mut parts, kept) = if heavy {
            super::off_workers(split_up)
        } else {
            split_up()
        };
        self.parts.store(made, Relaxed);
        let sent = parts.len();
        // The parts dropped (sent empty) go first: a key that moved out of one is never
        // counted in two parts at once.
        for n in (0..sent).rev() {
            self.send_part(n, std::mem::take(&mut parts[n]), interval_ms, last, take)
                .await;
        }
        self.forwarded.send_replace(take);
        kept
    }

    /// Sends part `n` of a forward of `take` to every controller, and keeps the first part's
    /// reply.
    async fn send_part(
        &self,
        n: usize,
        entries: Vec<Entry>,
        interval_ms: u64,
        last: bool,
        take: u64,
    ) {
        let source = match n {
            0 => self.source.clone(),
            n => format!("{}#{n}", self.source),
        };
        let report = Report {
            version: VERSION,
            source,
            zone: self.opts.zone.clone(),
            interval_ms,
            seq: self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            last,
            entries,
            instance: None,
        };
        let started = tokio::time::Instant::now();
        let token = self.opts.credentials.outgoing();
        let answers = self
            .targets
            .post_all(&self.client, token.as_deref(), report, self.opts.interval)
            .await;
        for (url, answer) in self.targets.urls().zip(&answers) {
            match answer {
                Ok(_) => {
                    self.forward_seconds
                        .observe(started.elapsed().as_secs_f64());
                    self.forwards.with_label_values(&["ok"]).inc();
                }
                Err(e) => {
                    self.forwards.with_label_values(&["error"]).inc();
                    tracing::debug!(error = %e, %url, "forward to the controller failed");
                }
            }
        }
        // Only the first part's reply carries the ratios: an authoritative controller's.
        if n == 0 {
            if let Some(Ok((reply, _))) = self.targets.pick(answers) {
                self.relayed
                    .store(Arc::new(Some(Relayed::new(reply, started, take))));
            }
        }
    }
}

/// What the last windowed forward sent, for an early forward to send again with steps.
#[derive(Default)]
struct Sent {
    /// Each part's entries, as sent (none if there were more than [`RESEND_MOST_ENTRIES`]).
    parts: Vec<Vec<Entry>>,
    /// The window they cover.
    interval_ms: u64,
}

/// The most entries a forward may have for early forwards to send it again: it is copied
/// every interval for them.
const RESEND_MOST_ENTRIES: usize = 10_000;

/// What an early forward found to send.
enum Steps {
    /// No step waits: the forward that took them is over.
    None,
    Sent,
    /// A stepped key is not in the last window's parts.
    Unknown,
}

/// The most a part of a forward holds, by its estimated JSON size: well under [`super::MAX_BODY`]
/// and under what the controller holds per source.
const PART_BYTES: usize = 3 << 20;

/// Forwards in a row that must need fewer parts before the parts shrink: a count that wavers
/// around a boundary does not move keys between parts each time.
pub const SHRINK_AFTER: usize = 10;

/// The parts this forward has, and the forwards in a row that needed fewer: never fewer than
/// `before` until [`SHRINK_AFTER`] forwards in a row needed only `needed`.
fn parts_now(before: usize, needed: usize, fewer: usize) -> (usize, usize) {
    if needed >= before {
        return (needed, 0);
    }
    match fewer + 1 {
        n if n >= SHRINK_AFTER => (needed, 0),
        n => (before, n),
    }
}

/// The parts of about [`PART_BYTES`] of JSON at most that `entries` need (at least one).
fn needed_parts(entries: &[Entry]) -> usize {
    let total: usize = entries.iter().map(entry_cost).sum();
    total.div_ceil(PART_BYTES).max(1)
}

/// An entry's estimated size in a report's JSON.
fn entry_cost(e: &Entry) -> usize {
    160 + e.service.len()
        + e.rule.len()
        + e.key.as_ref().map_or(0, String::len)
        + e.sketch.as_ref().map_or(0, String::len)
}

/// `entries` in at least `at_least` (and at least one) parts of about [`PART_BYTES`] of JSON
/// at most, each key in the part its hash picks, so that it stays there while the count does.
fn split(entries: Vec<Entry>, at_least: usize) -> Vec<Vec<Entry>> {
    let n = needed_parts(&entries).max(at_least).max(1);
    let mut parts: Vec<Vec<Entry>> = (0..n).map(|_| Vec::new()).collect();
    for e in entries {
        let mut h = std::hash::DefaultHasher::new();
        std::hash::Hash::hash(&(&e.service, &e.rule, &e.key), &mut h);
        let i = (std::hash::Hasher::finish(&h) % n as u64) as usize;
        parts[i].push(e);
    }
    parts
}

/// Binds the listeners and starts serving and forwarding.
pub async fn start(opts: AggregatorOptions) -> std::io::Result<Running> {
    let insecure = server::check_exposure(
        "aggregator",
        &[opts.listen, opts.admin],
        &opts.credentials,
        opts.insecure,
    )?;
    if !(Duration::from_millis(100)..=Duration::from_secs(600)).contains(&opts.interval) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "--interval: between 100ms and 600s",
        ));
    }
    if let Some(r) = &opts.replica {
        let ok = !r.is_empty()
            && r.len() <= 128
            && r.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        if !ok {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "--replica: 1 to 128 of A-Z a-z 0-9 . _ -",
            ));
        }
    }
    if opts.zone.is_empty() || opts.zone.len() > super::MAX_ZONE {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("--zone: 1 to {} characters", super::MAX_ZONE),
        ));
    }
    let listener = server::bind(opts.listen, "aggregator").await?;
    let admin = server::bind(opts.admin, "admin").await?;
    server::room_for_connections(&listener, "aggregator");
    let (addr, admin_addr) = (listener.local_addr()?, admin.local_addr()?);
    let (targets, tls) = Targets::new(&opts.controllers, opts.ca_file.as_deref()).map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("--controller: {e}"),
        )
    })?;
    let replica = opts.replica.clone().unwrap_or_else(|| {
        let host: String = std::env::var("HOSTNAME")
            .unwrap_or_else(|_| "aggregator".into())
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || "._-".contains(*c))
            .take(100)
            .collect();
        format!("{host}-{:08x}", fastrand::u32(..))
    });
    // ASCII only, at most 64 + 128 bytes and a part number: within MAX_SOURCE.
    let source = format!("zone:{}/{replica}", opts.zone);
    let registry = Registry::new();
    crate::metrics::register_process(&registry);
    let reports = IntCounterVec::new(
        Opts::new(
            "spillway_aggregator_reports_total",
            "Host reports received, by result (ok, other_zone, duplicate, unauthorized, forbidden, foreign, throttled, too_soon, held, malformed, invalid); other_zone counts reports kept from hosts that name another zone; entries_dropped counts invalid entries dropped from reports that were kept.",
        ),
        &["result"],
    )
    .expect("valid metric");
    let hosts =
        IntGauge::new("spillway_aggregator_hosts", "Hosts reporting now.").expect("valid metric");
    let forwards = IntCounterVec::new(
        Opts::new(
            "spillway_aggregator_forwards_total",
            "Zone reports forwarded, to each controller, by result (ok, error).",
        ),
        &["result"],
    )
    .expect("valid metric");
    let forward_seconds = Histogram::with_opts(
        HistogramOpts::new(
            "spillway_aggregator_forward_seconds",
            "Round trip of a forward to the controller.",
        )
        .buckets(crate::metrics::SECONDS_BUCKETS.to_vec()),
    )
    .expect("valid metric");
    registry
        .register(Box::new(reports.clone()))
        .expect("unique");
    registry.register(Box::new(hosts.clone())).expect("unique");
    registry
        .register(Box::new(forwards.clone()))
        .expect("unique");
    registry
        .register(Box::new(forward_seconds.clone()))
        .expect("unique");
    server::insecure_gauge(&registry, "aggregator", insecure);
    let start_seq = super::client::first_seq();
    let state = Arc::new(State {
        sums: Shared::new(ZoneSums::new(0.0, opts.max_entries)),
        source,
        seq: std::sync::atomic::AtomicU64::new(start_seq),
        relayed: ArcSwap::from_pointee(None),
        parts: std::sync::atomic::AtomicUsize::new(0),
        fewer: std::sync::atomic::AtomicUsize::new(0),
        opts,
        targets,
        client: json_client(tls)?,
        registry,
        reports,
        warned: Default::default(),
        hosts,
        forwards,
        forward_seconds,
        early: tokio::sync::Notify::new(),
        steps_waiting: Default::default(),
        forwarded: watch::Sender::new(0),
    });
    let (stop, stopped) = watch::channel(false);
    let tls_server = state.opts.tls.clone();
    let forward = tokio::spawn(state.clone().forward_loop(stopped.clone()));
    let s = state.clone();
    let api = tokio::spawn(server::serve(
        listener,
        stopped.clone(),
        tls_server,
        move |req| {
            let s = s.clone();
            async move {
                match (req.method(), req.uri().path()) {
                    (&Method::POST, "/v1/report") => s.report(req).await,
                    _ => server::error(StatusCode::NOT_FOUND, "not found; try POST /v1/report"),
                }
            }
        },
    ));
    let s = state;
    let admin_task = tokio::spawn(server::serve(admin, stopped, None, move |req| {
        let s = s.clone();
        async move { server::admin_route(req.uri().path(), || server::render(&s.registry)) }
    }));
    Ok(Running::new(
        addr,
        admin_addr,
        stop,
        vec![api, admin_task, forward],
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relayed_ratios_are_never_as_fresh_as_the_report_they_answer() {
        use std::time::Duration;
        // A forward that left a few microseconds before the report came did not hold it.
        assert_eq!(relay_age_ms(Duration::ZERO), 1);
        assert_eq!(relay_age_ms(Duration::from_micros(400)), 1);
        assert_eq!(relay_age_ms(Duration::from_micros(1_001)), 2);
        assert_eq!(relay_age_ms(Duration::from_millis(250)), 250);
        assert_eq!(relay_age_ms(Duration::MAX), u64::MAX.div_ceil(1000));
    }

    #[test]
    fn parts_shrink_back_only_after_forwards_in_a_row_need_fewer() {
        // Growing is at once.
        assert_eq!(parts_now(1, 42, 0), (42, 0));
        // Shrinking waits for SHRINK_AFTER forwards in a row.
        let (mut parts, mut fewer) = (42, 0);
        for _ in 0..SHRINK_AFTER - 1 {
            (parts, fewer) = parts_now(parts, 1, fewer);
            assert_eq!(parts, 42);
        }
        (parts, fewer) = parts_now(parts, 1, fewer);
        assert_eq!((parts, fewer), (1, 0));
        // One forward that needs as many again starts the count over.
        let (mut parts, mut fewer) = (42, 0);
        for i in 0..3 * SHRINK_AFTER {
            let needed = if i % 5 == 4 { 42 } else { 3 };
            (parts, fewer) = parts_now(parts, needed, fewer);
            assert_eq!(parts, 42, "at {i}");
        }
    }

    #[test]
    fn a_large_forward_is_split_into_parts_the_controller_takes() {
        let entry = |i: usize| Entry {
            service: "s".repeat(64),
            rule: "r".repeat(64),
            limit: super::super::Limit {
                count: 1,
                period_ms: 1000,
            },
            key: Some(format!("{i:0>71}")),
            keys_folded: 0,
            offered: 1,
            admitted: 1,
            sketch: None,
            hosts: 0,
            jump: 0.0,
            own: None,
        };
        let entries: Vec<Entry> = (0..60_000).map(entry).collect();
        let parts = split(entries.clone(), 0);
        assert!(parts.len() > 1);
        // The same keys, asked for more parts: each key's part is its hash's.
        let again = split(entries, parts.len());
        assert_eq!(again, parts, "keys keep their parts");
        assert_eq!(parts.iter().map(Vec::len).sum::<usize>(), 60_000);
        for p in &parts {
            let report = Report {
                version: VERSION,
                source: "zone:z/r#1".into(),
                zone: "z".into(),
                interval_ms: 1000,
                seq: 1,
                last: false,
                entries: p.clone(),
                instance: None,
            };
            let bytes = serde_json::to_vec(&report).unwrap().len();
            assert!(bytes < super::super::MAX_BODY / 2, "{bytes}");
        }
        assert_eq!(split(Vec::new(), 0).len(), 1, "one part, sent empty");
        assert_eq!(split(Vec::new(), 3).len(), 3, "no fewer than before");
    }
}
