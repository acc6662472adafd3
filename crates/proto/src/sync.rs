//! [`lock`]: the one poison-tolerant `Mutex::lock` every crate uses. It lives
//! here because this is the lowest crate all others depend on.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `mutex`, taking over the data if a holder panicked: every mutex in
/// usbwire guards plain data that stays consistent between statements, so a
/// panic elsewhere must not take the server or client down with it.
pub fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_mutex_still_gives_its_data() {
        let mutex = std::sync::Arc::new(Mutex::new(5));
        let holder = mutex.clone();
        let _ = std::thread::spawn(move || {
            let _guard = holder.lock().unwrap();
            panic!("poisons the mutex");
        })
        .join();
        assert!(mutex.is_poisoned());
        *lock(&mutex) += 1;
        assert_eq!(*lock(&mutex), 6);
    }
}
