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

/// The reference configuration, every setting with its default, is one that loads.
#[cfg(feature = "redis")]
#[test]
fn the_reference_configuration_passes_check_config() {
    let file = concat!(env!("CARGO_MANIFEST_DIR"), "/config/reference.yaml");
    let out = Command::new(BIN)
        .args(["check-config", "--skip-files", file])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}

/// Headings of a Markdown text outside fenced code: (line index, level, title).
fn headings(text: &str) -> Vec<(usize, usize, String)> {
    let mut fenced = false;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        let level = line.chars().take_while(|&c| c == '#').count();
        if !fenced && (1..=6).contains(&level) && line[level..].starts_with(' ') {
            out.push((
                i,
                level,
                line[level..]
                    .trim()
                    .trim_end_matches('#')
                    .trim()
                    .to_string(),
            ));
        }
    }
    out
}

/// The anchors GitHub gives a page's headings: lowercased, spaces to `-`, punctuation other
/// than `-` and `_` removed, a repeated one numbered.
fn anchors(text: &str) -> Vec<String> {
    let mut seen = std::collections::HashMap::<String, usize>::new();
    let mut out = Vec::new();
    for (_, _, title) in headings(text) {
        let slug: String = title
            .to_lowercase()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                _ => None,
            })
            .collect();
        let n = seen.entry(slug.clone()).or_insert(0);
        out.push(if *n == 0 { slug } else { format!("{slug}-{n}") });
        *n += 1;
    }
    out
}

/// The targets of a Markdown text's inline links (`](target)`), outside code.
fn link_targets(text: &str) -> Vec<String> {
    let mut fenced = false;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Inline code spans are every other piece between backticks.
        for prose in line.split('`').step_by(2) {
            let mut rest = prose;
            while let Some(at) = rest.find("](") {
                rest = &rest[at + 2..];
                let end = rest.find(')').unwrap_or(rest.len());
                let target = rest[..end].split_whitespace().next().unwrap_or("");
                out.push(target.trim_matches(|c| c == '<' || c == '>').to_string());
                rest = &rest[end..];
            }
        }
    }
    out
}

/// The README stays a page for users: at most 24 KiB, no section over 60 lines.
#[test]
fn the_readme_is_at_most_24_kib_with_no_section_over_60_lines() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    assert!(
        readme.len() <= 24 * 1024,
        "README.md is {} bytes, over 24576",
        readme.len()
    );
    let lines = readme.lines().count();
    let mut starts: Vec<(usize, String)> = vec![(0, "(the top)".to_string())];
    starts.extend(
        headings(&readme)
            .into_iter()
            .filter(|h| h.1 <= 3)
            .map(|(i, l, t)| (i, format!("{} {t}", "#".repeat(l)))),
    );
    for (n, (start, title)) in starts.iter().enumerate() {
        let end = starts.get(n + 1).map_or(lines, |s| s.0);
        assert!(
            end - start <= 60,
            "README.md section {title:?} is {} lines, over 60",
            end - start
        );
    }
}

/// Every relative link in README.md and docs/*.md names a file of the repository, and an
/// anchor into a Markdown page names one of its headings.
#[test]
fn every_relative_link_in_the_readme_and_docs_resolves() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut pages = vec![root.join("README.md")];
    for entry in std::fs::read_dir(root.join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            pages.push(path);
        }
    }
    let mut broken = Vec::new();
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        let name = page.strip_prefix(root).unwrap().display().to_string();
        for target in link_targets(&text) {
            if target.is_empty()
                || ["http:", "https:", "mailto:"]
                    .iter()
                    .any(|s| target.starts_with(s))
            {
                continue;
            }
            let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
            let file = if path.is_empty() {
                page.clone()
            } else {
                page.parent().unwrap().join(path)
            };
            if !file.exists() {
                broken.push(format!("{name}: {target}: no such file"));
                continue;
            }
            if !anchor.is_empty() && file.extension().is_some_and(|e| e == "md") {
                let there = std::fs::read_to_string(&file).unwrap();
                if !anchors(&there).iter().any(|a| a == anchor) {
                    broken.push(format!("{name}: {target}: no such heading"));
                }
            }
        }
    }
    assert!(pages.len() > 5, "{pages:?}");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}
