//! No llama-server outlives corrald: with process groups and a parent-death signal when
//! there is no cgroup tree, with per-runner cgroups on a real cgroup2 hierarchy, and
//! under real systemd as PID 1 (the shipped unit). corrald runs as a whole process with
//! two models preloaded (`chat` and `embed`, two runners), so that it can be killed with
//! SIGKILL with runners loaded.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use corral::supervisor::cgroup::cgroup2_mount;
use nix::sys::signal::Signal;
use nix::unistd::Pid;

use crate::support::container::{Container, poll_until};
use crate::support::corrald::{CORRALD, Corrald, free_port, write_config};
use crate::support::notify::NotifyListener;
use crate::systemd_container::{install_with_preloads, wait_active_state};

const WAIT: Duration = Duration::from_secs(60);

/// True while `pid` exists and is not a zombie.
fn alive(pid: Pid) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|stat| stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')))
}

/// The live `llama-server` children of `parent`, from `/proc`.
fn runners_of(parent: Pid) -> Vec<Pid> {
    let mut runners: Vec<Pid> = std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|entry| {
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            // `PID (COMM) STATE PPID …`; COMM may hold spaces and parentheses.
            let (head, rest) = stat.rsplit_once(") ")?;
            let (pid, comm) = head.split_once(" (")?;
            let mut fields = rest.split_whitespace();
            let (state, parent_id) = (fields.next()?, fields.next()?);
            let ours = comm == "llama-server" && state != "Z" && parent_id == parent.to_string();
            ours.then(|| pid.parse().ok().map(Pid::from_raw)).flatten()
        })
        .collect();
    runners.sort();
    runners
}

/// corrald's configuration: the demo store in `dir` (`chat`, `embed`) with both models
/// preloaded, the real llama-server, CPU only.
fn preloading_config(dir: &Path) -> PathBuf {
    crate::support::api::demo_store(dir);
    write_config(
        dir,
        "corral.toml",
        &format!(
            "[server]\nlisten = [\"127.0.0.1:{}\"]\n[store]\npath = \"{}\"\n[runner]\nllama_server = \"{}\"\n\
             [scheduler]\nnum_ctx = 512\n[gpu]\nfixed = true\nhost_memory = \"4GiB\"\n\
             [models.\"chat\"]\npreload = true\n[models.\"embed\"]\npreload = true\n",
            free_port(),
            dir.join("models").display(),
            crate::support::llama::bin_dir().join("llama-server").display(),
        ),
    )
}

/// Waits until corrald reports both preloaded models ready (its `STATUS=`), then returns
/// its two runners.
fn wait_two_runners(corrald: &Corrald, notify: &NotifyListener) -> Vec<Pid> {
    poll_until(WAIT, "corrald to report two models loaded", || {
        let statuses: Vec<String> = notify.messages().into_iter().filter_map(|m| m.get("STATUS").cloned()).collect();
        if statuses.iter().any(|s| s.ends_with("; 2 models loaded")) {
            Ok(())
        } else {
            Err(format!("STATUS so far: {statuses:?}\n{}", corrald.stderr()))
        }
    });
    let runners = runners_of(corrald.pid());
    assert_eq!(runners.len(), 2, "two llama-server children: {runners:?}\n{}", corrald.stderr());
    assert!(runners.iter().all(|pid| alive(*pid)));
    runners
}

#[test]
fn sigkill_of_corrald_leaves_no_runner_without_cgroups() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = preloading_config(dir.path());
    let notify = NotifyListener::start();
    let mut corrald = Corrald::start(&["--config", config.to_str().expect("utf-8")], Some(notify.path()));
    let runners = wait_two_runners(&corrald, &notify);
    corrald.signal(Signal::SIGKILL);
    corrald.wait_exit(WAIT);
    poll_until(WAIT, "both runners to die with corrald", || {
        let left: Vec<Pid> = runners.iter().copied().filter(|pid| alive(*pid)).collect();
        if left.is_empty() { Ok(()) } else { Err(format!("still alive: {left:?}")) }
    });
}

/// A scratch cgroup on this machine's cgroup2 hierarchy, standing in for a service's
/// delegated one (named `….service`, as corrald adopts only a service's cgroup); removed
/// (with anything left in it) on drop.
struct ScratchCgroup(PathBuf);

impl ScratchCgroup {
    fn create() -> Self {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
        let fs = cgroup2_mount(&mountinfo).expect("cgroup2 is mounted");
        let path = fs.join(format!("corral-it-{}.service", std::process::id()));
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

/// The `runner-*` cgroups below `root`, by name.
fn runner_cgroups(root: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(root)
        .expect("read the cgroup")
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("runner-"))
        .collect();
    names.sort();
    names
}

#[test]
fn runners_get_their_own_cgroups_and_stale_ones_are_killed_at_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = preloading_config(dir.path());
    let root = ScratchCgroup::create();

    // A runner left by an earlier instance: a cgroup with a process in it.
    let stale_cgroup = root.0.join("runner-99");
    std::fs::create_dir(&stale_cgroup).expect("stale cgroup");
    let mut stale = ScratchCgroup::run_in(&stale_cgroup, "sleep", &["1000"]).spawn().expect("stale process");
    let stale_pid = Pid::from_raw(i32::try_from(stale.id()).expect("pid"));
    poll_until(WAIT, "the stale process in its cgroup", || {
        if procs(&stale_cgroup).contains(&stale_pid) { Ok(()) } else { Err("not yet".to_owned()) }
    });

    let notify = NotifyListener::start();
    let args = ["--log-target", "stderr", "--config", config.to_str().expect("utf-8")];
    let mut cmd = ScratchCgroup::run_in(&root.0, CORRALD, &args);
    cmd.env("NOTIFY_SOCKET", notify.path());
    let mut corrald = Corrald::spawn(cmd);
    let runners = wait_two_runners(&corrald, &notify);

    let _ = stale.wait();
    assert!(!stale_cgroup.exists(), "the stale runner cgroup is killed and removed");
    assert_eq!(procs(&root.0.join("daemon")), vec![corrald.pid()], "corrald moved itself into a leaf");
    let cgroups = runner_cgroups(&root.0);
    assert_eq!(cgroups, ["runner-1", "runner-2"], "a cgroup per runner");
    let mut inside: Vec<Pid> = cgroups
        .iter()
        .map(|name| {
            let pids = procs(&root.0.join(name));
            assert_eq!(pids.len(), 1, "one runner sits alone in {name}: {pids:?}");
            pids[0]
        })
        .collect();
    inside.sort();
    assert_eq!(inside, runners, "the runners are the processes in the runner cgroups");

    // A clean stop removes the runner cgroups.
    corrald.signal(Signal::SIGTERM);
    assert!(corrald.wait_exit(WAIT).success(), "{}", corrald.stderr());
    assert!(runners.iter().all(|pid| !alive(*pid)));
    assert!(runner_cgroups(&root.0).is_empty(), "runner cgroups removed");
}

#[test]
fn under_systemd_a_sigkilled_corrald_leaves_no_llama_server() {
    let ct = Container::boot("containment");
    install_with_preloads(&ct, &["chat", "embed"]);
    // systemd would start corrald again (`Restart=on-failure`), and it would load its
    // models again: this test is about the killed instance's runners.
    std::fs::write(ct.share_dir().join("no-restart.conf"), "[Service]\nRestart=no\n").expect("drop-in");
    let drop_in = "/etc/systemd/system/corrald.service.d/no-restart.conf";
    ct.run(&["install", "-D", "-m", "0644", "/srv/host/no-restart.conf", drop_in]);
    ct.run(&["systemctl", "daemon-reload"]);

    ct.run(&["systemctl", "start", "corrald.service"]);
    poll_until(WAIT, "corrald to report two models loaded", || {
        let status = ct.unit_property("corrald.service", "StatusText");
        if status.ends_with("2 models loaded") { Ok(()) } else { Err(status) }
    });
    let cgroup = "/sys/fs/cgroup/corral.slice/corrald.service";
    let out = ct.exec(&["sh", "-c", &format!("cat {cgroup}/runner-1/cgroup.procs {cgroup}/runner-2/cgroup.procs")]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 2, "two runners in their own cgroups");
    let main_pid = ct.unit_property("corrald.service", "MainPID");
    assert_eq!(ct.run(&["cat", &format!("{cgroup}/daemon/cgroup.procs")]), main_pid);
    assert_eq!(ct.run(&["pgrep", "-c", "-x", "llama-server"]), "2");

    ct.run(&["kill", "-9", &main_pid]);
    poll_until(WAIT, "no llama-server left in the container", || {
        let out = ct.exec(&["pgrep", "-x", "llama-server"]);
        let left = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        if left.is_empty() { Ok(()) } else { Err(format!("still running: {left}")) }
    });
    wait_active_state(&ct, "corrald.service", "failed");
}
