//! Noticing that a configuration file changed: filesystem events on its directory, and SIGHUP.
//!
//! The directory is watched rather than the file because Kubernetes updates a mounted
//! ConfigMap by swapping the `..data` symlink in that directory: the file's own inode never
//! changes, so a watch on the file alone would miss the update. Only events that name the file
//! or `..data` count. Events are debounced (an editor or the kubelet touches several entries at
//! once) and the callback decides, by the content's hash, whether anything really changed. Must
//! never: block the runtime, wake for a neighbour of the file, or stop watching because one
//! reload failed.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use notify::{RecursiveMode, Watcher};
use tokio::sync::{mpsc, watch};

/// Events closer together than this are one change.
const DEBOUNCE: Duration = Duration::from_millis(100);

/// What made the watcher call back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// Something changed in the file's directory.
    File,
    /// SIGHUP: reload even if the content looks the same.
    Signal,
}

/// Calls `on_change` after each (debounced) change of `path` or of its directory's `..data`
/// (`DIR/..data` stands for every entry of DIR) and on each SIGHUP, until `stop` turns true.
/// Fails only if the watch or the signal handler cannot be set up.
pub fn spawn<F, Fut>(
    path: &Path,
    mut stop: watch::Receiver<bool>,
    on_change: F,
) -> std::io::Result<tokio::task::JoinHandle<()>>
where
    F: Fn(Trigger) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    let dir: PathBuf = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path.file_name().map(|n| n.to_os_string());
    let (tx, mut rx) = mpsc::channel::<()>(1);
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        // Reading a file is an event too (inotify's open and close-without-write): a reload
        // that reads the files it watches would otherwise wake itself for ever. Only the file
        // itself and the ConfigMap's `..data` swap count: a neighbour (a log redirected into
        // the directory, which a failed reload writes to) would wake it for ever too.
        // Watching `DIR/..data` stands for every entry of DIR (a directory of token files).
        let every = name.as_deref().is_some_and(|n| n == "..data");
        let ours = |p: &PathBuf| {
            every
                || p.file_name()
                    .is_some_and(|n| Some(n) == name.as_deref() || n == "..data")
        };
        let changed = event.is_ok_and(|e| {
            !matches!(
                e.kind,
                notify::EventKind::Access(_) | notify::EventKind::Other
            ) && (e.paths.is_empty() || e.paths.iter().any(ours))
        });
        if changed {
            // Full means a change is already pending: nothing is lost by dropping this one.
            let _ = tx.try_send(());
        }
    })
    .map_err(std::io::Error::other)?;
    watcher
        .watch(&dir, RecursiveMode::NonRecursive)
        .map_err(|e| std::io::Error::other(format!("cannot watch {}: {e}", dir.display())))?;
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    Ok(tokio::spawn(async move {
        // Dropping the watcher ends the watch: it lives as long as this task.
        let _watcher = watcher;
        loop {
            tokio::select! {
                _ = stop.changed() => return,
                Some(()) = rx.recv() => {
                    tokio::time::sleep(DEBOUNCE).await;
                    while rx.try_recv().is_ok() {}
                    on_change(Trigger::File).await;
                }
                Some(()) = hup.recv() => on_change(Trigger::Signal).await,
            }
        }
    }))
}

/// A short, stable version of a configuration text: the first 16 hex digits of its SHA-1.
pub fn version_of(text: &str) -> String {
    let digest = sha1_smol::Sha1::from(text).digest().to_string();
    digest[..16].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// `name`, holding "one", in a directory of this process's own under the temp dir.
    fn fresh_file(dir: &str, name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("{dir}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join(name);
        std::fs::write(&file, "one").unwrap();
        file
    }

    #[tokio::test]
    async fn a_callback_that_reads_the_file_does_not_wake_itself() {
        let file = fresh_file("spillway-watch", "token");
        let (stop_tx, stop) = watch::channel(false);
        let calls = Arc::new(AtomicUsize::new(0));
        let (seen_tx, mut seen) = mpsc::channel::<()>(16);
        let (c, f) = (calls.clone(), file.clone());
        spawn(&file, stop, move |_| {
            let (c, f, seen_tx) = (c.clone(), f.clone(), seen_tx.clone());
            async move {
                // What every reload does: read the file it watches.
                let _ = std::fs::read(&f);
                c.fetch_add(1, Ordering::SeqCst);
                let _ = seen_tx.try_send(());
            }
        })
        .unwrap();
        std::fs::write(&file, "two").unwrap();
        tokio::time::timeout(Duration::from_secs(10), seen.recv())
            .await
            .expect("the change was seen");
        // Nothing signals "no more calls": give a loop ten debounce periods to show itself.
        tokio::time::sleep(DEBOUNCE * 10).await;
        assert_eq!(calls.load(Ordering::SeqCst), 1, "the callback woke itself");
        let _ = stop_tx.send(true);
    }

    /// Issue 48: stderr redirected into the config's directory made every failed reload's log
    /// line wake the watcher again, ten times a second for ever. Only the file and the
    /// ConfigMap's `..data` swap count.
    #[tokio::test]
    async fn only_the_file_and_a_configmap_swap_wake_it_not_its_neighbours() {
        let file = fresh_file("spillway-watch-n", "spillway.yaml");
        let dir = file.parent().unwrap().to_path_buf();
        let log = dir.join("stderr.log");
        let (stop_tx, stop) = watch::channel(false);
        let (seen_tx, mut seen) = mpsc::channel::<()>(64);
        spawn(&file, stop, move |_| {
            let seen_tx = seen_tx.clone();
            async move {
                let _ = seen_tx.try_send(());
            }
        })
        .unwrap();
        // A neighbour written many times: never a call.
        for i in 0..20 {
            std::fs::write(&log, format!("line {i}\n")).unwrap();
        }
        std::fs::write(&file, "two").unwrap();
        tokio::time::timeout(Duration::from_secs(10), seen.recv())
            .await
            .expect("the file's change was seen");
        // The kubelet's swap: a new `..data` symlink renamed over the old one.
        let tmp = dir.join("..data_tmp");
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(".", &tmp).unwrap();
        std::fs::rename(&tmp, dir.join("..data")).unwrap();
        tokio::time::timeout(Duration::from_secs(10), seen.recv())
            .await
            .expect("the ConfigMap's swap was seen");
        for i in 0..20 {
            std::fs::write(&log, format!("line {i}\n")).unwrap();
        }
        // Nothing signals "no more calls": give a loop ten debounce periods to show itself.
        tokio::time::sleep(DEBOUNCE * 10).await;
        assert!(seen.try_recv().is_err(), "a neighbour's writes woke it");
        let _ = stop_tx.send(true);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
