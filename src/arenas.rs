//! How many malloc arenas the control plane's processes keep.
//!
//! glibc gives each thread that allocates while another holds an arena an arena of its own, up
//! to eight per core, and an arena keeps the pages it once held. The aggregator and the
//! controller parse large reports on blocking threads: each burst of them spread its memory
//! over new arenas, so a process's peak (what a memory limit kills on) grew with how the burst
//! happened to interleave, not with what it held (tests/tenant.rs, the aggregator's budget).
//! Two arenas keep the peak near what is held. Owns that one setting, set by `main` before the
//! runtime's threads start; must never be set for the proxy, whose workers each allocate on
//! every request and would contend for two arenas.

// mallopt is the C library's, called as it documents.
#![allow(unsafe_code)]

/// Caps the arenas at two (glibc only; other C libraries have no such arenas).
pub fn cap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets an allocator parameter; M_ARENA_MAX takes any positive value.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}
