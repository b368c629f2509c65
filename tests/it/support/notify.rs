//! A stand-in service manager for `sd_notify`: a datagram socket that records every message.

use std::collections::BTreeMap;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One notification: its `KEY=VALUE` lines.
pub type Message = BTreeMap<String, String>;

struct Shared {
    socket: UnixDatagram,
    messages: Mutex<Vec<Message>>,
    arrived: Condvar,
    stop: AtomicBool,
}

impl Shared {
    /// Records every datagram queued on the socket now, under the lock (so that messages
    /// keep their order whoever drains): a message sent before a reader asks is seen, even
    /// when the recording thread has not woken yet (its sender may have exited already).
    fn drain(&self) -> std::sync::MutexGuard<'_, Vec<Message>> {
        use nix::sys::socket::{MsgFlags, recv};
        use std::os::fd::AsRawFd as _;
        let mut messages = self.messages.lock().expect("lock");
        let mut buf = vec![0u8; 64 * 1024];
        let before = messages.len();
        while let Ok(len) = recv(self.socket.as_raw_fd(), &mut buf, MsgFlags::MSG_DONTWAIT) {
            let text = String::from_utf8_lossy(&buf[..len]);
            messages.push(
                text.lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect(),
            );
        }
        if messages.len() > before {
            self.arrived.notify_all();
        }
        messages
    }
}

/// Listens on a socket in a temporary directory; pass [`NotifyListener::path`] as `NOTIFY_SOCKET`.
pub struct NotifyListener {
    path: PathBuf,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl NotifyListener {
    /// Binds the socket and starts recording.
    pub fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("notify.sock");
        let socket = UnixDatagram::bind(&path).expect("bind notify socket");
        socket.set_read_timeout(Some(Duration::from_millis(50))).expect("timeout");
        let shared = Arc::new(Shared {
            socket,
            messages: Mutex::default(),
            arrived: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let thread = {
            let shared = Arc::clone(&shared);
            std::thread::spawn(move || {
                use nix::sys::socket::{MsgFlags, recv};
                use std::os::fd::AsRawFd as _;
                while !shared.stop.load(Ordering::Relaxed) {
                    // Waits (at most the read timeout) for a datagram without taking it.
                    if recv(shared.socket.as_raw_fd(), &mut [0u8; 1], MsgFlags::MSG_PEEK).is_ok() {
                        drop(shared.drain());
                    }
                }
            })
        };
        Self { path, shared, thread: Some(thread), _dir: dir }
    }

    /// The socket path, for `NOTIFY_SOCKET`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Everything sent to it so far.
    pub fn messages(&self) -> Vec<Message> {
        self.shared.drain().clone()
    }

    /// Waits until a message received after the first `skip` ones has `key=value`; returns its index.
    pub fn wait_for_after(&self, skip: usize, key: &str, value: &str, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        let mut messages = self.shared.drain();
        loop {
            if let Some(i) = messages
                .iter()
                .enumerate()
                .skip(skip)
                .find(|(_, m)| m.get(key).is_some_and(|v| v == value))
                .map(|(i, _)| i)
            {
                return i;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "no {key}={value} within {timeout:?}; received {messages:?}");
            messages = self.shared.arrived.wait_timeout(messages, left).expect("lock").0;
        }
    }

    /// Waits for a message with `key=value`; returns its index.
    pub fn wait_for(&self, key: &str, value: &str, timeout: Duration) -> usize {
        self.wait_for_after(0, key, value, timeout)
    }
}

impl Drop for NotifyListener {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
