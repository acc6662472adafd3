//! An in-process usbwire server on `127.0.0.1:0` for a test: its config,
//! its virtual devices, and when it stops.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::sync::oneshot;
use usbwire_device::{Device, Speed};
use usbwire_proto::op::BusId;
use usbwire_server::{Security, Server, ServerConfig};

/// A server serving on the test's runtime until it is stopped or dropped.
pub struct TestServer {
    addr: SocketAddr,
    busids: Vec<BusId>,
    stop: Option<oneshot::Sender<()>>,
}

/// What a [`TestServer`] starts with: listening on `127.0.0.1:0`, no control
/// socket, the defaults otherwise, and no device until one is added.
pub struct ServerBuilder {
    config: ServerConfig,
    devices: Vec<(String, Box<dyn Device>)>,
}

impl TestServer {
    pub fn builder() -> ServerBuilder {
        ServerBuilder {
            config: ServerConfig {
                listen: SocketAddr::from(([127, 0, 0, 1], 0)),
                control_path: None,
                ..ServerConfig::default()
            },
            devices: Vec::new(),
        }
    }

    /// A plain server with one high-speed loopback device (bus id `0-1`).
    pub async fn loopback() -> Self {
        Self::builder().loopback().start().await
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The bus ids of the devices, in the order they were added.
    pub fn busids(&self) -> &[BusId] {
        &self.busids
    }

    /// Stops serving: the listener closes and the connections end.
    pub fn stop(&mut self) {
        self.stop.take();
    }

    /// Lets the server serve for as long as the test's runtime runs, and
    /// returns its address.
    pub fn keep_running(mut self) -> SocketAddr {
        if let Some(stop) = self.stop.take() {
            std::mem::forget(stop);
        }
        self.addr
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.stop();
    }
}

impl ServerBuilder {
    pub fn security(mut self, security: Security) -> Self {
        self.config.security = security;
        self
    }

    pub fn resume_grace(mut self, grace: Duration) -> Self {
        self.config.resume_grace = grace;
        self
    }

    /// Any other setting.
    pub fn config(mut self, edit: impl FnOnce(&mut ServerConfig)) -> Self {
        edit(&mut self.config);
        self
    }

    /// A high-speed loopback device (`usbwire_gadgets::loopback`).
    pub fn loopback(self) -> Self {
        self.device("loopback", Box::new(usbwire_gadgets::loopback(Speed::HIGH)))
    }

    pub fn device(mut self, kind: &str, device: Box<dyn Device>) -> Self {
        self.devices.push((kind.to_owned(), device));
        self
    }

    /// Binds and serves on the current runtime.
    pub async fn start(self) -> TestServer {
        let mut server = Server::new(self.config);
        let busids = self.devices.into_iter().map(|(kind, device)| server.export(&kind, device)).collect();
        let bound = server.bind().await.unwrap_or_else(|error| panic!("test server did not bind: {error}"));
        let addr = bound.local_addr();
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(bound.run(async move {
            // A sender dropped without sending stops the server too.
            let _ = stopped.await;
        }));
        TestServer { addr, busids, stop: Some(stop) }
    }
}

/// A peer on `127.0.0.1:0` that reads the 8-byte header of each request and
/// hangs up, as usbipd does on an op code it does not know: a stock server
/// for the usbwire extensions.
pub async fn stock_peer() -> SocketAddr {
    use tokio::io::AsyncReadExt as _;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|error| panic!("stock peer did not bind: {error}"));
    let addr = listener.local_addr().unwrap_or_else(|error| panic!("stock peer has no address: {error}"));
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let mut header = [0u8; 8];
            let _ = stream.read_exact(&mut header).await;
        }
    });
    addr
}
