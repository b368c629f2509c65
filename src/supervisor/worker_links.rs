//! A runner's TCP connections to its RPC workers, made to notice a worker that is cut off.
//!
//! llama.cpp's RPC client sets neither keepalive nor a user timeout, so a runner that
//! waits for a worker's answer on a link that went down waits forever: nothing of its own
//! is unacknowledged, so the kernel never gives up, and neither retransmissions nor
//! errors show.  Once the runner is ready, corrald takes a duplicate of each of its TCP
//! sockets (`pidfd_getfd`, allowed on its own child) and sets, on the shared socket,
//! keepalive probes every second and `TCP_USER_TIMEOUT` to the workers' check timeout: a
//! worker that answers no probe, or acknowledges no data, for that long fails the
//! runner's next read or write with `ETIMEDOUT`; llama.cpp aborts on it, and the runner's
//! end is handled like a worker killed.
//!
//! On a dead link the runner's goodbye never arrives, and rpc-server, which serves one
//! client at a time and sets no keepalive, waits for that client forever.  The health
//! check ends the worker's side once the link is back, from the runner's own port (see
//! `workers::check`); so that the port is free by then, the connections close with a
//! reset (`SO_LINGER` of zero) instead of a FIN the kernel would go on sending after the
//! runner is gone.
//!
//! A runner's only TCP sockets are its worker connections: it serves HTTP on a UNIX
//! socket.

use std::os::fd::AsFd;
use std::path::Path;
use std::time::Duration;

use nix::unistd::Pid;
use rustix::net::{AddressFamily, SocketType, sockopt};
use rustix::process::{PidfdFlags, PidfdGetfdFlags};

/// Silence on a connection before the first keepalive probe, and between probes.
const PROBE_EVERY: Duration = Duration::from_secs(1);

/// The most descriptors of a runner looked at (llama-server holds a few dozen).
const MAX_FDS: usize = 4096;

/// Sets keepalive and a user timeout of `timeout` on each TCP connection of the process
/// `pid`, whose descriptors are listed in `proc`'s `PID/fd`; returns how many it set.
pub fn arm(proc: &Path, pid: Pid, timeout: Duration) -> std::io::Result<usize> {
    let process = rustix::process::Pid::from_raw(pid.as_raw())
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "no such process: pid 0"))?;
    let pidfd = rustix::process::pidfd_open(process, PidfdFlags::empty())?;
    let mut armed = 0;
    for entry in std::fs::read_dir(proc.join(pid.as_raw().to_string()).join("fd"))?.take(MAX_FDS) {
        let entry = entry?;
        let is_socket = std::fs::read_link(entry.path()).is_ok_and(|l| l.to_string_lossy().starts_with("socket:"));
        let Some(fd) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()).filter(|_| is_socket) else {
            continue;
        };
        // A socket closed since it was listed is simply gone.
        let Ok(socket) = rustix::process::pidfd_getfd(&pidfd, fd, PidfdGetfdFlags::empty()) else { continue };
        if is_tcp_connection(&socket) {
            set_liveness(&socket, timeout)?;
            armed += 1;
        }
    }
    Ok(armed)
}

/// An IPv4 or IPv6 stream socket with a peer.
fn is_tcp_connection(socket: impl AsFd) -> bool {
    let socket = socket.as_fd();
    matches!(sockopt::socket_domain(socket), Ok(AddressFamily::INET | AddressFamily::INET6))
        && sockopt::socket_type(socket) == Ok(SocketType::STREAM)
        && rustix::net::getpeername(socket).is_ok()
}

/// Keepalive probes after [`PROBE_EVERY`] of silence and then every [`PROBE_EVERY`], the
/// connection dropped when no probe or data is acknowledged for `timeout`; closed with a
/// reset.
fn set_liveness(socket: impl AsFd, timeout: Duration) -> std::io::Result<()> {
    let socket = socket.as_fd();
    let timeout_ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX).max(1);
    sockopt::set_socket_keepalive(socket, true)?;
    sockopt::set_tcp_keepidle(socket, PROBE_EVERY)?;
    sockopt::set_tcp_keepintvl(socket, PROBE_EVERY)?;
    sockopt::set_tcp_user_timeout(socket, timeout_ms)?;
    sockopt::set_socket_linger(socket, Some(Duration::ZERO))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read as _, Write as _};
    use std::net::{TcpListener, TcpStream};
    use std::os::unix::process::CommandExt as _;

    /// The settings land on the other process's socket: read back through a second
    /// duplicate, and the connection still carries data.
    #[test]
    fn a_childs_tcp_connections_get_keepalive_a_user_timeout_and_a_closing_reset() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = listener.local_addr().expect("address");
        // A child that holds one connection (and a UNIX socket pair, which is left alone)
        // open on its standard input.
        let mut child = std::process::Command::new("sleep");
        child.arg("30");
        let stream = TcpStream::connect(address).expect("connect");
        let (unix, _other) = std::os::unix::net::UnixStream::pair().expect("pair");
        child.stdin(std::process::Stdio::from(std::os::fd::OwnedFd::from(stream.try_clone().expect("dup"))));
        child.stdout(std::process::Stdio::from(std::os::fd::OwnedFd::from(unix)));
        child.process_group(0);
        let mut child = child.spawn().expect("spawn sleep");
        let pid = Pid::from_raw(i32::try_from(child.id()).expect("pid"));
        let (mut served, _) = listener.accept().expect("accept");
        drop(stream);

        let armed = arm(Path::new("/proc"), pid, Duration::from_millis(2500));
        let pidfd = rustix::process::pidfd_open(
            rustix::process::Pid::from_raw(pid.as_raw()).expect("pid"),
            PidfdFlags::empty(),
        )
        .expect("pidfd");
        let theirs = rustix::process::pidfd_getfd(&pidfd, 0, PidfdGetfdFlags::empty()).expect("their socket");
        let settings = (
            sockopt::socket_keepalive(&theirs),
            sockopt::tcp_keepidle(&theirs),
            sockopt::tcp_keepintvl(&theirs),
            sockopt::tcp_user_timeout(&theirs),
            sockopt::socket_linger(&theirs),
        );
        let mut theirs = TcpStream::from(theirs);
        theirs.write_all(b"ping").expect("write");
        let mut got = [0; 4];
        served.read_exact(&mut got).expect("read");
        let _ = child.kill();
        let _ = child.wait();

        assert_eq!(armed.expect("armed"), 1, "the one TCP connection, not the UNIX socket");
        assert_eq!(
            settings,
            (Ok(true), Ok(PROBE_EVERY), Ok(PROBE_EVERY), Ok(2500), Ok(Some(Duration::ZERO))),
            "keepalive every second, the user timeout as asked, closed with a reset"
        );
        assert_eq!(&got, b"ping");
    }

    #[test]
    fn a_process_that_is_gone_is_an_error() {
        let mut child = std::process::Command::new("true").spawn().expect("spawn true");
        let pid = Pid::from_raw(i32::try_from(child.id()).expect("pid"));
        child.wait().expect("reaped");
        assert!(arm(Path::new("/proc"), pid, Duration::from_secs(1)).is_err());
        assert!(arm(Path::new("/proc"), Pid::from_raw(0), Duration::from_secs(1)).is_err());
    }
}
