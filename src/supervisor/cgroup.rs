//! Per-runner cgroups inside the service's delegated cgroup2 subtree.
//!
//! Under systemd with `Delegate=yes`, corrald owns its service cgroup.  cgroup2 lets
//! only leaves hold processes once controllers are enabled, so the daemon first moves
//! itself into `<service>/daemon`; each runner then gets a sibling
//! `<service>/runner-<id>`, with `memory.max` when a limit is set, `memory.current` and
//! `memory.peak` for reporting, and `cgroup.kill` to end everything in it at once.
//!
//! Where no writable, delegated cgroup2 tree exists (started by hand, or in the root
//! cgroup), [`CgroupTree::adopt`] returns `None` and runners fall back to a process group
//! plus a parent-death signal.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The prefix of runner cgroup names.
const RUNNER_PREFIX: &str = "runner-";

/// Where cgroup2 is mounted, from the text of `/proc/self/mountinfo`: `/sys/fs/cgroup`
/// on a unified host, `/sys/fs/cgroup/unified` on a hybrid one.
#[must_use]
pub fn cgroup2_mount(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        // "ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER"
        let (fields, fs) = line.split_once(" - ")?;
        if fs.split_whitespace().next() != Some("cgroup2") {
            return None;
        }
        fields.split_whitespace().nth(4).map(PathBuf::from)
    })
}

/// The service's delegated cgroup, with the daemon moved into its `daemon` leaf.
#[derive(Debug, Clone)]
pub struct CgroupTree {
    root: PathBuf,
    memory_controller: bool,
}

impl CgroupTree {
    /// Takes over the delegated subtree this process runs in, if there is one.
    ///
    /// `cgroup_fs` is where cgroup2 is mounted (`/sys/fs/cgroup`), `proc_self_cgroup` the
    /// text of `/proc/self/cgroup`.  A tree is adopted only when this process sits in a
    /// cgroup2 cgroup other than the root, whose directory it may write, which is what
    /// `Delegate=yes` grants.
    pub fn adopt(cgroup_fs: &Path, proc_self_cgroup: &str) -> io::Result<Option<Self>> {
        let Some(own) = proc_self_cgroup.lines().find_map(|l| l.strip_prefix("0::")) else { return Ok(None) };
        let own = own.trim().trim_start_matches('/');
        if own.is_empty() {
            return Ok(None);
        }
        let mut root = cgroup_fs.join(own);
        // After a restart in the same service cgroup the daemon may already sit in its leaf.
        if root.file_name().is_some_and(|n| n == "daemon") {
            root.pop();
        }
        if !root.join("cgroup.procs").exists() || !writable(&root) {
            return Ok(None);
        }
        let leaf = root.join("daemon");
        match fs::create_dir(&leaf) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        // Writing 0 moves the writing process (all its threads) into the cgroup.
        fs::write(leaf.join("cgroup.procs"), "0")?;
        let available = fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
        let memory_controller = available.split_whitespace().any(|c| c == "memory")
            && fs::write(root.join("cgroup.subtree_control"), "+memory").is_ok();
        Ok(Some(Self { root, memory_controller }))
    }

    /// Adopts the tree when this process runs as a systemd service (its cgroup is
    /// `….service`, or the `daemon` leaf below one): only there does `Delegate=yes` hand the
    /// subtree over.  A daemon started by hand, in the root cgroup or in a login session's
    /// scope, leaves cgroups alone and uses process groups.
    pub fn adopt_if_service() -> io::Result<Option<Self>> {
        let own = fs::read_to_string("/proc/self/cgroup")?;
        let mountinfo = fs::read_to_string("/proc/self/mountinfo")?;
        let Some(cgroup_fs) = cgroup2_mount(&mountinfo) else { return Ok(None) };
        if !is_service_cgroup(&own) {
            return Ok(None);
        }
        Self::adopt(&cgroup_fs, &own)
    }

    /// The service cgroup corral manages.
    #[must_use]
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Kills and removes runner cgroups an earlier daemon instance left behind.
    /// Returns the names of those it cleaned.
    pub fn kill_stale(&self) -> io::Result<Vec<String>> {
        let mut cleaned = Vec::new();
        for entry in fs::read_dir(&self.root)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(RUNNER_PREFIX) && entry.file_type()?.is_dir() {
                RunnerCgroup { path: entry.path() }.kill_and_remove(Duration::from_secs(5))?;
                cleaned.push(name);
            }
        }
        Ok(cleaned)
    }

    /// Creates the cgroup for runner `id`, limited to `memory_max` bytes when given.
    pub fn create_runner(&self, id: u64, memory_max: Option<u64>) -> io::Result<RunnerCgroup> {
        let path = self.root.join(format!("{RUNNER_PREFIX}{id}"));
        fs::create_dir(&path)?;
        let cgroup = RunnerCgroup { path };
        if let Some(limit) = memory_max {
            if !self.memory_controller {
                let _ = cgroup.remove();
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "a memory limit is configured but the memory controller is not delegated to corrald",
                ));
            }
            fs::write(cgroup.path.join("memory.max"), limit.to_string())?;
        }
        Ok(cgroup)
    }
}

/// One runner's cgroup.
#[derive(Debug)]
pub struct RunnerCgroup {
    path: PathBuf,
}

/// Memory use from a runner's cgroup, where the memory controller is available.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryUsage {
    /// `memory.current`.
    pub current: u64,
    /// `memory.peak`, on kernels that have it.
    pub peak: Option<u64>,
}

impl RunnerCgroup {
    /// The cgroup's directory.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens `cgroup.procs` for writing, so a child can move itself in between fork and exec.
    pub fn procs_file(&self) -> io::Result<fs::File> {
        fs::OpenOptions::new().write(true).open(self.path.join("cgroup.procs"))
    }

    /// Current and peak memory, if the memory controller is on.
    #[must_use]
    pub fn memory(&self) -> Option<MemoryUsage> {
        let read = |name: &str| fs::read_to_string(self.path.join(name)).ok()?.trim().parse().ok();
        Some(MemoryUsage { current: read("memory.current")?, peak: read("memory.peak") })
    }

    /// Kills every process in the cgroup, waits for it to empty, and removes it.
    pub fn kill_and_remove(&self, timeout: Duration) -> io::Result<()> {
        if fs::write(self.path.join("cgroup.kill"), "1").is_err() {
            // Kernels before 5.14 have no cgroup.kill: signal each process instead.
            for pid in fs::read_to_string(self.path.join("cgroup.procs"))?.lines() {
                if let Ok(pid) = pid.trim().parse::<i32>() {
                    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
                }
            }
        }
        let deadline = Instant::now() + timeout;
        while populated(&self.path)? {
            if Instant::now() > deadline {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "processes remain after cgroup.kill"));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        self.remove()
    }

    /// Removes the (empty) cgroup.
    pub fn remove(&self) -> io::Result<()> {
        match fs::remove_dir(&self.path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            other => other,
        }
    }
}

/// True when the cgroup2 entry of `proc_self_cgroup` names a service's cgroup or its `daemon` leaf.
fn is_service_cgroup(proc_self_cgroup: &str) -> bool {
    let Some(own) = proc_self_cgroup.lines().find_map(|l| l.strip_prefix("0::")) else { return false };
    let own = own.trim().trim_end_matches("/daemon");
    own.rsplit('/').next().is_some_and(|unit| unit.ends_with(".service"))
}

fn populated(path: &Path) -> io::Result<bool> {
    let events = match fs::read_to_string(path.join("cgroup.events")) {
        Ok(events) => events,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    Ok(events.lines().any(|l| l == "populated 1"))
}

fn writable(dir: &Path) -> bool {
    nix::unistd::access(dir, nix::unistd::AccessFlags::W_OK).is_ok()
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::{CgroupTree, MemoryUsage, RunnerCgroup, cgroup2_mount, is_service_cgroup};

    #[test]
    fn the_cgroup2_mount_is_found_on_unified_and_hybrid_hosts() {
        let unified =
            "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n";
        assert_eq!(cgroup2_mount(unified).as_deref(), Some(Path::new("/sys/fs/cgroup")));
        let hybrid = "25 24 0:22 / /sys/fs/cgroup ro - tmpfs tmpfs ro,mode=755\n\
                      41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n\
                      42 31 0:39 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n";
        assert_eq!(cgroup2_mount(hybrid).as_deref(), Some(Path::new("/sys/fs/cgroup/unified")));
        assert_eq!(cgroup2_mount("42 31 0:39 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"), None);
        assert_eq!(cgroup2_mount(""), None);
    }

    #[test]
    fn only_a_service_cgroup_counts_as_delegated() {
        assert!(is_service_cgroup("0::/corral.slice/corrald.service\n"));
        assert!(is_service_cgroup("0::/corral.slice/corrald.service/daemon\n"));
        assert!(is_service_cgroup("12:pids:/x\n0::/system.slice/corral-harness.service\n"));
        assert!(!is_service_cgroup("0::/\n"));
        assert!(!is_service_cgroup("0::/user.slice/user-0.slice/session-1.scope\n"));
        assert!(!is_service_cgroup("1:name=systemd:/system.slice/corrald.service\n"));
    }

    #[test]
    fn memory_figures_are_read_from_the_cgroup() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cgroup = RunnerCgroup { path: dir.path().to_owned() };
        assert_eq!(cgroup.memory(), None, "no memory controller, no figures");
        std::fs::write(dir.path().join("memory.current"), "123456\n").expect("write");
        assert_eq!(cgroup.memory(), Some(MemoryUsage { current: 123_456, peak: None }));
        std::fs::write(dir.path().join("memory.peak"), "234567\n").expect("write");
        assert_eq!(cgroup.memory(), Some(MemoryUsage { current: 123_456, peak: Some(234_567) }));
    }

    #[test]
    fn a_memory_limit_without_the_memory_controller_is_refused_and_leaves_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tree = CgroupTree { root: dir.path().to_owned(), memory_controller: false };
        let err = tree.create_runner(7, Some(1 << 30)).expect_err("no controller");
        assert!(err.to_string().contains("memory controller is not delegated"), "{err}");
        assert!(!dir.path().join("runner-7").exists());
        let runner = tree.create_runner(8, None).expect("no limit, no controller needed");
        assert!(runner.path().is_dir());
    }

    #[test]
    fn no_tree_in_the_root_cgroup_or_on_cgroup_v1_only() {
        let fs = tempfile::tempdir().expect("tempdir");
        assert!(CgroupTree::adopt(fs.path(), "0::/\n").expect("adopt").is_none());
        assert!(CgroupTree::adopt(fs.path(), "1:name=systemd:/x\n").expect("adopt").is_none());
        assert!(CgroupTree::adopt(fs.path(), "").expect("adopt").is_none());
    }

    #[test]
    fn no_tree_where_the_cgroup_directory_is_missing() {
        let fs = tempfile::tempdir().expect("tempdir");
        assert!(CgroupTree::adopt(fs.path(), "0::/corral.slice/corrald.service\n").expect("adopt").is_none());
    }
}
