//! The command size of an accelerated disk the kernel made of a vhci port:
//! usb-storage caps a USB 2 disk's commands at 240 sectors (120 KiB), for
//! drives that choke on more, and each command costs the accelerator a round
//! trip. For a device known to take 1 MiB commands (usbwire's own virtual
//! disk) the cap is raised to 2048 sectors once the disk is there, through
//! the sysfs attributes an administrator would write. Not for other devices:
//! a real drive's limits cannot be vouched for from here. Not for the relay
//! or the accelerator themselves (`kernel_relay`, `storage`).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::vhci;

/// usbwire's virtual disk (`--virtual disk=…`): VID:PID.
const VIRTUAL_DISK: (u16, u16) = (0x1209, 0x0003);
/// Sectors per command once raised: what usb-storage gives a SuperSpeed disk.
pub(crate) const RAISED_MAX_SECTORS: u32 = 2048;
/// Where the kernel lists its USB devices and interfaces.
const USB_DEVICES: &str = "/sys/bus/usb/devices";
/// How often the port and the disk are looked for, and for how long: past
/// usb-storage's settle delay and a slow guest's SCSI scan.
const POLL: Duration = Duration::from_millis(100);
const PATIENCE: Duration = Duration::from_secs(60);

/// Whether a device's commands may be raised to [`RAISED_MAX_SECTORS`].
pub(crate) fn takes_large_commands(vendor_id: u16, product_id: u16) -> bool {
    (vendor_id, product_id) == VIRTUAL_DISK
}

/// A SCSI disk usb-storage made of a USB device: its SCSI device's
/// directory (usb-storage's `max_sectors`) and its block queue's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ScsiDisk {
    pub(crate) device: PathBuf,
    pub(crate) queue: PathBuf,
}

/// The disks under the USB device `busid` in `usb_devices`
/// (`BUSID/BUSID:C.I/hostH/targetH:C:T/H:C:T:L/block/sdX/queue`).
pub(crate) fn disks_of(usb_devices: &Path, busid: &str) -> Vec<ScsiDisk> {
    let mut disks = Vec::new();
    let children = |dir: &Path, prefix: &str| -> Vec<PathBuf> {
        let Ok(entries) = fs::read_dir(dir) else { return Vec::new() };
        let mut found: Vec<PathBuf> = entries
            .flatten()
            .filter(|entry| entry.file_name().to_string_lossy().starts_with(prefix))
            .map(|entry| entry.path())
            .collect();
        found.sort();
        found
    };
    let interface_prefix = format!("{busid}:");
    for interface in children(&usb_devices.join(busid), &interface_prefix) {
        for host in children(&interface, "host") {
            for target in children(&host, "target") {
                for device in children(&target, "") {
                    if !device.join("max_sectors").is_file() {
                        continue;
                    }
                    for block in children(&device.join("block"), "") {
                        let queue = block.join("queue");
                        if queue.join("max_sectors_kb").is_file() {
                            disks.push(ScsiDisk { device: device.clone(), queue });
                        }
                    }
                }
            }
        }
    }
    disks
}

/// Raises a disk's command size to `sectors`: usb-storage's `max_sectors`
/// (the queue's hardware limit), then the block layer's `max_sectors_kb`.
pub(crate) fn raise(disk: &ScsiDisk, sectors: u32) -> io::Result<()> {
    fs::write(disk.device.join("max_sectors"), format!("{sectors}\n"))?;
    fs::write(disk.queue.join("max_sectors_kb"), format!("{}\n", sectors / 2))
}

/// Waits for the kernel to make a disk of the device on vhci `port` and
/// raises its command size, when the device is one known to take it. Logs
/// once what it did or why not; gives up after [`PATIENCE`].
pub(crate) async fn raise_when_attached(port: u32, vendor_id: u16, product_id: u16) {
    if !takes_large_commands(vendor_id, product_id) {
        return;
    }
    let started = tokio::time::Instant::now();
    let mut busid = None;
    while started.elapsed() < PATIENCE {
        tokio::time::sleep(POLL).await;
        if busid.is_none() {
            busid = vhci::ports().ok().and_then(|ports| {
                ports.into_iter().find(|p| p.port == port && p.local_busid != "0-0").map(|p| p.local_busid)
            });
        }
        let Some(busid) = &busid else { continue };
        let disks = disks_of(Path::new(USB_DEVICES), busid);
        if disks.is_empty() {
            continue;
        }
        for disk in &disks {
            match raise(disk, RAISED_MAX_SECTORS) {
                Ok(()) => tracing::info!(
                    port,
                    disk = %disk.device.display(),
                    max_sectors = RAISED_MAX_SECTORS,
                    "raised the accelerated disk's command size to 1 MiB"
                ),
                Err(error) => tracing::warn!(
                    port,
                    disk = %disk.device.display(),
                    %error,
                    "could not raise the accelerated disk's command size: it keeps usb-storage's 120 KiB"
                ),
            }
        }
        return;
    }
    tracing::debug!(port, "no disk appeared on the port: command size left as it is");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sysfs tree as the kernel makes it of a usb-storage disk on `busid`.
    fn plant_disk(root: &Path, busid: &str, sd: &str) -> ScsiDisk {
        let device = root.join(format!("{busid}/{busid}:1.0/host3/target3:0:0/3:0:0:0"));
        let queue = device.join(format!("block/{sd}/queue"));
        fs::create_dir_all(&queue).unwrap();
        fs::write(device.join("max_sectors"), "240\n").unwrap();
        fs::write(queue.join("max_sectors_kb"), "120\n").unwrap();
        ScsiDisk { device, queue }
    }

    #[test]
    fn the_disk_of_a_busid_is_found_and_raised_to_1_mib() {
        let root = tempfile::tempdir().unwrap();
        let disk = plant_disk(root.path(), "3-1", "sdb");
        plant_disk(root.path(), "3-2", "sdc");
        assert_eq!(disks_of(root.path(), "3-1"), vec![disk.clone()], "only 3-1's, not 3-2's");
        raise(&disk, RAISED_MAX_SECTORS).unwrap();
        assert_eq!(fs::read_to_string(disk.device.join("max_sectors")).unwrap(), "2048\n");
        assert_eq!(fs::read_to_string(disk.queue.join("max_sectors_kb")).unwrap(), "1024\n");
    }

    #[test]
    fn nothing_is_found_before_the_scsi_scan_made_the_block_device() {
        let root = tempfile::tempdir().unwrap();
        let host = root.path().join("3-1/3-1:1.0/host3/target3:0:0/3:0:0:0");
        fs::create_dir_all(&host).unwrap();
        fs::write(host.join("max_sectors"), "240\n").unwrap();
        assert!(disks_of(root.path(), "3-1").is_empty(), "no block device yet");
        assert!(disks_of(root.path(), "9-9").is_empty(), "no such device");
    }

    #[test]
    fn only_usbwires_own_disk_is_vouched_for() {
        assert!(takes_large_commands(0x1209, 0x0003));
        assert!(!takes_large_commands(0x0781, 0x5581), "a real flash drive");
        assert!(!takes_large_commands(0x1209, 0x0001), "another usbwire gadget");
    }
}
