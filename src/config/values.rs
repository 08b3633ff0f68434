//! The configuration's value types, each validated while it is deserialized (so that the YAML
//! parser's own position and path locate every error): names, durations, rates, URLs, header
//! names and values, key specs. Must never: accept a value it would print differently.

use super::*;

/// Deserializes a string and parses it inside the visitor, so that the YAML parser attaches
/// the value's own line and field path to a parse error.
pub(super) fn parse_str<'de, D, T, F>(d: D, parse: F) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    F: FnOnce(&str) -> Result<T, String>,
{
    struct ParseVisitor<F>(F);
    impl<'de, T, F: FnOnce(&str) -> Result<T, String>> Visitor<'de> for ParseVisitor<F> {
        type Value = T;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a string")
        }
        fn visit_str<E: de::Error>(self, s: &str) -> Result<T, E> {
            (self.0)(s).map_err(E::custom)
        }
    }
    d.deserialize_str(ParseVisitor(parse))
}

/// Deserializes one string or a non-empty list of them, each parsed inside the visitor (as
/// [`parse_str`] does) by `parse`, which is given the items parsed before it.
pub(super) fn parse_one_or_list<'de, D, T, F>(
    d: D,
    expecting: &'static str,
    parse: F,
) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    F: Fn(&str, &[T]) -> Result<T, String>,
{
    struct OneOrList<T, F>(&'static str, F, std::marker::PhantomData<T>);
    impl<'de, T, F: Fn(&str, &[T]) -> Result<T, String>> Visitor<'de> for OneOrList<T, F> {
        type Value = Vec<T>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str(self.0)
        }
        fn visit_str<E: de::Error>(self, s: &str) -> Result<Vec<T>, E> {
            (self.1)(s, &[]).map(|t| vec![t]).map_err(E::custom)
        }
        fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
            let mut out = Vec::new();
            while let Some(s) = seq.next_element::<String>()? {
                out.push((self.1)(&s, &out).map_err(de::Error::custom)?);
            }
            if out.is_empty() {
                return Err(de::Error::custom("give at least one URL"));
            }
            Ok(out)
        }
    }
    d.deserialize_any(OneOrList(expecting, parse, std::marker::PhantomData))
}

pub(super) fn err(message: impl fmt::Display) -> String {
    message.to_string()
}

/// A name used in metrics labels and headers: `[A-Za-z0-9_.-]{1,64}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(transparent)]
pub struct Name(pub String);

impl<'de> Deserialize<'de> for Name {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parse_str(d, |s: &str| {
            let ok = !s.is_empty()
                && s.len() <= 64
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
            if ok {
                Ok(Name(s.to_string()))
            } else {
                Err(err(format!(
                    "{s:?}: names are 1 to 64 of A-Z a-z 0-9 _ - ."
                )))
            }
        })
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A duration such as `250ms`, `1s`, `5m`, `2h`, `1d`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dur(pub Duration);

impl FromStr for Dur {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        parse_duration(s).map(Dur)
    }
}

/// Parses `250ms`, `1s`, `5m`, `2h`, `1d` (an integer and a unit).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("{s:?}: missing unit (ms, s, m, h or d)"))?;
    let (num, unit) = s.split_at(split);
    if num.is_empty() {
        return Err(format!(
            "{s:?}: expected a number then a unit, such as 250ms or 5s"
        ));
    }
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?}: number too large"))?;
    let per = match unit {
        "ms" => Duration::from_millis(1),
        "s" => Duration::from_secs(1),
        "m" => Duration::from_secs(60),
        "h" => Duration::from_secs(3600),
        "d" => Duration::from_secs(86_400),
        _ => {
            return Err(format!(
                "{s:?}: unknown unit {unit:?} (expected ms, s, m, h or d)"
            ))
        }
    };
    per.checked_mul(u32::try_from(n).map_err(|_| format!("{s:?}: number too large"))?)
        .ok_or_else(|| format!("{s:?}: too long"))
}

pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    for (unit, size) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1000),
    ] {
        if ms != 0 && ms % size == 0 {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parse_str(d, |s: &str| s.parse())
    }
}

impl Serialize for Dur {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_duration(self.0))
    }
}

/// A rate: `N/s`, `N/m`, `N/h`, `N/d`, or `N/<duration>` such as `100/10s`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    pub count: NonZeroU32,
    pub period: Duration,
}

impl Rate {
    /// The rate in units per second.
    pub fn per_sec(&self) -> f64 {
        f64::from(self.count.get()) / self.period.as_secs_f64().max(1e-9)
    }
}

impl FromStr for Rate {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (n, per) = s
            .split_once('/')
            .ok_or_else(|| format!("{s:?}: expected N/unit, such as 10/s or 100/10s"))?;
        let count: u32 = n
            .trim()
            .parse()
            .map_err(|_| format!("{s:?}: {n:?} is not a whole number"))?;
        let count =
            NonZeroU32::new(count).ok_or_else(|| format!("{s:?}: the count must be > 0"))?;
        let per = per.trim();
        let period = match per {
            "s" => Duration::from_secs(1),
            "m" => Duration::from_secs(60),
            "h" => Duration::from_secs(3600),
            "d" => Duration::from_secs(86_400),
            _ if per.starts_with(|c: char| c.is_ascii_digit()) => parse_duration(per)?,
            _ => {
                return Err(format!(
                    "{s:?}: unknown unit {per:?} (expected s, m, h, d or a duration such as 10s)"
                ))
            }
        };
        if period.is_zero() {
            return Err(format!("{s:?}: the period must be > 0"));
        }
        Ok(Rate { count, period })
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let unit = match self.period.as_secs() {
            1 if self.period.subsec_nanos() == 0 => "s".to_string(),
            60 if self.period.subsec_nanos() == 0 => "m".to_string(),
            3600 if self.period.subsec_nanos() == 0 => "h".to_string(),
            86_400 if self.period.subsec_nanos() == 0 => "d".to_string(),
            _ => format_duration(self.period),
        };
        write!(f, "{}/{unit}", self.count)
    }
}

impl<'de> Deserialize<'de> for Rate {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parse_str(d, |s: &str| s.parse())
    }
}

impl Serialize for Rate {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// An upstream base URL: `http://host:port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    pub authority: http::uri::Authority,
    /// `h2c://`: the upstream speaks HTTP/2 with prior knowledge (gRPC apps); else HTTP/1.1.
    pub h2: bool,
}

impl<'de> Deserialize<'de> for Upstream {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parse_str(d, |s: &str| {
            let uri: http::Uri = s
                .parse()
                .map_err(|e| err(format!("{s:?}: not a URL: {e}")))?;
            let h2 = match uri.scheme_str() {
                Some("http") => false,
                Some("h2c") => true,
                Some("https") => {
                    return Err(err(format!(
                        "{s:?}: https upstreams are not supported; the upstream is the app beside us, e.g. http://127.0.0.1:9000"
                    )))
                }
                _ => {
                    return Err(err(format!(
                        "{s:?}: expected http://host:port (or h2c://host:port for HTTP/2)"
                    )))
                }
            };
            if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
                return Err(err(format!(
                    "{s:?}: the upstream takes no path; requests keep theirs"
                )));
            }
            let authority = uri
                .authority()
                .cloned()
                .ok_or_else(|| err(format!("{s:?}: missing host")))?;
            Ok(Upstream { authority, h2 })
        })
    }
}

impl Serialize for Upstream {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let scheme = if self.h2 { "h2c" } else { "http" };
        s.collect_str(&format_args!("{scheme}://{}", self.authority))
    }
}

/// The control plane's base URL, `http://host:port` or `https://host:port`; or a list of
/// them, all of one scheme: the controllers that serve at once, each sent every report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlUrl(pub Vec<http::Uri>);

impl ControlUrl {
    pub fn tls(&self) -> bool {
        self.0.first().and_then(http::Uri::scheme_str) == Some("https")
    }
}

fn control_url(s: &str) -> Result<http::Uri, String> {
    let uri: http::Uri = s
        .parse()
        .map_err(|e| err(format!("{s:?}: not a URL: {e}")))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err(err(format!(
            "{s:?}: the control plane speaks http:// or https://"
        )));
    }
    if uri.authority().is_none() || !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        return Err(err(format!("{s:?}: expected http(s)://host:port")));
    }
    Ok(uri)
}

/// The most controllers one proxy reports to.
pub const MAX_CONTROL_URLS: usize = 8;

impl<'de> Deserialize<'de> for ControlUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parse_one_or_list(d, "http(s)://host:port, or a list of them", |s, before| {
            let u = control_url(s)?;
            if before
                .iter()
                .any(|o: &http::Uri| o.authority() == u.authority())
            {
                return Err(format!("{s:?} is given twice"));
            }
            if before.first().is_some_and(|o| o.scheme() != u.scheme()) {
                return Err("the URLs must be all http:// or all https://".into());
            }
            if before.len() >= MAX_CONTROL_URLS {
                return Err(format!("at most {MAX_CONTROL_URLS} URLs"));
            }
            Ok(u)
        })
        .map(ControlUrl)
    }
}

impl fmt::Display for ControlUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, u) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{u}")?;
        }
        Ok(())
    }
}

impl Serialize for ControlUrl {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0.as_slice() {
            [one] => s.collect_str(one),
            all => s.collect_seq(all.iter().map(ToString::to_string)),
        }
    }
}

/// A header-size limit in bytes, at least 1 KiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct HeaderBytes(pub usize);

impl<'de> Deserialize<'de> for HeaderBytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = usize::deserialize(d)?;
        if (1024..=1024 * 1024).contains(&n) {
            Ok(HeaderBytes(n))
        } else {
            Err(de::Error::custom(format!(
                "{n}: must be between 1024 and 1048576"
            )))
        }
    }
}

/// A budget of bytes held in memory: 64 KiB to 16 GiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct BufferBytes(pub u64);

impl<'de> Deserialize<'de> for BufferBytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = u64::deserialize(d)?;
        if ((64 << 10)..=(16 << 30)).contains(&n) {
            Ok(BufferBytes(n))
        } else {
            Err(de::Error::custom(format!(
                "{n}: must be between 65536 (64 KiB) and 17179869184 (16 GiB)"
            )))
        }
    }
}

/// A compiled `path_regex`.
#[derive(Debug, Clone)]
pub struct PathRegex(pub regex::Regex);

impl<'de> Deserialize<'de> for PathRegex {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parse_str(d, |s: &str| {
            regex::RegexBuilder::new(s)
                .size_limit(1 << 20)
                .build()
                .map(PathRegex)
                .map_err(|e| err(format!("{s:?}: bad regex: {e}")))
        })
    }
}

impl Serialize for PathRegex {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.0.as_str())
    }
}

/// `host`: an exact host name, or `*.example.com` for any subdomain. Case-insensitive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct HostPattern(pub String);

impl<'de> Deserialize<'de> for HostPattern {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parse_str(d, |s: &str| {
            let s = s.to_ascii_lowercase();
            let bare = s.strip_prefix("*.").unwrap_or(&s);
            if bare.is_empty()
                || !bare
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
            {
                return Err(err(format!(
                    "{s:?}: expected a host name such as api.example.com or *.example.com"
                )));
            }
            Ok(HostPattern(s))
        })
    }
}

/// An entry of `hosts:`: a name (`api.example.com`, `svc.ns`), `*.example.com` for any
/// subdomain, or an address (`10.1.2.3`, `fd00::1` or `[fd00::1]`). A port is ignored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServedHost {
    /// Lower case, without a trailing dot.
    Name(String),
    /// The suffix after `*`, lower case: `.example.com`.
    Subdomains(String),
    Ip(std::net::IpAddr),
}

impl ServedHost {
    /// Whether a request's host (without port and trailing dot, as
    /// [`crate::key::request_host`] gives it) is this one.
    pub fn serves(&self, host: &str) -> bool {
        match self {
            ServedHost::Name(name) => host.eq_ignore_ascii_case(name),
            ServedHost::Subdomains(suffix) => crate::key::under_domain(host, suffix),
            ServedHost::Ip(ip) => host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|h| h.to_canonical() == *ip),
        }
    }
}

impl FromStr for ServedHost {
    type Err = String;
    fn from_str(raw: &str) -> Result<Self, String> {
        let s = raw.trim().to_ascii_lowercase();
        // `[v6]`, `[v6]:port`, `v6`, `v4:port`, `name:port`.
        let bare = if let Some(rest) = s.strip_prefix('[') {
            rest.split(']').next().unwrap_or(rest).to_owned()
        } else if s.matches(':').count() == 1 {
            s.split(':').next().unwrap_or(&s).to_owned()
        } else {
            s.clone()
        };
        if let Ok(ip) = bare.parse::<std::net::IpAddr>() {
            return Ok(ServedHost::Ip(ip.to_canonical()));
        }
        let name = bare.strip_suffix('.').unwrap_or(&bare);
        let plain = name.strip_prefix("*.").unwrap_or(name);
        if plain.is_empty()
            || plain.starts_with('.')
            || plain.contains("..")
            || !plain
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
        {
            return Err(format!(
                "{raw:?}: expected a host name (api.example.com, svc.ns), *.example.com or an address"
            ));
        }
        Ok(match name.strip_prefix('*') {
            Some(suffix) => ServedHost::Subdomains(suffix.to_owned()),
            None => ServedHost::Name(name.to_owned()),
        })
    }
}

impl<'de> Deserialize<'de> for ServedHost {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parse_str(d, |s: &str| s.parse().map_err(err))
    }
}

impl Serialize for ServedHost {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            ServedHost::Name(n) => s.serialize_str(n),
            ServedHost::Subdomains(suffix) => s.serialize_str(&format!("*{suffix}")),
            ServedHost::Ip(ip) => s.serialize_str(&ip.to_string()),
        }
    }
}

/// An HTTP method name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MethodName(pub http::Method);

impl<'de> Deserialize<'de> for MethodName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parse_str(d, |s: &str| {
            if s.is_empty() || !s.bytes().all(|b| b.is_ascii_uppercase()) {
                return Err(err(format!(
                    "{s:?}: methods are upper case, such as GET or POST"
                )));
            }
            http::Method::from_bytes(s.as_bytes())
                .map(MethodName)
                .map_err(|_| err(format!("{s:?}: not a method")))
        })
    }
}

impl Serialize for MethodName {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.0.as_str())
    }
}

/// A header name, stored lower case.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderNameStr(pub http::HeaderName);

impl<'de> Deserialize<'de> for HeaderNameStr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parse_str(d, |s: &str| {
            http::HeaderName::from_bytes(s.to_ascii_lowercase().as_bytes())
                .map(HeaderNameStr)
                .map_err(|_| err(format!("{s:?}: not a header name")))
        })
    }
}

impl Serialize for HeaderNameStr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.0.as_str())
    }
}

/// `headers: {x-plan: premium}`: each named header must be present with exactly that value.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderEquals(pub Vec<(http::HeaderName, http::HeaderValue)>);

impl<'de> Deserialize<'de> for HeaderEquals {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let map = BTreeMap::<String, String>::deserialize(d)?;
        let mut out = Vec::with_capacity(map.len());
        for (k, v) in map {
            let name = http::HeaderName::from_bytes(k.to_ascii_lowercase().as_bytes())
                .map_err(|_| de::Error::custom(format!("{k:?}: not a header name")))?;
            let value = http::HeaderValue::from_str(&v)
                .map_err(|_| de::Error::custom(format!("{k}: {v:?}: not a header value")))?;
            out.push((name, value));
        }
        Ok(HeaderEquals(out))
    }
}

impl HeaderEquals {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl Serialize for HeaderEquals {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(
            self.0
                .iter()
                .map(|(k, v)| (k.as_str(), v.to_str().unwrap_or(""))),
        )
    }
}

/// What a rule counts by: one part, or a tuple of parts. `[]` is one bucket for everyone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySpec(pub Vec<KeyPart>);

impl<'de> Deserialize<'de> for KeySpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = KeySpec;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a key part (client_ip, header:NAME, query:NAME, path, method, host) or a list of them")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<KeySpec, E> {
                Ok(KeySpec(vec![s.parse().map_err(E::custom)?]))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<KeySpec, A::Error> {
                let mut parts = Vec::new();
                while let Some(s) = seq.next_element::<String>()? {
                    let part: KeyPart = s.parse().map_err(de::Error::custom)?;
                    if parts.contains(&part) {
                        return Err(de::Error::custom(format!("{s:?} appears twice")));
                    }
                    parts.push(part);
                }
                if parts.len() > 8 {
                    return Err(de::Error::custom("at most 8 parts in a key"));
                }
                Ok(KeySpec(parts))
            }
        }
        d.deserialize_any(V)
    }
}

impl Serialize for KeySpec {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(|p| p.to_string()))
    }
}
