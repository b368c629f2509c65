//! Entries for the journal in its native protocol, with fields of our choosing.
//!
//! The daemon's own events go through `tracing-journald`, which fixes
//! `SYSLOG_IDENTIFIER` for the whole process.  llama-server's lines must carry
//! `SYSLOG_IDENTIFIER=llama-server` and their own priority, so they are sent here:
//! one datagram per entry to journald's socket, `KEY=VALUE` lines, or the
//! length-prefixed form for values that contain a newline.  Values are capped so an
//! entry always fits one datagram.

use std::io;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};

/// journald's native socket.
pub const JOURNAL_SOCKET: &str = "/run/systemd/journal/socket";

/// The longest value sent; longer ones are cut (llama-server lines are far shorter).
const MAX_VALUE: usize = 32 * 1024;

/// syslog priorities, as journald's `PRIORITY=` field holds them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Priority {
    /// 3.
    Error = 3,
    /// 4.
    Warning = 4,
    /// 5.
    Notice = 5,
    /// 6.
    Info = 6,
    /// 7.
    Debug = 7,
}

/// Sends entries to journald.
#[derive(Debug)]
pub struct JournalWriter {
    socket: UnixDatagram,
    path: PathBuf,
}

impl JournalWriter {
    /// A writer for journald's socket at `path` (normally [`JOURNAL_SOCKET`]).
    pub fn new(path: &Path) -> io::Result<Self> {
        Ok(Self { socket: UnixDatagram::unbound()?, path: path.to_owned() })
    }

    /// Sends one entry: `MESSAGE`, `PRIORITY` and the extra fields.
    /// Field names must be upper-case letters, digits and underscores, as journald requires.
    pub fn send(&self, priority: Priority, message: &str, fields: &[(&str, &str)]) -> io::Result<()> {
        let mut entry = Vec::with_capacity(128 + message.len());
        append(&mut entry, "PRIORITY", &(priority as u8).to_string());
        append(&mut entry, "MESSAGE", message);
        for (name, value) in fields {
            debug_assert!(valid_field_name(name), "invalid journal field name {name}");
            append(&mut entry, name, value);
        }
        self.socket.send_to(&entry, &self.path).map(drop)
    }
}

fn append(entry: &mut Vec<u8>, name: &str, value: &str) {
    let value = cut(value);
    entry.extend_from_slice(name.as_bytes());
    if value.contains('\n') {
        entry.push(b'\n');
        entry.extend_from_slice(&(value.len() as u64).to_le_bytes());
    } else {
        entry.push(b'=');
    }
    entry.extend_from_slice(value.as_bytes());
    entry.push(b'\n');
}

fn cut(value: &str) -> &str {
    if value.len() <= MAX_VALUE {
        return value;
    }
    let mut end = MAX_VALUE;
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    &value[..end]
}

fn valid_field_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('_')
        && name.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixDatagram;

    use super::{JournalWriter, MAX_VALUE, Priority, valid_field_name};

    #[test]
    fn entries_use_the_native_protocol() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("socket");
        let rx = UnixDatagram::bind(&path).expect("bind");
        let writer = JournalWriter::new(&path).expect("writer");
        writer
            .send(Priority::Warning, "two\nlines", &[("SYSLOG_IDENTIFIER", "llama-server"), ("CORRAL_MODEL", "m")])
            .expect("send");
        let mut buf = vec![0u8; 1024];
        let len = rx.recv(&mut buf).expect("recv");
        let mut expected = b"PRIORITY=4\nMESSAGE\n".to_vec();
        expected.extend_from_slice(&9u64.to_le_bytes());
        expected.extend_from_slice(b"two\nlines\nSYSLOG_IDENTIFIER=llama-server\nCORRAL_MODEL=m\n");
        assert_eq!(&buf[..len], expected.as_slice());
    }

    #[test]
    fn long_values_are_cut_on_a_character_boundary() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("socket");
        let rx = UnixDatagram::bind(&path).expect("bind");
        let long = "é".repeat(MAX_VALUE);
        JournalWriter::new(&path).expect("writer").send(Priority::Info, &long, &[]).expect("send");
        let mut buf = vec![0u8; 4 * MAX_VALUE];
        let len = rx.recv(&mut buf).expect("recv");
        let text = std::str::from_utf8(&buf[..len]).expect("utf-8");
        let message = text.strip_prefix("PRIORITY=6\nMESSAGE=").expect("fields").trim_end_matches('\n');
        assert_eq!(message.len(), MAX_VALUE);
    }

    #[test]
    fn field_names_follow_journald_rules() {
        assert!(valid_field_name("CORRAL_RUNNER_PID"));
        assert!(!valid_field_name("_PID"));
        assert!(!valid_field_name("lower"));
        assert!(!valid_field_name(""));
    }
}
