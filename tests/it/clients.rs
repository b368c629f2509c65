//! The official Python clients from `PyPI` (`ollama`, `openai`, `anthropic`, pinned and installed once by
//! `scripts/setup-python-clients.sh`) against a real corrald with real llama-server
//! runners: the scripts in `tests/clients/` make the calls people make and assert on
//! the answers.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// The venv's python with the clients installed.  The first call in a test process runs
/// the setup script (seconds, once per cache); a failure panics, since these tests never skip.
fn python() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON
        .get_or_init(|| {
            let python = crate::support::setup::run("setup-python-clients.sh");
            assert!(python.is_file(), "{} is no python", python.display());
            python
        })
        .clone()
}

/// Starts corrald on that store and a free loopback port, runs `tests/clients/SCRIPT`
/// with the venv's python and `http://127.0.0.1:PORT`, and asserts that it exits 0.
fn run_client(script: &str) {
    let python = python();
    let dir = tempfile::tempdir().expect("tempdir");
    let (corrald, port, _notify) = crate::support::corrald::on_demo_store(dir.path());

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients").join(script);
    let output = Command::new(&python)
        .arg(&script)
        .arg(format!("http://127.0.0.1:{port}"))
        .env("NO_PROXY", "*")
        .env_remove("http_proxy")
        .env_remove("HTTP_PROXY")
        .env_remove("all_proxy")
        .env_remove("ALL_PROXY")
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    assert!(
        output.status.success(),
        "{} failed ({}):\n--- stdout\n{}\n--- stderr\n{}\n--- corrald\n{}",
        script.display(),
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
        corrald.stderr()
    );
}

#[test]
fn the_ollama_python_client_works() {
    run_client("ollama_client.py");
}

#[test]
fn the_openai_python_client_works() {
    run_client("openai_client.py");
}

#[test]
fn the_anthropic_python_client_works() {
    run_client("anthropic_client.py");
}
