//! The Linux usbfs ioctls this crate needs, and nothing else: the one place
//! with `unsafe` FFI against `/dev/bus/usb/BBB/DDD`.
//!
//! nusb covers enumeration and hotplug, but its transfer queues cannot cancel
//! one URB (only all of an endpoint's) and have no isochronous transfers; the
//! kernel stub needs both, so the data path submits and reaps usbfs URBs here
//! (layouts from `include/uapi/linux/usbdevice_fs.h`, x86-64/aarch64 LP64).

use std::ffi::c_void;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

const fn ioc(dir: u32, nr: u32, size: usize) -> libc::c_ulong {
    ((dir << 30) | ((size as u32) << 16) | ((b'U' as u32) << 8) | nr) as libc::c_ulong
}
const NONE: u32 = 0;
const WRITE: u32 = 1;
const READ: u32 = 2;

/// `struct usbdevfs_setinterface`.
#[repr(C)]
struct SetInterface {
    interface: u32,
    alt_setting: u32,
}

/// `struct usbdevfs_ioctl`: an ioctl aimed at one interface's kernel driver.
#[repr(C)]
struct InterfaceIoctl {
    interface: i32,
    code: i32,
    data: *mut c_void,
}

/// `struct usbdevfs_disconnect_claim`.
#[repr(C)]
struct DisconnectClaim {
    interface: u32,
    flags: u32,
    driver: [u8; 256],
}

/// `struct usbdevfs_iso_packet_desc`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct IsoPacket {
    pub(crate) length: u32,
    pub(crate) actual_length: u32,
    pub(crate) status: u32,
}

/// `struct usbdevfs_urb` (without its trailing iso packet array).
#[repr(C)]
#[derive(Debug)]
pub(crate) struct RawUrb {
    pub(crate) kind: u8,
    pub(crate) endpoint: u8,
    pub(crate) status: i32,
    pub(crate) flags: u32,
    pub(crate) buffer: *mut c_void,
    pub(crate) buffer_length: i32,
    pub(crate) actual_length: i32,
    pub(crate) start_frame: i32,
    pub(crate) number_of_packets: i32,
    pub(crate) error_count: i32,
    pub(crate) signal: u32,
    pub(crate) user_context: *mut c_void,
}

pub(crate) const URB_TYPE_ISO: u8 = 0;
pub(crate) const URB_TYPE_INTERRUPT: u8 = 1;
pub(crate) const URB_TYPE_CONTROL: u8 = 2;
pub(crate) const URB_TYPE_BULK: u8 = 3;

pub(crate) const URB_SHORT_NOT_OK: u32 = 0x01;
pub(crate) const URB_ISO_ASAP: u32 = 0x02;
pub(crate) const URB_ZERO_PACKET: u32 = 0x40;

const SET_INTERFACE: libc::c_ulong = ioc(READ, 4, std::mem::size_of::<SetInterface>());
const SET_CONFIGURATION: libc::c_ulong = ioc(READ, 5, 4);
const SUBMIT_URB: libc::c_ulong = ioc(READ, 10, std::mem::size_of::<RawUrb>());
const DISCARD_URB: libc::c_ulong = ioc(NONE, 11, 0);
const REAP_URB_NDELAY: libc::c_ulong = ioc(WRITE, 13, std::mem::size_of::<*mut c_void>());
const RELEASE_INTERFACE: libc::c_ulong = ioc(READ, 16, 4);
const INTERFACE_IOCTL: libc::c_ulong = ioc(READ | WRITE, 18, std::mem::size_of::<InterfaceIoctl>());
const RESET: libc::c_ulong = ioc(NONE, 20, 0);
const CLEAR_HALT: libc::c_ulong = ioc(READ, 21, 4);
const CONNECT: libc::c_ulong = ioc(NONE, 23, 0);
const DISCONNECT_CLAIM: libc::c_ulong = ioc(READ, 27, std::mem::size_of::<DisconnectClaim>());

fn check(result: libc::c_int) -> io::Result<libc::c_int> {
    if result < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(result)
    }
}

pub(crate) fn set_interface(fd: BorrowedFd<'_>, interface: u8, alt_setting: u8) -> io::Result<()> {
    let mut request = SetInterface { interface: interface.into(), alt_setting: alt_setting.into() };
    // SAFETY: a plain struct the kernel only reads.
    check(unsafe { libc::ioctl(fd.as_raw_fd(), SET_INTERFACE, &mut request) }).map(drop)
}

pub(crate) fn set_configuration(fd: BorrowedFd<'_>, value: u8) -> io::Result<()> {
    let mut value = libc::c_uint::from(value);
    // SAFETY: an int the kernel only reads.
    check(unsafe { libc::ioctl(fd.as_raw_fd(), SET_CONFIGURATION, &mut value) }).map(drop)
}

pub(crate) fn clear_halt(fd: BorrowedFd<'_>, endpoint_address: u8) -> io::Result<()> {
    let mut endpoint = libc::c_uint::from(endpoint_address);
    // SAFETY: an int the kernel only reads.
    check(unsafe { libc::ioctl(fd.as_raw_fd(), CLEAR_HALT, &mut endpoint) }).map(drop)
}

pub(crate) fn reset(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: no argument.
    check(unsafe { libc::ioctl(fd.as_raw_fd(), RESET) }).map(drop)
}

/// Claims an interface, unbinding whatever kernel driver holds it.
pub(crate) fn disconnect_and_claim(fd: BorrowedFd<'_>, interface: u8) -> io::Result<()> {
    let mut request = DisconnectClaim { interface: interface.into(), flags: 0, driver: [0; 256] };
    // SAFETY: a plain struct the kernel only reads.
    check(unsafe { libc::ioctl(fd.as_raw_fd(), DISCONNECT_CLAIM, &mut request) }).map(drop)
}

pub(crate) fn release_interface(fd: BorrowedFd<'_>, interface: u8) -> io::Result<()> {
    let mut interface = libc::c_uint::from(interface);
    // SAFETY: an int the kernel only reads.
    check(unsafe { libc::ioctl(fd.as_raw_fd(), RELEASE_INTERFACE, &mut interface) }).map(drop)
}

/// Lets the kernel bind its driver to an interface again.
pub(crate) fn connect_kernel_driver(fd: BorrowedFd<'_>, interface: u8) -> io::Result<()> {
    let mut request = InterfaceIoctl { interface: interface.into(), code: CONNECT as i32, data: std::ptr::null_mut() };
    // SAFETY: a plain struct the kernel only reads; CONNECT takes no data.
    check(unsafe { libc::ioctl(fd.as_raw_fd(), INTERFACE_IOCTL, &mut request) }).map(drop)
}

/// Starts a URB.
///
/// # Safety
/// `urb` (with its iso packet array) and the buffer it points at must stay
/// valid and unmoved until the URB is reaped.
pub(crate) unsafe fn submit(fd: BorrowedFd<'_>, urb: *mut RawUrb) -> io::Result<()> {
    // SAFETY: the caller keeps `urb` and its buffer alive until reaped.
    check(unsafe { libc::ioctl(fd.as_raw_fd(), SUBMIT_URB, urb) }).map(drop)
}

/// Asks the kernel to cancel a submitted URB (it is still reaped).
///
/// # Safety
/// `urb` must be a URB submitted on this fd and not yet reaped.
pub(crate) unsafe fn discard(fd: BorrowedFd<'_>, urb: *mut RawUrb) -> io::Result<()> {
    // SAFETY: the kernel looks the pointer up among its pending URBs.
    check(unsafe { libc::ioctl(fd.as_raw_fd(), DISCARD_URB, urb) }).map(drop)
}

/// A finished URB, or `Ok(None)` when none is ready (`EAGAIN`). `ENODEV`
/// means the device is gone and nothing is left to reap.
pub(crate) fn reap(fd: BorrowedFd<'_>) -> io::Result<Option<*mut RawUrb>> {
    let mut urb: *mut RawUrb = std::ptr::null_mut();
    // SAFETY: the kernel writes one pointer into `urb`.
    match check(unsafe { libc::ioctl(fd.as_raw_fd(), REAP_URB_NDELAY, &mut urb) }) {
        Ok(_) => Ok(Some(urb)),
        Err(error) if error.raw_os_error() == Some(libc::EAGAIN) => Ok(None),
        Err(error) => Err(error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The numbers `strace` shows for these ioctls on x86-64.
    #[test]
    fn ioctl_numbers_match_the_kernel_headers() {
        assert_eq!(std::mem::size_of::<RawUrb>(), 56);
        assert_eq!(SUBMIT_URB, 0x8038_550a);
        assert_eq!(REAP_URB_NDELAY, 0x4008_550d);
        assert_eq!(DISCARD_URB, 0x0000_550b);
        assert_eq!(INTERFACE_IOCTL, 0xc010_5512);
        assert_eq!(DISCONNECT_CLAIM, 0x8108_551b);
        assert_eq!(CLEAR_HALT, 0x8004_5515);
        assert_eq!(RESET, 0x0000_5514);
    }
}
