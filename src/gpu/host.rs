//! Host memory from `/proc/meminfo`.

use std::path::{Path, PathBuf};

use super::HostMemory;

/// Why host memory could not be read.
#[derive(Debug, thiserror::Error)]
pub enum HostMemoryError {
    /// The file could not be read.
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A line we need is not `Key: <number> kB`.
    #[error("meminfo line {line}: {text:?} is not \"Key: <number> kB\"")]
    Malformed {
        /// Its line number, from 1.
        line: usize,
        /// The line.
        text: String,
    },
    /// A field we need is missing.
    #[error("meminfo has no {0}")]
    Missing(&'static str),
}

/// Reads `<proc>/meminfo`.
pub fn read(proc: &Path) -> Result<HostMemory, HostMemoryError> {
    let path = proc.join("meminfo");
    let text = std::fs::read_to_string(&path).map_err(|source| HostMemoryError::Read { path, source })?;
    parse_meminfo(&text)
}

/// Parses the text of `/proc/meminfo`.
///
/// `MemTotal` and `MemAvailable` are in kB (KiB, in fact); without `MemAvailable` (kernels
/// before 3.14) the available memory is `MemFree + Buffers + Cached`.
pub fn parse_meminfo(text: &str) -> Result<HostMemory, HostMemoryError> {
    let (mut total, mut available, mut free, mut buffers, mut cached) = (None, None, None, None, None);
    for (number, line) in text.lines().enumerate() {
        let Some((key, value)) = line.split_once(':') else { continue };
        let slot = match key.trim() {
            "MemTotal" => &mut total,
            "MemAvailable" => &mut available,
            "MemFree" => &mut free,
            "Buffers" => &mut buffers,
            "Cached" => &mut cached,
            _ => continue,
        };
        let malformed = || HostMemoryError::Malformed { line: number + 1, text: line.to_owned() };
        let kib = match value.split_whitespace().collect::<Vec<_>>()[..] {
            [n, "kB"] => n.parse::<u64>().map_err(|_| malformed())?,
            _ => return Err(malformed()),
        };
        *slot = Some(kib.checked_mul(1024).ok_or_else(malformed)?);
    }
    let total_bytes = total.ok_or(HostMemoryError::Missing("MemTotal"))?;
    let available_bytes = if let Some(bytes) = available {
        bytes
    } else {
        let part = |value: Option<u64>, name| value.ok_or(HostMemoryError::Missing(name));
        part(free, "MemAvailable or MemFree")?
            .saturating_add(part(buffers, "MemAvailable or Buffers")?)
            .saturating_add(part(cached, "MemAvailable or Cached")?)
    };
    Ok(HostMemory { total_bytes, available_bytes })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::{HostMemory, HostMemoryError, parse_meminfo, read};

    const FIXTURE: &str = "\
MemTotal:       32594200 kB
MemFree:         1234567 kB
MemAvailable:   20000000 kB
Buffers:          100000 kB
Cached:          9000000 kB
SwapCached:            0 kB
HugePages_Total:       0
Hugepagesize:       2048 kB
";

    #[test]
    fn this_machines_meminfo_parses_to_plausible_numbers() {
        let host = read(Path::new("/proc")).expect("/proc/meminfo");
        assert!(host.total_bytes > 64 * 1024 * 1024, "{host:?}");
        assert!(host.total_bytes < 1 << 50, "{host:?}");
        assert!(host.available_bytes > 0 && host.available_bytes <= host.total_bytes, "{host:?}");
    }

    #[test]
    fn a_missing_file_is_a_read_error_naming_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = read(dir.path()).expect_err("no meminfo");
        assert!(matches!(err, HostMemoryError::Read { .. }));
        assert!(err.to_string().contains("meminfo: cannot read"), "{err}");
    }

    #[test]
    fn fixtures_parse_in_bytes() {
        let cases: &[(&str, HostMemory)] = &[
            (FIXTURE, HostMemory { total_bytes: 32_594_200 * 1024, available_bytes: 20_000_000 * 1024 }),
            (
                "MemTotal: 1000 kB\nMemFree: 100 kB\nBuffers: 20 kB\nCached: 3 kB\n",
                HostMemory { total_bytes: 1000 * 1024, available_bytes: 123 * 1024 },
            ),
            ("MemAvailable: 0 kB\nMemTotal: 4 kB", HostMemory { total_bytes: 4096, available_bytes: 0 }),
            (
                "junk without colon\nOther: not a number\nMemTotal: 2 kB\nMemAvailable: 1 kB\n",
                HostMemory { total_bytes: 2048, available_bytes: 1024 },
            ),
        ];
        for (text, want) in cases {
            assert_eq!(parse_meminfo(text).expect(text), *want, "{text:?}");
        }
    }

    #[test]
    fn malformed_or_incomplete_input_is_an_error_naming_what_is_wrong() {
        let cases: &[(&str, &str)] = &[
            ("", "no MemTotal"),
            ("MemAvailable: 1 kB\n", "no MemTotal"),
            ("MemTotal: 1 kB\nMemFree: 1 kB\nBuffers: 1 kB\n", "no MemAvailable or Cached"),
            ("MemTotal: 1 kB\n", "no MemAvailable or MemFree"),
            ("MemTotal: lots kB\n", "line 1: \"MemTotal: lots kB\""),
            ("MemFree: 1 kB\nMemTotal: 1 MB\n", "line 2"),
            ("MemTotal: 1\n", "line 1"),
            ("MemTotal: -1 kB\n", "line 1"),
            ("MemTotal: 1 2 kB\n", "line 1"),
            ("MemTotal: 18446744073709551615 kB\n", "line 1"),
        ];
        for (text, want) in cases {
            let err = parse_meminfo(text).expect_err(text).to_string();
            assert!(err.contains(want), "error for {text:?} should contain {want:?}: {err}");
        }
    }
}
