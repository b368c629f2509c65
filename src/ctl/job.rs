//! Following a job (pull, push, create, copy, delete) until it ends, with progress.

use std::io::Write;

use std::collections::HashMap;

use futures_util::StreamExt;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use zbus::zvariant::{OwnedObjectPath, OwnedValue};

use super::bus::{Bus, OrBus};
use super::error::CtlError;

/// How a job's progress is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// A bar for bytes transferred, and the status line beside it (a terminal).
    Bar,
    /// Each new status line on its own line (not a terminal).
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
        let mut view = View::new(progress);
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

/// What is on the screen.
struct View {
    progress: Progress,
    bar: Option<ProgressBar>,
    last_status: String,
}

impl View {
    fn new(progress: Progress) -> Self {
        let bar = (progress == Progress::Bar).then(|| {
            let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stdout());
            bar.set_style(
                ProgressStyle::with_template(
                    "{msg:<30!} {percent:>3}% [{bar:30}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} {eta}",
                )
                .expect("a valid template")
                .progress_chars("=> "),
            );
            bar
        });
        Self { progress, bar, last_status: String::new() }
    }

    fn status(&mut self, status: &str) {
        if status.is_empty() || status == self.last_status {
            return;
        }
        status.clone_into(&mut self.last_status);
        match (&self.bar, self.progress) {
            (Some(bar), _) => bar.set_message(status.to_owned()),
            (None, Progress::Lines) => {
                let _ = writeln!(std::io::stdout().lock(), "{status}");
            }
            (None, _) => {}
        }
    }

    /// Applies a `PropertiesChanged` of the job.
    fn changed(&mut self, changed: &HashMap<String, OwnedValue>) {
        if let Some(Ok(status)) = changed.get("Status").map(|v| <&str>::try_from(&**v)) {
            self.status(status);
        }
        if let Some(Ok(total)) = changed.get("Total").map(|v| u64::try_from(&**v)) {
            self.total(total);
        }
        if let Some(Ok(completed)) = changed.get("Completed").map(|v| u64::try_from(&**v)) {
            self.completed(completed);
        }
    }

    fn total(&self, total: u64) {
        if let Some(bar) = &self.bar {
            bar.set_length(total);
        }
    }

    fn completed(&self, completed: u64) {
        if let Some(bar) = &self.bar {
            bar.set_position(completed);
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }
}
