//! A rule's keys with limits of their own (`overrides:` and `overrides_file:`): the table a
//! decision looks a key up in, by the bytes its store keeps (or, for keys written as digests,
//! by the key's shown form), swapped whole when the file changes so a reload of the file
//! never touches a key's state. Must never: be asked by a rule that has no overrides, allocate
//! on a lookup, or swap in a table from a file that did not check.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::config::{rule_overrides, OwnLimit};
use crate::key::ClientIpPolicy;

use super::*;

/// A key's own limit, compiled.
pub(super) enum Own {
    /// The rule does not apply to the key.
    Unlimited,
    /// A rate: `quota` for the rule's algorithm (local and redis), `rate` for a global rule.
    Rate {
        quota: Quota,
        rate: Rate,
        answers: Arc<Answers>,
    },
    Slots {
        max: u32,
        answers: Arc<Answers>,
    },
}

impl Own {
    /// The 429 parts and policy of a key with this limit.
    pub(super) fn answers(&self) -> Option<&Arc<Answers>> {
        match self {
            Own::Unlimited => None,
            Own::Rate { answers, .. } | Own::Slots { answers, .. } => Some(answers),
        }
    }

    /// As the configuration writes it.
    pub(super) fn describe(&self) -> String {
        match self {
            Own::Unlimited => "unlimited".into(),
            Own::Rate { rate, quota, .. } => format!("{rate} (burst {})", quota.burst()),
            Own::Slots { max, .. } => format!("concurrency {max}"),
        }
    }
}

type Hasher = foldhash::fast::RandomState;

/// One rule's overrides, ready for lookups.
#[derive(Default)]
pub(super) struct Table {
    /// Key as the store keeps it -> index into `owns`.
    stored: HashMap<Box<[u8]>, u32, Hasher>,
    /// Key in its shown form (private parts as digests) -> index into `owns`.
    shown: HashMap<Box<[u8]>, u32, Hasher>,
    /// The distinct limits (few: a key's entry names one of them).
    owns: Vec<Own>,
}

impl Table {
    pub(super) fn len(&self) -> usize {
        self.stored.len() + self.shown.len()
    }

    /// The own limit of the key the rule stores as `key` (`shown`: its shown form, worked out
    /// only when some entry was written as a digest).
    #[inline]
    pub(super) fn get(&self, key: &[u8], shown: impl FnOnce() -> KeyBuf) -> Option<&Own> {
        if let Some(&i) = self.stored.get(key) {
            return self.owns.get(i as usize);
        }
        if self.shown.is_empty() {
            return None;
        }
        let shown = shown();
        let &i = self.shown.get(&shown[..])?;
        self.owns.get(i as usize)
    }
}

/// A rule's overrides and where more come from; kept across a rebuild that leaves the rule's
/// limit, key, scope and overrides as they were, so a config reload does not reread the file.
pub(super) struct Overrides {
    rule: Rule,
    policy: ClientIpPolicy,
    strict_path: bool,
    /// What the table was built for (see [`Overrides::identity`]).
    pub(super) identity: String,
    table: ArcSwap<Table>,
    /// The file's text the table was built from, once loaded.
    // A load's lock, off the request path (a file watcher or a reload).
    #[allow(clippy::disallowed_types)]
    loaded: std::sync::Mutex<Option<String>>,
    count: IntGauge,
    reloads_ok: IntCounter,
    reloads_error: IntCounter,
}

impl Overrides {
    /// What a rule's overrides depend on.
    pub(super) fn identity(r: &Rule, policy: &ClientIpPolicy, strict: bool) -> String {
        format!(
            "{}|{:?}|{:?}|{:?}|{:?}|{:?}|{:?}|{:?}|{}|{}",
            r.name.0,
            r.key,
            r.limit,
            r.scope,
            r.cost,
            r.overrides,
            r.overrides_file,
            policy.ipv4_prefix,
            policy.ipv6_prefix,
            strict
        )
    }

    /// `r`'s overrides with its inline entries (checked with the configuration), or `None`
    /// when it has none and no file.
    pub(super) fn of(
        r: &Rule,
        policy: &ClientIpPolicy,
        strict_path: bool,
        metrics: &Metrics,
    ) -> Option<Overrides> {
        if r.overrides.is_empty() && r.overrides_file.is_none() {
            return None;
        }
        let label = r.name.0.as_str();
        // See the field: a load's lock.
        #[allow(clippy::disallowed_types)]
        let o = Overrides {
            rule: r.clone(),
            policy: policy.clone(),
            strict_path,
            identity: Self::identity(r, policy, strict_path),
            table: ArcSwap::from_pointee(Table::default()),
            loaded: std::sync::Mutex::new(None),
            count: metrics.overrides.with_label_values(&[label]),
            reloads_ok: metrics.overrides_reloads.with_label_values(&[label, "ok"]),
            reloads_error: metrics
                .overrides_reloads
                .with_label_values(&[label, "error"]),
        };
        // Checked when the configuration was: this cannot fail but for a file.
        match o.build(None) {
            Ok(table) => o.swap(table),
            Err(e) => tracing::error!(rule = %r.name, "overrides: {e}"),
        }
        Some(o)
    }

    /// The table now.
    #[inline]
    pub(super) fn load(&self) -> arc_swap::Guard<Arc<Table>> {
        self.table.load()
    }

    /// Whether its file has loaded once: a set from it is in force.
    pub(super) fn has_loaded(&self) -> bool {
        self.loaded
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    pub(super) fn file(&self) -> Option<&Path> {
        self.rule.overrides_file.as_deref()
    }

    fn swap(&self, table: Table) {
        self.count.set(table.len() as i64);
        self.table.store(Arc::new(table));
    }

    /// The table of the inline entries and those of a file's text (and name).
    fn build(&self, file: Option<(&str, &str)>) -> Result<Table, String> {
        let (all, keys) = rule_overrides(&self.rule, file, &self.policy, self.strict_path)?;
        let mut table = Table {
            stored: HashMap::with_capacity_and_hasher(all.len(), Hasher::default()),
            ..Table::default()
        };
        // Each distinct limit is compiled once (with its 429s); keys name one of them.
        let mut distinct: HashMap<String, usize> = HashMap::new();
        for ((key, shown), o) in keys.into_iter().zip(&all) {
            let i = match distinct.get(&format!("{:?}", o.limit)) {
                Some(&i) => i,
                None => {
                    table.owns.push(self.compile(&o.limit)?);
                    distinct.insert(format!("{:?}", o.limit), table.owns.len() - 1);
                    table.owns.len() - 1
                }
            };
            let map = if shown {
                &mut table.shown
            } else {
                &mut table.stored
            };
            map.insert(key.to_vec().into_boxed_slice(), i as u32);
        }
        table.stored.shrink_to_fit();
        Ok(table)
    }

    fn compile(&self, own: &OwnLimit) -> Result<Own, String> {
        let r = &self.rule;
        let answers = |policy: String| {
            let policy = HeaderValue::from_str(&policy).expect("rule names are header-safe");
            Arc::new(Answers::new(Arc::from(r.name.0.as_str()), policy))
        };
        Ok(match *own {
            OwnLimit::Unlimited => Own::Unlimited,
            OwnLimit::Rate { rate, burst } => {
                let quota =
                    Quota::new(rate.count, rate.period, burst).map_err(|e| e.to_string())?;
                let policy = match &r.limit {
                    Limit::Rate { .. } if r.scope == Scope::Global => format!(
                        "\"{}\";q={};w={}",
                        r.name.0,
                        rate.count,
                        ceil_secs(quota.period()).max(1)
                    ),
                    Limit::Rate { algorithm, .. } => rate_policy(&r.name.0, *algorithm, &quota),
                    _ => return Err("a rate for a rule that limits no rate".into()),
                };
                Own::Rate {
                    quota,
                    rate,
                    answers: answers(policy),
                }
            }
            OwnLimit::Concurrency(n) => Own::Slots {
                max: n.get(),
                answers: answers(format!("\"{}\";q={n}", r.name.0)),
            },
        })
    }

    /// Reads the rule's file and swaps in the table of its entries and the inline ones; a
    /// file that does not read or check leaves the table as it was. `Ok(None)`: the file's
    /// text is the one loaded. Blocking (a file read and a parse): off the runtime's workers.
    pub(super) fn load_file(&self) -> Result<Option<usize>, String> {
        let Some(path) = self.file() else {
            return Ok(None);
        };
        let result = self.read(path);
        match &result {
            Ok(Some(_)) => self.reloads_ok.inc(),
            Ok(None) => {}
            Err(_) => self.reloads_error.inc(),
        }
        result
    }

    fn read(&self, path: &Path) -> Result<Option<usize>, String> {
        let file = path.display().to_string();
        // Held across the read and the build: two loads at once would race to swap, and a
        // stale read could land after a newer one.
        let mut loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        let text = std::fs::read_to_string(path).map_err(|e| format!("{file}: {e}"))?;
        if loaded.as_deref() == Some(text.as_str()) {
            return Ok(None);
        }
        let table = self.build(Some((&text, &file)))?;
        let n = table.len();
        self.swap(table);
        *loaded = Some(text);
        Ok(Some(n))
    }
}

/// What loading an `overrides_file` did: the entries loaded (`None`: the text is the one
/// loaded already), or why it did not load, and whether a set it loaded before stays in force.
pub type FileLoad = (Result<Option<usize>, String>, bool);

impl RuleSet {
    /// The rules with an `overrides_file`, and the file: what a caller loads (and watches).
    pub fn override_files(&self) -> Vec<(Arc<str>, PathBuf)> {
        self.rules
            .iter()
            .filter_map(|r| {
                let path = r.overrides.as_ref()?.file()?;
                Some((r.name.clone(), path.to_path_buf()))
            })
            .collect()
    }

    /// Loads the `overrides_file` of each rule that has `path` (every rule with one when
    /// `None`), returning each rule's [`FileLoad`]. Blocking.
    pub fn load_override_files(&self, path: Option<&Path>) -> Vec<(Arc<str>, FileLoad)> {
        self.rules
            .iter()
            .filter_map(|r| {
                let o = r.overrides.as_ref()?;
                let file = o.file()?;
                if path.is_some_and(|p| p != file) {
                    return None;
                }
                let kept = o.has_loaded();
                Some((r.name.clone(), (o.load_file(), kept)))
            })
            .collect()
    }
}

impl RuleSet {
    /// The own limit of `rule`'s `key` (for `req`) in `table`. A rule with keys written as
    /// digests works out the request's digest for a key not found by its bytes: a cost only
    /// such a rule pays.
    #[inline]
    pub(super) fn own_limit<'t>(
        &self,
        table: &'t Table,
        rule: &CompiledRule,
        key: &[u8],
        req: &RequestView<'_>,
    ) -> Option<&'t Own> {
        table.get(key, || {
            let mut shown = KeyBuf::new();
            extract_shown(
                &rule.key,
                req,
                |v, out| self.secret.push(v, out),
                &mut shown,
            );
            canonical_text(&mut shown);
            shown
        })
    }

    /// The own limit of `rule`'s `key`, its table loaded into `table` (the caller's, which
    /// outlives the answer's use). Out of line: asked only by a rule with extras.
    #[inline(never)]
    pub(super) fn own_of<'t>(
        &self,
        rule: &CompiledRule,
        key: &[u8],
        req: &RequestView<'_>,
        table: &'t mut Option<arc_swap::Guard<Arc<Table>>>,
    ) -> Option<&'t Own> {
        let o = rule.overrides.as_ref()?;
        let t = table.insert(o.load());
        self.own_limit(t, rule, key, req)
    }

    /// Whether a rule that stands in for `rule` applies to `req` (matches it, has its key,
    /// and is not itself replaced); then `rule` does not. The rules that replace form no cycle
    /// (refused with the configuration): this ends.
    #[inline(never)]
    pub(super) fn replaced(&self, rule: &CompiledRule, req: &RequestView<'_>) -> bool {
        if rule.replaced_by.is_empty() {
            return false;
        }
        let mut key = KeyBuf::new();
        rule.replaced_by.iter().any(|&j| {
            let other = &self.rules[j];
            other.matcher.matches(req)
                && other.key_of(req, &mut key) != Extract::Missing
                && !self.replaced(other, req)
        })
    }
}
