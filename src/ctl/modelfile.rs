//! A Modelfile as sent to corrald: checked here first, with relative `FROM` and `ADAPTER`
//! paths made absolute, since the daemon has no working directory of the caller's.
//!
//! The Modelfile is parsed, its paths changed, and written again by the store's writer,
//! so the daemon reads exactly the texts the file has (a line inside a quoted value that
//! looks like `FROM ./x` stays text); comments are not sent.

use std::path::{Path, PathBuf};

use super::error::CtlError;
use crate::store::modelfile::Modelfile;

/// Checks `text` (read from a file in `dir`) and returns it with every relative `FROM` and
/// `ADAPTER` path made absolute against `dir` (`~/` against `home`). A path that names no
/// file is refused here, naming its line.
pub fn prepare(text: &str, dir: &Path, home: Option<&Path>) -> Result<String, CtlError> {
    let (mut modelfile, lines) = Modelfile::parse_located(text).map_err(|e| CtlError::Invalid(e.to_string()))?;
    let sources = std::iter::once(("FROM", &mut modelfile.from))
        .chain(modelfile.adapters.iter_mut().map(|a| ("ADAPTER", a)))
        .zip(lines);
    for ((instruction, value), line) in sources {
        let Some(path) = absolute(value.trim(), dir, home) else { continue };
        if !path.exists() {
            return Err(CtlError::Invalid(format!(
                "Modelfile line {line}: {instruction} {value}: no such file {}",
                path.display()
            )));
        }
        let path = path
            .to_str()
            .ok_or_else(|| CtlError::Invalid(format!("Modelfile line {line}: {} is not UTF-8", path.display())))?;
        path.clone_into(value);
    }
    modelfile.write("").map_err(|e| CtlError::Invalid(format!("Modelfile: {e}")))
}

/// The absolute path `value` names when it is a relative path (by the daemon's rule: it
/// starts with `.` or `~`, ends in `.gguf`, or exists), else `None` (an absolute path, a
/// digest or a model name, sent as written).
fn absolute(value: &str, dir: &Path, home: Option<&Path>) -> Option<PathBuf> {
    if value.starts_with('/') || value.starts_with("sha256:") || value.starts_with("sha256-") {
        return None;
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
    use std::path::Path;

    use super::prepare;
    use crate::store::modelfile::Modelfile;

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
    fn names_digests_and_absolute_paths_are_sent_as_written() {
        let dir = tempfile::tempdir().expect("tempdir");
        for from in ["llama3:8b", "/srv/models/x.gguf", "sha256-0123"] {
            let out = prepare(&format!("FROM {from}\n"), dir.path(), None).expect("prepared");
            assert_eq!(Modelfile::parse(&out).expect("parses").from, from);
        }
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
}
