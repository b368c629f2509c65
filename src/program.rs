//! Finding an executable as a shell would: a path as given, or a bare name looked up on
//! `PATH`. A handful of lines, so no crate; the children's `PATH` is the daemon's.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

/// Why a program cannot be run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotRunnable {
    /// A bare name that no directory on `PATH` holds as an executable.
    NotOnPath,
    /// A path that names nothing, or something that is not an executable file: why.
    Unusable(String),
}

/// Where `program` (a path, or a bare name looked up on `path`) resolves to.
///
/// # Errors
/// Why it cannot be run.
pub fn locate(program: &Path, path: &OsStr) -> Result<PathBuf, NotRunnable> {
    if program.is_absolute() || program.components().count() > 1 {
        return executable(program).map(|()| program.to_owned()).map_err(NotRunnable::Unusable);
    }
    std::env::split_paths(path)
        .map(|dir| dir.join(program))
        .find(|candidate| executable(candidate).is_ok())
        .ok_or(NotRunnable::NotOnPath)
}

/// Ok when `path` is a file this process may execute, else why not.
///
/// # Errors
/// Why not, for a message: "does not exist", "is not a file", "is not executable: …".
pub fn executable(path: &Path) -> Result<(), String> {
    let metadata = std::fs::metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => "does not exist".to_owned(),
        _ => format!("cannot be read: {e}"),
    })?;
    if !metadata.is_file() {
        return Err("is not a file".to_owned());
    }
    nix::unistd::access(path, nix::unistd::AccessFlags::X_OK).map_err(|e| format!("is not executable: {}", e.desc()))
}
