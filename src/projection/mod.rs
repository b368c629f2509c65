//! Projection before the first load: llama.cpp's own answer to "how much memory will
//! this load take, on which device", asked of `llama-fit-params --fit-print on` to plan
//! (projector), and of llama-server's own `--fit` dry run with the child's exact arguments
//! for the plan it will follow (dry run), and cached in the state directory by a typed key.
//!
//! llama-fit-params does the trial load that `--fit` does (metadata and graph
//! reservation, no weights read) and prints model, context and compute MiB per device and
//! for the host.  Its figures are rounded down to whole MiB ([`Usage::upper_bound`]); it
//! leaves out the multimodal projector and draft models.  When it cannot be had (not
//! installed, failed, too slow), the scheduler falls back to its estimate.

mod cache;
mod dry_run;
mod key;
mod parse;
mod projector;

pub use crate::state_file::PendingWrite;
pub use cache::{MAX_ENTRIES, ProjectionCache};
pub use dry_run::{DryRun, MAX_DRY_RUN_OUTPUT, Reader as DryRunReader};
pub use key::ProjectionKey;
pub use parse::{
    DeviceUsage, MAX_LINE, MAX_MIB, MAX_NAME, MAX_OUTPUT, MAX_ROWS, ParseError, Projection, RESOLUTION, Usage,
};
pub use projector::{PROGRAM, ProjectionError, Projector, Unavailable, locate, log_availability};
