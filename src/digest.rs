//! The keyed digest that stands for a key's private parts wherever a key is shown or sent: a
//! `header:` or `query:` value (a bearer token, an API key, a customer id) becomes `~` and 32
//! hex digits of an HMAC-SHA256 under the secret the whole fleet of a service shares
//! (`key_secret_file`), so one value has one digest on every replica, in the rejection log,
//! in reports and in the control plane's state; `spillway digest` computes it for support.
//!
//! Owns the secret and the digest. Must never: run on a known key's local or global decision
//! (a global key keeps its digest with its counters; a Redis decision, a round trip anyway,
//! names its Redis key with one) but for a rule whose `overrides:` name keys by digest (a key
//! not listed by its bytes is looked up by its digest), show or send the secret, or leave a
//! digest that two replicas with one secret would compute apart.

use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Marks a digested part in a key's text form.
pub const MARK: u8 = crate::key::DIGEST_MARK;

/// Bytes of the HMAC kept: 128 bits.
const KEPT: usize = 16;

/// Used when no `key_secret_file` is configured: digests are stable but anyone can compute
/// the digest of a value they guess (check-config and the start-up log say so).
const BUILT_IN: &[u8] = b"spillway: no key_secret_file configured";

thread_local! {
    /// Digests computed by this thread: a known key's decision never adds one
    /// (`tests/no_alloc.rs`; per thread, so that tests deciding at the same time do not count).
    static COMPUTED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many digests this thread has computed.
pub fn computed() -> u64 {
    COMPUTED.with(std::cell::Cell::get)
}

/// A secret shorter than this is refused: it could be guessed.
pub const MIN_SECRET: usize = 16;

/// The fleet's key secret, its HMAC state keyed once.
#[derive(Clone)]
pub struct Secret {
    mac: Arc<Hmac<Sha256>>,
    built_in: bool,
}

impl Default for Secret {
    fn default() -> Self {
        Secret::new(BUILT_IN).with_built_in()
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.built_in {
            "Secret(built-in)"
        } else {
            "Secret(..)"
        })
    }
}

impl Secret {
    fn new(bytes: &[u8]) -> Self {
        // HMAC takes a key of any length.
        let mac = Hmac::<Sha256>::new_from_slice(bytes).unwrap_or_else(|_| unreachable!());
        Secret {
            mac: Arc::new(mac),
            built_in: false,
        }
    }

    fn with_built_in(mut self) -> Self {
        self.built_in = true;
        self
    }

    /// The secret in `path` (a mounted Secret's file): its bytes, one trailing newline
    /// dropped; at least [`MIN_SECRET`] bytes.
    pub fn load(path: &std::path::Path) -> Result<Secret, String> {
        let bytes =
            std::fs::read(path).map_err(|e| format!("key_secret_file {}: {e}", path.display()))?;
        let bytes = bytes.strip_suffix(b"\n").unwrap_or(&bytes);
        let bytes = bytes.strip_suffix(b"\r").unwrap_or(bytes);
        if bytes.len() < MIN_SECRET {
            return Err(format!(
                "key_secret_file {}: {} bytes; a secret has at least {MIN_SECRET} (openssl rand -hex 32)",
                path.display(),
                bytes.len()
            ));
        }
        Ok(Secret::new(bytes))
    }

    /// The configured secret, or the built-in one when `path` is `None`.
    pub fn of(path: Option<&std::path::Path>) -> Result<Secret, String> {
        path.map_or_else(|| Ok(Secret::default()), Secret::load)
    }

    /// Whether this is the built-in secret (no `key_secret_file`).
    pub fn built_in(&self) -> bool {
        self.built_in
    }

    /// Appends the digest of `value`: [`MARK`] and 32 lower-case hex digits.
    pub fn push(&self, value: &[u8], out: &mut crate::key::KeyBuf) {
        COMPUTED.with(|c| c.set(c.get() + 1));
        let mut mac = (*self.mac).clone();
        mac.update(value);
        let sum = mac.finalize().into_bytes();
        out.push(MARK);
        crate::key::push_hex(out, &sum[..KEPT]);
    }

    /// The digest of `value` as text.
    pub fn of_value(&self, value: &[u8]) -> String {
        let mut out = crate::key::KeyBuf::new();
        self.push(value, &mut out);
        String::from_utf8_lossy(&out).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &[u8]) -> std::path::PathBuf {
        let path = std::env::temp_dir().join(format!(
            "spillway-secret-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        ));
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn one_secret_gives_one_digest_and_another_secret_another() {
        let a = Secret::load(&file(b"0123456789abcdef0123\n")).unwrap();
        let again = Secret::load(&file(b"0123456789abcdef0123")).unwrap();
        let b = Secret::load(&file(b"fedcba98765432100123")).unwrap();
        let d = a.of_value(b"sk_live_abc");
        assert_eq!(d.len(), 33);
        assert!(d.starts_with('~') && d[1..].bytes().all(|c| c.is_ascii_hexdigit()));
        assert_eq!(
            d,
            again.of_value(b"sk_live_abc"),
            "a trailing newline is not the secret"
        );
        assert_ne!(d, b.of_value(b"sk_live_abc"));
        assert_ne!(d, a.of_value(b"sk_live_abd"));
        assert!(!d.contains("sk_live"));
        // RFC 4231 test case 2 ("Jefe"): the digest is HMAC-SHA256's first 16 bytes.
        let jefe = Secret::new(b"Jefe").of_value(b"what do ya want for nothing?");
        assert_eq!(jefe, "~5bdcc146bf60754e6a042426089575c7");
        assert!(Secret::default().built_in() && !a.built_in());
    }

    #[test]
    fn a_short_or_missing_secret_file_is_an_error_naming_it() {
        let e = Secret::load(&file(b"short\n")).unwrap_err();
        assert!(e.contains("at least 16"), "{e}");
        let e = Secret::load(std::path::Path::new("/nonexistent/secret")).unwrap_err();
        assert!(e.contains("/nonexistent/secret"), "{e}");
        assert!(
            !format!("{:?}", Secret::load(&file(b"0123456789abcdefXYZ")).unwrap()).contains("XYZ")
        );
    }
}
