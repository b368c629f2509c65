//! Workers on other hosts, for real: each worker is an upstream `rpc-server` in a network
//! namespace of its own, bound to its address on a veth pair to the head's namespace, where
//! corrald runs with the real llama-server (`support::netns`).  The rig model (121 MiB of
//! weights, about 170 MiB with its context) fits only split over two workers capped at
//! 140 MiB each.  corrald listens on a UNIX socket, so the test reaches it from outside the
//! namespaces; the only TCP addresses are the workers', inside namespaces the test made.
//!
//! Faults: a worker killed (SIGKILL) or cut off (`ip link set down` on its end) while an
//! answer streams, corrald stopped while its runner holds the workers, a worker that never
//! started.  And the health checks themselves must not take down a worker whose runner
//! holds it.
//!
//! What upstream rpc-server does that these tests met (b11434):
//!
//! * It serves one client at a time and listens with a backlog of 1: while a runner holds
//!   it, other connections complete into its accept queue (two at most) and wait there; the
//!   next one gets no answer to its SYN.
//! * It writes with `send(…, 0)` and does not ignore SIGPIPE: a client whose connection was
//!   reset (the head cut off, its runner killed meanwhile, then the link back) kills it with
//!   SIGPIPE, silently.  systemd ignores SIGPIPE for services (`IgnoreSIGPIPE=yes`), so the
//!   worker unit is safe; the fixture starts it the same way.

use std::fmt::Write as _;
use std::net::SocketAddrV4;
use std::path::PathBuf;
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use corral::store::Store;
use corral::store::create::CreateSpec;
use corral::store::modelfile::Modelfile;
use corral::store::name::ModelName;
use serde_json::{Value, json};

use crate::support::container::poll_until;
use crate::support::corrald::{Corrald, write_config};
use crate::support::http;
use crate::support::llama;
use crate::support::netns::{Link, Netns, NsRpcServer, output_within};
use crate::support::notify::NotifyListener;
use crate::support::rpc_process::RpcProcess;

/// The port every worker listens on (each in its own namespace).
const PORT: u16 = 50052;

/// Each worker's cap: the rig model fits only split over two.
const CAP: &str = "140MiB";

/// Checks each worker every second (`[worker_health]`).
const HEALTH: &str = "[worker_health]\ninterval = \"1s\"\n";

/// How long a request in flight may take to end once its worker is gone: the health
/// check's interval and timeout (1 s + 3 s) and the runner's stop, with room for a
/// machine shared with builds.  Far below any hang.
const FAULT_BOUND: Duration = Duration::from_secs(30);

/// How long a worker's state change may take to be seen (interval + timeout, and room).
const HEALTH_BOUND: Duration = Duration::from_secs(30);

/// One worker host: its namespace, its link to the head, and its rpc-server when it runs.
/// Fields drop in order: the server, then the link, then the namespace.
struct Worker {
    server: Option<NsRpcServer>,
    link: Link,
    netns: Netns,
    name: String,
}

impl Worker {
    fn endpoint(&self) -> SocketAddrV4 {
        SocketAddrV4::new(self.link.worker_addr(), PORT)
    }

    fn start(&mut self) {
        let program = llama::bin_dir().join("rpc-server");
        self.server = Some(NsRpcServer::start(&self.netns, &program, self.endpoint(), None));
    }

    fn server(&mut self) -> &mut NsRpcServer {
        self.server.as_mut().expect("the worker runs")
    }
}

/// The head's namespace with corrald, and the workers.  Fields drop in order: corrald (and
/// its runners) first, then the workers, then the head's namespace.
struct Rig {
    corrald: Option<Corrald>,
    workers: Vec<Worker>,
    head: Netns,
    dir: tempfile::TempDir,
}

impl Rig {
    /// The rig model in a store, the head's namespace and `started.len()` workers, each
    /// started when asked.
    fn new(started: &[bool]) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("models")).expect("store");
        corral::demo_model::write_llama(&dir.path().join("rig.gguf"), &corral::demo_model::LlamaShape::rig())
            .expect("rig model");
        let spec = CreateSpec::from_modelfile(&Modelfile::parse("FROM ./rig.gguf\n").expect("modelfile"), dir.path())
            .expect("spec");
        store.create(&ModelName::parse("rig").expect("name"), &spec, &mut |_| {}).expect("create");
        let head = Netns::new();
        let workers = started
            .iter()
            .enumerate()
            .map(|(i, &start)| {
                let netns = Netns::new();
                let link = Link::new(&head, &netns);
                let mut worker = Worker { server: None, link, netns, name: format!("w{i}") };
                if start {
                    worker.start();
                }
                worker
            })
            .collect();
        Self { corrald: None, workers, head, dir }
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("corral.sock")
    }

    /// Starts corrald in the head's namespace and waits until it is ready.
    fn start_corrald(&mut self) {
        let workers: Vec<String> = self
            .workers
            .iter()
            .map(|w| {
                format!("[[workers]]\nname = \"{}\"\naddress = \"{}\"\nmemory = \"{CAP}\"\n", w.name, w.endpoint())
            })
            .collect();
        let config = write_config(
            self.dir.path(),
            "corral.toml",
            &format!(
                "[server]\nlisten = [\"{}\"]\n[store]\npath = \"{}\"\n[runner]\nllama_server = \"{}\"\n\
                 [scheduler]\nnum_ctx = 2048\n{HEALTH}[gpu]\nfixed = true\nhost_memory = \"4GiB\"\nreserve = \"0B\"\n{}",
                self.socket().display(),
                self.dir.path().join("models").display(),
                llama::bin_dir().join("llama-server").display(),
                workers.join("")
            ),
        );
        let notify = NotifyListener::start();
        let corrald =
            Corrald::start_in_netns(self.head.name(), &["--config", config.to_str().expect("utf-8")], notify.path());
        notify.wait_for("READY", "1", Duration::from_secs(60));
        self.corrald = Some(corrald);
    }

    fn corrald(&mut self) -> &mut Corrald {
        self.corrald.as_mut().expect("corrald runs")
    }

    fn request(&self, method: &str, path: &str, body: Option<&Value>) -> http::Response {
        let body = body.map(Value::to_string);
        http::unix(&self.socket(), method, path, body.as_deref())
    }

    fn generate(&self) -> http::Response {
        let body = json!({"model": "rig", "prompt": "hi", "stream": false, "options": {"num_predict": 2}});
        self.request("POST", "/api/generate", Some(&body))
    }

    /// Loads the model (a short answer) and checks that it is split over both workers.
    fn load_split(&self) {
        let reply = self.generate();
        assert_eq!(reply.status, 200, "{}", reply.body);
        let devices = self.devices();
        let stderr = self.corrald.as_ref().map(Corrald::stderr).unwrap_or_default();
        assert!(self.workers.iter().all(|w| Self::on(&devices, w)), "split over both workers: {devices:?}\n{stderr}");
    }

    /// `llama-server --rpc WORKER --list-devices` from the head (a new client of the
    /// worker): its stdout, or why it failed.
    fn list_devices(&self, worker: &Worker) -> Result<String, String> {
        let mut list = self.head.command(llama::bin_dir().join("llama-server"));
        list.args(["--rpc", &worker.endpoint().to_string(), "--list-devices"]);
        let out = output_within(&mut list, Duration::from_secs(15))?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() {
            Ok(stdout)
        } else {
            Err(format!("{}: {stdout}{}", out.status, String::from_utf8_lossy(&out.stderr)))
        }
    }

    /// The devices of the one loaded model in `/api/ps`, by name (`rpc:ADDRESS#0`, `host`).
    fn devices(&self) -> Vec<String> {
        let ps = self.request("GET", "/api/ps", None).json();
        let models = ps["models"].as_array().expect("models");
        assert_eq!(models.len(), 1, "one model loaded: {ps}");
        let devices = models[0]["devices"].as_array().expect("devices");
        devices.iter().filter_map(|d| d["name"].as_str().map(str::to_owned)).collect()
    }

    /// The names of the devices on `worker`.
    fn on(devices: &[String], worker: &Worker) -> bool {
        let address = worker.endpoint().to_string();
        devices.iter().any(|d| d.contains(&address))
    }

    /// Waits until no model is loaded.
    fn wait_none_loaded(&self, what: &str) {
        poll_until(Duration::from_secs(30), what, || {
            let ps = self.request("GET", "/api/ps", None).json();
            if ps["models"].as_array().is_some_and(Vec::is_empty) { Ok(()) } else { Err(ps.to_string()) }
        });
    }

    /// Unloads the model (`keep_alive: 0`) and waits until it is gone.
    fn unload(&self) {
        let reply = self.request("POST", "/api/generate", Some(&json!({"model": "rig", "keep_alive": 0})));
        assert_eq!(reply.status, 200, "{}", reply.body);
        self.wait_none_loaded("the model to be unloaded");
    }

    /// How many of corrald's log lines so far are `event` for `worker`.
    fn events(&mut self, event: &str, worker: usize) -> usize {
        let name = self.workers[worker].name.clone();
        let (quoted, bare) = (format!("corral_worker=\"{name}\""), format!("corral_worker={name}"));
        let marker = format!("corral_event=\"{event}\"");
        self.corrald()
            .stderr()
            .lines()
            .filter(|l| l.contains(&marker) && (l.contains(&quoted) || l.contains(&bare)))
            .count()
    }

    /// Waits until corrald logs `event` for `worker` more than `before` times.
    fn wait_event(&mut self, event: &str, worker: usize, before: usize) {
        let deadline = Instant::now() + HEALTH_BOUND;
        while self.events(event, worker) <= before {
            assert!(Instant::now() < deadline, "no {event} for worker {worker}:\n{}", self.diagnosis());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// corrald's log, and each worker's output and TCP connections, for a failure message.
    fn diagnosis(&mut self) -> String {
        let mut text = format!("corrald:\n{}", self.corrald().stderr());
        let listed: Vec<String> = self.workers.iter().map(|w| self.list_devices(w).unwrap_or_else(|e| e)).collect();
        for (worker, listed) in self.workers.iter_mut().zip(listed) {
            let ended = worker.server.as_deref_mut().and_then(RpcProcess::exit_status);
            let output = worker.server.as_deref().map(RpcProcess::output).unwrap_or_default();
            let mut ss = worker.netns.command("ss");
            let sockets = output_within(ss.arg("-tan"), Duration::from_secs(10))
                .map_or_else(|e| e, |out| String::from_utf8_lossy(&out.stdout).into_owned());
            let _ = write!(
                text,
                "\n{}'s rpc-server (ended: {ended:?}):\n{output}\nits TCP sockets:\n{sockets}\nits devices, asked now:\n{listed}",
                worker.name
            );
        }
        text
    }

    /// Starts an answer that streams for long on a thread, and returns once corrald counts
    /// it active; the thread sends the whole reply when the stream ends.
    fn stream_long(&self) -> mpsc::Receiver<http::Response> {
        let (tx, rx) = mpsc::channel();
        let socket = self.socket();
        std::thread::spawn(move || {
            let body = json!({"model": "rig", "prompt": "hi", "options": {"num_predict": 1_000_000}}).to_string();
            let _ = tx.send(http::unix(&socket, "POST", "/api/generate", Some(&body)));
        });
        poll_until(Duration::from_secs(60), "the answer to stream", || {
            let metrics = self.request("GET", "/metrics", None).body;
            if metrics.lines().any(|l| l.starts_with("corral_runner_active_requests{") && l.ends_with(" 1")) {
                Ok(())
            } else {
                Err("no active request".to_owned())
            }
        });
        rx
    }

    /// A fault under a streaming answer: `fault` cuts worker 1 off; the stream must end
    /// within [`FAULT_BOUND`] with an error naming the worker, the runner be reaped, the next
    /// load plan without the worker, and `heal` bring it back for a split load again.
    fn fault_mid_stream(&mut self, fault: impl FnOnce(&mut Worker), heal: impl FnOnce(&mut Worker)) {
        self.start_corrald();
        self.load_split();
        let (downs, ups) = (self.events("worker-down", 1), self.events("worker-up", 1));

        let stream = self.stream_long();
        fault(&mut self.workers[1]);
        let faulted = Instant::now();
        let reply = stream
            .recv_timeout(FAULT_BOUND)
            .unwrap_or_else(|_| panic!("the stream did not end within {FAULT_BOUND:?}:\n{}", self.corrald().stderr()));
        eprintln!("the stream ended {:?} after the fault", faulted.elapsed());
        assert_eq!(reply.status, 200, "the stream had begun: {}", reply.body);
        let last = reply.body.lines().last().unwrap_or_default();
        assert!(last.contains("\"error\""), "the stream ends with an error: {last}");
        let (name, address) = (&self.workers[1].name, self.workers[1].endpoint().to_string());
        assert!(last.contains(name.as_str()) || last.contains(&address), "the error names the worker: {last}");
        self.wait_none_loaded("the runner to be reaped");
        self.wait_event("worker-down", 1, downs);

        // Planned without the lost worker: on the other one, and the CPU for what it cannot hold.
        let reply = self.generate();
        assert_eq!(reply.status, 200, "{}", reply.body);
        let devices = self.devices();
        assert!(Self::on(&devices, &self.workers[0]) && !Self::on(&devices, &self.workers[1]), "{devices:?}");

        // Back, and used again.
        heal(&mut self.workers[1]);
        self.wait_event("worker-up", 1, ups);
        self.unload();
        self.load_split();
    }

    /// The processes whose command line mentions this rig's directory (its runners: the
    /// model is a blob in the store there).
    fn processes_of_the_rig(&self) -> Vec<String> {
        let dir = self.dir.path().to_string_lossy().into_owned();
        let mut found = Vec::new();
        for entry in std::fs::read_dir("/proc").expect("read /proc").flatten() {
            if let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) {
                let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
                if cmdline.contains(&dir) && !cmdline.contains("corrald") {
                    found.push(format!("{}: {cmdline}", entry.file_name().to_string_lossy()));
                }
            }
        }
        found
    }
}

#[test]
fn a_model_split_across_two_worker_hosts_answers_a_chat() {
    let mut rig = Rig::new(&[true, true]);
    rig.start_corrald();
    let body = json!({"model": "rig", "stream": false, "messages": [{"role": "user", "content": "hello"}],
                      "options": {"num_predict": 4}});
    let reply = rig.request("POST", "/api/chat", Some(&body));
    assert_eq!(reply.status, 200, "{}", reply.body);
    let answer = reply.json();
    assert_eq!(answer["eval_count"], 4, "{answer}");
    assert!(answer["message"]["content"].is_string(), "{answer}");
    let devices = rig.devices();
    assert!(rig.workers.iter().all(|w| Rig::on(&devices, w)), "the runner is listed with both workers: {devices:?}");
    let metrics = rig.request("GET", "/metrics", None).body;
    for worker in &rig.workers {
        let up = format!("corral_worker_up{{worker=\"{}\",address=\"{}\"}} 1", worker.name, worker.endpoint());
        assert!(metrics.lines().any(|l| l == up), "{up} in:\n{metrics}");
    }
}

#[test]
fn a_worker_killed_mid_stream_ends_the_answer_and_is_used_again_when_back() {
    let mut rig = Rig::new(&[true, true]);
    rig.fault_mid_stream(
        |worker| {
            worker.server().kill();
        },
        Worker::start,
    );
}

/// A link down under a streaming answer.  The runner is killed while the worker waits for
/// data that never came; its goodbye is lost on the dead link, so once the link is back
/// the worker serves again only because the check resets that connection first.
#[test]
fn a_worker_cut_off_mid_stream_ends_the_answer_and_is_used_again_when_back() {
    let mut rig = Rig::new(&[true, true]);
    rig.fault_mid_stream(|worker| worker.link.set_worker_side(false), |worker| worker.link.set_worker_side(true));
}

/// A load onto a worker that went silent a moment before (no check has noticed yet):
/// llama-server's connection attempts go unanswered, and it would go on trying until the
/// head's neighbour entry for the worker fails (tens of seconds; minutes behind a router).
/// The load is called off when the check finds the worker down: the request fails naming
/// it, and no runner is left.
#[test]
fn a_load_onto_a_worker_gone_silent_a_moment_before_fails_fast_naming_it() {
    // The check's interval and timeout (1 s + 3 s), with room, and below the neighbour
    // entry's 15 s at the least.
    const CALLED_OFF_WITHIN: Duration = Duration::from_secs(14);
    let mut rig = Rig::new(&[true, true]);
    rig.start_corrald();
    let ups = rig.events("worker-up", 1);
    rig.workers[1].link.set_worker_silent(true);
    let asked = Instant::now();
    let reply = rig.generate();
    let took = asked.elapsed();
    assert!(took < CALLED_OFF_WITHIN, "the load waited {took:?}:\n{}", rig.corrald().stderr());
    // The model fits only across both workers: it cannot be loaded without this one.
    assert_ne!(reply.status, 200, "{}", reply.body);
    let (name, address) = (&rig.workers[1].name, rig.workers[1].endpoint().to_string());
    assert!(reply.body.contains(name.as_str()) || reply.body.contains(&address), "{}", reply.body);
    rig.wait_none_loaded("nothing to be loaded");
    poll_until(Duration::from_secs(10), "the called-off runner to be gone", || {
        let left = rig.processes_of_the_rig();
        if left.is_empty() { Ok(()) } else { Err(format!("{left:?}")) }
    });

    rig.workers[1].link.set_worker_silent(false);
    rig.wait_event("worker-up", 1, ups);
    rig.load_split();
}

/// The quiet case of a cut: the worker's kernel has acknowledged everything the runner
/// sent and the runner waits for the answer (the worker is stopped while it computes),
/// when its link goes down.  Nothing of the runner's is unacknowledged, so only the
/// keepalive corrald sets on the runner's connection notices.
#[test]
fn a_worker_cut_off_while_the_runner_awaits_its_answer_ends_the_answer_and_is_used_again() {
    use nix::sys::signal::{Signal, kill};
    let signal = |worker: &mut Worker, signal| {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(worker.server().pid()).expect("pid"));
        kill(pid, signal).expect("signal the worker");
    };
    let mut rig = Rig::new(&[true, true]);
    let head = rig.head.name().to_owned();
    rig.fault_mid_stream(
        |worker| {
            signal(worker, Signal::SIGSTOP);
            let stopped = Instant::now();
            let remote = rpc_table_address(worker.endpoint());
            // Within a second of the worker's stop the runner has sent all it can (a token
            // takes milliseconds) and waits for the worker's answer.
            poll_until(Duration::from_secs(10), "the runner to wait with its data acknowledged", || {
                if stopped.elapsed() < Duration::from_secs(1) {
                    return Err("the worker was just stopped".to_owned());
                }
                let mut cat = Command::new("ip");
                cat.args(["netns", "exec", &head, "cat", "/proc/net/tcp"]);
                let text = output_within(&mut cat, Duration::from_secs(10))?;
                let text = String::from_utf8_lossy(&text.stdout);
                let queues: Vec<&str> = text
                    .lines()
                    .filter(|l| l.split_whitespace().nth(2) == Some(remote.as_str()))
                    .filter_map(|l| l.split_whitespace().nth(4))
                    .collect();
                if !queues.is_empty() && queues.iter().all(|q| q.starts_with("00000000:")) {
                    Ok(())
                } else {
                    Err(format!("send queues {queues:?}"))
                }
            });
            worker.link.set_worker_side(false);
        },
        |worker| {
            worker.link.set_worker_side(true);
            signal(worker, Signal::SIGCONT);
        },
    );
}

/// `address` as `/proc/net/tcp` writes it: the IPv4 address as this machine stores the
/// 32-bit value, and the port, in hex.
fn rpc_table_address(address: SocketAddrV4) -> String {
    format!("{:08X}:{:04X}", u32::from_ne_bytes(address.ip().octets()), address.port())
}

#[test]
fn corrald_stopped_while_its_runner_holds_the_workers_frees_them() {
    let mut rig = Rig::new(&[true, true]);
    rig.start_corrald();
    rig.load_split();
    let held: Vec<u64> = rig.workers.iter_mut().map(|w| w.server().rss()).collect();
    assert!(held.iter().all(|&rss| rss > 40 << 20), "each worker holds its share of the weights: {held:?}");

    rig.corrald().signal(nix::sys::signal::Signal::SIGTERM);
    let status = rig.corrald().wait_exit(Duration::from_secs(30));
    assert!(status.success(), "{status}");
    assert_eq!(rig.processes_of_the_rig(), Vec::<String>::new(), "no runner is left");
    // Each worker let go of the runner's buffers (the client's connection closed) ...
    for (worker, held) in rig.workers.iter_mut().zip(held) {
        let server = worker.server.as_ref().expect("runs");
        poll_until(Duration::from_secs(10), "the worker to free its buffers", || {
            let rss = server.rss();
            if rss < held / 2 { Ok(()) } else { Err(format!("{rss} bytes resident, {held} under the runner")) }
        });
    }
    // ... and serves a new client (one at a time: a runner still connected would hold it).
    for worker in &rig.workers {
        let listed = rig.list_devices(worker).unwrap_or_else(|e| panic!("{e}"));
        assert!(listed.contains(&format!("RPC0: {}", worker.endpoint())), "{listed}");
    }
    // A fresh corrald loads the model across both again.
    rig.start_corrald();
    rig.load_split();
}

#[test]
fn a_worker_that_never_started_is_planned_around_or_named_at_once() {
    let mut rig = Rig::new(&[true, false]);
    rig.start_corrald();
    let asked = Instant::now();
    let reply = rig.generate();
    let took = asked.elapsed();
    assert!(took < Duration::from_secs(30), "the load did not wait on the worker: {took:?}");
    if reply.status == 200 {
        let devices = rig.devices();
        assert!(Rig::on(&devices, &rig.workers[0]) && !Rig::on(&devices, &rig.workers[1]), "{devices:?}");
    } else {
        let (name, address) = (&rig.workers[1].name, rig.workers[1].endpoint().to_string());
        assert!(reply.body.contains(name.as_str()) || reply.body.contains(&address), "{}", reply.body);
    }
    // The worker was seen down at start, and is used once it comes up.
    assert!(rig.events("worker-down", 1) >= 1, "{}", rig.corrald().stderr());
    rig.workers[1].start();
    rig.wait_event("worker-up", 1, 0);
    if reply.status == 200 {
        rig.unload();
    }
    rig.load_split();
}

/// While a runner holds a worker, rpc-server serves no one else: a health check's
/// connection would wait in its accept queue (`listen(fd, 1)`: two at most) and the next
/// would time out; the worker is up and its runner must keep it.  Five checks later, the
/// split runner still serves.
#[test]
fn a_runner_holding_its_workers_outlasts_their_health_checks() {
    let mut rig = Rig::new(&[true, true]);
    rig.start_corrald();
    rig.load_split();
    let count = |rig: &Rig| -> u64 {
        let metrics = rig.request("GET", "/metrics", None).body;
        let prefix = format!("corral_worker_checks_total{{worker=\"{}\"}} ", rig.workers[0].name);
        metrics.lines().find_map(|l| l.strip_prefix(&prefix).and_then(|n| n.parse().ok())).unwrap_or(0)
    };
    let (mut last, mut checks) = (count(&rig), 0);
    let deadline = Instant::now() + HEALTH_BOUND;
    while checks < 5 {
        assert_eq!(rig.events("worker-down", 0), 0, "w0 went down under its runner:\n{}", rig.diagnosis());
        assert!(Instant::now() < deadline, "fewer than 5 checks of w0 within {HEALTH_BOUND:?}:\n{}", rig.diagnosis());
        let now = count(&rig);
        if now != last {
            (last, checks) = (now, checks + 1);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let devices = rig.devices();
    assert!(rig.workers.iter().all(|w| Rig::on(&devices, w)), "still split: {devices:?}");
    let reply = rig.generate();
    assert_eq!(reply.status, 200, "{}", reply.body);
}
