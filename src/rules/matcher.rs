//! A rule's compiled `match:` block: path (exact, prefix, regex; with or without case), host,
//! methods and header conditions. Must never: allocate per request.

use super::*;

/// A compiled `match:` block; an absent condition always holds.
pub(super) struct Matcher {
    pub(super) path: Option<String>,
    /// `path` in its match form (see [`RequestView::path`]).
    pub(super) path_lenient: Option<String>,
    pub(super) path_prefix: Option<String>,
    /// A prefix ending in `/` names a directory: without that slash, the directory itself
    /// (`/api/` matches `/api`, which is the match form of `/api/`).
    pub(super) path_dir: Option<String>,
    pub(super) path_regex: Option<regex::Regex>,
    /// The same, matching without case.
    pub(super) path_regex_lenient: Option<regex::Regex>,
    pub(super) host: Option<HostPattern>,
    pub(super) methods: Vec<http::Method>,
    pub(super) headers: Vec<(http::HeaderName, HeaderValue)>,
    pub(super) present: Vec<http::HeaderName>,
    pub(super) absent: Vec<http::HeaderName>,
    /// The client's address is in one of these (none listed: any).
    pub(super) client_in: Vec<crate::key::Cidr>,
    /// The client's address is in none of these.
    pub(super) client_out: Vec<crate::key::Cidr>,
}

impl From<&Match> for Matcher {
    fn from(m: &Match) -> Self {
        Matcher {
            path: m.path.clone(),
            path_lenient: m
                .path
                .as_deref()
                .map(|p| crate::target::match_form(p).into_owned()),
            path_prefix: m.path_prefix.clone(),
            path_dir: m
                .path_prefix
                .as_deref()
                .and_then(|p| p.strip_suffix('/'))
                .filter(|d| !d.is_empty())
                .map(str::to_owned),
            path_regex: m.path_regex.as_ref().map(|r| r.0.clone()),
            path_regex_lenient: m.path_regex.as_ref().map(|r| {
                regex::RegexBuilder::new(r.0.as_str())
                    .case_insensitive(true)
                    .build()
                    .unwrap_or_else(|_| r.0.clone())
            }),
            host: m.host.clone(),
            methods: m.methods.iter().map(|m| m.0.clone()).collect(),
            headers: m.headers.0.clone(),
            present: m.headers_present.iter().map(|h| h.0.clone()).collect(),
            absent: m.headers_absent.iter().map(|h| h.0.clone()).collect(),
            client_in: m.client_ip.iter().map(|c| c.0).collect(),
            client_out: m.except_client_ip.iter().map(|c| c.0).collect(),
        }
    }
}

impl Matcher {
    // Always: `explain` asks too, and a second caller would leave the decision's outlined.
    #[inline(always)]
    pub(super) fn matches(&self, req: &RequestView<'_>) -> bool {
        let strict = req.strict_path;
        if self.path.is_some() || self.path_prefix.is_some() || self.path_regex.is_some() {
            let path = req.path();
            if strict {
                if self.path.as_ref().is_some_and(|p| path != p)
                    || self
                        .path_prefix
                        .as_ref()
                        .is_some_and(|p| !path.starts_with(p.as_str()))
                    || self
                        .path_regex
                        .as_ref()
                        .is_some_and(|re| !re.is_match(path))
                {
                    return false;
                }
            } else if self
                .path_lenient
                .as_ref()
                .is_some_and(|p| !(path == p || path.eq_ignore_ascii_case(p)))
                || self.path_prefix.as_ref().is_some_and(|p| {
                    // As written first: the common case, and a plain compare.
                    !(path.starts_with(p.as_str())
                        || (path.len() >= p.len()
                            && path.as_bytes()[..p.len()].eq_ignore_ascii_case(p.as_bytes()))
                        || self
                            .path_dir
                            .as_ref()
                            .is_some_and(|d| path.eq_ignore_ascii_case(d)))
                })
                || self
                    .path_regex_lenient
                    .as_ref()
                    .is_some_and(|re| !lenient_regex_match(re, path))
            {
                return false;
            }
        }
        // HEAD runs the GET handler in most frameworks: a rule on GET counts it too.
        let method_ok = self.methods.is_empty()
            || self.methods.contains(req.method)
            || (req.method == http::Method::HEAD && self.methods.contains(&http::Method::GET));
        if !method_ok {
            return false;
        }
        if let Some(h) = &self.host {
            if !host_matches(&h.0, req.host()) {
                return false;
            }
        }
        // Asked only when listed: most rules list none, and the loops would be calls.
        if !self.present.is_empty() && !self.present.iter().all(|h| req.headers.contains_key(h)) {
            return false;
        }
        if !self.absent.is_empty() && self.absent.iter().any(|h| req.headers.contains_key(h)) {
            return false;
        }
        if !self.client_in.is_empty() && !self.client_in.iter().any(|c| c.contains(req.client_addr))
        {
            return false;
        }
        if !self.client_out.is_empty()
            && self.client_out.iter().any(|c| c.contains(req.client_addr))
        {
            return false;
        }
        if !self.headers.is_empty()
            && !self
                .headers
                .iter()
                .all(|(name, want)| req.headers.get_all(name).iter().any(|v| v == want))
        {
            return false;
        }
        true
    }
}

/// Whether `re` matches `path` (a match form) or the same path with the trailing slash the
/// match form dropped: `^/api/` names `/api/`, whose match form is `/api`.
fn lenient_regex_match(re: &regex::Regex, path: &str) -> bool {
    if re.is_match(path) {
        return true;
    }
    if path.ends_with('/') {
        return false;
    }
    // On the stack for the usual path; a longer one is copied once.
    let mut buf = [0u8; 256];
    if path.len() < buf.len() {
        buf[..path.len()].copy_from_slice(path.as_bytes());
        buf[path.len()] = b'/';
        // A str with an ASCII byte appended.
        std::str::from_utf8(&buf[..=path.len()]).is_ok_and(|p| re.is_match(p))
    } else {
        re.is_match(&format!("{path}/"))
    }
}

/// `pattern` is lower case: `api.example.com` or `*.example.com` (subdomains only). A request
/// without a host (HTTP/1.0) reaches the one app all the same: every host rule applies to it.
pub(super) fn host_matches(pattern: &str, host: Option<&str>) -> bool {
    let Some(host) = host else { return true };
    match pattern.strip_prefix('*') {
        Some(suffix) => crate::key::under_domain(host, suffix),
        None => host.eq_ignore_ascii_case(pattern),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn matches(m: &Matcher, path: &str) -> bool {
        let (method, headers) = (http::Method::GET, http::HeaderMap::new());
        let uri: http::Uri = path.parse().unwrap();
        m.matches(&RequestView::new(
            &method,
            &uri,
            &headers,
            std::net::Ipv4Addr::LOCALHOST.into(),
        ))
    }

    fn matcher(yaml: &str) -> Matcher {
        Matcher::from(&serde_norway::from_str::<Match>(yaml).unwrap())
    }

    fn starts_with_ignore_case(s: &str, p: &str) -> bool {
        s.len() >= p.len() && s.as_bytes()[..p.len()].eq_ignore_ascii_case(p.as_bytes())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        /// Under lenient matching a prefix `P/` matches a path whose match form is `P` or
        /// continues `P/`, in any case; a prefix without a trailing slash is a string prefix;
        /// whatever matched as a string prefix still matches.
        #[test]
        fn a_prefix_matches_itself_and_what_is_under_it(
            segments in proptest::collection::vec("[aA]{0,2}(;v)?|\\.{1,2}", 0..5),
            prefix in proptest::collection::vec("[aA]{1,2}", 1..3),
            slash in proptest::bool::ANY,
            trailing in proptest::bool::ANY,
        ) {
            let raw = format!("/{}{}", segments.join("/"), if trailing { "/" } else { "" });
            // The rules see a normalised path (the request's hygiene runs first).
            let Ok(normal) = crate::target::normalize(&raw, false) else {
                return Ok(());
            };
            let path = normal.unwrap_or(raw);
            let p = format!("/{}{}", prefix.join("/"), if slash { "/" } else { "" });
            let form = crate::target::match_form(&path).into_owned();
            let m = matcher(&format!("path_prefix: \"{p}\""));
            let want = match p.strip_suffix('/') {
                Some(dir) => form.eq_ignore_ascii_case(dir) || starts_with_ignore_case(&form, &p),
                None => starts_with_ignore_case(&form, &p),
            };
            prop_assert_eq!(matches(&m, &path), want, "{} under {}", path, p);
            if starts_with_ignore_case(&form, &p) {
                prop_assert!(matches(&m, &path));
            }
            // An anchored regex naming the same directory agrees with the prefix.
            if slash {
                let re = matcher(&format!("path_regex: \"^{p}\""));
                prop_assert_eq!(matches(&re, &path), want, "{} under ^{}", path, p);
            }
        }
    }

    #[test]
    fn a_long_path_is_matched_with_its_trailing_slash_too() {
        let re = matcher("path_regex: \"^/a+/$\"");
        let long = format!("/{}", "a".repeat(300));
        assert!(matches(&re, &long));
        assert!(matches(&re, &format!("{long}/")));
        assert!(!matches(&re, &format!("{long}/b")));
    }
}
