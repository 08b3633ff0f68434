//! `spillway tune`: limits derived from history, and shadow rules promoted when safe.
//!
//! Uber keeps its limits fresh by setting them from weeks of observed peaks plus a margin, and
//! runs every new limit in shadow first. This reads that history from Prometheus (the
//! `spillway_requests_total` the proxies export), proposes per rule `peak x (1 + margin)`, and
//! writes a config whose changed rules are in `mode: shadow`; `--promote` later switches the
//! shadow rules whose would-be rejections stayed under a threshold to `mode: enforce`.
//!
//! Demand is offered requests: allowed + rejected + shadow_rejected, so limiting does not hide
//! it. Only the config's service is read: the `spillway_service` label, which any pod can
//! export, and `--namespace`, a target label Prometheus sets and no pod can (unless a scrape
//! job honours scraped labels; `--selector` narrows further). A local rule's peak is the busiest replica's, a global or redis rule's the fleet's.
//! History is per rule (metrics never carry keys), so proposals are made for rules with one
//! bucket (`key: []`); keyed rules are listed as skipped, with their rule-wide peak. The config
//! is edited as text (comments and layout survive) and the result is validated before it is
//! written. Must never: raise a limit without saying so, raise one more than tenfold without
//! `--allow-raise`, or propose from too little history.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use http::Uri;
use http_body_util::{BodyExt, Limited};

use crate::config::{format_duration, Config, Limit, Mode, Scope};

/// What `tune` and `--promote` read and how they judge it (also the command line's flags).
#[derive(Debug, Clone, clap::Args)]
pub struct Options {
    /// Prometheus's HTTP API, http://host:port or https://host:port.
    #[arg(long, env = "SPILLWAY_PROMETHEUS")]
    pub prometheus: String,
    /// With https://: a PEM file of the CA that signed Prometheus's certificate (default: the
    /// system's trust store).
    #[arg(long)]
    pub ca_file: Option<std::path::PathBuf>,
    /// A file holding a bearer token to send to Prometheus (or the proxy in front of it).
    #[arg(long)]
    pub bearer_token_file: Option<std::path::PathBuf>,
    /// The namespace the service's sidecars run in: matched on Prometheus's `namespace`
    /// target label, which a pod cannot set (so another team's pod exporting this service's
    /// name is not read). Required, unless --all-namespaces.
    #[arg(long, env = "SPILLWAY_NAMESPACE", required_unless_present = "all_namespaces", value_parser = parse_namespace)]
    pub namespace: Option<String>,
    /// Read the service's series from every namespace (a Prometheus without a namespace
    /// label); any pod exporting the service's name then counts. Wins over --namespace (and
    /// SPILLWAY_NAMESPACE).
    #[arg(long)]
    pub all_namespaces: bool,
    /// More label matchers for every series read, e.g. `cluster="eu-1"` (the config's
    /// service is always matched, by the `spillway_service` label).
    #[arg(long)]
    pub selector: Option<String>,
    /// Propose a limit more than ten times the current one (refused otherwise: a history that
    /// high is more likely forged or broken than real).
    #[arg(long)]
    pub allow_raise: bool,
    #[arg(long, default_value = "28d", value_parser = crate::config::parse_duration)]
    pub lookback: Duration,
    /// Proposed limit = observed peak x (1 + margin).
    #[arg(long, default_value = "25%", value_parser = parse_fraction)]
    pub margin: f64,
    /// The peak: the highest rate seen, or its 99th percentile (ignores rare spikes).
    #[arg(long, default_value = "max")]
    pub quantile: Quantile,
    /// No proposal for a rule with less history than this.
    #[arg(long, default_value = "7d", value_parser = crate::config::parse_duration)]
    pub min_history: Duration,
    /// Rate window and subquery step.
    #[arg(long, default_value = "5m", value_parser = crate::config::parse_duration)]
    pub step: Duration,
    /// --promote: the largest would-be rejection ratio a shadow rule may have had.
    #[arg(long, default_value = "1%", value_parser = parse_fraction)]
    pub threshold: f64,
}

/// The statistic of the offered rate over the lookback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quantile {
    Max,
    P99,
}

impl std::str::FromStr for Quantile {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "max" => Ok(Quantile::Max),
            "p99" => Ok(Quantile::P99),
            _ => Err(format!("{s:?}: expected max or p99")),
        }
    }
}

/// A Kubernetes namespace name: a DNS label.
pub fn parse_namespace(s: &str) -> Result<String, String> {
    let label = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-';
    let ok = (1..=63).contains(&s.len())
        && s.bytes().all(label)
        && !s.starts_with('-')
        && !s.ends_with('-');
    match ok {
        true => Ok(s.to_string()),
        false => Err(format!(
            "{s:?}: not a namespace name (lower-case letters, digits and '-', at most 63)"
        )),
    }
}

/// `25%` or `0.25`.
pub fn parse_fraction(s: &str) -> Result<f64, String> {
    let v = match s.strip_suffix('%') {
        Some(p) => p.trim().parse::<f64>().map(|v| v / 100.0),
        None => s.trim().parse::<f64>(),
    }
    .map_err(|_| format!("{s:?}: expected a percentage such as 25% or a fraction such as 0.25"))?;
    if !(0.0..=10.0).contains(&v) {
        return Err(format!("{s:?}: out of range"));
    }
    Ok(v)
}

/// One row of the `tune` table.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub rule: String,
    pub current: String,
    /// Offered requests per second at the chosen quantile; `None` when there was no data.
    pub peak: Option<f64>,
    /// Whether the peak is the busiest replica's (a local rule) rather than the fleet's.
    pub per_replica: bool,
    pub history: Duration,
    pub proposal: Proposal,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Proposal {
    /// A new rate (same period as the current one), and whether it raises the limit.
    Set {
        rate: String,
        raises: bool,
        change: f64,
    },
    Unchanged,
    Skipped(String),
}

/// The result of `tune`.
#[derive(Debug, Clone)]
pub struct Tuned {
    pub rows: Vec<Row>,
    /// The config with the proposals applied and their rules in shadow mode.
    pub text: String,
}

/// The most a proposal may multiply a limit by without `--allow-raise`.
const MAX_RAISE: u64 = 10;

/// Reads the history of every rule of `path` and proposes limits.
pub async fn tune(path: &Path, opts: &Options) -> Result<Tuned, String> {
    let (mut text, config) = load(path)?;
    let prom = Prometheus::new(opts)?;
    let sel = selector(&config, opts);
    let window = format!(
        "{}:{}",
        prom_duration(opts.lookback),
        prom_duration(opts.step)
    );
    let stat = |offered: String| match opts.quantile {
        Quantile::Max => format!("max_over_time(({offered})[{window}])"),
        Quantile::P99 => format!("quantile_over_time(0.99, ({offered})[{window}])"),
    };
    // A local rule limits each replica on its own: its peak is the busiest replica's. A global
    // or redis rule limits the fleet: its peak is the sum.
    let fleet_peaks = prom.by_rule(&stat(offered_rate(opts, &sel))).await?;
    let replica_peaks = prom.by_rule(&stat(offered_per_replica(opts, &sel))).await?;
    let history = history(&prom, opts, &sel).await?;
    let mut rows = Vec::new();
    for rule in &config.rules {
        let name = rule.name.0.clone();
        let had = history.get(&name).copied().unwrap_or_default();
        let per_replica = rule.scope == Scope::Local;
        let peaks = if per_replica {
            &replica_peaks
        } else {
            &fleet_peaks
        };
        let peak = peaks.get(&name).copied();
        let Limit::Rate { rate, .. } = &rule.limit else {
            rows.push(Row {
                rule: name,
                current: "concurrency".into(),
                peak,
                per_replica,
                history: had,
                proposal: Proposal::Skipped("not a rate limit".into()),
            });
            continue;
        };
        let current = rate.to_string();
        let proposal = if !rule.key.0.is_empty() {
            Proposal::Skipped("per-key limit; history is per rule".into())
        } else if had < opts.min_history {
            Proposal::Skipped(format!(
                "only {} of history (need {})",
                human(had),
                human(opts.min_history)
            ))
        } else {
            match peak {
                None => Proposal::Skipped("no traffic in the lookback".into()),
                Some(peak) if !peak.is_finite() || peak < 0.0 => {
                    Proposal::Skipped(format!("the peak Prometheus gave is {peak}"))
                }
                Some(peak) => {
                    let period = rate.period.as_secs_f64();
                    let count = (peak * (1.0 + opts.margin) * period).ceil().max(1.0) as u64;
                    let old = u64::from(rate.count.get());
                    let unit = current.split_once('/').map_or("s", |(_, u)| u);
                    let new_rate = format!("{count}/{unit}");
                    if count == old {
                        Proposal::Unchanged
                    } else if count > old.saturating_mul(MAX_RAISE) && !opts.allow_raise {
                        Proposal::Skipped(format!(
                            "{new_rate} would raise it {:.1}x, past {MAX_RAISE}x: check the history, then --allow-raise",
                            count as f64 / old as f64
                        ))
                    } else {
                        text = edit_rule(&text, &name, Some(&new_rate), Some(Mode::Shadow))?;
                        Proposal::Set {
                            rate: new_rate,
                            raises: count > old,
                            change: count as f64 / old as f64 - 1.0,
                        }
                    }
                }
            }
        };
        rows.push(Row {
            rule: name,
            current,
            peak,
            per_replica,
            history: had,
            proposal,
        });
    }
    validate(&text, path)?;
    Ok(Tuned { rows, text })
}

/// One row of the `--promote` table.
#[derive(Debug, Clone, PartialEq)]
pub struct PromoteRow {
    pub rule: String,
    /// Would-be rejections / offered over the lookback.
    pub ratio: Option<f64>,
    pub history: Duration,
    pub promoted: bool,
    pub why: String,
}

/// Switches shadow rules whose would-be rejection ratio stayed under the threshold to enforce.
pub async fn promote(path: &Path, opts: &Options) -> Result<(Vec<PromoteRow>, String), String> {
    let (mut text, config) = load(path)?;
    let prom = Prometheus::new(opts)?;
    let sel = selector(&config, opts);
    let range = prom_duration(opts.lookback);
    let shadow = prom
        .by_rule(&format!(
            "sum by (rule) (increase(spillway_requests_total{{decision=\"shadow_rejected\"{sel}}}[{range}]))"
        ))
        .await?;
    let offered = prom
        .by_rule(&format!(
            "sum by (rule) (increase(spillway_requests_total{{decision=~\"allowed|shadow_rejected\"{sel}}}[{range}]))"
        ))
        .await?;
    let history = history(&prom, opts, &sel).await?;
    let mut rows = Vec::new();
    for rule in config.rules.iter().filter(|r| r.mode == Mode::Shadow) {
        let name = rule.name.0.clone();
        let had = history.get(&name).copied().unwrap_or_default();
        let ratio = match (shadow.get(&name), offered.get(&name)) {
            (_, None) | (_, Some(0.0)) => None,
            (s, Some(o)) => Some(s.copied().unwrap_or(0.0) / o),
        };
        let (promoted, why) = if had < opts.min_history {
            (
                false,
                format!(
                    "only {} of history (need {})",
                    human(had),
                    human(opts.min_history)
                ),
            )
        } else {
            match ratio {
                None => (false, "no traffic in the lookback".to_string()),
                Some(r) if r <= opts.threshold => (
                    true,
                    format!(
                        "would have rejected {} <= {}",
                        percent(r),
                        percent(opts.threshold)
                    ),
                ),
                Some(r) => (
                    false,
                    format!(
                        "would have rejected {} > {}",
                        percent(r),
                        percent(opts.threshold)
                    ),
                ),
            }
        };
        if promoted {
            text = edit_rule(&text, &name, None, Some(Mode::Enforce))?;
        }
        rows.push(PromoteRow {
            rule: name,
            ratio,
            history: had,
            promoted,
            why,
        });
    }
    validate(&text, path)?;
    Ok((rows, text))
}

/// The `tune` table, Markdown.
pub fn render(rows: &[Row], opts: &Options) -> String {
    let mut out = String::new();
    let stat = match opts.quantile {
        Quantile::Max => "max",
        Quantile::P99 => "p99",
    };
    let _ = writeln!(
        out,
        "Offered requests/s ({stat} over {}, {} steps), margin {}:\n",
        human(opts.lookback),
        human(opts.step),
        percent(opts.margin)
    );
    let _ = writeln!(
        out,
        "| rule | current limit | observed peak | history | proposed limit | change |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|");
    let mut raised = Vec::new();
    for r in rows {
        let per = if r.per_replica { " per replica" } else { "" };
        let peak = r.peak.map_or("-".to_string(), |p| format!("{p:.1}/s{per}"));
        let (proposed, change) = match &r.proposal {
            Proposal::Set {
                rate,
                raises,
                change,
            } => {
                if *raises {
                    raised.push(r.rule.clone());
                }
                (
                    rate.clone(),
                    format!(
                        "{} {:+.0} % (shadow first)",
                        if *raises { "RAISE" } else { "lower" },
                        change * 100.0
                    ),
                )
            }
            Proposal::Unchanged => (r.current.clone(), "unchanged".into()),
            Proposal::Skipped(why) => ("-".into(), format!("skipped: {why}")),
        };
        let _ = writeln!(
            out,
            "| {} | {} | {peak} | {} | {proposed} | {change} |",
            r.rule,
            r.current,
            human(r.history)
        );
    }
    if !raised.is_empty() {
        let _ = writeln!(
            out,
            "\nWARNING: this RAISES the limit of {}: more traffic will reach the service.",
            raised.join(", ")
        );
    }
    out
}

/// The `--promote` table, Markdown.
pub fn render_promote(rows: &[PromoteRow], opts: &Options) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Shadow rules over {} (promote when would-be rejections <= {}):\n",
        human(opts.lookback),
        percent(opts.threshold)
    );
    let _ = writeln!(out, "| rule | would-be rejected | history | result |");
    let _ = writeln!(out, "|---|---|---|---|");
    for r in rows {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {}: {} |",
            r.rule,
            r.ratio.map_or("-".to_string(), percent),
            human(r.history),
            if r.promoted {
                "enforce"
            } else {
                "stays shadow"
            },
            r.why
        );
    }
    if rows.is_empty() {
        let _ = writeln!(out, "(no rule is in shadow mode)");
    }
    out
}

/// The extra label matchers of every selector: `,spillway_service="<service>"`, the
/// namespace's and the user's.
fn selector(config: &Config, opts: &Options) -> String {
    let mut sel = format!(
        ",{}=\"{}\"",
        crate::metrics::SERVICE_LABEL,
        config.service.0
    );
    if let Some(ns) = opts.namespace.as_deref().filter(|_| !opts.all_namespaces) {
        // A DNS label (`parse_namespace`): nothing in it needs escaping.
        let _ = write!(sel, ",namespace=\"{ns}\"");
    }
    if let Some(extra) = opts
        .selector
        .as_deref()
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        sel.push(',');
        sel.push_str(extra.trim_matches(|c| c == '{' || c == '}'));
    }
    sel
}

/// The fleet's offered requests/s per rule.
fn offered_rate(opts: &Options, sel: &str) -> String {
    format!(
        "sum by (rule) (rate(spillway_requests_total{{decision=~\"allowed|rejected|shadow_rejected\"{sel}}}[{}]))",
        prom_duration(opts.step)
    )
}

/// The busiest replica's offered requests/s per rule (`instance` is one scraped proxy).
fn offered_per_replica(opts: &Options, sel: &str) -> String {
    format!(
        "max by (rule) (sum by (rule, instance) (rate(spillway_requests_total{{decision=~\"allowed|rejected|shadow_rejected\"{sel}}}[{}])))",
        prom_duration(opts.step)
    )
}

/// How much history each rule has in the lookback: steps with data x step.
async fn history(
    prom: &Prometheus,
    opts: &Options,
    sel: &str,
) -> Result<BTreeMap<String, Duration>, String> {
    let q = format!(
        "count_over_time(({})[{}:{}])",
        offered_rate(opts, sel),
        prom_duration(opts.lookback),
        prom_duration(opts.step)
    );
    Ok(prom
        .by_rule(&q)
        .await?
        .into_iter()
        .map(|(rule, n)| (rule, opts.step.mul_f64(n.max(0.0))))
        .collect())
}

fn load(path: &Path) -> Result<(String, Config), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let config =
        Config::from_yaml(&text, &path.display().to_string()).map_err(|e| e.to_string())?;
    Ok((text, config))
}

fn validate(text: &str, path: &Path) -> Result<(), String> {
    Config::from_yaml(text, &format!("{} (as rewritten)", path.display()))
        .map(|_| ())
        .map_err(|e| format!("the rewritten config is not valid, nothing written: {e}"))
}

/// Sets, in the rule called `name`, the `rate:` of its `limit:` and/or its `mode:`, editing
/// only those values so that comments and layout stay.
pub fn edit_rule(
    text: &str,
    name: &str,
    rate: Option<&str>,
    mode: Option<Mode>,
) -> Result<String, String> {
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    let is_name = |l: &str| {
        let t = l.trim_start();
        let t = t.strip_prefix("- ").unwrap_or(t).trim_start();
        t.strip_prefix("name:")
            .map(|v| v.trim().trim_matches(|c| c == '"' || c == '\'') == name)
            .unwrap_or(false)
    };
    let start = lines
        .iter()
        .position(|l| is_name(l))
        .ok_or_else(|| format!("rule {name} not found in the file"))?;
    // The rule's keys are indented like its `name:`; the block ends at the next list item or
    // at anything indented less.
    let key_indent = {
        let l = lines[start];
        let dash = l.len() - l.trim_start().len();
        if l.trim_start().starts_with("- ") {
            dash + 2
        } else {
            dash
        }
    };
    let mut end = start + 1;
    while end < lines.len() {
        let l = lines[end];
        let indent = l.len() - l.trim_start().len();
        if !l.trim().is_empty()
            && (indent < key_indent || l.trim_start().starts_with("- ") && indent < key_indent + 1)
        {
            break;
        }
        end += 1;
    }
    let mut block: Vec<String> = lines[start..end].iter().map(|s| s.to_string()).collect();
    if let Some(rate) = rate {
        let i = block
            .iter()
            .position(|l| l.trim_start().starts_with("limit:"))
            .ok_or_else(|| format!("rule {name}: no limit: line"))?;
        // The rate is on the limit: line (flow style) or on a following one (block style).
        let j = (i..block.len())
            .find(|&j| block[j].contains("rate:"))
            .ok_or_else(|| format!("rule {name}: no rate: in its limit"))?;
        let l = &block[j];
        let at = l.find("rate:").expect("found above") + "rate:".len();
        let rest = &l[at..];
        let value_start = at + (rest.len() - rest.trim_start().len());
        let value_end = l[value_start..]
            .find(|c: char| c.is_whitespace() || c == ',' || c == '}')
            .map_or(l.len(), |e| value_start + e);
        block[j] = format!("{}{rate}{}", &l[..value_start], &l[value_end..]);
    }
    if let Some(mode) = mode {
        let value = match mode {
            Mode::Shadow => "shadow",
            Mode::Enforce => "enforce",
        };
        match block.iter().position(|l| {
            l.trim_start().starts_with("mode:") && l.len() - l.trim_start().len() == key_indent
        }) {
            Some(i) => block[i] = format!("{}mode: {value}\n", " ".repeat(key_indent)),
            None => {
                let mut at = block.len();
                while at > 1 && block[at - 1].trim().is_empty() {
                    at -= 1;
                }
                if !block[at - 1].ends_with('\n') {
                    block[at - 1].push('\n');
                }
                block.insert(at, format!("{}mode: {value}\n", " ".repeat(key_indent)));
            }
        }
    }
    let mut out: String = lines[..start].concat();
    out.extend(block);
    out.push_str(&lines[end..].concat());
    Ok(out)
}

/// Prometheus's HTTP API, instant queries, over HTTP or HTTPS, with a bearer token if given.
struct Prometheus {
    base: String,
    client: crate::control::client::JsonClient,
    token: Option<Vec<u8>>,
}

impl Prometheus {
    fn new(opts: &Options) -> Result<Self, String> {
        let base = opts.prometheus.trim_end_matches('/').to_string();
        let uri: Uri = base
            .parse()
            .map_err(|e| format!("--prometheus {base}: not a URL: {e}"))?;
        if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.authority().is_none() {
            return Err(format!(
                "--prometheus {base}: expected http://host:port or https://host:port"
            ));
        }
        let tls = match uri.scheme_str() {
            Some("https") => Some(
                crate::control::tls::client_config(opts.ca_file.as_deref())
                    .map_err(|e| format!("--ca-file: {e}"))?,
            ),
            _ if opts.ca_file.is_some() => {
                return Err("--ca-file is for an https:// Prometheus".into())
            }
            _ => None,
        };
        let token = match &opts.bearer_token_file {
            Some(p) => Some(
                crate::control::auth::read_token(p)
                    .map_err(|e| format!("--bearer-token-file {}: {e}", p.display()))?,
            ),
            None => None,
        };
        let client = crate::control::client::json_client(tls).map_err(|e| e.to_string())?;
        Ok(Prometheus {
            base,
            client,
            token,
        })
    }

    /// An instant query whose result is one value per `rule` label.
    async fn by_rule(&self, query: &str) -> Result<BTreeMap<String, f64>, String> {
        let encoded: String = url::form_urlencoded::byte_serialize(query.as_bytes()).collect();
        let uri: Uri = format!("{}/api/v1/query?query={encoded}", self.base)
            .parse()
            .map_err(|e| format!("bad query URL: {e}"))?;
        let mut req = http::Request::get(uri);
        if let Some(t) = &self.token {
            let mut value = b"Bearer ".to_vec();
            value.extend_from_slice(t);
            req = req.header(http::header::AUTHORIZATION, value);
        }
        let req = req
            .body(http_body_util::Full::new(Bytes::new()))
            .map_err(|e| format!("bad query: {e}"))?;
        let exchange = async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| format!("cannot reach Prometheus at {}: {e}", self.base))?;
            let status = resp.status();
            let body = Limited::new(resp.into_body(), 64 << 20)
                .collect()
                .await
                .map_err(|e| format!("reading Prometheus's answer: {e}"))?
                .to_bytes();
            Ok::<_, String>((status, body))
        };
        let (status, body) = tokio::time::timeout(Duration::from_secs(60), exchange)
            .await
            .map_err(|_| format!("Prometheus at {} did not answer within 60 s", self.base))??;
        let doc: serde_json::Value = serde_json::from_slice(&body)
            .map_err(|e| format!("Prometheus answered {status} with no JSON: {e}"))?;
        if doc["status"] != "success" {
            return Err(format!(
                "Prometheus refused the query ({status}): {}",
                doc["error"].as_str().unwrap_or("no error given")
            ));
        }
        let mut out = BTreeMap::new();
        for r in doc["data"]["result"].as_array().into_iter().flatten() {
            let (Some(rule), Some(v)) = (r["metric"]["rule"].as_str(), r["value"][1].as_str())
            else {
                continue;
            };
            if let Ok(v) = v.parse::<f64>() {
                if v.is_finite() {
                    out.insert(rule.to_string(), v);
                }
            }
        }
        Ok(out)
    }
}

/// A duration as PromQL writes it.
fn prom_duration(d: Duration) -> String {
    format_duration(d)
}

fn human(d: Duration) -> String {
    let s = d.as_secs();
    match (s / 86_400, (s % 86_400) / 3600, (s % 3600) / 60) {
        (0, 0, m) => format!("{m}m"),
        (0, h, m) => format!("{h}h{m:02}m"),
        (d, h, _) => format!("{d}d{h}h"),
    }
}

fn percent(f: f64) -> String {
    format!("{:.2} %", f * 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "service: s
listen: 127.0.0.1:0
upstream: http://127.0.0.1:1
rules:
  # the checkout API as a whole
  - name: checkout
    key: []
    limit: { rate: 100/s, burst: 200 }   # set in 2024
    cost: 1
  - name: search
    key: []
    limit:
      rate: 10/m
    mode: shadow
";

    #[test]
    fn edits_touch_only_the_rate_and_the_mode_and_keep_comments() {
        let out = edit_rule(FILE, "checkout", Some("140/s"), Some(Mode::Shadow)).unwrap();
        assert!(
            out.contains("    limit: { rate: 140/s, burst: 200 }   # set in 2024\n"),
            "{out}"
        );
        assert!(
            out.contains("    cost: 1\n    mode: shadow\n  - name: search"),
            "{out}"
        );
        assert!(out.contains("  # the checkout API as a whole\n"));
        let out = edit_rule(&out, "search", Some("12/m"), Some(Mode::Enforce)).unwrap();
        assert!(
            out.contains("    limit:\n      rate: 12/m\n    mode: enforce\n"),
            "{out}"
        );
        let c = Config::from_yaml(&out, "t").unwrap();
        assert_eq!(c.rules[0].mode, Mode::Shadow);
        assert_eq!(c.rules[1].mode, Mode::Enforce);
        assert!(edit_rule(FILE, "nope", None, Some(Mode::Shadow)).is_err());
    }

    #[test]
    fn fractions_and_durations_read_and_print_as_users_write_them() {
        assert_eq!(parse_fraction("25%").unwrap(), 0.25);
        assert_eq!(parse_fraction("0.1").unwrap(), 0.1);
        assert!(parse_fraction("lots").is_err());
        assert!(parse_fraction("-5%").is_err());
        assert_eq!(parse_namespace("shop-2").unwrap(), "shop-2");
        for bad in [
            "",
            "Shop",
            "shop\"}",
            "-shop",
            "shop-",
            "a.b",
            &"a".repeat(64),
        ] {
            assert!(parse_namespace(bad).is_err(), "{bad:?}");
        }
        assert_eq!(human(Duration::from_secs(3 * 86_400 + 7200)), "3d2h");
        assert_eq!(human(Duration::from_secs(5400)), "1h30m");
        assert_eq!(prom_duration(Duration::from_secs(28 * 86_400)), "28d");
        assert_eq!(prom_duration(Duration::from_secs(300)), "5m");
    }
}
