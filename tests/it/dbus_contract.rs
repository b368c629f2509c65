//! What corrald serves on D-Bus is what `dbus/org.corral.Corral1.*.xml` promises: every
//! method, signal, argument, property, type, access and annotation of our interfaces.

use std::collections::BTreeSet;

use zbus_xml::{ArgDirection, Node};

use crate::support::container::repo_root;
use crate::support::dbus::BusDaemon;

/// Everything about an interface that a client depends on, as comparable lines.
fn shape(node: &Node<'_>, interface: &str) -> BTreeSet<String> {
    let iface = node
        .interfaces()
        .iter()
        .find(|i| i.name().as_str() == interface)
        .unwrap_or_else(|| panic!("no interface {interface} in the node"));
    let mut lines = BTreeSet::new();
    for m in iface.methods() {
        let args: Vec<String> = m
            .args()
            .iter()
            .map(|a| {
                let dir = match a.direction() {
                    Some(ArgDirection::Out) => "out",
                    _ => "in",
                };
                format!("{dir} {}: {}", a.name().unwrap_or("?"), a.ty().inner())
            })
            .collect();
        lines.insert(format!("method {}({})", m.name(), args.join(", ")));
    }
    for s in iface.signals() {
        let args: Vec<String> =
            s.args().iter().map(|a| format!("{}: {}", a.name().unwrap_or("?"), a.ty().inner())).collect();
        lines.insert(format!("signal {}({})", s.name(), args.join(", ")));
    }
    for p in iface.properties() {
        // The specification's default is "true": an absent annotation says the same.
        let emits = p
            .annotations()
            .iter()
            .find(|a| a.name() == "org.freedesktop.DBus.Property.EmitsChangedSignal")
            .map_or("true", |a| a.value());
        lines.insert(format!("property {}: {} {:?} emits={emits}", p.name(), p.ty().inner(), p.access()));
    }
    lines
}

fn contract(interface: &str) -> String {
    let file = repo_root().join("dbus").join(format!("{interface}.xml"));
    std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()))
}

fn served(daemon: &BusDaemon, path: &str) -> String {
    let out = daemon.busctl(None, &["introspect", "--xml-interface", "org.corral.Corral1", path]);
    assert!(out.status.success(), "busctl introspect {path}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8")
}

fn assert_same(interface: &str, served_xml: &str) {
    let promised_xml = contract(interface);
    let promised = Node::from_reader(promised_xml.as_bytes()).expect("the contract parses");
    let served = Node::from_reader(served_xml.as_bytes()).expect("the served XML parses");
    let (promised, served) = (shape(&promised, interface), shape(&served, interface));
    let missing: Vec<_> = promised.difference(&served).collect();
    let extra: Vec<_> = served.difference(&promised).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{interface}: the daemon differs from dbus/{interface}.xml\n  promised, not served: {missing:#?}\n  served, not promised: {extra:#?}"
    );
}

#[test]
fn the_served_interfaces_match_the_xml_contract() {
    let daemon = BusDaemon::start("");
    assert_same("org.corral.Corral1.Manager", &served(&daemon, "/org/corral/Corral1"));
    assert_same("org.corral.Corral1.Model", &served(&daemon, "/org/corral/Corral1/models/chat_3alatest"));
    // A job to look at: a copy.
    let out = daemon.busctl(
        None,
        &[
            "call",
            "org.corral.Corral1",
            "/org/corral/Corral1",
            "org.corral.Corral1.Manager",
            "Copy",
            "ss",
            "chat",
            "chat-copy",
        ],
    );
    assert!(out.status.success(), "Copy: {}", String::from_utf8_lossy(&out.stderr));
    let job = String::from_utf8(out.stdout).expect("utf-8");
    let job = job.trim().strip_prefix("o ").expect("an object path").trim_matches('"').to_owned();
    assert!(job.starts_with("/org/corral/Corral1/jobs/"), "{job}");
    assert_same("org.corral.Corral1.Job", &served(&daemon, &job));
    // The root also serves the object manager, for discovery.
    let root = served(&daemon, "/org/corral/Corral1");
    assert!(root.contains("org.freedesktop.DBus.ObjectManager"), "{root}");
}

#[test]
fn the_comparison_catches_a_difference() {
    // The check above must be able to fail: a served interface lacking one method.
    let promised = contract("org.corral.Corral1.Manager");
    let altered = promised.replacen("<method name=\"Unload\">", "<method name=\"Unload2\">", 1);
    assert_ne!(promised, altered);
    let result = std::panic::catch_unwind(|| assert_same("org.corral.Corral1.Manager", &altered));
    let message = *result.expect_err("a difference must fail").downcast::<String>().expect("a message");
    assert!(message.contains("method Unload(in name: s)") && message.contains("Unload2"), "{message}");
}
