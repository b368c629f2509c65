//! A private, system-like `dbus-daemon` that enforces a given policy file, and a way to run
//! D-Bus clients and services as test users.
//!
//! The bus copies the default policy of Debian's `/usr/share/dbus-1/system.conf`
//! (`<type>system</type>`, EXTERNAL authentication, deny owning names and method calls by
//! default, the bus driver allowed) and then includes only the policy file under test.  It
//! listens on a socket in its own temporary directory and is killed on drop.
//!
//! Test users are real accounts made with `useradd` when missing (the tests run as root on a
//! throwaway machine); [`ensure_user`] serialises that across parallel tests with a lock file.
//! Clients run as a user through `setpriv --reuid --regid --init-groups`, so the bus sees
//! their real supplementary groups, which is what `<policy group="…">` is checked against.

use std::fmt::Write as _;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::container::{describe, output_within, poll_until, success_within, target_dir};

/// How long the bus and a service may take to come up, and a client call to finish.
pub const BUS_TIMEOUT: Duration = Duration::from_secs(60);

/// The bus configuration; `@SOCKET@` and `@POLICY@` are filled in.
const BUS_CONFIG: &str = r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<!-- corral test bus: the system bus's default policy, a private socket, one policy file. -->
<busconfig>
  <type>system</type>
  <auth>EXTERNAL</auth>
  <listen>unix:path=@SOCKET@</listen>
  <policy context="default">
    <allow user="*"/>
    <deny own="*"/>
    <deny send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_requested_reply="true" send_type="method_return"/>
    <allow send_requested_reply="true" send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Introspectable"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Properties"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Peer"/>
    <deny send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus" send_member="UpdateActivationEnvironment"/>
    <deny send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Debug.Stats"/>
  </policy>
  <policy user="root">
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Monitoring"/>
  </policy>
  <include>@POLICY@</include>
</busconfig>
"#;

/// A running private bus; killed on drop.
pub struct PrivateBus {
    dir: tempfile::TempDir,
    daemon: Child,
    address: String,
    services: Vec<Child>,
}

impl PrivateBus {
    /// Starts a bus that enforces `policy` (a `<busconfig>` file) and waits for its address.
    ///
    /// The users and groups the policy names must exist first: the bus resolves them when it
    /// reads its configuration (see [`ensure_user`]).
    pub fn start(policy: &Path) -> Self {
        let policy = policy.canonicalize().unwrap_or_else(|e| panic!("policy {}: {e}", policy.display()));
        let dir = tempfile::Builder::new().prefix("corral-bus-").tempdir().expect("tempdir");
        // Test users must reach the socket and the files copied here.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let socket = dir.path().join("system_bus_socket");
        let config = BUS_CONFIG.replace("@SOCKET@", &xml_path(&socket)).replace("@POLICY@", &xml_path(&policy));
        let config_file = dir.path().join("bus.conf");
        std::fs::write(&config_file, config).expect("write bus.conf");

        let mut daemon = Command::new("dbus-daemon")
            .arg(format!("--config-file={}", config_file.display()))
            .args(["--nofork", "--nopidfile", "--nosyslog", "--print-address"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(dir.path().join("dbus-daemon.log")).expect("log file"))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run dbus-daemon: {e} (apt-get install dbus-daemon)"));
        let stdout = daemon.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            let mut lines = std::io::BufReader::new(stdout).lines();
            let _ = tx.send(lines.next().and_then(Result::ok));
            // Keep reading so that the daemon never writes into a closed pipe.
            for _ in lines {}
        });
        let mut bus = Self { dir, daemon, address: String::new(), services: Vec::new() };
        match rx.recv_timeout(BUS_TIMEOUT) {
            Ok(Some(address)) if address.starts_with("unix:") => address.trim().clone_into(&mut bus.address),
            other => panic!("dbus-daemon printed no address ({other:?}); its log:\n{}", bus.log()),
        }
        bus
    }

    /// The bus address, `unix:path=…,guid=…`.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// The bus's temporary directory (readable by every user).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// What dbus-daemon wrote to stderr.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("dbus-daemon.log")).unwrap_or_default()
    }

    /// A command that runs `args` as `user` (`None`: as root) with its primary group and
    /// supplementary groups, and `DBUS_SYSTEM_BUS_ADDRESS` pointing at this bus.
    pub fn command_as(&self, user: Option<&str>, args: &[&str]) -> Command {
        let (program, rest) = args.split_first().expect("a command");
        let mut cmd = match user {
            Some(user) => {
                let mut cmd = Command::new("setpriv");
                cmd.args([format!("--reuid={user}"), format!("--regid={user}"), "--init-groups".to_owned()])
                    .arg("--")
                    .arg(program);
                cmd
            }
            None => Command::new(program),
        };
        cmd.args(rest).env("DBUS_SYSTEM_BUS_ADDRESS", &self.address).current_dir(self.dir.path());
        cmd
    }

    /// Runs `args` as `user` and returns what happened; the caller checks the status.
    pub fn run_as(&self, user: Option<&str>, args: &[&str]) -> Output {
        output_within(&mut self.command_as(user, args), BUS_TIMEOUT)
    }

    /// Calls `method` (`INTERFACE.MEMBER`) on `dest` at `path` as `user` with `dbus-send`;
    /// `args` are dbus-send arguments such as `string:x`.  Returns the reply or the error text.
    pub fn call_as(&self, user: Option<&str>, dest: &str, path: &str, method: &str, args: &[&str]) -> Output {
        let bus_arg = format!("--bus={}", self.address);
        let dest_arg = format!("--dest={dest}");
        let mut command = vec![
            "dbus-send",
            bus_arg.as_str(),
            "--print-reply",
            "--reply-timeout=20000",
            dest_arg.as_str(),
            path,
            method,
        ];
        command.extend_from_slice(args);
        self.run_as(user, &command)
    }

    /// Starts `args` as `user` in the background; it is killed when the bus is dropped.
    /// Its output goes to `LOGNAME.log` in the bus's directory.
    pub fn spawn_as(&mut self, user: Option<&str>, args: &[&str], log_name: &str) -> u32 {
        let log = std::fs::File::create(self.dir.path().join(format!("{log_name}.log"))).expect("log file");
        let child = self
            .command_as(user, args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start `{}`: {e}", args.join(" ")));
        let pid = child.id();
        self.services.push(child);
        pid
    }

    /// Waits until `name` has an owner on the bus; panics with `log_name`'s log if it gets none.
    pub fn wait_for_name(&mut self, name: &str, log_name: &str) {
        let log = self.dir.path().join(format!("{log_name}.log"));
        poll_until(BUS_TIMEOUT, &format!("{name} to be owned"), || {
            for service in &mut self.services {
                if let Ok(Some(status)) = service.try_wait() {
                    return Err(format!(
                        "a service exited ({status}): {}",
                        std::fs::read_to_string(&log).unwrap_or_default()
                    ));
                }
            }
            let name_arg = format!("string:{name}");
            let out = self.call_as(
                None,
                "org.freedesktop.DBus",
                "/org/freedesktop/DBus",
                "org.freedesktop.DBus.NameHasOwner",
                &[&name_arg],
            );
            if String::from_utf8_lossy(&out.stdout).contains("boolean true") { Ok(()) } else { Err(describe(&out)) }
        });
    }
}

impl Drop for PrivateBus {
    fn drop(&mut self) {
        for child in self.services.iter_mut().chain(std::iter::once(&mut self.daemon)) {
            if let Ok(pid) = i32::try_from(child.id()) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
            }
        }
        for child in self.services.iter_mut().chain(std::iter::once(&mut self.daemon)) {
            let mut waited = 0;
            while !matches!(child.try_wait(), Ok(Some(_))) && waited < 200 {
                std::thread::sleep(Duration::from_millis(10));
                waited += 1;
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A path for the bus configuration; the tests' paths need no XML escaping, and must not.
fn xml_path(path: &Path) -> String {
    let s = path.to_str().expect("a UTF-8 path");
    assert!(!s.contains(['<', '>', '&', '"', '\'']), "path needs XML escaping: {s}");
    s.to_owned()
}

/// Makes sure the system group `name` exists.
pub fn ensure_group(name: &str) {
    locked(&format!("getent group {name} >/dev/null || groupadd --system {name}"));
}

/// Makes sure the system user `name` exists, with a primary group of the same name, and is a
/// member of each of `groups` (which are created when missing).  No home directory, no login.
pub fn ensure_user(name: &str, groups: &[&str]) {
    for group in groups {
        ensure_group(group);
    }
    let mut script = format!(
        "getent passwd {name} >/dev/null || useradd --system --user-group --no-create-home \
         --home-dir /nonexistent --shell /usr/sbin/nologin {name}"
    );
    for group in groups {
        let _ = write!(
            script,
            "\nid -nG {name} | tr ' ' '\\n' | grep -qx {group} || usermod --append --groups {group} {name}"
        );
    }
    locked(&script);
}

/// Runs a small shell script under an exclusive lock, so that parallel tests do not edit
/// `/etc/passwd` and `/etc/group` at the same time.  Names are checked to be plain.
fn locked(script: &str) {
    assert!(
        script.split_whitespace().all(|w| !w.contains(['$', '`', ';', '&'])),
        "unexpected characters in user management script: {script}"
    );
    let lock: PathBuf = target_dir().join("it-users.lock");
    let mut cmd = Command::new("flock");
    cmd.args(["--timeout", "60"]).arg(&lock).args(["sh", "-ec", script]);
    success_within(&mut cmd, Duration::from_secs(90));
}
