//! `sd_notify`: readiness, status, reload, stop and watchdog messages to the service manager.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

use sd_notify::NotifyState;

/// Sends `sd_notify` messages to the service manager, if there is one.
///
/// The socket path is read once at start (then removed from the environment so that
/// children do not inherit it); `sd_notify::notify` would read the variable on every
/// call, which is why sending is done here.
#[derive(Debug, Clone, Default)]
pub struct Notifier {
    socket: Option<OsString>,
}

impl Notifier {
    /// A notifier that sends to `socket` (a path, or `@name` for an abstract socket).
    #[must_use]
    pub fn new(socket: Option<OsString>) -> Self {
        Self { socket }
    }

    /// True when a service manager listens.
    #[must_use]
    pub fn enabled(&self) -> bool {
        self.socket.is_some()
    }

    /// `READY=1` with the current status line.
    pub fn ready(&self, status: &str) {
        self.send(&[NotifyState::Ready, NotifyState::Status(status)]);
    }

    /// `STATUS=` alone.
    pub fn status(&self, status: &str) {
        self.send(&[NotifyState::Status(status)]);
    }

    /// `RELOADING=1` with the monotonic timestamp systemd 253+ requires.
    pub fn reloading(&self) {
        let mut states = vec![NotifyState::Reloading, NotifyState::Status("reloading configuration")];
        if let Ok(now) = NotifyState::monotonic_usec_now() {
            states.push(now);
        }
        self.send(&states);
    }

    /// `STOPPING=1`.
    pub fn stopping(&self) {
        self.send(&[NotifyState::Stopping, NotifyState::Status("stopping")]);
    }

    /// `WATCHDOG=1`.
    pub fn watchdog(&self) {
        self.send(&[NotifyState::Watchdog]);
    }

    fn send(&self, states: &[NotifyState<'_>]) {
        let Some(socket) = &self.socket else { return };
        let message = states.iter().fold(String::new(), |mut m, s| {
            let _ = writeln!(m, "{s}");
            m
        });
        if let Err(e) = send_datagram(socket, message.as_bytes()) {
            tracing::warn!(error = %e, "cannot notify the service manager");
        }
    }
}

fn send_datagram(socket: &OsString, message: &[u8]) -> io::Result<()> {
    let bytes = socket.as_bytes();
    let addr = match bytes.first() {
        Some(b'@') => SocketAddr::from_abstract_name(&bytes[1..])?,
        Some(b'/') => SocketAddr::from_pathname(socket)?,
        _ => return Err(io::Error::new(io::ErrorKind::InvalidInput, "NOTIFY_SOCKET is neither a path nor @abstract")),
    };
    UnixDatagram::unbound()?.send_to_addr(message, &addr).map(drop)
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixDatagram;

    use super::Notifier;

    #[test]
    fn notifier_sends_each_state_on_its_own_line() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("notify");
        let rx = UnixDatagram::bind(&path).expect("bind");
        let n = Notifier::new(Some(path.into_os_string()));
        assert!(n.enabled());
        n.ready("serving");
        n.stopping();
        let mut buf = [0u8; 512];
        let len = rx.recv(&mut buf).expect("recv");
        assert_eq!(&buf[..len], b"READY=1\nSTATUS=serving\n");
        let len = rx.recv(&mut buf).expect("recv");
        assert_eq!(&buf[..len], b"STOPPING=1\nSTATUS=stopping\n");
    }

    #[test]
    fn notifier_reaches_an_abstract_socket() {
        let name = format!("corral-test-{}", std::process::id());
        let addr =
            <std::os::unix::net::SocketAddr as std::os::linux::net::SocketAddrExt>::from_abstract_name(name.as_bytes())
                .expect("addr");
        let rx = UnixDatagram::bind_addr(&addr).expect("bind");
        Notifier::new(Some(format!("@{name}").into())).watchdog();
        let mut buf = [0u8; 64];
        let len = rx.recv(&mut buf).expect("recv");
        assert_eq!(&buf[..len], b"WATCHDOG=1\n");
    }

    #[test]
    fn notifier_without_a_manager_is_silent() {
        let n = Notifier::new(None);
        assert!(!n.enabled());
        n.ready("x");
    }
}
