//! `corralctl` end to end: the real binary against a real corrald (with runners of the
//! real llama-server) on a private system-like bus that enforces corral's own policy file
//! (`dbus/org.corral.Corral1.conf`), run as root and as a user outside the group corral.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use crate::support::bus::{PrivateBus, ensure_user};
use crate::support::container::{describe, repo_root};
use crate::support::corrald::free_port;
use crate::support::dbus::BusDaemon;
use crate::support::registry::DockerRegistry;

const CORRALCTL: &str = env!("CARGO_BIN_EXE_corralctl");
const WAIT: Duration = Duration::from_secs(60);
/// A user in no group of corral's: may read, may not change anything.
const OUTSIDER: &str = "corral-it-ctl-out";

/// corrald on a private bus, serving the demo store (`chat`, `embed`) over D-Bus, on a
/// loopback port and on a UNIX socket.
struct Rig {
    daemon: BusDaemon,
}

impl Rig {
    fn start() -> Self {
        ensure_user(OUTSIDER, &[]);
        Self { daemon: BusDaemon::start("[scheduler]\nnum_ctx = 512\n[gpu]\nfixed = true\nhost_memory = \"4GiB\"\n") }
    }

    /// `corralctl ARGS` as `user` (`None`: root), on the rig's bus.
    fn ctl_as(&self, user: Option<&str>, args: &[&str]) -> Output {
        let mut all = vec![CORRALCTL];
        all.extend_from_slice(args);
        self.daemon.bus.run_as(user, &all)
    }

    /// `corralctl ARGS` as root; asserts success and returns stdout.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.ctl_as(None, args);
        assert!(
            out.status.success(),
            "corralctl {}: {}\ncorrald:\n{}",
            args.join(" "),
            describe(&out),
            self.daemon.corrald.stderr()
        );
        String::from_utf8(out.stdout).expect("utf-8")
    }

    /// `corralctl --json ARGS` as root, parsed.
    fn json(&self, args: &[&str]) -> serde_json::Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let text = self.ok(&all);
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("corralctl {}: not JSON ({e}): {text}", all.join(" ")))
    }

    /// `corralctl ARGS` as `user`; asserts it fails with `code` and `message` on stderr.
    fn fails(&self, user: Option<&str>, args: &[&str], code: i32, message: &str) -> String {
        let out = self.ctl_as(user, args);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(code), "corralctl {}: {}", args.join(" "), describe(&out));
        assert!(stderr.contains(message), "corralctl {}: expected {message:?}: {}", args.join(" "), describe(&out));
        stderr
    }

    fn names(&self) -> Vec<String> {
        let list = self.json(&["list"]);
        list.as_array().expect("an array").iter().map(|m| m["name"].as_str().expect("a name").to_owned()).collect()
    }

    fn http(&self) -> String {
        format!("http://127.0.0.1:{}", self.daemon.port)
    }
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn corralctl_lists_shows_loads_and_unloads_models() {
    let rig = Rig::start();

    let list = rig.ok(&["list"]);
    let lines: Vec<&str> = list.lines().collect();
    assert!(lines[0].starts_with("NAME") && lines[0].contains("SIZE") && lines[0].contains("STATE"), "{list}");
    assert!(lines.iter().any(|l| l.starts_with("chat:latest") && l.ends_with("stopped")), "{list}");
    let json = rig.json(&["list"]);
    let chat = json.as_array().expect("array").iter().find(|m| m["name"] == "chat:latest").expect("chat listed");
    assert!(chat["digest"].as_str().expect("digest").starts_with("sha256:"), "{chat}");
    assert!(chat["size"].as_u64().expect("size") > 0, "{chat}");

    let show = rig.ok(&["show", "chat"]);
    assert!(show.contains("Name:") && show.contains("registry.ollama.ai/library/chat:latest"), "{show}");
    assert!(show.lines().any(|l| l.starts_with("State:") && l.ends_with("stopped")), "{show}");
    let shown = rig.json(&["show", "chat"]);
    assert_eq!(shown["short_name"], "chat:latest");
    assert_eq!(shown["details"]["format"], "gguf", "{shown}");
    assert_eq!(shown["pid"], 0);

    // Reading is open to everyone; changing is not.
    let as_outsider = rig.ctl_as(Some(OUTSIDER), &["list"]);
    assert!(as_outsider.status.success(), "{}", describe(&as_outsider));
    assert!(text(&as_outsider).contains("chat:latest"));
    let denied = rig.fails(Some(OUTSIDER), &["load", "chat"], 77, "permission denied: ");
    assert!(denied.contains("members of group corral or root"), "{denied}");
    rig.fails(Some(OUTSIDER), &["rm", "chat"], 77, "permission denied: ");
    assert!(rig.names().contains(&"chat:latest".to_owned()), "a refused rm changed the store");

    let loaded = rig.ok(&["load", "chat", "--keep-alive", "10m"]);
    assert!(loaded.starts_with("'chat:latest' is ready (pid "), "{loaded}");
    let ps = rig.json(&["ps"]);
    let running = &ps.as_array().expect("array")[0];
    assert_eq!(running["short_name"], "chat:latest", "{ps}");
    assert_eq!(running["state"], "ready", "{ps}");
    let pid = running["pid"].as_u64().expect("pid");
    assert!(Path::new(&format!("/proc/{pid}")).exists(), "pid {pid} is no process");
    assert!(running["ram_bytes"].as_u64().expect("ram") > 0, "{ps}");
    assert!(running["expires_at"].is_string(), "an idle model with a keep-alive expires: {ps}");
    let table = rig.ok(&["ps"]);
    let row = table.lines().nth(1).expect("a row");
    assert!(row.starts_with("chat:latest") && row.contains("ready") && row.contains(&pid.to_string()), "{table}");
    let until = row.trim_end_matches(|c: char| c == '-' || c.is_whitespace());
    assert!(row.contains(" in ") && until.ends_with('s'), "the time left to an unload: {table}");

    let status = rig.json(&["status"]);
    assert_eq!(status["loaded_models"], serde_json::json!(["chat:latest"]), "{status}");
    assert_eq!(status["host_memory"], 4u64 << 30, "{status}");
    assert_eq!(status["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(status["default_keep_alive"], 300);
    assert_eq!(status["gpus"], serde_json::json!([]));
    let human = rig.ok(&["status"]);
    assert!(
        human.lines().any(|l| l.starts_with("Loaded models:") && l.ends_with(" chat:latest (at most 3 runners)")),
        "{human}"
    );

    assert_eq!(rig.ok(&["unload", "chat"]), "unloaded 'chat'\n");
    assert_eq!(rig.json(&["ps"]), serde_json::json!([]));
    assert!(!Path::new(&format!("/proc/{pid}")).exists(), "the runner {pid} was not reaped");
    assert_eq!(rig.ok(&["unload", "chat"]), "'chat' is not loaded: nothing to unload\n");
}

#[test]
fn corralctl_copies_creates_and_removes_models() {
    let rig = Rig::start();

    assert_eq!(rig.ok(&["cp", "chat", "mine:v1"]), "copied 'chat' to 'mine:v1'\n");
    let names = rig.names();
    assert!(names.contains(&"mine:v1".to_owned()), "{names:?}");
    let copied = rig.json(&["show", "mine:v1"]);
    assert_eq!(copied["digest"], rig.json(&["show", "chat"])["digest"], "a copy has the same manifest");

    // A Modelfile with a relative FROM, given from another working directory: corralctl
    // makes the path absolute, since the daemon cannot know this one.
    let work = rig.daemon.path().join("work");
    std::fs::create_dir_all(work.join("weights")).expect("mkdir");
    corral::demo_model::write_tiny_llama(&work.join("weights/tiny.gguf")).expect("write the tiny llama");
    std::fs::write(
        work.join("Modelfile"),
        "FROM ./weights/tiny.gguf\nPARAMETER temperature 0.25\nSYSTEM \"\"\"Be brief.\"\"\"\n",
    )
    .expect("write the Modelfile");
    let modelfile = work.join("Modelfile");
    let modelfile = modelfile.to_str().expect("utf-8");
    let created = rig.ok(&["create", "made", "-f", modelfile]);
    assert!(created.lines().last() == Some("success"), "create prints its progress, then success: {created}");
    let made = rig.json(&["show", "made"]);
    assert_eq!(made["details"]["family"], "llama", "{made}");

    let outcome = rig.json(&["create", "made2", "-f", modelfile]);
    assert_eq!(outcome["kind"], "create");
    assert_eq!(outcome["state"], "succeeded");
    assert!(outcome["job"].as_str().expect("job").starts_with("/org/corral/Corral1/jobs/"), "{outcome}");

    // Wrong input is refused with what is wrong, and changes nothing.
    let before = rig.names();
    std::fs::write(work.join("Broken"), "FROM ./weights/missing.gguf\n").expect("write");
    let broken = work.join("Broken");
    rig.fails(
        None,
        &["create", "bad", "-f", broken.to_str().expect("utf-8")],
        1,
        "Modelfile line 1: FROM ./weights/missing.gguf: no such file",
    );
    std::fs::write(work.join("NoFrom"), "PARAMETER temperature 0.5\n").expect("write");
    let no_from = work.join("NoFrom");
    rig.fails(None, &["create", "bad", "-f", no_from.to_str().expect("utf-8")], 1, "no FROM instruction");
    rig.fails(None, &["create", "bad", "-f", "/nonexistent/Modelfile"], 1, "cannot read /nonexistent/Modelfile");
    rig.fails(None, &["create", "Bad Name!", "-f", modelfile], 1, "invalid model name 'Bad Name!'");
    rig.fails(None, &["show", "Bad Name!"], 1, "invalid model name 'Bad Name!'");
    rig.fails(None, &["show", "nothing-here"], 1, "model 'nothing-here' not found");
    rig.fails(None, &["load", "nothing-here"], 1, "not found");
    rig.fails(None, &["cp", "nothing-here", "other"], 1, "not found");
    rig.fails(None, &["rm", "nothing-here"], 1, "not found");
    rig.fails(None, &["show"], 2, "MODEL");
    assert_eq!(rig.names(), before, "a refused command changed the store");

    assert_eq!(rig.ok(&["rm", "mine:v1", "made"]), "deleted 'mine:v1'\ndeleted 'made'\n");
    let removed = rig.json(&["rm", "made2"]);
    assert_eq!(removed[0]["kind"], "delete", "{removed}");
    let names = rig.names();
    assert!(!names.iter().any(|n| n.starts_with("mine") || n.starts_with("made")), "{names:?}");
    assert!(names.contains(&"chat:latest".to_owned()), "deleting a copy kept the original: {names:?}");
}

#[test]
fn corralctl_run_chats_with_the_real_llama_server() {
    let rig = Rig::start();
    let http = rig.http();

    let out = rig.ok(&["run", "chat", "Say hello", "--option", "num_predict=16", "--host", &http]);
    assert!(out.ends_with('\n') && out.trim().chars().count() > 0, "no reply: {out:?}");

    // On the UNIX socket, named by CORRAL_HOST; --json gives the whole reply as one object.
    let socket = rig.daemon.socket();
    let socket = socket.to_str().expect("utf-8");
    let mut cmd = rig.daemon.bus.command_as(None, &[CORRALCTL, "--json", "run", "chat", "Hi", "-o", "num_predict=16"]);
    cmd.env("CORRAL_HOST", socket);
    let json = crate::support::container::output_within(&mut cmd, WAIT);
    assert!(json.status.success(), "{}", describe(&json));
    let reply: serde_json::Value = serde_json::from_slice(&json.stdout).expect("JSON");
    assert_eq!(reply["message"]["role"], "assistant", "{reply}");
    assert!(!reply["message"]["content"].as_str().expect("content").is_empty(), "{reply}");

    // Without a prompt, each line of standard input is a turn of one conversation.
    let script = format!(
        "printf 'Hello\\nAnd again\\n/bye\\nnever sent\\n' | {CORRALCTL} --json run chat -o num_predict=16 --host {http}"
    );
    let conversation = rig.daemon.bus.run_as(None, &["sh", "-c", &script]);
    assert!(conversation.status.success(), "{}", describe(&conversation));
    let turns: Vec<serde_json::Value> = serde_json::Deserializer::from_slice(&conversation.stdout)
        .into_iter()
        .collect::<Result<_, _>>()
        .expect("JSON objects");
    assert_eq!(turns.len(), 2, "two turns before /bye: {}", describe(&conversation));

    rig.fails(None, &["run", "nothing-here", "Hi", "--host", &http], 1, "not found");
    rig.fails(None, &["run", "chat", "Hi", "--host", "https://example.org"], 1, "https is not supported");
}

#[test]
fn corralctl_pushes_and_pulls_back_with_progress() {
    let rig = Rig::start();
    let registry = DockerRegistry::start();
    let remote = format!("{}/me/chat:1", registry.host());

    rig.ok(&["cp", "chat", &remote]);
    // The registry speaks plain HTTP: without --insecure the job fails and says why.
    let refused = rig.fails(None, &["push", &remote], 1, &format!("push of '{remote}' failed: "));
    assert!(!refused.is_empty());

    let pushed = rig.ok(&["push", &remote, "--insecure"]);
    assert_eq!(pushed.lines().last(), Some("success"), "{pushed}");
    let digest = rig.json(&["show", &remote])["digest"].clone();
    rig.ok(&["rm", &remote]);
    assert!(!rig.names().contains(&remote), "removed before the pull");

    let pulled = rig.ok(&["pull", &remote, "--insecure"]);
    assert!(pulled.lines().any(|l| l.starts_with("pulling ")), "pull shows its steps: {pulled}");
    assert_eq!(pulled.lines().last(), Some("success"), "{pulled}");
    assert_eq!(rig.json(&["show", &remote])["digest"], digest, "the pulled model is the pushed one");

    rig.fails(None, &["pull", &format!("{}/me/absent:1", registry.host()), "--insecure"], 1, "failed: ");

    // On a terminal (script(1) gives it one), pull draws a bar per layer.
    rig.ok(&["rm", &remote]);
    let on_tty =
        rig.daemon.bus.run_as(None, &["script", "-qec", &format!("{CORRALCTL} pull {remote} --insecure"), "/dev/null"]);
    assert!(on_tty.status.success(), "{}", describe(&on_tty));
    let screen = text(&on_tty);
    assert!(screen.contains("100% ▕") && screen.contains("success"), "no bar: {screen:?}");
    assert_eq!(rig.json(&["show", &remote])["digest"], digest);
}

#[test]
fn corralctl_says_when_corrald_is_not_running() {
    ensure_user("corral", &[]);
    let bus = PrivateBus::start(&repo_root().join("dbus/org.corral.Corral1.conf"));
    for args in [&["list"][..], &["status"], &["load", "chat"]] {
        let mut all = vec![CORRALCTL];
        all.extend_from_slice(args);
        let out = bus.run_as(None, &all);
        assert_eq!(out.status.code(), Some(69), "{}", describe(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.starts_with(
                "corralctl: corrald is not running (or not on the system bus): start it with `systemctl start corrald`"
            ),
            "{}",
            describe(&out)
        );
    }

    // No bus at all.
    let mut cmd = Command::new(CORRALCTL);
    cmd.arg("list").env("DBUS_SYSTEM_BUS_ADDRESS", format!("unix:path={}/nothing", bus.dir().display()));
    let out = crate::support::container::output_within(&mut cmd, WAIT);
    assert_eq!(out.status.code(), Some(69), "{}", describe(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot connect to the system bus"), "{}", describe(&out));

    // No HTTP API for run.
    let port = free_port();
    let out = bus.run_as(None, &[CORRALCTL, "run", "chat", "Hi", "--host", &format!("http://127.0.0.1:{port}")]);
    assert_eq!(out.status.code(), Some(69), "{}", describe(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot reach corrald's HTTP API"), "{}", describe(&out));
}

/// A daemon too busy for the request is a temporary failure (75, `EX_TEMPFAIL`) over
/// D-Bus and over HTTP alike, so that a script knows to try again.
#[test]
fn corralctl_exits_75_when_corrald_is_too_busy() {
    ensure_user(OUTSIDER, &[]);
    // No room in the queue of loads at all: every load is refused as busy.
    let rig = Rig { daemon: BusDaemon::start("[scheduler]\nmax_queue = 0\n") };
    rig.fails(None, &["load", "chat"], 75, "server busy");
    rig.fails(None, &["run", "chat", "Hi", "--host", &rig.http()], 75, "server busy");
    // Other failures keep exit code 1.
    rig.fails(None, &["load", "nope"], 1, "not found");
}

#[test]
fn corralctl_prints_completions() {
    for (shell, marker) in [("bash", "complete -F"), ("zsh", "#compdef corralctl"), ("fish", "complete -c corralctl")] {
        let out = crate::support::container::output_within(Command::new(CORRALCTL).args(["completions", shell]), WAIT);
        assert!(out.status.success(), "{}", describe(&out));
        let script = String::from_utf8_lossy(&out.stdout);
        assert!(script.contains(marker) && script.contains("pull"), "{shell}: {script}");
    }
    // The bash script is valid bash.
    let out = crate::support::container::output_within(
        Command::new("bash").args(["-c", &format!("source <({CORRALCTL} completions bash) && complete -p corralctl")]),
        WAIT,
    );
    assert!(out.status.success(), "{}", describe(&out));
}
