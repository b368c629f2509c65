//! The exact plan's projection: llama-server's own `--fit` dry run, with the child's
//! arguments, stopped once it has printed its projection.
//!
//! Why not `llama-fit-params` here: llama-server reserves its compute graph for one output
//! per slot (`n_outputs_max` = `-np`, set in `server_output_limits`), llama-fit-params for a
//! whole micro-batch of outputs, and no flag of llama-fit-params changes that.  The device
//! holding a model's last block and output layer was projected several MiB high (+52 % on
//! the rig's small partial-offload device, docs/benchmarks.md).  llama-server's dry run
//! (`common_fit_params`, run before the weights are read when `--fit on`) reserves the
//! graph exactly as the child will, and prints at `-lv 5`:
//!
//! ```text
//! I sched_reserve: RPC0[127.0.0.1:50071] compute buffer size =    16.01 MiB
//! I common_memory_breakdown_print: | memory breakdown [MiB] | total free self model context compute unaccounted |
//! I common_memory_breakdown_print: |   - RPC0 (127.0.0.1:50071) | 24105 = 24105 + (  35 =    15 +       4 +      16) +         -35 |
//! I common_memory_breakdown_print: |   - Host                   |                   143 =    98 +      26 +      19                |
//! ```
//!
//! The table gives model and context per device in whole MiB (rounded down, as
//! llama-fit-params prints them); the compute buffer lines give the compute to a
//! hundredth of a MiB.  Once the host's row is read the projection is complete, and the
//! process (about to read the weights) is killed.

use std::ffi::{OsStr, OsString};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncReadExt;

use super::parse::{DeviceUsage, MAX_ROWS, ParseError, Projection, RESOLUTION, Usage, check_name, mib};
use super::projector::{ProjectionError, failure_message, kill_group, reap, spawn};
use crate::durations::human;
use crate::supervisor::logparse::{BufferKind, LineSplitter, LoadReport, is_host_buffer};

/// The most stderr read from a dry run before it is given up (at `-lv 5` llama.cpp
/// prints a few lines per tensor: a few hundred KiB for the largest models).
pub const MAX_DRY_RUN_OUTPUT: usize = 64 << 20;

/// The longest stderr line kept whole.
const MAX_LINE: usize = 4096;

/// What starts a row of the memory table.
const TABLE: &str = "common_memory_breakdown_print:";

/// Runs llama-server's `--fit` dry run for an exact plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DryRun {
    /// llama-server, as the children run it.
    pub llama_server: PathBuf,
    /// Where the dry run's server socket goes (the runners' directory); it never serves.
    pub socket_dir: PathBuf,
    /// How long one dry run may take before it is killed.
    pub timeout: Duration,
}

impl DryRun {
    /// Runs llama-server with `args` (the child's model-shaping flags) plus `--fit on`,
    /// `-lv 5` and a socket of its own named after `id`, the environment `env` and
    /// nothing else; reads its stderr until the memory table's host row, then kills it.
    /// `buffers` pairs each planned device's name with its buffer name (`RPC1`,
    /// `RPC0[10.0.0.2:50052]`), to find its compute buffer line.
    pub async fn project(
        &self,
        args: &[OsString],
        env: &[(OsString, OsString)],
        id: u64,
        buffers: &[(String, String)],
    ) -> Result<Projection, ProjectionError> {
        let program = || self.llama_server.clone();
        let socket = self.socket_dir.join(format!("projection-{id}.sock"));
        // A socket left by a killed dry run would make the bind fail.
        let _ = std::fs::remove_file(&socket);
        let own = ["--fit", "on", "-lv", "5", "--offline", "--no-webui", "--host"].map(OsStr::new);
        let extra: Vec<&OsStr> = own.into_iter().chain([socket.as_os_str()]).collect();
        let mut child = spawn(&self.llama_server, args, &extra, env, Stdio::null())?;
        let pid = child.id();
        let started = std::time::Instant::now();
        let mut reader = Reader::default();
        let read = read_until_table(child.stderr.take(), &mut reader);
        let outcome = tokio::time::timeout(self.timeout, read).await;
        // Complete, failed or late: the weights are not wanted either way.
        kill_group(pid);
        let _ = child.start_kill();
        let status = reap(&mut child).await;
        let _ = std::fs::remove_file(&socket);
        match outcome {
            Err(_) => Err(ProjectionError::TimedOut { program: program(), after: self.timeout }),
            Ok(Err(source)) => Err(ProjectionError::Unreadable { program: program(), source }),
            Ok(Ok(false)) => match status {
                Some(status) if !status.success() => Err(ProjectionError::Failed {
                    program: program(),
                    status,
                    class: reader.report.failure_class(),
                    message: failure_message(&reader.report),
                }),
                _ => Err(ProjectionError::Unreadable { program: program(), source: ParseError::NoHost }),
            },
            Ok(Ok(true)) => {
                let projection = reader
                    .projection(buffers)
                    .map_err(|source| ProjectionError::Unreadable { program: program(), source })?;
                tracing::debug!(
                    devices = projection.devices().len(),
                    host = projection.host_total(),
                    "llama-server's dry run projected in {}",
                    human(started.elapsed())
                );
                Ok(projection)
            }
        }
    }
}

/// Feeds stderr to `reader` until the table is complete (`Ok(true)`), the pipe ends
/// (`Ok(false)`), or the output breaks a bound.
async fn read_until_table(
    pipe: Option<impl tokio::io::AsyncRead + Unpin>,
    reader: &mut Reader,
) -> Result<bool, ParseError> {
    let Some(mut pipe) = pipe else { return Ok(false) };
    let mut splitter = LineSplitter::with_max_line(MAX_LINE);
    let mut chunk = vec![0_u8; 8192];
    let mut read = 0_usize;
    loop {
        let n = match pipe.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        read = read.saturating_add(n);
        if read > MAX_DRY_RUN_OUTPUT {
            return Err(ParseError::TooLong);
        }
        for line in splitter.push(&chunk[..n]) {
            if reader.feed(&line)? {
                return Ok(true);
            }
        }
    }
    match splitter.finish() {
        Some(line) => reader.feed(&line),
        None => Ok(false),
    }
}

/// Reads a dry run's stderr, line by line.
#[derive(Debug, Default)]
pub struct Reader {
    /// The buffer lines (the compute ones matter) and the error lines.
    report: LoadReport,
    /// The table's device rows so far, with their whole-MiB figures.
    devices: Vec<DeviceUsage>,
    /// The table's host row, once read: the table is complete.
    host: Option<Usage>,
}

impl Reader {
    /// Takes one line; `Ok(true)` once the table is complete (the host's row is read).
    pub fn feed(&mut self, line: &str) -> Result<bool, ParseError> {
        if self.host.is_some() {
            return Ok(true);
        }
        let parsed = self.report.feed(line);
        let Some(row) = parsed.message.strip_prefix(TABLE) else { return Ok(false) };
        let line = self.devices.len() + 1;
        let cells: Vec<&str> = row.trim().split('|').map(str::trim).collect();
        // `| label | figures |`: the header says what the columns are.
        let ["", label, figures, ""] = cells[..] else { return Ok(false) };
        let Some(label) = label.strip_prefix("- ") else { return Ok(false) };
        let name = label.split_ascii_whitespace().next().unwrap_or_default();
        check_name(line, name)?;
        let numbers: Vec<&str> =
            figures.split(|c: char| c.is_ascii_whitespace() || "=+()".contains(c)).filter(|s| !s.is_empty()).collect();
        // A device: total = free + (self = model + context + compute) + unaccounted; the
        // host: self = model + context + compute.
        let (model, context, compute) = match (name == "Host", &numbers[..]) {
            (false, [_, _, _, model, context, compute, _]) | (true, [_, model, context, compute]) => {
                (*model, *context, *compute)
            }
            _ => return Err(ParseError::Fields { line, fields: numbers.len() }),
        };
        let usage = Usage {
            model: mib(line, "model", model)?,
            context: mib(line, "context", context)?,
            compute: mib(line, "compute", compute)?,
        };
        if name == "Host" {
            self.host = Some(usage);
            return Ok(true);
        }
        if self.devices.iter().any(|d| d.name == name) {
            return Err(ParseError::Duplicate { line, name: name.to_owned() });
        }
        if self.devices.len() + 1 >= MAX_ROWS {
            return Err(ParseError::TooManyRows);
        }
        self.devices.push(DeviceUsage { name: name.to_owned(), usage });
        Ok(false)
    }

    /// The projection: the table's model and context, and each device's compute from its
    /// compute buffer line (`buffers`: device name, buffer name) where that line agrees
    /// with the table's whole MiB, the table's figure otherwise; the host's compute from
    /// its host buffers' lines alike.
    pub fn projection(&self, buffers: &[(String, String)]) -> Result<Projection, ParseError> {
        let host = self.host.ok_or(ParseError::NoHost)?;
        let compute_lines = |matches: &dyn Fn(&str) -> bool| -> Option<u64> {
            let mut lines =
                self.report.buffers().filter(|(key, _)| key.kind == BufferKind::Compute && matches(&key.buffer));
            let first = lines.next()?;
            Some(lines.fold(first.1, |sum, (_, bytes)| sum.saturating_add(bytes)))
        };
        // Exact where it agrees with the rounded-down figure (a line of another buffer
        // would not).
        let refine = |floor: u64, exact: Option<u64>| match exact {
            Some(exact) if exact / RESOLUTION == floor / RESOLUTION => exact,
            _ => floor,
        };
        let devices = self
            .devices
            .iter()
            .map(|d| {
                let buffer = buffers.iter().find(|(name, _)| *name == d.name).map(|(_, buffer)| buffer.as_str());
                let exact = buffer.and_then(|buffer| compute_lines(&|b| b == buffer));
                DeviceUsage {
                    name: d.name.clone(),
                    usage: Usage { compute: refine(d.usage.compute, exact), ..d.usage },
                }
            })
            .collect();
        let host = Usage { compute: refine(host.compute, compute_lines(&is_host_buffer)), ..host };
        Projection::new(devices, host)
    }
}

#[cfg(test)]
mod tests {
    use super::{ParseError, Reader, Usage};

    const MIB: u64 = 1 << 20;

    /// The lines of llama-server b11434's dry run that matter, for the rig's partial
    /// offload (`-ngl 4 -ts 2,2` over two workers), as printed at `-lv 5`.
    const RIG_PARTIAL: &str = "\
0.00.027.834 I load_tensors:          CPU model buffer size =     0.00 MiB
0.00.027.835 I load_tensors: RPC0[127.0.0.1:50071] model buffer size =     0.00 MiB
0.00.037.479 I sched_reserve: RPC0[127.0.0.1:50071] compute buffer size =    16.01 MiB
0.00.037.480 I sched_reserve: RPC0[127.0.0.1:50072] compute buffer size =     6.01 MiB
0.00.037.480 I sched_reserve:        CPU compute buffer size =    19.02 MiB
0.00.038.276 I common_memory_breakdown_print: | memory breakdown [MiB]     | total    free    self   model   context   compute    unaccounted |
0.00.038.298 I common_memory_breakdown_print: |   - RPC0 (127.0.0.1:50071) | 24105 = 24105 + (  35 =    15 +       4 +      16) +         -35 |
0.00.038.298 I common_memory_breakdown_print: |   - RPC1 (127.0.0.1:50072) | 24105 = 24105 + (  16 =     8 +       2 +       6) +         -16 |
0.00.038.298 I common_memory_breakdown_print: |   - Host                   |                   143 =    98 +      26 +      19                |
0.00.038.938 I common_params_fit_impl: projected memory use with initial parameters [MiB]:
";

    fn buffers() -> Vec<(String, String)> {
        vec![("RPC0".into(), "RPC0[127.0.0.1:50071]".into()), ("RPC1".into(), "RPC0[127.0.0.1:50072]".into())]
    }

    fn read(text: &str) -> Result<(Reader, bool), ParseError> {
        let mut reader = Reader::default();
        for line in text.lines() {
            if reader.feed(line)? {
                return Ok((reader, true));
            }
        }
        Ok((reader, false))
    }

    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss,
        reason = "test figures of a few MiB"
    )]
    fn mib(figure: f64) -> u64 {
        (figure * MIB as f64).round() as u64
    }

    #[test]
    fn the_table_gives_model_and_context_and_the_buffer_lines_the_exact_compute() {
        let (reader, complete) = read(RIG_PARTIAL).expect("read");
        assert!(complete, "the host row completes the table");
        let projection = reader.projection(&buffers()).expect("a projection");
        let names: Vec<&str> = projection.devices().iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["RPC0", "RPC1"]);
        assert_eq!(projection.device("RPC0"), Some(Usage { model: 15 * MIB, context: 4 * MIB, compute: mib(16.01) }));
        // The output layer's device: 6.01 MiB, where llama-fit-params projects 14.
        assert_eq!(projection.device("RPC1"), Some(Usage { model: 8 * MIB, context: 2 * MIB, compute: mib(6.01) }));
        assert_eq!(projection.host(), Usage { model: 98 * MIB, context: 26 * MIB, compute: mib(19.02) });
    }

    #[test]
    fn a_compute_line_that_disagrees_with_the_table_or_is_missing_leaves_the_table_s_figure() {
        let (reader, _) = read(RIG_PARTIAL).expect("read");
        // Device names mapped to the wrong buffers: 6.01 is not 16 MiB, 16.01 not 6.
        let swapped =
            vec![("RPC0".into(), "RPC0[127.0.0.1:50072]".into()), ("RPC1".into(), "RPC0[127.0.0.1:50071]".into())];
        let projection = reader.projection(&swapped).expect("a projection");
        assert_eq!(projection.device("RPC0").map(|u| u.compute), Some(16 * MIB));
        assert_eq!(projection.device("RPC1").map(|u| u.compute), Some(6 * MIB));
        let projection = reader.projection(&[]).expect("a projection");
        assert_eq!(projection.device("RPC1").map(|u| u.compute), Some(6 * MIB));
    }

    #[test]
    fn lines_after_the_table_and_a_second_table_are_not_read() {
        let mut text = RIG_PARTIAL.to_owned();
        text.push_str("0.00.040.000 I common_memory_breakdown_print: |   - Host | 1 = 1 + 0 + 0 |\n");
        let (mut reader, complete) = read(&text).expect("read");
        assert!(complete);
        assert_eq!(reader.feed("0.00.041.000 I common_memory_breakdown_print: |   - Host | 1 = 1 + 0 + 0 |"), Ok(true));
        assert_eq!(reader.projection(&buffers()).expect("a projection").host().model, 98 * MIB);
    }

    #[test]
    fn output_without_a_table_is_incomplete_and_projects_nothing() {
        let (reader, complete) =
            read("0.00.010.000 E llama_model_load: error loading model: bad magic\n").expect("read");
        assert!(!complete);
        assert_eq!(reader.projection(&[]), Err(ParseError::NoHost));
        assert!(reader.report.failure_message().is_some_and(|m| m.contains("bad magic")));
    }

    #[test]
    fn malformed_rows_are_errors_naming_the_problem() {
        let row = |label: &str, figures: &str| format!("I common_memory_breakdown_print: | {label} | {figures} |");
        let device = |figures: &str| row("- RPC0 (a:1)", figures);
        for (line, expected) in [
            (device("1 = 1 + ( 1 = 1 + 0 + 0 )"), ParseError::Fields { line: 1, fields: 6 }),
            (
                device("1 = 1 + ( 1 = x + 0 + 0 ) + 0"),
                ParseError::BadNumber { line: 1, field: "model", text: "x".into() },
            ),
            (
                device("1 = 1 + ( 1 = -1 + 0 + 0 ) + 0"),
                ParseError::BadNumber { line: 1, field: "model", text: "-1".into() },
            ),
            (
                device("1 = 1 + ( 1 = 1 + 99999999999999 + 0 ) + 0"),
                ParseError::TooLarge { line: 1, field: "context", text: "99999999999999".into() },
            ),
            (
                row("- RPC<0> (a:1)", "1 = 1 + ( 1 = 1 + 0 + 0 ) + 0"),
                ParseError::BadName { line: 1, name: "RPC<0>".into() },
            ),
            (row("- Host", "1 = 1 + 0"), ParseError::Fields { line: 1, fields: 3 }),
        ] {
            assert_eq!(read(&line).map(|(_, complete)| complete), Err(expected), "{line}");
        }
        let twice = format!("{}\n{}", device("1 = 1 + ( 1 = 1 + 0 + 0 ) + 0"), device("1 = 1 + ( 1 = 1 + 0 + 0 ) + 0"));
        assert_eq!(read(&twice).map(|(_, c)| c), Err(ParseError::Duplicate { line: 2, name: "RPC0".into() }));
        // Rows that are not the table's are not read: the header, other shapes.
        assert_eq!(read(&row("memory breakdown [MiB]", "total free")).map(|(_, c)| c), Ok(false));
        assert_eq!(read("I common_memory_breakdown_print: nothing").map(|(_, c)| c), Ok(false));
    }

    #[test]
    fn more_devices_than_llama_cpp_can_have_are_refused() {
        let rows: Vec<String> = (0..super::MAX_ROWS)
            .map(|i| format!("I common_memory_breakdown_print: | - RPC{i} (a:{i}) | 1 = 1 + ( 1 = 1 + 0 + 0 ) + 0 |"))
            .collect();
        let rows = rows.join("\n");
        assert_eq!(read(&rows).map(|(_, c)| c), Err(ParseError::TooManyRows));
    }
}
