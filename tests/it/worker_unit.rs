//! The RPC worker unit `corral-rpc@.service` under real systemd 252 as PID 1 (a throwaway
//! container per test) with the real rpc-server: it serves its devices on the instance's
//! address as its own dynamic user, with its tensor cache in its `CacheDirectory=` (a
//! model's second load reads its big weights from there); it refuses the wildcard address
//! unless a drop-in allows it; its exposure score; and its IP filter, between network
//! namespaces the test makes inside the container: the head that `IPAddressAllow=` names
//! can list the worker's devices, another host cannot connect.  Under a `MemoryMax=` the
//! worker's allocation beyond it fails (a load out of memory naming its buffer) instead of
//! the OOM killer killing it.  The unit file verifies without a warning, and its man page
//! documents every setting of the launcher.

use corral::demo_model::{LlamaShape, Weights, write_llama};
use corral::supervisor::logparse::ErrorClass;

use crate::support::container::{Container, poll_until, repo_root};
use crate::support::journald::field;
use crate::systemd_container::{SETTLE, curl, wait_active_state};

/// The launcher's path, as the packages install it (the unit's `ExecStart=`).
const LAUNCHER: &str = "/usr/libexec/corral/rpc-worker";
/// systemd's range of dynamic users (`DynamicUser=yes`).
const DYNAMIC_UIDS: std::ops::RangeInclusive<u32> = 61184..=65519;
/// How long a client that must not get through is given to try.
const DENIED_WAIT: &str = "5";
/// The highest exposure `systemd-analyze security` may give the unit.
const MAX_EXPOSURE: f64 = 2.5;

/// Installs the worker unit as the packages do (the unit, the launcher, the sysusers.d
/// file), with the real rpc-server and llama-server in `/usr/local/bin`, on the unit's
/// `PATH`: the unit finds rpc-server by its bare name, as it does by default.
fn install_worker(ct: &Container) {
    let share = ct.share_dir();
    let systemd = repo_root().join("systemd");
    for (from, to) in [
        (systemd.join("corral-rpc@.service"), "corral-rpc@.service"),
        (systemd.join("corral-rpc-worker"), "rpc-worker"),
        (systemd.join("corral-rpc.sysusers"), "corral-rpc.sysusers"),
        (crate::support::llama::bin_dir().join("rpc-server"), "rpc-server"),
        (crate::support::llama::bin_dir().join("llama-server"), "llama-server"),
    ] {
        std::fs::copy(&from, share.join(to)).unwrap_or_else(|e| panic!("stage {}: {e}", from.display()));
    }
    ct.run(&["install", "-D", "-m", "0755", "/srv/host/rpc-worker", LAUNCHER]);
    ct.run(&["install", "-m", "0644", "/srv/host/corral-rpc@.service", "/etc/systemd/system/"]);
    ct.run(&["install", "-D", "-m", "0644", "/srv/host/corral-rpc.sysusers", "/usr/lib/sysusers.d/corral-rpc.conf"]);
    ct.run(&["systemd-sysusers", "corral-rpc.conf"]);
    ct.run(&["install", "-m", "0755", "/srv/host/rpc-server", "/srv/host/llama-server", "/usr/local/bin/"]);
    ct.run(&["systemctl", "daemon-reload"]);
}

/// The unit of the worker on `instance`.
fn unit(instance: &str) -> String {
    format!("corral-rpc@{instance}.service")
}

/// Writes a drop-in for `unit` and reloads systemd.
fn drop_in(ct: &Container, unit: &str, text: &str) {
    let dir = format!("/etc/systemd/system/{unit}.d");
    ct.run(&["mkdir", "-p", &dir]);
    ct.run(&["sh", "-c", &format!("printf '%s' \"$1\" >{dir}/50-test.conf"), "sh", text]);
    ct.run(&["systemctl", "daemon-reload"]);
}

/// `llama-server --rpc ENDPOINT --list-devices`, inside network namespace `netns` when
/// given, bounded by `timeout(1)` at `within` seconds; its status and its output.
fn list_devices(ct: &Container, netns: Option<&str>, endpoint: &str, within: &str) -> (Option<i32>, String) {
    let mut args = vec!["timeout", within];
    if let Some(ns) = netns {
        args.extend_from_slice(&["ip", "netns", "exec", ns]);
    }
    args.extend_from_slice(&["llama-server", "--rpc", endpoint, "--list-devices"]);
    let out = ct.exec(&args);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code(), text)
}

/// The device line llama-server prints for the worker at `endpoint`: `RPC0: ENDPOINT (N MiB,
/// M MiB free)` with N > 0.
fn rpc_device(listing: &str, endpoint: &str) -> Option<String> {
    let line = listing.lines().map(str::trim).find(|l| l.starts_with(&format!("RPC0: {endpoint} (")))?;
    let total: u64 = line.split_once(" (")?.1.split_once(" MiB")?.0.parse().ok()?;
    (total > 0 && line.ends_with("MiB free)")).then(|| line.to_owned())
}

/// Waits until the worker at `endpoint` lists its devices to llama-server (from `netns`).
fn wait_serving(ct: &Container, netns: Option<&str>, endpoint: &str) -> String {
    poll_until(SETTLE, &format!("the worker at {endpoint} to list its devices"), || {
        let (_, listing) = list_devices(ct, netns, endpoint, "30");
        rpc_device(&listing, endpoint).ok_or(listing)
    })
}

/// The messages of `unit`'s journal.
fn messages(ct: &Container, unit: &str) -> Vec<String> {
    ct.journal(unit).iter().filter_map(|e| field(e, "MESSAGE")).collect()
}

/// Waits until `unit`'s journal has a message containing `text`, and returns it.
fn wait_message(ct: &Container, unit: &str, text: &str) -> String {
    poll_until(SETTLE, &format!("'{text}' in the journal of {unit}"), || {
        let all = messages(ct, unit);
        all.iter().find(|m| m.contains(text)).cloned().ok_or_else(|| all.join("\n"))
    })
}

/// An address list property of `unit` (`IPAddressAllow`, `IPAddressDeny`), in order.
fn addresses(ct: &Container, unit: &str, property: &str) -> Vec<String> {
    let mut list: Vec<String> = ct.unit_property(unit, property).split_whitespace().map(str::to_owned).collect();
    list.sort();
    list
}

/// A container with the worker unit installed and the instance `instance` started.
fn started_worker(label: &str, instance: &str) -> (Container, String) {
    let ct = Container::boot(label);
    install_worker(&ct);
    let unit = unit(instance);
    ct.run(&["systemctl", "start", &unit]);
    wait_active_state(&ct, &unit, "active");
    (ct, unit)
}

/// The command line of process `pid`, its arguments joined by spaces.
fn cmdline(ct: &Container, pid: &str) -> String {
    ct.run(&["sh", "-c", &format!("tr '\\0' ' ' </proc/{pid}/cmdline")])
}

/// How many connections rpc-server logged as accepted.
fn accepted(ct: &Container, unit: &str) -> usize {
    messages(ct, unit).iter().filter(|m| m.as_str() == "Accepted client connection").count()
}

#[test]
fn the_worker_unit_serves_its_devices_as_its_own_user_with_its_tensor_cache() {
    let (ct, unit) = started_worker("worker-unit", "127.0.0.1:50052");

    // llama-server sees the worker's device, on the instance's address.
    let device = wait_serving(&ct, None, "127.0.0.1:50052");
    assert!(device.contains("MiB"), "{device}");

    // The main process is rpc-server itself (the launcher exec'd it), with the instance's
    // address and port and the tensor cache on.
    let pid = ct.unit_property(&unit, "MainPID");
    assert_ne!(pid, "0");
    assert_eq!(ct.run(&["readlink", &format!("/proc/{pid}/exe")]), "/usr/local/bin/rpc-server");
    assert_eq!(cmdline(&ct, &pid), "/usr/local/bin/rpc-server -H 127.0.0.1 -p 50052 -c");

    // It runs as the unit's own dynamic user, with the GPUs' groups.
    assert_eq!(ct.unit_property(&unit, "DynamicUser"), "yes");
    let owner = ct.run(&["stat", "-c", "%U %u", &format!("/proc/{pid}")]);
    let (name, uid) = owner.split_once(' ').expect("user and uid");
    assert_eq!(name, "corral-rpc", "{owner}");
    assert!(DYNAMIC_UIDS.contains(&uid.parse().expect("uid")), "not a dynamic uid: {owner}");
    let groups = ct.run(&["ps", "-o", "supgrp=", "-p", &pid]);
    assert!(groups.contains("video") && groups.contains("render"), "supplementary groups: {groups}");

    // The tensor cache is the unit's CacheDirectory (rpc-server adds rpc/), made for its user.
    let cache = "/var/cache/corral-rpc/127.0.0.1:50052";
    let environ = ct.run(&["sh", "-c", &format!("tr '\\0' '\\n' </proc/{pid}/environ")]);
    assert!(environ.lines().any(|l| l == format!("CACHE_DIRECTORY={cache}")), "{environ}");
    assert!(environ.lines().any(|l| l == format!("LLAMA_CACHE={cache}")), "{environ}");
    let line = wait_message(&ct, &unit, "local cache");
    assert_eq!(line.split(':').skip(1).collect::<Vec<_>>().join(":").trim(), format!("{cache}/rpc"), "{line}");
    assert_eq!(ct.run(&["stat", "-L", "-c", "%U %a", &format!("{cache}/rpc")]), "corral-rpc 700");

    // A crash is restarted (Restart=always), by a new rpc-server.
    ct.run(&["kill", "-KILL", &pid]);
    let restarted = poll_until(SETTLE, "a new rpc-server after SIGKILL", || {
        let now = ct.unit_property(&unit, "MainPID");
        if now != pid && now != "0" && ct.unit_property(&unit, "ActiveState") == "active" {
            Ok(now)
        } else {
            Err(format!("MainPID {now}"))
        }
    });
    assert_eq!(ct.run(&["readlink", &format!("/proc/{restarted}/exe")]), "/usr/local/bin/rpc-server");
    wait_serving(&ct, None, "127.0.0.1:50052");

    // As shipped, only loopback may connect.
    assert_eq!(addresses(&ct, &unit, "IPAddressDeny"), ["0.0.0.0/0", "::/0"]);
    assert_eq!(addresses(&ct, &unit, "IPAddressAllow"), ["127.0.0.0/8", "::1/128"]);
}

#[test]
fn the_worker_unit_refuses_a_wildcard_address_unless_a_drop_in_allows_it() {
    let ct = Container::boot("worker-wildcard");
    install_worker(&ct);

    // 0.0.0.0 is refused with the reason and the way out in the journal, and is not
    // restarted: the launcher exits 78 (RestartPreventExitStatus=).
    let wildcard = unit("0.0.0.0:50053");
    let _ = ct.exec(&["systemctl", "start", &wildcard]);
    wait_active_state(&ct, &wildcard, "failed");
    assert_eq!(ct.unit_property(&wildcard, "ExecMainStatus"), "78");
    assert_eq!(ct.unit_property(&wildcard, "NRestarts"), "0");
    let refusal = wait_message(&ct, &wildcard, "refusing the wildcard address 0.0.0.0");
    assert!(refusal.contains("no authentication") && refusal.contains("CORRAL_RPC_ALLOW_WILDCARD=1"), "{refusal}");
    let (_, listing) = list_devices(&ct, None, "127.0.0.1:50053", "30");
    assert!(rpc_device(&listing, "127.0.0.1:50053").is_none(), "nothing may listen: {listing}");

    // Forms inet_addr(3) would read as the wildcard, and names, are no addresses.
    for (instance, reason) in [("0:50054", "'0' is not an IPv4 address"), ("localhost", "'localhost' is not an IPv4")] {
        let refused = unit(instance);
        let _ = ct.exec(&["systemctl", "start", &refused]);
        wait_active_state(&ct, &refused, "failed");
        assert_eq!(ct.unit_property(&refused, "ExecMainStatus"), "78", "{refused}");
        wait_message(&ct, &refused, reason);
    }

    // The explicit setting lets it bind every address, loopback included, and says so.
    drop_in(&ct, &wildcard, "[Service]\nEnvironment=CORRAL_RPC_ALLOW_WILDCARD=1\n");
    ct.run(&["systemctl", "reset-failed", &wildcard]);
    ct.run(&["systemctl", "start", &wildcard]);
    wait_active_state(&ct, &wildcard, "active");
    wait_serving(&ct, None, "127.0.0.1:50053");
    wait_message(&ct, &wildcard, "listening on every address (0.0.0.0), as CORRAL_RPC_ALLOW_WILDCARD=1 allows");
    let pid = ct.unit_property(&wildcard, "MainPID");
    let line = cmdline(&ct, &pid);
    assert!(line.contains("-H 0.0.0.0 -p 50053"), "{line}");
}

#[test]
fn the_worker_unit_rates_at_most_2_5_as_shipped_and_with_its_head_allowed() {
    let (ct, unit) = started_worker("worker-security", "127.0.0.1:50052");
    let shipped = ct.exposure(&unit);
    assert!(shipped <= MAX_EXPOSURE, "{unit} rates {shipped}");

    // The documented drop-in for a head on the network.
    drop_in(&ct, &unit, "[Service]\nIPAddressAllow=10.0.0.1\n");
    ct.run(&["systemctl", "restart", &unit]);
    wait_active_state(&ct, &unit, "active");
    let with_head = ct.exposure(&unit);
    assert!(with_head <= MAX_EXPOSURE, "{unit} with its head allowed rates {with_head}");
    eprintln!("systemd-analyze security {unit}: {shipped} as shipped, {with_head} with IPAddressAllow=10.0.0.1");
}

/// A veth pair from the container's network namespace (the worker's) to a new namespace
/// `ns`: `worker_ip` on this side, `peer_ip` (with a default route back) on the other.
fn link_namespace(ct: &Container, ns: &str, worker_ip: &str, peer_ip: &str) {
    let veth = format!("wk-{ns}");
    ct.run(&["ip", "netns", "add", ns]);
    ct.run(&["ip", "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", ns]);
    ct.run(&["ip", "addr", "add", &format!("{worker_ip}/24"), "dev", &veth]);
    ct.run(&["ip", "link", "set", &veth, "up"]);
    ct.run(&["ip", "-n", ns, "addr", "add", &format!("{peer_ip}/24"), "dev", "eth0"]);
    ct.run(&["ip", "-n", ns, "link", "set", "eth0", "up"]);
    ct.run(&["ip", "-n", ns, "link", "set", "lo", "up"]);
    ct.run(&["ip", "-n", ns, "route", "add", "default", "via", worker_ip]);
}

#[test]
fn only_the_head_that_ip_address_allow_names_reaches_the_worker() {
    let ct = Container::boot("worker-ipfilter");
    install_worker(&ct);
    // Two hosts, each in a namespace of its own inside the container: the head on the
    // worker's network 10.77.1.0/24, and a stranger on 10.77.2.0/24 with a route to it.
    let endpoint = "10.77.1.1:50052";
    let unit = unit(endpoint);
    drop_in(&ct, &unit, "[Service]\nIPAddressAllow=10.77.1.2\n");

    // Started before its address exists (a tunnel that comes up late), rpc-server cannot
    // bind and exits; the unit tries again until the address is there.
    ct.run(&["systemctl", "start", &unit]);
    wait_message(&ct, &unit, "Failed to create server socket");
    poll_until(SETTLE, "the unit to try again", || {
        let restarts = ct.unit_property(&unit, "NRestarts");
        if restarts.parse::<u32>().is_ok_and(|n| n > 0) { Ok(()) } else { Err(restarts) }
    });
    link_namespace(&ct, "head", "10.77.1.1", "10.77.1.2");
    link_namespace(&ct, "stranger", "10.77.2.1", "10.77.2.2");
    wait_active_state(&ct, &unit, "active");
    assert_eq!(addresses(&ct, &unit, "IPAddressDeny"), ["0.0.0.0/0", "::/0"]);
    assert_eq!(addresses(&ct, &unit, "IPAddressAllow"), ["10.77.1.2/32", "127.0.0.0/8", "::1/128"]);

    // The head lists the worker's device.
    wait_serving(&ct, Some("head"), endpoint);
    let before = poll_until(SETTLE, "rpc-server to log the head's connection", || {
        let n = accepted(&ct, &unit);
        if n > 0 { Ok(n) } else { Err(messages(&ct, &unit).join("\n")) }
    });

    // The stranger's connection never reaches rpc-server: systemd's BPF filter drops its
    // packets, so its llama-server lists nothing until timeout(1) ends it.
    let (status, listing) = list_devices(&ct, Some("stranger"), endpoint, DENIED_WAIT);
    assert_eq!(status, Some(124), "the stranger must hang until the timeout: {listing}");
    assert!(rpc_device(&listing, endpoint).is_none(), "{listing}");
    assert_eq!(accepted(&ct, &unit), before, "rpc-server accepted the stranger");

    // Control: the same stranger, once IPAddressAllow= names it too, gets through: the
    // route was there, the filter alone kept it out.
    ct.run(&["systemctl", "set-property", "--runtime", &unit, "IPAddressAllow=10.77.2.2"]);
    let (_, listing) = list_devices(&ct, Some("stranger"), endpoint, "30");
    assert!(rpc_device(&listing, endpoint).is_some(), "allowed now, the stranger lists the device: {listing}");
    assert!(ct.exposure(&unit) <= MAX_EXPOSURE);
}

#[test]
fn the_worker_unit_verifies_without_a_single_warning() {
    let dir = tempfile::tempdir().expect("tempdir");
    let systemd = repo_root().join("systemd");
    let text = std::fs::read_to_string(systemd.join("corral-rpc@.service")).expect("read the unit");
    assert!(text.contains(&format!("ExecStart={LAUNCHER} %I")), "{text}");
    // The launcher from the checkout stands at its installed path (verify checks it exists).
    let launcher = systemd.join("corral-rpc-worker").display().to_string();
    let unit = dir.path().join("corral-rpc@.service");
    std::fs::write(&unit, text.replace(LAUNCHER, &launcher)).expect("write the unit");
    // A template is verified as an instance of it.
    let (ok, output) =
        crate::shipped::analyze(&["verify".to_owned(), "--man=no".to_owned(), unit.display().to_string()]);
    assert!(ok && output.trim().is_empty(), "systemd-analyze verify:\n{output}");
}

#[test]
fn the_worker_man_page_renders_and_documents_every_setting() {
    let page = repo_root().join("packaging/man/corral-rpc@.service.8");
    let out = std::process::Command::new("groff").arg("-man").arg("-ww").arg("-z").arg(&page).output().expect("groff");
    let warnings = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && warnings.is_empty(), "groff: {warnings}");
    let text = std::fs::read_to_string(&page).expect("read the man page");
    // Every variable the launcher reads has an entry.
    let launcher = std::fs::read_to_string(repo_root().join("systemd/corral-rpc-worker")).expect("read the launcher");
    let mut settings: Vec<&str> = launcher
        .split(|c: char| !(c.is_ascii_uppercase() || c == '_'))
        .filter(|w| w.starts_with("CORRAL_RPC_") && w.len() > "CORRAL_RPC_".len())
        .collect();
    settings.sort_unstable();
    settings.dedup();
    assert_eq!(settings.len(), 6, "{settings:?}");
    for setting in settings {
        assert!(text.contains(&format!(".B {setting}\n")), "corral-rpc@.service(8) documents {setting}");
    }
}

/// A llama with weight matrices over rpc-server's 10 MiB threshold for its tensor cache
/// (feed-forward 2048 × 4096 in F16: 16 MiB each); one layer, about 70 MiB.
const CACHED_LLAMA: LlamaShape = LlamaShape {
    name: "corral-cache-llama",
    n_layer: 1,
    n_embd: 2048,
    n_ff: 4096,
    n_head: 16,
    n_head_kv: 4,
    context: 512,
    weights: Weights::RandomBits,
};

/// Starts llama-server as the transient unit `unit` on the staged model, every layer on
/// the worker at 127.0.0.1:50052, serving on 127.0.0.1:8080.
fn start_head(ct: &Container, unit: &str) {
    ct.run(&[
        "systemd-run",
        &format!("--unit={unit}"),
        "/usr/local/bin/llama-server",
        "-m",
        "/srv/host/cached.gguf",
        "--rpc",
        "127.0.0.1:50052",
        "-ngl",
        "99",
        "-c",
        "512",
        "--host",
        "127.0.0.1",
        "--port",
        "8080",
    ]);
}

/// Loads the staged model with every layer on the worker (llama-server as the transient
/// unit `unit`), waits until it is ready and has it compute two tokens; then stops it
/// and waits until the worker saw the connection close.
fn load_on_the_worker(ct: &Container, worker: &str, unit: &str) {
    let closed = messages(ct, worker).iter().filter(|m| m.as_str() == "Client connection closed").count();
    start_head(ct, unit);
    poll_until(SETTLE, "llama-server to load the model on the worker", || {
        match curl(ct, &[], "http://127.0.0.1:8080/health") {
            Ok((200, _)) => Ok(()),
            Ok((code, body)) => Err(format!("{code} {body}")),
            Err(e) => Err(e),
        }
    });
    let body = serde_json::json!({"prompt": "Hello", "n_predict": 2}).to_string();
    let (code, answer) = curl(ct, &["-d", &body], "http://127.0.0.1:8080/completion").expect("completion");
    assert_eq!(code, 200, "a completion computed on the worker: {answer}");
    ct.run(&["systemctl", "stop", unit]);
    poll_until(SETTLE, "the worker to see the head's connection close", || {
        let now = messages(ct, worker).iter().filter(|m| m.as_str() == "Client connection closed").count();
        if now > closed { Ok(()) } else { Err(format!("{now} closed")) }
    });
}

/// The cache files rpc-server logged as saved.
fn saved(ct: &Container, unit: &str) -> Vec<String> {
    messages(ct, unit)
        .iter()
        .filter_map(|m| m.split_once("saved to '").and_then(|(_, rest)| rest.strip_suffix('\'')).map(str::to_owned))
        .collect()
}

#[test]
fn the_worker_keeps_the_tensors_it_was_sent_in_its_cache_for_the_next_load() {
    let (ct, worker) = started_worker("worker-cache", "127.0.0.1:50052");
    write_llama(&ct.share_dir().join("cached.gguf"), &CACHED_LLAMA).expect("write the model");
    wait_serving(&ct, None, "127.0.0.1:50052");

    // The first load sends the big weights and the worker writes each into its cache.
    load_on_the_worker(&ct, &worker, "test-head-1");
    let first = saved(&ct, &worker);
    assert!(first.len() >= 3, "the feed-forward weights are cached: {first:?}");
    let dir = "/var/cache/corral-rpc/127.0.0.1:50052/rpc";
    for file in &first {
        assert!(file.starts_with(&format!("{dir}/")), "{file} is outside the CacheDirectory");
        assert_eq!(ct.run(&["stat", "-L", "-c", "%U %s", file]).split(' ').next(), Some("corral-rpc"), "{file}");
    }
    let listed = ct.run(&["ls", "-1", &format!("{dir}/")]);
    assert_eq!(listed.lines().count(), first.len(), "{listed}");
    eprintln!("the first load cached {} tensors in {dir}", first.len());

    // The second load finds them there: nothing is sent or saved again, and it computes.
    load_on_the_worker(&ct, &worker, "test-head-2");
    assert_eq!(saved(&ct, &worker), first, "the second load must come from the cache");
}

#[test]
fn a_worker_under_memory_max_fails_an_allocation_beyond_it_instead_of_being_killed() {
    let ct = Container::boot_with_memory_controller("worker-memory");
    install_worker(&ct);
    let worker = unit("127.0.0.1:50052");
    // 48 MiB: rpc-server itself takes a few, the model's weights about 70.
    drop_in(&ct, &worker, "[Service]\nMemoryMax=48M\n");
    ct.run(&["systemctl", "start", &worker]);
    wait_active_state(&ct, &worker, "active");
    wait_message(&ct, &worker, &format!("rpc-server's data limit is the unit's memory limit, {} bytes", 48 << 20));
    write_llama(&ct.share_dir().join("cached.gguf"), &CACHED_LLAMA).expect("write the model");
    wait_serving(&ct, None, "127.0.0.1:50052");

    let head = "test-head.service";
    start_head(&ct, head);
    wait_active_state(&ct, head, "failed");
    // The load fails out of memory, naming the worker's buffer, as corrald classifies it.
    let mut report = corral::supervisor::logparse::LoadReport::new();
    let lines = messages(&ct, head);
    for line in &lines {
        let _ = report.feed(line);
    }
    let all = lines.join("\n");
    assert_eq!(report.failure_class(), Some(ErrorClass::OutOfMemory), "{all}");
    let message = report.failure_message().expect("a failure line");
    assert!(message.contains("allocate RPC0[127.0.0.1:50052] buffer"), "{message}");
    // The worker says why, and lives on: not killed, not restarted, and serving.
    wait_message(&ct, &worker, "failed to allocate buffer");
    assert_eq!(ct.unit_property(&worker, "ActiveState"), "active");
    assert_eq!(ct.unit_property(&worker, "NRestarts"), "0");
    // The OOM kills in the unit's cgroup: cgroup2's memory.events, or v1's memory.oom_control.
    let cgroup = ct.unit_property(&worker, "ControlGroup");
    let events = ct.run(&[
        "sh",
        "-c",
        "cat /sys/fs/cgroup$1/memory.events 2>/dev/null || cat /sys/fs/cgroup/memory$1/memory.oom_control",
        "sh",
        &cgroup,
    ]);
    assert!(events.lines().any(|l| l == "oom_kill 0"), "no OOM kill: {events}");
    wait_serving(&ct, None, "127.0.0.1:50052");
}
