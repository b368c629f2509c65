//! A child's stderr, read and parsed on a thread of its own.
//!
//! llama-server writes each log line in three `write`s, unbuffered, and at `-lv 4` (which
//! the load report needs) about 20 lines per request. Read as it arrives, that is dozens
//! of wake-ups of the daemon per request, right when the answer is on its way. So once
//! the runner is ready, the reader reads what has gathered at most every [`SETTLED_PAUSE`]:
//! a sleeping thread is not woken by each write, and the lines reach the journal a moment
//! later, in order. While loading it reads at once, since readiness is decided on its
//! lines.
//!
//! A full pipe blocks llama-server's logging and slows its answers (at 2 000 tiny requests
//! a second it writes about 4 MB/s): batching needs the pipe enlarged to `PIPE_SIZE`,
//! 115 KB being 25 ms of that rate. Where the kernel refuses (`fs.pipe-max-size`,
//! or the user's pipe pages used up), the reader reads eagerly instead.

use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nix::unistd::Pid;
use tokio::sync::{mpsc, oneshot, watch};

use super::logparse::{LineSplitter, LoadReport, ParsedLine, Priorities};
use crate::sync::lock;
use crate::systemd::{JournalWriter, Priority};

/// Where a child's output goes besides the parser.
#[derive(Debug, Clone)]
pub enum LogSink {
    /// journald, one entry per line with `SYSLOG_IDENTIFIER=llama-server`.
    Journal(Arc<JournalWriter>),
    /// The daemon's own log (stderr when not under systemd).
    Tracing,
}

/// How long the reader of a ready runner's log waits between reads.
pub const SETTLED_PAUSE: Duration = Duration::from_millis(25);

/// The pipe size that batching needs: Linux's default `fs.pipe-max-size`.
const PIPE_SIZE: i32 = 1 << 20;

/// What the reader tells the child's watcher, each once, in this order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Milestone {
    /// The `listening` line.
    Listening,
    /// The task loop runs too (`all slots are idle`).
    TaskLoop,
}

/// The watcher's side of a child's log reader.
#[derive(Debug)]
pub struct ChildLog {
    report: Arc<Mutex<LoadReport>>,
    settled: Arc<AtomicBool>,
    milestones: mpsc::UnboundedReceiver<Milestone>,
    ended: oneshot::Receiver<()>,
    /// The reading thread, to wake from its pause.
    reader: std::thread::Thread,
}

impl ChildLog {
    /// Starts reading `pipe` on a new thread: every line is parsed into the report and
    /// forwarded to `sink`; `progress` gets the time of each read.
    ///
    /// # Errors
    /// The thread could not be started.
    pub fn start(
        pipe: std::fs::File,
        sink: LogSink,
        model: String,
        pid: Pid,
        progress: watch::Sender<Instant>,
    ) -> std::io::Result<Self> {
        let enlarged = nix::fcntl::fcntl(&pipe, nix::fcntl::FcntlArg::F_SETPIPE_SZ(PIPE_SIZE)).is_ok();
        let pause = if enlarged { SETTLED_PAUSE } else { Duration::ZERO };
        Self::start_pausing(pipe, sink, model, pid, progress, pause)
    }

    /// [`ChildLog::start`] with the pause between reads once settled.
    fn start_pausing(
        pipe: std::fs::File,
        sink: LogSink,
        model: String,
        pid: Pid,
        progress: watch::Sender<Instant>,
        pause: Duration,
    ) -> std::io::Result<Self> {
        let report = Arc::new(Mutex::new(LoadReport::new()));
        let settled = Arc::new(AtomicBool::new(false));
        let (milestone_tx, milestones) = mpsc::unbounded_channel();
        let (ended_tx, ended) = oneshot::channel();
        let reader = Reader {
            pause,
            report: Arc::clone(&report),
            settled: Arc::clone(&settled),
            milestones: milestone_tx,
            sink,
            model,
            pid,
            progress,
        };
        let thread = std::thread::Builder::new().name(format!("log-{pid}")).spawn(move || {
            reader.run(pipe);
            drop(ended_tx);
        })?;
        Ok(Self { report, settled, milestones, ended, reader: thread.thread().clone() })
    }

    /// The next milestone; `None` once the reader ended.
    pub async fn milestone(&mut self) -> Option<Milestone> {
        self.milestones.recv().await
    }

    /// The report so far.
    pub fn report(&self) -> MutexGuard<'_, LoadReport> {
        lock(&self.report)
    }

    /// The runner is ready (or failed to be): from now on, read in batches.
    pub fn settle(&self) {
        self.settled.store(true, Ordering::Relaxed);
    }

    /// Ends the reader's pauses and waits up to `limit` for it to reach the end of the
    /// output (every holder of the pipe closed it); returns the report. A grandchild that
    /// keeps the pipe open does not hold this up; the reader then ends when the runner's
    /// group is killed.
    pub async fn finish(&mut self, limit: Duration) -> LoadReport {
        // The child is gone: its last lines are read at once, not after a pause.
        self.settled.store(false, Ordering::Relaxed);
        self.reader.unpark();
        let _ = tokio::time::timeout(limit, &mut self.ended).await;
        self.report().clone()
    }
}

/// The thread's side.
struct Reader {
    /// The wait between reads once settled.
    pause: Duration,
    report: Arc<Mutex<LoadReport>>,
    settled: Arc<AtomicBool>,
    milestones: mpsc::UnboundedSender<Milestone>,
    sink: LogSink,
    model: String,
    pid: Pid,
    progress: watch::Sender<Instant>,
}

impl Reader {
    fn run(self, mut pipe: std::fs::File) {
        let mut splitter = LineSplitter::new();
        let mut buf = vec![0u8; 64 * 1024];
        let (mut listening, mut task_loop) = (false, false);
        let mut priorities = Priorities::default();
        loop {
            let (lines, end) = match pipe.read(&mut buf) {
                Ok(0) => (splitter.finish().into_iter().collect(), true),
                Ok(n) => (splitter.push(&buf[..n]), false),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => (splitter.finish().into_iter().collect(), true),
            };
            self.progress.send_replace(Instant::now());
            for line in &lines {
                let parsed = {
                    let mut report = lock(&self.report);
                    let parsed = report.feed(line);
                    if !listening && report.listening().is_some() {
                        listening = true;
                        let _ = self.milestones.send(Milestone::Listening);
                    }
                    if listening && !task_loop && report.task_loop_running() {
                        task_loop = true;
                        let _ = self.milestones.send(Milestone::TaskLoop);
                    }
                    parsed
                };
                let priority = priorities.of(&parsed);
                forward(&self.sink, &self.model, self.pid, &parsed, priority);
            }
            if end {
                return;
            }
            if !self.pause.is_zero() && self.settled.load(Ordering::Relaxed) {
                // Woken early by `finish` (or spuriously: then it just reads sooner).
                std::thread::park_timeout(self.pause);
            }
        }
    }
}

/// One line to the journal (or to stderr through tracing), at `priority`.
fn forward(sink: &LogSink, model: &str, pid: Pid, line: &ParsedLine<'_>, priority: u8) {
    match sink {
        LogSink::Journal(journal) => {
            let priority = match priority {
                0..=3 => Priority::Error,
                4 => Priority::Warning,
                5 => Priority::Notice,
                6 => Priority::Info,
                _ => Priority::Debug,
            };
            let pid = pid.as_raw().to_string();
            // journald sets _PID from the socket's credentials, corrald's: no unprivileged
            // sender can set another. SYSLOG_PID carries the child's, as syslog(3) senders
            // do, and CORRAL_RUNNER_PID as on corrald's own entries about the runner.
            let fields = [
                ("SYSLOG_IDENTIFIER", "llama-server"),
                ("SYSLOG_PID", &pid),
                ("CORRAL_MODEL", model),
                ("CORRAL_RUNNER_PID", &pid),
            ];
            if let Err(e) = journal.send(priority, &line.message, &fields) {
                tracing::debug!(error = %e, "cannot forward a llama-server line to the journal");
            }
        }
        LogSink::Tracing => {
            // `pid`, not CORRAL_RUNNER_PID: on stderr only corrald's own events carry that.
            let (model, pid, message) = (model, pid.as_raw(), &line.message);
            match priority {
                0..=3 => tracing::error!(target: "llama-server", corral_model = model, pid, "{message}"),
                4 => tracing::warn!(target: "llama-server", corral_model = model, pid, "{message}"),
                // Info lines are many at -lv 4: they go to the journal, or to stderr at debug level.
                _ => tracing::debug!(target: "llama-server", corral_model = model, pid, "{message}"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;
    use crate::supervisor::logparse::MAX_ERROR_LINES;

    fn start() -> (ChildLog, std::fs::File, watch::Receiver<Instant>) {
        let (reader, writer) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).expect("pipe");
        let (reader, writer) = (std::fs::File::from(reader), std::fs::File::from(writer));
        let (progress, progress_rx) = watch::channel(Instant::now());
        let log = ChildLog::start(reader, LogSink::Tracing, "tiny".into(), Pid::from_raw(1), progress).expect("start");
        (log, writer, progress_rx)
    }

    async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
        tokio::time::timeout(Duration::from_secs(10), future).await.unwrap_or_else(|_| panic!("no {what} within 10 s"))
    }

    #[tokio::test]
    async fn milestones_come_in_order_as_the_lines_arrive() {
        let (mut log, mut writer, mut progress) = start();
        writer.write_all(b"0.00.100.000 I srv  llama_server: loading model\n").expect("write");
        within("progress", progress.changed()).await.expect("a read is progress");
        writer.write_all(b"0.00.200.000 I srv  llama_server: listening on unix:///run/x.sock\n").expect("write");
        assert_eq!(within("milestone", log.milestone()).await, Some(Milestone::Listening));
        writer.write_all(b"0.00.200.010 I srv  update_slots: all slots are idle\n").expect("write");
        assert_eq!(within("milestone", log.milestone()).await, Some(Milestone::TaskLoop));
        assert!(log.report().task_loop_running());
        // The idle line again after each request is no milestone.
        writer.write_all(b"0.00.300.000 I srv  update_slots: all slots are idle\n").expect("write");
        drop(writer);
        assert_eq!(within("the end", log.milestone()).await, None, "the reader ends at the end of the output");
    }

    #[tokio::test]
    async fn a_settled_reader_keeps_every_line_in_order() {
        let (mut log, writer, _progress) = start();
        log.settle();
        // More than the default 64 KiB pipe holds, written while the reader sleeps.
        let writing = std::thread::spawn(move || {
            let mut writer = writer;
            for i in 0..20_000 {
                writeln!(writer, "0.01.000.000 E srv    operator(): error {i:05}").expect("write");
            }
        });
        let report = log.finish(Duration::from_secs(10)).await;
        writing.join().expect("the writer");
        let errors: Vec<&str> = report.errors().map(|e| e.message.as_str()).collect();
        let expected: Vec<String> =
            (20_000 - MAX_ERROR_LINES..20_000).map(|i| format!("srv    operator(): error {i:05}")).collect();
        assert_eq!(errors, expected);
    }

    #[tokio::test]
    async fn finish_ends_the_pause_so_the_last_lines_are_read_at_once() {
        let (reader, writer) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).expect("pipe");
        let mut writer = std::fs::File::from(writer);
        let (progress, _progress) = watch::channel(Instant::now());
        let hour = Duration::from_secs(3600);
        let mut log =
            ChildLog::start_pausing(reader.into(), LogSink::Tracing, "tiny".into(), Pid::from_raw(1), progress, hour)
                .expect("start");
        log.settle();
        writer.write_all(b"0.01.000.000 E srv    operator(): first\n").expect("write");
        // Once it read the first line the reader pauses for an hour.
        within("the first line", async {
            while log.report().errors().count() == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await;
        writer.write_all(b"0.01.000.001 E srv    operator(): last\n").expect("write");
        drop(writer);
        let report = log.finish(Duration::from_secs(5)).await;
        let errors: Vec<&str> = report.errors().map(|e| e.message.as_str()).collect();
        assert_eq!(errors, ["srv    operator(): first", "srv    operator(): last"]);
    }

    #[tokio::test]
    async fn the_pipe_is_enlarged_so_a_sleeping_reader_does_not_block_the_child() {
        let (_log, writer, _progress) = start();
        let size = nix::fcntl::fcntl(&writer, nix::fcntl::FcntlArg::F_GETPIPE_SZ).expect("F_GETPIPE_SZ");
        assert_eq!(size, PIPE_SIZE);
    }
}
