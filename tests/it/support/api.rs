//! An in-process API over a temporary store holding `chat` (the tiny llama) and `embed`
//! (the tiny bert), with runners on the real llama-server.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use corral::http::AppState;
use corral::scheduler::actor::{Limits, Scheduler};
use corral::scheduler::backend::SupervisorBackend;
use corral::scheduler::footprints::Footprints;
use corral::scheduler::keep_alive::{Clamp, KeepAlive};
use corral::scheduler::request::Defaults;
use corral::store::Store;
use corral::store::create::CreateSpec;
use corral::store::modelfile::Modelfile;
use corral::store::name::ModelName;
use corral::supervisor::runner::{LogSink, SupervisorConfig};

use super::llama;

/// An API over a store holding `chat` (tiny llama) and `embed` (tiny bert), with real runners.
pub fn state(dir: &Path) -> AppState {
    let store = Store::open(&dir.join("models")).expect("store");
    corral::demo_model::write_tiny_llama(&dir.join("tiny.gguf")).expect("llama");
    corral::demo_model::write_tiny_bert(&dir.join("bert.gguf")).expect("bert");
    for (name, file) in [("chat", "tiny.gguf"), ("embed", "bert.gguf")] {
        let spec =
            CreateSpec::from_modelfile(&Modelfile::parse(&format!("FROM ./{file}\n")).expect("mf"), dir).expect("spec");
        store.create(&ModelName::parse(name).expect("name"), &spec, &mut |_| {}).expect("create");
    }
    let backend = SupervisorBackend {
        config: SupervisorConfig {
            llama_server: llama::bin_dir().join("llama-server"),
            runtime_dir: dir.to_owned(),
            inherited_env: vec![("PATH".into(), std::env::var_os("PATH").unwrap_or_default())],
            log_sink: LogSink::Tracing,
            cgroups: None,
            stop_grace: Duration::from_secs(10),
        },
        load_timeout: Duration::from_secs(60),
        devices: Vec::new(),
        probe: None,
    };
    let limits = Limits {
        max_loaded: 3,
        max_queue: 16,
        default_keep_alive: KeepAlive::For(Duration::from_secs(300)),
        clamp: Clamp::default(),
    };
    let (scheduler, handle) = Scheduler::new(Arc::new(backend), Vec::new(), 4 << 30, limits, Footprints::in_memory());
    tokio::spawn(scheduler.run());
    AppState::for_tests(store, handle, Defaults { num_ctx: 512, parallel: 1 })
}
