//! Which keys of a rule were refused lately, for `top`: up to [`PER_SECOND`] refusals a
//! second are counted by key (a flood's first ones each second, which its heaviest keys
//! dominate), in this minute's and the last minute's tables. Owns the tables. Must never:
//! wait for its lock (a refusal that finds it taken is not counted), hold more than
//! [`MOST_KEYS`] keys a minute, or cost a refusal past the second's budget more than two
//! loads.

// A lock taken by at most `PER_SECOND` refusals a second, never waited for (`try_lock`).
#[allow(clippy::disallowed_types)]
use std::sync::Mutex;

use super::{LogBudget, Nanos, StoredKey, NANOS_PER_SEC};

/// Refusals a second a rule counts by key, at most.
pub const PER_SECOND: u32 = 100;
/// Keys a rule's table holds a minute, at most; refusals of further keys are not counted.
pub const MOST_KEYS: usize = 512;

/// One rule's refused keys.
#[derive(Default)]
pub(super) struct RefusedKeys {
    budget: LogBudget,
    #[allow(clippy::disallowed_types)]
    tables: Mutex<Tables>,
}

#[derive(Default)]
struct Tables {
    minute: u64,
    now: std::collections::HashMap<StoredKey, u64>,
    last: std::collections::HashMap<StoredKey, u64>,
}

impl Tables {
    /// Turns the tables to `minute`: the current one becomes the last (or both are emptied
    /// after a quiet minute).
    fn turn(&mut self, minute: u64) {
        if minute == self.minute {
            return;
        }
        self.last = if minute == self.minute + 1 {
            std::mem::take(&mut self.now)
        } else {
            self.now.clear();
            Default::default()
        };
        self.minute = minute;
    }
}

impl RefusedKeys {
    /// Counts a refusal of `key` at `now`, within the second's budget.
    #[inline]
    pub(super) fn record(&self, key: &[u8], now: Nanos) {
        if self.budget.take(now, PER_SECOND) {
            self.count(key, now);
        }
    }

    #[cold]
    fn count(&self, key: &[u8], now: Nanos) {
        let Ok(mut t) = self.tables.try_lock() else {
            return;
        };
        t.turn(now / (60 * NANOS_PER_SEC));
        if let Some(n) = t.now.get_mut(key) {
            *n += 1;
        } else if t.now.len() < MOST_KEYS {
            t.now.insert(StoredKey::from_slice(key), 1);
        }
    }

    /// The `n` keys refused most over this minute and the last at `now`, with their counts.
    pub(super) fn top(&self, n: usize, now: Nanos) -> Vec<(StoredKey, u64)> {
        let mut t = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        t.turn(now / (60 * NANOS_PER_SEC));
        let mut all: std::collections::HashMap<&StoredKey, u64> = Default::default();
        for (k, c) in t.now.iter().chain(t.last.iter()) {
            *all.entry(k).or_default() += c;
        }
        let mut list: Vec<(StoredKey, u64)> =
            all.into_iter().map(|(k, c)| (k.clone(), c)).collect();
        list.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        list.truncate(n);
        list
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: Nanos = NANOS_PER_SEC;

    #[test]
    fn refusals_are_counted_by_key_within_the_seconds_budget_over_two_minutes() {
        let r = RefusedKeys::default();
        let t0 = 3600 * SEC;
        for i in 0..150 {
            r.record(if i % 3 == 0 { b"b" } else { b"a" }, t0);
        }
        // The second's budget: 100 of 150 counted.
        let top = r.top(10, t0);
        assert_eq!(
            top.iter().map(|(_, c)| c).sum::<u64>(),
            u64::from(PER_SECOND)
        );
        assert_eq!(&top[0].0[..], b"a");
        // The next minute still shows them; the one after that does not.
        r.record(b"c", t0 + 61 * SEC);
        let top = r.top(10, t0 + 61 * SEC);
        assert_eq!(top.len(), 3);
        assert_eq!(
            r.top(10, t0 + 125 * SEC).len(),
            1,
            "c, of the minute before"
        );
        assert_eq!(r.top(10, t0 + 185 * SEC).len(), 0);
    }

    #[test]
    fn a_minute_holds_at_most_its_bound_of_keys() {
        let r = RefusedKeys::default();
        for i in 0..(MOST_KEYS as u64 + 100) {
            // One a second: the budget never binds.
            r.record(&i.to_le_bytes(), i * SEC / 20);
        }
        assert!(r.top(usize::MAX, 0).len() <= MOST_KEYS);
    }
}
