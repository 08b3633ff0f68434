//! Room for the file descriptors the configured connections need, made before the first client.
//!
//! Two things, once at start-up:
//!
//! - The soft open-files limit (`RLIMIT_NOFILE`) is raised towards what `limits.max_connections`
//!   needs, up to the hard limit, as nginx's `worker_rlimit_nofile` does: container runtimes
//!   often start processes at a soft limit of 1024, which would refuse clients (`EMFILE`) long
//!   before the configured cap. Below the need, [`prepare`] says so and the caller warns.
//! - The kernel's descriptor table is grown once to that size. Linux grows a process's table by
//!   doubling when a new descriptor does not fit (64, 128, 256, ...), and in a process with more
//!   than one thread each growth first waits for an RCU grace period (`expand_fdtable` calls
//!   `synchronize_rcu`): the worker that accepted a client or connected upstream sleeps, with
//!   every connection it serves (docs/measurements.md, "The descriptor table grown at
//!   start-up"). nginx's workers are single-threaded processes, which skip the wait.
//!
//! Cost: a table of 8 bytes per descriptor in kernel memory, nothing per request.

// The limits and the table are the C library's, called as it documents them.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// Descriptors the table is grown to at most; a larger need grows the rest on demand.
const MAX_PRESIZE: u64 = 1 << 16;

/// What [`prepare`] found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Room {
    /// Descriptors the configuration may use at once.
    pub needed: u64,
    /// The soft limit now in force.
    pub limit: u64,
}

/// Descriptors the proxy may use at once: `max_connections` client connections,
/// `max_upstream` upstream connections (idle ones included: `limits.max_upstream_connections`
/// counts them all), and some for listeners, the control plane and Redis.
pub fn needed(max_connections: u32, max_upstream: u32) -> u64 {
    u64::from(max_connections) + u64::from(max_upstream) + 256
}

/// Raises the soft open-files limit towards `needed` and grows the descriptor table to the
/// limit (at most [`MAX_PRESIZE`]), duplicating `any` high and closing the copy.
pub fn prepare(needed: u64, any: BorrowedFd<'_>) -> io::Result<Room> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the limits into `lim`, a valid rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if lim.rlim_cur < needed && lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: needed.min(lim.rlim_max),
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit reads `raised`, a valid rlimit; a soft limit up to the hard one is
        // always allowed.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim = raised;
        }
    }
    let top = needed.min(lim.rlim_cur).min(MAX_PRESIZE).saturating_sub(1);
    if let Ok(top) = libc::c_int::try_from(top) {
        // SAFETY: F_DUPFD_CLOEXEC duplicates a descriptor that `any` keeps open onto the
        // lowest free number at or above `top`; the copy is ours alone and closed at once.
        let copy = unsafe { libc::fcntl(any.as_raw_fd(), libc::F_DUPFD_CLOEXEC, top) };
        if copy >= 0 {
            // SAFETY: `copy` was just opened here and nothing else knows it.
            unsafe { libc::close(copy) };
        }
    }
    Ok(Room {
        needed,
        limit: lim.rlim_cur,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    /// The kernel's descriptor table size of this process (`FDSize` in /proc/self/status).
    fn table_size() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("FDSize:"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    #[test]
    fn the_table_is_grown_to_the_need_within_the_limit() {
        let file = std::fs::File::open("/proc/self/status").unwrap();
        let room = prepare(needed(1000, 1000), file.as_fd()).unwrap();
        assert_eq!(room.needed, 2000 + 256);
        let want = room.needed.min(room.limit);
        assert!(
            table_size() >= want,
            "table {} for a need of {want}",
            table_size()
        );
        // Still open and usable: only the copy was closed.
        assert!(std::fs::File::open("/proc/self/status").is_ok());
        drop(file);
    }
}
