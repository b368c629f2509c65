//! Which models are loaded, where, for how long, and who waits.
//!
//! - [`keep_alive`]: what clients send and the server's clamps on it;
//! - [`policy`]: pure decisions (fit, placement, eviction) on a snapshot.

pub mod keep_alive;
pub mod policy;
