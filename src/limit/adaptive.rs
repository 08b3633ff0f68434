//! Adaptive concurrency: a limit on requests in flight that follows the upstream's latency, in
//! the family of Netflix's Gradient2 and Envoy's adaptive concurrency filter. Each 100 ms window
//! (or 10 samples, whichever is later) the average latency of its completed requests is one
//! sample; a timer closes a window no completion closed within a second, where requests
//! still pending since it opened give a lower bound of latency. The no-load latency (the
//! baseline) is learned without probes: it drops at once to a lower sample and rises slowly
//! (0.5 % a window) only while latency is within tolerance or the limit is at `min` (Envoy
//! pins concurrency to a floor to measure it, with 503 bursts).
//!
//! The limit starts at `initial` and doubles each good window while it is used (slow start),
//! then grows by `sqrt(limit)` per good window and shrinks by `max(0.5, tolerance x baseline /
//! sample)` per bad one, smoothed (0.2). It grows only when the window's peak in flight reached
//! half of it (Gradient2 grows without bound under a standing queue).
//!
//! Cost in the request path: a CAS, a `fetch_max` and a clock read to admit, two relaxed adds
//! to complete. Must never: block a request on the window's recomputation (one thread claims it
//! with a CAS, nobody waits), or let the limit leave `min..=max`.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use super::clock::{Clock, MonotonicClock};
use super::Nanos;

/// One sample is the average latency of the requests completed in at least this long.
pub const WINDOW: Nanos = 100_000_000;
/// ...and at least this many of them (a quiet window waits for more, up to `10 x WINDOW`).
pub const MIN_SAMPLES: u64 = 10;
/// How fast the baseline may rise per window while latency is fine.
const BASELINE_DRIFT: f64 = 0.005;
/// The flag in a permit's start time that says its latency was taken (nanoseconds never
/// reach it: 292 years of uptime).
const MEASURED: Nanos = 1 << 63;
/// Weight of a new limit against the current one.
const SMOOTHING: f64 = 0.2;

/// The settings of one adaptive limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Settings {
    pub min: u32,
    pub max: u32,
    pub initial: u32,
    /// How many times the baseline latency is still fine (e.g. 2.0).
    pub tolerance: f64,
}

/// What the limiter reports after each window, for gauges.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Snapshot {
    pub limit: u32,
    pub baseline: Nanos,
    pub sample: Nanos,
}

/// The limiter of one rule: shared by every request it matches.
pub struct Adaptive {
    settings: Settings,
    /// The limit admission reads; `limit_f` keeps the fraction between windows.
    limit: AtomicU32,
    limit_f: AtomicU64,
    in_flight: AtomicU32,
    // Relaxed: window accumulators, swapped out by the one thread that updates.
    sum: AtomicU64,
    count: AtomicU64,
    peak: AtomicU32,
    window_start: AtomicU64,
    /// In flight when the window opened: those still pending when it closes with no
    /// completion have waited at least its age.
    held: AtomicU32,
    baseline: AtomicU64,
    last_sample: AtomicU64,
    /// Slow start until latency first leaves tolerance.
    slow_start: AtomicBool,
    updating: AtomicBool,
    clock: MonotonicClock,
    /// Told the new state after each window (the proxy sets gauges from it).
    on_window: Option<Box<dyn Fn(Snapshot) + Send + Sync>>,
}

impl std::fmt::Debug for Adaptive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Adaptive")
            .field("settings", &self.settings)
            .field("limit", &self.limit())
            .field("in_flight", &self.in_flight())
            .field("baseline", &self.baseline())
            .finish()
    }
}

impl Adaptive {
    /// As [`new`](Self::new), calling `on_window` with the new state after each window.
    pub fn with_observer(
        settings: Settings,
        on_window: impl Fn(Snapshot) + Send + Sync + 'static,
    ) -> Self {
        let mut a = Self::new(settings);
        a.on_window = Some(Box::new(on_window));
        a
    }

    pub fn new(settings: Settings) -> Self {
        let initial = settings.initial.clamp(settings.min, settings.max);
        Adaptive {
            settings,
            limit: AtomicU32::new(initial),
            limit_f: AtomicU64::new(f64::from(initial).to_bits()),
            in_flight: AtomicU32::new(0),
            sum: AtomicU64::new(0),
            count: AtomicU64::new(0),
            peak: AtomicU32::new(0),
            window_start: AtomicU64::new(0),
            held: AtomicU32::new(0),
            baseline: AtomicU64::new(0),
            last_sample: AtomicU64::new(0),
            slow_start: AtomicBool::new(true),
            updating: AtomicBool::new(false),
            clock: MonotonicClock::default(),
            on_window: None,
        }
    }

    pub fn limit(&self) -> u32 {
        self.limit.load(Ordering::Relaxed)
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// A slot, if fewer than the current limit are in flight.
    pub fn try_acquire(self: &Arc<Self>) -> Option<AdaptivePermit> {
        let limit = self.limit.load(Ordering::Relaxed);
        let n = self
            .in_flight
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < limit).then_some(n + 1)
            })
            .ok()?;
        self.peak.fetch_max(n + 1, Ordering::Relaxed);
        Some(AdaptivePermit {
            limiter: self.clone(),
            started: self.clock.now() & !MEASURED,
        })
    }

    /// Records one completed request of `latency` at `now`; returns the new state when this
    /// call closed a window.
    pub fn record(&self, latency: Nanos, now: Nanos) -> Option<Snapshot> {
        self.sum.fetch_add(latency, Ordering::Relaxed);
        let count = self.count.fetch_add(1, Ordering::Relaxed) + 1;
        let start = self.window_start.load(Ordering::Relaxed);
        if start == 0 {
            self.window_start.store(now.max(1), Ordering::Relaxed);
            return None;
        }
        let age = now.saturating_sub(start);
        self.close_if(
            age >= WINDOW && (count >= MIN_SAMPLES || age >= 10 * WINDOW),
            now,
        )
    }

    /// Closes a window that no completion closed within `10 x WINDOW` (a timer calls it):
    /// with its samples, as a completion would have; with none while requests that were in
    /// flight when it opened still are, its age is a lower bound of their latency, which
    /// shrinks the limit past tolerance (an app that stopped answering is learned before its
    /// requests time out) and never lowers the baseline.
    pub fn tick(&self) -> Option<Snapshot> {
        self.tick_at(self.clock.now())
    }

    /// [`tick`](Self::tick) at `now`.
    pub fn tick_at(&self, now: Nanos) -> Option<Snapshot> {
        let start = self.window_start.load(Ordering::Relaxed);
        if start == 0 {
            if self.in_flight() > 0 {
                self.held.store(self.in_flight(), Ordering::Relaxed);
                self.window_start.store(now.max(1), Ordering::Relaxed);
            }
            return None;
        }
        self.close_if(now.saturating_sub(start) >= 10 * WINDOW, now)
    }

    /// Closes the window when `due`, unless another thread is closing it (nobody waits), and
    /// tells the observer.
    fn close_if(&self, due: bool, now: Nanos) -> Option<Snapshot> {
        if !due
            || self
                .updating
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
        {
            return None;
        }
        let snapshot = self.update(now);
        self.updating.store(false, Ordering::Release);
        if let (Some(observe), Some(s)) = (&self.on_window, snapshot) {
            observe(s);
        }
        snapshot
    }

    /// Closes the window: one sample, the baseline, the new limit.
    fn update(&self, now: Nanos) -> Option<Snapshot> {
        let count = self.count.swap(0, Ordering::Relaxed);
        let sum = self.sum.swap(0, Ordering::Relaxed);
        let in_flight = self.in_flight();
        let peak = self.peak.swap(in_flight, Ordering::Relaxed);
        let held = self.held.swap(in_flight, Ordering::Relaxed);
        let start = self.window_start.swap(now.max(1), Ordering::Relaxed);
        // No completion: a lower bound only, while what was pending at the start still is.
        let (sample, bound) = match count {
            0 if held > 0 && in_flight > 0 => (now.saturating_sub(start).max(1), true),
            0 => return None,
            _ => ((sum / count).max(1), false),
        };
        let s = self.settings;
        let current = f64::from_bits(self.limit_f.load(Ordering::Relaxed));
        let at_min = current <= f64::from(s.min) + 0.5;
        let old = self.baseline.load(Ordering::Relaxed);
        let fine = old == 0 || (sample as f64) <= s.tolerance * old as f64;
        if bound && fine {
            return None;
        }
        let baseline = if bound {
            old
        } else if old == 0 || sample < old {
            sample
        } else if fine || at_min {
            (old + ((old as f64 * BASELINE_DRIFT) as u64).max(1)).min(sample)
        } else {
            old
        };
        self.baseline.store(baseline, Ordering::Relaxed);
        self.last_sample.store(sample, Ordering::Relaxed);

        let used = f64::from(peak) >= current / 2.0;
        let next = if !fine {
            self.slow_start.store(false, Ordering::Relaxed);
            let gradient = (s.tolerance * baseline as f64 / sample as f64).clamp(0.5, 1.0);
            current * (1.0 - SMOOTHING) + current * gradient * SMOOTHING
        } else if self.slow_start.load(Ordering::Relaxed) && f64::from(peak) >= current {
            current * 2.0
        } else if used {
            current * (1.0 - SMOOTHING) + (current + current.sqrt()) * SMOOTHING
        } else {
            current
        };
        let next = next.clamp(f64::from(s.min), f64::from(s.max));
        self.limit_f.store(next.to_bits(), Ordering::Relaxed);
        let limit = next.round() as u32;
        self.limit.store(limit, Ordering::Relaxed);
        Some(Snapshot {
            limit,
            baseline,
            sample,
        })
    }

    /// Learned no-load latency (0 before the first window).
    pub fn baseline(&self) -> Nanos {
        self.baseline.load(Ordering::Relaxed)
    }
}

/// A slot of an adaptive limit: held until the response body ends. Its latency (to the
/// response head, or to the drop when no response came) feeds the limiter once.
#[derive(Debug)]
pub struct AdaptivePermit {
    limiter: Arc<Adaptive>,
    /// When it was taken, and [`MEASURED`] once its latency has fed the limiter (one word:
    /// a permit with a client's part stays three).
    started: Nanos,
}

impl AdaptivePermit {
    /// Gives the slot back unused (the request was refused after all): no latency to take.
    pub fn cancel(mut self) {
        self.started |= MEASURED;
    }

    /// The upstream answered (its response head): the request's latency is known now.
    pub fn responded(&mut self) -> Option<Snapshot> {
        self.measure()
    }

    fn measure(&mut self) -> Option<Snapshot> {
        if self.started & MEASURED != 0 {
            return None;
        }
        let started = self.started;
        self.started |= MEASURED;
        let now = self.limiter.clock.now();
        self.limiter.record(now.saturating_sub(started), now)
    }

    pub fn limiter(&self) -> &Arc<Adaptive> {
        &self.limiter
    }
}

impl Drop for AdaptivePermit {
    fn drop(&mut self) {
        // No response (upstream error, timeout, client gone): the time spent still counts,
        // so an upstream that times out under load shrinks the limit.
        self.measure();
        self.limiter.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Nanos = 1_000_000;

    fn limiter(min: u32, max: u32, initial: u32) -> Adaptive {
        Adaptive::new(Settings {
            min,
            max,
            initial,
            tolerance: 2.0,
        })
    }

    /// One window: `n` requests of `latency` with `peak` in flight, closed at `*now`.
    fn window(a: &Adaptive, now: &mut Nanos, latency: Nanos, peak: u32) -> Snapshot {
        a.peak.fetch_max(peak, Ordering::Relaxed);
        let mut last = None;
        for _ in 0..MIN_SAMPLES {
            *now += WINDOW / MIN_SAMPLES;
            last = a.record(latency, *now).or(last);
        }
        last.expect("the window closed")
    }

    fn started(a: &Adaptive) -> Nanos {
        let mut now = 1_000 * MS;
        a.record(10 * MS, now);
        now += 1;
        now
    }

    #[test]
    fn slow_start_doubles_while_latency_is_fine_and_the_limit_is_hit() {
        let a = limiter(4, 512, 4);
        let mut now = started(&a);
        let limits: Vec<u32> = (0..5)
            .map(|_| {
                let peak = a.limit();
                window(&a, &mut now, 10 * MS, peak).limit
            })
            .collect();
        assert_eq!(limits, [8, 16, 32, 64, 128]);
    }

    #[test]
    fn an_unused_limit_does_not_grow() {
        let a = limiter(4, 512, 20);
        let mut now = started(&a);
        for _ in 0..50 {
            assert_eq!(window(&a, &mut now, 10 * MS, 3).limit, 20);
        }
    }

    #[test]
    fn latency_past_tolerance_shrinks_the_limit_and_the_baseline_holds() {
        let a = limiter(4, 512, 100);
        let mut now = started(&a);
        window(&a, &mut now, 10 * MS, 100); // baseline 10 ms
        assert_eq!(a.baseline(), 10 * MS);
        // 40 ms: four times the baseline, twice the tolerance.
        let mut limits = Vec::new();
        for _ in 0..30 {
            limits.push(window(&a, &mut now, 40 * MS, 200).limit);
        }
        assert!(limits.windows(2).all(|w| w[1] <= w[0]), "{limits:?}");
        assert!(limits[29] < 20, "{limits:?}");
        assert_eq!(
            a.baseline(),
            10 * MS,
            "a standing queue does not raise the baseline"
        );
    }

    #[test]
    fn the_limit_never_leaves_min_and_max() {
        let a = limiter(4, 64, 4);
        let mut now = started(&a);
        for _ in 0..40 {
            window(&a, &mut now, 10 * MS, 1_000);
        }
        assert_eq!(a.limit(), 64);
        for _ in 0..200 {
            window(&a, &mut now, 1_000 * MS, 1_000);
        }
        assert_eq!(a.limit(), 4);
    }

    #[test]
    fn an_app_that_got_slower_at_any_concurrency_is_learned_at_min() {
        let a = limiter(4, 64, 4);
        let mut now = started(&a);
        window(&a, &mut now, 10 * MS, 4);
        // Now 50 ms whatever the load: the limit falls to min, then the baseline catches up.
        for _ in 0..2_000 {
            window(&a, &mut now, 50 * MS, 4);
        }
        assert!(a.baseline() * 2 >= 50 * MS, "baseline {}", a.baseline());
        // And with latency within tolerance again the limit grows back.
        let before = a.limit();
        for _ in 0..20 {
            let peak = a.limit();
            window(&a, &mut now, 50 * MS, peak);
        }
        assert!(a.limit() > before, "{} -> {}", before, a.limit());
    }

    #[test]
    fn a_timer_closes_a_quiet_window_with_the_samples_it_has() {
        let a = limiter(4, 512, 20);
        let mut now = started(&a);
        for _ in 0..3 {
            now += WINDOW;
            assert!(a.record(10 * MS, now).is_none(), "fewer than MIN_SAMPLES");
        }
        assert!(a.tick_at(now).is_none(), "younger than 10 windows");
        now += 10 * WINDOW;
        let s = a.tick_at(now).expect("the timer closed it");
        assert_eq!(s.sample, 10 * MS);
        assert_eq!(a.baseline(), 10 * MS);
        // Nothing in flight, nothing completed: nothing to learn, the limit stays.
        now += 20 * WINDOW;
        assert!(a.tick_at(now).is_none());
        assert_eq!(a.limit(), 20);
    }

    #[test]
    fn requests_pending_a_whole_timer_window_shrink_the_limit_without_a_completion() {
        let a = Arc::new(Adaptive::new(Settings {
            min: 4,
            max: 512,
            initial: 40,
            tolerance: 2.0,
        }));
        let mut now = 1_000 * MS;
        a.record(10 * MS, now);
        now += 10 * WINDOW;
        assert!(a.record(10 * MS, now).is_some(), "baseline learned");
        assert_eq!(a.baseline(), 10 * MS);
        let hung: Vec<_> = (0..30).map(|_| a.try_acquire().unwrap()).collect();
        // The window that opened before them says nothing of them.
        now += 10 * WINDOW;
        assert!(a.tick_at(now).is_none());
        let mut limits = Vec::new();
        for _ in 0..10 {
            now += 10 * WINDOW;
            limits.push(a.tick_at(now).expect("a bound past tolerance").limit);
        }
        assert!(limits.windows(2).all(|w| w[1] <= w[0]), "{limits:?}");
        assert!(limits[9] < 30, "{limits:?}");
        assert_eq!(a.baseline(), 10 * MS, "a lower bound never moves it");
        drop(hung);
    }

    #[test]
    fn pending_requests_within_tolerance_change_nothing() {
        let a = Arc::new(limiter(4, 512, 40));
        let mut now = 1_000 * MS;
        a.record(2_000 * MS, now);
        now += 10 * WINDOW;
        assert!(a.record(2_000 * MS, now).is_some());
        let _pending: Vec<_> = (0..5).map(|_| a.try_acquire().unwrap()).collect();
        for _ in 0..3 {
            now += 10 * WINDOW;
            assert!(a.tick_at(now).is_none(), "1 s pending is within 2 x 2 s");
        }
        assert_eq!(a.limit(), 40);
        assert_eq!(a.baseline(), 2_000 * MS);
    }

    #[test]
    fn a_cancelled_permit_frees_its_slot_and_feeds_no_latency() {
        let a = Arc::new(limiter(2, 2, 2));
        a.try_acquire().unwrap().cancel();
        assert_eq!(a.in_flight(), 0);
        assert_eq!(a.count.load(Ordering::Relaxed), 0, "no sample");
        drop(a.try_acquire().unwrap());
        assert_eq!(
            a.count.load(Ordering::Relaxed),
            1,
            "a dropped one is a sample"
        );
    }

    #[test]
    fn admission_stops_at_the_limit_and_a_dropped_permit_frees_its_slot() {
        let a = Arc::new(limiter(2, 2, 2));
        let p1 = a.try_acquire().unwrap();
        let _p2 = a.try_acquire().unwrap();
        assert!(a.try_acquire().is_none());
        drop(p1);
        assert_eq!(a.in_flight(), 1);
        assert!(a.try_acquire().is_some());
    }
}
