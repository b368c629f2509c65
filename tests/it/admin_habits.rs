//! What systemd admins expect of corrald and corralctl, without PID-1 systemd (the unit
//! behaviour under real systemd is in `systemd_container.rs`): a rejected configuration
//! answered and named, a missing llama-server named at start and at load, reading that
//! never starts corrald, a bus that is down blamed as such, `--user` on the session bus,
//! model names in shell completion, and every journal event in the README's table.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use crate::support::bus::PrivateBus;
use crate::support::container::{describe, output_within};
use crate::support::corrald::{CORRALD, Corrald, free_port, write_config};
use crate::support::dbus::BusDaemon;
use crate::support::notify::NotifyListener;

const CORRALCTL: &str = env!("CARGO_BIN_EXE_corralctl");
const WAIT: Duration = Duration::from_secs(60);

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The demo store in `dir` and a configuration for it (a free loopback port, `extra`
/// appended): its path and the port.
fn on_demo_store(dir: &Path, extra: &str) -> (std::path::PathBuf, u16) {
    crate::support::api::demo_store(dir);
    let port = free_port();
    let store = dir.join("models");
    let text = format!("[server]\nlisten = [\"127.0.0.1:{port}\"]\n[store]\npath = \"{}\"\n{extra}", store.display());
    (write_config(dir, "corral.toml", &text), port)
}

/// A raw HTTP/1.0 GET on `port`: the status line and the body.
fn get(port: u16, path: &str) -> (String, String) {
    use std::io::{Read, Write};
    // systemd-socket-activate may not be listening yet.
    let mut stream = crate::support::http::connect("the socket", || std::net::TcpStream::connect(("127.0.0.1", port)));
    stream.set_read_timeout(Some(WAIT)).expect("timeout");
    write!(stream, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").expect("write");
    let mut text = String::new();
    stream.read_to_string(&mut text).expect("read");
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    (head.lines().next().unwrap_or_default().to_owned(), body.to_owned())
}

#[test]
fn a_rejected_configuration_answers_the_waiting_connection_and_exits_78() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = write_config(dir.path(), "corral.toml", "[scheduler]\nkeep_alive = \"soon\"\n");
    let notify = NotifyListener::start();
    let port = free_port();
    let mut corrald = Corrald::socket_activated(
        &[format!("127.0.0.1:{port}")],
        &["--config", config.to_str().expect("utf-8")],
        notify.path(),
        &[],
    );
    // The connection that starts it is told where to look, not left with a closed socket
    // or a hang.
    let (status, body) = get(port, "/api/tags");
    assert!(status.contains("503"), "{status} {body}");
    let error: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    let error = error["error"].as_str().expect("an error");
    assert!(error.starts_with("corrald is not running: its configuration is rejected"), "{error}");
    assert!(error.contains("`journalctl -u corrald`") && error.contains("`corrald --check-config`"), "{error}");
    // The reason itself (which may quote a secret) stays in the journal.
    assert!(
        !error.contains("soon") && !error.contains("corral.toml"),
        "the rejected value reached the client: {error}"
    );
    let status = corrald.wait_exit(WAIT);
    assert_eq!(status.code(), Some(78), "{}", corrald.stderr());
    // The log entry's message carries the reason itself, not only a field.
    let log = corrald.stderr();
    let line = log.lines().find(|l| l.contains("invalid configuration")).unwrap_or_else(|| panic!("{log}"));
    assert!(line.contains("invalid configuration, not starting: ") && line.contains("is not a duration"), "{line}");
}

#[test]
fn a_missing_llama_server_is_named_at_start_and_at_load_without_its_path_for_clients() {
    let dir = tempfile::tempdir().expect("tempdir");
    crate::support::api::demo_store(dir.path());
    let missing = dir.path().join("opt/llama-server");
    let port = free_port();
    let config = write_config(
        dir.path(),
        "corral.toml",
        &format!(
            "[server]\nlisten = [\"127.0.0.1:{port}\"]\n[store]\npath = \"{}\"\n[runner]\nllama_server = \"{}\"\n\
             [dbus]\nbus = \"off\"\n[gpu]\nfixed = true\nhost_memory = \"2GiB\"\n",
            dir.path().join("models").display(),
            missing.display()
        ),
    );
    let corrald = Corrald::start(&["--config", config.to_str().expect("utf-8")], None);
    corrald.wait_stderr("corrald ready", WAIT);
    let log = corrald.stderr();
    let ready_at = log.find("corrald ready").expect("ready");
    let warning = log.find(&format!("[runner] llama_server: {} does not exist", missing.display()));
    assert!(warning.is_some_and(|at| at < ready_at), "a warning before ready naming the key and the path:\n{log}");

    let stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    let reply = crate::support::http::request(
        stream,
        "POST",
        "/api/generate",
        Some(r#"{"model": "chat", "prompt": "hi", "stream": false}"#),
    );
    let error = reply.json()["error"].as_str().unwrap_or_default().to_owned();
    assert!(error.contains("[runner] llama_server = …/llama-server"), "the client is told the key: {}", reply.body);
    assert!(!error.contains(&dir.path().display().to_string()), "{error}");
    // The journal (here stderr) has the whole path.
    corrald.wait_stderr(&format!("cannot start llama-server ([runner] llama_server = {})", missing.display()), WAIT);

    // A program that is not llama-server is named too (asked for its version).
    let wrong = write_config(
        dir.path(),
        "wrong.toml",
        &format!(
            "[server]\nlisten = [\"127.0.0.1:{}\"]\n[runner]\nllama_server = \"/bin/true\"\n[dbus]\nbus = \"off\"\n\
             [gpu]\nfixed = true\nhost_memory = \"2GiB\"\n[store]\npath = \"{}\"\n",
            free_port(),
            dir.path().join("models").display()
        ),
    );
    let other = Corrald::start(&["--config", wrong.to_str().expect("utf-8")], None);
    other.wait_stderr("[runner] llama_server: /bin/true does not look like llama.cpp's llama-server", WAIT);

    // --check-config warns too, and still says the configuration is valid.
    let out = output_within(Command::new(CORRALD).args(["--check-config", "--config"]).arg(&config), WAIT);
    assert!(out.status.success(), "{}", describe(&out));
    assert!(stderr(&out).contains("warning: [runner] llama_server: "), "{}", describe(&out));
}

/// A bus whose activation runs `marker.sh` for `org.corral.Corral1`: the script leaves a
/// file behind and fails, so a test sees whether anything tried to start corrald.
struct ActivatingBus {
    dir: tempfile::TempDir,
    daemon: std::process::Child,
    address: String,
}

impl ActivatingBus {
    fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let services = dir.path().join("services");
        std::fs::create_dir(&services).expect("mkdir");
        let script = dir.path().join("marker.sh");
        std::fs::write(&script, format!("#!/bin/sh\ntouch {}\nexit 1\n", dir.path().join("started").display()))
            .expect("script");
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        std::fs::write(
            services.join("org.corral.Corral1.service"),
            format!("[D-BUS Service]\nName=org.corral.Corral1\nExec={}\n", script.display()),
        )
        .expect("service file");
        let socket = dir.path().join("bus");
        // A session-type bus: activation runs Exec= itself (a system bus would need the
        // setuid launch helper).
        let config = format!(
            "<!DOCTYPE busconfig PUBLIC \"-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN\" \
             \"http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd\">\n<busconfig><type>session</type>\
             <listen>unix:path={}</listen><servicedir>{}</servicedir><auth>EXTERNAL</auth>\
             <policy context=\"default\"><allow send_destination=\"*\" eavesdrop=\"true\"/><allow eavesdrop=\"true\"/>\
             <allow own=\"*\"/></policy></busconfig>\n",
            socket.display(),
            services.display()
        );
        std::fs::write(dir.path().join("bus.conf"), config).expect("bus.conf");
        let mut daemon = Command::new("dbus-daemon")
            .arg(format!("--config-file={}", dir.path().join("bus.conf").display()))
            .args(["--nofork", "--nopidfile", "--nosyslog", "--print-address"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("dbus-daemon");
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(daemon.stdout.take().expect("stdout")), &mut line)
            .expect("address");
        assert!(line.starts_with("unix:"), "{line}");
        Self { dir, daemon, address: line.trim().to_owned() }
    }

    fn started(&self) -> bool {
        self.dir.path().join("started").exists()
    }

    fn ctl(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new(CORRALCTL);
        cmd.args(args)
            .env("DBUS_SYSTEM_BUS_ADDRESS", &self.address)
            .env("DBUS_SESSION_BUS_ADDRESS", "unix:path=/nonexistent");
        output_within(&mut cmd, WAIT)
    }
}

impl Drop for ActivatingBus {
    fn drop(&mut self) {
        let _ = self.daemon.kill();
        let _ = self.daemon.wait();
    }
}

#[test]
fn reading_never_starts_corrald_and_changing_may() {
    let bus = ActivatingBus::start();
    for args in [&["ps"][..], &["list"], &["list", "--quiet"], &["show", "chat"], &["status"], &["--system", "ps"]] {
        let started = std::time::Instant::now();
        let out = bus.ctl(args);
        assert_eq!(out.status.code(), Some(69), "corralctl {args:?}: {}", describe(&out));
        let text = stderr(&out);
        assert!(text.contains("corrald is not running"), "{args:?}: {text}");
        assert!(text.contains("reading does not start it"), "{args:?}: {text}");
        assert!(!bus.started(), "corralctl {args:?} started corrald by bus activation");
        assert!(started.elapsed() < Duration::from_secs(15), "{args:?} took {:?}", started.elapsed());
    }
    // A change may start it: activation runs (and fails here), and the error says so, promptly.
    let out = bus.ctl(&["load", "chat"]);
    assert_eq!(out.status.code(), Some(69), "{}", describe(&out));
    assert!(bus.started(), "load did not try to start corrald");
    assert!(stderr(&out).contains("corrald is not running"), "{}", describe(&out));
}

#[test]
fn with_the_bus_down_corralctl_blames_the_bus_not_corrald() {
    let dir = tempfile::tempdir().expect("tempdir");
    for args in [&["ps"][..], &["load", "chat"], &["--user", "list"]] {
        let mut cmd = Command::new(CORRALCTL);
        cmd.args(args)
            .env("DBUS_SYSTEM_BUS_ADDRESS", format!("unix:path={}/system", dir.path().display()))
            .env("DBUS_SESSION_BUS_ADDRESS", format!("unix:path={}/session", dir.path().display()));
        let out = output_within(&mut cmd, WAIT);
        assert_eq!(out.status.code(), Some(69), "{}", describe(&out));
        let text = stderr(&out);
        let bus = if args[0] == "--user" { "session" } else { "system" };
        assert!(text.starts_with(&format!("corralctl: cannot connect to the {bus} bus (")), "{text}");
        assert!(text.contains("is D-Bus running?") && !text.contains("corrald is not running"), "{text}");
    }
}

/// `corrald --user` (what the user units run) serves D-Bus on the session bus, and a plain
/// `corralctl` finds it there without options.
#[test]
fn corrald_user_serves_the_session_bus_and_corralctl_finds_it_there() {
    crate::support::dbus::ensure_users();
    let bus = PrivateBus::start(&crate::support::dbus::policy());
    let dir = tempfile::tempdir().expect("tempdir");
    let (config, _port) = on_demo_store(dir.path(), "[gpu]\nfixed = true\nhost_memory = \"2GiB\"\n");
    let mut cmd = Command::new(CORRALD);
    cmd.args(["--user", "--log-target", "stderr", "--config"]).arg(&config);
    cmd.env("DBUS_SESSION_BUS_ADDRESS", bus.address()).env("DBUS_SYSTEM_BUS_ADDRESS", "unix:path=/nonexistent");
    let corrald = Corrald::spawn(cmd);
    corrald.wait_stderr("serving D-Bus", WAIT);
    assert!(corrald.stderr().contains("bus=Session"), "{}", corrald.stderr());

    let mut ctl = Command::new(CORRALCTL);
    ctl.args(["list", "--quiet"])
        .env("DBUS_SESSION_BUS_ADDRESS", bus.address())
        .env("DBUS_SYSTEM_BUS_ADDRESS", "unix:path=/nonexistent");
    let out = output_within(&mut ctl, WAIT);
    assert!(out.status.success(), "{}", describe(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "chat:latest\nembed:latest\n");
}

#[test]
fn bash_completes_model_names_from_corrald() {
    let rig = BusDaemon::start("[gpu]\nfixed = true\nhost_memory = \"2GiB\"\n");
    let bin = Path::new(CORRALCTL).parent().expect("bin dir").display().to_string();
    let script = format!(
        "export PATH={bin}:$PATH; source <(corralctl completions bash)\n\
         complete -p corralctl\n\
         COMP_WORDS=(corralctl show ''); COMP_CWORD=2; _corralctl_with_models corralctl '' show\n\
         printf 'show:%s\\n' \"${{COMPREPLY[@]}}\"\n\
         COMP_WORDS=(corralctl --system rm e); COMP_CWORD=3; _corralctl_with_models corralctl e rm\n\
         printf 'rm:%s\\n' \"${{COMPREPLY[@]}}\"\n\
         COMP_WORDS=(corralctl pu); COMP_CWORD=1; _corralctl_with_models corralctl pu corralctl\n\
         printf 'sub:%s\\n' \"${{COMPREPLY[@]}}\"\n"
    );
    let out = rig.bus.run_as(None, &["bash", "-c", &script]);
    assert!(out.status.success(), "{}", describe(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("-F _corralctl_with_models corralctl"), "{text}");
    assert!(text.contains("show:chat:latest\nshow:embed:latest\n"), "{text}");
    assert!(text.contains("rm:embed:latest\n") && !text.contains("rm:chat"), "{text}");
    // Elsewhere, clap's own completion: subcommands.
    assert!(text.contains("sub:pull\nsub:push\n"), "{text}");
}

/// zsh: the stored-model arguments are completed by `_corralctl_models`, which offers
/// corrald's model names whole (colons and all). Completion itself needs a terminal, so
/// `compadd` is stood in for by one that prints what it was given.
#[test]
fn zsh_completes_model_names_from_corrald() {
    let rig = BusDaemon::start("[gpu]\nfixed = true\nhost_memory = \"2GiB\"\n");
    let bin = Path::new(CORRALCTL).parent().expect("bin dir").display().to_string();
    let script = format!(
        "export PATH={bin}:$PATH\n\
         corralctl completions zsh > $TMPDIR/_corralctl || exit 1\n\
         zsh -n $TMPDIR/_corralctl || exit 1\n\
         grep -c ':_corralctl_models' $TMPDIR/_corralctl\n\
         compdef() {{ :; }}\n\
         source $TMPDIR/_corralctl\n\
         compadd() {{ [[ $1 == -a ]] && printf 'name:%s\\n' \"${{(@P)2}}\"; }}\n\
         _corralctl_models\n"
    );
    let tmp = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let out = rig.bus.run_as(None, &["env", &format!("TMPDIR={}", tmp.path().display()), "zsh", "-f", "-c", &script]);
    assert!(out.status.success(), "{}", describe(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    let pointed = text.lines().next().and_then(|n| n.parse::<u32>().ok()).expect("grep's count");
    assert!(pointed >= 6, "show, load, unload, rm, cp and run complete names: {text}");
    assert!(text.contains("name:chat:latest\nname:embed:latest\n"), "{text}");
}

/// corrald(8) points only at what the packages ship, and at corral.toml(5).
#[test]
fn the_daemon_manual_names_shipped_files_and_the_configuration_manual() {
    let root = crate::support::container::repo_root();
    let page = std::fs::read_to_string(root.join("packaging/man/corrald.8")).expect("corrald.8");
    let see_also = page.split(".SH SEE ALSO").nth(1).expect("a SEE ALSO section");
    assert!(see_also.contains(".BR corral.toml (5)"), "{see_also}");
    let cargo = std::fs::read_to_string(root.join("Cargo.toml")).expect("Cargo.toml");
    for doc in page.split_whitespace().filter(|w| w.contains("/usr/share/doc/")) {
        let shipped = doc.trim_start_matches("/usr/share/doc/corral/").trim_end_matches(['.', ',']);
        assert!(
            cargo.contains(&format!("\"{shipped}\", \"usr/share/doc/corral/")),
            "corrald(8) names {doc}, which is not shipped"
        );
    }
    assert!(page.contains("RestartPreventExitStatus=78") && page.contains("\\-\\-user"), "{page}");
}

/// Every journal event corrald logs (`corral_event = "…"` in its source, `CORRAL_EVENT=` in
/// the journal) has a row in the README's table of them, which admins filter by.
#[test]
fn every_journal_event_is_in_the_readmes_table() {
    fn sources(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("read src/") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                sources(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let root = crate::support::container::repo_root();
    let mut files = Vec::new();
    sources(&root.join("src"), &mut files);
    let logged = regex::Regex::new(r#"corral_event = "([a-z_-]+)""#).expect("regex");
    let events: std::collections::BTreeSet<String> = files
        .iter()
        .flat_map(|f| {
            let text = std::fs::read_to_string(f).expect("a source file");
            logged.captures_iter(&text).map(|c| c[1].to_owned()).collect::<Vec<_>>()
        })
        .collect();
    assert!(events.len() > 20 && events.contains("offload"), "the pattern finds the events: {events:?}");
    // The table's first cells: "| `create`, `delete` | …".
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let table = readme.split("| `CORRAL_EVENT` | when |").nth(1).expect("the table of events");
    let named = regex::Regex::new(r"`([a-z_-]+)`").expect("regex");
    let documented: std::collections::BTreeSet<String> = table
        .lines()
        .skip(1)
        .take_while(|l| l.starts_with('|'))
        .flat_map(|l| {
            named.captures_iter(l.split('|').nth(1).unwrap_or_default()).map(|c| c[1].to_owned()).collect::<Vec<_>>()
        })
        .collect();
    let missing: Vec<&String> = events.difference(&documented).collect();
    assert!(missing.is_empty(), "logged but not in the README's table: {missing:?}");
    let stale: Vec<&String> = documented.difference(&events).collect();
    assert!(stale.is_empty(), "in the README's table but never logged: {stale:?}");
}

/// corrald keeps its listing of the models in its state directory between runs: after a
/// restart, listings answer from it at once, and one walk of the store then brings in what
/// other programs changed while corrald was down, reading only those manifests.
#[test]
fn a_restart_lists_from_the_saved_listing_and_then_what_changed_while_down() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (config, port) = on_demo_store(dir.path(), "[dbus]\nbus = \"off\"\n");
    let state = dir.path().join("state");
    let start = || {
        let notify = NotifyListener::start();
        let mut cmd = Command::new(CORRALD);
        cmd.args(["--log-target", "stderr", "--config", config.to_str().expect("utf-8")]);
        cmd.env("NOTIFY_SOCKET", notify.path()).env("STATE_DIRECTORY", &state).env("RUST_LOG", "corral=debug");
        let corrald = Corrald::spawn(cmd);
        notify.wait_for("READY", "1", WAIT);
        corrald
    };
    let names = || -> Vec<String> {
        let tags = crate::support::http::tcp(([127, 0, 0, 1], port).into(), "GET", "/api/tags");
        let body: serde_json::Value = serde_json::from_str(&tags.body).expect("json");
        let mut names: Vec<String> = body["models"]
            .as_array()
            .expect("models")
            .iter()
            .map(|m| m["name"].as_str().expect("name").to_owned())
            .collect();
        names.sort();
        names
    };

    let mut first = start();
    assert_eq!(first.state_dir(), state);
    assert_eq!(names(), ["chat:latest", "embed:latest"]);
    first.wait_stderr("listed the models models=2 read=2", WAIT);
    first.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(first.wait_exit(WAIT).success(), "{}", first.stderr());
    // A stop while the start's walks or collection run is no error (a task the stop
    // cancelled was once logged as a panic).
    assert!(!first.stderr().contains(" ERROR "), "{}", first.stderr());
    let saved = std::fs::read_to_string(state.join("listing.json")).expect("the listing saved in the state directory");
    assert!(saved.contains("\"chat:latest\"") && saved.contains("\"embed:latest\""), "{saved}");

    // While corrald is down, another program removes one model and adds another.
    let library = dir.path().join("models/manifests/registry.ollama.ai/library");
    std::fs::remove_dir_all(library.join("embed")).expect("rm");
    std::fs::create_dir(library.join("outside")).expect("mkdir");
    std::fs::copy(library.join("chat/latest"), library.join("outside/latest")).expect("copy the manifest");

    let second = start();
    // The check reads only the manifest it did not know; the listing then shows the store.
    second.wait_stderr("listed the models models=2 read=1", WAIT);
    assert_eq!(names(), ["chat:latest", "outside:latest"]);
    drop(second);
    let saved = std::fs::read_to_string(state.join("listing.json")).expect("saved again");
    assert!(saved.contains("\"outside:latest\"") && !saved.contains("\"embed:latest\""), "{saved}");
}

/// An administrator may hold corrald to few open files (`LimitNOFILE=`): a store of more
/// models than that still lists every one, as the walk opens one model's directory at a
/// time (it once held every directory of a namespace open at once, and left out the models
/// past the limit).
#[test]
fn a_store_of_more_models_than_files_corrald_may_open_lists_them_all() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (config, port) = on_demo_store(dir.path(), "[dbus]\nbus = \"off\"\n");
    let library = dir.path().join("models/manifests/registry.ollama.ai/library");
    for i in 0..300 {
        let model = library.join(format!("many{i:03}"));
        std::fs::create_dir(&model).expect("mkdir");
        std::fs::copy(library.join("chat/latest"), model.join("latest")).expect("copy the manifest");
    }
    let notify = NotifyListener::start();
    let mut cmd = Command::new("prlimit");
    cmd.args(["--nofile=128:128", "--", CORRALD, "--log-target", "stderr", "--config"]).arg(&config);
    cmd.env("NOTIFY_SOCKET", notify.path());
    let corrald = Corrald::spawn(cmd);
    notify.wait_for("READY", "1", WAIT);
    let (status, body) = get(port, "/api/tags");
    assert!(status.contains(" 200 "), "{status}: {body}");
    let tags: serde_json::Value = serde_json::from_str(&body).expect("json");
    let listed = tags["models"].as_array().expect("models").len();
    assert_eq!(listed, 302, "every model, under a limit of 128 open files: {}", corrald.stderr());
}
