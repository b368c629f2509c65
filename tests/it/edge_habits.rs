//! Ollama users' habits at the HTTP edge (issue 14): the Host names Ollama's clients send,
//! a wildcard listener reached from the network, who may change the store over TCP and
//! over the UNIX socket, `/api/version`, and corralctl finding the API through
//! `OLLAMA_HOST` and `CORRAL_HOST`. Each test drives a real corrald (or the real
//! corralctl) over real sockets.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use crate::support::api::demo_store;
use crate::support::corrald::{Corrald, free_port, write_config};
use crate::support::http::{self, Response};
use crate::support::notify::NotifyListener;

const WAIT: Duration = Duration::from_secs(60);
const CORRALCTL: &str = env!("CARGO_BIN_EXE_corralctl");

/// A configuration over [`demo_store`] (models `chat` and `embed`) in `dir` with `server`
/// as the `[server]` table's keys; no D-Bus, no llama-server needed.
fn config(dir: &Path, server: &str) -> PathBuf {
    drop(demo_store(dir));
    write_config(
        dir,
        "corral.toml",
        &format!(
            "[server]\n{server}\n[store]\npath = \"{}\"\n[runner]\nllama_server = \"/nonexistent/llama-server\"\n\
             [gpu]\nfixed = true\nhost_memory = \"4GiB\"\n[dbus]\nbus = \"off\"\n",
            dir.join("models").display(),
        ),
    )
}

/// corrald with `server` in its `[server]` table, ready.
fn start(dir: &Path, server: &str, notify: &NotifyListener) -> Corrald {
    let config = config(dir, server);
    let corrald = Corrald::start(&["--config", config.to_str().expect("utf-8")], Some(notify.path()));
    notify.wait_for("READY", "1", WAIT);
    corrald
}

/// `head` (request line and headers, no blank line) and `body`, on a new connection with
/// `Connection: close`; the whole answer.
fn send(mut stream: impl Read + Write, head: &str, body: &str) -> Response {
    let head = format!("{head}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
    stream.write_all(head.as_bytes()).expect("send head");
    stream.write_all(body.as_bytes()).expect("send body");
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply).expect("read the answer");
    http::parse(&reply)
}

fn tcp(addr: SocketAddr) -> TcpStream {
    let stream = http::connect(&addr.to_string(), || TcpStream::connect(addr));
    stream.set_read_timeout(Some(WAIT)).expect("timeout");
    stream
}

fn unix(path: &Path) -> UnixStream {
    let stream = http::connect(&path.display().to_string(), || UnixStream::connect(path));
    stream.set_read_timeout(Some(WAIT)).expect("timeout");
    stream
}

fn error_of(response: &Response) -> String {
    response.json()["error"].as_str().unwrap_or_default().to_owned()
}

/// An IPv4 address of this machine that is not loopback: how a LAN client reaches it.
fn network_address() -> Ipv4Addr {
    nix::ifaddrs::getifaddrs()
        .expect("getifaddrs")
        .filter_map(|a| a.address.and_then(|a| a.as_sockaddr_in().map(nix::sys::socket::SockaddrIn::ip)))
        .find(|ip| !ip.is_loopback())
        .expect("this test needs an IPv4 address on an interface other than lo")
}

/// The machine's hostname.
fn hostname() -> String {
    nix::unistd::gethostname().expect("hostname").into_string().expect("utf-8")
}

#[test]
fn names_ollamas_clients_send_pass_on_loopback_and_public_names_do_not() {
    let dir = tempfile::tempdir().expect("tempdir");
    let notify = NotifyListener::start();
    let port = free_port();
    let _corrald = start(dir.path(), &format!("listen = [\"127.0.0.1:{port}\"]"), &notify);
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let lan = network_address();
    let hostname = hostname();
    let get = |host: &str| send(tcp(addr), &format!("GET /api/tags HTTP/1.1\r\nHost: {host}"), "");

    for host in [
        format!("0.0.0.0:{port}"),
        "0.0.0.0".to_owned(),
        format!("[::]:{port}"),
        hostname.clone(),
        format!("{}:{port}", hostname.to_uppercase()),
        format!("{hostname}.local"),
        "corral.local".to_owned(),
        format!("host.docker.internal:{port}"),
        "gateway.internal".to_owned(),
        format!("{lan}:{port}"),
        "192.168.178.20".to_owned(),
        format!("10.1.2.3:{port}"),
        "172.20.0.1".to_owned(),
        "169.254.10.10".to_owned(),
        format!("[fe80::1]:{port}"),
        "[fd12:3456::1]".to_owned(),
        format!("localhost:{port}"),
        "app.localhost".to_owned(),
    ] {
        let response = get(&host);
        assert_eq!(response.status, 200, "Host: {host}: {}", response.body);
    }
    // DNS rebinding: a public name (or address) that an attacker's DNS points at 127.0.0.1.
    for host in [
        "evil.example".to_owned(),
        format!("{hostname}.evil.example:{port}"),
        "localhost.evil.example".to_owned(),
        "local.evil.example".to_owned(),
        format!("8.8.8.8:{port}"),
        "[2606:4700::1111]".to_owned(),
    ] {
        let response = get(&host);
        assert_eq!(response.status, 403, "Host: {host}: {}", response.body);
        assert!(error_of(&response).contains("allowed_hosts"), "{}", response.body);
    }
    // Issue 13's strictness stays.
    let two = send(tcp(addr), "GET /api/tags HTTP/1.1\r\nHost: 0.0.0.0\r\nHost: localhost", "");
    assert_eq!(two.status, 400, "{}", two.body);
    let target = send(tcp(addr), "GET http://evil.example/api/tags HTTP/1.1\r\nHost: 0.0.0.0", "");
    assert_eq!(target.status, 403, "{}", target.body);
    let none = send(tcp(addr), "GET /api/tags HTTP/1.1", "");
    assert_eq!(none.status, 400, "{}", none.body);
}

#[test]
fn a_wildcard_socket_serves_lan_clients_whatever_their_host_but_guards_its_loopback_side() {
    let dir = tempfile::tempdir().expect("tempdir");
    let notify = NotifyListener::start();
    let port = free_port();
    let config = config(dir.path(), "");
    // As `ListenStream=0.0.0.0:11434` in a drop-in of corrald.socket.
    let _corrald = Corrald::socket_activated(
        &[format!("0.0.0.0:{port}")],
        &["--config", config.to_str().expect("utf-8")],
        notify.path(),
        &[],
    );
    let lan = SocketAddr::from((network_address(), port));
    let loopback = SocketAddr::from(([127, 0, 0, 1], port));
    for host in ["corral.example.org", "my-server", "8.8.8.8:11434", "evil.example"] {
        let response = send(tcp(lan), &format!("GET /api/tags HTTP/1.1\r\nHost: {host}"), "");
        assert_eq!(response.status, 200, "LAN client with Host: {host}: {}", response.body);
    }
    notify.wait_for("READY", "1", WAIT);
    let copied = send(
        tcp(lan),
        "POST /api/copy HTTP/1.1\r\nHost: corral.example.org\r\nContent-Type: application/json",
        r#"{"source":"chat","destination":"from-lan"}"#,
    );
    assert_eq!(copied.status, 200, "{}", copied.body);
    // The same socket reached through loopback: a rebinding page's way in.
    let rebound = send(tcp(loopback), "GET /api/tags HTTP/1.1\r\nHost: evil.example", "");
    assert_eq!(rebound.status, 403, "{}", rebound.body);
    let local = send(tcp(loopback), &format!("GET /api/tags HTTP/1.1\r\nHost: 0.0.0.0:{port}"), "");
    assert_eq!(local.status, 200, "{}", local.body);
    // A LAN client must still send exactly one Host.
    let two = send(tcp(lan), "GET /api/tags HTTP/1.1\r\nHost: a\r\nHost: b", "");
    assert_eq!(two.status, 400, "{}", two.body);
}

/// A copy of `chat` to `to`: a change of the store.
fn copy_head(token: Option<&str>) -> String {
    let auth = token.map(|t| format!("\r\nAuthorization: Bearer {t}")).unwrap_or_default();
    format!("POST /api/copy HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json{auth}")
}

fn copy_body(to: &str) -> String {
    format!(r#"{{"source":"chat","destination":"{to}"}}"#)
}

/// corrald with `store_changes = mode` (and `extra` keys) on TCP and a UNIX socket; its
/// TCP address and socket path.
fn both_sockets(dir: &Path, mode: &str, extra: &str, notify: &NotifyListener) -> (Corrald, SocketAddr, PathBuf) {
    let port = free_port();
    let sock = dir.join("api.sock");
    let server =
        format!("listen = [\"127.0.0.1:{port}\", \"{}\"]\nstore_changes = \"{mode}\"\n{extra}", sock.display());
    let corrald = start(dir, &server, notify);
    (corrald, SocketAddr::from(([127, 0, 0, 1], port)), sock)
}

#[test]
fn by_default_anyone_on_the_tcp_port_changes_the_store_as_with_ollama() {
    let dir = tempfile::tempdir().expect("tempdir");
    let notify = NotifyListener::start();
    let (corrald, addr, sock) = both_sockets(dir.path(), "any", "", &notify);
    assert_eq!(send(tcp(addr), &copy_head(None), &copy_body("over-tcp")).status, 200);
    assert_eq!(send(unix(&sock), &copy_head(None), &copy_body("over-unix")).status, 200);
    // Over the UNIX socket the peer is named in the log: this test's own user and process.
    let uid = nix::unistd::getuid().as_raw();
    corrald.wait_stderr(&format!("POST /api/copy over the UNIX socket by uid {uid}"), WAIT);
    let log = corrald.stderr();
    assert!(log.contains(&format!("corral_peer_pid={}", std::process::id())), "{log}");
}

#[test]
fn with_token_mode_changes_over_tcp_need_a_token_and_nothing_else_does() {
    let dir = tempfile::tempdir().expect("tempdir");
    let notify = NotifyListener::start();
    let (_corrald, addr, sock) = both_sockets(dir.path(), "token", "api_tokens = [\"s3cret\"]", &notify);

    let refused = send(tcp(addr), &copy_head(None), &copy_body("no-token"));
    assert_eq!(refused.status, 401, "{}", refused.body);
    let error = error_of(&refused);
    assert!(error.contains("store_changes") && error.contains("Authorization: Bearer"), "{error}");
    assert!(error.contains("UNIX socket") && error.contains("corralctl"), "says what to do instead: {error}");
    assert_eq!(send(tcp(addr), &copy_head(Some("wrong")), &copy_body("wrong")).status, 401);
    assert_eq!(send(tcp(addr), &copy_head(Some("s3cret")), &copy_body("with-token")).status, 200);
    assert_eq!(send(unix(&sock), &copy_head(None), &copy_body("over-unix")).status, 200);
    // Every route that changes the store is guarded, not only copy.
    for (method, path, body) in [
        ("DELETE", "/api/delete", r#"{"model":"chat"}"#.to_owned()),
        ("POST", "/api/create", r#"{"model":"evil","from":"chat"}"#.to_owned()),
        ("POST", "/api/pull", r#"{"model":"127.0.0.1:1/x/y","insecure":true}"#.to_owned()),
        ("POST", "/api/push", r#"{"model":"chat","insecure":true}"#.to_owned()),
        ("POST", &format!("/api/blobs/{}", corral::store::digest::Digest::of(b"x")), "x".to_owned()),
    ] {
        let response = send(
            tcp(addr),
            &format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"),
            &body,
        );
        assert_eq!(response.status, 401, "{method} {path}: {}", response.body);
    }
    // Reading (and running models) needs no token in this mode.
    let tags = send(tcp(addr), "GET /api/tags HTTP/1.1\r\nHost: localhost", "");
    assert_eq!(tags.status, 200, "{}", tags.body);
    let names: Vec<String> =
        tags.json()["models"].as_array().expect("models").iter().map(|m| m["name"].to_string()).collect();
    let names = names.join(" ");
    assert!(names.contains("with-token") && names.contains("over-unix") && names.contains("chat"), "{names}");
    assert!(!names.contains("no-token") && !names.contains("wrong") && !names.contains("evil"), "{names}");
    let show = send(tcp(addr), "POST /api/show HTTP/1.1\r\nHost: localhost", r#"{"model":"chat"}"#);
    assert_eq!(show.status, 200, "{}", show.body);
}

#[test]
fn with_unix_mode_changes_over_tcp_are_refused_even_with_a_token() {
    let dir = tempfile::tempdir().expect("tempdir");
    let notify = NotifyListener::start();
    let (_corrald, addr, sock) = both_sockets(dir.path(), "unix", "api_tokens = [\"s3cret\"]", &notify);
    let refused = send(tcp(addr), &copy_head(Some("s3cret")), &copy_body("over-tcp"));
    assert_eq!(refused.status, 403, "{}", refused.body);
    let error = error_of(&refused);
    assert!(error.contains("store_changes = \"unix\"") && error.contains("UNIX socket"), "{error}");
    let removed = send(
        tcp(addr),
        "DELETE /api/delete HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nAuthorization: Bearer s3cret",
        r#"{"model":"chat"}"#,
    );
    assert_eq!(removed.status, 403, "{}", removed.body);
    // The UNIX socket (with the token every request needs here) may.
    assert_eq!(send(unix(&sock), &copy_head(Some("s3cret")), &copy_body("over-unix")).status, 200);
    let tags = send(tcp(addr), "GET /api/tags HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer s3cret", "");
    let names = tags.body;
    assert!(names.contains("over-unix") && names.contains("\"chat:latest\""), "{names}");
    assert!(!names.contains("over-tcp"), "{names}");
}

#[test]
fn version_reports_an_ollama_version_and_corrals_own() {
    let dir = tempfile::tempdir().expect("tempdir");
    let notify = NotifyListener::start();
    let port = free_port();
    let _corrald = start(dir.path(), &format!("listen = [\"127.0.0.1:{port}\"]"), &notify);
    let response = http::tcp(SocketAddr::from(([127, 0, 0, 1], port)), "GET", "/api/version");
    assert_eq!(response.status, 200);
    let json = response.json();
    assert_eq!(json["corral_version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(response.header("x-corral-version"), Some(env!("CARGO_PKG_VERSION")));
    // What clients compare: a semantic version at least as new as the features corral serves
    // (structured outputs 0.5, thinking 0.9).
    let version = json["version"].as_str().expect("version");
    let parts: Vec<u64> = version.split('.').map(|p| p.parse().expect("number")).collect();
    assert_eq!(parts.len(), 3, "{version}");
    assert!((parts[0], parts[1]) >= (0, 9), "{version}");
    assert_ne!(version, env!("CARGO_PKG_VERSION"), "the Ollama version is not corral's own");
    // Refusals carry corral's version too.
    let refused =
        send(tcp(SocketAddr::from(([127, 0, 0, 1], port))), "GET /api/tags HTTP/1.1\r\nHost: evil.example", "");
    assert_eq!(refused.header("x-corral-version"), Some(env!("CARGO_PKG_VERSION")));
}

/// One request as a fake API received it: the request line and its `Host`.
struct Received {
    line: String,
    host: String,
}

/// A fake API on `127.0.0.1` that answers `run`'s `/api/show` (the model is there) and
/// one `/api/chat` with a one-line reply, and tells what the chat request was.
fn fake_api() -> (u16, std::sync::mpsc::Receiver<Received>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        while let Ok((stream, _)) = listener.accept() {
            if let Some(chat) = answer(stream) {
                let _ = tx.send(chat);
                return;
            }
        }
    });
    (port, rx)
}

/// Reads one request from `stream` and answers it: `{}` for `/api/show`, else a chat
/// reply; the chat request as received, `None` for the show.
fn answer<S: Read + Write>(stream: S) -> Option<Received> {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).expect("request line");
    let (mut host, mut length) = (String::new(), 0usize);
    loop {
        let mut header = String::new();
        reader.read_line(&mut header).expect("header");
        let header = header.trim_end();
        if header.is_empty() {
            break;
        }
        let (name, value) = header.split_once(':').expect("header");
        match name.to_ascii_lowercase().as_str() {
            "host" => value.trim().clone_into(&mut host),
            "content-length" => length = value.trim().parse().expect("length"),
            _ => {}
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).expect("body");
    let show = line.contains("/api/show ");
    let reply =
        if show { "{}\n" } else { "{\"message\":{\"role\":\"assistant\",\"content\":\"pong\"},\"done\":true}\n" };
    let mut stream = reader.into_inner();
    let _ = write!(
        stream,
        "HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{reply}",
        reply.len()
    );
    (!show).then(|| Received { line: line.trim_end().to_owned(), host })
}

/// `corralctl run chat ping` with `env` (and no other host variable).
fn run_with(env: &[(&str, String)], args: &[&str]) -> Output {
    let mut cmd = Command::new(CORRALCTL);
    cmd.args(args).args(["run", "chat", "ping"]).env_remove("CORRAL_HOST").env_remove("OLLAMA_HOST");
    for (name, value) in env {
        cmd.env(name, value);
    }
    cmd.output().expect("run corralctl")
}

#[test]
fn corralctl_finds_the_api_through_ollama_host_and_corral_host() {
    // What `OLLAMA_HOST=0.0.0.0` (a server's bind address) means to a client: this machine.
    let (port, received) = fake_api();
    let out = run_with(&[("OLLAMA_HOST", format!("0.0.0.0:{port}"))], &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "pong");
    let got = received.recv_timeout(WAIT).expect("the request arrived");
    assert_eq!((got.line.as_str(), got.host), ("POST /api/chat HTTP/1.1", format!("127.0.0.1:{port}")));

    // With a scheme and a proxy's path prefix, quoted as people write it in unit files.
    let (port, received) = fake_api();
    let out = run_with(&[("OLLAMA_HOST", format!("\"http://127.0.0.1:{port}/ollama/\""))], &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(received.recv_timeout(WAIT).expect("arrived").line, "POST /ollama/api/chat HTTP/1.1");

    // CORRAL_HOST wins over OLLAMA_HOST, and --host over both.
    let (port, received) = fake_api();
    let nowhere = format!("127.0.0.1:{}", free_port());
    let out = run_with(&[("CORRAL_HOST", format!("localhost:{port}")), ("OLLAMA_HOST", nowhere.clone())], &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(received.recv_timeout(WAIT).expect("arrived").host, format!("localhost:{port}"));
    let (port, received) = fake_api();
    let out = Command::new(CORRALCTL)
        .args(["run", "chat", "ping", "--host", &format!("http://127.0.0.1:{port}")])
        .env("CORRAL_HOST", &nowhere)
        .env("OLLAMA_HOST", &nowhere)
        .output()
        .expect("run");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    received.recv_timeout(WAIT).expect("arrived");

    // Nothing listening: the error names where it looked.
    let out = run_with(&[("OLLAMA_HOST", nowhere.clone())], &[]);
    assert_eq!(out.status.code(), Some(69), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains(&nowhere), "{}", String::from_utf8_lossy(&out.stderr));
    // A value that does not parse is named with its variable, not silently replaced.
    let out = run_with(&[("OLLAMA_HOST", "box:http".to_owned())], &[]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("OLLAMA_HOST=box:http") && stderr.contains("port"), "{stderr}");
}

#[test]
fn corralctl_reaches_the_api_on_a_unix_socket_named_in_corral_host() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("api.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).expect("bind");
    let server = std::thread::spawn(move || {
        loop {
            let (stream, _) = listener.accept().expect("accept");
            if let Some(chat) = answer(stream) {
                return chat;
            }
        }
    });
    let out = run_with(&[("CORRAL_HOST", format!("unix:{}", sock.display())), ("OLLAMA_HOST", "0.0.0.0".into())], &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "pong");
    let chat = server.join().expect("server");
    assert_eq!(chat.line, "POST /api/chat HTTP/1.1");
}
