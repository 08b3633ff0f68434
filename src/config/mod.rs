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
    /// Admin listener: `/metrics`, `/healthz`, `/readyz` to anyone; and, from loopback only
    /// (or with `admin_token_file`'s token), `/config`, `/ui` (unless `admin_open` names
    /// them), `/explain`, `/top` and `/log-level`.
    #[serde(default = "default_admin")]
    pub admin: SocketAddr,
    /// A file holding a bearer token that opens `/explain`, `/top` and `/log-level` to
    /// requests from beyond loopback (`Authorization: Bearer <token>`), read at each request.
    /// Without it they answer loopback only: never the scraped address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin_token_file: Option<std::path::PathBuf>,
    /// Admin pages served beyond loopback without the token: `config` (the rules, as
    /// loaded), `ui` (the status page; keys still only with the token). Default none: the
    /// pod network reaches what probes and scrapes need, and nothing of the rules.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub admin_open: Vec<AdminPage>,
    /// What the command line put over `listen`, `admin` and `upstream` (already applied):
    /// kept so that a reload of the file keeps it.
    #[serde(skip)]
    #[schemars(skip)]
    pub placement: Placement,
    /// The hosts the app answers for; a request naming another gets 421 (empty: any host).
    /// A request without a host (HTTP/1.0) is served, and every host rule counts it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<ServedHost>,
    /// How the client's address is found (the proxies whose `X-Forwarded-For` is believed),
    /// and the prefixes clients are keyed by.
    #[serde(default)]
    pub client_ip: ClientIp,
    /// Request headers only a proxy in `client_ip.trusted_proxies` may set (a tier, a customer
    /// id): removed from any other peer's requests before the rules or the app see them. The
    /// ingress must overwrite them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub trusted_headers: Vec<HeaderNameStr>,
    /// The secret the `header:` and `query:` parts of keys are digested under in logs and
    /// reports: one per service, the same file on every replica (the chart mounts a Secret).
    /// Without it, a built-in secret: digests anyone can recompute for a value they guess.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_secret_file: Option<std::path::PathBuf>,
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
    /// How long each phase of a connection and of a request may take.
    #[serde(default)]
    pub timeouts: Timeouts,
    /// Which responses carry the `RateLimit` and `RateLimit-Policy` headers: `on_reject` (429s
    /// only), `always` (admitted responses too) or `never`.
    #[serde(default)]
    pub headers: HeaderMode,
    /// Bounds on what clients may hold and send: connections, request heads, HTTP/2 streams,
    /// buffered response bytes, upstream connections.
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
    /// Request ids: whose are taken, and whether the app is sent one made here.
    #[serde(default, skip_serializing_if = "RequestIds::is_default")]
    pub request_id: RequestIds,
    /// An access log (off unless set): every request Spillway refuses or answers itself, and
    /// one in `admitted_one_in` of those it forwards, a line each on stderr (JSON with
    /// `--log-format json`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_log: Option<AccessLog>,
    /// The rate-limiting rules; every rule whose `match` holds applies, and a request is
    /// refused if any enforcing one refuses it (`[]`: a plain proxy).
    #[serde(default)]
    pub rules: Vec<Rule>,
}

/// `request_id:`: the id every answer of Spillway's carries (`x-request-id`, and in its
/// problem document), its rejection and access log lines too.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RequestIds {
    /// Whose `x-request-id` (or `traceparent`) is taken: `trusted` (a peer in
    /// `client_ip.trusted_proxies`, the default), `any`, or `never` (always made here).
    #[serde(default)]
    pub from: crate::ids::IdFrom,
    /// Send the app the id as `x-request-id` when it has none it takes (made here, or a
    /// client's it does not take, replaced). Off by default: the app's request is unchanged.
    #[serde(default)]
    pub forward: bool,
}

impl RequestIds {
    fn is_default(&self) -> bool {
        *self == RequestIds::default()
    }
}

/// `access_log:`: which requests get a line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AccessLog {
    /// One in this many forwarded requests gets a line (1: all; 0: none); every refusal and
    /// every error answered here does, up to `refusals_per_second`.
    #[serde(default = "default_admitted_one_in")]
    pub admitted_one_in: u32,
    /// Lines of refusals and errors a second, at most: a flood of refused requests must not
    /// become a flood of log writes (those past it are counted in
    /// `spillway_access_log_dropped_total`).
    #[serde(default = "default_refusals_per_second")]
    pub refusals_per_second: u32,
}

fn default_admitted_one_in() -> u32 {
    100
}

fn default_refusals_per_second() -> u32 {
    1000
}

fn default_admin() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9901))
}

fn yes() -> bool {
    true
}

/// Where a sidecar listens and forwards when its command line says so, over the file's: an
/// injected pod's, whose limits are its release's ConfigMap, one for every workload.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct Placement {
    /// Where clients connect, over the file's `listen`.
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<SocketAddr>,
    /// The admin listener, over the file's `admin`.
    #[arg(long, value_name = "ADDR")]
    pub admin: Option<SocketAddr>,
    /// The app beside us (`http://host:port`, `h2c://` for HTTP/2), over the file's `upstream`.
    #[arg(long, value_name = "URL", value_parser = parse_upstream)]
    pub upstream: Option<Upstream>,
}

fn parse_upstream(s: &str) -> Result<Upstream, String> {
    use serde::de::IntoDeserializer;
    let d: serde::de::value::StrDeserializer<'_, serde::de::value::Error> = s.into_deserializer();
    Upstream::deserialize(d).map_err(|e| e.to_string())
}

impl Placement {
    /// Puts what was given over `config`'s, and keeps it there for reloads.
    pub fn apply(&self, config: &mut Config) {
        if let Some(a) = self.listen {
            config.listen = a;
        }
        if let Some(a) = self.admin {
            config.admin = a;
        }
        if let Some(u) = &self.upstream {
            config.upstream = u.clone();
        }
        config.placement = self.clone();
    }
}

/// An admin page that `admin_open` may serve beyond loopback.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum AdminPage {
    Config,
    Ui,
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
    /// NAT64 prefixes whose addresses are keyed by the IPv4 client inside (default the
    /// well-known `64:ff9b::/96`; add a local-use one such as `64:ff9b:1:abcd::/96`).
    pub nat64_prefixes: Vec<crate::key::Cidr>,
}

impl Default for ClientIp {
    fn default() -> Self {
        ClientIp {
            trusted_proxies: Vec::new(),
            trusted_hops: None,
            ipv4_prefix: 32,
            ipv6_prefix: 64,
            nat64_prefixes: vec![crate::key::WELL_KNOWN_NAT64],
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
            nat64: self.nat64_prefixes.clone(),
        }
    }
}

/// `client_ip:`: how the client's address is found, and the prefix a public address is keyed
/// by.
#[derive(Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct RawClientIp {
    /// The proxies (CIDR blocks) whose `X-Forwarded-For`, `X-Forwarded-Host`/`-Proto` and
    /// cost headers are believed; empty: the socket peer is the client.
    #[serde(default)]
    trusted_proxies: Vec<CidrStr>,
    /// With `trusted_proxies`: the most `X-Forwarded-For` entries walked (0 or unset: until an
    /// address outside the list); above 0 without them is an error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    trusted_hops: Option<u8>,
    /// The prefix length (1 to 32) public IPv4 clients are keyed by: 32 is the address.
    #[serde(default = "default_v4_prefix")]
    ipv4_prefix: u8,
    /// The prefix length (1 to 128) public IPv6 clients are keyed by: 64 is one host's whole
    /// block, which it can rotate through.
    #[serde(default = "default_v6_prefix")]
    ipv6_prefix: u8,
    /// NAT64 prefixes (RFC 6052: of length 32, 40, 48, 56, 64 or 96) whose addresses are keyed
    /// by the IPv4 client inside; add a local-use one such as `64:ff9b:1:abcd::/96`.
    #[serde(default = "default_nat64")]
    nat64_prefixes: Vec<CidrStr>,
}

fn default_nat64() -> Vec<CidrStr> {
    vec![CidrStr(crate::key::WELL_KNOWN_NAT64)]
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
        for net in &r.nat64_prefixes {
            if !net.0.is_v6() || !crate::key::NAT64_LENGTHS.contains(&net.0.prefix()) {
                return Err(format!(
                    "nat64_prefixes: {}: must be an IPv6 block of length 32, 40, 48, 56, 64 or 96 (RFC 6052)",
                    net.0
                ));
            }
        }
        Ok(ClientIp {
            trusted_proxies: r.trusted_proxies.into_iter().map(|c| c.0).collect(),
            trusted_hops: r.trusted_hops,
            ipv4_prefix: r.ipv4_prefix,
            ipv6_prefix: r.ipv6_prefix,
            nat64_prefixes: r.nat64_prefixes.into_iter().map(|c| c.0).collect(),
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
            nat64_prefixes: c.nat64_prefixes.into_iter().map(CidrStr).collect(),
        }
    }
}

/// A CIDR block as written in YAML.
#[derive(Debug, Clone)]
pub struct CidrStr(pub crate::key::Cidr);

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

/// `timeouts:`: how long each phase of a connection and of a request may take. Those that
/// bound a request's phase are at least 100ms; `client_idle`, `upstream_idle` and `drain` may
/// be 0.
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
    /// A response body the upstream sends no byte of for this long is given up (nginx's
    /// `proxy_read_timeout`): the HTTP/1 client's connection closes, the HTTP/2 stream is
    /// reset, and the upstream connection is closed.
    pub upstream_body_idle: Dur,
    /// A request body the client sends no byte of for this long gets 408 (nginx's
    /// `client_body_timeout`); the upstream connection it went to is closed.
    pub client_body_idle: Dur,
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
        // Every request meets these: below [`LEAST_TIMEOUT`] one would end every request at
        // once. Nothing kept idle and no drain are choices.
        for (name, d) in [
            ("header_read", self.header_read),
            ("upstream_connect", self.upstream_connect),
            ("upstream_response", self.upstream_response),
            ("upstream_body_idle", self.upstream_body_idle),
            ("client_body_idle", self.client_body_idle),
            ("send", self.send),
        ] {
            if d.0 < LEAST_TIMEOUT {
                return Err(format!(
                    "timeouts.{name}: at least {LEAST_TIMEOUT:?} ({:?} would end every request at once)",
                    d.0
                ));
            }
        }
        Ok(())
    }
}

/// The least a timeout that bounds a request's phase may be (the workers' timers tick at half
/// the shortest): the global ones every request meets, and a rule's `upstream_body_idle`.
pub(crate) const LEAST_TIMEOUT: Duration = Duration::from_millis(100);

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            header_read: Dur(Duration::from_secs(10)),
            upstream_connect: Dur(Duration::from_secs(3)),
            upstream_response: Dur(Duration::from_secs(30)),
            upstream_body_idle: Dur(Duration::from_secs(60)),
            client_body_idle: Dur(Duration::from_secs(60)),
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
    /// HTTP/2 response bytes held for clients in all (handed to a connection and not yet
    /// written to its socket): at it, the connection holding the most is closed, and
    /// responses wait, their upstreams unread.
    pub max_response_buffer: BufferBytes,
    /// The same for one HTTP/2 connection: at it, its responses wait for the client to read.
    pub max_response_buffer_per_connection: BufferBytes,
    /// Connections one client (its address; IPv6, its /64) may hold at once; past it, new
    /// ones get 429 and are closed.
    pub max_connections_per_client: NonZeroU32,
    /// Peers without that cap besides `client_ip.trusted_proxies`: a mesh's or an
    /// ingress's proxy, through which every client comes (default: loopback).
    pub connections_per_client_exempt: Vec<CidrStr>,
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
            max_h2_streams: NonZeroU32::new(128).expect("non-zero"),
            max_upstream_connections: None,
            max_upstream_per_client: NonZeroU32::new(32).expect("non-zero"),
            max_response_buffer: BufferBytes(16 << 20),
            max_response_buffer_per_connection: BufferBytes(1 << 20),
            max_connections_per_client: NonZeroU32::new(256).expect("non-zero"),
            connections_per_client_exempt: ["127.0.0.0/8", "::1/128"]
                .iter()
                .map(|c| CidrStr(c.parse().expect("a valid block")))
                .collect(),
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

/// Fields `trusted_headers` cannot name: the proxy frames, routes or forwards by them, and
/// removing a client's would let its body be read as a request no rule saw.
const UNTRUSTABLE: [&str; 14] = [
    "content-length",
    "transfer-encoding",
    "host",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
    "expect",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-proto",
    "forwarded",
];

/// `trusted_headers`, refused when it names a field the proxy itself relies on.
pub(crate) fn check_trusted_headers(headers: &[HeaderNameStr]) -> Result<(), String> {
    match headers.iter().find(|h| UNTRUSTABLE.contains(&h.0.as_str())) {
        Some(h) => Err(format!(
            "trusted_headers: {}: the proxy frames or forwards requests by it; list headers that say who the client is (a tier, a customer id)",
            h.0
        )),
        None => Ok(()),
    }
}

impl Config {
    /// Peers without a per-client bound of their own (connections, a shared limit's part): the
    /// listed proxies and `limits.connections_per_client_exempt`, behind which every client
    /// looks alike.
    pub fn per_client_exempt(&self) -> Vec<crate::key::Cidr> {
        (self.client_ip.trusted_proxies.iter().copied())
            .chain(
                self.limits
                    .connections_per_client_exempt
                    .iter()
                    .map(|c| c.0),
            )
            .collect()
    }

    /// What is valid but likely not meant: said by `check-config` and at start-up, never
    /// refused (a configuration that ran yesterday still runs).
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.hosts.is_empty() {
            for rule in self.rules.iter().filter(|r| r.matcher.host.is_some()) {
                out.push(format!(
                    "rule {}: matches on host, but no hosts: list is set; a request naming any other host (an address, an empty Host) skips the rule and the app serves it: list the hosts the app answers for",
                    rule.name
                ));
            }
            let keyed = |r: &&Rule| r.key.0.contains(&crate::key::KeyPart::Host);
            for rule in self.rules.iter().filter(keyed) {
                out.push(format!(
                    "rule {}: keyed by host, but no hosts: list is set; every Host a client makes up is a key of its own, with a limit of its own: list the hosts the app answers for",
                    rule.name
                ));
            }
        }
        let blocks = self
            .client_ip
            .trusted_proxies
            .iter()
            .map(|c| ("client_ip.trusted_proxies", c))
            .chain(
                self.limits
                    .connections_per_client_exempt
                    .iter()
                    .map(|c| ("limits.connections_per_client_exempt", &c.0)),
            );
        for (field, block) in blocks {
            let wide = block.prefix() < if block.is_v6() { 32 } else { 8 };
            if wide || !block.is_private() {
                out.push(format!(
                    "{field}: {block} {}: every client in it is trusted as a proxy would be; list your ingress's or mesh's own addresses",
                    if wide {
                        "is wider than a /8 (IPv4) or /32 (IPv6)"
                    } else {
                        "holds public addresses"
                    }
                ));
            }
        }
        if let Some(redis) = &self.redis {
            for url in &redis.url.0 {
                if url.starts_with("rediss://") && url.contains("#insecure") {
                    out.push("redis.url: #insecure turns off the check of Redis's certificate: anyone on the path can read and change every count; give redis.ca_file instead".into());
                }
                if !url.contains('@') {
                    out.push("redis.url: no user: every service that shares this Redis can read and change this one's counts; give each service an ACL user of its own (docs/redis.md)".into());
                }
            }
        }
        if self.key_secret_file.is_none()
            && self
                .rules
                .iter()
                .any(|r| r.log_keys == LogKeys::Digest && crate::key::has_private(&r.key.0))
        {
            out.push("key_secret_file: not set; the header and query parts of keys are logged and reported as digests under a built-in secret, which anyone can recompute for a value they guess".into());
        }
        out
    }

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
        check_replaces(&config.rules).map_err(|(i, message)| ConfigError::Invalid {
            file: file.to_string(),
            line: line_of_nth_name(text, &config.rules[i].name.0, 1),
            column: None,
            message,
        })?;
        config
            .check_override_keys()
            .map_err(|(i, message)| ConfigError::Invalid {
                file: file.to_string(),
                line: line_of_nth_name(text, &config.rules[i].name.0, 1),
                column: None,
                message,
            })?;
        check_control_plane(config.control_plane.as_ref(), &config.rules, text, file)?;
        config.check_redis(text, file)?;
        check_trusted_headers(&config.trusted_headers).map_err(|message| ConfigError::Invalid {
            file: file.to_string(),
            line: text
                .lines()
                .position(|l| l.starts_with("trusted_headers:"))
                .map(|i| i + 1),
            column: None,
            message,
        })?;
        Ok(config)
    }
}

/// The deepest nesting a configuration may have (its own is under 10): a file nested
/// thousands deep costs the parser seconds of CPU for nothing.
pub const MAX_DEPTH: usize = 64;

/// The line of the first place `text` nests deeper than [`MAX_DEPTH`]: flow collections
/// (every `[` and `{` counts, in quotes and comments too: telling them apart is the parser's
/// job, and a legitimate file comes nowhere near the bound), counted afresh at each top-level
/// line, and block indentation (two spaces or a `- ` a level, at most).
fn too_deep(text: &str) -> Option<usize> {
    let mut flow = 0usize;
    for (n, line) in text.lines().enumerate() {
        if line.starts_with(|c: char| !c.is_whitespace() && c != '-' && c != ']' && c != '}') {
            flow = 0;
        }
        let indent = line.len() - line.trim_start_matches([' ', '-']).len();
        if indent > 2 * MAX_DEPTH {
            return Some(n + 1);
        }
        for b in line.bytes() {
            match b {
                b'[' | b'{' => {
                    flow += 1;
                    if flow > MAX_DEPTH {
                        return Some(n + 1);
                    }
                }
                b']' | b'}' => flow = flow.saturating_sub(1),
                _ => {}
            }
        }
    }
    None
}

/// Deserializes YAML into `T`, turning the parser's error into file:line:column: path: what.
pub(crate) fn parse_yaml<T: serde::de::DeserializeOwned>(
    text: &str,
    file: &str,
) -> Result<T, ConfigError> {
    if let Some(line) = too_deep(text) {
        return Err(ConfigError::Invalid {
            file: file.to_string(),
            line: Some(line),
            column: None,
            message: format!("nested deeper than {MAX_DEPTH} levels"),
        });
    }
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

mod overrides;
pub mod reference;
mod rule;
pub mod schema;
mod shared;
mod values;

pub use overrides::*;
pub use rule::*;
pub use shared::*;
pub use values::*;

#[cfg(test)]
mod tests;
