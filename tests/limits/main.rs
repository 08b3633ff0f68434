//! Limits through the real proxy: every algorithm, adaptive concurrency, and rules that mean what they say.
//! One test binary: its files share the harness in `tests/common`.

#[path = "../common/mod.rs"]
mod common;

mod adaptive;
mod algorithms;
mod rules;
mod usage;
