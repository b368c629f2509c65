//! Why a load failed, as a class the edges map (HTTP statuses, D-Bus error names), taken
//! from the supervisor's own classification of the child's end.

use crate::supervisor::runner::{Failure, LoadError};

/// What kind of failure a load met.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureClass {
    /// Memory ran out: llama.cpp said so, or its projection shows the plan overfills a device.
    OutOfMemory,
    /// The model file is missing, corrupt or not one this llama-server reads.
    BadModel,
    /// The child made no progress for the load timeout.
    Timeout,
    /// The child died while loading (a signal, an abort, a lost RPC worker, an exit
    /// without a reason).
    Crashed,
    /// Anything else: it could not be started, its command line or socket was refused, it
    /// never answered healthy.
    Other,
}

impl FailureClass {
    /// A short name for logs and messages.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::OutOfMemory => "out of memory",
            Self::BadModel => "bad model",
            Self::Timeout => "timeout",
            Self::Crashed => "crashed",
            Self::Other => "other",
        }
    }
}

impl From<Failure> for FailureClass {
    fn from(failure: Failure) -> Self {
        match failure {
            Failure::OutOfMemory => Self::OutOfMemory,
            Failure::BadModelFile => Self::BadModel,
            Failure::Killed | Failure::Crashed => Self::Crashed,
            Failure::BindFailure | Failure::InvalidArgument => Self::Other,
        }
    }
}

impl From<&LoadError> for FailureClass {
    fn from(error: &LoadError) -> Self {
        match error {
            // A clean exit before ready has no failure class: it still ended unasked.
            LoadError::Exited(exit) => exit.failure.map_or(Self::Crashed, Self::from),
            LoadError::Stalled { .. } => Self::Timeout,
            LoadError::Spawn { .. } | LoadError::Cgroup(_) | LoadError::Unhealthy(_) => Self::Other,
        }
    }
}

/// A load that failed: its class and what happened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct LoadFailure {
    /// The kind of failure.
    pub class: FailureClass,
    /// What happened, for people.
    pub reason: String,
}

impl LoadFailure {
    /// A failure of `class`.
    #[must_use]
    pub fn new(class: FailureClass, reason: impl Into<String>) -> Self {
        Self { class, reason: reason.into() }
    }
}

impl From<LoadError> for LoadFailure {
    fn from(error: LoadError) -> Self {
        Self { class: FailureClass::from(&error), reason: error.to_string() }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;
    use std::process::ExitStatus;
    use std::time::Duration;

    use super::{FailureClass, LoadFailure};
    use crate::supervisor::runner::{Exit, Failure, LoadError};

    fn exited(failure: Option<Failure>) -> LoadError {
        LoadError::Exited(Exit {
            status: ExitStatus::from_raw(1 << 8),
            requested: false,
            failure,
            last_errors: vec!["the last line".into()],
        })
    }

    #[test]
    fn the_supervisors_classes_become_load_failure_classes() {
        for (error, class) in [
            (exited(Some(Failure::OutOfMemory)), FailureClass::OutOfMemory),
            (exited(Some(Failure::BadModelFile)), FailureClass::BadModel),
            (exited(Some(Failure::Killed)), FailureClass::Crashed),
            (exited(Some(Failure::Crashed)), FailureClass::Crashed),
            (exited(None), FailureClass::Crashed),
            (exited(Some(Failure::BindFailure)), FailureClass::Other),
            (exited(Some(Failure::InvalidArgument)), FailureClass::Other),
            (LoadError::Stalled { after: Duration::from_secs(5), last: None }, FailureClass::Timeout),
            (LoadError::Unhealthy("503".into()), FailureClass::Other),
            (
                LoadError::Spawn { program: "/x/llama-server".into(), source: std::io::Error::from_raw_os_error(2) },
                FailureClass::Other,
            ),
        ] {
            let message = error.to_string();
            let failure = LoadFailure::from(error);
            assert_eq!(failure.class, class, "{message}");
            assert_eq!(failure.reason, message, "the supervisor's message is kept");
        }
    }
}
