//! The limiter cores: pure algorithms, no I/O, no tokio, time injected through [`Clock`].
//!
//! Owns: [`Quota`] (what a rule allows), [`Decision`] (the answer, which always says when a
//! retry would be admitted), and the per-key state of each algorithm. Must never: read a
//! real clock itself, allocate or lock in a decision, or know about HTTP.
//!
//! Cost of a decision for a known key: one atomic load and one successful CAS in the common
//! case (a retry per lost race), plus a few integer operations; see `benches/decision.rs`.

pub mod adaptive;
mod clock;
pub mod concurrency;
pub mod distinct;
pub mod fixed_window;
pub mod gcra;
pub mod leaky_bucket;
pub mod sketch;
pub mod sliding_window_counter;
pub mod sliding_window_log;
pub mod token_bucket;

pub use adaptive::Adaptive;
pub use clock::{AnyClock, Clock, ManualClock, MonotonicClock, Nanos, NANOS_PER_SEC};
pub use concurrency::{Concurrency, Permit, Permits};
pub use distinct::{AtomicDistinct, Distinct};
pub use fixed_window::FixedWindow;
pub use gcra::Gcra;
pub use leaky_bucket::LeakyBucket;
pub use sketch::Sketch;
pub use sliding_window_counter::SlidingWindowCounter;
pub use sliding_window_log::SlidingWindowLog;
pub use token_bucket::TokenBucket;

/// A rate algorithm's per-key state. Implementations are lock-free or hold a per-key lock for
/// a few instructions; none allocates in `check` once the key exists.
pub trait Limiter: Send + Sync + 'static {
    /// Decides a request of `cost` units at `now`; an admitted request's units are taken.
    fn check(&self, quota: &Quota, now: Nanos, cost: u32) -> Decision;
    /// Gives back `cost` units that a `check` at `now` admitted, when another rule refused the
    /// same request.
    fn refund(&self, quota: &Quota, now: Nanos, cost: u32);
    /// True when the state at `now` is indistinguishable from a fresh one, so that forgetting
    /// the key loses nothing (no client gets a bucket it did not earn).
    fn is_idle(&self, quota: &Quota, now: Nanos) -> bool;
    /// The decision [`Self::check`] would make at `now`, taking nothing: on a copy of the
    /// state (for `explain`, off the request path).
    fn peek(&self, quota: &Quota, now: Nanos, cost: u32) -> Decision;
}

/// One decision on a state that is one atomic word: `step` reads the word and gives the new
/// one with what admitting means, or what refusing means (the word left as it is); it runs
/// again on what another thread wrote meanwhile. Relaxed: the word is the whole state and
/// publishes nothing else.
#[inline(always)]
fn decide<T>(
    state: &std::sync::atomic::AtomicU64,
    mut step: impl FnMut(u64) -> Result<(u64, T), T>,
) -> T {
    use std::sync::atomic::Ordering::Relaxed;
    let mut current = state.load(Relaxed);
    loop {
        let (new, admitted) = match step(current) {
            Ok(next) => next,
            Err(refused) => return refused,
        };
        match state.compare_exchange_weak(current, new, Relaxed, Relaxed) {
            Ok(_) => return admitted,
            Err(actual) => current = actual,
        }
    }
}

/// Which rate algorithm a rule uses (`limit.algorithm`).
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    Hash,
    serde::Serialize,
    serde::Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    #[default]
    TokenBucket,
    Gcra,
    LeakyBucket,
    FixedWindow,
    SlidingWindowLog,
    SlidingWindowCounter,
}

impl Algorithm {
    pub const ALL: [Algorithm; 6] = [
        Algorithm::TokenBucket,
        Algorithm::Gcra,
        Algorithm::LeakyBucket,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindowLog,
        Algorithm::SlidingWindowCounter,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::Gcra => "gcra",
            Algorithm::LeakyBucket => "leaky_bucket",
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingWindowLog => "sliding_window_log",
            Algorithm::SlidingWindowCounter => "sliding_window_counter",
        }
    }
}

use std::num::NonZeroU32;
use std::time::Duration;

/// What a rule allows: `count` per `period`, with up to `burst` at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    count: u32,
    period: Nanos,
    burst: u32,
    /// Nanoseconds that one unit of quota takes to come back (`period / count`).
    emission: Nanos,
    /// `burst * emission`: how far ahead of now the bucket may be spent.
    tolerance: Nanos,
    /// `period * burst / count`: the window of the window algorithms, which admit `burst`
    /// units per window (the rate's own period when `burst` is the rate's count).
    window: Nanos,
}

/// Why a [`Quota`] cannot be built.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuotaError {
    #[error("rate is faster than one request per nanosecond")]
    TooFast,
    #[error("period must be between 1ns and 365d")]
    BadPeriod,
}

impl Quota {
    /// `count` per `period`, `burst` at once. The emission interval is rounded to the nearest
    /// nanosecond, so rates are exact to within 0.5 ns per request (1 part in 2 000 at 1 M/s).
    pub fn new(count: NonZeroU32, period: Duration, burst: NonZeroU32) -> Result<Self, QuotaError> {
        let period_ns = u64::try_from(period.as_nanos()).map_err(|_| QuotaError::BadPeriod)?;
        if period_ns == 0 || period > Duration::from_secs(365 * 86_400) {
            return Err(QuotaError::BadPeriod);
        }
        let count = count.get();
        let emission = (period_ns + u64::from(count) / 2) / u64::from(count);
        if emission == 0 {
            return Err(QuotaError::TooFast);
        }
        // Cannot overflow: emission <= 365d in ns (< 2^55) and burst < 2^32 would, so clamp
        // through checked arithmetic and refuse what does not fit.
        let tolerance = emission
            .checked_mul(u64::from(burst.get()))
            .ok_or(QuotaError::BadPeriod)?;
        let window =
            u64::try_from(u128::from(period_ns) * u128::from(burst.get()) / u128::from(count))
                .map_err(|_| QuotaError::BadPeriod)?
                .max(1);
        Ok(Self {
            count,
            period: period_ns,
            burst: burst.get(),
            emission,
            tolerance,
            window,
        })
    }

    pub fn count(&self) -> u32 {
        self.count
    }
    pub fn period(&self) -> Nanos {
        self.period
    }
    pub fn burst(&self) -> u32 {
        self.burst
    }
    /// Nanoseconds for one unit of quota to come back.
    pub fn emission(&self) -> Nanos {
        self.emission
    }
    /// Nanoseconds for an empty bucket to refill completely.
    pub fn refill_time(&self) -> Nanos {
        self.tolerance
    }
    /// The window length of the window algorithms (`burst` units per window).
    pub fn window(&self) -> Nanos {
        self.window
    }
}

/// The answer of a limiter for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Admitted. `remaining` units are left now; the quota is whole again in `reset_after`.
    /// A shaping algorithm (leaky bucket) asks the request to `wait` before it goes on.
    Allow {
        remaining: u32,
        reset_after: Nanos,
        wait: Nanos,
    },
    /// Refused. A request of the same cost is admitted in `retry_after` if nothing else
    /// consumes meanwhile; `None` when the cost exceeds the burst and can never be admitted.
    Deny { retry_after: Option<Nanos> },
}

impl Decision {
    pub fn is_allowed(&self) -> bool {
        matches!(self, Decision::Allow { .. })
    }
}

/// Whole seconds, rounded up, for headers that count in seconds.
pub fn ceil_secs(n: Nanos) -> u64 {
    n.div_ceil(NANOS_PER_SEC)
}

#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    pub const MS: Nanos = 1_000_000;

    pub fn quota(count: u32, period: Duration, burst: u32) -> Quota {
        Quota::new(
            NonZeroU32::new(count).unwrap(),
            period,
            NonZeroU32::new(burst).unwrap(),
        )
        .unwrap()
    }
}

#[cfg(test)]
mod tests;
