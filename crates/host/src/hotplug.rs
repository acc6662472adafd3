//! USB hotplug from the kernel's own uevents (netlink `KOBJECT_UEVENT`, group 1).
//!
//! nusb's watcher listens to udevd's re-broadcast, so it hears nothing on
//! machines without udevd (containers, initramfs, minimal VMs); the kernel's
//! events need nothing but the kernel, and carry the sysfs path, which gives
//! the bus id directly.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// A USB device arriving or leaving, by bus id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Hotplug {
    Added(String),
    Removed(String),
}

/// A subscription to the kernel's uevents.
pub struct HotplugWatch {
    socket: AsyncFd<OwnedFd>,
    buffer: Vec<u8>,
}

/// Starts listening. Must be called inside a tokio runtime.
pub fn watch() -> io::Result<HotplugWatch> {
    // SAFETY: plain socket creation; the fd is owned below.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            libc::NETLINK_KOBJECT_UEVENT,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh socket nobody else owns.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_nl is plain data; all-zero is valid before we set fields.
    let mut address: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    address.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    address.nl_groups = 1; // the kernel's own broadcast
                           // SAFETY: a valid sockaddr_nl and its size.
    let bound = unsafe {
        libc::bind(
            socket.as_raw_fd(),
            (&address as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if bound < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the AsyncFd owns the socket, so the fd stays open while registered.
    let socket =
        unsafe { AsyncFd::register_with_interest(socket, Interest::READABLE) }.map_err(|error| error.into_parts().1)?;
    Ok(HotplugWatch { socket, buffer: vec![0; 16 * 1024] })
}

impl HotplugWatch {
    /// The next USB device arrival or departure.
    pub async fn next(&mut self) -> io::Result<Hotplug> {
        loop {
            let mut guard = self.socket.readable().await?;
            let received = guard.try_io(|socket| {
                // SAFETY: `buffer` is valid for its length.
                let n =
                    unsafe { libc::recv(socket.as_raw_fd(), self.buffer.as_mut_ptr().cast(), self.buffer.len(), 0) };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            match received {
                Ok(Ok(n)) => {
                    if let Some(event) = parse_uevent(&self.buffer[..n]) {
                        return Ok(event);
                    }
                }
                // ENOBUFS: the kernel dropped events under load; keep listening.
                Ok(Err(error)) if error.raw_os_error() == Some(libc::ENOBUFS) => {}
                Ok(Err(error)) => return Err(error),
                Err(_would_block) => {}
            }
        }
    }
}

/// `add@/devices/…/1-1.2\0ACTION=add\0DEVPATH=…\0SUBSYSTEM=usb\0DEVTYPE=usb_device\0…`
/// → the event, for whole USB devices only (not their interfaces).
fn parse_uevent(message: &[u8]) -> Option<Hotplug> {
    let mut fields = message.split(|&b| b == 0).filter_map(|f| std::str::from_utf8(f).ok());
    let _summary = fields.next()?;
    let (mut action, mut devpath, mut subsystem, mut devtype) = (None, None, None, None);
    for field in fields {
        match field.split_once('=') {
            Some(("ACTION", v)) => action = Some(v),
            Some(("DEVPATH", v)) => devpath = Some(v),
            Some(("SUBSYSTEM", v)) => subsystem = Some(v),
            Some(("DEVTYPE", v)) => devtype = Some(v),
            _ => {}
        }
    }
    if subsystem != Some("usb") || devtype != Some("usb_device") {
        return None;
    }
    let busid = devpath?.rsplit('/').next()?.to_owned();
    match action? {
        "add" => Some(Hotplug::Added(busid)),
        "remove" => Some(Hotplug::Removed(busid)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_device_events_and_ignores_interfaces() {
        let add = b"add@/devices/pci0000:00/0000:00:03.0/usb17/17-2\0ACTION=add\0DEVPATH=/devices/pci0000:00/0000:00:03.0/usb17/17-2\0SUBSYSTEM=usb\0DEVNAME=bus/usb/017/006\0DEVTYPE=usb_device\0PRODUCT=627/1/0\0SEQNUM=1234\0";
        assert_eq!(parse_uevent(add), Some(Hotplug::Added("17-2".into())));
        let remove = b"remove@/devices/x/usb1/1-1.4\0ACTION=remove\0DEVPATH=/devices/x/usb1/1-1.4\0SUBSYSTEM=usb\0DEVTYPE=usb_device\0";
        assert_eq!(parse_uevent(remove), Some(Hotplug::Removed("1-1.4".into())));
        let interface = b"add@/devices/x/usb1/1-1/1-1:1.0\0ACTION=add\0DEVPATH=/devices/x/usb1/1-1/1-1:1.0\0SUBSYSTEM=usb\0DEVTYPE=usb_interface\0";
        assert_eq!(parse_uevent(interface), None);
        let bind =
            b"bind@/devices/x/usb1/1-1\0ACTION=bind\0DEVPATH=/devices/x/usb1/1-1\0SUBSYSTEM=usb\0DEVTYPE=usb_device\0";
        assert_eq!(parse_uevent(bind), None);
        assert_eq!(parse_uevent(b"libudev\0\xfe\xed"), None);
    }
}
