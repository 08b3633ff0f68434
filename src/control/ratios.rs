//! How a reply becomes the drop ratios a proxy holds ([`DropRatios`], which the decision in
//! `rules` reads): the service's own ratios only, each clamped to [0, 1]. Pure, no I/O.

use super::Reply;
use crate::limit::Nanos;
use crate::rules::DropRatios;

impl DropRatios {
    /// The ratios of `service` in `reply`, computed at `at`.
    pub fn from_reply(reply: &Reply, service: &str, at: Nanos) -> Self {
        let ratios = reply.ratios.iter().filter(|r| r.service == service);
        let mut out = DropRatios::of(
            at,
            ratios.map(|r| (r.rule.as_str(), r.key.as_deref(), r.ratio)),
        );
        for h in reply.rules.iter().filter(|h| h.service == service) {
            out.hint(&h.rule, h.name_above, h.cut_below);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::{Ratio, VERSION};

    #[test]
    fn named_keys_get_their_ratio_and_the_rest_the_other_ratio() {
        let reply = Reply {
            version: VERSION,
            age_ms: 0,
            ratios: vec![
                Ratio {
                    service: "s".into(),
                    rule: "r".into(),
                    key: Some("k".into()),
                    ratio: 0.5,
                },
                Ratio {
                    service: "s".into(),
                    rule: "r".into(),
                    key: None,
                    ratio: 0.1,
                },
                Ratio {
                    service: "other".into(),
                    rule: "r".into(),
                    key: Some("j".into()),
                    ratio: 0.9,
                },
            ],
            rules: Vec::new(),
            warming: false,
        };
        let d = DropRatios::from_reply(&reply, "s", 7);
        assert_eq!(d.ratio("r", b"k", false), 0.5);
        assert_eq!(
            d.ratio("r", b"k", true),
            0.5,
            "a named key has its own ratio"
        );
        assert_eq!(
            d.ratio("r", b"j", true),
            0.1,
            "another service's ratio does not apply; a folded key gets the tail's"
        );
        assert_eq!(
            d.ratio("r", b"j", false),
            0.0,
            "a key the report named (or never reported) that the reply leaves out: 0"
        );
        assert_eq!(d.ratio("q", b"k", true), 0.0);
        assert_eq!(d.at, 7);
    }
}
