//! A rule's compiled `match:` block: path (exact, prefix, regex; with or without case), host,
//! methods and header conditions. Must never: allocate per request.

use super::*;

/// A compiled `match:` block; an absent condition always holds.
pub(super) struct Matcher {
    pub(super) path: Option<String>,
    /// `path` in its match form (see [`RequestView::path`]).
    pub(super) path_lenient: Option<String>,
    pub(super) path_prefix: Option<String>,
    pub(super) path_regex: Option<regex::Regex>,
    /// The same, matching without case.
    pub(super) path_regex_lenient: Option<regex::Regex>,
    pub(super) host: Option<HostPattern>,
    pub(super) methods: Vec<http::Method>,
    pub(super) headers: Vec<(http::HeaderName, HeaderValue)>,
    pub(super) present: Vec<http::HeaderName>,
    pub(super) absent: Vec<http::HeaderName>,
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
        }
    }
}

impl Matcher {
    #[inline]
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
                            && path.as_bytes()[..p.len()].eq_ignore_ascii_case(p.as_bytes())))
                })
                || self
                    .path_regex_lenient
                    .as_ref()
                    .is_some_and(|re| !re.is_match(path))
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
        if !self.present.iter().all(|h| req.headers.contains_key(h)) {
            return false;
        }
        if self.absent.iter().any(|h| req.headers.contains_key(h)) {
            return false;
        }
        if !self
            .headers
            .iter()
            .all(|(name, want)| req.headers.get_all(name).iter().any(|v| v == want))
        {
            return false;
        }
        true
    }
}

/// `pattern` is lower case: `api.example.com` or `*.example.com` (subdomains only). A request
/// without a host (HTTP/1.0) reaches the one app all the same: every host rule applies to it.
pub(super) fn host_matches(pattern: &str, host: Option<&str>) -> bool {
    let Some(host) = host else { return true };
    match pattern.strip_prefix('*') {
        Some(suffix) => {
            host.len() > suffix.len()
                && host.is_char_boundary(host.len() - suffix.len())
                && host[host.len() - suffix.len()..].eq_ignore_ascii_case(suffix)
        }
        None => host.eq_ignore_ascii_case(pattern),
    }
}
