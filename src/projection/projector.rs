//! Running `llama-fit-params --fit-print on`: a bounded child with a clean environment,
//! and where to find the program.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};

use super::parse::{MAX_OUTPUT, ParseError, Projection};
use crate::config::RunnerConfig;
use crate::durations::human;
use crate::supervisor::logparse::{ErrorClass, LineSplitter, LoadReport};

/// The program's name beside llama-server.
pub const PROGRAM: &str = "llama-fit-params";

/// How long a killed projection may take to be reaped before it is left to the runtime.
const REAP_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest stderr line kept whole (longer ones are cut, as the supervisor's are).
const MAX_STDERR_LINE: usize = 4096;

/// Runs llama.cpp's `llama-fit-params` to ask what a load would take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Projector {
    /// The executable (see [`locate`]).
    pub program: PathBuf,
    /// How long one projection may take before it is killed.
    pub timeout: Duration,
}

/// Why a projection could not be had.  Each says which program, so the journal tells an
/// administrator what to fix; the scheduler then falls back to its estimate.
#[derive(Debug, thiserror::Error)]
pub enum ProjectionError {
    /// The program does not exist.
    #[error(
        "{} does not exist: install llama.cpp's llama-server and llama-fit-params, or name them in [runner] llama_server or [runner] llama_fit_params",
        .program.display()
    )]
    NotFound {
        /// The program.
        program: PathBuf,
    },
    /// The program exists but could not be started.
    #[error("cannot run {}: {source}", .program.display())]
    CannotRun {
        /// The program.
        program: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// It did not finish within the timeout, and was killed.
    #[error("{} did not finish within {} and was killed ([runner] projection_timeout)", .program.display(), human(*.after))]
    TimedOut {
        /// The program.
        program: PathBuf,
        /// The timeout.
        after: Duration,
    },
    /// It exited unsuccessfully.
    #[error(
        "{} failed ({status}): {}",
        .program.display(),
        .message.as_deref().unwrap_or("it printed no error line")
    )]
    Failed {
        /// The program.
        program: PathBuf,
        /// How it ended.
        status: ExitStatus,
        /// The class of its most telling error line, if it printed one.
        class: Option<ErrorClass>,
        /// That line (without timestamp and level).
        message: Option<String>,
    },
    /// It succeeded but printed something that is not a projection.
    #[error("{} printed no projection: {source}", .program.display())]
    Unreadable {
        /// The program.
        program: PathBuf,
        /// What is wrong with the output.
        source: ParseError,
    },
}

impl Projector {
    /// The projector `[runner]` names (see [`locate`]), with `[runner] projection_timeout`;
    /// `path` is the `PATH` to look bare names up on.
    pub fn from_config(runner: &RunnerConfig, path: Option<&OsStr>) -> Result<Self, Unavailable> {
        Ok(Self { program: locate(runner, path)?, timeout: runner.projection_timeout })
    }

    /// Runs the program with exactly `args` plus `--fit-print on`, the environment `env`
    /// and nothing else, stdin closed, in a process group of its own; reads at most
    /// [`MAX_OUTPUT`] bytes of stdout and stderr's error lines; kills the group at the
    /// timeout (and the program when the future is dropped).
    ///
    /// `args` are llama-server's model-shaping flags (`-m`, `-c`, `-np`, `-ngl`, `-ts`,
    /// `--device`, `--rpc`, …) without its server-only ones, which llama-fit-params rejects.
    pub async fn project(
        &self,
        args: &[OsString],
        env: &[(OsString, OsString)],
    ) -> Result<Projection, ProjectionError> {
        let program = || self.program.clone();
        let mut child =
            spawn(&self.program, args, &[OsStr::new("--fit-print"), OsStr::new("on")], env, Stdio::piped())?;
        let pid = child.id();
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let started = std::time::Instant::now();
        let run = async { tokio::join!(read_capped(stdout), read_errors(stderr), child.wait()) };
        let Ok((out, report, status)) = tokio::time::timeout(self.timeout, run).await else {
            // The group outlives a reaped leader only while a member (holding the pipes) is
            // alive, so its id cannot have been reused.
            kill_group(pid);
            let _ = child.start_kill();
            let _ = reap(&mut child).await;
            return Err(ProjectionError::TimedOut { program: program(), after: self.timeout });
        };
        let status = status.map_err(|source| ProjectionError::CannotRun { program: program(), source })?;
        if !status.success() {
            return Err(ProjectionError::Failed {
                program: program(),
                status,
                class: report.failure_class(),
                message: failure_message(&report),
            });
        }
        let (out, complete) = out;
        if !complete {
            return Err(ProjectionError::Unreadable { program: program(), source: ParseError::TooLong });
        }
        let projection =
            Projection::parse(&out).map_err(|source| ProjectionError::Unreadable { program: program(), source })?;
        tracing::debug!(
            devices = projection.devices().len(),
            host = projection.host_total(),
            "llama-fit-params projected in {}",
            human(started.elapsed())
        );
        Ok(projection)
    }
}

/// Starts a projection's program with `args` then `extra`, exactly the environment `env`,
/// stdin closed, stderr piped (stdout as `stdout` says), in a process group of its own,
/// and killed when dropped.
pub(super) fn spawn(
    program: &Path,
    args: &[OsString],
    extra: &[&OsStr],
    env: &[(OsString, OsString)],
    stdout: Stdio,
) -> Result<tokio::process::Child, ProjectionError> {
    tokio::process::Command::new(program)
        .args(args)
        .args(extra)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| match source.kind() {
            std::io::ErrorKind::NotFound => ProjectionError::NotFound { program: program.to_owned() },
            _ => ProjectionError::CannotRun { program: program.to_owned(), source },
        })
}

/// The error line that says most: the first of the most telling class, or when none is
/// classified, the last one (after an uncaught exception, `what(): …` rather than
/// `terminate called …`; llama.cpp's own error lines may be lost in an abort, since its
/// log is written by a thread of its own).
pub(super) fn failure_message(report: &LoadReport) -> Option<String> {
    let message = match report.failure_class() {
        Some(ErrorClass::Other) => report.errors().last().map(|line| line.message.as_str()),
        _ => report.failure_message(),
    };
    message.map(|m| m.trim().to_owned())
}

/// Waits at most [`REAP_TIMEOUT`] for a killed projection to be reaped; `None` when it
/// was not (it is then left to the runtime).
pub(super) async fn reap(child: &mut tokio::process::Child) -> Option<ExitStatus> {
    tokio::time::timeout(REAP_TIMEOUT, child.wait()).await.ok().and_then(Result::ok)
}

/// SIGKILL to the projection's process group (a crashing llama.cpp may have started a
/// debugger to print its backtrace).
pub(super) fn kill_group(pid: Option<u32>) {
    if let Some(pid) = pid.and_then(|pid| i32::try_from(pid).ok()) {
        // ESRCH: the group is gone already.
        let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
    }
}

/// Reads a pipe to its end, keeping at most one byte more than [`MAX_OUTPUT`]; the rest is
/// read and dropped so that the writer never blocks.  Returns the bytes and whether they are
/// all of it.
async fn read_capped(pipe: Option<impl AsyncRead + Unpin>) -> (Vec<u8>, bool) {
    let mut kept = Vec::new();
    let Some(mut pipe) = pipe else { return (kept, true) };
    let mut chunk = vec![0_u8; 8192];
    let mut complete = true;
    loop {
        match pipe.read(&mut chunk).await {
            Ok(0) | Err(_) => return (kept, complete),
            Ok(n) => {
                let room = MAX_OUTPUT.saturating_sub(kept.len());
                if n > room {
                    complete = false;
                }
                kept.extend_from_slice(&chunk[..n.min(room)]);
            }
        }
    }
}

/// Reads stderr to its end through llama-server's log parser, which keeps only the error
/// lines (a bounded number) and their class.
async fn read_errors(pipe: Option<impl AsyncRead + Unpin>) -> LoadReport {
    let mut report = LoadReport::new();
    let Some(mut pipe) = pipe else { return report };
    let mut splitter = LineSplitter::with_max_line(MAX_STDERR_LINE);
    let mut chunk = vec![0_u8; 8192];
    loop {
        match pipe.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                for line in splitter.push(&chunk[..n]) {
                    report.feed(&line);
                }
            }
        }
    }
    if let Some(line) = splitter.finish() {
        report.feed(&line);
    }
    report
}

/// Why there is no projector: the scheduler then plans with its estimate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unavailable {
    /// `[runner] llama_fit_params` names something that cannot run.
    #[error(
        "[runner] llama_fit_params: {} {why}; memory projections are unavailable and loads are planned \
         with corral's estimate",
        .path.display()
    )]
    Configured {
        /// The configured path (or the name looked up).
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// No usable `llama-fit-params` beside `[runner] llama_server`.
    #[error(
        "llama-fit-params is not beside [runner] llama_server ({} {why}); memory projections are unavailable \
         and loads are planned with corral's estimate: install it there or set [runner] llama_fit_params",
        .path.display()
    )]
    NotBeside {
        /// Where it was looked for.
        path: PathBuf,
        /// What is wrong there.
        why: String,
    },
    /// llama-server itself is not found, so neither is its neighbour.
    #[error(
        "[runner] llama_server \"{}\" {why}, so llama-fit-params is not found beside it; memory projections are \
         unavailable and loads are planned with corral's estimate: set [runner] llama_fit_params",
        .name.display()
    )]
    NoLlamaServer {
        /// The configured name or path.
        name: PathBuf,
        /// What is wrong with it.
        why: String,
    },
}

/// Where `llama-fit-params` is: `[runner] llama_fit_params` when set (a bare name looked
/// up on `path`), else `llama-fit-params` in the directory of `[runner] llama_server`
/// (itself looked up on `path` when a bare name).  The file must exist and be executable.
pub fn locate(runner: &RunnerConfig, path: Option<&OsStr>) -> Result<PathBuf, Unavailable> {
    if let Some(configured) = &runner.llama_fit_params {
        return resolve(configured, path).map_err(|why| Unavailable::Configured { path: configured.clone(), why });
    }
    let server = resolve(&runner.llama_server, path)
        .map_err(|why| Unavailable::NoLlamaServer { name: runner.llama_server.clone(), why })?;
    let beside = server.parent().unwrap_or_else(|| Path::new(".")).join(PROGRAM);
    crate::program::executable(&beside).map_err(|why| Unavailable::NotBeside { path: beside.clone(), why })?;
    Ok(beside)
}

/// Checks at start where llama-fit-params is: found, at debug; missing, a warning that
/// says the estimate will be used and which key to set.  Never an error: corrald runs
/// without projections.
pub fn log_availability(runner: &RunnerConfig, path: Option<&OsStr>) -> Option<PathBuf> {
    match locate(runner, path) {
        Ok(found) => {
            tracing::debug!(llama_fit_params = %found.display(), "memory projections by {}", found.display());
            Some(found)
        }
        Err(e) => {
            tracing::warn!(error = %e, "{e}");
            None
        }
    }
}

/// A path as given, or a bare name looked up on `path`.
fn resolve(program: &Path, path: Option<&OsStr>) -> Result<PathBuf, String> {
    crate::program::locate(program, path.unwrap_or_default()).map_err(|problem| match problem {
        crate::program::NotRunnable::NotOnPath => "is not found on PATH".to_owned(),
        crate::program::NotRunnable::Unusable(why) => why,
    })
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;
    use std::path::{Path, PathBuf};

    use super::{Unavailable, locate};
    use crate::config::RunnerConfig;

    fn script(dir: &Path, name: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, "#!/bin/sh\n").expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        path
    }

    #[test]
    fn the_projector_is_found_beside_llama_server_or_where_the_configuration_says() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bin = dir.path().join("bin");
        std::fs::create_dir(&bin).expect("mkdir");
        let server = script(&bin, "llama-server");
        let runner = |server: &Path, fit: Option<&Path>| RunnerConfig {
            llama_server: server.to_owned(),
            llama_fit_params: fit.map(Path::to_owned),
            ..RunnerConfig::default()
        };
        let path = Some(bin.as_os_str());

        // Beside llama-server: missing, then there.
        let err = locate(&runner(&server, None), path).expect_err("missing");
        assert!(matches!(&err, Unavailable::NotBeside { path, .. } if *path == bin.join("llama-fit-params")));
        let text = err.to_string();
        assert!(text.contains("does not exist") && text.contains("[runner] llama_fit_params"), "{text}");
        let fit = script(&bin, "llama-fit-params");
        assert_eq!(locate(&runner(&server, None), path), Ok(fit.clone()));
        // A bare llama-server name is looked up on PATH first.
        assert_eq!(locate(&runner(Path::new("llama-server"), None), path), Ok(fit.clone()));
        let err = locate(&runner(Path::new("llama-server"), None), Some(dir.path().as_os_str())).expect_err("none");
        assert!(err.to_string().starts_with("[runner] llama_server \"llama-server\" is not found on PATH"), "{err}");
        let gone = dir.path().join("gone/llama-server");
        let err = locate(&runner(&gone, None), path).expect_err("no llama-server");
        assert!(err.to_string().contains("llama-server\" does not exist, so llama-fit-params"), "{err}");

        // Configured: used as is (a bare name on PATH), and checked.
        let other = script(dir.path(), "fit-elsewhere");
        assert_eq!(locate(&runner(&server, Some(&other)), path), Ok(other));
        assert_eq!(locate(&runner(&server, Some(Path::new("llama-fit-params"))), path), Ok(fit.clone()));
        let err = locate(&runner(&server, Some(&dir.path().join("nope"))), path).expect_err("missing");
        assert!(err.to_string().starts_with("[runner] llama_fit_params: "), "{err}");
        assert!(err.to_string().contains("nope does not exist"), "{err}");
        std::fs::set_permissions(&fit, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let err = locate(&runner(&server, Some(&fit)), path).expect_err("not executable");
        assert!(err.to_string().contains("is not executable"), "{err}");
        let err = locate(&runner(&server, Some(&bin)), path).expect_err("a directory");
        assert!(err.to_string().contains("is not a file"), "{err}");
    }
}
