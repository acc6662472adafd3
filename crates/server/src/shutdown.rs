//! How every task of a server learns that it is stopping: one `watch` flag,
//! set once by [`BoundServer::run`](crate::BoundServer::run) on its way out.

use tokio::sync::watch;

/// Resolves once the server starts shutting down.
pub(crate) async fn stopped(stop: &mut watch::Receiver<bool>) {
    // The borrow `wait_for` returns is not Send; end it here, inside this function.
    let _ = stop.wait_for(|stopping| *stopping).await.map(|_| ());
}
