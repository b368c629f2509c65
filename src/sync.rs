//! Locks on data shared between threads, all taken one way.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `mutex`, recovering from poisoning: every holder keeps the data consistent at
/// each step, so a panic elsewhere with the lock held leaves it usable.
pub fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
