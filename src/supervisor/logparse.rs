//! Parsing of a `llama-server` child's stderr: pure, no IO, no clock, no logging.
//!
//! Three layers, each usable alone:
//!
//! * [`LineSplitter`] turns the arbitrary byte chunks read from the pipe into lines: it
//!   reassembles lines split across reads, drops the `\r` of `\r\n`, replaces bytes that
//!   are not UTF-8 with U+FFFD, and caps a line at a fixed length (the rest of the line is
//!   dropped and counted), so a child cannot make the daemon allocate without bound.
//! * [`parse_line`] splits one line into llama.cpp's level letter, the message, and an
//!   optional [`LogEvent`] (offload, buffer sizes, model loaded, listening, classified
//!   errors).
//! * [`LoadReport`] accumulates the events of one load: offloaded layers, buffer sizes
//!   (VRAM/RAM split), the last error lines and the most telling failure class.
//!
//! # The input
//!
//! corrald runs `llama-server` with its default log prefix and timestamps and `-lv 4`
//! (buffer-size and offload lines need verbosity 4). A line then looks like
//! `0.00.013.600 I load_tensors: offloaded 0/5 layers to GPU`: time since start as
//! `M.SS.mmm.uuu`, a level letter `I`/`W`/`E`/`D`, then the message; server lines carry a
//! tag (`srv  `, `slot `, `cmn  `, `spec `) and a padded function name
//! (`srv    load_model: …`), library lines only the function name. The timestamp is
//! optional here (`--no-log-timestamps`). ANSI colour sequences (`--log-colors on`) are
//! removed before parsing.
//!
//! Some lines carry no prefix: argument errors and warnings printed with a bare
//! `fprintf(stderr)` (`error: invalid argument: --no-mmap`, `warning: no usable GPU
//! found…`), usage text, `GGML_ABORT`/`GGML_ASSERT` messages (`file.cpp:123: …`), the C++
//! runtime's `terminate called after throwing …`, and the continuation lines of
//! multi-line messages. [`parse_line`] gives unprefixed `warning:`/`warn:` lines the level
//! [`Level::Warn`]; `error:`/`error while …` lines and the crash lines above
//! [`Level::Error`]; all others no level.
//!
//! # Multi-line messages
//!
//! A few messages span several lines: the chat-template example (`init: chat template,
//! example_format: '<|im_start|>system` followed by the rendered template, ending in a
//! line `'`) and `sampler params:` (followed by tab-indented lines). Only the first line
//! has a prefix, and nothing marks the last one, so grouping them would need a look-ahead
//! (holding a line back until the next one arrives, or a timer). Instead every physical
//! line stands alone: a continuation line has no level (journald priority 6, like an info
//! line) and never produces an event, because the event patterns are anchored to a
//! function-name prefix that continuation lines do not have. Nothing lost: none of these
//! messages carries anything the supervisor needs.
//!
//! The chat-template example is text from the model file, so a hostile GGUF can print
//! lines that look like llama-server's own. Treat every event as a report, not as proof:
//! readiness is confirmed over HTTP, and memory figures only feed accounting.
//!
//! # Plain text, not `--log-jsonl`
//!
//! `--log-jsonl` puts log records on stdout as JSON with the level and the whole
//! (multi-line) message, but the bare `fprintf(stderr)` lines above (argument errors,
//! GPU warnings, aborts, uncaught exceptions) stay plain text on stderr. A daemon would
//! need both parsers anyway and would lose the relative order of the two streams. Plain
//! text on one stream, passed through to the journal as the operator expects to read it,
//! is simpler and loses nothing the supervisor uses.
//!
//! # Buffers and the `--fit` dry run
//!
//! With `--fit on` (the default) llama-server opens the model twice: a no-alloc dry run,
//! then the real load. At `-lv 5` the dry run prints its own buffer and offload lines,
//! some with zero sizes and under other buffer names (`CPU` for what becomes
//! `CPU_Mapped`). The end of the dry run is always logged at `-lv 4`
//! (`common_fit_params: fitting params to free memory took …`, [`LogEvent::FitFinished`]),
//! and [`LoadReport`] forgets the buffers and offload figures seen before it. Within one
//! pass the last line per (function, buffer, kind) wins.

use std::borrow::Cow;
use std::collections::{BTreeMap, VecDeque};

mod patterns;

/// The default cap on one line, in bytes (without the newline).
pub const DEFAULT_MAX_LINE: usize = 16 * 1024;

/// How many error lines a [`LoadReport`] keeps (the most recent ones).
pub const MAX_ERROR_LINES: usize = 8;

/// How many buffers (by component, buffer and kind) a [`LoadReport`] keeps: a load prints
/// a few per device. Names come from the child's output, which a worker's devices can
/// shape; the report's readers look each device up among them.
pub const MAX_BUFFERS: usize = 256;

/// Reassembles lines from the byte chunks of a child's output.
///
/// Feed every chunk to [`push`](Self::push) in order, and call [`finish`](Self::finish)
/// at end of file for a last line without a newline. The result does not depend on how
/// the stream was cut into chunks. A line longer than the cap keeps its first `max_line`
/// bytes (cut back to a whole UTF-8 character) followed by ` [… N KiB cut]` (the size cut, in binary units); the
/// splitter never buffers more than `max_line` bytes.
#[derive(Debug, Clone)]
pub struct LineSplitter {
    buf: Vec<u8>,
    max_line: usize,
    /// Bytes of the current line dropped because of the cap.
    cut: usize,
    /// Whether the current line's last byte so far (kept or cut) is `\r`.
    ends_in_cr: bool,
}

impl Default for LineSplitter {
    fn default() -> Self {
        Self::new()
    }
}

impl LineSplitter {
    /// A splitter with the [`DEFAULT_MAX_LINE`] cap.
    #[must_use]
    pub fn new() -> Self {
        Self::with_max_line(DEFAULT_MAX_LINE)
    }

    /// A splitter that keeps at most `max_line` bytes of each line.
    #[must_use]
    pub fn with_max_line(max_line: usize) -> Self {
        Self { buf: Vec::new(), max_line, cut: 0, ends_in_cr: false }
    }

    /// Takes the next chunk and returns the lines it completes, without their `\n` or
    /// `\r\n`.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<String> {
        let mut lines = Vec::new();
        let mut rest = chunk;
        while let Some(newline) = rest.iter().position(|&b| b == b'\n') {
            self.append(&rest[..newline]);
            lines.push(self.take_line());
            rest = &rest[newline + 1..];
        }
        self.append(rest);
        lines
    }

    /// Ends the stream: returns the last line if it had no newline.
    pub fn finish(&mut self) -> Option<String> {
        (!self.buf.is_empty() || self.cut > 0).then(|| self.take_line())
    }

    fn append(&mut self, bytes: &[u8]) {
        let Some(&last) = bytes.last() else { return };
        let room = self.max_line.saturating_sub(self.buf.len());
        let keep = room.min(bytes.len());
        self.buf.extend_from_slice(&bytes[..keep]);
        self.cut += bytes.len() - keep;
        self.ends_in_cr = last == b'\r';
    }

    fn take_line(&mut self) -> String {
        if self.ends_in_cr {
            if self.cut > 0 {
                self.cut -= 1;
            } else {
                self.buf.pop();
            }
        }
        let line = if self.cut > 0 {
            let whole = complete_prefix_len(&self.buf);
            let cut = self.cut + (self.buf.len() - whole);
            format!("{} [… {} cut]", String::from_utf8_lossy(&self.buf[..whole]), crate::units::bytes(cut as u64))
        } else {
            String::from_utf8_lossy(&self.buf).into_owned()
        };
        self.buf.clear();
        self.cut = 0;
        self.ends_in_cr = false;
        line
    }
}

/// The length of `bytes` without a trailing, incomplete UTF-8 sequence.
fn complete_prefix_len(bytes: &[u8]) -> usize {
    let n = bytes.len();
    for back in 1..=n.min(4) {
        let b = bytes[n - back];
        if b & 0xC0 != 0x80 {
            let needed = match b {
                0xC0..=0xDF => 2,
                0xE0..=0xEF => 3,
                0xF0..=0xF7 => 4,
                _ => 1,
            };
            return if needed > back { n - back } else { n };
        }
    }
    n
}

/// A llama.cpp log level (the letter after the timestamp).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Level {
    /// `E`, or an unprefixed error/crash line.
    Error,
    /// `W`, or an unprefixed `warning:` line.
    Warn,
    /// `I`.
    Info,
    /// `D`.
    Debug,
}

impl Level {
    /// The syslog priority for journald: 3 (err), 4 (warning), 6 (info), 7 (debug).
    #[must_use]
    pub fn priority(self) -> u8 {
        match self {
            Self::Error => 3,
            Self::Warn => 4,
            Self::Info => 6,
            Self::Debug => 7,
        }
    }

    fn from_letter(letter: &str) -> Option<Self> {
        match letter {
            "E" => Some(Self::Error),
            "W" => Some(Self::Warn),
            "I" => Some(Self::Info),
            "D" => Some(Self::Debug),
            _ => None,
        }
    }
}

/// The kind of memory a buffer-size line reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BufferKind {
    /// Model weights (`model buffer size`).
    Model,
    /// Logits/embeddings output (`output buffer size`).
    Output,
    /// The KV cache (`KV buffer size`).
    Kv,
    /// Compute scratch (`compute buffer size`), also the projector's.
    Compute,
    /// The recurrent state of Mamba-like layers (`RS buffer size`).
    RecurrentState,
}

impl BufferKind {
    fn from_word(word: &str) -> Option<Self> {
        match word {
            "model" => Some(Self::Model),
            "output" => Some(Self::Output),
            "KV" => Some(Self::Kv),
            "compute" => Some(Self::Compute),
            "RS" => Some(Self::RecurrentState),
            _ => None,
        }
    }
}

/// Why llama-server failed, from an error line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// The model file is missing, unreadable, truncated, corrupt or unsupported.
    BadModelFile,
    /// Host or device memory ran out (`std::bad_alloc`, failed allocations, CUDA OOM).
    OutOfMemory,
    /// The HTTP socket could not be bound.
    BindFailure,
    /// The command line was rejected.
    InvalidArgument,
    /// An RPC worker (a ggml `rpc-server` that a `--rpc` device lives on) could not be
    /// reached, or its connection broke: it crashed, was killed (the kernel's OOM killer
    /// included: a worker over its cgroup's `memory.max` is killed, it never reports a
    /// failed allocation) or went away.  llama.cpp then aborts (SIGABRT).  Only the lines
    /// at start name the worker (`Failed to connect to HOST:PORT`); the abort on a broken
    /// connection does not say which.
    WorkerLost,
    /// Anything else.
    Other,
}

impl ErrorClass {
    /// Classifies an error message (without timestamp and level).
    #[must_use]
    pub fn classify(message: &str) -> Self {
        let lower = message.to_ascii_lowercase();
        let has = |needles: &[&str]| needles.iter().any(|n| lower.contains(n));
        if has(&["couldn't bind", "could not bind", "failed to bind", "address already in use"]) {
            Self::BindFailure
        } else if lower.starts_with("error: invalid argument")
            || lower.starts_with("error while handling argument")
            || lower.starts_with("error while handling environment variable")
        {
            Self::InvalidArgument
        } else if lower.trim_start().starts_with("gguf_") {
            // Everything the GGUF reader rejects is the file's fault, including its
            // `bad_alloc` while reading an absurd key or string length.
            Self::BadModelFile
        } else if has(OUT_OF_MEMORY) {
            Self::OutOfMemory
        } else if has(WORKER_LOST) || (lower.contains("ggml-rpc.cpp:") && has(WORKER_UNREACHABLE)) {
            Self::WorkerLost
        } else if has(BAD_MODEL_FILE) {
            Self::BadModelFile
        } else {
            Self::Other
        }
    }

    /// How telling the class is when several show up in one failure: the highest wins.
    fn rank(self) -> u8 {
        match self {
            Self::Other => 0,
            Self::InvalidArgument => 1,
            Self::BindFailure => 2,
            Self::BadModelFile => 3,
            Self::WorkerLost => 4,
            Self::OutOfMemory => 5,
        }
    }
}

/// Lower-case substrings of out-of-memory errors: llama.cpp's own (`failed to
/// allocate …`, `unable to allocate CUDA0 buffer`, `not enough space in the buffer`), the
/// C++ runtime's, the GPU backends', and the projector's (`clip_encode: failed to
/// allocate compute graph`).
const OUT_OF_MEMORY: &[&str] = &[
    "bad_alloc",
    "out of memory",
    "out of device memory",
    "failed to allocate",
    "unable to allocate",
    "allocation failed",
    "not enough memory",
    "not enough space in the buffer",
    "insufficient memory",
    "cudamalloc failed",
    "hipmalloc failed",
    "vk_error_out_of_device_memory",
    "erroroutofdevicememory",
    "erroroutofmemory",
];

/// Lower-case substrings of the errors of llama.cpp's RPC client when a worker's connection
/// breaks: the abort (`ggml-rpc.cpp:569: Remote RPC server crashed or returned malformed
/// response`) and the transport's own lines before it (`send failed (bytes_sent=0,
/// size_to_send=8)`, `recv failed (…)`).
const WORKER_LOST: &[&str] = &["remote rpc server crashed", "send failed (bytes_sent=", "recv failed (bytes_recv="];

/// Lower-case substrings of the RPC client's aborts when a worker cannot be reached at
/// start (`ggml-rpc.cpp:547: Failed to connect to 127.0.0.1:50052`); counted only in a
/// `ggml-rpc.cpp` abort, since other code connects to things too.
const WORKER_UNREACHABLE: &[&str] = &["failed to connect to ", "rpc handshake failed for "];

/// Lower-case substrings of errors about the model (or projector) file.
const BAD_MODEL_FILE: &[&str] = &[
    "failed to open gguf file",
    "invalid magic",
    "failed to read magic",
    "failed to read header",
    "failed to read key-value",
    "failed to read tensor",
    "gguf file is version",
    "not within the file bounds",
    "unknown model architecture",
    "unknown projector type",
    "error loading model",
    "check_tensor_dims",
    "wrong number of tensors",
    "missing tensor",
    "failed to load clip model",
];

/// Something a line tells the supervisor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogEvent {
    /// `load_tensors: offloaded N/M layers to GPU` (printed only by builds with a GPU or
    /// RPC backend, at `-lv 4`).
    Offload {
        /// Layers placed on GPU devices (N).
        gpu_layers: u32,
        /// All layers, the output layer included (M).
        total_layers: u32,
    },
    /// `<function>: <buffer> <kind> buffer size = X MiB` (at `-lv 4`).
    Buffer {
        /// The function that printed it (`load_tensors`, `llama_kv_cache`, …).
        component: String,
        /// The buffer type: `CPU_Mapped`, `CPU`, `CUDA0`, `CUDA_Host`, `RPC0[host:port]`, …
        buffer: String,
        /// What the buffer holds.
        kind: BufferKind,
        /// The size, converted from the MiB with two decimals that llama.cpp prints.
        bytes: u64,
    },
    /// `common_fit_params: fitting params to free memory took …`: the `--fit` dry run is
    /// over, the buffer and offload lines that follow belong to the real load.
    FitFinished,
    /// `llama_server: model loaded`.
    ModelLoaded,
    /// `update_slots: all slots are idle`: the server's task loop runs. Only from here on
    /// does llama-server act on SIGTERM (a signal before it starts is lost, upstream).
    SlotsIdle,
    /// `llama_server: listening on <address>`, printed after the load.
    Listening {
        /// `unix:///path/x.sock` or `http://host:port`.
        address: String,
    },
    /// An error line, classified.
    Error(ErrorClass, String),
}

/// One line, split up by [`parse_line`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedLine<'a> {
    /// The level letter, or the level of an unprefixed warning/error line; `None` for
    /// other unprefixed lines (continuations, usage text).
    pub level: Option<Level>,
    /// The line without timestamp and level letter (and without colour sequences).
    pub message: Cow<'a, str>,
    /// What the line reports, if anything.
    pub event: Option<LogEvent>,
}

impl ParsedLine<'_> {
    /// The syslog priority for journald: the level's, or 6 (info) without a level. The
    /// server's chatter about each request (slot choice, prompt cache, sampler, timings:
    /// about 20 info lines per chat) is debug: an admin's journal keeps the load, the
    /// errors and the warnings, and `journalctl -p debug` shows the rest.
    #[must_use]
    pub fn priority(&self) -> u8 {
        match self.level {
            Some(Level::Info) if is_request_chatter(&self.message) => Level::Debug.priority(),
            level => level.map_or(6, Level::priority),
        }
    }
}

/// The priorities of a stream of lines: a line without a level of its own (the rest of a
/// multi-line message, such as the sampler parameters under `sampler params:`) takes
/// the priority of the line before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Priorities {
    last: u8,
}

impl Default for Priorities {
    fn default() -> Self {
        Self { last: Level::Info.priority() }
    }
}

impl Priorities {
    /// The journald priority of `line`, the next line of the stream.
    pub fn of(&mut self, line: &ParsedLine<'_>) -> u8 {
        if line.level.is_some() {
            self.last = line.priority();
        }
        self.last
    }
}

/// Whether an info line is llama-server's per-request (or per-slot) chatter: every
/// `slot <function>:` line, and the `srv <function>:` lines of request handling, i.e.
/// all but those of the load (`load_model`, `init`) and of the server itself
/// (`llama_server`: model loaded, listening, stopping).
#[must_use]
pub fn is_request_chatter(message: &str) -> bool {
    let mut words = message.split_whitespace();
    match (words.next(), words.next()) {
        (Some("slot"), Some(_)) => true,
        (Some("srv"), Some(function)) => {
            function.ends_with(':') && !matches!(function, "llama_server:" | "load_model:" | "init:")
        }
        _ => false,
    }
}

/// Parses one line (without its newline) of llama-server's stderr.
#[must_use]
pub fn parse_line(line: &str) -> ParsedLine<'_> {
    let (level, message) = match patterns::strip_colours(line) {
        Cow::Borrowed(clean) => {
            let (level, message) = split_prefix(clean);
            (level, Cow::Borrowed(message))
        }
        Cow::Owned(clean) => {
            let (level, message) = split_prefix(&clean);
            (level, Cow::Owned(message.to_owned()))
        }
    };
    let event = event(level, &message);
    ParsedLine { level, message, event }
}

fn split_prefix(line: &str) -> (Option<Level>, &str) {
    if let Some((letter, message)) = patterns::level_prefix(line) {
        return (Level::from_letter(letter), message);
    }
    (unprefixed_level(line), line)
}

fn unprefixed_level(line: &str) -> Option<Level> {
    let starts = |prefix: &str| line.get(..prefix.len()).is_some_and(|head| head.eq_ignore_ascii_case(prefix));
    if starts("warning:") || starts("warn:") {
        Some(Level::Warn)
    } else if starts("error:")
        || starts("error while")
        || starts("terminate called")
        || line.starts_with("  what():")
        || patterns::is_abort(line)
    {
        Some(Level::Error)
    } else {
        None
    }
}

fn event(level: Option<Level>, message: &str) -> Option<LogEvent> {
    if level == Some(Level::Error) {
        return Some(LogEvent::Error(ErrorClass::classify(message), message.to_owned()));
    }
    if let Some((gpu_layers, total_layers)) = patterns::offload(message) {
        return Some(LogEvent::Offload {
            gpu_layers: gpu_layers.parse().ok()?,
            total_layers: total_layers.parse().ok()?,
        });
    }
    if let Some(line) = patterns::buffer(message) {
        return Some(LogEvent::Buffer {
            component: line.component.to_owned(),
            buffer: line.name.to_owned(),
            kind: BufferKind::from_word(line.kind)?,
            bytes: mib_to_bytes(line.mib)?,
        });
    }
    if message.starts_with("common_fit_params: fitting params to free memory took") {
        return Some(LogEvent::FitFinished);
    }
    if patterns::model_loaded(message) {
        return Some(LogEvent::ModelLoaded);
    }
    if let Some(address) = patterns::listening(message) {
        return Some(LogEvent::Listening { address: address.to_owned() });
    }
    if patterns::slots_idle(message) {
        return Some(LogEvent::SlotsIdle);
    }
    None
}

/// The sum of buffer sizes, saturating: the sizes are whatever the child printed.
fn saturating_sum<'a>(buffers: impl Iterator<Item = (&'a BufferKey, u64)>) -> u64 {
    buffers.fold(0, |sum, (_, bytes)| sum.saturating_add(bytes))
}

/// `123.45` MiB in bytes, rounded to the nearest byte; `None` if it does not fit a `u64`
/// (or has more than 18 decimals).
fn mib_to_bytes(mib: &str) -> Option<u64> {
    const MIB: u128 = 1 << 20;
    let (int, frac) = mib.split_once('.').unwrap_or((mib, ""));
    if frac.len() > 18 {
        return None;
    }
    let int: u128 = int.parse().ok()?;
    let frac_bytes = if frac.is_empty() {
        0
    } else {
        let scale = 10u128.pow(u32::try_from(frac.len()).ok()?);
        let frac: u128 = frac.parse().ok()?;
        (frac * MIB + scale / 2) / scale
    };
    u64::try_from(int.checked_mul(MIB)?.checked_add(frac_bytes)?).ok()
}

/// Whether a buffer type lives in host memory: `CPU`, `CPU_Mapped`, `CPU_REPACK`, … and
/// pinned host buffers of GPU backends (`CUDA_Host`, `Vulkan_Host`, …).
#[must_use]
pub fn is_host_buffer(buffer: &str) -> bool {
    buffer.starts_with("CPU") || buffer.ends_with("_Host")
}

/// Which buffer a size belongs to in a [`LoadReport`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferKey {
    /// The function that printed the line (the model, the context and the projector
    /// print compute buffers of the same name).
    pub component: String,
    /// The buffer type (`CPU_Mapped`, `CUDA0`, …).
    pub buffer: String,
    /// What it holds.
    pub kind: BufferKind,
}

/// The layers a load placed on GPU devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offload {
    /// Layers on GPU devices.
    pub gpu_layers: u32,
    /// All layers, the output layer included.
    pub total_layers: u32,
}

/// An error line and its class.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorLine {
    /// Its class.
    pub class: ErrorClass,
    /// The message, without timestamp and level.
    pub message: String,
}

/// What one llama-server load reported, accumulated from its [`LogEvent`]s.
///
/// The supervisor feeds it every line of a child, from spawn until it is ready or dead.
/// It holds a bounded amount of data: one entry per buffer line pattern, at most
/// [`MAX_BUFFERS`] of them (more are left out), and at most [`MAX_ERROR_LINES`] error lines.
///
/// Known limit: a speculative-decoding draft model prints the same buffer lines as the
/// main model, so its sizes replace the main model's instead of adding to them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadReport {
    offload: Option<Offload>,
    buffers: BTreeMap<BufferKey, u64>,
    errors: VecDeque<ErrorLine>,
    worst: Option<ErrorLine>,
    model_loaded: bool,
    task_loop_running: bool,
    listening: Option<String>,
}

impl LoadReport {
    /// An empty report.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Parses a line and records its event; returns the parsed line (for the journal).
    pub fn feed<'a>(&mut self, line: &'a str) -> ParsedLine<'a> {
        let parsed = parse_line(line);
        if let Some(event) = &parsed.event {
            self.observe(event);
        }
        parsed
    }

    /// Records one event.
    pub fn observe(&mut self, event: &LogEvent) {
        match event {
            LogEvent::Offload { gpu_layers, total_layers } => {
                self.offload = Some(Offload { gpu_layers: *gpu_layers, total_layers: *total_layers });
            }
            LogEvent::Buffer { component, buffer, kind, bytes } => {
                let key = BufferKey { component: component.clone(), buffer: buffer.clone(), kind: *kind };
                if self.buffers.len() < MAX_BUFFERS || self.buffers.contains_key(&key) {
                    self.buffers.insert(key, *bytes);
                }
            }
            LogEvent::FitFinished => {
                self.buffers.clear();
                self.offload = None;
            }
            LogEvent::ModelLoaded => self.model_loaded = true,
            LogEvent::SlotsIdle => self.task_loop_running = true,
            LogEvent::Listening { address } => self.listening = Some(address.clone()),
            LogEvent::Error(class, message) => {
                let line = ErrorLine { class: *class, message: message.clone() };
                if self.worst.as_ref().is_none_or(|worst| class.rank() > worst.class.rank()) {
                    self.worst = Some(line.clone());
                }
                if self.errors.len() == MAX_ERROR_LINES {
                    self.errors.pop_front();
                }
                self.errors.push_back(line);
            }
        }
    }

    /// The layers that sit on a device: the offload line's figures, checked against the
    /// model buffers. A build with the RPC backend prints "offloaded 5/5 layers to GPU"
    /// even with no device at all, its weights then all in CPU buffers: layers count as
    /// offloaded only when a device (a non-host buffer) holds model bytes. `None` if no
    /// offload line was printed (a build without GPU or RPC backend, or verbosity below 4):
    /// then everything is on the CPU.
    #[must_use]
    pub fn offload(&self) -> Option<Offload> {
        let mut offload = self.offload?;
        let model_buffers: Vec<(&BufferKey, u64)> =
            self.buffers().filter(|(key, _)| key.kind == BufferKind::Model).collect();
        let on_device = model_buffers.iter().any(|(key, bytes)| *bytes > 0 && !is_host_buffer(&key.buffer));
        // Without buffer lines there is nothing to check the line against.
        if !model_buffers.is_empty() && !on_device {
            offload.gpu_layers = 0;
        }
        Some(offload)
    }

    /// Every buffer size of the load, in key order.
    pub fn buffers(&self) -> impl Iterator<Item = (&BufferKey, u64)> + '_ {
        self.buffers.iter().map(|(key, &bytes)| (key, bytes))
    }

    /// The bytes of one buffer type and kind, summed over the components that printed it.
    #[must_use]
    pub fn buffer_bytes(&self, buffer: &str, kind: BufferKind) -> u64 {
        saturating_sum(self.buffers().filter(|(key, _)| key.buffer == buffer && key.kind == kind))
    }

    /// Bytes in device buffers: everything but [`is_host_buffer`] ones.
    #[must_use]
    pub fn vram_bytes(&self) -> u64 {
        saturating_sum(self.buffers().filter(|(key, _)| !is_host_buffer(&key.buffer)))
    }

    /// Bytes in the buffers of one buffer type, over every kind (`CUDA0`,
    /// `RPC0[10.0.0.2:50052]`: an RPC worker's device is named by the worker).
    #[must_use]
    pub fn device_bytes(&self, buffer: &str) -> u64 {
        saturating_sum(self.buffers().filter(|(key, _)| key.buffer == buffer))
    }

    /// The buffer types on devices (not the host) the load used, in name order.
    #[must_use]
    pub fn devices(&self) -> Vec<String> {
        let names: std::collections::BTreeSet<&str> =
            self.buffers.keys().filter(|key| !is_host_buffer(&key.buffer)).map(|key| key.buffer.as_str()).collect();
        names.into_iter().map(str::to_owned).collect()
    }

    /// Bytes in host buffers ([`is_host_buffer`]). Mapped weights (`CPU_Mapped`) count
    /// although the page cache backs them.
    #[must_use]
    pub fn ram_bytes(&self) -> u64 {
        saturating_sum(self.buffers().filter(|(key, _)| is_host_buffer(&key.buffer)))
    }

    /// Whether `model loaded` was printed.
    #[must_use]
    pub fn model_loaded(&self) -> bool {
        self.model_loaded
    }

    /// True once the server's task loop runs (it then acts on SIGTERM).
    #[must_use]
    pub fn task_loop_running(&self) -> bool {
        self.task_loop_running
    }

    /// The address of the `listening on` line.
    #[must_use]
    pub fn listening(&self) -> Option<&str> {
        self.listening.as_deref()
    }

    /// The last [`MAX_ERROR_LINES`] error lines, oldest first.
    pub fn errors(&self) -> impl Iterator<Item = &ErrorLine> + '_ {
        self.errors.iter()
    }

    /// The most telling class among all error lines seen (not only the kept ones):
    /// out of memory, then a lost RPC worker, a bad model file, a bind failure, an invalid
    /// argument, other.
    #[must_use]
    pub fn failure_class(&self) -> Option<ErrorClass> {
        self.worst.as_ref().map(|line| line.class)
    }

    /// The first error line of the [`failure_class`](Self::failure_class).
    #[must_use]
    pub fn failure_message(&self) -> Option<&str> {
        self.worst.as_ref().map(|line| line.message.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // ---- the line splitter ----

    /// Splits `chunks` and returns all lines, the one `finish` gives included.
    fn split_all(splitter: &mut LineSplitter, chunks: &[&[u8]]) -> Vec<String> {
        let mut lines: Vec<String> = chunks.iter().flat_map(|chunk| splitter.push(chunk)).collect();
        lines.extend(splitter.finish());
        lines
    }

    const SAMPLE: &[u8] = b"0.00.001.142 I srv  llama_server: initializing ...\r\n\
        plain \xff byte\n\
        caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\xa6\x99\n\
        \n\
        \tsampler continuation\r\n\
        lone\rcarriage\n\
        no newline at the end";

    fn sample_lines() -> Vec<String> {
        [
            "0.00.001.142 I srv  llama_server: initializing ...",
            "plain \u{fffd} byte",
            "café € 🦙",
            "",
            "\tsampler continuation",
            "lone\rcarriage",
            "no newline at the end",
        ]
        .map(str::to_owned)
        .to_vec()
    }

    #[test]
    fn huge_buffer_sizes_saturate_instead_of_overflowing() {
        // Found by the llama_log fuzz target: two sizes that each fit a u64 overflowed
        // their sum (a panic in debug builds, a wrapped size in release ones).
        let mut report = LoadReport::new();
        for device in ["CUDA0", "CUDA1", "CPU"] {
            report.feed(&format!("load_tensors:   {device} model buffer size = 17592186044415.00 MiB"));
        }
        report.feed("load_tensors:   CPU_Mapped model buffer size = 17592186044415.00 MiB");
        assert_eq!(report.vram_bytes(), u64::MAX);
        assert_eq!(report.ram_bytes(), u64::MAX);
        assert_eq!(report.buffer_bytes("CPU", BufferKind::Model), 17_592_186_044_415 << 20);
    }

    /// Buffers beyond [`MAX_BUFFERS`] are left out, so a child printing a million names
    /// cannot grow the report (nor the per-device lookups over it); those kept still
    /// take their last size.
    #[test]
    fn a_report_keeps_at_most_its_number_of_buffers() {
        let mut report = LoadReport::new();
        for i in 0..10 * MAX_BUFFERS {
            report.feed(&format!("load_tensors:   RPC{i} model buffer size = 1.00 MiB"));
        }
        report.feed("load_tensors:   RPC0 model buffer size = 3.00 MiB");
        assert_eq!(report.devices().len(), MAX_BUFFERS);
        assert_eq!(report.vram_bytes(), (MAX_BUFFERS as u64 + 2) << 20);
        assert_eq!(report.buffer_bytes("RPC0", BufferKind::Model), 3 << 20);
    }

    #[test]
    fn splitter_whole_sample() {
        assert_eq!(split_all(&mut LineSplitter::new(), &[SAMPLE]), sample_lines());
    }

    #[test]
    fn splitter_every_chunk_boundary() {
        for i in 0..=SAMPLE.len() {
            let lines = split_all(&mut LineSplitter::new(), &[&SAMPLE[..i], &SAMPLE[i..]]);
            assert_eq!(lines, sample_lines(), "split at {i}");
        }
        for i in 0..=SAMPLE.len() {
            for j in i..=SAMPLE.len() {
                let lines = split_all(&mut LineSplitter::new(), &[&SAMPLE[..i], &SAMPLE[i..j], &SAMPLE[j..]]);
                assert_eq!(lines, sample_lines(), "split at {i} and {j}");
            }
        }
    }

    #[test]
    fn splitter_byte_by_byte() {
        let chunks: Vec<&[u8]> = SAMPLE.chunks(1).collect();
        assert_eq!(split_all(&mut LineSplitter::new(), &chunks), sample_lines());
    }

    #[test]
    fn splitter_empty_input() {
        let mut splitter = LineSplitter::new();
        assert!(splitter.push(b"").is_empty());
        assert_eq!(splitter.finish(), None);
        assert_eq!(splitter.push(b"\n\r\n"), ["", ""]);
        assert_eq!(splitter.finish(), None);
        assert_eq!(splitter.push(b"\r"), Vec::<String>::new());
        assert_eq!(splitter.finish().as_deref(), Some(""));
    }

    #[test]
    fn splitter_caps_a_huge_line() {
        let mut splitter = LineSplitter::with_max_line(16);
        let huge = vec![b'x'; 1_000_000];
        for chunk in huge.chunks(4096) {
            assert!(splitter.push(chunk).is_empty());
            assert!(splitter.buf.len() <= 16 && splitter.buf.capacity() <= 32);
        }
        assert_eq!(splitter.push(b"\r\nnext\n"), [format!("{} [… 976.5 KiB cut]", "x".repeat(16)), "next".into()]);
        // Exactly at the cap is not cut, nor is the `\r` of `\r\n` just past it.
        assert_eq!(splitter.push(&[b"y".repeat(16).as_slice(), b"\r\n"].concat()), ["y".repeat(16)]);
        // Cut without a newline at the end.
        assert!(splitter.push(&b"z".repeat(20)).is_empty());
        assert_eq!(splitter.finish(), Some(format!("{} [… 4 B cut]", "z".repeat(16))));
    }

    #[test]
    fn splitter_cuts_on_a_character_boundary() {
        // 14 ASCII bytes, then a 3-byte euro sign across the 16-byte cap.
        let mut splitter = LineSplitter::with_max_line(16);
        let line = [b"a".repeat(14).as_slice(), "€€".as_bytes(), b"\n"].concat();
        assert_eq!(splitter.push(&line), [format!("{} [… 6 B cut]", "a".repeat(14))]);
        // An invalid byte at the cut stays a replacement character.
        let line = [b"a".repeat(15).as_slice(), b"\xff\xff\n"].concat();
        assert_eq!(splitter.push(&line), [format!("{}\u{fffd} [… 1 B cut]", "a".repeat(15))]);
    }

    #[test]
    fn complete_prefix_len_cases() {
        assert_eq!(complete_prefix_len(b""), 0);
        assert_eq!(complete_prefix_len(b"ab"), 2);
        assert_eq!(complete_prefix_len("a€".as_bytes()), 4);
        assert_eq!(complete_prefix_len(&"a€".as_bytes()[..3]), 1);
        assert_eq!(complete_prefix_len(&"🦙".as_bytes()[..3]), 0);
        assert_eq!(complete_prefix_len(b"a\x80\x80\x80\x80"), 5);
    }

    // ---- parse_line ----

    #[test]
    fn levels_and_priorities() {
        let cases: &[(&str, Option<Level>, u8, &str)] = &[
            (
                "0.00.001.142 I srv  llama_server: initializing ...",
                Some(Level::Info),
                6,
                "srv  llama_server: initializing ...",
            ),
            (
                "0.00.002.876 W srv  llama_server: security: no API key",
                Some(Level::Warn),
                4,
                "srv  llama_server: security: no API key",
            ),
            (
                "12.59.999.999 E gguf_init_from_reader: failed to read magic",
                Some(Level::Error),
                3,
                "gguf_init_from_reader: failed to read magic",
            ),
            ("0.00.009.000 D create_tensor: x", Some(Level::Debug), 7, "create_tensor: x"),
            ("I load_tensors: no timestamp", Some(Level::Info), 6, "load_tensors: no timestamp"),
            (
                "load_tensors:   CPU model buffer size =     0.43 MiB",
                None,
                6,
                "load_tensors:   CPU model buffer size =     0.43 MiB",
            ),
            (
                "warning: no usable GPU found, --gpu-layers option will be ignored",
                Some(Level::Warn),
                4,
                "warning: no usable GPU found, --gpu-layers option will be ignored",
            ),
            (
                "warn: LLAMA_ARG_CTX_SIZE environment variable is set",
                Some(Level::Warn),
                4,
                "warn: LLAMA_ARG_CTX_SIZE environment variable is set",
            ),
            ("error: invalid argument: --no-mmap", Some(Level::Error), 3, "error: invalid argument: --no-mmap"),
            (
                "error while handling argument \"-c\": stoi",
                Some(Level::Error),
                3,
                "error while handling argument \"-c\": stoi",
            ),
            (
                "terminate called after throwing an instance of 'std::bad_alloc'",
                Some(Level::Error),
                3,
                "terminate called after throwing an instance of 'std::bad_alloc'",
            ),
            ("  what():  std::bad_alloc", Some(Level::Error), 3, "  what():  std::bad_alloc"),
            (
                "/src/ggml/src/ggml-cuda/ggml-cuda.cu:109: CUDA error",
                Some(Level::Error),
                3,
                "/src/ggml/src/ggml-cuda/ggml-cuda.cu:109: CUDA error",
            ),
            ("\tmirostat = 0, mirostat_lr = 0.100", None, 6, "\tmirostat = 0, mirostat_lr = 0.100"),
            ("You are a helpful assistant<|im_end|>", None, 6, "You are a helpful assistant<|im_end|>"),
            ("'", None, 6, "'"),
            ("usage:", None, 6, "usage:"),
            ("", None, 6, ""),
            ("0.00.001.142 X srv  unknown level", None, 6, "0.00.001.142 X srv  unknown level"),
            ("0.00.001.142 I", None, 6, "0.00.001.142 I"),
        ];
        for &(line, level, priority, message) in cases {
            let parsed = parse_line(line);
            assert_eq!(parsed.level, level, "{line:?}");
            assert_eq!(parsed.priority(), priority, "{line:?}");
            assert_eq!(parsed.message, message, "{line:?}");
        }
    }

    #[test]
    fn colours_are_removed() {
        let line = "\x1b[34m0.00.011.183\x1b[0m \x1b[32mI \x1b[0mload_tensors: offloaded 2/5 layers to GPU";
        let parsed = parse_line(line);
        assert_eq!(parsed.level, Some(Level::Info));
        assert_eq!(parsed.message, "load_tensors: offloaded 2/5 layers to GPU");
        assert_eq!(parsed.event, Some(LogEvent::Offload { gpu_layers: 2, total_layers: 5 }));
        let line = "\x1b[34m0.00.004.385\x1b[0m \x1b[31mE srv         start: couldn't bind HTTP server socket\x1b[0m";
        let parsed = parse_line(line);
        assert_eq!(parsed.level, Some(Level::Error));
        assert!(matches!(parsed.event, Some(LogEvent::Error(ErrorClass::BindFailure, _))));
    }

    fn buffer(component: &str, buffer: &str, kind: BufferKind, bytes: u64) -> LogEvent {
        LogEvent::Buffer { component: component.into(), buffer: buffer.into(), kind, bytes }
    }

    #[test]
    fn events() {
        use BufferKind::{Compute, Kv, Model, Output, RecurrentState};
        let cases: Vec<(&str, Option<LogEvent>)> = vec![
            (
                "0.00.011.183 I load_tensors: offloaded 2/5 layers to GPU",
                Some(LogEvent::Offload { gpu_layers: 2, total_layers: 5 }),
            ),
            (
                "I llm_load_tensors: offloaded 33/33 layers to GPU",
                Some(LogEvent::Offload { gpu_layers: 33, total_layers: 33 }),
            ),
            ("0.00.011.170 I load_tensors: offloading 1 repeating layers to GPU", None),
            (
                "0.00.011.198 I load_tensors:   CPU_Mapped model buffer size =     0.43 MiB",
                Some(buffer("load_tensors", "CPU_Mapped", Model, 450_888)),
            ),
            (
                "0.00.018.551 I load_tensors: RPC0[127.0.0.1:50152] model buffer size =     0.36 MiB",
                Some(buffer("load_tensors", "RPC0[127.0.0.1:50152]", Model, 377_487)),
            ),
            (
                "I llama_context:        CPU  output buffer size =     0.01 MiB",
                Some(buffer("llama_context", "CPU", Output, 10_486)),
            ),
            (
                "I llama_kv_cache:      CUDA0 KV buffer size =  8192.00 MiB",
                Some(buffer("llama_kv_cache", "CUDA0", Kv, 8 << 30)),
            ),
            (
                "I sched_reserve:  CUDA_Host compute buffer size =    12.01 MiB",
                Some(buffer("sched_reserve", "CUDA_Host", Compute, 12_593_398)),
            ),
            (
                "I llama_memory_recurrent:        CPU RS buffer size =     0.25 MiB",
                Some(buffer("llama_memory_recurrent", "CPU", RecurrentState, 262_144)),
            ),
            (
                "I reserve_compute_meta:        CPU compute buffer size =     1.39 MiB",
                Some(buffer("reserve_compute_meta", "CPU", Compute, 1_457_521)),
            ),
            (
                "load_tensors:   CPU_Mapped model buffer size =     1 MiB",
                Some(buffer("load_tensors", "CPU_Mapped", Model, 1 << 20)),
            ),
            (
                "D ~llama_context:        CPU compute buffer size is   3.3926 MiB, matches expectation of   3.3926 MiB",
                None,
            ),
            ("I llama_adapter_lora_init_impl:        CPU LoRA buffer size =     1.00 MiB", None),
            (
                "0.00.006.445 I common_fit_params: fitting params to free memory took 0.00 seconds",
                Some(LogEvent::FitFinished),
            ),
            ("0.00.017.313 I srv  llama_server: model loaded", Some(LogEvent::ModelLoaded)),
            ("0.00.014.953 I srv  update_slots: all slots are idle", Some(LogEvent::SlotsIdle)),
            (
                "0.00.017.316 I srv  llama_server: listening on http://127.0.0.1:41057",
                Some(LogEvent::Listening { address: "http://127.0.0.1:41057".into() }),
            ),
            (
                "0.00.022.315 I srv  llama_server: listening on unix:///tmp/x.sock",
                Some(LogEvent::Listening { address: "unix:///tmp/x.sock".into() }),
            ),
            // continuation lines cannot fake events
            ("<|im_start|>user offloaded 2/5 layers to GPU", None),
            ("\tlistening on http://evil", None),
            ("", None),
        ];
        for (line, event) in cases {
            assert_eq!(parse_line(line).event, event, "{line:?}");
        }
    }

    #[test]
    fn numbers_too_large() {
        for line in [
            "I load_tensors: offloaded 99999999999/5 layers to GPU",
            "I load_tensors: offloaded 5/4294967296 layers to GPU",
            "I load_tensors:   CPU_Mapped model buffer size = 99999999999999999999999999999999999999999.00 MiB",
            "I load_tensors:   CPU_Mapped model buffer size = 17592186044416.00 MiB",
            "I load_tensors:   CPU_Mapped model buffer size = 0.0000000000000000001 MiB",
        ] {
            assert_eq!(parse_line(line).event, None, "{line:?}");
        }
        // The largest that fits.
        assert_eq!(
            parse_line("I load_tensors: offloaded 4294967295/4294967295 layers to GPU").event,
            Some(LogEvent::Offload { gpu_layers: u32::MAX, total_layers: u32::MAX })
        );
        assert_eq!(mib_to_bytes("17592186044415.99"), Some(u64::MAX - 10_485));
        assert_eq!(mib_to_bytes("0.000000000000000001"), Some(0));
        assert_eq!(mib_to_bytes("0.00"), Some(0));
        assert_eq!(mib_to_bytes("3.39"), Some(3_554_673));
    }

    #[test]
    fn error_classes() {
        use ErrorClass::{BadModelFile, BindFailure, InvalidArgument, Other, OutOfMemory, WorkerLost};
        let cases: &[(&str, ErrorClass)] = &[
            ("gguf_init_from_file: failed to open GGUF file '/x.gguf' (No such file or directory)", BadModelFile),
            ("gguf_init_from_reader: failed to read magic", BadModelFile),
            ("gguf_init_from_reader: failed to read header", BadModelFile),
            ("gguf_init_from_reader: failed to read key-value pairs", BadModelFile),
            ("gguf_init_from_reader: invalid magic characters: 'D ?<', expected 'GGUF'", BadModelFile),
            (
                "gguf_init_from_reader: this GGUF file is version 99 but this software only supports up to version 3",
                BadModelFile,
            ),
            ("gguf_init_from_file_impl: encountered bad_alloc error while reading key 3", BadModelFile),
            (
                "llama_model_load: error loading model: tensor 'blk.1.ffn_gate.weight' data is not within the file \
                bounds, model is corrupted or incomplete",
                BadModelFile,
            ),
            ("llama_model_load: error loading model: unknown model architecture: 'foobar'", BadModelFile),
            (
                "llama_model_load: error loading model: check_tensor_dims: tensor 'output_norm.weight' not found",
                BadModelFile,
            ),
            (
                "llama_model_load: error loading model: done_getting_tensors: wrong number of tensors; expected 39, \
                got 38",
                BadModelFile,
            ),
            ("clip_model_loader: failed to load CLIP model from /x. Does this file exist?", BadModelFile),
            ("llama_init_from_model: failed to initialize the context: std::bad_alloc", OutOfMemory),
            ("llama_model_load: error loading model: unable to allocate CUDA0 buffer", OutOfMemory),
            (
                "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 8192.00 MiB on device 0: cudaMalloc failed: \
                out of memory",
                OutOfMemory,
            ),
            ("CUDA error: out of memory", OutOfMemory),
            ("ggml_gallocr_reserve_n: failed to allocate CUDA0 buffer of size 2151677952", OutOfMemory),
            ("ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate buffer of size 53687091200", OutOfMemory),
            (
                "ggml_dyn_tallocr_alloc: not enough space in the buffer to allocate 1024 bytes, largest block \
                available 16 bytes",
                OutOfMemory,
            ),
            ("clip_encode: failed to allocate compute graph", OutOfMemory),
            ("mtmd_init_from_file: error: std::bad_alloc", OutOfMemory),
            ("ggml_vk_create_buffer: vk::Device::allocateMemory: ErrorOutOfDeviceMemory", OutOfMemory),
            ("terminate called after throwing an instance of 'std::bad_alloc'", OutOfMemory),
            ("srv         start: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 57499", BindFailure),
            ("error: invalid argument: --no-mmap", InvalidArgument),
            ("error while handling argument \"-c\": stoi", InvalidArgument),
            ("error while handling environment variable \"LLAMA_ARG_CTX_SIZE\": stoi", InvalidArgument),
            // An rpc-server killed under a loaded model (SIGKILL, or its cgroup's OOM killer):
            // the abort, then the transport's line (b11434, the rig's transcripts).
            (
                "/var/cache/corral-dev/llama-server/src-11434.0.0/llama.cpp/ggml/src/ggml-rpc/ggml-rpc.cpp:569: \
                Remote RPC server crashed or returned malformed response",
                WorkerLost,
            ),
            ("send failed (bytes_sent=0, size_to_send=8)", WorkerLost),
            ("send failed (bytes_sent=964943, size_to_send=1132514)", WorkerLost),
            ("recv failed (bytes_recv=0, size_to_recv=16)", WorkerLost),
            // A worker that is not there at start.
            (
                "/var/cache/corral-dev/llama-server/src-11434.0.0/llama.cpp/ggml/src/ggml-rpc/ggml-rpc.cpp:547: \
                Failed to connect to 127.0.0.1:52369",
                WorkerLost,
            ),
            ("ggml/src/ggml-rpc/ggml-rpc.cpp:550: RPC handshake failed for 127.0.0.1:50052", WorkerLost),
            ("common_download_file: failed to connect to huggingface.co", Other),
            // A worker under an address-space limit: a real allocation failure, named by device.
            (
                "ggml_backend_buft_alloc_buffer_n_default: failed to allocate RPC0[127.0.0.1:52363] buffer of size \
                55713792",
                OutOfMemory,
            ),
            ("llama_model_load: error loading model: unable to allocate RPC0[127.0.0.1:52363] buffer", OutOfMemory),
            ("srv  llama_server: exiting due to model loading error", Other),
            ("llama_model_load_from_file_impl: failed to load model", Other),
            (
                "srv    send_error: task id = 0, error: the current context does not support logits computation. \
                skipping",
                Other,
            ),
            ("", Other),
        ];
        for &(message, class) in cases {
            assert_eq!(ErrorClass::classify(message), class, "{message:?}");
        }
    }

    // ---- LoadReport ----

    fn error(class: ErrorClass, message: &str) -> LogEvent {
        LogEvent::Error(class, message.into())
    }

    #[test]
    fn a_lost_rpc_worker_is_the_failure() {
        // The end of llama-server's stderr when one of its two rpc-servers was killed with
        // SIGKILL during a streamed completion (b11434, the rig's test): the abort, unprefixed,
        // and the transport's error line (in either order), then gdb's backtrace.
        let lines = [
            "0.00.532.295 I slot init_sampler: id  3 | task 0 | init sampler, took 0.00 ms, tokens: text = 3",
            "/var/cache/corral-dev/llama-server/src-11434.0.0/llama.cpp/ggml/src/ggml-rpc/ggml-rpc.cpp:569: Remote RPC \
            server crashed or returned malformed response",
            "0.00.739.170 E send failed (bytes_sent=0, size_to_send=8)",
            "38\t../sysdeps/unix/sysv/linux/x86_64/syscall.S: No such file or directory.",
            "#1  0x00005633a9bca57b in ggml_print_backtrace ()",
        ]
        .map(str::to_owned);
        let report = report_of(&lines);
        assert_eq!(report.failure_class(), Some(ErrorClass::WorkerLost));
        assert!(
            report
                .failure_message()
                .is_some_and(|m| m.ends_with("Remote RPC server crashed or returned malformed response"))
        );
        assert_eq!(report.errors().count(), 2, "the backtrace is no error: {:?}", report.errors().collect::<Vec<_>>());
    }

    #[test]
    fn failure_class_prefers_the_most_telling() {
        let mut report = LoadReport::new();
        assert_eq!(report.failure_class(), None);
        report.observe(&error(ErrorClass::Other, "first other"));
        report.observe(&error(ErrorClass::BadModelFile, "bad file"));
        report.observe(&error(ErrorClass::OutOfMemory, "oom 1"));
        report.observe(&error(ErrorClass::OutOfMemory, "oom 2"));
        for i in 0..20 {
            report.observe(&error(ErrorClass::Other, &format!("other {i}")));
        }
        assert_eq!(report.failure_class(), Some(ErrorClass::OutOfMemory));
        assert_eq!(report.failure_message(), Some("oom 1"));
        let kept: Vec<&str> = report.errors().map(|e| e.message.as_str()).collect();
        assert_eq!(kept, (12..20).map(|i| format!("other {i}")).collect::<Vec<_>>());
        let ascending = [
            ErrorClass::Other,
            ErrorClass::InvalidArgument,
            ErrorClass::BindFailure,
            ErrorClass::BadModelFile,
            ErrorClass::WorkerLost,
            ErrorClass::OutOfMemory,
        ];
        assert!(ascending.windows(2).all(|pair| pair[0].rank() < pair[1].rank()));
    }

    #[test]
    fn last_buffer_value_wins_and_fit_resets() {
        let mut report = LoadReport::new();
        report.observe(&buffer("load_tensors", "CUDA0", BufferKind::Model, 0));
        report.observe(&buffer("load_tensors", "CUDA0", BufferKind::Model, 5));
        report.observe(&buffer("load_tensors", "CPU", BufferKind::Model, 7));
        report.observe(&LogEvent::Offload { gpu_layers: 1, total_layers: 2 });
        assert_eq!((report.vram_bytes(), report.ram_bytes()), (5, 7));
        report.observe(&error(ErrorClass::OutOfMemory, "dry run"));
        report.observe(&LogEvent::FitFinished);
        assert_eq!((report.vram_bytes(), report.ram_bytes(), report.offload()), (0, 0, None));
        assert_eq!(report.failure_class(), Some(ErrorClass::OutOfMemory));
        report.observe(&buffer("load_tensors", "CUDA0", BufferKind::Model, 9));
        report.observe(&buffer("load_tensors", "CUDA_Host", BufferKind::Model, 3));
        report.observe(&buffer("load_tensors", "Vulkan0", BufferKind::Model, 1));
        assert_eq!((report.vram_bytes(), report.ram_bytes()), (10, 3));
        assert_eq!(report.buffer_bytes("CUDA0", BufferKind::Model), 9);
        assert_eq!(report.buffer_bytes("CUDA0", BufferKind::Kv), 0);
    }

    #[test]
    fn host_buffers() {
        for name in ["CPU", "CPU_Mapped", "CPU_REPACK", "CUDA_Host", "Vulkan_Host", "ROCm_Host"] {
            assert!(is_host_buffer(name), "{name}");
        }
        for name in ["CUDA0", "RPC0[127.0.0.1:50152]", "Vulkan0", "MTL0", "MTL0_Mapped", "ROCm1"] {
            assert!(!is_host_buffer(name), "{name}");
        }
    }

    // ---- golden transcripts recorded with the project's llama-server ----

    /// What a transcript must produce.
    struct Golden {
        file: &'static str,
        offload: Option<(u32, u32)>,
        buffers: &'static [(&'static str, &'static str, BufferKind, u64)],
        loaded: bool,
        listening: Option<&'static str>,
        failure: Option<(ErrorClass, &'static str)>,
        /// (number of error lines kept, the last one)
        errors: (usize, Option<&'static str>),
    }

    const CPU_TINY_LLAMA: &[(&str, &str, BufferKind, u64)] = &[
        ("llama_context", "CPU", BufferKind::Output, 10_486),
        ("llama_kv_cache", "CPU", BufferKind::Kv, 1_048_576),
        ("load_tensors", "CPU_Mapped", BufferKind::Model, 450_888),
        ("sched_reserve", "CPU", BufferKind::Compute, 3_554_673),
    ];
    const RPC: &str = "RPC0[127.0.0.1:50152]";
    const EXIT_LOAD: &str = "srv  llama_server: exiting due to model loading error";
    const EXIT_HTTP: &str = "srv  llama_server: exiting due to HTTP server error";

    const GOLDEN: &[Golden] = &[
        Golden {
            file: "cpu-ngl0.log",
            offload: Some((0, 5)),
            buffers: CPU_TINY_LLAMA,
            loaded: true,
            listening: Some("unix:///tmp/corral-logparse/cpu-ngl0.sock"),
            failure: None,
            errors: (0, None),
        },
        Golden {
            file: "cpu-lv5.log",
            offload: Some((0, 5)),
            buffers: CPU_TINY_LLAMA,
            loaded: true,
            listening: Some("unix:///tmp/corral-logparse/cpu-lv5.sock"),
            failure: None,
            errors: (0, None),
        },
        Golden {
            file: "rpc-ngl99.log",
            offload: Some((5, 5)),
            buffers: &[
                ("llama_context", "CPU", BufferKind::Output, 10_486),
                ("llama_kv_cache", RPC, BufferKind::Kv, 1_048_576),
                ("load_tensors", "CPU_Mapped", BufferKind::Model, 83_886),
                ("load_tensors", RPC, BufferKind::Model, 377_487),
                ("sched_reserve", "CPU", BufferKind::Compute, 2_642_412),
                ("sched_reserve", RPC, BufferKind::Compute, 3_418_358),
            ],
            loaded: true,
            listening: Some("unix:///tmp/corral-logparse/rpc-ngl99.sock"),
            failure: None,
            errors: (0, None),
        },
        Golden {
            file: "rpc-ngl2.log",
            offload: Some((2, 5)),
            buffers: &[
                ("llama_context", "CPU", BufferKind::Output, 10_486),
                ("llama_kv_cache", "CPU", BufferKind::Kv, 786_432),
                ("llama_kv_cache", RPC, BufferKind::Kv, 262_144),
                ("load_tensors", "CPU_Mapped", BufferKind::Model, 304_087),
                ("load_tensors", RPC, BufferKind::Model, 157_286),
                ("sched_reserve", "CPU", BufferKind::Compute, 3_554_673),
                ("sched_reserve", RPC, BufferKind::Compute, 2_631_926),
            ],
            loaded: true,
            listening: Some("unix:///tmp/corral-logparse/rpc-ngl2.sock"),
            failure: None,
            errors: (0, None),
        },
        Golden {
            file: "bert-embeddings.log",
            offload: Some((0, 5)),
            buffers: &[
                ("llama_context", "CPU", BufferKind::Output, 0),
                ("load_tensors", "CPU_Mapped", BufferKind::Model, 440_402),
                ("sched_reserve", "CPU", BufferKind::Compute, 1_457_521),
            ],
            loaded: true,
            listening: Some("unix:///tmp/corral-logparse/bert-embeddings.sock"),
            // Errors of requests after the load (a completion on an embedding model).
            failure: Some((
                ErrorClass::Other,
                "srv    send_error: task id = 0, error: the current context does not support logits computation. \
                skipping",
            )),
            errors: (
                2,
                Some(
                    "srv    send_error: task id = 3, error: the current context does not support logits computation. \
                    skipping",
                ),
            ),
        },
        Golden {
            file: "nonexistent.log",
            offload: None,
            buffers: &[],
            loaded: false,
            listening: None,
            failure: Some((
                ErrorClass::BadModelFile,
                "gguf_init_from_file: failed to open GGUF file '/tmp/corral-logparse/does-not-exist-\u{fffd}.gguf' \
                (No such file or directory)",
            )),
            errors: (8, Some(EXIT_LOAD)),
        },
        Golden {
            file: "truncated.log",
            offload: None,
            buffers: &[],
            loaded: false,
            listening: None,
            failure: Some((
                ErrorClass::BadModelFile,
                "llama_model_load: error loading model: tensor 'blk.1.ffn_gate.weight' data is not within the file \
                bounds, model is corrupted or incomplete",
            )),
            errors: (8, Some(EXIT_LOAD)),
        },
        Golden {
            file: "random-bytes.log",
            offload: None,
            buffers: &[],
            loaded: false,
            listening: None,
            failure: Some((
                ErrorClass::BadModelFile,
                "gguf_init_from_reader: invalid magic characters: 'D ?<', expected 'GGUF'",
            )),
            errors: (8, Some(EXIT_LOAD)),
        },
        Golden {
            file: "ctx-too-big-ulimit.log",
            offload: Some((0, 5)),
            buffers: &[
                ("llama_context", "CPU", BufferKind::Output, 10_486),
                ("load_tensors", "CPU_Mapped", BufferKind::Model, 450_888),
            ],
            loaded: false,
            listening: None,
            failure: Some((
                ErrorClass::OutOfMemory,
                "llama_init_from_model: failed to initialize the context: std::bad_alloc",
            )),
            errors: (7, Some(EXIT_LOAD)),
        },
        Golden {
            file: "unknown-flag.log",
            offload: None,
            buffers: &[],
            loaded: false,
            listening: None,
            failure: Some((ErrorClass::InvalidArgument, "error: invalid argument: --no-mmap")),
            errors: (1, Some("error: invalid argument: --no-mmap")),
        },
        Golden {
            file: "bad-value.log",
            offload: None,
            buffers: &[],
            loaded: false,
            listening: None,
            failure: Some((ErrorClass::InvalidArgument, "error while handling argument \"-c\": stoi")),
            errors: (1, Some("error while handling argument \"-c\": stoi")),
        },
        Golden {
            file: "bind-missing-dir.log",
            offload: None,
            buffers: &[],
            loaded: false,
            listening: None,
            failure: Some((
                ErrorClass::BindFailure,
                "srv         start: couldn't bind HTTP server socket, hostname: \
                /tmp/corral-logparse/no-such-dir/x.sock, port: 8080",
            )),
            errors: (2, Some(EXIT_HTTP)),
        },
        Golden {
            file: "bind-port-in-use.log",
            offload: None,
            buffers: &[],
            loaded: false,
            listening: None,
            failure: Some((
                ErrorClass::BindFailure,
                "srv         start: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 50153",
            )),
            errors: (2, Some(EXIT_HTTP)),
        },
    ];

    fn read_golden(file: &str) -> Vec<u8> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/logs").join(file);
        std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    fn report_of(lines: &[String]) -> LoadReport {
        let mut report = LoadReport::new();
        for line in lines {
            let _ = report.feed(line);
        }
        report
    }

    #[test]
    fn per_request_chatter_is_debug_and_the_load_stays_info() {
        // A served transcript: two requests after the load.
        let lines = split_all(&mut LineSplitter::new(), &[&read_golden("cpu-ngl0.log")]);
        let listening = lines.iter().position(|l| l.contains("listening on")).expect("a listening line");
        let mut priorities = Priorities::default();
        let all: Vec<u8> = lines.iter().map(|l| priorities.of(&parse_line(l))).collect();
        let info_after: Vec<&String> = lines[listening + 1..]
            .iter()
            .zip(&all[listening + 1..])
            .filter(|(l, p)| **p == 6 && !l.contains("common_memory_breakdown_print"))
            .map(|(l, _)| l)
            .collect();
        assert!(info_after.is_empty(), "per-request lines at info: {info_after:#?}");
        let debug_after = all[listening + 1..].iter().filter(|p| u32::from(**p) == 7).count();
        assert!(debug_after >= 20, "the chatter is kept, at debug: {debug_after}");
        // The load's milestones, warnings and errors keep their level.
        for (line, priority) in [
            ("0.00.014.881 I srv  llama_server: model loaded", 6),
            ("0.00.014.897 I srv  llama_server: listening on unix:///x.sock", 6),
            ("0.00.012.443 I srv    load_model: initializing, n_slots = 4", 6),
            ("0.00.008.868 I load_tensors: offloaded 0/5 layers to GPU", 6),
            ("0.00.030.463 I slot print_timing: id  3 | task 0 | prompt eval time = 3.79 ms", 7),
            ("0.00.014.953 I srv  update_slots: all slots are idle", 7),
            ("0.00.050.000 W srv          stop: cancel task, id_task = 3", 4),
            ("0.00.050.000 E srv    send_error: task id = 4, error: x", 3),
        ] {
            assert_eq!(parse_line(line).priority(), priority, "{line}");
        }
        // The idle line is still the task loop's milestone, whatever its priority.
        assert_eq!(parse_line("I srv  update_slots: all slots are idle").event, Some(LogEvent::SlotsIdle));
    }

    #[test]
    fn layers_count_as_offloaded_only_when_a_device_holds_model_bytes() {
        // An RPC-enabled build with no device prints a full offload while every weight
        // sits in a CPU buffer (the issue's CPU-only host): nothing is on a GPU.
        let cpu_only = report_of(&[
            "0.00.008.868 I load_tensors: offloaded 5/5 layers to GPU".to_owned(),
            "0.00.008.869 I load_tensors:   CPU_Mapped model buffer size =     0.43 MiB".to_owned(),
            "0.00.009.060 I llama_kv_cache:        CPU KV buffer size =     1.00 MiB".to_owned(),
        ]);
        assert_eq!(cpu_only.offload(), Some(Offload { gpu_layers: 0, total_layers: 5 }));
        assert_eq!(cpu_only.vram_bytes(), 0);
        // A device buffer that holds nothing is no offload either.
        let empty_device = report_of(&[
            "I load_tensors: offloaded 5/5 layers to GPU".to_owned(),
            "I load_tensors:   CPU_Mapped model buffer size =     0.43 MiB".to_owned(),
            "I load_tensors: CUDA0 model buffer size =     0.00 MiB".to_owned(),
        ]);
        assert_eq!(empty_device.offload().map(|o| o.gpu_layers), Some(0));
        // Weights on a device: the line's figures stand (partial and full).
        let mut full = report_of(&split_all(&mut LineSplitter::new(), &[&read_golden("rpc-ngl99.log")]));
        assert_eq!(full.offload(), Some(Offload { gpu_layers: 5, total_layers: 5 }));
        let partial = report_of(&split_all(&mut LineSplitter::new(), &[&read_golden("rpc-ngl2.log")]));
        assert_eq!(partial.offload(), Some(Offload { gpu_layers: 2, total_layers: 5 }));
        // No buffer lines at all: nothing to check against, the line is taken as said.
        full = report_of(&["I load_tensors: offloaded 3/5 layers to GPU".to_owned()]);
        assert_eq!(full.offload().map(|o| o.gpu_layers), Some(3));
    }

    #[test]
    fn golden_transcripts() {
        for golden in GOLDEN {
            let bytes = read_golden(golden.file);
            let lines = split_all(&mut LineSplitter::new(), &[&bytes]);
            for size in [1, 3, 64, 4093] {
                let chunks: Vec<&[u8]> = bytes.chunks(size).collect();
                assert_eq!(split_all(&mut LineSplitter::new(), &chunks), lines, "{} in chunks of {size}", golden.file);
            }
            let report = report_of(&lines);
            let name = golden.file;
            assert_eq!(report.offload().map(|o| (o.gpu_layers, o.total_layers)), golden.offload, "{name}");
            let buffers: Vec<(&str, &str, BufferKind, u64)> = report
                .buffers()
                .map(|(key, bytes)| (key.component.as_str(), key.buffer.as_str(), key.kind, bytes))
                .collect();
            assert_eq!(buffers, golden.buffers, "{name}");
            let (vram, ram) = golden.buffers.iter().fold((0, 0), |(vram, ram), &(_, buffer, _, bytes)| {
                if buffer.starts_with("RPC") { (vram + bytes, ram) } else { (vram, ram + bytes) }
            });
            assert_eq!((report.vram_bytes(), report.ram_bytes()), (vram, ram), "{name}");
            assert_eq!(report.model_loaded(), golden.loaded, "{name}");
            assert_eq!(report.listening(), golden.listening, "{name}");
            assert_eq!(report.failure_class().zip(report.failure_message()), golden.failure, "{name}");
            let last = report.errors().last().map(|e| e.message.as_str());
            assert_eq!((report.errors().count(), last), golden.errors, "{name}");
        }
    }

    #[test]
    fn golden_levels() {
        // Every prefixed line keeps its level; the unprefixed ones are the known kinds.
        for golden in GOLDEN {
            let lines = split_all(&mut LineSplitter::new(), &[&read_golden(golden.file)]);
            for line in &lines {
                let parsed = parse_line(line);
                if parsed.level.is_none() {
                    assert!(!line.starts_with("0."), "{}: a prefixed line without level: {line:?}", golden.file);
                }
            }
        }
        let cpu = split_all(&mut LineSplitter::new(), &[&read_golden("cpu-ngl0.log")]);
        let unprefixed: Vec<&String> = cpu.iter().filter(|line| parse_line(line).level.is_none()).collect();
        // The chat-template example (9 continuation lines) and 2 × sampler params (4 each).
        assert_eq!(unprefixed.len(), 9 + 8, "{unprefixed:#?}");
        assert!(unprefixed.iter().all(|line| parse_line(line).event.is_none()));
        let warnings = cpu.iter().filter(|line| parse_line(line).priority() == 4).count();
        assert_eq!(warnings, 1);
        let bad_value = split_all(&mut LineSplitter::new(), &[&read_golden("bad-value.log")]);
        let levels: Vec<Option<Level>> = bad_value.iter().map(|line| parse_line(line).level).collect();
        assert_eq!(levels[0], Some(Level::Error));
        assert!(levels[1..].iter().all(Option::is_none), "{bad_value:#?}");
    }
}
