//! A load's memory projection is made once per key: the next load of the same model with
//! the same options takes it from the cache, without running `llama-fit-params` again
//! (what a first load pays, measured by `benches/big_load.rs`, is paid once).

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use crate::support::corrald::{on_demo_store_with, write_config};
use crate::support::http::{connect, request};
use crate::support::notify::NotifyListener;

/// `body` sent with POST to `path` on corrald at `port`; the answer's status and JSON.
fn post(port: u16, path: &str, body: &str) -> (u16, serde_json::Value) {
    let stream = connect("corrald", || std::net::TcpStream::connect(("127.0.0.1", port)));
    stream.set_read_timeout(Some(Duration::from_secs(120))).expect("timeout");
    let response = request(stream, "POST", path, Some(body));
    (response.status, response.json())
}

/// How many times the wrapper ran the real llama-fit-params.
fn runs(count: &Path) -> usize {
    std::fs::read_to_string(count).map_or(0, |text| text.lines().count())
}

/// Unloads `chat` and waits until `/api/ps` is empty.
fn unload(port: u16) {
    assert_eq!(post(port, "/api/generate", r#"{"model":"chat","keep_alive":0}"#).0, 200);
    crate::support::container::poll_until(Duration::from_secs(60), "chat to be unloaded", || {
        let ps = crate::support::http::tcp(([127, 0, 0, 1], port).into(), "GET", "/api/ps").json();
        if ps["models"].as_array().is_some_and(Vec::is_empty) { Ok(()) } else { Err(ps.to_string()) }
    });
}

#[test]
fn a_second_load_takes_the_projection_from_the_cache() {
    let dir = tempfile::tempdir().expect("tempdir");
    // The real llama-fit-params, behind a script that counts its runs.
    let real = crate::support::llama::bin_dir().join("llama-fit-params");
    let real = if real.is_file() {
        real
    } else {
        let bin = crate::support::llama::bin_dir();
        let key = bin.parent().and_then(Path::file_name).expect("key").to_string_lossy().into_owned();
        bin.parent().and_then(Path::parent).expect("cache").join(format!("build-{key}/bin/llama-fit-params"))
    };
    assert!(real.is_file(), "no llama-fit-params at {}", real.display());
    let count = dir.path().join("runs");
    let wrapper = dir.path().join("llama-fit-params");
    std::fs::write(
        &wrapper,
        format!("#!/bin/sh\necho run >> '{}'\nexec '{}' \"$@\"\n", count.display(), real.display()),
    )
    .expect("wrapper");
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    // The demo store's configuration, and a drop-in naming the wrapper.
    let drop_ins = dir.path().join("corral.toml.d");
    std::fs::create_dir_all(&drop_ins).expect("drop-in directory");
    write_config(&drop_ins, "fit.toml", &format!("[runner]\nllama_fit_params = \"{}\"\n", wrapper.display()));
    let notify = NotifyListener::start();
    let (_corrald, port) = on_demo_store_with(dir.path(), "", &notify);
    notify.wait_for("READY", "1", Duration::from_secs(60));

    let load = r#"{"model":"chat","prompt":"","keep_alive":"10m"}"#;
    assert_eq!(post(port, "/api/generate", load).0, 200);
    assert_eq!(runs(&count), 1, "the first load made one projection");
    unload(port);
    assert_eq!(post(port, "/api/generate", load).0, 200);
    assert_eq!(runs(&count), 1, "the second load took it from the cache");
    unload(port);
    // Another context is another projection: the count does see runs.
    let other = r#"{"model":"chat","prompt":"","keep_alive":"10m","options":{"num_ctx":1024}}"#;
    assert_eq!(post(port, "/api/generate", other).0, 200);
    assert_eq!(runs(&count), 2, "a load with another context projects again");
}
