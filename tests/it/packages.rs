//! The built .deb, end to end under real systemd 252 as PID 1: install it, let the first
//! connection start corrald, create a model from the tiny GGUF and pull one from a local
//! registry, chat, read the journal's offload event and the runner cgroups, restart and
//! SIGKILL without leaving a llama-server behind, and remove and purge the package.
//!
//! The package is built with `scripts/build-packages.sh` (the documented command, lintian
//! included); its release build is incremental, so once CI has built it this is quick.

use std::path::PathBuf;
use std::time::Duration;

use sha2::Digest as _;

use crate::support::container::{Container, describe, output_within, poll_until, repo_root};
use crate::support::journald::field;
use crate::systemd_container::{SETTLE, curl, wait_active_state, wait_event};

/// How long building the package may take: a release build from scratch on two cores.
const BUILD_TIMEOUT: Duration = Duration::from_secs(1200);
/// The registry inside the container.
/// (The container also runs the host's own docker-registry.service on port 5000.)
const REGISTRY: &str = "127.0.0.1:5055";

/// Runs `scripts/build-packages.sh KIND` and returns the packages it printed: corral's,
/// then corral-worker's.
fn build(kind: &str) -> (PathBuf, PathBuf) {
    // The environment of a shell, not of cargo and nextest: their variables would make the
    // release build's fingerprints differ from CI's own build, and rebuild it each time.
    let mut cmd = std::process::Command::new(repo_root().join("scripts/build-packages.sh"));
    cmd.arg(kind)
        .env_clear()
        .envs(std::env::vars().filter(|(k, _)| ["PATH", "HOME", "CARGO_HOME", "RUSTUP_HOME"].contains(&k.as_str())));
    let out = output_within(&mut cmd, BUILD_TIMEOUT);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "build-packages.sh {kind} failed:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let packages: Vec<PathBuf> = text.trim().lines().rev().take(2).map(PathBuf::from).collect();
    for package in &packages {
        assert!(package.extension().is_some_and(|e| e == kind) && package.is_file(), "no .{kind} printed: {text}");
    }
    let name = |p: &PathBuf| p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    match packages.as_slice() {
        [worker, corral] if name(worker).starts_with("corral-worker") && !name(corral).starts_with("corral-worker") => {
            (corral.clone(), worker.clone())
        }
        _ => panic!("corral's and corral-worker's .{kind}, in that order, expected: {text}"),
    }
}

/// `curl` with a JSON body; the status and body.
fn post(ct: &Container, path: &str, body: &serde_json::Value) -> (u16, String) {
    let url = format!("http://127.0.0.1:11434{path}");
    curl(ct, &["-H", "Content-Type: application/json", "-d", &body.to_string()], &url)
        .unwrap_or_else(|e| panic!("POST {path}: {e}"))
}

/// The pids of every llama-server in the container.
fn llama_servers(ct: &Container) -> String {
    let out = ct.exec(&["pgrep", "-x", "llama-server"]);
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn wait_no_llama_server(ct: &Container, after: &str) {
    poll_until(SETTLE, &format!("no llama-server left after {after}"), || {
        let left = llama_servers(ct);
        if left.is_empty() { Ok(()) } else { Err(format!("still running: {left}")) }
    });
}

/// Chats with `model` and returns the runner's pid (the only llama-server).
fn chat(ct: &Container, model: &str) -> String {
    let request = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "Hello"}],
        "stream": false,
        "options": {"num_predict": 4},
    });
    let (code, body) = post(ct, "/api/chat", &request);
    assert_eq!(code, 200, "chat with {model}: {body}");
    let reply: serde_json::Value = serde_json::from_str(&body).expect("chat JSON");
    assert_eq!(reply["done"], true, "{body}");
    assert_eq!(reply["message"]["role"], "assistant", "{body}");
    let pids = llama_servers(ct);
    assert_eq!(pids.lines().count(), 1, "one runner: {pids}");
    pids
}

/// Puts the package, the tiny model, llama-server and the test's configuration into the
/// container's share; returns the model's digest.
fn stage(ct: &Container, deb: &std::path::Path) -> String {
    let share = ct.share_dir();
    std::fs::copy(deb, share.join("corral.deb")).expect("stage the package");
    let model = corral::demo_model::tiny_llama_bytes().expect("tiny llama");
    let digest = format!("sha256:{}", hex::encode(sha2::Sha256::digest(&model)));
    std::fs::write(share.join("tiny.gguf"), &model).expect("stage the model");
    std::fs::copy(crate::support::llama::bin_dir().join("llama-server"), share.join("llama-server")).expect("stage");
    std::fs::write(
        share.join("50-test.toml"),
        format!(
            "[runner]\nllama_server = \"/srv/host/llama-server\"\n[store]\ninsecure_registries = [\"{REGISTRY}\"]\n\
             [scheduler]\nnum_ctx = 512\n[gpu]\nfixed = true\nhost_memory = \"2GiB\"\n"
        ),
    )
    .expect("config");
    std::fs::write(
        share.join("registry.yml"),
        format!(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: /var/lib/test-registry\n\
             http:\n  addr: {REGISTRY}\n"
        ),
    )
    .expect("registry config");

    digest
}

/// Pulls a model from a registry inside the container: pushes a copy of `tiny` there,
/// deletes it here and pulls it back; returns its name.
fn pull_from_a_local_registry(ct: &Container) -> String {
    ct.run(&["systemd-run", "--unit=test-registry", "/usr/bin/docker-registry", "serve", "/srv/host/registry.yml"]);
    poll_until(SETTLE, "the registry to answer", || curl(ct, &[], &format!("http://{REGISTRY}/v2/")));
    let remote = format!("{REGISTRY}/corral/tiny:v1");
    assert_eq!(post(ct, "/api/copy", &serde_json::json!({"source": "tiny", "destination": remote})).0, 200);
    let (code, body) = post(ct, "/api/push", &serde_json::json!({"model": remote, "insecure": true, "stream": false}));
    assert_eq!((code, body.as_str()), (200, r#"{"status":"success"}"#));
    let (code, body) = curl(
        ct,
        &["-X", "DELETE", "-d", &serde_json::json!({"model": remote}).to_string()],
        "http://127.0.0.1:11434/api/delete",
    )
    .expect("delete");
    assert_eq!(code, 200, "{body}");
    let (code, body) = post(ct, "/api/pull", &serde_json::json!({"model": remote, "insecure": true, "stream": false}));
    assert_eq!((code, body.as_str()), (200, r#"{"status":"success"}"#));
    let (_, tags) = curl(ct, &[], "http://127.0.0.1:11434/api/tags").expect("tags");
    assert!(tags.contains(&remote), "{tags}");

    remote
}

#[test]
fn the_deb_installs_serves_restarts_and_removes_cleanly_under_real_systemd() {
    let (deb, worker_deb) = build("deb");
    let ct = Container::boot("deb");
    let digest = stage(&ct, &deb);

    // This host was built as a container image, whose policy-rc.d forbids maintainer
    // scripts to start services (deb-systemd-invoke honours it); a real system has none.
    ct.run(&["rm", "-f", "/usr/sbin/policy-rc.d"]);

    // Install: the user, /etc/corral, and an enabled, listening socket; no service yet.
    ct.run(&["dpkg", "-i", "/srv/host/corral.deb"]);
    assert_eq!(ct.run(&["id", "-nG", "corral"]).split_whitespace().next(), Some("corral"));
    assert_eq!(ct.run(&["stat", "-c", "%a %U %G", "/etc/corral/corral.toml"]), "640 root corral");
    assert_eq!(ct.run(&["stat", "-c", "%a %U %G", "/etc/corral/corral.toml.d"]), "750 root corral");
    assert_eq!(ct.run(&["systemctl", "is-enabled", "corrald.socket"]), "enabled");
    assert_eq!(ct.unit_property("corrald.socket", "SubState"), "listening");
    assert_eq!(ct.unit_property("corrald.service", "ActiveState"), "inactive");
    ct.run(&["test", "-f", "/usr/share/man/man5/corral.toml.5.gz"]);
    // Shell completions, and a package that needs a system bus.
    for file in [
        "/usr/share/bash-completion/completions/corralctl",
        "/usr/share/zsh/vendor-completions/_corralctl",
        "/usr/share/fish/vendor_completions.d/corralctl.fish",
    ] {
        ct.run(&["test", "-s", file]);
    }
    let bash = ct.run(&["cat", "/usr/share/bash-completion/completions/corralctl"]);
    assert!(bash.contains("corralctl list --quiet"), "model names are completed: {bash}");
    let depends = ct.run(&["dpkg-query", "-W", "-f", "${Depends}", "corral"]);
    assert!(depends.contains("default-dbus-system-bus | dbus-system-bus"), "{depends}");
    // The installed unit, as the running systemd sees it, keeps its exposure low.
    let score = ct.exposure("corrald.service");
    assert!(score <= 2.0, "the installed corrald.service rates {score}");
    ct.run(&["install", "-m", "0640", "-g", "corral", "/srv/host/50-test.toml", "/etc/corral/corral.toml.d/"]);

    // The first request starts the service.
    let (code, body) = curl(&ct, &[], "http://127.0.0.1:11434/api/version").expect("first request");
    assert_eq!(code, 200, "{body}");
    wait_active_state(&ct, "corrald.service", "active");
    wait_event(&ct, "ready");

    // Create a model from the tiny GGUF: upload the blob, then create.
    let blob = format!("http://127.0.0.1:11434/api/blobs/{digest}");
    let (code, body) = curl(&ct, &["-T", "/srv/host/tiny.gguf", "-X", "POST"], &blob).expect("upload");
    assert_eq!(code, 201, "{body}");
    let create = serde_json::json!({"model": "tiny", "files": {"tiny.gguf": digest}, "stream": false});
    let (code, body) = post(&ct, "/api/create", &create);
    assert_eq!((code, body.as_str()), (200, r#"{"status":"success"}"#));

    // Chat; the runner's offload event reaches the journal with its fields.
    let runner = chat(&ct, "tiny");
    wait_event(&ct, "offload");
    the_offload_event_reports_the_plan_and_the_memory(&ct, &runner);

    // systemctl status shows the daemon's leaf and the runner's own cgroup.
    let status = ct.exec(&["systemctl", "status", "--no-pager", "-l", "corrald.service"]);
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(status.contains("├─daemon") || status.contains("─daemon"), "{status}");
    let runner_line = status.lines().position(|l| l.contains("─runner-")).unwrap_or_else(|| panic!("{status}"));
    let under = status.lines().nth(runner_line + 1).unwrap_or_default();
    assert!(under.contains(&runner) && under.contains("llama-server"), "the runner under its cgroup: {status}");

    d_bus_on_the_system_bus(&ct, &runner);

    let remote = pull_from_a_local_registry(&ct);
    the_readme_first_steps_work(&ct);

    // A restart stops the runner with the old instance.
    let main_pid = ct.unit_property("corrald.service", "MainPID");
    ct.run(&["systemctl", "restart", "corrald.service"]);
    wait_active_state(&ct, "corrald.service", "active");
    assert_ne!(ct.unit_property("corrald.service", "MainPID"), main_pid);
    wait_no_llama_server(&ct, "systemctl restart");

    // SIGKILL of the main process: systemd kills the rest of the cgroup, and the
    // socket starts a new instance on the next request.
    let runner = chat(&ct, &remote);
    let main_pid = ct.unit_property("corrald.service", "MainPID");
    ct.run(&["kill", "-KILL", &main_pid]);
    poll_until(SETTLE, "the runner to die with its daemon", || {
        if ct.exec(&["kill", "-0", &runner]).status.success() { Err(format!("{runner} alive")) } else { Ok(()) }
    });
    wait_no_llama_server(&ct, "SIGKILL of corrald");
    chat(&ct, "tiny");
    assert_ne!(ct.unit_property("corrald.service", "MainPID"), main_pid);

    // Removing the package stops everything and keeps the models.
    ct.run(&["dpkg", "-r", "corral"]);
    assert_eq!(ct.unit_property("corrald.socket", "ActiveState"), "inactive");
    assert_eq!(ct.unit_property("corrald.service", "ActiveState"), "inactive");
    wait_no_llama_server(&ct, "dpkg -r");
    assert!(ct.exec(&["pgrep", "-x", "corrald"]).stdout.is_empty(), "no corrald after removal");
    let blob_file = format!("/var/lib/corral/models/blobs/{}", digest.replace(':', "-"));
    ct.run(&["test", "-f", &blob_file]);
    ct.run(&["test", "-f", "/var/lib/corral/models/manifests/registry.ollama.ai/library/tiny/latest"]);
    assert!(curl(&ct, &[], "http://127.0.0.1:11434/api/version").is_err(), "nothing listens after removal");

    // Purging takes the models and the configuration too.
    ct.run(&["dpkg", "-P", "corral"]);
    for gone in ["/var/lib/corral", "/etc/corral", "/usr/bin/corrald"] {
        assert!(!ct.exec(&["test", "-e", gone]).status.success(), "{gone} is left after purge");
    }

    // The worker's package needs nothing of corral's.
    std::fs::copy(&worker_deb, ct.share_dir().join("corral-worker.deb")).expect("stage the worker package");
    the_worker_package_installs_an_enableable_unit(&ct);
}

/// corral-worker's .deb (staged at `/srv/host/corral-worker.deb`, with llama-server in
/// `/srv/host`): its files, an instance enabled and serving with the installed unit and
/// launcher, stopped on removal, its enablement and cache gone with a purge.
pub(crate) fn the_worker_package_installs_an_enableable_unit(ct: &Container) {
    std::fs::copy(crate::support::llama::bin_dir().join("rpc-server"), ct.share_dir().join("rpc-server"))
        .expect("stage rpc-server");
    ct.run(&["dpkg", "-i", "/srv/host/corral-worker.deb"]);
    for file in [
        "/lib/systemd/system/corral-rpc@.service",
        "/usr/libexec/corral/rpc-worker",
        "/usr/lib/sysusers.d/corral-rpc.conf",
        "/usr/share/man/man8/corral-rpc@.service.8.gz",
    ] {
        ct.run(&["test", "-s", file]);
    }
    ct.run(&["getent", "group", "render"]);
    assert_eq!(ct.run(&["dpkg-query", "-W", "-f", "${Depends}", "corral-worker"]), "systemd (>= 252)");

    // An instance on loopback, rpc-server named by a drop-in as the README shows.
    let unit = "corral-rpc@127.0.0.1:50052.service";
    ct.run(&["mkdir", "-p", &format!("/etc/systemd/system/{unit}.d")]);
    ct.run(&[
        "sh",
        "-c",
        &format!("printf '[Service]\\nEnvironment=CORRAL_RPC_SERVER=/srv/host/rpc-server\\n' >/etc/systemd/system/{unit}.d/rpc-server.conf"),
    ]);
    ct.run(&["systemctl", "daemon-reload"]);
    ct.run(&["systemctl", "enable", "--now", unit]);
    assert_eq!(ct.run(&["systemctl", "is-enabled", unit]), "enabled");
    ct.run(&["test", "-L", &format!("/etc/systemd/system/multi-user.target.wants/{unit}")]);
    wait_active_state(ct, unit, "active");
    let listing = poll_until(SETTLE, "the packaged worker to list its device", || {
        let out = ct.exec(&["/srv/host/llama-server", "--rpc", "127.0.0.1:50052", "--list-devices"]);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if text.contains("RPC0: 127.0.0.1:50052 (") { Ok(text) } else { Err(describe(&out)) }
    });
    assert!(listing.contains("MiB free)"), "{listing}");
    let score = ct.exposure(unit);
    assert!(score <= 2.5, "the installed {unit} rates {score}");

    // Removal stops it; a purge takes its enablement and its cache.
    ct.run(&["dpkg", "-r", "corral-worker"]);
    assert_eq!(ct.unit_property(unit, "ActiveState"), "inactive");
    ct.run(&["dpkg", "-P", "corral-worker"]);
    for gone in [
        format!("/etc/systemd/system/multi-user.target.wants/{unit}"),
        "/var/cache/private/corral-rpc".to_owned(),
        "/usr/libexec/corral/rpc-worker".to_owned(),
    ] {
        assert!(!ct.exec(&["test", "-e", &gone]).status.success(), "{gone} is left after purge");
    }
}

/// The runner's `offload` journal entry: its model and pid, the layers and memory, the
/// plan next to what was allocated, and what the runner's cgroup was charged.
fn the_offload_event_reports_the_plan_and_the_memory(ct: &Container, runner: &str) {
    let entries = ct.journal("corrald.service");
    let offload =
        entries.iter().find(|e| field(e, "CORRAL_EVENT").as_deref() == Some("offload")).expect("an offload entry");
    assert_eq!(field(offload, "CORRAL_MODEL").as_deref(), Some("tiny:latest"), "{offload}");
    assert_eq!(field(offload, "CORRAL_RUNNER_PID").as_deref(), Some(runner), "{offload}");
    // The plan next to what was allocated, and what the runner's cgroup was charged.
    let devices = field(offload, "CORRAL_DEVICES").unwrap_or_default();
    assert!(devices.starts_with("Host:planned=") && devices.contains(",actual="), "{offload}");
    for name in [
        "CORRAL_GPU_LAYERS",
        "CORRAL_TOTAL_LAYERS",
        "CORRAL_VRAM_BYTES",
        "CORRAL_RAM_BYTES",
        "CORRAL_PLANNED_RAM_BYTES",
    ] {
        let value = field(offload, name).unwrap_or_else(|| panic!("{name} missing: {offload}"));
        assert!(value.parse::<u64>().is_ok(), "{name}={value}");
    }
    // The cgroup's charge is reported wherever the runner's cgroup accounts memory.
    let accounted = ct
        .exec(&["sh", "-c", "ls /sys/fs/cgroup/corral.slice/corrald.service/runner-*/memory.current"])
        .status
        .success();
    let peak = field(offload, "CORRAL_MEMORY_PEAK_BYTES");
    assert_eq!(peak.is_some(), accounted, "the runner cgroup accounts memory: {accounted}; {offload}");
    assert!(peak.is_none_or(|p| p.parse::<u64>().is_ok_and(|p| p > 0)), "{offload}");
}

/// The shell commands of the README section headed `heading` (its first `sh` block).
fn readme_commands(heading: &str) -> Vec<String> {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).expect("README.md");
    let section = readme.split_once(&format!("\n{heading}\n")).map(|(_, rest)| rest).expect("the README section");
    let block = section.split_once("```sh\n").and_then(|(_, rest)| rest.split_once("```")).expect("a sh block").0;
    block.lines().filter(|l| !l.trim().is_empty()).map(str::to_owned).collect()
}

/// The README's "First steps", line by line as a new user types them, on the installed
/// package (the pull from the public registry needs the internet: the local registry's
/// pull above stands for it).
fn the_readme_first_steps_work(ct: &Container) {
    let commands = readme_commands("### First steps");
    assert!(commands.len() >= 8, "{commands:?}");
    let mut ran = Vec::new();
    for command in commands.iter().filter(|c| !c.contains("llama3.2")) {
        let out = ct.exec(&["bash", "-euo", "pipefail", "-c", command]);
        assert!(out.status.success(), "the README's `{command}` failed: {}", describe(&out));
        ran.push((command.as_str(), String::from_utf8_lossy(&out.stdout).into_owned()));
    }
    let output = |what: &str| {
        ran.iter().find(|(c, _)| c.contains(what)).map_or_else(|| panic!("no {what}"), |(_, o)| o.as_str())
    };
    assert!(output("api/version").contains("\"version\""), "{ran:?}");
    assert!(output("api/create").contains("success"), "{ran:?}");
    assert!(output("api/chat").contains("\"done\":true"), "{ran:?}");
    assert!(output("corralctl ps").contains("tiny:latest"), "{ran:?}");
    assert!(output("busctl introspect").contains("org.corral.Corral1.Manager"), "{ran:?}");
    assert!(output("CORRAL_EVENT=offload").contains("CORRAL_RUNNER_PID"), "{ran:?}");
    assert!(output("systemctl status").contains("runner-"), "{ran:?}");
}

/// `busctl` and `corralctl` on the container's real system bus, under the installed
/// policy: the loaded model and its runner are visible to all, changes only to root and
/// group `corral`, and a call to the name starts the service by bus activation.
fn d_bus_on_the_system_bus(ct: &Container, runner: &str) {
    const DEST: &str = "org.corral.Corral1";
    const MODEL: &str = "/org/corral/Corral1/models/tiny_3alatest";
    for file in ["Manager", "Model", "Job"] {
        ct.run(&["test", "-f", &format!("/usr/share/dbus-1/interfaces/org.corral.Corral1.{file}.xml")]);
    }
    ct.run(&["test", "-f", "/usr/share/man/man1/corralctl.1.gz"]);
    let owner = ct.run(&["busctl", "status", "--no-pager", DEST]);
    assert!(
        owner.contains("UID=") && owner.contains(&format!("PID={}", ct.unit_property("corrald.service", "MainPID"))),
        "{owner}"
    );
    let loaded =
        ct.run(&["busctl", "get-property", DEST, "/org/corral/Corral1", "org.corral.Corral1.Manager", "LoadedModels"]);
    assert_eq!(loaded, r#"as 1 "tiny:latest""#);
    let props = ct.run(&["busctl", "get-property", DEST, MODEL, "org.corral.Corral1.Model", "State", "Pid"]);
    assert_eq!(props, format!("s \"ready\"\nu {runner}"));
    let ps = ct.run(&["corralctl", "ps"]);
    assert!(ps.contains("tiny:latest") && ps.contains(runner), "{ps}");

    // Someone outside group corral may look but not act.
    ct.run(&["useradd", "--system", "--no-create-home", "corral-e2e-outsider"]);
    let as_outsider = |args: &[&str]| {
        let mut command =
            vec!["setpriv", "--reuid=corral-e2e-outsider", "--regid=corral-e2e-outsider", "--init-groups", "--"];
        command.extend_from_slice(args);
        ct.exec(&command)
    };
    let out = as_outsider(&["busctl", "call", DEST, "/org/corral/Corral1", "org.corral.Corral1.Manager", "ListModels"]);
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("tiny:latest"), "{}", describe(&out));
    let out = as_outsider(&["busctl", "call", DEST, MODEL, "org.corral.Corral1.Model", "Unload"]);
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("Access denied"),
        "{}",
        describe(&out)
    );
    let out = as_outsider(&["corralctl", "unload", "tiny"]);
    assert_eq!(out.status.code(), Some(77), "{}", describe(&out));
    assert_eq!(ct.run(&["busctl", "get-property", DEST, MODEL, "org.corral.Corral1.Model", "State"]), r#"s "ready""#);

    // Bus activation: with the service stopped, a call to the name starts it.
    ct.run(&["systemctl", "stop", "corrald.service"]);
    wait_no_llama_server(ct, "systemctl stop");
    let listed = ct.run(&["busctl", "call", DEST, "/org/corral/Corral1", "org.corral.Corral1.Manager", "ListModels"]);
    assert!(listed.contains("tiny:latest") && listed.contains("stopped"), "{listed}");
    wait_active_state(ct, "corrald.service", "active");
}

/// The .rpm from `packaging/rpm/corral.spec`: the files at Fedora's paths, the user from
/// sysusers.d before the files land, the socket enabled on a first install, and the
/// units stopped on removal and restarted on an upgrade.
#[test]
fn the_rpm_holds_the_units_and_the_scriptlets() {
    let (rpm, worker) = build("rpm");
    let query_of = |package: &PathBuf, args: &[&str]| {
        let out = output_within(
            std::process::Command::new("rpm").arg("-qp").args(args).arg(package),
            Duration::from_secs(60),
        );
        assert!(out.status.success(), "rpm -qp {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let query = |args: &[&str]| query_of(&rpm, args);
    let files = query(&["--list"]);
    for file in [
        "/usr/bin/corrald",
        "/usr/bin/corralctl",
        "/usr/share/dbus-1/system.d/org.corral.Corral1.conf",
        "/usr/share/dbus-1/system-services/org.corral.Corral1.service",
        "/usr/share/dbus-1/interfaces/org.corral.Corral1.Manager.xml",
        "/usr/lib/systemd/system/corrald.service",
        "/usr/lib/systemd/system/corrald.socket",
        "/usr/lib/systemd/system/corral.slice",
        "/usr/lib/systemd/user/corrald.service",
        "/usr/lib/systemd/user/corrald.socket",
        "/usr/lib/sysusers.d/corral.conf",
        "/usr/lib/tmpfiles.d/corral.conf",
        "/etc/corral/corral.toml",
        "/etc/corral/corral.toml.d",
        "/usr/share/bash-completion/completions/corralctl",
        "/usr/share/zsh/site-functions/_corralctl",
        "/usr/share/fish/vendor_completions.d/corralctl.fish",
    ] {
        assert!(files.lines().any(|l| l == file), "{file} missing from the rpm:\n{files}");
    }
    assert!(files.lines().any(|l| l.starts_with("/usr/share/man/man1/corralctl.1")), "{files}");
    let config = query(&["--configfiles"]);
    assert_eq!(config.trim(), "/etc/corral/corral.toml");
    let owners = query(&["--queryformat", "[%{FILEMODES:perms} %{FILEUSERNAME}:%{FILEGROUPNAME} %{FILENAMES}\n]"]);
    assert!(owners.contains("-rw-r----- root:corral /etc/corral/corral.toml\n"), "{owners}");
    let scripts = query(&["--scripts"]);
    let pre = scripts.split("postinstall scriptlet").next().unwrap_or_default();
    assert!(
        pre.contains("systemd-sysusers") && pre.contains("u corral -:corral"),
        "the user exists before the files: {scripts}"
    );
    assert!(scripts.contains("systemctl enable --now corrald.socket"), "{scripts}");
    assert!(scripts.contains("disable --now corrald.socket corrald.service"), "{scripts}");
    assert!(scripts.contains("try-restart corrald.socket corrald.service"), "{scripts}");
    let requires = query(&["--requires"]);
    assert!(requires.lines().any(|l| l.starts_with("systemd >= 252")), "{requires}");
    assert!(requires.lines().any(|l| l.trim() == "dbus"), "{requires}");

    // corral-worker: the unit, its launcher and man page, architecture-independent; its
    // instances stopped on removal and restarted on an upgrade; nothing of corral's needed.
    let files = query_of(&worker, &["--list"]);
    for file in [
        "/usr/lib/systemd/system/corral-rpc@.service",
        "/usr/libexec/corral/rpc-worker",
        "/usr/lib/sysusers.d/corral-rpc.conf",
    ] {
        assert!(files.lines().any(|l| l == file), "{file} missing from the worker rpm:\n{files}");
    }
    assert!(files.lines().any(|l| l.starts_with("/usr/share/man/man8/corral-rpc@.service.8")), "{files}");
    assert!(!files.contains("/usr/bin/"), "{files}");
    assert_eq!(query_of(&worker, &["--queryformat", "%{ARCH}"]), "noarch");
    let scripts = query_of(&worker, &["--scripts"]);
    assert!(scripts.contains("systemctl stop 'corral-rpc@*.service'"), "{scripts}");
    assert!(scripts.contains("systemctl try-restart 'corral-rpc@*.service'"), "{scripts}");
    let requires = query_of(&worker, &["--requires"]);
    assert!(requires.lines().any(|l| l.starts_with("systemd >= 252")), "{requires}");
    assert!(!requires.contains("corral"), "{requires}");
}
