//! Records the commit the binary was built from, for `spillway_build_info{commit}`:
//! `SPILLWAY_COMMIT` when set (an image build without `.git`), else `git rev-parse`, else
//! `unknown`.

use std::path::Path;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=SPILLWAY_COMMIT");
    // Only paths that exist: a missing one would rebuild the crate every time.
    for path in [".git/HEAD", ".git/refs/heads", ".git/packed-refs"] {
        if Path::new(path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    let commit = std::env::var("SPILLWAY_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .or_else(|| {
            let out = Command::new("git")
                .args(["rev-parse", "--short=12", "HEAD"])
                .output()
                .ok()?;
            out.status
                .success()
                .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
        })
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=SPILLWAY_COMMIT={commit}");
}
