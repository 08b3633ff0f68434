//! The YAML configuration: parsed from a string, validated into types, checked offline.
//!
//! Owns the schema (the user interface: field names are a contract) and its errors, which
//! always name the file, the line and the field path (`rules[1].limit.rate: ...`). Values are
//! validated while they are deserialized, so the YAML parser's own position and path tracking
//! locates every error. Must never: touch the network, start anything, or panic on input.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use schemars::JsonSchema;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize, Serializer};

use crate::key::KeyPart;
use crate::limit::{Algorithm, Quota};

/// A whole proxy configuration.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Identity of the service this sidecar fronts (not starting with `_` or `.`: reserved).
    #[schemars(extend("pattern" = "^[A-Za-z0-9-]"))]
    pub service: Name,
    /// Where clients connect.
    pub listen: SocketAddr,
    /// The app beside us, `http://host:port`.
    pub upstream: Upstream,
    /// Admin listener: `/metrics`, `/healthz`, `/readyz`, `/config`.
    #[serde(default = "default_admin")]
    pub admin: SocketAddr,
    #[serde(default)]
    pub client_ip: ClientIp,
    /// Normalise each request's path (escapes, dot segments, repeated slashes) before rules
    /// see it and forward the normalised one; `false` keeps the raw target (signed URLs).
    #[serde(default = "yes")]
    pub normalize_path: bool,
    /// What an encoded `/` or `\` (`%2F`, `%5C`) in a path gets: kept, or 400.
    #[serde(default)]
    pub path_escapes: PathEscapes,
    /// How rules compare paths: `lenient` (no case, no `;params`, no trailing slash) or
    /// `strict` (as written).
    #[serde(default)]
    pub path_match: PathMatch,
    /// Lines logged for a rule's rejections, per rule and second at most (0: none).
    #[serde(default = "default_log_rejections")]
    pub log_rejections: u32,
    /// What a `GET` or `HEAD` with a body gets: `forward` (on an upstream connection closed
    /// after its answer, so an app that ignores the body cannot read it as a request) or 400.
    #[serde(default)]
    pub bodies_on_get: BodiesOnGet,
    /// The `Upgrade` protocols forwarded (`h2c` never is).
    #[serde(default = "default_upgrades")]
    pub upgrades: Vec<UpgradeProtocol>,
    #[serde(default)]
    pub timeouts: Timeouts,
    #[serde(default)]
    pub headers: HeaderMode,
    #[serde(default)]
    pub limits: Limits,
    /// Data-plane threads, each with its own runtime and upstream connections, sharing the listener; default:
    /// one per CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workers: Option<NonZeroU32>,
    /// Where `scope: global` rules report and get their drop ratios.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane: Option<ControlPlane>,
    /// Where `scope: redis` rules keep their exact, shared counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redis: Option<RedisConfig>,
    #[serde(default)]
    pub rules: Vec<Rule>,
}

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
    #[serde(default)]
    pub on_error: OnError,
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
    Dur(Duration::from_millis(5))
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
    pub failures: NonZeroU32,
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

fn check_redis_url(s: &str) -> Result<String, String> {
    if !(s.starts_with("redis://") || s.starts_with("rediss://")) {
        return Err(err(format!(
            "{:?}: expected a redis:// or rediss:// URL",
            redact_url(s)
        )));
    }
    redis::Client::open(s)
        .map(|_| s.to_string())
        .map_err(|e| err(format!("{:?}: not a Redis URL: {e}", redact_url(s))))
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
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RedisUrls;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a redis:// URL or a list of them")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<RedisUrls, E> {
                check_redis_url(s)
                    .map(|u| RedisUrls(vec![u]))
                    .map_err(E::custom)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<RedisUrls, A::Error> {
                let mut out = Vec::new();
                while let Some(s) = seq.next_element::<String>()? {
                    out.push(check_redis_url(&s).map_err(de::Error::custom)?);
                }
                if out.is_empty() {
                    return Err(de::Error::custom("give at least one URL"));
                }
                Ok(RedisUrls(out))
            }
        }
        d.deserialize_any(V)
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
    /// How often counts are reported (at least 100ms).
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
    /// This proxy's zone and host name in reports (default: `$SPILLWAY_ZONE`, `$HOSTNAME`). An
    /// aggregator of another zone counts the reports (`other_zone`) and warns: the proxy's
    /// `url` names the wrong zone's aggregators.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
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

fn default_admin() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9901))
}

fn yes() -> bool {
    true
}

/// What an encoded path separator gets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PathEscapes {
    #[default]
    Keep,
    Reject,
}

/// Rejection log lines per rule per second unless configured.
pub const DEFAULT_LOG_REJECTIONS: u32 = 10;

fn default_log_rejections() -> u32 {
    DEFAULT_LOG_REJECTIONS
}

/// What a `GET` or `HEAD` request with a body gets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum BodiesOnGet {
    /// Forwarded with `Connection: close`; its upstream connection is never reused (search
    /// APIs send JSON bodies on GET).
    #[default]
    Forward,
    /// Answered 400, the connection closed.
    Reject,
}

/// How rules compare paths.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PathMatch {
    #[default]
    Lenient,
    Strict,
}

/// An `Upgrade` protocol that may be forwarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum UpgradeProtocol {
    Websocket,
}

impl UpgradeProtocol {
    /// The protocol's token in `Upgrade` (compared without case).
    pub fn token(self) -> &'static str {
        match self {
            UpgradeProtocol::Websocket => "websocket",
        }
    }
}

pub(crate) fn default_upgrades() -> Vec<UpgradeProtocol> {
    vec![UpgradeProtocol::Websocket]
}

/// How the client address is found.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(try_from = "RawClientIp", into = "RawClientIp")]
pub struct ClientIp {
    /// The proxies (CIDR blocks) whose `X-Forwarded-For`, `X-Forwarded-Host`/`-Proto` and
    /// cost headers are believed; empty: the socket peer is the client.
    pub trusted_proxies: Vec<crate::key::Cidr>,
    /// `X-Forwarded-For` entries walked at most; `None`: until an address outside the list.
    pub trusted_hops: Option<u8>,
    /// Public IPv4 clients are keyed by this prefix (default 32, the address).
    pub ipv4_prefix: u8,
    /// Public IPv6 clients are keyed by this prefix (default 64: one host's whole block).
    pub ipv6_prefix: u8,
}

impl Default for ClientIp {
    fn default() -> Self {
        ClientIp {
            trusted_proxies: Vec::new(),
            trusted_hops: None,
            ipv4_prefix: 32,
            ipv6_prefix: 64,
        }
    }
}

impl ClientIp {
    /// The key module's policy for this section.
    pub fn policy(&self) -> crate::key::ClientIpPolicy {
        crate::key::ClientIpPolicy {
            proxies: self.trusted_proxies.clone(),
            max_hops: self
                .trusted_hops
                .filter(|h| *h > 0)
                .map_or(usize::MAX, usize::from),
            ipv4_prefix: self.ipv4_prefix,
            ipv6_prefix: self.ipv6_prefix,
        }
    }
}

#[derive(Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct RawClientIp {
    #[serde(default)]
    trusted_proxies: Vec<CidrStr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    trusted_hops: Option<u8>,
    #[serde(default = "default_v4_prefix")]
    ipv4_prefix: u8,
    #[serde(default = "default_v6_prefix")]
    ipv6_prefix: u8,
}

fn default_v4_prefix() -> u8 {
    32
}

fn default_v6_prefix() -> u8 {
    64
}

impl TryFrom<RawClientIp> for ClientIp {
    type Error = String;
    fn try_from(r: RawClientIp) -> Result<Self, String> {
        if r.trusted_proxies.is_empty() && r.trusted_hops.is_some_and(|h| h > 0) {
            return Err(format!(
                "trusted_hops: {} reads X-Forwarded-For, which any client can write; list the proxies that add it (trusted_proxies: [10.0.0.0/8], your ingress's addresses) or remove trusted_hops",
                r.trusted_hops.unwrap_or(0)
            ));
        }
        if !(1..=32).contains(&r.ipv4_prefix) {
            return Err(format!("ipv4_prefix: {}: must be 1 to 32", r.ipv4_prefix));
        }
        if !(1..=128).contains(&r.ipv6_prefix) {
            return Err(format!("ipv6_prefix: {}: must be 1 to 128", r.ipv6_prefix));
        }
        Ok(ClientIp {
            trusted_proxies: r.trusted_proxies.into_iter().map(|c| c.0).collect(),
            trusted_hops: r.trusted_hops,
            ipv4_prefix: r.ipv4_prefix,
            ipv6_prefix: r.ipv6_prefix,
        })
    }
}

impl From<ClientIp> for RawClientIp {
    fn from(c: ClientIp) -> Self {
        RawClientIp {
            trusted_proxies: c.trusted_proxies.into_iter().map(CidrStr).collect(),
            trusted_hops: c.trusted_hops,
            ipv4_prefix: c.ipv4_prefix,
            ipv6_prefix: c.ipv6_prefix,
        }
    }
}

/// A CIDR block as written in YAML.
struct CidrStr(crate::key::Cidr);

impl<'de> Deserialize<'de> for CidrStr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map(CidrStr).map_err(de::Error::custom)
    }
}

impl Serialize for CidrStr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&self.0)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Timeouts {
    /// A client must send a whole request head within this: a new connection's first, and
    /// each later one from its first byte.
    pub header_read: Dur,
    /// A kept-alive client connection waits this long for the first byte of its next request
    /// (above what load balancers keep idle connections for, so they close first); an HTTP/2
    /// connection with no open stream for this long is closed with GOAWAY.
    pub client_idle: Dur,
    /// A connection to the upstream must be made within this (3 s by default: longer than
    /// the 1 s after which Linux retries a SYN the app's full backlog dropped, and the wait
    /// counts while the worker is busy with other connections).
    pub upstream_connect: Dur,
    /// From the request sent upstream to the response head received.
    pub upstream_response: Dur,
    /// A client that accepts no byte of a response for this long is disconnected (an HTTP/2
    /// stream whose window stays shut: its response is dropped), freeing its slots.
    pub send: Dur,
    /// An upstream connection idle this long is not used again.
    #[serde(default = "unset")]
    #[schemars(default = "default_upstream_idle")]
    pub upstream_idle: Dur,
    /// The old name of `upstream_idle`, still read (with a warning at start-up); settled
    /// into `upstream_idle` as the file is read.
    #[serde(skip_serializing)]
    pub idle: Option<Dur>,
    /// On shutdown, in-flight requests get this long to finish.
    pub drain: Dur,
}

fn default_upstream_idle() -> Dur {
    Timeouts::default().upstream_idle
}

/// `upstream_idle` not given (in a `timeouts:` section that is).
fn unset() -> Dur {
    Dur(Duration::MAX)
}

impl Timeouts {
    /// How long an upstream connection may stay unused: `upstream_idle`, or the old `idle`.
    pub fn upstream_idle(&self) -> Duration {
        match self.upstream_idle == unset() {
            true => self.idle.unwrap_or(Timeouts::default().upstream_idle).0,
            false => self.upstream_idle.0,
        }
    }

    /// `upstream_idle` from the one of its two names given; both is an error.
    fn settle(&mut self) -> Result<(), String> {
        if self.idle.is_some() && self.upstream_idle != unset() {
            return Err("timeouts: give upstream_idle alone (idle is its old name)".into());
        }
        self.upstream_idle = Dur(self.upstream_idle());
        Ok(())
    }
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            header_read: Dur(Duration::from_secs(10)),
            upstream_connect: Dur(Duration::from_secs(3)),
            upstream_response: Dur(Duration::from_secs(30)),
            send: Dur(Duration::from_secs(60)),
            client_idle: Dur(Duration::from_secs(75)),
            upstream_idle: Dur(Duration::from_secs(60)),
            idle: None,
            drain: Dur(Duration::from_secs(25)),
        }
    }
}

/// Protective limits on what clients may send.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Larger request heads get 431.
    pub max_header_bytes: HeaderBytes,
    /// Connections accepted at once; further ones wait in the kernel backlog.
    pub max_connections: NonZeroU32,
    /// Concurrent streams per HTTP/2 connection.
    pub max_h2_streams: NonZeroU32,
    /// Upstream connections open at once, idle ones included (default: `max_connections`, so
    /// that the descriptor budget is two per client connection).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_upstream_connections: Option<NonZeroU32>,
    /// Upstream connections one client connection uses at once (its HTTP/2 streams).
    pub max_upstream_per_client: NonZeroU32,
}

impl Limits {
    /// `max_upstream_connections`, or its default.
    pub fn upstream_connections(&self) -> u32 {
        self.max_upstream_connections
            .unwrap_or(self.max_connections)
            .get()
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_header_bytes: HeaderBytes(16 * 1024),
            max_connections: NonZeroU32::new(10_000).expect("non-zero"),
            max_h2_streams: NonZeroU32::new(256).expect("non-zero"),
            max_upstream_connections: None,
            max_upstream_per_client: NonZeroU32::new(32).expect("non-zero"),
        }
    }
}

/// Which responses carry the `RateLimit` / `RateLimit-Policy` headers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum HeaderMode {
    Always,
    #[default]
    OnReject,
    Never,
}

/// One rate-limiting rule.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(try_from = "RawRule", into = "RawRule")]
pub struct Rule {
    pub name: Name,
    pub matcher: Match,
    pub key: KeySpec,
    pub limit: Limit,
    /// Units each request takes (rate limits only).
    pub cost: Cost,
    pub on_limit: OnLimit,
    /// With `on_limit: delay` (1 s by default): the longest a request may wait for the
    /// limiter. With a leaky bucket: the longest it may wait in the queue (else its burst
    /// bounds the wait).
    pub max_delay: Option<Dur>,
    /// With `on_limit: delay`: requests of this rule that may wait at once.
    pub max_queue: NonZeroU32,
    pub scope: Scope,
    /// For `scope: global`: a local limit that applies while the control plane is stale.
    pub fallback: Option<Limit>,
    pub mode: Mode,
    /// Keys tracked at most; past it, keys that find no idle state to replace are decided by
    /// the rule's count-min sketch (rate limits).
    pub max_keys: NonZeroU32,
    /// The size of that sketch.
    pub sketch: SketchSize,
}

/// A count-min sketch's shape: `depth` rows of `width` counters, for each of two windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SketchSize {
    pub width: NonZeroU32,
    pub depth: NonZeroU32,
}

impl Default for SketchSize {
    fn default() -> Self {
        SketchSize {
            width: NonZeroU32::new(4096).expect("non-zero"),
            depth: NonZeroU32::new(4).expect("non-zero"),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct RawRule {
    name: Name,
    #[serde(default, rename = "match")]
    matcher: Match,
    key: KeySpec,
    limit: Limit,
    #[serde(default)]
    cost: Option<Cost>,
    #[serde(default)]
    on_limit: OnLimit,
    /// Only with `on_limit: delay` (default 1 s) or a leaky bucket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_delay: Option<Dur>,
    /// Only with `on_limit: delay` (default 100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_queue: Option<NonZeroU32>,
    #[serde(default)]
    scope: Scope,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    fallback: Option<Limit>,
    #[serde(default)]
    mode: Mode,
    #[serde(default = "default_max_keys")]
    max_keys: NonZeroU32,
    #[serde(default)]
    sketch: SketchSize,
}

fn default_max_keys() -> NonZeroU32 {
    NonZeroU32::new(100_000).expect("non-zero")
}

fn default_max_queue() -> NonZeroU32 {
    NonZeroU32::new(100).expect("non-zero")
}

fn default_max_delay() -> Dur {
    Dur(Duration::from_secs(1))
}

/// Memory a sliding-window-log rule may hold at most, over all its keys.
const SLIDING_LOG_BUDGET: u64 = 1 << 30;

impl TryFrom<RawRule> for Rule {
    type Error = String;
    fn try_from(r: RawRule) -> Result<Self, String> {
        // The parser locates this error at the rule, not at one field: name the rule.
        check_rule(&r).map_err(|e| format!("rule {}: {e}", r.name))?;
        Ok(Rule {
            name: r.name,
            matcher: r.matcher,
            key: r.key,
            limit: r.limit,
            cost: r.cost.unwrap_or(Cost::Fixed(1)),
            on_limit: r.on_limit,
            max_delay: match r.on_limit {
                OnLimit::Delay => Some(r.max_delay.unwrap_or_else(default_max_delay)),
                OnLimit::Reject => r.max_delay,
            },
            max_queue: r.max_queue.unwrap_or_else(default_max_queue),
            scope: r.scope,
            fallback: r.fallback,
            mode: r.mode,
            max_keys: r.max_keys,
            sketch: r.sketch,
        })
    }
}

/// What one field of a rule cannot tell alone: how its limit, cost and delay fit together.
fn check_rule(r: &RawRule) -> Result<(), String> {
    // A field the proxy removes from every request would never be there to match or key by.
    let removed = r
        .key
        .0
        .iter()
        .filter_map(|p| match p {
            KeyPart::Header(h) => Some(h),
            _ => None,
        })
        .chain(r.matcher.headers.0.iter().map(|(h, _)| h))
        .chain(r.matcher.headers_present.iter().map(|h| &h.0))
        .chain(r.matcher.headers_absent.iter().map(|h| &h.0))
        .find(|h| crate::key::is_client_claim(h.as_str()));
    if let Some(h) = removed {
        return Err(format!(
            "{h}: the proxy removes this field from every request (a client can write it and the app might believe it), so no rule can match or key by it"
        ));
    }
    // Accepted and then ignored would be worse than refused: say which setting does nothing.
    let leaky = matches!(
        r.limit,
        Limit::Rate {
            algorithm: Algorithm::LeakyBucket,
            ..
        }
    );
    if r.on_limit != OnLimit::Delay && r.max_queue.is_some() {
        return Err("max_queue applies only with on_limit: delay".into());
    }
    if r.on_limit != OnLimit::Delay && !leaky && r.max_delay.is_some() {
        return Err(
            "max_delay applies only with on_limit: delay or algorithm: leaky_bucket".into(),
        );
    }
    if matches!(r.fallback, Some(Limit::Concurrency(_) | Limit::Adaptive(_))) {
        return Err("fallback: takes a rate limit".into());
    }
    // As for the rule's own limit: a fixed cost above the burst could never be admitted.
    if let (Some(Limit::Rate { burst, .. }), Some(Cost::Fixed(n))) = (&r.fallback, &r.cost) {
        if *n > burst.get() {
            return Err(format!(
                "cost: {n} exceeds fallback.burst {burst}: such requests could never be admitted while the fallback decides"
            ));
        }
    }
    if let Some(Limit::Rate {
        algorithm, burst, ..
    }) = &r.fallback
    {
        match algorithm {
            Algorithm::LeakyBucket => return Err("fallback.algorithm: leaky_bucket shapes by making requests wait, which a global or redis rule does not do; use another algorithm".into()),
            Algorithm::SlidingWindowLog => {
                let worst = u64::from(burst.get())
                    * u64::from(r.max_keys.get())
                    * crate::limit::sliding_window_log::BYTES_PER_ENTRY;
                if worst > SLIDING_LOG_BUDGET {
                    return Err(format!(
                        "fallback: sliding_window_log keeps 16 bytes per request in the window: burst {burst} x max_keys {} could take {} MiB; lower them (at most 1024 MiB)",
                        r.max_keys,
                        worst >> 20
                    ));
                }
            }
            _ => {}
        }
    }
    if u64::from(r.sketch.width.get()) * u64::from(r.sketch.depth.get()) > 1 << 24 {
        return Err("sketch: width x depth must be at most 16777216 counters".into());
    }
    if let Limit::Adaptive(_) = r.limit {
        if r.scope != Scope::Local {
            return Err("an adaptive limit is local: it follows this proxy's upstream".into());
        }
        if !r.key.0.is_empty() {
            return Err(
                "an adaptive limit is one per rule (the upstream's capacity): give key: []".into(),
            );
        }
        if r.cost.is_some() || r.on_limit == OnLimit::Delay || r.fallback.is_some() {
            return Err("an adaptive limit takes no cost, on_limit: delay or fallback".into());
        }
        return Ok(());
    }
    if r.scope == Scope::Global {
        match &r.limit {
            Limit::Concurrency(_) => {
                return Err("scope: global takes a rate limit, not concurrency".into())
            }
            Limit::Rate { algorithm, .. } if *algorithm != Algorithm::TokenBucket => {
                return Err(
                    "limit.algorithm: a global rule is enforced by drop ratios; give no algorithm"
                        .into(),
                )
            }
            _ => {}
        }
        if r.on_limit == OnLimit::Delay {
            return Err("on_limit: delay applies to local rules, not global ones".into());
        }
        if let Limit::Rate { rate, burst, .. } = &r.limit {
            if *burst != rate.count {
                return Err(format!(
                    "limit.burst: a global rule's fleet-wide limit is its rate ({rate}), enforced by drop ratios that have no burst; give the burst to its fallback"
                ));
            }
        }
        if !matches!(r.cost, None | Some(Cost::Fixed(1))) {
            return Err("cost: global rules count requests; give no cost".into());
        }
        if let Some(Limit::Concurrency(_)) = r.fallback {
            return Err("fallback: takes a rate limit".into());
        }
    } else if r.scope == Scope::Redis {
        match &r.limit {
            Limit::Concurrency(_) => {
                return Err("scope: redis takes a rate limit, not concurrency".into())
            }
            Limit::Rate {
                algorithm: Algorithm::LeakyBucket,
                ..
            } => {
                return Err("limit.algorithm: leaky_bucket shapes by waiting in one proxy; with scope: redis use token_bucket, gcra, fixed_window, sliding_window_log or sliding_window_counter".into())
            }
            _ => {}
        }
        if r.on_limit == OnLimit::Delay {
            return Err("on_limit: delay applies to local rules, not redis ones".into());
        }
        if let Some(Limit::Concurrency(_)) = r.fallback {
            return Err("fallback: takes a rate limit".into());
        }
    } else if r.fallback.is_some() {
        return Err("fallback: applies to scope: global and scope: redis rules only".into());
    }
    {
        match (&r.limit, &r.cost) {
            (Limit::Concurrency(_), Some(_)) => {
                return Err("cost: applies to rate limits, not to concurrency".into())
            }
            (Limit::Concurrency(_), None) if r.on_limit == OnLimit::Delay => {
                return Err("on_limit: delay applies to rate limits, not to concurrency".into())
            }
            (Limit::Rate { burst, .. }, Some(Cost::Fixed(n))) if *n > burst.get() => {
                return Err(format!(
                    "cost: {n} exceeds limit.burst {burst}: such requests could never be admitted"
                ))
            }
            (
                Limit::Rate {
                    burst,
                    algorithm: Algorithm::SlidingWindowLog,
                    ..
                },
                _,
            ) if r.scope != Scope::Redis => {
                let worst = u64::from(burst.get())
                    * u64::from(r.max_keys.get())
                    * crate::limit::sliding_window_log::BYTES_PER_ENTRY;
                if worst > SLIDING_LOG_BUDGET {
                    return Err(format!(
                        "limit: sliding_window_log keeps 16 bytes per request in the window: burst {burst} x max_keys {} could take {} MiB; lower them (at most 1024 MiB)",
                        r.max_keys,
                        worst >> 20
                    ));
                }
            }
            _ => {}
        }
        if r.on_limit == OnLimit::Delay && leaky {
            return Err("on_limit: delay is redundant with leaky_bucket, which always queues (its burst is the queue)".into());
        }
        Ok(())
    }
}

impl From<Rule> for RawRule {
    fn from(r: Rule) -> Self {
        RawRule {
            name: r.name,
            matcher: r.matcher,
            key: r.key,
            limit: r.limit,
            cost: Some(r.cost),
            on_limit: r.on_limit,
            max_delay: r.max_delay,
            max_queue: (r.on_limit == OnLimit::Delay).then_some(r.max_queue),
            scope: r.scope,
            fallback: r.fallback,
            mode: r.mode,
            max_keys: r.max_keys,
            sketch: r.sketch,
        }
    }
}

/// What a rule does with a request over its limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnLimit {
    /// Answer 429 at once.
    #[default]
    Reject,
    /// Wait (up to `max_delay`, at most `max_queue` at once) until the limiter admits it.
    Delay,
}

/// Units a request takes: a constant, or read from a request header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cost {
    Fixed(u32),
    Header {
        header: http::HeaderName,
        /// When the header is absent or not honoured (>= 1).
        default: u32,
        /// Larger values count as this.
        max: u32,
        /// Whose header is honoured.
        from: CostFrom,
    },
}

/// Whose cost header a rule honours.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CostFrom {
    /// Only a peer in `client_ip.trusted_proxies` (a gateway that computed it); from anyone
    /// else the header is ignored and `default` applies.
    #[default]
    Trusted,
    /// Anyone: a client then names its own price, up to `max`.
    Any,
}

#[derive(Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct RawCostHeader {
    header: HeaderNameStr,
    #[serde(default = "one")]
    default: NonZeroU32,
    max: NonZeroU32,
    #[serde(default)]
    from: CostFrom,
}

fn one() -> NonZeroU32 {
    NonZeroU32::MIN
}

impl<'de> Deserialize<'de> for Cost {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Cost;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a whole number >= 1, or { header: NAME, default: N, max: N }")
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<Cost, E> {
                match u32::try_from(n) {
                    Ok(n) if n >= 1 => Ok(Cost::Fixed(n)),
                    _ => Err(E::custom(format!("{n}: must be between 1 and 4294967295"))),
                }
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<Cost, E> {
                Err(E::custom(format!("{n}: must be >= 1")))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Cost, A::Error> {
                let raw = RawCostHeader::deserialize(de::value::MapAccessDeserializer::new(map))?;
                if raw.default > raw.max {
                    return Err(de::Error::custom(format!(
                        "default {} exceeds max {}",
                        raw.default, raw.max
                    )));
                }
                Ok(Cost::Header {
                    header: raw.header.0,
                    default: raw.default.get(),
                    max: raw.max.get(),
                    from: raw.from,
                })
            }
        }
        d.deserialize_any(V)
    }
}

impl Serialize for Cost {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Cost::Fixed(n) => s.serialize_u32(*n),
            Cost::Header {
                header,
                default,
                max,
                from,
            } => RawCostHeader {
                header: HeaderNameStr(header.clone()),
                default: NonZeroU32::new(*default).unwrap_or(NonZeroU32::MIN),
                max: NonZeroU32::new(*max).unwrap_or(NonZeroU32::MIN),
                from: *from,
            }
            .serialize(s),
        }
    }
}

/// Which requests a rule applies to; every given condition must hold.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Match {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_prefix: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_regex: Option<PathRegex>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<HostPattern>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub methods: Vec<MethodName>,
    #[serde(default, skip_serializing_if = "HeaderEquals::is_empty")]
    pub headers: HeaderEquals,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers_present: Vec<HeaderNameStr>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers_absent: Vec<HeaderNameStr>,
}

/// A rule's limit: a rate (with `burst` and an algorithm), or a concurrency cap.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(try_from = "RawLimit", into = "RawLimit")]
pub enum Limit {
    Rate {
        rate: Rate,
        burst: NonZeroU32,
        algorithm: Algorithm,
        quota: Quota,
    },
    /// Requests of a key in flight at once.
    Concurrency(NonZeroU32),
    /// Requests of the rule in flight at once, a limit that follows the upstream's latency.
    Adaptive(AdaptiveSpec),
}

/// `limit: { adaptive: { min, max, initial, tolerance } }`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AdaptiveSpec {
    #[serde(default = "default_adaptive_min")]
    pub min: NonZeroU32,
    pub max: NonZeroU32,
    /// Where the limit starts (default: `min`); it doubles each good window until latency
    /// first rises.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial: Option<NonZeroU32>,
    /// Latency up to this many times the learned no-load latency is fine (1.1 to 10).
    #[serde(default = "default_tolerance")]
    pub tolerance: f64,
}

fn default_adaptive_min() -> NonZeroU32 {
    NonZeroU32::new(1).expect("non-zero")
}

fn default_tolerance() -> f64 {
    2.0
}

impl AdaptiveSpec {
    pub fn settings(&self) -> crate::limit::adaptive::Settings {
        crate::limit::adaptive::Settings {
            min: self.min.get(),
            max: self.max.get(),
            initial: self.initial.unwrap_or(self.min).get(),
            tolerance: self.tolerance,
        }
    }

    fn check(&self) -> Result<(), String> {
        if self.min > self.max {
            return Err(format!(
                "adaptive: min {} is above max {}",
                self.min, self.max
            ));
        }
        if let Some(i) = self.initial {
            if i < self.min || i > self.max {
                return Err(format!("adaptive: initial {i} is outside min..max"));
            }
        }
        if !(1.1..=10.0).contains(&self.tolerance) {
            return Err(format!(
                "adaptive: tolerance {} must be between 1.1 and 10",
                self.tolerance
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct RawLimit {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rate: Option<Rate>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    burst: Option<NonZeroU32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    algorithm: Option<Algorithm>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    concurrency: Option<NonZeroU32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    adaptive: Option<AdaptiveSpec>,
}

impl TryFrom<RawLimit> for Limit {
    type Error = String;
    fn try_from(raw: RawLimit) -> Result<Self, String> {
        if let Some(spec) = raw.adaptive {
            if raw.rate.is_some()
                || raw.concurrency.is_some()
                || raw.burst.is_some()
                || raw.algorithm.is_some()
            {
                return Err("adaptive takes no rate, burst, algorithm or concurrency".into());
            }
            spec.check()?;
            return Ok(Limit::Adaptive(spec));
        }
        match (raw.rate, raw.concurrency) {
            (Some(rate), None) => {
                let burst = raw.burst.unwrap_or(rate.count);
                let algorithm = raw.algorithm.unwrap_or_default();
                if algorithm == Algorithm::SlidingWindowCounter
                    && burst.get() > crate::limit::sliding_window_counter::MAX_LIMIT
                {
                    return Err(format!(
                        "sliding_window_counter counts up to {} per window; burst is {burst}",
                        crate::limit::sliding_window_counter::MAX_LIMIT
                    ));
                }
                let quota = Quota::new(rate.count, rate.period, burst)
                    .map_err(|e| format!("rate {rate}: {e}"))?;
                Ok(Limit::Rate {
                    rate,
                    burst,
                    algorithm,
                    quota,
                })
            }
            (None, Some(n)) => {
                if raw.burst.is_some() || raw.algorithm.is_some() {
                    return Err("concurrency takes no burst or algorithm".into());
                }
                Ok(Limit::Concurrency(n))
            }
            (Some(_), Some(_)) => Err("give either rate or concurrency, not both".into()),
            (None, None) => Err(
                "missing rate (such as 10/s), concurrency (such as 4) or adaptive (such as { max: 100 })"
                    .into(),
            ),
        }
    }
}

impl From<Limit> for RawLimit {
    fn from(l: Limit) -> Self {
        match l {
            Limit::Rate {
                rate,
                burst,
                algorithm,
                ..
            } => RawLimit {
                rate: Some(rate),
                burst: Some(burst),
                algorithm: Some(algorithm),
                concurrency: None,
                adaptive: None,
            },
            Limit::Concurrency(n) => RawLimit {
                rate: None,
                burst: None,
                algorithm: None,
                concurrency: Some(n),
                adaptive: None,
            },
            Limit::Adaptive(spec) => RawLimit {
                rate: None,
                burst: None,
                algorithm: None,
                concurrency: None,
                adaptive: Some(spec),
            },
        }
    }
}

/// Where a rule's state lives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    #[default]
    Local,
    Global,
    Redis,
}

impl<'de> Deserialize<'de> for Scope {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parse_str(d, |s: &str| match s {
            "local" => Ok(Scope::Local),
            "global" => Ok(Scope::Global),
            "redis" => Ok(Scope::Redis),
            _ => Err(format!(
                "unknown variant `{s}`, expected one of `local`, `global`, `redis`"
            )),
        })
    }
}

/// Whether a rule rejects or only counts what it would have rejected.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    #[default]
    Enforce,
    Shadow,
}

// ---------------------------------------------------------------------------------------------
// Value types, validated while deserialized.

/// Deserializes a string and parses it inside the visitor, so that the YAML parser attaches
/// the value's own line and field path to a parse error.
fn parse_str<'de, D, T, F>(d: D, parse: F) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    F: FnOnce(&str) -> Result<T, String>,
{
    struct ParseVisitor<F>(F);
    impl<'de, T, F: FnOnce(&str) -> Result<T, String>> Visitor<'de> for ParseVisitor<F> {
        type Value = T;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a string")
        }
        fn visit_str<E: de::Error>(self, s: &str) -> Result<T, E> {
            (self.0)(s).map_err(E::custom)
        }
    }
    d.deserialize_str(ParseVisitor(parse))
}

fn err(message: impl fmt::Display) -> String {
    message.to_string()
}

/// A name used in metrics labels and headers: `[A-Za-z0-9_.-]{1,64}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(transparent)]
pub struct Name(pub String);

impl<'de> Deserialize<'de> for Name {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parse_str(d, |s: &str| {
            let ok = !s.is_empty()
                && s.len() <= 64
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
            if ok {
                Ok(Name(s.to_string()))
            } else {
                Err(err(format!(
                    "{s:?}: names are 1 to 64 of A-Z a-z 0-9 _ - ."
                )))
            }
        })
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A duration such as `250ms`, `1s`, `5m`, `2h`, `1d`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dur(pub Duration);

impl FromStr for Dur {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        parse_duration(s).map(Dur)
    }
}

/// Parses `250ms`, `1s`, `5m`, `2h`, `1d` (an integer and a unit).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("{s:?}: missing unit (ms, s, m, h or d)"))?;
    let (num, unit) = s.split_at(split);
    if num.is_empty() {
        return Err(format!(
            "{s:?}: expected a number then a unit, such as 250ms or 5s"
        ));
    }
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?}: number too large"))?;
    let per = match unit {
        "ms" => Duration::from_millis(1),
        "s" => Duration::from_secs(1),
        "m" => Duration::from_secs(60),
        "h" => Duration::from_secs(3600),
        "d" => Duration::from_secs(86_400),
        _ => {
            return Err(format!(
                "{s:?}: unknown unit {unit:?} (expected ms, s, m, h or d)"
            ))
        }
    };
    per.checked_mul(u32::try_from(n).map_err(|_| format!("{s:?}: number too large"))?)
        .ok_or_else(|| format!("{s:?}: too long"))
}

pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    for (unit, size) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1000),
    ] {
        if ms != 0 && ms % size == 0 {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parse_str(d, |s: &str| s.parse())
    }
}

impl Serialize for Dur {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_duration(self.0))
    }
}

/// A rate: `N/s`, `N/m`, `N/h`, `N/d`, or `N/<duration>` such as `100/10s`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    pub count: NonZeroU32,
    pub period: Duration,
}

impl FromStr for Rate {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (n, per) = s
            .split_once('/')
            .ok_or_else(|| format!("{s:?}: expected N/unit, such as 10/s or 100/10s"))?;
        let count: u32 = n
            .trim()
            .parse()
            .map_err(|_| format!("{s:?}: {n:?} is not a whole number"))?;
        let count =
            NonZeroU32::new(count).ok_or_else(|| format!("{s:?}: the count must be > 0"))?;
        let per = per.trim();
        let period = match per {
            "s" => Duration::from_secs(1),
            "m" => Duration::from_secs(60),
            "h" => Duration::from_secs(3600),
            "d" => Duration::from_secs(86_400),
            _ if per.starts_with(|c: char| c.is_ascii_digit()) => parse_duration(per)?,
            _ => {
                return Err(format!(
                    "{s:?}: unknown unit {per:?} (expected s, m, h, d or a duration such as 10s)"
                ))
            }
        };
        if period.is_zero() {
            return Err(format!("{s:?}: the period must be > 0"));
        }
        Ok(Rate { count, period })
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let unit = match self.period.as_secs() {
            1 if self.period.subsec_nanos() == 0 => "s".to_string(),
            60 if self.period.subsec_nanos() == 0 => "m".to_string(),
            3600 if self.period.subsec_nanos() == 0 => "h".to_string(),
            86_400 if self.period.subsec_nanos() == 0 => "d".to_string(),
            _ => format_duration(self.period),
        };
        write!(f, "{}/{unit}", self.count)
    }
}

impl<'de> Deserialize<'de> for Rate {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parse_str(d, |s: &str| s.parse())
    }
}

impl Serialize for Rate {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// An upstream base URL: `http://host:port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    pub authority: http::uri::Authority,
    /// `h2c://`: the upstream speaks HTTP/2 with prior knowledge (gRPC apps); else HTTP/1.1.
    pub h2: bool,
}

impl<'de> Deserialize<'de> for Upstream {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parse_str(d, |s: &str| {
            let uri: http::Uri = s
                .parse()
                .map_err(|e| err(format!("{s:?}: not a URL: {e}")))?;
            let h2 = match uri.scheme_str() {
                Some("http") => false,
                Some("h2c") => true,
                Some("https") => {
                    return Err(err(format!(
                        "{s:?}: https upstreams are not supported; the upstream is the app beside us, e.g. http://127.0.0.1:9000"
                    )))
                }
                _ => {
                    return Err(err(format!(
                        "{s:?}: expected http://host:port (or h2c://host:port for HTTP/2)"
                    )))
                }
            };
            if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
                return Err(err(format!(
                    "{s:?}: the upstream takes no path; requests keep theirs"
                )));
            }
            let authority = uri
                .authority()
                .cloned()
                .ok_or_else(|| err(format!("{s:?}: missing host")))?;
            Ok(Upstream { authority, h2 })
        })
    }
}

impl Serialize for Upstream {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let scheme = if self.h2 { "h2c" } else { "http" };
        s.collect_str(&format_args!("{scheme}://{}", self.authority))
    }
}

/// The control plane's base URL: `http://host:port` or `https://host:port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlUrl(pub http::Uri);

impl ControlUrl {
    pub fn tls(&self) -> bool {
        self.0.scheme_str() == Some("https")
    }
}

impl<'de> Deserialize<'de> for ControlUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parse_str(d, |s: &str| {
            let uri: http::Uri = s
                .parse()
                .map_err(|e| err(format!("{s:?}: not a URL: {e}")))?;
            if !matches!(uri.scheme_str(), Some("http" | "https")) {
                return Err(err(format!(
                    "{s:?}: the control plane speaks http:// or https://"
                )));
            }
            if uri.authority().is_none() || !matches!(uri.path(), "" | "/") || uri.query().is_some()
            {
                return Err(err(format!("{s:?}: expected http(s)://host:port")));
            }
            Ok(ControlUrl(uri))
        })
    }
}

impl Serialize for ControlUrl {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&self.0)
    }
}

/// A header-size limit in bytes, at least 1 KiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct HeaderBytes(pub usize);

impl<'de> Deserialize<'de> for HeaderBytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = usize::deserialize(d)?;
        if (1024..=1024 * 1024).contains(&n) {
            Ok(HeaderBytes(n))
        } else {
            Err(de::Error::custom(format!(
                "{n}: must be between 1024 and 1048576"
            )))
        }
    }
}

/// A compiled `path_regex`.
#[derive(Debug, Clone)]
pub struct PathRegex(pub regex::Regex);

impl<'de> Deserialize<'de> for PathRegex {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parse_str(d, |s: &str| {
            regex::RegexBuilder::new(s)
                .size_limit(1 << 20)
                .build()
                .map(PathRegex)
                .map_err(|e| err(format!("{s:?}: bad regex: {e}")))
        })
    }
}

impl Serialize for PathRegex {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.0.as_str())
    }
}

/// `host`: an exact host name, or `*.example.com` for any subdomain. Case-insensitive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct HostPattern(pub String);

impl<'de> Deserialize<'de> for HostPattern {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parse_str(d, |s: &str| {
            let s = s.to_ascii_lowercase();
            let bare = s.strip_prefix("*.").unwrap_or(&s);
            if bare.is_empty()
                || !bare
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
            {
                return Err(err(format!(
                    "{s:?}: expected a host name such as api.example.com or *.example.com"
                )));
            }
            Ok(HostPattern(s))
        })
    }
}

/// An HTTP method name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MethodName(pub http::Method);

impl<'de> Deserialize<'de> for MethodName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parse_str(d, |s: &str| {
            if s.is_empty() || !s.bytes().all(|b| b.is_ascii_uppercase()) {
                return Err(err(format!(
                    "{s:?}: methods are upper case, such as GET or POST"
                )));
            }
            http::Method::from_bytes(s.as_bytes())
                .map(MethodName)
                .map_err(|_| err(format!("{s:?}: not a method")))
        })
    }
}

impl Serialize for MethodName {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.0.as_str())
    }
}

/// A header name, stored lower case.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderNameStr(pub http::HeaderName);

impl<'de> Deserialize<'de> for HeaderNameStr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parse_str(d, |s: &str| {
            http::HeaderName::from_bytes(s.to_ascii_lowercase().as_bytes())
                .map(HeaderNameStr)
                .map_err(|_| err(format!("{s:?}: not a header name")))
        })
    }
}

impl Serialize for HeaderNameStr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.0.as_str())
    }
}

/// `headers: {x-plan: premium}`: each named header must be present with exactly that value.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderEquals(pub Vec<(http::HeaderName, http::HeaderValue)>);

impl<'de> Deserialize<'de> for HeaderEquals {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let map = BTreeMap::<String, String>::deserialize(d)?;
        let mut out = Vec::with_capacity(map.len());
        for (k, v) in map {
            let name = http::HeaderName::from_bytes(k.to_ascii_lowercase().as_bytes())
                .map_err(|_| de::Error::custom(format!("{k:?}: not a header name")))?;
            let value = http::HeaderValue::from_str(&v)
                .map_err(|_| de::Error::custom(format!("{k}: {v:?}: not a header value")))?;
            out.push((name, value));
        }
        Ok(HeaderEquals(out))
    }
}

impl HeaderEquals {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl Serialize for HeaderEquals {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(
            self.0
                .iter()
                .map(|(k, v)| (k.as_str(), v.to_str().unwrap_or(""))),
        )
    }
}

/// What a rule counts by: one part, or a tuple of parts. `[]` is one bucket for everyone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySpec(pub Vec<KeyPart>);

impl<'de> Deserialize<'de> for KeySpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = KeySpec;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a key part (client_ip, header:NAME, query:NAME, path, method, host) or a list of them")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<KeySpec, E> {
                Ok(KeySpec(vec![s.parse().map_err(E::custom)?]))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<KeySpec, A::Error> {
                let mut parts = Vec::new();
                while let Some(s) = seq.next_element::<String>()? {
                    let part: KeyPart = s.parse().map_err(de::Error::custom)?;
                    if parts.contains(&part) {
                        return Err(de::Error::custom(format!("{s:?} appears twice")));
                    }
                    parts.push(part);
                }
                if parts.len() > 8 {
                    return Err(de::Error::custom("at most 8 parts in a key"));
                }
                Ok(KeySpec(parts))
            }
        }
        d.deserialize_any(V)
    }
}

impl Serialize for KeySpec {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(|p| p.to_string()))
    }
}

// ---------------------------------------------------------------------------------------------
// Loading and errors.

/// A configuration that could not be read or is not valid.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{file}: cannot read: {source}")]
    Read {
        file: String,
        source: std::io::Error,
    },
    /// `file:line:column: field.path: what is wrong`.
    #[error("{file}{}: {message}", location(*line, *column))]
    Invalid {
        file: String,
        line: Option<usize>,
        column: Option<usize>,
        message: String,
    },
}

fn location(line: Option<usize>, column: Option<usize>) -> String {
    match (line, column) {
        (Some(l), Some(c)) => format!(":{l}:{c}"),
        (Some(l), None) => format!(":{l}"),
        _ => String::new(),
    }
}

impl Config {
    /// Reads and validates the file at `path`.
    pub fn load(path: impl AsRef<Path>) -> Result<Config, ConfigError> {
        let path = path.as_ref();
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            file: file.clone(),
            source,
        })?;
        Config::from_yaml(&text, &file)
    }

    /// Parses and validates YAML text; `file` names it in errors.
    pub fn from_yaml(text: &str, file: &str) -> Result<Config, ConfigError> {
        let mut config: Config = parse_yaml(text, file)?;
        if let Err(message) = config.timeouts.settle() {
            return Err(ConfigError::Invalid {
                file: file.to_string(),
                line: text
                    .lines()
                    .position(|l| l.starts_with("timeouts:"))
                    .map(|i| i + 1),
                column: None,
                message,
            });
        }
        if config.service.0.starts_with(['_', '.']) {
            return Err(ConfigError::Invalid {
                file: file.to_string(),
                line: text
                    .lines()
                    .position(|l| l.starts_with("service:"))
                    .map(|i| i + 1),
                column: None,
                message: format!(
                    "service: {:?}: names starting with _ or . are reserved (the control plane's token files _aggregators and _admin, a Secret's ..data)",
                    config.service.0
                ),
            });
        }
        check_rule_names(&config.rules, text, file)?;
        config.check_control_plane(text, file)?;
        config.check_redis(text, file)?;
        Ok(config)
    }

    /// Redis rules need a `redis:` section, and `on_error: fallback` a fallback on each of them.
    fn check_redis(&self, text: &str, file: &str) -> Result<(), ConfigError> {
        let invalid = |rule: &Rule, message: String| ConfigError::Invalid {
            file: file.to_string(),
            line: line_of_nth_name(text, &rule.name.0, 1),
            column: None,
            message: format!("rule {}: {message}", rule.name),
        };
        let mut redis_rules = self.rules.iter().filter(|r| r.scope == Scope::Redis);
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

    /// Global rules need somewhere to report; intervals must make sense together.
    fn check_control_plane(&self, text: &str, file: &str) -> Result<(), ConfigError> {
        let invalid = |line, message: String| ConfigError::Invalid {
            file: file.to_string(),
            line,
            column: None,
            message,
        };
        if let Some(cp) = &self.control_plane {
            let line = text
                .lines()
                .position(|l| l.starts_with("control_plane:"))
                .map(|i| i + 1);
            if cp.ca_file.is_some() && !cp.url.tls() {
                return Err(invalid(
                    line,
                    "control_plane.ca_file: only used with an https:// url".into(),
                ));
            }
            if cp.report_interval.0 < Duration::from_millis(100) {
                return Err(invalid(
                    line,
                    "control_plane.report_interval: must be at least 100ms".into(),
                ));
            }
            if cp.stale_after.0 < cp.report_interval.0 * 2 {
                return Err(invalid(
                    line,
                    "control_plane.stale_after: must be at least two report intervals".into(),
                ));
            }
        } else if let Some(rule) = self.rules.iter().find(|r| r.scope == Scope::Global) {
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
}

/// Deserializes YAML into `T`, turning the parser's error into file:line:column: path: what.
pub(crate) fn parse_yaml<T: serde::de::DeserializeOwned>(
    text: &str,
    file: &str,
) -> Result<T, ConfigError> {
    serde_norway::from_str(text).map_err(|e| {
        let loc = e.location();
        let mut message = e.to_string();
        if let Some(l) = &loc {
            let suffix = format!(" at line {} column {}", l.line(), l.column());
            if let Some(stripped) = message.strip_suffix(&suffix) {
                message = stripped.to_string();
            }
        }
        let (mut line, mut column) = (
            loc.as_ref().map(|l| l.line()),
            loc.as_ref().map(|l| l.column()),
        );
        // A rule-level check is located by the parser at the list, not the rule: point at the
        // rule's name instead.
        if let Some(rest) = message.strip_prefix("rules: rule ") {
            if let Some((name, _)) = rest.split_once(": ") {
                if let Some(l) = line_of_nth_name(text, name, 1) {
                    (line, column) = (Some(l), None);
                    message = format!("rule {rest}");
                }
            }
        }
        ConfigError::Invalid {
            file: file.to_string(),
            line,
            column,
            message,
        }
    })
}

/// Rule names are metric labels and header values: they must be unique.
pub(crate) fn check_rule_names(rules: &[Rule], text: &str, file: &str) -> Result<(), ConfigError> {
    for (i, rule) in rules.iter().enumerate() {
        if rules[..i].iter().any(|r| r.name == rule.name) {
            return Err(ConfigError::Invalid {
                file: file.to_string(),
                line: line_of_nth_name(text, &rule.name.0, 2),
                column: None,
                message: format!("rules[{i}].name: duplicate rule name {:?}", rule.name.0),
            });
        }
    }
    Ok(())
}

/// Best effort: the line of the `n`th `name: <value>` in the text.
pub(crate) fn line_of_nth_name(text: &str, value: &str, n: usize) -> Option<usize> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| {
            let t = l.trim_start().trim_start_matches("- ").trim_start();
            t.strip_prefix("name:")
                .map(|v| v.trim().trim_matches(|c| c == '"' || c == '\'') == value)
                .unwrap_or(false)
        })
        .nth(n - 1)
        .map(|(i, _)| i + 1)
}

pub mod schema;

#[cfg(test)]
mod tests;
