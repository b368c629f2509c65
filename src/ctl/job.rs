//! Following a job (pull, push, create, copy, delete) until it ends, with progress.

use std::io::Write;

use futures_util::StreamExt;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use zbus::zvariant::OwnedObjectPath;

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

/// Follows the job at `path` until it ends, showing progress as `progress` says.
///
/// The signal streams are subscribed to before the job's state is first read, so that an
/// end between the call that started it and this one is never missed.
pub async fn follow(bus: &Bus, path: OwnedObjectPath, progress: Progress) -> Result<Outcome, CtlError> {
    let job = bus.job(path.clone()).await?;
    let mut finished = job.receive_finished().await.or_bus(bus)?;
    let properties = zbus::fdo::PropertiesProxy::builder(bus.connection())
        .destination(crate::dbus::BUS_NAME)
        .and_then(|b| b.path(path.clone()))
        .or_bus(bus)?
        .cache_properties(zbus::proxy::CacheProperties::No)
        .build()
        .await
        .or_bus(bus)?;
    let mut changes = properties.receive_properties_changed().await.or_bus(bus)?;

    let kind = job.kind().await.or_bus(bus)?;
    let model = job.model().await.or_bus(bus)?;
    let mut view = View::new(progress);
    view.status(&job.status().await.or_bus(bus)?);
    view.total(job.total().await.or_bus(bus)?);
    view.completed(job.completed().await.or_bus(bus)?);

    if job.state().await.or_bus(bus)? == "running" {
        loop {
            tokio::select! {
                end = finished.next() => {
                    if end.is_none() {
                        return Err(CtlError::Bus("the connection to the bus closed while following the job".into()));
                    }
                    break;
                }
                Some(change) = changes.next() => {
                    if let Ok(args) = change.args() {
                        view.changed(&args.changed_properties);
                    }
                }
            }
        }
    }
    // The final values, rather than the signal's: one read answers both cases above.
    let state = job.state().await.or_bus(bus)?;
    let error = job.error().await.or_bus(bus)?;
    view.status(&job.status().await.or_bus(bus)?);
    view.finish();
    Ok(Outcome { job: path.to_string(), kind, model, state, error })
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
    fn changed(&mut self, changed: &std::collections::HashMap<&str, zbus::zvariant::Value<'_>>) {
        if let Some(Ok(status)) = changed.get("Status").map(<&str>::try_from) {
            self.status(status);
        }
        if let Some(Ok(total)) = changed.get("Total").map(u64::try_from) {
            self.total(total);
        }
        if let Some(Ok(completed)) = changed.get("Completed").map(u64::try_from) {
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
