//! [`lock`]: the one poison-tolerant `Mutex::lock` of every crate that shares
//! state between tasks or threads (devices and their handles in gadgets and
//! external, the server's registry and meter, the client's waiters, the TLS
//! client's pin). It lives here because this is the lowest crate all of them
//! stand on, and `usbwire-proto` is the USB/IP protocol only; one function
//! does not earn a crate of its own.
//!
//! Not for locking on the data path: each device is driven by one task and
//! needs no lock there (see [`crate::Device`]).

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
