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
        sketch: None,
        hosts: 0,
        jump: 0.0,
        own: None,
    }
}

pub(super) fn report(source: &str, entries: Vec<Entry>) -> Report {
    Report {
        version: VERSION,
        source: source.into(),
        zone: "z".into(),
        interval_ms: 1000,
        seq: 0,
        last: false,
        entries,
        instance: None,
    }
}

fn key<'a>(view: &'a [KeyView], k: &str) -> &'a KeyView {
    view.iter().find(|v| v.key.as_deref() == Some(k)).unwrap()
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
    let mut acc = Accumulator::new(1.0);
    acc.record(&report("a", vec![entry(Some("k"), 90, 90)]), "t", 0.0)
        .unwrap();
    acc.record(&report("b", vec![entry(Some("k"), 30, 30)]), "t", 0.0)
        .unwrap();
    let both = vec![entry(Some("k"), 30, 30), entry(Some("j"), 10, 10)];
    acc.record(&report("c", both), "t", 0.0).unwrap();
    let view = acc.view(None, 0.0);
    let k = key(&view, "k");
    assert_eq!(k.offered_rps, 150.0);
    assert_eq!(k.sources, 3);
    assert!((k.ratio - 1.0 / 3.0).abs() < 1e-12);
    assert_eq!(key(&view, "j").ratio, 0.0, "keys are limited independently");
    let ratios = acc.ratios(Some(&["svc"]), 0.0);
    assert_eq!(ratios.len(), 1, "only non-zero ratios travel");
    assert!(acc.ratios(Some(&["other-service"]), 0.0).is_empty());
    assert_eq!(acc.ratios(None, 0.0).len(), 1);
}

#[test]
fn a_new_report_replaces_its_sources_values_and_the_sum_is_smoothed_over_time() {
    let mut acc = Accumulator::new(1.0);
    acc.record(&report("a", vec![entry(Some("k"), 100, 100)]), "t", 0.0)
        .unwrap();
    for t in 1..=4 {
        acc.record(
            &report("a", vec![entry(Some("k"), 300, 100)]),
            "t",
            f64::from(t),
        )
        .unwrap();
    }
    // Held at 300 since t = 1: 300 - 200 e^-3 at t = 4, within 5 % of 300.
    let v = &acc.view(None, 4.0)[0];
    assert!((v.offered_rps - (300.0 - 200.0 * (-3.0f64).exp())).abs() < 1e-9);
    assert_eq!(v.sources, 1, "one source, however many reports");
    // A key missing from the source's next report no longer counts for it.
    acc.record(&report("a", vec![entry(Some("j"), 10, 10)]), "t", 5.0)
        .unwrap();
    let v = acc.view(None, 5.0);
    assert_eq!(key(&v, "k").sources, 0);
    assert!(key(&v, "k").offered_rps < 300.0);
}

/// A restarted controller hears its sources one by one (and a source whose first report
/// comes after a key's first interval is smoothed in), so that smoothed from there its sums
/// would climb toward the fleet's load for seconds after the warm-up: the fleet over-admits
/// just after a controller's start. While warming up, the sums are not smoothed, so the
/// first authoritative ones hold every source whole.
#[test]
fn a_warming_controllers_first_sums_hold_every_source_whole() {
    let offered = |settle: bool| {
        let mut acc = Accumulator::new(1.0);
        acc.settle(settle);
        for (t, source, n) in [(0.0, "a", 100), (1.0, "a", 100), (1.5, "b", 200)] {
            let mut r = report(source, vec![entry(Some("k"), n, n)]);
            r.seq = (t * 2.0) as u64;
            acc.record(&r, "t", t).unwrap();
        }
        // Warmed up: smoothing goes on from here.
        acc.settle(false);
        key(&acc.view(None, 2.0), "k").offered_rps
    };
    assert_eq!(offered(true), 300.0);
    assert!(
        offered(false) < 270.0,
        "smoothed from the first source's sum alone"
    );
}

/// Zones forward at their own times: a new key's sum starts from every source that reports
/// it within the first one's interval, not from the first zone's part alone (smoothed from
/// there, the fleet would over-admit the key for seconds); a source reporting again in that
/// time is counted once.
#[test]
fn a_new_keys_sum_starts_from_every_zone_that_reports_it_within_its_first_interval() {
    let mut acc = Accumulator::new(1.0);
    for (t, source, n) in [
        (0.0, "a", 480),
        (0.001, "b", 160),
        (0.3, "a", 480),
        (0.4, "c", 80),
    ] {
        let mut r = report(source, vec![entry(Some("k"), n, n)]);
        r.interval_ms = 500;
        r.seq = (t * 1000.0) as u64;
        acc.record(&r, "t", t).unwrap();
    }
    let offered = key(&acc.view(None, 0.5), "k").offered_rps;
    assert!((offered - 1440.0).abs() < 1e-9, "{offered}");
    // A source that joins later is smoothed in as before.
    let mut r = report("d", vec![entry(Some("k"), 100, 100)]);
    r.interval_ms = 500;
    acc.record(&r, "t", 0.6).unwrap();
    let offered = key(&acc.view(None, 0.6), "k").offered_rps;
    assert!(offered < 1500.0, "{offered}");
}

#[test]
fn a_tail_first_named_empty_starts_from_its_first_sum() {
    // A proxy's announce names its rule's tail with nothing counted; its first report, an
    // interval later, is the tail's first sum, and the sum starts there (not at 0, climbing
    // while the fleet under-drops).
    let mut acc = Accumulator::new(1.0);
    acc.record(&report("a", vec![entry(None, 0, 0)]), "t", 0.0)
        .unwrap();
    let mut first = report("a", vec![entry(None, 300, 100)]);
    first.seq = 1;
    acc.record(&first, "t", 1.0).unwrap();
    let v = acc.view(None, 1.0);
    assert_eq!(v[0].offered_rps, 300.0, "{v:?}");
}

#[test]
fn replicas_sharing_a_zones_hosts_in_turn_add_up_to_the_zone() {
    // One host at 300/s reporting every second, its reports landing on replica A and B in
    // turn; each replica forwards what it got every second, half a second apart.
    let mut a = ZoneSums::new(0.0, 1000);
    let mut b = ZoneSums::new(0.0, 1000);
    let mut acc = Accumulator::new(1.0);
    let mut sent = 0;
    let mut forwarded = 0;
    let mut samples = Vec::new();
    for tick in 0..400 {
        let t = f64::from(tick) * 0.1;
        if tick % 10 == 3 {
            let mut r = report("host", vec![entry(Some("k"), 300, 100)]);
            r.seq = tick as u64 + 1;
            let to = if (tick / 10) % 2 == 0 { &mut a } else { &mut b };
            to.record(r, "t", t).unwrap();
            sent += 300;
        }
        for (name, z, phase) in [("zone:z/a", &mut a, 0), ("zone:z/b", &mut b, 5)] {
            if tick % 10 == phase && tick > 0 {
                let (entries, ms) = z.take(t, false);
                forwarded += entries.iter().map(|e| e.offered).sum::<u64>();
                let mut r = report(name, entries);
                r.interval_ms = ms;
                acc.record(&r, "t", t).unwrap();
            }
        }
        if t >= 10.0 {
            samples.push(acc.view(None, t)[0].offered_rps);
        }
    }
    let last: u64 = [&mut a, &mut b]
        .into_iter()
        // After the last report's interval: all of it.
        .map(|z| z.take(41.0, false).0.iter().map(|e| e.offered).sum::<u64>())
        .sum();
    assert_eq!(
        forwarded + last,
        sent,
        "every host interval is forwarded exactly once"
    );
    let mean = samples.iter().sum::<f64>() / samples.len() as f64;
    assert!((mean - 300.0).abs() < 0.02 * 300.0, "mean {mean}");
    // Per-source smoothing would have counted the host in both replicas: about 600.
    assert!(
        samples.iter().all(|s| (150.0..450.0).contains(s)),
        "{samples:?}"
    );
}

#[test]
fn a_zones_steps_are_taken_apart_from_its_units_and_only_for_keys_it_knows() {
    let mut z = ZoneSums::new(0.0, 1000);
    let stepped = |seq, k: &str, jump| {
        let mut e = entry(Some(k), 100, 100);
        e.jump = jump;
        let mut r = report("host", vec![e]);
        r.seq = seq;
        r
    };
    z.record(stepped(1, "k", 0.0), "t", 0.0).unwrap();
    assert_eq!(z.take_steps(|_, _, _| true), Some(Vec::new()), "no step");
    z.record(stepped(2, "k", 40.0), "t", 0.5).unwrap();
    let takes = z.takes();
    // A key the caller does not know: nothing taken, the step waits for the next take.
    assert_eq!(z.take_steps(|_, _, k| k != "k"), None);
    assert_eq!(z.takes(), takes);
    let steps = z.take_steps(|_, _, _| true).expect("known");
    assert_eq!(steps.len(), 1);
    assert_eq!((&*steps[0].2, steps[0].3), ("k", 40.0));
    assert_eq!(
        z.takes(),
        takes + 1,
        "a report recorded before is in this take"
    );
    assert_eq!(z.take_steps(|_, _, _| true), Some(Vec::new()), "taken once");
    // The units are all still there for the window's take (the first report's whole second,
    // which the second report brought in early, and half the second's), its step gone with
    // the early one.
    let (entries, _) = z.take(1.0, false);
    assert_eq!(entries.iter().map(|e| e.offered).sum::<u64>(), 150);
    assert!(entries.iter().all(|e| e.jump == 0.0), "{entries:?}");
}

#[test]
fn a_silent_sources_values_stand_for_two_intervals_and_it_is_forgotten_after_three() {
    let mut acc = Accumulator::new(1.0);
    acc.record(&report("a", vec![entry(Some("k"), 100, 100)]), "t", 0.0)
        .unwrap();
    acc.record(&report("b", vec![entry(Some("k"), 100, 100)]), "t", 1.5)
        .unwrap();
    acc.sweep(2.1);
    assert_eq!(acc.view(None, 2.1)[0].sources, 1, "a's values are gone");
    assert_eq!(acc.sources(), 2, "a is still known");
    acc.sweep(3.2);
    assert_eq!(acc.sources(), 1);
    assert_eq!(acc.tracked(), 1);
    acc.sweep(20.0);
    assert_eq!(acc.tracked(), 0);
    assert_eq!(
        acc.view(None, 20.0).len(),
        1,
        "kept while its history matters"
    );
    // Watched (at its limit) until WATCH_FOR after it was last that heavy.
    acc.sweep(23.1);
    assert_eq!(acc.view(None, 23.1).len(), 1, "still watched");
    let gone = 23.1 + crate::control::sum::WATCH_FOR;
    acc.sweep(gone);
    assert!(acc.view(None, gone).is_empty(), "the faded key is dropped");
}

#[test]
fn disagreeing_limits_take_the_smallest_and_count_a_conflict() {
    let mut acc = Accumulator::new(1.0);
    acc.record(&report("a", vec![entry(Some("k"), 100, 100)]), "t", 0.0)
        .unwrap();
    let mut e = entry(Some("k"), 100, 100);
    e.limit.count = 50;
    acc.record(&report("b", vec![e]), "t", 0.0).unwrap();
    assert_eq!(acc.conflicts, 1);
    assert_eq!(acc.view(None, 0.0)[0].limit_rps, 50.0);
    // When b's values lapse, a's limit applies again.
    acc.record(&report("a", vec![entry(Some("k"), 100, 100)]), "t", 5.0)
        .unwrap();
    acc.sweep(5.0);
    assert_eq!(acc.view(None, 5.0)[0].limit_rps, 100.0);
}

#[test]
fn the_folded_tail_is_limited_as_many_keys() {
    let mut acc = Accumulator::new(1.0);
    let mut other = entry(None, 250, 250);
    other.keys_folded = 2;
    acc.record(&report("a", vec![other]), "t", 0.0).unwrap();
    let v = &acc.view(None, 0.0)[0];
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
    r.source = "x".repeat(MAX_SOURCE + 1);
    assert_eq!(r.validate(), Err(ReportError::Name));
    let mut r = ok.clone();
    r.zone = "x".repeat(MAX_ZONE + 1);
    assert_eq!(r.validate(), Err(ReportError::Name));
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
fn an_oversized_key_drops_its_entry_not_the_report() {
    let long = "k".repeat(MAX_KEY + 1);
    let mut r = report(
        "a",
        vec![entry(Some(&long), 10, 10), entry(Some("fine"), 10, 10)],
    );
    assert_eq!(r.drop_invalid(), 1);
    assert_eq!(r.entries.len(), 1);
    assert_eq!(r.entries[0].key.as_deref(), Some("fine"));
}

#[test]
fn a_flood_of_sources_and_keys_is_bounded_and_counted() {
    // Every fake host with a token of its own: the overall bound still holds.
    let mut acc = Accumulator::bounded(1.0, 3);
    for i in 0..10 {
        let mut e = entry(Some(&format!("k{i}")), 1, 1);
        e.service = format!("service-{i}");
        let r = report(&format!("fake-{i}"), vec![e]);
        acc.record(&r, &format!("owner-{i}"), 0.0).unwrap();
    }
    assert_eq!(acc.view(None, 0.0).len(), 3);
    assert_eq!(acc.refused, 7);
    // A source already holding values keeps updating them at the bound.
    let mut e = entry(Some("k0"), 50, 50);
    e.service = "service-0".into();
    acc.record(&report("fake-0", vec![e]), "owner-0", 1.0)
        .unwrap();
    assert_eq!(acc.refused, 7);
    // Once the flood goes silent, room frees up.
    acc.sweep(10.0);
    acc.record(&report("real", vec![entry(Some("k"), 1, 1)]), "t", 10.0)
        .unwrap();
    assert_eq!(acc.tracked(), 1);
}

#[test]
fn one_source_holds_a_bounded_number_of_key_bytes() {
    let mut acc = Accumulator::new(1.0);
    let key = "k".repeat(1000);
    let entries: Vec<Entry> = (0..5000)
        .map(|i| entry(Some(&format!("{key}{i}")), 1, 1))
        .collect();
    acc.record(&report("big", entries), "t", 0.0).unwrap();
    let kept = acc.tracked();
    assert!(kept * 1000 <= sum::MAX_HELD_BYTES, "{kept}");
    assert_eq!(acc.refused as usize, 5000 - kept);
}

#[test]
fn an_absurd_rate_is_refused_not_clamped() {
    let mut r = report("h", vec![entry(Some("k"), 20_000_000_000, 0)]);
    r.interval_ms = 100; // 2 * 10^10 in 100 ms: 2 * 10^11 units/s
    assert!(matches!(r.validate(), Err(ReportError::Entry(0, _))));
    r.interval_ms = 1000;
    assert!(r.validate().is_ok());
}

#[test]
fn a_report_already_counted_is_not_counted_again() {
    let mut zone = ZoneSums::new(0.0, 100);
    let mut r = report("h", vec![entry(Some("k"), 10, 10)]);
    r.seq = 7;
    zone.record(r.clone(), "t", 0.0).unwrap();
    assert_eq!(
        zone.record(r.clone(), "t", 0.1),
        Err(SourceRefusal::Duplicate(7))
    );
    r.seq = 6;
    assert_eq!(
        zone.record(r.clone(), "t", 0.2),
        Err(SourceRefusal::Duplicate(6))
    );
    assert_eq!(zone.refusals().2, 2);
    r.seq = 8;
    zone.record(r.clone(), "t", 0.3).unwrap();
    // Each report's units over its own interval: all of both by the end of the second one.
    let (entries, _) = zone.take(1.3, false);
    assert_eq!(entries[0].offered, 20);
}

#[test]
fn a_source_reporting_faster_than_its_interval_is_refused_past_three_in_a_row() {
    let mut zone = ZoneSums::new(0.0, 100);
    let mut seq = 0;
    let mut send = |zone: &mut ZoneSums, at: f64, interval_ms: u64, last: bool| {
        seq += 1;
        let mut r = report("h", vec![entry(Some("k"), 10, 10)]);
        r.seq = seq;
        r.last = last;
        r.interval_ms = interval_ms;
        zone.record(r, "t", at)
    };
    // On time, then a late reply's report and the next on time back to back: all taken.
    for at in [0.0, 1.0, 2.9, 3.0, 4.0] {
        assert!(send(&mut zone, at, 1000, false).is_ok(), "at {at}");
    }
    // Ten a second: past the third in a row, refused until the interval has caught up.
    let refused = (0..10)
        .filter(|i| send(&mut zone, 4.1 + f64::from(*i) / 10.0, 1000, false).is_err())
        .count();
    assert_eq!(refused, 8);
    assert_eq!(zone.refusals_too_soon(), 8);
    // A stopping source's last report is taken however soon, once; not every one so marked.
    assert!(send(&mut zone, 5.05, 1000, true).is_ok());
    assert!(send(&mut zone, 5.06, 1000, true).is_err());
}

#[test]
fn a_host_replacing_its_keys_every_report_adds_no_more_pending_keys_than_the_room() {
    // Room for 20: ten reports of ten new keys each in one forward's window would leave 100
    // keys pending; past 20 their units go to the tail, and no unit is lost.
    let mut zone = ZoneSums::new(0.0, 20);
    for i in 0..10u32 {
        let keys = (0..10)
            .map(|k| entry(Some(&format!("k{i}-{k}")), 10, 10))
            .collect();
        let mut r = report("h", keys);
        r.seq = u64::from(i) + 1;
        r.interval_ms = 100;
        zone.record(r, "t", f64::from(i) / 10.0).unwrap();
    }
    // Another service's host, in the same window, still finds room for its keys.
    let mut other = entry(Some("theirs"), 10, 10);
    other.service = "books".into();
    let mut theirs = report("b", vec![other]);
    theirs.interval_ms = 100;
    zone.record(theirs, "u", 0.9).unwrap();
    let (entries, _) = zone.take(1.0, false);
    let named = |service: &str| {
        entries
            .iter()
            .filter(|e| e.key.is_some() && e.service == service)
            .count()
    };
    assert!(named("svc") <= 10, "{} keys forwarded", named("svc"));
    assert_eq!(named("books"), 1);
    let offered: u64 = entries
        .iter()
        .filter(|e| e.service == "svc")
        .map(|e| e.offered)
        .sum();
    assert_eq!(offered, 1000);
}

#[test]
fn a_live_hosts_name_and_sequence_numbers_stay_with_the_process_reporting_under_it() {
    let mut zone = ZoneSums::new(0.0, 100);
    let from = |instance: Option<u64>, seq: u64| {
        let mut r = report("shop-0", vec![entry(Some("k"), 10, 10)]);
        r.seq = seq;
        r.instance = instance;
        r
    };
    zone.record(from(Some(1), 10), "t", 0.0).unwrap();
    // Another process with the same token: neither its report nor a huge seq takes the name.
    for (instance, seq) in [(Some(2), 11), (Some(2), u64::MAX), (None, u64::MAX)] {
        assert_eq!(
            zone.record(from(instance, seq), "t", 0.5),
            Err(SourceRefusal::Held),
            "{instance:?} {seq}"
        );
    }
    // The owner's next report is counted as ever.
    zone.record(from(Some(1), 11), "t", 1.0).unwrap();
    // Silent for more than an interval (a restart): the name goes to the new process, whose
    // sequence numbers start afresh.
    zone.record(from(Some(3), 5), "t", 2.1).unwrap();
    assert_eq!(
        zone.record(from(Some(1), 12), "t", 2.5),
        Err(SourceRefusal::Held)
    );
    // A sender that says it stops frees the name at once.
    let mut last = from(Some(3), 6);
    last.last = true;
    zone.record(last, "t", 3.0).unwrap();
    zone.record(from(Some(4), 1), "t", 3.1).unwrap();
}

#[test]
fn a_forward_names_at_most_the_heaviest_keys_of_a_service_and_folds_the_rest_into_the_tail() {
    use super::zone::FORWARD_KEYS_PER_SERVICE;
    let n = FORWARD_KEYS_PER_SERVICE + 50;
    let mut zone = ZoneSums::new(0.0, 4 * n);
    // Key i offered 2 + i: the lightest 50 are folded.
    let keys = (0..n)
        .map(|i| entry(Some(&format!("k{i}")), 2 + i as u64, 1))
        .collect();
    let mut r = report("h", keys);
    r.interval_ms = 100;
    zone.record(r, "t", 0.0).unwrap();
    let (entries, _) = zone.take(0.1, false);
    let named: Vec<&Entry> = entries.iter().filter(|e| e.key.is_some()).collect();
    assert_eq!(named.len(), FORWARD_KEYS_PER_SERVICE);
    assert!(!named.iter().any(|e| e.key.as_deref() == Some("k0")));
    let tail = entries.iter().find(|e| e.key.is_none()).unwrap();
    assert_eq!(tail.keys_folded, 50);
    let d = crate::limit::Distinct::decode(tail.sketch.as_deref().unwrap()).unwrap();
    assert!((d.count() - 50.0).abs() < 5.0, "{}", d.count());
    let offered: u64 = entries.iter().map(|e| e.offered).sum();
    assert_eq!(offered, (0..n as u64).map(|i| 2 + i).sum::<u64>());
}

#[test]
fn a_report_stating_a_long_interval_is_not_held_against_the_next_on_time() {
    // A sender whose previous reply timed out states the 5 s since its last report, then goes
    // on every second: the long interval says what it covers, not when the next may come.
    let mut zone = ZoneSums::new(0.0, 100);
    for (seq, (at, ms)) in [(0.0, 1000), (5.0, 5000), (6.0, 1000), (7.0, 1000)]
        .into_iter()
        .enumerate()
    {
        let mut r = report("h", vec![entry(Some("k"), 10, 10)]);
        r.seq = seq as u64 + 1;
        r.interval_ms = ms;
        assert!(zone.record(r, "t", at).is_ok(), "at {at}");
    }
    // Nor a restart that reports every 100 ms from then on, under the same name.
    for i in 0..30 {
        let mut r = report("h", vec![entry(Some("k"), 1, 1)]);
        r.seq = 100 + i;
        r.interval_ms = 100;
        let at = 7.5 + f64::from(i as u32) / 10.0;
        assert!(zone.record(r, "t", at).is_ok(), "report {i}");
    }
}

#[test]
fn an_owner_at_its_source_cap_has_its_idle_sources_evicted_before_newcomers_wait_long() {
    use super::sources::MAX_SOURCES_PER_OWNER;
    let mut zone = ZoneSums::new(0.0, 100);
    let with_minute = |name: &str| {
        let mut r = report(name, vec![]);
        r.interval_ms = 60_000;
        r
    };
    // The owner's cap reached within 50 s, at the most new sources a second.
    let per_sec = NEW_SOURCES_PER_SEC as usize;
    for i in 0..MAX_SOURCES_PER_OWNER {
        let at = (i / per_sec) as f64;
        zone.record(with_minute(&format!("h-{i}")), "t", at)
            .unwrap();
    }
    let newcomer = with_minute("new");
    assert_eq!(
        zone.record(newcomer.clone(), "t", 170.0),
        Err(SourceRefusal::Flood)
    );
    // Two minutes silent is idle for a full owner (not yet forgotten otherwise: three
    // minutes), so the next sweep makes room; the one that kept reporting stays.
    zone.record(with_minute("h-0"), "t", 160.0).unwrap();
    zone.take(175.0, false);
    assert_eq!(zone.hosts(), 1);
    assert!(zone.record(newcomer, "t", 175.5).is_ok());
}

#[test]
fn a_flood_of_new_hosts_is_throttled_per_second_and_known_hosts_still_report() {
    let mut zone = ZoneSums::new(0.0, 100);
    let known = report("known", vec![entry(Some("k"), 10, 10)]);
    assert!(zone.record(known.clone(), "t", 0.5).is_ok());
    for i in 1..NEW_SOURCES_PER_SEC {
        let r = report(&format!("fake-{i}"), vec![]);
        assert!(zone.record(r.clone(), "t", 0.6).is_ok(), "source {i}");
    }
    let one_more = report("fake-x", vec![]);
    assert_eq!(
        zone.record(one_more.clone(), "t", 0.7),
        Err(SourceRefusal::Flood)
    );
    assert_eq!(zone.refusals().0, 1);
    assert!(
        zone.record(known.clone(), "t", 0.8).is_ok(),
        "a known host is not new"
    );
    assert!(
        zone.record(one_more.clone(), "t", 1.1).is_ok(),
        "the next second has room again"
    );
    // Silent hosts are forgotten.
    zone.take(100.0, false);
    assert_eq!(zone.hosts(), 0);
}

#[test]
fn a_host_cannot_report_for_another_service_but_an_aggregator_can() {
    let mut acc = Accumulator::new(1.0);
    let mut own = entry(Some("k"), 10, 10);
    own.service = "shop".into();
    let mut other = entry(Some("k"), 1_000_000, 0);
    other.service = "payments".into();
    acc.record(&report("pod-a", vec![own.clone()]), "t", 1.0)
        .unwrap();
    let refused = acc.record(&report("pod-a", vec![own.clone(), other.clone()]), "t", 1.5);
    assert_eq!(
        refused,
        Err(SourceRefusal::Foreign(
            "pod-a".into(),
            "payments".into(),
            "shop".into()
        ))
    );
    assert_eq!(acc.refusals().1, 1);
    let zone = report("zone:eu-1/a", vec![own, other]);
    assert!(acc.record(&zone, "t", 1.5).is_ok());
    assert!(
        acc.record(&zone, "t", 2.0).is_ok(),
        "zones carry every service of their hosts"
    );
}

#[test]
fn a_source_that_went_silent_and_returns_takes_its_old_values_out_first() {
    // The review's attack: a 100 ms source reports, is silent past three intervals but not yet
    // swept, and reports again: its first values must not stay in the sums for ever.
    let mut acc = Accumulator::new(1.0);
    let mut r = report("h", vec![entry(Some("k"), 10_000, 0)]);
    r.interval_ms = 100;
    acc.record(&r, "t", 0.0).unwrap();
    acc.record(&r, "t", 0.35).unwrap();
    assert_eq!(acc.tracked(), 1);
    assert_eq!(acc.view(None, 0.35)[0].sources, 1);
    acc.sweep(10.0);
    assert_eq!(acc.tracked(), 0, "nothing left behind");
}

#[test]
fn one_service_cannot_take_all_the_room_or_all_the_new_sources() {
    let mut acc = Accumulator::bounded(1.0, 20);
    let of = |service: &str, i: usize| {
        let mut e = entry(Some(&format!("k{i}")), 1, 1);
        e.service = service.into();
        e
    };
    // Through its own hosts and through a zone's sums alike: a quarter of the room at most.
    for i in 0..10 {
        acc.record(&report(&format!("a-{i}"), vec![of("a", i)]), "a", 0.0)
            .unwrap();
    }
    let zone = report("zone:z/r", (10..20).map(|i| of("a", i)).collect());
    acc.record(&zone, "_zones", 0.0).unwrap();
    assert_eq!(acc.tracked(), 5, "a service holds at most a quarter");
    acc.record(&report("b-0", vec![of("b", 0)]), "b", 0.0)
        .unwrap();
    assert_eq!(acc.tracked(), 6, "another service still finds room");
    let mut zone = ZoneSums::new(0.0, 100);
    for i in 0..NEW_SOURCES_PER_SEC {
        zone.record(report(&format!("a-{i}"), vec![]), "a", 0.5)
            .unwrap();
    }
    let more = report("a-x", vec![]);
    assert_eq!(
        zone.record(more.clone(), "a", 0.6),
        Err(SourceRefusal::Flood)
    );
    assert!(
        zone.record(report("b-1", vec![]), "b", 0.6).is_ok(),
        "b's hosts are not crowded out"
    );
}

#[test]
fn a_report_alternating_limits_for_one_rule_costs_one_conflict_each_not_a_walk() {
    let mut acc = Accumulator::new(1.0);
    for i in 0..50 {
        acc.record(
            &report(&format!("s{i}"), vec![entry(Some("k"), 1, 1)]),
            "t",
            0.0,
        )
        .unwrap();
    }
    let entries: Vec<Entry> = (0..1000)
        .map(|i| {
            let mut e = entry(Some(&format!("k{i}")), 1, 1);
            e.limit.count = 100 + (i % 2);
            e
        })
        .collect();
    let before = acc.conflicts;
    acc.record(&report("x", entries), "t", 0.0).unwrap();
    assert_eq!(
        acc.conflicts - before,
        500,
        "the first limit stands, each other one counts"
    );
    assert_eq!(acc.view(None, 0.0)[0].limit_rps, 100.0);
}

#[test]
fn a_host_naming_too_many_services_is_refused() {
    let entries: Vec<Entry> = (0..=MAX_HOST_SERVICES)
        .map(|i| {
            let mut e = entry(Some("k"), 1, 1);
            e.service = format!("s{i}");
            e
        })
        .collect();
    assert_eq!(
        report("h", entries.clone()).validate(),
        Err(ReportError::Services)
    );
    assert!(
        report("zone:z/r", entries).validate().is_ok(),
        "zone sums carry many"
    );
}

#[test]
fn a_senders_last_report_stands_for_what_it_covers_and_one_interval_more() {
    // A replica forwarding every second stops 0.3 s after its last forward: its last one
    // covers the 0.3 s left of its hosts' intervals. The units of the time after reach the
    // controller in another replica's forward only at the end of that one's interval: held
    // for the 0.3 s alone, the zone went uncounted for a second (a rolling restart's worst second);
    // for two intervals, counted twice for one.
    let mut acc = Accumulator::new(1.0);
    let mut r = report("zone:z/old", vec![entry(Some("k"), 100, 100)]);
    acc.record(&r, "t", 0.0).unwrap();
    r.last = true;
    r.seq = 2;
    r.interval_ms = 300;
    r.entries = vec![entry(Some("k"), 30, 30)];
    acc.record(&r, "t", 0.3).unwrap();
    acc.sweep(1.35);
    assert_eq!(acc.tracked(), 1, "what it covers, and an interval more");
    let view = acc.view(None, 1.35);
    assert!(
        (key(&view, "k").offered_rps - 100.0).abs() < 1.0,
        "at its rate: {view:?}"
    );
    // Sweeps come with records: one just before its end (1.6) takes it away, or it would
    // stand to the next record, an interval late, beside its successor's forward.
    acc.sweep(1.5);
    assert_eq!(
        acc.tracked(),
        0,
        "and then it is gone: a stopped replica is not counted on"
    );
}

#[test]
fn a_report_alternating_rules_entry_by_entry_holds_each_once() {
    // Every entry its own group: each group's room grows with it, not with the report.
    let mut acc = Accumulator::new(1.0);
    let entries: Vec<Entry> = (0..20_000)
        .map(|i| {
            let mut e = entry(Some(&format!("k{i}")), 1, 1);
            e.rule = format!("r{}", i % 2);
            e
        })
        .collect();
    acc.record(&report("h", entries), "t", 0.0).unwrap();
    assert_eq!(acc.tracked(), 20_000);
    assert_eq!(acc.view(None, 0.0).len(), 20_000);
}

/// A tail of `offered` units/s folding the keys `keys` (a sketch), limit 5/s.
fn tail(keys: std::ops::Range<u32>, offered: u64, sketch: bool) -> Entry {
    let mut e = entry(None, offered, offered);
    e.limit = Limit {
        count: 5,
        period_ms: 1000,
    };
    e.keys_folded = u64::from(keys.end - keys.start);
    if sketch {
        let mut d = crate::limit::Distinct::default();
        for k in keys {
            d.insert(format!("client-{k}").as_bytes());
        }
        e.sketch = Some(d.encode());
    }
    e
}

fn tail_ratio(acc: &mut Accumulator, now: f64) -> f64 {
    acc.view(None, now)
        .iter()
        .find(|v| v.key.is_none())
        .unwrap()
        .ratio
}

#[test]
fn the_tails_allowance_is_the_fleets_distinct_tail_keys_not_one_sources() {
    // Three proxies each fold 30 clients of their own at 3/s (60 % of 5/s): 270/s in the
    // tail against 90 x 5/s.
    let mut acc = Accumulator::new(1.0);
    for (i, src) in ["a", "b", "c"].iter().enumerate() {
        let i = i as u32;
        acc.record(
            &report(src, vec![tail(i * 30..i * 30 + 30, 90, true)]),
            "t",
            0.0,
        )
        .unwrap();
    }
    assert_eq!(tail_ratio(&mut acc, 0.0), 0.0);
    // Version 1 counts (the most one source folded, 30 x 5/s) would drop 44 %.
    let mut v1 = Accumulator::new(1.0);
    for (i, src) in ["a", "b", "c"].iter().enumerate() {
        let i = i as u32;
        v1.record(
            &report(src, vec![tail(i * 30..i * 30 + 30, 90, false)]),
            "t",
            0.0,
        )
        .unwrap();
    }
    assert!((tail_ratio(&mut v1, 0.0) - (270.0 - 150.0) / 270.0).abs() < 1e-9);
    // The same 30 keys folded on all three proxies are 30 keys, not 90.
    let mut same = Accumulator::new(1.0);
    for src in ["a", "b", "c"] {
        same.record(&report(src, vec![tail(0..30, 90, true)]), "t", 0.0)
            .unwrap();
    }
    let r = tail_ratio(&mut same, 0.0);
    assert!((r - (270.0 - 150.0) / 270.0).abs() < 0.05, "{r}");
}

#[test]
fn a_key_heavy_enough_to_watch_travels_with_how_far_under_its_limit_it_is() {
    let mut acc = Accumulator::new(1.0);
    // Limit 100/s over four hosts (a zone's sums say three, a host one): name above 12.5/s,
    // watch from half the limit (what four hosts folding a key can hide of it is under 50/s).
    let mut zone = vec![
        entry(Some("watched"), 60, 60),
        entry(Some("named"), 40, 40),
        entry(Some("quiet"), 5, 5),
    ];
    zone[0].hosts = 3;
    acc.record(&report("zone:z/r", zone), "zones", 0.0).unwrap();
    acc.record(&report("h", vec![entry(Some("over"), 150, 150)]), "t", 0.0)
        .unwrap();
    let reply = acc.reply(Some(&["svc"]), 0.0);
    let ratio = |k: &str| {
        reply
            .ratios
            .iter()
            .find(|r| r.key.as_deref() == Some(k))
            .map(|r| r.ratio)
    };
    // Under its limit, a watched key's ratio is below 0: (offered - limit) / offered, so
    // that a proxy knows the share of the fleet's load the limit allows (100 / 60).
    let watched = ratio("watched").expect("past 50/s: watched");
    assert!((watched - (60.0 - 100.0) / 60.0).abs() < 1e-9, "{watched}");
    assert_eq!(
        ratio("named"),
        None,
        "named, but under half the limit: not sent"
    );
    assert_eq!(ratio("quiet"), None, "under: not sent");
    assert!(ratio("over").unwrap() > 0.0);
    assert_eq!(reply.rules.len(), 1);
    assert_eq!(reply.rules[0].name_above, 100.0 / 8.0);
    assert_eq!(reply.rules[0].cut_below, None);
}

#[test]
fn behind_an_aggregator_that_relays_no_hints_every_key_past_name_above_is_watched() {
    // Limit 100/s; a host names "seen" at 40/s. A zone's sums that do not say their hosts
    // come from a previous release's aggregator, whose proxies never learn name_above and
    // fold what is past their top_k: the rest of "seen" may hide there, so it is watched
    // from name_above (25/s over two reporters), not from half the limit.
    let watched = |zone_says_hosts: bool| {
        let mut acc = Accumulator::new(1.0);
        let mut zone = vec![entry(Some("other"), 10, 10)];
        if zone_says_hosts {
            zone[0].hosts = 1;
        }
        acc.record(&report("zone:z/r", zone), "zones", 0.0).unwrap();
        acc.record(&report("h", vec![entry(Some("seen"), 40, 40)]), "t", 0.0)
            .unwrap();
        let reply = acc.reply(Some(&["svc"]), 0.0);
        assert_eq!(reply.rules[0].name_above, 25.0);
        reply
            .ratios
            .iter()
            .any(|r| r.key.as_deref() == Some("seen"))
    };
    assert!(watched(false), "zone of a previous release: watched");
    assert!(
        !watched(true),
        "every proxy names past 25/s: not watched under 50/s"
    );
}

#[test]
fn a_key_first_seen_in_a_short_report_is_judged_by_what_its_count_can_show() {
    // Reports every 250 ms. A key's first count is all its history: one request in 250 ms
    // is what a client at 1/s sends as often as not, and no evidence of 4/s against a
    // limit of 2/s (nor are two); three, and 75 against 100/s (300/s), are, and are dropped
    // from at once.
    let first = |limit: u64, n: u64| {
        let mut acc = Accumulator::new(1.0);
        let mut e = entry(Some("k"), n, n);
        e.limit.count = limit;
        let mut r = report("h", vec![e]);
        r.interval_ms = 250;
        acc.record(&r, "t", 0.0).unwrap();
        acc.ratios(Some(&["svc"]), 0.0)
            .iter()
            .find(|r| r.key.as_deref() == Some("k"))
            .map_or(0.0, |r| r.ratio)
    };
    assert_eq!(first(2, 1), 0.0, "one request");
    assert_eq!(first(2, 2), 0.0, "two requests");
    assert_eq!(first(2, 3), 1.0 - 2.0 / 12.0, "three requests: past chance");
    let heavy = first(100, 75);
    assert!(
        (0.5..=2.0 / 3.0).contains(&heavy),
        "300/s against 100/s from its first report: {heavy}"
    );
}

#[test]
fn a_zone_forward_without_a_rule_does_not_forget_what_the_zone_said_of_it() {
    // A previous release's aggregator forwards only what came since its last forward: with
    // hosts reporting less often than it forwards, every other forward carries nothing of the
    // rule. Its statement (a zone that relays no hints, one host) stands until it lapses, so
    // "seen" stays watched from name_above (25/s over two reporters): were the zone forgotten
    // between its forwards, the rule would look as if every proxy named past 50/s, and a
    // reply built then would not watch "seen", which the zone's proxies then keep folding.
    let mut acc = Accumulator::new(1.0);
    let mut zone = report("zone:z/r", vec![entry(Some("other"), 10, 10)]);
    zone.interval_ms = 100;
    zone.seq = 1;
    acc.record(&zone, "zones", 0.0).unwrap();
    acc.record(&report("h", vec![entry(Some("seen"), 40, 40)]), "t", 0.0)
        .unwrap();
    zone.entries.clear();
    zone.seq = 2;
    acc.record(&zone, "zones", 0.1).unwrap();
    let watched = |acc: &mut Accumulator, now: f64| {
        let reply = acc.reply(Some(&["svc"]), now);
        let seen = reply
            .ratios
            .iter()
            .any(|r| r.key.as_deref() == Some("seen"));
        (reply.rules[0].name_above, seen)
    };
    assert_eq!(watched(&mut acc, 0.15), (25.0, true), "between forwards");
    // A zone that has said nothing of the rule for longer than it holds values no longer
    // counts there: every reporter left names past name_above.
    zone.seq = 3;
    acc.record(&zone, "zones", 0.4).unwrap();
    // ("seen" stays watched a while, as any key once heavy enough: see WATCH_FOR.)
    assert_eq!(
        watched(&mut acc, 0.45),
        (50.0, true),
        "the zone's statement lapsed"
    );
}

#[test]
fn in_a_fleet_of_thousands_of_hosts_a_reply_carries_only_keys_near_their_limit() {
    let mut acc = Accumulator::new(1.0);
    // 2 000 hosts of one rule at 100/s (reporting every 10 s, arriving 500 a second, as
    // the new-source guard lets them): name_above is 0.025/s, so every host names its key at
    // 1/s; one key is at 60/s across 60 hosts.
    for h in 0..2000 {
        let mut keys = vec![entry(Some(&format!("k{h}")), 10, 10)];
        if h < 60 {
            keys.push(entry(Some("busy"), 10, 10));
        }
        let mut r = report(&format!("h{h}"), keys);
        r.interval_ms = 10_000;
        acc.record(&r, "t", f64::from(h) * 0.002).unwrap();
    }
    let reply = acc.reply(Some(&["svc"]), 4.5);
    assert_eq!(reply.rules[0].name_above, 100.0 / 4000.0);
    let named: Vec<_> = reply
        .ratios
        .iter()
        .filter_map(|r| r.key.as_deref())
        .collect();
    assert_eq!(
        named,
        ["busy"],
        "only the key past half its limit is watched"
    );
}

#[test]
fn a_cut_reply_says_the_most_any_ratio_left_out_was_and_keeps_the_tail() {
    let mut acc = Accumulator::new(1.0);
    let n = super::sum::MAX_RATIOS_PER_SERVICE + 50;
    // Key i offers 101 + i against 100: the lowest ratios are cut.
    let entries: Vec<Entry> = (0..n)
        .map(|i| entry(Some(&format!("k{i}")), 101 + i as u64, 0))
        .chain([entry(None, 1, 0)])
        .collect();
    acc.record(&report("h", entries), "t", 0.0).unwrap();
    let reply = acc.reply(Some(&["svc"]), 0.0);
    assert_eq!(reply.ratios.len(), super::sum::MAX_RATIOS_PER_SERVICE);
    let cut = reply.rules[0].cut_below.expect("cut");
    let lowest_sent = reply
        .ratios
        .iter()
        .filter(|r| r.key.is_some())
        .map(|r| r.ratio)
        .fold(f64::INFINITY, f64::min);
    assert!(cut <= lowest_sent && cut > 0.0, "{cut} {lowest_sent}");
    assert!(
        (cut - drop_ratio(101.0 + 50.0, 100.0)).abs() < 1e-2,
        "the 51st lowest: {cut}"
    );
    // A version-1 reader gets the same ratios and no hints.
    let mut v1 = reply.clone();
    v1.downgrade();
    assert!(v1.rules.is_empty());
    assert!(!serde_json::to_string(&v1).unwrap().contains("rules"));
}

#[test]
fn hosts_reporting_every_250ms_1s_and_5s_are_forwarded_at_their_rates() {
    // Three hosts at 100/s each behind one replica forwarding every second.
    let mut zone = ZoneSums::new(0.0, 1000);
    let hosts = [("fast", 250u64), ("steady", 1000), ("slow", 5000)];
    let mut seq = 0;
    let mut windows = Vec::new();
    for tick in 1..=600u64 {
        // 50 ms ticks.
        let now = tick as f64 / 20.0;
        for (name, every) in hosts {
            if (tick * 50) % every == 0 {
                seq += 1;
                let mut r = report(name, vec![entry(Some("k"), 100 * every / 1000, 0)]);
                r.interval_ms = every;
                r.seq = seq;
                zone.record(r, "t", now).unwrap();
            }
        }
        if tick % 20 == 10 {
            let (entries, ms) = zone.take(now, false);
            let sum: u64 = entries.iter().map(|e| e.offered).sum();
            windows.push((now, sum as f64 * 1000.0 / ms as f64));
            if let Some(e) = entries.first() {
                let reported = hosts.iter().filter(|h| now * 1000.0 >= h.1 as f64).count();
                assert_eq!(e.hosts as usize, reported, "at {now}");
            }
        }
    }
    // Once the slow host has reported, every 1 s window carries 300/s within a unit or two.
    for (at, rate) in windows.iter().filter(|(at, _)| *at > 6.0) {
        assert!((rate - 300.0).abs() <= 2.0, "{rate}/s forwarded at {at}");
    }
}

#[test]
fn a_zones_tail_carries_the_union_of_its_hosts_sketches() {
    let mut zone = ZoneSums::new(0.0, 1000);
    for (i, host) in ["a", "b"].iter().enumerate() {
        let i = i as u32;
        let r = report(host, vec![tail(i * 20..i * 20 + 40, 10, true)]);
        zone.record(r, "t", 0.0).unwrap();
    }
    let (entries, _) = zone.take(1.0, false);
    let tail = entries.iter().find(|e| e.key.is_none()).unwrap();
    let d = crate::limit::Distinct::decode(tail.sketch.as_deref().unwrap()).unwrap();
    assert!((d.count() - 60.0).abs() < 4.0, "{}", d.count());
    assert_eq!(tail.offered, 20);
    assert!(Report {
        entries: entries.clone(),
        ..report("zone:z/r", vec![])
    }
    .validate()
    .is_ok());
}

#[test]
fn only_a_zones_sums_may_say_they_stand_for_many_hosts() {
    let mut acc = Accumulator::new(1.0);
    let mut e = entry(Some("k"), 10, 10);
    e.hosts = 1_000;
    acc.record(&report("pod-a", vec![e.clone()]), "t", 0.0)
        .unwrap();
    let reply = acc.reply(Some(&["svc"]), 0.0);
    assert_eq!(reply.rules[0].name_above, 100.0 / 2.0, "one host");
    acc.record(&report("zone:z/r", vec![e]), "zones", 0.0)
        .unwrap();
    let reply = acc.reply(Some(&["svc"]), 0.0);
    assert_eq!(reply.rules[0].name_above, 100.0 / (2.0 * 1001.0));
}

#[test]
fn a_stopping_replica_hands_over_all_its_hosts_reports_hold() {
    let mut zone = ZoneSums::new(0.0, 1000);
    let mut r = report("slow", vec![entry(Some("k"), 500, 500)]);
    r.interval_ms = 5000;
    zone.record(r, "t", 0.0).unwrap();
    let (first, _) = zone.take(1.0, false);
    assert_eq!(first[0].offered, 100, "one second of five");
    let (last, ms) = zone.take(1.5, true);
    assert_eq!(last[0].offered, 400, "the rest, at once");
    // Over the time it covers, to the end of the host's interval: at the host's rate (100/s),
    // not 400 units over the half second since the last take (800/s, which the controller
    // would hold as the zone's rate while the host's next report lands on another replica).
    assert_eq!(ms, 4000);
    assert!(zone.take(10.0, false).0.is_empty());
}

#[test]
fn a_sketch_is_charged_against_the_replicas_room_as_its_bytes_are() {
    // Room for 30 entries: a plain entry and a sketched tail (1 + 21) fit, a second tail not.
    let mut zone = ZoneSums::new(0.0, 60);
    let r = report(
        "h",
        vec![
            entry(Some("k"), 1, 1),
            tail(0..5, 1, true),
            tail(5..9, 1, true),
        ],
    );
    zone.record(r, "t", 0.0).unwrap();
    assert_eq!(zone.refused, 1);
}

#[test]
fn a_long_key_is_charged_against_the_replicas_room_as_its_bytes_are() {
    // Room for 20 entries (10 per owner): a 640-byte key takes 10 of them, so a second one
    // and any more of the same owner's keys find none, while another owner's still do.
    let mut zone = ZoneSums::new(0.0, 20);
    let long = "k".repeat(640);
    let r = report(
        "h",
        vec![
            entry(Some(&long), 1, 1),
            entry(Some(&format!("{long}2")), 1, 1),
            entry(Some("k"), 1, 1),
        ],
    );
    zone.record(r, "t", 0.0).unwrap();
    assert_eq!(zone.refused, 2);
    zone.record(report("other", vec![entry(Some("k"), 1, 1)]), "u", 0.0)
        .unwrap();
    assert_eq!(zone.refused, 2);
}

#[test]
fn a_stopping_senders_last_report_counts_no_more_than_it_was_sending() {
    // A previous release's aggregator hands over the rest of its hosts' intervals in its last
    // forward, over the half second since its previous one: 400 units in 500 ms.
    let mut acc = Accumulator::new(1.0);
    acc.record(
        &report("zone:z/old", vec![entry(Some("k"), 100, 100)]),
        "t",
        0.0,
    )
    .unwrap();
    let mut last = report("zone:z/old", vec![entry(Some("k"), 400, 100)]);
    last.interval_ms = 500;
    last.last = true;
    last.seq = 1;
    acc.record(&last, "t", 0.5).unwrap();
    // Held for its half second: the sum stays at 100/s, where 800/s would have pulled it to
    // about 330/s by then.
    let view = acc.view(None, 0.9);
    assert!(
        (key(&view, "k").offered_rps - 100.0).abs() < 1e-6,
        "{view:?}"
    );
    // Another sender's ordinary report is taken as it says.
    let mut more = report("zone:z/other", vec![entry(Some("k"), 400, 100)]);
    more.interval_ms = 500;
    acc.record(&more, "t", 0.9).unwrap();
    let view = acc.view(None, 1.0);
    assert!(key(&view, "k").offered_rps > 150.0, "{view:?}");
}

#[test]
fn state_readers_share_one_walk_per_snapshot_and_see_each_rules_heaviest_keys() {
    let mut acc = Accumulator::new(1.0);
    let entries: Vec<Entry> = (0..5_000u64)
        .map(|i| entry(Some(&format!("k{i}")), i + 1, 1))
        .collect();
    acc.record(&report("h", entries), "t", 0.0).unwrap();
    let first = acc.state(0.0);
    let again = acc.state(0.0);
    assert!(
        std::sync::Arc::ptr_eq(&first.rules, &again.rules),
        "a second read walked the keys again"
    );
    let rule = &first.rules[0];
    assert_eq!(
        (rule.keys, rule.heaviest.len()),
        (5_000, super::sum::STATE_KEYS)
    );
    assert_eq!(rule.heaviest[0].key.as_deref(), Some("k4999"));
    assert!(rule
        .heaviest
        .windows(2)
        .all(|w| w[0].offered_rps >= w[1].offered_rps));
    // The totals are every key's, not the shown ones'.
    let all: f64 = acc.view(None, 0.0).iter().map(|v| v.offered_rps).sum();
    assert!((rule.offered_rps - all).abs() < 1e-6 * all);
    assert_eq!(first.sources.len(), 1);
    // A later snapshot, a new walk.
    assert!(!std::sync::Arc::ptr_eq(&acc.state(5.0).rules, &first.rules));
}

/// A host at 100/s, then `jump` in its report at 10 s (its rate 300/s): the controller's
/// smoothed sum of the key 0.5 s later.
fn smoothed_after_a_step(jump: f64) -> f64 {
    let mut acc = Accumulator::new(1.0);
    for t in 0..10 {
        let mut r = report("a", vec![entry(Some("k"), 100, 100)]);
        r.seq = t + 1;
        acc.record(&r, "t", t as f64).unwrap();
    }
    let mut stepped = entry(Some("k"), 300, 100);
    stepped.jump = jump;
    let mut r = report("a", vec![stepped]);
    r.seq = 11;
    acc.record(&r, "t", 10.0).unwrap();
    acc.view(None, 10.5)[0].offered_rps
}

#[test]
fn a_senders_step_moves_the_smoothed_sum_at_once_and_holds_it_for_the_senders_interval() {
    // Smoothed, a step from 100/s to 300/s is a third of the way there after 0.5 s...
    let smoothed = smoothed_after_a_step(0.0);
    assert!(
        (smoothed - (300.0 - 200.0 * (-0.5f64).exp())).abs() < 1e-6,
        "{smoothed}"
    );
    // ...and all of it when the sender says it stepped, its own smoothed rate with it, and
    // there it stands (not pulled toward a zone's half-old sum) for the sender's interval.
    assert_eq!(smoothed_after_a_step(200.0), 300.0);
}

/// `host`'s report number `seq` at `at` of key "k": (offered, admitted) and a step of `jump`.
fn stepped(acc: &mut Accumulator, host: &str, counts: (u64, u64), jump: f64, seq: u64, at: f64) {
    let mut e = entry(Some("k"), counts.0, counts.1);
    e.jump = jump;
    let mut r = report(host, vec![e]);
    r.seq = seq;
    acc.record(&r, "t", at).unwrap();
}

/// Hosts "a" and "b" each report `counts` (offered, admitted) of key "k" once a second for
/// five seconds, from 0: a steady sum to step from.
fn two_steady_hosts(acc: &mut Accumulator, counts: (u64, u64)) {
    for t in 0..5 {
        stepped(acc, "a", counts, 0.0, t + 1, t as f64);
        stepped(acc, "b", counts, 0.0, t + 1, t as f64);
    }
}

#[test]
fn a_step_down_moves_the_sum_only_as_far_as_it_matches_a_step_up() {
    // Two hosts at 100/s; one steps up by 200/s while the other steps down by 100/s, half a
    // second apart (load moving between them, and more of it): the sum moves by the net.
    let mut acc = Accumulator::new(1.0);
    let send = |acc: &mut Accumulator, host: &str, offered: u64, jump: f64, seq: u64, at: f64| {
        stepped(acc, host, (offered, offered), jump, seq, at)
    };
    two_steady_hosts(&mut acc, (100, 100));
    send(&mut acc, "b", 10, -100.0, 6, 5.0);
    assert!(
        acc.view(None, 5.1)[0].offered_rps > 190.0,
        "a step down alone is left to smoothing (a burst's end keeps its ratio a while)"
    );
    let before = acc.view(None, 5.5)[0].offered_rps;
    send(&mut acc, "a", 300, 200.0, 6, 5.5);
    let after = acc.view(None, 5.5)[0].offered_rps;
    assert!(
        (after - before - 100.0).abs() < 1e-9,
        "200 up, 100 of it matched: {before} -> {after}"
    );
    // From there the held sum (310, more than the smoothed one) pulls it the step's way.
    assert!(acc.view(None, 5.6)[0].offered_rps > after);
    // An unmatched step down: smoothing alone, never below nothing.
    let mut acc = Accumulator::new(1.0);
    send(&mut acc, "a", 100, 0.0, 1, 0.0);
    send(&mut acc, "a", 10, -500.0, 2, 1.0);
    let v = acc.view(None, 1.5)[0].offered_rps;
    assert!((v - (10.0 + 90.0 * (-0.5f64).exp())).abs() < 1e-6, "{v}");
}

#[test]
fn a_step_down_that_leaves_a_key_far_over_its_limit_moves_the_sum_at_once() {
    // Two hosts at 10 000/s of a key limited to 100/s; one's load falls by half (a closed
    // loop's clients on a busy machine) and it says so. The key is still limited hard: no
    // burst's ratio to keep, and each proxy's allowance pairs its own rate, which stepped,
    // with the sum. Left to smoothing, the sum would stand near 20 000 for a second, and
    // every proxy's allowance a quarter short.
    let mut acc = Accumulator::new(1.0);
    let send = |acc: &mut Accumulator, host: &str, offered: u64, jump: f64, seq: u64, at: f64| {
        stepped(acc, host, (offered, 50), jump, seq, at)
    };
    two_steady_hosts(&mut acc, (10_000, 50));
    send(&mut acc, "b", 5_000, -5_000.0, 6, 5.0);
    let v = acc.view(None, 5.1)[0].offered_rps;
    assert!((v - 15_000.0).abs() < 1e-6, "{v}");
    send(&mut acc, "a", 10, -9_990.0, 6, 5.5);
    let v = acc.view(None, 5.6)[0].offered_rps;
    assert!((v - 5_010.0).abs() < 1e-6, "{v}");
    // Past twice its limit the rest of a step down is left to smoothing (a burst's end keeps
    // its ratio a while): the sum stops at twice the limit, and smoothing goes on from there.
    send(&mut acc, "b", 10, -4_990.0, 7, 6.0);
    let v = acc.view(None, 6.0)[0].offered_rps;
    assert!((v - 200.0).abs() < 1e-6, "{v}");
    let v = acc.view(None, 6.5)[0].offered_rps;
    assert!((v - (20.0 + 180.0 * (-0.5f64).exp())).abs() < 1e-6, "{v}");
}

#[test]
fn after_a_senders_step_the_others_rates_go_on_moving_the_sum_the_steps_way() {
    // Two hosts at 1 000/s. One doubles, its zone's forward holding half a window of it (1 500
    // counted): the sum steps to 3 000 and is not pulled back toward the 2 500 held.
    let mut acc = Accumulator::new(1.0);
    two_steady_hosts(&mut acc, (1_000, 1_000));
    stepped(&mut acc, "a", (1_500, 1_000), 1_000.0, 6, 5.0);
    let v = acc.view(None, 5.5)[0].offered_rps;
    assert!((v - 3_000.0).abs() < 1e-6, "{v}");
    // The other's rate rises meanwhile without a step of its own (what its proxy's smoothed
    // rate follows): the sum follows it, from where it stands.
    stepped(&mut acc, "b", (2_000, 1_000), 0.0, 6, 5.5);
    let v = acc.view(None, 5.9)[0].offered_rps;
    let toward = 3_000.0 + 500.0 * (1.0 - (-0.4f64).exp());
    assert!((v - toward).abs() < 1e-6, "{v} against {toward}");
    // Once the step's interval is over, the held sum pulls either way.
    stepped(&mut acc, "b", (500, 500), 0.0, 7, 6.0);
    let (at, v) = (
        acc.view(None, 6.0)[0].offered_rps,
        acc.view(None, 6.5)[0].offered_rps,
    );
    assert!(v < at, "{at} -> {v}");
}

#[test]
fn steps_both_ways_within_a_senders_interval_hold_the_sum_where_they_left_it() {
    // Two hosts at 10 000/s: one steps up by 10 000, the other down by 4 000 (matched by the
    // first's jump: load moving), each zone's forward holding half a window of its step.
    let mut acc = Accumulator::new(1.0);
    two_steady_hosts(&mut acc, (10_000, 50));
    stepped(&mut acc, "a", (15_000, 50), 10_000.0, 6, 5.0);
    stepped(&mut acc, "b", (8_000, 50), -4_000.0, 6, 5.2);
    let at = acc.view(None, 5.2)[0].offered_rps;
    assert!((at - 26_000.0).abs() < 1e-6, "{at}");
    // Moved both ways: the held 23 000 pulls neither way until the last step's window closes.
    let v = acc.view(None, 6.1)[0].offered_rps;
    assert!((v - at).abs() < 1e-6, "{v}");
    let v = acc.view(None, 6.5)[0].offered_rps;
    assert!(v < at - 100.0, "{v}");
}

#[test]
fn a_step_is_a_named_keys_finite_rate_and_no_version_1_reader_sees_one() {
    let mut r = report("a", vec![entry(Some("k"), 10, 10), entry(None, 5, 5)]);
    r.entries[0].jump = 1e12;
    assert!(r.validate().is_err(), "past 10^11/s");
    r.entries[0].jump = f64::NAN;
    assert!(r.validate().is_err());
    r.entries[0].jump = -10.0;
    assert_eq!(r.validate(), Ok(()));
    r.entries[1].jump = 1.0;
    assert!(
        r.validate().is_err(),
        "the tail has no one key's rate to step"
    );
    r.entries[1].jump = 0.0;
    let json = serde_json::to_string(&r).unwrap();
    assert!(json.contains("\"jump\":-10.0"), "{json}");
    r.downgrade();
    let json = serde_json::to_string(&r).unwrap();
    assert!(!json.contains("jump"), "{json}");
}

#[test]
fn a_zone_forwards_each_hosts_step_once_with_the_keys_next_units() {
    // Two hosts behind one replica forwarding every second; each steps once.
    let mut zone = ZoneSums::new(0.0, 1000);
    let step = |name: &str, offered: u64, jump: f64, seq: u64| {
        let mut e = entry(Some("k"), offered, offered);
        e.jump = jump;
        let mut r = report(name, vec![e]);
        r.seq = seq;
        r
    };
    zone.record(step("a", 100, 0.0, 1), "t", 0.0).unwrap();
    zone.record(step("b", 50, 0.0, 1), "t", 0.0).unwrap();
    zone.record(step("a", 300, 200.0, 2), "t", 1.0).unwrap();
    zone.record(step("b", 10, -40.0, 2), "t", 1.2).unwrap();
    let (entries, _) = zone.take(1.5, false);
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0].jump, 160.0, "both hosts' steps, added");
    // A host's next report (no step) and the next forward: no step again.
    zone.record(step("a", 300, 0.0, 3), "t", 2.0).unwrap();
    let (entries, _) = zone.take(2.5, false);
    assert_eq!(entries[0].jump, 0.0, "each step forwarded once");
}

#[test]
fn a_keys_own_limit_is_the_smallest_its_senders_state_and_a_raise_waits_for_all() {
    let own = |per_sec: u64| {
        let mut e = entry(Some("vip"), 300, 300);
        e.own = Some(Limit {
            count: per_sec,
            period_ms: 1000,
        });
        e
    };
    let mut acc = Accumulator::new(0.0);
    // One proxy raised vip to 400/s; the other still states the rule's 100/s.
    acc.record(&report("a", vec![own(400)]), "t", 0.0).unwrap();
    acc.record(&report("b", vec![entry(Some("vip"), 300, 300)]), "t", 0.0)
        .unwrap();
    let v = acc.view(None, 0.0);
    assert_eq!(key(&v, "vip").limit_rps, 100.0, "not every proxy reloaded");
    assert!((key(&v, "vip").ratio - (600.0 - 100.0) / 600.0).abs() < 1e-9);
    // Both state the raise: 600/s offered against 400/s.
    acc.record(&report("a", vec![own(400)]), "t", 1.0).unwrap();
    acc.record(&report("b", vec![own(400)]), "t", 1.0).unwrap();
    let v = acc.view(None, 1.0);
    assert_eq!(key(&v, "vip").limit_rps, 400.0);
    assert!((key(&v, "vip").ratio - (600.0 - 400.0) / 600.0).abs() < 1e-9);
    // A cut applies as soon as one proxy states it.
    acc.record(&report("a", vec![own(50)]), "t", 2.0).unwrap();
    assert_eq!(key(&acc.view(None, 2.0), "vip").limit_rps, 50.0);
}

#[test]
fn a_zone_relays_the_smallest_own_limit_its_hosts_state() {
    let mut z = ZoneSums::new(0.0, 1000);
    let host = |name: &str, own: Option<u64>| {
        let mut e = entry(Some("vip"), 100, 100);
        e.own = own.map(|count| Limit {
            count,
            period_ms: 1000,
        });
        (report(name, vec![e]), name.to_string())
    };
    for (r, owner) in [host("h1", Some(400)), host("h2", None)] {
        z.record(r, &owner, 0.0).unwrap();
    }
    let (out, _) = z.take(1.0, false);
    let vip = out
        .iter()
        .find(|e| e.key.as_deref() == Some("vip"))
        .unwrap();
    assert_eq!(vip.own.map(|l| l.count), Some(100), "h2 states the rule's");
    for (r, owner) in [host("h1", Some(400)), host("h2", Some(300))] {
        z.record(r, &owner, 1.0).unwrap();
    }
    let (out, _) = z.take(2.0, false);
    let vip = out
        .iter()
        .find(|e| e.key.as_deref() == Some("vip"))
        .unwrap();
    assert_eq!(vip.own.map(|l| l.count), Some(300));
    // No host states one: none relayed.
    for (r, owner) in [host("h1", None), host("h2", None)] {
        z.record(r, &owner, 2.0).unwrap();
    }
    let (out, _) = z.take(3.0, false);
    let vip = out
        .iter()
        .find(|e| e.key.as_deref() == Some("vip"))
        .unwrap();
    assert_eq!(vip.own, None);
}

#[test]
fn an_own_limit_that_is_no_limit_or_not_a_named_keys_is_refused() {
    for (key, count, period_ms) in [
        (Some("vip"), 0, 1000),
        (Some("vip"), 5, 0),
        (Some("vip"), 5, 86_400_000 * 366),
        (None, 5, 1000),
    ] {
        let mut e = entry(key, 1, 1);
        e.own = Some(Limit { count, period_ms });
        let r = report("a", vec![e]);
        assert!(
            matches!(r.validate(), Err(ReportError::Entry(0, _))),
            "{key:?} {count}/{period_ms}ms"
        );
    }
    let mut e = entry(Some("vip"), 1, 1);
    e.own = Some(Limit {
        count: 5,
        period_ms: 1000,
    });
    assert_eq!(report("a", vec![e]).validate(), Ok(()));
}
