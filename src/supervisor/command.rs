//! The llama-server command line and environment, as a pure function of what to run.
//!
//! No IO: [`invocation`] turns (model files, load options, placement) into an
//! [`Invocation`] that the supervisor spawns as is, so every flag is tested here.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The files a model is made of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelFiles {
    /// The GGUF model.
    pub model: PathBuf,
    /// A multimodal projector, if the model has one.
    pub projector: Option<PathBuf>,
    /// `LoRA` adapters, applied in order.
    pub adapters: Vec<PathBuf>,
}

/// Options that shape a load: changing any of them needs a new llama-server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadOptions {
    /// Context length per request slot (Ollama's `num_ctx`).
    pub num_ctx: u32,
    /// Request slots (`-np`); the whole context is `num_ctx × parallel`.
    pub parallel: u32,
    /// Batch size (`-b` and `-ub`), or llama.cpp's default.
    pub num_batch: Option<u32>,
    /// Generation threads (`-t`), or llama.cpp's default.
    pub num_thread: Option<u32>,
    /// Layers on the GPU: a count, 0 for none, or `None` to let llama.cpp's own fit decide.
    pub num_gpu: Option<u32>,
    /// The GPU for single-device placement (`-sm none -mg N`).
    pub main_gpu: Option<u32>,
    /// `Some(false)` loads the weights without mmap (`-lm none`); `None` keeps llama.cpp's default.
    pub use_mmap: Option<bool>,
    /// Flash attention.
    pub flash_attention: FlashAttention,
    /// The KV cache type for K and V (`f16`, `q8_0`, `q4_0`, …), or llama.cpp's default (f16).
    pub kv_cache_type: Option<String>,
    /// Serve embeddings only, with this pooling.
    pub embedding: Option<Pooling>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            num_ctx: 4096,
            parallel: 1,
            num_batch: None,
            num_thread: None,
            num_gpu: None,
            main_gpu: None,
            use_mmap: None,
            flash_attention: FlashAttention::Auto,
            kv_cache_type: None,
            embedding: None,
        }
    }
}

/// `--flash-attn`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlashAttention {
    /// llama.cpp decides per device.
    Auto,
    /// Always.
    On,
    /// Never.
    Off,
}

/// `--pooling` for embedding models.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The model's own pooling type (from its GGUF metadata).
    ModelDefault,
    /// Mean of all token embeddings.
    Mean,
    /// The first (CLS) token.
    Cls,
    /// The last token.
    Last,
}

/// Where the scheduler placed a model.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placement {
    /// The local GPUs the child may see; empty means every device llama.cpp finds.
    pub devices: Vec<Device>,
    /// Keep the projector on the CPU (the retry after a projector out-of-memory, or no room on the GPU).
    pub projector_on_cpu: bool,
    /// llama.cpp RPC workers (`host:port`) serving as extra devices.
    pub rpc_servers: Vec<String>,
    /// The plan, when corral made one: then llama.cpp's own fit is off, so the child
    /// does exactly what was planned.
    pub plan: Option<DevicePlan>,
}

/// Which devices take the model's layers, as llama.cpp names them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DevicePlan {
    /// The devices, in `--device` order; none means the CPU only.
    pub devices: Vec<PlannedDevice>,
    /// Layers on those devices (`-ngl`); `None` for all of them.
    pub layers: Option<u32>,
}

/// One device of a [`DevicePlan`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedDevice {
    /// Its name for `--device` and in `llama-fit-params` output (`CUDA0`, `RPC1`).
    pub name: String,
    /// Its buffers' name in llama.cpp's log: the device name for local GPUs, the worker's
    /// own device name and address for RPC devices (`RPC0[10.0.0.2:50052]`).
    pub buffer: String,
    /// Its share of the layers (`-ts`, relative).
    pub share: u64,
}

/// A GPU the child may use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    /// Its driver family, which decides the visibility variable.
    pub backend: Backend,
    /// Its id for that variable: an index or a UUID.
    pub id: String,
}

/// GPU driver families.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// NVIDIA (`CUDA_VISIBLE_DEVICES`).
    Cuda,
    /// AMD (`ROCR_VISIBLE_DEVICES`).
    Rocm,
    /// Vulkan (`GGML_VK_VISIBLE_DEVICES`).
    Vulkan,
    /// A ggml `rpc-server` worker, reached with `--rpc` (no visibility variable).
    Rpc,
}

impl Backend {
    /// Its name in reports: `cuda`, `rocm` or `vulkan`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cuda => "cuda",
            Self::Rocm => "rocm",
            Self::Vulkan => "vulkan",
            Self::Rpc => "rpc",
        }
    }

    fn visibility_variable(self) -> Option<&'static str> {
        match self {
            Self::Cuda => Some("CUDA_VISIBLE_DEVICES"),
            Self::Rocm => Some("ROCR_VISIBLE_DEVICES"),
            Self::Vulkan => Some("GGML_VK_VISIBLE_DEVICES"),
            Self::Rpc => None,
        }
    }
}

/// A process to start: program, arguments and the complete environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invocation {
    /// The llama-server executable.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Its whole environment: nothing else is inherited.
    pub env: Vec<(OsString, OsString)>,
}

/// Variables a child may inherit from the daemon; everything else (`NOTIFY_SOCKET`,
/// `LISTEN_*`, credentials, …) stays behind.
pub const INHERITED_VARIABLES: &[&str] = &["PATH", "LD_LIBRARY_PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "TZ"];

/// What to run, and where.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// The llama-server executable.
    pub program: &'a Path,
    /// The model's files.
    pub files: &'a ModelFiles,
    /// The load options.
    pub options: &'a LoadOptions,
    /// The placement.
    pub placement: &'a Placement,
    /// The UNIX socket the child serves HTTP on.
    pub socket: &'a Path,
    /// The model's name, reported by the child's `/v1/models`.
    pub alias: &'a str,
    /// The daemon's environment, filtered through [`INHERITED_VARIABLES`].
    pub inherited_env: &'a [(OsString, OsString)],
}

/// Builds the command line and environment for one llama-server.
#[must_use]
pub fn invocation(r: &Request<'_>) -> Invocation {
    let mut args = Args::default();
    args.flag_value("-m", r.files.model.as_os_str());
    args.flag_value("--host", r.socket.as_os_str());
    args.flag_value("-a", r.alias);
    // Buffer-size and offload lines appear only from verbosity 4 on.
    args.flag_value("-lv", "4");
    args.flag("--no-webui");
    args.flag("--offline");
    args.flag("--metrics");
    model_args(&mut args, r.files, r.options, r.placement);
    Invocation { program: r.program.to_owned(), args: args.0, env: environment(r.inherited_env, r.placement) }
}

/// The arguments and environment `llama-fit-params` needs to project the memory of the
/// load [`invocation`] starts: the same model-shaping flags, without the server's own.
#[must_use]
pub fn projection(
    files: &ModelFiles,
    options: &LoadOptions,
    placement: &Placement,
    inherited_env: &[(OsString, OsString)],
) -> (Vec<OsString>, Vec<(OsString, OsString)>) {
    let mut args = Args::default();
    args.flag_value("-m", files.model.as_os_str());
    model_args(&mut args, files, options, placement);
    (args.0, environment(inherited_env, placement))
}

/// Everything that decides what is loaded where: shared by the server and the projection.
fn model_args(args: &mut Args, files: &ModelFiles, options: &LoadOptions, placement: &Placement) {
    let o = options;
    args.flag_value("-c", (u64::from(o.num_ctx) * u64::from(o.parallel.max(1))).to_string());
    args.flag_value("-np", o.parallel.max(1).to_string());
    if let Some(batch) = o.num_batch {
        args.flag_value("-b", batch.to_string());
        args.flag_value("-ub", batch.to_string());
    }
    if let Some(threads) = o.num_thread {
        args.flag_value("-t", threads.to_string());
    }
    args.flag_value(
        "-fa",
        match o.flash_attention {
            FlashAttention::Auto => "auto",
            FlashAttention::On => "on",
            FlashAttention::Off => "off",
        },
    );
    if let Some(kind) = &o.kv_cache_type {
        args.flag_value("-ctk", kind);
        args.flag_value("-ctv", kind);
    }
    // `--no-mmap` no longer exists; loading without mmap is `-lm none`.
    if o.use_mmap == Some(false) {
        args.flag_value("-lm", "none");
    }
    if let Some(pooling) = o.embedding {
        args.flag("--embeddings");
        let name = match pooling {
            Pooling::ModelDefault => None,
            Pooling::Mean => Some("mean"),
            Pooling::Cls => Some("cls"),
            Pooling::Last => Some("last"),
        };
        if let Some(name) = name {
            args.flag_value("--pooling", name);
        }
    }
    // `--rpc` first: the devices it adds must exist when `--device` names them.
    if !placement.rpc_servers.is_empty() {
        args.flag_value("--rpc", placement.rpc_servers.join(","));
    }
    // A client's num_gpu forces -ngl, as in Ollama; otherwise corral's plan decides, or,
    // without one, llama.cpp's own fit.
    let layers = o.num_gpu.or_else(|| placement.plan.as_ref().and_then(|p| p.layers));
    match &placement.plan {
        Some(plan) if o.main_gpu.is_none() => {
            args.flag_value("--fit", "off");
            if plan.devices.is_empty() {
                args.flag_value("--device", "none");
                args.flag_value("-ngl", "0");
            } else {
                let names: Vec<&str> = plan.devices.iter().map(|d| d.name.as_str()).collect();
                args.flag_value("--device", names.join(","));
                args.flag_value("-ngl", layers.map_or_else(|| "all".to_owned(), |n| n.to_string()));
                if plan.devices.len() > 1 {
                    let split: Vec<String> = plan.devices.iter().map(|d| d.share.max(1).to_string()).collect();
                    args.flag_value("-ts", split.join(","));
                }
            }
        }
        _ => {
            if let Some(layers) = layers {
                args.flag_value("-ngl", layers.to_string());
            }
        }
    }
    if let Some(gpu) = o.main_gpu {
        args.flag_value("-sm", "none");
        args.flag_value("-mg", gpu.to_string());
    }
    if let Some(projector) = &files.projector {
        args.flag_value("--mmproj", projector.as_os_str());
        if placement.projector_on_cpu
            || layers == Some(0)
            || placement.plan.as_ref().is_some_and(|p| p.devices.is_empty())
        {
            args.flag("--no-mmproj-offload");
        }
    }
    for adapter in &files.adapters {
        args.flag_value("--lora", adapter.as_os_str());
    }
}

fn environment(inherited: &[(OsString, OsString)], placement: &Placement) -> Vec<(OsString, OsString)> {
    let mut env: Vec<(OsString, OsString)> =
        inherited.iter().filter(|(k, _)| INHERITED_VARIABLES.iter().any(|allowed| k == allowed)).cloned().collect();
    for backend in [Backend::Cuda, Backend::Rocm, Backend::Vulkan] {
        let ids: Vec<&str> = placement.devices.iter().filter(|d| d.backend == backend).map(|d| d.id.as_str()).collect();
        if let (false, Some(variable)) = (ids.is_empty(), backend.visibility_variable()) {
            env.push((variable.into(), ids.join(",").into()));
        }
    }
    env
}

#[derive(Default)]
struct Args(Vec<OsString>);

impl Args {
    fn flag(&mut self, flag: &str) {
        self.0.push(flag.into());
    }

    fn flag_value(&mut self, flag: &str, value: impl Into<OsString>) {
        self.0.push(flag.into());
        self.0.push(value.into());
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::OsString;
    use std::path::{Path, PathBuf};

    use super::{
        Backend, Device, DevicePlan, FlashAttention, LoadOptions, ModelFiles, Placement, PlannedDevice, Pooling,
        Request, invocation,
    };

    fn files() -> ModelFiles {
        ModelFiles { model: PathBuf::from("/blobs/m"), projector: None, adapters: Vec::new() }
    }

    /// The argv after the fixed head (`-m … --metrics`), as one string.
    fn tail(files: &ModelFiles, options: &LoadOptions, placement: &Placement) -> String {
        let r = Request {
            program: Path::new("/usr/bin/llama-server"),
            files,
            options,
            placement,
            socket: Path::new("/run/corral/r1.sock"),
            alias: "tiny:latest",
            inherited_env: &[],
        };
        let args: Vec<String> = invocation(&r).args.iter().map(|a| a.to_string_lossy().into_owned()).collect();
        let head = "-m /blobs/m --host /run/corral/r1.sock -a tiny:latest -lv 4 --no-webui --offline --metrics";
        let all = args.join(" ");
        all.strip_prefix(head).unwrap_or_else(|| panic!("unexpected head: {all}")).trim_start().to_owned()
    }

    #[test]
    #[allow(clippy::too_many_lines, reason = "one table of cases")]
    fn command_lines_for_many_option_sets() {
        let base = LoadOptions::default();
        let cpu = Placement::default();
        let cases: Vec<(&str, ModelFiles, LoadOptions, Placement, &str)> = vec![
            ("defaults: no -ngl, so llama.cpp fits", files(), base.clone(), cpu.clone(), "-c 4096 -np 1 -fa auto"),
            (
                "context is num_ctx x parallel",
                files(),
                LoadOptions { num_ctx: 2048, parallel: 4, ..base.clone() },
                cpu.clone(),
                "-c 8192 -np 4 -fa auto",
            ),
            (
                "parallel 0 counts as 1",
                files(),
                LoadOptions { parallel: 0, ..base.clone() },
                cpu.clone(),
                "-c 4096 -np 1 -fa auto",
            ),
            (
                "num_gpu 0",
                files(),
                LoadOptions { num_gpu: Some(0), ..base.clone() },
                cpu.clone(),
                "-c 4096 -np 1 -fa auto -ngl 0",
            ),
            (
                "num_gpu 12",
                files(),
                LoadOptions { num_gpu: Some(12), ..base.clone() },
                cpu.clone(),
                "-c 4096 -np 1 -fa auto -ngl 12",
            ),
            (
                "batch, threads, flash attention, kv type",
                files(),
                LoadOptions {
                    num_batch: Some(256),
                    num_thread: Some(6),
                    flash_attention: FlashAttention::On,
                    kv_cache_type: Some("q8_0".into()),
                    ..base.clone()
                },
                cpu.clone(),
                "-c 4096 -np 1 -b 256 -ub 256 -t 6 -fa on -ctk q8_0 -ctv q8_0",
            ),
            (
                "mmap off is -lm none",
                files(),
                LoadOptions { use_mmap: Some(false), flash_attention: FlashAttention::Off, ..base.clone() },
                cpu.clone(),
                "-c 4096 -np 1 -fa off -lm none",
            ),
            (
                "mmap on adds nothing",
                files(),
                LoadOptions { use_mmap: Some(true), ..base.clone() },
                cpu.clone(),
                "-c 4096 -np 1 -fa auto",
            ),
            (
                "embeddings with mean pooling",
                files(),
                LoadOptions { embedding: Some(Pooling::Mean), ..base.clone() },
                cpu.clone(),
                "-c 4096 -np 1 -fa auto --embeddings --pooling mean",
            ),
            (
                "embeddings with the model's pooling",
                files(),
                LoadOptions { embedding: Some(Pooling::ModelDefault), ..base.clone() },
                cpu.clone(),
                "-c 4096 -np 1 -fa auto --embeddings",
            ),
            (
                "cls and last pooling",
                files(),
                LoadOptions { embedding: Some(Pooling::Cls), ..base.clone() },
                cpu.clone(),
                "-c 4096 -np 1 -fa auto --embeddings --pooling cls",
            ),
            (
                "main gpu means single-device split",
                files(),
                LoadOptions { num_gpu: Some(99), main_gpu: Some(1), ..base.clone() },
                cpu.clone(),
                "-c 4096 -np 1 -fa auto -ngl 99 -sm none -mg 1",
            ),
            (
                "projector offloaded by default",
                ModelFiles { projector: Some("/blobs/p".into()), ..files() },
                base.clone(),
                cpu.clone(),
                "-c 4096 -np 1 -fa auto --mmproj /blobs/p",
            ),
            (
                "projector on the CPU after an out-of-memory retry",
                ModelFiles { projector: Some("/blobs/p".into()), ..files() },
                base.clone(),
                Placement { projector_on_cpu: true, ..cpu.clone() },
                "-c 4096 -np 1 -fa auto --mmproj /blobs/p --no-mmproj-offload",
            ),
            (
                "projector on the CPU when the model is",
                ModelFiles { projector: Some("/blobs/p".into()), ..files() },
                LoadOptions { num_gpu: Some(0), ..base.clone() },
                cpu.clone(),
                "-c 4096 -np 1 -fa auto -ngl 0 --mmproj /blobs/p --no-mmproj-offload",
            ),
            (
                "adapters in order",
                ModelFiles { adapters: vec!["/blobs/a1".into(), "/blobs/a2".into()], ..files() },
                base.clone(),
                cpu.clone(),
                "-c 4096 -np 1 -fa auto --lora /blobs/a1 --lora /blobs/a2",
            ),
            (
                "rpc workers",
                files(),
                base.clone(),
                Placement { rpc_servers: vec!["10.0.0.2:50052".into(), "10.0.0.3:50052".into()], ..cpu.clone() },
                "-c 4096 -np 1 -fa auto --rpc 10.0.0.2:50052,10.0.0.3:50052",
            ),
            (
                "a plan over two workers: llama.cpp's fit is off, the devices and split are explicit",
                files(),
                base.clone(),
                Placement {
                    rpc_servers: vec!["10.0.0.2:50052".into(), "10.0.0.3:50052".into()],
                    plan: Some(DevicePlan {
                        devices: vec![
                            PlannedDevice { name: "RPC0".into(), buffer: "RPC0[10.0.0.2:50052]".into(), share: 300 },
                            PlannedDevice { name: "RPC1".into(), buffer: "RPC0[10.0.0.3:50052]".into(), share: 0 },
                        ],
                        layers: None,
                    }),
                    ..cpu.clone()
                },
                "-c 4096 -np 1 -fa auto --rpc 10.0.0.2:50052,10.0.0.3:50052 --fit off --device RPC0,RPC1 -ngl all -ts 300,1",
            ),
            (
                "a partial plan on one device: its layers only",
                files(),
                base.clone(),
                Placement {
                    plan: Some(DevicePlan {
                        devices: vec![PlannedDevice { name: "CUDA0".into(), buffer: "CUDA0".into(), share: 1 }],
                        layers: Some(9),
                    }),
                    ..cpu.clone()
                },
                "-c 4096 -np 1 -fa auto --fit off --device CUDA0 -ngl 9",
            ),
            (
                "a client's num_gpu forces -ngl over the plan, as in Ollama",
                files(),
                LoadOptions { num_gpu: Some(3), ..base.clone() },
                Placement {
                    plan: Some(DevicePlan {
                        devices: vec![PlannedDevice { name: "CUDA0".into(), buffer: "CUDA0".into(), share: 1 }],
                        layers: None,
                    }),
                    ..cpu.clone()
                },
                "-c 4096 -np 1 -fa auto --fit off --device CUDA0 -ngl 3",
            ),
            (
                "a plan on the CPU keeps every device out",
                files(),
                base.clone(),
                Placement { plan: Some(DevicePlan::default()), ..cpu.clone() },
                "-c 4096 -np 1 -fa auto --fit off --device none -ngl 0",
            ),
            (
                "a huge context does not overflow",
                files(),
                LoadOptions { num_ctx: u32::MAX, parallel: 4, ..base.clone() },
                cpu.clone(),
                "-c 17179869180 -np 4 -fa auto",
            ),
        ];
        for (name, files, options, placement, expected) in cases {
            assert_eq!(tail(&files, &options, &placement), expected, "{name}");
        }
    }

    #[test]
    fn the_environment_is_clean_but_for_allowed_variables_and_devices() {
        let inherited: Vec<(OsString, OsString)> = [
            ("PATH", "/usr/bin"),
            ("NOTIFY_SOCKET", "/run/systemd/notify"),
            ("LISTEN_FDS", "2"),
            ("HOME", "/var/lib/corral"),
            ("AWS_SECRET_ACCESS_KEY", "x"),
        ]
        .iter()
        .map(|(k, v)| ((*k).into(), (*v).into()))
        .collect();
        let placement = Placement {
            devices: vec![
                Device { backend: Backend::Cuda, id: "GPU-1234".into() },
                Device { backend: Backend::Cuda, id: "GPU-5678".into() },
                Device { backend: Backend::Rocm, id: "0".into() },
            ],
            ..Placement::default()
        };
        let files = files();
        let options = LoadOptions::default();
        let r = Request {
            program: Path::new("llama-server"),
            files: &files,
            options: &options,
            placement: &placement,
            socket: Path::new("/run/corral/x.sock"),
            alias: "m",
            inherited_env: &inherited,
        };
        let env: Vec<(String, String)> = invocation(&r)
            .env
            .iter()
            .map(|(k, v)| (k.to_string_lossy().into_owned(), v.to_string_lossy().into_owned()))
            .collect();
        let expected: Vec<(String, String)> = [
            ("PATH", "/usr/bin"),
            ("HOME", "/var/lib/corral"),
            ("CUDA_VISIBLE_DEVICES", "GPU-1234,GPU-5678"),
            ("ROCR_VISIBLE_DEVICES", "0"),
        ]
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
        assert_eq!(env, expected);
    }
}
