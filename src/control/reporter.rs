//! The proxy's reporter: every `report_interval` it takes the global rules' counts, posts them
//! to the aggregator (or controller) and publishes the drop ratios of the reply.
//!
//! Runs beside the request path, never in it: requests only bump counters and read the
//! published snapshot. A slow or dead control plane only makes reports late (each post is
//! bounded by one interval), and the ratios it left behind age out (see [`super::Staleness`]).

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_TYPE};
use http::{Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use tokio::sync::watch;

use super::{DropRatios, Entry, Reply, Report, Staleness, MAX_BODY, VERSION};
use crate::limit::{AnyClock, Clock, Nanos};
use crate::metrics::Metrics;
use crate::rules::RuleSet;

/// A client for the control plane's JSON endpoints.
pub type JsonClient = Client<HttpConnector, Full<Bytes>>;

pub fn json_client() -> JsonClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(1)));
    Client::builder(TokioExecutor::new()).build(connector)
}

/// Posts `report` to `url` (`.../v1/report`) and returns the reply, within `timeout`.
pub async fn post_report(
    client: &JsonClient,
    url: &Uri,
    token: Option<&[u8]>,
    report: &Report,
    timeout: Duration,
) -> Result<(Reply, usize), String> {
    let body = serde_json::to_vec(report).map_err(|e| e.to_string())?;
    let size = body.len();
    let mut req = Request::post(url.clone()).header(CONTENT_TYPE, "application/json");
    if let Some(t) = token {
        let mut value = b"Bearer ".to_vec();
        value.extend_from_slice(t);
        req = req.header(AUTHORIZATION, value);
    }
    let req = req
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let exchange = async {
        let resp = client.request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status();
        let bytes = Limited::new(resp.into_body(), MAX_BODY)
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        if status != StatusCode::OK {
            return Err(format!(
                "{status}: {}",
                String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
            ));
        }
        serde_json::from_slice::<Reply>(&bytes).map_err(|e| format!("malformed reply: {e}"))
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(Ok(reply)) => Ok((reply, size)),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(format!("no reply within {timeout:?}")),
    }
}

/// Everything the reporter needs, fixed at start.
pub struct Reporter {
    pub client: JsonClient,
    /// `<control plane>/v1/report`.
    pub url: Uri,
    pub token: crate::control::server::Token,
    pub service: String,
    pub source: String,
    pub zone: String,
    pub interval: Duration,
    pub top_k: usize,
    pub staleness: Staleness,
    pub ratios: Arc<ArcSwap<DropRatios>>,
    pub clock: AnyClock,
    pub metrics: Arc<Metrics>,
}

/// The report of `rules`' global counts since the last one: the `top_k` heaviest keys of each
/// rule one by one, the rest folded into one "other" entry, so that its size does not grow
/// with the number of distinct keys.
pub fn build_report(
    rules: &RuleSet,
    service: &str,
    source: &str,
    zone: &str,
    interval: Duration,
    top_k: usize,
) -> Report {
    let mut entries = Vec::new();
    for counts in rules.drain_global(top_k) {
        let entry = |key, keys_folded, offered, admitted| Entry {
            service: service.to_string(),
            rule: counts.rule.clone(),
            limit: counts.limit,
            key,
            keys_folded,
            offered,
            admitted,
        };
        for (k, o, a) in &counts.keys {
            entries.push(entry(Some(k.clone()), 0, *o, *a));
        }
        let (o, a, n) = counts.other;
        if o > 0 {
            entries.push(entry(None, n, o, a));
        }
    }
    Report {
        version: VERSION,
        source: source.to_string(),
        zone: zone.to_string(),
        interval_ms: interval.as_millis() as u64,
        entries,
    }
}

impl Reporter {
    /// The report of the counts since the last one.
    pub fn report(&self, rules: &RuleSet) -> Report {
        build_report(
            rules,
            &self.service,
            &self.source,
            &self.zone,
            self.interval,
            self.top_k,
        )
    }

    /// Reports every interval until `stop`, then sends one last report (within one interval).
    pub async fn run(self, rules: Arc<ArcSwap<RuleSet>>, mut stop: watch::Receiver<bool>) {
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
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

    /// One report and the publication of its reply.
    pub async fn once(&self, rules: &RuleSet) {
        let report = self.report(rules);
        let sent_at = self.clock.now();
        match post_report(
            &self.client,
            &self.url,
            self.token.get().as_deref().map(Vec::as_slice),
            &report,
            self.interval,
        )
        .await
        {
            Ok((reply, size)) => {
                let age = Duration::from_millis(reply.age_ms).as_nanos() as Nanos;
                let at = sent_at.saturating_sub(age);
                self.ratios
                    .store(Arc::new(DropRatios::from_reply(&reply, &self.service, at)));
                self.metrics.reports_ok.inc();
                self.metrics.report_bytes.set(size as i64);
            }
            Err(e) => {
                self.metrics.reports_failed.inc();
                tracing::debug!(error = %e, url = %self.url, "report failed");
            }
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
                    url = %self.url,
                    age_s = age as f64 / 1e9,
                    "control plane stale: holding the last drop ratios, then letting them decay (fail open)"
                );
            } else {
                tracing::info!(url = %self.url, "control plane answering again");
            }
        }
        if stale && factor == 0.0 {
            tracing::debug!("stale drop ratios have decayed to zero");
        }
        stale
    }
}
