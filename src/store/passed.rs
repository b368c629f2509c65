//! Files a caller hands corrald as open descriptors (D-Bus `CreateWithFiles`) instead of
//! naming them by path: corrald reads what the caller could read, wherever it is (its unit
//! hides `/home`), with no copy of the bytes through the caller first.
//!
//! The descriptor comes from whoever called, so it is checked before anything is read: a
//! regular file (not a pipe, socket, device or directory, which could be endless or block),
//! open for reading (not `O_PATH`, not write-only). It is read at positions of its own
//! (`pread`), never through the file offset it shares with the caller, and only as far as
//! the size it had when it was checked: a file that grows is read to that size, one that
//! shrinks fails the create.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::sync::Arc;

use rustix::fs::OFlags;

use super::StoreError;

/// An open regular file a caller passed, checked, with the size it had then.
#[derive(Debug, Clone)]
pub struct PassedFile {
    file: Arc<File>,
    name: String,
    size: u64,
}

impl PartialEq for PassedFile {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.file, &other.file)
    }
}

impl Eq for PassedFile {}

/// The size of `file`, which `name` names in errors, if it is a regular file; anything else
/// (a pipe, a socket, a device, a directory) could be endless or block a read.
fn regular_size(file: &File, name: &str) -> Result<u64, StoreError> {
    let refuse = |why: &str| StoreError::Invalid(format!("{name}: {why}"));
    let meta = file.metadata().map_err(|e| refuse(&format!("cannot stat it: {e}")))?;
    let kind = meta.file_type();
    let other = [
        (kind.is_dir(), "a directory"),
        (kind.is_fifo(), "a pipe"),
        (kind.is_socket(), "a socket"),
        (kind.is_char_device(), "a character device"),
        (kind.is_block_device(), "a block device"),
    ];
    if let Some((_, what)) = other.iter().find(|(is, _)| *is) {
        return Err(refuse(&format!("{what}, not a regular file")));
    }
    if !kind.is_file() {
        return Err(refuse("not a regular file"));
    }
    Ok(meta.len())
}

/// Opens the file at `path` (outside the store, named by a caller as `name`) for reading,
/// with its size, refusing what [`PassedFile::new`] refuses. Opened with `O_NONBLOCK`, so
/// that a FIFO there cannot hold the open (and the job, which cannot cancel an `open`)
/// waiting for a writer; the flag is cleared once it is known to be a regular file.
pub(super) fn open_regular(path: &std::path::Path, name: &str) -> Result<(File, u64), StoreError> {
    let flags = OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NONBLOCK;
    let cannot = |e: rustix::io::Errno| super::io_err(format!("cannot open {name}"))(e.into());
    let fd = rustix::fs::open(path, flags, rustix::fs::Mode::empty()).map_err(cannot)?;
    let file = File::from(fd);
    let size = regular_size(&file, name)?;
    let status = rustix::fs::fcntl_getfl(&file).map_err(cannot)?;
    rustix::fs::fcntl_setfl(&file, status - OFlags::NONBLOCK).map_err(cannot)?;
    Ok((file, size))
}

impl PassedFile {
    /// Checks `fd`, which the caller calls `name` (how errors name it).
    ///
    /// # Errors
    /// [`StoreError::Invalid`] naming what it is instead of a regular file open for reading.
    pub fn new(fd: OwnedFd, name: &str) -> Result<Self, StoreError> {
        let refuse = |why: &str| StoreError::Invalid(format!("{name}: {why}"));
        let flags = rustix::fs::fcntl_getfl(&fd).map_err(|e| refuse(&format!("cannot read its flags: {e}")))?;
        if flags.contains(OFlags::PATH) {
            return Err(refuse("opened with O_PATH, not for reading"));
        }
        if flags & OFlags::ACCMODE == OFlags::WRONLY {
            return Err(refuse("open for writing only, not for reading"));
        }
        let file = File::from(fd);
        let size = regular_size(&file, name)?;
        Ok(Self { file: Arc::new(file), name: name.to_owned(), size })
    }

    /// What the caller calls it.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its size when it was checked: the bytes a create takes from it.
    #[must_use]
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The open file.
    pub(super) fn file(&self) -> &File {
        &self.file
    }

    /// A reader of its first [`PassedFile::size`] bytes.
    pub(super) fn reader(&self) -> At<'_> {
        At::new(&self.file, self.size)
    }
}

/// Reads a file from positions of its own, up to `end`, as a file of that length: the
/// file's shared offset is never used or moved.
#[derive(Debug)]
pub(super) struct At<'a> {
    file: &'a File,
    pos: u64,
    end: u64,
}

impl<'a> At<'a> {
    /// A reader of `file`'s first `end` bytes, from the first.
    pub(super) fn new(file: &'a File, end: u64) -> Self {
        Self { file, pos: 0, end }
    }
}

impl Read for At<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = usize::try_from(self.end.saturating_sub(self.pos)).unwrap_or(usize::MAX);
        let want = buf.len().min(left);
        if want == 0 {
            return Ok(0);
        }
        let n = self.file.read_at(&mut buf[..want], self.pos)?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl Seek for At<'_> {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let target = match to {
            SeekFrom::Start(n) => Some(n),
            SeekFrom::End(d) => self.end.checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        self.pos = target.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "a seek before the start"))?;
        Ok(self.pos)
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Seek, SeekFrom, Write};
    use std::os::fd::OwnedFd;

    use super::PassedFile;

    fn passed(file: std::fs::File) -> Result<PassedFile, String> {
        PassedFile::new(OwnedFd::from(file), "/x/model.gguf").map_err(|e| e.to_string())
    }

    #[test]
    fn a_regular_file_open_for_reading_is_taken_with_its_size() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("f");
        std::fs::write(&path, b"0123456789").expect("write");
        let file = passed(std::fs::File::open(&path).expect("open")).expect("taken");
        assert_eq!((file.name(), file.size()), ("/x/model.gguf", 10));
        let rw = std::fs::OpenOptions::new().read(true).write(true).open(&path).expect("open rw");
        assert_eq!(passed(rw).expect("read-write is readable").size(), 10);
    }

    #[test]
    fn what_is_not_a_regular_file_open_for_reading_is_refused_by_name() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("f");
        std::fs::write(&path, b"data").expect("write");
        let fifo = dir.path().join("fifo");
        rustix::fs::mknodat(rustix::fs::CWD, &fifo, rustix::fs::FileType::Fifo, rustix::fs::Mode::from(0o600), 0)
            .expect("mkfifo");
        let pipe = rustix::fs::open(&fifo, rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::NONBLOCK, 0.into())
            .expect("open the FIFO");
        let (socket, _other) = std::os::unix::net::UnixStream::pair().expect("socket pair");
        let cases: Vec<(OwnedFd, &str)> = vec![
            (std::fs::File::open(dir.path()).expect("dir").into(), "a directory, not a regular file"),
            (pipe, "a pipe, not a regular file"),
            (socket.into(), "a socket, not a regular file"),
            (std::fs::File::open("/dev/zero").expect("zero").into(), "a character device, not a regular file"),
            (std::fs::OpenOptions::new().write(true).open(&path).expect("wo").into(), "open for writing only"),
            (
                rustix::fs::open(&path, rustix::fs::OFlags::PATH, rustix::fs::Mode::empty()).expect("O_PATH"),
                "opened with O_PATH",
            ),
        ];
        for (fd, why) in cases {
            let e = PassedFile::new(fd, "/x/model.gguf").expect_err(why).to_string();
            assert!(e.starts_with("/x/model.gguf: ") && e.contains(why), "{why}: {e}");
        }
    }

    #[test]
    fn it_is_read_at_its_own_positions_up_to_the_size_it_had() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("f");
        std::fs::write(&path, b"0123456789").expect("write");
        let mut shared = std::fs::File::open(&path).expect("open");
        let file = passed(shared.try_clone().expect("dup")).expect("taken");
        // The caller moves the offset it shares, and the file grows: neither shows.
        shared.seek(SeekFrom::Start(7)).expect("seek");
        std::fs::OpenOptions::new().append(true).open(&path).expect("append").write_all(b"more").expect("grow");
        let mut all = Vec::new();
        file.reader().read_to_end(&mut all).expect("read");
        assert_eq!(all, b"0123456789");
        let mut reader = file.reader();
        assert_eq!(reader.seek(SeekFrom::End(-3)).expect("seek"), 7);
        let mut tail = String::new();
        reader.read_to_string(&mut tail).expect("tail");
        assert_eq!(tail, "789");
        assert!(reader.seek(SeekFrom::Current(-11)).is_err(), "before the start");
        assert_eq!(shared.stream_position().expect("offset"), 7, "the shared offset is the caller's");
    }
}
