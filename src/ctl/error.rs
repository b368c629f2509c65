//! What can go wrong in `corralctl`, the message each case prints, and its exit code.
//!
//! Exit codes follow sysexits.h where one fits: 0 success, 1 any other failure, 2 bad
//! usage (clap's own), 69 (`EX_UNAVAILABLE`) when corrald or its bus cannot be reached,
//! 75 (`EX_TEMPFAIL`) when corrald is busy or stopping (the same command may work later),
//! 77 (`EX_NOPERM`) when the bus policy refuses the call.

/// A failed command, with no exit code yet.
#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    /// The bus itself cannot be reached: D-Bus is down, not corrald.
    #[error(
        "cannot connect to the {bus} bus ({detail}): is D-Bus running? (`systemctl{} status dbus`); \
         corralctl reaches corrald through it",
        if *bus == "session" { " --user" } else { "" }
    )]
    NoBus {
        /// "system" or "session".
        bus: &'static str,
        /// What connecting said.
        detail: String,
    },
    /// No corrald on the bus: the message says why, when the service manager knows.
    #[error("{message}")]
    NotRunning {
        /// What to tell the user.
        message: String,
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
    /// The HTTP API answered 503: too busy for the request, or stopping.
    #[error("{message}")]
    HttpUnavailable {
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
/// sysexits.h: a temporary failure; the command may work if tried again.
pub const EX_TEMPFAIL: u8 = 75;
/// sysexits.h: permission denied.
pub const EX_NOPERM: u8 = 77;

impl CtlError {
    /// The process exit code for this error.
    #[must_use]
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::NoBus { .. } | Self::NotRunning { .. } | Self::HttpUnreachable { .. } => EX_UNAVAILABLE,
            Self::AccessDenied { .. } | Self::HttpDenied { .. } => EX_NOPERM,
            Self::HttpUnavailable { .. } => EX_TEMPFAIL,
            Self::Daemon { name, .. } if matches!(name.as_str(), "Busy" | "ShuttingDown") => EX_TEMPFAIL,
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
            // A reading call that got no answer in time: corrald hangs, the bus does not.
            zbus::Error::InputOutput(e) if e.kind() == std::io::ErrorKind::TimedOut => Self::NotRunning {
                message: format!(
                    "corrald does not answer (no reply within {}); see `journalctl{} -u corrald`",
                    crate::durations::human(super::bus::READ_TIMEOUT),
                    if bus == "session" { " --user" } else { "" }
                ),
                detail: e.to_string(),
            },
            // No socket, or nothing listening on it: the bus itself is missing.
            e @ (zbus::Error::InputOutput(_) | zbus::Error::Address(_) | zbus::Error::Handshake(_)) => {
                Self::no_bus(bus, &e)
            }
            other => Self::Bus(other.to_string()),
        }
    }

    /// The bus `bus` cannot be reached.
    #[must_use]
    pub fn no_bus(bus: &'static str, error: &zbus::Error) -> Self {
        let detail = match error {
            zbus::Error::InputOutput(e) => e.to_string(),
            zbus::Error::Address(e) => format!("no address: {e}"),
            other => other.to_string(),
        };
        Self::NoBus { bus, detail }
    }

    /// corrald is not on the bus: what the service manager knows, and what to do.
    #[must_use]
    pub fn not_running(diagnosis: &Diagnosis, detail: String) -> Self {
        let message = diagnosis.message(&detail);
        Self::NotRunning { message, detail }
    }

    fn from_named(name: &str, message: String, bus: &'static str) -> Self {
        match name {
            "org.freedesktop.DBus.Error.ServiceUnknown"
            | "org.freedesktop.DBus.Error.NameHasNoOwner"
            | "org.freedesktop.DBus.Error.NoReply"
            | "org.freedesktop.DBus.Error.Disconnected"
            | "org.freedesktop.DBus.Error.TimedOut"
            | "org.freedesktop.systemd1.UnitMasked" => not_running(bus, message),
            spawn if spawn.starts_with("org.freedesktop.DBus.Error.Spawn.") => not_running(bus, message),
            "org.freedesktop.DBus.Error.AccessDenied" => Self::AccessDenied { detail: message },
            _ => match name.strip_prefix("org.corral.Corral1.Error.") {
                Some(short) => Self::Daemon { name: short.to_owned(), message },
                None => Self::Bus(format!("{name}: {message}")),
            },
        }
    }
}

fn not_running(bus: &'static str, detail: String) -> CtlError {
    CtlError::not_running(&Diagnosis { bus, state: None, reading: false }, detail)
}

/// What the service manager says about corrald's units (`systemctl show` properties).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UnitState {
    /// corrald.service's `LoadState`: loaded, not-found, masked...
    pub load: String,
    /// Its `ActiveState`: active, inactive, failed...
    pub active: String,
    /// Its `Result`: success, exit-code, start-limit-hit...
    pub result: String,
    /// Its `ExecMainStatus`: 78 for a rejected configuration.
    pub exit_status: i32,
    /// corrald.socket's `ActiveState`.
    pub socket_active: String,
    /// corrald.socket's `Result`: service-start-limit-hit when it gave up.
    pub socket_result: String,
}

impl UnitState {
    /// Whether these (user manager's) units are set up and in use.
    #[must_use]
    pub fn user_units_in_use(&self) -> bool {
        self.load == "loaded"
            && (matches!(self.active.as_str(), "active" | "activating" | "reloading") || self.socket_active == "active")
    }
}

/// Why corrald is not on the bus, as far as known, for a message that says what to do.
#[derive(Debug, Clone)]
pub struct Diagnosis {
    /// "system" or "session".
    pub bus: &'static str,
    /// The units' state; `None` when no service manager answered.
    pub state: Option<UnitState>,
    /// A read-only command (which does not start corrald).
    pub reading: bool,
}

/// sysexits.h: a configuration error, corrald's exit status for a rejected configuration.
const EX_CONFIG: i32 = 78;

impl Diagnosis {
    /// Whether starting corrald is pointless (masked, a rejected configuration, or the
    /// socket's start limit): the message says what to fix first.
    #[must_use]
    pub fn blocks_start(&self) -> bool {
        self.state.as_ref().is_some_and(|s| {
            s.load == "masked"
                || (s.active == "failed" && s.exit_status == EX_CONFIG)
                || s.socket_result == "service-start-limit-hit"
                || s.result == "start-limit-hit"
        })
    }

    fn message(&self, detail: &str) -> String {
        let user = if self.bus == "session" { " --user" } else { "" };
        let Some(state) = &self.state else {
            let reading = if self.reading { "; reading does not start it" } else { "" };
            return format!(
                "corrald is not running (or not on the {} bus): start it with `systemctl{user} start corrald`{reading} \
                 ({detail})",
                self.bus
            );
        };
        let journal = format!("`journalctl{user} -u corrald`");
        let mut message = if state.load == "masked" {
            format!(
                "corrald is not running: corrald.service is masked, so nothing may start it \
                 (`systemctl{user} unmask corrald.service` allows it again)"
            )
        } else if state.load == "not-found" {
            format!(
                "corrald is not running, and the {} service manager has no corrald.service: install corral, \
                 or run corrald by hand",
                if self.bus == "session" { "user" } else { "system" }
            )
        } else if state.active == "failed" && state.exit_status == EX_CONFIG {
            format!(
                "corrald is not running: its configuration is rejected; see {journal} or run `corrald{} --check-config`, \
                 fix it, then `systemctl{user} reset-failed corrald` and `systemctl{user} start corrald`",
                if self.bus == "session" { " --user" } else { "" }
            )
        } else if state.active == "failed" {
            format!(
                "corrald is not running: it failed ({}, exit status {}); see {journal}, then `systemctl{user} reset-failed corrald`",
                state.result, state.exit_status
            )
        } else if self.reading {
            format!(
                "corrald is not running (reading does not start it): start it with `systemctl{user} start corrald`, \
                 or with any request to its socket"
            )
        } else {
            format!("corrald is not running: start it with `systemctl{user} start corrald` ({detail})")
        };
        if state.socket_result == "service-start-limit-hit" || state.socket_active == "failed" {
            message = format!(
                "{message}; corrald.socket stopped after too many failed starts, so port 11434 is closed: \
                 `systemctl{user} reset-failed corrald.socket corrald.service && systemctl{user} start corrald.socket`"
            );
        }
        message
    }
}

/// The error name and message of a standard `org.freedesktop.DBus.Error.*`.
fn fdo_parts(error: &zbus::fdo::Error) -> (String, String) {
    use zbus::DBusError as _;
    (error.name().to_string(), error.description().unwrap_or_default().to_owned())
}

#[cfg(test)]
mod tests {
    use super::{CtlError, Diagnosis, EX_NOPERM, EX_UNAVAILABLE, UnitState};

    fn diagnosed(bus: &'static str, state: UnitState, reading: bool) -> CtlError {
        CtlError::not_running(&Diagnosis { bus, state: Some(state), reading }, "nobody owns it".into())
    }

    fn loaded(active: &str) -> UnitState {
        UnitState { load: "loaded".into(), active: active.into(), ..UnitState::default() }
    }

    #[test]
    fn a_rejected_configuration_says_where_to_look_and_what_to_run() {
        let state = UnitState { result: "exit-code".into(), exit_status: 78, ..loaded("failed") };
        let e = diagnosed("system", state.clone(), true);
        assert_eq!(e.exit_code(), EX_UNAVAILABLE);
        let text = e.to_string();
        assert!(text.starts_with("corrald is not running: its configuration is rejected"), "{text}");
        assert!(text.contains("`journalctl -u corrald`") && text.contains("`corrald --check-config`"), "{text}");
        assert!(Diagnosis { bus: "system", state: Some(state.clone()), reading: false }.blocks_start());
        // The socket's start limit is named with the commands that reopen the port.
        let stopped =
            UnitState { socket_active: "failed".into(), socket_result: "service-start-limit-hit".into(), ..state };
        let text = diagnosed("session", stopped, false).to_string();
        assert!(
            text.contains("`journalctl --user -u corrald`") && text.contains("`corrald --user --check-config`"),
            "{text}"
        );
        assert!(text.contains("systemctl --user reset-failed corrald.socket corrald.service"), "{text}");
    }

    #[test]
    fn a_masked_unit_says_so_and_exits_69() {
        let e = diagnosed("system", UnitState { load: "masked".into(), ..UnitState::default() }, true);
        assert_eq!(e.exit_code(), EX_UNAVAILABLE);
        assert!(e.to_string().contains("corrald.service is masked"), "{e}");
        assert!(e.to_string().contains("systemctl unmask corrald.service"), "{e}");
    }

    #[test]
    fn a_stopped_service_is_not_started_by_reading() {
        let text = diagnosed("system", loaded("inactive"), true).to_string();
        assert!(text.starts_with("corrald is not running (reading does not start it)"), "{text}");
        assert!(!Diagnosis { bus: "system", state: Some(loaded("inactive")), reading: false }.blocks_start());
        let failed = UnitState { result: "signal".into(), exit_status: 9, ..loaded("failed") };
        assert!(diagnosed("system", failed, true).to_string().contains("it failed (signal, exit status 9)"));
    }

    #[test]
    fn user_units_in_use_means_the_session_bus() {
        assert!(loaded("active").user_units_in_use());
        assert!(UnitState { socket_active: "active".into(), ..loaded("inactive") }.user_units_in_use());
        assert!(!loaded("inactive").user_units_in_use());
        assert!(
            !UnitState { load: "not-found".into(), socket_active: "active".into(), ..UnitState::default() }
                .user_units_in_use()
        );
    }

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
    fn no_bus_socket_blames_the_bus_not_corrald() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory");
        let e = CtlError::from_zbus(zbus::Error::InputOutput(io.into()), "system");
        assert_eq!(e.exit_code(), EX_UNAVAILABLE);
        let text = e.to_string();
        assert!(text.starts_with("cannot connect to the system bus (No such file or directory)"), "{text}");
        assert!(text.contains("is D-Bus running?") && !text.contains("corrald is not running"), "{text}");
    }

    #[test]
    fn a_reading_call_without_an_answer_says_corrald_does_not_answer() {
        let io = std::io::Error::new(std::io::ErrorKind::TimedOut, "timed out");
        let e = CtlError::from_zbus(zbus::Error::InputOutput(io.into()), "system");
        assert_eq!(e.exit_code(), EX_UNAVAILABLE);
        assert_eq!(e.to_string(), "corrald does not answer (no reply within 30 s); see `journalctl -u corrald`");
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
