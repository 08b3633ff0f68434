//! The upstream side: a client connection's own upstream connection, its reuse and its caps.
//! One test binary: its files share the harness in `tests/common`.

#[path = "../common/mod.rs"]
mod common;

mod caps;
mod conns;
mod framing;
mod pool_hygiene;
