//! corrald serving D-Bus on a private system bus that enforces the shipped policy
//! (`dbus/org.corral.Corral1.conf`), with the demo store and the real llama-server.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::bus::{PrivateBus, ensure_user};
use super::container::repo_root;
use super::corrald::{CORRALD, Corrald, free_port, write_config};
use super::{api, llama};

/// In group `corral`: may call the mutating methods.
pub const MEMBER: &str = "corral-it-member";
/// In no special group: may only read.
pub const OUTSIDER: &str = "corral-it-outsider";
/// The error every refused call gets.
pub const ACCESS_DENIED: &str = "org.freedesktop.DBus.Error.AccessDenied";

/// The users and groups the shipped policy and the tests name.
pub fn ensure_users() {
    // The policy names the service user and group `corral`; the bus resolves them at start.
    ensure_user("corral", &[]);
    ensure_user(MEMBER, &["corral"]);
    ensure_user(OUTSIDER, &[]);
}

/// A bus with the shipped policy, and corrald on it (HTTP on a loopback port and on
/// `corral.sock` in its directory).
pub struct BusDaemon {
    /// The daemon (declared first: dropped before the bus).
    pub corrald: Corrald,
    /// The private bus.
    pub bus: PrivateBus,
    /// Holds the store (`chat`, `embed`), the GGUF files and the config.
    pub dir: tempfile::TempDir,
    /// corrald's HTTP port.
    pub port: u16,
}

impl BusDaemon {
    /// Starts corrald with the demo store and `extra` appended to its configuration
    /// (`[scheduler]`, `[gpu]`, … tables), and waits until it owns its name.
    pub fn start(extra: &str) -> Self {
        Self::with_store("", extra)
    }

    /// [`BusDaemon::start`] with `store_keys` added to the `[store]` table.
    pub fn with_store(store_keys: &str, extra: &str) -> Self {
        Self::with(store_keys, &llama::bin_dir().join("llama-server"), extra)
    }

    /// [`BusDaemon::with_store`] running `llama_server` as the runner.
    pub fn with(store_keys: &str, llama_server: &Path, extra: &str) -> Self {
        ensure_users();
        let mut bus = PrivateBus::start(&policy());
        let dir = tempfile::tempdir().expect("tempdir");
        api::demo_store(dir.path());
        let port = free_port();
        let config = format!(
            "[server]\nlisten = [\"127.0.0.1:{port}\", \"{socket}\"]\n[store]\npath = \"{store}\"\n{store_keys}\n[runner]\nllama_server = \"{llama}\"\n\
             [dbus]\nbus = \"system\"\n{extra}",
            socket = dir.path().join("corral.sock").display(),
            store = dir.path().join("models").display(),
            llama = llama_server.display(),
        );
        write_config(dir.path(), "corral.toml", &config);
        let corrald = Self::spawn_corrald(&mut bus, dir.path());
        Self { corrald, bus, dir, port }
    }

    /// Starts corrald with the configuration and state directory in `dir`, and waits
    /// until it owns its name.
    fn spawn_corrald(bus: &mut PrivateBus, dir: &Path) -> Corrald {
        let mut cmd = Command::new(CORRALD);
        cmd.args(["--log-target", "stderr", "--config"]).arg(dir.join("corral.toml"));
        cmd.env("DBUS_SYSTEM_BUS_ADDRESS", bus.address()).env("STATE_DIRECTORY", dir.join("state"));
        let corrald = Corrald::spawn(cmd);
        corrald.wait_stderr("serving D-Bus", std::time::Duration::from_secs(60));
        bus.wait_for_name("org.corral.Corral1", "none");
        corrald
    }

    /// Stops corrald as systemd does (SIGTERM); it must exit cleanly.
    pub fn stop(&mut self) {
        self.corrald.signal(nix::sys::signal::Signal::SIGTERM);
        let status = self.corrald.wait_exit(std::time::Duration::from_secs(60));
        assert!(status.success(), "corrald stopped with {status}: {}", self.corrald.stderr());
    }

    /// Starts corrald again after [`BusDaemon::stop`], on the same bus, store and state
    /// directory.
    pub fn start_again(&mut self) {
        self.corrald = Self::spawn_corrald(&mut self.bus, self.dir.path());
    }

    /// A client connection as root.
    pub async fn connect(&self) -> zbus::Connection {
        zbus::connection::Builder::address(self.bus.address())
            .expect("address")
            .build()
            .await
            .unwrap_or_else(|e| panic!("cannot connect to the test bus: {e}\n{}", self.bus.log()))
    }

    /// `busctl ARGS` against the bus, as `user` (`None`: root).
    pub fn busctl(&self, user: Option<&str>, args: &[&str]) -> std::process::Output {
        let address = format!("--address={}", self.bus.address());
        let mut command = vec!["busctl", address.as_str()];
        command.extend_from_slice(args);
        self.bus.run_as(user, &command)
    }

    /// corrald's UNIX socket.
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("corral.sock")
    }

    /// The directory of the test's files.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

/// The shipped bus policy.
pub fn policy() -> PathBuf {
    repo_root().join("dbus/org.corral.Corral1.conf")
}
