//! What ships beside the binary: the systemd units pass `systemd-analyze verify` with no output at all, and the
//! service's hardening keeps its exposure score low, and the man page renders cleanly.

use std::path::Path;
use std::process::Command;

use crate::support::corrald::CORRALD;

const UNITS: &[&str] = &["corrald.service", "corrald.socket", "corral.slice"];
/// The units for `systemctl --user`, in `systemd/user/`.
const USER_UNITS: &[&str] = &["corrald.service", "corrald.socket"];

/// Copies the units into `dir`, pointing `ExecStart=` at the binary under test.
fn stage_units(dir: &Path) {
    stage(dir, "systemd", UNITS);
}

fn stage(dir: &Path, from: &str, units: &[&str]) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(from);
    for unit in units {
        let text = std::fs::read_to_string(src.join(unit)).expect("read unit");
        std::fs::write(dir.join(unit), text.replace("/usr/bin/corrald", CORRALD)).expect("write unit");
    }
}

/// Runs `systemd-analyze ARGS` in a private mount namespace with a fresh /run, because
/// it writes below /run/systemd even when only checking files.
pub(crate) fn analyze(args: &[String]) -> (bool, String) {
    // The user manager's checks need a runtime directory.
    let script = r#"mount -t tmpfs tmpfs /run && mkdir -p -m 0700 /run/user/0 && exec systemd-analyze "$@""#;
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", script, "sh"])
        .args(args)
        .env("XDG_RUNTIME_DIR", "/run/user/0")
        .output()
        .expect("run unshare (util-linux) and systemd-analyze");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

#[test]
fn units_verify_without_a_single_warning() {
    let dir = tempfile::tempdir().expect("tempdir");
    stage_units(dir.path());
    let mut args = vec!["verify".to_owned(), "--man=no".to_owned()];
    args.extend(UNITS.iter().map(|u| dir.path().join(u).display().to_string()));
    let (ok, output) = analyze(&args);
    // verify exits 0 on unknown keys and bad values, and only warns: any output is a failure.
    assert!(ok && output.trim().is_empty(), "systemd-analyze verify:\n{output}");
}

#[test]
fn user_units_verify_without_a_single_warning() {
    let dir = tempfile::tempdir().expect("tempdir");
    stage(dir.path(), "systemd/user", USER_UNITS);
    let mut args = vec!["verify".to_owned(), "--user".to_owned(), "--man=no".to_owned()];
    args.extend(USER_UNITS.iter().map(|u| dir.path().join(u).display().to_string()));
    let (ok, output) = analyze(&args);
    assert!(ok && output.trim().is_empty(), "systemd-analyze verify --user:\n{output}");
}

#[test]
fn a_broken_unit_is_caught_by_the_same_check() {
    let dir = tempfile::tempdir().expect("tempdir");
    stage_units(dir.path());
    let path = dir.path().join("corrald.service");
    let text = std::fs::read_to_string(&path).expect("read");
    std::fs::write(&path, text.replace("KillMode=mixed", "KillMode=mixed\nRestartt=always")).expect("write");
    let (_, output) = analyze(&["verify".to_owned(), "--man=no".to_owned(), path.display().to_string()]);
    assert!(output.contains("Restartt"), "the check must see an unknown key: {output}");
}

#[test]
fn the_service_is_hardened() {
    let dir = tempfile::tempdir().expect("tempdir");
    stage_units(dir.path());
    let unit = dir.path().join("corrald.service").display().to_string();
    let (_, output) = analyze(&["security".to_owned(), "--offline=true".to_owned(), "--man=no".to_owned(), unit]);
    let score: f64 = output
        .lines()
        .find_map(|l| l.split("Overall exposure level for corrald.service:").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no exposure score in:\n{output}"));
    // GPU access rules out PrivateDevices= and MemoryDenyWriteExecute=, the delegated cgroup
    // ProtectControlGroups=, and pulling models PrivateNetwork=; the rest is on (1.8 today).
    assert!(score <= 2.0, "exposure {score} > 2.0:\n{output}");
    // The device ACL admits the GPUs (and nothing but pseudo devices besides).
    let acl =
        output.lines().find(|l| l.contains("DeviceAllow=")).unwrap_or_else(|| panic!("no DeviceAllow= in:\n{output}"));
    for device in ["char-nvidia-frontend:rw", "char-nvidia-uvm:rw", "char-drm:rw", "char-kfd:rw"] {
        assert!(acl.contains(device), "{device} missing from the device ACL: {acl}");
    }
}

#[test]
fn the_man_page_renders_without_warnings() {
    let page = concat!(env!("CARGO_MANIFEST_DIR"), "/packaging/man/corrald.8");
    let out = Command::new("groff").args(["-man", "-ww", "-z", page]).output().expect("run groff (groff-base)");
    let warnings = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && warnings.is_empty(), "groff: {warnings}");
    let text = std::fs::read_to_string(page).expect("read");
    for option in ["--config", "--check-config", "--log-target"] {
        assert!(text.contains(&option.replace('-', "\\-")), "the man page documents {option}");
    }
}

#[test]
fn the_configuration_man_page_renders_and_documents_every_key() {
    let page = concat!(env!("CARGO_MANIFEST_DIR"), "/packaging/man/corral.toml.5");
    let out = Command::new("groff").args(["-man", "-ww", "-z", page]).output().expect("run groff (groff-base)");
    let warnings = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && warnings.is_empty(), "groff: {warnings}");
    let text = std::fs::read_to_string(page).expect("read");
    // Every key the shipped configuration sets or shows commented out has an entry.
    let example = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/packaging/corral.toml")).expect("read");
    let keys: Vec<&str> = example
        .lines()
        .map(|l| l.trim_start_matches("# ").trim_start_matches('#'))
        .filter_map(|l| l.split_once(" = ").map(|(k, _)| k.trim()))
        .filter(|k| !k.is_empty() && k.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
        .collect();
    assert!(keys.contains(&"exit_on_idle") && keys.len() > 20, "{keys:?}");
    for key in keys {
        assert!(text.contains(&format!("\\fB{}\\fR", key.replace('-', "\\-"))), "corral.toml(5) documents {key}");
    }
}
