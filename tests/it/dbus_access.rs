//! The shipped bus policy, enforced by a real dbus-daemon: everyone may look, only root
//! and the group `corral` may change anything, only `corral` (and root) may own the name.

use crate::support::container::describe;
use crate::support::dbus::{ACCESS_DENIED, BusDaemon, MEMBER, OUTSIDER};

const DEST: &str = "org.corral.Corral1";
const ROOT: &str = "/org/corral/Corral1";
const MANAGER: &str = "org.corral.Corral1.Manager";

fn call(daemon: &BusDaemon, user: Option<&str>, path: &str, iface: &str, args: &[&str]) -> std::process::Output {
    let mut command = vec!["call", DEST, path, iface];
    command.extend_from_slice(args);
    daemon.busctl(user, &command)
}

fn assert_denied(out: &std::process::Output, what: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("Access denied"),
        "{what}: expected access denied: {}",
        describe(out)
    );
}

#[test]
fn everyone_may_look_only_root_and_group_corral_may_act() {
    let daemon = BusDaemon::start("");
    let model = "/org/corral/Corral1/models/chat_3alatest";
    for user in [None, Some(MEMBER), Some(OUTSIDER)] {
        let who = user.unwrap_or("root");
        let out = call(&daemon, user, ROOT, MANAGER, &["ListModels"]);
        assert!(out.status.success(), "{who} ListModels: {}", describe(&out));
        assert!(String::from_utf8_lossy(&out.stdout).contains("chat:latest"), "{}", describe(&out));
        let out = call(&daemon, user, ROOT, MANAGER, &["GetModel", "s", "chat"]);
        assert!(out.status.success(), "{who} GetModel: {}", describe(&out));
        let out = daemon.busctl(user, &["get-property", DEST, model, "org.corral.Corral1.Model", "State"]);
        assert!(out.status.success(), "{who} Get: {}", describe(&out));
        let out = daemon.busctl(user, &["introspect", DEST, ROOT]);
        assert!(out.status.success(), "{who} introspect: {}", describe(&out));
        let out = call(&daemon, user, ROOT, "org.freedesktop.DBus.ObjectManager", &["GetManagedObjects"]);
        assert!(out.status.success(), "{who} GetManagedObjects: {}", describe(&out));
    }

    // The outsider is refused every change, by the bus, before corrald sees it.
    let refused: &[(&str, &str, &[&str])] = &[
        (ROOT, MANAGER, &["Load", "sa{sv}", "chat", "0"]),
        (ROOT, MANAGER, &["Unload", "s", "chat"]),
        (ROOT, MANAGER, &["Pull", "sa{sv}", "chat", "0"]),
        (ROOT, MANAGER, &["Push", "sa{sv}", "chat", "0"]),
        (ROOT, MANAGER, &["Create", "ss", "x", "FROM chat"]),
        (ROOT, MANAGER, &["CreateWithFiles", "ssa{sh}", "x", "FROM chat", "0"]),
        (ROOT, MANAGER, &["Copy", "ss", "chat", "x"]),
        (ROOT, MANAGER, &["Delete", "s", "chat"]),
        (model, "org.corral.Corral1.Model", &["Load", "a{sv}", "0"]),
        (model, "org.corral.Corral1.Model", &["Unload"]),
        (ROOT, "org.corral.Corral1.Job", &["Cancel"]),
    ];
    for (path, iface, args) in refused {
        assert_denied(&call(&daemon, Some(OUTSIDER), path, iface, args), &format!("{OUTSIDER} {iface}.{}", args[0]));
    }
    let out = daemon.busctl(Some(OUTSIDER), &["set-property", DEST, model, "org.freedesktop.DBus.Properties", "x"]);
    assert!(!out.status.success(), "{}", describe(&out));
    // Nothing changed.
    let out = call(&daemon, None, ROOT, MANAGER, &["GetModel", "s", "chat"]);
    assert!(out.status.success(), "{}", describe(&out));

    // A member of group corral gets through to corrald: its answer, not the bus's.
    let out = call(&daemon, Some(MEMBER), ROOT, MANAGER, &["Unload", "s", "chat"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("is not loaded"), "{}", describe(&out));
    let out = call(&daemon, Some(MEMBER), ROOT, MANAGER, &["Copy", "ss", "chat", "chat-member"]);
    assert!(out.status.success(), "{MEMBER} Copy: {}", describe(&out));
    let out = call(&daemon, None, ROOT, MANAGER, &["Delete", "s", "chat-member"]);
    assert!(out.status.success(), "root Delete: {}", describe(&out));
}

#[test]
fn only_the_service_user_and_root_may_own_the_name() {
    let daemon = BusDaemon::start("");
    let request = |user: Option<&str>| {
        daemon.bus.call_as(
            user,
            "org.freedesktop.DBus",
            "/org/freedesktop/DBus",
            "org.freedesktop.DBus.RequestName",
            &["string:org.corral.Corral1", "uint32:4"],
        )
    };
    for user in [MEMBER, OUTSIDER] {
        let out = request(Some(user));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(ACCESS_DENIED), "{user}: {}", describe(&out));
    }
    // The service user may: corrald (root here) holds it, so the answer is "exists" (3).
    let out = request(Some("corral"));
    assert!(out.status.success(), "corral: {}", describe(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("uint32 3"), "{}", describe(&out));
}
