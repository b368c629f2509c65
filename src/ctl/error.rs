//! What can go wrong in `corralctl`, the message each case prints, and its exit code.
//!
//! Exit codes follow sysexits.h where one fits: 0 success, 1 any other failure, 2 bad
//! usage (clap's own), 69 (`EX_UNAVAILABLE`) when corrald or its bus cannot be reached,
//! 77 (`EX_NOPERM`) when the bus policy refuses the call.

/// A failed command, with no exit code yet.
#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    /// No bus to connect to, or no corrald on it.
    #[error("corrald is not running (or not on the {bus} bus): start it with `{start}` ({detail})")]
    NotRunning {
        /// "system" or "session".
        bus: &'static str,
        /// How to start it.
        start: &'static str,
        /// What the bus said.
        detail: String,
    },
    /// The bus policy refused the call.
    #[error(
        "permission denied: {detail}; loading, unloading and changing models is for members of group corral \
         or root (try `sudo`, or `usermod -aG corral $USER` and log in again)"
    )]
    AccessDenied {
        /// What the bus said.
        detail: String,
    },
    /// One of corrald's named errors (`org.corral.Corral1.Error.NAME`), whose message says
    /// what to do.
    #[error("{message}")]
    Daemon {
        /// The error's last name part, e.g. `NoSuchModel`.
        name: String,
        /// corrald's message.
        message: String,
    },
    /// Any other D-Bus failure.
    #[error("D-Bus: {0}")]
    Bus(String),
    /// A job ended without doing what it was asked.
    #[error("{kind} of '{model}' failed: {error}")]
    JobFailed {
        /// pull, push, create, copy or delete.
        kind: String,
        /// The model's name as given.
        model: String,
        /// What went wrong.
        error: String,
    },
    /// The HTTP API could not be reached.
    #[error("cannot reach corrald's HTTP API at {host}: {detail} (is corrald running? see --host and CORRAL_HOST)")]
    HttpUnreachable {
        /// The address tried.
        host: String,
        /// Why not.
        detail: String,
    },
    /// The HTTP API refused a request for want of a token.
    #[error("permission denied by the HTTP API at {host}: {message} (set CORRAL_API_TOKEN or --token)")]
    HttpDenied {
        /// The address.
        host: String,
        /// Its message.
        message: String,
    },
    /// The HTTP API answered with an error.
    #[error("{message}")]
    Http {
        /// Its message.
        message: String,
    },
    /// Input the command cannot use (a Modelfile, a host address).
    #[error("{0}")]
    Invalid(String),
    /// Reading or writing the terminal or a file.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        source: std::io::Error,
    },
}

/// sysexits.h: a service is unavailable.
pub const EX_UNAVAILABLE: u8 = 69;
/// sysexits.h: permission denied.
pub const EX_NOPERM: u8 = 77;

impl CtlError {
    /// The process exit code for this error.
    #[must_use]
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::NotRunning { .. } | Self::HttpUnreachable { .. } => EX_UNAVAILABLE,
            Self::AccessDenied { .. } | Self::HttpDenied { .. } => EX_NOPERM,
            _ => 1,
        }
    }

    /// Maps a D-Bus failure talking to corrald on `bus` ("system" or "session").
    #[must_use]
    pub fn from_zbus(error: zbus::Error, bus: &'static str) -> Self {
        match error {
            zbus::Error::MethodError(name, message, _) => {
                Self::from_named(name.as_str(), message.unwrap_or_default(), bus)
            }
            zbus::Error::FDO(fdo) => {
                let (name, message) = fdo_parts(&fdo);
                Self::from_named(&name, message, bus)
            }
            // No socket, or nothing listening on it: the bus itself is missing.
            zbus::Error::InputOutput(e) => not_running(bus, format!("cannot connect to the {bus} bus: {e}")),
            zbus::Error::Address(e) => not_running(bus, format!("no {bus} bus address: {e}")),
            zbus::Error::Handshake(e) => not_running(bus, format!("cannot connect to the {bus} bus: {e}")),
            other => Self::Bus(other.to_string()),
        }
    }

    fn from_named(name: &str, message: String, bus: &'static str) -> Self {
        match name {
            "org.freedesktop.DBus.Error.ServiceUnknown"
            | "org.freedesktop.DBus.Error.NameHasNoOwner"
            | "org.freedesktop.DBus.Error.NoReply"
            | "org.freedesktop.DBus.Error.Disconnected" => not_running(bus, message),
            "org.freedesktop.DBus.Error.AccessDenied" => Self::AccessDenied { detail: message },
            _ => match name.strip_prefix("org.corral.Corral1.Error.") {
                Some(short) => Self::Daemon { name: short.to_owned(), message },
                None => Self::Bus(format!("{name}: {message}")),
            },
        }
    }
}

fn not_running(bus: &'static str, detail: String) -> CtlError {
    let start = if bus == "system" { "systemctl start corrald" } else { "systemctl --user start corrald" };
    CtlError::NotRunning { bus, start, detail }
}

/// The error name and message of a standard `org.freedesktop.DBus.Error.*`.
fn fdo_parts(error: &zbus::fdo::Error) -> (String, String) {
    use zbus::DBusError as _;
    (error.name().to_string(), error.description().unwrap_or_default().to_owned())
}

#[cfg(test)]
mod tests {
    use super::{CtlError, EX_NOPERM, EX_UNAVAILABLE};

    fn named(name: &str, message: &str) -> CtlError {
        CtlError::from_named(name, message.to_owned(), "system")
    }

    #[test]
    fn a_missing_daemon_says_how_to_start_it_and_exits_69() {
        for name in ["org.freedesktop.DBus.Error.ServiceUnknown", "org.freedesktop.DBus.Error.NameHasNoOwner"] {
            let e = named(name, "The name is not activatable");
            assert_eq!(e.exit_code(), EX_UNAVAILABLE);
            let text = e.to_string();
            assert!(text.starts_with("corrald is not running (or not on the system bus)"), "{text}");
            assert!(text.contains("systemctl start corrald"), "{text}");
        }
        let e = CtlError::from_named("org.freedesktop.DBus.Error.ServiceUnknown", String::new(), "session");
        assert!(e.to_string().contains("systemctl --user start corrald"), "{e}");
    }

    #[test]
    fn no_bus_socket_is_a_missing_daemon() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory");
        let e = CtlError::from_zbus(zbus::Error::InputOutput(io.into()), "system");
        assert_eq!(e.exit_code(), EX_UNAVAILABLE);
        assert!(e.to_string().contains("cannot connect to the system bus"), "{e}");
    }

    #[test]
    fn access_denied_names_the_group_and_exits_77() {
        let e = named("org.freedesktop.DBus.Error.AccessDenied", "Rejected send message");
        assert_eq!(e.exit_code(), EX_NOPERM);
        let text = e.to_string();
        assert!(text.starts_with("permission denied: Rejected send message"), "{text}");
        assert!(text.contains("members of group corral or root"), "{text}");
    }

    #[test]
    fn corrals_named_errors_print_their_message() {
        let e = named("org.corral.Corral1.Error.NoSuchModel", "model 'x:latest' not found");
        assert_eq!(e.to_string(), "model 'x:latest' not found");
        assert_eq!(e.exit_code(), 1);
        assert!(matches!(e, CtlError::Daemon { ref name, .. } if name == "NoSuchModel"));
        let other = named("org.freedesktop.DBus.Error.UnknownMethod", "no such method");
        assert_eq!(other.to_string(), "D-Bus: org.freedesktop.DBus.Error.UnknownMethod: no such method");
    }
}
