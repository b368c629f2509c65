//! One check of one worker: resolve its address (refusing public ones unless allowed),
//! connect within the timeout, and, when its devices are wanted, list them the way
//! llama.cpp sees them.  Every step is bounded.
//!
//! A worker a runner holds is not connected to: rpc-server serves one client at a time
//! and listens with a backlog of one, so a check's connection would wait in its accept
//! queue, and the next ones would find the queue full and time out.  Its health is read
//! from the runner's own connection instead, in `/proc/net/tcp`: a connection whose
//! data goes unacknowledged through [`STALLED_AFTER`] retransmission timeouts (about
//! 1.4 s on a LAN) is a worker cut off.
//!
//! A worker cut off from a runner that then died may still hold that runner's connection
//! open: the runner's goodbye was lost on the dead link, and rpc-server, which sets no
//! keepalive, waits on its one client forever.  Before such a worker is listed again, the
//! check reconnects from each local end the runner had ([`reset_left_open`]): the
//! worker's TCP answers a SYN on an open connection with an ACK (RFC 5961), which this
//! side's kernel rejects with a reset that ends the old connection.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::fleet::Outcome;
use crate::config::{WorkerConfig, is_private_v4};
use crate::gpu::rpc;

/// Retransmission timeouts in a row (RTO 200 ms, doubling) after which a runner's
/// connection to its worker counts as cut off.
pub const STALLED_AFTER: u32 = 3;

/// The most of `/proc/net/tcp` read (about 150 bytes a socket).
const MAX_TCP_TABLE: u64 = 64 << 20;

/// How long a reset from a runner's old port waits: the worker's ACK and this side's reset
/// take a round trip; the SYN is sent again after a second.
const RESET_WAIT: Duration = Duration::from_millis(500);

/// The most connections to one worker remembered for a reset: a runner has one; other
/// local programs' connections (any user may open some) must not make the check wait.
const MAX_HELD: usize = 16;

/// A TCP connection from this host to a worker, by its two ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Connection {
    /// This host's end.
    pub local: SocketAddr,
    /// The worker's end.
    pub remote: SocketAddr,
}

/// What a check found.
#[derive(Debug)]
pub struct Checked {
    /// The worker's state.
    pub outcome: Outcome,
    /// The established connections of this host to the worker (a runner's).
    pub held: Vec<Connection>,
}

impl From<Outcome> for Checked {
    fn from(outcome: Outcome) -> Self {
        Self { outcome, held: Vec::new() }
    }
}

/// How a check is made.
#[derive(Debug, Clone)]
pub struct CheckSettings {
    /// The kernel's table of this network namespace's TCP sockets, normally
    /// `/proc/net/tcp`.
    pub tcp_table: std::path::PathBuf,
    /// `[runner] llama_server`, which lists a worker's devices.
    pub llama_server: std::path::PathBuf,
    /// How long resolving and connecting may take.
    pub timeout: Duration,
    /// How long a listing may take (llama-server starts, connects and asks).
    pub list_timeout: Duration,
    /// `[gpu] reserve`, taken off each device.
    pub reserve: u64,
}

/// Checks `worker`: a connection within the timeout, and its devices when `list`;
/// `left_open` are connections a runner had to it, reset before a listing when no runner
/// holds the worker any more.
///
/// Connecting is all an rpc-server busy with a runner can answer (it serves one client
/// at a time; the kernel still accepts into its backlog), so an up worker is only
/// connected to; its devices are listed when it comes up.
pub async fn check(worker: &WorkerConfig, settings: &CheckSettings, list: bool, left_open: &[Connection]) -> Checked {
    let address = match resolve(worker, settings.timeout).await {
        Ok(address) => address,
        Err(why) => return Outcome::Down(why).into(),
    };
    let (state, held) = connections(&settings.tcp_table, address);
    let outcome = match state {
        Held::Stalled(timeouts) if !list => Outcome::Down(format!(
            "a runner's connection to {address} got no answer through {timeouts} retransmission timeouts"
        )),
        Held::Healthy if !list => Outcome::Busy,
        Held::Free if list && !left_open.is_empty() => {
            reset_left_open(left_open).await;
            connect(worker, settings, address, list).await
        }
        _ => connect(worker, settings, address, list).await,
    };
    Checked { outcome, held }
}

/// The connection, and the listing when `list`.
async fn connect(worker: &WorkerConfig, settings: &CheckSettings, address: SocketAddr, list: bool) -> Outcome {
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

/// What the established connections from this host to a worker say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    /// None: the worker is free to be connected to.
    Free,
    /// A runner holds it, and its data is acknowledged.
    Healthy,
    /// A runner holds it, and its data has gone unacknowledged through this many
    /// retransmission timeouts.
    Stalled(u32),
}

/// Reads `table` (`/proc/net/tcp`) for established connections to `address`; an
/// unreadable table counts as none.
fn connections(table: &std::path::Path, address: SocketAddr) -> (Held, Vec<Connection>) {
    use std::io::Read as _;
    let mut text = String::new();
    let read = std::fs::File::open(table).and_then(|f| f.take(MAX_TCP_TABLE).read_to_string(&mut text));
    if read.is_err() {
        return (Held::Free, Vec::new());
    }
    held_in(&text, address)
}

/// Reconnects from the local end of each of `left_open` (their ports are free once the
/// runner is gone: its sockets close with a reset), waiting [`RESET_WAIT`] for each: a
/// worker that still has the connection answers the SYN with an ACK for it, which this
/// side's kernel answers with the reset that ends it; one that does not accepts a
/// connection, closed at once.  A port in use again is left alone.
async fn reset_left_open(left_open: &[Connection]) {
    let resets = left_open.iter().map(|c| async move {
        let socket = match c.local {
            SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
            SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
        };
        let Ok(socket) = socket else { return };
        if socket.set_reuseaddr(true).is_err() || socket.bind(c.local).is_err() {
            return;
        }
        let _ = tokio::time::timeout(RESET_WAIT, socket.connect(c.remote)).await;
    });
    futures_util::future::join_all(resets).await;
}

/// [`connections`] on the table's text.  Each line: `sl local rem st tx:rx tr:when retrnsmt …`,
/// addresses as `HEXIP:HEXPORT` (the IP the kernel's 32-bit value in this machine's byte
/// order), state `01` established, `retrnsmt` the retransmission timeouts in a row (hex).
/// Written by hand: the procfs crate does not expose the retransmission count.
fn held_in(text: &str, address: SocketAddr) -> (Held, Vec<Connection>) {
    let SocketAddr::V4(address) = address else { return (Held::Free, Vec::new()) };
    let mut held = Held::Free;
    let mut connections = Vec::new();
    for line in text.lines().skip(1) {
        let fields: Vec<&str> = line.split_whitespace().take(7).collect();
        let [_, local, remote, state, _, _, retransmits] = fields[..] else { continue };
        if state != "01" || parse_v4(remote) != Some(address) {
            continue;
        }
        if let Some(local) = parse_v4(local).filter(|_| connections.len() < MAX_HELD) {
            connections.push(Connection { local: local.into(), remote: address.into() });
        }
        let timeouts = u32::from_str_radix(retransmits, 16).unwrap_or(0);
        held = match held {
            Held::Stalled(n) => Held::Stalled(n.max(timeouts)),
            _ if timeouts >= STALLED_AFTER => Held::Stalled(timeouts),
            _ => Held::Healthy,
        };
    }
    (held, connections)
}

/// `0100007F:C35A` as 127.0.0.1:50010.
fn parse_v4(text: &str) -> Option<std::net::SocketAddrV4> {
    let (ip, port) = text.split_once(':')?;
    if ip.len() != 8 {
        return None;
    }
    let ip = u32::from_str_radix(ip, 16).ok()?;
    let port = u16::from_str_radix(port, 16).ok()?;
    Some(std::net::SocketAddrV4::new(std::net::Ipv4Addr::from(ip.to_ne_bytes()), port))
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

    use super::{CheckSettings, Held, MAX_HELD, Outcome, check, held_in, pick};
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
            tcp_table: dir.join("no-tcp-table"),
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

        let Outcome::Up { devices: Some(devices), .. } =
            check(&worker(&address, false), &settings, true, &[]).await.outcome
        else {
            panic!("up with devices");
        };
        assert_eq!(devices.len(), 1);
        assert_eq!((devices[0].total_bytes, devices[0].free_bytes), (90 * MIB, 80 * MIB), "the reserve is off");
        assert_eq!(devices[0].endpoint.as_deref(), Some(address.as_str()));
        let connected = check(&worker(&address, false), &settings, false, &[]).await.outcome;
        assert!(matches!(connected, Outcome::Up { devices: None, .. }), "{connected:?}");

        drop(listener);
        let Outcome::Down(why) = check(&worker(&address, false), &settings, false, &[]).await.outcome else {
            panic!("down")
        };
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
        let Outcome::Down(why) = check(&worker(&address, false), &settings, true, &[]).await.outcome else {
            panic!("down")
        };
        assert!(why.contains("does not list its devices") && why.contains("Failed to connect to x"), "{why}");
        settings.llama_server = dir.path().join("missing");
        let Outcome::Down(why) = check(&worker(&address, false), &settings, true, &[]).await.outcome else {
            panic!("down")
        };
        assert!(why.contains("cannot run"), "{why}");
    }

    /// A `/proc/net/tcp` line from `local` to `remote` in `state` with `timeouts`.
    fn line(remote: &str, state: &str, timeouts: u32) -> String {
        let hex = |a: &str| {
            let a: std::net::SocketAddrV4 = a.parse().expect("address");
            format!("{:08X}:{:04X}", u32::from_ne_bytes(a.ip().octets()), a.port())
        };
        format!(
            "   1: {} {} {state} 00000010:00000000 01:00000014 {timeouts:08X}     0        0 123 2 0 20 4 30 10 -1",
            hex("10.0.0.1:40000"),
            hex(remote)
        )
    }

    #[test]
    fn a_held_worker_is_judged_by_its_runners_connection() {
        let header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode";
        let worker: std::net::SocketAddr = "10.0.0.2:50052".parse().expect("address");
        let table = |lines: &[String]| format!("{header}\n{}\n", lines.join("\n"));
        assert_eq!(held_in(&table(&[]), worker).0, Held::Free);
        // Another worker's, a closing one and a listening one do not count.
        let others =
            [line("10.0.0.3:50052", "01", 9), line("10.0.0.2:50052", "06", 9), line("10.0.0.2:50052", "0A", 0)];
        assert_eq!(held_in(&table(&others), worker).0, Held::Free);
        assert_eq!(held_in(&table(&[line("10.0.0.2:50052", "01", 0)]), worker).0, Held::Healthy);
        assert_eq!(
            held_in(&table(&[line("10.0.0.2:50052", "01", 2)]), worker).0,
            Held::Healthy,
            "a lost packet or two"
        );
        assert_eq!(held_in(&table(&[line("10.0.0.2:50052", "01", 3)]), worker).0, Held::Stalled(3));
        let both = [line("10.0.0.2:50052", "01", 0), line("10.0.0.2:50052", "01", 17)];
        assert_eq!(held_in(&table(&both), worker).0, Held::Stalled(17), "hex, and the worst connection decides");
        assert_eq!(held_in("garbage\n1: x y 01 z w 3\n\n", worker).0, Held::Free, "malformed lines are skipped");
    }

    #[test]
    fn the_connections_remembered_for_a_reset_are_bounded() {
        let header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode";
        let worker: std::net::SocketAddr = "10.0.0.2:50052".parse().expect("address");
        let many: Vec<String> = (0..1000).map(|_| line("10.0.0.2:50052", "01", 0)).collect();
        let (held, connections) = held_in(&format!("{header}\n{}\n", many.join("\n")), worker);
        assert_eq!(held, Held::Healthy);
        assert_eq!(connections.len(), MAX_HELD);
        assert_eq!(connections[0].local, "10.0.0.1:40000".parse::<std::net::SocketAddr>().expect("address"));
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
        let local = check(&worker(&format!("localhost:{port}"), false), &settings, false, &[]).await.outcome;
        assert!(matches!(local, Outcome::Up { .. }), "{local:?}");
        let Outcome::Down(why) = check(&worker("no-such-host.invalid:1", false), &settings, false, &[]).await.outcome
        else {
            panic!("down")
        };
        assert!(why.contains("no-such-host.invalid"), "{why}");
    }
}
