//! Who may report now, for the aggregator and the controller alike.
//!
//! Owns one small record per live source (a proxy, or one aggregator replica): when it last
//! reported, its interval, its sequence number, the process reporting under its name, the
//! services it reports for and its owner (the service whose token sent it, or the aggregators,
//! or the shared token). From those it refuses a flood of new sources ([`NEW_SOURCES_PER_SEC`]
//! and [`MAX_SOURCES_PER_OWNER`], per owner, so that one service's token cannot crowd out
//! another's hosts; a full owner's idle sources make room first), a host reporting for a
//! service other than those its first report named, a report it has already counted (a retry
//! or a replay to the same replica: same or older `seq`), a host's reports past one per
//! interval (three in a row pass), and another process reporting under a live source's name.
//! Must never: hold more than one record per source, keep one past three of its intervals,
//! drop a returning source's data unseen (its owner must take its values out first), or count
//! a report twice.

use std::collections::HashMap;

use super::{Report, NEW_SOURCES_PER_SEC};

/// Live sources one owner may have; past it, its new sources are refused like a flood.
pub const MAX_SOURCES_PER_OWNER: usize = 50_000;

/// Why a report's source was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceRefusal {
    #[error("too many new sources this second; retry")]
    Flood,
    #[error("source {0} reports for service {1}, but it is a source of {2}")]
    Foreign(String, String, String),
    /// Not an error for the sender: its counts are in already.
    #[error("report {0} of this source was already counted")]
    Duplicate(u64),
    #[error("this source reports more often than once per its interval; retry")]
    TooSoon,
    /// Another process reports under this name and has not gone quiet (nor said it stops).
    #[error("another process reports under this source's name; it is free once that one has been silent for an interval")]
    Held,
}

/// One live source.
#[derive(Debug)]
pub struct Source<T> {
    /// Seconds on the owner's clock of the last report taken.
    pub last: f64,
    /// The source's own report interval, in seconds.
    pub interval: f64,
    seq: u64,
    /// When its next report is due at the earliest, on the owner's clock: one report per its
    /// interval, three in a row allowed (a reply that came late, then the next on time).
    due: f64,
    /// Its last report said it was stopping: one such report passes early, not every one.
    stopping: bool,
    /// The process that reports under this name (`None`: a sender that does not say).
    instance: Option<u64>,
    services: Vec<Box<str>>,
    owner: Box<str>,
    /// What the owner keeps per source.
    pub data: T,
}

/// Every live source, with `T` kept beside each.
#[derive(Debug)]
pub struct Sources<T> {
    index: HashMap<Box<str>, Source<T>>,
    /// The second new sources are being counted in, and how many each owner brought in it.
    second: u64,
    new_sources: HashMap<Box<str>, u32>,
    /// Live sources per owner.
    live: HashMap<Box<str>, usize>,
    pub throttled: u64,
    pub foreign: u64,
    pub duplicates: u64,
    pub too_soon: u64,
    pub held: u64,
}

impl<T> Default for Sources<T> {
    fn default() -> Self {
        Sources {
            index: HashMap::new(),
            second: 0,
            new_sources: HashMap::new(),
            live: HashMap::new(),
            throttled: 0,
            foreign: 0,
            duplicates: 0,
            too_soon: 0,
            held: 0,
        }
    }
}

/// A source is forgotten after this many of its intervals without a report.
const FORGET_AFTER: f64 = 3.0;

/// ...or after this many, when its owner has no room for another source (past what the
/// controller holds a source's values for, two of its intervals).
const IDLE_AT_CAP: f64 = 2.0;

impl<T> Source<T> {
    /// Starts its record afresh at `now` (a source back after silence, or another process
    /// taking its name): numbers, spacing and services; its data stays for its owner.
    fn start_over(&mut self, now: f64) {
        self.seq = 0;
        self.due = now;
        self.stopping = false;
        self.services.clear();
    }

    /// Whose budget it counts against.
    pub fn owner(&self) -> &str {
        &self.owner
    }
}

impl<T: Default> Sources<T> {
    /// Takes `report` from `owner`'s source at `now` (seconds) if it may report: the source's
    /// data to update, or why not. A host (any source not named `zone:...`) is pinned to the
    /// services of its first non-empty report. A source that went silent and comes back keeps
    /// its data (the caller's to replace) but starts over otherwise.
    pub fn admit(
        &mut self,
        report: &Report,
        owner: &str,
        now: f64,
    ) -> Result<&mut Source<T>, SourceRefusal> {
        let interval = report.interval_ms as f64 / 1000.0;
        let pinned = !report.source.starts_with("zone:");
        let known = self.index.get(report.source.as_str());
        let live = known.is_some_and(|s| now - s.last <= FORGET_AFTER * s.interval);
        if !live {
            let second = now as u64;
            if self.second != second {
                self.second = second;
                self.new_sources.clear();
            }
            let fresh = self.new_sources.get(owner).copied().unwrap_or(0);
            let holds = self.live.get(owner).copied().unwrap_or(0);
            if fresh >= NEW_SOURCES_PER_SEC || (known.is_none() && holds >= MAX_SOURCES_PER_OWNER) {
                self.throttled += 1;
                return Err(SourceRefusal::Flood);
            }
            *self.new_sources.entry(owner.into()).or_default() += 1;
            match self.index.get_mut(report.source.as_str()) {
                Some(s) => s.start_over(now),
                None => {
                    *self.live.entry(owner.into()).or_default() += 1;
                    self.index.insert(
                        report.source.as_str().into(),
                        Source {
                            last: now,
                            interval,
                            seq: 0,
                            due: now,
                            stopping: false,
                            instance: report.instance,
                            services: Vec::new(),
                            owner: owner.into(),
                            data: T::default(),
                        },
                    );
                }
            }
        }
        let s = self
            .index
            .get_mut(report.source.as_str())
            .expect("inserted above");
        // A live name is bound to the process reporting under it: another (a pod holding the
        // same token) takes it only once that one has been silent for an interval or said it
        // stops; then it starts afresh, its own sequence numbers with it.
        if live && s.instance.is_some() && s.instance != report.instance {
            if !s.stopping && now - s.last <= s.interval {
                self.held += 1;
                return Err(SourceRefusal::Held);
            }
            s.start_over(now);
        }
        s.instance = report.instance;
        if report.seq != 0 && report.seq <= s.seq {
            self.duplicates += 1;
            return Err(SourceRefusal::Duplicate(report.seq));
        }
        // At most one report per interval from a host (a stopping source's first last one
        // aside): a tenant's source cannot have its values replaced and its sums walked many times a
        // second. A report states the time since the one before, so the spacing charged is the
        // shorter of its interval and the previous one's (a long interval after a late reply,
        // or a restart with a shorter one, is not held against the next reports); three pass
        // in a row, and a hair of float error never refuses one.
        let step = interval.min(s.interval);
        // What is owed in the old spacing, in the new one when it shrinks.
        let owed = (s.due - now).max(0.0) * (step / s.interval);
        let due = now + owed;
        let early = due - now > 2.0 * step + 1e-6;
        let first_last = report.last && !s.stopping;
        // Zone sums are exempt: only the aggregators send them, and a forward refused would
        // lose a zone's counts (a replica whose forwards came late sends them back to back).
        if live && early && !first_last && pinned {
            self.too_soon += 1;
            return Err(SourceRefusal::TooSoon);
        }
        if pinned {
            if s.services.is_empty() {
                s.services = report
                    .entries
                    .iter()
                    .map(|e| e.service.as_str().into())
                    .collect();
                s.services.sort_unstable();
                s.services.dedup();
            }
            if let Some(e) = report
                .entries
                .iter()
                .find(|e| !s.services.iter().any(|x| **x == *e.service))
            {
                self.foreign += 1;
                return Err(SourceRefusal::Foreign(
                    report.source.clone(),
                    e.service.clone(),
                    s.services.join(", "),
                ));
            }
        }
        s.last = now;
        s.interval = interval;
        s.seq = s.seq.max(report.seq);
        s.due = due + step;
        s.stopping = report.last;
        Ok(s)
    }

    /// Forgets the sources silent for three of their intervals, and those of an owner at its
    /// [`MAX_SOURCES_PER_OWNER`] silent for [`IDLE_AT_CAP`] of theirs (its newcomers are
    /// refused meanwhile, so idle ones make room first), handing each one's data to `gone`
    /// first.
    pub fn expire(&mut self, now: f64, mut gone: impl FnMut(&str, Source<T>)) {
        let full = |owner: &str| {
            self.live
                .get(owner)
                .is_some_and(|n| *n >= MAX_SOURCES_PER_OWNER)
        };
        let dead: Vec<Box<str>> = self
            .index
            .iter()
            .filter(|(_, s)| {
                let silent = now - s.last;
                silent > FORGET_AFTER * s.interval
                    || (silent > IDLE_AT_CAP * s.interval && full(&s.owner))
            })
            .map(|(n, _)| n.clone())
            .collect();
        for name in dead {
            if let Some(s) = self.index.remove(&name) {
                if let Some(n) = self.live.get_mut(&s.owner) {
                    *n -= 1;
                    if *n == 0 {
                        self.live.remove(&s.owner);
                    }
                }
                gone(&name, s);
            }
        }
    }

    pub fn get_mut(&mut self, name: &str) -> Option<&mut Source<T>> {
        self.index.get_mut(name)
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &Source<T>)> {
        self.index.iter().map(|(n, s)| (&**n, s))
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&str, &mut Source<T>)> {
        self.index.iter_mut().map(|(n, s)| (&**n, s))
    }
}
