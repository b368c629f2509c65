//! The project's setup scripts, run from tests: they install what a test needs once
//! (into a cache outside the checkout) and print where it is.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Runs `scripts/NAME` and returns the path it prints; a failure panics with the
/// script's stderr, since tests never skip for a missing tool.
pub fn run(name: &str) -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts").join(name);
    let output = Command::new("bash")
        .arg(&script)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{} failed ({}):\n{stderr}", script.display(), output.status);
    let printed = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    assert!(printed.exists(), "{} printed {}, which does not exist:\n{stderr}", script.display(), printed.display());
    printed
}
