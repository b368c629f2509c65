//! File access beneath the store's root that never follows a symbolic link.
//!
//! Every path below the root is walked one component at a time from a directory's file
//! descriptor: directories are opened with `O_DIRECTORY | O_NOFOLLOW`, files with
//! `O_NOFOLLOW` (and `O_NONBLOCK`, so that a planted FIFO cannot hang a read), and files
//! are made, renamed, linked and removed with the `*at` calls relative to their
//! directory, which never follow a link in the last component either. A symbolic link
//! met anywhere below the root (a planted `-partial` file, a manifest directory, a blob)
//! is refused with [`Refusal`]; nothing is read, written or deleted through it.
//!
//! Why a walk per component rather than `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`:
//! `openat2` needs Linux 5.6 and some container seccomp filters refuse it, while the
//! store's paths are at most five components deep, so the walk costs a few system calls
//! and works on every kernel. rustix gives these calls over owned descriptors without
//! `unsafe` (nix's equivalents take raw descriptors). The one exception is
//! [`Dir::quick_stat`], on every request's path: there one `openat2` (then `fstat` and
//! `close`) does what the walk does in nine calls, where the kernel has it, and the walk
//! still answers everything else.
//!
//! The root itself is opened following links: where it is, is the administrator's choice.

use std::ffi::OsStr;
use std::fmt;
use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::SystemTime;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags};

/// Why an entry of the store was not used: it is not what the store keeps there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// A symbolic link, which the store never follows.
    Symlink,
    /// Something other than a regular file where a file belongs (a FIFO, a device, a directory).
    NotAFile,
    /// Something other than a directory where a directory belongs.
    NotADirectory,
}

impl Refusal {
    /// The reason, for an error message.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            Self::Symlink => "it is a symbolic link, and the store never follows one",
            Self::NotAFile => "it is not a regular file",
            Self::NotADirectory => "it is not a directory",
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.reason())
    }
}

impl std::error::Error for Refusal {}

/// The refusal an I/O error carries, if it is one.
pub(crate) fn refusal(error: &io::Error) -> Option<&Refusal> {
    error.get_ref().and_then(|e| e.downcast_ref::<Refusal>())
}

fn refused(refusal: Refusal) -> io::Error {
    io::Error::other(refusal)
}

/// What an entry of a directory is, without following it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    File,
    Dir,
    Symlink,
    Other,
}

impl Kind {
    fn of(file_type: FileType) -> Self {
        match file_type {
            FileType::RegularFile => Self::File,
            FileType::Directory => Self::Dir,
            FileType::Symlink => Self::Symlink,
            _ => Self::Other,
        }
    }
}

/// One entry of a directory.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub(crate) name: String,
    pub(crate) kind: Kind,
}

/// What `stat` tells of an entry, without following it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Meta {
    pub(crate) kind: Kind,
    pub(crate) ino: u64,
    pub(crate) len: u64,
    pub(crate) modified: SystemTime,
    /// The later of the modification and the status change: a hard link or a rename
    /// into the store counts as arriving.
    pub(crate) arrived: SystemTime,
}

impl Meta {
    fn of(stat: &rustix::fs::Stat) -> Self {
        // The field types differ between targets; times before 1970 count as 1970.
        fn time(secs: impl TryInto<u64>, nanos: impl TryInto<u32>) -> SystemTime {
            let (secs, nanos) = (secs.try_into().unwrap_or(0), nanos.try_into().unwrap_or(0));
            SystemTime::UNIX_EPOCH + std::time::Duration::new(secs, nanos.min(999_999_999))
        }
        let modified = time(stat.st_mtime, stat.st_mtime_nsec);
        let changed = time(stat.st_ctime, stat.st_ctime_nsec);
        Self {
            kind: Kind::of(FileType::from_raw_mode(stat.st_mode)),
            ino: stat.st_ino,
            len: u64::try_from(stat.st_size).unwrap_or(0),
            modified,
            arrived: modified.max(changed),
        }
    }
}

/// An open directory of the store, with its path below the root for messages.
#[derive(Debug)]
pub(crate) struct Dir {
    fd: OwnedFd,
    rel: String,
    /// Whether [`Dir::quick_stat`] may try `openat2` (cleared once the kernel or a
    /// seccomp filter refuses it).
    resolves: AtomicBool,
}

impl std::os::fd::AsFd for Dir {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Checks that `name` is one component, so that no call below can walk anywhere else.
fn component(name: &str) -> io::Result<&str> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') || name.contains('\0') {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("\"{name}\" is not a file name")));
    }
    Ok(name)
}

impl Dir {
    /// Opens the store's root (following links: its place is configured).
    pub(crate) fn open_root(path: &Path) -> io::Result<Self> {
        let fd = rustix::fs::open(path, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())?;
        Ok(Self::new(fd, String::new()))
    }

    fn new(fd: OwnedFd, rel: String) -> Self {
        Self { fd, rel, resolves: AtomicBool::new(true) }
    }

    /// The path of `name` in this directory, relative to the store's root.
    pub(crate) fn rel(&self, name: &str) -> String {
        if self.rel.is_empty() { name.to_owned() } else { format!("{}/{name}", self.rel) }
    }

    /// This directory's path relative to the store's root (`""` for the root).
    pub(crate) fn path(&self) -> &str {
        &self.rel
    }

    /// A second handle on the same directory.
    pub(crate) fn try_clone(&self) -> io::Result<Self> {
        Ok(Self {
            fd: self.fd.try_clone()?,
            rel: self.rel.clone(),
            resolves: AtomicBool::new(self.resolves.load(Ordering::Relaxed)),
        })
    }

    /// Why `name` could not be opened as `wanted`: a refusal when it is a link or of
    /// another kind, else `error` itself.
    fn classify(&self, name: &str, error: io::Error, wanted: Kind) -> io::Error {
        if !matches!(error.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR | libc::EISDIR | libc::ENXIO)) {
            return error;
        }
        match self.stat(name) {
            Ok(Some(meta)) if meta.kind == Kind::Symlink => refused(Refusal::Symlink),
            Ok(Some(meta)) if meta.kind != wanted => {
                refused(if wanted == Kind::Dir { Refusal::NotADirectory } else { Refusal::NotAFile })
            }
            _ => error,
        }
    }

    /// Opens subdirectory `name`.
    pub(crate) fn dir(&self, name: &str) -> io::Result<Self> {
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        match rustix::fs::openat(&self.fd, component(name)?, flags, Mode::empty()) {
            Ok(fd) => Ok(Self::new(fd, self.rel(name))),
            Err(e) => Err(self.classify(name, e.into(), Kind::Dir)),
        }
    }

    /// Opens subdirectory `name`, making it first if it is not there.
    pub(crate) fn create_dir(&self, name: &str) -> io::Result<Self> {
        match rustix::fs::mkdirat(&self.fd, component(name)?, Mode::from_raw_mode(0o755)) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(e.into()),
        }
        self.dir(name)
    }

    /// Opens file `name` with `flags` (plus `O_NOFOLLOW`), and checks it is a regular file.
    fn open_with(&self, name: &str, flags: OFlags, mode: u32) -> io::Result<File> {
        // O_NONBLOCK: opening a planted FIFO must not wait for a writer.
        let flags = flags | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK;
        let fd = rustix::fs::openat(&self.fd, component(name)?, flags, Mode::from_raw_mode(mode))
            .map_err(|e| self.classify(name, e.into(), Kind::File))?;
        let stat = rustix::fs::fstat(&fd)?;
        if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
            return Err(refused(Refusal::NotAFile));
        }
        let flags = rustix::fs::fcntl_getfl(&fd)?;
        rustix::fs::fcntl_setfl(&fd, flags - OFlags::NONBLOCK)?;
        Ok(File::from(fd))
    }

    /// Opens regular file `name` for reading.
    pub(crate) fn open(&self, name: &str) -> io::Result<File> {
        self.open_with(name, OFlags::RDONLY, 0)
    }

    /// Opens regular file `name` for reading and writing, creating it (mode 0644 less the
    /// umask) if `create`, and emptying it if `truncate`.
    pub(crate) fn open_rw(&self, name: &str, create: bool, truncate: bool) -> io::Result<File> {
        let mut flags = OFlags::RDWR;
        if create {
            flags |= OFlags::CREATE;
        }
        if truncate {
            flags |= OFlags::TRUNC;
        }
        self.open_with(name, flags, 0o644)
    }

    /// Creates a new file `name` (it must not exist) with `mode` (less the umask).
    pub(crate) fn create_new(&self, name: &str, mode: u32) -> io::Result<File> {
        self.open_with(name, OFlags::RDWR | OFlags::CREATE | OFlags::EXCL, mode)
    }

    /// What `name` is, without following it; `None` when it is not there.
    pub(crate) fn stat(&self, name: &str) -> io::Result<Option<Meta>> {
        match rustix::fs::statat(&self.fd, component(name)?, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(stat) => Ok(Some(Meta::of(&stat))),
            Err(rustix::io::Errno::NOENT) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// What the entry at `parts` below this directory is, when one `openat2` that refuses
    /// every link on the way (`RESOLVE_NO_SYMLINKS`; the last component, a link included,
    /// is looked at, never followed) can tell; `None` otherwise: a part missing, a link or
    /// not a directory, or no `openat2` here (Linux before 5.6, a seccomp filter). The
    /// caller then walks, which says exactly what is wrong; this only makes the common
    /// case, the path as it should be, one path lookup instead of one per component.
    pub(crate) fn quick_stat(&self, parts: &[&str]) -> Option<Meta> {
        if !self.resolves.load(Ordering::Relaxed) || parts.iter().any(|p| component(p).is_err()) {
            return None;
        }
        let path = parts.join("/");
        let flags = OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let how = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
        match rustix::fs::openat2(&self.fd, path.as_str(), flags, Mode::empty(), how) {
            Ok(fd) => rustix::fs::fstat(&fd).ok().map(|stat| Meta::of(&stat)),
            Err(
                rustix::io::Errno::NOSYS
                | rustix::io::Errno::PERM
                | rustix::io::Errno::INVAL
                | rustix::io::Errno::TOOBIG,
            ) => {
                self.resolves.store(false, Ordering::Relaxed);
                None
            }
            Err(_) => None,
        }
    }

    /// [`Dir::quick_stat`] never tries `openat2` again: as where the kernel refuses it.
    #[cfg(test)]
    pub(crate) fn without_openat2(&self) {
        self.resolves.store(false, Ordering::Relaxed);
    }

    /// Renames `from` in this directory to `to` in `target` (replacing a file there; a
    /// link there is replaced, never followed).
    pub(crate) fn rename(&self, from: &str, target: &Dir, to: &str) -> io::Result<()> {
        rustix::fs::renameat(&self.fd, component(from)?, &target.fd, component(to)?).map_err(Into::into)
    }

    /// Removes the file (or link: never what it points to) `name`.
    pub(crate) fn remove_file(&self, name: &str) -> io::Result<()> {
        rustix::fs::unlinkat(&self.fd, component(name)?, AtFlags::empty()).map_err(Into::into)
    }

    /// Removes the empty directory `name`.
    pub(crate) fn remove_dir(&self, name: &str) -> io::Result<()> {
        rustix::fs::unlinkat(&self.fd, component(name)?, AtFlags::REMOVEDIR).map_err(Into::into)
    }

    /// Makes `name` a hard link to `source` (a path outside the store, or `source_dir`'s
    /// entry): linkat never follows a link, so a link is linked as a link, which the
    /// caller's check of the result then refuses.
    pub(crate) fn link_from(&self, source_dir: Option<&Dir>, source: &Path, name: &str) -> io::Result<()> {
        let to = component(name)?;
        match source_dir {
            Some(dir) => rustix::fs::linkat(&dir.fd, source, &self.fd, to, AtFlags::empty()),
            None => rustix::fs::linkat(rustix::fs::CWD, source, &self.fd, to, AtFlags::empty()),
        }
        .map_err(Into::into)
    }

    /// The entries of this directory (`.` and `..` left out), each with its kind.
    pub(crate) fn entries(&self) -> io::Result<Vec<Entry>> {
        let mut out = Vec::new();
        for entry in rustix::fs::Dir::read_from(&self.fd)? {
            let entry = entry?;
            let bytes = entry.file_name().to_bytes();
            if bytes == b"." || bytes == b".." {
                continue;
            }
            let Some(name) = OsStr::from_bytes(bytes).to_str() else { continue };
            let mut kind = Kind::of(entry.file_type());
            if entry.file_type() == FileType::Unknown {
                // Some file systems do not say in the listing; ask, without following.
                kind = match self.stat(name) {
                    Ok(Some(meta)) => meta.kind,
                    Ok(None) => continue,
                    Err(_) => Kind::Other,
                };
            }
            out.push(Entry { name: name.to_owned(), kind });
        }
        Ok(out)
    }

    /// Flushes the directory's entries to disk (after a rename into it).
    pub(crate) fn sync(&self) -> io::Result<()> {
        rustix::fs::fsync(&self.fd).map_err(Into::into)
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::{Dir, Kind, Refusal, refusal};

    #[test]
    fn links_and_other_kinds_are_refused_and_never_followed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let outside = tempfile::tempdir().expect("outside");
        std::fs::write(outside.path().join("secret"), b"secret").expect("write");
        symlink(outside.path().join("secret"), dir.path().join("file-link")).expect("symlink");
        symlink(outside.path(), dir.path().join("dir-link")).expect("symlink");
        std::fs::create_dir(dir.path().join("sub")).expect("mkdir");
        nix::unistd::mkfifo(&dir.path().join("fifo"), nix::sys::stat::Mode::S_IRWXU).expect("fifo");
        let root = Dir::open_root(dir.path()).expect("root");

        let e = root.open("file-link").expect_err("a link");
        assert_eq!(refusal(&e), Some(&Refusal::Symlink), "{e}");
        let e = root.open_rw("file-link", true, true).expect_err("a link");
        assert_eq!(refusal(&e), Some(&Refusal::Symlink), "{e}");
        let e = root.dir("dir-link").expect_err("a link");
        assert_eq!(refusal(&e), Some(&Refusal::Symlink), "{e}");
        let e = root.create_dir("dir-link").expect_err("a link");
        assert_eq!(refusal(&e), Some(&Refusal::Symlink), "{e}");
        let e = root.open("fifo").expect_err("a FIFO");
        assert_eq!(refusal(&e), Some(&Refusal::NotAFile), "{e}");
        let e = root.open("sub").expect_err("a directory");
        assert_eq!(refusal(&e), Some(&Refusal::NotAFile), "{e}");
        assert!(root.open("../x").is_err() && root.dir("..").is_err(), "one component only");

        // Renaming over a link replaces the link; removing one removes the link.
        root.create_new("new", 0o600).expect("create");
        root.rename("new", &root, "file-link").expect("rename");
        assert_eq!(root.stat("file-link").expect("stat").expect("there").kind, Kind::File);
        root.remove_file("dir-link").expect("remove");
        assert_eq!(std::fs::read(outside.path().join("secret")).expect("untouched"), b"secret");

        // The one-call stat tells a file and a link as they are, and leaves everything
        // else (a link on the way, a missing part) to the walk; without openat2, all of it.
        std::fs::write(dir.path().join("sub/file"), b"data").expect("write");
        symlink(outside.path().join("secret"), dir.path().join("sub/link")).expect("symlink");
        symlink(outside.path(), dir.path().join("sub/dir-link")).expect("symlink");
        let quick = |parts: &[&str]| root.quick_stat(parts).map(|meta| meta.kind);
        assert_eq!(quick(&["sub", "file"]), Some(Kind::File), "openat2 is there on the kernels tested on");
        assert_eq!(quick(&["sub", "link"]), Some(Kind::Symlink), "a link at the end is looked at, not followed");
        assert_eq!(quick(&["sub", "dir-link", "secret"]), None, "a link on the way");
        assert_eq!(quick(&["sub", "missing"]), None);
        assert_eq!(quick(&["sub", "..", "sub", "file"]), None, "one component per part");
        root.without_openat2();
        assert_eq!(quick(&["sub", "file"]), None, "the walk answers where openat2 is refused");
        for name in ["file", "link", "dir-link"] {
            std::fs::remove_file(dir.path().join("sub").join(name)).expect("remove");
        }

        let mut names: Vec<(String, Kind)> =
            root.entries().expect("entries").into_iter().map(|e| (e.name, e.kind)).collect();
        names.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(names, [("fifo".into(), Kind::Other), ("file-link".into(), Kind::File), ("sub".into(), Kind::Dir)]);
    }
}
