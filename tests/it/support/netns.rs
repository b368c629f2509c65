//! Network namespaces for tests across hosts: a head namespace and worker namespaces joined
//! by veth pairs on private /30 subnets, processes run inside them (`ip netns exec`, so a
//! child's PID is the program's own), links brought down and up, and latency added with
//! `tc netem` where the kernel has it.  Everything is made with `ip` and `tc` (iproute2) and
//! removed in `Drop`, also when a test panics; namespaces left by a test process that was
//! killed are removed by the next one.
//!
//! Self-contained (std and nix only, and `rpc_process.rs`), so that
//! `benches/rpc_workers.rs` uses it too.

use std::ffi::OsStr;
use std::io::Read;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::ops::{Deref, DerefMut};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::Once;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::rpc_process::RpcProcess;

/// How long one `ip` or `tc` command may take.
const TOOL_TIMEOUT: Duration = Duration::from_secs(20);

/// How long a connection attempt into a namespace may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The prefix of every namespace the tests make: `corral-it-<pid>-<n>`.
const PREFIX: &str = "corral-it-";

/// Numbers namespaces and links within this process.
static NEXT: AtomicU32 = AtomicU32::new(0);

/// Runs `cmd` to its end within `timeout` (killed past it); its output.
pub fn output_within(cmd: &mut Command, timeout: Duration) -> Result<Output, String> {
    let shown = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {shown}: {e} (iproute2 is needed: tests/rig/README.md)"))?;
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut bytes);
            }
            bytes
        })
    };
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) | Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{shown} did not finish within {timeout:?}"));
            }
        }
    };
    Ok(Output { status, stdout: stdout.join().unwrap_or_default(), stderr: stderr.join().unwrap_or_default() })
}

/// Runs `program args…` and fails with its stderr unless it succeeds.
fn tool(program: &str, args: &[&str]) -> Result<(), String> {
    let out = output_within(Command::new(program).args(args), TOOL_TIMEOUT)?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("`{program} {}` failed ({}): {}", args.join(" "), out.status, String::from_utf8_lossy(&out.stderr)))
    }
}

/// Removes the namespaces of test processes that no longer run (killed before their `Drop`).
fn remove_stale_namespaces() {
    let Ok(entries) = std::fs::read_dir("/run/netns") else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix(PREFIX).and_then(|rest| rest.split('-').next()) else { continue };
        if pid.parse::<u32>().is_ok() && !Path::new("/proc").join(pid).exists() {
            let _ = tool("ip", &["netns", "del", &name]);
        }
    }
}

/// A network namespace of its own (`ip netns add corral-it-<pid>-<n>`), loopback up; deleted
/// on drop.  Its processes belong to their own fixtures, which end them.
pub struct Netns {
    name: String,
}

impl Netns {
    /// Makes a new namespace with its loopback up.
    pub fn new() -> Self {
        static SWEEP: Once = Once::new();
        SWEEP.call_once(remove_stale_namespaces);
        let name = format!("{PREFIX}{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        tool("ip", &["netns", "add", &name]).unwrap_or_else(|e| panic!("{e}"));
        let netns = Self { name };
        netns.ip(&["link", "set", "lo", "up"]).unwrap_or_else(|e| panic!("{e}"));
        netns
    }

    /// Its name, as `ip netns` knows it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `ip -n NAME ARGS`.
    pub fn ip(&self, args: &[&str]) -> Result<(), String> {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        tool("ip", &all)
    }

    /// `tc -n NAME ARGS`.
    pub fn tc(&self, args: &[&str]) -> Result<(), String> {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        tool("tc", &all)
    }

    /// A command that runs `program` inside the namespace (`ip netns exec`, which execs it:
    /// the child's PID is the program's).
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name]).arg(program);
        cmd
    }

    /// Whether a TCP connection to `addr` from inside the namespace succeeds (bash's
    /// `/dev/tcp`, within 5 s).
    pub fn can_connect(&self, addr: SocketAddrV4) -> bool {
        let mut cmd = self.command("bash");
        cmd.args(["-c", r#"exec 3<>"/dev/tcp/$0/$1""#]).arg(addr.ip().to_string()).arg(addr.port().to_string());
        output_within(&mut cmd, CONNECT_TIMEOUT).is_ok_and(|out| out.status.success())
    }
}

impl Default for Netns {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(e) = tool("ip", &["netns", "del", &self.name]) {
            eprintln!("cannot remove network namespace {}: {e}", self.name);
        }
    }
}

/// A veth pair from a head namespace to a worker namespace, on a private /30 of its own
/// (`10.A.B.C/30`, from the test process's PID and a counter): the head's end is `.1`, the
/// worker's `.2`.  Removed on drop (deleting one end removes both).
pub struct Link {
    head_ns: String,
    worker_ns: String,
    head_dev: String,
    worker_dev: String,
    head: Ipv4Addr,
    worker: Ipv4Addr,
}

impl Link {
    /// Makes the pair, addresses both ends and brings them up.
    pub fn new(head: &Netns, worker: &Netns) -> Self {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        // Each namespace has its own routes, so subnets could repeat across tests; they
        // differ anyway, which keeps a failing test's `ip addr` unambiguous.
        let a = u8::try_from(200 + pid % 50).expect("< 250");
        let b = u8::try_from((pid / 50 + n / 64) % 256).expect("< 256");
        let c = u8::try_from((n % 64) * 4).expect("< 256");
        let link = Self {
            head_ns: head.name().to_owned(),
            worker_ns: worker.name().to_owned(),
            head_dev: format!("ch{n}"),
            worker_dev: format!("cw{n}"),
            head: Ipv4Addr::new(10, a, b, c + 1),
            worker: Ipv4Addr::new(10, a, b, c + 2),
        };
        let made = head
            .ip(&[
                "link",
                "add",
                &link.head_dev,
                "type",
                "veth",
                "peer",
                "name",
                &link.worker_dev,
                "netns",
                worker.name(),
            ])
            .and_then(|()| head.ip(&["addr", "add", &format!("{}/30", link.head), "dev", &link.head_dev]))
            .and_then(|()| head.ip(&["link", "set", &link.head_dev, "up"]))
            .and_then(|()| worker.ip(&["addr", "add", &format!("{}/30", link.worker), "dev", &link.worker_dev]))
            .and_then(|()| worker.ip(&["link", "set", &link.worker_dev, "up"]));
        made.unwrap_or_else(|e| panic!("{e}"));
        link
    }

    /// The head's address on this link.
    pub fn head_addr(&self) -> Ipv4Addr {
        self.head
    }

    /// The worker's address on this link.
    pub fn worker_addr(&self) -> Ipv4Addr {
        self.worker
    }

    /// The worker's end of the pair, in the worker's namespace.
    pub fn worker_dev(&self) -> &str {
        &self.worker_dev
    }

    /// `ip link set DEV up|down` on the worker's end: down, the head's end loses its carrier
    /// and nothing passes; no connection is closed, packets are just lost.
    pub fn set_worker_side(&self, up: bool) {
        let state = if up { "up" } else { "down" };
        tool("ip", &["-n", &self.worker_ns, "link", "set", &self.worker_dev, state]).unwrap_or_else(|e| panic!("{e}"));
    }

    /// Takes the worker's address off its end (or puts it back): the link stays up, and what
    /// the head sends it (over the neighbour entry it still holds) is dropped without a
    /// reply, as a firewall that drops would: no reset, no unreachable, only silence.
    pub fn set_worker_silent(&self, silent: bool) {
        let op = if silent { "del" } else { "add" };
        let address = format!("{}/30", self.worker);
        tool("ip", &["-n", &self.worker_ns, "addr", op, &address, "dev", &self.worker_dev])
            .unwrap_or_else(|e| panic!("{e}"));
    }

    /// Adds `delay` to every packet the head sends on this link (`tc qdisc replace … netem
    /// delay`), so each round trip to the worker takes that much longer; zero removes it.
    /// An error when the kernel has no netem (`CONFIG_NET_SCH_NETEM`).
    pub fn set_delay(&self, delay: Duration) -> Result<(), String> {
        if delay.is_zero() {
            // No qdisc of ours (never set, or already removed) is the same state.
            let _ = tool("tc", &["-n", &self.head_ns, "qdisc", "del", "dev", &self.head_dev, "root"]);
            return Ok(());
        }
        let micros = format!("{}us", delay.as_micros());
        tool("tc", &["-n", &self.head_ns, "qdisc", "replace", "dev", &self.head_dev, "root", "netem", "delay", &micros])
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        // Fails harmlessly when the namespace, and with it the pair, is already gone.
        let _ = tool("ip", &["-n", &self.head_ns, "link", "del", &self.head_dev]);
    }
}

/// An upstream `rpc-server` inside a namespace, bound to one of its addresses (`-H`), with
/// its tensor cache (`-c`, in a directory given as `LLAMA_CACHE`) when asked.  Dropping it
/// kills it (SIGKILL) and reaps it.  The process's own methods ([`RpcProcess`]) are reached
/// through it.
pub struct NsRpcServer {
    process: RpcProcess,
    endpoint: SocketAddrV4,
}

impl NsRpcServer {
    /// Starts `program` (rpc-server) in `netns` on `endpoint` and waits until it accepted a
    /// probe connection from inside the namespace.
    pub fn start(netns: &Netns, program: &Path, endpoint: SocketAddrV4, cache: Option<&Path>) -> Self {
        let mut sh = netns.command("sh");
        let (host, port) = (endpoint.ip().to_string(), endpoint.port().to_string());
        let mut args = vec!["-H", &host, "-p", &port];
        if let Some(cache) = cache {
            args.push("-c");
            sh.env("LLAMA_CACHE", cache);
        }
        let place = format!("rpc-server on {endpoint}");
        let mut process = RpcProcess::spawn(sh, ":", OsStr::new("rpc-server"), program, &args, place);
        process.wait_accepting(|| netns.can_connect(endpoint)).unwrap_or_else(|e| panic!("{e}"));
        Self { process, endpoint }
    }

    /// `ADDRESS:PORT`.
    pub fn endpoint(&self) -> SocketAddrV4 {
        self.endpoint
    }
}

impl Deref for NsRpcServer {
    type Target = RpcProcess;

    fn deref(&self) -> &RpcProcess {
        &self.process
    }
}

impl DerefMut for NsRpcServer {
    fn deref_mut(&mut self) -> &mut RpcProcess {
        &mut self.process
    }
}
