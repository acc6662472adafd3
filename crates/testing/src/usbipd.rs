//! A scripted stock usbipd (Linux's `usbipd` with `usbip-host`) exporting one
//! device that can be unplugged and plugged in again, for tests of what a
//! client does when a device goes away without a word.
//!
//! It speaks the stock protocol only: `OP_REQ_DEVLIST`, and `OP_REQ_IMPORT`,
//! after which the connection is the device's URB channel; any other op code
//! (usbwire's extensions) is hung up on, as usbipd does. Unplugging closes
//! every URB channel — what usbip-host does when its device disconnects, no
//! END, no reason — and while unplugged the bus id is unknown (`ST_NODEV`).
//! URBs are read and dropped: nothing here answers them.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use usbwire_proto::op::{self, DeviceRecord, OpCode, OpStatus, BUSID_LEN, OP_HEADER_LEN};

/// Import requests remembered, at most (a test looks at the first few).
const MAX_REMEMBERED: usize = 4096;

/// The scripted usbipd (see the module docs); it serves until dropped.
pub struct StockUsbipd {
    addr: SocketAddr,
    plugged: watch::Sender<bool>,
    imports: Arc<Mutex<Vec<Instant>>>,
    task: tokio::task::JoinHandle<()>,
}

impl StockUsbipd {
    /// Serves `device` (plugged in) on `127.0.0.1:0`, on the current runtime.
    pub async fn start(device: DeviceRecord) -> Self {
        let listener =
            TcpListener::bind("127.0.0.1:0").await.unwrap_or_else(|error| panic!("stock usbipd did not bind: {error}"));
        let addr = listener.local_addr().unwrap_or_else(|error| panic!("stock usbipd has no address: {error}"));
        let (plugged, _) = watch::channel(true);
        let imports = Arc::new(Mutex::new(Vec::new()));
        let (state, seen) = (plugged.clone(), imports.clone());
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(stream, device.clone(), state.subscribe(), seen.clone()));
            }
        });
        Self { addr, plugged, imports, task }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The device disconnects: every import's connection is closed, and the
    /// bus id is unknown until [`plug`](Self::plug).
    pub fn unplug(&self) {
        self.plugged.send_replace(false);
    }

    /// The device is back at its bus id.
    pub fn plug(&self) {
        self.plugged.send_replace(true);
    }

    /// When each `OP_REQ_IMPORT` arrived, in order.
    pub fn imports(&self) -> Vec<Instant> {
        self.imports.lock().map(|imports| imports.clone()).unwrap_or_default()
    }
}

impl Drop for StockUsbipd {
    fn drop(&mut self) {
        self.task.abort();
        self.unplug();
    }
}

async fn serve(
    mut stream: TcpStream,
    device: DeviceRecord,
    mut plugged: watch::Receiver<bool>,
    imports: Arc<Mutex<Vec<Instant>>>,
) {
    let mut header = [0u8; OP_HEADER_LEN];
    if stream.read_exact(&mut header).await.is_err() {
        return;
    }
    let mut reply = BytesMut::new();
    match OpCode(u16::from_be_bytes([header[2], header[3]])) {
        OpCode::REQ_DEVLIST => {
            let listed: Vec<DeviceRecord> = plugged.borrow().then(|| device.clone()).into_iter().collect();
            op::encode_devlist_reply(&listed, &mut reply);
            let _ = stream.write_all(&reply).await;
        }
        OpCode::REQ_IMPORT => {
            let mut busid = [0u8; BUSID_LEN];
            if stream.read_exact(&mut busid).await.is_err() {
                return;
            }
            if let Ok(mut imports) = imports.lock() {
                if imports.len() < MAX_REMEMBERED {
                    imports.push(Instant::now());
                }
            }
            let named = busid.split(|&b| b == 0).next().unwrap_or_default();
            let here = *plugged.borrow_and_update() && named == device.busid.as_str().as_bytes();
            op::encode_import_reply(if here { Ok(&device) } else { Err(OpStatus::NODEV) }, &mut reply);
            if stream.write_all(&reply).await.is_err() || !here {
                return;
            }
            urb_channel(stream, plugged).await;
        }
        // An op code usbipd does not know (usbwire's extensions): it hangs up.
        _ => {}
    }
}

/// The imported device's URB channel: what the client sends is dropped,
/// and the connection closes when the device is unplugged.
async fn urb_channel(mut stream: TcpStream, mut plugged: watch::Receiver<bool>) {
    let mut sink = [0u8; 4096];
    loop {
        tokio::select! {
            read = stream.read(&mut sink) => if !matches!(read, Ok(n) if n > 0) { return },
            changed = plugged.changed() => if changed.is_err() || !*plugged.borrow_and_update() { return },
        }
    }
}
