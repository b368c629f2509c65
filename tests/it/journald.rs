//! corrald logging to a real `systemd-journald` (a private one per test, see
//! `support::journald`): structured lifecycle entries, a rejected reload, and its
//! runners' lines with the offload event.

use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::Duration;

use nix::sys::signal::Signal;

use crate::support::container::poll_until;
use crate::support::corrald::free_port;
use crate::support::http;
use crate::support::journald::{JournalSandbox, corrald_events, field, is_corrald_event, summary};

const CORRALD: &str = env!("CARGO_BIN_EXE_corrald");
/// How long the daemon may take to start, answer, log or stop on a busy machine.
const SETTLE: Duration = Duration::from_secs(60);

/// A loopback address with a port that was free a moment ago.
fn free_loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

/// One `GET` with `Connection: close`: the status code and the body.
fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String), String> {
    let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(|e| e.to_string())?;
    stream.set_read_timeout(Some(Duration::from_secs(30))).map_err(|e| e.to_string())?;
    let response = http::request(stream, "GET", path, None);
    Ok((response.status, response.body))
}

fn wait_serving(sandbox: &mut JournalSandbox, addr: SocketAddr) -> String {
    poll_until(SETTLE, &format!("corrald to answer on {addr}"), || {
        if let Some(status) = sandbox.try_status() {
            // Logging to the journal, corrald says why it exited there, not on stderr.
            let why = summary(&sandbox.entries());
            return Ok(Err(format!("corrald exited early ({status}): {}; journal: {why}", sandbox.script_errors())));
        }
        match http_get(addr, "/api/version") {
            Ok((200, body)) => Ok(Ok(body)),
            Ok((code, body)) => Err(format!("HTTP {code}: {body}")),
            Err(e) => Err(e),
        }
    })
    .unwrap_or_else(|e: String| panic!("{e}"))
}

fn write_config(path: &Path, addr: SocketAddr, extra: &str) {
    std::fs::write(path, format!("[server]\nlisten = [\"{addr}\"]\n{extra}")).expect("write the config");
}

#[test]
fn lifecycle_events_reach_the_journal() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("corral.toml");
    let addr = free_loopback();
    write_config(&config, addr, "");
    let mut sandbox = JournalSandbox::spawn(
        CORRALD,
        &["--config".as_ref(), config.as_os_str(), "--log-target".as_ref(), "journal".as_ref()],
    );
    let pid = sandbox.command_pid();

    let body = wait_serving(&mut sandbox, addr);
    assert!(body.contains(env!("CARGO_PKG_VERSION")), "{body}");

    sandbox.signal(Signal::SIGTERM);
    let status = sandbox.wait(SETTLE);
    assert!(status.success(), "corrald did not exit cleanly on SIGTERM: {status}; {}", sandbox.script_errors());

    let entries = sandbox.entries();
    let events = corrald_events(&entries);
    let names: Vec<&str> = events.iter().map(|(e, _)| e.as_str()).collect();
    assert_eq!(names, ["start", "ready", "stop"], "lifecycle events: {}", summary(&entries));
    let message = |event: &str| events.iter().find(|(e, _)| e == event).map(|(_, m)| m.clone()).unwrap_or_default();
    assert_eq!(message("start"), format!("corrald {} starting", env!("CARGO_PKG_VERSION")));
    assert!(message("ready").contains(&format!("serving on {addr}")), "ready MESSAGE: {:?}", message("ready"));
    assert_eq!(message("stop"), "corrald stopping");

    // Every entry of corrald's came from that process over the native protocol, with structured fields.
    let own: Vec<_> = entries.iter().filter(|e| field(e, "SYSLOG_IDENTIFIER").as_deref() == Some("corrald")).collect();
    for e in &own {
        assert_eq!(field(e, "_PID"), Some(pid.to_string()), "{e}");
        assert_eq!(field(e, "_TRANSPORT").as_deref(), Some("journal"), "{e}");
        assert!(field(e, "PRIORITY").is_some(), "{e}");
    }
    let start = own.iter().find(|e| is_corrald_event(e, "start")).expect("start entry");
    assert_eq!(field(start, "VERSION").as_deref(), Some(env!("CARGO_PKG_VERSION")), "{start}");
    assert!(own.iter().any(|e| field(e, "MESSAGE").as_deref() == Some("corrald stopped")), "{}", summary(&entries));
}

#[test]
fn reload_with_a_bad_config_is_logged_and_serving_continues() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("corral.toml");
    let addr = free_loopback();
    write_config(&config, addr, "");
    let mut sandbox = JournalSandbox::spawn(
        CORRALD,
        &["--config".as_ref(), config.as_os_str(), "--log-target".as_ref(), "journal".as_ref()],
    );
    wait_serving(&mut sandbox, addr);
    sandbox.wait_for_entry(SETTLE, "the ready entry", |e| is_corrald_event(e, "ready"));

    // A key the schema does not know: the reload is rejected, naming the file, line and key.
    write_config(&config, addr, "no_such_key = true\n");
    sandbox.signal(Signal::SIGHUP);
    let entry = sandbox.wait_for_entry(SETTLE, "a reload entry", |e| is_corrald_event(e, "reload"));
    let message = field(&entry, "MESSAGE").unwrap_or_default();
    assert!(message.contains("configuration rejected"), "reload MESSAGE: {message:?}");
    assert!(message.contains("no_such_key"), "the message names the bad key: {message:?}");
    assert!(message.contains(&format!("{}:3", config.display())), "the message names file and line: {message:?}");
    let priority: u8 = field(&entry, "PRIORITY").and_then(|p| p.parse().ok()).expect("PRIORITY");
    assert!(priority <= 3, "a rejected reload is logged as an error (PRIORITY {priority}): {entry}");

    // Still serving, with the old configuration.
    let (code, body) = http_get(addr, "/api/version").expect("request after the rejected reload");
    assert_eq!(code, 200, "{body}");

    // A fixed file reloads fine.
    write_config(&config, addr, "");
    sandbox.signal(Signal::SIGHUP);
    sandbox.wait_for_entry(SETTLE, "a successful reload entry", |e| {
        is_corrald_event(e, "reload") && field(e, "MESSAGE").as_deref() == Some("configuration reloaded")
    });

    sandbox.signal(Signal::SIGTERM);
    let status = sandbox.wait(SETTLE);
    assert!(status.success(), "corrald did not exit cleanly: {status}; {}", sandbox.script_errors());
    let entries = sandbox.entries();
    let names: Vec<String> = corrald_events(&entries).into_iter().map(|(e, _)| e).collect();
    assert_eq!(names, ["start", "ready", "reload", "reload", "stop"], "{}", summary(&entries));
}

/// llama-server's own lines reach the journal as `llama-server` entries with the model,
/// the runner's pid and a priority from llama.cpp's level letter; each load adds one
/// `CORRAL_EVENT=offload` entry with the parsed layers and memory. corrald preloads a
/// model onto a local rpc-server configured as a worker, so the offload figures are real
/// llama.cpp output.
#[test]
fn llama_server_lines_and_the_offload_event_reach_the_journal() {
    let dir = tempfile::tempdir().expect("tempdir");
    crate::support::api::demo_store(dir.path());
    let rpc = crate::support::llama::RpcServer::start_free();
    let config = dir.path().join("corral.toml");
    let addr = free_loopback();
    write_config(
        &config,
        addr,
        &format!(
            "[store]\npath = \"{}\"\n[runner]\nllama_server = \"{}\"\n[scheduler]\nnum_ctx = 512\n\
             [gpu]\nfixed = true\nhost_memory = \"4GiB\"\n[[workers]]\naddress = \"{}\"\n[models.\"chat\"]\npreload = true\n",
            dir.path().join("models").display(),
            crate::support::llama::bin_dir().join("llama-server").display(),
            rpc.endpoint(),
        ),
    );
    let mut sandbox = JournalSandbox::spawn(
        CORRALD,
        &["--config".as_ref(), config.as_os_str(), "--log-target".as_ref(), "journal".as_ref()],
    );

    let offload = sandbox.wait_for_entry(SETTLE, "the offload event", |e| is_corrald_event(e, "offload"));
    let pid = field(&offload, "CORRAL_RUNNER_PID").expect("CORRAL_RUNNER_PID");
    assert_eq!(field(&offload, "CORRAL_MODEL").as_deref(), Some("chat:latest"));
    assert_eq!(field(&offload, "CORRAL_GPU_LAYERS").as_deref(), Some("5"));
    assert_eq!(field(&offload, "CORRAL_TOTAL_LAYERS").as_deref(), Some("5"));
    let vram: u64 = field(&offload, "CORRAL_VRAM_BYTES").and_then(|v| v.parse().ok()).expect("CORRAL_VRAM_BYTES");
    let ram: u64 = field(&offload, "CORRAL_RAM_BYTES").and_then(|v| v.parse().ok()).expect("CORRAL_RAM_BYTES");
    assert!(vram > 400_000, "the weights sit on the rpc device: {vram}");
    assert!(ram > 0, "output and host buffers: {ram}");

    sandbox.signal(Signal::SIGTERM);
    assert!(sandbox.wait(SETTLE).success(), "{}", sandbox.script_errors());
    let entries = sandbox.entries();
    let child_lines: Vec<&serde_json::Value> =
        entries.iter().filter(|e| field(e, "SYSLOG_IDENTIFIER").as_deref() == Some("llama-server")).collect();
    assert!(child_lines.len() > 20, "every llama-server line is forwarded: {}", summary(&entries));
    for entry in &child_lines {
        assert_eq!(field(entry, "CORRAL_MODEL").as_deref(), Some("chat:latest"));
        assert_eq!(field(entry, "CORRAL_RUNNER_PID").as_deref(), Some(pid.as_str()));
    }
    let line_with = |text: &str| {
        child_lines
            .iter()
            .find(|e| field(e, "MESSAGE").is_some_and(|m| m.contains(text)))
            .unwrap_or_else(|| panic!("no llama-server entry containing {text:?}"))
    };
    assert_eq!(field(line_with("offloaded 5/5 layers to GPU"), "PRIORITY").as_deref(), Some("6"));
    assert_eq!(field(line_with("listening on unix://"), "PRIORITY").as_deref(), Some("6"));
    // The I/W/E prefix is gone from the message: the priority carries it.
    let warning = line_with("no API key is set");
    assert_eq!(field(warning, "PRIORITY").as_deref(), Some("4"));
    assert!(field(warning, "MESSAGE").is_some_and(|m| m.starts_with("srv ")), "{warning}");
}
