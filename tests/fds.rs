//! The proxy makes room for the descriptors its connection cap needs before its first client
//! (src/fds.rs). Alone in its test binary: it lowers the process's open-files limit.
// The open-files limits are the C library's.
#![allow(unsafe_code)]

mod common;

use common::*;

fn nofile() -> libc::rlimit {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into `lim`, a valid rlimit.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    lim
}

fn set_soft(soft: libc::rlim_t) {
    let lim = libc::rlimit {
        rlim_cur: soft,
        rlim_max: nofile().rlim_max,
    };
    // SAFETY: setrlimit reads `lim`, a valid rlimit at or below the hard limit.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
}

/// The kernel's descriptor table size of this process.
fn table_size() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find_map(|l| l.strip_prefix("FDSize:"));
    line.unwrap().trim().parse().unwrap()
}

#[tokio::test]
async fn a_low_soft_open_files_limit_is_raised_for_the_connection_cap() {
    let before = nofile();
    // 1 000 client connections, 1 500 upstream connections (idle ones included), 256 others.
    let needed = 2756;
    assert!(
        before.rlim_max >= needed,
        "this test needs a hard open-files limit of {needed}, not {}",
        before.rlim_max
    );
    set_soft(256);
    let up = upstream().await;
    let sc = spillway::internal::proxy::Sidecar::start(config(
        up.addr,
        "workers: 1\nlimits: { max_connections: 1000, max_upstream_connections: 1500 }\nrules: []",
    ))
    .await
    .unwrap();
    let after = nofile();
    let table = table_size();
    sc.shutdown();
    sc.wait().await;
    set_soft(before.rlim_cur);
    assert_eq!(after.rlim_cur, needed, "soft limit raised to the need");
    assert!(table >= needed, "descriptor table of {table} for {needed}");
}
