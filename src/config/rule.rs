//! One rate-limiting rule as configured: its match, key, limit, cost, scope, fallback and mode,
//! and the checks across those fields (`check_rule`) that refuse what would be accepted and do
//! nothing. Must never: accept a combination that means something else than it says.

use super::*;

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
    /// When a concurrency slot is given back: at the response's end (default), or at its
    /// head (`concurrency:` with `release: head`; an adaptive limit always does).
    pub release: Release,
    /// A shared (`key: []`) concurrency or adaptive limit: the part of its slots one client
    /// address may hold (`DEFAULT_CLIENT_SHARE` unless set; 1 = no part). `None` elsewhere.
    pub client_share: Option<f64>,
    /// `timeouts.upstream_body_idle` for the requests this rule applies to (event streams):
    /// the longest of the rules that apply and set it wins over the global one.
    pub upstream_body_idle: Option<Dur>,
    /// How the key's `header:` and `query:` parts are shown in logs and sent to the control
    /// plane: as a keyed digest (default), or in clear.
    pub log_keys: LogKeys,
    /// For `scope: redis`: the keys this proxy has not seen lately that it may send to Redis
    /// each second (as many again at once); past it such a key gets 429 here, so that a client
    /// rotating keys cannot fill Redis.
    pub new_keys: NonZeroU32,
    /// Rules this one stands in for: they do not apply to a request this rule applies to.
    pub replaces: Vec<Name>,
    /// Keys with a limit of their own.
    pub overrides: Vec<Override>,
    /// A file of more such keys, reloaded whenever it changes (a bad one keeps the last).
    pub overrides_file: Option<std::path::PathBuf>,
}

/// How a rule's private key parts are shown and sent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum LogKeys {
    /// `~` and the HMAC of the value under `key_secret_file` (see `spillway digest`).
    #[default]
    Digest,
    /// As the client sent them (tokens and API keys in the log: opt in knowingly).
    Clear,
}

/// When a request gives back its concurrency slot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Release {
    /// When the response body ends (for endpoints whose work is the response's time).
    #[default]
    End,
    /// When the response head comes (for event streams and long downloads).
    Head,
}

/// A count-min sketch's shape: `depth` rows of `width` counters, for each of two windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SketchSize {
    /// Counters in each row; `width` x `depth` is at most 16777216.
    pub width: NonZeroU32,
    /// Rows of counters: a key is refused only when its estimate reaches the burst in every
    /// row.
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

/// One rate-limiting rule: the requests it applies to, what it counts them by, and its limit.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRule {
    /// The rule's name, unique in the file: a metric label and a header value.
    pub(super) name: Name,
    /// Which requests the rule applies to (default: all of them).
    #[serde(default, rename = "match")]
    pub(super) matcher: Match,
    /// What the rule counts by, each key with a limit of its own; the rule does not apply to a
    /// request missing a part (a header or query parameter absent).
    pub(super) key: KeySpec,
    /// A rate (with `burst` and `algorithm`), a concurrency cap, or an adaptive one.
    pub(super) limit: Limit,
    /// Units each request takes of a rate (1 when unset): a whole number, a request header's,
    /// or what the app's response says.
    #[serde(default)]
    pub(super) cost: Option<Cost>,
    /// What a request over the limit gets: `reject` (429 at once) or `delay` (it waits until
    /// the limiter admits it, up to `max_delay`).
    #[serde(default)]
    pub(super) on_limit: OnLimit,
    /// With `on_limit: delay` (default 1s): the longest a request may wait for the limiter.
    /// With a leaky bucket: the longest it may wait in the queue (else its burst bounds it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) max_delay: Option<Dur>,
    /// With `on_limit: delay` only: requests of the rule that may wait at once (default 100);
    /// past it, 429 at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) max_queue: Option<NonZeroU32>,
    /// Where the rule's state lives: `local` (this proxy), `global` (fleet-wide, through
    /// `control_plane`) or `redis` (exact and shared, through `redis`).
    #[serde(default)]
    pub(super) scope: Scope,
    /// A rate limit counted in this proxy alone: for `scope: global`, while the control plane
    /// is stale; for `scope: redis`, when Redis fails under `on_error: fallback`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) fallback: Option<Limit>,
    /// `enforce` refuses; `shadow` decides and counts what it would have refused, and refuses
    /// nothing.
    #[serde(default)]
    pub(super) mode: Mode,
    /// Keys tracked at most; past it, keys that find no idle state to replace are decided by
    /// the rule's count-min sketch (rate limits).
    #[serde(default = "default_max_keys")]
    pub(super) max_keys: NonZeroU32,
    /// The count-min sketch that decides keys finding no place past `max_keys`.
    #[serde(default)]
    pub(super) sketch: SketchSize,
    /// With `concurrency:` only: when a slot is given back, at the response's `end` (the
    /// default) or at its `head` (event streams, long downloads).
    #[serde(default, skip_serializing_if = "is_end")]
    pub(super) release: Release,
    /// With `key: []` and a concurrency or adaptive limit only: the part of its slots one client
    /// address may hold at once (default 0.5; 1: no part).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) client_share: Option<f64>,
    /// `timeouts.upstream_body_idle` for the requests this rule applies to (event streams;
    /// at least 100ms): the longest of the rules that apply and set it wins.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) upstream_body_idle: Option<Dur>,
    /// How the key's `header:` and `query:` parts are shown in logs and sent to the control
    /// plane: `digest` (keyed by `key_secret_file`, the default) or `clear` (as sent).
    #[serde(default, skip_serializing_if = "is_digest")]
    pub(super) log_keys: LogKeys,
    /// With `scope: redis` only: keys this proxy has not seen lately that it may send to Redis
    /// each second (default 1000); past it such a key gets 429 here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) new_keys: Option<NonZeroU32>,
    /// Rules this one stands in for (a more specific rule for a general one): they do not
    /// apply to a request this rule applies to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(super) replaces: Vec<Name>,
    /// Keys with a limit of their own: more, less, or none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(super) overrides: Vec<Override>,
    /// A YAML file of more such entries, reloaded whenever it changes (a bad one keeps the
    /// last).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) overrides_file: Option<std::path::PathBuf>,
}

fn is_digest(l: &LogKeys) -> bool {
    *l == LogKeys::Digest
}

fn is_end(r: &Release) -> bool {
    *r == Release::End
}

/// The part of a shared concurrency or adaptive limit one client may hold by default.
pub const DEFAULT_CLIENT_SHARE: f64 = 0.5;

/// Whether `r`'s limit is one pool of slots for every client: a share applies to it.
fn shared_slots(r: &RawRule) -> bool {
    matches!(r.limit, Limit::Concurrency(_) | Limit::Adaptive(_)) && r.key.0.is_empty()
}

pub(super) fn default_max_keys() -> NonZeroU32 {
    NonZeroU32::new(100_000).expect("non-zero")
}

pub(super) fn default_new_keys() -> NonZeroU32 {
    NonZeroU32::new(1000).expect("non-zero")
}

pub(super) fn default_max_queue() -> NonZeroU32 {
    NonZeroU32::new(100).expect("non-zero")
}

pub(super) fn default_max_delay() -> Dur {
    Dur(Duration::from_secs(1))
}

/// Memory a sliding-window-log rule may hold at most, over all its keys.
pub(super) const SLIDING_LOG_BUDGET: u64 = 1 << 30;

impl TryFrom<RawRule> for Rule {
    type Error = String;
    fn try_from(r: RawRule) -> Result<Self, String> {
        // The parser locates this error at the rule, not at one field: name the rule.
        check_rule(&r).map_err(|e| format!("rule {}: {e}", r.name))?;
        check_overridable(&r).map_err(|e| format!("rule {}: {e}", r.name))?;
        if r.overrides.len() > MAX_OVERRIDES {
            return Err(format!(
                "rule {}: overrides: at most {MAX_OVERRIDES} entries",
                r.name
            ));
        }
        let client_share = shared_slots(&r).then(|| r.client_share.unwrap_or(DEFAULT_CLIENT_SHARE));
        let rule = Rule {
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
            release: r.release,
            client_share,
            upstream_body_idle: r.upstream_body_idle,
            log_keys: r.log_keys,
            new_keys: r.new_keys.unwrap_or_else(default_new_keys),
            replaces: r.replaces,
            overrides: r.overrides,
            overrides_file: r.overrides_file,
        };
        for (i, o) in rule.overrides.iter().enumerate() {
            if o.key.0.len() != rule.key.0.len() {
                return Err(format!(
                    "rule {}: overrides[{i}]: key {}: the rule's key has {} part(s); write their values in order",
                    rule.name,
                    o.key,
                    rule.key.0.len()
                ));
            }
            check_own(&rule, &o.limit)
                .map_err(|e| format!("rule {}: overrides[{i}] ({}): {e}", rule.name, o.key))?;
        }
        Ok(rule)
    }
}

/// What one field of a rule cannot tell alone: how its limit, cost and delay fit together.
pub(super) fn check_rule(r: &RawRule) -> Result<(), String> {
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
    match (&r.limit, r.release) {
        (_, Release::End) | (Limit::Concurrency(_), Release::Head) => {}
        (Limit::Adaptive(_), Release::Head) => {
            return Err(
                "release: an adaptive limit always gives its slot back at the response head".into(),
            )
        }
        (Limit::Rate { .. }, Release::Head) => {
            return Err("release: applies to concurrency limits, not to rates".into())
        }
    }
    if r.upstream_body_idle
        .is_some_and(|d| d.0 < super::LEAST_TIMEOUT)
    {
        return Err(format!("upstream_body_idle: at least {:?} (the silence a response body may keep; the workers' timers tick at half the shortest)", super::LEAST_TIMEOUT));
    }
    if let Some(share) = r.client_share {
        if !(share > 0.0 && share <= 1.0) {
            return Err(format!(
                "client_share: {share} is not a part of the limit's slots: more than 0, at most 1 (1 = none)"
            ));
        }
        if !shared_slots(r) {
            return Err("client_share: applies to a shared (key: []) concurrency or adaptive limit; a keyed one is per key already, a rate has no slots".into());
        }
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
    if let Some(Cost::Response(cost)) = &r.cost {
        check_response_cost(r, cost)?;
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
    if r.new_keys.is_some() && r.scope != Scope::Redis {
        return Err("new_keys: applies to scope: redis rules only".into());
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

/// What a response cost needs of its rule: a bucket that can be charged after the decision,
/// and a request that is decided once.
fn check_response_cost(r: &RawRule, cost: &ResponseCost) -> Result<(), String> {
    if r.on_limit == OnLimit::Delay {
        return Err("on_limit: delay waits for units before the request goes on; a response's cost is known only after it has gone, so there is nothing to wait for: use on_limit: reject".into());
    }
    match r.scope {
        Scope::Local => {}
        // Redis's scripts take at least one unit a decision.
        Scope::Redis if cost.reserve == 0 => {
            return Err(
                "cost.reserve: at least 1 with scope: redis (a decision there takes a unit)".into(),
            )
        }
        Scope::Redis => {}
        // What a key's share on one proxy holds of debt (`crate::rules::SHARE_MAX_UNITS`).
        Scope::Global if cost.max > 1 << 22 => {
            return Err(format!(
                "cost.max: {} is more than a global rule charges one call (4194304)",
                cost.max
            ))
        }
        Scope::Global => {}
    }
    match &r.limit {
        Limit::Rate {
            algorithm: Algorithm::TokenBucket | Algorithm::Gcra,
            burst,
            ..
        } => {
            // A global rule's reservation is only its keys' first estimate: no bucket holds it.
            if r.scope != Scope::Global && cost.reserve > burst.get() {
                return Err(format!(
                    "cost.reserve: {} exceeds limit.burst {burst}: such requests could never be admitted",
                    cost.reserve
                ));
            }
            Ok(())
        }
        Limit::Rate { algorithm, .. } => Err(format!(
            "cost.response: a response's cost is charged as debt to a token_bucket or gcra (a budget that refills); {} cannot owe units",
            algorithm.name()
        )),
        Limit::Concurrency(_) | Limit::Adaptive(_) => {
            Err("cost: applies to rate limits, not to concurrency".into())
        }
    }
}

impl From<Rule> for RawRule {
    fn from(r: Rule) -> Self {
        // A concurrency or adaptive limit takes no cost: printed, it would not read back.
        let slots = matches!(r.limit, Limit::Adaptive(_) | Limit::Concurrency(_));
        let cost = (!slots).then_some(r.cost.clone());
        RawRule {
            name: r.name,
            matcher: r.matcher,
            key: r.key,
            limit: r.limit,
            cost,
            on_limit: r.on_limit,
            max_delay: r.max_delay,
            max_queue: (r.on_limit == OnLimit::Delay).then_some(r.max_queue),
            scope: r.scope,
            fallback: r.fallback,
            mode: r.mode,
            max_keys: r.max_keys,
            sketch: r.sketch,
            release: r.release,
            client_share: r.client_share,
            upstream_body_idle: r.upstream_body_idle,
            log_keys: r.log_keys,
            new_keys: (r.scope == Scope::Redis).then_some(r.new_keys),
            replaces: r.replaces,
            overrides: r.overrides,
            overrides_file: r.overrides_file,
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

/// Units a request takes: a constant, read from a request header, or what the app's response
/// says it consumed (charged after the response).
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
    Response(ResponseCost),
}

impl Cost {
    /// The units taken when the request is decided: all of them, or a response cost's
    /// reservation.
    pub fn response(&self) -> Option<&ResponseCost> {
        match self {
            Cost::Response(r) => Some(r),
            _ => None,
        }
    }
}

/// A cost known only once the app has answered: the request is admitted while its key's
/// budget is not in debt (taking `reserve` up front), and the units the response says are
/// charged when it says them, the reservation reconciled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseCost {
    pub usage: Usage,
    /// Units taken at admission (0: admitted while not in debt), given back or topped up once
    /// the response's units are known.
    pub reserve: u32,
    /// Usage past this counts as this (and is counted as clamped).
    pub max: u32,
    /// Charged when the response never says its units (the field missing or malformed, or
    /// the response cut short before it): at least 1 (by default `max`), never nothing by
    /// accident.
    pub unknown: u32,
}

/// Where a response says what it consumed. Only the app's response is read: the client never
/// names its own usage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Usage {
    /// A response header field: one whole number.
    Header(HeaderNameStr),
    /// A trailer field (HTTP/1 chunked, HTTP/2): one whole number.
    Trailer(HeaderNameStr),
    /// The body's bytes delivered to the client (counted as they are sent; a body cut short
    /// is charged what was sent).
    BodyBytes,
    /// Whole numbers at JSON pointers of a JSON body, or of an event stream's events (the
    /// last found at each pointer), summed.
    Json(crate::usage::Pointers),
}

/// `{ header: NAME }`, `{ trailer: NAME }` or `{ json: POINTERS }`: one of them.
#[derive(Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUsageField {
    /// A response header field holding one whole number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) header: Option<HeaderNameStr>,
    /// A trailer field (HTTP/1 chunked, HTTP/2) holding one whole number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) trailer: Option<HeaderNameStr>,
    /// JSON pointers (`/usage/total_tokens`), one or a list summed, or `openai` or
    /// `anthropic`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) json: Option<OneOrMany>,
}

/// One string, or a list of them.
#[derive(Deserialize, Serialize, JsonSchema)]
#[serde(untagged)]
pub(super) enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl<'de> Deserialize<'de> for Usage {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Usage;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(
                    "{ header: NAME }, { trailer: NAME }, { json: POINTERS }, json or body_bytes",
                )
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Usage, E> {
                match v {
                    "body_bytes" => Ok(Usage::BodyBytes),
                    "json" => crate::usage::Pointers::parse(crate::usage::OPENAI.iter().copied())
                        .map(Usage::Json)
                        .map_err(E::custom),
                    _ => Err(E::custom(format!(
                        "{v}: give {{ header: NAME }}, {{ trailer: NAME }}, {{ json: POINTERS }}, json or body_bytes"
                    ))),
                }
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Usage, A::Error> {
                let raw = RawUsageField::deserialize(de::value::MapAccessDeserializer::new(map))?;
                match (raw.header, raw.trailer, raw.json) {
                    (Some(h), None, None) => Ok(Usage::Header(h)),
                    (None, Some(t), None) => Ok(Usage::Trailer(t)),
                    (None, None, Some(j)) => {
                        let list = match &j {
                            OneOrMany::One(p) => vec![p.as_str()],
                            OneOrMany::Many(ps) => ps.iter().map(String::as_str).collect(),
                        };
                        crate::usage::Pointers::parse(list)
                            .map(Usage::Json)
                            .map_err(de::Error::custom)
                    }
                    _ => Err(de::Error::custom(
                        "give one of header:, trailer: or json: (where the app's response says its usage)",
                    )),
                }
            }
        }
        d.deserialize_any(V)
    }
}

impl Serialize for Usage {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let field = |header, trailer, json| RawUsageField {
            header,
            trailer,
            json,
        };
        match self {
            Usage::Header(h) => field(Some(h.clone()), None, None).serialize(s),
            Usage::Trailer(t) => field(None, Some(t.clone()), None).serialize(s),
            Usage::BodyBytes => s.serialize_str("body_bytes"),
            Usage::Json(p) => {
                field(None, None, Some(OneOrMany::Many(p.text().to_vec()))).serialize(s)
            }
        }
    }
}

/// `{ response, reserve, max, unknown }`: the units the app's response says it consumed,
/// charged once it says them; a key's requests are admitted while its budget is not in debt.
#[derive(Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RawResponseCost {
    /// Where the response says its units.
    pub(super) response: Usage,
    /// Units taken at admission (default 1), reconciled once the response says its units.
    #[serde(default = "one_u32")]
    pub(super) reserve: u32,
    /// Usage past this counts as this.
    pub(super) max: NonZeroU32,
    /// Charged when the response never says its units (default: max).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) unknown: Option<NonZeroU32>,
}

fn one_u32() -> u32 {
    1
}

/// Either map form of a cost, read whole before it is told apart.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCostMap {
    header: Option<HeaderNameStr>,
    default: Option<NonZeroU32>,
    max: NonZeroU32,
    from: Option<CostFrom>,
    response: Option<Usage>,
    reserve: Option<u32>,
    unknown: Option<NonZeroU32>,
}

impl RawCostMap {
    fn cost(self) -> Result<Cost, String> {
        let max = self.max.get();
        if let Some(usage) = self.response {
            if self.header.is_some() || self.default.is_some() || self.from.is_some() {
                return Err("a response cost takes response, reserve, max and unknown; header, default and from are a request header's cost".into());
            }
            let reserve = self.reserve.unwrap_or(1);
            if reserve > max {
                return Err(format!("reserve {reserve} exceeds max {max}"));
            }
            if usage == Usage::BodyBytes && self.unknown.is_some() {
                return Err("unknown: a body's bytes are always known (a body cut short is charged what was sent)".into());
            }
            // Unsaid, a call is charged as the most it could have used: a client that can keep
            // the usage out of the answer (a stream without its usage chunk, a disconnect
            // before it) gains nothing by it.
            let unknown = self.unknown.map_or(max, NonZeroU32::get);
            if unknown > max {
                return Err(format!("unknown {unknown} exceeds max {max}"));
            }
            return Ok(Cost::Response(ResponseCost {
                usage,
                reserve,
                max,
                unknown,
            }));
        }
        let Some(header) = self.header else {
            return Err(
                "give header: (a request header's cost) or response: (the app's response's)".into(),
            );
        };
        if self.reserve.is_some() || self.unknown.is_some() {
            return Err("reserve and unknown apply to a response cost (response:)".into());
        }
        let default = self.default.map_or(1, NonZeroU32::get);
        if default > max {
            return Err(format!("default {default} exceeds max {max}"));
        }
        Ok(Cost::Header {
            header: header.0,
            default,
            max,
            from: self.from.unwrap_or_default(),
        })
    }
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

/// `{ header, default, max, from }`: the units a request header says the request takes.
#[derive(Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCostHeader {
    /// The request header that says the units: a whole number of at least 1 (one read that is
    /// not gets 400).
    pub(super) header: HeaderNameStr,
    /// Units when the header is absent or not honoured.
    #[serde(default = "one")]
    pub(super) default: NonZeroU32,
    /// Larger values count as this.
    pub(super) max: NonZeroU32,
    /// Whose header is honoured: `trusted` (a peer in `client_ip.trusted_proxies`) or `any`
    /// (every client names its own cost, up to `max`).
    #[serde(default)]
    pub(super) from: CostFrom,
}

pub(super) fn one() -> NonZeroU32 {
    NonZeroU32::MIN
}

impl<'de> Deserialize<'de> for Cost {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Cost;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a whole number >= 1, { header: NAME, default: N, max: N }, or { response: WHERE, reserve: N, max: N }")
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
                RawCostMap::deserialize(de::value::MapAccessDeserializer::new(map))?
                    .cost()
                    .map_err(de::Error::custom)
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
            Cost::Response(r) => RawResponseCost {
                response: r.usage.clone(),
                reserve: r.reserve,
                max: NonZeroU32::new(r.max).unwrap_or(NonZeroU32::MIN),
                unknown: (r.usage != Usage::BodyBytes)
                    .then(|| NonZeroU32::new(r.unknown))
                    .flatten(),
            }
            .serialize(s),
        }
    }
}

/// Which requests a rule applies to; every given condition must hold.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Match {
    /// The path is this one (no query; without case under `path_match: lenient`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// The path starts with this; under `path_match: lenient`, one ending in `/` names a
    /// directory and matches it too (`/api/` matches `/api`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_prefix: Option<String>,
    /// The path matches this regular expression (no query); under `path_match: lenient`,
    /// without case, and tried again on the path with a trailing slash.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_regex: Option<PathRegex>,
    /// The request's host is this one, or under it with `*.`; a request without a host (HTTP/1.0)
    /// matches every host rule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<HostPattern>,
    /// The method is one of these (`GET` matches `HEAD` too, which most frameworks route to
    /// the GET handler).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub methods: Vec<MethodName>,
    /// Each named header is present with exactly this value: `{x-plan: premium}`.
    #[serde(default, skip_serializing_if = "HeaderEquals::is_empty")]
    pub headers: HeaderEquals,
    /// Each of these headers is present.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers_present: Vec<HeaderNameStr>,
    /// None of these headers is present.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers_absent: Vec<HeaderNameStr>,
    /// The client's address is in one of these blocks: the address the keys use (through
    /// `client_ip.trusted_proxies`), before any prefix cuts it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub client_ip: Vec<super::CidrStr>,
    /// The client's address is in none of these blocks: an exemption (the office, a
    /// partner's range, the cluster's own probes).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub except_client_ip: Vec<super::CidrStr>,
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

/// `limit: { adaptive: { min, max, initial, tolerance } }`: requests of the rule in flight at
/// once, a limit that falls when the upstream's latency rises and grows while it is fine.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AdaptiveSpec {
    /// The least the limit falls to.
    #[serde(default = "default_adaptive_min")]
    pub min: NonZeroU32,
    /// The most the limit grows to.
    pub max: NonZeroU32,
    /// Where the limit starts (default: `min`); it doubles each good window until latency
    /// first rises.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial: Option<NonZeroU32>,
    /// Latency up to this many times the learned no-load latency is fine (1.1 to 10).
    #[serde(default = "default_tolerance")]
    pub tolerance: f64,
}

pub(super) fn default_adaptive_min() -> NonZeroU32 {
    NonZeroU32::new(1).expect("non-zero")
}

pub(super) fn default_tolerance() -> f64 {
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

/// A rule's limit: a `rate` (with `burst` and `algorithm`), a `concurrency` cap, or an
/// `adaptive` one; only one of the three.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLimit {
    /// The long-run rate: `N/s`, `N/m`, `N/h`, `N/d` or `N/<duration>` (`100/10s`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) rate: Option<Rate>,
    /// With `rate`: how much may pass at once (default: the count in `rate`); a window
    /// algorithm admits it per window of `burst / rate`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) burst: Option<NonZeroU32>,
    /// With `rate`: the algorithm that decides it (default `token_bucket`, the only one a
    /// global rule takes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) algorithm: Option<Algorithm>,
    /// Instead of a rate: requests of a key in flight at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) concurrency: Option<NonZeroU32>,
    /// Instead of a rate: requests of the rule in flight at once, a limit that follows the
    /// upstream's latency (`key: []`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) adaptive: Option<AdaptiveSpec>,
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
