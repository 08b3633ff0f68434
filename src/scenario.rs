//! `spillway test`: scenario files that prove what a configuration's limits do before it
//! ships. Each scenario's clients send requests at set rates over simulated time, through the
//! real decision code ([`RuleSet::check`]) on a manual clock, to one or more simulated proxies;
//! global rules are answered by the controller's real sums and ratios ([`Accumulator`]) at the
//! control plane's report interval, and `scope: redis` rules by the local algorithm of the
//! same name, one state per key for the whole fleet (Redis's exact count). The scenario then
//! checks what each client was admitted against what it expects.
//!
//! Owns the scenario format, the simulation and its report. Must never: read a clock, open a
//! socket, or pass a scenario whose expectation did not hold. Not simulated (the report says
//! so): how long a response takes but for a client's `hold`, `on_limit: delay` (a wait is
//! counted as a refusal), and a cost that is the response's (its reservation is charged).

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use serde::{Deserialize, Serialize};

use crate::config::{Config, Dur, Rate, Scope};
use crate::control::sum::Accumulator;
use crate::limit::{
    Algorithm, Decision, FixedWindow, Gcra, Limiter, Nanos, Quota, SlidingWindowCounter,
    SlidingWindowLog, TokenBucket, NANOS_PER_SEC,
};
use crate::metrics::Metrics;
use crate::rules::{DropRatios, Question, RemoteStore, RuleSet, StoreAnswer, Verdict};

/// A scenario file: the configuration it tries, and its scenarios.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct File {
    /// The configuration, relative to the scenario file.
    pub config: PathBuf,
    /// Simulated proxies, unless a scenario says (default 1).
    #[serde(default)]
    pub proxies: Option<u32>,
    pub scenarios: Vec<Scenario>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub name: String,
    /// Simulated time the scenario runs for.
    pub duration: Dur,
    /// Simulated proxies: each client's requests go to them in turn.
    #[serde(default)]
    pub proxies: Option<u32>,
    pub clients: Vec<Client>,
    #[serde(default)]
    pub expect: Vec<Expect>,
}

/// One client: who it is, what it sends, and how often.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Client {
    pub name: String,
    /// Its address as the keys resolve it (after the trusted proxies in front).
    #[serde(default)]
    pub ip: Option<IpAddr>,
    #[serde(default = "default_method")]
    pub method: String,
    #[serde(default = "default_path")]
    pub path: String,
    /// Request headers as the rules see them (a load balancer's already set).
    #[serde(default)]
    pub headers: std::collections::BTreeMap<String, String>,
    /// A steady rate from `from` to `until`...
    #[serde(default)]
    pub rate: Option<Rate>,
    /// ...or rates that change: each from its `at` to the next.
    #[serde(default)]
    pub steps: Vec<Step>,
    #[serde(default)]
    pub from: Option<Dur>,
    #[serde(default)]
    pub until: Option<Dur>,
    /// How long each admitted request holds a concurrency slot (default: none).
    #[serde(default)]
    pub hold: Option<Dur>,
}

fn default_method() -> String {
    "GET".into()
}

fn default_path() -> String {
    "/".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Step {
    pub at: Dur,
    /// `0/s` pauses.
    pub rate: StepRate,
}

/// A step's rate: `N/unit`, or `0/s` for none.
#[derive(Debug, Clone, Copy)]
pub struct StepRate(Option<Rate>);

impl<'de> Deserialize<'de> for StepRate {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s.trim().starts_with("0/") {
            return Ok(StepRate(None));
        }
        s.parse()
            .map(|r| StepRate(Some(r)))
            .map_err(serde::de::Error::custom)
    }
}

/// What a client's requests must come to.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    pub client: String,
    /// Requests admitted (in `during`, if given): a number, or `{ min, max }`.
    #[serde(default)]
    pub admitted: Option<Count>,
    /// Requests refused (429 or 503).
    #[serde(default)]
    pub refused: Option<Count>,
    /// The first refusal comes at this time, to within one of the client's request spacings;
    /// `never`: no request is refused.
    #[serde(default)]
    pub first_refused: Option<When>,
    /// The window `admitted` and `refused` count in (default: the whole scenario).
    #[serde(default)]
    pub during: Option<Window>,
    /// The most admitted in any one second (whole seconds of simulated time).
    #[serde(default)]
    pub most_per_second: Option<u64>,
}

#[derive(Debug, Clone, Copy, Deserialize, Serialize)]
#[serde(untagged)]
pub enum Count {
    Exactly(u64),
    Between { min: u64, max: u64 },
}

impl Count {
    fn holds(&self, n: u64) -> bool {
        match *self {
            Count::Exactly(want) => n == want,
            Count::Between { min, max } => (min..=max).contains(&n),
        }
    }
}

impl std::fmt::Display for Count {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Count::Exactly(n) => write!(f, "{n}"),
            Count::Between { min, max } => write!(f, "{min} to {max}"),
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub enum When {
    Never,
    At(Dur),
}

impl<'de> Deserialize<'de> for When {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s == "never" {
            return Ok(When::Never);
        }
        s.parse().map(When::At).map_err(serde::de::Error::custom)
    }
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Window {
    pub from: Dur,
    pub to: Dur,
}

/// What one client saw.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Seen {
    pub sent: u64,
    pub admitted: u64,
    pub refused: u64,
    pub bad_requests: u64,
    /// Seconds into the scenario.
    pub first_refused_s: Option<f64>,
    /// Admitted per whole second.
    #[serde(skip)]
    pub per_second: Vec<u64>,
    /// (time, admitted) of each request, for windows; kept only when an expectation has one.
    #[serde(skip)]
    pub log: Vec<(Nanos, bool)>,
}

/// One scenario's outcome.
#[derive(Debug, Serialize)]
pub struct Outcome {
    pub scenario: String,
    pub passed: bool,
    pub requests: u64,
    pub clients: Vec<(String, Seen)>,
    /// Each expectation that did not hold, said plainly.
    pub failures: Vec<String>,
    /// What the simulation does not model for this configuration.
    pub notes: Vec<String>,
}

/// Reads and runs the scenario file at `path`.
pub fn run_file(path: &Path) -> Result<Vec<Outcome>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let file: File =
        crate::config::parse_yaml(&text, &path.display().to_string()).map_err(|e| e.to_string())?;
    let config_path = path.parent().unwrap_or(Path::new(".")).join(&file.config);
    let config = Config::load(&config_path).map_err(|e| e.to_string())?;
    file.scenarios
        .iter()
        .map(|s| run(&config, s, s.proxies.or(file.proxies).unwrap_or(1)))
        .collect()
}

/// Bounds: a scenario is a test, not a load generator.
const MAX_REQUESTS: u64 = 50_000_000;
const MAX_DURATION: std::time::Duration = std::time::Duration::from_secs(86_400);
const MAX_PROXIES: u32 = 1_000;

/// Runs `s` against `config` on `proxies` simulated proxies.
pub fn run(config: &Config, s: &Scenario, proxies: u32) -> Result<Outcome, String> {
    if proxies == 0 || proxies > MAX_PROXIES {
        return Err(format!(
            "{}: proxies: 1 to {MAX_PROXIES}, not {proxies}",
            s.name
        ));
    }
    if s.duration.0 > MAX_DURATION {
        return Err(format!(
            "{}: duration: at most {MAX_DURATION:?} of simulated time",
            s.name
        ));
    }
    let end = nanos(s.duration);
    // Counted before any is made: a scenario is a test, not a load generator.
    let mut total = 0u64;
    for client in &s.clients {
        let n = times(client, end, |_| {}, true)
            .map_err(|e| format!("{}: client {}: {e}", s.name, client.name))?;
        total = total.saturating_add(n);
    }
    if total > MAX_REQUESTS {
        return Err(format!(
            "{}: {total} requests, more than {MAX_REQUESTS}; shorten it or lower the rates",
            s.name
        ));
    }
    let mut events = Vec::with_capacity(total as usize);
    for (c, client) in s.clients.iter().enumerate() {
        times(client, end, |t| events.push((t, c as u32)), false)
            .map_err(|e| format!("{}: client {}: {e}", s.name, client.name))?;
    }
    for e in &s.expect {
        if !s.clients.iter().any(|c| c.name == e.client) {
            return Err(format!(
                "{}: expect: no client is called {:?}",
                s.name, e.client
            ));
        }
    }
    // Stable: requests at one instant go in the clients' order.
    events.sort_by_key(|&(t, c)| (t, c));
    let mut sim = Fleet::new(config, proxies)?;
    let requests: Vec<Request> = s
        .clients
        .iter()
        .map(|c| Request::of(c, config))
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{}: {e}", s.name))?;
    let windowed = s.expect.iter().any(|e| e.during.is_some());
    let mut seen = vec![Seen::default(); s.clients.len()];
    let mut turn = vec![0u32; s.clients.len()];
    // Concurrency slots held until their client's `hold` is over.
    let mut held: std::collections::BinaryHeap<std::cmp::Reverse<(Nanos, u64)>> =
        Default::default();
    let mut holding: HashMap<u64, crate::rules::Admit> = HashMap::new();
    let mut next_hold = 0u64;
    for (t, c) in events {
        let now = START + t;
        while let Some(std::cmp::Reverse((until, id))) = held.peek().copied() {
            if until > now {
                break;
            }
            held.pop();
            holding.remove(&id);
        }
        sim.advance(now);
        let c = c as usize;
        let proxy = (turn[c] % proxies) as usize;
        turn[c] += 1;
        let answer = sim.decide(proxy, &requests[c], now);
        let seen = &mut seen[c];
        seen.sent += 1;
        let second = (t / NANOS_PER_SEC) as usize;
        if seen.per_second.len() <= second {
            seen.per_second.resize(second + 1, 0);
        }
        let admitted = match answer {
            Answer::Admitted(admit) => {
                seen.admitted += 1;
                seen.per_second[second] += 1;
                if let Some(hold) = s.clients[c].hold {
                    let until = now.saturating_add(nanos(hold).min(end));
                    held.push(std::cmp::Reverse((until, next_hold)));
                    holding.insert(next_hold, admit);
                    next_hold += 1;
                }
                true
            }
            Answer::Refused => {
                seen.refused += 1;
                seen.first_refused_s
                    .get_or_insert(t as f64 / NANOS_PER_SEC as f64);
                false
            }
            Answer::Bad => {
                seen.bad_requests += 1;
                false
            }
        };
        if windowed {
            seen.log.push((t, admitted));
        }
    }
    let mut failures = Vec::new();
    for e in &s.expect {
        let (c, client) = s
            .clients
            .iter()
            .enumerate()
            .find(|(_, c)| c.name == e.client)
            .expect("checked above");
        check(e, client, &seen[c], &mut failures);
    }
    let requests = seen.iter().map(|s| s.sent).sum();
    Ok(Outcome {
        scenario: s.name.clone(),
        passed: failures.is_empty(),
        requests,
        clients: s.clients.iter().map(|c| c.name.clone()).zip(seen).collect(),
        failures,
        notes: sim.notes,
    })
}

/// Where simulated time starts: past zero, as a running proxy's clock is.
const START: Nanos = 1_000 * NANOS_PER_SEC;

fn nanos(d: Dur) -> Nanos {
    Nanos::try_from(d.0.as_nanos()).unwrap_or(Nanos::MAX)
}

/// Each request time of `client` before `end`, evenly spaced at its rate; how many (only
/// counted, none put, when `count_only`).
fn times(
    client: &Client,
    end: Nanos,
    mut put: impl FnMut(Nanos),
    count_only: bool,
) -> Result<u64, String> {
    let from = client.from.map_or(0, nanos);
    let until = client.until.map_or(end, nanos).min(end);
    let mut steps: Vec<(Nanos, Option<Rate>)> = match (&client.rate, client.steps.is_empty()) {
        (Some(r), true) => vec![(from, Some(*r))],
        (None, false) => client
            .steps
            .iter()
            .map(|s| (nanos(s.at).max(from), s.rate.0))
            .collect(),
        (Some(_), false) => return Err("give rate or steps, not both".into()),
        (None, true) => return Err("missing rate (such as 5/s) or steps".into()),
    };
    steps.sort_by_key(|s| s.0);
    let mut n = 0u64;
    for (i, (at, rate)) in steps.iter().enumerate() {
        let stop = steps.get(i + 1).map_or(until, |s| s.0).min(until);
        let Some(rate) = rate else { continue };
        if stop <= *at {
            continue;
        }
        // The i-th request at i x period / count: no drift from a rounded spacing.
        let (period, count) = (rate.period.as_nanos().max(1), u128::from(rate.count.get()));
        let here = (u128::from(stop - at) * count).div_ceil(period);
        n = n.saturating_add(u64::try_from(here).unwrap_or(u64::MAX));
        if count_only {
            continue;
        }
        for i in 0..here {
            let t = u128::from(*at) + i * period / count;
            if t >= u128::from(stop) {
                break;
            }
            put(t as Nanos);
        }
    }
    Ok(n)
}

fn check(e: &Expect, client: &Client, seen: &Seen, failures: &mut Vec<String>) {
    let (admitted, refused) = match e.during {
        None => (seen.admitted, seen.refused),
        Some(w) => {
            let (from, to) = (nanos(w.from), nanos(w.to));
            let inside = seen.log.iter().filter(|(t, _)| (from..to).contains(t));
            let (a, r) = inside.fold(
                (0, 0),
                |(a, r), (_, ok)| {
                    if *ok {
                        (a + 1, r)
                    } else {
                        (a, r + 1)
                    }
                },
            );
            (a, r)
        }
    };
    let during = e
        .during
        .map(|w| format!(" from {:?} to {:?}", w.from.0, w.to.0))
        .unwrap_or_default();
    if let Some(want) = e.admitted {
        if !want.holds(admitted) {
            failures.push(format!(
                "{}: admitted {admitted}{during}, expected {want}",
                e.client
            ));
        }
    }
    if let Some(want) = e.refused {
        if !want.holds(refused) {
            failures.push(format!(
                "{}: refused {refused}{during}, expected {want}",
                e.client
            ));
        }
    }
    match (e.first_refused, seen.first_refused_s) {
        (None, _) | (Some(When::Never), None) => {}
        (Some(When::Never), Some(at)) => failures.push(format!(
            "{}: first refused at {at:.3}s, expected never",
            e.client
        )),
        (Some(When::At(want)), None) => failures.push(format!(
            "{}: never refused, expected a first refusal at {:?}",
            e.client, want.0
        )),
        (Some(When::At(want)), Some(at)) => {
            let spacing = spacing_at(client, at).unwrap_or(0.0);
            let want_s = want.0.as_secs_f64();
            if (at - want_s).abs() > spacing + 1e-9 {
                failures.push(format!(
                    "{}: first refused at {at:.3}s, expected {:?} (within {spacing:.3}s)",
                    e.client, want.0
                ));
            }
        }
    }
    if let Some(most) = e.most_per_second {
        if let Some((s, n)) = seen.per_second.iter().enumerate().find(|(_, n)| **n > most) {
            failures.push(format!(
                "{}: {n} admitted in second {s}, expected at most {most}",
                e.client
            ));
        }
    }
}

/// The client's request spacing at `at` seconds.
fn spacing_at(client: &Client, at: f64) -> Option<f64> {
    let rate = match &client.rate {
        Some(r) => Some(*r),
        None => client
            .steps
            .iter()
            .filter(|s| s.at.0.as_secs_f64() <= at)
            .max_by_key(|s| s.at.0)
            .and_then(|s| s.rate.0),
    }?;
    Some(rate.period.as_secs_f64() / f64::from(rate.count.get()))
}

/// One client's request, built once.
struct Request {
    req: http::Request<()>,
    client: crate::key::Client,
}

impl Request {
    fn of(c: &Client, config: &Config) -> Result<Self, String> {
        let mut b = http::Request::builder()
            .method(c.method.as_str())
            .uri(c.path.as_str());
        for (k, v) in &c.headers {
            b = b.header(k.as_str(), v.as_str());
        }
        let req = b.body(()).map_err(|e| format!("client {}: {e}", c.name))?;
        let ip = c.ip.unwrap_or(IpAddr::from([192, 0, 2, 1]));
        let policy = config.client_ip.policy();
        let addr = policy.unwrapped(ip.to_canonical());
        Ok(Request {
            req,
            client: crate::key::Client {
                addr,
                keyed: policy.cut(addr),
            },
        })
    }
}

enum Answer {
    Admitted(crate::rules::Admit),
    Refused,
    Bad,
}

/// The simulated proxies, their control plane and their Redis.
struct Fleet {
    proxies: Vec<Arc<RuleSet>>,
    exact: Arc<ExactStore>,
    ratios: Vec<Arc<ArcSwap<DropRatios>>>,
    controller: Option<Accumulator>,
    service: String,
    interval: Nanos,
    top_k: usize,
    next_report: Nanos,
    next_sweep: Nanos,
    seq: u64,
    strict: bool,
    notes: Vec<String>,
}

impl Fleet {
    fn new(config: &Config, n: u32) -> Result<Fleet, String> {
        let mut notes = Vec::new();
        // A simulation's refusals are its report, not log lines.
        let mut config = config.clone();
        config.log_rejections = 0;
        let config = &config;
        let secret = crate::digest::Secret::of(config.key_secret_file.as_deref())?;
        let exact = Arc::new(ExactStore::default());
        let redis: Arc<dyn RemoteStore> = exact.clone();
        let mut proxies = Vec::new();
        let mut ratios = Vec::new();
        for _ in 0..n {
            let r = Arc::new(ArcSwap::from_pointee(DropRatios::empty(START)));
            let rules = RuleSet::build_with_ratios(config, &Metrics::new(), r.clone())
                .with_secret(secret.clone())
                .with_store(Some(redis.clone()));
            for (rule, (result, _)) in rules.load_override_files(None) {
                result.map_err(|e| format!("rule {rule}: overrides_file {e}"))?;
            }
            proxies.push(Arc::new(rules));
            ratios.push(r);
        }
        for r in &config.rules {
            if r.on_limit == crate::config::OnLimit::Delay {
                notes.push(format!(
                    "rule {}: on_limit: delay is counted as a refusal (the wait is not simulated)",
                    r.name
                ));
            }
            if r.cost.response().is_some() {
                notes.push(format!(
                    "rule {}: a response's cost is not simulated: each request takes its reservation",
                    r.name
                ));
            }
            if matches!(r.limit, crate::config::Limit::Adaptive(_)) {
                notes.push(format!(
                    "rule {}: an adaptive limit follows the upstream's latency, which is not simulated",
                    r.name
                ));
            }
        }
        let global = config.rules.iter().any(|r| r.scope == Scope::Global);
        let cp = config.control_plane.as_ref();
        let interval = cp.map_or(NANOS_PER_SEC, |c| nanos(c.report_interval));
        Ok(Fleet {
            proxies,
            exact,
            ratios,
            controller: global.then(|| Accumulator::new(1.0)),
            service: config.service.0.clone(),
            interval,
            top_k: cp.map_or(100, |c| c.top_k.get() as usize),
            next_report: START + interval,
            next_sweep: START + NANOS_PER_SEC,
            seq: 0,
            strict: config.path_match == crate::config::PathMatch::Strict,
            notes,
        })
    }

    /// Runs what the proxies and the control plane do in the background up to `now`.
    fn advance(&mut self, now: Nanos) {
        while self.next_sweep <= now {
            for p in &self.proxies {
                p.sweep(self.next_sweep);
            }
            self.next_sweep += NANOS_PER_SEC;
        }
        while self.next_report <= now {
            let at = self.next_report;
            self.report(at);
            self.next_report += self.interval;
        }
    }

    /// Every proxy reports, and takes the controller's answer.
    fn report(&mut self, at: Nanos) {
        let Some(acc) = &mut self.controller else {
            return;
        };
        self.seq += 1;
        let secs = at as f64 / NANOS_PER_SEC as f64;
        let interval = std::time::Duration::from_nanos(self.interval);
        for (i, rules) in self.proxies.iter().enumerate() {
            let source = format!("proxy-{i}");
            let counts = rules.drain_global(self.top_k, interval.as_secs_f64(), self.seq, at);
            let report = crate::control::reporter::report_of(
                counts,
                &self.service,
                &source,
                "sim",
                interval,
                self.seq,
            );
            // A simulated fleet's own reports: none is refused.
            let _ = acc.record(&report, &source, secs);
        }
        let reply = acc.reply(Some(&[self.service.as_str()]), secs);
        for r in &self.ratios {
            r.store(Arc::new(
                DropRatios::from_reply(&reply, &self.service, at).answering(self.seq),
            ));
        }
    }

    fn decide(&self, proxy: usize, r: &Request, now: Nanos) -> Answer {
        let rules = &self.proxies[proxy];
        self.exact
            .now
            .store(now, std::sync::atomic::Ordering::Relaxed);
        let view = crate::key::RequestView::for_proxy(
            &r.req,
            r.client,
            (false, self.strict),
            crate::ids::IdFrom::Never,
        );
        match rules.check(&view, now) {
            Verdict::Allow(a) => Answer::Admitted(a),
            Verdict::Deny(_) => Answer::Refused,
            Verdict::BadRequest(_) => Answer::Bad,
            Verdict::Remote(mut remote) => {
                let store = rules.store().expect("the simulation's").clone();
                while let Some(q) = remote.question(rules) {
                    let answer = ready(store.decide(q));
                    if let Some(v) = rules.answer(&mut remote, answer, &view, now) {
                        return match v {
                            Verdict::Allow(a) => Answer::Admitted(a),
                            Verdict::BadRequest(_) => Answer::Bad,
                            _ => Answer::Refused,
                        };
                    }
                }
                match rules.finish(remote) {
                    Verdict::Allow(a) => Answer::Admitted(a),
                    _ => Answer::Refused,
                }
            }
        }
    }
}

/// The output of a future that is ready at once (the simulation's store answers in place).
fn ready<T>(mut f: std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + '_>>) -> T {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match f.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(v) => v,
        std::task::Poll::Pending => unreachable!("the simulated store answers at once"),
    }
}

/// Redis for the simulation: the local algorithm of each rule's name, one state per (rule,
/// key) for the whole fleet, on the scenario's clock (the question's `now` is the decision's).
#[derive(Default)]
struct ExactStore {
    // The simulation is one thread; the lock is the trait's `Sync`.
    #[allow(clippy::disallowed_types)]
    states: std::sync::Mutex<HashMap<(String, Vec<u8>), Exact>>,
    metrics: std::sync::OnceLock<crate::metrics::RedisMetrics>,
    now: std::sync::atomic::AtomicU64,
}

enum Exact {
    TokenBucket(TokenBucket),
    Gcra(Gcra),
    FixedWindow(FixedWindow),
    SlidingWindowLog(SlidingWindowLog),
    SlidingWindowCounter(SlidingWindowCounter),
}

impl Exact {
    fn new(a: Algorithm) -> Exact {
        match a {
            Algorithm::Gcra => Exact::Gcra(Gcra::default()),
            Algorithm::FixedWindow => Exact::FixedWindow(FixedWindow::default()),
            Algorithm::SlidingWindowLog => Exact::SlidingWindowLog(SlidingWindowLog::default()),
            Algorithm::SlidingWindowCounter => {
                Exact::SlidingWindowCounter(SlidingWindowCounter::default())
            }
            // Leaky buckets are refused with scope: redis.
            _ => Exact::TokenBucket(TokenBucket::default()),
        }
    }

    fn check(&self, q: &Quota, now: Nanos, cost: u32) -> Decision {
        match self {
            Exact::TokenBucket(l) => l.check(q, now, cost),
            Exact::Gcra(l) => l.check(q, now, cost),
            Exact::FixedWindow(l) => l.check(q, now, cost),
            Exact::SlidingWindowLog(l) => l.check(q, now, cost),
            Exact::SlidingWindowCounter(l) => l.check(q, now, cost),
        }
    }
}

impl RemoteStore for ExactStore {
    fn decide<'a>(
        &'a self,
        q: Question<'a>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Option<StoreAnswer>> + Send + 'a>> {
        let now = self.now.load(std::sync::atomic::Ordering::Relaxed);
        let mut states = self.states.lock().unwrap_or_else(|p| p.into_inner());
        let state = states
            .entry((q.rule.to_string(), q.key.to_vec()))
            .or_insert_with(|| Exact::new(q.algorithm));
        let answer = match state.check(q.quota, now, q.cost) {
            Decision::Allow {
                remaining,
                reset_after,
                ..
            } => StoreAnswer {
                admitted: true,
                remaining,
                retry_after: None,
                reset_after,
            },
            Decision::Deny { retry_after } => StoreAnswer {
                admitted: false,
                remaining: 0,
                retry_after,
                reset_after: retry_after.unwrap_or(0),
            },
        };
        Box::pin(std::future::ready(Some(answer)))
    }

    fn peek<'a>(
        &'a self,
        _: Question<'a>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Option<StoreAnswer>> + Send + 'a>> {
        Box::pin(std::future::ready(None))
    }

    fn owe(&self, _: Arc<str>, _: Box<[u8]>, _: Quota, _: i64, _: prometheus::IntCounter) {}

    fn on_error(&self) -> crate::config::OnError {
        crate::config::OnError::Allow
    }

    fn cache_refusals(&self) -> bool {
        false
    }

    fn retry_hint(&self) -> Nanos {
        NANOS_PER_SEC
    }

    fn metrics(&self) -> &crate::metrics::RedisMetrics {
        self.metrics.get_or_init(|| Metrics::new().redis)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Config {
        Config::from_yaml(
            "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nrules:\n  - name: r\n    key: client_ip\n    limit: { rate: 10/s }\n",
            "t",
        )
        .unwrap()
    }

    fn scenario(yaml: &str) -> Scenario {
        serde_norway::from_str(yaml).unwrap()
    }

    #[test]
    fn a_scenario_past_its_bounds_is_refused_before_anything_is_made() {
        let c = config();
        for (yaml, says) in [
            (
                "name: s\nduration: 1d\nclients: [{ name: a, rate: 1000000/s }]\n",
                "more than",
            ),
            (
                "name: s\nduration: 2d\nclients: [{ name: a, rate: 1/s }]\n",
                "duration: at most",
            ),
            (
                "name: s\nduration: 1s\nclients: [{ name: a }]\n",
                "missing rate",
            ),
            (
                "name: s\nduration: 1s\nclients: [{ name: a, rate: 1/s }]\nexpect: [{ client: b, admitted: 1 }]\n",
                "no client is called",
            ),
        ] {
            let e = run(&c, &scenario(yaml), 1).unwrap_err();
            assert!(e.contains(says), "{yaml}: {e}");
        }
        assert!(run(
            &c,
            &scenario("name: s\nduration: 1s\nclients: [{ name: a, rate: 1/s }]\n"),
            0
        )
        .is_err());
    }

    #[test]
    fn requests_come_evenly_at_their_rate_and_far_starts_cost_nothing() {
        let c = config();
        let o = run(
            &c,
            &scenario(
                "name: s\nduration: 10s\nclients: [{ name: a, rate: 3/s, from: 100000d, hold: 100000d }, { name: b, steps: [{ at: 0s, rate: 7/s }, { at: 5s, rate: 0/s }] }]\n",
            ),
            1,
        )
        .unwrap();
        assert_eq!(o.clients[0].1.sent, 0);
        assert_eq!(o.clients[1].1.sent, 35);
    }

    #[test]
    fn an_expectation_that_does_not_hold_fails_the_scenario_and_says_why() {
        let c = config();
        let o = run(
            &c,
            &scenario(
                "name: s\nduration: 10s\nclients: [{ name: a, rate: 20/s }]\nexpect: [{ client: a, admitted: 150 }, { client: a, first_refused: never }, { client: a, during: { from: 5s, to: 10s }, admitted: { min: 50, max: 50 } }, { client: a, most_per_second: 20 }]\n",
            ),
            1,
        )
        .unwrap();
        assert!(!o.passed);
        // 10/s and a burst of 10: 10 + 10 x 9.95 s (the last request at 9.95 s).
        assert_eq!(o.clients[0].1.admitted, 109);
        assert_eq!(o.failures.len(), 2, "{:?}", o.failures);
        assert!(o.failures[0].contains("admitted 109"), "{:?}", o.failures);
        assert!(o.failures[1].contains("expected never"), "{:?}", o.failures);
    }
}
