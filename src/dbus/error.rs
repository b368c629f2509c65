//! The named errors of `org.corral.Corral1`, and how core errors map onto them.
//!
//! Only here do scheduler, store and registry errors become D-Bus error names; each
//! carries the core error's message, which says what to do, without the server's paths
//! (`crate::redact`; the journal gets the original).
//!
//! A failed load is named by its class: out of memory is `InsufficientMemory` (as when
//! the scheduler refuses a model that cannot fit: the remedy is the same), a bad model
//! file `BadModel`, a load that made no progress `LoadTimeout`, and a crash or anything
//! else `LoadFailed` (as before classes existed).

use crate::scheduler::failure::FailureClass;
use crate::scheduler::request::RequestError;
use crate::scheduler::types::ScheduleError;
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
    /// The model does not fit, even after unloading what may be unloaded, or memory ran
    /// out while it loaded.
    InsufficientMemory(String),
    /// The model's file is missing, corrupt or not one llama-server reads.
    BadModel(String),
    /// llama-server made no progress loading the model for `[runner] load_timeout`.
    LoadTimeout(String),
    /// llama-server crashed or failed otherwise while loading the model (or failed
    /// recently and is backing off).
    LoadFailed(String),
    /// Too many requests are waiting for models to load, or `[dbus] max_jobs` store jobs
    /// are running.
    Busy(String),
    /// The store is read-only (`[store] read_only`).
    ReadOnly(String),
    /// The daemon is stopping.
    ShuttingDown(String),
    /// The reply would be larger than one message of the bus carries.
    LimitsExceeded(String),
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
            ScheduleError::QueueFull(_) | ScheduleError::TooManyNames { .. } => Self::Busy(message),
            ScheduleError::InsufficientMemory { .. } => Self::InsufficientMemory(message),
            ScheduleError::LoadFailed { class, .. } => match class {
                FailureClass::OutOfMemory => Self::InsufficientMemory(message),
                FailureClass::BadModel => Self::BadModel(message),
                FailureClass::Timeout => Self::LoadTimeout(message),
                FailureClass::Crashed | FailureClass::Other => Self::LoadFailed(message),
            },
            ScheduleError::BackingOff { .. } => Self::LoadFailed(message),
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
            // Weights corral's own reader refuses: a bad model, as when llama-server refuses them.
            RequestError::Store(e @ StoreError::Gguf { .. }) => Self::BadModel(public(&e)),
            RequestError::Store(e) => e.into(),
            e @ RequestError::InvalidOption { .. } => Self::InvalidArgument(public(&e)),
            // Here the keep-alive is one of the call's options: named as one.
            RequestError::KeepAlive(e) => Self::InvalidArgument(format!("option keep_alive: {}", public(&e))),
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
    use crate::scheduler::failure::FailureClass;
    use crate::scheduler::types::ScheduleError;
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
            class: FailureClass::Other,
            reason: "cannot start /opt/llama/bin/llama-server: No such file or directory".into(),
        };
        let Error::LoadFailed(message) = Error::from(load) else { panic!("LoadFailed") };
        assert!(message.contains("…/llama-server") && !message.contains("/opt/llama"), "{message}");
    }

    #[test]
    fn each_class_of_failed_load_has_its_error_name() {
        let named = |class| {
            let error = Error::from(ScheduleError::LoadFailed { model: "chat".into(), class, reason: "why".into() });
            let name = zbus::DBusError::name(&error).to_string();
            let message = zbus::DBusError::description(&error).unwrap_or_default().to_owned();
            (name, message)
        };
        for (class, name) in [
            (FailureClass::OutOfMemory, "org.corral.Corral1.Error.InsufficientMemory"),
            (FailureClass::BadModel, "org.corral.Corral1.Error.BadModel"),
            (FailureClass::Timeout, "org.corral.Corral1.Error.LoadTimeout"),
            (FailureClass::Crashed, "org.corral.Corral1.Error.LoadFailed"),
            (FailureClass::Other, "org.corral.Corral1.Error.LoadFailed"),
        ] {
            assert_eq!(named(class), (name.to_owned(), "model 'chat' failed to load: why".to_owned()), "{class:?}");
        }
    }
}
