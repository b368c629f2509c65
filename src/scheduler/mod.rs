//! Which models are loaded, where, for how long, and who waits.
//!
//! - [`actor`]: the one task that owns all scheduling state, and its loop;
//! - [`handle`]: its address, the [`Handle`](handle::Handle) everything else holds, and
//!   the [`Lease`](handle::Lease) a request holds a runner by;
//! - [`types`]: what it is asked and answers (requests, limits, errors, reports, notices);
//! - [`policy`]: pure decisions (fit, placement, eviction) on a snapshot;
//! - [`keep_alive`]: what clients send and the server's clamps on it;
//! - [`backend`]: the runners the actor starts, behind a trait, and the real one;
//! - [`footprints`]: what models really used, learned at each load and kept on disk;
//! - [`request`]: from a model name and a client's options to what the actor needs;
//! - [`key`]: the [`RunnerKey`](key::RunnerKey) that says which requests share a runner;
//! - [`failure`]: why a load failed, as a class the edges map;
//! - [`device_use`]: each device with what the runners take on it, for the views.

pub mod actor;
pub mod backend;
pub mod device_use;
pub mod failure;
pub mod footprints;
pub mod handle;
pub mod keep_alive;
pub mod key;
pub mod policy;
pub mod projections;
pub mod request;
pub mod types;

#[cfg(test)]
mod actor_tests;
