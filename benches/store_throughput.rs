//! Store throughput: corrald moving a model's weights against the plainest way to move the
//! same bytes, side by side in one run, on synthetic GGUFs of growing size (256 MiB and
//! 1 GiB by default).
//!
//! Everything lives in one temporary directory (`CORRAL_BENCH_DIR`, else the system's), so
//! the store, the floors' copies and the registry's storage share one file system; the
//! floors write their copies into the store's `blobs/` directory, where corrald writes
//! (ext4 places a file by its directory: the same 1 GiB write measured 1.05 to 3 s here
//! depending on the directory).
//!
//! | operation | corral | floor |
//! |---|---|---|
//! | upload | `curl -T` to `POST /api/blobs/<digest>` | `cp` + `sync FILE` (fsync) |
//! | create | `HEAD` + `POST /api/blobs` + `POST /api/create` with `files` (what Ollama's client sends once it has the digest) | `cp` + `sync FILE` |
//! | create (`corralctl`) | `corralctl create` of a Modelfile naming the file: passed open over D-Bus, hashed as corrald copies it | `cp` + `sync FILE` |
//! | pull | `POST /api/pull` from a local `docker-registry` into an empty store | `curl -o FILE` of the blob from the same registry |
//! | push | `POST /api/push` to a new repository of that registry | `curl` `POST /blobs/uploads/`, then one monolithic `PUT ?digest=` of the blob |
//!
//! Clients are `curl` on both sides, rounds alternate the sides, and the table shows medians;
//! each side starts from the same state: what either side writes removed, then `sync`.
//! ratio = floor time / corral time (1.0: as fast as the floor). corrald's peak RSS during
//! each operation is its `VmHWM` after a reset (`/proc/PID/clear_refs` 5) before it.
//! Where corrald hashes the blob on its way (all but push), the row also shows how long the
//! store's SHA-256 alone takes for it, at the speed measured in memory at the start, and the
//! ratio that alone would allow (floor / that time): one core's hash bounds the operation
//! however well the rest overlaps, so a ratio it allows near 0.8 leaves no room.
//!
//! `CORRAL_BENCH_SIZES_MIB` sets the sizes (default `256,1024`), `CORRAL_BENCH_ROUNDS` the
//! rounds (default 3), `CORRAL_BENCH_CORRALD` another corrald binary to measure.
//!
//! On a VM whose balloon device reports free pages to its host, page cache that a removed
//! file freed goes back to the host and every later write through the page cache fetches
//! it again: such writes swing 2-3x from round to round, and the run says so first. Turn
//! reporting off for the run (`echo 11 > /sys/module/page_reporting/parameters/page_reporting_order`,
//! above the largest order; 9 again afterwards) to compare builds.
//!
//! Run with `cargo bench --bench store_throughput` (needs `curl`, `docker-registry` and
//! `dbus-daemon`: corrald and corralctl talk on a private session bus).

#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]

use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::{Process, free_port, median, session_bus, toml_string};
use corral::demo_model::{LlamaShape, Weights};
use corral::store::digest::{Digest, Hasher};

const REGISTRY: &str = "/usr/bin/docker-registry";

/// Runs `curl` with `args` (failing on an HTTP error); its stdout.
fn curl(args: &[&str]) -> String {
    let out = Command::new("curl")
        .args(["-sS", "--fail-with-body", "-H", "Expect:"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run curl");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "curl {args:?}: {}{stdout}", String::from_utf8_lossy(&out.stderr));
    stdout
}

/// Posts JSON to corrald and checks that the (NDJSON) answer ends in success.
fn post_json(base: &str, path: &str, body: &serde_json::Value) {
    let out = curl(&[
        "-X",
        "POST",
        "-H",
        "Content-Type: application/json",
        "-d",
        &body.to_string(),
        &format!("{base}{path}"),
    ]);
    let last = out.lines().last().unwrap_or_default();
    assert!(last.contains("\"success\"") && !out.contains("\"error\""), "{path}: {out}");
}

/// Posts JSON to corrald that answers a plain 200 (`/api/copy`).
fn post_ok(base: &str, path: &str, body: &serde_json::Value) {
    curl(&["-X", "POST", "-H", "Content-Type: application/json", "-d", &body.to_string(), &format!("{base}{path}")]);
}

/// Uploads `file` to corrald as blob `url` (`POST /api/blobs/<digest>`), as a stream.
fn upload(file: &str, url: &str) {
    curl(&["-X", "POST", "-T", file, "-H", "Content-Type: application/octet-stream", url]);
}

/// Deletes `model` from corrald's store if it is there.
fn delete_model(base: &str, model: &str) {
    let body = serde_json::json!({"model": model}).to_string();
    let _ = Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-X", "DELETE", "-d", &body, &format!("{base}/api/delete")])
        .status();
}

/// Waits until `url` answers 200.
fn wait_for(url: &str, process: &mut Process) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        assert!(process.0.try_wait().expect("wait").is_none(), "the server for {url} exited");
        let ok = Command::new("curl")
            .args(["-sf", "-o", "/dev/null", url])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return;
        }
        assert!(Instant::now() < deadline, "{url} did not answer");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A `docker-registry serve` on loopback, its storage in `dir`.
fn start_registry(dir: &Path) -> (Process, String) {
    let port = free_port();
    let config = dir.join("registry.yml");
    fs::write(
        &config,
        format!(
            "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\n\
             storage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\n  \
             maintenance:\n    uploadpurging:\n      enabled: false\n\
             http:\n  addr: 127.0.0.1:{port}\n",
            dir.join("registry").display()
        ),
    )
    .expect("registry config");
    let child = Command::new(REGISTRY)
        .arg("serve")
        .arg(&config)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start docker-registry");
    let mut process = Process(child);
    let host = format!("127.0.0.1:{port}");
    wait_for(&format!("http://{host}/v2/"), &mut process);
    (process, host)
}

/// corrald on loopback with a store in `dir/models`, speaking plain HTTP to `registry`,
/// and on the session bus at `bus` (for `corralctl create`).
fn start_corrald(dir: &Path, registry: &str, bus: &str) -> (Process, String) {
    let port = free_port();
    let config = dir.join("corral.toml");
    fs::write(
        &config,
        format!(
            "[server]\nlisten = [\"127.0.0.1:{port}\"]\n[store]\npath = {}\ninsecure_registries = [\"{registry}\"]\n\
             [dbus]\nbus = \"session\"\n",
            toml_string(&dir.join("models")),
        ),
    )
    .expect("config");
    let mut daemon = Command::new(common::corrald_binary());
    daemon.arg("--config").arg(&config).args(["--log-target", "stderr"]);
    daemon.env("STATE_DIRECTORY", dir.join("state")).env("RUNTIME_DIRECTORY", dir.join("run"));
    daemon.env("DBUS_SESSION_BUS_ADDRESS", bus);
    daemon.env("RUST_LOG", "error").stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::inherit());
    let mut process = Process(daemon.spawn().expect("start corrald"));
    let base = format!("http://127.0.0.1:{port}");
    wait_for(&format!("{base}/api/version"), &mut process);
    // On the bus too (it takes its name after READY=1).
    let deadline = Instant::now() + Duration::from_secs(30);
    while !corralctl(bus, &["list"]).status.success() {
        assert!(Instant::now() < deadline, "corrald did not take its name on the bus");
        std::thread::sleep(Duration::from_millis(20));
    }
    (process, base)
}

/// Runs `corralctl --user ARGS` on the session bus at `bus`.
fn corralctl(bus: &str, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_corralctl"))
        .arg("--user")
        .args(args)
        .env("DBUS_SESSION_BUS_ADDRESS", bus)
        .stdin(Stdio::null())
        .output()
        .expect("run corralctl")
}

/// The smallest random-weight llama of at least `bytes` of tensors.
fn shape_of(bytes: u64) -> LlamaShape {
    let mut shape = LlamaShape {
        name: "corral-bench-llama",
        n_layer: 1,
        n_embd: 1024,
        n_ff: 4096,
        n_head: 8,
        n_head_kv: 4,
        context: 4096,
        weights: Weights::RandomBits,
    };
    while shape.tensor_bytes() < bytes {
        shape.n_layer += 1;
    }
    shape
}

/// Resets corrald's peak RSS, so that the next reading is the peak of what follows.
fn reset_peak(pid: u32) {
    fs::write(format!("/proc/{pid}/clear_refs"), "5").expect("reset the peak RSS (needs root or the same user)");
}

/// corrald's peak RSS since the last reset, MiB.
fn peak_mib(pid: u32) -> f64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).expect("read status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmHWM");
    #[allow(clippy::cast_precision_loss, reason = "a figure for people")]
    let mib = kib as f64 / 1024.0;
    mib
}

fn timed(work: impl FnOnce()) -> f64 {
    let start = Instant::now();
    work();
    start.elapsed().as_secs_f64()
}

/// One row of the table.
struct Row {
    size_mib: u64,
    operation: &'static str,
    floor: Vec<f64>,
    corral: Vec<f64>,
    peak_mib: f64,
    /// How long the hasher alone takes for the blob, where corrald hashes it on the way.
    hash: Option<f64>,
}

impl Row {
    fn new(size_mib: u64, operation: &'static str, hash: Option<f64>) -> Self {
        Self { size_mib, operation, floor: Vec::new(), corral: Vec::new(), peak_mib: 0.0, hash }
    }

    /// One round: the floor, then corral (whose peak RSS is kept), each starting from
    /// the same state: `results` (what either side writes) absent and everything on disk,
    /// so that neither pays for the other's pages (their reclaim, or freeing a removed
    /// file's blocks) or write-back.
    fn round(&mut self, pid: u32, results: &[&Path], floor: impl FnOnce(), corral: impl FnOnce()) {
        settle(results);
        self.floor.push(timed(floor));
        settle(results);
        reset_peak(pid);
        self.corral.push(timed(corral));
        self.peak_mib = self.peak_mib.max(peak_mib(pid));
    }

    /// The row, with the hasher's own time for the blob and the ratio that time alone
    /// allows (floor / hash): where it is near 0.8, one core's SHA-256 bounds the operation.
    fn print(&self) {
        let (floor, corral) = (median(&self.floor), median(&self.corral));
        let hash = self.hash.map_or_else(|| "– | –".to_owned(), |hash| format!("{hash:.2} s | {:.2}", floor / hash));
        println!(
            "| {} MiB | {} | {floor:.2} s | {corral:.2} s | {:.2} | {hash} | {:.1} MiB |",
            self.size_mib,
            self.operation,
            floor / corral,
            self.peak_mib
        );
    }
}

/// `cp` + `sync FILE` (an fsync of the copy), the copy removed afterwards.
fn cp_fsync(source: &Path, target: &Path) {
    let status = Command::new("sh")
        .arg("-c")
        .arg("cp \"$1\" \"$2\" && sync \"$2\"")
        .args(["sh", source.to_str().expect("path"), target.to_str().expect("path")])
        .status()
        .expect("run cp");
    assert!(status.success(), "cp + sync failed");
}

fn remove(path: &Path) {
    let _ = fs::remove_file(path);
}

/// The order of the free memory blocks the guest reports to its host (a balloon device's
/// free page reporting), when it reports any: blocks above the largest order never are.
fn free_page_reporting() -> Option<u32> {
    let parameters = Path::new("/sys/module/page_reporting/parameters");
    let reported: u64 = fs::read_to_string(parameters.join("reported_kib")).ok()?.trim().parse().ok()?;
    let order: u32 = fs::read_to_string(parameters.join("page_reporting_order")).ok()?.trim().parse().ok()?;
    // 10 is the largest order of x86-64's and arm64's default configurations.
    (reported > 0 && order <= 10).then_some(order)
}

/// Removes `paths`, then syncs every file system.
fn settle(paths: &[&Path]) {
    for path in paths {
        remove(path);
    }
    assert!(Command::new("sync").status().expect("run sync").success(), "sync failed");
}

#[allow(clippy::too_many_lines, reason = "one linear script of a benchmark")]
fn main() {
    let rounds: usize = std::env::var("CORRAL_BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    let sizes: Vec<u64> = std::env::var("CORRAL_BENCH_SIZES_MIB")
        .unwrap_or_else(|_| "256,1024".to_owned())
        .split(',')
        .map(|s| s.trim().parse().expect("a size in MiB"))
        .collect();
    let dir = match std::env::var_os("CORRAL_BENCH_DIR") {
        Some(parent) => tempfile::tempdir_in(parent),
        None => tempfile::tempdir(),
    }
    .expect("tempdir");
    let dir = dir.path();
    let sha_ni = fs::read_to_string("/proc/cpuinfo").is_ok_and(|c| c.split_whitespace().any(|w| w == "sha_ni"));

    // The hasher alone, on data in memory.
    let data: Vec<u8> = (0..256u32 << 20).map(|i| i.wrapping_mul(2_654_435_761).to_le_bytes()[2]).collect();
    let mut hasher = Hasher::default();
    let hash_s = timed(|| {
        hasher.update(&data);
    });
    drop((hasher, data));
    let hash_bytes_per_s = 268_435_456.0 / hash_s;
    println!(
        "SHA-256 (the store's hasher) on 256 MiB in memory: {:.0} MB/s; CPU sha_ni: {sha_ni}",
        hash_bytes_per_s / 1e6
    );

    if let Some(order) = free_page_reporting() {
        println!(
            "free page reporting is on (order {order}): freed page cache goes back to the host and comes \
             back slowly, so writes through the page cache swing 2-3x (docs/benchmarks.md, session 24)"
        );
    }

    let (mut registry, host) = start_registry(dir);
    let (_bus, bus) = session_bus(dir);
    let (mut daemon, base) = start_corrald(dir, &host, &bus);
    let pid = daemon.0.id();
    let blobs = dir.join("models/blobs");

    let mut rows = Vec::new();
    for &size_mib in &sizes {
        let gguf = dir.join(format!("bench-{size_mib}.gguf"));
        corral::demo_model::write_llama(&gguf, &shape_of(size_mib << 20)).expect("write the model");
        // On disk before anything is measured: its write-back must not compete with the first rounds.
        fs::File::open(&gguf).and_then(|f| f.sync_all()).expect("sync the model");
        let (digest, bytes) = Digest::of_reader(fs::File::open(&gguf).expect("open")).expect("hash the model");
        let blob_url = format!("{base}/api/blobs/{digest}");
        let in_store = blobs.join(digest.file_name());
        // Beside the blobs: the file system places a file by its directory, and the same
        // write took from 1.05 to 3 s here depending on which directory it went to.
        let copy = blobs.join("floor.copy");
        let gguf_text = gguf.to_str().expect("path").to_owned();
        println!("model {size_mib} MiB: {bytes} bytes, {digest}");
        #[allow(clippy::cast_precision_loss, reason = "a size in bytes, far below 2^52")]
        let sha_alone = Some(bytes as f64 / hash_bytes_per_s);

        // Upload: the blob alone, removed from the store between rounds.
        let mut row = Row::new(size_mib, "upload (`POST /api/blobs`)", sha_alone);
        for _ in 0..rounds {
            row.round(pid, &[&in_store, &copy], || cp_fsync(&gguf, &copy), || upload(&gguf_text, &blob_url));
            assert!(in_store.is_file(), "the upload is in the store");
        }
        row.print();
        rows.push(row);

        // Create: what Ollama's client (and `corralctl create` to a corrald that cannot take
        // files passed open) sends once it has the file's digest.
        let client_hash = timed(|| {
            Digest::of_reader(fs::File::open(&gguf).expect("open")).expect("hash");
        });
        let model = format!("{host}/bench/m{size_mib}:latest");
        let mut row = Row::new(size_mib, "create (`HEAD` + `POST /api/blobs` + `/api/create`)", sha_alone);
        for _ in 0..rounds {
            row.round(
                pid,
                &[&in_store, &copy],
                || cp_fsync(&gguf, &copy),
                || {
                    let head = Command::new("curl")
                        .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "-I", &blob_url])
                        .output()
                        .expect("curl");
                    assert_eq!(String::from_utf8_lossy(&head.stdout), "404");
                    upload(&gguf_text, &blob_url);
                    let files = serde_json::json!({"bench.gguf": digest.to_string()});
                    post_json(&base, "/api/create", &serde_json::json!({"model": model, "files": files}));
                },
            );
        }
        row.print();
        rows.push(row);

        // Create as `corralctl create` does it: the file passed open over D-Bus
        // (`CreateWithFiles`), read once by corrald, no digest from the client first.
        let modelfile = dir.join(format!("Modelfile-{size_mib}"));
        fs::write(&modelfile, format!("FROM {gguf_text}\n")).expect("write the Modelfile");
        let modelfile = modelfile.to_str().expect("path").to_owned();
        let created = format!("passed{size_mib}");
        let create = || {
            let out = corralctl(&bus, &["create", &created, "-f", &modelfile]);
            assert!(out.status.success(), "corralctl create: {}", String::from_utf8_lossy(&out.stderr));
        };
        let mut row = Row::new(size_mib, "create (`corralctl create`, the file passed open)", sha_alone);
        for _ in 0..rounds {
            row.round(pid, &[&in_store, &copy], || cp_fsync(&gguf, &copy), create);
        }
        remove(&copy);
        row.print();
        rows.push(row);
        // Again, the blob in the store: corrald reads the file, finds it, and writes nothing.
        settle(&[]);
        let again = timed(create);

        // Push: the model under a new repository each round (a registry answers HEAD per
        // repository), against POST + one monolithic PUT of the blob to another new one.
        let mut row = Row::new(size_mib, "push (`/api/push`)", None);
        for round in 0..rounds {
            let target = format!("{host}/bench/push{size_mib}-{round}:latest");
            post_ok(&base, "/api/copy", &serde_json::json!({"source": model, "destination": target}));
            row.round(
                pid,
                &[],
                || {
                    let headers = curl(&[
                        "-i",
                        "-X",
                        "POST",
                        &format!("http://{host}/v2/bench/floor{size_mib}-{round}/blobs/uploads/"),
                    ]);
                    let location = headers
                        .lines()
                        .find_map(|l| l.strip_prefix("Location: ").or_else(|| l.strip_prefix("location: ")))
                        .expect("a Location")
                        .trim();
                    let separator = if location.contains('?') { '&' } else { '?' };
                    curl(&[
                        "-X",
                        "PUT",
                        "-T",
                        &gguf_text,
                        "-H",
                        "Content-Type: application/octet-stream",
                        &format!("{location}{separator}digest={digest}"),
                    ]);
                },
                || post_json(&base, "/api/push", &serde_json::json!({"model": target})),
            );
        }
        row.print();
        rows.push(row);

        // Pull: into a store without the blob (every model using it deleted first).
        let source = format!("{host}/bench/push{size_mib}-0:latest");
        let mut row = Row::new(size_mib, "pull (`/api/pull`)", sha_alone);
        for round in 0..rounds {
            delete_model(&base, &model);
            delete_model(&base, &created);
            for r in 0..rounds {
                delete_model(&base, &format!("{host}/bench/push{size_mib}-{r}:latest"));
            }
            assert!(!in_store.exists(), "round {round}: the blob is gone before the pull");
            let url = format!("http://{host}/v2/bench/push{size_mib}-0/blobs/{digest}");
            row.round(
                pid,
                &[&copy],
                || {
                    curl(&["-o", copy.to_str().expect("path"), &url]);
                },
                || post_json(&base, "/api/pull", &serde_json::json!({"model": source})),
            );
            remove(&copy);
            assert!(in_store.is_file(), "the pull put the blob in place");
        }
        row.print();
        rows.push(row);
        // Back to the state the next size starts from: the model created again from the blob.
        post_ok(&base, "/api/copy", &serde_json::json!({"source": source, "destination": model}));
        remove(&gguf);
        println!(
            "client-side digest of the {size_mib} MiB file (Ollama's client's pass before it uploads): \
             {client_hash:.2} s; the same `corralctl create` again, the blob in the store: {again:.2} s"
        );
    }

    println!();
    println!(
        "store throughput, {rounds} rounds alternating (medians); ratio = floor / corral; SHA-256 alone: \
         the hasher's time for the blob at the speed measured first, and the ratio that time alone allows"
    );
    println!();
    println!("| size | operation | floor | corral | ratio | SHA-256 alone | ratio it allows | corrald peak RSS |");
    println!("|---|---|---|---|---|---|---|---|");
    for row in &rows {
        row.print();
    }
    assert!(daemon.0.try_wait().expect("wait").is_none(), "corrald exited");
    assert!(registry.0.try_wait().expect("wait").is_none(), "the registry exited");
}
