//! Everything systemd hands the daemon, and everything it tells systemd back.
//!
//! [`Handoff::take`] must run first thing in `main`, before any thread exists: it
//! reads the socket-activation, notify and watchdog variables and removes them from
//! the environment, so that no child process inherits them.  This module holds the
//! daemon's only `unsafe` code (environment edits and adopting inherited fds).
#![allow(unsafe_code)]

use std::ffi::OsString;
use std::fmt::Write as _;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

use sd_notify::NotifyState;

/// The file-descriptor name corral serves HTTP on (`FileDescriptorName=http`).
pub const HTTP_FD_NAME: &str = "http";

/// What systemd passed to this process.
#[derive(Debug)]
pub struct Handoff {
    /// Inherited sockets with their `LISTEN_FDNAMES` names, in fd order.
    pub sockets: Vec<(String, OwnedFd)>,
    /// Where to send readiness and status.
    pub notifier: Notifier,
    /// How often systemd expects a watchdog ping, when it does.
    pub watchdog: Option<Duration>,
    /// True when stderr is connected to the journal (`JOURNAL_STREAM` matches it).
    pub stderr_is_journal: bool,
}

impl Handoff {
    /// Takes the systemd environment: inherited sockets, `NOTIFY_SOCKET`, the watchdog
    /// and `JOURNAL_STREAM`, then removes those variables from the environment.
    ///
    /// Fails when the process already runs a second thread: editing the environment is
    /// only sound while nothing else can read it.  A second call finds nothing to take.
    pub fn take() -> io::Result<Self> {
        if thread_count()? != 1 {
            return Err(io::Error::other("the systemd environment must be taken before any thread starts"));
        }
        // SAFETY: this process has one thread (checked above, and only this thread could
        // start another), so editing the environment cannot race a reader.  sd-notify checks
        // LISTEN_PID, so only fds meant for this process are taken.
        let fds = unsafe { sd_notify::listen_fds_with_names_and_unset_env() }?;
        let sockets = fds
            .map(|(fd, name)| {
                // SAFETY: systemd passed this fd to our PID (checked through LISTEN_PID), and
                // nothing else owns it: the variables that name it were removed just now, so no
                // later call can take it again.
                (name, unsafe { OwnedFd::from_raw_fd(fd) })
            })
            .collect();
        // SAFETY: single-threaded, as checked above.
        let watchdog = unsafe { sd_notify::watchdog_enabled_and_unset_env() };
        let notifier = Notifier { socket: std::env::var_os("NOTIFY_SOCKET") };
        let stderr_is_journal = std::env::var("JOURNAL_STREAM").is_ok_and(|v| stream_is_stderr(&v));
        // SAFETY: single-threaded, as checked above.
        unsafe {
            std::env::remove_var("NOTIFY_SOCKET");
            std::env::remove_var("JOURNAL_STREAM");
        }
        Ok(Self { sockets, notifier, watchdog, stderr_is_journal })
    }
}

/// The number of threads of this process, from `/proc/self/status`.
fn thread_count() -> io::Result<usize> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .ok_or_else(|| io::Error::other("no thread count in /proc/self/status"))
}

/// True when `journal_stream` (`DEVICE:INODE`) names the file on our stderr.
fn stream_is_stderr(journal_stream: &str) -> bool {
    let Some((dev, ino)) = journal_stream.split_once(':') else { return false };
    let Ok(stat) = nix::sys::stat::fstat(io::stderr()) else { return false };
    dev.parse() == Ok(stat.st_dev) && ino.parse() == Ok(stat.st_ino)
}

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
