//! `org.corral.Corral1.Job`: pull, push, create, copy and delete, run in the background
//! and shown as objects at `/org/corral/Corral1/jobs/<n>` until 32 newer ones finished.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use zbus::object_server::SignalEmitter;
use zbus::zvariant::{ObjectPath, OwnedObjectPath};
use zbus::{Connection, interface};

use super::error::Error;
use super::manager::{Manager, blocking};
use super::{JOBS_PATH, ROOT_PATH, Shared, lock};
use crate::store::create::CreateSpec;
use crate::store::name::ModelName;
use crate::store::registry::{Progress, Registry};

/// Finished jobs kept for their results.
const KEEP_FINISHED: usize = 32;
/// The most PropertiesChanged per second for a job's progress.
const PROGRESS_INTERVAL: Duration = Duration::from_millis(200);

/// Job numbers and the finished jobs still shown.
#[derive(Debug, Default)]
pub(super) struct Jobs {
    next: u64,
    finished: VecDeque<OwnedObjectPath>,
    /// Every job object served, with its data (for the object tree).
    shown: Vec<(OwnedObjectPath, Arc<Mutex<JobData>>)>,
}

impl Jobs {
    /// The job objects served, with their data now.
    pub fn shown(&self) -> Vec<(OwnedObjectPath, JobData)> {
        self.shown.iter().map(|(path, data)| (path.clone(), lock(data).clone())).collect()
    }
}

/// What a job does.
pub(super) enum Work {
    Pull { name: ModelName, registry: Registry },
    Push { name: ModelName, registry: Registry },
    Create { name: ModelName, spec: Box<CreateSpec> },
    Copy { from: ModelName, to: ModelName },
    Delete { name: ModelName },
}

impl Work {
    fn kind(&self) -> &'static str {
        match self {
            Work::Pull { .. } => "pull",
            Work::Push { .. } => "push",
            Work::Create { .. } => "create",
            Work::Copy { .. } => "copy",
            Work::Delete { .. } => "delete",
        }
    }

    /// Only transfers stop half-way without harm: their partial downloads are resumable
    /// and they write the manifest last.
    fn cancellable(&self) -> bool {
        matches!(self, Work::Pull { .. } | Work::Push { .. })
    }
}

#[derive(Debug, Clone, Default)]
pub(super) struct JobData {
    pub kind: &'static str,
    pub model: String,
    pub state: &'static str,
    pub status: String,
    pub total: u64,
    pub completed: u64,
    pub error: String,
    /// The last state of each step that ended since the last report: reports are
    /// throttled, but a client still sees every step and how far it got.
    ended_steps: Vec<(String, u64, u64)>,
}

struct Job {
    data: Arc<Mutex<JobData>>,
    cancel: CancellationToken,
    cancellable: bool,
}

impl Job {
    fn get<T>(&self, read: impl FnOnce(&JobData) -> T) -> T {
        read(&lock(&self.data))
    }
}

#[interface(name = "org.corral.Corral1.Job")]
impl Job {
    /// Stops a running pull or push.
    fn cancel(&self) -> Result<(), Error> {
        let state = self.get(|d| d.state);
        if state != "running" {
            return Err(Error::Failed(format!("the job has already ended ({state})")));
        }
        if !self.cancellable {
            let kind = self.get(|d| d.kind);
            return Err(Error::Failed(format!("a {kind} job cannot be cancelled")));
        }
        self.cancel.cancel();
        Ok(())
    }

    /// The job ended.
    #[zbus(signal)]
    async fn finished(emitter: &SignalEmitter<'_>, success: bool, error: &str) -> zbus::Result<()>;

    #[zbus(property(emits_changed_signal = "const"))]
    fn kind(&self) -> String {
        self.get(|d| d.kind.to_owned())
    }

    #[zbus(property(emits_changed_signal = "const"))]
    fn model(&self) -> String {
        self.get(|d| d.model.clone())
    }

    #[zbus(property)]
    fn state(&self) -> String {
        self.get(|d| d.state.to_owned())
    }

    #[zbus(property)]
    fn status(&self) -> String {
        self.get(|d| d.status.clone())
    }

    #[zbus(property)]
    fn total(&self) -> u64 {
        self.get(|d| d.total)
    }

    #[zbus(property)]
    fn completed(&self) -> u64 {
        self.get(|d| d.completed)
    }

    #[zbus(property)]
    fn error(&self) -> String {
        self.get(|d| d.error.clone())
    }
}

/// Serves a new job object for `work` and starts it; returns its path at once.
pub(super) async fn start(
    shared: &Arc<Shared>,
    connection: &Connection,
    model: &str,
    work: Work,
) -> Result<OwnedObjectPath, Error> {
    reserve(shared)?;
    let number = {
        let mut jobs = lock(&shared.jobs);
        jobs.next += 1;
        jobs.next
    };
    let path = OwnedObjectPath::try_from(format!("{JOBS_PATH}/{number}")).expect("a valid path");
    let data = Arc::new(Mutex::new(JobData {
        kind: work.kind(),
        model: model.to_owned(),
        state: "running",
        ..JobData::default()
    }));
    let cancel = CancellationToken::new();
    let job = Job { data: Arc::clone(&data), cancel: cancel.clone(), cancellable: work.cancellable() };
    lock(&shared.jobs).shown.push((path.clone(), Arc::clone(&data)));
    if let Err(e) = connection.object_server().at(&path, job).await {
        lock(&shared.jobs).shown.retain(|(shown, _)| *shown != path);
        shared.jobs_running.fetch_sub(1, Ordering::Relaxed);
        return Err(e.into());
    }
    tokio::spawn(run(Arc::clone(shared), connection.clone(), path.clone(), data, cancel, work));
    Ok(path)
}

/// Counts a new job as running, unless `[dbus] max_jobs` are: each holds an object, a
/// task and (for a pull or push) connections to a registry until it ends, so a caller
/// starting jobs in a loop must not grow them without end. Refused rather than queued,
/// as an upload past `[server] max_uploads` is: the caller learns at once and retries
/// after a `JobFinished`.
fn reserve(shared: &Shared) -> Result<(), Error> {
    let max = shared.context.max_jobs;
    let room = |n: usize| (n < usize::try_from(max).unwrap_or(usize::MAX)).then_some(n + 1);
    shared.jobs_running.fetch_update(Ordering::Relaxed, Ordering::Relaxed, room).map(drop).map_err(|_| {
        Error::Busy(format!(
            "{max} store jobs are already running, the most [dbus] max_jobs allows; \
             start this one after a JobFinished signal"
        ))
    })
}

/// Runs the work, reports progress, then the outcome; retires old jobs.
async fn run(
    shared: Arc<Shared>,
    connection: Connection,
    path: OwnedObjectPath,
    data: Arc<Mutex<JobData>>,
    cancel: CancellationToken,
    work: Work,
) {
    let (changed_tx, changed_rx) = tokio::sync::watch::channel(());
    let reporter = tokio::spawn(report_progress(connection.clone(), path.clone(), changed_rx));
    let progress = {
        let data = Arc::clone(&data);
        move |p: Progress| {
            {
                let mut d = lock(&data);
                if d.status != p.status && !d.status.is_empty() {
                    let ended = (std::mem::take(&mut d.status), d.total, d.completed);
                    d.ended_steps.push(ended);
                }
                d.status = p.status;
                d.total = p.total.unwrap_or(0);
                d.completed = p.completed.unwrap_or(0);
            }
            let _ = changed_tx.send(());
        }
    };
    let outcome = tokio::select! {
        // The job's error is shown to D-Bus clients: without the server's paths.
        result = perform(&shared, work, progress) => result.map_err(|e| Some(crate::redact::for_client(e, "D-Bus job"))),
        () = cancel.cancelled() => Err(None),
    };
    // The reporter ends once the progress callback (the sender) is gone.
    let _ = reporter.await;
    let (state, error) = match &outcome {
        Ok(()) => ("succeeded", String::new()),
        Err(Some(e)) => ("failed", e.clone()),
        Err(None) => ("cancelled", "cancelled".to_owned()),
    };
    {
        let mut d = lock(&data);
        d.state = state;
        d.error.clone_from(&error);
        if outcome.is_ok() {
            d.status = "success".into();
        }
    }
    shared.jobs_running.fetch_sub(1, Ordering::Relaxed);
    if let Err(e) = announce(&connection, &path, outcome.is_ok(), &error).await {
        tracing::warn!(job = %path, error = %e, "cannot signal the end of a D-Bus job");
    }
    retire(&shared, &connection, path).await;
}

/// Emits the job's property changes, at most every [`PROGRESS_INTERVAL`], each step that
/// ended meanwhile first (with its last values), so that no step is lost to the throttle.
async fn report_progress(connection: Connection, path: OwnedObjectPath, changed: tokio::sync::watch::Receiver<()>) {
    throttled(changed, PROGRESS_INTERVAL, || report_now(&connection, &path)).await;
}

/// Calls `report` on the first change, then at most once per `interval` while changes
/// come, and once more when the sender is gone: at once, not after the rest of an
/// interval (the job's end waits for it).
async fn throttled<F: Future<Output = ()>>(
    mut changed: tokio::sync::watch::Receiver<()>,
    interval: Duration,
    mut report: impl FnMut() -> F,
) {
    let mut pending = false;
    'reports: loop {
        if !pending && changed.changed().await.is_err() {
            break;
        }
        pending = false;
        report().await;
        let pause = tokio::time::sleep(interval);
        tokio::pin!(pause);
        loop {
            tokio::select! {
                () = &mut pause => break,
                more = changed.changed() => {
                    if more.is_err() {
                        break 'reports;
                    }
                    pending = true;
                }
            }
        }
    }
    report().await;
}

async fn report_now(connection: &Connection, path: &OwnedObjectPath) {
    let Ok(iface) = connection.object_server().interface::<_, Job>(path).await else { return };
    let emitter = iface.signal_emitter();
    let job = iface.get().await;
    let ended = std::mem::take(&mut lock(&job.data).ended_steps);
    for (status, total, completed) in ended {
        let changed = std::collections::HashMap::from([
            ("Status", zbus::zvariant::Value::from(status)),
            ("Total", zbus::zvariant::Value::from(total)),
            ("Completed", zbus::zvariant::Value::from(completed)),
        ]);
        let interface = zbus::names::InterfaceName::from_static_str_unchecked("org.corral.Corral1.Job");
        let _ = zbus::fdo::Properties::properties_changed(emitter, interface, changed, std::borrow::Cow::Borrowed(&[]))
            .await;
    }
    let _ = job.status_changed(emitter).await;
    let _ = job.total_changed(emitter).await;
    let _ = job.completed_changed(emitter).await;
}

async fn announce(connection: &Connection, path: &OwnedObjectPath, success: bool, error: &str) -> zbus::Result<()> {
    let iface = connection.object_server().interface::<_, Job>(path).await?;
    let emitter = iface.signal_emitter();
    {
        let job = iface.get().await;
        job.status_changed(emitter).await?;
        job.total_changed(emitter).await?;
        job.completed_changed(emitter).await?;
        job.error_changed(emitter).await?;
        job.state_changed(emitter).await?;
    }
    Job::finished(emitter, success, error).await?;
    let manager = SignalEmitter::new(connection, ROOT_PATH)?;
    Manager::job_finished(&manager, ObjectPath::from(path), success, error).await
}

/// Keeps the newest finished jobs; removes the oldest beyond [`KEEP_FINISHED`].
async fn retire(shared: &Shared, connection: &Connection, path: OwnedObjectPath) {
    let expired: Vec<OwnedObjectPath> = {
        let mut jobs = lock(&shared.jobs);
        jobs.finished.push_back(path);
        let excess = jobs.finished.len().saturating_sub(KEEP_FINISHED);
        let expired: Vec<OwnedObjectPath> = jobs.finished.drain(..excess).collect();
        jobs.shown.retain(|(shown, _)| !expired.contains(shown));
        expired
    };
    for old in expired {
        let _ = connection.object_server().remove::<Job, _>(&old).await;
    }
}

/// Does the work; the error is the message the job shows.
async fn perform(shared: &Shared, work: Work, progress: impl FnMut(Progress) + Send + 'static) -> Result<(), String> {
    let store = shared.context.store.clone();
    match work {
        Work::Pull { name, registry } => {
            registry.pull(&store, &name, progress).await.map(drop).map_err(|e| e.to_string())
        }
        Work::Push { name, registry } => {
            registry.push(&store, &name, progress).await.map(drop).map_err(|e| e.to_string())
        }
        Work::Create { name, spec } => {
            let mut progress = progress;
            let result = blocking(move || store.create(&name, &spec, &mut progress).map(drop)).await;
            flatten(result)
        }
        Work::Copy { from, to } => flatten(blocking(move || store.copy(&from, &to)).await),
        Work::Delete { name } => {
            let short = name.to_string();
            flatten(blocking(move || store.delete(&name).map(drop)).await)?;
            // A deleted model does not stay loaded (its runners stop once their requests end).
            match shared.context.scheduler.unload_model(&short).await {
                Ok(()) | Err(crate::scheduler::types::ScheduleError::NotLoaded(_)) => Ok(()),
                Err(e) => Err(e.to_string()),
            }
        }
    }
}

fn flatten<E: std::fmt::Display>(result: Result<Result<(), E>, Error>) -> Result<(), String> {
    match result {
        Ok(inner) => inner.map_err(|e| e.to_string()),
        Err(e) => Err(format!("{e:?}")),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::throttled;

    const INTERVAL: Duration = Duration::from_millis(200);

    /// Runs `throttled` on a paused clock while `drive` sends changes; the reports made
    /// and how long (on the paused clock) the reporter outlived the sender.
    async fn run(drive: impl AsyncFnOnce(&tokio::sync::watch::Sender<()>)) -> (usize, Duration) {
        let (tx, rx) = tokio::sync::watch::channel(());
        let reports = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&reports);
        let reporter = tokio::spawn(throttled(rx, INTERVAL, move || {
            counted.fetch_add(1, Ordering::Relaxed);
            std::future::ready(())
        }));
        drive(&tx).await;
        let dropped = tokio::time::Instant::now();
        drop(tx);
        reporter.await.expect("the reporter");
        (reports.load(Ordering::Relaxed), dropped.elapsed())
    }

    #[tokio::test(start_paused = true)]
    async fn the_end_is_reported_at_once_not_after_the_throttle() {
        // One change, then the end within the throttle's pause.
        let (reports, late) = run(async |tx| tx.send(()).expect("send")).await;
        assert_eq!((reports, late), (2, Duration::ZERO), "the first change, then the end at once");
    }

    #[tokio::test(start_paused = true)]
    async fn changes_within_an_interval_make_one_report_and_none_is_lost() {
        let (reports, late) = run(async |tx| {
            for _ in 0..10 {
                tx.send(()).expect("send");
                tokio::time::sleep(INTERVAL / 10).await;
            }
            // Past the pause, with changes pending: they are reported then.
            tokio::time::sleep(INTERVAL * 2).await;
        })
        .await;
        // The first change, the nine during its pause once the pause ended, the end.
        assert_eq!((reports, late), (3, Duration::ZERO));
    }
}
