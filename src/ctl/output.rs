//! How results are printed: aligned tables and `key: value` lists for people, JSON for
//! programs (`--json`).

use std::fmt::Write as _;
use std::io::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use super::error::CtlError;

/// Writes `text` to standard output. Not holding the lock between writes lets the
/// progress bar draw there too.
pub fn print(text: &str) -> Result<(), CtlError> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|source| CtlError::Io { what: "writing to standard output".into(), source })
}

/// Prints `value` as pretty JSON and a newline.
pub fn print_json(value: &impl Serialize) -> Result<(), CtlError> {
    let mut text = serde_json::to_string_pretty(value).expect("plain data serializes");
    text.push('\n');
    print(&text)
}

/// Columns padded to their widest cell, two spaces apart, one row a line.
#[must_use]
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = headers.iter().map(|h| (*h).to_owned()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let mut line = String::new();
        for (i, (cell, width)) in row.iter().zip(&widths).enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                let _ = write!(line, "{cell:<width$}  ");
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// `key: value` lines with the values aligned; a value of several lines continues
/// under its first.
#[must_use]
pub fn fields(pairs: &[(&str, String)]) -> String {
    let width = pairs.iter().map(|(k, _)| k.chars().count() + 1).max().unwrap_or(0);
    let mut out = String::new();
    for (key, value) in pairs {
        let key = format!("{key}:");
        let mut lines = value.lines();
        let _ = writeln!(out, "{key:<width$}  {}", lines.next().unwrap_or_default());
        for line in lines {
            let _ = writeln!(out, "{:width$}  {line}", "");
        }
    }
    out
}

/// Bytes in binary units, "1.5 GiB".
#[must_use]
pub fn size(bytes: u64) -> String {
    bytesize::ByteSize(bytes).display().iec().to_string()
}

/// A digest's first 12 hex digits, as `ollama list` shows it.
#[must_use]
pub fn short_digest(digest: &str) -> String {
    let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
    hex.chars().take(12).collect()
}

/// When an idle model unloads, from `ExpiresAt` (microseconds since the epoch, 0 for
/// never), relative to `now`: "in 4m 59s", "now" once past, "-" for never.
#[must_use]
pub fn expires(micros: u64, now: SystemTime) -> String {
    if micros == 0 {
        return "-".to_owned();
    }
    let at = UNIX_EPOCH + Duration::from_micros(micros);
    match at.duration_since(now) {
        Ok(left) if left.as_secs() > 0 => {
            format!("in {}", humantime::format_duration(Duration::from_secs(left.as_secs())))
        }
        _ => "now".to_owned(),
    }
}

/// `ExpiresAt` as an RFC 3339 time for JSON; `None` for never.
#[must_use]
pub fn expires_rfc3339(micros: u64) -> Option<String> {
    (micros != 0).then(|| {
        let at = UNIX_EPOCH + Duration::from_micros(micros);
        humantime::format_rfc3339_seconds(at).to_string()
    })
}

/// `DefaultKeepAlive` seconds: "5m", or "forever" for -1.
#[must_use]
pub fn keep_alive(seconds: i64) -> String {
    match u64::try_from(seconds) {
        Ok(secs) => humantime::format_duration(Duration::from_secs(secs)).to_string(),
        Err(_) => "forever".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use super::{expires, expires_rfc3339, fields, keep_alive, short_digest, size, table};

    #[test]
    fn tables_align_columns_and_trim_line_ends() {
        let rows = vec![vec!["tiny:latest".to_owned(), "1 KiB".to_owned(), String::new()]];
        assert_eq!(table(&["NAME", "SIZE", "X"], &rows), "NAME         SIZE   X\ntiny:latest  1 KiB\n");
        assert_eq!(table(&["NAME"], &[]), "NAME\n");
    }

    #[test]
    fn fields_align_values() {
        assert_eq!(fields(&[("a", "1".into()), ("long", "2".into())]), "a:     1\nlong:  2\n");
        assert_eq!(fields(&[("a", "1\n2".into()), ("long", "3".into())]), "a:     1\n       2\nlong:  3\n");
    }

    #[test]
    fn units_and_times_read_as_people_write_them() {
        assert_eq!(size(1536 << 20), "1.5 GiB");
        assert_eq!(short_digest("sha256:0123456789abcdef"), "0123456789ab");
        let now = UNIX_EPOCH + Duration::from_secs(1_000);
        assert_eq!(expires(0, now), "-");
        assert_eq!(expires(1_299_500_000, now), "in 4m 59s");
        assert_eq!(expires(999_000_000, now), "now");
        assert_eq!(expires_rfc3339(0), None);
        assert_eq!(expires_rfc3339(86_400_000_000).as_deref(), Some("1970-01-02T00:00:00Z"));
        assert_eq!(keep_alive(300), "5m");
        assert_eq!(keep_alive(-1), "forever");
    }
}
