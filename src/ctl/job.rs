//! Following a job (pull, push, create, copy, delete) until it ends, with progress.

use std::collections::HashMap;
use std::io::Write;
use std::time::Instant;

use futures_util::StreamExt;
use serde::Serialize;
use zbus::zvariant::{OwnedObjectPath, OwnedValue};

use super::bus::{Bus, OrBus};
use super::error::CtlError;

/// How a job's progress is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// On a terminal: each layer's line with its bar, drawn in place until it is done.
    Bar,
    /// Each step on its own line once, a layer's when it ends (not a terminal).
    Lines,
    /// Nothing (`--json`).
    Quiet,
}

/// How a job ended.
#[derive(Debug, Serialize)]
pub struct Outcome {
    /// The job's object path.
    pub job: String,
    /// pull, push, create, copy or delete.
    pub kind: String,
    /// The model as given.
    pub model: String,
    /// succeeded, failed or cancelled.
    pub state: String,
    /// What went wrong; empty on success.
    pub error: String,
}

impl Outcome {
    /// `Ok` when it succeeded, else the job's error.
    pub fn into_result(self) -> Result<Self, CtlError> {
        if self.state == "succeeded" {
            Ok(self)
        } else {
            let error = if self.error.is_empty() { self.state.clone() } else { self.error.clone() };
            Err(CtlError::JobFailed { kind: self.kind, model: self.model, error })
        }
    }
}

/// Signals held for a [`Watch`] before it reads them.
const QUEUE: usize = 4096;

/// The signals of every job, subscribed to before the call that starts one, so that no
/// progress line and no end is missed however quickly the job runs.
pub struct Watch {
    stream: zbus::MessageStream,
}

impl Watch {
    /// Subscribes to the signals under `/org/corral/Corral1/jobs`.
    pub async fn start(bus: &Bus) -> Result<Self, CtlError> {
        let rule = zbus::MatchRule::builder()
            .msg_type(zbus::message::Type::Signal)
            .path_namespace(crate::dbus::JOBS_PATH)
            .map(zbus::match_rule::Builder::build)
            .or_bus(bus)?;
        // Room for other jobs' signals while a call's reply is awaited and nothing reads
        // the stream (a full queue holds up the connection, replies included).
        let stream = zbus::MessageStream::for_match_rule(rule, bus.connection(), Some(QUEUE)).await.or_bus(bus)?;
        Ok(Self { stream })
    }

    /// Follows the job at `path` until it ends, showing progress as `progress` says.
    pub async fn follow(&mut self, bus: &Bus, path: OwnedObjectPath, progress: Progress) -> Result<Outcome, CtlError> {
        let mut view = View::new(progress, Sink::Stdout);
        while let Some(message) = self.stream.next().await {
            let message = message.or_bus(bus)?;
            let header = message.header();
            if header.path().is_none_or(|p| p.as_str() != path.as_str()) {
                continue;
            }
            match (
                header.interface().map(zbus::names::InterfaceName::as_str),
                header.member().map(zbus::names::MemberName::as_str),
            ) {
                (Some("org.freedesktop.DBus.Properties"), Some("PropertiesChanged")) => {
                    if let Ok((_, changed, _)) =
                        message.body().deserialize::<(String, HashMap<String, OwnedValue>, Vec<String>)>()
                    {
                        view.changed(&changed);
                    }
                }
                (Some("org.corral.Corral1.Job"), Some("Finished")) => {
                    // The job object stays after its end, for its result.
                    let job = bus.job(path.clone()).await?;
                    view.finish();
                    return Ok(Outcome {
                        job: path.to_string(),
                        kind: job.kind().await.or_bus(bus)?,
                        model: job.model().await.or_bus(bus)?,
                        state: job.state().await.or_bus(bus)?,
                        error: job.error().await.or_bus(bus)?,
                    });
                }
                _ => {}
            }
        }
        Err(CtlError::Bus("the connection to the bus closed while following the job".into()))
    }
}

/// Where progress is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sink {
    /// Standard output (`pull`, `push`, `create`).
    Stdout,
    /// Standard error (a pull before `run`, whose output is the reply).
    Stderr,
}

/// What is on the screen: like Ollama's, one line per step, each layer's transfer a line
/// with its own bar (drawn in place on a terminal, its last state kept), `success` last.
pub struct View {
    progress: Progress,
    sink: Sink,
    /// The job's current values, as its signals left them.
    status: String,
    total: u64,
    completed: u64,
    /// The step on the screen's last line, not yet ended with a newline (a terminal), or not
    /// yet printed (a layer, without one).
    open: Option<Line>,
}

/// One step of the job on the screen.
struct Line {
    status: String,
    /// Whether it is a layer's transfer, shown with its bytes.
    layer: bool,
    total: u64,
    completed: u64,
    /// When it began and how far it was then, for the rate.
    started: Instant,
    started_at: u64,
}

impl View {
    /// Nothing shown yet.
    #[must_use]
    pub fn new(progress: Progress, sink: Sink) -> Self {
        Self { progress, sink, status: String::new(), total: 0, completed: 0, open: None }
    }

    /// Shows the job's state: its step (or layer) and how far it got.
    pub fn set(&mut self, status: &str, total: u64, completed: u64) {
        status.clone_into(&mut self.status);
        self.total = total;
        self.completed = completed;
        self.update();
    }

    /// Applies a `PropertiesChanged` of the job.
    fn changed(&mut self, changed: &HashMap<String, OwnedValue>) {
        if let Some(Ok(status)) = changed.get("Status").map(|v| <&str>::try_from(&**v)) {
            status.clone_into(&mut self.status);
        }
        if let Some(Ok(total)) = changed.get("Total").map(|v| u64::try_from(&**v)) {
            self.total = total;
        }
        if let Some(Ok(completed)) = changed.get("Completed").map(|v| u64::try_from(&**v)) {
            self.completed = completed;
        }
        self.update();
    }

    fn update(&mut self) {
        if self.progress == Progress::Quiet || self.status.is_empty() {
            return;
        }
        if self.open.as_ref().is_some_and(|line| line.status == self.status) {
            if let Some(line) = &mut self.open {
                line.total = self.total;
                line.completed = self.completed;
                // A new step's first signal may still carry the previous step's count.
                line.started_at = line.started_at.min(self.completed);
            }
        } else {
            self.close();
            let layer = is_layer(&self.status);
            self.open = Some(Line {
                status: self.status.clone(),
                layer,
                total: self.total,
                completed: self.completed,
                started: Instant::now(),
                started_at: self.completed,
            });
            if !layer && self.progress == Progress::Lines {
                let status = self.status.clone();
                self.write(&format!("{status}\n"));
            }
        }
        if self.progress == Progress::Bar {
            if let Some(line) = &self.open {
                self.write(&format!("\r{}\x1b[K", line.render(terminal_width(self.sink), false)));
            }
        }
    }

    /// Ends the open line: on a terminal drawn as finished with its newline, without one
    /// a layer's line printed now that its end is known.
    fn close(&mut self) {
        let Some(line) = self.open.take() else { return };
        match self.progress {
            Progress::Bar => self.write(&format!("\r{}\x1b[K\n", line.render(terminal_width(self.sink), true))),
            Progress::Lines if line.layer => self.write(&format!("{}\n", line.render(0, true))),
            Progress::Lines | Progress::Quiet => {}
        }
    }

    /// Ends the last line.
    pub fn finish(&mut self) {
        self.close();
    }

    /// Writes and flushes at once; a closed pipe is not the job's failure.
    fn write(&self, text: &str) {
        let _ = match self.sink {
            Sink::Stdout => {
                let mut out = std::io::stdout().lock();
                out.write_all(text.as_bytes()).and_then(|()| out.flush())
            }
            Sink::Stderr => {
                let mut out = std::io::stderr().lock();
                out.write_all(text.as_bytes()).and_then(|()| out.flush())
            }
        };
    }
}

impl Line {
    /// `pulling 0123456789ab:  45% ▕███     ▏ 230 MiB/512 MiB  20 MiB/s  14s` while it runs,
    /// `pulling 0123456789ab: 100% ▕████████▏ 512 MiB` once `done`; a step is its status.
    /// `width` 0 leaves the bar out (not a terminal).
    fn render(&self, width: usize, done: bool) -> String {
        if !self.layer {
            return self.status.clone();
        }
        let fraction = if self.total == 0 {
            1.0
        } else {
            #[allow(clippy::cast_precision_loss)]
            let f = self.completed.min(self.total) as f64 / self.total as f64;
            f
        };
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let percent = (fraction * 100.0).floor() as u32;
        let prefix = format!("{}: {percent:>3}%", self.status);
        let running = (!(done || self.completed >= self.total)).then(|| {
            let elapsed = self.started.elapsed().as_secs_f64();
            let moved = self.completed.saturating_sub(self.started_at);
            #[allow(clippy::cast_precision_loss)]
            let rate = (elapsed >= 1.0 && moved > 0).then(|| moved as f64 / elapsed);
            rate.map_or_else(String::new, |rate| {
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                let per_second = rate as u64;
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
                let left = ((self.total - self.completed) as f64 / rate).ceil() as u64;
                format!("  {}/s  {}", size(per_second), eta(left))
            })
        });
        if width == 0 {
            return match running {
                None => format!("{prefix} {}", size(self.total)),
                Some(rate) => format!("{prefix} {}/{}{rate}", size(self.completed), size(self.total)),
            };
        }
        // As Ollama's: the part after the bar has one width, so that the bars line up.
        let suffix = match running {
            None => format!("{:>9}", size(self.total)),
            Some(rate) => format!("{:>9}/{:<9}{rate}", size(self.completed), size(self.total)),
        };
        let suffix = format!("{suffix:<SUFFIX$}");
        // Two edges and a space on each side of the bar.
        let room = width.saturating_sub(prefix.chars().count() + SUFFIX + 4).max(10);
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
        let full = ((room as f64) * fraction).floor() as usize;
        format!("{prefix} ▕{}{}▏ {suffix}", "█".repeat(full), " ".repeat(room - full))
    }
}

/// The width of what follows a bar: `  1.5 GiB/  2.0 GiB  100 MiB/s  1h59m`.
const SUFFIX: usize = 38;

/// Bytes as Ollama shows them in progress, in binary units: `19 B`, `1.5 GiB`, `512 MiB`.
fn size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    #[allow(clippy::cast_precision_loss)]
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 || value >= 10.0 {
        format!("{value:.0} {}", UNITS[unit])
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// Whether a status is a transfer, drawn with a bar: a layer's (`pulling` or `pushing`
/// and 12 hex digits) or a file's (`copying` and the 12 hex digits of an upload, or the
/// name of a file a create copies or `checking`: hashes to see whether the store has it).
fn is_layer(status: &str) -> bool {
    status.starts_with("copying ")
        || status.starts_with("checking ")
        || status
            .strip_prefix("pulling ")
            .or_else(|| status.strip_prefix("pushing "))
            .is_some_and(|hex| hex.len() == 12 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Seconds left as `42s`, `3m10s`, `2h5m`.
fn eta(seconds: u64) -> String {
    match seconds {
        0..60 => format!("{seconds}s"),
        60..3600 => format!("{}m{}s", seconds / 60, seconds % 60),
        _ => format!("{}h{}m", seconds / 3600, seconds / 60 % 60),
    }
}

/// The terminal's columns (80 when it does not say).
fn terminal_width(sink: Sink) -> usize {
    match sink {
        Sink::Stdout => rustix::termios::tcgetwinsize(std::io::stdout()),
        Sink::Stderr => rustix::termios::tcgetwinsize(std::io::stderr()),
    }
    .ok()
    .map(|size| usize::from(size.ws_col))
    .filter(|&columns| columns > 0)
    .unwrap_or(80)
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::{Line, eta, is_layer, size};

    fn line(status: &str, total: u64, completed: u64) -> Line {
        Line {
            status: status.into(),
            layer: is_layer(status),
            total,
            completed,
            started: Instant::now(),
            started_at: completed,
        }
    }

    #[test]
    fn layers_are_lines_with_their_own_bar_and_steps_are_plain() {
        assert!(is_layer("pulling 0123456789ab") && is_layer("pushing abcdefabcdef"));
        assert!(is_layer("copying 0123456789ab") && is_layer("copying model.gguf") && is_layer("checking model.gguf"));
        assert!(!is_layer("pulling manifest") && !is_layer("verifying sha256 digest") && !is_layer("success"));
        let done = line("pulling 0123456789ab", 512 << 20, 512 << 20).render(60, true);
        assert!(done.starts_with("pulling 0123456789ab: 100% ▕█"), "{done}");
        assert!(done.trim_end().ends_with("█▏   512 MiB"), "{done}");
        assert_eq!(done.chars().count(), 26 + 4 + 10 + 38, "at least 10 columns of bar: {done}");
        let half = line("pulling 0123456789ab", 100, 50).render(100, false);
        assert!(
            half.starts_with("pulling 0123456789ab:  50% ▕") && half.trim_end().ends_with("▏      50 B/100 B"),
            "{half}"
        );
        assert!(half.contains("█ ") && half.chars().count() == 100, "{half}");
        let full = line("pulling 0123456789ab", 100, 100).render(100, true);
        let edge = |text: &str| text.chars().position(|c| c == '▏');
        assert_eq!(edge(&full), edge(&half), "bars line up:\n{half}\n{full}");
        let plain = line("pushing 0123456789ab", 19, 19).render(0, true);
        assert_eq!(plain, "pushing 0123456789ab: 100% 19 B");
        assert_eq!(line("writing manifest", 0, 0).render(80, true), "writing manifest");
    }

    #[test]
    fn sizes_are_short() {
        assert_eq!(size(19), "19 B");
        assert_eq!(size(1536 << 20), "1.5 GiB");
        assert_eq!(size(512 << 20), "512 MiB");
        assert_eq!(size(5 << 40), "5.0 TiB");
    }

    #[test]
    fn times_left_are_short() {
        assert_eq!(eta(5), "5s");
        assert_eq!(eta(190), "3m10s");
        assert_eq!(eta(7500), "2h5m");
    }
}
