//! One check of one worker: resolve its address (refusing public ones unless allowed),
//! connect within the timeout, and, when its devices are wanted, list them the way
//! llama.cpp sees them.  Every step is bounded.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::fleet::Outcome;
use crate::config::{WorkerConfig, is_private_v4};
use crate::gpu::rpc;

/// How a check is made.
#[derive(Debug, Clone)]
pub struct CheckSettings {
    /// `[runner] llama_server`, which lists a worker's devices.
    pub llama_server: std::path::PathBuf,
    /// How long resolving and connecting may take.
    pub timeout: Duration,
    /// How long a listing may take (llama-server starts, connects and asks).
    pub list_timeout: Duration,
    /// `[gpu] reserve`, taken off each device.
    pub reserve: u64,
}

/// Checks `worker`: a connection within the timeout, and its devices when `list`.
///
/// Connecting is all an rpc-server busy with a runner can answer (it serves one client
/// at a time; the kernel still accepts into its backlog), so an up worker is only
/// connected to; its devices are listed when it comes up.
pub async fn check(worker: &WorkerConfig, settings: &CheckSettings, list: bool) -> Outcome {
    let address = match resolve(worker, settings.timeout).await {
        Ok(address) => address,
        Err(why) => return Outcome::Down(why),
    };
    let started = Instant::now();
    match tokio::time::timeout(settings.timeout, tokio::net::TcpStream::connect(address)).await {
        Err(_) => {
            return Outcome::Down(format!(
                "no connection to {address} within {}",
                crate::durations::human(settings.timeout)
            ));
        }
        Ok(Err(e)) => return Outcome::Down(format!("cannot connect to {address}: {e}")),
        Ok(Ok(stream)) => drop(stream),
    }
    let rtt = started.elapsed();
    if !list {
        return Outcome::Up { rtt, devices: None };
    }
    let (program, text, timeout) =
        (settings.llama_server.clone(), worker.address.as_str().to_owned(), settings.list_timeout);
    let listed = tokio::task::spawn_blocking(move || rpc::ask(&program, &text, timeout)).await;
    match listed {
        Ok(Ok(listed)) => {
            let mut devices = rpc::to_gpus(worker, &listed);
            for device in &mut devices {
                crate::gpu::reserve(device, settings.reserve);
            }
            Outcome::Up { rtt, devices: Some(devices) }
        }
        Ok(Err(e)) => Outcome::Down(format!("it does not list its devices: {e}")),
        Err(_) => Outcome::Down("the listing panicked".to_owned()),
    }
}

/// The worker's first IPv4 address.  A name is resolved within `timeout`, and every
/// address it resolves to must be loopback or private unless the worker allows public
/// ones: rpc-server has no authentication.
async fn resolve(worker: &WorkerConfig, timeout: Duration) -> Result<SocketAddr, String> {
    if let Some(ip) = worker.address.ip() {
        // Public literals are refused when the configuration is read.
        return Ok(SocketAddr::from((ip, worker.address.port())));
    }
    let host = worker.address.as_str();
    let found = tokio::time::timeout(timeout, tokio::net::lookup_host(host))
        .await
        .map_err(|_| format!("{} did not resolve within {}", worker.address.host(), crate::durations::human(timeout)))?
        .map_err(|e| format!("cannot resolve {}: {e}", worker.address.host()))?;
    pick(worker.address.host(), found.take(16).collect(), worker.allow_public)
}

/// The first IPv4 address of `found` (llama.cpp's RPC client connects over IPv4 only),
/// when all of them are loopback or private or `allow_public` says public ones will do.
fn pick(host: &str, found: Vec<SocketAddr>, allow_public: bool) -> Result<SocketAddr, String> {
    let v4: Vec<SocketAddr> = found.into_iter().filter(SocketAddr::is_ipv4).collect();
    let public = v4.iter().find(|a| matches!(a.ip(), std::net::IpAddr::V4(ip) if !is_private_v4(ip)));
    if let (Some(public), false) = (public, allow_public) {
        return Err(format!(
            "{host} resolves to the public address {}; rpc-server has no authentication, so corral only \
             uses loopback or private addresses unless allow_public = true is set for this worker",
            public.ip()
        ));
    }
    v4.first().copied().ok_or_else(|| format!("{host} has no IPv4 address"))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;
    use std::time::Duration;

    use super::{CheckSettings, Outcome, check, pick};
    use crate::config::WorkerConfig;

    const MIB: u64 = 1024 * 1024;

    fn worker(address: &str, allow_public: bool) -> WorkerConfig {
        WorkerConfig { address: address.parse().expect("address"), name: None, memory: None, allow_public }
    }

    fn settings(dir: &std::path::Path) -> CheckSettings {
        let program = dir.join("llama-server");
        std::fs::write(&program, "#!/bin/sh\necho 'Available devices:'\necho \"  RPC0: $2 (100 MiB, 90 MiB free)\"\n")
            .expect("write");
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        CheckSettings {
            llama_server: program,
            timeout: Duration::from_secs(2),
            list_timeout: Duration::from_secs(10),
            reserve: 10 * MIB,
        }
    }

    #[tokio::test]
    async fn a_listening_worker_is_up_with_its_devices_and_a_closed_port_is_down() {
        let dir = tempfile::tempdir().expect("tempdir");
        let settings = settings(dir.path());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address").to_string();

        let Outcome::Up { devices: Some(devices), .. } = check(&worker(&address, false), &settings, true).await else {
            panic!("up with devices");
        };
        assert_eq!(devices.len(), 1);
        assert_eq!((devices[0].total_bytes, devices[0].free_bytes), (90 * MIB, 80 * MIB), "the reserve is off");
        assert_eq!(devices[0].endpoint.as_deref(), Some(address.as_str()));
        let connected = check(&worker(&address, false), &settings, false).await;
        assert!(matches!(connected, Outcome::Up { devices: None, .. }), "{connected:?}");

        drop(listener);
        let Outcome::Down(why) = check(&worker(&address, false), &settings, false).await else { panic!("down") };
        assert!(why.starts_with(&format!("cannot connect to {address}")), "{why}");
    }

    #[tokio::test]
    async fn a_worker_that_does_not_list_devices_is_down_with_the_reason() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut settings = settings(dir.path());
        std::fs::write(&settings.llama_server, "#!/bin/sh\necho 'Failed to connect to x' >&2\nexit 1\n")
            .expect("write");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address").to_string();
        let Outcome::Down(why) = check(&worker(&address, false), &settings, true).await else { panic!("down") };
        assert!(why.contains("does not list its devices") && why.contains("Failed to connect to x"), "{why}");
        settings.llama_server = dir.path().join("missing");
        let Outcome::Down(why) = check(&worker(&address, false), &settings, true).await else { panic!("down") };
        assert!(why.contains("cannot run"), "{why}");
    }

    #[test]
    fn a_name_that_resolves_to_a_public_address_is_refused_unless_allowed() {
        let addr = |s: &str| s.parse::<std::net::SocketAddr>().expect("address");
        let public = vec![addr("10.0.0.2:1"), addr("8.8.8.8:1")];
        let err = pick("box", public.clone(), false).expect_err("refused");
        assert!(
            err.contains("box resolves to the public address 8.8.8.8") && err.contains("allow_public = true"),
            "{err}"
        );
        assert_eq!(pick("box", public, true), Ok(addr("10.0.0.2:1")), "allowed: the first one");
        assert_eq!(pick("box", vec![addr("[::1]:1"), addr("192.168.0.9:1")], false), Ok(addr("192.168.0.9:1")));
        assert_eq!(pick("box", vec![addr("[::1]:1")], false), Err("box has no IPv4 address".to_owned()));
    }

    #[tokio::test]
    async fn names_must_resolve_to_private_addresses_unless_public_ones_are_allowed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let settings = settings(dir.path());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("address").port();
        // localhost resolves (from /etc/hosts) to loopback: allowed.
        let local = check(&worker(&format!("localhost:{port}"), false), &settings, false).await;
        assert!(matches!(local, Outcome::Up { .. }), "{local:?}");
        let Outcome::Down(why) = check(&worker("no-such-host.invalid:1", false), &settings, false).await else {
            panic!("down")
        };
        assert!(why.contains("no-such-host.invalid"), "{why}");
    }
}
