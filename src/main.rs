//! The `spillway` command line. Everything but argument parsing lives in the library.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// mimalloc, not the C library's malloc: a request's few allocations of the same sizes, made
/// and freed on one worker's thread, are what its per-thread free lists are for; glibc sent
/// them (and every aligned one, such as a task's) through its bins (BENCHMARKS.md, issue 49).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "spillway",
    version,
    about = "A reverse-proxy sidecar with built-in rate limiting"
)]
struct Cli {
    /// How log lines are written to stderr: `text` (colour only on a terminal) or `json`
    /// (one object a line, for log collectors; the chart sets it).
    #[arg(
        long,
        global = true,
        env = "SPILLWAY_LOG_FORMAT",
        default_value = "text"
    )]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, PartialEq, clap::ValueEnum)]
enum CheckOutput {
    Text,
    Json,
}

/// Checks one configuration: `-` is stdin. The files it names (token, CAs) must be readable
/// too, or the proxy would start without them.
/// `spillway digest`: the digests of `values` under the configured (or given) secret.
fn digest(
    config: Option<&std::path::Path>,
    secret_file: Option<&std::path::Path>,
    values: &[String],
) -> Result<(), String> {
    let file = match config {
        Some(path) => {
            spillway::Config::load(path)
                .map_err(|e| e.to_string())?
                .key_secret_file
        }
        None => secret_file.map(std::path::Path::to_path_buf),
    };
    let secret = spillway::internal::digest::Secret::of(file.as_deref())?;
    if secret.built_in() {
        eprintln!("warning: no key_secret_file: the digests under the built-in secret");
    }
    let mut lines = Vec::new();
    for value in values {
        if value == "-" {
            let text = read_input(std::path::Path::new("-"))?;
            lines.extend(text.lines().map(str::to_owned));
        } else {
            lines.push(value.clone());
        }
    }
    for line in lines {
        println!("{}", secret.of_value(line.as_bytes()));
    }
    Ok(())
}

fn check_one(file: &std::path::Path, skip_files: bool) -> Result<spillway::Config, String> {
    let config = if file.as_os_str() == "-" {
        spillway::Config::from_yaml(&read_input(file)?, "<stdin>")
    } else {
        spillway::Config::load(file)
    }
    .map_err(|e| e.to_string())?;
    let named = [
        (
            "control_plane.token_file",
            config
                .control_plane
                .as_ref()
                .and_then(|c| c.token_file.clone()),
        ),
        (
            "control_plane.ca_file",
            config
                .control_plane
                .as_ref()
                .and_then(|c| c.ca_file.clone()),
        ),
        (
            "redis.ca_file",
            config.redis.as_ref().and_then(|r| r.ca_file.clone()),
        ),
        ("admin_token_file", config.admin_token_file.clone()),
    ];
    for (field, path) in named.into_iter().filter(|_| !skip_files) {
        if let Some(path) = path {
            std::fs::File::open(&path)
                .map_err(|e| format!("{}: {field}: {}: {e}", file.display(), path.display()))?;
        }
    }
    if let Some(path) = config.key_secret_file.as_deref().filter(|_| !skip_files) {
        spillway::internal::digest::Secret::load(path)
            .map_err(|e| format!("{}: {e}", file.display()))?;
    }
    if !skip_files {
        config
            .check_override_files()
            .map_err(|e| format!("{}: {e}", file.display()))?;
    }
    Ok(config)
}

/// `spillway test`: runs each scenario file, prints each scenario's outcome.
fn scenarios(files: &[PathBuf], json: bool) -> ExitCode {
    use spillway::internal::scenario;
    let mut all = Vec::new();
    let mut failed = false;
    for file in files {
        match scenario::run_file(file) {
            Ok(outcomes) => {
                for o in outcomes {
                    failed |= !o.passed;
                    if !json {
                        let mark = if o.passed { "ok  " } else { "FAIL" };
                        println!(
                            "{mark} {}: {} ({} requests)",
                            file.display(),
                            o.scenario,
                            o.requests
                        );
                        for (name, seen) in &o.clients {
                            let first = seen
                                .first_refused_s
                                .map_or("never".to_string(), |s| format!("{s:.3}s"));
                            println!(
                                "       {name}: sent {}, admitted {}, refused {} (first {first}){}",
                                seen.sent,
                                seen.admitted,
                                seen.refused,
                                if seen.bad_requests > 0 {
                                    format!(", {} bad requests", seen.bad_requests)
                                } else {
                                    String::new()
                                }
                            );
                        }
                        for f in &o.failures {
                            println!("       expected: {f}");
                        }
                        for n in &o.notes {
                            println!("       note: {n}");
                        }
                    }
                    all.push(
                        serde_json::json!({ "file": file.display().to_string(), "outcome": o }),
                    );
                }
            }
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
        }
    }
    if json {
        println!("{}", serde_json::Value::Array(all));
    }
    if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

/// The text of `file`, or of stdin for `-`.
fn read_input(file: &std::path::Path) -> Result<String, String> {
    if file.as_os_str() == "-" {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)
            .map_err(|e| format!("<stdin>: {e}"))?;
        return Ok(text);
    }
    std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the sidecar: proxy to the upstream, limiting by the rules in the config.
    Proxy {
        /// The YAML configuration.
        #[arg(long, short, env = "SPILLWAY_CONFIG")]
        config: PathBuf,
        /// Over the file's listen, admin and upstream (an injected pod's: its release's
        /// limits ConfigMap, this pod's ports).
        #[command(flatten)]
        placement: spillway::internal::config::Placement,
    },
    /// Validate configuration files; exit 0 when all are valid, else 2 and what is wrong.
    CheckConfig {
        /// The YAML configurations; `-` reads one from stdin.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// `text` (a line per file) or `json` (an array of {file, ok, service, rules, error}).
        #[arg(long, default_value = "text")]
        output: CheckOutput,
        /// Do not check that the files the configuration names (token, CAs) can be read: for a
        /// configuration checked away from the pod that mounts them.
        #[arg(long)]
        skip_files: bool,
    },
    /// List the pods that asked for the sidecar (their namespace labelled, or themselves
    /// annotated, spillway.dev/inject: enabled) and run without it: pipe `kubectl get
    /// namespaces,pods -A -o yaml`. Exit 0 when there are none, 1 when there are, 2 on bad input.
    CheckInjection {
        /// The namespaces and pods; `-` reads stdin.
        #[arg(default_value = "-")]
        file: PathBuf,
        /// The injector's namespace (never injected): its pods are not listed.
        #[arg(long, default_value = "spillway-system")]
        injector_namespace: String,
    },
    /// Run the admission webhook that adds the sidecar to pods as they are created, in
    /// namespaces labelled (or pods annotated) spillway.dev/inject: enabled; HTTPS only.
    Injector {
        /// Where the API server calls it (HTTPS).
        #[arg(long, env = "SPILLWAY_LISTEN", default_value = "0.0.0.0:8443")]
        listen: std::net::SocketAddr,
        /// /metrics /healthz /readyz.
        #[arg(long, env = "SPILLWAY_ADMIN", default_value = "0.0.0.0:9903")]
        admin: std::net::SocketAddr,
        /// Its settings: `spillway inject`'s options as YAML (image, proxy_port, admin_port,
        /// release, token_secret, token_key, ca_secret, native_sidecar, resources), read at
        /// each review.
        #[arg(long, env = "SPILLWAY_INJECTOR_CONFIG")]
        config: PathBuf,
        /// The namespace it runs in, never injected.
        #[arg(long, env = "POD_NAMESPACE")]
        namespace: String,
        /// The PEM certificate chain it serves (re-read when it changes).
        #[arg(long, env = "SPILLWAY_TLS_CERT")]
        tls_cert: PathBuf,
        /// The PEM private key of --tls-cert.
        #[arg(long, env = "SPILLWAY_TLS_KEY")]
        tls_key: PathBuf,
    },
    /// Run the controller: sums zones' reports and answers with drop ratios.
    Controller {
        /// Where aggregators (or proxies, for small fleets) report.
        #[arg(long, env = "SPILLWAY_LISTEN", default_value = "0.0.0.0:7000")]
        listen: std::net::SocketAddr,
        /// /metrics /healthz /readyz, and /ui (its state needs a token).
        #[arg(long, env = "SPILLWAY_ADMIN", default_value = "0.0.0.0:9902")]
        admin: std::net::SocketAddr,
        #[command(flatten)]
        security: Security,
        /// Time constant of the smoothing of the fleet's sums, e.g. 1s.
        #[arg(long, env = "SPILLWAY_SMOOTHING", default_value = "1s", value_parser = parse_duration)]
        smoothing: std::time::Duration,
        /// After a start, replies say the ratios are not authoritative yet for at least this
        /// long (and for two of the longest intervals reported): proxies keep the ratios they
        /// have meanwhile, e.g. 2s.
        #[arg(long, env = "SPILLWAY_WARM_UP", default_value = "2s", value_parser = parse_duration)]
        warm_up: std::time::Duration,
    },
    /// Run a zone aggregator replica: forwards its proxies' counts once and relays the ratios.
    Aggregator {
        /// Where the zone's proxies report.
        #[arg(long, env = "SPILLWAY_LISTEN", default_value = "0.0.0.0:7001")]
        listen: std::net::SocketAddr,
        /// The controller, http://host:port or https://host:port; with several (given again,
        /// or comma-separated), each is sent every forward: controllers that serve at once.
        #[arg(
            long,
            env = "SPILLWAY_CONTROLLER",
            required = true,
            value_delimiter = ','
        )]
        controller: Vec<http::Uri>,
        /// With an https:// controller: a PEM file of the CA that signed its certificate
        /// (default: the system's trust store).
        #[arg(long, env = "SPILLWAY_CA_FILE")]
        ca_file: Option<PathBuf>,
        /// This aggregator's zone.
        #[arg(long, env = "SPILLWAY_ZONE")]
        zone: String,
        /// This replica's name, unique in its zone (default: $HOSTNAME and a random suffix).
        #[arg(long, env = "SPILLWAY_REPLICA")]
        replica: Option<String>,
        /// /metrics /healthz /readyz.
        #[arg(long, env = "SPILLWAY_ADMIN", default_value = "0.0.0.0:9903")]
        admin: std::net::SocketAddr,
        /// How often the zone's sums go to the controller, e.g. 1s or 250ms.
        #[arg(long, env = "SPILLWAY_INTERVAL", default_value = "1s", value_parser = parse_duration)]
        interval: std::time::Duration,
        /// The most entries (keys) its proxies' reports may hold at once, half of them for one
        /// service: its memory's bound (docs/fleet.md sizes it; the default fits the chart's
        /// 256 MiB). Entries past it are refused and counted.
        #[arg(long, env = "SPILLWAY_MAX_ENTRIES", default_value_t = spillway::internal::control::aggregator::DEFAULT_MAX_ENTRIES as u64, value_parser = clap::value_parser!(u64).range(1000..=10_000_000))]
        max_entries: u64,
        #[command(flatten)]
        security: Security,
    },
    #[cfg(feature = "tune")]
    /// Propose limits from Prometheus history (peak offered rate + margin), new ones in shadow
    /// mode first; or, with --promote, switch shadow rules that would rarely have rejected to
    /// enforce.
    Tune {
        /// The config whose rate limits are tuned.
        #[arg(long, required_unless_present = "promote", conflicts_with = "promote")]
        config: Option<PathBuf>,
        /// Instead: promote this config's shadow rules whose would-be rejections stayed under
        /// --threshold over --lookback.
        #[arg(long)]
        promote: Option<PathBuf>,
        #[command(flatten)]
        opts: spillway::internal::tune::Options,
        /// Write the resulting config here (validated first); without it, a dry run.
        #[arg(long)]
        write: Option<PathBuf>,
    },
    /// Add the sidecar to Kubernetes workloads (Deployment, StatefulSet, DaemonSet): reads
    /// manifests (a file, or `-` for stdin, one or more documents) and prints them injected.
    Inject {
        /// The manifests; `-` reads stdin.
        #[arg(default_value = "-")]
        file: PathBuf,
        #[command(flatten)]
        opts: spillway::internal::inject::Options,
    },
    /// Print the JSON Schema of the configuration file (for editors: the one in schema/), or
    /// with --markdown the configuration reference written from it (docs/configuration.md).
    Schema {
        /// The reference in Markdown instead of the schema.
        #[arg(long)]
        markdown: bool,
    },
    /// Why a request would be refused: which rules match it, each one's key (as logs show it)
    /// and that key's state on a running sidecar, and what each would decide now, taking
    /// nothing. With --config, offline: rules and keys only.
    Explain {
        /// The request's path and query.
        #[arg(default_value = "/")]
        path: String,
        /// The method.
        #[arg(long, short = 'X', default_value = "GET")]
        method: String,
        /// A header field, `name: value` (repeatable).
        #[arg(long = "header", short = 'H')]
        headers: Vec<String>,
        /// The address the request comes from (default 127.0.0.1).
        #[arg(long)]
        client: Option<std::net::IpAddr>,
        #[command(flatten)]
        admin: AdminArgs,
        /// Explain offline from this configuration (a YAML file, or a saved `/config`): no
        /// sidecar asked, no state.
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// Print the answer as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Each rule's most active keys on a running sidecar now (read from its stores), or with
    /// --controller the fleet's heaviest keys of global rules.
    Top {
        /// Keys per rule.
        #[arg(short, default_value_t = 10)]
        n: usize,
        #[command(flatten)]
        admin: AdminArgs,
        /// Ask the controller instead (its admin URL's host and port, e.g. 127.0.0.1:7000),
        /// with --token-file a token that may read the service's state.
        #[arg(long)]
        controller: Option<String>,
        /// Print the answer as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Read or change the log filter of a running sidecar (`RUST_LOG`'s syntax: `debug`,
    /// `info,spillway::rejection=off`).
    LogLevel {
        /// The new filter; without it, the one in force is printed.
        filter: Option<String>,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Print the digest each value (a header's as sent, a query parameter's percent-decoded)
    /// is logged and reported as: how support finds a customer's key in logs and in the
    /// control plane. One line per value.
    Digest {
        /// The configuration whose key_secret_file to use.
        #[arg(long, short, env = "SPILLWAY_CONFIG", conflicts_with = "secret_file")]
        config: Option<PathBuf>,
        /// The secret file itself (as mounted in the pod).
        #[arg(long)]
        secret_file: Option<PathBuf>,
        /// The values; `-` reads one per line from stdin.
        #[arg(required = true)]
        values: Vec<String>,
    },
    /// Prove what a configuration's limits do before it ships: run scenario files (clients,
    /// their headers and rates over simulated time, and what each must be admitted) through
    /// the real decision code on a manual clock. Exits 1 if an expectation fails.
    Test {
        /// Scenario files (each names its configuration).
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Print a JSON array of outcomes instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Run an upstream, the proxy and a load generator on loopback, and show the limiter work.
    Demo {
        /// How long to offer load, in seconds.
        #[arg(long, default_value_t = 15)]
        seconds: u64,
        /// A whole fleet instead: a controller, two aggregator replicas for one zone and one
        /// for another, three proxies.
        #[arg(long, conflicts_with = "tokens")]
        fleet: bool,
        /// Token budgets instead: a fake OpenAI-compatible app streaming chat completions,
        /// each API key charged the tokens its answers say they used.
        #[arg(long)]
        tokens: bool,
    },
}

/// How the command line reaches a sidecar's admin listener.
#[derive(clap::Args)]
struct AdminArgs {
    /// The sidecar's admin address (its `admin:`).
    #[arg(long, env = "SPILLWAY_ADMIN", default_value = "127.0.0.1:9901")]
    admin: String,
    /// A file holding the token of its `admin_token_file`, for an address beyond loopback.
    #[arg(long, env = "SPILLWAY_ADMIN_TOKEN_FILE")]
    token_file: Option<PathBuf>,
}

impl AdminArgs {
    /// `method` `path` on the admin listener with `body`: the status and the answer's text.
    fn call(&self, method: &str, path: &str, body: Vec<u8>) -> Result<(u16, String), String> {
        let token = match &self.token_file {
            Some(f) => Some(
                spillway::internal::control::auth::read_token(f)
                    .map_err(|e| format!("--token-file {}: {e}", f.display()))?,
            ),
            None => None,
        };
        call(&self.admin, method, path, token, body)
    }
}

/// One HTTP/1.1 request to `authority` (host:port), with a bearer `token` (in clear: reach a
/// sidecar through `kubectl port-forward`, not across a network).
fn call(
    authority: &str,
    method: &str,
    path: &str,
    token: Option<Vec<u8>>,
    body: Vec<u8>,
) -> Result<(u16, String), String> {
    use http_body_util::BodyExt;
    let uri: http::Uri = format!("http://{authority}{path}")
        .parse()
        .map_err(|e| format!("{authority}: {e}"))?;
    let mut req = http::Request::builder().method(method).uri(uri);
    if let Some(t) = token {
        let mut value = b"Bearer ".to_vec();
        value.extend_from_slice(&t);
        req = req.header(http::header::AUTHORIZATION, value);
    }
    if !body.is_empty() {
        req = req.header(http::header::CONTENT_TYPE, "application/json");
    }
    let req = req
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async move {
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http();
        let asked = tokio::time::timeout(std::time::Duration::from_secs(10), async {
            let resp = client
                .request(req)
                .await
                .map_err(|e| format!("{authority}: {e}"))?;
            let status = resp.status().as_u16();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| format!("{authority}: {e}"))?
                .to_bytes();
            Ok::<_, String>((status, String::from_utf8_lossy(&body).into_owned()))
        });
        asked
            .await
            .map_err(|_| format!("{authority}: no answer within 10 s"))?
    })
}

/// Prints an explanation for a person: the decision, then a line or two per rule.
fn print_explanation(doc: &serde_json::Value) {
    let s = |v: &serde_json::Value, k: &str| {
        v.get(k).and_then(|x| x.as_str()).unwrap_or("").to_string()
    };
    let mut head = format!("decision: {}", s(doc, "decision"));
    if let Some(by) = doc.get("by").and_then(|b| b.as_str()) {
        head.push_str(&format!(" by rule {by}"));
    }
    if let Some(r) = doc.get("retry_after_s").and_then(|r| r.as_u64()) {
        head.push_str(&format!(" (Retry-After: {r})"));
    }
    println!("{head}");
    if let Some(reason) = doc.get("reason").and_then(|r| r.as_str()) {
        println!("  {reason}");
    }
    println!("client {}  path {}", s(doc, "client"), s(doc, "path"));
    for r in doc
        .get("rules")
        .and_then(|r| r.as_array())
        .into_iter()
        .flatten()
    {
        let key = r
            .get("key")
            .and_then(|k| k.as_str())
            .map(|k| format!(" key {k:?}"))
            .unwrap_or_default();
        println!(
            "- {} ({}, {}): {}{key}",
            s(r, "rule"),
            s(r, "kind"),
            s(r, "mode"),
            s(r, "decision")
        );
        println!("    {}", s(r, "reason"));
        if let Some(own) = r.get("override").and_then(|o| o.as_str()) {
            println!("    the key's own limit (overrides): {own}");
        }
        if let Some(state) = r.get("state").filter(|v| !v.is_null()) {
            println!("    state {state}");
        }
    }
}

/// Who may talk to a controller or aggregator, and over what.
#[derive(clap::Args)]
struct Security {
    /// A directory of tokens (a mounted Secret): a file per service holding its proxies'
    /// token, `_aggregators` for the aggregators' zone sums, `_admin` to read all state.
    #[arg(long, env = "SPILLWAY_TOKENS", conflicts_with = "token_file")]
    tokens: Option<PathBuf>,
    /// Instead: one shared bearer token for every service (and, on an aggregator, the token it
    /// presents to the controller).
    #[arg(long, env = "SPILLWAY_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// A file holding a token that may read every service's state (and report nothing).
    #[arg(long, env = "SPILLWAY_ADMIN_TOKEN_FILE")]
    admin_token_file: Option<PathBuf>,
    /// Serve HTTPS with this PEM certificate chain (re-read when it changes).
    #[arg(long, env = "SPILLWAY_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, env = "SPILLWAY_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Listen beyond loopback with no token anyway (anyone who reaches it can change every
    /// service's limits and read their keys); logged, and shown in a metric.
    #[arg(long)]
    insecure: bool,
}

impl Security {
    /// The credentials and TLS they describe, reloaded when their files change for as long as
    /// the returned sender is kept.
    #[allow(clippy::type_complexity)]
    fn load(
        self,
    ) -> anyhow::Result<(
        spillway::internal::control::auth::Credentials,
        Option<spillway::internal::control::tls::ServerTls>,
        tokio::sync::watch::Sender<bool>,
    )> {
        use spillway::internal::control::auth::{Credentials, TokenSource};
        let (watching, stop) = tokio::sync::watch::channel(false);
        let (source, what) = match (self.tokens, self.token_file) {
            (Some(d), _) => (
                TokenSource::Dir(d.clone()),
                format!("--tokens {}", d.display()),
            ),
            (None, Some(f)) => (
                TokenSource::File(f.clone()),
                format!("--token-file {}", f.display()),
            ),
            (None, None) => (TokenSource::None, String::new()),
        };
        let shared_file = matches!(source, TokenSource::File(_));
        let creds = Credentials::load(source, self.admin_token_file, stop.clone())
            .map_err(|e| anyhow::anyhow!("{what}: {e}"))?;
        if shared_file {
            tracing::warn!(
                "{what}: one token for every service and the aggregators: a pod holding it can report for and read every service, claim any host name and send zone sums; give each service its own with --tokens DIR (_shared there is a token for every service that sends no zone sums)"
            );
        }
        let tls = match (self.tls_cert, self.tls_key) {
            (Some(c), Some(k)) => Some(
                spillway::internal::control::tls::ServerTls::load(c, k, stop)
                    .map_err(|e| anyhow::anyhow!("--tls-cert/--tls-key: {e}"))?,
            ),
            _ => None,
        };
        Ok((creds, tls, watching))
    }
}

fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    spillway::internal::config::parse_duration(s)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Before the runtime's threads start (glibc chooses a thread's arena at its first
    // allocation).
    if matches!(
        cli.command,
        Command::Controller { .. } | Command::Aggregator { .. }
    ) {
        spillway::internal::allocator::for_control_plane();
    }
    // The demo's table is its output; the proxy's own info logs would only clutter it.
    let default_filter = match cli.command {
        Command::Demo { .. } => "warn",
        _ => "info",
    };
    spillway::internal::logs::init(matches!(cli.log_format, LogFormat::Json), default_filter);
    match cli.command {
        Command::CheckConfig {
            files,
            output,
            skip_files,
        } => {
            let mut all_ok = true;
            let mut report = Vec::new();
            for file in &files {
                let name = file.display().to_string();
                match check_one(file, skip_files) {
                    Ok(config) => {
                        let warnings = config.warnings();
                        if output == CheckOutput::Text {
                            println!(
                                "{name}: ok (service {}, {} rule{})",
                                config.service,
                                config.rules.len(),
                                if config.rules.len() == 1 { "" } else { "s" }
                            );
                            for w in &warnings {
                                eprintln!("warning: {name}: {w}");
                            }
                        }
                        report.push(serde_json::json!({
                            "file": name, "ok": true,
                            "service": config.service.to_string(), "rules": config.rules.len(),
                            "warnings": warnings,
                        }));
                    }
                    Err(e) => {
                        all_ok = false;
                        if output == CheckOutput::Text {
                            eprintln!("error: {e}");
                        }
                        report.push(serde_json::json!({ "file": name, "ok": false, "error": e }));
                    }
                }
            }
            if output == CheckOutput::Json {
                println!("{}", serde_json::Value::Array(report));
            }
            if all_ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(2)
            }
        }
        Command::Proxy {
            config: path,
            placement,
        } => {
            let file = path.display().to_string();
            let loaded = std::fs::read_to_string(&path)
                .map_err(|source| spillway::ConfigError::Read {
                    file: file.clone(),
                    source,
                })
                .and_then(|text| spillway::Config::from_yaml(&text, &file).map(|c| (c, text)));
            let (mut config, text) = match loaded {
                Ok(pair) => pair,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(2);
                }
            };
            placement.apply(&mut config);
            run(async move {
                let signal = shutdown_signal()?;
                let sidecar = spillway::Sidecar::start(config).await?;
                // Hot reload: changes to the file (or its directory's ConfigMap symlink) and SIGHUP.
                // Without it (no inotify watches left, say) the proxy still serves.
                if let Err(e) = sidecar.watch_file(path, &text) {
                    tracing::warn!("hot reload is off: cannot watch the config file: {e}");
                }
                // Tests and scripts wait for this line: it is printed once both are bound.
                println!(
                    "spillway proxy listening on {} (admin {})",
                    sidecar.addr(),
                    sidecar.admin_addr()
                );
                sidecar.run_until(signal).await;
                tracing::info!("stopped");
                Ok(())
            })
        }
        Command::CheckInjection {
            file,
            injector_namespace,
        } => {
            let found = read_input(&file).and_then(|text| {
                spillway::internal::inject::webhook::uninjected(&text, &[&injector_namespace])
            });
            match found {
                Ok(missing) if missing.is_empty() => {
                    println!("every pod that asked for the sidecar runs with it");
                    ExitCode::SUCCESS
                }
                Ok(missing) => {
                    for pod in &missing {
                        println!("{pod}: asked for the sidecar and runs without it: the injector was unreachable when it was created (restart its workload), or could not inject it (its log and spillway_injector_pods_total{{result=\"not_injected\"}} say why)");
                    }
                    ExitCode::from(1)
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(2)
                }
            }
        }
        Command::Injector {
            listen,
            admin,
            config,
            namespace,
            tls_cert,
            tls_key,
        } => run(async move {
            let (_watching, stop) = tokio::sync::watch::channel(false);
            let tls = spillway::internal::control::tls::ServerTls::load(tls_cert, tls_key, stop)
                .map_err(|e| anyhow::anyhow!("--tls-cert/--tls-key: {e}"))?;
            let options = spillway::internal::inject::webhook::InjectorOptions {
                listen,
                admin,
                tls: Some(tls),
                config,
                namespace,
            };
            serve_role(
                "injector",
                spillway::internal::inject::webhook::start(options),
            )
            .await
        }),
        Command::Controller {
            listen,
            admin,
            security,
            smoothing,
            warm_up,
        } => run(async move {
            let insecure = security.insecure;
            let (credentials, tls, _watching) = security.load()?;
            let options = spillway::internal::control::controller::ControllerOptions {
                listen,
                admin,
                credentials,
                tls,
                insecure,
                smoothing,
                warm_up,
            };
            serve_role(
                "controller",
                spillway::internal::control::controller::start(options),
            )
            .await
        }),
        Command::Aggregator {
            listen,
            controller,
            ca_file,
            zone,
            replica,
            admin,
            interval,
            max_entries,
            security,
        } => run(async move {
            let insecure = security.insecure;
            let (credentials, tls, _watching) = security.load()?;
            if credentials.outgoing().is_none() && !credentials.is_open() {
                anyhow::bail!(
                    "--tokens: no _aggregators file: the aggregator needs its token to report to the controller"
                );
            }
            let options = spillway::internal::control::aggregator::AggregatorOptions {
                listen,
                admin,
                controllers: controller,
                zone,
                replica,
                interval,
                credentials,
                tls,
                ca_file,
                insecure,
                max_entries: max_entries as usize,
            };
            serve_role(
                "aggregator",
                spillway::internal::control::aggregator::start(options),
            )
            .await
        }),
        #[cfg(feature = "tune")]
        Command::Tune {
            config,
            promote,
            opts,
            write,
        } => run(async move {
            let (table, text) = match (config, promote) {
                (Some(path), _) => {
                    let tuned = spillway::internal::tune::tune(&path, &opts)
                        .await
                        .map_err(anyhow::Error::msg)?;
                    (
                        spillway::internal::tune::render(&tuned.rows, &opts),
                        tuned.text,
                    )
                }
                (None, Some(path)) => {
                    let (rows, text) = spillway::internal::tune::promote(&path, &opts)
                        .await
                        .map_err(anyhow::Error::msg)?;
                    (spillway::internal::tune::render_promote(&rows, &opts), text)
                }
                (None, None) => anyhow::bail!("give --config FILE or --promote FILE"),
            };
            print!("{table}");
            match write {
                Some(out) => {
                    std::fs::write(&out, text)
                        .map_err(|e| anyhow::anyhow!("{}: {e}", out.display()))?;
                    println!(
                        "
wrote {}",
                        out.display()
                    );
                }
                None => println!(
                    "
(dry run: give --write FILE to write the result)"
                ),
            }
            Ok(())
        }),
        Command::Schema { markdown } => {
            match markdown {
                true => print!("{}", spillway::internal::config::reference::markdown()),
                false => print!("{}", spillway::internal::config::schema::text()),
            }
            ExitCode::SUCCESS
        }
        Command::Explain {
            path,
            method,
            headers,
            client,
            admin,
            config,
            json,
        } => match explain(path, method, headers, client, &admin, config.as_deref()) {
            Ok(doc) => {
                if json {
                    println!("{}", serde_json::to_string_pretty(&doc).unwrap_or_default());
                } else {
                    print_explanation(&doc);
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(2)
            }
        },
        Command::Top {
            n,
            admin,
            controller,
            json,
        } => match top(n, &admin, controller.as_deref(), json) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(2)
            }
        },
        Command::LogLevel { filter, admin } => {
            let answer = match filter {
                Some(f) => admin.call("PUT", "/log-level", f.into_bytes()),
                None => admin.call("GET", "/log-level", Vec::new()),
            };
            match answer {
                Ok((200, text)) => {
                    print!("{text}");
                    ExitCode::SUCCESS
                }
                Ok((status, text)) => {
                    eprintln!("error: {status}: {}", text.trim());
                    ExitCode::from(2)
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(2)
                }
            }
        }
        Command::Test { files, json } => scenarios(&files, json),
        Command::Digest {
            config,
            secret_file,
            values,
        } => match digest(config.as_deref(), secret_file.as_deref(), &values) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(2)
            }
        },
        Command::Inject { file, opts } => {
            let text = match read_input(&file) {
                Ok(text) => text,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(2);
                }
            };
            match spillway::internal::inject::inject(&text, &opts) {
                Ok(out) => {
                    print!("{}", out.text);
                    for line in &out.summary {
                        eprintln!("{line}");
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(2)
                }
            }
        }
        Command::Demo {
            seconds,
            fleet,
            tokens,
        } => {
            if fleet {
                run(spillway::internal::demo::fleet())
            } else if tokens {
                run(spillway::internal::demo::tokens::run(
                    std::time::Duration::from_secs(seconds),
                ))
            } else {
                run(spillway::internal::demo::run(
                    std::time::Duration::from_secs(seconds),
                ))
            }
        }
    }
}

/// `spillway explain`: asks the sidecar, or explains offline from `config`.
fn explain(
    path: String,
    method: String,
    headers: Vec<String>,
    client: Option<std::net::IpAddr>,
    admin: &AdminArgs,
    config: Option<&std::path::Path>,
) -> Result<serde_json::Value, String> {
    let mut fields = Vec::new();
    for h in &headers {
        let (name, value) = h
            .split_once(':')
            .ok_or_else(|| format!("-H {h:?}: give a header as `name: value`"))?;
        fields.push(serde_json::json!([name.trim(), value.trim()]));
    }
    let asked = serde_json::json!({
        "method": method, "path": path, "headers": fields, "client": client,
    });
    match config {
        Some(file) => {
            let text = read_input(file)?;
            let config = offline_config(&text, &file.display().to_string())?;
            let asked = serde_json::from_value(asked).map_err(|e| e.to_string())?;
            spillway::internal::proxy::admin::explain_offline(&config, asked)
        }
        None => {
            let body = serde_json::to_vec(&asked).map_err(|e| e.to_string())?;
            match admin.call("POST", "/explain", body)? {
                (200, text) => serde_json::from_str(&text).map_err(|e| format!("the answer: {e}")),
                (status, text) => Err(format!("{status}: {}", text.trim())),
            }
        }
    }
}

/// A configuration from a YAML file, or from what a sidecar's `/config` served (its
/// version, load time, source and pending fields taken out).
fn offline_config(text: &str, file: &str) -> Result<spillway::Config, String> {
    if let Ok(serde_json::Value::Object(mut doc)) = serde_json::from_str::<serde_json::Value>(text)
    {
        for meta in ["version", "loaded_at", "source", "pending_restart"] {
            doc.remove(meta);
        }
        let text = serde_json::to_string(&doc).map_err(|e| e.to_string())?;
        return spillway::Config::from_yaml(&text, file).map_err(|e| e.to_string());
    }
    spillway::Config::from_yaml(text, file).map_err(|e| e.to_string())
}

/// `spillway top`: each rule's most active keys on a sidecar, or the fleet's from the
/// controller.
fn top(n: usize, admin: &AdminArgs, controller: Option<&str>, json: bool) -> Result<(), String> {
    let (status, text) = match controller {
        Some(c) => {
            let token = match &admin.token_file {
                Some(f) => Some(
                    spillway::internal::control::auth::read_token(f)
                        .map_err(|e| format!("--token-file {}: {e}", f.display()))?,
                ),
                None => None,
            };
            call(c, "GET", "/v1/state", token, Vec::new())?
        }
        None => admin.call("GET", &format!("/top?n={n}"), Vec::new())?,
    };
    if status != 200 {
        return Err(format!("{status}: {}", text.trim()));
    }
    let doc: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("the answer: {e}"))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&doc).unwrap_or_default());
        return Ok(());
    }
    let s = |v: &serde_json::Value, k: &str| {
        v.get(k)
            .map(|x| x.as_str().map_or_else(|| x.to_string(), str::to_string))
            .unwrap_or_default()
    };
    if controller.is_some() {
        // The fleet's heaviest keys of each global rule, by offered rate.
        let mut keys: Vec<&serde_json::Value> = doc
            .get("keys")
            .and_then(|k| k.as_array())
            .into_iter()
            .flatten()
            .collect();
        let rate =
            |k: &serde_json::Value, f: &str| k.get(f).and_then(|x| x.as_f64()).unwrap_or(0.0);
        keys.sort_by(|a, b| {
            rate(b, "offered_rps")
                .partial_cmp(&rate(a, "offered_rps"))
                .unwrap_or(std::cmp::Ordering::Equal)
        });
        println!(
            "{:<16} {:<16} {:<40} {:>12} {:>12} {:>12}",
            "service", "rule", "key", "offered/s", "admitted/s", "refused/s"
        );
        let mut shown: std::collections::HashMap<(String, String), usize> = Default::default();
        for k in keys {
            let seen = shown.entry((s(k, "service"), s(k, "rule"))).or_default();
            *seen += 1;
            if *seen > n {
                continue;
            }
            let (o, a) = (rate(k, "offered_rps"), rate(k, "admitted_rps"));
            println!(
                "{:<16} {:<16} {:<40} {:>12.1} {:>12.1} {:>12.1}",
                s(k, "service"),
                s(k, "rule"),
                s(k, "key"),
                o,
                a,
                (o - a).max(0.0)
            );
        }
        return Ok(());
    }
    for r in doc
        .get("rules")
        .and_then(|r| r.as_array())
        .into_iter()
        .flatten()
    {
        println!(
            "{} ({}): {} keys; {}",
            s(r, "rule"),
            s(r, "kind"),
            s(r, "keys"),
            s(r, "used")
        );
        for k in r
            .get("top")
            .and_then(|t| t.as_array())
            .into_iter()
            .flatten()
        {
            let limited = if k.get("limited").and_then(|l| l.as_bool()) == Some(true) {
                "  limited now"
            } else {
                ""
            };
            println!("  {:<48} {:>10}{limited}", s(k, "key"), s(k, "used"));
        }
    }
    Ok(())
}

/// Runs a control-plane role until SIGTERM/SIGINT: the signal handlers first, then `start`,
/// then the readiness line that scripts and tests wait for.
async fn serve_role(
    role: &str,
    start: impl std::future::Future<
        Output = std::io::Result<spillway::internal::control::server::Running>,
    >,
) -> anyhow::Result<()> {
    let signal = shutdown_signal()?;
    let running = start.await?;
    println!(
        "spillway {role} listening on {} (admin {})",
        running.addr, running.admin_addr
    );
    running.run_until(signal).await;
    Ok(())
}

fn run(fut: impl std::future::Future<Output = anyhow::Result<()>>) -> ExitCode {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(fut) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// SIGTERM (Kubernetes) or SIGINT (Ctrl-C). The handlers are installed when this returns,
/// so a signal that arrives after it can no longer kill the process undrained.
fn shutdown_signal() -> std::io::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
    })
}
