//! RPC workers' devices: what llama.cpp sees on each `[[workers]]` endpoint.
//!
//! Each worker is asked the way llama.cpp itself sees it:
//! `llama-server --rpc ADDRESS --list-devices` (`--rpc` first: `--list-devices` exits as
//! soon as it is parsed), within [`ASK_TIMEOUT`] and with its output bounded.  The answer
//! is parsed strictly ([`parse_list`]).  `[[workers]] memory` caps each of its devices.
//! When to ask, and what a failure means, is the health monitor's ([`crate::workers`]).

use std::io::Read;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use super::{Backend, Gpu};
use crate::config::WorkerConfig;

/// How long one worker's listing may take: llama-server connects, says hello and asks
/// for the devices (milliseconds on a reachable worker).
pub const ASK_TIMEOUT: Duration = Duration::from_secs(10);

/// The most output read from one listing; more is an error.
const MAX_OUTPUT: u64 = 64 * 1024;

/// The most devices one worker may list.
pub const MAX_DEVICES: usize = 64;

/// The most of a failed listing's message kept for the log.
const MAX_REASON: usize = 300;

const MIB: u64 = 1024 * 1024;

/// One device line of `--list-devices`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// llama.cpp's name for it in that process: `RPC0`, `RPC1`, …
    pub name: String,
    /// Its description: for an RPC device, the endpoint.
    pub description: String,
    /// Its memory in bytes.
    pub total_bytes: u64,
    /// Its free memory in bytes.
    pub free_bytes: u64,
}

/// Why a listing is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ListError {
    /// No `Available devices:` line.
    #[error("no \"Available devices:\" line")]
    NoHeader,
    /// A line after the header that is not a device.
    #[error("line {line}: {text:?} is not \"  NAME: DESCRIPTION (N MiB, M MiB free)\"")]
    Malformed {
        /// Its number, from 1.
        line: usize,
        /// The line, shortened.
        text: String,
    },
    /// A size too large for bytes.
    #[error("line {line}: {mib} MiB is too large")]
    TooLarge {
        /// Its number, from 1.
        line: usize,
        /// The size.
        mib: u64,
    },
    /// More free memory than there is.
    #[error("line {line}: {free} MiB free of {total} MiB")]
    FreeAboveTotal {
        /// Its number, from 1.
        line: usize,
        /// The free memory.
        free: u64,
        /// The total.
        total: u64,
    },
    /// The same device twice.
    #[error("line {line}: {name} is listed twice")]
    Repeated {
        /// Its number, from 1.
        line: usize,
        /// The device's name.
        name: String,
    },
    /// No RPC device at all.
    #[error("it lists no RPC device")]
    NoDevice,
    /// Too many devices.
    #[error("it lists more than {MAX_DEVICES} devices")]
    TooMany,
}

/// Why a worker's devices are not known.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// llama-server could not be started.
    #[error("cannot run {}: {source}", program.display())]
    Spawn {
        /// The program.
        program: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// No answer in time.
    #[error("no answer within {}", crate::durations::human(*.0))]
    Timeout(Duration),
    /// More output than a listing has.
    #[error("the listing is longer than {MAX_OUTPUT} bytes")]
    TooLong,
    /// llama-server failed (cannot connect, the handshake failed, …).
    #[error("{message} (llama-server exited with {status})")]
    Failed {
        /// How it exited.
        status: String,
        /// Its last message.
        message: String,
    },
    /// The answer is not a listing.
    #[error("unexpected answer: {0}")]
    Answer(#[from] ListError),
    /// The asking thread panicked.
    #[error("the listing panicked")]
    Panicked,
}

/// Parses the standard output of `llama-server --rpc … --list-devices`:
///
/// ```text
/// Available devices:
///   RPC0: 127.0.0.1:50061 (24105 MiB, 24105 MiB free)
/// ```
///
/// Lines before the header are ignored; after it every line is a device (or `(none)`).
/// Only RPC devices (`RPC<n>`) are kept: a GPU build lists its local GPUs too, which the
/// other probes find.
pub fn parse_list(text: &str) -> Result<Vec<Listed>, ListError> {
    let mut lines = text.lines().enumerate();
    lines.find(|(_, l)| l.trim_end() == "Available devices:").ok_or(ListError::NoHeader)?;
    let mut devices: Vec<Listed> = Vec::new();
    let mut seen = 0_usize;
    for (index, raw) in lines {
        let line = index + 1;
        let trimmed = raw.trim();
        if trimmed.is_empty() || trimmed == "(none)" {
            continue;
        }
        seen += 1;
        if seen > MAX_DEVICES {
            return Err(ListError::TooMany);
        }
        let device = parse_line(raw, line)?;
        if devices.iter().any(|d| d.name == device.name) {
            return Err(ListError::Repeated { line, name: device.name });
        }
        if is_rpc_name(&device.name) {
            devices.push(device);
        }
    }
    if devices.is_empty() {
        return Err(ListError::NoDevice);
    }
    Ok(devices)
}

/// `  NAME: DESCRIPTION (N MiB, M MiB free)`, as llama.cpp's `common_print_available_devices`
/// prints it.
fn parse_line(raw: &str, line: usize) -> Result<Listed, ListError> {
    let malformed = || ListError::Malformed { line, text: shorten(raw, 120) };
    let body = raw.strip_prefix("  ").ok_or_else(malformed)?;
    let (name, rest) = body.split_once(": ").ok_or_else(malformed)?;
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_graphic() && b != b':') {
        return Err(malformed());
    }
    let inner = rest.strip_suffix(" MiB free)").ok_or_else(malformed)?;
    let (description, sizes) = inner.rsplit_once(" (").ok_or_else(malformed)?;
    let (total, free) = sizes.split_once(" MiB, ").ok_or_else(malformed)?;
    let number = |s: &str| {
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(malformed());
        }
        s.parse::<u64>().map_err(|_| malformed())
    };
    let (total, free) = (number(total)?, number(free)?);
    if description.trim().is_empty() || description.chars().any(char::is_control) {
        return Err(malformed());
    }
    if free > total {
        return Err(ListError::FreeAboveTotal { line, free, total });
    }
    let bytes = |mib: u64| mib.checked_mul(MIB).ok_or(ListError::TooLarge { line, mib });
    Ok(Listed {
        name: name.to_owned(),
        description: description.to_owned(),
        total_bytes: bytes(total)?,
        free_bytes: bytes(free)?,
    })
}

/// `RPC` and a number: the names llama.cpp gives remote devices.
fn is_rpc_name(name: &str) -> bool {
    name.strip_prefix("RPC").is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// `text` cut to `max` characters, with `…` when cut.
fn shorten(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_owned(),
    }
}

/// The worker's devices as the inventory holds them: each capped by its `memory`, named
/// after the worker (with its position when it has several).
#[must_use]
pub fn to_gpus(worker: &WorkerConfig, listed: &[Listed]) -> Vec<Gpu> {
    let cap = worker.memory.unwrap_or(u64::MAX);
    listed
        .iter()
        .zip(0_u32..)
        .map(|(device, index)| Gpu {
            index,
            id: format!("rpc:{}#{index}", worker.address),
            name: if listed.len() == 1 { worker.name().to_owned() } else { format!("{} #{index}", worker.name()) },
            backend: Backend::Rpc,
            total_bytes: device.total_bytes.min(cap),
            free_bytes: device.free_bytes.min(cap),
            driver: None,
            compute: None,
            endpoint: Some(worker.address.as_str().to_owned()),
        })
        .collect()
}

/// Runs `llama_server --rpc address --list-devices` and parses its answer.
///
/// The child runs in its own process group, so that a timeout kills all of it; its
/// output is read up to `MAX_OUTPUT` bytes.
pub fn ask(llama_server: &Path, address: &str, timeout: Duration) -> Result<Vec<Listed>, WorkerError> {
    let mut child = Command::new(llama_server)
        .args(["--rpc", address, "--list-devices"])
        // A failed connection aborts; without this ggml attaches gdb for a backtrace.
        .env("GGML_NO_BACKTRACE", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .map_err(|source| WorkerError::Spawn { program: llama_server.to_owned(), source })?;
    let pid = child.id();
    let (Some(stdout), Some(stderr)) = (child.stdout.take(), child.stderr.take()) else {
        kill_group(pid);
        let _ = child.wait();
        let source = std::io::Error::other("its output pipes are missing");
        return Err(WorkerError::Spawn { program: llama_server.to_owned(), source });
    };
    let (done, finished) = std::sync::mpsc::channel();
    let out_done = done.clone();
    let out = std::thread::spawn(move || {
        let read = read_bounded(stdout);
        let _ = out_done.send(());
        read
    });
    let err = std::thread::spawn(move || {
        let read = read_bounded(stderr);
        let _ = done.send(());
        read
    });
    // Both pipes close when the child (and anything it started) exits.
    let deadline = std::time::Instant::now() + timeout;
    let mut closed = 0;
    while closed < 2 {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match finished.recv_timeout(left) {
            Ok(()) => closed += 1,
            Err(_) => break,
        }
    }
    if closed < 2 {
        kill_group(pid);
        let _ = child.wait();
        // The readers end when the pipes close; nothing waits for them (a process that
        // left the group could hold a pipe open).
        drop((out, err));
        return Err(WorkerError::Timeout(timeout));
    }
    let status = child.wait().map_err(|source| WorkerError::Spawn { program: llama_server.to_owned(), source })?;
    let (stdout, stdout_long) = out.join().unwrap_or_default();
    let (stderr, _) = err.join().unwrap_or_default();
    if !status.success() {
        return Err(WorkerError::Failed { status: status.to_string(), message: reason(&stderr) });
    }
    if stdout_long {
        return Err(WorkerError::TooLong);
    }
    Ok(parse_list(&stdout)?)
}

/// Reads a pipe to its end, keeping at most [`MAX_OUTPUT`] bytes; says whether there was more.
fn read_bounded(pipe: impl Read) -> (String, bool) {
    let mut kept = Vec::new();
    let mut limited = pipe.take(MAX_OUTPUT + 1);
    let _ = limited.read_to_end(&mut kept);
    let long = kept.len() as u64 > MAX_OUTPUT;
    // Drain the rest so the child never blocks on a full pipe.
    let _ = std::io::copy(&mut limited.into_inner(), &mut std::io::sink());
    kept.truncate(usize::try_from(MAX_OUTPUT).unwrap_or(usize::MAX));
    (String::from_utf8_lossy(&kept).into_owned(), long)
}

/// The last message on a failed listing's stderr, without ggml's `file.cpp:123: ` prefix.
fn reason(stderr: &str) -> String {
    let Some(last) = stderr.lines().map(str::trim).rfind(|l| !l.is_empty()) else {
        return "no message".to_owned();
    };
    let message = last
        .split_once(": ")
        .filter(|(place, _)| {
            place.rsplit_once(':').is_some_and(|(file, n)| file.contains('.') && n.parse::<u32>().is_ok())
        })
        .map_or(last, |(_, message)| message);
    shorten(message, MAX_REASON)
}

/// SIGKILL to the process group `pid` leads.
fn kill_group(pid: u32) {
    if let Ok(pid) = i32::try_from(pid) {
        let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;
    use std::path::Path;
    use std::time::{Duration, Instant};

    use proptest::prelude::{any, proptest};

    use super::{ListError, Listed, WorkerError, ask, parse_list, reason, to_gpus};
    use crate::config::WorkerConfig;
    use crate::gpu::Backend;

    const MIB: u64 = 1024 * 1024;

    fn worker(address: &str, name: Option<&str>, memory: Option<u64>) -> WorkerConfig {
        WorkerConfig {
            address: address.parse().expect("address"),
            name: name.map(str::to_owned),
            memory,
            allow_public: false,
        }
    }

    #[test]
    fn a_real_listing_parses() {
        let text = "Available devices:\n  RPC0: 127.0.0.1:50061 (24105 MiB, 24000 MiB free)\n";
        assert_eq!(
            parse_list(text),
            Ok(vec![Listed {
                name: "RPC0".into(),
                description: "127.0.0.1:50061".into(),
                total_bytes: 24105 * MIB,
                free_bytes: 24000 * MIB,
            }])
        );
    }

    #[test]
    fn local_gpus_and_preambles_are_skipped_and_several_rpc_devices_kept() {
        let text = "ggml_cuda_init: found 1 CUDA devices\nAvailable devices:\n  CUDA0: NVIDIA H200 (143771 MiB, \
                    143000 MiB free)\n  RPC0: h:1 (10 MiB, 5 MiB free)\n  RPC1: h:1 (20 MiB, 0 MiB free)\n\n";
        let listed = parse_list(text).expect("valid");
        let names: Vec<_> = listed.iter().map(|d| (d.name.as_str(), d.total_bytes, d.free_bytes)).collect();
        assert_eq!(names, [("RPC0", 10 * MIB, 5 * MIB), ("RPC1", 20 * MIB, 0)]);
    }

    #[test]
    fn bad_listings_are_typed_errors_naming_the_line() {
        let cases: &[(&str, ListError)] = &[
            ("", ListError::NoHeader),
            ("  RPC0: h:1 (1 MiB, 1 MiB free)\n", ListError::NoHeader),
            ("Available devices:\n  (none)\n", ListError::NoDevice),
            ("Available devices:\n  CUDA0: x (1 MiB, 1 MiB free)\n", ListError::NoDevice),
            (
                "Available devices:\n  RPC0: h:1 (2 MiB, 3 MiB free)\n",
                ListError::FreeAboveTotal { line: 2, free: 3, total: 2 },
            ),
            (
                "Available devices:\n  RPC0: h:1 (1 MiB, 1 MiB free)\n  RPC0: h:1 (1 MiB, 1 MiB free)\n",
                ListError::Repeated { line: 3, name: "RPC0".into() },
            ),
            (
                "Available devices:\n  RPC0: h:1 (18446744073709551615 MiB, 0 MiB free)\n",
                ListError::TooLarge { line: 2, mib: u64::MAX },
            ),
        ];
        for (text, want) in cases {
            assert_eq!(parse_list(text).as_ref(), Err(want), "{text:?}");
        }
        for line in [
            "RPC0: h:1 (1 MiB, 1 MiB free)",
            "  RPC0 h:1 (1 MiB, 1 MiB free)",
            "  RPC0: h:1 (1 MiB, 1 MiB)",
            "  RPC0: h:1 (1 GiB, 1 MiB free)",
            "  RPC0: h:1 (-1 MiB, 1 MiB free)",
            "  RPC0: h:1 (1 MiB, +1 MiB free)",
            "  RPC0: h:1 (99999999999999999999 MiB, 1 MiB free)",
            "  RPC0:  (1 MiB, 1 MiB free)",
            "  : h:1 (1 MiB, 1 MiB free)",
            "  RPC 0: h:1 (1 MiB, 1 MiB free)",
            "  RPC0: h:1 (1 MiB, 1 MiB free) trailing",
            "  RPC0: h:1\u{7}x (1 MiB, 1 MiB free)",
        ] {
            let text = format!("Available devices:\n{line}\n");
            assert!(
                matches!(parse_list(&text), Err(ListError::Malformed { line: 2, .. })),
                "{line:?}: {:?}",
                parse_list(&text)
            );
        }
        let many = (0..65).map(|i| format!("  RPC{i}: h:1 (1 MiB, 1 MiB free)\n")).collect::<Vec<_>>().concat();
        assert_eq!(parse_list(&format!("Available devices:\n{many}")), Err(ListError::TooMany));
    }

    proptest! {
        #[test]
        fn any_input_parses_or_fails_without_panicking(text in any::<String>()) {
            let _ = parse_list(&text);
            let _ = parse_list(&format!("Available devices:\n{text}"));
        }

        #[test]
        fn any_well_formed_device_parses_back(index in 0_u32..1000, total in 0_u64..1 << 40, free_part in 0_u64..=100) {
            let free = total / 100 * free_part;
            let text = format!("Available devices:\n  RPC{index}: w:1 ({total} MiB, {free} MiB free)\n");
            let listed = parse_list(&text).expect("well formed");
            assert_eq!((listed[0].total_bytes, listed[0].free_bytes), (total * MIB, free * MIB));
        }
    }

    #[test]
    fn devices_are_named_after_the_worker_and_capped_by_its_memory() {
        let listed = |n: u64| Listed {
            name: format!("RPC{n}"),
            description: "x".into(),
            total_bytes: n * 100 * MIB,
            free_bytes: n * 50 * MIB,
        };
        let one = to_gpus(&worker("127.0.0.1:50052", None, Some(120 * MIB)), &[listed(2)]);
        let [gpu] = &one[..] else { panic!("{one:?}") };
        assert_eq!((gpu.index, gpu.id.as_str(), gpu.name.as_str()), (0, "rpc:127.0.0.1:50052#0", "127.0.0.1:50052"));
        assert_eq!((gpu.backend, gpu.endpoint.as_deref()), (Backend::Rpc, Some("127.0.0.1:50052")));
        assert_eq!((gpu.total_bytes, gpu.free_bytes), (120 * MIB, 100 * MIB), "capped by memory");
        let two = to_gpus(&worker("h:2", Some("box"), None), &[listed(1), listed(3)]);
        let names: Vec<_> = two.iter().map(|g| (g.index, g.id.as_str(), g.name.as_str(), g.total_bytes)).collect();
        assert_eq!(names, [(0, "rpc:h:2#0", "box #0", 100 * MIB), (1, "rpc:h:2#1", "box #1", 300 * MIB)]);
    }

    #[test]
    fn failures_keep_ggmls_message_without_its_source_position() {
        let stderr = "noise\n/src/ggml/src/ggml-rpc/ggml-rpc.cpp:547: Failed to connect to 127.0.0.1:1\n\n";
        assert_eq!(reason(stderr), "Failed to connect to 127.0.0.1:1");
        assert_eq!(reason("error: invalid argument: --rpc\n"), "error: invalid argument: --rpc");
        assert_eq!(reason(""), "no message");
    }

    /// A script standing in for llama-server.
    fn script(dir: &Path, body: &str) -> std::path::PathBuf {
        let path = dir.join("llama-server");
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        path
    }

    #[test]
    fn the_child_is_asked_with_rpc_first_and_its_failures_are_typed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let echo = script(
            dir.path(),
            "echo 'Available devices:'; echo \"  RPC0: $2 (7 MiB, 6 MiB free)\"; [ \"$1 $3\" = '--rpc --list-devices' ]",
        );
        let listed = ask(&echo, "h:9", Duration::from_secs(10)).expect("listed");
        assert_eq!((listed[0].description.as_str(), listed[0].free_bytes), ("h:9", 6 * MIB));

        let failing = script(dir.path(), "echo '/x/ggml-rpc.cpp:547: Failed to connect to h:9' >&2; exit 134");
        let err = ask(&failing, "h:9", Duration::from_secs(10)).expect_err("fails");
        assert!(matches!(&err, WorkerError::Failed { message, .. } if message == "Failed to connect to h:9"), "{err}");

        let garbage = script(dir.path(), "echo hello");
        assert!(matches!(ask(&garbage, "h:9", Duration::from_secs(10)), Err(WorkerError::Answer(ListError::NoHeader))));

        let long = script(dir.path(), "echo 'Available devices:'; head -c 100000 /dev/zero | tr '\\0' x");
        assert!(matches!(ask(&long, "h:9", Duration::from_secs(10)), Err(WorkerError::TooLong)));

        let missing = dir.path().join("nothing-here");
        assert!(matches!(ask(&missing, "h:9", Duration::from_secs(10)), Err(WorkerError::Spawn { .. })));
    }

    #[test]
    fn a_silent_worker_times_out_and_its_process_group_is_killed() {
        let dir = tempfile::tempdir().expect("tempdir");
        // A grandchild holding the pipes open must not outlive the timeout either.
        let hang = script(dir.path(), "sleep 30 & sleep 30");
        let started = Instant::now();
        let err = ask(&hang, "h:9", Duration::from_millis(300)).expect_err("times out");
        assert!(matches!(err, WorkerError::Timeout(_)), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    }
}
