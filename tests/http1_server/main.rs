//! The proxy's own HTTP/1 server side as clients see it on the wire, one file per behaviour.
//! One test binary: its files share the harness in `tests/common`.

#[path = "../common/mod.rs"]
mod common;

mod corners;
mod get_bodies;
mod keep_alive;
mod send_timeout;
mod wire;
