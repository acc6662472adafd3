//! Takes an imported device's descriptor snapshot (`docs/protocol.md` §5.8):
//! runs [`Plan`]'s `GET_DESCRIPTOR` requests on the device, one at a time,
//! before the import reply goes out, so the client can answer the kernel's
//! enumeration without a round trip per descriptor.
//!
//! It owns only the driving: the requests and what is kept are the plan's
//! (`usbwire_proto::descriptors::plan`). A device that does not answer in
//! [`SNAPSHOT_TIMEOUT`] is left with what it gave so far; a request it still
//! holds is cancelled, and if even that does not end it the device is reset,
//! so no completion of ours can reach the client's URB channel. Not for the
//! client's use of the snapshot (its relay's).

use std::future::poll_fn;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::{timeout_at, Instant};
use tracing::debug;
use usbwire_device::{Device, Urb};
use usbwire_proto::descriptors::plan::Plan;
use usbwire_proto::descriptors::Snapshot;
use usbwire_proto::urb::CmdSubmit;
use usbwire_proto::{Direction, Status};

/// The most a snapshot may take; a device slower than this is enumerated by the kernel as before.
pub(crate) const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a cancelled request may take to complete before the device is reset.
const CANCEL_WAIT: Duration = Duration::from_millis(500);

/// Runs the plan on `device`; what it answered in time.
pub(crate) async fn take(device: &mut dyn Device, devid: u32) -> Snapshot {
    let started = Instant::now();
    let deadline = started + SNAPSHOT_TIMEOUT;
    let mut plan = Plan::new();
    let mut seqnum = 0u32;
    while let Some(setup) = plan.next_request() {
        seqnum += 1;
        let length = u32::from(u16::from_le_bytes([setup[6], setup[7]]));
        device.submit(Urb::from_submit(CmdSubmit::new(seqnum, devid, Direction::In, 0, length, setup, Bytes::new())));
        match timeout_at(deadline, poll_fn(|cx| device.poll_complete(cx))).await {
            Ok(done) if done.seqnum == seqnum => {
                plan.answered(setup, (done.status == Status::OK).then_some(&done.data[..]));
            }
            Ok(other) => {
                debug!(seqnum = other.seqnum, "descriptor snapshot: a completion not asked for; snapshot ends here");
                break;
            }
            Err(_) => {
                device.cancel(seqnum);
                let ended = timeout_at(Instant::now() + CANCEL_WAIT, poll_fn(|cx| device.poll_complete(cx))).await;
                if ended.is_err() {
                    debug!("descriptor snapshot: the device kept a request past its cancel; resetting it");
                    device.reset();
                }
                debug!(timeout = ?SNAPSHOT_TIMEOUT, "descriptor snapshot: the device did not answer in time");
                break;
            }
        }
    }
    let snapshot = plan.finish();
    debug!(
        entries = snapshot.entries().len(),
        requests = seqnum,
        took_ms = started.elapsed().as_millis() as u64,
        "descriptor snapshot taken"
    );
    snapshot
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(snapshot: &Snapshot, request_type: u8, value: u16, index: u16, length: u16) -> Option<Bytes> {
        let mut setup = [request_type, 6, 0, 0, 0, 0, 0, 0];
        setup[2..4].copy_from_slice(&value.to_le_bytes());
        setup[4..6].copy_from_slice(&index.to_le_bytes());
        setup[6..8].copy_from_slice(&length.to_le_bytes());
        snapshot.answer(&setup)
    }

    #[tokio::test]
    async fn a_virtual_keyboard_gives_every_descriptor_linux_reads() {
        let (mut device, _keys) = usbwire_gadgets::hid::keyboard();
        let snapshot = take(&mut device, 0x10002).await;
        let device_descriptor = get(&snapshot, 0x80, 0x0100, 0, 18).expect("device descriptor");
        assert_eq!(device_descriptor.len(), 18);
        let header = get(&snapshot, 0x80, 0x0200, 0, 9).expect("configuration");
        let total = u16::from_le_bytes([header[2], header[3]]);
        assert_eq!(get(&snapshot, 0x80, 0x0200, 0, 0xffff).expect("whole configuration").len(), usize::from(total));
        let languages = get(&snapshot, 0x80, 0x0300, 0, 255).expect("string 0");
        let language = u16::from_le_bytes([languages[2], languages[3]]);
        let product = device_descriptor[15];
        assert!(product != 0 && get(&snapshot, 0x80, 0x0300 | u16::from(product), language, 255).is_some());
        let report = get(&snapshot, 0x81, 0x2200, 0, 0xffff).expect("the keyboard's report descriptor");
        assert!(report.len() > 20, "{report:?}");
    }

    /// A device that never completes anything, and ignores cancels.
    struct Silent {
        reset: bool,
    }

    impl Device for Silent {
        fn summary(&self) -> usbwire_device::DeviceSummary {
            usbwire_gadgets::hid::keyboard().0.summary()
        }
        fn endpoint_type(&self, _: Direction, _: u8) -> Option<usbwire_device::TransferType> {
            None
        }
        fn submit(&mut self, _: Urb) {}
        fn poll_complete(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<usbwire_device::Completion> {
            std::task::Poll::Pending
        }
        fn cancel(&mut self, _: u32) {}
        fn reset(&mut self) {
            self.reset = true;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_device_gives_an_empty_snapshot_and_is_reset_so_nothing_of_ours_completes_later() {
        let mut device = Silent { reset: false };
        let before = Instant::now();
        let snapshot = take(&mut device, 0x10002).await;
        assert!(snapshot.is_empty());
        assert!(device.reset, "the request it kept was abandoned");
        assert!(before.elapsed() >= SNAPSHOT_TIMEOUT && before.elapsed() < SNAPSHOT_TIMEOUT + Duration::from_secs(1));
    }
}
