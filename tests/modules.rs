//! The crate's modules import each other without a cycle: a module that uses another's items
//! sits above it. Read from the source's `use` declarations and `crate::`, `super::` and
//! `self::` paths (test code left out); each path goes to the deepest module file it names. A
//! module and those inside it may use each other (a parent re-exports its children's items and
//! they use its types, as `limit` does); between any others an import goes one way.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module's path from the crate root, e.g. `["proxy", "http1", "server"]`.
type Module = Vec<String>;

fn module_files(dir: &Path, root: &Path, out: &mut BTreeMap<Module, PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            module_files(&path, root, out);
            continue;
        }
        let name = path.file_name().unwrap().to_str().unwrap();
        // Test files (`tests.rs`, `*_tests.rs` behind a `#[path]`) may import anything.
        if !name.ends_with(".rs") || name == "tests.rs" || name.ends_with("_tests.rs") {
            continue;
        }
        let rel = path.strip_prefix(root).unwrap().with_extension("");
        let mut module: Module = rel
            .components()
            .map(|c| c.as_os_str().to_str().unwrap().to_string())
            .collect();
        if module.last().is_some_and(|m| m == "mod") {
            module.pop();
        }
        if module == ["main"] || module == ["lib"] {
            continue;
        }
        out.insert(module, path);
    }
}

/// `a::{b, c::{d, e}}` as `a::b`, `a::c::d`, `a::c::e`.
fn expand(tree: &str) -> Vec<String> {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else {
        return vec![tree.to_string()];
    };
    let close = tree.rfind('}').unwrap();
    let (prefix, body) = (&tree[..open], &tree[open + 1..close]);
    let (mut parts, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, ch) in body.char_indices() {
        match ch {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&body[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&body[start..]);
    parts
        .into_iter()
        .filter(|p| !p.trim().is_empty())
        .flat_map(|p| expand(p).into_iter().map(move |e| format!("{prefix}{e}")))
        .collect()
}

/// The paths a file's non-test code names.
fn paths(text: &str) -> Vec<String> {
    // An inline test module is the file's last item; `mod tests;` is a file of its own.
    let code = match text.find("#[cfg(test)]\nmod tests {") {
        Some(i) => &text[..i],
        None => text,
    };
    let code: String = code
        .lines()
        .map(|l| l.split("//").next().unwrap())
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = Vec::new();
    let use_decl = regex::Regex::new(r"(?m)^\s*(?:pub(?:\([^)]*\))?\s+)?use\s+([^;]+);").unwrap();
    for m in use_decl.captures_iter(&code) {
        out.extend(expand(&m[1].replace('\n', " ")));
    }
    // Paths in the code: from `crate`, `super`, `self`, or a name (a child module, or with
    // `use super::*` a sibling), not the tail of a longer path.
    let inline = regex::Regex::new(r"\b[a-z_][a-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)+").unwrap();
    out.extend(
        inline
            .find_iter(&code)
            .filter(|m| !code[..m.start()].ends_with(':'))
            .map(|m| m.as_str().to_string()),
    );
    out
}

/// The module file `path` (seen from `from`, which glob-imports its parent's names when
/// `globs_parent`) names: the longest prefix that is one.
fn resolve(
    from: &Module,
    path: &str,
    globs_parent: bool,
    files: &BTreeMap<Module, PathBuf>,
) -> Option<Module> {
    let path = path.split(" as ").next().unwrap().trim();
    let segs: Vec<&str> = path.split("::").map(str::trim).collect();
    let mut target: Module = match segs[0] {
        "crate" => Vec::new(),
        "super" | "self" => from.clone(),
        name => {
            // A child module, or (through `use super::*`) a sibling; anything else is a crate
            // or a type, not ours.
            let mut child = from.clone();
            child.push(name.to_string());
            let mut sibling = from[..from.len().saturating_sub(1)].to_vec();
            sibling.push(name.to_string());
            if files.contains_key(&child) {
                child
            } else if globs_parent && !from.is_empty() && files.contains_key(&sibling) {
                sibling
            } else {
                return None;
            }
        }
    };
    let mut rest = &segs[1..];
    if segs[0] == "super" {
        target.pop();
        while rest.first() == Some(&"super") {
            target.pop();
            rest = &rest[1..];
        }
    }
    target.extend(rest.iter().map(|s| s.to_string()));
    (1..=target.len())
        .rev()
        .map(|n| target[..n].to_vec())
        .find(|m| files.contains_key(m))
}

/// Each module and the modules it imports (not those around it or inside it).
fn imports() -> (
    BTreeMap<Module, PathBuf>,
    BTreeMap<Module, BTreeSet<Module>>,
) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = BTreeMap::new();
    module_files(&root, &root, &mut files);
    let mut edges: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    for (module, path) in &files {
        let text = std::fs::read_to_string(path).unwrap();
        let globs_parent = text.contains("use super::*;");
        for p in paths(&text) {
            if let Some(target) = resolve(module, &p, globs_parent, &files) {
                // Itself, a module around it, or one inside it.
                let nested = target.starts_with(module) || module.starts_with(&target);
                if !nested {
                    edges.entry(module.clone()).or_default().insert(target);
                }
            }
        }
    }
    (files, edges)
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    let (files, edges) = imports();
    assert!(
        edges.values().map(BTreeSet::len).sum::<usize>() > 50,
        "the scan found the imports: {edges:?}"
    );
    // A cycle shows as a path back to where a depth-first walk started.
    let mut cycles = Vec::new();
    for start in files.keys() {
        let mut stack = vec![(start.clone(), vec![start.clone()])];
        let mut seen = BTreeSet::new();
        while let Some((at, trail)) = stack.pop() {
            for next in edges.get(&at).into_iter().flatten() {
                if next == start {
                    let names: Vec<String> = trail.iter().map(|m| m.join("::")).collect();
                    cycles.push(format!("{} -> {}", names.join(" -> "), start.join("::")));
                } else if seen.insert(next.clone()) {
                    let mut t = trail.clone();
                    t.push(next.clone());
                    stack.push((next.clone(), t));
                }
            }
        }
    }
    assert!(
        cycles.is_empty(),
        "modules that import each other:\n{}",
        cycles.join("\n")
    );
}

/// Whole top-level modules too: two files of two modules never import each other's modules
/// back through other files (`rules` keeps a rule's 429s, `respond` renders them: the slots are
/// `rules`', what goes in them `respond`'s).
#[test]
fn no_top_level_module_imports_one_that_imports_it_back() {
    let (_, edges) = imports();
    let mut tops: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for (from, targets) in &edges {
        for to in targets {
            if from[0] != to[0] {
                tops.entry(from[0].as_str())
                    .or_default()
                    .insert(to[0].as_str());
            }
        }
    }
    assert!(tops.len() > 5, "the scan found the modules: {tops:?}");
    let mut cycles = Vec::new();
    for &start in tops.keys() {
        let mut stack = vec![(start, vec![start])];
        let mut seen = BTreeSet::new();
        while let Some((at, trail)) = stack.pop() {
            for &next in tops.get(at).into_iter().flatten() {
                if next == start {
                    cycles.push(format!("{} -> {start}", trail.join(" -> ")));
                } else if seen.insert(next) {
                    let mut t = trail.clone();
                    t.push(next);
                    stack.push((next, t));
                }
            }
        }
    }
    assert!(
        cycles.is_empty(),
        "top-level modules that import each other:\n{}",
        cycles.join("\n")
    );
}

/// The decision is synchronous and below the data plane and the control plane: it never
/// awaits, asks Redis only through the caller (`rules::RemoteStore`), and holds the drop ratios
/// and global counters that the control plane fills and drains.
#[test]
fn the_decision_never_awaits_nor_imports_the_data_plane_the_control_plane_the_renderer_or_redis() {
    let (files, edges) = imports();
    let ours: Vec<&Module> = files.keys().filter(|m| m[0] == "rules").collect();
    assert!(ours.len() > 1, "the rules modules: {ours:?}");
    for module in ours {
        let above: Vec<String> = edges
            .get(module)
            .into_iter()
            .flatten()
            .filter(|m| ["proxy", "exact", "gate", "control", "respond"].contains(&m[0].as_str()))
            .map(|m| m.join("::"))
            .collect();
        assert!(above.is_empty(), "{module:?} imports {above:?}");
        let text = std::fs::read_to_string(&files[module]).unwrap();
        assert!(
            !text.contains("async fn") && !text.contains(".await"),
            "{module:?} awaits"
        );
        assert!(
            !text.contains("redis::"),
            "{module:?} names the Redis client"
        );
    }
}

/// The data plane's layers (src/proxy/mod.rs): the protocol servers (HTTP/1's server side,
/// HTTP/2) are handed the request path as a `Handler` by `connection`, which tells which one
/// a connection speaks: they never import the request path (`request`), the forward
/// (`forward`, `forwarded`, `upstream_pool`), the connection owner or the wiring (`shared`,
/// `settings`, `worker`), and HTTP/1 never imports HTTP/2. `protocol`, what both are given, imports none
/// of those. (An upgrade's tunnel takes the upstream connection from its response: HTTP/1's
/// client side is not among them.)
#[test]
fn protocol_servers_never_import_the_request_path_and_http1_never_imports_http2() {
    let (files, edges) = imports();
    let m = |path: &str| -> Module { path.split("::").map(String::from).collect() };
    let servers: Vec<&Module> = files
        .keys()
        .filter(|f| {
            f.starts_with(&m("proxy::http2"))
                || [
                    "proxy::http1::server",
                    "proxy::http1::request_head",
                    "proxy::http1::request_body",
                    "proxy::http1::tunnel",
                    "proxy::protocol",
                ]
                .iter()
                .any(|s| **f == m(s))
        })
        .collect();
    assert!(
        servers.len() >= 7,
        "the scan found the servers: {servers:?}"
    );
    let above = [
        "proxy::shared",
        "proxy::settings",
        "proxy::worker",
        "proxy::request",
        "proxy::forward",
        "proxy::forwarded",
        "proxy::upstream_pool",
        "proxy::connection",
    ]
    .map(m);
    let mut wrong = Vec::new();
    for server in servers {
        for to in edges.get(server).into_iter().flatten() {
            let http1_to_http2 =
                server.starts_with(&m("proxy::http1")) && to.starts_with(&m("proxy::http2"));
            if above.contains(to) || http1_to_http2 {
                wrong.push(format!("{} -> {}", server.join("::"), to.join("::")));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the layers:\n{}",
        wrong.join("\n")
    );
}

/// Below the request path (src/proxy/mod.rs): the forward (`forward`, `forwarded`,
/// `upstream_pool`, `failure`, and HTTP/1's client side: `client`, `upload`, `response_head`)
/// and the response (`response`) never import the request path, the connection owner, the
/// protocol servers (HTTP/1's server side, HTTP/2, what they are given) or the wiring.
#[test]
fn the_forward_never_imports_the_request_path_the_servers_or_the_wiring() {
    let (files, edges) = imports();
    let m = |path: &str| -> Module { path.split("::").map(String::from).collect() };
    let below = [
        "proxy::forward",
        "proxy::forwarded",
        "proxy::upstream_pool",
        "proxy::failure",
        "proxy::response",
        "proxy::http1::client",
        "proxy::http1::upload",
        "proxy::http1::response_head",
    ]
    .map(m);
    for module in &below {
        assert!(files.contains_key(module), "the scan found {module:?}");
    }
    let above = [
        "proxy::request",
        "proxy::connection",
        "proxy::protocol",
        "proxy::shared",
        "proxy::settings",
        "proxy::worker",
        "proxy::http1::server",
        "proxy::http1::request_head",
        "proxy::http1::tunnel",
    ]
    .map(m);
    let mut wrong = Vec::new();
    for module in &below {
        for to in edges.get(module).into_iter().flatten() {
            if above.contains(to) || to.starts_with(&m("proxy::http2")) {
                wrong.push(format!("{} -> {}", module.join("::"), to.join("::")));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the layers:\n{}",
        wrong.join("\n")
    );
}

/// The control plane's sums never know the decision's types (and `rules` never imports
/// `control`, above): inside `control` only the proxy's side imports `rules`, the reporter
/// (which drains the decision's counts) and `ratios` (which turns a reply into the ratios the
/// decision reads). The aggregator, controller, sums, zones, sources and server never do, nor
/// does `control` itself re-export the decision's types.
#[test]
fn only_the_control_planes_proxy_side_imports_rules() {
    let (_, edges) = imports();
    let proxy_side = [["control", "reporter"], ["control", "ratios"]];
    assert!(
        proxy_side.iter().all(|m| edges
            .get(m.map(String::from).as_slice())
            .is_some_and(|to| to.iter().any(|t| t[0] == "rules"))),
        "the scan sees the reporter and ratios import rules: {edges:?}"
    );
    let wrong: Vec<String> = edges
        .iter()
        .filter(|(from, _)| from[0] == "control" && !proxy_side.iter().any(|m| from[..] == m[..]))
        .flat_map(|(from, to)| {
            to.iter()
                .filter(|t| t[0] == "rules")
                .map(move |t| format!("{} -> {}", from.join("::"), t.join("::")))
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "imports against the direction:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_scan_sees_grouped_and_relative_imports() {
    assert_eq!(
        expand("crate::a::{b, c::{d, e as f}}"),
        ["crate::a::b", "crate::a::c::d", "crate::a::c::e as f"]
    );
    let files: BTreeMap<Module, PathBuf> = [
        vec!["proxy".to_string()],
        vec!["proxy".into(), "forward".into()],
        vec!["proxy".into(), "http1".into()],
        vec!["proxy".into(), "http1".into(), "server".into()],
    ]
    .into_iter()
    .map(|m| (m, PathBuf::new()))
    .collect();
    let server = vec!["proxy".to_string(), "http1".into(), "server".into()];
    assert_eq!(
        resolve(&server, "super::super::forward::Streamed", false, &files),
        Some(vec!["proxy".to_string(), "forward".into()])
    );
    assert_eq!(
        resolve(
            &server,
            "crate::proxy::http1::server::IN_HAND",
            false,
            &files
        ),
        Some(server.clone())
    );
    assert_eq!(
        resolve(&server, "crate::proxy::Conn", false, &files),
        Some(vec!["proxy".to_string()])
    );
    // A name: a child of `proxy` seen from proxy/mod.rs, or a sibling seen through
    // `use super::*`; a crate's or a type's name is not ours.
    let proxy = vec!["proxy".to_string()];
    let forward = vec!["proxy".to_string(), "forward".into()];
    assert_eq!(
        resolve(&proxy, "forward::Forward", false, &files),
        Some(forward.clone())
    );
    let request = vec!["proxy".to_string(), "request".into()];
    assert_eq!(
        resolve(&request, "forward::Forward", true, &files),
        Some(forward)
    );
    assert_eq!(resolve(&request, "forward::Forward", false, &files), None);
    assert_eq!(resolve(&request, "http::Request", true, &files), None);
}
