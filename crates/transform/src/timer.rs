//! [`PreciseTimer`]: the jitter buffer's release clock. tokio's timer wheel
//! ticks in whole milliseconds and rounds every deadline up to the next tick,
//! so frames re-timed with it land up to 1 ms late, a different amount each:
//! half of a 2 ms spacing budget gone before the network is counted. A Linux
//! timerfd is backed by the kernel's high-resolution timers, so a release
//! wakes within microseconds of its deadline. Where a timerfd cannot be made,
//! tokio's timer stands in.

use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use tokio::io::unix::AsyncFd;
use tokio::time::Sleep;
use tracing::warn;

pub(crate) struct PreciseTimer {
    clock: Clock,
    /// The deadline the clock is set for.
    armed: Option<Instant>,
}

enum Clock {
    TimerFd(AsyncFd<OwnedFd>),
    Tokio(Option<Pin<Box<Sleep>>>),
}

impl PreciseTimer {
    /// A timerfd if the kernel gives one (it needs a tokio runtime with I/O), else tokio's timer.
    pub(crate) fn new() -> Self {
        let clock = match timerfd() {
            Ok(fd) => Clock::TimerFd(fd),
            Err(error) => {
                warn!(%error, "no timerfd: the jitter buffer re-times with tokio's 1 ms timer");
                Clock::Tokio(None)
            }
        };
        Self { clock, armed: None }
    }

    /// Ready once `deadline` has passed; otherwise arms the timer and registers `cx`.
    pub(crate) fn poll_until(&mut self, cx: &mut Context<'_>, deadline: Instant) -> Poll<()> {
        loop {
            let now = Instant::now();
            if now >= deadline {
                return Poll::Ready(());
            }
            match &mut self.clock {
                Clock::TimerFd(fd) => {
                    if self.armed != Some(deadline) {
                        if let Err(error) = arm(fd.get_ref(), deadline - now) {
                            warn!(%error, "timerfd failed: the jitter buffer re-times with tokio's 1 ms timer");
                            self.clock = Clock::Tokio(None);
                            continue;
                        }
                        self.armed = Some(deadline);
                    }
                    match fd.poll_read_ready(cx) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(Ok(mut guard)) => {
                            // Read the expiry count so the fd is quiet again; then check the clock.
                            let mut expirations = [0u8; 8];
                            // SAFETY: reading 8 bytes into an 8-byte buffer from a non-blocking fd we own.
                            let _ = unsafe {
                                libc::read(fd.get_ref().as_raw_fd(), expirations.as_mut_ptr().cast(), expirations.len())
                            };
                            guard.clear_ready();
                            self.armed = None;
                        }
                        Poll::Ready(Err(error)) => {
                            warn!(%error, "timerfd failed: the jitter buffer re-times with tokio's 1 ms timer");
                            self.clock = Clock::Tokio(None);
                        }
                    }
                }
                Clock::Tokio(sleep) => {
                    let at = tokio::time::Instant::from_std(deadline);
                    let sleep = sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at)));
                    if sleep.deadline() != at {
                        sleep.as_mut().reset(at);
                    }
                    return sleep.as_mut().poll(cx);
                }
            }
        }
    }
}

impl Default for PreciseTimer {
    fn default() -> Self {
        Self::new()
    }
}

fn timerfd() -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: plain system call; the result is checked before use.
    let fd = unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_NONBLOCK | libc::TFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: the `OwnedFd` is moved into the `AsyncFd` and stays open, the same
    // descriptor, until the `AsyncFd` is dropped.
    unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }.map_err(io::Error::from)
}

/// Sets a one-shot expiry `after` from now (relative, on the same monotonic clock as `Instant`).
fn arm(fd: &OwnedFd, after: std::time::Duration) -> io::Result<()> {
    // A zero it_value would disarm the timer: at least a nanosecond.
    let nanos = after.as_nanos().max(1);
    let value = libc::itimerspec {
        it_interval: libc::timespec { tv_sec: 0, tv_nsec: 0 },
        it_value: libc::timespec {
            tv_sec: (nanos / 1_000_000_000) as libc::time_t,
            tv_nsec: (nanos % 1_000_000_000) as libc::c_long,
        },
    };
    // SAFETY: `value` is a valid itimerspec; the old value is not asked for.
    if unsafe { libc::timerfd_settime(fd.as_raw_fd(), 0, &value, std::ptr::null_mut()) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn wakes_after_each_deadline_on_a_timerfd() {
        let mut timer = PreciseTimer::new();
        assert!(matches!(timer.clock, Clock::TimerFd(_)), "Linux gives a timerfd");
        for i in 0..20u64 {
            // Deadlines between tokio's millisecond ticks.
            let deadline = Instant::now() + Duration::from_micros(300 + 37 * i);
            std::future::poll_fn(|cx| timer.poll_until(cx, deadline)).await;
            assert!(Instant::now() >= deadline, "woke before the deadline");
        }
        // How close to the deadline it wakes is measured by `usbwire bench --periodic`.
    }

    #[tokio::test]
    async fn a_moved_deadline_is_honoured() {
        let mut timer = PreciseTimer::new();
        let far = Instant::now() + Duration::from_secs(60);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(timer.poll_until(&mut cx, far).is_pending());
        let near = Instant::now() + Duration::from_millis(2);
        std::future::poll_fn(|cx| timer.poll_until(cx, near)).await;
        assert!(Instant::now() >= near);
    }
}
