//! Everything systemd hands the daemon, and everything it tells systemd back.
//!
//! [`Handoff::take`] must run first thing in `main`, before any thread exists: it
//! reads the socket-activation, notify and watchdog variables and removes them from
//! the environment, so that no child process inherits them.  This module holds the
//! daemon's only `unsafe` code (environment edits and adopting inherited fds).
#![allow(unsafe_code)]

mod journal;
mod notify;

use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::time::Duration;

pub use journal::{JOURNAL_SOCKET, JournalWriter, Priority};
pub use notify::Notifier;

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
        let notifier = Notifier::new(std::env::var_os("NOTIFY_SOCKET"));
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
