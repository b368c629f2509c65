//! Go templates (Ollama's `TEMPLATE` syntax) rendered into prompts, with every cost
//! bounded: the one place corral runs a template it was sent.
//!
//! The engine is gtmpl, a port of Go's `text/template`. It recurses once per nesting
//! level while parsing, executing and dropping a template, follows `{{template}}`
//! calls 100 000 deep, and copies a value for every reference. So before gtmpl sees a
//! template, `shape` scans it (without recursion) and refuses what could blow the
//! stack or run away: too long, nested too deep, templates that call themselves, more
//! steps than [`Limits::steps`] once ranges and calls are multiplied out, or more copied
//! bytes than [`Limits::copies`]. What a render produces is bounded while it runs: the
//! output goes into a writer that fails past [`Limits::output`] or the deadline, and the
//! builtins that build strings (`print`, `printf`, `println`, `urlquery`) refuse results
//! past [`MAX_VALUE`] that are larger than their largest argument.
//!
//! Rendering runs on a thread of its own with a stack sized for the nesting limit
//! ([`STACK_SIZE`]), never on an async worker; [`Renderer::render`] awaits it with the
//! deadline, at most [`MAX_RENDERS`] at once.
//! A panic inside gtmpl stays on that thread and comes back as
//! [`TemplateError::EngineFailed`].

mod funcs;
mod shape;

use std::collections::HashMap;
use std::io;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use gtmpl::error::ExecError;
use tokio::sync::Semaphore;

/// The largest template accepted: real Ollama templates are at most about 10 KiB.
pub const MAX_SOURCE: usize = 64 << 10;

/// How deep blocks (`if`, `range`, `with`, each `else if`, `define`, `block`),
/// parentheses and `{{template}}` calls may nest, counted together: real templates
/// nest fewer than 10 levels. gtmpl recurses a few frames per level.
pub const MAX_NESTING: usize = 64;

/// Evaluation steps a render may take at most, counted before it starts with every
/// `range` running as many times as the data allows and every `{{template}}` call
/// expanded: a real template takes a few hundred.
pub const MAX_STEPS: u64 = 100_000;

/// Bytes a render may copy at most, counted before it starts as the references it may
/// evaluate times the largest value one may copy (the fields, or [`MAX_VALUE`]). gtmpl
/// copies a value for every reference, so this bounds both its time and its memory: a
/// real template refers to its fields a few times, so prompts of megabytes still fit.
pub const MAX_COPIES: u64 = 64 << 20;

/// The largest string `print`, `printf`, `println` or `urlquery` may build, unless it is
/// no larger than their largest argument (`printf "%s" .Prompt` is fine at any size).
pub const MAX_VALUE: usize = 16 << 10;

/// The largest rendered prompt.
pub const MAX_OUTPUT: usize = 16 << 20;

/// How long a render may take; real ones take well under a millisecond.
pub const MAX_TIME: Duration = Duration::from_secs(2);

/// Renders running at once, each on its own thread; more wait (within [`MAX_TIME`]) for
/// one to end. With the limits above this bounds the memory of all renders together to
/// a few hundred MiB.
pub const MAX_RENDERS: usize = 4;

/// The render thread's stack: gtmpl needs about 20 KiB per nesting level in a debug
/// build (less optimised), so [`MAX_NESTING`] levels fit many times over.
pub const STACK_SIZE: usize = 16 << 20;

/// The bounds of one render; [`Limits::default`] holds the constants above.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Template size in bytes.
    pub source: usize,
    /// Nesting depth.
    pub nesting: usize,
    /// Evaluation steps.
    pub steps: u64,
    /// Bytes copied.
    pub copies: u64,
    /// Output size in bytes.
    pub output: usize,
    /// Wall-clock time.
    pub time: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            source: MAX_SOURCE,
            nesting: MAX_NESTING,
            steps: MAX_STEPS,
            copies: MAX_COPIES,
            output: MAX_OUTPUT,
            time: MAX_TIME,
        }
    }
}

/// Why a template was refused or failed. Every variant but [`TemplateError::Thread`]
/// is the template's fault (a client error).
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// Longer than [`Limits::source`].
    #[error("template is larger than {}", bytes(*.0 as u64))]
    TooLong(usize),
    /// Deeper than [`Limits::nesting`].
    #[error("template nests deeper than {0} levels")]
    TooDeep(usize),
    /// A `{{template}}` cycle.
    #[error("template \"{0}\" calls itself, directly or through other templates")]
    Recursive(String),
    /// More than [`Limits::steps`].
    #[error("template would take more than {0} steps (ranges and template calls multiply its work)")]
    TooManySteps(u64),
    /// More than [`Limits::copies`].
    #[error("template would copy more than {} (references times the size of its fields)", bytes(*.0))]
    TooManyCopies(u64),
    /// A built string larger than [`MAX_VALUE`] and than its arguments.
    #[error("template builds a string larger than {} (print, printf, println or urlquery)", bytes(*.0 as u64))]
    ValueTooLarge(usize),
    /// More output than [`Limits::output`].
    #[error("template output is larger than {}", bytes(*.0 as u64))]
    OutputTooLarge(usize),
    /// Slower than [`Limits::time`].
    #[error("template took longer than {} ms to render", .0.as_millis())]
    Timeout(Duration),
    /// A syntax error (the scan's message, or gtmpl's for what the scan lets through).
    #[error("invalid template: {0}")]
    Syntax(String),
    /// An error while rendering: an undefined function, a missing template, bad arguments.
    #[error("invalid template: {0}")]
    Render(String),
    /// gtmpl panicked on the template (contained on the render thread).
    #[error("invalid template: the template engine failed on it")]
    EngineFailed,
    /// [`MAX_RENDERS`] renders kept running for all of [`Limits::time`].
    #[error("too many templates are rendering at once ({0}); try again")]
    Busy(usize),
    /// No render thread could be started.
    #[error("could not start a thread to render the template: {0}")]
    Thread(#[source] io::Error),
}

/// Renders templates for the async side: at most [`MAX_RENDERS`] at once, each on a
/// thread of its own, within its limits. Cloned, it shares the same slots.
#[derive(Debug, Clone)]
pub struct Renderer {
    limits: Limits,
    slots: Arc<Semaphore>,
}

impl Default for Renderer {
    fn default() -> Self {
        Self::new(Limits::default())
    }
}

impl Renderer {
    /// A renderer with these limits.
    #[must_use]
    pub fn new(limits: Limits) -> Self {
        Self { limits, slots: Arc::new(Semaphore::new(MAX_RENDERS)) }
    }

    /// Renders `source` with `fields` (its `.Name`s, all strings); the caller's task
    /// waits without blocking its worker. A render that outlives its deadline keeps its
    /// slot until its thread ends.
    pub async fn render(&self, source: &str, fields: &[(&str, &str)]) -> Result<String, TemplateError> {
        let limits = self.limits;
        if source.len() > limits.source {
            return Err(TemplateError::TooLong(limits.source));
        }
        let waiting = tokio::time::timeout(limits.time, Arc::clone(&self.slots).acquire_owned());
        let Ok(Ok(slot)) = waiting.await else { return Err(TemplateError::Busy(MAX_RENDERS)) };
        let (send, receive) = tokio::sync::oneshot::channel();
        spawn(source, fields, limits, move |result| {
            let _ = send.send(result);
            drop(slot);
        })?;
        match tokio::time::timeout(limits.time, receive).await {
            Ok(Ok(result)) => result,
            // The thread ends only by sending, unless it died some other way.
            Ok(Err(_)) => Err(TemplateError::EngineFailed),
            Err(_) => Err(TemplateError::Timeout(limits.time)),
        }
    }
}

/// [`Renderer::render`] for callers without a runtime (the fuzz target): the same
/// thread, waited for with the same deadline, without the shared slots.
pub fn render_blocking(source: &str, fields: &[(&str, &str)], limits: &Limits) -> Result<String, TemplateError> {
    let (send, receive) = mpsc::channel();
    spawn(source, fields, *limits, move |result| {
        let _ = send.send(result);
    })?;
    match receive.recv_timeout(limits.time) {
        Ok(result) => result,
        Err(mpsc::RecvTimeoutError::Disconnected) => Err(TemplateError::EngineFailed),
        Err(mpsc::RecvTimeoutError::Timeout) => Err(TemplateError::Timeout(limits.time)),
    }
}

/// Starts the render thread, which hands its result to `done`. A render that outlives
/// the caller's deadline stops at its next write (the writer checks the deadline) and
/// within the steps and copies checked before it started.
fn spawn(
    source: &str,
    fields: &[(&str, &str)],
    limits: Limits,
    done: impl FnOnce(Result<String, TemplateError>) + Send + 'static,
) -> Result<(), TemplateError> {
    // Refused here, before anything is copied for the thread.
    if source.len() > limits.source {
        return Err(TemplateError::TooLong(limits.source));
    }
    let source = source.to_owned();
    let fields: Vec<(String, String)> = fields.iter().map(|&(k, v)| (k.to_owned(), v.to_owned())).collect();
    let deadline = Instant::now() + limits.time;
    std::thread::Builder::new()
        .name("corral-template".into())
        .stack_size(STACK_SIZE)
        .spawn(move || {
            let result = catch_unwind(AssertUnwindSafe(|| render_here(&source, &fields, &limits, deadline)))
                .unwrap_or(Err(TemplateError::EngineFailed));
            done(result);
        })
        .map_err(TemplateError::Thread)?;
    Ok(())
}

/// Checks and renders on the current thread, which must have a stack of
/// [`STACK_SIZE`].
fn render_here(
    source: &str,
    fields: &[(String, String)],
    limits: &Limits,
    deadline: Instant,
) -> Result<String, TemplateError> {
    if source.len() > limits.source {
        return Err(TemplateError::TooLong(limits.source));
    }
    let shape = match shape::scan(source, limits.nesting) {
        Ok(shape) => shape,
        Err(shape::ScanError::TooDeep) => return Err(TemplateError::TooDeep(limits.nesting)),
        Err(shape::ScanError::Recursive(name)) => return Err(TemplateError::Recursive(name)),
        // Not handed to gtmpl for its own message: the scan stopped at the error, and
        // gtmpl might read on (where the scan is stricter) into unchecked nesting.
        Err(shape::ScanError::Syntax(message)) => return Err(TemplateError::Syntax(message)),
    };
    // Only the data's root (a map of the fields) can be ranged over: no builtin makes
    // a list or a map.
    let cost = shape.cost(fields.len().max(1) as u64);
    if cost.depth > limits.nesting {
        return Err(TemplateError::TooDeep(limits.nesting));
    }
    if cost.steps > limits.steps {
        return Err(TemplateError::TooManySteps(limits.steps));
    }
    // The largest value a reference may copy: the root (all the fields), one field, a
    // literal, or a string a builtin built (at most the value limit, or its largest
    // argument).
    // (A copy is a clone: the fields' own sizes, with some room for the map's entries.)
    let root: usize = fields.iter().map(|(k, v)| k.len() + v.len() + 64).sum();
    let largest = root.max(MAX_VALUE).max(shape.longest_literal()) as u64;
    if cost.copies.saturating_mul(largest) > limits.copies {
        return Err(TemplateError::TooManyCopies(limits.copies));
    }

    let mut template = parse(shape.source()).map_err(TemplateError::Syntax)?;
    funcs::bound(&mut template);
    let data: HashMap<String, gtmpl::Value> =
        fields.iter().map(|(k, v)| (k.clone(), gtmpl::Value::from(v.as_str()))).collect();
    let mut out = funcs::Capped::new(limits.output, deadline);
    let result = template.execute(&mut out, &gtmpl::Context::from(gtmpl::Value::from(data)));
    match result {
        Ok(()) => String::from_utf8(out.into_inner()).map_err(|e| TemplateError::Render(e.to_string())),
        Err(e) => Err(exec_error(&e, limits)),
    }
}

/// Parses with the bounded builtins' names known (they are the builtins' names).
fn parse(source: &str) -> Result<gtmpl::Template, String> {
    let mut template = gtmpl::Template::default();
    template.parse(source).map_err(|e| e.to_string())?;
    Ok(template)
}

/// gtmpl's execution error, with the limits' own refusals taken back out of it.
fn exec_error(error: &ExecError, limits: &Limits) -> TemplateError {
    match error {
        ExecError::IOError(e) => match e.get_ref().and_then(|inner| inner.downcast_ref::<funcs::Stop>()) {
            Some(funcs::Stop::Output) => return TemplateError::OutputTooLarge(limits.output),
            Some(funcs::Stop::Deadline) => return TemplateError::Timeout(limits.time),
            None => {}
        },
        ExecError::FuncError(gtmpl::FuncError::Other(e)) if e.downcast_ref::<funcs::TooLarge>().is_some() => {
            return TemplateError::ValueTooLarge(MAX_VALUE);
        }
        _ => {}
    }
    TemplateError::Render(error.to_string())
}

/// A size for messages: the limits are whole KiB or MiB.
fn bytes(n: u64) -> String {
    if n >= 1 << 20 && n % (1 << 20) == 0 {
        format!("{} MiB", n >> 20)
    } else if n >= 1 << 10 && n % (1 << 10) == 0 {
        format!("{} KiB", n >> 10)
    } else {
        format!("{n} bytes")
    }
}

#[cfg(test)]
mod tests;
