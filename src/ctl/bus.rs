//! The connection to corrald on D-Bus, with every failure mapped to a [`CtlError`].

use zbus::proxy::CacheProperties;
use zbus::zvariant::OwnedObjectPath;

use super::error::CtlError;
use crate::dbus::proxy::{JobProxy, ManagerProxy, ModelProxy};

/// A connection to the system or session bus.
#[derive(Debug, Clone)]
pub struct Bus {
    connection: zbus::Connection,
    kind: &'static str,
}

impl Bus {
    /// Connects to the session bus when `session`, else to the system bus
    /// (`$DBUS_SYSTEM_BUS_ADDRESS`, else its standard socket).
    pub async fn connect(session: bool) -> Result<Self, CtlError> {
        let kind = if session { "session" } else { "system" };
        let connection = if session { zbus::Connection::session().await } else { zbus::Connection::system().await };
        let connection = connection.map_err(|e| CtlError::from_zbus(e, kind))?;
        Ok(Self { connection, kind })
    }

    /// The connection.
    pub fn connection(&self) -> &zbus::Connection {
        &self.connection
    }

    /// Maps a failure of a call on this bus.
    #[must_use]
    pub fn error(&self, error: zbus::Error) -> CtlError {
        CtlError::from_zbus(error, self.kind)
    }

    /// The manager. Properties are read fresh each time: a one-shot command gains nothing
    /// from a cache, and some properties are not signalled.
    pub async fn manager(&self) -> Result<ManagerProxy<'static>, CtlError> {
        ManagerProxy::builder(&self.connection)
            .cache_properties(CacheProperties::No)
            .build()
            .await
            .map_err(|e| self.error(e))
    }

    /// The model object at `path`.
    pub async fn model(&self, path: OwnedObjectPath) -> Result<ModelProxy<'static>, CtlError> {
        ModelProxy::builder(&self.connection)
            .path(path)
            .map_err(|e| self.error(e))?
            .cache_properties(CacheProperties::No)
            .build()
            .await
            .map_err(|e| self.error(e))
    }

    /// The job object at `path`.
    pub async fn job(&self, path: OwnedObjectPath) -> Result<JobProxy<'static>, CtlError> {
        JobProxy::builder(&self.connection)
            .path(path)
            .map_err(|e| self.error(e))?
            .cache_properties(CacheProperties::No)
            .build()
            .await
            .map_err(|e| self.error(e))
    }
}

/// Maps `zbus::Result<T>` to `Result<T, CtlError>` for a bus.
pub trait OrBus<T> {
    /// The value, or the failure mapped for `bus`.
    fn or_bus(self, bus: &Bus) -> Result<T, CtlError>;
}

impl<T> OrBus<T> for zbus::Result<T> {
    fn or_bus(self, bus: &Bus) -> Result<T, CtlError> {
        self.map_err(|e| bus.error(e))
    }
}
