//! The proxy's reporter: every `report_interval` it takes the global rules' counts, posts them
//! to the aggregator (or controller) and publishes the drop ratios of the reply.
//!
//! Runs beside the request path, never in it: requests only bump counters and read the
//! published snapshot. A slow or dead control plane only makes reports late (each post is
//! bounded by one interval), and the ratios it left behind age out (see [`Staleness`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::sync::watch;

use super::client::{first_seq, json_client, JsonClient, Targets};
use super::{Entry, Limit, Report, VERSION};
use crate::config::ControlPlane;
use crate::limit::{AnyClock, Clock, Nanos};
use crate::metrics::Metrics;
use crate::rules::{DropRatios, GlobalCounts, RuleSet, Staleness};

/// Everything the reporter needs, fixed at start.
pub struct Reporter {
    pub client: JsonClient,
    /// `<control plane>/v1/report` of each URL the configuration gives.
    pub targets: Targets,
    pub token: crate::control::auth::Token,
    pub service: String,
    pub source: String,
    pub zone: String,
    pub interval: Duration,
    pub top_k: usize,
    /// The next report's sequence number (starting from the wall clock in milliseconds, so
    /// that it keeps increasing across restarts).
    pub seq: std::sync::atomic::AtomicU64,
    pub staleness: Staleness,
    pub ratios: Arc<ArcSwap<DropRatios>>,
    pub clock: AnyClock,
    pub metrics: Arc<Metrics>,
    /// When the last report was sent (limiter clock): which of this proxy's reports the sums
    /// behind a reply hold (see [`DropRatios::own_lag`]).
    pub last_sent: std::sync::atomic::AtomicU64,
    /// When the reporter was made (tokio's clock), and how long after that the last report's
    /// counts were taken, in nanoseconds: each report states the time its counts cover.
    pub started: tokio::time::Instant,
    pub drained: std::sync::atomic::AtomicU64,
}

/// The report of `rules`' global counts since the last one: per rule the keys
/// [`RuleSet::drain_global`] names one by one, the rest folded into one "other" entry with a
/// sketch of which keys those are, so that its size does not grow with the number of keys.
pub fn build_report(
    rules: &RuleSet,
    service: &str,
    source: &str,
    zone: &str,
    interval: Duration,
    top_k: usize,
    seq: u64,
) -> Report {
    // No time on the limiter clock: decisions take the ratios' shares as they are.
    let counts = rules.drain_global(top_k, interval.as_secs_f64(), seq, 0);
    report_of(counts, service, source, zone, interval, seq)
}

/// The report numbered `seq` of `counts`, covering `interval`.
pub(crate) fn report_of(
    counts: impl IntoIterator<Item = GlobalCounts>,
    service: &str,
    source: &str,
    zone: &str,
    interval: Duration,
    seq: u64,
) -> Report {
    let mut entries = Vec::new();
    for counts in counts {
        let entry = |key, keys_folded, offered, admitted| Entry {
            service: service.to_string(),
            rule: counts.rule.clone(),
            limit: Limit::of(counts.rate),
            key,
            keys_folded,
            offered,
            admitted,
            sketch: None,
            hosts: 0,
            jump: 0.0,
            own: None,
        };
        for (k, o, a, jump) in &counts.keys {
            let mut e = entry(Some(k.clone()), 0, *o, *a);
            e.jump = *jump;
            e.own = counts.owns.get(k).map(|r| Limit::of(*r));
            entries.push(e);
        }
        // The tail goes even when empty: a report that names the rule is answered with its
        // ratios and hints, so that a quiet interval does not wipe them before the next burst.
        let (o, a, n) = counts.other;
        let mut tail = entry(None, n, o, a);
        if !counts.folded.is_empty() {
            tail.sketch = Some(counts.folded.encode());
        }
        entries.push(tail);
    }
    Report {
        version: VERSION,
        source: source.to_string(),
        zone: zone.to_string(),
        interval_ms: interval.as_millis() as u64,
        seq,
        last: false,
        entries,
        instance: None,
    }
}

impl Reporter {
    /// The reporter for `cp`, with its token read now so that a bad token file stops start-up
    /// (and re-read when the file changes, until `stop`).
    pub fn new(
        service: &str,
        cp: &ControlPlane,
        ratios: &Arc<ArcSwap<DropRatios>>,
        clock: &AnyClock,
        metrics: &Arc<Metrics>,
        stop: watch::Receiver<bool>,
    ) -> std::io::Result<Reporter> {
        let token = match &cp.token_file {
            Some(path) => {
                crate::control::auth::Token::from_file(path.clone(), stop).map_err(|e| {
                    std::io::Error::new(
                        e.kind(),
                        format!("control_plane.token_file {}: {e}", path.display()),
                    )
                })?
            }
            None => Default::default(),
        };
        let (targets, tls) = Targets::new(&cp.url.0, cp.ca_file.as_deref()).map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("control_plane.url {}: {e}", cp.url),
            )
        })?;
        let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        Ok(Reporter {
            client: json_client(tls)?,
            targets,
            token,
            service: service.to_string(),
            source: cp
                .host
                .clone()
                .or_else(|| env("HOSTNAME"))
                .unwrap_or_else(|| format!("spillway-{}", std::process::id())),
            zone: cp
                .zone
                .clone()
                .or_else(|| env("SPILLWAY_ZONE"))
                .unwrap_or_default(),
            interval: cp.report_interval.0,
            top_k: cp.top_k.get() as usize,
            seq: first_seq().into(),
            staleness: Staleness {
                stale_after: cp.stale_after.0.as_nanos() as u64,
                decay: cp.decay.0.as_nanos() as u64,
            },
            ratios: ratios.clone(),
            clock: clock.clone(),
            metrics: metrics.clone(),
            last_sent: Default::default(),
            started: tokio::time::Instant::now(),
            drained: Default::default(),
        })
    }

    /// The report of the counts since the last one, over the time since then: not the
    /// configured interval, which a report delayed (one controller of several not answering
    /// before its timeout) or cut short (the last, at stop) does not cover, and whose counts
    /// it would then state as rates over the wrong time.
    pub fn report(&self, rules: &RuleSet) -> Report {
        let now = u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let since = self.drained.swap(now, std::sync::atomic::Ordering::Relaxed);
        let covered = Duration::from_nanos(now.saturating_sub(since))
            .clamp(Duration::from_millis(100), Duration::from_secs(600));
        let seq = self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // Names the proxy in the per-key trace of the drain (see `RuleSet::drain_global`).
        let _span = tracing::trace_span!(target: crate::rules::FLEET_TRACE, "report", source = %self.source)
            .entered();
        let counts = rules.drain_global(self.top_k, covered.as_secs_f64(), seq, self.clock.now());
        report_of(
            counts,
            &self.service,
            &self.source,
            &self.zone,
            covered,
            seq,
        )
    }

    /// Announces itself at once (see [`Self::announce`]: its reply's hints hold a new key to
    /// its share of the limit from the start, not to the whole limit until the first
    /// interval's reply), then reports every interval until `stop`, then sends one last report
    /// (within one interval).
    pub async fn run(self, rules: Arc<ArcSwap<RuleSet>>, mut stop: watch::Receiver<bool>) {
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        self.send(self.announce(&rules.load())).await;
        let mut was_stale = false;
        loop {
            let stopping = tokio::select! {
                _ = tick.tick() => false,
                _ = stop.changed() => true,
            };
            self.once(&rules.load()).await;
            was_stale = self.watch_staleness(was_stale);
            if stopping {
                return;
            }
        }
    }

    /// The report a proxy sends as it starts: each global rule named, nothing counted (what
    /// was counted so far goes with the first interval's report, whose rate it is).
    pub fn announce(&self, rules: &RuleSet) -> Report {
        let nothing = rules.global_rules().map(|(rule, rate)| GlobalCounts {
            owns: Default::default(),
            rule: rule.to_string(),
            rate,
            keys: Vec::new(),
            other: (0, 0, 0),
            folded: Default::default(),
        });
        report_of(
            nothing,
            &self.service,
            &self.source,
            &self.zone,
            self.interval,
            self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        )
    }

    /// One report and the publication of its reply.
    pub async fn once(&self, rules: &RuleSet) {
        self.send(self.report(rules)).await;
    }

    /// Sends `report` and publishes its reply.
    async fn send(&self, report: Report) {
        let seq = report.seq;
        // What the report names, for the keys a cut reply leaves out.
        let named: Vec<(String, String)> = report
            .entries
            .iter()
            .filter_map(|e| Some((e.rule.clone(), e.key.clone()?)))
            .collect();
        let sent_at = self.clock.now();
        let before = self.last_sent.swap(sent_at, Ordering::Relaxed);
        let token = self.token.get();
        let answers = self
            .targets
            .post_all(
                &self.client,
                token.as_deref().map(Vec::as_slice),
                report,
                self.interval,
            )
            .await;
        for (url, answer) in self.targets.urls().zip(&answers) {
            if let Err(e) = answer {
                // Each target that failed: one of two controllers down shows here.
                self.metrics.reports_failed.inc();
                tracing::debug!(error = %e, %url, "report failed");
            }
        }
        match self.targets.pick(answers) {
            Some(Ok((reply, _))) if reply.warming => {
                // Nothing authoritative yet: the ratios held stand (and age) until a reply is.
                self.metrics.reports_ok.inc();
                tracing::debug!(urls = %self.targets, "the controller is warming up: ratios kept");
            }
            Some(Ok((reply, size))) => {
                let age = Duration::from_millis(reply.age_ms).as_nanos() as Nanos;
                let at = sent_at.saturating_sub(age);
                let mut ratios = DropRatios::from_reply(&reply, &self.service, at).answering(seq);
                // The sums behind the ratios were taken at `at`: they hold the last of this
                // proxy's reports sent by then.
                ratios.own_lag = if at >= sent_at {
                    0
                } else if at >= before {
                    1
                } else {
                    2
                };
                ratios.keep_cut(
                    &self.ratios.load(),
                    named.iter().map(|(r, k)| (r.as_str(), k.as_str())),
                );
                self.ratios.store(Arc::new(ratios));
                self.metrics.reports_ok.inc();
                self.metrics.report_bytes.set(size as i64);
            }
            Some(Err(_)) | None => {}
        }
    }

    /// Updates the staleness metrics and logs when staleness changes; returns it.
    fn watch_staleness(&self, was_stale: bool) -> bool {
        let age = self.clock.now().saturating_sub(self.ratios.load().at);
        let (factor, stale) = self.staleness.factor(age);
        self.metrics.control_plane_age.set(age as f64 / 1e9);
        self.metrics.control_plane_stale.set(i64::from(stale));
        if stale != was_stale {
            if stale {
                tracing::warn!(
                    urls = %self.targets,
                    age_s = age as f64 / 1e9,
                    "control plane stale: holding the last drop ratios, then letting them decay (fail open)"
                );
            } else {
                tracing::info!(urls = %self.targets, "control plane answering again");
            }
        }
        if stale && factor == 0.0 {
            tracing::debug!("stale drop ratios have decayed to zero");
        }
        stale
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each report states the time its counts cover: one delayed (a controller of several
    /// slow to answer) or cut short (the last, at stop) is not stated as one interval.
    #[tokio::test(start_paused = true)]
    async fn a_report_states_the_time_its_counts_cover() {
        let config = crate::Config::from_yaml(
            "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\n\
             control_plane: { url: 'http://127.0.0.1:9', report_interval: 1s }\n",
            "t",
        )
        .unwrap();
        let metrics = Arc::new(crate::metrics::Metrics::new());
        let rules = RuleSet::build(&config, &metrics);
        let ratios = Arc::new(ArcSwap::from_pointee(DropRatios::empty(0)));
        let (_stop, stopped) = watch::channel(false);
        let cp = config.control_plane.as_ref().unwrap();
        let reporter =
            Reporter::new("s", cp, &ratios, &AnyClock::default(), &metrics, stopped).unwrap();
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(reporter.report(&rules).interval_ms, 1000);
        tokio::time::advance(Duration::from_millis(1750)).await;
        assert_eq!(reporter.report(&rules).interval_ms, 1750, "delayed");
        tokio::time::advance(Duration::from_millis(300)).await;
        assert_eq!(reporter.report(&rules).interval_ms, 300, "cut short");
        tokio::time::advance(Duration::from_millis(10)).await;
        assert_eq!(
            reporter.report(&rules).interval_ms,
            100,
            "what receivers take at least"
        );
    }
}
