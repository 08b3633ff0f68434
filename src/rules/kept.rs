//! What a rule keeps of its 429s: one slot per retry hint of up to a minute, filled on the
//! rule's first refusal with that hint by the renderer `respond` hands in, and dropped with the
//! rule.
//!
//! Owns the slots. Must never: know what a 429 says (its status, fields and body are
//! `respond`'s, which builds each [`Answer`]), or allocate for a hint whose slot is filled.

use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use http::header::{HeaderMap, HeaderValue};

/// Retry hints (whole seconds) whose 429 a rule keeps: up to a minute covers rules limited per
/// second or per minute; longer hints are rendered per refusal.
const KEPT_SECS: usize = 60;

/// One rule's kept 429s. About 1 KiB per rule until used, plus about 1 KiB per hint seen.
pub struct Answers {
    rule: Arc<str>,
    /// The rule's `RateLimit-Policy` value.
    policy: HeaderValue,
    // Shared so that a refusal's response can hold its answer; a pointer per unused hint.
    by_secs: [OnceLock<Arc<Answer>>; KEPT_SECS],
}

/// A 429's parts for one rule and retry hint, as `respond` rendered them.
pub struct Answer {
    pub body: Bytes,
    pub headers: HeaderMap,
    /// `headers` written as the lines of an HTTP/1 head, the `RateLimit` ones last...
    pub fields: Box<[u8]>,
    /// ...from here on.
    pub rate_at: usize,
}

/// How `respond` renders a rule's 429: from the rule's name, its policy and the retry hint.
pub type Render = fn(&str, &HeaderValue, Option<u64>) -> Answer;

impl Answers {
    pub fn new(rule: Arc<str>, policy: HeaderValue) -> Self {
        Self {
            rule,
            policy,
            by_secs: std::array::from_fn(|_| OnceLock::new()),
        }
    }

    /// The rule's name.
    pub fn rule(&self) -> &Arc<str> {
        &self.rule
    }

    /// The rule's `RateLimit-Policy` value.
    pub fn policy(&self) -> &HeaderValue {
        &self.policy
    }

    /// The kept answer for `retry`, rendered on first use; `None` for a hint not kept.
    pub fn get(&self, retry: Option<u64>, render: Render) -> Option<&Arc<Answer>> {
        let secs = retry?;
        let slot = self
            .by_secs
            .get(usize::try_from(secs).ok()?.checked_sub(1)?)?;
        Some(slot.get_or_init(|| Arc::new(self.render(retry, render))))
    }

    /// The answer for `retry`, rendered now and not kept.
    pub fn render(&self, retry: Option<u64>, render: Render) -> Answer {
        render(&self.rule, &self.policy, retry)
    }
}

impl std::fmt::Debug for Answers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kept = self.by_secs.iter().filter(|s| s.get().is_some()).count();
        f.debug_struct("Answers")
            .field("rule", &self.rule)
            .field("kept", &kept)
            .finish()
    }
}
