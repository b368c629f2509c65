//! The HTTP edge under hostile clients (issue 13): cross-site browser requests, Host
//! tricks, server paths in errors, and slow clients. Most tests drive a real corrald
//! over TCP with raw requests; the thread-exhaustion test drives the router in-process
//! with hundreds of stalled bodies.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{Request, StatusCode};
use corral::config::ServerConfig;
use corral::http::listeners::MAX_HEAD;
use corral::http::{AppState, LocalNames, Safety, router};
use corral::scheduler::actor::Scheduler;
use corral::scheduler::footprints::Footprints;
use corral::scheduler::request::Defaults;
use corral::store::Store;
use corral::store::digest::Digest;
use tower::ServiceExt;

use crate::support::api::{demo_store, fake_behaviour, limits};
use crate::support::container::poll_until;
use crate::support::corrald::{CORRALD, Corrald, free_port, write_config};
use crate::support::http::{self, Response};
use crate::support::notify::NotifyListener;

const WAIT: Duration = Duration::from_secs(60);
/// A llama-server that does not exist, under a directory whose name must never reach a client.
const MISSING_LLAMA: &str = "/nonexistent-corral-secret/bin/llama-server";

/// corrald on [`demo_store`] in `dir` (models `chat` and `embed`), on a free loopback
/// port, with `server` added to its `[server]` table; returns it, its port and the store.
fn corrald(dir: &Path, server: &str, notify: &NotifyListener) -> (Corrald, u16) {
    let (config, port) = config(dir, server);
    let corrald = Corrald::start(&["--config", config.to_str().expect("utf-8")], Some(notify.path()));
    notify.wait_for("READY", "1", WAIT);
    (corrald, port)
}

fn config(dir: &Path, server: &str) -> (PathBuf, u16) {
    config_with(dir, server, MISSING_LLAMA)
}

/// [`config`] with `llama_server` as the runner.
fn config_with(dir: &Path, server: &str, llama_server: &str) -> (PathBuf, u16) {
    drop(demo_store(dir));
    let port = free_port();
    let config = write_config(
        dir,
        "corral.toml",
        &format!(
            "[server]\nlisten = [\"127.0.0.1:{port}\"]\n{server}\n[store]\npath = \"{}\"\n[runner]\n\
             llama_server = \"{llama_server}\"\n[gpu]\nfixed = true\nhost_memory = \"4GiB\"\n[dbus]\nbus = \"off\"\n",
            dir.join("models").display(),
        ),
    );
    (config, port)
}

/// Sends `head` (request line and headers, without the blank line) and `body` on a new
/// connection, with `Connection: close`, and reads the answer to its end.
fn raw(port: u16, head: &str, body: &[u8]) -> Response {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    stream.set_read_timeout(Some(WAIT)).expect("timeout");
    let head = format!("{head}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
    stream.write_all(head.as_bytes()).expect("send head");
    stream.write_all(body).expect("send body");
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply).expect("read the answer");
    http::parse(&reply)
}

/// The error message of an Ollama- or OpenAI-shaped error body.
fn error_of(response: &Response) -> String {
    let json = response.json();
    json["error"].as_str().or_else(|| json["error"]["message"].as_str()).unwrap_or_default().to_owned()
}

/// Every file under the store, with its size: what a refused request must not change.
fn store_files(root: &Path) -> BTreeSet<(PathBuf, u64)> {
    let mut out = BTreeSet::new();
    let mut dirs = vec![root.to_owned()];
    // A file or directory removed while the walk runs (a partial upload going) is not there.
    let gone = |e: &std::io::Error| e.kind() == ErrorKind::NotFound;
    while let Some(dir) = dirs.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Err(e) if gone(&e) => continue,
            entries => entries.expect("read_dir"),
        };
        for entry in entries {
            let entry = entry.expect("entry");
            let meta = match entry.metadata() {
                Err(e) if gone(&e) => continue,
                meta => meta.expect("metadata"),
            };
            if meta.is_dir() {
                dirs.push(entry.path());
            } else {
                out.insert((entry.path().strip_prefix(root).expect("inside").to_owned(), meta.len()));
            }
        }
    }
    out
}

/// The routes that change the store or run a model, with a body that would do it.
fn changing_requests(blob: &Digest) -> Vec<(&'static str, String, String)> {
    vec![
        ("POST", "/api/copy".into(), r#"{"source":"chat","destination":"stolen"}"#.into()),
        ("POST", "/api/create".into(), r#"{"model":"evil","from":"chat","system":"pwned"}"#.into()),
        ("POST", "/api/pull".into(), r#"{"model":"127.0.0.1:1/evil/model","insecure":true}"#.into()),
        ("POST", "/api/push".into(), r#"{"model":"chat","insecure":true}"#.into()),
        ("DELETE", "/api/delete".into(), r#"{"model":"chat"}"#.into()),
        ("POST", format!("/api/blobs/{blob}"), "evil bytes".into()),
        ("POST", "/api/generate".into(), r#"{"model":"chat","prompt":"hi"}"#.into()),
        ("POST", "/api/chat".into(), r#"{"model":"chat","messages":[]}"#.into()),
        ("POST", "/api/embed".into(), r#"{"model":"embed","input":"hi"}"#.into()),
        ("POST", "/v1/chat/completions".into(), r#"{"model":"chat","messages":[]}"#.into()),
    ]
}

#[test]
fn cross_site_browser_requests_are_refused_on_every_changing_route_and_change_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let notify = NotifyListener::start();
    let (corrald, port) = corrald(dir.path(), "", &notify);
    let store = dir.path().join("models");
    let before = store_files(&store);
    let blob = Digest::of(b"evil bytes");

    // What a page on another site can send without a preflight: text, forms, multipart;
    // and a request its browser marks as cross-site, with the Origin left out.
    let browsers = [
        ("Origin: https://evil.example", "text/plain;charset=UTF-8", "\"https://evil.example\""),
        ("Origin: https://evil.example", "application/x-www-form-urlencoded", "\"https://evil.example\""),
        ("Origin: null", "multipart/form-data; boundary=x", "\"null\""),
        ("Origin: http://localhost.evil.example:11434", "application/json", "localhost.evil.example"),
        ("Sec-Fetch-Site: cross-site", "text/plain", "another site"),
        ("Sec-Fetch-Site: same-site", "application/json", "another site"),
    ];
    for (method, path, body) in changing_requests(&blob) {
        for (marker, content_type, named) in browsers {
            let head = format!(
                "{method} {path} HTTP/1.1\r\nHost: localhost:{port}\r\n{marker}\r\nContent-Type: {content_type}"
            );
            let response = raw(port, &head, body.as_bytes());
            assert_eq!(response.status, 403, "{method} {path} {marker} {content_type}: {}", response.body);
            let error = error_of(&response);
            assert!(error.contains(named), "{method} {path}: the refusal names the origin: {error}");
            assert!(response.header("access-control-allow-origin").is_none(), "{response:?}");
        }
    }
    assert_eq!(store_files(&store), before, "no refused request changed the store");
    assert!(!corrald.stderr().contains("corral_event=\"load\""), "no refused request tried to start a model");
}

#[test]
fn allowed_origins_and_clients_that_are_not_browsers_still_work() {
    let dir = tempfile::tempdir().expect("tempdir");
    let notify = NotifyListener::start();
    let (_corrald, port) = corrald(dir.path(), "", &notify);
    let copy = |to: &str| format!(r#"{{"source":"chat","destination":"{to}"}}"#);
    let host = format!("Host: 127.0.0.1:{port}");

    // A page on an allowed origin, with JSON; its answer carries the CORS header.
    let head = format!(
        "POST /api/copy HTTP/1.1\r\n{host}\r\nOrigin: http://localhost:3000\r\nSec-Fetch-Site: same-site\r\n\
         Sec-Fetch-Mode: cors\r\nContent-Type: application/json"
    );
    let response = raw(port, &head, copy("by-page").as_bytes());
    assert_eq!(response.status, 200, "{}", response.body);
    assert_eq!(response.header("access-control-allow-origin"), Some("http://localhost:3000"));
    // Ollama's clients: JSON, no Origin; or no Content-Type at all.
    let response = raw(
        port,
        &format!("POST /api/copy HTTP/1.1\r\n{host}\r\nContent-Type: application/json"),
        copy("by-client").as_bytes(),
    );
    assert_eq!(response.status, 200, "{}", response.body);
    let response = raw(port, &format!("POST /api/copy HTTP/1.1\r\n{host}"), copy("untyped").as_bytes());
    assert_eq!(response.status, 200, "{}", response.body);
    // `curl -d` (every example in Ollama's documentation) sends a form type.
    let curl = format!(
        "POST /api/copy HTTP/1.1\r\n{host}\r\nUser-Agent: curl/8.5.0\r\nContent-Type: application/x-www-form-urlencoded"
    );
    let response = raw(port, &curl, copy("by-curl").as_bytes());
    assert_eq!(response.status, 200, "{}", response.body);
    // A user's own navigation (Sec-Fetch-Site: none) is not a cross-site request.
    let typed = format!("POST /api/copy HTTP/1.1\r\n{host}\r\nSec-Fetch-Site: none\r\nContent-Type: application/json");
    assert_eq!(raw(port, &typed, copy("typed").as_bytes()).status, 200);

    // The same form from a browser on an allowed origin, and text from anyone: 415.
    let form = format!(
        "POST /api/copy HTTP/1.1\r\n{host}\r\nOrigin: http://localhost:3000\r\nContent-Type: application/x-www-form-urlencoded"
    );
    let response = raw(port, &form, copy("form").as_bytes());
    assert_eq!(response.status, 415, "{}", response.body);
    assert!(error_of(&response).contains("form body"), "{}", response.body);
    let text = format!("POST /api/copy HTTP/1.1\r\n{host}\r\nContent-Type: text/plain");
    let response = raw(port, &text, copy("text").as_bytes());
    assert_eq!(response.status, 415, "{}", response.body);
    assert!(error_of(&response).contains("\"text/plain\""), "{}", response.body);

    // Reading from any page is answered (without CORS headers, so its script cannot read it).
    let response = raw(port, &format!("GET /api/tags HTTP/1.1\r\n{host}\r\nOrigin: https://evil.example"), b"");
    assert_eq!(response.status, 200);
    assert!(response.header("access-control-allow-origin").is_none());
    let names: BTreeSet<String> = response.json()["models"]
        .as_array()
        .expect("models")
        .iter()
        .map(|m| m["name"].as_str().expect("name").to_owned())
        .collect();
    for name in ["by-page", "by-client", "untyped", "by-curl", "typed"] {
        assert!(names.contains(&format!("{name}:latest")), "{name} was copied: {names:?}");
    }
    assert!(!names.contains("form:latest") && !names.contains("text:latest"), "{names:?}");
}

#[test]
fn two_host_headers_and_absolute_targets_naming_other_hosts_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let notify = NotifyListener::start();
    let (_corrald, port) = corrald(dir.path(), "", &notify);
    let store = dir.path().join("models");
    let before = store_files(&store);
    let body = r#"{"source":"chat","destination":"rebound"}"#.as_bytes();

    for hosts in [
        "Host: localhost\r\nHost: evil.example",
        "Host: evil.example\r\nHost: localhost",
        "Host: localhost\r\nHost: localhost",
    ] {
        let response =
            raw(port, &format!("POST /api/copy HTTP/1.1\r\n{hosts}\r\nContent-Type: application/json"), body);
        assert_eq!(response.status, 400, "{hosts}: {}", response.body);
        assert!(error_of(&response).contains("more than one Host"), "{}", response.body);
    }
    for target in
        ["http://evil.example/api/copy", "http://evil.example:11434/api/copy", "http://localhost@evil.example/api/copy"]
    {
        let head = format!("POST {target} HTTP/1.1\r\nHost: localhost:{port}\r\nContent-Type: application/json");
        let response = raw(port, &head, body);
        assert_eq!(response.status, 403, "{target}: {}", response.body);
        let error = error_of(&response);
        assert!(error.contains("evil.example") && error.contains("allowed_hosts"), "{error}");
    }
    assert_eq!(store_files(&store), before, "no refused request changed the store");
    // An absolute-form target naming this server is fine.
    let local = raw(port, &format!("GET http://localhost:{port}/api/version HTTP/1.1\r\nHost: localhost:{port}"), b"");
    assert_eq!(local.status, 200, "{}", local.body);
}

/// Text that must never reach a client: where the store, the daemon's directories and
/// llama-server are.
fn assert_no_server_paths(what: &str, body: &str, secrets: &[&Path]) {
    for secret in secrets {
        let secret = secret.display().to_string();
        assert!(!body.contains(&secret), "{what}: the answer shows {secret}: {body}");
    }
    assert!(!body.contains("nonexistent-corral-secret"), "{what}: the answer shows llama-server's path: {body}");
    assert!(!body.contains("/models/"), "{what}: the answer shows a store path: {body}");
}

#[test]
fn error_answers_show_no_server_paths() {
    let dir = tempfile::tempdir().expect("tempdir");
    let notify = NotifyListener::start();
    let (corrald, port) = corrald(dir.path(), "", &notify);
    let store = dir.path().join("models");
    let secrets = [dir.path(), store.as_path(), Path::new(MISSING_LLAMA)];
    let host = format!("Host: localhost:{port}");
    let json = |path: &str, body: &str| {
        raw(port, &format!("POST {path} HTTP/1.1\r\n{host}\r\nContent-Type: application/json"), body.as_bytes())
    };

    // A load that cannot start llama-server (its path is in the error).
    for (path, body) in [
        ("/api/generate", r#"{"model":"chat","prompt":"hi","stream":false}"#),
        ("/api/chat", r#"{"model":"chat","messages":[{"role":"user","content":"hi"}]}"#),
        ("/v1/chat/completions", r#"{"model":"chat","messages":[{"role":"user","content":"hi"}]}"#),
    ] {
        let response = json(path, body);
        assert!(response.status >= 500, "{path}: {} {}", response.status, response.body);
        assert!(
            error_of(&response).contains("llama-server"),
            "{path}: the error still says what failed: {}",
            response.body
        );
        assert_no_server_paths(path, &response.body, &secrets);
    }
    corrald.wait_stderr(MISSING_LLAMA, WAIT);

    // The store failing on disk: the manifests' directory of a new name is a file.
    std::fs::write(store.join("manifests/registry.ollama.ai/blocked"), "not a directory").expect("plant a file");
    for (path, body) in [
        ("/api/copy", r#"{"source":"chat","destination":"blocked/model"}"#),
        ("/api/create", r#"{"model":"blocked/model","from":"chat","stream":false}"#),
        ("/api/create", r#"{"model":"blocked/model","from":"chat"}"#),
    ] {
        let response = json(path, body);
        assert_no_server_paths(path, &response.body, &secrets);
        assert!(response.body.contains("error"), "{path} failed: {} {}", response.status, response.body);
    }
    // A blob that cannot be written: the store's blob directory is gone.
    std::fs::rename(store.join("blobs"), dir.path().join("blobs-moved")).expect("move blobs");
    let data = b"some weights";
    let upload = raw(port, &format!("POST /api/blobs/{} HTTP/1.1\r\n{host}", Digest::of(data)), data);
    assert_eq!(upload.status, 500, "{}", upload.body);
    assert_no_server_paths("/api/blobs", &upload.body, &secrets);
    let tags = raw(port, &format!("POST /api/show HTTP/1.1\r\n{host}"), br#"{"model":"chat"}"#);
    assert_no_server_paths("/api/show", &tags.body, &secrets);
    // The journal (here stderr) keeps the whole error (the store names its files relative
    // to its root; llama-server's absolute path was checked above).
    corrald.wait_stderr("refusing manifests/registry.ollama.ai/blocked in the model store", WAIT);
}

/// Reads from `stream` until the server closes it; how long that took, or `None` when it
/// stayed open for `within`.
fn closed_within(stream: &mut TcpStream, within: Duration) -> Option<Duration> {
    let started = Instant::now();
    stream.set_read_timeout(Some(within)).expect("timeout");
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return Some(started.elapsed()),
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => return None,
            Err(_) => return Some(started.elapsed()),
        }
    }
}

#[test]
fn half_sent_headers_and_silent_connections_are_closed_within_the_header_timeout() {
    let dir = tempfile::tempdir().expect("tempdir");
    let notify = NotifyListener::start();
    let (_corrald, port) = corrald(dir.path(), "header_timeout = \"1s\"", &notify);
    // The bound: the timeout and a generous margin for a loaded machine.
    let bound = Duration::from_secs(15);

    let mut half = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    half.write_all(b"POST /api/pull HTTP/1.1\r\nHost: localh").expect("send half a head");
    let took = closed_within(&mut half, bound).expect("a half-sent head is closed");
    assert!(took >= Duration::from_millis(900), "closed after the timeout, not before: {took:?}");

    let mut silent = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    closed_within(&mut silent, bound).expect("a connection that sends nothing is closed");

    // A client that sends its head in time is served, and may keep its connection.
    let mut client = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    client.write_all(format!("GET /api/version HTTP/1.1\r\nHost: localhost:{port}\r\n\r\n").as_bytes()).expect("send");
    client.set_read_timeout(Some(WAIT)).expect("timeout");
    let mut reply = [0u8; 1024];
    let n = client.read(&mut reply).expect("answer");
    assert!(reply[..n].starts_with(b"HTTP/1.1 200 OK"), "{}", String::from_utf8_lossy(&reply[..n]));
    // Kept alive, it is closed once it sends no next request within the timeout.
    closed_within(&mut client, bound).expect("an idle kept-alive connection is closed");
}

/// Sends `bytes` on a new connection (as much as the server takes) and reads until it
/// closes: what it answered. A server that closes with part of a request unread resets the
/// connection, which ends the read; `read_to_end` keeps what had arrived before.
fn send_and_read_answer(port: u16, bytes: &[u8]) -> String {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    stream.set_read_timeout(Some(WAIT)).expect("timeout");
    let _ = stream.write_all(bytes);
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    String::from_utf8_lossy(&answer).into_owned()
}

#[test]
fn request_heads_over_their_bounds_are_answered_431_and_the_daemon_serves_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let notify = NotifyListener::start();
    let (_corrald, port) = corrald(dir.path(), "", &notify);
    let start = format!("GET /api/version HTTP/1.1\r\nHost: localhost:{port}\r\nConnection: close\r\n");
    let filler = |len: usize| format!("{start}X-Filler: {}\r\n\r\n", "a".repeat(len));
    let many = (0..100).fold(String::new(), |mut all, i| {
        let _ = write!(all, "X-Header-{i}: v\r\n");
        all
    });
    for (what, head) in [
        ("a head with one header of MAX_HEAD bytes", filler(MAX_HEAD)),
        ("a head that never ends, twice MAX_HEAD long", format!("{start}X-Filler: {}", "a".repeat(2 * MAX_HEAD))),
        ("102 headers (hyper's bound is 100)", format!("{start}{many}\r\n")),
    ] {
        let answer = send_and_read_answer(port, head.as_bytes());
        assert!(answer.starts_with("HTTP/1.1 431 "), "{what}: {}", answer.chars().take(300).collect::<String>());
    }
    // A head just within the bound is served, and so is the next client.
    for head in [filler(MAX_HEAD - 1024), format!("{start}\r\n")] {
        let answer = send_and_read_answer(port, head.as_bytes());
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{}", answer.chars().take(300).collect::<String>());
    }
}

/// A client that asks for an endless stream and reads none of it is let go after
/// `send_timeout`: its request ends, which frees the runner's one slot for the next
/// request, and the log says why.
#[test]
fn a_client_that_stops_reading_its_answer_is_let_go_after_send_timeout() {
    let dir = tempfile::tempdir().expect("tempdir");
    let notify = NotifyListener::start();
    let (config, port) = config_with(dir.path(), "send_timeout = \"3s\"", env!("CARGO_BIN_EXE_fake-llama-server"));
    // Tokens of 64 KiB: the socket's buffers (4 MiB on loopback) fill in a moment.
    let store = Store::open(&dir.path().join("models")).expect("store");
    fake_behaviour(&store, "chat", &serde_json::json!({ "token_bytes": 65536 }));
    let corrald = Corrald::start(&["--config", config.to_str().expect("utf-8")], Some(notify.path()));
    notify.wait_for("READY", "1", WAIT);
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    // The runner's requests in flight, from /metrics.
    let active = || {
        let metrics = http::tcp(addr, "GET", "/metrics").body;
        let line = metrics.lines().find(|l| l.starts_with("corral_runner_active_requests{model=\"chat:latest\""));
        line.and_then(|l| l.rsplit(' ').next()?.parse::<u32>().ok()).ok_or_else(|| metrics.clone())
    };

    // The fake runner streams a billion tokens, as fast as they are taken.
    let body = r#"{"model":"chat","prompt":"hi","options":{"num_predict":1000000000}}"#;
    let mut stalled = TcpStream::connect(addr).expect("connect");
    let head = format!("POST /api/generate HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}\r\n\r\n", body.len());
    stalled.write_all(format!("{head}{body}").as_bytes()).expect("request");
    poll_until(WAIT, "the stream to hold the runner", || match active()? {
        1 => Ok(()),
        n => Err(format!("{n} requests")),
    });
    poll_until(WAIT, "the stalled client's request to end", || match active()? {
        0 => Ok(()),
        n => Err(format!("{n} requests")),
    });
    assert!(corrald.stderr().contains("[server] send_timeout"), "{}", corrald.stderr());
    // Its connection is closed: what was buffered drains, then the stream ends.
    stalled.set_read_timeout(Some(WAIT)).expect("timeout");
    let mut sink = vec![0; 1 << 20];
    while stalled.read(&mut sink).expect("read until closed") > 0 {}

    // The next request gets the runner's slot.
    let body = r#"{"model":"chat","prompt":"hi","stream":false,"options":{"num_predict":3}}"#;
    let response = raw(port, "POST /api/generate HTTP/1.1\r\nHost: localhost", body.as_bytes());
    assert_eq!(response.status, 200, "{}", response.body);
}

#[test]
fn an_upload_that_stalls_is_aborted_and_its_partial_file_removed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let notify = NotifyListener::start();
    let (_corrald, port) = corrald(dir.path(), "body_idle_timeout = \"1s\"", &notify);
    let blobs = dir.path().join("models/blobs");
    let before = store_files(&blobs);

    let data = vec![7u8; 100_000];
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    let head = format!(
        "POST /api/blobs/{} HTTP/1.1\r\nHost: localhost:{port}\r\nContent-Length: {}\r\n\r\n",
        Digest::of(&data),
        data.len()
    );
    stream.write_all(head.as_bytes()).expect("head");
    stream.write_all(&data[..1000]).expect("a little of the body");
    // The partial file appears, then the upload stalls.
    poll_until(WAIT, "the upload's partial file", || {
        if store_files(&blobs).len() > before.len() { Ok(()) } else { Err("none yet".into()) }
    });
    stream.set_read_timeout(Some(WAIT)).expect("timeout");
    let mut reply = Vec::new();
    let _ = stream.read_to_end(&mut reply);
    let response = http::parse(&reply);
    assert_eq!(response.status, 408, "{}", response.body);
    assert!(error_of(&response).contains("body_idle_timeout"), "{}", response.body);
    poll_until(WAIT, "the partial file removed", || {
        let now = store_files(&blobs);
        if now == before { Ok(()) } else { Err(format!("{now:?}")) }
    });
}

#[test]
fn uploads_beyond_max_uploads_get_503_with_retry_after() {
    let dir = tempfile::tempdir().expect("tempdir");
    let notify = NotifyListener::start();
    let (_corrald, port) = corrald(dir.path(), "max_uploads = 2", &notify);
    let data = vec![9u8; 10_000];
    let head = format!(
        "POST /api/blobs/{} HTTP/1.1\r\nHost: localhost:{port}\r\nContent-Length: {}\r\n\r\n",
        Digest::of(&data),
        data.len()
    );
    let blobs = dir.path().join("models/blobs");
    let before = store_files(&blobs).len();
    let mut stalled: Vec<TcpStream> = (0..2)
        .map(|_| {
            let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
            stream.write_all(head.as_bytes()).expect("head");
            stream.write_all(&data[..10]).expect("a little");
            stream
        })
        .collect();
    poll_until(WAIT, "two uploads in progress", || {
        let now = store_files(&blobs).len();
        if now == before + 2 { Ok(()) } else { Err(format!("{now} files")) }
    });
    let third = raw(port, &format!("POST /api/blobs/{} HTTP/1.1\r\nHost: localhost:{port}", Digest::of(&data)), &data);
    assert_eq!(third.status, 503, "{}", third.body);
    assert!(third.header("retry-after").is_some(), "{third:?}");
    assert!(error_of(&third).contains("max_uploads"), "{}", third.body);

    // One finishes; its place is free again.
    let mut first = stalled.remove(0);
    first.write_all(&data[10..]).expect("the rest");
    first.set_read_timeout(Some(WAIT)).expect("timeout");
    let mut reply = Vec::new();
    let mut buf = [0u8; 1024];
    while !reply.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = first.read(&mut buf).expect("answer");
        assert!(n > 0, "closed without an answer");
        reply.extend_from_slice(&buf[..n]);
    }
    assert!(reply.starts_with(b"HTTP/1.1 201"), "{}", String::from_utf8_lossy(&reply));
    drop(first);
    let other = b"other weights";
    let next = raw(port, &format!("POST /api/blobs/{} HTTP/1.1\r\nHost: localhost:{port}", Digest::of(other)), other);
    assert_eq!(next.status, 201, "{}", next.body);
}

/// A router over [`demo_store`] whose runners would use a llama-server that does not exist.
fn in_process(dir: &Path, server: &ServerConfig) -> AppState {
    let store: Store = demo_store(dir);
    let mut backend = crate::support::api::backend(dir);
    backend.config.llama_server = MISSING_LLAMA.into();
    let (scheduler, handle) = Scheduler::new(Arc::new(backend), Vec::new(), 4 << 30, limits(), Footprints::in_memory());
    tokio::spawn(scheduler.run());
    let mut state = AppState::for_tests(store, handle, Defaults { num_ctx: 512, parallel: 1 });
    state.safety = Arc::new(Safety::new(server, LocalNames::system()));
    state
}

async fn call(state: &AppState, method: &str, path: &str, body: Body) -> StatusCode {
    let request = Request::builder().method(method).uri(path).body(body).expect("request");
    router(state.clone()).oneshot(request).await.expect("infallible").status()
}

/// A body of more JSON values than any request carries (each a few bytes of text, 32 in
/// memory) is refused with 413 on every JSON route before it is parsed, naming the bound;
/// nothing is loaded or stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_of_millions_of_json_values_is_refused_on_every_json_route() {
    use http_body_util::BodyExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let state = in_process(dir.path(), &ServerConfig::default());
    let before = state.store.list().expect("list").len();
    // 3 MiB of `0,`: 1.5 million values, within max_body.
    let body = format!(r#"{{"model":"chat","prompt":[{}0]}}"#, "0,".repeat(3 << 19));
    for path in [
        "/api/chat",
        "/api/generate",
        "/api/embed",
        "/api/embeddings",
        "/api/show",
        "/api/create",
        "/api/pull",
        "/api/push",
        "/api/copy",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/messages",
    ] {
        let request = Request::builder().method("POST").uri(path).body(Body::from(body.clone())).expect("request");
        let response = router(state.clone()).oneshot(request).await.expect("infallible");
        let status = response.status();
        let text =
            String::from_utf8_lossy(&response.into_body().collect().await.expect("body").to_bytes()).into_owned();
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{path}: {text}");
        assert!(text.contains("the request body holds more than 1048576 JSON values"), "{path}: {text}");
    }
    assert_eq!(state.store.list().expect("list").len(), before);
    assert!(state.scheduler.loaded().await.expect("loaded").is_empty());
}

/// Temporary files in the store's blob directory: one per upload in progress.
fn partial_files(state: &AppState) -> usize {
    std::fs::read_dir(state.store.blobs_dir())
        .expect("blobs/")
        .filter(|e| e.as_ref().is_ok_and(|e| e.file_name().to_string_lossy().starts_with(".tmp-")))
        .count()
}

/// More stalled uploads than the blocking pool has threads (512): before, each parked a
/// thread waiting for the network, and every store operation queued behind them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_uploads_hold_no_thread_and_store_operations_still_answer() {
    const STALLED: usize = 600;
    let dir = tempfile::tempdir().expect("tempdir");
    let server =
        ServerConfig { max_uploads: 1000, body_idle_timeout: Duration::from_secs(600), ..ServerConfig::default() };
    let state = in_process(dir.path(), &server);
    let mut senders = Vec::new();
    let mut uploads = tokio::task::JoinSet::new();
    for i in 0..STALLED {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
        tx.send(Ok(Bytes::from(vec![1u8; 100]))).await.expect("first chunk");
        senders.push(tx);
        let body = Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|chunk| (chunk, rx))
        }));
        let path = format!("/api/blobs/{}", Digest::of(format!("never sent {i}").as_bytes()));
        let state = state.clone();
        uploads.spawn(async move { call(&state, "POST", &path, body).await });
    }
    let deadline = Instant::now() + WAIT;
    while partial_files(&state) < 512 {
        assert!(Instant::now() < deadline, "only {} uploads started", partial_files(&state));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Store operations answer at once, though every upload is waiting for its client.
    let prompt = Duration::from_secs(20);
    let tags = tokio::time::timeout(prompt, call(&state, "GET", "/api/tags", Body::empty())).await;
    assert_eq!(tags.expect("/api/tags answered while uploads stall"), StatusCode::OK);
    let copy = Body::from(r#"{"source":"chat","destination":"copied"}"#);
    let copied = tokio::time::timeout(prompt, call(&state, "POST", "/api/copy", copy)).await;
    assert_eq!(copied.expect("/api/copy answered while uploads stall"), StatusCode::OK);
    let head = format!("/api/blobs/{}", Digest::of(b"absent"));
    let present = tokio::time::timeout(prompt, call(&state, "HEAD", &head, Body::empty())).await;
    assert_eq!(present.expect("HEAD /api/blobs answered while uploads stall"), StatusCode::NOT_FOUND);

    // Bodies that end short of their digest are refused, and leave no partial file.
    drop(senders);
    while let Some(status) = tokio::time::timeout(WAIT, uploads.join_next()).await.expect("uploads end") {
        assert_eq!(status.expect("upload task"), StatusCode::BAD_REQUEST);
    }
    assert_eq!(partial_files(&state), 0, "partial files removed");
}

#[test]
fn the_units_raise_the_open_files_limit_and_corrald_its_soft_limit() {
    for unit in ["systemd/corrald.service", "systemd/user/corrald.service"] {
        let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(unit)).expect("unit");
        let limit = text
            .lines()
            .find_map(|l| l.strip_prefix("LimitNOFILE="))
            .unwrap_or_else(|| panic!("{unit} sets no LimitNOFILE="));
        let soft = limit.split(':').next().and_then(|n| n.parse::<u64>().ok()).expect("a number");
        assert!(soft >= 65_536, "{unit}: LimitNOFILE={limit}");
    }

    // Started with the usual soft limit of 1024, corrald raises it to the hard one.
    let dir = tempfile::tempdir().expect("tempdir");
    let (config, _port) = config(dir.path(), "");
    let notify = NotifyListener::start();
    let mut cmd = std::process::Command::new("sh");
    cmd.args(["-c", "ulimit -Sn 1024 && exec \"$0\" \"$@\"", CORRALD, "--log-target", "stderr"])
        .args(["--config", config.to_str().expect("utf-8")])
        .env("NOTIFY_SOCKET", notify.path());
    let corrald = Corrald::spawn(cmd);
    notify.wait_for("READY", "1", WAIT);
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", corrald.pid())).expect("limits");
    let line = limits.lines().find(|l| l.starts_with("Max open files")).expect("open files line");
    let numbers: Vec<&str> = line.split_whitespace().skip(3).take(2).collect();
    assert_eq!(numbers[0], numbers[1], "the soft limit is the hard one: {line}");
    let hard: u64 = numbers[1].parse().unwrap_or(u64::MAX);
    assert!(hard <= 1024 || numbers[0] != "1024", "{line}");
}
