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

    /// The manager. Its properties are read fresh each time: a command reads a few of them
    /// once, and some are not signalled.
    pub async fn manager(&self) -> Result<ManagerProxy<'static>, CtlError> {
        self.proxy(None, CacheProperties::No).await
    }

    /// The model object at `path`, with its properties read in one `GetAll` (commands read
    /// them all; the two that are not signalled are still read on their own).
    pub async fn model(&self, path: OwnedObjectPath) -> Result<ModelProxy<'static>, CtlError> {
        self.proxy(Some(path), CacheProperties::Yes).await
    }

    /// The job object at `path`.
    pub async fn job(&self, path: OwnedObjectPath) -> Result<JobProxy<'static>, CtlError> {
        self.proxy(Some(path), CacheProperties::No).await
    }

    /// A proxy of type `P` at `path` (else its default path).
    async fn proxy<P>(&self, path: Option<OwnedObjectPath>, cache: CacheProperties) -> Result<P, CtlError>
    where
        P: zbus::proxy::Defaults + From<zbus::Proxy<'static>>,
    {
        let mut builder = zbus::proxy::Builder::<P>::new(&self.connection).cache_properties(cache);
        if let Some(path) = path {
            builder = builder.path(path).map_err(|e| self.error(e))?;
        }
        builder.build().await.map_err(|e| self.error(e))
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
