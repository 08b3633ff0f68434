//! Whose bearer token may do what on the control plane.
//!
//! Owns the credentials of a controller or aggregator: none (a loopback development setup), one
//! shared token (`--token-file`, standing for every service and for aggregators), or a
//! directory of them (`--tokens DIR`, a mounted Secret): a file per service holding its
//! proxies' token, `_aggregators` for the zone sums, `_admin` for reading all state,
//! `_metrics` for the controller's per-rule metrics alone, `_shared` for one token every
//! service's proxies may use (never for zone sums there). Entries
//! starting with `.` (the Secret's `..data` links) are ignored. Files are re-read when they
//! change; a bad set keeps the previous one. Tokens are compared in constant time, against
//! every configured token. Must never: let a service's token report for, or read, another
//! service, or log a token. Also the one token a proxy presents ([`Token`]), re-read likewise.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use http::header::AUTHORIZATION;
use subtle::ConstantTimeEq;

/// Who presented a token (or that none is needed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Principal {
    /// No token is configured: everything is allowed (loopback or `--insecure` only).
    Open,
    /// The shared token: every service; and zone sums, unless the aggregators have a token of
    /// their own (`true`: they have not, `--token-file`).
    Shared(bool),
    /// One service's proxies.
    Service(Arc<str>),
    /// The aggregators: zone sums for every service.
    Aggregator,
    /// Reads everything; reports nothing.
    Admin,
    /// Reads the controller's per-rule metrics, nothing else (what Prometheus is given).
    Metrics,
}

impl Principal {
    /// Whether it may send a report for `service`.
    pub fn may_report(&self, service: &str) -> bool {
        match self {
            Principal::Open | Principal::Shared(_) | Principal::Aggregator => true,
            Principal::Service(s) => **s == *service,
            Principal::Admin | Principal::Metrics => false,
        }
    }

    /// Whether it may send an aggregator's zone sums (a `zone:` source).
    pub fn may_send_zone_sums(&self) -> bool {
        matches!(
            self,
            Principal::Open | Principal::Shared(true) | Principal::Aggregator
        )
    }

    /// The one service it is limited to, if any.
    pub fn service(&self) -> Option<&str> {
        match self {
            Principal::Service(s) => Some(s),
            _ => None,
        }
    }

    /// Whose budget (new sources, values held) `report` from it counts against: its service;
    /// for the shared or no token, the service the report names first (they stand for every
    /// service, which must not all share one budget); for zone sums, `_zones`.
    pub fn owner<'a>(&'a self, report: &'a super::Report) -> &'a str {
        if report.source.starts_with("zone:") {
            return "_zones";
        }
        let named = || report.entries.first().map(|e| e.service.as_str());
        match self {
            Principal::Service(s) => s,
            Principal::Open => named().unwrap_or("_open"),
            Principal::Shared(_) => named().unwrap_or("_shared"),
            Principal::Aggregator => "_aggregators",
            Principal::Admin => "_admin",
            Principal::Metrics => "_metrics",
        }
    }

    /// Its name in metrics and logs (never the token).
    /// Who it is, as budgets per principal count it: its kind, and a service's name.
    pub fn id(&self) -> String {
        format!("{}/{}", self.kind(), self.service().unwrap_or(""))
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Principal::Open => "open",
            Principal::Shared(_) => "shared",
            Principal::Service(_) => "service",
            Principal::Aggregator => "aggregator",
            Principal::Admin => "admin",
            Principal::Metrics => "metrics",
        }
    }
}

/// The tokens in force now.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct TokenSet {
    shared: Option<Vec<u8>>,
    services: Vec<(Arc<str>, Vec<u8>)>,
    aggregators: Option<Vec<u8>>,
    admin: Option<Vec<u8>>,
    metrics: Option<Vec<u8>>,
}

impl TokenSet {
    fn is_empty(&self) -> bool {
        self.shared.is_none()
            && self.services.is_empty()
            && self.aggregators.is_none()
            && self.admin.is_none()
            && self.metrics.is_none()
    }

    /// Reads `--tokens DIR`. Fails on an unreadable or empty file, a name that cannot be a
    /// service, or one token used for two names (it would be ambiguous).
    pub fn from_dir(dir: &Path) -> std::io::Result<TokenSet> {
        let bad = |msg: String| std::io::Error::new(std::io::ErrorKind::InvalidData, msg);
        let mut set = TokenSet::default();
        let mut names: Vec<(String, PathBuf)> = Vec::new();
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                continue;
            }
            let path = entry.path();
            // A mounted Secret's entries are links into `..data`: follow them.
            if !std::fs::metadata(&path)?.is_file() {
                continue;
            }
            names.push((name, path));
        }
        names.sort();
        for (name, path) in names {
            let token = read_token(&path)?;
            match name.as_str() {
                "_aggregators" => set.aggregators = Some(token),
                "_admin" => set.admin = Some(token),
                "_metrics" => set.metrics = Some(token),
                // One token every service's proxies may use (not for zone sums: those need
                // `_aggregators`).
                "_shared" => set.shared = Some(token),
                n if n.starts_with('_') => {
                    return Err(bad(format!(
                        "{}: names starting with _ are reserved (_aggregators, _admin, _metrics, _shared)",
                        path.display()
                    )))
                }
                n if n.len() > 64 => {
                    return Err(bad(format!(
                        "{}: a service name is at most 64 characters",
                        path.display()
                    )))
                }
                n => set.services.push((n.into(), token)),
            }
        }
        let mut all: Vec<&Vec<u8>> = set.services.iter().map(|(_, t)| t).collect();
        all.extend(set.shared.iter());
        all.extend(set.aggregators.iter());
        all.extend(set.admin.iter());
        all.extend(set.metrics.iter());
        let n = all.len();
        all.sort();
        all.dedup();
        if all.len() != n {
            return Err(bad(format!(
                "{}: two files hold the same token; each service, _aggregators, _admin and _metrics needs its own",
                dir.display()
            )));
        }
        if set.is_empty() {
            return Err(bad(format!("{}: no token files", dir.display())));
        }
        Ok(set)
    }

    /// Who `given` belongs to, comparing it with every token in constant time.
    fn principal(&self, given: &[u8]) -> Option<Principal> {
        let mut found = None;
        let mut check = |token: &Option<Vec<u8>>, p: Principal| {
            if let Some(t) = token {
                if bool::from(given.ct_eq(t)) {
                    found = Some(p);
                }
            }
        };
        check(&self.shared, Principal::Shared(self.aggregators.is_none()));
        check(&self.aggregators, Principal::Aggregator);
        check(&self.admin, Principal::Admin);
        check(&self.metrics, Principal::Metrics);
        for (service, t) in &self.services {
            if bool::from(given.ct_eq(t)) {
                found = Some(Principal::Service(service.clone()));
            }
        }
        found
    }
}

/// The credentials of a control-plane server, swapped whole when their files change.
#[derive(Debug, Clone, Default)]
pub struct Credentials(Arc<ArcSwap<TokenSet>>);

impl Credentials {
    /// No tokens: everything is open.
    pub fn open() -> Self {
        Self::default()
    }

    /// One shared token.
    pub fn shared(token: Vec<u8>) -> Self {
        Self::with(TokenSet {
            shared: Some(token),
            ..Default::default()
        })
    }

    pub fn with(set: TokenSet) -> Self {
        Credentials(Arc::new(ArcSwap::from_pointee(set)))
    }

    /// Whether any token is configured.
    pub fn is_open(&self) -> bool {
        self.0.load().is_empty()
    }

    /// The token this process presents upstream (an aggregator to its controller): the
    /// aggregators' token, or the shared one.
    pub fn outgoing(&self) -> Option<Vec<u8>> {
        let set = self.0.load();
        set.aggregators.clone().or_else(|| set.shared.clone())
    }

    /// Adds an admin token (from `--admin-token-file`).
    pub fn set_admin(&self, token: Vec<u8>) {
        let mut set = (**self.0.load()).clone();
        set.admin = Some(token);
        self.0.store(Arc::new(set));
    }

    /// Who sent `headers` (`Authorization: Bearer <token>`); `None` when a token is configured
    /// and the request does not carry a known one.
    pub fn authenticate(&self, headers: &http::HeaderMap) -> Option<Principal> {
        let set = self.0.load();
        if set.is_empty() {
            return Some(Principal::Open);
        }
        let given = headers
            .get(AUTHORIZATION)
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))?;
        set.principal(given)
    }

    /// Loads `--token-file` or `--tokens DIR` (an error stops start-up) and re-reads it when
    /// it changes or on SIGHUP, until `stop`; a bad set keeps the old one. With
    /// `admin`, that file's token is added as the admin token (and re-read with the rest).
    pub fn load(
        source: TokenSource,
        admin: Option<PathBuf>,
        stop: tokio::sync::watch::Receiver<bool>,
    ) -> std::io::Result<Credentials> {
        let read = {
            let (source, admin) = (source.clone(), admin.clone());
            move || -> std::io::Result<TokenSet> {
                let mut set = match &source {
                    TokenSource::None => TokenSet::default(),
                    TokenSource::File(p) => TokenSet {
                        shared: Some(read_token(p)?),
                        ..Default::default()
                    },
                    TokenSource::Dir(d) => TokenSet::from_dir(d)?,
                };
                if let Some(a) = &admin {
                    set.admin = Some(read_token(a)?);
                }
                Ok(set)
            }
        };
        let creds = Credentials::with(read()?);
        let mut watched: Vec<PathBuf> = match &source {
            TokenSource::None => Vec::new(),
            TokenSource::File(p) => vec![p.clone()],
            // The watcher watches a path's directory: any entry of DIR stands for DIR.
            TokenSource::Dir(d) => vec![d.join("..data")],
        };
        watched.extend(admin);
        for path in watched {
            let (c, read) = (creds.clone(), read.clone());
            let watching = crate::watch::spawn(&path, stop.clone(), move |_| {
                let (c, read) = (c.clone(), read.clone());
                async move {
                    match read() {
                        Ok(set) if set == **c.0.load() => {}
                        Ok(set) => {
                            c.0.store(Arc::new(set));
                            tracing::info!("bearer tokens reloaded");
                        }
                        Err(e) => tracing::error!(
                            "cannot reload the bearer tokens, the previous ones stay: {e}"
                        ),
                    }
                }
            });
            // Without a watch (no inotify watches left, say) the tokens still work; they just
            // do not rotate until a restart.
            if let Err(e) = watching {
                tracing::warn!("the bearer tokens will not reload: {e}");
            }
        }
        Ok(creds)
    }
}

/// Where a server's tokens come from.
#[derive(Debug, Clone)]
pub enum TokenSource {
    None,
    File(PathBuf),
    Dir(PathBuf),
}

/// A bearer token that its file can replace while running (a rotated Kubernetes Secret):
/// readers take the current one per request, a watcher swaps it.
#[derive(Debug, Clone, Default)]
pub struct Token(Arc<arc_swap::ArcSwapOption<Vec<u8>>>);

impl Token {
    pub fn new(token: Option<Vec<u8>>) -> Self {
        Token(Arc::new(arc_swap::ArcSwapOption::new(token.map(Arc::new))))
    }

    /// The token now, if one is configured.
    pub fn get(&self) -> Option<Arc<Vec<u8>>> {
        self.0.load_full()
    }

    /// Reads `path` now (an error stops start-up), then re-reads it whenever it changes or
    /// the process gets SIGHUP, until `stop`; a bad or empty file keeps the old token.
    /// Must be called within a tokio runtime.
    pub fn from_file(
        path: std::path::PathBuf,
        stop: tokio::sync::watch::Receiver<bool>,
    ) -> std::io::Result<Token> {
        let token = Token::new(Some(read_token(&path)?));
        let t = token.clone();
        let watching = crate::watch::spawn(&path.clone(), stop, move |_| {
            let (t, path) = (t.clone(), path.clone());
            async move {
                match read_token(&path) {
                    Ok(new) if t.get().as_deref() != Some(&new) => {
                        t.0.store(Some(Arc::new(new)));
                        tracing::info!(file = %path.display(), "bearer token reloaded");
                    }
                    Ok(_) => {}
                    Err(e) => tracing::error!(
                        file = %path.display(),
                        "cannot reload the bearer token, the previous one stays: {e}"
                    ),
                }
            }
        });
        // Without a watch (no inotify watches left, say) the token still works; it just does
        // not rotate until a restart.
        if let Err(e) = watching {
            tracing::warn!("the bearer token will not reload: cannot watch its file: {e}");
        }
        Ok(token)
    }
}

/// Reads a token file: its content without surrounding white space.
pub fn read_token(path: &std::path::Path) -> std::io::Result<Vec<u8>> {
    let text = std::fs::read(path)?;
    let trimmed = text.trim_ascii();
    if trimmed.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{}: the token file is empty", path.display()),
        ));
    }
    Ok(trimmed.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(token: &str) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        h.insert(AUTHORIZATION, format!("Bearer {token}").parse().unwrap());
        h
    }

    fn dir(files: &[(&str, &str)]) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "spillway-auth-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        ));
        std::fs::create_dir_all(&d).unwrap();
        for (name, text) in files {
            std::fs::write(d.join(name), text).unwrap();
        }
        d
    }

    #[test]
    fn a_directory_maps_each_token_to_its_service_and_ignores_dot_entries() {
        let d = dir(&[
            ("shop", "shop-token\n"),
            ("books", "books-token"),
            ("_aggregators", "agg-token"),
            (".hidden", "ignored-token"),
        ]);
        std::fs::create_dir(d.join("..data")).unwrap();
        let c = Credentials::with(TokenSet::from_dir(&d).unwrap());
        assert_eq!(
            c.authenticate(&headers("shop-token")),
            Some(Principal::Service("shop".into()))
        );
        assert_eq!(
            c.authenticate(&headers("agg-token")),
            Some(Principal::Aggregator)
        );
        assert_eq!(c.authenticate(&headers("ignored-token")), None);
        assert_eq!(c.authenticate(&http::HeaderMap::new()), None);
        assert_eq!(c.outgoing().as_deref(), Some(&b"agg-token"[..]));
        let shop = Principal::Service("shop".into());
        assert!(shop.may_report("shop") && !shop.may_report("books"));
        assert!(!shop.may_send_zone_sums());
    }

    #[test]
    fn a_reserved_name_a_shared_token_or_an_empty_file_is_refused() {
        for files in [
            &[("_other", "x")][..],
            &[("a", "same"), ("b", "same")][..],
            &[("a", " \n")][..],
            &[][..],
        ] {
            assert!(TokenSet::from_dir(&dir(files)).is_err(), "{files:?}");
        }
    }

    #[test]
    fn a_shared_token_beside_the_aggregators_own_reports_for_any_service_but_sends_no_zone_sums() {
        let c = Credentials::with(
            TokenSet::from_dir(&dir(&[("_shared", "s"), ("_aggregators", "a")])).unwrap(),
        );
        let shared = c.authenticate(&headers("s")).unwrap();
        assert_eq!(shared, Principal::Shared(false));
        assert!(shared.may_report("shop") && shared.may_report("books"));
        assert!(!shared.may_send_zone_sums());
        assert!(c.authenticate(&headers("a")).unwrap().may_send_zone_sums());
        assert_eq!(c.outgoing().as_deref(), Some(&b"a"[..]));
    }

    #[test]
    fn without_tokens_everything_is_open() {
        assert_eq!(
            Credentials::open().authenticate(&http::HeaderMap::new()),
            Some(Principal::Open)
        );
        let shared = Credentials::shared(b"s".to_vec());
        assert_eq!(
            shared.authenticate(&headers("s")),
            Some(Principal::Shared(true))
        );
        assert_eq!(shared.authenticate(&headers("t")), None);
    }
}
