//! Habits of people at the keyboard, for models: a model that shares another's runner
//! shows as loaded everywhere (`corralctl`, D-Bus, `/api/ps`); unloading tells "not
//! loaded" from "not found"; `list` is newest first; `show` has what `ollama show` has;
//! and the journal reads well: one model field, the child's pid, per-request chatter at
//! debug. Against corrald with runners of the real llama-server.

use std::net::SocketAddr;
use std::process::Output;
use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::Value;

use crate::support::container::{describe, poll_until};
use crate::support::corrald::free_port;
use crate::support::dbus::BusDaemon;
use crate::support::http;
use crate::support::journald::{JournalSandbox, field, summary};

const CORRALCTL: &str = env!("CARGO_BIN_EXE_corralctl");
const CORRALD: &str = env!("CARGO_BIN_EXE_corrald");
const SETTLE: Duration = Duration::from_secs(60);

/// corrald on a private bus with the demo store (`chat`, `embed`), CPU only.
struct Rig {
    daemon: BusDaemon,
}

impl Rig {
    fn start() -> Self {
        Self { daemon: BusDaemon::start("[scheduler]\nnum_ctx = 512\n[gpu]\nfixed = true\nhost_memory = \"4GiB\"\n") }
    }

    fn ctl(&self, args: &[&str]) -> Output {
        let mut all = vec![CORRALCTL];
        all.extend_from_slice(args);
        self.daemon.bus.run_as(None, &all)
    }

    /// stdout of a `corralctl ARGS` that succeeded.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.ctl(args);
        assert!(out.status.success(), "corralctl {}: {}", args.join(" "), describe(&out));
        String::from_utf8(out.stdout).expect("utf-8")
    }

    fn json(&self, args: &[&str]) -> Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        serde_json::from_str(&self.ok(&all)).expect("JSON")
    }

    /// `GET /api/ps`'s models.
    fn api_ps(&self) -> Vec<Value> {
        let addr = SocketAddr::from(([127, 0, 0, 1], self.daemon.port));
        let response = http::tcp(addr, "GET", "/api/ps");
        assert_eq!(response.status, 200, "{}", response.body);
        response.json()["models"].as_array().expect("models").clone()
    }
}

fn ps_entry<'a>(models: &'a [Value], name: &str) -> &'a Value {
    models.iter().find(|m| m["name"] == name).unwrap_or_else(|| panic!("{name} not in {models:?}"))
}

#[test]
fn a_model_sharing_a_runner_shows_as_loaded_and_says_with_whom() {
    let rig = Rig::start();
    // A copy has the same weights and, without options of its own, the same load options.
    assert_eq!(rig.ok(&["cp", "chat", "tiny2"]), "copied 'chat' to 'tiny2'\n");

    let chat = rig.ok(&["load", "chat"]);
    assert!(chat.starts_with("'chat:latest' is ready (pid "), "{chat}");
    let tiny2 = rig.ok(&["load", "tiny2"]);
    assert!(tiny2.starts_with("'tiny2:latest' is ready (pid "), "not 'stopped (pid 0)': {tiny2}");
    assert!(tiny2.contains("sharing the runner of 'chat:latest'"), "{tiny2}");

    // D-Bus: both ready, one process, each naming the other.
    let (a, b) = (rig.json(&["show", "chat"]), rig.json(&["show", "tiny2"]));
    assert_eq!((a["state"].as_str(), b["state"].as_str()), (Some("ready"), Some("ready")), "{a}\n{b}");
    assert_eq!(a["pid"], b["pid"], "one llama-server serves both");
    assert_eq!(a["shared_with"], serde_json::json!(["tiny2:latest"]));
    assert_eq!(b["shared_with"], serde_json::json!(["chat:latest"]));
    let status = rig.json(&["status"]);
    assert_eq!(status["loaded_models"], serde_json::json!(["chat:latest", "tiny2:latest"]), "{status}");

    // corralctl ps: a row each, with the sharing shown.
    let ps = rig.json(&["ps"]);
    let names: Vec<&str> = ps.as_array().expect("array").iter().filter_map(|m| m["short_name"].as_str()).collect();
    assert_eq!(names, ["chat:latest", "tiny2:latest"], "{ps}");
    let table = rig.ok(&["ps"]);
    assert!(table.lines().next().is_some_and(|h| h.ends_with("SHARED WITH")), "{table}");
    assert!(table.lines().any(|l| l.starts_with("tiny2:latest") && l.ends_with("chat:latest")), "{table}");

    // /api/ps: an entry per model name.
    let models = rig.api_ps();
    assert_eq!(models.len(), 2, "{models:?}");
    assert_eq!(ps_entry(&models, "tiny2:latest")["shared_with"], serde_json::json!(["chat:latest"]));
    assert_eq!(ps_entry(&models, "chat:latest")["shared_with"], serde_json::json!(["tiny2:latest"]));

    // Unloading one stops the one process, and says so.
    let unloaded = rig.ok(&["unload", "tiny2"]);
    assert_eq!(unloaded, "unloaded 'tiny2' and 'chat:latest', which shared its runner\n");
    assert_eq!(rig.json(&["ps"]), serde_json::json!([]));
    assert_eq!(rig.json(&["show", "chat"])["state"], "stopped");
}

#[test]
fn other_load_options_get_a_runner_of_their_own_and_replace_nothing_silently() {
    let rig = Rig::start();
    rig.ok(&["cp", "chat", "tiny2"]);
    rig.ok(&["load", "chat"]);
    let chat_pid = rig.json(&["show", "chat"])["pid"].clone();
    // Another context: not the same runner; chat's stays as it was.
    let tiny2 = rig.ok(&["load", "tiny2", "--num-ctx", "256"]);
    assert!(tiny2.starts_with("'tiny2:latest' is ready (pid "), "{tiny2}");
    assert!(!tiny2.contains("sharing"), "{tiny2}");
    let (chat, tiny2) = (rig.json(&["show", "chat"]), rig.json(&["show", "tiny2"]));
    assert_eq!((chat["state"].as_str(), tiny2["state"].as_str()), (Some("ready"), Some("ready")), "{chat}\n{tiny2}");
    assert_eq!(chat["pid"], chat_pid, "chat's runner was not replaced");
    assert_ne!(tiny2["pid"], chat_pid);
    assert_eq!(chat["shared_with"], serde_json::json!([]));
    let models = rig.api_ps();
    assert_eq!(ps_entry(&models, "tiny2:latest")["context_length"], 256);
    assert_eq!(ps_entry(&models, "chat:latest")["context_length"], 512);
}

#[test]
fn unload_tells_not_loaded_from_not_found_and_list_is_newest_first() {
    let rig = Rig::start();
    // Not loaded: already where unloading takes it; said, exit 0 (as `systemctl stop`).
    let out = rig.ctl(&["unload", "chat"]);
    assert!(out.status.success(), "{}", describe(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "'chat' is not loaded: nothing to unload\n");
    assert_eq!(rig.json(&["unload", "chat"])["unloaded"], false);
    // Not in the store: a failure that says so.
    let out = rig.ctl(&["unload", "nothing-here"]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("model 'nothing-here' not found"), "{}", describe(&out));
    // The D-Bus errors are told apart by name.
    let call = |name: &str| {
        let arg = format!("string:{name}");
        let out = rig.daemon.bus.call_as(
            None,
            "org.corral.Corral1",
            "/org/corral/Corral1",
            "org.corral.Corral1.Manager.Unload",
            &[arg.as_str()],
        );
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let not_loaded = call("chat");
    assert!(not_loaded.contains("org.corral.Corral1.Error.NotLoaded"), "{not_loaded}");
    assert!(not_loaded.contains("model 'chat:latest' is not loaded"), "{not_loaded}");
    let not_found = call("nothing-here");
    assert!(not_found.contains("org.corral.Corral1.Error.NoSuchModel"), "{not_found}");
    assert!(not_found.contains("model 'nothing-here' not found"), "{not_found}");

    // Newest first, as `ollama list`: a copy made now comes before the demo models.
    rig.ok(&["cp", "embed", "aaa-newest"]);
    let list = rig.ok(&["list"]);
    let names: Vec<&str> = list.lines().skip(1).filter_map(|l| l.split_whitespace().next()).collect();
    assert_eq!(names.first(), Some(&"aaa-newest:latest"), "{list}");
    assert_eq!(names.len(), 3, "{list}");
    let json = rig.json(&["list"]);
    assert_eq!(json[0]["name"], "aaa-newest:latest", "{json}");
}

#[test]
fn show_has_the_system_prompt_parameters_context_capabilities_and_the_modelfile() {
    let rig = Rig::start();
    let dir = rig.daemon.dir.path();
    std::fs::write(
        dir.join("Modelfile"),
        "FROM ./tiny.gguf\nPARAMETER temperature 0.25\nPARAMETER stop \"<end>\"\nSYSTEM \"\"\"Be brief.\"\"\"\n",
    )
    .expect("write the Modelfile");
    let modelfile = dir.join("Modelfile");
    rig.ok(&["create", "brief", "-f", modelfile.to_str().expect("utf-8")]);

    let shown = rig.ok(&["show", "brief"]);
    let line = |label: &str| {
        shown.lines().find(|l| l.starts_with(label)).unwrap_or_else(|| panic!("no {label} in:\n{shown}")).to_owned()
    };
    assert!(line("System:").ends_with("Be brief."), "{shown}");
    assert!(line("Options:").contains("stop") && line("Options:").contains("\"<end>\""), "{shown}");
    // A value of several lines continues under its first.
    let temperature = shown.lines().find(|l| l.contains("temperature")).expect("temperature");
    assert!(temperature.starts_with(&" ".repeat("Options:".len())), "{shown}");
    assert!(line("Context length:").split_whitespace().last().is_some_and(|n| n.parse::<u64>().is_ok()), "{shown}");
    assert!(line("Capabilities:").ends_with("completion"), "{shown}");
    assert!(line("Modified:").contains('T'), "{shown}");
    let json = rig.json(&["show", "brief"]);
    assert_eq!(json["system"], "Be brief.");
    assert_eq!(json["capabilities"], serde_json::json!(["completion"]));
    assert!(json["context_length"].as_u64().is_some_and(|n| n > 0), "{json}");
    let embed = rig.json(&["show", "embed"]);
    assert_eq!(embed["capabilities"], serde_json::json!(["embedding"]));

    // --modelfile: the store's own writer, which reads back as the same model.
    let text = rig.ok(&["show", "--modelfile", "brief"]);
    assert!(text.starts_with("# Modelfile generated by corral"), "{text}");
    assert!(text.lines().any(|l| l.starts_with("FROM /")), "{text}");
    assert!(text.contains("SYSTEM") && text.contains("Be brief.") && text.contains("temperature 0.25"), "{text}");
    let out = rig.ctl(&["show", "--modelfile", "nothing-here"]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
}

/// corrald under a private journald, one chat: llama-server's entries carry the child's
/// pid in `SYSLOG_PID`, the chat adds no info-level llama-server entries, every entry has
/// one model field (`CORRAL_MODEL`, never `MODEL`), and corrald's entries about a model name
/// it in MESSAGE.
#[test]
fn the_journal_reads_well_for_a_chat() {
    let dir = tempfile::tempdir().expect("tempdir");
    crate::support::api::demo_store(dir.path());
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let config = dir.path().join("corral.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = [\"{addr}\"]\n[store]\npath = \"{}\"\n[runner]\nllama_server = \"{}\"\n\
             [scheduler]\nnum_ctx = 512\n[gpu]\nfixed = true\nhost_memory = \"4GiB\"\n",
            dir.path().join("models").display(),
            crate::support::llama::bin_dir().join("llama-server").display(),
        ),
    )
    .expect("config");
    let mut sandbox = JournalSandbox::spawn(
        CORRALD,
        &["--config".as_ref(), config.as_os_str(), "--log-target".as_ref(), "journal".as_ref()],
    );
    poll_until(SETTLE, "corrald to answer", || {
        if let Some(status) = sandbox.try_status() {
            return Ok(Err(format!("corrald exited ({status}): {}", sandbox.script_errors())));
        }
        match std::net::TcpStream::connect(addr) {
            Ok(_) => Ok(Ok(())),
            Err(e) => Err(e.to_string()),
        }
    })
    .unwrap_or_else(|e: String| panic!("{e}"));

    let chat = |text: &str| {
        let body = serde_json::json!({
            "model": "chat", "stream": false, "options": {"num_predict": 4},
            "messages": [{"role": "user", "content": text}],
        })
        .to_string();
        let stream = std::net::TcpStream::connect(addr).expect("connect");
        let response = http::request(stream, "POST", "/api/chat", Some(&body));
        assert_eq!(response.status, 200, "{}", response.body);
    };
    // The server says "all slots are idle" once loaded and after each request: the
    // journal has all of a request's lines once it has that line again.
    let idle_lines = |count: usize| {
        poll_until(SETTLE, &format!("{count} idle lines"), || {
            let entries = sandbox.entries();
            let seen = entries
                .iter()
                .filter(|e| field(e, "MESSAGE").is_some_and(|m| m.contains("all slots are idle")))
                .count();
            if seen >= count { Ok(entries.len()) } else { Err(format!("{seen}: {}", summary(&entries))) }
        })
    };
    // The first chat loads the model; what the second adds is the per-chat noise.
    chat("hello");
    let before = idle_lines(2);
    chat("hello again");
    let after = idle_lines(3);
    sandbox.signal(Signal::SIGTERM);
    assert!(sandbox.wait(SETTLE).success(), "{}", sandbox.script_errors());
    let entries = sandbox.entries();
    let child = |e: &&Value| field(e, "SYSLOG_IDENTIFIER").as_deref() == Some("llama-server");

    // The second chat's llama-server entries are all debug.
    let during: Vec<&Value> = entries[before..after].iter().filter(child).collect();
    assert!(!during.is_empty(), "the chat's lines are forwarded: {}", summary(&entries));
    let info: Vec<String> = during
        .iter()
        .filter(|e| field(e, "PRIORITY").and_then(|p| p.parse::<u8>().ok()).is_some_and(|p| p <= 6))
        .filter_map(|e| field(e, "MESSAGE"))
        .collect();
    assert!(info.is_empty(), "info-level llama-server entries for one chat: {info:#?}");

    for entry in &entries {
        assert!(field(entry, "MODEL").is_none(), "MODEL beside CORRAL_MODEL: {entry}");
    }
    let lines: Vec<&Value> = entries.iter().filter(child).collect();
    assert!(!lines.is_empty());
    for entry in &lines {
        let pid = field(entry, "CORRAL_RUNNER_PID").expect("CORRAL_RUNNER_PID");
        assert_eq!(field(entry, "SYSLOG_PID"), Some(pid), "{entry}");
        assert_eq!(field(entry, "CORRAL_MODEL").as_deref(), Some("chat:latest"), "{entry}");
    }
    let own = entries.iter().filter(|e| field(e, "SYSLOG_IDENTIFIER").as_deref() == Some("corrald"));
    for entry in own.filter(|e| field(e, "CORRAL_MODEL").is_some()) {
        let (model, message) =
            (field(entry, "CORRAL_MODEL").expect("model"), field(entry, "MESSAGE").unwrap_or_default());
        assert!(message.contains(&model), "a message about {model} without its name: {message:?}");
        assert!(!message.contains(" bytes"), "raw byte counts: {message:?}");
    }
    let offload = entries
        .iter()
        .find(|e| field(e, "CORRAL_EVENT").as_deref() == Some("offload"))
        .unwrap_or_else(|| panic!("no offload entry: {}", summary(&entries)));
    assert!(field(offload, "CORRAL_RAM_BYTES").is_some_and(|b| b.parse::<u64>().is_ok()), "{offload}");
}

/// On a host without GPUs the RPC-enabled llama-server says "offloaded 5/5 layers to
/// GPU" for `-ngl 99` while every weight sits in a CPU buffer: corral reports what sits
/// on a device, nothing.
#[test]
fn a_cpu_only_load_reports_no_layers_on_a_gpu() {
    let rig = Rig::start();
    rig.ok(&["load", "chat", "--num-gpu", "99"]);
    let shown = rig.json(&["show", "chat"]);
    assert_eq!((shown["gpu_layers"].as_u64(), shown["total_layers"].as_u64()), (Some(0), Some(5)), "{shown}");
    assert_eq!(shown["vram_bytes"], 0, "{shown}");
    let text = rig.ok(&["show", "chat"]);
    assert!(text.lines().any(|l| l.starts_with("GPU layers:") && l.ends_with("0 of 5 (all on the CPU)")), "{text}");
    assert!(rig.daemon.corrald.stderr().contains("0 of 5 layers on GPUs"), "{}", rig.daemon.corrald.stderr());
    // The plan (llama.cpp's projection) next to what was allocated: all in host memory.
    let memory = shown["memory"].as_array().expect("memory");
    assert_eq!(memory.len(), 1, "the host alone: {shown}");
    assert_eq!(memory[0]["device"], "Host", "{shown}");
    assert!(memory[0]["planned"].as_u64().is_some_and(|b| b > 0), "{shown}");
    assert!(memory[0]["actual"].as_u64().is_some_and(|b| b > 0), "{shown}");
    assert!(text.lines().any(|l| l.starts_with("Memory:") && l.contains("Host") && l.contains("planned")), "{text}");
}

#[test]
fn top_shows_each_models_speed_in_its_last_answer() {
    let rig = Rig::start();
    rig.ok(&["load", "chat"]);
    let speed = |rig: &Rig| {
        let snapshot = rig.json(&["top", "--once"]);
        let models = snapshot["models"].as_array().expect("models").clone();
        ps_entry(&models, "chat:latest")["speed"].as_str().expect("speed").to_owned()
    };
    assert_eq!(speed(&rig), "-", "no answer yet");

    let addr = SocketAddr::from(([127, 0, 0, 1], rig.daemon.port));
    let body = serde_json::json!({
        "model": "chat", "stream": false, "options": {"num_predict": 8},
        "messages": [{"role": "user", "content": "hi"}],
    })
    .to_string();
    let response =
        http::request(std::net::TcpStream::connect(addr).expect("connect"), "POST", "/api/chat", Some(&body));
    assert_eq!(response.status, 200, "{}", response.body);
    let reply = response.json();
    let (count, nanos) = (reply["eval_count"].as_f64().expect("count"), reply["eval_duration"].as_f64().expect("ns"));
    assert!(count > 0.0 && nanos > 0.0, "{reply}");

    // The D-Bus property (read by `top` each second) is the answer's eval rate.
    let shown: f64 = speed(&rig).parse().expect("a number of tokens per second");
    let expected = count / (nanos / 1e9);
    assert!((shown - expected).abs() <= 0.05 + expected * 1e-6, "top shows {shown}, the answer says {expected}");
}
