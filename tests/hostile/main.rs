//! What attackers send, against the real proxy on loopback: a limit already used up or taken
//! from everyone (`limits`), abuse of the data plane (`abuse`), and every phase of a request
//! past its head held to a bound (`phases`). One test binary: its files share the harness in
//! `tests/common`.

#[path = "../common/mod.rs"]
mod common;

mod abuse;
mod limits;
mod phases;
