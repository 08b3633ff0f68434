//! Turning config rules into compiled ones: matchers, per-key stores, pre-resolved metric
//! handles and the `RateLimit-Policy` value, built once per rule set; a reload keeps the state
//! of each rule whose identity is unchanged. Must never: run per request.

use super::*;

impl RuleSet {
    /// Compiles `config`'s rules, resolving their metric handles in `metrics`.
    pub fn build(config: &Config, metrics: &Metrics) -> RuleSet {
        let ratios = Arc::new(ArcSwap::from_pointee(DropRatios::empty(0)));
        Self::build_with_ratios(config, metrics, ratios)
    }

    /// As [`build`](Self::build), with global rules reading the drop ratios in `ratios`.
    pub fn build_with_ratios(
        config: &Config,
        metrics: &Metrics,
        ratios: Arc<ArcSwap<DropRatios>>,
    ) -> RuleSet {
        Self::rebuild(config, metrics, ratios, None)
    }

    /// Builds the rule set of a reloaded `config`, keeping the state of every rule of
    /// `previous` whose identity did not change (see [`from_rules`](Self::from_rules)).
    pub fn rebuild(
        config: &Config,
        metrics: &Metrics,
        ratios: Arc<ArcSwap<DropRatios>>,
        previous: Option<&RuleSet>,
    ) -> RuleSet {
        let reading = (
            &config.client_ip.policy(),
            config.path_match == crate::config::PathMatch::Strict,
        );
        let mut set =
            Self::from_rules_keeping(&config.rules, config.headers, metrics, previous, reading)
                .in_fleet(config.control_plane.as_ref(), ratios);
        set.log_rejections = config.log_rejections;
        set.share_exempt = config.per_client_exempt().into();
        // The secret is read once, at start (a restart field): a reload keeps it.
        if let Some(previous) = previous {
            set.secret = previous.secret.clone();
        }
        set
    }

    /// Global rules read the drop ratios in `ratios`, and treat their age as `control_plane`
    /// says (its defaults without one).
    pub fn in_fleet(
        mut self,
        control_plane: Option<&ControlPlane>,
        ratios: Arc<ArcSwap<DropRatios>>,
    ) -> RuleSet {
        self.ratios = ratios;
        if let Some(cp) = control_plane {
            self.staleness = Staleness {
                stale_after: cp.stale_after.0.as_nanos() as Nanos,
                decay: cp.decay.0.as_nanos() as Nanos,
            };
            self.report_interval = cp.report_interval.0.as_nanos() as Nanos;
        }
        self
    }

    /// Compiles `rules`, resolving their metric handles in `metrics`.
    pub fn from_rules(rules: &[Rule], header_mode: HeaderMode, metrics: &Metrics) -> RuleSet {
        let policy = crate::key::ClientIpPolicy::default();
        Self::from_rules_keeping(rules, header_mode, metrics, None, (&policy, false))
    }

    /// As [`from_rules`](Self::from_rules); a rule whose identity (name, key, limit, scope,
    /// fallback, max_keys) is the same as one of `previous`'s shares that rule's per-key state,
    /// so a reload hands no client a fresh bucket. Other rules start empty.
    fn from_rules_keeping(
        rules: &[Rule],
        header_mode: HeaderMode,
        metrics: &Metrics,
        previous: Option<&RuleSet>,
        (policy, strict): (&crate::key::ClientIpPolicy, bool),
    ) -> RuleSet {
        let mut compiled: Vec<CompiledRule> = rules
            .iter()
            .map(|r| {
                let identity = identity(r);
                let kept = previous.and_then(|p| {
                    p.rules
                        .iter()
                        .find(|old| old.identity == identity)
                        .map(|old| old.kind.clone())
                });
                let mut rule = compile(r, metrics, identity, kept);
                // Unchanged overrides keep their table (and what their file loaded).
                let wanted = overrides::Overrides::identity(r, policy, strict);
                rule.overrides = previous
                    .and_then(|p| {
                        p.rules.iter().find_map(|old| {
                            old.overrides
                                .as_ref()
                                .filter(|o| o.identity == wanted)
                                .cloned()
                        })
                    })
                    .or_else(|| overrides::Overrides::of(r, policy, strict, metrics).map(Arc::new));
                rule
            })
            .collect();
        for (i, r) in rules.iter().enumerate() {
            let c = &mut compiled[i];
            c.replaced_by = rules
                .iter()
                .enumerate()
                .filter(|(_, o)| o.replaces.contains(&r.name))
                .map(|(j, _)| j)
                .collect();
            c.extras = c.overrides.is_some() || !c.replaced_by.is_empty();
        }
        RuleSet {
            rules: compiled,
            header_mode,
            ratios: Arc::new(ArcSwap::from_pointee(DropRatios::empty(0))),
            staleness: Staleness {
                stale_after: 5 * NANOS_PER_SEC,
                decay: 10 * NANOS_PER_SEC,
            },
            report_interval: NANOS_PER_SEC,
            log_rejections: crate::config::DEFAULT_LOG_REJECTIONS,
            store: None,
            secret: crate::digest::Secret::default(),
            // Loopback, as `limits.connections_per_client_exempt` says by default.
            share_exempt: (crate::config::Limits::default().connections_per_client_exempt)
                .iter()
                .map(|c| c.0)
                .collect(),
        }
    }

    /// Names of the rules that share their state with `other` (kept across a reload).
    pub fn kept_from(&self, other: &RuleSet) -> Vec<String> {
        self.rules
            .iter()
            .filter(|r| other.rules.iter().any(|o| Arc::ptr_eq(&o.kind, &r.kind)))
            .map(|r| r.name.to_string())
            .collect()
    }
}

/// A store's bound and metric handles, labelled `label` (the rule, or a part of it).
pub(super) fn store_parts(r: &Rule, metrics: &Metrics, label: &str) -> StoreParts {
    StoreParts {
        max_keys: r.max_keys.get() as usize,
        keys: metrics.keys.with_label_values(&[label]),
        evicted_idle: metrics.evicted.with_label_values(&[label, "idle"]),
        overflowed: metrics.overflow.with_label_values(&[label]),
    }
}

/// A rule's `fallback:` limit, if it has one.
pub(super) fn fallback_store(r: &Rule, metrics: &Metrics, label: &str) -> Option<Fallback> {
    match &r.fallback {
        Some(Limit::Rate {
            quota, algorithm, ..
        }) => {
            let label = format!("{label}.fallback");
            Some(Fallback {
                quota: *quota,
                store: RateStore::new(*algorithm, store_parts(r, metrics, &label)),
                overflow: Overflow {
                    quota: *quota,
                    sketch: std::sync::OnceLock::new(),
                    size: r.sketch,
                    refused: metrics.sketch_refused.with_label_values(&[&label]),
                },
            })
        }
        _ => None,
    }
}

/// `"name";q=<burst>;w=<seconds>` for a rate limit: the window of the window algorithms, the
/// refill time of the buckets.
pub(super) fn rate_policy(name: &str, algorithm: Algorithm, quota: &Quota) -> String {
    let window = match algorithm {
        Algorithm::TokenBucket | Algorithm::Gcra | Algorithm::LeakyBucket => quota.refill_time(),
        _ => quota.window(),
    };
    format!(
        "\"{name}\";q={};w={}",
        quota.burst(),
        ceil_secs(window).max(1)
    )
}

/// `RateLimit-Policy` of a rule: `"name";q=<quota>;w=<window seconds>`.
pub(super) fn policy_of(r: &Rule, name: &str) -> String {
    match &r.limit {
        Limit::Rate { rate, quota, .. } if r.scope == Scope::Global => format!(
            "\"{name}\";q={};w={}",
            rate.count,
            ceil_secs(quota.period()).max(1)
        ),
        Limit::Rate {
            algorithm, quota, ..
        } => rate_policy(name, *algorithm, quota),
        Limit::Concurrency(n) => format!("\"{name}\";q={n}"),
        Limit::Adaptive(spec) => format!("\"{name}\";q={}", spec.max),
    }
}

/// A rule's empty per-key state and its limiter.
pub(super) fn compile_kind(r: &Rule, metrics: &Metrics, label: &str) -> Kind {
    let parts = store_parts(r, metrics, label);
    match &r.limit {
        Limit::Rate { rate, .. } if r.scope == Scope::Global => Kind::Global {
            rate: *rate,
            store: Store::new(parts),
            overflow_keys: Default::default(),
            fallback: fallback_store(r, metrics, label),
            drained: std::sync::atomic::AtomicU64::new(0),
        },
        Limit::Rate {
            algorithm, quota, ..
        } if r.scope == Scope::Redis => Kind::Redis {
            algorithm: *algorithm,
            quota: *quota,
            refused: Store::new(store_parts(r, metrics, &format!("{label}.refused"))),
            cache_answers: metrics.redis.cache_answers.with_label_values(&[label]),
            admission: Admission {
                seen: Store::new(store_parts(r, metrics, &format!("{label}.seen"))),
                memory: quota.window().saturating_mul(2),
                budget: Gcra::new(),
                quota: Quota::new(r.new_keys, std::time::Duration::from_secs(1), r.new_keys)
                    .expect("a positive count a second"),
                refused: metrics.redis.new_keys_refused.with_label_values(&[label]),
            },
            fallback: fallback_store(r, metrics, label),
        },
        Limit::Rate {
            algorithm, quota, ..
        } => Kind::Rate {
            quota: *quota,
            store: match r.cost {
                // A bucket either way: the config gives a response cost to no other.
                Cost::Response(_) => RateStore::owed(parts),
                _ => RateStore::new(*algorithm, parts),
            },
            overflow: Overflow {
                quota: *quota,
                sketch: std::sync::OnceLock::new(),
                size: r.sketch,
                refused: metrics.sketch_refused.with_label_values(&[label]),
            },
        },
        Limit::Concurrency(n) => Kind::Concurrency {
            max: n.get(),
            store: Store::new(parts),
            at_head: r.release == crate::config::Release::Head,
            share: share_of(r, metrics, label),
        },
        Limit::Adaptive(spec) => {
            let limit = metrics.adaptive_limit.with_label_values(&[label]);
            let baseline = metrics.adaptive_baseline.with_label_values(&[label]);
            let sample = metrics.adaptive_latency.with_label_values(&[label]);
            let settings = spec.settings();
            limit.set(i64::from(
                settings.initial.clamp(settings.min, settings.max),
            ));
            Kind::Adaptive {
                limiter: Arc::new(Adaptive::with_observer(settings, move |s| {
                    limit.set(i64::from(s.limit));
                    baseline.set(s.baseline as f64 / 1e9);
                    sample.set(s.sample as f64 / 1e9);
                })),
                share: share_of(r, metrics, label),
            }
        }
    }
}

/// One client's part of a shared limit's slots, unless the rule gives every client all of them.
fn share_of(r: &Rule, metrics: &Metrics, label: &str) -> Option<Share> {
    let fraction = r.client_share.filter(|f| *f < 1.0)?;
    let parts = store_parts(r, metrics, &format!("{label}.client"));
    Some(Share::new(fraction, Store::new(parts)))
}

/// The decision of a concurrency limit (fixed or adaptive) of `limit` slots for rule `i`:
/// a granted slot goes into `admit`, held until the response body ends.
pub(super) fn slot(
    permit: Option<Permit>,
    limit: u32,
    i: usize,
    admit: &mut Admit,
    taken: &mut SmallVec<[(usize, Taken); 4]>,
) -> Decision {
    match permit {
        Some(p) => {
            let remaining = limit.saturating_sub(p.in_flight());
            admit.permits.push(p);
            taken.push((i, Taken::Concurrency));
            Decision::Allow {
                remaining,
                reset_after: 0,
                wait: 0,
            }
        }
        None => Decision::Deny {
            retry_after: Some(CONCURRENCY_RETRY),
        },
    }
}

/// What a rule's per-key state depends on: while these are equal, the state stays valid (a
/// cost that becomes, or stops being, the response's changes the store's kind).
pub(super) fn identity(r: &Rule) -> String {
    format!(
        "{:?}|{:?}|{:?}|{:?}|{:?}|{}|{:?}|{}|{:?}|{:?}|{:?}|{}",
        r.name,
        r.key,
        r.limit,
        r.scope,
        r.fallback,
        r.max_keys,
        r.log_keys,
        r.new_keys,
        r.release,
        r.client_share,
        r.sketch,
        r.cost.response().is_some()
    )
}

pub(super) fn compile(
    r: &Rule,
    metrics: &Metrics,
    identity: String,
    kept: Option<Arc<Kind>>,
) -> CompiledRule {
    let name: Arc<str> = Arc::from(r.name.0.as_str());
    let label = &*name;
    let policy = HeaderValue::from_str(&policy_of(r, &name))
        .expect("rule names are header-safe by validation");
    // A kept rule's state is the previous set's; its policy follows from the same limit.
    let kind = kept.unwrap_or_else(|| Arc::new(compile_kind(r, metrics, label)));
    let delay = (r.on_limit == OnLimit::Delay).then(|| Delay {
        max_delay: r
            .max_delay
            .map_or(0, |d| Nanos::try_from(d.0.as_nanos()).unwrap_or(Nanos::MAX)),
        queue: Arc::new(DelayQueue {
            waiting: AtomicU32::new(0),
            max: r.max_queue.get(),
            gauge: metrics.delay_queue.with_label_values(&[label]),
            delayed: metrics.delayed.with_label_values(&[label]),
        }),
    });
    let charge = r
        .cost
        .response()
        .map(|cost| Arc::new(ChargeRule::new(kind.clone(), cost.clone(), metrics, &name)));
    CompiledRule {
        charge,
        body_idle: r.upstream_body_idle.map(|d| d.0),
        digested: r.log_keys == LogKeys::Digest && crate::key::has_private(&r.key.0),
        matcher: Matcher::from(&r.matcher),
        key: r.key.0.clone(),
        mode: r.mode,
        cost: r.cost.clone(),
        kind,
        identity,
        delay,
        max_wait: match &r.limit {
            Limit::Rate {
                algorithm: Algorithm::LeakyBucket,
                ..
            } => r.max_delay.map_or(Nanos::MAX, |d| {
                Nanos::try_from(d.0.as_nanos()).unwrap_or(Nanos::MAX)
            }),
            _ => Nanos::MAX,
        },
        answers: Arc::new(Answers::new(name.clone(), policy)),
        allowed: metrics.requests.with_label_values(&[label, "allowed"]),
        rejected: metrics.requests.with_label_values(&[label, "rejected"]),
        shadow_rejected: metrics
            .requests
            .with_label_values(&[label, "shadow_rejected"]),
        logged: LogBudget::default(),
        refused_keys: Default::default(),
        overrides: None,
        extras: false,
        replaced_by: Box::default(),
        name,
    }
}

impl CompiledRule {
    /// Writes the rule's key for `req` into `key`, bounded: a global or redis rule's in its
    /// fleet-wide text form, a local rule's as bytes (hashed past 64).
    #[inline]
    pub(super) fn key_of(&self, req: &RequestView<'_>, key: &mut KeyBuf) -> Extract {
        if matches!(*self.kind, Kind::Global { .. } | Kind::Redis { .. }) {
            let found = extract_text(&self.key, req, key);
            if found == Extract::Found {
                canonical_text(key);
            }
            found
        } else {
            let found = extract(&self.key, req, key);
            if found == Extract::Found {
                bound_local(key);
            }
            found
        }
    }

    /// For a local rule whose cost is the response's: the units `req`'s key owes past its
    /// budget at `now` (0: none). Looked up again: for the rejection log only.
    #[cold]
    pub(super) fn owed(&self, req: &RequestView<'_>, now: Nanos) -> Option<u64> {
        self.charge.as_ref()?;
        let Kind::Rate {
            quota,
            store: RateStore::Owed(store),
            ..
        } = &*self.kind
        else {
            return None;
        };
        let mut key = KeyBuf::new();
        if self.key_of(req, &mut key) != Extract::Found {
            return None;
        }
        let owed = store.map.get(&key[..]).map_or(0, |s| s.owed(quota, now));
        Some(owed)
    }

    /// The 400 for a request that sends a keyed field more than once.
    #[cold]
    pub(super) fn repeated_key(&self, req: &RequestView<'_>) -> BadRequest {
        let part = self
            .key
            .iter()
            .find(|p| {
                let mut k = KeyBuf::new();
                extract(std::slice::from_ref(*p), req, &mut k) == Extract::Repeated
            })
            .map_or_else(|| "a key part".to_string(), ToString::to_string);
        BadRequest {
            rule: self.name.clone(),
            reason: crate::metrics::Reason::RepeatedKey,
            detail: format!(
                "rule {} keys requests by {part}, which this request sends more than once",
                self.name
            ),
        }
    }

    /// The request's cost under this rule: at least 1, or a response cost's reservation (which
    /// may be 0). A cost header is read only from a trusted proxy (unless the rule says
    /// `from: any`); one it reads must be a whole number of at least 1, sent once.
    #[inline(always)]
    pub(super) fn cost_of(&self, req: &RequestView<'_>) -> Result<u32, BadRequest> {
        match &self.cost {
            Cost::Fixed(n) => Ok(*n),
            _ => self.cost_read(req),
        }
    }

    /// [`Self::cost_of`] for a cost that is not a constant: apart, so that the constant one,
    /// every rule's by default, is decided inline.
    #[inline(never)]
    fn cost_read(&self, req: &RequestView<'_>) -> Result<u32, BadRequest> {
        match &self.cost {
            Cost::Fixed(n) => Ok(*n),
            // The response's units are charged after it (`charge`); this is what is held.
            Cost::Response(r) => Ok(r.reserve),
            Cost::Header {
                header,
                default,
                max,
                from,
            } => {
                if *from == CostFrom::Trusted && !req.trusted_peer {
                    return Ok(*default);
                }
                let mut values = req.headers.get_all(header).iter();
                match (values.next(), values.next()) {
                    (None, _) => Ok(*default),
                    (Some(v), None) => match parse_cost(v.as_bytes()) {
                        Some(n) => Ok(n.min(*max)),
                        None => Err(self.bad_cost(header)),
                    },
                    (Some(_), Some(_)) => Err(self.bad_cost(header)),
                }
            }
        }
    }

    #[cold]
    pub(super) fn bad_cost(&self, header: &http::HeaderName) -> BadRequest {
        BadRequest {
            rule: self.name.clone(),
            reason: crate::metrics::Reason::Cost,
            detail: format!(
                "rule {} reads the cost from {header}, which must be sent once, as a whole number of at least 1",
                self.name
            ),
        }
    }
}
