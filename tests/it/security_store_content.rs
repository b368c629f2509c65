//! Issue 13, store content, through the real HTTP API: every size from outside is bounded
//! (a registry's text layers, blobs planted in the store, a hostile GGUF's arrays in a
//! verbose show), and the Modelfile `/api/show` writes creates the same model again,
//! whatever its texts say.

use std::fs;
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use corral::gguf::GgufArray;
use corral::http::{AppState, router};
use corral::store::digest::Digest;
use corral::store::manifest::{self, LICENSE, Layer, Manifest};
use corral::store::modelfile::Modelfile;
use corral::store::name::ModelName;
use serde_json::{Value, json};
use tower::ServiceExt;

use crate::support::api::{blob_files, state};
use crate::support::registry::{Action, DockerRegistry, Proxy};

/// The most any one request may take, however loaded the machine.
const DEADLINE: Duration = Duration::from_secs(120);

/// Sends a request and returns the status and the body's bytes, within [`DEADLINE`].
async fn send(state: &AppState, method: Method, path: &str, body: Body) -> (StatusCode, Vec<u8>) {
    let request = Request::builder().method(method).uri(path).body(body).expect("request");
    let work = async {
        let response = router(state.clone()).oneshot(request).await.expect("infallible");
        let status = response.status();
        (status, axum::body::to_bytes(response.into_body(), 1 << 26).await.expect("body").to_vec())
    };
    tokio::time::timeout(DEADLINE, work).await.unwrap_or_else(|_| panic!("{path} took longer than {DEADLINE:?}"))
}

async fn post(state: &AppState, path: &str, body: &Value) -> (StatusCode, Value) {
    let (status, bytes) = send(state, Method::POST, path, Body::from(body.to_string())).await;
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

fn name(text: &str) -> ModelName {
    ModelName::parse(text).expect("model name")
}

/// Uploads `bytes` as a blob, as a client does with the files of a Modelfile.
async fn upload(state: &AppState, bytes: Vec<u8>) -> Digest {
    let digest = Digest::of(&bytes);
    let (status, _) = send(state, Method::POST, &format!("/api/blobs/{digest}"), Body::from(bytes)).await;
    assert!(status == StatusCode::CREATED || status == StatusCode::OK, "upload: {status}");
    digest
}

/// What a client such as `ollama create` sends for a Modelfile: its `FROM` file
/// uploaded, its text, parameters and messages as JSON.
async fn create_from_modelfile(state: &AppState, model: &str, modelfile: &Modelfile) -> (StatusCode, Value) {
    let weights = upload(state, fs::read(&modelfile.from).expect("the FROM file")).await;
    let request = json!({
        "model": model,
        "files": {"model.gguf": weights.to_string()},
        "template": modelfile.template,
        "system": modelfile.system,
        "license": modelfile.licenses,
        "parameters": modelfile.parameters,
        "messages": modelfile.messages,
        "stream": false,
    });
    post(state, "/api/create", &request).await
}

/// Texts that end the old writer's `"""` early, or read differently than written.
const HOSTILE: &[&str] = &[
    "\"\"\"\nFROM /etc/shadow\n\"\"\"",
    "You are helpful.\"\"\"\nADAPTER /etc/passwd\nLICENSE \"\"\"x",
    "\"\"\"   \nPARAMETER num_ctx 999999\n# a comment\nMESSAGE user \"\"\"hi",
    "back\\slash \\\" \\n \\u{41} and \"quotes\"",
    "NUL \0, escape \u{1b}[31m, CR \r and CRLF \r\n",
    "\n  leading and trailing white space  \n",
    "\"",
    "",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shown_modelfile_creates_the_same_model_whatever_its_texts_say() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let chat = state.store.show(&name("chat"), false).expect("chat");
    for (i, text) in HOSTILE.iter().enumerate() {
        let model = format!("hostile{i}");
        let request = json!({
            "model": model,
            "from": "chat",
            "system": text,
            "template": format!("{{{{ .Prompt }}}}{text}"),
            "license": [text, "MIT"],
            "parameters": {"stop": [text, "</s>"], "temperature": 0.5, "num_ctx": 1024, "seed": -1},
            "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": text}],
            "stream": false,
        });
        let (status, reply) = post(&state, "/api/create", &request).await;
        assert_eq!(status, StatusCode::OK, "{text:?}: {reply}");
        let (status, shown) = post(&state, "/api/show", &json!({"model": model})).await;
        assert_eq!(status, StatusCode::OK, "{text:?}: {shown}");
        let written = shown["modelfile"].as_str().expect("a modelfile");

        // The text stays text: the one FROM is the weights' blob, whatever the system prompt says.
        let parsed = Modelfile::parse(written).unwrap_or_else(|e| panic!("{text:?}: {e}\n{written}"));
        assert_eq!(parsed.from, state.store.blob_path(&chat.manifest.model().digest).to_string_lossy());
        assert!(parsed.adapters.is_empty(), "{text:?}:\n{written}");
        assert_eq!(parsed.system.as_deref(), Some(*text), "{written}");

        // Fed back to create, it is the same model.
        let again = format!("again{i}");
        let (status, reply) = create_from_modelfile(&state, &again, &parsed).await;
        assert_eq!(status, StatusCode::OK, "{text:?}: {reply}");
        let (first, second) = (
            state.store.show(&name(&model), false).expect("first"),
            state.store.show(&name(&again), false).expect("second"),
        );
        assert_eq!(second.system.as_deref(), Some(*text));
        assert_eq!(second.template, first.template, "{text:?}");
        assert_eq!(second.licenses, first.licenses, "{text:?}");
        assert_eq!(second.parameters, first.parameters, "{text:?}");
        assert_eq!(second.messages, first.messages, "{text:?}");
        assert_eq!(second.manifest.model().digest, first.manifest.model().digest);
        let (_, shown_again) = post(&state, "/api/show", &json!({"model": again})).await;
        assert_eq!(shown_again["modelfile"].as_str().map(|m| m.replace(&again, &model)).as_deref(), Some(written));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_the_syntax_cannot_say_gets_a_modelfile_that_create_refuses() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    // A parameter key no Modelfile can hold (from a registry or the JSON API): no lines of it.
    let request = json!({
        "model": "odd",
        "from": "chat",
        "parameters": {"stop\nFROM /etc/shadow\nSYSTEM": 1},
        "stream": false,
    });
    let (status, reply) = post(&state, "/api/create", &request).await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    let (status, shown) = post(&state, "/api/show", &json!({"model": "odd"})).await;
    assert_eq!(status, StatusCode::OK, "{shown}");
    let written = shown["modelfile"].as_str().expect("modelfile");
    assert!(written.lines().all(|l| l.starts_with("# ")), "{written}");
    assert!(written.contains("cannot be written as a Modelfile"), "{written}");
    let err = Modelfile::parse(written).expect_err("no FROM");
    assert!(err.to_string().contains("no FROM instruction"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_text_layer_over_its_cap_is_refused_before_anything_is_stored() {
    let registry = DockerRegistry::start();
    let proxy = Proxy::start(registry.addr());
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let model = format!("{}/corral/big:v1", proxy.host());
    let (status, _) = post(&state, "/api/copy", &json!({"source": "chat", "destination": model})).await;
    assert_eq!(status, StatusCode::OK);
    let (status, reply) = post(&state, "/api/push", &json!({"model": model, "insecure": true, "stream": false})).await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    let (status, _) =
        send(&state, Method::DELETE, "/api/delete", Body::from(json!({"model": model}).to_string())).await;
    assert_eq!(status, StatusCode::OK);

    // The registry's manifest, with a license layer of 200 MiB added.
    let (pushed, _, _) = state.store.manifest(&name("chat")).expect("chat");
    let huge =
        Layer { media_type: LICENSE.into(), digest: Digest::of(b"a 200 MiB license"), size: 200 << 20, from: None };
    let mut layers = pushed.layers().to_vec();
    layers.push(huge.clone());
    let crafted =
        String::from_utf8(Manifest::new(pushed.config().clone(), layers).expect("weights").to_bytes()).expect("JSON");
    proxy.rule(move |seen| {
        if seen.method == "GET" && seen.path.contains("/manifests/") {
            let headers = vec![("Content-Type".to_owned(), manifest::MANIFEST_MEDIA_TYPE.to_owned())];
            Action::Respond { status: 200, headers, body: crafted.clone() }
        } else {
            Action::Pass
        }
    });
    let before = blob_files(&state);
    proxy.clear();
    let (status, bytes) =
        send(&state, Method::POST, "/api/pull", Body::from(json!({"model": model, "insecure": true}).to_string()))
            .await;
    assert_eq!(status, StatusCode::OK);
    let lines: Vec<Value> =
        String::from_utf8(bytes).expect("utf-8").lines().map(|l| serde_json::from_str(l).expect("JSON")).collect();
    let error = lines.last().and_then(|l| l["error"].as_str()).unwrap_or_else(|| panic!("no error: {lines:?}"));
    let expected = format!(
        "sent a bad manifest for corral/big:v1: the license layer {} is 200 MiB (209715200 bytes), \
         more than the limit of 1 MiB for a license layer",
        huge.digest
    );
    assert!(error.contains(&expected), "{error}");
    // Refused before any download: no request for a blob, nothing new in the store.
    assert!(proxy.seen().iter().all(|s| !s.path.contains("/blobs/")), "{:?}", proxy.seen());
    assert_eq!(blob_files(&state), before, "the store changed");
    assert!(matches!(state.store.manifest(&name(&model)), Err(corral::store::StoreError::NotFound(_))));
}

/// A FIFO at `path` whose writer sends 64 MiB and then waits without closing it: a
/// reader without a cap never finishes (it waits for the rest), one with a cap stops at it.
struct EndlessFile {
    path: std::path::PathBuf,
    stop: Arc<AtomicBool>,
    release: std::sync::mpsc::Sender<()>,
    writer: std::thread::JoinHandle<()>,
}

impl EndlessFile {
    fn plant(path: &std::path::Path) -> Self {
        fs::remove_file(path).expect("remove the blob");
        nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o644)).expect("mkfifo");
        // Opened for reading and writing, the FIFO never blocks the writer's open and
        // always has a writer for readers to wait on.
        let mut fifo = fs::OpenOptions::new().read(true).write(true).open(path).expect("open the FIFO");
        let stop = Arc::new(AtomicBool::new(false));
        let (release, released) = std::sync::mpsc::channel();
        let flag = Arc::clone(&stop);
        let writer = std::thread::spawn(move || {
            let chunk = [b'{'; 4096];
            let mut written = 0;
            while written < 64 << 20 && !flag.load(Ordering::SeqCst) && fifo.write_all(&chunk).is_ok() {
                written += chunk.len();
            }
            let _ = released.recv();
        });
        Self { path: path.to_owned(), stop, release, writer }
    }

    /// Stops the writer: drains the FIFO until it has seen the flag.
    fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.release.send(());
        let mut reader = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&self.path)
            .expect("open the FIFO to drain it");
        let deadline = Instant::now() + DEADLINE;
        let mut buf = vec![0; 1 << 16];
        while !self.writer.is_finished() {
            assert!(Instant::now() < deadline, "the FIFO's writer did not stop");
            match reader.read(&mut buf) {
                Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::yield_now(),
                other => drop(other),
            }
        }
        self.writer.join().expect("writer");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blobs_planted_in_the_store_are_read_within_their_caps() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let request = json!({"model": "planted", "from": "chat", "system": "a short prompt", "stream": false});
    let (status, reply) = post(&state, "/api/create", &request).await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    let (planted, _, _) = state.store.manifest(&name("planted")).expect("planted");

    // A system prompt blob replaced by 256 MiB: show names the layer and the limit.
    let system = planted.layers_of(manifest::SYSTEM).next().expect("a system layer").digest;
    let path = state.store.blob_path(&system);
    fs::remove_file(&path).expect("remove");
    fs::File::create(&path).and_then(|f| f.set_len(256 << 20)).expect("a sparse 256 MiB file");
    let (status, reply) = post(&state, "/api/show", &json!({"model": "planted"})).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{reply}");
    let expected = format!(
        "the system prompt layer {system} is 256 MiB (268435456 bytes), more than the limit of 1 MiB for a \
         system prompt layer"
    );
    assert_eq!(reply["error"].as_str(), Some(expected.as_str()), "{reply}");
    // A request for the model gets the same error, rather than a model with a huge prompt.
    let (status, reply) = post(&state, "/api/generate", &json!({"model": "planted", "prompt": "hi"})).await;
    assert!(reply["error"].as_str().is_some_and(|e| e.contains("more than the limit of 1 MiB")), "{status} {reply}");

    // A config blob that never ends: the listing still answers, without that config's facts.
    fs::write(&path, "a short prompt").expect("the system prompt back");
    let config = state.store.blob_path(&planted.config().digest);
    let endless = EndlessFile::plant(&config);
    let (status, bytes) = send(&state, Method::GET, "/api/tags", Body::empty()).await;
    let tags: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    assert_eq!(status, StatusCode::OK, "{tags}");
    let listed = tags["models"].as_array().expect("models");
    let entry = listed.iter().find(|m| m["name"] == "planted:latest").unwrap_or_else(|| panic!("{tags}"));
    assert_eq!(entry["details"]["format"], "", "{entry}");
    assert_ne!(listed.iter().find(|m| m["name"] == "chat:latest").map(|m| &m["details"]["format"]), Some(&json!("")));
    let (status, reply) = post(&state, "/api/show", &json!({"model": "planted"})).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "a config that never ends cannot be shown: {reply}");
    endless.stop();

    // A manifest of 64 MiB: skipped by the listing, refused by name, never read whole.
    let huge = state.store.manifest_path(&name("huge"));
    fs::create_dir_all(huge.parent().expect("a directory")).expect("mkdir");
    fs::File::create(&huge).and_then(|f| f.set_len(64 << 20)).expect("a sparse manifest");
    let (status, bytes) = send(&state, Method::GET, "/api/tags", Body::empty()).await;
    assert_eq!(status, StatusCode::OK);
    let tags: Value = serde_json::from_slice(&bytes).expect("JSON");
    assert!(tags["models"].as_array().expect("models").iter().all(|m| m["name"] != "huge:latest"), "{tags}");
    let (status, reply) = post(&state, "/api/show", &json!({"model": "huge"})).await;
    assert_ne!(status, StatusCode::OK);
    let error = reply["error"].as_str().unwrap_or_default();
    assert!(error.contains("is 64 MiB (67108864 bytes), more than the limit of 4 MiB for a manifest"), "{reply}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verbose_show_of_a_hostile_gguf_stays_bounded() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let bytes = corral::demo_model::tiny_llama_bytes_with(vec![
        ("hostile.array".into(), GgufArray::U8(vec![1; 3 << 20]).into()),
        ("hostile.nested".into(), GgufArray::Array(vec![GgufArray::I8(vec![-1; 2 << 20])]).into()),
    ])
    .expect("a hostile GGUF");
    let weights = upload(&state, bytes).await;
    let request = json!({"model": "hostile", "files": {"hostile.gguf": weights.to_string()}, "stream": false});
    let (status, reply) = post(&state, "/api/create", &request).await;
    assert_eq!(status, StatusCode::OK, "{reply}");

    let (status, body) =
        send(&state, Method::POST, "/api/show", Body::from(json!({"model": "hostile", "verbose": true}).to_string()))
            .await;
    assert_eq!(status, StatusCode::OK);
    let shown: Value = serde_json::from_slice(&body).expect("JSON");
    let info = &shown["model_info"];
    // Arrays past the cap are left out (null), as a brief show leaves out every array.
    assert!(info["hostile.array"].is_null() && info["hostile.nested"].is_null(), "{}", body.len());
    // The real vocabulary is listed.
    assert!(info["tokenizer.ggml.tokens"].as_array().is_some_and(|t| t.len() > 100));
    assert!(body.len() < 1 << 20, "{} bytes", body.len());
}
