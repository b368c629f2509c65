//! A Modelfile as sent to corrald: checked here first, its local `FROM` and `ADAPTER`
//! files passed open over D-Bus (corrald may not see the caller's files, its unit hides
//! `/home`; it reads each once, hashing as it copies). Where corrald cannot take them, they
//! are uploaded as blobs over the HTTP API (as Ollama's client does) and named by digest;
//! without the HTTP API, named by absolute path, since the daemon has no working directory
//! of the caller's.
//!
//! The Modelfile is parsed, its paths changed, and written again by the store's writer,
//! so the daemon reads exactly the texts the file has (a line inside a quoted value that
//! looks like `FROM ./x` stays text); comments are not sent.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures_util::StreamExt;
use hyper::body::{Bytes, Frame};

use super::chat::{Api, Upload};
use super::error::CtlError;
use super::job::{Progress, Sink, View};
use crate::store::digest::{Digest, Hasher};
use crate::store::modelfile::Modelfile;

/// A Modelfile checked, with its local files (`FROM` and `ADAPTER` paths) made absolute.
#[derive(Debug)]
pub struct Prepared {
    modelfile: Modelfile,
    /// The local files it names, each once, in order.
    pub files: Vec<PathBuf>,
}

/// Checks `text` (read from a file in `dir`) and makes every relative `FROM` and `ADAPTER`
/// path absolute against `dir` (`~/` against `home`). A path that names no file is refused
/// here, naming its line.
pub fn prepare(text: &str, dir: &Path, home: Option<&Path>) -> Result<Prepared, CtlError> {
    let (mut modelfile, lines) = Modelfile::parse_located(text).map_err(|e| CtlError::Invalid(e.to_string()))?;
    let mut files: Vec<PathBuf> = Vec::new();
    let sources = std::iter::once(("FROM", &mut modelfile.from))
        .chain(modelfile.adapters.iter_mut().map(|a| ("ADAPTER", a)))
        .zip(lines);
    for ((instruction, value), line) in sources {
        let Some(path) = local(value.trim(), dir, home) else { continue };
        if !path.exists() {
            return Err(CtlError::Invalid(format!(
                "Modelfile line {line}: {instruction} {value}: no such file {}",
                path.display()
            )));
        }
        let text = path
            .to_str()
            .ok_or_else(|| CtlError::Invalid(format!("Modelfile line {line}: {} is not UTF-8", path.display())))?;
        text.clone_into(value);
        if !files.contains(&path) {
            files.push(path);
        }
    }
    Ok(Prepared { modelfile, files })
}

impl Prepared {
    /// The Modelfile to send, each local file named by `names` (its blob's digest) instead of
    /// its path; a file not in `names` keeps its absolute path.
    pub fn text(&self, names: &HashMap<PathBuf, String>) -> Result<String, CtlError> {
        let mut modelfile = self.modelfile.clone();
        let values = std::iter::once(&mut modelfile.from).chain(modelfile.adapters.iter_mut());
        for value in values {
            if let Some(name) = names.get(Path::new(value.as_str())) {
                name.clone_into(value);
            }
        }
        modelfile.write("").map_err(|e| CtlError::Invalid(format!("Modelfile: {e}")))
    }
}

/// Each file opened for reading, keyed by its path as the Modelfile sent names it: what
/// D-Bus `CreateWithFiles` takes.
pub fn open(files: &[PathBuf]) -> Result<Vec<(String, std::fs::File)>, CtlError> {
    files
        .iter()
        .map(|path| {
            let file = std::fs::File::open(path)
                .map_err(|source| CtlError::Io { what: format!("cannot read {}", path.display()), source })?;
            // `prepare` took only UTF-8 paths.
            Ok((path.to_string_lossy().into_owned(), file))
        })
        .collect()
}

/// Whether corrald cannot take files passed open, so that they go another way: a corrald
/// without `CreateWithFiles`, or a connection that cannot pass descriptors.
#[must_use]
pub fn descriptors_refused(error: &zbus::Error) -> bool {
    const REFUSALS: [&str; 2] = ["org.freedesktop.DBus.Error.UnknownMethod", "org.freedesktop.DBus.Error.NotSupported"];
    match error {
        zbus::Error::Unsupported => true,
        zbus::Error::MethodError(name, _, _) => REFUSALS.contains(&name.as_str()),
        zbus::Error::FDO(e) => matches!(**e, zbus::fdo::Error::UnknownMethod(_) | zbus::fdo::Error::NotSupported(_)),
        _ => false,
    }
}

/// Uploads each file as a blob, as Ollama's client does: hashed here, asked for with
/// `HEAD /api/blobs/<digest>`, sent only when corrald lacks it (corrald checks the digest).
/// corrald then needs no access to the caller's files (its unit hides `/home`).
/// Returns each file's digest.
pub async fn upload(api: &Api, files: &[PathBuf], progress: Progress) -> Result<HashMap<PathBuf, String>, CtlError> {
    let mut names = HashMap::new();
    for path in files {
        let (digest, size) = hash(path.clone()).await?;
        let name = digest.to_string();
        let mut view = View::new(progress, Sink::Stdout);
        let status = format!("copying {}", &digest.hex()[..12]);
        if api.has_blob(&name).await? {
            view.set(&format!("using existing blob {name}"), 0, 0);
        } else {
            let sent = Arc::new(AtomicU64::new(0));
            let body = file_body(path.clone(), Arc::clone(&sent));
            let mut upload = std::pin::pin!(api.upload_blob(&name, size, body));
            let mut ticker = tokio::time::interval(std::time::Duration::from_millis(100));
            loop {
                tokio::select! {
                    result = &mut upload => {
                        result?;
                        break;
                    }
                    _ = ticker.tick() => view.set(&status, size, sent.load(Ordering::Relaxed)),
                }
            }
            view.set(&status, size, size);
        }
        view.finish();
        names.insert(path.clone(), name);
    }
    Ok(names)
}

/// The file's digest and size, read on a blocking thread.
async fn hash(path: PathBuf) -> Result<(Digest, u64), CtlError> {
    let what = format!("cannot read {}", path.display());
    tokio::task::spawn_blocking(move || {
        let mut file = std::fs::File::open(&path)?;
        let mut hasher = Hasher::default();
        let mut buffer = vec![0; 1 << 20];
        loop {
            let n = file.read(&mut buffer)?;
            if n == 0 {
                return Ok(hasher.finish());
            }
            hasher.update(&buffer[..n]);
        }
    })
    .await
    .map_err(|e| CtlError::Io { what: what.clone(), source: std::io::Error::other(e) })?
    .map_err(|source| CtlError::Io { what, source })
}

/// The file as a request body, read on a thread of its own, counting what was sent.
fn file_body(path: PathBuf, sent: Arc<AtomicU64>) -> Upload {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
    std::thread::spawn(move || {
        let mut file = match std::fs::File::open(&path) {
            Ok(file) => file,
            Err(e) => {
                let _ = tx.blocking_send(Err(e));
                return;
            }
        };
        loop {
            let mut buffer = vec![0; 1 << 20];
            match file.read(&mut buffer) {
                Ok(0) => return,
                Ok(n) => {
                    buffer.truncate(n);
                    if tx.blocking_send(Ok(Bytes::from(buffer))).is_err() {
                        return;
                    }
                }
                Err(e) => {
                    let _ = tx.blocking_send(Err(e));
                    return;
                }
            }
        }
    });
    let stream = futures_util::stream::unfold((rx, sent), |(mut rx, sent)| async move {
        let chunk = rx.recv().await?;
        if let Ok(bytes) = &chunk {
            sent.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        }
        Some((chunk.map(Frame::data), (rx, sent)))
    });
    http_body_util::StreamBody::new(stream.boxed())
}

/// The absolute path of the local file `value` names: an absolute path, or a relative one
/// (by the daemon's rule: it starts with `.` or `~`, ends in `.gguf`, or exists); `None`
/// for a digest or a model name, sent as written.
fn local(value: &str, dir: &Path, home: Option<&Path>) -> Option<PathBuf> {
    if value.starts_with("sha256:") || value.starts_with("sha256-") {
        return None;
    }
    if value.starts_with('/') {
        return Some(normalize(Path::new(value)));
    }
    if let (Some(rest), Some(home)) = (value.strip_prefix("~/"), home) {
        return Some(home.join(rest));
    }
    let joined = dir.join(value);
    let gguf = Path::new(value).extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    (value.starts_with(['.', '~']) || gguf || joined.exists()).then(|| normalize(&joined))
}

/// `a/./b/../c` as `a/c`, without touching the file system (symbolic links stay as named).
fn normalize(path: &Path) -> PathBuf {
    use std::path::Component;
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::path::Path;

    use crate::ctl::error::CtlError;
    use crate::store::modelfile::Modelfile;

    /// The Modelfile as sent when no file is uploaded: with absolute paths.
    fn prepare(text: &str, dir: &Path, home: Option<&Path>) -> Result<String, CtlError> {
        super::prepare(text, dir, home)?.text(&HashMap::new())
    }

    #[test]
    fn relative_paths_become_absolute_and_the_rest_is_kept() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("w.gguf"), b"x").expect("write");
        std::fs::create_dir(dir.path().join("sub")).expect("mkdir");
        std::fs::write(dir.path().join("sub/lora.bin"), b"x").expect("write");
        let text = "# weights\nFROM ./w.gguf\nadapter sub/lora.bin\nTEMPLATE \"\"\"\nFROM ./nothing\n\"\"\"\n\
                    SYSTEM \"two\nFROM ./w.gguf\"\nPARAMETER temperature 0.5\n";
        let out = Modelfile::parse(&prepare(text, dir.path(), None).expect("prepared")).expect("parses");
        let mut expected = Modelfile::parse(text).expect("parses");
        expected.from = format!("{}/w.gguf", dir.path().display());
        expected.adapters = vec![format!("{}/sub/lora.bin", dir.path().display())];
        // The lines inside quoted values are text, not instructions, and stay as written.
        assert_eq!(expected.template.as_deref(), Some("\nFROM ./nothing\n"));
        assert_eq!(expected.system.as_deref(), Some("two\nFROM ./w.gguf"));
        assert_eq!(out, expected);
    }

    #[test]
    fn names_and_digests_are_sent_as_written() {
        let dir = tempfile::tempdir().expect("tempdir");
        for from in ["llama3:8b", "sha256-0123"] {
            let out = prepare(&format!("FROM {from}\n"), dir.path(), None).expect("prepared");
            assert_eq!(Modelfile::parse(&out).expect("parses").from, from);
        }
        let e = prepare("FROM /srv/models/x.gguf\n", dir.path(), None).expect_err("no such file");
        assert!(e.to_string().contains("no such file /srv/models/x.gguf"), "{e}");
    }

    #[test]
    fn local_files_are_listed_once_and_replaced_by_their_digests() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("w.gguf"), b"x").expect("write");
        std::fs::write(dir.path().join("a.gguf"), b"y").expect("write");
        let text = format!("FROM ./w.gguf\nADAPTER {}/a.gguf\nADAPTER w.gguf\n", dir.path().display());
        let prepared = super::prepare(&text, dir.path(), None).expect("prepared");
        assert_eq!(prepared.files, [dir.path().join("w.gguf"), dir.path().join("a.gguf")]);
        let names = HashMap::from([
            (dir.path().join("w.gguf"), "sha256:".to_owned() + &"1".repeat(64)),
            (dir.path().join("a.gguf"), "sha256:".to_owned() + &"2".repeat(64)),
        ]);
        let sent = Modelfile::parse(&prepared.text(&names).expect("text")).expect("parses");
        assert_eq!(sent.from, names[&dir.path().join("w.gguf")]);
        assert_eq!(
            sent.adapters,
            [names[&dir.path().join("a.gguf")].clone(), names[&dir.path().join("w.gguf")].clone()]
        );
    }

    #[test]
    fn home_is_expanded_and_parent_directories_resolved() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(dir.path().join("a")).expect("mkdir");
        std::fs::write(dir.path().join("w.gguf"), b"x").expect("write");
        let expected = format!("{}/w.gguf", dir.path().display());
        let out = prepare("FROM ../w.gguf", &dir.path().join("a"), None).expect("prepared");
        assert_eq!(Modelfile::parse(&out).expect("parses").from, expected);
        let out = prepare("FROM ~/w.gguf\n", Path::new("/elsewhere"), Some(dir.path())).expect("prepared");
        assert_eq!(Modelfile::parse(&out).expect("parses").from, expected);
    }

    #[test]
    fn a_missing_file_or_a_bad_modelfile_is_refused_naming_the_line() {
        let dir = tempfile::tempdir().expect("tempdir");
        let e = prepare("# x\nFROM ./missing.gguf\n", dir.path(), None).expect_err("missing file");
        let text = e.to_string();
        assert!(text.starts_with("Modelfile line 2: FROM ./missing.gguf: no such file"), "{text}");
        let e = prepare("PARAMETER temperature 0.5\n", dir.path(), None).expect_err("no FROM");
        assert!(e.to_string().contains("Modelfile line 1: no FROM instruction"), "{e}");
    }

    #[test]
    fn only_a_corrald_or_bus_that_cannot_take_descriptors_sends_the_files_another_way() {
        use zbus::names::OwnedErrorName;
        let method_error = |name: &str| {
            let name = OwnedErrorName::try_from(name).expect("an error name");
            zbus::Error::MethodError(
                name,
                Some("no".into()),
                zbus::Message::signal("/a", "a.b", "C").expect("a message").build(&()).expect("built"),
            )
        };
        let refused = [
            zbus::Error::Unsupported,
            method_error("org.freedesktop.DBus.Error.UnknownMethod"),
            method_error("org.freedesktop.DBus.Error.NotSupported"),
            zbus::Error::FDO(Box::new(zbus::fdo::Error::UnknownMethod("no".into()))),
        ];
        for e in &refused {
            assert!(super::descriptors_refused(e), "{e}");
        }
        // corrald's own answers, and the bus's refusals, are the caller's to see.
        let answered = [
            method_error("org.corral.Corral1.Error.InvalidArgument"),
            method_error("org.freedesktop.DBus.Error.AccessDenied"),
            method_error("org.corral.Corral1.Error.ReadOnly"),
            zbus::Error::FDO(Box::new(zbus::fdo::Error::AccessDenied("no".into()))),
        ];
        for e in &answered {
            assert!(!super::descriptors_refused(e), "{e}");
        }
    }

    #[test]
    fn files_are_opened_under_the_paths_the_modelfile_sends() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("m.gguf");
        std::fs::write(&path, b"weights").expect("write");
        let opened = super::open(std::slice::from_ref(&path)).expect("open");
        assert_eq!(opened.len(), 1);
        assert_eq!(opened[0].0, path.to_str().expect("utf-8"));
        let missing = dir.path().join("gone.gguf");
        let err = super::open(std::slice::from_ref(&missing)).expect_err("missing").to_string();
        assert!(err.contains(&format!("cannot read {}", missing.display())), "{err}");
    }
}
