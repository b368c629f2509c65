//! The start check of `[runner] llama_server`: found, executable, and answering as
//! llama.cpp's llama-server does.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::program::NotRunnable;

/// Why the configured llama-server cannot run.  Each message names the key, so that the
/// reader knows what to change.
#[derive(Debug, thiserror::Error)]
pub enum LlamaServerProblem {
    /// A bare name that no directory on `PATH` holds as an executable.
    #[error(
        "[runner] llama_server: \"{name}\" is not found on PATH ({path}); models cannot load until it is \
         installed there or [runner] llama_server names the executable"
    )]
    NotOnPath {
        /// The configured name.
        name: String,
        /// The `PATH` searched.
        path: String,
    },
    /// A path that names nothing, or something that is not an executable file.
    #[error("[runner] llama_server: {} {why}; models cannot load until it names the llama-server executable", .path.display())]
    Unusable {
        /// The configured path.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
}

/// Where `llama_server` (a path, or a bare name looked up on `PATH`) resolves to, or why it
/// cannot run.
pub fn find_llama_server(llama_server: &Path) -> Result<PathBuf, LlamaServerProblem> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    crate::program::locate(llama_server, &path).map_err(|problem| match problem {
        NotRunnable::NotOnPath => LlamaServerProblem::NotOnPath {
            name: llama_server.display().to_string(),
            path: path.to_string_lossy().into_owned(),
        },
        NotRunnable::Unusable(why) => LlamaServerProblem::Unusable { path: llama_server.to_owned(), why },
    })
}

/// Checks `[runner] llama_server` at start: a warning now, naming the key and the path,
/// instead of an error at the first chat.  The daemon starts either way (the store can
/// still be used, and llama-server may be installed later).
pub(super) fn check_llama_server(llama_server: &Path) {
    match find_llama_server(llama_server) {
        Ok(found) => {
            tracing::debug!(llama_server = %found.display(), "llama-server is {}", found.display());
            // A wrong program (another tool, a broken build) is found by asking it, in the
            // background: readiness does not wait for it.
            tokio::spawn(probe_llama_server(found));
        }
        Err(e) => tracing::warn!(error = %e, "{e}"),
    }
}

/// Runs `llama-server --version` and warns, naming the key and the path, unless it
/// answers as llama.cpp's builds do (`version: ...`).
async fn probe_llama_server(path: PathBuf) {
    const WITHIN: Duration = Duration::from_secs(10);
    let run = tokio::process::Command::new(&path)
        .arg("--version")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let problem = match tokio::time::timeout(WITHIN, run).await {
        Ok(Ok(out)) => {
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            if out.status.success() && text.lines().any(|l| l.starts_with("version: ")) {
                let version = text.lines().find(|l| l.starts_with("version: ")).unwrap_or_default();
                tracing::debug!(llama_server = %path.display(), "llama-server's {version}");
                return;
            }
            let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("nothing").trim().to_owned();
            format!("`--version` exited with {} and printed \"{first}\"", out.status)
        }
        Ok(Err(e)) => format!("it cannot be run: {e}"),
        Err(_) => format!("`--version` did not answer within {}", crate::durations::human(WITHIN)),
    };
    tracing::warn!(
        llama_server = %path.display(),
        "[runner] llama_server: {} does not look like llama.cpp's llama-server ({problem}); loads will fail \
         until it names the llama-server executable",
        path.display()
    );
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_missing_or_unusable_llama_server_names_the_key_and_the_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("llama-server");
        let text = super::find_llama_server(&missing).expect_err("missing").to_string();
        assert!(text.starts_with("[runner] llama_server: "), "{text}");
        assert!(text.contains(&format!("{} does not exist", missing.display())), "{text}");
        std::fs::write(&missing, "#!/bin/sh\n").expect("write");
        let text = super::find_llama_server(&missing).expect_err("not executable").to_string();
        assert!(text.contains("is not executable"), "{text}");
        let text = super::find_llama_server(dir.path()).expect_err("a directory").to_string();
        assert!(text.contains("is not a file"), "{text}");
        let text =
            super::find_llama_server(std::path::Path::new("no-such-llama-server-here")).expect_err("none").to_string();
        assert!(text.contains("\"no-such-llama-server-here\" is not found on PATH ("), "{text}");
        assert_eq!(
            super::find_llama_server(std::path::Path::new("sh")).expect("sh is on PATH").file_name(),
            Some("sh".as_ref())
        );
    }
}
