//! The canonical request target: one spelling of a path, so that what the rules count is what
//! the app serves.
//!
//! Owns path normalisation (RFC 3986: unreserved escapes decoded, remaining escapes in upper
//! case, dot segments removed, repeated slashes merged) and the lenient "match form" that rules
//! compare against (no `;params`, no trailing slash, `%2F`, `%5C` and `\` as `/`; case is
//! folded by the comparisons), and query decoding for keys. Must never: allocate for a path
//! that is already canonical, accept a `..` above the root or a broken escape, or panic on any
//! input.

use std::borrow::Cow;

/// Why a target cannot be normalised; each is answered 400.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TargetError {
    #[error("the request path has a '%' that is not followed by two hex digits")]
    BadEscape,
    #[error("the request path climbs above the root with '..'")]
    AboveRoot,
    #[error("the request path has an encoded '/' or '\\', which this proxy refuses")]
    EncodedSeparator,
    #[error("the request path has a dot segment with parameters (';')")]
    DotWithParams,
}

/// The canonical spelling of `path`: `None` when it is canonical already (the common case,
/// found without allocating). `reject_separators` refuses `%2F` and `%5C` instead of keeping
/// them. A path that does not start with `/` (`*`, an authority) is left alone.
pub fn normalize(path: &str, reject_separators: bool) -> Result<Option<String>, TargetError> {
    let bytes = path.as_bytes();
    if bytes.first() != Some(&b'/') {
        return Ok(None);
    }
    // Most paths: no escape, no segment that starts with a dot or is empty. One pass.
    let mut plain = true;
    let mut i = 1;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%' || (bytes[i - 1] == b'/' && (b == b'/' || b == b'.')) {
            plain = false;
            break;
        }
        i += 1;
    }
    if plain || is_canonical(bytes, reject_separators)? {
        return Ok(None);
    }
    // Escapes first, so that `%2E%2E` is a dot segment like `..`.
    let mut decoded: Vec<u8> = Vec::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%' {
            let v = escape_at(bytes, i)?;
            if unreserved(v) {
                decoded.push(v);
            } else {
                if reject_separators && (v == b'/' || v == b'\\') {
                    return Err(TargetError::EncodedSeparator);
                }
                decoded.extend_from_slice(&[
                    b'%',
                    HEX[usize::from(v >> 4)],
                    HEX[usize::from(v & 15)],
                ]);
            }
            i += 3;
        } else {
            decoded.push(b);
            i += 1;
        }
    }
    let mut out: Vec<u8> = Vec::with_capacity(decoded.len());
    let segments: Vec<&[u8]> = decoded[1..].split(|&b| b == b'/').collect();
    let last = segments.len() - 1;
    // Lengths of `out` before each kept segment, for `..`.
    let mut starts: Vec<usize> = Vec::new();
    let mut trailing = false;
    for (n, seg) in segments.iter().enumerate() {
        trailing = false;
        match *seg {
            b"" | b"." => trailing = n == last,
            b".." => {
                let start = starts.pop().ok_or(TargetError::AboveRoot)?;
                out.truncate(start);
                trailing = n == last;
            }
            s => {
                if is_dot_with_params(s) {
                    return Err(TargetError::DotWithParams);
                }
                starts.push(out.len());
                out.push(b'/');
                out.extend_from_slice(s);
            }
        }
    }
    if out.is_empty() || trailing {
        out.push(b'/');
    }
    // Only ASCII was added to the input's own bytes, split at ASCII: still UTF-8.
    let out = String::from_utf8(out)
        .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned());
    Ok(Some(out))
}

/// `uri` with its path normalised (see [`normalize`]), the query as it was; `None` when the
/// path is canonical already.
pub fn canonical_uri(
    uri: &http::Uri,
    reject_separators: bool,
) -> Result<Option<http::Uri>, TargetError> {
    let Some(path) = normalize(uri.path(), reject_separators)? else {
        return Ok(None);
    };
    let mut parts = uri.clone().into_parts();
    let target = match uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path,
    };
    // Made of the original's bytes and upper-case escapes: still a valid target.
    parts.path_and_query = Some(target.parse().map_err(|_| TargetError::BadEscape)?);
    http::Uri::from_parts(parts)
        .map(Some)
        .map_err(|_| TargetError::BadEscape)
}

/// The form rules match `path` by, unless `path_match: strict`: every segment's `;params`
/// dropped and one trailing slash ignored (as Tomcat and Spring route), encoded and back
/// slashes taken as `/`. Borrowed when that changes nothing.
pub fn match_form(path: &str) -> Cow<'_, str> {
    // The common case in one pass: nothing to drop or map, at most a trailing slash.
    if !path.bytes().any(|b| matches!(b, b';' | b'%' | b'\\')) {
        return Cow::Borrowed(match path.strip_suffix('/') {
            Some(t) if !t.is_empty() => t,
            _ => path,
        });
    }
    // An encoded or back slash is a separator to some servers (PATH_INFO decoding, Windows
    // paths): the rules count it as one, over-counting rather than under-counting.
    let escaped_separator = |p: &str| {
        p.as_bytes().windows(3).any(|w| {
            w[0] == b'%'
                && ((w[1] == b'2' && w[2].eq_ignore_ascii_case(&b'f'))
                    || (w[1] == b'5' && w[2].eq_ignore_ascii_case(&b'c')))
        })
    };
    if path.contains('\\') || escaped_separator(path) {
        let slashed = path
            .replace("%2F", "/")
            .replace("%2f", "/")
            .replace("%5C", "/")
            .replace("%5c", "/")
            .replace('\\', "/");
        if slashed != path {
            let merged = match normalize(&slashed, false) {
                Ok(Some(p)) => p,
                _ => slashed,
            };
            return Cow::Owned(match_form(&merged).into_owned());
        }
    }
    let trimmed = match path.strip_suffix('/') {
        Some(t) if !t.is_empty() => t,
        _ => path,
    };
    if !trimmed.contains(';') {
        return Cow::Borrowed(trimmed);
    }
    let mut out = String::with_capacity(trimmed.len());
    for (n, seg) in trimmed.split('/').enumerate() {
        if n > 0 {
            out.push('/');
        }
        out.push_str(seg.split(';').next().unwrap_or(""));
    }
    if out.len() > 1 && out.ends_with('/') {
        out.pop();
    }
    Cow::Owned(out)
}

/// Percent-decodes a query parameter's name or value (`%XX`, and `+` as a space). Borrowed
/// when there is nothing to decode; a broken escape stays as it is written.
pub fn decode_query(raw: &str) -> Cow<'_, [u8]> {
    let bytes = raw.as_bytes();
    if !bytes.iter().any(|&b| b == b'%' || b == b'+') {
        return Cow::Borrowed(bytes);
    }
    Cow::Owned(query_bytes(bytes).collect())
}

/// Whether `raw` percent-decodes (`%XX`, `+`) to exactly `want`, without allocating.
pub fn decodes_to(raw: &str, want: &[u8]) -> bool {
    query_bytes(raw.as_bytes()).eq(want.iter().copied())
}

/// The bytes `raw` decodes to as a query part: `+` a space, `%XX` its byte, a broken escape
/// as it is written.
fn query_bytes(raw: &[u8]) -> impl Iterator<Item = u8> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        let b = *raw.get(i)?;
        let (out, step) = match b {
            b'+' => (b' ', 1),
            b'%' => escape_at(raw, i).map_or((b'%', 1), |v| (v, 3)),
            b => (b, 1),
        };
        i += step;
        Some(out)
    })
}

const HEX: &[u8; 16] = b"0123456789ABCDEF";

/// RFC 3986 §2.3: ALPHA / DIGIT / "-" / "." / "_" / "~".
fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// The byte of the escape at `bytes[i]` (a `%`).
fn escape_at(bytes: &[u8], i: usize) -> Result<u8, TargetError> {
    let hi = bytes.get(i + 1).copied().and_then(hex_value);
    let lo = bytes.get(i + 2).copied().and_then(hex_value);
    match (hi, lo) {
        (Some(h), Some(l)) => Ok(h << 4 | l),
        _ => Err(TargetError::BadEscape),
    }
}

/// `.;x` or `..;x`: a dot segment to Tomcat, a name to everyone else.
fn is_dot_with_params(seg: &[u8]) -> bool {
    seg.contains(&b';') && matches!(seg.split(|&b| b == b';').next(), Some(b"." | b".."))
}

/// True when `normalize` would change nothing; errors found on the way are returned at once.
fn is_canonical(bytes: &[u8], reject_separators: bool) -> Result<bool, TargetError> {
    let mut canonical = true;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let v = escape_at(bytes, i)?;
                if reject_separators && (v == b'/' || v == b'\\') {
                    return Err(TargetError::EncodedSeparator);
                }
                if unreserved(v)
                    || bytes[i + 1].is_ascii_lowercase()
                    || bytes[i + 2].is_ascii_lowercase()
                {
                    canonical = false;
                }
                i += 3;
            }
            b'/' => {
                let seg_end = bytes[i + 1..]
                    .iter()
                    .position(|&b| b == b'/')
                    .map_or(bytes.len(), |p| i + 1 + p);
                let seg = &bytes[i + 1..seg_end];
                // An empty segment is a repeated slash unless it is the trailing one.
                if (seg.is_empty() && seg_end != bytes.len()) || seg == b"." || seg == b".." {
                    canonical = false;
                }
                if is_dot_with_params(seg) {
                    return Err(TargetError::DotWithParams);
                }
                i += 1;
            }
            _ => i += 1,
        }
    }
    Ok(canonical)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(p: &str) -> String {
        normalize(p, false)
            .unwrap()
            .unwrap_or_else(|| p.to_string())
    }

    #[test]
    fn equivalent_spellings_of_a_path_become_one() {
        for p in [
            "/login",
            "/%6cogin",
            "/%6Cogin",
            "//login",
            "/./login",
            "/x/../login",
            "/x/%2e%2e/login",
            "///x/.././/login",
        ] {
            assert_eq!(norm(p), "/login", "{p}");
        }
    }

    #[test]
    fn canonical_paths_are_left_alone() {
        for p in [
            "/",
            "/a/b/",
            "/a%20b",
            "/a%2Fb",
            "/a;jsessionid=1",
            "/~u/x.y-z_",
        ] {
            assert_eq!(normalize(p, false), Ok(None), "{p}");
        }
    }

    #[test]
    fn remaining_escapes_are_upper_case_and_separators_kept_or_refused() {
        assert_eq!(norm("/a%2fb%5c"), "/a%2Fb%5C");
        assert_eq!(norm("/a%c3%a9"), "/a%C3%A9");
        assert_eq!(
            normalize("/a%2fb", true),
            Err(TargetError::EncodedSeparator)
        );
        assert_eq!(
            normalize("/a%5Cb", true),
            Err(TargetError::EncodedSeparator)
        );
    }

    #[test]
    fn trailing_slashes_and_dots_at_the_end_keep_a_directory() {
        assert_eq!(norm("/a/."), "/a/");
        assert_eq!(norm("/a/b/.."), "/a/");
        assert_eq!(norm("/a//"), "/a/");
    }

    #[test]
    fn what_cannot_be_normalised_is_an_error() {
        assert_eq!(normalize("/..", false), Err(TargetError::AboveRoot));
        assert_eq!(normalize("/a/../../b", false), Err(TargetError::AboveRoot));
        assert_eq!(normalize("/a%zz", false), Err(TargetError::BadEscape));
        assert_eq!(normalize("/a%4", false), Err(TargetError::BadEscape));
        assert_eq!(
            normalize("/..;/admin", false),
            Err(TargetError::DotWithParams)
        );
        assert_eq!(
            normalize("/x/.;a/y", false),
            Err(TargetError::DotWithParams)
        );
    }

    #[test]
    fn the_match_form_drops_params_and_one_trailing_slash() {
        assert_eq!(match_form("/login"), "/login");
        assert_eq!(match_form("/login/"), "/login");
        assert_eq!(match_form("/"), "/");
        assert_eq!(match_form("/login;jsessionid=x"), "/login");
        assert_eq!(match_form("/a;x/b;y/"), "/a/b");
        assert!(matches!(match_form("/a/b"), Cow::Borrowed(_)));
    }

    #[test]
    fn encoded_and_back_slashes_are_separators_in_the_match_form() {
        assert_eq!(match_form("/api%2Flogin"), "/api/login");
        assert_eq!(match_form("/api\\login"), "/api/login");
        assert_eq!(match_form("/x%2F..%2Fapi/login"), "/api/login");
        assert_eq!(match_form("/a%20b"), "/a%20b");
    }

    #[test]
    fn a_name_is_compared_decoded_without_allocating() {
        assert!(decodes_to("%75ser", b"user"));
        assert!(decodes_to("a+b", b"a b"));
        assert!(!decodes_to("%75se", b"user"));
        assert!(!decodes_to("users", b"user"));
    }

    #[test]
    fn query_values_are_decoded() {
        assert_eq!(&*decode_query("b%6Fb"), b"bob");
        assert_eq!(&*decode_query("a+b%2"), b"a b%2");
        assert!(matches!(decode_query("bob"), Cow::Borrowed(_)));
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        fn target() -> impl Strategy<Value = String> {
            prop::collection::vec(
                prop_oneof![
                    Just("/".to_string()),
                    Just(".".to_string()),
                    Just("..".to_string()),
                    Just(";".to_string()),
                    Just("%".to_string()),
                    Just("%2e".to_string()),
                    Just("%2F".to_string()),
                    "[a-zA-Z0-9%._~-]{1,3}",
                ],
                0..16,
            )
            .prop_map(|parts| format!("/{}", parts.concat()))
        }

        proptest! {
            #[test]
            fn normalising_is_idempotent_and_leaves_no_dot_segments(p in target(), reject in any::<bool>()) {
                if let Ok(n) = normalize(&p, reject) {
                    let once = n.unwrap_or_else(|| p.clone());
                    prop_assert!(once.starts_with('/'));
                    prop_assert_eq!(normalize(&once, reject), Ok(None), "{} -> {}", p, once);
                    for seg in once.split('/') {
                        prop_assert!(seg != "." && seg != "..", "{} -> {}", p, once);
                    }
                    prop_assert!(!once.contains("//"), "{} -> {}", p, once);
                }
            }

            #[test]
            fn any_bytes_never_panic(s in ".{0,64}") {
                let _ = normalize(&s, false);
                let _ = normalize(&format!("/{s}"), true);
                let _ = match_form(&s);
                let _ = decode_query(&s);
            }
        }
    }
}
