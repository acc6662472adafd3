//! The threads USB/IP connections run on: one single-threaded tokio runtime per
//! core, and each connection on one of them from its handshake to its end.
//!
//! Why not the main (multi-threaded) runtime: there a connection's task moved
//! between workers with every wake-up, and each move woke the other worker.
//! Profiles of a 64 KiB bulk stream over TLS showed the task's encryption split
//! evenly between two workers and a fifth of the server's time in waking and
//! switching threads. Pinned to one thread the task keeps its buffers in that
//! core's cache and wakes nobody, as the kernel's usbip-host keeps one thread
//! per device direction. Connections spread over the threads by how many each
//! runs, so many devices still use every core.
//!
//! Not for listeners, the control socket or the HTTP pages (they stay on the
//! main runtime), and not a limit on connections (`admission` is). Tasks a
//! connection spawns run on its thread; wakers work across runtimes, so a
//! device or a resumed session's stream that belongs to another runtime still
//! works, at the cost of a wake-up between threads.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::runtime::{Builder, Handle};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// The connection threads of one server: see the module docs.
pub(crate) struct ConnectionThreads {
    threads: Vec<ConnectionThread>,
    /// Where the search for the least busy thread starts (round robin among equals).
    next: usize,
}

struct ConnectionThread {
    runtime: Handle,
    /// Connections running there.
    running: Arc<AtomicUsize>,
    /// Dropped to end the thread (its runtime cancels what is still running there).
    stop: Option<oneshot::Sender<()>>,
    /// Resolves once the thread's runtime is gone, its blocking tasks finished.
    ended: Option<oneshot::Receiver<()>>,
}

impl ConnectionThreads {
    /// One thread per core this process may use.
    pub(crate) fn start() -> std::io::Result<Self> {
        let count = std::thread::available_parallelism().map_or(1, usize::from);
        let threads = (0..count).map(ConnectionThread::start).collect::<std::io::Result<_>>()?;
        Ok(Self { threads, next: 0 })
    }

    /// Runs `connection` on the thread with the fewest connections; the
    /// returned future resolves when it ends, and cancels it if dropped first.
    /// `connection` is built there, so the sockets it registers belong to that
    /// thread's runtime.
    pub(crate) fn spawn<F, Fut>(&mut self, connection: F) -> Running
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let count = self.threads.len();
        let chosen = (0..count)
            .map(|i| (self.next + i) % count)
            .min_by_key(|&i| self.threads[i].running.load(Ordering::Relaxed))
            .unwrap_or(0);
        self.next = (chosen + 1) % count.max(1);
        let thread = &self.threads[chosen];
        let running = CountedRun::new(thread.running.clone());
        let task = thread.runtime.spawn(async move {
            let _running = running;
            connection().await;
        });
        Running(task)
    }

    /// Ends every thread and waits until their runtimes are gone (the
    /// releases their connections left on blocking threads included).
    pub(crate) async fn shut_down(mut self) {
        for thread in &mut self.threads {
            thread.stop.take();
        }
        for thread in &mut self.threads {
            if let Some(ended) = thread.ended.take() {
                let _ = ended.await;
            }
        }
    }
}

impl ConnectionThread {
    fn start(index: usize) -> std::io::Result<Self> {
        let runtime = Builder::new_current_thread().enable_all().build()?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let (ended_tx, ended) = oneshot::channel();
        std::thread::Builder::new().name(format!("usbwire-conn-{index}")).spawn(move || {
            // Until the server drops its end of `stop`.
            let _ = runtime.block_on(stopped);
            // Here, not in an async context: waits for its blocking tasks.
            drop(runtime);
            let _ = ended_tx.send(());
        })?;
        Ok(Self { runtime: handle, running: Arc::new(AtomicUsize::new(0)), stop: Some(stop), ended: Some(ended) })
    }
}

/// Counts a connection on its thread while it runs.
struct CountedRun(Arc<AtomicUsize>);

impl CountedRun {
    fn new(running: Arc<AtomicUsize>) -> Self {
        running.fetch_add(1, Ordering::Relaxed);
        Self(running)
    }
}

impl Drop for CountedRun {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A connection running on its thread: resolves when it ends (a panic in it
/// included: the runtime has caught and reported it); dropping it cancels it.
pub(crate) struct Running(JoinHandle<()>);

impl Future for Running {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        Pin::new(&mut self.0).poll(cx).map(|_| ())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn connections_spread_over_the_threads_and_stay_on_theirs() {
        let mut threads = ConnectionThreads::start().expect("threads");
        let count = threads.threads.len();
        let (release_tx, release_rx) = tokio::sync::watch::channel(false);
        let mut names = Vec::new();
        let mut running = Vec::new();
        for _ in 0..count {
            let (name_tx, name_rx) = oneshot::channel();
            let mut release = release_rx.clone();
            running.push(threads.spawn(move || async move {
                let before = std::thread::current().name().map(str::to_owned);
                let _ = release.wait_for(|&go| go).await;
                let after = std::thread::current().name().map(str::to_owned);
                let _ = name_tx.send((before, after));
            }));
            names.push(name_rx);
        }
        release_tx.send(true).expect("release");
        let mut seen = std::collections::HashSet::new();
        for (name, run) in names.into_iter().zip(running) {
            run.await;
            let (before, after) = name.await.expect("ran");
            assert_eq!(before, after, "a connection stays on its thread");
            let before = before.expect("named thread");
            assert!(before.starts_with("usbwire-conn-"), "{before}");
            seen.insert(before);
        }
        assert_eq!(seen.len(), count, "one connection per thread while each runs one");
        threads.shut_down().await;
    }

    #[tokio::test]
    async fn dropping_the_handle_cancels_the_connection() {
        let mut threads = ConnectionThreads::start().expect("threads");
        let (dropped_tx, dropped_rx) = oneshot::channel::<()>();
        let run = threads.spawn(move || async move {
            let _tell = dropped_tx;
            std::future::pending::<()>().await;
        });
        drop(run);
        // The sender goes with the cancelled future, and the count with it.
        assert!(dropped_rx.await.is_err());
        let running = || threads.threads.iter().map(|t| t.running.load(Ordering::Relaxed)).sum::<usize>();
        for _ in 0..100 {
            if running() == 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(running(), 0);
        threads.shut_down().await;
    }
}
