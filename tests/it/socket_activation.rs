//! corrald under `systemd-socket-activate` with a notify listener, and on its own
//! binding the configured addresses: readiness, status, watchdog, reload, stop, and
//! a clean failure when an address is taken.

use std::net::SocketAddr;
use std::time::Duration;

use nix::sys::signal::Signal;

use crate::support::corrald::{Corrald, IDLE_CHECKS, free_port, write_config};
use crate::support::http;
use crate::support::notify::NotifyListener;

const WAIT: Duration = Duration::from_secs(60);

#[test]
fn socket_activation_on_tcp_and_unix_reports_ready_and_serves_both() {
    let dir = tempfile::tempdir().expect("tempdir");
    let notify = NotifyListener::start();
    let port = free_port();
    let tcp: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    let unix = dir.path().join("api.sock");
    // The configured address must not be used when systemd passes sockets.
    let unused = free_port();
    let config = write_config(dir.path(), "corral.toml", &format!("[server]\nlisten = [\"127.0.0.1:{unused}\"]\n"));
    let mut corrald = Corrald::socket_activated(
        &[tcp.to_string(), unix.display().to_string()],
        &["--config", config.to_str().expect("utf-8")],
        notify.path(),
        &[],
    );

    // The first connection starts corrald, which adopts the socket it arrived on.
    let version = http::tcp(tcp, "GET", "/api/version");
    assert_eq!(version.status, 200);
    assert_eq!(
        version.json(),
        serde_json::json!({ "version": corral::http::OLLAMA_VERSION, "corral_version": env!("CARGO_PKG_VERSION") })
    );
    let ready = notify.wait_for("READY", "1", WAIT);
    let status = notify.messages()[ready]["STATUS"].clone();
    assert!(status.contains(&tcp.to_string()) && status.contains("api.sock"), "{status}");

    let root = http::unix(&unix, "GET", "/", None);
    assert_eq!((root.status, root.body.as_str()), (200, "corral is running"));
    let head = http::unix(&unix, "HEAD", "/api/version", None);
    assert_eq!(head.status, 200);
    assert!(std::net::TcpStream::connect(("127.0.0.1", unused)).is_err(), "configured address not bound");
    corrald.wait_stderr("socket_activated=true", WAIT);

    corrald.signal(Signal::SIGTERM);
    notify.wait_for("STOPPING", "1", WAIT);
    assert!(corrald.wait_exit(WAIT).success(), "{}", corrald.stderr());
    assert!(unix.exists(), "a socket systemd owns is left for systemd");
}

#[test]
fn sockets_with_other_names_only_are_refused() {
    let notify = NotifyListener::start();
    let port = free_port();
    let mut cmd = std::process::Command::new("systemd-socket-activate");
    cmd.args(["-l", &format!("127.0.0.1:{port}"), "--fdname=metrics", "-E", "NOTIFY_SOCKET"])
        .args(["-E", "STATE_DIRECTORY", "-E", "RUNTIME_DIRECTORY"])
        .env("NOTIFY_SOCKET", notify.path())
        .args([crate::support::corrald::CORRALD, "--log-target", "stderr"]);
    let mut corrald = Corrald::spawn(cmd);
    // Trigger the activation; the connection is dropped when corrald refuses to start.
    let _ = http::connect("the activation socket", || std::net::TcpStream::connect(("127.0.0.1", port)));
    assert!(!corrald.wait_exit(WAIT).success());
    assert!(corrald.stderr().contains("none named \"http\""), "{}", corrald.stderr());
    assert!(notify.messages().iter().all(|m| !m.contains_key("READY")), "never reported ready");
}

#[test]
fn without_systemd_it_binds_the_configured_addresses() {
    let dir = tempfile::tempdir().expect("tempdir");
    let notify = NotifyListener::start();
    let port = free_port();
    let unix = dir.path().join("own.sock");
    let config = write_config(
        dir.path(),
        "corral.toml",
        &format!("[server]\nlisten = [\"127.0.0.1:{port}\", \"{}\"]\n", unix.display()),
    );
    let mut corrald = Corrald::start(&["--config", config.to_str().expect("utf-8")], Some(notify.path()));
    notify.wait_for("READY", "1", WAIT);
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    assert_eq!(http::tcp(addr, "GET", "/api/version").status, 200);
    let missing = http::unix(&unix, "GET", "/api/tags/nope", None);
    assert_eq!(missing.status, 404);
    assert_eq!(missing.json(), serde_json::json!({ "error": "path /api/tags/nope not found" }));
    corrald.signal(Signal::SIGINT);
    assert!(corrald.wait_exit(WAIT).success());
    assert!(!unix.exists(), "corrald removes the socket file it created");
}

#[test]
fn watchdog_is_pinged_at_half_the_interval() {
    let dir = tempfile::tempdir().expect("tempdir");
    let notify = NotifyListener::start();
    let config = write_config(dir.path(), "c.toml", &format!("[server]\nlisten = [\"127.0.0.1:{}\"]\n", free_port()));
    let mut cmd = std::process::Command::new(crate::support::corrald::CORRALD);
    cmd.args(["--log-target", "stderr", "--config", config.to_str().expect("utf-8")])
        .env("NOTIFY_SOCKET", notify.path())
        .env("WATCHDOG_USEC", "200000");
    let _corrald = Corrald::spawn(cmd);
    let ready = notify.wait_for("READY", "1", WAIT);
    let first = notify.wait_for_after(ready, "WATCHDOG", "1", WAIT);
    notify.wait_for_after(first + 1, "WATCHDOG", "1", WAIT);
}

#[test]
fn reload_applies_a_good_config_and_keeps_serving_on_a_bad_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let notify = NotifyListener::start();
    let port = free_port();
    let listen = format!("[server]\nlisten = [\"127.0.0.1:{port}\"]\n");
    let config = write_config(dir.path(), "corral.toml", &listen);
    let corrald = Corrald::start(&["--config", config.to_str().expect("utf-8")], Some(notify.path()));
    let ready = notify.wait_for("READY", "1", WAIT);
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");

    std::fs::write(&config, format!("{listen}[scheduler]\nkeep_alive = \"1h\"\n")).expect("write");
    corrald.signal(Signal::SIGHUP);
    let reloading = notify.wait_for_after(ready + 1, "RELOADING", "1", WAIT);
    assert!(notify.messages()[reloading].contains_key("MONOTONIC_USEC"));
    let ready_again = notify.wait_for_after(reloading, "READY", "1", WAIT);
    corrald.wait_stderr("configuration reloaded", WAIT);

    std::fs::write(&config, format!("{listen}[scheduler]\nkeep_alive = 5\n")).expect("write");
    corrald.signal(Signal::SIGHUP);
    let reloading = notify.wait_for_after(ready_again + 1, "RELOADING", "1", WAIT);
    notify.wait_for_after(reloading, "READY", "1", WAIT);
    corrald.wait_stderr("configuration rejected, keeping the previous one", WAIT);
    assert!(corrald.stderr().contains("scheduler.keep_alive"), "{}", corrald.stderr());
    assert_eq!(http::tcp(addr, "GET", "/api/version").status, 200, "still serving");
}

#[test]
fn an_address_in_use_is_a_clear_error_and_nothing_stays_behind() {
    let dir = tempfile::tempdir().expect("tempdir");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr");
    let unix = dir.path().join("first.sock");
    let config =
        write_config(dir.path(), "corral.toml", &format!("[server]\nlisten = [\"{}\", \"{addr}\"]\n", unix.display()));
    let notify = NotifyListener::start();
    let mut corrald = Corrald::start(&["--config", config.to_str().expect("utf-8")], Some(notify.path()));
    let status = corrald.wait_exit(WAIT);
    assert_eq!(status.code(), Some(1));
    let stderr = corrald.stderr();
    assert!(stderr.contains(&format!("cannot listen on {addr}: Address already in use")), "{stderr}");
    assert!(!unix.exists(), "the socket bound before the failure is removed");
    assert!(notify.messages().iter().all(|m| !m.contains_key("READY")), "never reported ready");
    let last = notify.messages().last().cloned().unwrap_or_default();
    assert!(last.get("STATUS").is_some_and(|s| s.contains("cannot listen")), "{last:?}");
    // The cause is named once, not again as the error's source.
    let status = last.get("STATUS").cloned().unwrap_or_default();
    assert_eq!(status.matches("Address already in use").count(), 1, "{status}");
}

#[test]
fn an_invalid_config_at_start_exits_78_and_says_why() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = write_config(dir.path(), "corral.toml", "[scheduler]\nmax_queue = \"lots\"\n");
    let notify = NotifyListener::start();
    let mut corrald = Corrald::start(&["--config", config.to_str().expect("utf-8")], Some(notify.path()));
    assert_eq!(corrald.wait_exit(WAIT).code(), Some(78));
    assert!(corrald.stderr().contains("scheduler.max_queue"), "{}", corrald.stderr());
    let last = notify.messages().last().cloned().unwrap_or_default();
    assert!(last.get("STATUS").is_some_and(|s| s.contains("invalid configuration")), "{last:?}");
}

#[test]
fn stop_is_bounded_even_when_a_client_never_finishes_its_request() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let config = write_config(
        dir.path(),
        "corral.toml",
        &format!("[server]\nlisten = [\"127.0.0.1:{port}\"]\nshutdown_timeout = \"1s\"\n"),
    );
    let notify = NotifyListener::start();
    let mut corrald = Corrald::start(&["--config", config.to_str().expect("utf-8")], Some(notify.path()));
    notify.wait_for("READY", "1", WAIT);
    let mut slow = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    std::io::Write::write_all(&mut slow, b"GET / HTTP/1.1\r\nHost: x\r\n").expect("half a request");
    // A later connection answered means the slow one was accepted before it (one accept
    // loop takes connections in order).
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    assert_eq!(http::tcp(addr, "GET", "/api/version").status, 200);
    corrald.signal(Signal::SIGTERM);
    // The grace period is 1 s; the bound here only has to tell "bounded" from "hangs".
    assert!(corrald.wait_exit(Duration::from_secs(30)).success(), "{}", corrald.stderr());
}

#[test]
fn the_store_is_opened_at_start_and_an_unusable_one_is_a_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let config = write_config(dir.path(), "corral.toml", &format!("[server]\nlisten = [\"127.0.0.1:{port}\"]\n"));
    let notify = NotifyListener::start();
    let corrald = Corrald::start(&["--config", config.to_str().expect("utf-8")], Some(notify.path()));
    notify.wait_for("READY", "1", WAIT);
    let store = corrald.state_dir().join("models");
    assert!(store.join("blobs").is_dir() && store.join("manifests").is_dir(), "the store is laid out at start");
    drop(corrald);

    let blocked = write_config(
        dir.path(),
        "blocked.toml",
        &format!("[server]\nlisten = [\"127.0.0.1:{port}\"]\n[store]\npath = \"{}\"\n", config.display()),
    );
    let mut corrald = Corrald::start(&["--config", blocked.to_str().expect("utf-8")], None);
    assert_eq!(corrald.wait_exit(WAIT).code(), Some(1));
    let stderr = corrald.stderr();
    let expected = format!("cannot open the model store: {} is not a directory", config.display());
    assert!(stderr.contains(&expected), "{stderr}");
}

/// `[server] exit_on_idle` under socket activation: a request still in flight (a blob
/// upload whose body is half sent) keeps corrald up past the limit; once it ends, corrald
/// exits cleanly on its own, saying why.  (That the next connection starts it again is
/// systemd's part, tested in `systemd_container`.)
#[test]
fn exit_on_idle_waits_for_requests_in_flight_then_exits_cleanly() {
    use std::io::{Read as _, Write as _};

    let dir = tempfile::tempdir().expect("tempdir");
    let notify = NotifyListener::start();
    let tcp: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
    let config = write_config(dir.path(), "corral.toml", "[server]\nexit_on_idle = \"1s\"\n");
    let mut corrald = Corrald::socket_activated(
        &[tcp.to_string()],
        &["--config", config.to_str().expect("utf-8")],
        notify.path(),
        &[("RUST_LOG", IDLE_CHECKS)],
    );

    let body = b"0123456789";
    let digest = format!("sha256:{}", hex::encode(<sha2::Sha256 as sha2::Digest>::digest(body)));
    let mut upload = http::connect("the activation socket", || std::net::TcpStream::connect(tcp));
    let head = format!("POST /api/blobs/{digest} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 10\r\n\r\n");
    upload.write_all(head.as_bytes()).expect("send head");
    upload.write_all(&body[..5]).expect("send half the body");
    notify.wait_for("READY", "1", WAIT);

    // Three idle checks (every 2 s) pass the 1 s limit while the upload is open.
    let since = corrald.idle_checks();
    corrald.wait_idle_checks(since, 3, WAIT);
    assert!(
        !corrald.stderr().contains("corral_event=\"idle\""),
        "exited with a request in flight:\n{}",
        corrald.stderr()
    );
    upload.write_all(&body[5..]).expect("send the rest");
    let mut reply = String::new();
    upload.read_to_string(&mut reply).expect("read the reply");
    assert!(reply.starts_with("HTTP/1.1 201"), "the upload was answered: {reply}");
    drop(upload);

    let status = corrald.wait_exit(WAIT);
    assert!(status.success(), "a clean exit: {status}\n{}", corrald.stderr());
    let stderr = corrald.stderr();
    assert!(stderr.contains("nothing loaded or in flight for 1 s; exiting until the next connection"), "{stderr}");
    let stopping = notify.wait_for("STOPPING", "1", WAIT);
    assert!(stopping > 0);
}

/// Without sockets from systemd nothing would start corrald again, so it stays up.
#[test]
fn exit_on_idle_is_ignored_without_socket_activation() {
    let dir = tempfile::tempdir().expect("tempdir");
    let notify = NotifyListener::start();
    let port = free_port();
    let config = write_config(
        dir.path(),
        "corral.toml",
        &format!("[server]\nlisten = [\"127.0.0.1:{port}\"]\nexit_on_idle = \"1s\"\n"),
    );
    let mut command = std::process::Command::new(crate::support::corrald::CORRALD);
    command.args(["--log-target", "stderr", "--config", config.to_str().expect("utf-8")]);
    command.env("NOTIFY_SOCKET", notify.path()).env("RUST_LOG", IDLE_CHECKS);
    let mut corrald = Corrald::spawn(command);
    notify.wait_for("READY", "1", WAIT);
    corrald.wait_stderr("server.exit_on_idle applies only when systemd passes the sockets; staying up", WAIT);
    // Three idle checks past the limit.
    corrald.wait_idle_checks(0, 3, WAIT);
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    assert_eq!(http::tcp(addr, "GET", "/api/version").status, 200, "{}", corrald.stderr());
    assert!(!corrald.stderr().contains("corral_event=\"idle\""), "{}", corrald.stderr());
    corrald.signal(Signal::SIGTERM);
    assert!(corrald.wait_exit(WAIT).success());
}
