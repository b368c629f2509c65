//! `corrald --check-config` on good and bad files: exit status and the message a person reads.

use std::process::Command;

use crate::support::corrald::{CORRALD, write_config};

struct Outcome {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

fn check(args: &[&str]) -> Outcome {
    let out = Command::new(CORRALD).arg("--check-config").args(args).output().expect("run corrald");
    Outcome {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

#[test]
fn a_valid_file_and_its_drop_ins_pass_and_are_listed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let main = write_config(dir.path(), "corral.toml", "[scheduler]\nkeep_alive = \"10m\"\n");
    std::fs::create_dir(dir.path().join("corral.toml.d")).expect("mkdir");
    write_config(&dir.path().join("corral.toml.d"), "10-port.toml", "[server]\nlisten = [\"127.0.0.1:9999\"]\n");
    let out = check(&["--config", main.to_str().expect("utf-8")]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(out.stdout.contains("configuration is valid"), "{}", out.stdout);
    assert!(out.stdout.contains("corral.toml\n"), "{}", out.stdout);
    assert!(out.stdout.contains("corral.toml.d/10-port.toml"), "{}", out.stdout);
}

#[test]
fn the_shipped_example_configuration_is_valid() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/packaging/corral.toml");
    let out = check(&["--config", example]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
}

#[test]
fn no_file_at_all_means_the_built_in_defaults() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(CORRALD)
        .arg("--check-config")
        .env("CONFIGURATION_DIRECTORY", dir.path())
        .output()
        .expect("run corrald");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0));
    assert!(stdout.contains("using the built-in defaults"), "{stdout}");
    assert!(stdout.contains(&dir.path().join("corral.toml").display().to_string()), "{stdout}");
}

#[test]
fn bad_files_exit_78_naming_file_line_key_and_expectation() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cases: &[(&str, &[&str])] = &[
        (
            "[server]\nlisten = [\"127.0.0.1:1\"]\nport = 1\n",
            &[":3: server.port: unknown field `port`", "expected one of `listen`, `shutdown_timeout`"],
        ),
        (
            "[scheduler]\nmax_loaded_models = \"three\"\n",
            &[":2: scheduler.max_loaded_models: invalid type: string \"three\""],
        ),
        ("[scheduler]\nkeep_alive = \"soon\"\n", &["scheduler.keep_alive", "is not a duration"]),
        ("[server]\nlisten = [\"11434\"]\n", &["server.listen", "neither an IP address with a port"]),
        ("[server]\napi_tokens = \"t\"\nmax_body = \"1G\"\n", &[":2: server.api_tokens", "expected a sequence"]),
        ("[[server]]\n", &[":1: server", "invalid type"]),
        ("this is not toml\n", &[":1:"]),
    ];
    for (i, (text, wanted)) in cases.iter().enumerate() {
        let path = write_config(dir.path(), &format!("bad{i}.toml"), text);
        let out = check(&["--config", path.to_str().expect("utf-8")]);
        assert_eq!(out.code, Some(78), "{text:?} should be rejected: {}", out.stdout);
        assert!(out.stderr.contains(&path.display().to_string()), "the file is named: {}", out.stderr);
        for w in *wanted {
            assert!(out.stderr.contains(w), "{text:?}: stderr should contain {w:?}: {}", out.stderr);
        }
    }
}

#[test]
fn a_bad_drop_in_is_named_even_when_the_main_file_is_good() {
    let dir = tempfile::tempdir().expect("tempdir");
    let main = write_config(dir.path(), "corral.toml", "");
    std::fs::create_dir(dir.path().join("corral.toml.d")).expect("mkdir");
    write_config(&dir.path().join("corral.toml.d"), "90-typo.toml", "[runner]\nllama_sever = \"x\"\n");
    let out = check(&["--config", main.to_str().expect("utf-8")]);
    assert_eq!(out.code, Some(78));
    assert!(out.stderr.contains("90-typo.toml:2: runner.llama_sever: unknown field `llama_sever`"), "{}", out.stderr);
}

#[test]
fn a_missing_explicit_file_is_an_error() {
    let out = check(&["--config", "/nonexistent/corral.toml"]);
    assert_eq!(out.code, Some(78));
    assert!(out.stderr.contains("/nonexistent/corral.toml: cannot read"), "{}", out.stderr);
}
