use super::*;

fn breaker(threshold: u32, cooldown: Nanos) -> Breaker {
    Breaker {
        failures: AtomicU32::new(0),
        open_until: AtomicU64::new(0),
        probing: AtomicBool::new(false),
        threshold,
        cooldown,
    }
}

#[test]
fn the_breaker_opens_after_consecutive_failures_and_a_success_resets_the_count() {
    let b = breaker(3, 1_000);
    assert!(!b.failure(10, false));
    assert!(!b.failure(11, false));
    assert!(!b.success(), "closed: nothing to close");
    assert!(!b.failure(12, false));
    assert!(!b.failure(13, false));
    assert_eq!(b.admit(14), Admit::Call, "two failures since the success");
    assert!(
        b.failure(14, false),
        "the third consecutive failure opens it"
    );
    assert_eq!(b.admit(15), Admit::Skip);
    assert_eq!(b.admit(1_013), Admit::Skip, "cool-down runs until 1014");
}

#[test]
fn after_the_cooldown_one_probe_goes_and_its_result_closes_or_reopens() {
    let b = breaker(1, 1_000);
    assert!(b.failure(0, false));
    assert_eq!(b.admit(1_000), Admit::Probe);
    assert_eq!(b.admit(1_001), Admit::Skip, "only one probe at a time");
    b.failure(1_002, true);
    assert_eq!(b.admit(1_500), Admit::Skip, "a failed probe opens it again");
    assert_eq!(b.admit(2_002), Admit::Probe);
    assert!(b.success(), "a good probe closes it");
    assert_eq!(b.admit(2_003), Admit::Call);
}

#[test]
fn answers_are_parsed_and_never_trusted_blindly() {
    assert_eq!(
        parse_answer(&[1, 4, 0, 2_500_000]),
        Some(Answer {
            admitted: true,
            remaining: 4,
            retry_after: Some(0),
            reset_after: 2_500_000_000,
        })
    );
    assert_eq!(
        parse_answer(&[0, 0, -1, 7]).map(|a| (a.admitted, a.retry_after)),
        Some((false, None))
    );
    assert_eq!(
        parse_answer(&[0, -5, 10, -3]).map(|a| (a.remaining, a.reset_after)),
        Some((0, 0))
    );
    assert_eq!(parse_answer(&[1, 2, 3]), None);
    assert_eq!(parse_answer(&[]), None);
}

#[test]
fn every_key_of_a_decision_shares_one_hash_tag() {
    let secret = crate::digest::Secret::default();
    let redis_key = |service, rule, key: &[u8]| super::redis_key(&secret, service, rule, key);
    let k = redis_key("shop", "login", b"10.0.0.1");
    // The client's part is a digest: one size, and no brace of a client's moves the tag.
    assert_eq!(k.len(), "{shop:login:}".len() + 33);
    assert!(k.starts_with(b"{shop:login:") && k.ends_with(b"}"));
    let braced = redis_key("shop", "login", b"}x{y}");
    assert_eq!(braced.iter().filter(|b| **b == b'}').count(), 1);
    assert_ne!(redis_key("shop", "login", &[b'a'; 10_000]), k);
    // Redis Cluster hashes what is between the first '{' and the next '}': the whole name.
    let tag = |k: &[u8]| {
        let open = k.iter().position(|b| *b == b'{').unwrap();
        let close = open + 1 + k[open + 1..].iter().position(|b| *b == b'}').unwrap();
        k[open + 1..close].to_vec()
    };
    let mut log = k.clone();
    log.extend_from_slice(b":log");
    let mut seq = k.clone();
    seq.extend_from_slice(b":seq");
    assert_eq!(tag(&log), tag(&seq));
    assert_eq!(tag(&log), &k[1..k.len() - 1]);
}
