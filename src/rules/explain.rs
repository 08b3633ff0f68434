//! `explain`: for a described request, which rules match, each one's key as logs and reports
//! show it, that key's state, and what each rule and the whole set would decide now, and why.
//! Owns [`RuleSet::explain`] and [`RuleSet::top`]. Must never: take anything from a key (every
//! decision is made on a copy of its state, or read from it), create a key's state, hold a
//! store's lock beyond one key's copy, write a key's private part, or await (a `scope: redis`
//! rule's question is left to the caller, who asks Redis read only).

use serde::Serialize;

use super::*;

/// What the rules would make of one request now.
#[derive(Debug, Serialize)]
pub struct Explanation {
    /// `admit`, `refuse` (429, or 503 for an adaptive limit), `bad_request` (400), `delay`
    /// (a rule's queue), `unknown` (a rule's decision was not read), or `asks_redis` (the
    /// local rules admit; Redis decides, and was not reached).
    pub decision: &'static str,
    /// The enforcing rule that decides a refusal or a 400.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    /// Seconds a refused client is told to wait (`Retry-After`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after_s: Option<u64>,
    pub rules: Vec<RuleExplained>,
    /// The `scope: redis` rules whose answer is Redis's: for the caller to ask it, read only
    /// ([`RuleSet::redis_question`], [`Explanation::redis_answered`]).
    #[serde(skip)]
    pub asks: Vec<RedisAsk>,
    /// A rule's decision could not be read (a full store's sketch).
    #[serde(skip)]
    unknown: bool,
}

/// A question `explain` leaves to Redis: the rule (`rule`th, `at` in the explanation's list),
/// its key and the request's units. Never shown (the key is as the client sent it).
#[derive(Debug, Clone)]
pub struct RedisAsk {
    at: usize,
    rule: usize,
    key: Vec<u8>,
    cost: u32,
    /// The key's own limit, asked instead of the rule's.
    own: Option<Quota>,
}

/// One rule's part of an [`Explanation`].
#[derive(Debug, Serialize)]
pub struct RuleExplained {
    pub rule: String,
    /// `enforce` or `shadow` (a shadow rule's refusal is counted, never made).
    pub mode: &'static str,
    /// `local`, `global`, `redis`, `concurrency` or `adaptive`.
    pub kind: &'static str,
    /// `admit`, `refuse`, `delay` (`on_limit: delay`: it waits, then is decided again),
    /// `unknown` (decided by a full store's sketch or overflow, not read), `not_matched`,
    /// `replaced` (a rule naming it in `replaces:` applies), `no_key` (the request lacks a key
    /// part: the rule does not apply), `unlimited` (the key's override), `bad_request` or
    /// `asks_redis`.
    pub decision: &'static str,
    /// Why, in a sentence.
    pub reason: String,
    /// The key as the rejection log and the control plane show it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// The key as `top` lists it (local keys are stored in a form of their own).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stored: Option<String>,
    /// The units the request takes under the rule.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub units: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remaining: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after_s: Option<u64>,
    /// The key's state: whatever the rule's kind keeps.
    #[serde(skip_serializing_if = "serde_json::Value::is_null")]
    pub state: serde_json::Value,
    /// The key's own limit (`overrides:`), when it has one.
    #[serde(rename = "override", skip_serializing_if = "Option::is_none")]
    pub own: Option<String>,
}

impl RuleExplained {
    fn new(rule: &CompiledRule, decision: &'static str, reason: String) -> Self {
        RuleExplained {
            rule: rule.name.to_string(),
            mode: match rule.mode {
                Mode::Enforce => "enforce",
                Mode::Shadow => "shadow",
            },
            kind: rule.kind_name(),
            decision,
            reason,
            key: None,
            stored: None,
            units: None,
            remaining: None,
            retry_after_s: None,
            state: serde_json::Value::Null,
            own: None,
        }
    }
}

impl CompiledRule {
    fn kind_name(&self) -> &'static str {
        match &*self.kind {
            Kind::Rate { .. } => "local",
            Kind::Global { .. } => "global",
            Kind::Redis { .. } => "redis",
            Kind::Concurrency { .. } => "concurrency",
            Kind::Adaptive { .. } => "adaptive",
        }
    }
}

/// One key of a rule in [`RuleSet::top`].
#[derive(Debug, Serialize)]
pub struct TopKey {
    pub key: String,
    /// How much of its limit the key holds now: units used of a local limit's burst, in
    /// flight of a concurrency limit's slots, offered since the last report of a global rule.
    pub used: f64,
    /// A request of one unit would be refused now.
    pub limited: bool,
}

/// One rule's most active keys in [`RuleSet::top`].
#[derive(Debug, Serialize)]
pub struct TopRule {
    pub rule: String,
    pub kind: &'static str,
    /// Keys tracked (of which `top` read at most the first 10 000 the store walks).
    pub keys: usize,
    /// What `used` counts.
    pub used: &'static str,
    pub top: Vec<TopKey>,
    /// The keys refused most over this minute and the last, with their refusals counted
    /// (up to a hundred a second: a flood's first each second).
    pub refused: Vec<RefusedKey>,
}

/// A key of [`TopRule::refused`].
#[derive(Debug, Serialize)]
pub struct RefusedKey {
    pub key: String,
    pub refusals: u64,
}

impl RuleSet {
    /// What the rules would decide of `req` at `now`, rule by rule, taking nothing.
    pub fn explain(&self, req: &RequestView<'_>, now: Nanos) -> Explanation {
        let mut out = Explanation {
            decision: "admit",
            by: None,
            retry_after_s: None,
            rules: Vec::with_capacity(self.rules.len()),
            asks: Vec::new(),
            unknown: false,
        };
        let mut key = KeyBuf::new();
        let mut ratios = None;
        let mut redis = false;
        for (i, rule) in self.rules.iter().enumerate() {
            if !rule.matcher.matches(req) {
                out.rules.push(RuleExplained::new(
                    rule,
                    "not_matched",
                    "its match: does not select the request".into(),
                ));
                continue;
            }
            if !rule.replaced_by.is_empty() && self.replaced(rule, req) {
                let by: Vec<&str> = rule
                    .replaced_by
                    .iter()
                    .map(|&j| &*self.rules[j].name)
                    .collect();
                out.rules.push(RuleExplained::new(
                    rule,
                    "replaced",
                    format!(
                        "a rule that replaces it applies to the request ({})",
                        by.join(", ")
                    ),
                ));
                continue;
            }
            let mut e = match rule.key_of(req, &mut key) {
                Extract::Found => RuleExplained::new(rule, "admit", String::new()),
                Extract::Missing => {
                    out.rules.push(RuleExplained::new(
                        rule,
                        "no_key",
                        "the request lacks a part of the rule's key: the rule does not apply"
                            .into(),
                    ));
                    continue;
                }
                Extract::Repeated => {
                    let bad = rule.repeated_key(req);
                    let e = RuleExplained::new(rule, "bad_request", bad.detail);
                    out.decided(rule, "bad_request", None);
                    out.rules.push(e);
                    continue;
                }
            };
            e.key = Some(String::from_utf8_lossy(&self.shown_key(rule, req)).into_owned());
            if !matches!(&*rule.kind, Kind::Global { .. } | Kind::Adaptive { .. }) {
                e.stored = Some(self.stored_form(rule, &key));
            }
            let table;
            let own = match &rule.overrides {
                None => None,
                Some(o) => {
                    table = o.load();
                    self.own_limit(&table, rule, &key, req)
                }
            };
            e.own = own.map(overrides::Own::describe);
            if let Some(overrides::Own::Unlimited) = own {
                e.decision = "unlimited";
                e.reason = "the key's override: the rule does not limit it".into();
                out.rules.push(e);
                continue;
            }
            let cost = match rule.cost_of(req) {
                Ok(cost) => cost,
                Err(bad) => {
                    e.decision = "bad_request";
                    e.reason = bad.detail;
                    out.decided(rule, "bad_request", None);
                    out.rules.push(e);
                    continue;
                }
            };
            e.units = Some(cost);
            let t = Turn {
                i,
                rule,
                req,
                key: &key,
                cost,
                now,
                dry: true,
                own,
            };
            let decision = match &*rule.kind {
                Kind::Rate { quota, store, .. } => {
                    let quota = match own {
                        Some(overrides::Own::Rate { quota, .. }) => quota,
                        _ => quota,
                    };
                    let (d, tracked) = store.peek(&key, quota, now, cost);
                    e.state = serde_json::json!({
                        "algorithm": store.algorithm_name(),
                        "tracked": tracked,
                        "burst": quota.burst(),
                        "per_sec": f64::from(quota.count()) * NANOS_PER_SEC as f64
                            / quota.period() as f64,
                    });
                    e.reason = if tracked {
                        "the key's own state".into()
                    } else {
                        "a key not seen lately: a fresh state".into()
                    };
                    if !tracked && store.is_full() {
                        // Such a key is decided by the rule's sketch, which is not read here.
                        e.decision = "unknown";
                        e.reason = "a key the full store has no place for: the rule's sketch decides it (max_keys)".into();
                        out.unknown = true;
                        out.rules.push(e);
                        continue;
                    }
                    match d {
                        Decision::Allow { wait, .. } if wait > rule.max_wait => Decision::Deny {
                            retry_after: Some(wait - rule.max_wait),
                        },
                        d => d,
                    }
                }
                Kind::Concurrency {
                    max, store, share, ..
                } => {
                    let max = match own {
                        Some(overrides::Own::Slots { max, .. }) => max,
                        _ => max,
                    };
                    // An untracked key of a full store shares its overflow's slots.
                    let held = store
                        .peek_state(&key, |c| c.in_flight())
                        .unwrap_or_else(|| {
                            if store.len.load(Ordering::Relaxed) >= store.max_keys {
                                store.overflow.in_flight()
                            } else {
                                0
                            }
                        });
                    let part = share
                        .as_ref()
                        .and_then(|s| s.peek(req.client_ip, *max, &self.share_exempt));
                    e.state = serde_json::json!({
                        "in_flight": held, "max": max,
                        "client_in_flight": part.map(|p| p.0),
                        "client_max": part.map(|p| p.1),
                    });
                    let client_full = part.is_some_and(|(h, m)| h >= m);
                    e.reason = if held >= *max {
                        format!("{held} of {max} slots in flight")
                    } else if client_full {
                        "the client holds its whole part of the slots".into()
                    } else {
                        format!("{held} of {max} slots in flight: a slot is free")
                    };
                    slot_decision(held < *max && !client_full, *max - held.min(*max))
                }
                Kind::Adaptive { limiter, share } => {
                    let (held, limit) = (limiter.in_flight(), limiter.limit());
                    let part = share
                        .as_ref()
                        .and_then(|s| s.peek(req.client_ip, limit, &self.share_exempt));
                    e.state = serde_json::json!({
                        "in_flight": held, "limit_now": limit,
                        "client_in_flight": part.map(|p| p.0),
                        "client_max": part.map(|p| p.1),
                    });
                    let client_full = part.is_some_and(|(h, m)| h >= m);
                    e.reason = format!("{held} in flight against an adaptive limit of {limit} now");
                    slot_decision(held < limit && !client_full, limit - held.min(limit))
                }
                Kind::Redis { refused, .. } => {
                    let remembered = refused.peek_state(&key, |r| r.refused(now, cost)).flatten();
                    e.state = serde_json::json!({ "refusal_remembered": remembered.is_some() });
                    match remembered {
                        Some(retry) => {
                            e.reason =
                                "Redis refused this key lately: refused here until its retry time"
                                    .into();
                            Decision::Deny {
                                retry_after: Some(retry),
                            }
                        }
                        None => {
                            e.decision = "asks_redis";
                            e.reason = "decided by Redis once every local rule admits".into();
                            redis = true;
                            out.asks.push(RedisAsk {
                                at: out.rules.len(),
                                rule: i,
                                key: key.to_vec(),
                                cost,
                                own: match own {
                                    Some(overrides::Own::Rate { quota, .. }) => Some(*quota),
                                    _ => None,
                                },
                            });
                            out.rules.push(e);
                            continue;
                        }
                    }
                }
                Kind::Global {
                    rate,
                    store,
                    fallback,
                    ..
                } => {
                    let Some(mut g) = GlobalRule::of(&rule.kind) else {
                        continue;
                    };
                    let rate = match own {
                        Some(overrides::Own::Rate { rate, .. }) => rate,
                        _ => rate,
                    };
                    g.rate = rate;
                    let found = store.peek_state(&key, |c| c.copy());
                    let tracked = found.is_some();
                    if !tracked && store.len.load(Ordering::Relaxed) >= store.max_keys {
                        // Such a key shares the store's overflow counters, not read here.
                        e.decision = "unknown";
                        e.reason = "a key the full store has no place for: it shares the rule's overflow counters (max_keys)".into();
                        out.unknown = true;
                        out.rules.push(e);
                        continue;
                    }
                    let counters = Arc::new(found.unwrap_or_default());
                    let r = ratios.get_or_insert_with(|| self.ratios.load());
                    let age = now.saturating_sub(r.at);
                    let (factor, stale) = self.staleness.factor(age);
                    let choice = counters.choice(r.answers);
                    // The name the control plane knows the key by, as the decision finds it.
                    let shown = e.key.clone().unwrap_or_default();
                    let name: &[u8] = if rule.digested {
                        shown.as_bytes()
                    } else {
                        &key
                    };
                    let (ratio, keep) = r.ratio_keep(&rule.name, name, || choice != Choice::Named);
                    let mut state = counters.describe(now);
                    if let serde_json::Value::Object(m) = &mut state {
                        m.insert("tracked".into(), tracked.into());
                        m.insert("limit_per_sec".into(), rate.per_sec().into());
                        m.insert("drop_ratio".into(), (ratio * factor).into());
                        m.insert("ratios_age_s".into(), (age as f64 / 1e9).into());
                        m.insert("stale".into(), stale.into());
                        m.insert("fallback".into(), (stale && fallback.is_some()).into());
                        m.insert(
                            "assigned".into(),
                            match choice {
                                Choice::New => "no: not in a report the control plane answered",
                                Choice::Named => "named in the last answered report",
                                Choice::Folded => "folded into the rule's other keys",
                            }
                            .into(),
                        );
                        if keep > 0.0 {
                            let (allowance, surge) =
                                counters.allowance(keep, r.answers, r.own_lag, rate.per_sec());
                            m.insert("allowance_per_sec".into(), allowance.into());
                            m.insert("surge_held".into(), surge.into());
                        }
                        if choice == Choice::New && fallback.is_none() {
                            m.insert(
                                "provisional_per_sec".into(),
                                r.provisional(&rule.name, rate.per_sec()).into(),
                            );
                        }
                    }
                    e.state = state;
                    e.reason = if stale && fallback.is_some() {
                        "the control plane is silent: the rule's fallback limit decides".into()
                    } else if stale && factor <= 0.0 {
                        "the control plane is silent: fail open".into()
                    } else if choice == Choice::New {
                        "a key no reply has assigned yet: its provisional limit decides".into()
                    } else if ratio > 0.0 {
                        format!(
                            "the fleet is over the limit: this proxy admits {:.4} of the key's requests, within its allowance",
                            1.0 - ratio * factor
                        )
                    } else {
                        "under its limit fleet-wide (drop ratio 0)".into()
                    };
                    let mut admit = Admit::default();
                    let mut taken = SmallVec::new();
                    let mut granted = Granted {
                        admit: &mut admit,
                        taken: &mut taken,
                    };
                    self.global_decide(&t, &g, counters, Slot::Keyed, &mut ratios, &mut granted)
                }
            };
            match decision {
                Decision::Allow { remaining, .. } => {
                    e.decision = "admit";
                    e.remaining = Some(remaining);
                }
                Decision::Deny { retry_after }
                    if rule.mode == Mode::Enforce
                        && rule
                            .delay
                            .as_ref()
                            .is_some_and(|d| retry_after.is_some_and(|r| r <= d.max_delay)) =>
                {
                    // `on_limit: delay`: the request waits in the rule's queue (if it has a
                    // place) and is decided again.
                    e.decision = "delay";
                    e.retry_after_s = retry_after.map(|n| ceil_secs(n).max(1));
                    e.reason.push_str(
                        "; on_limit: delay: it waits that long in the rule's queue (if it has a place), then is decided again",
                    );
                    out.decided(rule, "delay", e.retry_after_s);
                }
                Decision::Deny { retry_after } => {
                    e.decision = "refuse";
                    e.remaining = Some(0);
                    e.retry_after_s = retry_after.map(|n| ceil_secs(n).max(1));
                    if rule.mode == Mode::Enforce {
                        out.decided(rule, "refuse", e.retry_after_s);
                    } else {
                        e.reason.push_str(" (shadow: counted, not refused)");
                    }
                }
            }
            out.rules.push(e);
        }
        if out.decision == "admit" && redis {
            out.decision = "asks_redis";
        }
        if out.decision == "admit" && out.unknown {
            out.decision = "unknown";
        }
        out
    }

    /// Each rule's `n` most active keys now, read from its store (nothing is counted per
    /// request for this): one key's state at a time.
    pub fn top(&self, n: usize, now: Nanos) -> Vec<TopRule> {
        let mut out = Vec::new();
        for rule in &self.rules {
            let shown = |k: &[u8]| self.stored_form(rule, k);
            let (used, mut keys): (&'static str, Vec<TopKey>) = match &*rule.kind {
                Kind::Rate { quota, store, .. } => (
                    "units of the burst in use",
                    store.each(quota, now, |k, d| {
                        let (used, limited) = match d {
                            Decision::Allow { remaining, .. } => (
                                f64::from(quota.burst().saturating_sub(remaining + 1)),
                                false,
                            ),
                            Decision::Deny { .. } => (f64::from(quota.burst()), true),
                        };
                        TopKey {
                            key: shown(k),
                            used,
                            limited,
                        }
                    }),
                ),
                Kind::Concurrency { max, store, .. } => (
                    "requests in flight",
                    store.each_key(|k, c| {
                        Some(TopKey {
                            key: shown(k),
                            used: f64::from(c.in_flight()),
                            limited: c.in_flight() >= *max,
                        })
                    }),
                ),
                Kind::Global { store, .. } => (
                    "units offered since the last report",
                    store.each_key(|k, c| {
                        // By the name it is reported by (its private parts digested), or as
                        // the logs write it before that name is worked out.
                        let key = match (rule.digested, c.named()) {
                            (true, false) => shown(k),
                            _ => String::from_utf8_lossy(c.reported(k)).into_owned(),
                        };
                        Some(TopKey {
                            key,
                            used: c.offered_now() as f64,
                            limited: false,
                        })
                    }),
                ),
                Kind::Redis { refused, .. } => (
                    "refused by Redis lately (1: its refusal is remembered)",
                    refused.each_key(|k, r| {
                        (!r.expired(now)).then(|| TopKey {
                            key: shown(k),
                            used: 1.0,
                            limited: true,
                        })
                    }),
                ),
                Kind::Adaptive { .. } => ("requests in flight", Vec::new()),
            };
            let tracked = keys.len();
            keys.sort_by(|a, b| {
                (b.limited, b.used)
                    .partial_cmp(&(a.limited, a.used))
                    .unwrap_or(std::cmp::Ordering::Equal)
            });
            keys.truncate(n);
            let refused = rule
                .refused_keys
                .top(n, now)
                .into_iter()
                .map(|(k, refusals)| RefusedKey {
                    key: shown(&k),
                    refusals,
                })
                .collect();
            out.push(TopRule {
                rule: rule.name.to_string(),
                kind: rule.kind_name(),
                keys: tracked,
                used,
                top: keys,
                refused,
            });
        }
        out
    }
}

impl RuleSet {
    /// The question `ask` puts to the store, as a decision would put it.
    pub fn redis_question<'a>(&'a self, ask: &'a RedisAsk) -> Option<Question<'a>> {
        let mut q = self.question_of(ask.rule, &ask.key, ask.cost)?;
        if let Some(own) = &ask.own {
            q.quota = own;
        }
        Some(q)
    }

    /// A key as its store keeps it, for `top`, written as the logs write it (private parts
    /// as digests, unless `log_keys: clear`); a local key kept as its hash (past 64 bytes) as
    /// `hashed:` and that hash, which `explain` shows as `stored` for a request.
    fn stored_form(&self, rule: &CompiledRule, key: &[u8]) -> String {
        let local = !matches!(&*rule.kind, Kind::Global { .. } | Kind::Redis { .. });
        let shown = if rule.digested {
            shown_stored(&rule.key, key, local, |v, out| self.secret.push(v, out))
        } else {
            shown_stored(&rule.key, key, local, |v, out| out.extend_from_slice(v))
        };
        match shown {
            Some(text) => String::from_utf8_lossy(&text).into_owned(),
            // A local key kept as its keyed hash (past 64 bytes): that hash.
            None if local && key.len() == 17 && key[0] == 0xff => {
                let hex: String = key[1..].iter().map(|b| format!("{b:02x}")).collect();
                format!("hashed:{hex}")
            }
            // A text key kept as the SHA-256 of a long one, with no private part in it (with
            // one, an unkeyed hash could be guessed back): that hash.
            None if !local && !rule.digested && is_sha256_form(key) => {
                String::from_utf8_lossy(key).into_owned()
            }
            // Anything else is never written as it is: a digest of the whole key.
            None => format!("key-digest:{}", self.secret.of_value(key)),
        }
    }
}

/// Whether `key` is the form a long text key is kept in: `sha256:` and 64 lower-case hex
/// digits.
fn is_sha256_form(key: &[u8]) -> bool {
    key.len() == 71
        && key.starts_with(b"sha256:")
        && key[7..]
            .iter()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

/// A slot limit's decision: a slot free, or refused with the hint a refusal gives.
fn slot_decision(free: bool, remaining: u32) -> Decision {
    if free {
        Decision::Allow {
            remaining: remaining.saturating_sub(1),
            reset_after: 0,
            wait: 0,
        }
    } else {
        Decision::Deny {
            retry_after: Some(CONCURRENCY_RETRY),
        }
    }
}

impl Explanation {
    /// What Redis, asked read only, said of `ask` (`None`: no answer, so `on_error` decides):
    /// the rule's decision, and the whole one's if no rule refused before.
    pub fn redis_answered(
        &mut self,
        ask: &RedisAsk,
        answer: Option<StoreAnswer>,
        on_error: Option<OnError>,
    ) {
        let Some(e) = self.rules.get_mut(ask.at) else {
            return;
        };
        let enforce = e.mode == "enforce";
        match answer {
            Some(a) => {
                e.state = serde_json::json!({
                    "read_from_redis": true,
                    "remaining": a.remaining,
                    "reset_s": a.reset_after as f64 / NANOS_PER_SEC as f64,
                });
                e.remaining = Some(a.remaining);
                if a.admitted {
                    e.decision = "admit";
                    e.reason = "Redis would admit it (read by a script that cannot write)".into();
                } else {
                    e.decision = "refuse";
                    e.retry_after_s = a.retry_after.map(|n| ceil_secs(n).max(1));
                    e.reason = "Redis would refuse it (read by a script that cannot write)".into();
                    if enforce && self.by.is_none() {
                        self.decision = "refuse";
                        self.by = Some(e.rule.clone());
                        self.retry_after_s = e.retry_after_s;
                    }
                }
            }
            None => {
                e.reason = match on_error {
                    Some(OnError::Allow) => "Redis gave no answer: on_error: allow admits it",
                    Some(OnError::Deny) => "Redis gave no answer: on_error: deny refuses it",
                    Some(OnError::Fallback) => {
                        "Redis gave no answer: on_error: fallback, the local limit, decides"
                    }
                    None => "no Redis to ask",
                }
                .into();
            }
        }
        // Every question answered with an admission: the request is admitted.
        if self.decision == "asks_redis"
            && self.asks.iter().all(|a| {
                self.rules
                    .get(a.at)
                    .is_some_and(|r| r.decision == "admit" || r.mode == "shadow")
            })
        {
            self.decision = if self.unknown { "unknown" } else { "admit" };
        }
    }

    /// The first rule that refuses (enforcing) or cannot decide the request (any) decides.
    fn decided(&mut self, rule: &CompiledRule, how: &'static str, retry: Option<u64>) {
        if self.by.is_none() {
            self.decision = how;
            self.by = Some(rule.name.to_string());
            self.retry_after_s = retry;
        }
    }
}
