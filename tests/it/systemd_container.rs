//! corrald's units under real systemd 252 as PID 1 (a throwaway container per test):
//! socket activation over TCP and the UNIX socket, readiness and status, the journal,
//! reload and stop.

use std::time::Duration;

use crate::support::container::{Container, describe, poll_until};
use crate::support::journald::{corrald_events, field, is_corrald_event, summary};

/// How long a state change of a unit may take on a busy machine.
pub(crate) const SETTLE: Duration = Duration::from_secs(60);

/// `curl` inside the container: the HTTP status and body, or curl's complaint.
pub(crate) fn curl(ct: &Container, extra: &[&str], url: &str) -> Result<(u16, String), String> {
    let mut args = vec!["curl", "-sS", "--max-time", "30", "-w", "\n%{http_code}"];
    args.extend_from_slice(extra);
    args.push(url);
    let out = ct.exec(&args);
    if !out.status.success() {
        return Err(describe(&out));
    }
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').ok_or_else(|| format!("no status line in {text:?}"))?;
    Ok((code.trim().parse().map_err(|e| format!("bad status {code:?}: {e}"))?, body.to_owned()))
}

fn assert_version(result: Result<(u16, String), String>, via: &str) {
    let (code, body) = result.unwrap_or_else(|e| panic!("GET /api/version via {via} failed: {e}"));
    assert_eq!(code, 200, "GET /api/version via {via}: {body}");
    let json: serde_json::Value =
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("via {via}: not JSON ({e}): {body}"));
    assert_eq!(json["corral_version"], env!("CARGO_PKG_VERSION"), "via {via}: {body}");
    assert_eq!(json["version"], corral::http::OLLAMA_VERSION, "via {via}: {body}");
}

pub(crate) fn wait_active_state(ct: &Container, unit: &str, want: &str) {
    poll_until(SETTLE, &format!("{unit} to be {want}"), || {
        let state = ct.unit_property(unit, "ActiveState");
        if state == want { Ok(()) } else { Err(state) }
    });
}

/// Waits until corrald's journal entries include `event`, and returns that entry's MESSAGE.
pub(crate) fn wait_event(ct: &Container, event: &str) -> String {
    poll_until(SETTLE, &format!("CORRAL_EVENT={event} in the journal of corrald.service"), || {
        let entries = ct.journal("corrald.service");
        entries
            .iter()
            .find(|e| is_corrald_event(e, event))
            .map(|e| field(e, "MESSAGE").unwrap_or_default())
            .ok_or_else(|| summary(&entries))
    })
}

#[test]
fn socket_activation_status_journal_reload_and_stop() {
    let ct = Container::boot("lifecycle");
    ct.install_corral();

    // The socket listens; nothing runs yet.
    ct.run(&["systemctl", "start", "corrald.socket"]);
    assert_eq!(ct.unit_property("corrald.socket", "ActiveState"), "active");
    assert_eq!(ct.unit_property("corrald.socket", "SubState"), "listening");
    assert_eq!(ct.unit_property("corrald.service", "ActiveState"), "inactive");
    assert_eq!(ct.unit_property("corrald.service", "MainPID"), "0");
    let listening = ct.run(&["systemctl", "show", "-P", "Listen", "corrald.socket"]);
    assert!(listening.contains("127.0.0.1:11434") && listening.contains("/run/corral.sock"), "{listening}");

    // The first connection starts the service and is answered by it.
    assert_version(curl(&ct, &[], "http://127.0.0.1:11434/api/version"), "TCP (first connection)");
    wait_active_state(&ct, "corrald.service", "active");
    assert_eq!(ct.run(&["systemctl", "is-active", "corrald.service"]), "active");
    let main_pid = ct.unit_property("corrald.service", "MainPID");
    assert_ne!(main_pid, "0");
    let proc_dir = format!("/proc/{main_pid}");
    assert_eq!(ct.run(&["stat", "-c", "%U %G", &proc_dir]), "corral corral", "corrald runs as User=corral");
    let cgroup = ct.unit_property("corrald.service", "ControlGroup");
    assert_eq!(cgroup, "/corral.slice/corrald.service");
    // Delegate=yes: corrald moved itself into a leaf, so runners can be its siblings.
    let own = ct.run(&["cat", &format!("{proc_dir}/cgroup")]);
    assert!(own.lines().any(|l| l == "0::/corral.slice/corrald.service/daemon"), "corrald's cgroup: {own}");
    // The same process also serves the UNIX socket.
    assert_version(
        curl(&ct, &["--unix-socket", "/run/corral.sock"], "http://localhost/api/version"),
        "/run/corral.sock",
    );
    assert_eq!(ct.unit_property("corrald.service", "MainPID"), main_pid, "one service instance serves both sockets");

    // READY=1 and STATUS= reached systemd.
    let status = ct.unit_property("corrald.service", "StatusText");
    assert!(status.starts_with("serving on "), "StatusText: {status:?}");
    assert!(status.contains("127.0.0.1:11434") && status.contains("/run/corral.sock"), "StatusText: {status:?}");

    // The journal has corrald's own structured entries, attributed to the unit.
    let start = wait_event(&ct, "start");
    assert!(start.contains("starting"), "start MESSAGE: {start:?}");
    let ready = wait_event(&ct, "ready");
    assert!(ready.contains("ready") && ready.contains("serving on"), "ready MESSAGE: {ready:?}");
    let entries = ct.journal("corrald.service");
    let own: Vec<_> = entries.iter().filter(|e| field(e, "CORRAL_EVENT").is_some()).collect();
    assert!(!own.is_empty());
    for e in &own {
        assert_eq!(field(e, "SYSLOG_IDENTIFIER").as_deref(), Some("corrald"), "{e}");
        assert_eq!(field(e, "_SYSTEMD_UNIT").as_deref(), Some("corrald.service"), "{e}");
        assert_eq!(field(e, "_PID").as_deref(), Some(main_pid.as_str()), "{e}");
        assert_eq!(field(e, "_TRANSPORT").as_deref(), Some("journal"), "native protocol expected: {e}");
    }

    // Reload: ExecReload sends SIGHUP; the daemon re-reads its configuration in place.
    ct.run(&["systemctl", "reload", "corrald.service"]);
    let reload = wait_event(&ct, "reload");
    assert!(reload.contains("reloaded"), "reload MESSAGE: {reload:?}");
    wait_active_state(&ct, "corrald.service", "active");
    assert_eq!(ct.unit_property("corrald.service", "MainPID"), main_pid, "reload must not restart the process");
    poll_until(SETTLE, "StatusText back to serving after the reload", || {
        let status = ct.unit_property("corrald.service", "StatusText");
        if status.starts_with("serving on ") { Ok(()) } else { Err(status) }
    });
    assert_version(curl(&ct, &[], "http://127.0.0.1:11434/api/version"), "TCP after reload");

    // Stop: a clean exit, recorded as such.
    ct.run(&["systemctl", "stop", "corrald.service"]);
    wait_active_state(&ct, "corrald.service", "inactive");
    assert_eq!(ct.unit_property("corrald.service", "Result"), "success");
    assert_eq!(ct.unit_property("corrald.service", "ExecMainStatus"), "0");
    let stop = wait_event(&ct, "stop");
    assert!(stop.contains("stopping"), "stop MESSAGE: {stop:?}");
    let events: Vec<String> = corrald_events(&ct.journal("corrald.service")).into_iter().map(|(e, _)| e).collect();
    assert_eq!(events, ["start", "ready", "reload", "stop"], "lifecycle events in order");

    // The socket stayed and activates a new instance.
    assert_eq!(ct.unit_property("corrald.socket", "ActiveState"), "active");
    assert_version(curl(&ct, &[], "http://127.0.0.1:11434/api/version"), "TCP after stop");
    wait_active_state(&ct, "corrald.service", "active");
    assert_ne!(ct.unit_property("corrald.service", "MainPID"), main_pid, "a new process after stop");
}

#[test]
fn unix_socket_activates_and_admits_only_group_corral() {
    let ct = Container::boot("unix-socket");
    ct.install_corral();
    // Users created in the container's throwaway overlay: one in group corral, one not.
    ct.run(&["useradd", "--no-create-home", "--groups", "corral", "corral-member"]);
    ct.run(&["useradd", "--no-create-home", "corral-outsider"]);

    ct.run(&["systemctl", "start", "corrald.socket"]);
    let mode = ct.run(&["stat", "-c", "%a %U %G", "/run/corral.sock"]);
    assert_eq!(mode, "660 root corral", "SocketMode/SocketUser/SocketGroup of /run/corral.sock");
    assert_eq!(ct.unit_property("corrald.service", "ActiveState"), "inactive");

    // A user outside group corral cannot connect, and does not start the service.
    let denied = ct.exec(&[
        "setpriv",
        "--reuid=corral-outsider",
        "--regid=corral-outsider",
        "--init-groups",
        "curl",
        "-v",
        "-sS",
        "--max-time",
        "30",
        "--unix-socket",
        "/run/corral.sock",
        "http://localhost/api/version",
    ]);
    // curl says why only with -v: "Immediate connect fail for /run/corral.sock: Permission denied".
    assert!(!denied.status.success(), "an outsider reached the API: {}", describe(&denied));
    assert!(String::from_utf8_lossy(&denied.stderr).contains("Permission denied"), "{}", describe(&denied));
    assert_eq!(ct.unit_property("corrald.service", "ActiveState"), "inactive");

    // A member of group corral is the first connection: it starts the service and is answered.
    let args = ["--reuid=corral-member", "--regid=corral-member", "--init-groups"];
    let mut cmd = vec!["setpriv"];
    cmd.extend_from_slice(&args);
    cmd.extend_from_slice(&[
        "curl",
        "-sS",
        "--max-time",
        "30",
        "-w",
        "\n%{http_code}",
        "--unix-socket",
        "/run/corral.sock",
        "http://localhost/api/version",
    ]);
    let out = ct.exec(&cmd);
    assert!(out.status.success(), "member request failed: {}", describe(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    let (body, code) = text.rsplit_once('\n').expect("status line");
    assert_eq!(code.trim(), "200", "{text}");
    assert!(body.contains(&format!("\"corral_version\":\"{}\"", env!("CARGO_PKG_VERSION"))), "{body}");
    wait_active_state(&ct, "corrald.service", "active");
    let ready = wait_event(&ct, "ready");
    assert!(ready.contains("/run/corral.sock"), "ready MESSAGE: {ready:?}");
}

/// Installs corral ([`Container::install_corral`]) with the demo store (`chat`, `embed`;
/// the service, user corral, reads it but never writes) and the real llama-server from the
/// host, CPU only, each model of `preload` preloaded.
pub(crate) fn install_with_preloads(ct: &Container, preload: &[&str]) {
    ct.install_corral();
    let share = ct.share_dir();
    crate::support::api::demo_store(share);
    std::fs::copy(crate::support::llama::bin_dir().join("llama-server"), share.join("llama-server")).expect("stage");
    let mut config =
        "[store]\npath = \"/srv/host/models\"\nread_only = true\n[runner]\nllama_server = \"/srv/host/llama-server\"\n\
                      [scheduler]\nnum_ctx = 512\n[gpu]\nfixed = true\nhost_memory = \"2GiB\"\n"
            .to_owned();
    config.extend(preload.iter().map(|model| format!("[models.\"{model}\"]\npreload = true\n")));
    std::fs::write(share.join("corral.toml"), config).expect("config");
    ct.run(&["install", "-D", "-m", "0644", "/srv/host/corral.toml", "/etc/corral/corral.toml"]);
}

/// Starts corrald.service and waits for its one preloaded model: the offload event's
/// message.
fn start_with_one_model(ct: &Container) -> String {
    ct.run(&["systemctl", "start", "corrald.service"]);
    poll_until(SETTLE, "corrald to report the loaded model", || {
        let status = ct.unit_property("corrald.service", "StatusText");
        if status.ends_with("1 model loaded") { Ok(()) } else { Err(status) }
    });
    wait_event(ct, "offload")
}

/// corrald under real systemd with a model to preload: the runner runs in its own cgroup
/// beside the daemon's leaf, its lines and the offload event reach the journal, and
/// stopping the service reaps it.
#[test]
fn a_preloaded_model_runs_in_its_own_cgroup_and_logs_to_the_journal() {
    let ct = Container::boot("runner");
    install_with_preloads(&ct, &["chat"]);

    let offload = start_with_one_model(&ct);
    assert!(offload.contains("chat:latest"), "{offload}");
    let entries = ct.journal("corrald.service");
    let lines: Vec<&serde_json::Value> =
        entries.iter().filter(|e| field(e, "SYSLOG_IDENTIFIER").as_deref() == Some("llama-server")).collect();
    assert!(lines.len() > 10, "llama-server's lines are in the journal: {}", summary(&entries));
    let pid = field(lines[0], "CORRAL_RUNNER_PID").expect("CORRAL_RUNNER_PID");
    assert_eq!(field(lines[0], "CORRAL_MODEL").as_deref(), Some("chat:latest"));

    // The runner sits alone in its cgroup, a sibling of the daemon's leaf.
    let service = "/sys/fs/cgroup/corral.slice/corrald.service";
    assert_eq!(ct.run(&["cat", &format!("{service}/runner-1/cgroup.procs")]), pid);
    let main_pid = ct.unit_property("corrald.service", "MainPID");
    assert_eq!(ct.run(&["cat", &format!("{service}/daemon/cgroup.procs")]), main_pid);

    ct.run(&["systemctl", "stop", "corrald.service"]);
    wait_active_state(&ct, "corrald.service", "inactive");
    assert_eq!(ct.unit_property("corrald.service", "Result"), "success");
    let left = ct.exec(&["pgrep", "-x", "llama-server"]);
    assert!(String::from_utf8_lossy(&left.stdout).trim().is_empty(), "no llama-server is left");
}

/// A runner on an RPC worker, under the unit's system call filter and sandbox: corrald
/// takes a duplicate of the runner's connection to the worker (`pidfd_getfd`, which the
/// unit allows beyond `@system-service`) and sets keepalive on it, so that a worker cut
/// off while the runner waits for its answer is noticed.
#[test]
fn a_runner_on_a_worker_gets_keepalive_on_its_connection_under_the_unit() {
    let ct = Container::boot("keepalive");
    install_with_preloads(&ct, &["chat"]);
    let share = ct.share_dir();
    std::fs::copy(crate::support::llama::bin_dir().join("rpc-server"), share.join("rpc-server")).expect("stage");
    let mut config = std::fs::read_to_string(share.join("corral.toml")).expect("config");
    config.push_str("[[workers]]\nname = \"w0\"\naddress = \"127.0.0.1:50052\"\nmemory = \"1GiB\"\n");
    std::fs::write(share.join("corral.toml"), config).expect("config");
    ct.run(&["install", "-m", "0644", "/srv/host/corral.toml", "/etc/corral/corral.toml"]);
    ct.run(&["systemd-run", "--unit=rpc-worker", "/srv/host/rpc-server", "-H", "127.0.0.1", "-p", "50052"]);
    wait_active_state(&ct, "rpc-worker.service", "active");

    let offload = start_with_one_model(&ct);
    assert!(offload.contains("RPC0"), "the model is on the worker: {offload}");
    // The runner's one connection to the worker, with its keepalive timer running.
    let sockets = ct.run(&["ss", "-tnoH", "state", "established", "dst", "127.0.0.1:50052"]);
    assert_eq!(sockets.lines().count(), 1, "{sockets}");
    assert!(sockets.contains("timer:(keepalive,"), "{sockets}");
    let entries = ct.journal("corrald.service");
    assert!(!summary(&entries).contains("cannot set keepalive"), "{}", summary(&entries));
}

/// `[server] exit_on_idle` under real systemd: corrald exits cleanly when idle, the socket
/// stays, and the next connection starts a new instance that answers it.
#[test]
fn an_idle_service_exits_and_the_next_connection_starts_it_again() {
    let ct = Container::boot("idle");
    ct.install_corral();
    std::fs::write(ct.share_dir().join("corral.toml"), "[server]\nexit_on_idle = \"1s\"\n").expect("config");
    ct.run(&["install", "-D", "-m", "0644", "/srv/host/corral.toml", "/etc/corral/corral.toml"]);
    ct.run(&["systemctl", "start", "corrald.socket"]);

    assert_version(curl(&ct, &[], "http://127.0.0.1:11434/api/version"), "TCP (first connection)");
    let first = ct.unit_property("corrald.service", "MainPID");
    assert_ne!(first, "0");
    let idle = wait_event(&ct, "idle");
    assert!(idle.contains("exiting until the next connection"), "{idle}");
    wait_active_state(&ct, "corrald.service", "inactive");
    assert_eq!(ct.unit_property("corrald.service", "Result"), "success");
    assert_eq!(ct.unit_property("corrald.service", "ExecMainStatus"), "0");
    assert_eq!(ct.unit_property("corrald.socket", "SubState"), "listening");

    // The request that comes after the exit waits in the socket's backlog and is answered.
    assert_version(curl(&ct, &["--unix-socket", "/run/corral.sock"], "http://localhost/api/version"), "after idle");
    wait_active_state(&ct, "corrald.service", "active");
    assert_ne!(ct.unit_property("corrald.service", "MainPID"), first, "a new instance");
}

/// Installs what the package adds to [`Container::install_corral`]: `corralctl`, the bus
/// policy and the activation file (then the bus reads them), and the user units in
/// `/etc/systemd/user`.
fn install_corralctl_and_d_bus(ct: &Container) {
    let share = ct.share_dir().join("corral");
    let root = crate::support::container::repo_root();
    if std::fs::hard_link(env!("CARGO_BIN_EXE_corralctl"), share.join("corralctl")).is_err() {
        std::fs::copy(env!("CARGO_BIN_EXE_corralctl"), share.join("corralctl")).expect("stage corralctl");
    }
    for (from, name) in [
        ("dbus/org.corral.Corral1.conf", "policy.conf"),
        ("dbus/org.corral.Corral1.service", "activation.service"),
        ("systemd/user/corrald.service", "user.service"),
        ("systemd/user/corrald.socket", "user.socket"),
    ] {
        std::fs::copy(root.join(from), share.join(name)).expect("stage");
    }
    ct.run(&["install", "-m", "0755", "/srv/host/corral/corralctl", "/usr/bin/corralctl"]);
    let policy = "/usr/share/dbus-1/system.d/org.corral.Corral1.conf";
    ct.run(&["install", "-D", "-m", "0644", "/srv/host/corral/policy.conf", policy]);
    let activation = "/usr/share/dbus-1/system-services/org.corral.Corral1.service";
    ct.run(&["install", "-D", "-m", "0644", "/srv/host/corral/activation.service", activation]);
    ct.run(&["install", "-D", "-m", "0644", "/srv/host/corral/user.service", "/etc/systemd/user/corrald.service"]);
    ct.run(&["install", "-D", "-m", "0644", "/srv/host/corral/user.socket", "/etc/systemd/user/corrald.socket"]);
    ct.run(&[
        "busctl",
        "call",
        "org.freedesktop.DBus",
        "/org/freedesktop/DBus",
        "org.freedesktop.DBus",
        "ReloadConfig",
    ]);
}

/// `corralctl ARGS` as `user` (`None`: root) inside the container.
fn corralctl(ct: &Container, user: Option<&str>, args: &[&str]) -> std::process::Output {
    let ids = user.map(|user| [format!("--reuid={user}"), format!("--regid={user}")]);
    let mut command = Vec::new();
    if let Some([uid, gid]) = &ids {
        command.extend_from_slice(&["setpriv", uid.as_str(), gid.as_str(), "--init-groups", "--"]);
    }
    command.push("corralctl");
    command.extend_from_slice(args);
    ct.exec(&command)
}

/// A broken drop-in, a reload and a stopped or masked service, as admins meet them: the
/// service fails once with 78 and is not restarted, the socket keeps listening and every
/// connection is told why, corralctl says what to do without starting anything, a reload
/// of a rejected configuration fails and one that changes start-only keys names them.
#[test]
fn a_broken_configuration_a_reload_and_a_stopped_service_follow_systemd_conventions() {
    let ct = Container::boot("admin");
    ct.install_corral();
    install_corralctl_and_d_bus(&ct);
    ct.run(&["useradd", "--no-create-home", "corral-reader"]);
    let share = ct.share_dir();
    std::fs::write(share.join("bad.toml"), "[scheduler]\nkeep_alive = \"soon\"\n").expect("bad");
    std::fs::write(
        share.join("restart.toml"),
        "[store]\npath = \"/var/lib/corral/other\"\n[scheduler]\nmax_queue = 7\n",
    )
    .expect("restart");
    let bad = "/etc/corral/corral.toml.d/50-bad.toml";
    ct.run(&["install", "-D", "-m", "0644", "/srv/host/bad.toml", bad]);
    ct.run(&["systemctl", "start", "corrald.socket"]);

    // Each connection starts corrald once and is answered with the reason; more failed
    // starts than the start limit allows (5 in 10 s) leave the socket listening.
    for attempt in 1..=6 {
        let (code, body) = curl(&ct, &[], "http://127.0.0.1:11434/api/tags").expect("an answer, not a closed port");
        assert_eq!(code, 503, "attempt {attempt}: {body}");
        assert!(body.contains("its configuration is rejected") && body.contains("journalctl -u corrald"), "{body}");
        wait_active_state(&ct, "corrald.service", "failed");
        assert_eq!(ct.unit_property("corrald.service", "ExecMainStatus"), "78");
        assert_eq!(ct.unit_property("corrald.service", "NRestarts"), "0", "no restart for exit 78");
        assert_eq!(ct.unit_property("corrald.socket", "SubState"), "listening", "attempt {attempt}");
    }
    // The journal's message carries the reason itself.
    let entries = ct.journal("corrald.service");
    assert!(
        entries.iter().any(|e| field(e, "PRIORITY").as_deref() == Some("3")
            && field(e, "MESSAGE")
                .is_some_and(|m| m.contains("invalid configuration") && m.contains("is not a duration"))),
        "{}",
        summary(&entries)
    );

    // corralctl says what to do, at once, and starts nothing: reading or changing.
    for (user, args) in [(Some("corral-reader"), &["ps"][..]), (None, &["load", "tiny"])] {
        let started = std::time::Instant::now();
        let out = corralctl(&ct, user, args);
        assert_eq!(out.status.code(), Some(69), "{}", describe(&out));
        let text = String::from_utf8_lossy(&out.stderr);
        assert!(text.contains("corrald is not running: its configuration is rejected"), "{text}");
        assert!(text.contains("`journalctl -u corrald`") && text.contains("`corrald --check-config`"), "{text}");
        assert!(started.elapsed() < Duration::from_secs(15), "took {:?}", started.elapsed());
        assert_eq!(ct.unit_property("corrald.service", "ActiveState"), "failed", "{args:?} started it");
    }

    // Fixed: it starts.  A reload of a rejected configuration fails and changes nothing.
    ct.run(&["rm", bad]);
    ct.run(&["systemctl", "reset-failed", "corrald.service"]);
    ct.run(&["systemctl", "start", "corrald.service"]);
    let main_pid = ct.unit_property("corrald.service", "MainPID");
    ct.run(&["install", "-D", "-m", "0644", "/srv/host/bad.toml", bad]);
    let out = ct.exec(&["systemctl", "reload", "corrald.service"]);
    assert!(!out.status.success(), "the reload of a rejected configuration succeeded: {}", describe(&out));
    assert_eq!(ct.unit_property("corrald.service", "ActiveState"), "active");
    assert_eq!(ct.unit_property("corrald.service", "MainPID"), main_pid);
    ct.run(&["rm", bad]);
    // A reload that changes start-only keys names them (and not the ones it applied).
    ct.run(&["install", "-D", "-m", "0644", "/srv/host/restart.toml", "/etc/corral/corral.toml.d/60-restart.toml"]);
    ct.run(&["systemctl", "reload", "corrald.service"]);
    let reload = wait_event(&ct, "reload");
    assert!(reload.contains("take effect only at the next restart") && reload.contains("[store] path"), "{reload}");
    assert!(!reload.contains("max_queue"), "{reload}");

    // Stopped: reading does not start it.
    ct.run(&["systemctl", "stop", "corrald.service"]);
    wait_active_state(&ct, "corrald.service", "inactive");
    let out = corralctl(&ct, Some("corral-reader"), &["ps"]);
    assert_eq!(out.status.code(), Some(69), "{}", describe(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("reading does not start it"), "{}", describe(&out));
    assert_eq!(ct.unit_property("corrald.service", "ActiveState"), "inactive", "corralctl ps started corrald");

    // Masked: 69 and a clear message, for reading and changing.
    // (A unit in /etc cannot be masked: moved where the package puts it.)
    ct.run(&["mv", "/etc/systemd/system/corrald.service", "/usr/lib/systemd/system/corrald.service"]);
    ct.run(&["systemctl", "mask", "corrald.service"]);
    assert_eq!(ct.unit_property("corrald.service", "LoadState"), "masked");
    for (user, args) in [(Some("corral-reader"), &["list"][..]), (None, &["load", "tiny"])] {
        let out = corralctl(&ct, user, args);
        assert_eq!(out.status.code(), Some(69), "{}", describe(&out));
        assert!(String::from_utf8_lossy(&out.stderr).contains("corrald.service is masked"), "{}", describe(&out));
    }
}

/// The user units as shipped: `systemctl --user` starts corrald on the first connection,
/// with D-Bus on the session bus, and a plain `corralctl` finds it there.
#[test]
fn the_user_units_work_with_corralctl_as_shipped() {
    let ct = Container::boot("user-units");
    ct.install_corral();
    install_corralctl_and_d_bus(&ct);
    ct.run(&["useradd", "--create-home", "corral-alice"]);
    let uid = ct.run(&["id", "-u", "corral-alice"]);
    ct.run(&["systemctl", "start", &format!("user@{uid}.service")]);
    let runtime = format!("XDG_RUNTIME_DIR=/run/user/{uid}");
    let as_alice = |args: &[&str]| {
        let mut command = vec!["setpriv", "--reuid=corral-alice", "--regid=corral-alice", "--init-groups", "--", "env"];
        command.push(&runtime);
        command.extend_from_slice(args);
        ct.exec(&command)
    };
    let ok = |args: &[&str]| {
        let out = as_alice(args);
        assert!(out.status.success(), "{args:?}: {}", describe(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    ok(&["systemctl", "--user", "daemon-reload"]);
    ok(&["systemctl", "--user", "start", "corrald.socket"]);

    // Before the first connection: corralctl looks on the session bus, and reading does
    // not start corrald.
    let out = as_alice(&["corralctl", "ps"]);
    assert_eq!(out.status.code(), Some(69), "{}", describe(&out));
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("reading does not start it") && text.contains("systemctl --user start corrald"), "{text}");

    let (code, body) = curl(&ct, &[], "http://127.0.0.1:11434/api/version").expect("the user socket answers");
    assert_eq!(code, 200, "{body}");
    poll_until(SETTLE, "the user's corrald on the session bus", || {
        let out = as_alice(&["corralctl", "status"]);
        if out.status.success() { Ok(()) } else { Err(describe(&out)) }
    });
    let status = ok(&["corralctl", "--json", "status"]);
    assert!(status.contains(env!("CARGO_PKG_VERSION")), "{status}");
    // Not the system bus: nothing of corral's runs there.
    assert_eq!(ct.unit_property("corrald.service", "ActiveState"), "inactive");
}
