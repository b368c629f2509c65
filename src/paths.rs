//! Where corral keeps its state, runtime sockets, configuration and cache.
//!
//! Resolved once at start from systemd's `*_DIRECTORY` variables, else the system
//! locations for root, else the XDG base directories for an ordinary user.
//! Nothing else in the daemon reads these environment variables.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The directories the daemon works in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Paths {
    /// Persistent state: the model store lives below it (`/var/lib/corral`).
    pub state: PathBuf,
    /// Runtime files: one UNIX socket per runner (`/run/corral`).
    pub runtime: PathBuf,
    /// Configuration directory holding `corral.toml` and `corral.toml.d/` (`/etc/corral`).
    pub config: PathBuf,
    /// Disposable cache (`/var/cache/corral`).
    pub cache: PathBuf,
}

impl Paths {
    /// Resolves the directories from the process environment.
    #[must_use]
    pub fn from_process_env() -> Self {
        Self::resolve(|name| std::env::var_os(name), nix::unistd::Uid::effective().is_root())
    }

    /// Resolves the directories from `env` (a variable lookup) for a root or an ordinary user.
    pub fn resolve(env: impl Fn(&str) -> Option<OsString>, is_root: bool) -> Self {
        let home = || env("HOME").map_or_else(|| PathBuf::from("/"), PathBuf::from);
        let xdg = |var: &str, fallback: &str| {
            non_empty_absolute(env(var)).unwrap_or_else(|| home().join(fallback)).join("corral")
        };
        let pick = |systemd_var: &str, system: &str, user: &dyn Fn() -> PathBuf| {
            // systemd passes a colon-separated list when a unit names several directories;
            // the first is ours.
            let from_systemd = env(systemd_var).and_then(|v| {
                let first = v.to_string_lossy().split(':').next().map(PathBuf::from);
                first.filter(|p| p.is_absolute())
            });
            from_systemd.unwrap_or_else(|| if is_root { PathBuf::from(system) } else { user() })
        };
        let runtime_user = || {
            non_empty_absolute(env("XDG_RUNTIME_DIR")).map_or_else(
                || std::env::temp_dir().join(format!("corral-{}", nix::unistd::Uid::effective())),
                |dir| dir.join("corral"),
            )
        };
        Self {
            state: pick("STATE_DIRECTORY", "/var/lib/corral", &|| xdg("XDG_STATE_HOME", ".local/state")),
            runtime: pick("RUNTIME_DIRECTORY", "/run/corral", &runtime_user),
            config: pick("CONFIGURATION_DIRECTORY", "/etc/corral", &|| xdg("XDG_CONFIG_HOME", ".config")),
            cache: pick("CACHE_DIRECTORY", "/var/cache/corral", &|| xdg("XDG_CACHE_HOME", ".cache")),
        }
    }

    /// The main configuration file, `corral.toml` in the configuration directory.
    #[must_use]
    pub fn config_file(&self) -> PathBuf {
        self.config.join("corral.toml")
    }

    /// The default model store, `models/` in the state directory.
    #[must_use]
    pub fn default_store(&self) -> PathBuf {
        self.state.join("models")
    }
}

fn non_empty_absolute(value: Option<OsString>) -> Option<PathBuf> {
    value.map(PathBuf::from).filter(|p| Path::is_absolute(p))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::{Path, Paths};

    fn resolve(vars: &[(&str, &str)], is_root: bool) -> Paths {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        Paths::resolve(|name| map.get(name).map(Into::into), is_root)
    }

    #[test]
    fn root_without_systemd_uses_system_locations() {
        let p = resolve(&[("HOME", "/root")], true);
        assert_eq!(p.state, Path::new("/var/lib/corral"));
        assert_eq!(p.runtime, Path::new("/run/corral"));
        assert_eq!(p.config, Path::new("/etc/corral"));
        assert_eq!(p.cache, Path::new("/var/cache/corral"));
        assert_eq!(p.config_file(), Path::new("/etc/corral/corral.toml"));
        assert_eq!(p.default_store(), Path::new("/var/lib/corral/models"));
    }

    #[test]
    fn systemd_directories_win_and_the_first_of_a_list_is_taken() {
        let p = resolve(
            &[
                ("STATE_DIRECTORY", "/var/lib/corral:/var/lib/other"),
                ("RUNTIME_DIRECTORY", "/run/corral"),
                ("CONFIGURATION_DIRECTORY", "/etc/corral"),
                ("CACHE_DIRECTORY", "/var/cache/corral"),
                ("HOME", "/home/u"),
            ],
            false,
        );
        assert_eq!(p.state, Path::new("/var/lib/corral"));
        assert_eq!(p.runtime, Path::new("/run/corral"));
        assert_eq!(p.config, Path::new("/etc/corral"));
        assert_eq!(p.cache, Path::new("/var/cache/corral"));
    }

    #[test]
    fn ordinary_user_gets_xdg_directories() {
        let p = resolve(
            &[
                ("HOME", "/home/u"),
                ("XDG_STATE_HOME", "/home/u/st"),
                ("XDG_RUNTIME_DIR", "/run/user/1000"),
                ("XDG_CONFIG_HOME", ""),
            ],
            false,
        );
        assert_eq!(p.state, Path::new("/home/u/st/corral"));
        assert_eq!(p.runtime, Path::new("/run/user/1000/corral"));
        assert_eq!(p.config, Path::new("/home/u/.config/corral"));
        assert_eq!(p.cache, Path::new("/home/u/.cache/corral"));
    }

    #[test]
    fn relative_values_are_ignored() {
        let p = resolve(&[("HOME", "/home/u"), ("STATE_DIRECTORY", "relative"), ("XDG_CACHE_HOME", "rel")], false);
        assert_eq!(p.state, Path::new("/home/u/.local/state/corral"));
        assert_eq!(p.cache, Path::new("/home/u/.cache/corral"));
    }
}
