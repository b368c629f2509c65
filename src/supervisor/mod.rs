//! Supervision of the `llama-server` children: one per loaded model.
//!
//! - [`command`]: the command line and environment, a pure function of what to run;
//! - [`logparse`]: what a child prints: levels for the journal, the load's offload,
//!   memory and failure reports;
//! - [`runner`]: one child from spawn to reap, with readiness and a bounded stop;
//! - [`child_log`]: a child's output, read and parsed on its own thread, in batches
//!   once the child is ready;
//! - [`cgroup`]: each child in its own cgroup under the service's delegated subtree;
//! - [`upstream`]: HTTP to a child over its private UNIX socket;
//! - [`worker_links`]: a child's connections to its RPC workers, made to notice one cut off.

pub mod cgroup;
pub mod child_log;
pub mod command;
pub mod logparse;
pub mod runner;
pub mod upstream;
pub mod worker_links;
