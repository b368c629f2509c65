//! A Modelfile as sent to corrald: checked here first, with relative `FROM` and `ADAPTER`
//! paths made absolute, since the daemon has no working directory of the caller's.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::error::CtlError;
use crate::store::modelfile::Modelfile;

/// Checks `text` (read from a file in `dir`) and returns it with every relative `FROM` and
/// `ADAPTER` path made absolute against `dir` (`~/` against `home`). A path that names no
/// file is refused here, naming its line.
pub fn prepare(text: &str, dir: &Path, home: Option<&Path>) -> Result<String, CtlError> {
    Modelfile::parse(text).map_err(|e| CtlError::Invalid(format!("Modelfile: {e}")))?;
    let mut out = String::with_capacity(text.len());
    let mut in_block = false;
    for (index, line) in text.split_inclusive('\n').enumerate() {
        if in_block {
            in_block = !line.contains("\"\"\"");
            out.push_str(line);
            continue;
        }
        let body = line.trim_end_matches(['\n', '\r']);
        let ending = &line[body.len()..];
        let trimmed = body.trim_start();
        let (instruction, rest) = trimmed.split_once(char::is_whitespace).unwrap_or((trimmed, ""));
        let rest = rest.trim();
        if let Some(after) = rest.strip_prefix("\"\"\"") {
            in_block = !after.contains("\"\"\"");
        }
        let is_source = instruction.eq_ignore_ascii_case("FROM") || instruction.eq_ignore_ascii_case("ADAPTER");
        let value = rest.strip_prefix('"').and_then(|v| v.strip_suffix('"')).unwrap_or(rest);
        match (is_source && !in_block && !rest.starts_with("\"\"\"")).then(|| absolute(value, dir, home)).flatten() {
            Some(path) => {
                if !path.exists() {
                    return Err(CtlError::Invalid(format!(
                        "Modelfile line {}: {instruction} {value}: no such file {}",
                        index + 1,
                        path.display()
                    )));
                }
                let path = path.to_str().ok_or_else(|| {
                    CtlError::Invalid(format!("Modelfile line {}: {} is not UTF-8", index + 1, path.display()))
                })?;
                let _ = write!(out, "{instruction} \"{path}\"{ending}");
            }
            None => out.push_str(line),
        }
    }
    Ok(out)
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

    #[test]
    fn relative_paths_become_absolute_and_the_rest_is_kept() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("w.gguf"), b"x").expect("write");
        std::fs::create_dir(dir.path().join("sub")).expect("mkdir");
        std::fs::write(dir.path().join("sub/lora.bin"), b"x").expect("write");
        let text = "# weights\nFROM ./w.gguf\nadapter sub/lora.bin\nTEMPLATE \"\"\"\nFROM ./nothing\n\"\"\"\n\
                    PARAMETER temperature 0.5\n";
        let out = prepare(text, dir.path(), None).expect("prepared");
        let d = dir.path().display();
        assert_eq!(
            out,
            format!(
                "# weights\nFROM \"{d}/w.gguf\"\nadapter \"{d}/sub/lora.bin\"\nTEMPLATE \"\"\"\nFROM ./nothing\n\"\"\"\n\
                 PARAMETER temperature 0.5\n"
            )
        );
    }

    #[test]
    fn names_digests_and_absolute_paths_are_sent_as_written() {
        let dir = tempfile::tempdir().expect("tempdir");
        for text in ["FROM llama3:8b\n", "FROM /srv/models/x.gguf\n", "FROM sha256-0123\n"] {
            assert_eq!(prepare(text, dir.path(), None).expect("prepared"), text);
        }
    }

    #[test]
    fn home_is_expanded_and_parent_directories_resolved() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(dir.path().join("a")).expect("mkdir");
        std::fs::write(dir.path().join("w.gguf"), b"x").expect("write");
        let out = prepare("FROM ../w.gguf", &dir.path().join("a"), None).expect("prepared");
        assert_eq!(out, format!("FROM \"{}/w.gguf\"", dir.path().display()));
        let out = prepare("FROM ~/w.gguf\n", Path::new("/elsewhere"), Some(dir.path())).expect("prepared");
        assert_eq!(out, format!("FROM \"{}/w.gguf\"\n", dir.path().display()));
    }

    #[test]
    fn a_missing_file_or_a_bad_modelfile_is_refused_naming_the_line() {
        let dir = tempfile::tempdir().expect("tempdir");
        let e = prepare("# x\nFROM ./missing.gguf\n", dir.path(), None).expect_err("missing file");
        let text = e.to_string();
        assert!(text.starts_with("Modelfile line 2: FROM ./missing.gguf: no such file"), "{text}");
        let e = prepare("PARAMETER temperature 0.5\n", dir.path(), None).expect_err("no FROM");
        assert!(e.to_string().contains("no FROM instruction"), "{e}");
    }
}
