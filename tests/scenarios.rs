//! `spillway test`: the example configurations' scenarios pass, and a scenario fails when the
//! rule it proves is changed.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::BIN;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn spillway_test(files: &[&Path]) -> Output {
    Command::new(BIN)
        .arg("test")
        .args(files)
        .current_dir(ROOT)
        .output()
        .unwrap()
}

/// The example scenarios this build can run (Redis's needs its feature).
fn examples() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(Path::new(ROOT).join("config"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".test.yaml"))
        .filter(|p| cfg!(feature = "redis") || !p.ends_with("exact.test.yaml"))
        .collect();
    out.sort();
    out
}

#[test]
fn every_example_configurations_scenarios_hold() {
    let files = examples();
    assert!(files.len() >= 4, "{files:?}");
    for file in files {
        let out = spillway_test(&[&file]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}: {text}{}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(text.contains("ok "), "{text}");
        assert!(!text.contains("FAIL"), "{text}");
    }
}

/// A copy of `config/<name>` with `from` replaced by `to`, beside a copy of its scenarios.
fn changed(name: &str, from: &str, to: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "spillway-scenarios-{}-{}",
        std::process::id(),
        name.replace('.', "-")
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let config = std::fs::read_to_string(Path::new(ROOT).join("config").join(name)).unwrap();
    assert!(config.contains(from), "{name} has no {from:?}");
    std::fs::write(dir.join(name), config.replace(from, to)).unwrap();
    let test = name.replace(".yaml", ".test.yaml");
    std::fs::copy(Path::new(ROOT).join("config").join(&test), dir.join(&test)).unwrap();
    dir.join(test)
}

#[test]
fn a_scenario_fails_when_the_rule_it_proves_is_changed() {
    for (name, from, to, says) in [
        (
            "tiers.yaml",
            "limit: { rate: 5/s, burst: 10 }",
            "limit: { rate: 6/s, burst: 10 }",
            "anonymous: admitted",
        ),
        (
            "overrides.yaml",
            "{ key: acme, limit: { rate: 100/s, burst: 200 } }",
            "{ key: acme, limit: { rate: 90/s, burst: 200 } }",
            "acme: admitted",
        ),
        (
            "overrides.yaml",
            "    replaces: [per-key]\n",
            "",
            "partner: admitted",
        ),
        (
            "fleet.yaml",
            "limit: { rate: 100/s }         # fleet-wide, per key",
            "limit: { rate: 120/s }",
            "heavy: admitted",
        ),
    ] {
        let file = changed(name, from, to);
        let out = spillway_test(&[&file]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(1), "{name}: {text}");
        assert!(text.contains("FAIL"), "{text}");
        assert!(text.contains(says), "{name}: {text}");
    }
}

#[test]
fn a_scenario_that_names_no_client_is_refused_with_the_reason() {
    let dir = std::env::temp_dir().join(format!("spillway-scenarios-{}-bad", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        Path::new(ROOT).join("config/spillway.yaml"),
        dir.join("spillway.yaml"),
    )
    .unwrap();
    let file = dir.join("bad.test.yaml");
    std::fs::write(
        &file,
        "config: spillway.yaml\nscenarios:\n  - name: s\n    duration: 1s\n    clients: [{ name: a, rate: 1/s }]\n    expect: [{ client: b, admitted: 1 }]\n",
    )
    .unwrap();
    let out = spillway_test(&[&file]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no client is called \"b\""), "{err}");
}
