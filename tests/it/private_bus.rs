//! The private system-like bus (`support::bus`) enforces a policy file like the system bus
//! does.  Proven with a fixture policy (`tests/data/dbus/corral-it-fixture.conf`) and a
//! stand-in service (`tests/data/dbus/fixture-service.py`); corral's own policy is tested
//! elsewhere with the same fixture.

use std::path::PathBuf;
use std::process::Output;

use crate::support::bus::{PrivateBus, ensure_user};
use crate::support::container::{describe, repo_root};

const NAME: &str = "org.corral.ItFixture1";
const PATH: &str = "/org/corral/ItFixture1";
/// May own NAME.
const SERVICE_USER: &str = "corral-it-svc";
/// In group corral-it-admin: may call the Admin interface.
const ADMIN: &str = "corral-it-alice";
/// In no special group.
const OTHER: &str = "corral-it-bob";
const ADMIN_GROUP: &str = "corral-it-admin";
const ACCESS_DENIED: &str = "org.freedesktop.DBus.Error.AccessDenied";

fn data(file: &str) -> PathBuf {
    repo_root().join("tests/data/dbus").join(file)
}

fn fixture_bus() -> PrivateBus {
    ensure_user(SERVICE_USER, &[]);
    ensure_user(ADMIN, &[ADMIN_GROUP]);
    ensure_user(OTHER, &[]);
    PrivateBus::start(&data("corral-it-fixture.conf"))
}

fn request_name(bus: &PrivateBus, user: Option<&str>) -> Output {
    let name = format!("string:{NAME}");
    // Flags 4: do not queue, so the answer is immediate.
    bus.call_as(
        user,
        "org.freedesktop.DBus",
        "/org/freedesktop/DBus",
        "org.freedesktop.DBus.RequestName",
        &[&name, "uint32:4"],
    )
}

fn assert_denied(out: &Output, who: &str) {
    assert!(!out.status.success(), "{who} was allowed: {}", describe(out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(ACCESS_DENIED), "{who}: expected {ACCESS_DENIED}: {}", describe(out));
}

#[test]
fn only_the_service_user_may_own_the_name() {
    let bus = fixture_bus();

    let owner = request_name(&bus, Some(SERVICE_USER));
    assert!(owner.status.success(), "{SERVICE_USER} could not own {NAME}: {}\n{}", describe(&owner), bus.log());
    // 1: DBUS_REQUEST_NAME_REPLY_PRIMARY_OWNER
    assert!(String::from_utf8_lossy(&owner.stdout).contains("uint32 1"), "{}", describe(&owner));

    assert_denied(&request_name(&bus, Some(OTHER)), OTHER);
    assert_denied(&request_name(&bus, Some(ADMIN)), ADMIN);
    // deny own="*" binds root too: only the policy file can grant a name.
    assert_denied(&request_name(&bus, None), "root");

    // A name the policy does not mention is denied even to the service user.
    let other_name = bus.call_as(
        Some(SERVICE_USER),
        "org.freedesktop.DBus",
        "/org/freedesktop/DBus",
        "org.freedesktop.DBus.RequestName",
        &["string:org.corral.ItFixture2", "uint32:4"],
    );
    assert_denied(&other_name, "the service user for another name");
}

#[test]
fn only_group_members_may_call_the_method() {
    let mut bus = fixture_bus();
    let script = bus.dir().join("fixture-service.py");
    std::fs::copy(data("fixture-service.py"), &script).expect("copy the stand-in service");
    let address = bus.address().to_owned();
    let script = script.to_str().expect("UTF-8 path").to_owned();
    bus.spawn_as(Some(SERVICE_USER), &["/usr/bin/python3", &script, &address], "service");
    bus.wait_for_name(NAME, "service");

    let ping = |user: Option<&str>| bus.call_as(user, NAME, PATH, "org.corral.ItFixture1.Admin.Ping", &[]);

    let out = ping(Some(ADMIN));
    assert!(out.status.success(), "{ADMIN} (in {ADMIN_GROUP}) was refused: {}", describe(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("string \"pong\""), "{}", describe(&out));

    assert_denied(&ping(Some(OTHER)), OTHER);
    assert_denied(&ping(None), "root");

    // The default context still lets anyone introspect: the denial is the policy, not a broken bus.
    let introspect = bus.call_as(Some(OTHER), NAME, PATH, "org.freedesktop.DBus.Introspectable.Introspect", &[]);
    assert!(introspect.status.success(), "{OTHER} could not introspect: {}", describe(&introspect));
    assert!(String::from_utf8_lossy(&introspect.stdout).contains("org.corral.ItFixture1.Admin"));

    // Membership is the caller's real supplementary groups: without them, the admin is refused too.
    let no_groups = bus.run_as(
        None,
        &[
            "setpriv",
            &format!("--reuid={ADMIN}"),
            &format!("--regid={ADMIN}"),
            "--clear-groups",
            "dbus-send",
            &format!("--bus={address}"),
            "--print-reply",
            "--reply-timeout=20000",
            &format!("--dest={NAME}"),
            PATH,
            "org.corral.ItFixture1.Admin.Ping",
        ],
    );
    assert_denied(&no_groups, "the admin without supplementary groups");

    // And a client that only reads DBUS_SYSTEM_BUS_ADDRESS reaches this bus.
    let busctl = bus.run_as(
        Some(ADMIN),
        &["busctl", "--system", "--timeout=20", "call", NAME, PATH, "org.corral.ItFixture1.Admin", "Ping"],
    );
    assert!(busctl.status.success(), "busctl --system: {}", describe(&busctl));
    assert_eq!(String::from_utf8_lossy(&busctl.stdout).trim(), "s \"pong\"");
}
