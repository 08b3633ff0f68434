//! Where limits are shared beyond one proxy: the `control_plane` section (global rules) and
//! the `redis` section (`scope: redis`), their URLs checked when parsed and shown without
//! passwords, and the checks that tie them to the rules. Must never: print a password, or
//! accept a section the build cannot serve (a missing feature is named).

use std::num::NonZeroU32;
use std::time::Duration;

use schemars::JsonSchema;
use serde::de::Deserializer;
use serde::{Deserialize, Serialize, Serializer};

use super::*;

/// The Redis of `scope: redis` rules, and what to do when it does not answer.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RedisConfig {
    /// `redis://[user:password@]host:port[/db]` (`rediss://` for TLS), or a list of such URLs:
    /// the nodes of a Redis Cluster.
    pub url: RedisUrls,
    /// The longest a decision waits for Redis; then `on_error` applies.
    #[serde(default = "default_redis_timeout")]
    pub timeout: Dur,
    /// What a decision does when Redis fails, times out or the breaker is open: `allow` (fail
    /// open), `deny` (429) or `fallback` (the rule's `fallback` limit).
    #[serde(default)]
    pub on_error: OnError,
    /// A circuit breaker: Redis failing again and again is not called for a while.
    #[serde(default)]
    pub breaker: BreakerConfig,
    /// Remember keys Redis refused until their retry time and answer them locally (an abusive
    /// client then costs no round trips).
    #[serde(default = "default_true")]
    pub cache_refusals: bool,
    /// With `rediss://`: a PEM file of the CA that signed Redis's certificate, instead of the
    /// system's trust store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<std::path::PathBuf>,
}

fn default_true() -> bool {
    true
}

fn default_redis_timeout() -> Dur {
    Dur(Duration::from_millis(50))
}

/// What a decision does when Redis fails, times out, or the breaker is open.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnError {
    /// Admit (fail open): an outage of Redis is not an outage of the service.
    #[default]
    Allow,
    /// Refuse with 429 (fail closed).
    Deny,
    /// Apply the rule's `fallback:` limit, counted in this proxy alone.
    Fallback,
}

/// After `failures` consecutive failures, Redis is not called for `cooldown`; then one probe.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct BreakerConfig {
    /// Consecutive failures of Redis that open the breaker.
    pub failures: NonZeroU32,
    /// How long the open breaker keeps Redis uncalled before one probe.
    pub cooldown: Dur,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failures: NonZeroU32::new(5).expect("non-zero"),
            cooldown: Dur(Duration::from_secs(1)),
        }
    }
}

/// One Redis URL, or the nodes of a cluster; checked when parsed, shown without passwords.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisUrls(pub Vec<String>);

impl RedisUrls {
    /// More than one node: Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.0.len() > 1
    }
}

/// What a config that needs Redis is told by a build without it.
#[cfg(not(feature = "redis"))]
const FEATURE_REDIS: &str =
    "needs the `redis` feature, which this build of spillway lacks (cargo build --features redis)";
/// What a config that needs TLS is told by a build without it.
#[cfg(not(feature = "tls"))]
const FEATURE_TLS: &str =
    "needs the `tls` feature, which this build of spillway lacks (cargo build --features tls)";

/// The line a top-level section starts on.
fn section_line(text: &str, section: &str) -> Option<usize> {
    text.lines()
        .position(|l| l.starts_with(section))
        .map(|i| i + 1)
}

fn check_redis_url(s: &str) -> Result<String, String> {
    if !(s.starts_with("redis://") || s.starts_with("rediss://")) {
        return Err(err(format!(
            "{:?}: expected a redis:// or rediss:// URL",
            redact_url(s)
        )));
    }
    // Without Redis in the build the section is refused as a whole (`check_redis`).
    #[cfg(feature = "redis")]
    redis::Client::open(s)
        .map_err(|e| err(format!("{:?}: not a Redis URL: {e}", redact_url(s))))?;
    Ok(s.to_string())
}

/// `s` with any password replaced, for errors and `/config`.
pub fn redact_url(s: &str) -> String {
    match (s.find("://"), s.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &s[scheme + 3..at];
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &s[..scheme + 3], &s[at..]),
                None => s.to_string(),
            }
        }
        _ => s.to_string(),
    }
}

impl<'de> Deserialize<'de> for RedisUrls {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parse_one_or_list(d, "a redis:// URL or a list of them", |s, _| {
            check_redis_url(s)
        })
        .map(RedisUrls)
    }
}

impl Serialize for RedisUrls {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let shown: Vec<String> = self.0.iter().map(|u| redact_url(u)).collect();
        match shown.as_slice() {
            [one] => s.serialize_str(one),
            _ => shown.serialize(s),
        }
    }
}

/// The proxy's side of the control plane.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ControlPlane {
    /// The zone's aggregators (or a controller, for small fleets): `http://host:port` or
    /// `https://host:port`.
    pub url: ControlUrl,
    /// With `https://`: a PEM file of the CA that signed the control plane's certificate,
    /// instead of the system's trust store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<std::path::PathBuf>,
    /// How often counts are reported: 100ms to 600s (to aggregators, at most 60 of their
    /// intervals, and at least 60s, whatever theirs).
    #[serde(default = "default_report_interval")]
    pub report_interval: Dur,
    /// No good reply for this long: the control plane is stale.
    #[serde(default = "default_stale_after")]
    pub stale_after: Dur,
    /// Once stale, held ratios fall linearly to zero over this long.
    #[serde(default = "default_decay")]
    pub decay: Dur,
    /// A file holding the shared bearer token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_file: Option<std::path::PathBuf>,
    /// Keys reported one by one per rule; the rest are folded into one "other" entry.
    #[serde(default = "default_top_k")]
    pub top_k: NonZeroU32,
    /// This proxy's zone in reports (default: `$SPILLWAY_ZONE`). An aggregator of another zone
    /// counts the reports (`other_zone`) and warns: the proxy's `url` names the wrong zone's
    /// aggregators.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    /// This proxy's name in reports (default: `$HOSTNAME`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
}

fn default_report_interval() -> Dur {
    Dur(Duration::from_secs(1))
}
fn default_stale_after() -> Dur {
    Dur(Duration::from_secs(5))
}
fn default_decay() -> Dur {
    Dur(Duration::from_secs(10))
}
fn default_top_k() -> NonZeroU32 {
    NonZeroU32::new(100).expect("non-zero")
}

/// Global rules need somewhere to report; intervals must make sense together (the sidecar's
/// config, and the tower layer's).
pub(crate) fn check_control_plane(
    control_plane: Option<&ControlPlane>,
    rules: &[Rule],
    text: &str,
    file: &str,
) -> Result<(), ConfigError> {
    let invalid = |line, message: String| ConfigError::Invalid {
        file: file.to_string(),
        line,
        column: None,
        message,
    };
    if let Some(cp) = control_plane {
        let line = section_line(text, "control_plane:");
        #[cfg(not(feature = "tls"))]
        if cp.url.tls() {
            return Err(invalid(
                line,
                format!("control_plane.url: https:// {FEATURE_TLS}"),
            ));
        }
        if cp.ca_file.is_some() && !cp.url.tls() {
            return Err(invalid(
                line,
                "control_plane.ca_file: only used with an https:// url".into(),
            ));
        }
        // What the aggregators and the controller take (they hold each report for its own
        // interval, whatever theirs).
        if cp.report_interval.0 < Duration::from_millis(100)
            || cp.report_interval.0 > Duration::from_secs(600)
        {
            return Err(invalid(
                line,
                "control_plane.report_interval: must be between 100ms and 600s".into(),
            ));
        }
        if cp.stale_after.0 < cp.report_interval.0 * 2 {
            return Err(invalid(
                line,
                "control_plane.stale_after: must be at least two report intervals".into(),
            ));
        }
    } else if let Some(rule) = rules.iter().find(|r| r.scope == Scope::Global) {
        return Err(invalid(
            line_of_nth_name(text, &rule.name.0, 1),
            format!(
                "rule {}: scope: global needs a control_plane section with the aggregator's url",
                rule.name
            ),
        ));
    }
    Ok(())
}

impl Config {
    /// Redis rules need a build with Redis and a `redis:` section, and `on_error: fallback` a fallback on each of them.
    pub(super) fn check_redis(&self, text: &str, file: &str) -> Result<(), ConfigError> {
        let invalid = |rule: &Rule, message: String| ConfigError::Invalid {
            file: file.to_string(),
            line: line_of_nth_name(text, &rule.name.0, 1),
            column: None,
            message: format!("rule {}: {message}", rule.name),
        };
        let mut redis_rules = self.rules.iter().filter(|r| r.scope == Scope::Redis);
        #[cfg(not(feature = "redis"))]
        {
            if let Some(rule) = redis_rules.next() {
                return Err(invalid(rule, FEATURE_REDIS.into()));
            }
            if self.redis.is_some() {
                return Err(ConfigError::Invalid {
                    file: file.to_string(),
                    line: section_line(text, "redis:"),
                    column: None,
                    message: format!("redis: {FEATURE_REDIS}"),
                });
            }
        }
        #[cfg(all(feature = "redis", not(feature = "tls")))]
        if let Some(redis) = &self.redis {
            if redis.ca_file.is_some() || redis.url.0.iter().any(|u| u.starts_with("rediss://")) {
                return Err(ConfigError::Invalid {
                    file: file.to_string(),
                    line: section_line(text, "redis:"),
                    column: None,
                    message: format!("redis: rediss:// and ca_file: {FEATURE_TLS}"),
                });
            }
        }
        match &self.redis {
            None => match redis_rules.next() {
                Some(rule) => Err(invalid(
                    rule,
                    "scope: redis needs a redis section with the server's url".into(),
                )),
                None => Ok(()),
            },
            Some(redis) if redis.on_error == OnError::Fallback => {
                match redis_rules.find(|r| r.fallback.is_none()) {
                    Some(rule) => Err(invalid(
                        rule,
                        "redis.on_error is fallback, so this rule needs a fallback: limit".into(),
                    )),
                    None => Ok(()),
                }
            }
            Some(_) => Ok(()),
        }
    }
}
