//! What handlers share: the model store, the scheduler's address and the request checks.
//! All are cheap to clone; handlers keep no state of their own.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::safety::Safety;
use crate::scheduler::handle::Handle;
use crate::scheduler::request::Defaults;
use crate::store::Store;
use crate::store::registry::{Registry, RegistryConfig};
use crate::sync::lock;

/// The state every route gets: one pointer, as the router clones it for every request
/// (cloning the parts themselves took a few microseconds a request, a dozen reference
/// counts and the store's path).
#[derive(Debug, Clone)]
pub struct AppState(Arc<Shared>);

impl From<Shared> for AppState {
    fn from(shared: Shared) -> Self {
        Self(Arc::new(shared))
    }
}

impl std::ops::Deref for AppState {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// Set-up code (tests) changes a part; a state other handles share is copied first, so
/// they never see the change.
impl std::ops::DerefMut for AppState {
    fn deref_mut(&mut self) -> &mut Shared {
        Arc::make_mut(&mut self.0)
    }
}

/// What the handlers share.
#[derive(Debug, Clone)]
pub struct Shared {
    /// The model store.
    pub store: Store,
    /// The scheduler.
    pub scheduler: Handle,
    /// The checks every request passes first (`[server]` hosts, CORS, tokens, body size).
    pub safety: Arc<Safety>,
    /// `[scheduler]` defaults for building load requests.
    pub defaults: Defaults,
    /// The registry client, shared so that concurrent pulls of a blob share one download.
    pub registry: Registry,
    /// Tokens processed by `/api/chat`, `/api/generate` and `/v1/*`, for `/metrics`.
    pub tokens: Arc<Tokens>,
    /// Kept-alive connections to the runners.
    pub upstream: crate::supervisor::upstream::Pool,
    /// Request templates' renderer, with the slots all requests share.
    pub templates: crate::prompt_template::Renderer,
    /// The devices, host memory and workers' health, for the per-device views.
    pub fleet: crate::workers::FleetView,
    /// `/api/tags`' body, with the store index's generation it was made from.
    pub tags: Arc<Mutex<Option<(u64, axum::body::Bytes)>>>,
}

/// Token counters since start, and each model's speed in its last answer.
#[derive(Debug, Default)]
pub struct Tokens {
    prompt: AtomicU64,
    generated: AtomicU64,
    /// Generated tokens per second in each model's last `/api/chat` or `/api/generate`
    /// answer, by the model's name; at most [`MAX_SPEEDS`] names (the store's models).
    speeds: Mutex<HashMap<String, f64>>,
}

/// How many models' speeds are kept; past it the map starts again (names come from the
/// store, so this is only a bound, never reached in practice).
const MAX_SPEEDS: usize = 4096;

impl Tokens {
    /// Adds one answer's prompt and generated tokens.
    pub fn record(&self, prompt: u64, generated: u64) {
        self.prompt.fetch_add(prompt, Ordering::Relaxed);
        self.generated.fetch_add(generated, Ordering::Relaxed);
    }

    /// Records `model`'s last answer: `generated` tokens in `generating` (the prompt's
    /// time left out, as Ollama's `eval rate`).
    pub fn record_speed(&self, model: &str, generated: u64, generating: Duration) {
        if generated == 0 || generating.is_zero() {
            return;
        }
        #[allow(clippy::cast_precision_loss)] // token counts are far below 2^52
        let speed = generated as f64 / generating.as_secs_f64();
        let mut speeds = lock(&self.speeds);
        if speeds.len() >= MAX_SPEEDS && !speeds.contains_key(model) {
            speeds.clear();
        }
        speeds.insert(model.to_owned(), speed);
    }

    /// Generated tokens per second in `model`'s last answer; 0 before one.
    #[must_use]
    pub fn speed(&self, model: &str) -> f64 {
        lock(&self.speeds).get(model).copied().unwrap_or(0.0)
    }

    /// Prompt tokens and generated tokens so far.
    #[must_use]
    pub fn totals(&self) -> (u64, u64) {
        (self.prompt.load(Ordering::Relaxed), self.generated.load(Ordering::Relaxed))
    }
}

impl AppState {
    /// A state with the default request checks, for tests that drive the router in-process.
    #[must_use]
    pub fn for_tests(store: Store, scheduler: Handle, defaults: Defaults) -> Self {
        let safety = Arc::new(Safety::new(&crate::config::ServerConfig::default(), super::LocalNames::system()));
        let registry = Registry::new(RegistryConfig::default());
        Self::from(Shared {
            store,
            scheduler,
            safety,
            defaults,
            registry,
            tokens: Arc::default(),
            upstream: crate::supervisor::upstream::Pool::default(),
            templates: crate::prompt_template::Renderer::default(),
            fleet: crate::workers::FleetView::default(),
            tags: Arc::default(),
        })
    }
}

/// A state for handler tests: an empty store in a temporary directory (with the tiny
/// GGUF written next to it as `tiny.gguf`) and a scheduler on `backend` with 1 GiB of
/// host memory and no GPU. Call it inside a Tokio runtime: it spawns the scheduler.
#[cfg(test)]
pub(crate) fn for_tests(backend: Arc<dyn crate::scheduler::backend::Backend>) -> (tempfile::TempDir, AppState) {
    use crate::scheduler::actor::Scheduler;
    use crate::scheduler::footprints::Footprints;

    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&dir.path().join("store")).expect("open the store");
    crate::demo_model::write_tiny_llama(&dir.path().join("tiny.gguf")).expect("tiny model");
    let (scheduler, handle) = Scheduler::new(backend, Vec::new(), 1 << 30, test_limits(), Footprints::in_memory());
    tokio::spawn(scheduler.run());
    (dir, AppState::for_tests(store, handle, Defaults { num_ctx: 2048, parallel: 1 }))
}

/// The scheduler limits of [`for_tests`]: two runners, a queue of eight.
#[cfg(test)]
pub(crate) fn test_limits() -> crate::scheduler::types::Limits {
    use crate::scheduler::keep_alive::{Clamp, KeepAlive};
    crate::scheduler::types::Limits {
        max_loaded: 2,
        max_queue: 8,
        default_keep_alive: KeepAlive::For(Duration::from_secs(300)),
        clamp: Clamp::default(),
        partial_offload: true,
    }
}

/// A backend that never starts anything (its llama-server does not exist).
#[cfg(test)]
pub(crate) fn absent_backend() -> Arc<dyn crate::scheduler::backend::Backend> {
    use crate::scheduler::backend::SupervisorBackend;
    use crate::supervisor::child_log::LogSink;
    use crate::supervisor::runner::SupervisorConfig;

    Arc::new(SupervisorBackend {
        config: SupervisorConfig {
            llama_server: "/nonexistent".into(),
            runtime_dir: std::env::temp_dir(),
            inherited_env: Vec::new(),
            log_sink: LogSink::Tracing,
            cgroups: None,
            stop_grace: Duration::from_secs(1),
            worker_link_timeout: Duration::from_secs(3),
        },
        load_timeout: Duration::from_secs(5),
        devices: Arc::default(),
        probe: None,
        projections: None,
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::Tokens;

    #[test]
    fn each_models_last_speed_is_kept() {
        let tokens = Tokens::default();
        assert!(tokens.speed("chat").abs() < f64::EPSILON, "none before an answer");
        tokens.record_speed("chat", 20, Duration::from_secs(2));
        tokens.record_speed("embed", 0, Duration::from_secs(1));
        tokens.record_speed("other", 5, Duration::ZERO);
        assert!((tokens.speed("chat") - 10.0).abs() < 1e-9);
        assert!(tokens.speed("embed").abs() < f64::EPSILON && tokens.speed("other").abs() < f64::EPSILON);
        tokens.record_speed("chat", 30, Duration::from_secs(1));
        assert!((tokens.speed("chat") - 30.0).abs() < 1e-9, "the last answer counts");
    }
}
