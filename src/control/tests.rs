use super::*;

fn entry(key: Option<&str>, offered: u64, admitted: u64) -> Entry {
    Entry {
        service: "svc".into(),
        rule: "r".into(),
        limit: Limit {
            count: 100,
            period_ms: 1000,
        },
        key: key.map(String::from),
        keys_folded: 0,
        offered,
        admitted,
    }
}

fn report(source: &str, entries: Vec<Entry>) -> Report {
    Report {
        version: VERSION,
        source: source.into(),
        zone: "z".into(),
        interval_ms: 1000,
        entries,
    }
}

#[test]
fn a_fleet_at_one_and_a_half_times_its_limit_drops_one_third() {
    assert!((drop_ratio(150.0, 100.0) - 1.0 / 3.0).abs() < 1e-12);
    assert_eq!(drop_ratio(100.0, 100.0), 0.0);
    assert_eq!(drop_ratio(50.0, 100.0), 0.0);
    assert_eq!(drop_ratio(0.0, 100.0), 0.0);
    assert_eq!(drop_ratio(f64::NAN, 100.0), 0.0);
    assert!((drop_ratio(1000.0, 100.0) - 0.9).abs() < 1e-12);
}

#[test]
fn rates_from_several_sources_sum_per_key() {
    let mut acc = Accumulator::default();
    acc.add(&report("a", vec![entry(Some("k"), 90, 90)]), 0.0);
    acc.add(&report("b", vec![entry(Some("k"), 30, 30)]), 0.0);
    acc.add(
        &report(
            "c",
            vec![entry(Some("k"), 30, 30), entry(Some("j"), 10, 10)],
        ),
        0.0,
    );
    let view = acc.view(None);
    let k = view.iter().find(|v| v.key.as_deref() == Some("k")).unwrap();
    assert_eq!(k.offered_rps, 150.0);
    assert_eq!(k.sources, 3);
    assert!((k.ratio - 1.0 / 3.0).abs() < 1e-12);
    let j = view.iter().find(|v| v.key.as_deref() == Some("j")).unwrap();
    assert_eq!(j.ratio, 0.0, "keys are limited independently");
    let reply = acc.reply(&["svc"]);
    assert_eq!(reply.ratios.len(), 1, "only non-zero ratios travel");
    assert!(acc.reply(&["other-service"]).ratios.is_empty());
}

#[test]
fn the_smoothed_rate_follows_a_step_within_a_few_intervals() {
    let mut acc = Accumulator::default();
    acc.add(&report("a", vec![entry(Some("k"), 100, 100)]), 0.0);
    for t in 1..=4 {
        acc.add(&report("a", vec![entry(Some("k"), 300, 100)]), f64::from(t));
    }
    let v = &acc.view(None)[0];
    // 100 -> 300: after four intervals the estimate is within 5 % of 300.
    assert!((v.offered_rps - 300.0).abs() < 15.0, "{}", v.offered_rps);
}

#[test]
fn silent_sources_are_forgotten() {
    let mut acc = Accumulator::default();
    acc.add(&report("a", vec![entry(Some("k"), 100, 100)]), 0.0);
    acc.add(&report("b", vec![entry(Some("k"), 100, 100)]), 2.5);
    // Three intervals of 1 s: a (last heard at 0) is gone at 3.5, b is not.
    acc.expire(3.5);
    let v = acc.view(None);
    assert_eq!(v[0].sources, 1);
    assert_eq!(acc.sources(), 1);
    acc.expire(10.0);
    assert!(acc.view(None).is_empty());
}

#[test]
fn disagreeing_limits_take_the_smallest_and_count_a_conflict() {
    let mut acc = Accumulator::default();
    acc.add(&report("a", vec![entry(Some("k"), 100, 100)]), 0.0);
    let mut e = entry(Some("k"), 100, 100);
    e.limit.count = 50;
    acc.add(&report("b", vec![e]), 0.0);
    assert_eq!(acc.conflicts, 1);
    assert_eq!(acc.view(None)[0].limit_rps, 50.0);
    // When b goes silent, a's limit applies again.
    acc.add(&report("a", vec![entry(Some("k"), 100, 100)]), 5.0);
    acc.expire(5.0);
    assert_eq!(acc.view(None)[0].limit_rps, 100.0);
}

#[test]
fn the_folded_tail_is_limited_as_many_keys() {
    let mut acc = Accumulator::default();
    let mut other = entry(None, 250, 250);
    other.keys_folded = 2;
    acc.add(&report("a", vec![other]), 0.0);
    let v = &acc.view(None)[0];
    assert_eq!(v.limit_rps, 200.0);
    assert!((v.ratio - 0.2).abs() < 1e-12);
}

#[test]
fn absurd_or_inconsistent_reports_are_refused() {
    let ok = report("a", vec![entry(Some("k"), 10, 5)]);
    assert_eq!(ok.validate(), Ok(()));
    let mut r = ok.clone();
    r.version = 2;
    assert_eq!(r.validate(), Err(ReportError::Version(2)));
    let mut r = ok.clone();
    r.interval_ms = 0;
    assert_eq!(r.validate(), Err(ReportError::Interval));
    let mut r = ok.clone();
    r.entries[0].admitted = 11;
    assert!(r.validate().is_err());
    let mut r = ok.clone();
    r.entries[0].offered = MAX_COUNT + 1;
    assert!(r.validate().is_err());
    let mut r = ok;
    r.entries[0].limit.count = 0;
    assert!(r.validate().is_err());
}

#[test]
fn an_aggregator_forwards_its_zone_as_one_source() {
    let mut zone = Accumulator::default();
    zone.add(&report("a", vec![entry(Some("k"), 60, 60)]), 0.0);
    zone.add(&report("b", vec![entry(Some("k"), 60, 60)]), 0.0);
    let forwarded = report("zone:z", zone.as_entries(1000));
    let mut region = Accumulator::default();
    region.add(&forwarded, 0.0);
    let v = &region.view(None)[0];
    assert_eq!((v.offered_rps, v.sources), (120.0, 1));
    assert!((v.ratio - 20.0 / 120.0).abs() < 1e-12);
}

#[test]
fn a_flood_of_sources_and_keys_is_bounded_and_counted() {
    let mut acc = Accumulator::bounded(3);
    for i in 0..10 {
        acc.add(
            &report(
                &format!("fake-{i}"),
                vec![entry(Some(&format!("k{i}")), 1, 1)],
            ),
            0.0,
        );
    }
    assert_eq!(acc.view(None).len(), 3);
    assert_eq!(acc.refused, 7);
    // Known (source, key) pairs keep updating at the bound.
    acc.add(&report("fake-0", vec![entry(Some("k0"), 50, 50)]), 1.0);
    assert_eq!(acc.refused, 7);
    // Once the flood goes silent, room frees up.
    acc.expire(10.0);
    acc.add(&report("real", vec![entry(Some("k"), 1, 1)]), 10.0);
    assert_eq!(acc.view(None).len(), 1);
}

#[test]
fn an_absurd_rate_is_refused_not_clamped() {
    let mut r = report("h", vec![entry(Some("k"), 2_000_000, 0)]);
    r.interval_ms = 10; // 2 * 10^6 in 10 ms: 2 * 10^8 requests/s
    assert!(matches!(r.validate(), Err(ReportError::Entry(0, _))));
    r.interval_ms = 1000;
    assert!(r.validate().is_ok());
}

#[test]
fn a_flood_of_new_hosts_is_throttled_per_second_and_known_hosts_still_report() {
    let mut acc = Accumulator::default();
    let known = report("known", vec![entry(Some("k"), 10, 10)]);
    assert!(acc.admit_source(&known, 0.5).is_ok());
    for i in 1..NEW_SOURCES_PER_SEC {
        let r = report(&format!("fake-{i}"), vec![]);
        assert!(acc.admit_source(&r, 0.6).is_ok(), "source {i}");
    }
    let one_more = report("fake-x", vec![]);
    assert_eq!(acc.admit_source(&one_more, 0.7), Err(SourceRefusal::Flood));
    assert_eq!(acc.throttled, 1);
    assert!(
        acc.admit_source(&known, 0.8).is_ok(),
        "a known host is not new"
    );
    assert!(
        acc.admit_source(&one_more, 1.1).is_ok(),
        "the next second has room again"
    );
    // Silent sources are forgotten with their rates.
    acc.expire(100.0);
    assert_eq!(acc.source_ages(100.0).len(), 0);
}

#[test]
fn a_host_cannot_report_for_another_service_but_an_aggregator_can() {
    let mut acc = Accumulator::default();
    let mut own = entry(Some("k"), 10, 10);
    own.service = "shop".into();
    let mut other = entry(Some("k"), 1_000_000, 0);
    other.service = "payments".into();
    assert!(acc
        .admit_source(&report("pod-a", vec![own.clone()]), 1.0)
        .is_ok());
    let refused = acc.admit_source(&report("pod-a", vec![own.clone(), other.clone()]), 1.5);
    assert_eq!(
        refused,
        Err(SourceRefusal::Foreign(
            "pod-a".into(),
            "payments".into(),
            "shop".into()
        ))
    );
    assert_eq!(acc.foreign, 1);
    let zone = report("zone:eu-1", vec![own, other]);
    assert!(acc.admit_source(&zone, 1.5).is_ok());
    assert!(
        acc.admit_source(&zone, 2.0).is_ok(),
        "zones carry every service of their hosts"
    );
}
