//! The connection to corrald on D-Bus, with every failure mapped to a [`CtlError`].
//!
//! Which bus: `--system` or `--user` (`--session`) when given; otherwise the session bus
//! when corrald runs there or the user manager has its socket (the user units), else
//! the system bus.
//!
//! Reading never starts corrald: a command that only reads ([`Access::Read`]) asks the
//! bus who owns `org.corral.Corral1` (`GetNameOwner`, which never activates anything) and
//! sends every call to that unique name, to which the bus never auto-starts a service
//! (the same effect as the `NO_AUTO_START` flag, for property reads and proxies too).
//! When nobody owns the name, the service manager is asked why (masked, a rejected
//! configuration, the socket's start limit) and the message says what to do.
//! A command that changes something may start it, within [`START_TIMEOUT`].

use std::time::Duration;

use zbus::names::{BusName, OwnedUniqueName};
use zbus::proxy::CacheProperties;
use zbus::zvariant::OwnedObjectPath;

use super::error::{CtlError, Diagnosis, UnitState};
use crate::dbus::proxy::{JobProxy, ManagerProxy, ModelProxy};

/// corrald's well-known name.
const NAME: &str = "org.corral.Corral1";
/// The longest wait for corrald to start by bus activation (the bus's own limit is 25 s).
pub const START_TIMEOUT: Duration = Duration::from_secs(20);
/// The longest wait for a question to the bus or the service manager.
const ASK_TIMEOUT: Duration = Duration::from_secs(5);

/// Which bus the command line asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    /// `--system`.
    System,
    /// `--user` or `--session`.
    Session,
    /// Neither: see the module.
    Auto,
}

/// What a command does with corrald.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Only reads: never starts corrald.
    Read,
    /// Changes something: may start corrald by bus activation.
    Change,
}

/// A connection to the system or session bus, and where calls go.
#[derive(Debug, Clone)]
pub struct Bus {
    connection: zbus::Connection,
    kind: &'static str,
    /// The owner's unique name for reading (no activation), else the well-known name.
    destination: BusName<'static>,
}

impl Bus {
    /// Connects as `choice` says, for `access` (see the module).
    pub async fn connect(choice: Choice, access: Access) -> Result<Self, CtlError> {
        let (connection, kind) = match choice {
            Choice::System => (connect("system", access).await?, "system"),
            Choice::Session => (connect("session", access).await?, "session"),
            Choice::Auto => match auto_session(access).await {
                Some(session) => (session, "session"),
                None => (connect("system", access).await?, "system"),
            },
        };
        let owner = ask(name_owner(&connection)).await.flatten();
        let destination = match (owner, access) {
            (Some(unique), Access::Read) => BusName::Unique(unique.into_inner()),
            (Some(_), Access::Change) => BusName::try_from(NAME).map_err(|e| CtlError::Bus(e.to_string()))?,
            (None, access) => {
                let state = ask(unit_state(&connection)).await.flatten();
                let diagnosis = Diagnosis { bus: kind, state, reading: access == Access::Read };
                if access == Access::Read || diagnosis.blocks_start() {
                    return Err(CtlError::not_running(&diagnosis, "nobody owns org.corral.Corral1".to_owned()));
                }
                start(&connection, kind).await?;
                BusName::try_from(NAME).map_err(|e| CtlError::Bus(e.to_string()))?
            }
        };
        Ok(Self { connection, kind, destination })
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

    /// The model object at `path`, with its properties read in one `GetAll`; its explicit
    /// ones, which `GetAll` leaves out, are read with `Get` when asked for.
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
        let mut builder = zbus::proxy::Builder::<P>::new(&self.connection)
            .cache_properties(cache)
            .destination(self.destination.clone())
            .map_err(|e| self.error(e))?;
        if let Some(path) = path {
            builder = builder.path(path).map_err(|e| self.error(e))?;
        }
        builder.build().await.map_err(|e| self.error(e))
    }
}

/// The longest wait for an answer to a reading call: reading is quick, and a corrald that
/// does not answer must not hang a script.  Changes (a load waits until the model is
/// ready) have no limit.
pub const READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Connects to the `kind` bus; a failure is about the bus, not corrald.
async fn connect(kind: &'static str, access: Access) -> Result<zbus::Connection, CtlError> {
    let connecting = async {
        let builder = if kind == "session" {
            zbus::connection::Builder::session()?
        } else {
            zbus::connection::Builder::system()?
        };
        let builder = if access == Access::Read { builder.method_timeout(READ_TIMEOUT) } else { builder };
        builder.build().await
    };
    match tokio::time::timeout(ASK_TIMEOUT, connecting).await {
        Ok(Ok(connection)) => Ok(connection),
        Ok(Err(e)) => Err(CtlError::no_bus(kind, &e)),
        Err(_) => Err(CtlError::NoBus {
            bus: kind,
            detail: format!("no answer within {}", crate::durations::human(ASK_TIMEOUT)),
        }),
    }
}

/// The session bus, when corrald runs there or the user manager has corrald's socket or
/// service active; `None` means the system bus.
async fn auto_session(access: Access) -> Option<zbus::Connection> {
    let session = connect("session", access).await.ok()?;
    if ask(name_owner(&session)).await.flatten().is_some() {
        return Some(session);
    }
    let state = ask(unit_state(&session)).await.flatten()?;
    state.user_units_in_use().then_some(session)
}

/// `f` within [`ASK_TIMEOUT`]; `None` when it took longer.
async fn ask<T>(f: impl Future<Output = T>) -> Option<T> {
    tokio::time::timeout(ASK_TIMEOUT, f).await.ok()
}

/// The unique name owning corrald's name; `None` when nobody does.  `GetNameOwner` never
/// starts a service.
async fn name_owner(connection: &zbus::Connection) -> Option<OwnedUniqueName> {
    let dbus = zbus::fdo::DBusProxy::new(connection).await.ok()?;
    let name = BusName::try_from(NAME).ok()?;
    dbus.get_name_owner(name).await.ok()
}

/// corrald.service's and corrald.socket's state from this bus's service manager (the
/// system manager on the system bus, the user manager on the session bus); `None` when
/// there is no manager to ask.
async fn unit_state(connection: &zbus::Connection) -> Option<UnitState> {
    let service = unit_properties(connection, "corrald_2eservice").await?;
    let socket = unit_properties(connection, "corrald_2esocket").await;
    let get = |props: &std::collections::HashMap<String, zbus::zvariant::OwnedValue>, key: &str| {
        props.get(key).and_then(|v| String::try_from(v.clone()).ok()).unwrap_or_default()
    };
    let service_result = service_property(connection, "Result").await.and_then(|v| String::try_from(v).ok());
    let exit_status = service_property(connection, "ExecMainStatus").await.and_then(|v| i32::try_from(v).ok());
    Some(UnitState {
        load: get(&service, "LoadState"),
        active: get(&service, "ActiveState"),
        result: service_result.unwrap_or_default(),
        exit_status: exit_status.unwrap_or_default(),
        socket_active: socket.as_ref().map(|s| get(s, "ActiveState")).unwrap_or_default(),
        socket_result: socket_property(connection).await.unwrap_or_default(),
    })
}

/// `org.freedesktop.systemd1.Unit`'s properties of the unit at its escaped path name
/// (systemd loads a unit that is asked about by path).
async fn unit_properties(
    connection: &zbus::Connection,
    escaped: &str,
) -> Option<std::collections::HashMap<String, zbus::zvariant::OwnedValue>> {
    let props = properties(connection, escaped).await?;
    let interface = zbus::names::InterfaceName::try_from("org.freedesktop.systemd1.Unit").ok()?;
    props.get_all(interface).await.ok()
}

async fn properties(connection: &zbus::Connection, escaped: &str) -> Option<zbus::fdo::PropertiesProxy<'static>> {
    zbus::fdo::PropertiesProxy::builder(connection)
        .destination("org.freedesktop.systemd1")
        .ok()?
        .path(format!("/org/freedesktop/systemd1/unit/{escaped}"))
        .ok()?
        .cache_properties(CacheProperties::No)
        .build()
        .await
        .ok()
}

async fn service_property(connection: &zbus::Connection, name: &str) -> Option<zbus::zvariant::OwnedValue> {
    let props = properties(connection, "corrald_2eservice").await?;
    let interface = zbus::names::InterfaceName::try_from("org.freedesktop.systemd1.Service").ok()?;
    props.get(interface, name).await.ok()
}

async fn socket_property(connection: &zbus::Connection) -> Option<String> {
    let props = properties(connection, "corrald_2esocket").await?;
    let interface = zbus::names::InterfaceName::try_from("org.freedesktop.systemd1.Socket").ok()?;
    props.get(interface, "Result").await.ok().and_then(|v| String::try_from(v).ok())
}

/// Starts corrald by bus activation, within [`START_TIMEOUT`]; a failure says why.
async fn start(connection: &zbus::Connection, kind: &'static str) -> Result<(), CtlError> {
    let starting = async {
        let dbus = zbus::fdo::DBusProxy::new(connection).await?;
        let name = zbus::names::WellKnownName::try_from(NAME)?;
        dbus.start_service_by_name(name, 0).await.map_err(zbus::Error::from)
    };
    let failure = match tokio::time::timeout(START_TIMEOUT, starting).await {
        Ok(Ok(_)) => return Ok(()),
        Ok(Err(e)) => match CtlError::from_zbus(e, kind) {
            // Access denied, say, is the answer itself.
            CtlError::NotRunning { detail, .. } | CtlError::Bus(detail) => detail,
            other => return Err(other),
        },
        Err(_) => format!("corrald did not start within {}", crate::durations::human(START_TIMEOUT)),
    };
    let state = ask(unit_state(connection)).await.flatten();
    Err(CtlError::not_running(&Diagnosis { bus: kind, state, reading: false }, failure))
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
