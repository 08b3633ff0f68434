//! A rule's `overrides:`: keys with a limit of their own (more, less, or none), written in the
//! configuration or in a file of their own (`overrides_file:`, reloaded apart from it), and the
//! checks that refuse an entry whose limit could not hold as written; and a rule's `replaces:`
//! (a rule that stands in for others), checked across the rule list. Must never: read a
//! file but the one it is asked to, or accept an entry the rule would decide differently.

use super::*;

/// One key's own limit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Override {
    /// The key's value; a key of several parts as the list of their values, in the rule's
    /// order. A `header:` or `query:` value may be written as its digest (`~` and 32 hex
    /// digits, from `spillway digest`), so that API keys need not sit in a ConfigMap.
    pub key: OverrideKey,
    /// `unlimited`, a rate (`{ rate: 10/m, burst: 20 }`, decided by the rule's algorithm), or
    /// `{ concurrency: N }` for a concurrency rule.
    pub limit: OwnLimit,
}

/// An override's key: its parts' values in order.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OverrideKey(pub Vec<String>);

impl<'de> Deserialize<'de> for OverrideKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged, expecting = "a key value, or a list of its parts' values")]
        enum Raw {
            One(String),
            Parts(Vec<String>),
        }
        Ok(OverrideKey(match Raw::deserialize(d)? {
            Raw::One(v) => vec![v],
            Raw::Parts(p) => p,
        }))
    }
}

impl Serialize for OverrideKey {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0.as_slice() {
            [one] => s.serialize_str(one),
            parts => parts.serialize(s),
        }
    }
}

impl fmt::Display for OverrideKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.as_slice() {
            [one] => write!(f, "{one:?}"),
            parts => write!(f, "{parts:?}"),
        }
    }
}

/// A key's own limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OwnLimit {
    /// The rule does not apply to the key at all.
    Unlimited,
    Rate {
        rate: Rate,
        burst: NonZeroU32,
    },
    Concurrency(NonZeroU32),
}

/// A key's own limit: `unlimited`, `{ rate: 10/m, burst: 20 }` or `{ concurrency: 4 }`.
#[derive(Serialize, Deserialize, JsonSchema)]
#[serde(
    untagged,
    expecting = "unlimited, { rate: 10/m, burst: 20 } or { concurrency: 4 }"
)]
enum RawOwn {
    /// `unlimited`: the rule does not apply to the key at all.
    Word(String),
    Rate(OwnRate),
    Concurrency(OwnSlots),
}

/// A key's own rate, decided by the rule's algorithm.
// Unknown fields refused: a misspelt `burst` read as the default would raise nobody.
#[derive(Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct OwnRate {
    /// The key's long-run rate, as a rule's `limit.rate`.
    rate: Rate,
    /// How much may pass at once (default: the count in `rate`); a global rule's key gives
    /// none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    burst: Option<NonZeroU32>,
}

/// A key's own concurrency cap, under a concurrency rule.
#[derive(Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct OwnSlots {
    /// Requests of the key in flight at once.
    concurrency: NonZeroU32,
}

impl<'de> Deserialize<'de> for OwnLimit {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match RawOwn::deserialize(d)? {
            RawOwn::Word(w) if w == "unlimited" => Ok(OwnLimit::Unlimited),
            RawOwn::Word(w) => Err(de::Error::custom(format!(
                "{w:?}: expected unlimited, {{ rate: 10/m, burst: 20 }} or {{ concurrency: 4 }}"
            ))),
            RawOwn::Rate(OwnRate { rate, burst }) => Ok(OwnLimit::Rate {
                rate,
                burst: burst.unwrap_or(rate.count),
            }),
            RawOwn::Concurrency(OwnSlots { concurrency }) => Ok(OwnLimit::Concurrency(concurrency)),
        }
    }
}

impl Serialize for OwnLimit {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match *self {
            OwnLimit::Unlimited => RawOwn::Word("unlimited".into()),
            OwnLimit::Rate { rate, burst } => RawOwn::Rate(OwnRate {
                rate,
                burst: Some(burst),
            }),
            OwnLimit::Concurrency(n) => RawOwn::Concurrency(OwnSlots { concurrency: n }),
        }
        .serialize(s)
    }
}

impl JsonSchema for OwnLimit {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "OwnLimit".into()
    }
    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        RawOwn::json_schema(generator)
    }
}

impl JsonSchema for OverrideKey {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "OverrideKey".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "A key value, or a list of its parts' values in the rule's order.",
            "anyOf": [
                { "type": "string" },
                { "type": "array", "items": { "type": "string" } }
            ]
        })
    }
}

/// The most entries one rule may list (inline and in its file together).
pub const MAX_OVERRIDES: usize = 1_000_000;

/// The most distinct limits one rule's overrides may give (each keeps its own 429s).
pub const MAX_DISTINCT_LIMITS: usize = 1_000;

/// Whether `own` can be a key's limit under `r` (its limit, key, cost and scope): the same
/// kind of limit, a burst that admits the rule's fixed cost, the rule's window for a window
/// algorithm (a state is judged idle by it), and a global rule's burst equal to its rate.
pub fn check_own(r: &Rule, own: &OwnLimit) -> Result<(), String> {
    match (&r.limit, own) {
        (_, OwnLimit::Unlimited) => Ok(()),
        (Limit::Adaptive(_), _) => unreachable!("refused with the rule"),
        (
            Limit::Rate {
                algorithm,
                quota: rule_quota,
                ..
            },
            OwnLimit::Rate { rate, burst },
        ) => {
            let quota = Quota::new(rate.count, rate.period, *burst)
                .map_err(|e| format!("rate {rate}: {e}"))?;
            if let Cost::Fixed(n) = r.cost {
                if n > burst.get() {
                    return Err(format!(
                        "burst {burst} is below the rule's cost {n}: the key could never be admitted"
                    ));
                }
            }
            if r.scope == Scope::Global && *burst != rate.count {
                return Err(format!(
                    "a global rule's limit is its rate ({rate}), which has no burst; give none"
                ));
            }
            let windowed = matches!(
                algorithm,
                Algorithm::FixedWindow
                    | Algorithm::SlidingWindowLog
                    | Algorithm::SlidingWindowCounter
            );
            if windowed && r.scope != Scope::Global && quota.window() != rule_quota.window() {
                let want = u128::from(burst.get()) * rule_quota.window() as u128
                    / quota.window().max(1) as u128;
                return Err(format!(
                    "{algorithm:?} counts in the rule's window ({:?}); a key's own limit keeps it: with rate {rate}, give burst: {want}",
                    std::time::Duration::from_nanos(rule_quota.window())
                ));
            }
            if *algorithm == Algorithm::SlidingWindowCounter
                && burst.get() > crate::limit::sliding_window_counter::MAX_LIMIT
            {
                return Err(format!(
                    "sliding_window_counter counts up to {} per window; burst is {burst}",
                    crate::limit::sliding_window_counter::MAX_LIMIT
                ));
            }
            if *algorithm == Algorithm::SlidingWindowLog
                && r.scope == Scope::Local
                && u64::from(burst.get()) * crate::limit::sliding_window_log::BYTES_PER_ENTRY
                    > SLIDING_LOG_BUDGET / 64
            {
                return Err(format!(
                    "sliding_window_log keeps 16 bytes per request in the window: burst {burst} is too many for one key"
                ));
            }
            Ok(())
        }
        (Limit::Concurrency(_), OwnLimit::Concurrency(_)) => Ok(()),
        (Limit::Rate { .. }, OwnLimit::Concurrency(_)) => {
            Err("the rule limits a rate: give { rate, burst } or unlimited".into())
        }
        (Limit::Concurrency(_), OwnLimit::Rate { .. }) => {
            Err("the rule limits concurrency: give { concurrency: N } or unlimited".into())
        }
    }
}

/// What the rule must be for overrides at all: keyed, not adaptive, its cost known before
/// the response.
pub(super) fn check_overridable(r: &RawRule) -> Result<(), String> {
    if r.overrides.is_empty() && r.overrides_file.is_none() {
        return Ok(());
    }
    if r.key.0.is_empty() {
        return Err("overrides: the rule has one limit for everyone (key: []); a key's own limit needs a key".into());
    }
    if matches!(r.limit, Limit::Adaptive(_)) {
        return Err("overrides: an adaptive limit is one for the upstream, not per key".into());
    }
    if matches!(r.cost, Some(Cost::Response(_))) {
        return Err("overrides: not yet with a cost that is the response's (its charges are settled on the rule's own limit)".into());
    }
    Ok(())
}

/// Reads an `overrides_file`: a YAML list of entries (`- key: ...` / `limit: ...`), or
/// `overrides:` and such a list.
pub fn parse_overrides(text: &str, file: &str) -> Result<Vec<Override>, ConfigError> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Doc {
        List(Vec<Override>),
        Wrapped { overrides: Vec<Override> },
    }
    // An editor that truncates before it writes must not lift every override in force.
    let content = text
        .lines()
        .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'));
    if !content {
        return Err(ConfigError::Invalid {
            file: file.to_string(),
            line: None,
            column: None,
            message: "no entries: write [] for none".into(),
        });
    }
    // The list's own errors are the useful ones: try it first, then the wrapped form.
    match parse_yaml::<Vec<Override>>(text, file) {
        Ok(list) => Ok(list),
        Err(list_error) => match parse_yaml::<Doc>(text, file) {
            Ok(Doc::List(l) | Doc::Wrapped { overrides: l }) => Ok(l),
            Err(_) => Err(list_error),
        },
    }
}

/// Every `replaces:` names another rule of the list, not a rule that replaces it in turn, and
/// no shadow rule replaces one (it would stop limiting what it stands in for).
pub(crate) fn check_replaces(rules: &[Rule]) -> Result<(), (usize, String)> {
    for (i, r) in rules.iter().enumerate() {
        if r.replaces.is_empty() {
            continue;
        }
        if r.mode == Mode::Shadow {
            return Err((i, format!("rule {}: replaces: a shadow rule never refuses, so the rules it replaced would limit nothing; shadow them instead", r.name)));
        }
        for name in &r.replaces {
            if *name == r.name {
                return Err((i, format!("rule {}: replaces: itself", r.name)));
            }
            if !rules.iter().any(|o| o.name == *name) {
                return Err((
                    i,
                    format!("rule {}: replaces: no rule is called {:?}", r.name, name.0),
                ));
            }
        }
    }
    // A cycle would leave every rule in it standing in for another and none applying.
    for (i, r) in rules.iter().enumerate() {
        let mut seen = vec![false; rules.len()];
        let mut todo: Vec<&Name> = r.replaces.iter().collect();
        while let Some(name) = todo.pop() {
            let Some(j) = rules.iter().position(|o| o.name == *name) else {
                continue;
            };
            if j == i {
                return Err((
                    i,
                    format!(
                        "rule {}: replaces: rules that replace each other would all stand aside",
                        r.name
                    ),
                ));
            }
            if !std::mem::replace(&mut seen[j], true) {
                todo.extend(rules[j].replaces.iter());
            }
        }
    }
    Ok(())
}

/// One entry's key in the form its rule's store keeps, and whether that is the shown form
/// (its private parts written as digests).
pub type WrittenKey = (crate::key::KeyBuf, bool);

/// Each of `entries`' key as `r`'s store keeps it (see [`crate::key::written_key`]), each
/// limit checked against the rule ([`check_own`]); no key may be listed twice.
pub fn written_keys(
    r: &Rule,
    entries: &[Override],
    policy: &crate::key::ClientIpPolicy,
    strict_path: bool,
) -> Result<Vec<WrittenKey>, String> {
    if entries.len() > MAX_OVERRIDES {
        return Err(format!(
            "overrides: {} entries, at most {MAX_OVERRIDES}",
            entries.len()
        ));
    }
    let local = r.scope == Scope::Local;
    let limits: std::collections::HashSet<String> =
        entries.iter().map(|o| format!("{:?}", o.limit)).collect();
    if limits.len() > MAX_DISTINCT_LIMITS {
        return Err(format!(
            "overrides: {} distinct limits, at most {MAX_DISTINCT_LIMITS}: give keys limits from a set of tiers",
            limits.len()
        ));
    }
    let mut seen = std::collections::HashMap::with_capacity(entries.len());
    let mut out = Vec::with_capacity(entries.len());
    for (i, o) in entries.iter().enumerate() {
        let at = |e: String| format!("overrides[{i}] ({}): {e}", o.key);
        let written = crate::key::written_key(&r.key.0, &o.key.0, local, (policy, strict_path))
            .map_err(at)?;
        check_own(r, &o.limit).map_err(at)?;
        if let Some(first) = seen.insert(written.clone(), i) {
            return Err(at(format!("the same key as overrides[{first}]")));
        }
        out.push(written);
    }
    Ok(out)
}

/// `r`'s inline entries followed by those of an overrides file (its text and name; `None`:
/// the inline ones only), each with its key as the rule's store keeps it: what a proxy loads,
/// and what `check-config` checks.
pub fn rule_overrides(
    r: &Rule,
    file: Option<(&str, &str)>,
    policy: &crate::key::ClientIpPolicy,
    strict_path: bool,
) -> Result<(Vec<Override>, Vec<WrittenKey>), String> {
    let mut all = r.overrides.clone();
    if let Some((text, name)) = file {
        all.extend(parse_overrides(text, name).map_err(|e| e.to_string())?);
    }
    let keys = written_keys(r, &all, policy, strict_path).map_err(|e| match file {
        Some((_, name)) => format!("{name}: {e}"),
        None => e,
    })?;
    Ok((all, keys))
}

impl Config {
    /// Every rule's inline overrides name keys the rule can have, once each.
    pub(crate) fn check_override_keys(&self) -> Result<(), (usize, String)> {
        let policy = self.client_ip.policy();
        let strict = self.path_match == PathMatch::Strict;
        for (i, r) in self.rules.iter().enumerate() {
            written_keys(r, &r.overrides, &policy, strict)
                .map_err(|e| (i, format!("rule {}: {e}", r.name)))?;
        }
        Ok(())
    }
}

impl Config {
    /// Reads and checks every rule's `overrides_file` as the proxy would load it (with the
    /// rule's inline entries): `spillway check-config`.
    pub fn check_override_files(&self) -> Result<(), String> {
        let policy = self.client_ip.policy();
        let strict = self.path_match == PathMatch::Strict;
        for r in &self.rules {
            let Some(path) = &r.overrides_file else {
                continue;
            };
            let file = path.display().to_string();
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("rule {}: overrides_file {file}: {e}", r.name))?;
            rule_overrides(r, Some((&text, &file)), &policy, strict)
                .map_err(|e| format!("rule {}: overrides_file {e}", r.name))?;
        }
        Ok(())
    }
}
