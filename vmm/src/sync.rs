//! Poison-tolerant locking for the host crates (`vmm`, `devices` and the
//! helper): a thread that panicked while holding a lock must not take every
//! later user of that lock down with it. The data behind these locks stays
//! consistent at every await and early return (they guard tables and
//! counters, updated in one step), so the poisoned state is taken as it is.
//!
//! The guest agent has its own copy (`guest_agent::sync`): it cannot link
//! this crate.

use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// [`Mutex::lock`] that recovers a poisoned lock.
pub trait MutexExt<T: ?Sized> {
    /// The guard, poisoned or not.
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T: ?Sized> MutexExt<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// [`RwLock::read`] and [`RwLock::write`] that recover a poisoned lock.
pub trait RwLockExt<T: ?Sized> {
    /// The read guard, poisoned or not.
    fn read_locked(&self) -> RwLockReadGuard<'_, T>;
    /// The write guard, poisoned or not.
    fn write_locked(&self) -> RwLockWriteGuard<'_, T>;
}

impl<T: ?Sized> RwLockExt<T> for RwLock<T> {
    fn read_locked(&self) -> RwLockReadGuard<'_, T> {
        self.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write_locked(&self) -> RwLockWriteGuard<'_, T> {
        self.write().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_still_locks() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            panic!("poison it");
        })
        .join();
        assert!(m.is_poisoned());
        *m.locked() += 1;
        assert_eq!(*m.locked(), 2);
        let rw = RwLock::new(5);
        *rw.write_locked() = 6;
        assert_eq!(*rw.read_locked(), 6);
    }
}
