//! How soon the control plane's processes give freed memory back.
//!
//! The aggregator and the controller parse large reports on blocking threads, each thread
//! allocating for its own. What a burst of them freed stays with the threads for a while: with
//! mimalloc (the binary's allocator, feature `mimalloc`) for its purge delay, a second by
//! default; with glibc's malloc in per-thread arenas, which keep their pages. Either way a
//! process's peak (what a memory limit kills on) grew with how the burst happened to
//! interleave, not with what it held (tests/tenant.rs, the aggregator's budget). Owns that one
//! setting, made by `main` before the runtime's threads start: freed pages purged at once
//! (mimalloc), or two arenas (glibc). Must never be made for the proxy, whose workers
//! allocate on every request: purging at once or two shared arenas would cost it on each.

// One allocator parameter, set through its C interface as the allocator documents.
#![allow(unsafe_code)]

/// mimalloc's `mi_option_purge_delay` (include/mimalloc.h of the version the lock file pins;
/// `the_purge_delay_is_the_option_set` checks it by its documented default).
#[cfg(feature = "mimalloc")]
const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Frees memory back to the system as soon as the process's threads let go of it.
pub fn for_control_plane() {
    #[cfg(feature = "mimalloc")]
    // SAFETY: mi_option_set only stores an option's value; a purge delay takes any integer.
    unsafe {
        libmimalloc_sys::mi_option_set(PURGE_DELAY, 0);
    }
    #[cfg(all(not(feature = "mimalloc"), target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets an allocator parameter; M_ARENA_MAX takes any positive value.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

#[cfg(all(test, feature = "mimalloc"))]
mod tests {
    /// mimalloc's value of `option`, or `None` when the environment sets it (`MIMALLOC_<name>`).
    fn default_of(option: libmimalloc_sys::mi_option_t, names: &[&str]) -> Option<i64> {
        if names
            .iter()
            .any(|n| std::env::var_os(format!("MIMALLOC_{n}")).is_some())
        {
            return None;
        }
        // SAFETY: reading an option's value has no precondition.
        Some(unsafe { libmimalloc_sys::mi_option_get(option) } as i64)
    }

    #[test]
    fn the_purge_delay_is_the_option_set() {
        // mimalloc 3's documented default purge delay, in milliseconds: another option here
        // (the header's order changed) would have another value.
        if let Some(delay) = default_of(super::PURGE_DELAY, &["PURGE_DELAY", "RESET_DELAY"]) {
            assert_eq!(
                delay,
                1000,
                "option {} is not the purge delay",
                super::PURGE_DELAY
            );
        }
    }

    #[test]
    fn arenas_are_committed_as_they_are_used() {
        // `mi_option_arena_eager_commit` (include/mimalloc.h): 0 only when the build took
        // .cargo/config.toml's CFLAGS (a CFLAGS of the builder's own replaces it).
        let names = ["ARENA_EAGER_COMMIT", "EAGER_REGION_COMMIT"];
        if let Some(eager) = default_of(4, &names) {
            assert_eq!(
                eager, 0,
                "mimalloc was built without MI_DEFAULT_ARENA_EAGER_COMMIT=0"
            );
        }
    }
}
