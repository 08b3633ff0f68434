//! The `spillway` binary as a user runs it: check-config, and the proxy's signal handling.

mod common;

use std::io::Write;

use common::{temp_file, Proc, BIN};
use std::process::Command;

#[test]
fn check_config_accepts_the_example_configs() {
    for file in [
        "config/spillway.yaml",
        "config/tiers.yaml",
        "config/fleet.yaml",
        "config/overrides.yaml",
        #[cfg(feature = "redis")]
        "config/exact.yaml",
    ] {
        let out = Command::new(BIN)
            .args(["check-config", file])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .unwrap();
        assert!(out.status.success(), "{file}: {out:?}");
        assert!(String::from_utf8_lossy(&out.stdout).contains(": ok"));
    }
}

/// The binary built without Redis says which feature the Redis example needs, and fails.
#[cfg(not(feature = "redis"))]
#[test]
fn check_config_names_the_feature_a_config_needs() {
    let out = Command::new(BIN)
        .args(["check-config", "config/exact.yaml"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("needs the `redis` feature"), "{err}");
}

#[test]
fn check_config_explains_a_bad_file_with_line_and_field_and_exits_non_zero() {
    let path = temp_file(
        "bad.yaml",
        "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nrules:\n  - name: a\n    key: client_ip\n    limit: { rate: 10/x }\n",
    );
    let out = Command::new(BIN)
        .args(["check-config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("{}:7:", path.display())),
        "names file and line: {err}"
    );
    assert!(
        err.contains("rules[0].limit.rate: \"10/x\": unknown unit"),
        "{err}"
    );
}

#[test]
fn check_config_takes_several_files_stdin_and_json_and_refuses_missing_token_files() {
    let good = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/spillway.yaml");
    let missing = temp_file(
        "missing-token.yaml",
        "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\ncontrol_plane: { url: 'http://127.0.0.1:7001', token_file: /nonexistent/token }\n",
    );
    let mut child = Command::new(BIN)
        .args(["check-config", "--output", "json", "-"])
        .arg(&good)
        .arg(&missing)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"service: t\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(2), "one of three is invalid");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let oks: Vec<bool> = report
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["ok"].as_bool().unwrap())
        .collect();
    assert_eq!(oks, [true, true, false]);
    assert_eq!(report[0]["file"], "-");
    assert_eq!(report[0]["service"], "t");
    let error = report[2]["error"].as_str().unwrap();
    assert!(
        error.contains("control_plane.token_file") && error.contains("/nonexistent/token"),
        "{error}"
    );
}

#[test]
fn the_proxy_refuses_to_start_on_a_bad_config() {
    let path = temp_file("bad-proxy.yaml", "service: s\nlisten: nowhere\n");
    let out = Command::new(BIN)
        .args(["proxy", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("listen"));
}

#[test]
fn sigterm_drains_and_exits_zero() {
    let path = temp_file(
        "sigterm.yaml",
        "service: s\nlisten: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://127.0.0.1:1\ntimeouts: { drain: 5s }\nrules: []\n",
    );
    // Proc waits for the readiness line, printed once both listeners are bound.
    let mut proxy = Proc::spawn(&["proxy", "--config", path.to_str().unwrap()]);
    assert!(proxy.addr.ip().is_loopback());
    let mut s = std::net::TcpStream::connect(proxy.admin).unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut resp = String::new();
    std::io::Read::read_to_string(&mut s, &mut resp).unwrap();
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");

    // SAFETY: kill(2) on the pid of the child this test spawned and has not reaped yet.
    #[allow(unsafe_code)]
    let killed = unsafe { libc::kill(proxy.child.id() as libc::pid_t, libc::SIGTERM) };
    assert_eq!(killed, 0);
    let status = proxy.child.wait().unwrap();
    assert_eq!(status.code(), Some(0));
}

/// The README's full configuration, every field with its default, is one that loads.
#[cfg(feature = "redis")]
#[test]
fn the_readmes_full_configuration_passes_check_config() {
    let readme = include_str!("../README.md");
    let from = readme
        .find("## Configuration reference")
        .expect("the README has its reference");
    let start = readme[from..].find("```yaml\n").expect("a yaml block") + from + 8;
    let end = readme[start..].find("```").expect("the block ends") + start;
    let file = temp_file("readme-full.yaml", &readme[start..end]);
    let out = Command::new(BIN)
        .args(["check-config", "--skip-files"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}
