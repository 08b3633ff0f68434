//! The JSON Schema of the configuration (`spillway schema`, `schema/spillway.schema.json`), for
//! editors and for the chart's `values.schema.json`.
//!
//! Generated from the config types: their serde attributes give the fields, defaults and
//! unknown-field refusals; the types parsed from strings (durations, rates, names, URLs, key
//! parts) are described here, each with a pattern that admits what its parser admits. The
//! schema checks shape only: what crosses fields (a global rule's burst, a fallback's
//! algorithm) is `check-config`'s. Must never: admit a shape the parser refuses when a pattern
//! can say it, or be edited by hand (a test keeps the committed file equal to this output).

use std::borrow::Cow;

use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};

use super::*;

/// A duration: a whole number and a unit.
pub const DURATION: &str = "^\\s*[0-9]+(ms|s|m|h|d)\\s*$";
/// A rate: a count above zero per unit, or per duration (`100/10s`).
pub const RATE: &str = "^\\s*0*[1-9][0-9]*\\s*/\\s*(s|m|h|d|0*[1-9][0-9]*(ms|s|m|h|d))\\s*$";
/// A service or rule name (metric labels, header values).
pub const NAME: &str = "^[A-Za-z0-9_.-]{1,64}$";
/// An HTTP header field name (RFC 9110 token).
const HEADER: &str = "[!#$%&'*+.^_`|~0-9A-Za-z-]+";

/// The configuration's schema as pretty JSON, the form committed in `schema/`.
pub fn text() -> String {
    let generator = schemars::generate::SchemaSettings::draft07().into_generator();
    let mut schema = generator.into_root_schema_for::<Config>();
    schema.insert("title".into(), "spillway.yaml".into());
    let mut out = serde_json::to_string_pretty(&schema).expect("a schema serializes");
    out.push('\n');
    out
}

/// A string schema with `pattern` and `description`.
fn pattern(pattern: &str, description: &str) -> Schema {
    json_schema!({ "type": "string", "pattern": pattern, "description": description })
}

macro_rules! string_schema {
    ($ty:ty, $name:literal, $pattern:expr, $description:literal) => {
        impl JsonSchema for $ty {
            fn schema_name() -> Cow<'static, str> {
                $name.into()
            }
            fn json_schema(_: &mut SchemaGenerator) -> Schema {
                pattern($pattern, $description)
            }
        }
    };
}

string_schema!(
    Dur,
    "Duration",
    DURATION,
    "A duration: 250ms, 10s, 5m, 2h, 1d."
);
string_schema!(
    Rate,
    "Rate",
    RATE,
    "Requests per unit: 10/s, 600/m, 1000/h, 5/d, or per a duration: 100/10s."
);
string_schema!(
    Name,
    "Name",
    NAME,
    "1 to 64 of A-Z a-z 0-9 _ - . (it becomes a metric label and a header value)."
);
string_schema!(
    Upstream,
    "Upstream",
    "^(http|h2c)://[^/?#\\s]+/?$",
    "The app beside the proxy: http://host:port, or h2c://host:port for HTTP/2 with prior knowledge (gRPC)."
);
string_schema!(
    HostPattern,
    "HostPattern",
    "^(\\*\\.)?[A-Za-z0-9._-]+$",
    "A host name such as api.example.com, or *.example.com for any subdomain."
);
string_schema!(
    ServedHost,
    "ServedHost",
    "^(\\*\\.)?[A-Za-z0-9._-]+(:[0-9]{1,5})?$|^\\[?[0-9A-Fa-f:.]+\\]?(:[0-9]{1,5})?$",
    "A host the app answers for: api.example.com, svc.ns, *.example.com (any subdomain), or an address (10.1.2.3, fd00::1); a port is ignored."
);
string_schema!(
    MethodName,
    "Method",
    "^[A-Z]+$",
    "An HTTP method in upper case, such as GET or POST."
);
string_schema!(
    HeaderNameStr,
    "HeaderName",
    "^[!#$%&'*+.^_`|~0-9A-Za-z-]+$",
    "An HTTP header field name."
);
string_schema!(
    CidrStr,
    "Cidr",
    "^[0-9A-Fa-f:.]+(/[0-9]{1,3})?$",
    "An address or CIDR block: 10.0.0.0/8, fd00::/8."
);

impl JsonSchema for PathRegex {
    fn schema_name() -> Cow<'static, str> {
        "PathRegex".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({ "type": "string", "format": "regex", "description": "A regular expression the whole path is searched with." })
    }
}

impl JsonSchema for HeaderBytes {
    fn schema_name() -> Cow<'static, str> {
        "HeaderBytes".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "integer",
            "minimum": 1024,
            "maximum": 1048576,
            "description": "A size in bytes: 1024 (1 KiB) to 1048576 (1 MiB)."
        })
    }
}

impl JsonSchema for BufferBytes {
    fn schema_name() -> Cow<'static, str> {
        "BufferBytes".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "integer",
            "minimum": 65536u64,
            "maximum": 17179869184u64,
            "description": "A size in bytes: 65536 (64 KiB) to 17179869184 (16 GiB)."
        })
    }
}

impl JsonSchema for HeaderEquals {
    fn schema_name() -> Cow<'static, str> {
        "HeaderEquals".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "object",
            "description": "Each named header must be present with exactly this value.",
            "propertyNames": { "pattern": format!("^{HEADER}$") },
            "additionalProperties": { "type": "string" }
        })
    }
}

impl JsonSchema for ControlUrl {
    fn schema_name() -> Cow<'static, str> {
        "ControlUrl".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        let url = json_schema!({ "type": "string", "pattern": "^https?://[^/?#\\s]+/?$" });
        json_schema!({
            "description": "The zone's aggregators (or a controller): http://host:port or https://host:port; or a list of controllers that serve at once (all http:// or all https://), each sent every report.",
            "anyOf": [url, { "type": "array", "items": url, "minItems": 1, "maxItems": crate::config::MAX_CONTROL_URLS, "uniqueItems": true }]
        })
    }
}

impl JsonSchema for RedisUrls {
    fn schema_name() -> Cow<'static, str> {
        "RedisUrls".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        let url = json_schema!({ "type": "string", "pattern": "^rediss?://" });
        json_schema!({
            "description": "redis://[user:password@]host:port[/db] (rediss:// for TLS), or a list of them: the nodes of a Redis Cluster.",
            "anyOf": [url, { "type": "array", "items": url, "minItems": 1 }]
        })
    }
}

impl JsonSchema for KeySpec {
    fn schema_name() -> Cow<'static, str> {
        "Key".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        let part = json_schema!({
            "type": "string",
            "pattern": format!("^(client_ip(/[0-9]{{1,3}}){{0,2}}|path|method|host|header:{HEADER}|query:.+)$")
        });
        json_schema!({
            "description": "What a rule counts by: client_ip (or client_ip/N with the rule's own prefix: 1-32 for IPv4, 33-128 for IPv6, client_ip/V4/V6 for both), header:NAME, query:NAME, path, method or host, or a list of up to 8 of them ([] is one bucket for everyone).",
            "anyOf": [part, { "type": "array", "items": part, "maxItems": 8, "uniqueItems": true }]
        })
    }
}

impl JsonSchema for Cost {
    fn schema_name() -> Cow<'static, str> {
        "Cost".into()
    }
    fn json_schema(generator: &mut SchemaGenerator) -> Schema {
        let header = generator.subschema_for::<RawCostHeader>();
        let response = generator.subschema_for::<RawResponseCost>();
        json_schema!({
            "description": "Units each request takes: a whole number, read from a request header, or what the app's response says it consumed (charged after it).",
            "anyOf": [{ "type": "integer", "minimum": 1, "maximum": 4294967295u64 }, header, response]
        })
    }
}

impl JsonSchema for Usage {
    fn schema_name() -> Cow<'static, str> {
        "Usage".into()
    }
    fn json_schema(generator: &mut SchemaGenerator) -> Schema {
        let field = generator.subschema_for::<RawUsageField>();
        json_schema!({
            "description": "Where the app's response says what it consumed: { header: NAME } or { trailer: NAME } (one whole number), { json: POINTERS } (JSON pointers of a JSON body or of its event stream's events, summed; or openai, anthropic), json (/usage/total_tokens), or body_bytes (the body's bytes sent to the client).",
            "anyOf": [{ "type": "string", "enum": ["body_bytes", "json"] }, field]
        })
    }
}

impl JsonSchema for Scope {
    fn schema_name() -> Cow<'static, str> {
        "Scope".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "enum": ["local", "global", "redis"],
            "description": "Where a rule's state lives: local (this proxy), global (fleet-wide, through the control plane) or redis (exact and shared, through Redis)."
        })
    }
}

/// The types read through a raw form take its schema.
macro_rules! as_raw {
    ($ty:ty, $raw:ty, $name:literal) => {
        impl JsonSchema for $ty {
            fn schema_name() -> Cow<'static, str> {
                $name.into()
            }
            fn json_schema(generator: &mut SchemaGenerator) -> Schema {
                <$raw>::json_schema(generator)
            }
        }
    };
}

as_raw!(Rule, RawRule, "Rule");
as_raw!(Limit, RawLimit, "Limit");
as_raw!(ClientIp, RawClientIp, "ClientIp");

#[cfg(test)]
mod tests {
    use super::*;

    fn committed(path: &str) -> String {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    #[test]
    fn the_committed_schema_is_the_one_the_types_give() {
        assert!(
            committed("schema/spillway.schema.json") == text(),
            "schema/spillway.schema.json differs from `spillway schema`: run scripts/schema"
        );
    }

    #[test]
    fn the_charts_values_schema_has_the_same_definitions() {
        let ours: serde_json::Value = serde_json::from_str(&text()).unwrap();
        let chart: serde_json::Value =
            serde_json::from_str(&committed("charts/spillway/values.schema.json")).unwrap();
        assert!(
            chart["definitions"] == ours["definitions"],
            "charts/spillway/values.schema.json has other definitions: run scripts/schema"
        );
        let limits = &chart["properties"]["limits"]["properties"];
        assert_eq!(limits["rules"]["items"]["$ref"], "#/definitions/Rule");
        assert_eq!(
            limits["redis"]["anyOf"][1]["$ref"],
            "#/definitions/RedisConfig"
        );
    }

    #[test]
    fn each_pattern_admits_what_its_parser_admits() {
        let re = |p: &str| regex::Regex::new(p).unwrap();
        let (duration, rate, name) = (re(DURATION), re(RATE), re(NAME));
        for s in ["250ms", "1s", "5m", "2h", "1d", " 10s "] {
            assert!(duration.is_match(s) && s.parse::<Dur>().is_ok(), "{s}");
        }
        for s in ["10", "1.5s", "s", "10sec", "-1s", ""] {
            assert!(!duration.is_match(s) && s.parse::<Dur>().is_err(), "{s}");
        }
        for s in [
            "10/s",
            "600/m",
            "1/h",
            "5/d",
            "100/10s",
            "1 / 250ms",
            "007/s",
        ] {
            assert!(rate.is_match(s) && s.parse::<Rate>().is_ok(), "{s}");
        }
        for s in ["0/s", "10", "10/x", "10/sec", "/s", "-1/s", "1.5/s"] {
            assert!(!rate.is_match(s) && s.parse::<Rate>().is_err(), "{s}");
        }
        for (s, ok) in [
            ("shop-api_v1.2", true),
            ("", false),
            ("a b", false),
            ("é", false),
        ] {
            assert_eq!(name.is_match(s), ok, "{s}");
        }
        assert!(!name.is_match(&"a".repeat(65)));
    }
}
