//! The configuration reference (`spillway schema --markdown`, `docs/configuration.md`), written
//! from the JSON Schema: the top-level settings, then a section per definition the schema
//! reaches (objects as tables of their fields, then the values they take), each field's type,
//! default and description as the schema gives them.
//!
//! The schema's descriptions are the config types' doc comments, so the reference says what
//! the code does: a field is documented once, where it is declared. Must never: depend on
//! anything but the schema (a test keeps the committed file equal to this output), or write a
//! table cell that breaks its row (pipes escaped, lines joined).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;

use serde_json::{Map, Value};

/// The configuration reference as Markdown, the form committed in `docs/`.
pub fn markdown() -> String {
    let schema: Value = serde_json::from_str(&super::schema::text()).expect("the schema is JSON");
    render(&schema)
}

/// The reference of `schema` (a draft-07 schema with its types in `definitions`).
pub fn render(schema: &Value) -> String {
    let empty = Map::new();
    let definitions = schema["definitions"].as_object().unwrap_or(&empty);
    let order = reach_order(schema, definitions);
    let (objects, values): (Vec<&str>, Vec<&str>) = order
        .iter()
        .map(String::as_str)
        .partition(|name| definitions[*name].get("properties").is_some());
    let used = uses(schema, definitions);

    let mut out = String::new();
    out.push_str("# Configuration reference\n\n");
    out.push_str(
        "This file is generated from the configuration's JSON Schema by `spillway schema \
         --markdown` (`bash scripts/schema` writes it): do not edit it by hand. Each description \
         is the doc comment of a config type in `src/config/`; change it there.\n\n",
    );
    let title = schema["title"].as_str().unwrap_or("the configuration");
    let _ = writeln!(
        out,
        "`{title}`: {} A field marked *required* has no default; any other may be left out. \
         [Objects](#objects) are the sections and list items the settings take, \
         [values](#values) the strings, numbers and choices.\n",
        flat(schema["description"].as_str().unwrap_or_default()),
    );
    out.push_str("## Settings\n\n");
    table(&mut out, schema, definitions);
    out.push_str("## Objects\n\n");
    for name in objects {
        section(&mut out, name, definitions, &used);
    }
    out.push_str("## Values\n\n");
    for name in values {
        section(&mut out, name, definitions, &used);
    }
    while out.ends_with("\n\n") {
        out.pop();
    }
    out
}

/// The definitions in the order a reader meets them: depth first from the top-level settings,
/// each child in the schema's order; any the settings do not reach, after them.
fn reach_order(schema: &Value, definitions: &Map<String, Value>) -> Vec<String> {
    fn visit(name: &str, definitions: &Map<String, Value>, out: &mut Vec<String>) {
        if out.iter().any(|n| n == name) || !definitions.contains_key(name) {
            return;
        }
        out.push(name.to_string());
        for (_, target) in references(&definitions[name], "") {
            visit(&target, definitions, out);
        }
    }
    let mut out = Vec::new();
    for (_, target) in references(schema, "") {
        visit(&target, definitions, &mut out);
    }
    for name in definitions.keys() {
        visit(name, definitions, &mut out);
    }
    out
}

/// Every `$ref` under `node` (not into `definitions`), in the schema's order, each with the
/// property it is the type of (`""` for the node itself).
fn references(node: &Value, field: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let Some(map) = node.as_object() else {
        return out;
    };
    if let Some(target) = map.get("$ref").and_then(Value::as_str) {
        out.push((field.to_string(), ref_name(target).to_string()));
    }
    if let Some(properties) = map.get("properties").and_then(Value::as_object) {
        for (name, property) in properties {
            out.extend(references(property, name));
        }
    }
    for key in ["items", "additionalProperties", "allOf", "anyOf", "oneOf"] {
        match map.get(key) {
            Some(Value::Array(list)) => list.iter().for_each(|n| out.extend(references(n, field))),
            Some(n @ Value::Object(_)) => out.extend(references(n, field)),
            _ => {}
        }
    }
    out
}

/// For each definition, the places that use it: a setting, a field of an object (its link
/// and the field's name), or another definition.
fn uses(schema: &Value, definitions: &Map<String, Value>) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut add = |owner: Option<&str>, field: &str, target: String| {
        let place = match (owner, field) {
            (None, f) => format!("[settings](#settings) `{f}`"),
            (Some(o), "") => link(o),
            (Some(o), f) => format!("{} `{f}`", link(o)),
        };
        let list = out.entry(target).or_default();
        if !list.contains(&place) {
            list.push(place);
        }
    };
    for (field, target) in references(schema, "") {
        add(None, &field, target);
    }
    for (owner, definition) in definitions {
        for (field, target) in references(definition, "") {
            add(Some(owner), &field, target);
        }
    }
    out
}

/// One definition's section: its description, where it is used, and its fields or values.
fn section(
    out: &mut String,
    name: &str,
    definitions: &Map<String, Value>,
    used: &BTreeMap<String, Vec<String>>,
) {
    let node = &definitions[name];
    let _ = writeln!(out, "### {name}\n");
    if let Some(d) = node.get("description").and_then(Value::as_str) {
        let _ = writeln!(out, "{}\n", flat(d));
    }
    if let Some(places) = used.get(name) {
        let _ = writeln!(out, "Used in: {}.\n", places.join(", "));
    }
    if node.get("properties").is_some() {
        table(out, node, definitions);
        return;
    }
    let choices = node.get("oneOf").and_then(Value::as_array);
    let described = choices.filter(|list| list.iter().all(|c| c.get("const").is_some()));
    if let Some(list) = described {
        out.push_str("One of:\n\n");
        for choice in list {
            let _ = write!(out, "- {}", code(&scalar(&choice["const"])));
            if let Some(d) = choice.get("description").and_then(Value::as_str) {
                let _ = write!(out, ": {}", flat(d));
            }
            out.push('\n');
        }
        out.push('\n');
    } else if node.get("enum").is_some() || node.get("anyOf").is_some() || choices.is_some() {
        let _ = writeln!(out, "One of: {}.\n", alternatives(node).join(", "));
    } else {
        let _ = writeln!(out, "Type: {}{}.\n", type_of(node), range(node));
    }
}

/// An object's fields as a table: `| field | type | default | description |`.
fn table(out: &mut String, node: &Value, definitions: &Map<String, Value>) {
    let empty = Map::new();
    let properties = node["properties"].as_object().unwrap_or(&empty);
    let required: BTreeSet<&str> = (node["required"].as_array().into_iter().flatten())
        .filter_map(Value::as_str)
        .collect();
    out.push_str("| field | type | default | description |\n|---|---|---|---|\n");
    for (field, property) in properties {
        let default = match property.get("default") {
            _ if required.contains(field.as_str()) => "*required*".to_string(),
            None | Some(Value::Null) => String::new(),
            Some(d) if fields_defaults(property, d, definitions) => "each field's".to_string(),
            Some(d) => code(&serde_json::to_string(d).unwrap_or_default()),
        };
        let description = property["description"].as_str().unwrap_or_default();
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} |",
            cell(&code(field)),
            cell(&type_of(property)),
            cell(&default),
            cell(&flat(description)),
        );
    }
    out.push('\n');
}

/// Whether `default` is an object whose every field is that field's own default in the
/// definition `property` refers to: the table there says it, one field a row.
fn fields_defaults(property: &Value, default: &Value, definitions: &Map<String, Value>) -> bool {
    let Some(fields) = default.as_object().filter(|f| !f.is_empty()) else {
        return false;
    };
    let targets = references(property, "");
    let [(_, target)] = targets.as_slice() else {
        return false;
    };
    let own = &definitions[target.as_str()]["properties"];
    fields
        .iter()
        .all(|(k, v)| own[k.as_str()].get("default") == Some(v))
}

/// A node's type, readably: `string`, `integer`, `[string]`, a link to a definition, or the
/// alternatives it takes.
fn type_of(node: &Value) -> String {
    alternatives(node).join(" or ")
}

/// The types or values `node` takes, each as [`type_of`] shows it; `null` (an unset option)
/// left out.
fn alternatives(node: &Value) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut push = |s: String| {
        if !out.contains(&s) {
            out.push(s);
        }
    };
    if let Some(target) = node.get("$ref").and_then(Value::as_str) {
        push(link(ref_name(target)));
    } else if let Some(list) = ["allOf", "anyOf", "oneOf"]
        .iter()
        .find_map(|k| node.get(*k).and_then(Value::as_array))
    {
        list.iter().flat_map(alternatives).for_each(&mut push);
    } else if let Some(values) = node.get("enum").and_then(Value::as_array) {
        values.iter().map(|v| code(&scalar(v))).for_each(&mut push);
    } else if let Some(value) = node.get("const") {
        push(code(&scalar(value)));
    } else {
        let types: Vec<&str> = match &node["type"] {
            Value::String(t) => vec![t.as_str()],
            Value::Array(list) => list.iter().filter_map(Value::as_str).collect(),
            _ => vec!["any"],
        };
        let values = node.get("additionalProperties").filter(|v| v.is_object());
        for t in types {
            match (t, values) {
                ("null", _) => {}
                ("array", _) => push(format!("[{}]", type_of(&node["items"]))),
                ("object", Some(values)) => push(format!("map of {}", type_of(values))),
                (t, _) => push(t.to_string()),
            }
        }
    }
    out
}

/// `, from N to M` for a number with bounds.
fn range(node: &Value) -> String {
    match (node.get("minimum"), node.get("maximum")) {
        (Some(min), Some(max)) => format!(", from {min} to {max}"),
        (Some(min), None) => format!(", at least {min}"),
        (None, Some(max)) => format!(", at most {max}"),
        (None, None) => String::new(),
    }
}

/// The definition a `$ref` names.
fn ref_name(target: &str) -> &str {
    target.rsplit('/').next().unwrap_or(target)
}

/// A link to a definition's section (GitHub's anchor: the heading in lower case).
fn link(name: &str) -> String {
    format!("[{name}](#{})", name.to_ascii_lowercase())
}

/// A value as written in YAML: a string bare, anything else as JSON.
fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        v => v.to_string(),
    }
}

/// `s` as inline code, fenced by more backticks than it holds.
fn code(s: &str) -> String {
    if s.contains('`') {
        format!("`` {s} ``")
    } else {
        format!("`{s}`")
    }
}

/// A description on one line: doc comments wrap theirs.
fn flat(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Text that stays in its table cell: pipes escaped, on one line.
fn cell(s: &str) -> String {
    flat(s).replace('|', "\\|")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn committed(path: &str) -> String {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    fn schema() -> Value {
        serde_json::from_str(&super::super::schema::text()).unwrap()
    }

    /// The cells of a table row, split at the pipes that are not escaped.
    fn cells(row: &str) -> Vec<String> {
        let inner = row.trim().trim_start_matches('|');
        let inner = inner.strip_suffix('|').unwrap_or(inner);
        let (mut out, mut cur, mut escaped) = (Vec::new(), String::new(), false);
        for c in inner.chars() {
            match c {
                '|' if !escaped => out.push(std::mem::take(&mut cur)),
                c => cur.push(c),
            }
            escaped = c == '\\' && !escaped;
        }
        out.push(cur);
        out
    }

    #[test]
    fn the_committed_reference_is_the_one_the_schema_gives() {
        assert!(
            committed("docs/configuration.md") == markdown(),
            "docs/configuration.md differs from `spillway schema --markdown`: run bash scripts/schema"
        );
    }

    fn described(node: &Value) -> bool {
        node["description"]
            .as_str()
            .is_some_and(|d| !d.trim().is_empty())
    }

    #[test]
    fn every_definition_and_field_has_a_description() {
        fn walk(node: &Value, path: &str, missing: &mut Vec<String>) {
            if let Some(properties) = node.get("properties").and_then(Value::as_object) {
                for (name, property) in properties {
                    let here = format!("{path}.{name}");
                    if !described(property) {
                        missing.push(here.clone());
                    }
                    walk(property, &here, missing);
                }
            }
            for key in ["items", "additionalProperties", "allOf", "anyOf", "oneOf"] {
                match node.get(key) {
                    Some(Value::Array(list)) => list.iter().for_each(|n| walk(n, path, missing)),
                    Some(n @ Value::Object(_)) => walk(n, path, missing),
                    _ => {}
                }
            }
        }
        let schema = schema();
        let mut missing = Vec::new();
        if !described(&schema) {
            missing.push("(the configuration)".to_string());
        }
        for (name, definition) in schema["definitions"].as_object().unwrap() {
            if !described(definition) {
                missing.push(format!("#{name}"));
            }
            walk(definition, &format!("#{name}"), &mut missing);
        }
        walk(&schema, "", &mut missing);
        assert!(
            missing.is_empty(),
            "undocumented in the schema (give each a /// doc comment, or #[schemars(description)] where none reaches): {missing:?}"
        );
    }

    #[test]
    fn every_definition_has_a_section_and_every_row_four_cells() {
        let schema = schema();
        let text = render(&schema);
        for name in schema["definitions"].as_object().unwrap().keys() {
            assert!(
                text.contains(&format!("\n### {name}\n")),
                "no section for {name}"
            );
        }
        let rows: Vec<&str> = text.lines().filter(|l| l.starts_with('|')).collect();
        assert!(rows.len() > 100, "{} rows", rows.len());
        for row in rows {
            assert_eq!(cells(row).len(), 4, "{row}");
        }
        let names: BTreeSet<String> = (schema["definitions"].as_object().unwrap().keys())
            .map(|n| n.to_ascii_lowercase())
            .chain(["settings", "objects", "values"].map(String::from))
            .collect();
        for anchor in text.split("](#").skip(1) {
            let anchor = &anchor[..anchor.find(')').unwrap()];
            assert!(
                names.contains(anchor),
                "a link to #{anchor}, which no heading makes"
            );
        }
    }

    #[test]
    fn cells_keep_pipes_and_line_breaks_inside() {
        let schema = serde_json::json!({
            "description": "A test.",
            "type": "object",
            "required": ["a"],
            "properties": {
                "a": { "description": "one | two\nthree", "type": ["string", "null"] },
                "b": { "type": "array", "items": { "$ref": "#/definitions/T" }, "default": [] },
                "c": { "allOf": [{ "$ref": "#/definitions/T" }], "default": { "x": 1 } },
                "d": { "anyOf": [{ "$ref": "#/definitions/T" }, { "type": "null" }], "default": null }
            },
            "definitions": {
                "T": {
                    "description": "A thing.",
                    "type": "object",
                    "properties": { "x": { "description": "X.", "type": "integer", "default": 1 } }
                },
                "U": { "description": "Left over.", "type": "string", "enum": ["p|q", "r"] }
            }
        });
        let text = render(&schema);
        assert!(
            text.contains("| `a` | string | *required* | one \\| two three |"),
            "{text}"
        );
        assert!(text.contains("| `b` | [[T](#t)] | `[]` |  |"), "{text}");
        assert!(
            text.contains("| `c` | [T](#t) | each field's |  |"),
            "{text}"
        );
        assert!(text.contains("| `d` | [T](#t) |  |  |"), "{text}");
        assert!(
            text.contains("### U\n\nLeft over.\n\nOne of: `p|q`, `r`."),
            "{text}"
        );
        let t = text.find("### T").unwrap();
        assert!(t < text.find("### U").unwrap() && text.contains("Used in: [settings](#settings) `b`, [settings](#settings) `c`, [settings](#settings) `d`."), "{text}");
        for row in text.lines().filter(|l| l.starts_with('|')) {
            assert_eq!(cells(row).len(), 4, "{row}");
        }
    }
}
