//! How far one aggregator core and one controller core go, with simulated hosts over real HTTP.
//!
//! `cargo bench --bench control_scale` (or `bench/scale.sh`). The server under test is the
//! release `spillway` binary pinned to CPU 0 (`taskset`); the simulated hosts are this process,
//! pinned to CPU 1: 64 concurrent senders, each report pre-built, on loopback. Measured:
//! - aggregator: host reports per second with 100 keys each (2 000 hosts over 1 000 keys);
//! - controller: host reports per second with 100 keys each from 10 000 sources of eight
//!   services, then the values it holds and its resident memory with all 10 000 x 100 live;
//! - controller: zone sums per second with 1 000 keys each (200 aggregator replicas).
//!   Each source states an interval that lets it report as often as the server takes it
//!   (a source past one report per interval is refused).
//!   Reports that the new-source guard turns away (429, 1 000 new sources a second) are
//!   retried and not counted.

use std::io::BufRead;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;

const BIN: &str = env!("CARGO_BIN_EXE_spillway");
const SENDERS: usize = 64;

struct Server {
    child: std::process::Child,
    addr: SocketAddr,
    admin: SocketAddr,
}

impl Server {
    fn start(args: &[&str]) -> Server {
        // SPILLWAY_BENCH_BIN: another build (a baseline) run through the same load.
        let bin = std::env::var("SPILLWAY_BENCH_BIN").unwrap_or_else(|_| BIN.to_string());
        let mut child = std::process::Command::new("taskset")
            .args(["-c", "0", &bin])
            .args(args)
            // A 2 000-host zone of one service (an environment variable: a baseline without
            // the flag ignores it).
            .env("SPILLWAY_MAX_ENTRIES", "400000")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("taskset (util-linux) and the release binary");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line.split("listening on ").nth(1).unwrap();
        let addr = addr.split(' ').next().unwrap().parse().unwrap();
        let admin = line.split("(admin ").nth(1).unwrap();
        let admin = admin.trim_end_matches([')', '\n']).parse().unwrap();
        Server { child, addr, admin }
    }

    /// Resident memory, MiB.
    fn rss_mib(&self) -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let kb: f64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        kb / 1024.0
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The entries of a report: `n` keys of `service` starting at key `first` of `space`, each
/// offered 120 and admitted 100 under a limit of `limit` a second.
fn entries(service: &str, n: usize, first: usize, space: usize, limit: u32) -> String {
    (0..n)
        .map(|i| {
            format!(
                r#"{{"service":"{service}","rule":"r","limit":{{"count":{limit},"period_ms":1000}},"key":"key-{}","offered":120,"admitted":100}}"#,
                (first + i * 7) % space
            )
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Sends reports from `sources` (name, entries) round-robin for `secs` after `warmup`, each
/// source's `seq` increasing; returns OK reports per second.
async fn blast(
    addr: SocketAddr,
    sources: Arc<Vec<(String, String)>>,
    interval_ms: u64,
    warmup: Duration,
    secs: Duration,
) -> f64 {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let next = Arc::new(AtomicU64::new(0));
    let ok = Arc::new(AtomicU64::new(0));
    let counting = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let started = Instant::now();
    let end = started + warmup + secs;
    let mut tasks = Vec::new();
    for _ in 0..SENDERS {
        let (client, sources, next, ok, counting) = (
            client.clone(),
            sources.clone(),
            next.clone(),
            ok.clone(),
            counting.clone(),
        );
        tasks.push(tokio::spawn(async move {
            while Instant::now() < end {
                let n = next.fetch_add(1, Ordering::Relaxed);
                // New sources come in at 900 a second (the server takes 1 000): each joins the
                // round once it may, and stays live from then on.
                let joined = (900.0 * (started.elapsed().as_secs_f64() + 1.0)) as u64;
                let (name, body) = &sources[(n % joined.min(sources.len() as u64)) as usize];
                let report = format!(
                    r#"{{"version":1,"source":"{name}","interval_ms":{interval_ms},"seq":{},"entries":[{body}]}}"#,
                    n + 1
                );
                // As this release's reporters: a warming controller (its warm-up is two of
                // the longest intervals reported) answers them, and refuses older ones 503.
                let req = http::Request::post(format!("http://{addr}/v1/report"))
                    .header("spillway-wire", "2")
                    .body(Full::new(Bytes::from(report)))
                    .unwrap();
                let Ok(resp) = client.request(req).await else {
                    continue;
                };
                let status = resp.status();
                let _ = resp.into_body().collect().await;
                if status == http::StatusCode::OK && counting.load(Ordering::Relaxed) {
                    ok.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    tokio::time::sleep(warmup).await;
    counting.store(true, Ordering::Relaxed);
    let counted = Instant::now();
    for t in tasks {
        let _ = t.await;
    }
    ok.load(Ordering::Relaxed) as f64 / counted.elapsed().as_secs_f64()
}

async fn metric(admin: SocketAddr, name: &str) -> f64 {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let resp = client
        .get(format!("http://{admin}/metrics").parse().unwrap())
        .await
        .unwrap();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8_lossy(&body)
        .lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(f64::NAN)
}

fn main() -> anyhow::Result<()> {
    // This process (the simulated hosts) on CPU 1; the server under test on CPU 0.
    // SAFETY: a zeroed cpu_set_t is an empty set; the calls read it and this thread's id.
    #[allow(unsafe_code)]
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(1, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let loopback = ["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"];
        println!("| server (one core) | load | per second | held | resident memory |");
        println!("|---|---|---|---|---|");

        let ctl = Server::start(&[&["controller"][..], &loopback].concat());
        let url = format!("http://{}", ctl.addr);
        let agg = Server::start(
            &[
                &["aggregator", "--controller", &url, "--zone", "z", "--interval", "1s"][..],
                &loopback,
            ]
            .concat(),
        );
        let hosts: Vec<(String, String)> = (0..2000)
            .map(|i| (format!("host-{i}"), entries("svc", 100, i, 1000, 100)))
            .collect();
        // Each host at most four reports a second (its interval), as the server allows.
        let rate = blast(
            agg.addr,
            Arc::new(hosts),
            250,
            Duration::from_secs(3),
            Duration::from_secs(10),
        )
        .await;
        println!(
            "| aggregator | host reports, 100 keys each, 2 000 hosts | {rate:.0} reports | - | {:.0} MiB |",
            agg.rss_mib()
        );
        drop(agg);
        drop(ctl);

        let ctl = Server::start(&[&["controller"][..], &loopback].concat());
        let idle = ctl.rss_mib();
        let sources: Vec<(String, String)> = (0..10_000)
            // Eight services: one service may hold only a quarter of the controller's room.
            .map(|i| {
                let service = format!("svc-{}", i % 8);
                (format!("host-{i}"), entries(&service, 100, i * 100, 1_000_000, 1000))
            })
            .collect();
        // One second keeps all 10 000 live while they are sent round-robin (each about once a
        // second, a report past one per second refused); each key (one source's) stays under
        // its limit, as the 600 s interval kept it before: over it, every reply carries the
        // service's ratios and the row measures replies.
        let rate = blast(
            ctl.addr,
            Arc::new(sources),
            1000,
            Duration::from_secs(12),
            Duration::from_secs(10),
        )
        .await;
        let held = metric(ctl.admin, "spillway_controller_tracked").await;
        let n = metric(ctl.admin, "spillway_controller_sources").await;
        println!(
            "| controller | host reports, 100 keys each, {n:.0} sources | {rate:.0} reports | {held:.0} values | {:.0} MiB ({idle:.0} MiB idle) |",
            ctl.rss_mib()
        );
        drop(ctl);

        let ctl = Server::start(&[&["controller"][..], &loopback].concat());
        // 200 replicas forwarding up to ten times a second each: a source reports at most once
        // per its interval.
        let zones: Vec<(String, String)> = (0..200)
            .map(|i| {
                let source = format!("zone:z{}/r{i}", i / 2);
                (source, entries("svc", 1000, i * 1000, 20_000, 100))
            })
            .collect();
        let rate = blast(
            ctl.addr,
            Arc::new(zones),
            100,
            Duration::from_secs(2),
            Duration::from_secs(10),
        )
        .await;
        let held = metric(ctl.admin, "spillway_controller_tracked").await;
        println!(
            "| controller | zone sums, 1 000 keys each, 200 replicas | {rate:.0} sums | {held:.0} values | {:.0} MiB |",
            ctl.rss_mib()
        );
        Ok(())
    })
}
