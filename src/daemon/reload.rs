//! SIGHUP: the configuration read again, applied live where [`RELOADED_KEYS`] says so, the
//! other changed keys named as needing a restart.

use crate::config::{ConfigSource, Loaded};
use crate::systemd::Notifier;

/// Reads the configuration again; an invalid one is rejected and the current one kept.
/// Returns whether a new one was applied.  The entry says which changed keys take effect
/// only at the next restart.
pub(super) fn reload(
    source: &ConfigSource,
    base: &toml::Table,
    current: &mut Loaded,
    socket_activated: bool,
    notifier: &Notifier,
) -> bool {
    notifier.reloading();
    match source.load_over(base.clone()) {
        Ok(new) => {
            let changed = changed_keys(&current.table, &new.table);
            let later: Vec<String> =
                changed.iter().filter(|key| !applies_on_reload(key)).map(|key| shown_key(key)).collect();
            let listen_unused = socket_activated
                && changed
                    .iter()
                    .any(|k| k.first().is_some_and(|t| t == "server") && k.get(1).is_some_and(|k| k == "listen"));
            *current = new;
            if later.is_empty() {
                tracing::info!(corral_event = "reload", config_files = ?current.files, "configuration reloaded");
            } else {
                let list = later.join(", ");
                let socket_note = if listen_unused {
                    "; [server] listen applies only when systemd passes no socket (edit corrald.socket instead)"
                } else {
                    ""
                };
                tracing::warn!(
                    corral_event = "reload",
                    config_files = ?current.files,
                    restart_needed = %list,
                    "configuration reloaded, but these changed keys take effect only at the next restart \
                     (`systemctl restart corrald`): {list}{socket_note}"
                );
            }
            true
        }
        Err(e) => {
            tracing::error!(
                corral_event = "reload",
                error = %e,
                "configuration rejected, keeping the previous one: {e}"
            );
            false
        }
    }
}

/// The keys a reload applies to the running daemon; every other key is read at start only.
/// (A key added later needs a restart until it is added here.)
const RELOADED_KEYS: &[&str] = &[
    "scheduler.keep_alive",
    "scheduler.keep_alive_min",
    "scheduler.keep_alive_max",
    "scheduler.max_loaded_models",
    "scheduler.max_queue",
    "scheduler.partial_offload",
    "server.exit_on_idle",
    "server.shutdown_timeout",
];

fn applies_on_reload(key: &[String]) -> bool {
    RELOADED_KEYS.contains(&key.join(".").as_str())
}

/// `["server", "listen"]` as people write it: `[server] listen`; a model's policy as
/// `[models."NAME"] preload`.
fn shown_key(key: &[String]) -> String {
    match key {
        [workers] if workers == "workers" => "[[workers]]".to_owned(),
        [table] => format!("[{table}]"),
        [models, name, rest @ ..] if models == "models" => {
            let table = format!("[models.\"{name}\"]");
            if rest.is_empty() { table } else { format!("{table} {}", rest.join(".")) }
        }
        [table, rest @ ..] => format!("[{table}] {}", rest.join(".")),
        [] => String::new(),
    }
}

/// The keys whose value differs between two merged configurations (set, changed or
/// removed), down to the leaves of tables; arrays count as one value.
fn changed_keys(old: &toml::Table, new: &toml::Table) -> Vec<Vec<String>> {
    let mut changed = Vec::new();
    diff_tables(&mut Vec::new(), old, new, &mut changed);
    changed
}

fn diff_tables(prefix: &mut Vec<String>, old: &toml::Table, new: &toml::Table, out: &mut Vec<Vec<String>>) {
    let keys: std::collections::BTreeSet<&String> = old.keys().chain(new.keys()).collect();
    for key in keys {
        prefix.push(key.clone());
        match (old.get(key), new.get(key)) {
            (Some(toml::Value::Table(a)), Some(toml::Value::Table(b))) => diff_tables(prefix, a, b, out),
            (Some(toml::Value::Table(a)), None) => diff_tables(prefix, a, &toml::Table::new(), out),
            (None, Some(toml::Value::Table(b))) => diff_tables(prefix, &toml::Table::new(), b, out),
            (a, b) if a != b => out.push(prefix.clone()),
            _ => {}
        }
        prefix.pop();
    }
}

#[cfg(test)]
mod tests {
    fn table(text: &str) -> toml::Table {
        toml::from_str(text).expect("toml")
    }

    #[test]
    fn a_reload_names_every_changed_key_that_needs_a_restart() {
        let old = table(
            "[server]\nlisten = [\"127.0.0.1:1\"]\n[scheduler]\nkeep_alive = \"5m\"\n[models.\"chat\"]\npreload = true\n",
        );
        let new = table(
            "[server]\nlisten = [\"127.0.0.1:2\"]\n[scheduler]\nkeep_alive = \"9m\"\nmax_queue = 3\n\
             [store]\npath = \"/x\"\n[runner]\nstream_idle_timeout = \"1m\"\n[dbus]\nbus = \"off\"\n\
             [[workers]]\naddress = \"h:1\"\n",
        );
        let changed = super::changed_keys(&old, &new);
        let later: Vec<String> =
            changed.iter().filter(|k| !super::applies_on_reload(k)).map(|k| super::shown_key(k)).collect();
        assert_eq!(
            later,
            [
                "[dbus] bus",
                "[models.\"chat\"] preload",
                "[runner] stream_idle_timeout",
                "[server] listen",
                "[store] path",
                "[[workers]]"
            ]
        );
        let live: Vec<String> = changed.iter().filter(|k| super::applies_on_reload(k)).map(|k| k.join(".")).collect();
        assert_eq!(live, ["scheduler.keep_alive", "scheduler.max_queue"]);
        assert!(super::changed_keys(&old, &old).is_empty());
    }
}
