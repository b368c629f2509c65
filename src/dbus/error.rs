//! The named errors of `org.corral.Corral1`, and how core errors map onto them.
//!
//! Only here do scheduler, store and registry errors become D-Bus error names; each
//! carries the core error's message, which says what to do, without the server's paths
//! (`crate::redact`; the journal gets the original).

use crate::scheduler::actor::ScheduleError;
use crate::scheduler::request::RequestError;
use crate::store::StoreError;
use crate::store::name::InvalidName;

/// An error reply, named `org.corral.Corral1.Error.<Variant>`.
#[derive(Debug, zbus::DBusError)]
#[zbus(prefix = "org.corral.Corral1.Error")]
pub enum Error {
    /// A D-Bus failure of zbus itself.
    #[zbus(error)]
    ZBus(zbus::Error),
    /// The store has no model by that name.
    NoSuchModel(String),
    /// Nothing by that name is loaded.
    NotLoaded(String),
    /// The name is not a valid model name.
    InvalidName(String),
    /// An argument or option has the wrong type or value.
    InvalidArgument(String),
    /// The model does not fit, even after unloading what may be unloaded.
    InsufficientMemory(String),
    /// llama-server failed to load the model (or failed recently and is backing off).
    LoadFailed(String),
    /// Too many requests are waiting for models to load.
    Busy(String),
    /// The store is read-only (`[store] read_only`).
    ReadOnly(String),
    /// The daemon is stopping.
    ShuttingDown(String),
    /// Anything else, with what happened.
    Failed(String),
}

impl Error {
    /// A missing model named as the caller wrote it, not in its long form.
    #[must_use]
    pub fn naming(self, given: &str) -> Self {
        match self {
            Self::NoSuchModel(_) => Self::NoSuchModel(format!("model '{given}' not found")),
            other => other,
        }
    }
}

/// The message of an error on its way to a D-Bus client.
fn public(error: &impl std::fmt::Display) -> String {
    crate::redact::for_client(error.to_string(), "D-Bus")
}

impl From<ScheduleError> for Error {
    fn from(error: ScheduleError) -> Self {
        let message = public(&error);
        match error {
            ScheduleError::QueueFull(_) => Self::Busy(message),
            ScheduleError::InsufficientMemory { .. } => Self::InsufficientMemory(message),
            ScheduleError::LoadFailed { .. } | ScheduleError::BackingOff { .. } => Self::LoadFailed(message),
            ScheduleError::NotLoaded(_) => Self::NotLoaded(message),
            ScheduleError::ShuttingDown => Self::ShuttingDown(message),
        }
    }
}

impl From<StoreError> for Error {
    fn from(error: StoreError) -> Self {
        let message = public(&error);
        match error {
            StoreError::NotFound(name) => Self::NoSuchModel(format!("model '{name}' not found")),
            StoreError::Invalid(_) => Self::InvalidArgument(message),
            _ => Self::Failed(message),
        }
    }
}

impl From<RequestError> for Error {
    fn from(error: RequestError) -> Self {
        match error {
            RequestError::Store(e) => e.into(),
            e @ RequestError::InvalidOption { .. } => Self::InvalidArgument(public(&e)),
        }
    }
}

impl From<InvalidName> for Error {
    fn from(error: InvalidName) -> Self {
        Self::InvalidName(public(&error))
    }
}

#[cfg(test)]
mod tests {
    use super::Error;
    use crate::scheduler::actor::ScheduleError;
    use crate::store::StoreError;

    #[test]
    fn errors_reach_d_bus_clients_without_server_paths() {
        let io = StoreError::Io {
            context: "cannot write /var/lib/corral/models/blobs/.tmp-x1".into(),
            source: std::io::Error::from_raw_os_error(28),
        };
        let Error::Failed(message) = Error::from(io) else { panic!("an I/O failure is Failed") };
        assert!(message.starts_with("cannot write …/.tmp-x1: ") && !message.contains("/var/lib"), "{message}");

        let load = ScheduleError::LoadFailed {
            model: "chat".into(),
            reason: "cannot start /opt/llama/bin/llama-server: No such file or directory".into(),
        };
        let Error::LoadFailed(message) = Error::from(load) else { panic!("LoadFailed") };
        assert!(message.contains("…/llama-server") && !message.contains("/opt/llama"), "{message}");
    }
}
