//! No llama-server outlives its supervisor: with process groups and a parent-death
//! signal when there is no cgroup tree, with per-runner cgroups on a real cgroup2
//! hierarchy, and under real systemd as PID 1. The supervisor runs as a whole process
//! (`supervise-harness`) so that it can be killed with SIGKILL with runners loaded.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use corral::supervisor::cgroup::cgroup2_mount;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::support::container::{Container, poll_until};
use crate::support::llama;

const HARNESS: &str = env!("CARGO_BIN_EXE_supervise-harness");
const WAIT: Duration = Duration::from_secs(60);

/// True while `pid` exists and is not a zombie.
fn alive(pid: Pid) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|stat| stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')))
}

/// Two copies of the tiny model (two runners of different models).
fn two_models(dir: &Path) -> Vec<PathBuf> {
    ["alpha.gguf", "beta.gguf"]
        .iter()
        .map(|name| {
            let path = dir.join(name);
            corral::demo_model::write_tiny_llama(&path).expect("write model");
            path
        })
        .collect()
}

/// The harness as a child; killed on drop if still running.
struct Harness {
    child: Child,
    stdout: BufReader<ChildStdout>,
}

impl Harness {
    fn start(cmd: &mut Command) -> Self {
        let mut child = cmd.stdout(Stdio::piped()).stdin(Stdio::null()).spawn().expect("start supervise-harness");
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        Self { child, stdout }
    }

    /// Reads `ready <id> <pid>` lines until `n` runners are ready; returns their pids.
    fn wait_ready(&mut self, n: usize) -> Vec<Pid> {
        let mut pids = Vec::new();
        while pids.len() < n {
            let mut line = String::new();
            let read = self.stdout.read_line(&mut line).expect("read harness stdout");
            assert!(read > 0, "the harness ended before {n} runners were ready ({:?})", self.child.try_wait());
            let pid: i32 = line.split_whitespace().nth(2).and_then(|p| p.parse().ok()).expect("ready <id> <pid>");
            pids.push(Pid::from_raw(pid));
        }
        pids
    }

    fn pid(&self) -> Pid {
        Pid::from_raw(i32::try_from(self.child.id()).expect("pid"))
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn harness_command(runtime: &Path, extra: &[&str], models: &[PathBuf]) -> Command {
    let mut cmd = Command::new(HARNESS);
    cmd.arg("--llama-server").arg(llama::bin_dir().join("llama-server")).arg("--runtime-dir").arg(runtime);
    cmd.args(extra).args(models);
    cmd
}

#[test]
fn sigkill_of_the_supervisor_leaves_no_runner_without_cgroups() {
    let dir = tempfile::tempdir().expect("tempdir");
    let models = two_models(dir.path());
    let mut harness = Harness::start(&mut harness_command(dir.path(), &[], &models));
    let runners = harness.wait_ready(2);
    assert!(runners.iter().all(|pid| alive(*pid)));
    kill(harness.pid(), Signal::SIGKILL).expect("kill the supervisor");
    let _ = harness.child.wait();
    poll_until(WAIT, "both runners to die with their supervisor", || {
        let left: Vec<Pid> = runners.iter().copied().filter(|pid| alive(*pid)).collect();
        if left.is_empty() { Ok(()) } else { Err(format!("still alive: {left:?}")) }
    });
}

/// A scratch cgroup on this machine's cgroup2 hierarchy, standing in for a service's
/// delegated one; removed (with anything left in it) on drop.
struct ScratchCgroup(PathBuf);

impl ScratchCgroup {
    fn create() -> Self {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
        let fs = cgroup2_mount(&mountinfo).expect("cgroup2 is mounted");
        let path = fs.join(format!("corral-it-{}", std::process::id()));
        std::fs::create_dir(&path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
        Self(path)
    }

    /// A shell command that moves itself into `cgroup` and then runs `program`.
    fn run_in(cgroup: &Path, program: &str, args: &[&str]) -> Command {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", r#"echo $$ > "$0/cgroup.procs" && exec "$@""#]).arg(cgroup).arg(program).args(args);
        cmd
    }
}

impl Drop for ScratchCgroup {
    fn drop(&mut self) {
        let Ok(entries) = std::fs::read_dir(&self.0) else { return };
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                let _ = std::fs::write(entry.path().join("cgroup.kill"), "1");
                let _ = poll_cgroup_empty(&entry.path());
                let _ = std::fs::remove_dir(entry.path());
            }
        }
        let _ = std::fs::remove_dir(&self.0);
    }
}

fn poll_cgroup_empty(path: &Path) -> bool {
    for _ in 0..500 {
        match std::fs::read_to_string(path.join("cgroup.events")) {
            Ok(events) if events.lines().any(|l| l == "populated 1") => std::thread::sleep(Duration::from_millis(10)),
            _ => return true,
        }
    }
    false
}

fn procs(cgroup: &Path) -> Vec<Pid> {
    std::fs::read_to_string(cgroup.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .map(Pid::from_raw)
        .collect()
}

#[test]
fn runners_get_their_own_cgroups_and_stale_ones_are_killed_at_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    let models = two_models(dir.path());
    let root = ScratchCgroup::create();

    // A runner left by an earlier instance: a cgroup with a process in it.
    let stale_cgroup = root.0.join("runner-99");
    std::fs::create_dir(&stale_cgroup).expect("stale cgroup");
    let mut stale = ScratchCgroup::run_in(&stale_cgroup, "sleep", &["1000"]).spawn().expect("stale process");
    let stale_pid = Pid::from_raw(i32::try_from(stale.id()).expect("pid"));
    poll_until(WAIT, "the stale process in its cgroup", || {
        if procs(&stale_cgroup).contains(&stale_pid) { Ok(()) } else { Err("not yet".to_owned()) }
    });

    let llama_server = llama::bin_dir().join("llama-server");
    let mut args = vec![
        "--llama-server".to_owned(),
        llama_server.display().to_string(),
        "--runtime-dir".to_owned(),
        dir.path().display().to_string(),
        "--cgroups".to_owned(),
    ];
    args.extend(models.iter().map(|m| m.display().to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut harness = Harness::start(&mut ScratchCgroup::run_in(&root.0, HARNESS, &args));
    let runners = harness.wait_ready(2);

    let _ = stale.wait();
    assert!(!stale_cgroup.exists(), "the stale runner cgroup is killed and removed");
    assert_eq!(procs(&root.0.join("daemon")), vec![harness.pid()], "the supervisor moved itself into a leaf");
    for (i, pid) in runners.iter().enumerate() {
        let cgroup = root.0.join(format!("runner-{}", i + 1));
        assert_eq!(procs(&cgroup), vec![*pid], "runner {} sits alone in {}", i + 1, cgroup.display());
    }

    // A clean stop removes the runner cgroups.
    kill(harness.pid(), Signal::SIGTERM).expect("SIGTERM");
    assert!(harness.child.wait().expect("wait").success());
    assert!(runners.iter().all(|pid| !alive(*pid)));
    assert!(!root.0.join("runner-1").exists() && !root.0.join("runner-2").exists(), "runner cgroups removed");
}

#[test]
fn under_systemd_a_sigkilled_supervisor_leaves_no_llama_server() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ct = Container::boot("containment");
    let share = ct.share_dir();
    for model in two_models(dir.path()) {
        std::fs::copy(&model, share.join(model.file_name().expect("name"))).expect("stage model");
    }
    std::fs::copy(llama::bin_dir().join("llama-server"), share.join("llama-server")).expect("stage llama-server");
    std::fs::copy(HARNESS, share.join("supervise-harness")).expect("stage harness");

    ct.run(&[
        "systemd-run",
        "--unit=corral-harness",
        "-p",
        "Delegate=yes",
        "-p",
        "KillMode=mixed",
        "/srv/host/supervise-harness",
        "--llama-server",
        "/srv/host/llama-server",
        "--runtime-dir",
        "/run",
        "--cgroups",
        "/srv/host/alpha.gguf",
        "/srv/host/beta.gguf",
    ]);
    let cgroup = "/sys/fs/cgroup/system.slice/corral-harness.service";
    poll_until(WAIT, "two runners in their own cgroups", || {
        let out = ct.exec(&["sh", "-c", &format!("cat {cgroup}/runner-1/cgroup.procs {cgroup}/runner-2/cgroup.procs")]);
        let pids = String::from_utf8_lossy(&out.stdout).lines().count();
        if pids == 2 { Ok(()) } else { Err(format!("{pids} runner processes so far")) }
    });
    let main_pid = ct.unit_property("corral-harness.service", "MainPID");
    assert_eq!(ct.run(&["cat", &format!("{cgroup}/daemon/cgroup.procs")]), main_pid);
    assert_eq!(ct.run(&["pgrep", "-c", "-x", "llama-server"]), "2");

    ct.run(&["kill", "-9", &main_pid]);
    poll_until(WAIT, "no llama-server left in the container", || {
        let out = ct.exec(&["pgrep", "-x", "llama-server"]);
        let left = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        if left.is_empty() { Ok(()) } else { Err(format!("still running: {left}")) }
    });
}
