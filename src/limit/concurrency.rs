//! Concurrency: at most `N` requests of a key in flight at once.
//!
//! A slot is taken when the request is admitted and given back when its response body ends
//! or the client goes away (the [`Permit`] is dropped). No rate, no window: it protects an
//! upstream whose cost is time (uploads, reports), not count.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use super::adaptive::AdaptivePermit;

/// Per-key in-flight count: 8 bytes behind an `Arc`, shared with the permits.
#[derive(Debug, Default)]
pub struct Concurrency {
    // AcqRel on acquire/release is not needed for memory safety (nothing else is published),
    // Relaxed keeps the count exact since every change is one read-modify-write.
    in_flight: AtomicU32,
    /// Its slots are given back at the response head (the rule's `release: head`): kept
    /// here, not in each permit, so that a permit stays three words with a client's part.
    at_head: AtomicBool,
}

impl Concurrency {
    /// A slot when fewer than `max` are taken; `at_head`: given back at the response head
    /// ([`Permit::releases_at_head`]), else when dropped.
    pub fn try_acquire(self: &Arc<Self>, max: u32, at_head: bool) -> Option<Permit> {
        let taken = self.try_take(max)?;
        if at_head {
            self.at_head.store(true, Ordering::Relaxed);
        }
        Some(Permit {
            held: Held::Fixed(taken),
            part: None,
        })
    }

    /// A slot when fewer than `max` are taken, given back by the [`Permit`] it is added to
    /// ([`Permit::with_part`]).
    pub fn try_take(self: &Arc<Self>, max: u32) -> Option<Arc<Self>> {
        self.in_flight
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| self.clone())
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }
}

/// The slots one request holds, one per concurrency rule that applied (one without an
/// allocation).
pub type Permits = smallvec::SmallVec<[Permit; 1]>;

/// A slot of a concurrency limit, fixed or adaptive, with the slot of its client's part of
/// a shared limit when it has one; dropping it frees both.
#[derive(Debug)]
pub struct Permit {
    held: Held,
    part: Option<Arc<Concurrency>>,
}

#[derive(Debug)]
enum Held {
    Fixed(Arc<Concurrency>),
    Adaptive(AdaptivePermit),
}

impl Permit {
    /// Slots of this key (or adaptive rule) taken now, this one included.
    pub fn in_flight(&self) -> u32 {
        match &self.held {
            Held::Fixed(c) => c.in_flight(),
            Held::Adaptive(p) => p.limiter().in_flight(),
        }
    }

    /// With the slot of its client's part (see [`Concurrency::try_take`]).
    pub fn with_part(mut self, part: Option<Arc<Concurrency>>) -> Self {
        self.part = part;
        self
    }

    /// The upstream answered: an adaptive limit takes the request's latency now (else when
    /// the permit is dropped). Nothing for a fixed limit.
    pub fn responded(&mut self) {
        if let Held::Adaptive(p) = &mut self.held {
            p.responded();
        }
    }

    /// Whether the slot is given back once the response head has come (it is dropped then):
    /// an adaptive limit's always (it measures to the head, as Envoy's does, so a long-lived
    /// response never holds it), a fixed one's with `release: head`.
    pub fn releases_at_head(&self) -> bool {
        match &self.held {
            Held::Fixed(c) => c.at_head.load(Ordering::Relaxed),
            Held::Adaptive(_) => true,
        }
    }
}

impl From<AdaptivePermit> for Permit {
    fn from(p: AdaptivePermit) -> Self {
        Permit {
            held: Held::Adaptive(p),
            part: None,
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        // An adaptive permit frees its slot in its own Drop.
        if let Held::Fixed(c) = &self.held {
            c.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
        if let Some(c) = &self.part {
            c.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_permit_stays_three_words_with_a_part_and_frees_both() {
        assert_eq!(
            std::mem::size_of::<Permit>(),
            3 * std::mem::size_of::<usize>()
        );
        let (rule, part) = (
            Arc::new(Concurrency::default()),
            Arc::new(Concurrency::default()),
        );
        let p = rule
            .try_acquire(2, false)
            .unwrap()
            .with_part(part.try_take(1));
        assert_eq!((rule.in_flight(), part.in_flight()), (1, 1));
        assert!(part.try_take(1).is_none());
        drop(p);
        assert_eq!((rule.in_flight(), part.in_flight()), (0, 0));
    }

    #[test]
    fn at_most_n_permits_exist_and_dropping_one_frees_a_slot() {
        let c = Arc::new(Concurrency::default());
        let a = c.try_acquire(2, false).unwrap();
        let _b = c.try_acquire(2, false).unwrap();
        assert!(c.try_acquire(2, false).is_none());
        drop(a);
        assert_eq!(c.in_flight(), 1);
        assert!(c.try_acquire(2, false).is_some());
    }

    #[test]
    fn concurrency_never_exceeds_n_under_many_threads() {
        let c = Arc::new(Concurrency::default());
        let peak = Arc::new(AtomicU32::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (c, peak) = (c.clone(), peak.clone());
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        if let Some(p) = c.try_acquire(3, false) {
                            peak.fetch_max(c.in_flight(), Ordering::Relaxed);
                            drop(p);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(peak.load(Ordering::Relaxed) <= 3);
        assert_eq!(c.in_flight(), 0);
    }
}
