//! Concurrency: at most `N` requests of a key in flight at once.
//!
//! A slot is taken when the request is admitted and given back when its response body ends
//! or the client goes away (the [`Permit`] is dropped). No rate, no window: it protects an
//! upstream whose cost is time (uploads, reports), not count.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use super::adaptive::AdaptivePermit;

/// Per-key in-flight count: 4 bytes behind an `Arc`, shared with the permits.
#[derive(Debug, Default)]
pub struct Concurrency {
    // AcqRel on acquire/release is not needed for memory safety (nothing else is published),
    // Relaxed keeps the count exact since every change is one read-modify-write.
    in_flight: AtomicU32,
}

impl Concurrency {
    /// Takes a slot if fewer than `max` are taken.
    /// A slot when fewer than `max` are taken; `at_head`: given back at the response head
    /// ([`Permit::releases_at_head`]), else when dropped.
    pub fn try_acquire(self: &Arc<Self>, max: u32, at_head: bool) -> Option<Permit> {
        self.in_flight
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Permit(Held::Fixed(self.clone(), at_head)))
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }
}

/// The slots one request holds: a rule's, and its client's part of a shared one (two fit
/// without an allocation).
pub type Permits = smallvec::SmallVec<[Permit; 2]>;

/// A slot of a concurrency limit, fixed or adaptive; dropping it frees the slot.
#[derive(Debug)]
pub struct Permit(Held);

#[derive(Debug)]
enum Held {
    /// With whether it is given back at the response head.
    Fixed(Arc<Concurrency>, bool),
    Adaptive(AdaptivePermit),
}

impl Permit {
    /// Slots of this key (or adaptive rule) taken now, this one included.
    pub fn in_flight(&self) -> u32 {
        match &self.0 {
            Held::Fixed(c, _) => c.in_flight(),
            Held::Adaptive(p) => p.limiter().in_flight(),
        }
    }

    /// The upstream answered: an adaptive limit takes the request's latency now (else when
    /// the permit is dropped). Nothing for a fixed limit.
    pub fn responded(&mut self) {
        if let Held::Adaptive(p) = &mut self.0 {
            p.responded();
        }
    }

    /// Whether the slot is given back once the response head has come (it is dropped then):
    /// an adaptive limit's always (it measures to the head, as Envoy's does, so a long-lived
    /// response never holds it), a fixed one's with `release: head`.
    pub fn releases_at_head(&self) -> bool {
        match &self.0 {
            Held::Fixed(_, at_head) => *at_head,
            Held::Adaptive(_) => true,
        }
    }
}

impl From<AdaptivePermit> for Permit {
    fn from(p: AdaptivePermit) -> Self {
        Permit(Held::Adaptive(p))
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        // An adaptive permit frees its slot in its own Drop.
        if let Held::Fixed(c, _) = &self.0 {
            c.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
