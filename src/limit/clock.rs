//! Time for the limiters, injected so that every algorithm can be tested exactly.
//!
//! A [`Clock`] returns monotonic nanoseconds since its own epoch. The limiters only ever
//! subtract and compare these values, so the epoch is arbitrary. [`MonotonicClock`] is one of
//! the two real clocks in the crate (the other is tokio's timer for background loops).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Nanoseconds on a [`Clock`]'s time line.
pub type Nanos = u64;

pub const NANOS_PER_SEC: Nanos = 1_000_000_000;

/// A monotonic source of time for the limiters.
pub trait Clock: Send + Sync + 'static {
    /// Nanoseconds since this clock's epoch; never goes backwards.
    fn now(&self) -> Nanos;
}

/// The process's monotonic clock, with its epoch at construction.
///
/// Reads the CPU's invariant TSC through `quanta` where the CPU has one (cheaper than
/// `clock_gettime`, which would otherwise be the largest single part of a decision;
/// docs/measurements.md, "The clock"), and the OS monotonic clock where it does not.
#[derive(Debug, Clone)]
pub struct MonotonicClock {
    clock: quanta::Clock,
    epoch: quanta::Instant,
}

impl MonotonicClock {
    pub fn new() -> Self {
        let clock = quanta::Clock::new();
        let epoch = clock.now();
        Self { clock, epoch }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    #[inline]
    fn now(&self) -> Nanos {
        // u64 nanoseconds last 584 years of uptime.
        self.clock
            .now()
            .saturating_duration_since(self.epoch)
            .as_nanos() as Nanos
    }
}

/// A clock that only moves when told to; shared between clones.
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    // Relaxed is enough: the value itself is the only thing published.
    now: Arc<AtomicU64>,
}

impl ManualClock {
    pub fn new(start: Nanos) -> Self {
        Self {
            now: Arc::new(AtomicU64::new(start)),
        }
    }

    pub fn advance(&self, by: std::time::Duration) {
        self.now
            .fetch_add(by.as_nanos() as Nanos, Ordering::Relaxed);
    }

    pub fn set(&self, to: Nanos) {
        self.now.store(to, Ordering::Relaxed);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Nanos {
        self.now.load(Ordering::Relaxed)
    }
}

/// A clock chosen at run time: the real one in production, a manual one in tests.
#[derive(Debug, Clone)]
pub enum AnyClock {
    Monotonic(MonotonicClock),
    Manual(ManualClock),
}

impl Default for AnyClock {
    fn default() -> Self {
        AnyClock::Monotonic(MonotonicClock::new())
    }
}

impl Clock for AnyClock {
    #[inline]
    fn now(&self) -> Nanos {
        match self {
            AnyClock::Monotonic(c) => c.now(),
            AnyClock::Manual(c) => c.now(),
        }
    }
}
