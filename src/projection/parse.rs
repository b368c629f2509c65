//! `llama-fit-params --fit-print on`'s stdout read into a [`Projection`].
//!
//! llama.cpp (`common_fit_print` in `common/fit.cpp`) prints one line per device it would
//! use, then one for the host, each `NAME MODEL CONTEXT COMPUTE ` with the figures in
//! whole MiB (the bytes divided by 2^20, rounded down):
//!
//! ```text
//! RPC0 0 0 10
//! RPC1 0 0 10
//! Host 0 0 9
//! ```
//!
//! The output is another program's, so the reader is strict and bounded: anything else
//! (more lines than devices llama.cpp can have, long lines, figures beyond a petabyte,
//! names that are not llama.cpp's, a missing or misplaced host row) is a [`ParseError`].

use serde::{Deserialize, Serialize};

/// The most output read: far beyond a real projection (a line per device).
pub const MAX_OUTPUT: usize = 64 * 1024;
/// The most rows, the host's included (llama.cpp has at most a few dozen devices).
pub const MAX_ROWS: usize = 65;
/// The longest line read.
pub const MAX_LINE: usize = 256;
/// The longest device name.
pub const MAX_NAME: usize = 64;
/// The largest figure accepted, in MiB: one pebibyte.
pub const MAX_MIB: u64 = 1 << 30;
/// The unit of the printed figures, in bytes; each figure is rounded down to it.
pub const RESOLUTION: u64 = 1 << 20;

/// The name of the host's row.
const HOST: &str = "Host";

/// Bytes one device (or the host) would hold, by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Usage {
    /// The weights.
    pub model: u64,
    /// The context: KV cache (and recurrent state).
    pub context: u64,
    /// The compute buffers.
    pub compute: u64,
}

impl Usage {
    /// Model, context and compute together.
    #[must_use]
    pub fn total(&self) -> u64 {
        self.model.saturating_add(self.context).saturating_add(self.compute)
    }

    /// [`total`](Self::total) plus what llama.cpp's rounding may have taken off: it prints
    /// each figure in whole MiB rounded down, so each may be up to a MiB short.
    #[must_use]
    pub fn upper_bound(&self) -> u64 {
        self.total().saturating_add(3 * (RESOLUTION - 1))
    }
}

/// One device's row.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceUsage {
    /// The device's name as llama.cpp prints it: `CUDA0`, `Vulkan1`, `RPC0`, ….
    pub name: String,
    /// What it would hold.
    pub usage: Usage,
}

/// What llama.cpp projects a load to need, per device and on the host.
///
/// Invariants (checked by [`Projection::parse`], [`Projection::new`] and when read back
/// from a file): at most [`MAX_ROWS`] − 1 devices with distinct, valid names (none called
/// `Host`), every figure at most [`MAX_MIB`] MiB.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "Unchecked")]
pub struct Projection {
    devices: Vec<DeviceUsage>,
    host: Usage,
}

/// A projection as it is written, before its invariants are checked.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Unchecked {
    devices: Vec<DeviceUsage>,
    host: Usage,
}

impl TryFrom<Unchecked> for Projection {
    type Error = ParseError;

    fn try_from(raw: Unchecked) -> Result<Self, ParseError> {
        Self::new(raw.devices, raw.host)
    }
}

/// Why output is not a projection.  Line numbers count from 1.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// Nothing was printed.
    #[error("it printed nothing")]
    Empty,
    /// More than [`MAX_OUTPUT`] bytes.
    #[error("it printed more than {} bytes", MAX_OUTPUT)]
    TooLong,
    /// More than [`MAX_ROWS`] rows.
    #[error("it printed more than {} rows", MAX_ROWS)]
    TooManyRows,
    /// A line longer than [`MAX_LINE`].
    #[error("line {line} is longer than {} bytes", MAX_LINE)]
    LineTooLong {
        /// The line.
        line: usize,
    },
    /// A line with bytes other than printable ASCII and spaces.
    #[error("line {line} is not plain text")]
    NotText {
        /// The line.
        line: usize,
    },
    /// A line without exactly four fields.
    #[error("line {line} has {fields} fields; expected `NAME MODEL CONTEXT COMPUTE`")]
    Fields {
        /// The line.
        line: usize,
        /// How many it has.
        fields: usize,
    },
    /// A name that is not a device name (too long, or with other characters).
    #[error("line {line}: {name:?} is not a device name")]
    BadName {
        /// The line.
        line: usize,
        /// The name.
        name: String,
    },
    /// A figure that is not a whole number.
    #[error("line {line}: {field} {text:?} is not a whole number of MiB")]
    BadNumber {
        /// The line.
        line: usize,
        /// `model`, `context` or `compute`.
        field: &'static str,
        /// What was printed.
        text: String,
    },
    /// A figure beyond [`MAX_MIB`].
    #[error("line {line}: {field} {text} MiB is more than {} MiB", MAX_MIB)]
    TooLarge {
        /// The line.
        line: usize,
        /// `model`, `context` or `compute`.
        field: &'static str,
        /// What was printed.
        text: String,
    },
    /// A device printed twice.
    #[error("line {line}: device {name} is printed twice")]
    Duplicate {
        /// The line.
        line: usize,
        /// The device.
        name: String,
    },
    /// A row after the host's (which llama.cpp prints last).
    #[error("line {line} follows the Host row, which comes last")]
    AfterHost {
        /// The line.
        line: usize,
    },
    /// No host row.
    #[error("it printed no Host row")]
    NoHost,
}

impl Projection {
    /// A projection from its rows, checked as if llama.cpp had printed them in this order
    /// (an error's line is the device's position, from 1).
    pub fn new(devices: Vec<DeviceUsage>, host: Usage) -> Result<Self, ParseError> {
        if devices.len() >= MAX_ROWS {
            return Err(ParseError::TooManyRows);
        }
        for (index, device) in devices.iter().enumerate() {
            let line = index + 1;
            check_name(line, &device.name)?;
            if device.name == HOST {
                return Err(ParseError::AfterHost { line: line + 1 });
            }
            if devices[..index].iter().any(|d| d.name == device.name) {
                return Err(ParseError::Duplicate { line, name: device.name.clone() });
            }
            check_usage(line, &device.usage)?;
        }
        check_usage(devices.len() + 1, &host)?;
        Ok(Self { devices, host })
    }

    /// Reads `llama-fit-params --fit-print on`'s stdout (see the module).
    pub fn parse(stdout: &[u8]) -> Result<Self, ParseError> {
        if stdout.len() > MAX_OUTPUT {
            return Err(ParseError::TooLong);
        }
        let mut devices: Vec<DeviceUsage> = Vec::new();
        let mut host = None;
        let mut rows = 0;
        for (index, raw) in stdout.split(|&b| b == b'\n').enumerate() {
            let line = index + 1;
            if raw.len() > MAX_LINE {
                return Err(ParseError::LineTooLong { line });
            }
            // Printable ASCII and spaces only (llama.cpp ends each row with a space).
            if !raw.iter().all(|&b| b == b' ' || b == b'\t' || b == b'\r' || b.is_ascii_graphic()) {
                return Err(ParseError::NotText { line });
            }
            let text = std::str::from_utf8(raw).map_err(|_| ParseError::NotText { line })?;
            if text.trim().is_empty() {
                continue;
            }
            rows += 1;
            if rows > MAX_ROWS {
                return Err(ParseError::TooManyRows);
            }
            if host.is_some() {
                return Err(ParseError::AfterHost { line });
            }
            let fields: Vec<&str> = text.split_ascii_whitespace().collect();
            let [name, model, context, compute] = fields[..] else {
                return Err(ParseError::Fields { line, fields: fields.len() });
            };
            check_name(line, name)?;
            let usage = Usage {
                model: mib(line, "model", model)?,
                context: mib(line, "context", context)?,
                compute: mib(line, "compute", compute)?,
            };
            if name == HOST {
                host = Some(usage);
            } else if devices.iter().any(|d| d.name == name) {
                return Err(ParseError::Duplicate { line, name: name.to_owned() });
            } else {
                devices.push(DeviceUsage { name: name.to_owned(), usage });
            }
        }
        if rows == 0 {
            return Err(ParseError::Empty);
        }
        let host = host.ok_or(ParseError::NoHost)?;
        Ok(Self { devices, host })
    }

    /// The devices' rows, in llama.cpp's order.
    #[must_use]
    pub fn devices(&self) -> &[DeviceUsage] {
        &self.devices
    }

    /// One device's row, by the name llama.cpp gives it (`RPC0`, `CUDA0`).
    #[must_use]
    pub fn device(&self, name: &str) -> Option<Usage> {
        self.devices.iter().find(|d| d.name == name).map(|d| d.usage)
    }

    /// One device's total, by name.
    #[must_use]
    pub fn device_total(&self, name: &str) -> Option<u64> {
        self.device(name).map(|u| u.total())
    }

    /// The sum over the devices (the host left out).
    #[must_use]
    pub fn devices_total(&self) -> u64 {
        self.devices.iter().fold(0, |sum, d| sum.saturating_add(d.usage.total()))
    }

    /// The host's row: what stays in host memory (weights not offloaded, CPU buffers).
    #[must_use]
    pub fn host(&self) -> Usage {
        self.host
    }

    /// The host's total.
    #[must_use]
    pub fn host_total(&self) -> u64 {
        self.host.total()
    }
}

pub(super) fn check_name(line: usize, name: &str) -> Result<(), ParseError> {
    // llama.cpp's device names: letters, digits and a little punctuation (`RPC[host:port]`
    // in some versions).
    let allowed = |c: char| c.is_ascii_alphanumeric() || "_-.:[]/#@".contains(c);
    if name.is_empty() || name.len() > MAX_NAME || !name.chars().all(allowed) {
        let shown: String = name.chars().take(MAX_NAME).collect();
        return Err(ParseError::BadName { line, name: shown });
    }
    Ok(())
}

fn check_usage(line: usize, usage: &Usage) -> Result<(), ParseError> {
    for (field, bytes) in [("model", usage.model), ("context", usage.context), ("compute", usage.compute)] {
        if bytes > MAX_MIB * RESOLUTION {
            return Err(ParseError::TooLarge { line, field, text: (bytes / RESOLUTION).to_string() });
        }
    }
    Ok(())
}

/// A figure in whole MiB as bytes.
pub(super) fn mib(line: usize, field: &'static str, text: &str) -> Result<u64, ParseError> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ParseError::BadNumber { line, field, text: text.to_owned() });
    }
    let too_large = || ParseError::TooLarge { line, field, text: text.to_owned() };
    // Only digits: a parse failure is an overflow.
    let value: u64 = text.parse().map_err(|_| too_large())?;
    if value > MAX_MIB {
        return Err(too_large());
    }
    Ok(value * RESOLUTION)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::{DeviceUsage, MAX_MIB, MAX_OUTPUT, MAX_ROWS, ParseError, Projection, RESOLUTION, Usage};

    const MIB: u64 = 1 << 20;

    fn usage(model: u64, context: u64, compute: u64) -> Usage {
        Usage { model: model * MIB, context: context * MIB, compute: compute * MIB }
    }

    #[test]
    fn real_output_reads_per_device_and_host_in_bytes() {
        // llama-fit-params b11434 on the tiny model with two rpc-servers (`-ngl 99 -ts 1,1`).
        let p = Projection::parse(b"RPC0 0 0 10 \nRPC1 0 0 10 \nHost 0 0 9 \n").expect("valid");
        let names: Vec<&str> = p.devices().iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["RPC0", "RPC1"]);
        assert_eq!(p.device("RPC1"), Some(usage(0, 0, 10)));
        assert_eq!(p.device_total("RPC0"), Some(10 * MIB));
        assert_eq!(p.device("CUDA0"), None);
        assert_eq!(p.devices_total(), 20 * MIB);
        assert_eq!(p.host(), usage(0, 0, 9));
        assert_eq!(p.host_total(), 9 * MIB);
        // The CPU only: the host row alone.
        let p = Projection::parse(b"Host 0 1 3 \n").expect("valid");
        assert!(p.devices().is_empty());
        assert_eq!((p.host(), p.host_total()), (usage(0, 1, 3), 4 * MIB));
        // A large GPU figure, and no trailing newline or space.
        let p = Projection::parse(b"CUDA0 15360 2048 512\nHost 300 0 40").expect("valid");
        assert_eq!(p.device("CUDA0"), Some(usage(15360, 2048, 512)));
        assert_eq!(p.device_total("CUDA0"), Some(17920 * MIB));
    }

    #[test]
    fn the_upper_bound_adds_what_rounding_down_took_off() {
        assert_eq!(usage(0, 0, 10).upper_bound(), 13 * MIB - 3);
        assert_eq!(Usage { model: u64::MAX, context: 0, compute: 0 }.upper_bound(), u64::MAX);
    }

    #[test]
    fn hostile_or_unexpected_output_is_a_typed_error() {
        let cases: &[(&[u8], ParseError)] = &[
            (b"", ParseError::Empty),
            (b"\n \n", ParseError::Empty),
            (b"RPC0 0 0 10\n", ParseError::NoHost),
            (b"Host 0 0 9\nRPC0 0 0 10\n", ParseError::AfterHost { line: 2 }),
            (b"Host 0 0 9\nHost 0 0 9\n", ParseError::AfterHost { line: 2 }),
            (b"RPC0 0 0\nHost 0 0 9\n", ParseError::Fields { line: 1, fields: 3 }),
            (b"RPC0 0 0 1 2\nHost 0 0 9\n", ParseError::Fields { line: 1, fields: 5 }),
            (b"RPC0 0 -1 10\nHost 0 0 9\n", ParseError::BadNumber { line: 1, field: "context", text: "-1".into() }),
            (b"RPC0 0 0 1.5\nHost 0 0 9\n", ParseError::BadNumber { line: 1, field: "compute", text: "1.5".into() }),
            (
                b"Host 99999999999999999999999 0 9\n",
                ParseError::TooLarge { line: 1, field: "model", text: "99999999999999999999999".into() },
            ),
            (b"Host 1073741825 0 9\n", ParseError::TooLarge { line: 1, field: "model", text: "1073741825".into() }),
            (b"RPC0 0 0 1\nRPC0 0 0 1\nHost 0 0 9\n", ParseError::Duplicate { line: 2, name: "RPC0".into() }),
            (b"RPC0 0 0 1\n\xff\nHost 0 0 9\n", ParseError::NotText { line: 2 }),
            (b"RPC0\x1b[31m 0 0 1\nHost 0 0 9\n", ParseError::NotText { line: 1 }),
            (b"R{C0 0 0 1\nHost 0 0 9\n", ParseError::BadName { line: 1, name: "R{C0".into() }),
            // What the tool prints without `--fit-print on`, or an error on the wrong stream.
            (
                b"error: invalid argument: --host\n",
                ParseError::BadNumber { line: 1, field: "model", text: "invalid".into() },
            ),
            (b"-c 4096 -ngl 99\n", ParseError::BadNumber { line: 1, field: "context", text: "-ngl".into() }),
        ];
        for (input, want) in cases {
            assert_eq!(Projection::parse(input).as_ref(), Err(want), "{:?}", String::from_utf8_lossy(input));
        }
        let long_name = format!("{} 0 0 1\nHost 0 0 1\n", "D".repeat(65));
        assert!(matches!(Projection::parse(long_name.as_bytes()), Err(ParseError::BadName { line: 1, .. })));
        let long_line = format!("RPC0 0 0 1{}\nHost 0 0 1\n", " ".repeat(300));
        assert_eq!(Projection::parse(long_line.as_bytes()), Err(ParseError::LineTooLong { line: 1 }));
        let rows = |n: usize| (0..n).fold(String::new(), |text, i| text + &format!("RPC{i} 0 0 1\n")) + "Host 0 0 1\n";
        let many = rows(MAX_ROWS);
        assert_eq!(Projection::parse(many.as_bytes()), Err(ParseError::TooManyRows));
        let most = rows(MAX_ROWS - 1);
        assert_eq!(Projection::parse(most.as_bytes()).expect("the most rows").devices().len(), MAX_ROWS - 1);
        let flood = vec![b'\n'; MAX_OUTPUT + 1];
        assert_eq!(Projection::parse(&flood), Err(ParseError::TooLong));
        // The largest figure is accepted, and its sums do not overflow.
        let max = format!("A {MAX_MIB} {MAX_MIB} {MAX_MIB}\nHost {MAX_MIB} {MAX_MIB} {MAX_MIB}\n");
        let p = Projection::parse(max.as_bytes()).expect("the largest figures");
        assert_eq!(p.host_total(), 3 * MAX_MIB * RESOLUTION);
        // Messages say what is wrong in words.
        let message = Projection::parse(b"RPC0 0 0 x\nHost 0 0 9\n").expect_err("bad").to_string();
        assert_eq!(message, "line 1: compute \"x\" is not a whole number of MiB");
    }

    #[test]
    fn new_checks_what_parse_checks_and_files_are_checked_when_read() {
        let row = |name: &str| DeviceUsage { name: name.into(), usage: usage(1, 2, 3) };
        let p = Projection::new(vec![row("CUDA0"), row("RPC0")], usage(4, 0, 1)).expect("valid");
        let json = serde_json::to_string(&p).expect("json");
        assert_eq!(serde_json::from_str::<Projection>(&json).expect("read back"), p);
        assert!(matches!(
            Projection::new(vec![row("A"), row("A")], Usage::default()),
            Err(ParseError::Duplicate { line: 2, .. })
        ));
        assert!(matches!(Projection::new(vec![row("Host")], Usage::default()), Err(ParseError::AfterHost { .. })));
        assert!(matches!(Projection::new(vec![row("a b")], Usage::default()), Err(ParseError::BadName { .. })));
        let huge = Usage { model: u64::MAX, ..Usage::default() };
        assert!(matches!(Projection::new(Vec::new(), huge), Err(ParseError::TooLarge { line: 1, .. })));
        let bad = json.replace("CUDA0", "RPC0");
        assert!(serde_json::from_str::<Projection>(&bad).expect_err("duplicate").to_string().contains("printed twice"));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic_and_accepted_output_is_consistent(input in proptest::collection::vec(any::<u8>(), 0..2048)) {
            if let Ok(p) = Projection::parse(&input) {
                prop_assert!(p.devices().len() < MAX_ROWS);
                for d in p.devices() {
                    prop_assert_eq!(p.device(&d.name), Some(d.usage));
                    prop_assert!(d.usage.total() <= 3 * MAX_MIB * RESOLUTION);
                }
                prop_assert_eq!(Projection::new(p.devices().to_vec(), p.host()), Ok(p));
            }
        }

        #[test]
        fn printed_rows_read_back(
            rows in proptest::collection::vec((0..=MAX_MIB, 0..=MAX_MIB, 0..=MAX_MIB), 0..8),
            host in (0..=MAX_MIB, 0..=MAX_MIB, 0..=MAX_MIB),
            noise in "[ \t\r]{0,3}",
        ) {
            use std::fmt::Write as _;
            let mut text = String::new();
            for (i, (m, c, k)) in rows.iter().enumerate() {
                writeln!(text, "{noise}CUDA{i} {m} {c} {k}{noise}").expect("to a string");
            }
            writeln!(text, "Host {} {} {} ", host.0, host.1, host.2).expect("to a string");
            let p = Projection::parse(text.as_bytes()).expect("valid rows");
            prop_assert_eq!(p.devices().len(), rows.len());
            for (i, (m, c, k)) in rows.iter().enumerate() {
                prop_assert_eq!(p.device(&format!("CUDA{i}")), Some(usage(*m, *c, *k)));
            }
            prop_assert_eq!(p.host(), usage(host.0, host.1, host.2));
        }

        #[test]
        fn arbitrary_lines_of_fields_never_panic(lines in proptest::collection::vec("[A-Za-z0-9 .:\\-]{0,40}", 0..80)) {
            let text = lines.join("\n");
            let _ = Projection::parse(text.as_bytes());
        }
    }
}
