//! Client proxies for `org.corral.Corral1`, written from the XML contract (not generated
//! from the server's code). The test `dbus_contract` reads this file and checks every
//! member, signature and property caching against `dbus/*.xml`, and that each member of
//! the XML has its proxy here.

// The macro generates signal streams and argument structs that carry no documentation.
#![allow(missing_docs)]

use std::collections::HashMap;

use zbus::proxy;
use zbus::zvariant::{Fd, OwnedObjectPath, Value};

/// `org.corral.Corral1.Manager`.
#[proxy(
    interface = "org.corral.Corral1.Manager",
    default_service = "org.corral.Corral1",
    default_path = "/org/corral/Corral1"
)]
pub trait Manager {
    /// Every model: (name, path, digest, size, state).
    fn list_models(&self) -> zbus::Result<Vec<(String, OwnedObjectPath, String, u64, String)>>;
    /// A model's object path.
    fn get_model(&self, name: &str) -> zbus::Result<OwnedObjectPath>;
    /// Loads; returns once ready.
    fn load(&self, name: &str, options: HashMap<&str, Value<'_>>) -> zbus::Result<OwnedObjectPath>;
    /// Unloads; returns once reaped.
    fn unload(&self, name: &str) -> zbus::Result<()>;
    /// Starts a pull.
    fn pull(&self, name: &str, options: HashMap<&str, Value<'_>>) -> zbus::Result<OwnedObjectPath>;
    /// Starts a push.
    fn push(&self, name: &str, options: HashMap<&str, Value<'_>>) -> zbus::Result<OwnedObjectPath>;
    /// Starts a create from a Modelfile.
    fn create(&self, name: &str, modelfile: &str) -> zbus::Result<OwnedObjectPath>;
    /// Starts a create from a Modelfile whose local files are passed open.
    fn create_with_files(
        &self,
        name: &str,
        modelfile: &str,
        files: HashMap<&str, Fd<'_>>,
    ) -> zbus::Result<OwnedObjectPath>;
    /// Starts a copy.
    fn copy(&self, source: &str, destination: &str) -> zbus::Result<OwnedObjectPath>;
    /// Starts a delete.
    fn delete(&self, name: &str) -> zbus::Result<OwnedObjectPath>;

    /// A model became ready.
    #[zbus(signal)]
    fn model_loaded(&self, name: String, model: OwnedObjectPath, pid: u32) -> zbus::Result<()>;
    /// A model's runner stopped.
    #[zbus(signal)]
    fn model_unloaded(&self, name: String, model: OwnedObjectPath, reason: String) -> zbus::Result<()>;
    /// Where a runner placed its layers.
    #[zbus(signal)]
    fn offload_reported(
        &self,
        name: String,
        model: OwnedObjectPath,
        gpu_layers: u32,
        total_layers: u32,
        vram_bytes: u64,
        ram_bytes: u64,
    ) -> zbus::Result<()>;
    /// A job ended.
    #[zbus(signal)]
    fn job_finished(&self, job: OwnedObjectPath, success: bool, error: String) -> zbus::Result<()>;

    /// corrald's version.
    #[zbus(property)]
    fn version(&self) -> zbus::Result<String>;
    /// GPUs: (id, name, driver, total, usable). Superseded by `devices`.
    #[zbus(property(emits_changed_signal = "false"))]
    fn gpus(&self) -> zbus::Result<Vec<(String, String, String, u64, u64)>>;
    /// Devices, the host last: (kind, name, description, total, usable, used by corral).
    #[zbus(property(emits_changed_signal = "false"))]
    fn devices(&self) -> zbus::Result<Vec<(String, String, String, u64, u64, u64)>>;
    /// Workers: (name, address, "up" or "down", devices, last error, rtt µs, since µs).
    #[zbus(property)]
    fn workers(&self) -> zbus::Result<Vec<(String, String, String, Vec<String>, String, u64, u64)>>;
    /// Host memory for models.
    #[zbus(property)]
    fn host_memory(&self) -> zbus::Result<u64>;
    /// Models with a runner.
    #[zbus(property)]
    fn loaded_models(&self) -> zbus::Result<Vec<String>>;
    /// Requests waiting for a load.
    #[zbus(property(emits_changed_signal = "false"))]
    fn queue_depth(&self) -> zbus::Result<u32>;
    /// The most runners at once.
    #[zbus(property)]
    fn max_loaded_models(&self) -> zbus::Result<u32>;
    /// The most waiting requests.
    #[zbus(property)]
    fn max_queue(&self) -> zbus::Result<u32>;
    /// Seconds; -1 for forever.
    #[zbus(property)]
    fn default_keep_alive(&self) -> zbus::Result<i64>;
}

/// `org.corral.Corral1.Model`.
#[proxy(interface = "org.corral.Corral1.Model", default_service = "org.corral.Corral1")]
pub trait Model {
    /// Loads; returns once ready.
    fn load(&self, options: HashMap<&str, Value<'_>>) -> zbus::Result<()>;
    /// Unloads; returns once reaped.
    fn unload(&self) -> zbus::Result<()>;
    /// The full name.
    #[zbus(property)]
    fn name(&self) -> zbus::Result<String>;
    /// The name as Ollama shows it.
    #[zbus(property)]
    fn short_name(&self) -> zbus::Result<String>;
    /// The manifest digest.
    #[zbus(property)]
    fn digest(&self) -> zbus::Result<String>;
    /// Bytes of its blobs.
    #[zbus(property)]
    fn size(&self) -> zbus::Result<u64>;
    /// `format`, `family`, `parameter_size`, `quantization_level`.
    #[zbus(property)]
    fn details(&self) -> zbus::Result<HashMap<String, String>>;
    /// stopped, loading, ready, unloading or failed.
    #[zbus(property)]
    fn state(&self) -> zbus::Result<String>;
    /// Why the last load or run failed.
    #[zbus(property)]
    fn last_error(&self) -> zbus::Result<String>;
    /// The llama-server process.
    #[zbus(property)]
    fn pid(&self) -> zbus::Result<u32>;
    /// Layers on GPUs.
    #[zbus(property)]
    fn gpu_layers(&self) -> zbus::Result<u32>;
    /// All layers.
    #[zbus(property)]
    fn total_layers(&self) -> zbus::Result<u32>;
    /// GPU memory.
    #[zbus(property)]
    fn vram_bytes(&self) -> zbus::Result<u64>;
    /// Host memory.
    #[zbus(property)]
    fn ram_bytes(&self) -> zbus::Result<u64>;
    /// The system prompt.
    #[zbus(property(emits_changed_signal = "invalidates"))]
    fn system(&self) -> zbus::Result<String>;
    /// Default options, `name value` lines.
    #[zbus(property(emits_changed_signal = "invalidates"))]
    fn parameters(&self) -> zbus::Result<String>;
    /// The trained context.
    #[zbus(property)]
    fn context_length(&self) -> zbus::Result<u64>;
    /// completion, embedding, tools, insert, vision.
    #[zbus(property)]
    fn capabilities(&self) -> zbus::Result<Vec<String>>;
    /// A Modelfile that recreates it.
    #[zbus(property(emits_changed_signal = "invalidates"))]
    fn modelfile(&self) -> zbus::Result<String>;
    /// Microseconds since the epoch.
    #[zbus(property)]
    fn modified_at(&self) -> zbus::Result<u64>;
    /// The other models served by the same runner.
    #[zbus(property)]
    fn shared_with(&self) -> zbus::Result<Vec<String>>;
    /// Microseconds since the epoch; 0 for none.
    #[zbus(property(emits_changed_signal = "false"))]
    fn expires_at(&self) -> zbus::Result<u64>;
    /// Generated tokens per second in its last answer; 0 before one.
    #[zbus(property(emits_changed_signal = "false"))]
    fn tokens_per_second(&self) -> zbus::Result<f64>;
    /// Requests holding it.
    #[zbus(property(emits_changed_signal = "false"))]
    fn active_requests(&self) -> zbus::Result<u32>;
    /// Where its runner's memory is: (device name, kind, bytes), the host last.
    #[zbus(property(emits_changed_signal = "false"))]
    fn devices(&self) -> zbus::Result<Vec<(String, String, u64)>>;
    /// Its runner's memory per device: (llama.cpp's device name, planned, actual), the host last.
    #[zbus(property(emits_changed_signal = "false"))]
    fn memory(&self) -> zbus::Result<Vec<(String, u64, u64)>>;
}

/// `org.corral.Corral1.Job`.
#[proxy(interface = "org.corral.Corral1.Job", default_service = "org.corral.Corral1")]
pub trait Job {
    /// Stops a pull or push.
    fn cancel(&self) -> zbus::Result<()>;
    /// The job ended.
    #[zbus(signal)]
    fn finished(&self, success: bool, error: String) -> zbus::Result<()>;
    /// pull, push, create, copy or delete.
    #[zbus(property)]
    fn kind(&self) -> zbus::Result<String>;
    /// The model as given.
    #[zbus(property)]
    fn model(&self) -> zbus::Result<String>;
    /// running, succeeded, failed or cancelled.
    #[zbus(property)]
    fn state(&self) -> zbus::Result<String>;
    /// The latest progress line.
    #[zbus(property)]
    fn status(&self) -> zbus::Result<String>;
    /// Bytes of the current blob.
    #[zbus(property)]
    fn total(&self) -> zbus::Result<u64>;
    /// Bytes done.
    #[zbus(property)]
    fn completed(&self) -> zbus::Result<u64>;
    /// What went wrong.
    #[zbus(property)]
    fn error(&self) -> zbus::Result<String>;
}
