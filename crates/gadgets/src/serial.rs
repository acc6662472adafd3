//! CDC-ACM serial port bridged to a pseudo-terminal on the server: the
//! descriptors, the ACM class requests, and moving bytes between the bulk
//! endpoints and the pty master.
//!
//! Programs on the server use the slave side (`/dev/pts/N`, or the link
//! given to [`serial`]) like any serial port; the host sees a `ttyACM`.
//! Flow control comes from the kernel's pty buffers, so no data is dropped
//! or buffered here: bytes are read from the master only when a bulk IN URB
//! is waiting for them, and a bulk OUT URB stays pending until the master
//! has taken all of it. The device also keeps the slave open itself, so the
//! master never sees a hangup (EIO) when no program has the port open.

use std::collections::VecDeque;
use std::ffi::OsStr;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::task::{Context, Poll};

use bytes::Bytes;
use tokio::io::unix::AsyncFd;
use tracing::{debug, trace, warn};
use usbwire_device::control::{Recipient, RequestKind, SetupPacket};
use usbwire_device::descriptor::{ConfigurationBuilder, DeviceDescriptor, EndpointSpec, CS_INTERFACE};
use usbwire_device::{
    Completion, CompletionQueue, ControlReply, DescriptorSet, Function, Speed, Status, Urb, VirtualDevice,
};

use crate::identity::{MANUFACTURER, VENDOR_ID};

/// The serial port's product id.
pub const PRODUCT_ID: u16 = 0x0004;

const COMMUNICATION_INTERFACE: u16 = 0;
const DATA_INTERFACE: u8 = 1;
const DATA_IN: u8 = 0x81;
const DATA_OUT: u8 = 0x02;
const NOTIFY_IN: u8 = 0x83;
/// The most read from the pty for one IN URB (the Linux driver asks for
/// two packets, 1 KiB, at a time).
const MAX_READ: usize = 16 * 1024;

/// ACM class requests (CDC PSTN 1.2 §6.3).
mod class {
    pub(super) const SEND_BREAK: u8 = 0x23;
    pub(super) const SET_LINE_CODING: u8 = 0x20;
    pub(super) const GET_LINE_CODING: u8 = 0x21;
    pub(super) const SET_CONTROL_LINE_STATE: u8 = 0x22;
}

/// Why the serial gadget could not be created.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SerialError {
    /// [`serial`] was called outside a tokio runtime: the pty is registered
    /// with the runtime's reactor. Create the device inside the server's runtime.
    #[error("the serial gadget must be created inside a tokio runtime")]
    NoRuntime,
    /// Opening or setting up the pseudo-terminal failed (no `/dev/ptmx`,
    /// the system ran out of ptys, ...).
    #[error("cannot set up a pseudo-terminal")]
    Pty(#[source] io::Error),
    /// The link path exists and is not a symlink; it is left alone. Choose
    /// another path or remove the file.
    #[error("{} exists and is not a symlink; refusing to replace it", .0.display())]
    LinkOccupied(PathBuf),
    /// Creating the link (or removing the old one) failed.
    #[error("cannot create the link {}", path.display())]
    Link {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// The 7-byte line coding of SET/GET_LINE_CODING.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LineCoding {
    /// Bits per second.
    pub baud: u32,
    /// 0: 1 stop bit, 1: 1.5, 2: 2.
    pub stop_bits: u8,
    /// 0 none, 1 odd, 2 even, 3 mark, 4 space.
    pub parity: u8,
    /// 5, 6, 7, 8 or 16.
    pub data_bits: u8,
}

impl Default for LineCoding {
    /// 9600 8N1, what the host driver also starts with.
    fn default() -> Self {
        Self { baud: 9600, stop_bits: 0, parity: 0, data_bits: 8 }
    }
}

impl LineCoding {
    pub fn to_bytes(self) -> [u8; 7] {
        let [a, b, c, d] = self.baud.to_le_bytes();
        [a, b, c, d, self.stop_bits, self.parity, self.data_bits]
    }

    /// `None` when shorter than 7 bytes.
    pub fn parse(bytes: &[u8]) -> Option<Self> {
        let bytes: &[u8; 7] = bytes.get(..7)?.try_into().ok()?;
        Some(Self {
            baud: u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]),
            stop_bits: bytes[4],
            parity: bytes[5],
            data_bits: bytes[6],
        })
    }
}

/// The CDC-ACM function (see [`serial`]).
#[derive(Debug)]
pub struct CdcAcm {
    descriptors: DescriptorSet,
    pty: Pty,
    /// Removes the user's link when the device goes away.
    _link: Option<Link>,
    line_coding: LineCoding,
    /// wValue of the last SET_CONTROL_LINE_STATE (bit 0 DTR, bit 1 RTS).
    control_lines: u16,
    /// Bulk IN URBs waiting for bytes from the pty.
    reads: VecDeque<Urb>,
    /// Bulk OUT URBs being written to the pty.
    writes: VecDeque<PendingWrite>,
    /// Interrupt IN URBs on the notification endpoint: we have nothing to
    /// notify, so they wait until cancelled.
    notifications: VecDeque<Urb>,
    done: CompletionQueue,
}

#[derive(Debug)]
struct PendingWrite {
    urb: Urb,
    written: usize,
}

/// A CDC-ACM serial port (VID 0x1209, PID 0x0004) bridged to a new
/// pseudo-terminal, and the path of its slave side (`/dev/pts/N`).
///
/// With `link`, a symlink to the slave is created there (replacing an
/// existing symlink, never another kind of file) and removed when the device
/// is dropped. Must be called inside a tokio runtime with I/O enabled.
pub fn serial(link: Option<&Path>) -> Result<(VirtualDevice<CdcAcm>, PathBuf), SerialError> {
    if tokio::runtime::Handle::try_current().is_err() {
        return Err(SerialError::NoRuntime);
    }
    let pty = Pty::open().map_err(SerialError::Pty)?;
    let link = link.map(|path| Link::create(path, &pty.path)).transpose()?;
    let path = pty.path.clone();
    let line_coding = LineCoding::default();
    if let Err(error) = apply_line_coding(&pty.slave, line_coding) {
        debug!(%error, "cannot apply the line coding to the pty");
    }
    let function = CdcAcm {
        descriptors: descriptors(),
        pty,
        _link: link,
        line_coding,
        control_lines: 0,
        reads: VecDeque::new(),
        writes: VecDeque::new(),
        notifications: VecDeque::new(),
        done: CompletionQueue::new(),
    };
    Ok((VirtualDevice::new(function), path))
}

fn descriptors() -> DescriptorSet {
    let speed = Speed::HIGH;
    let configuration = ConfigurationBuilder::new(speed, 100)
        .association(0, 2, 0x02, 0x02, 0x01)
        .interface(COMMUNICATION_INTERFACE as u8, 1, 0x02, 0x02, 0x01, 0)
        // Header: CDC 1.10.
        .raw(&[5, CS_INTERFACE, 0x00, 0x10, 0x01])
        // Call management: the host does not manage calls; data interface 1.
        .raw(&[5, CS_INTERFACE, 0x01, 0x00, DATA_INTERFACE])
        // ACM: line coding and serial state (0x02), SEND_BREAK (0x04).
        .raw(&[4, CS_INTERFACE, 0x02, 0x06])
        // Union: interface 0 controls interface 1.
        .raw(&[5, CS_INTERFACE, 0x06, COMMUNICATION_INTERFACE as u8, DATA_INTERFACE])
        .endpoint(EndpointSpec::interrupt(NOTIFY_IN, 16, 16, speed))
        .interface(DATA_INTERFACE, 2, 0x0a, 0x00, 0x00, 0)
        .endpoint(EndpointSpec::bulk(DATA_IN, speed))
        .endpoint(EndpointSpec::bulk(DATA_OUT, speed))
        .build();
    // Miscellaneous device class with an interface association, so hosts
    // group the two interfaces into one function.
    let mut device = DeviceDescriptor::for_speed(speed, VENDOR_ID, PRODUCT_ID);
    (device.class, device.subclass, device.protocol) = (0xef, 0x02, 0x01);
    DescriptorSet::new(
        speed,
        device,
        configuration,
        vec![MANUFACTURER.into(), "usbwire serial".into(), "00040001".into()],
    )
}

impl CdcAcm {
    /// The slave side programs open, `/dev/pts/N`.
    pub fn slave_path(&self) -> &Path {
        &self.pty.path
    }

    /// The line coding the host last set.
    pub fn line_coding(&self) -> LineCoding {
        self.line_coding
    }

    /// Data terminal ready, as the host last set it (set while a program on the host has the port open).
    pub fn dtr(&self) -> bool {
        self.control_lines & 0x01 != 0
    }

    /// Request to send, as the host last set it.
    pub fn rts(&self) -> bool {
        self.control_lines & 0x02 != 0
    }

    /// Writes pending OUT data to the master; the next finished OUT URB, if any.
    fn poll_write(&mut self, cx: &mut Context<'_>) -> Option<Completion> {
        loop {
            let pending = self.writes.front_mut()?;
            if pending.written >= pending.urb.data.len() {
                let pending = self.writes.pop_front()?;
                return Some(pending.urb.complete_out());
            }
            let mut guard = match self.pty.master.poll_write_ready(cx) {
                Poll::Ready(Ok(guard)) => guard,
                Poll::Ready(Err(error)) => {
                    warn!(%error, "pty is no longer polled; failing the write");
                    let pending = self.writes.pop_front()?;
                    return Some(Completion {
                        actual_length: pending.written as u32,
                        ..pending.urb.complete_with(Status::ESHUTDOWN)
                    });
                }
                Poll::Pending => return None,
            };
            let rest = &pending.urb.data[pending.written..];
            match guard.try_io(|master| master.get_ref().write(rest)) {
                Ok(Ok(n)) if n > 0 => {
                    trace!(bytes = n, "to pty");
                    pending.written += n;
                }
                Ok(result) => {
                    let error = result.err().unwrap_or_else(|| io::ErrorKind::WriteZero.into());
                    warn!(%error, "writing to the pty failed");
                    let pending = self.writes.pop_front()?;
                    return Some(Completion {
                        actual_length: pending.written as u32,
                        ..pending.urb.complete_with(Status::EPIPE)
                    });
                }
                // Would block: readiness was cleared, poll again to register.
                Err(_) => {}
            }
        }
    }

    /// Reads from the master for the oldest waiting IN URB.
    fn poll_read(&mut self, cx: &mut Context<'_>) -> Option<Completion> {
        let urb = self.reads.front()?;
        let want = (urb.length as usize).min(MAX_READ);
        if want == 0 {
            let urb = self.reads.pop_front()?;
            return Some(urb.complete_in(Bytes::new()));
        }
        loop {
            let mut guard = match self.pty.master.poll_read_ready(cx) {
                Poll::Ready(Ok(guard)) => guard,
                Poll::Ready(Err(error)) => {
                    warn!(%error, "pty is no longer polled; failing the read");
                    let urb = self.reads.pop_front()?;
                    return Some(urb.complete_with(Status::ESHUTDOWN));
                }
                Poll::Pending => return None,
            };
            let mut buffer = vec![0; want];
            match guard.try_io(|master| master.get_ref().read(&mut buffer)) {
                Ok(Ok(n)) if n > 0 => {
                    trace!(bytes = n, "from pty");
                    buffer.truncate(n);
                    let urb = self.reads.pop_front()?;
                    return Some(urb.complete_in(Bytes::from(buffer)));
                }
                Ok(result) => {
                    // EIO (or end of file) means every slave descriptor is
                    // closed, which our own open slave should prevent. Wait
                    // for the next readiness change rather than spin.
                    if let Err(error) = result {
                        debug!(%error, "pty read failed; waiting");
                    }
                    guard.clear_ready();
                    return None;
                }
                Err(_) => {}
            }
        }
    }

    fn class_request(&mut self, setup: &SetupPacket, data: &[u8]) -> ControlReply {
        match setup.request {
            class::SET_LINE_CODING => {
                let Some(coding) = LineCoding::parse(data) else {
                    return ControlReply::Stall;
                };
                debug!(?coding, "line coding set");
                if let Err(error) = apply_line_coding(&self.pty.slave, coding) {
                    debug!(%error, "cannot apply the line coding to the pty");
                }
                self.line_coding = coding;
                ControlReply::Data(Vec::new())
            }
            class::GET_LINE_CODING => ControlReply::Data(self.line_coding.to_bytes().to_vec()),
            class::SET_CONTROL_LINE_STATE => {
                debug!(dtr = setup.value & 1 != 0, rts = setup.value & 2 != 0, "control lines set");
                self.control_lines = setup.value;
                ControlReply::Data(Vec::new())
            }
            class::SEND_BREAK => {
                // A pty has no line to hold in break; acknowledge like a USB-serial bridge would.
                debug!(millis = setup.value, "break requested");
                ControlReply::Data(Vec::new())
            }
            _ => ControlReply::Stall,
        }
    }
}

impl Function for CdcAcm {
    fn descriptors(&self) -> &DescriptorSet {
        &self.descriptors
    }

    fn control(&mut self, setup: &SetupPacket, data: &[u8]) -> ControlReply {
        if setup.kind() != RequestKind::Class
            || setup.recipient() != Recipient::Interface
            || setup.index != COMMUNICATION_INTERFACE
        {
            return ControlReply::Stall;
        }
        self.class_request(setup, data)
    }

    fn submit(&mut self, urb: Urb) {
        match urb.endpoint_address() {
            DATA_OUT => self.writes.push_back(PendingWrite { urb, written: 0 }),
            DATA_IN => self.reads.push_back(urb),
            NOTIFY_IN => self.notifications.push_back(urb),
            _ => self.done.push(urb.complete_with(Status::EPIPE)),
        }
    }

    fn poll_complete(&mut self, cx: &mut Context<'_>) -> Poll<Completion> {
        if let Poll::Ready(done) = self.done.poll_pop(cx) {
            return Poll::Ready(done);
        }
        if let Some(done) = self.poll_write(cx) {
            return Poll::Ready(done);
        }
        match self.poll_read(cx) {
            Some(done) => Poll::Ready(done),
            None => Poll::Pending,
        }
    }

    fn cancel(&mut self, seqnum: u32) {
        let done = if let Some(i) = self.writes.iter().position(|w| w.urb.seqnum == seqnum) {
            self.writes
                .remove(i)
                .map(|w| Completion { actual_length: w.written as u32, ..w.urb.complete_with(Status::ECONNRESET) })
        } else if let Some(i) = self.reads.iter().position(|u| u.seqnum == seqnum) {
            self.reads.remove(i).map(|u| u.complete_with(Status::ECONNRESET))
        } else if let Some(i) = self.notifications.iter().position(|u| u.seqnum == seqnum) {
            self.notifications.remove(i).map(|u| u.complete_with(Status::ECONNRESET))
        } else {
            None
        };
        if let Some(done) = done {
            self.done.push(done);
        }
    }

    fn reset(&mut self) {
        // Bytes programs wrote stay in the pty for the next host.
        self.reads.clear();
        self.writes.clear();
        self.notifications.clear();
        self.done.clear();
        self.control_lines = 0;
        self.line_coding = LineCoding::default();
        if let Err(error) = apply_line_coding(&self.pty.slave, self.line_coding) {
            debug!(%error, "cannot apply the line coding to the pty");
        }
    }
}

/// A pseudo-terminal pair: the master we serve, the slave we hold open.
#[derive(Debug)]
struct Pty {
    master: AsyncFd<File>,
    slave: File,
    path: PathBuf,
}

impl Pty {
    fn open() -> io::Result<Self> {
        // What posix_openpt does on Linux, without an unsafe call.
        let master = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOCTTY | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/ptmx")?;
        let fd = master.as_raw_fd();
        // SAFETY: `fd` is an open pty master owned by `master`; grantpt takes no pointers.
        if unsafe { libc::grantpt(fd) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: as above.
        if unsafe { libc::unlockpt(fd) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let mut name = [0 as libc::c_char; 128];
        // SAFETY: `name` is writable for `name.len()` bytes; on success ptsname_r
        // leaves a NUL-terminated string in it.
        let status = unsafe { libc::ptsname_r(fd, name.as_mut_ptr(), name.len()) };
        if status != 0 {
            return Err(io::Error::from_raw_os_error(status));
        }
        let name: Vec<u8> = name.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        let path = PathBuf::from(OsStr::from_bytes(&name));
        let slave =
            OpenOptions::new().read(true).write(true).custom_flags(libc::O_NOCTTY | libc::O_CLOEXEC).open(&path)?;
        make_raw(&slave)?;
        // SAFETY: `master` owns its descriptor for as long as the AsyncFd
        // holds it, and is only ever borrowed (`get_ref`), never replaced.
        let master = unsafe { AsyncFd::register(master) }?;
        Ok(Self { master, slave, path })
    }
}

/// The terminal attributes of `tty`.
fn termios_of(tty: &File) -> io::Result<libc::termios> {
    let mut termios = MaybeUninit::<libc::termios>::uninit();
    // SAFETY: `tty` is an open descriptor and `termios` is writable; tcgetattr
    // fills the whole struct when it returns 0.
    if unsafe { libc::tcgetattr(tty.as_raw_fd(), termios.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: initialised by the successful tcgetattr above.
    Ok(unsafe { termios.assume_init() })
}

fn set_termios(tty: &File, termios: &libc::termios) -> io::Result<()> {
    // SAFETY: `tty` is an open descriptor and `termios` a valid struct.
    if unsafe { libc::tcsetattr(tty.as_raw_fd(), libc::TCSANOW, termios) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Raw mode on the slave: no echo back into the master (which would send
/// the host its own bytes), no line editing, no newline translation.
fn make_raw(slave: &File) -> io::Result<()> {
    let mut termios = termios_of(slave)?;
    // SAFETY: `termios` is a valid, initialised struct.
    unsafe { libc::cfmakeraw(&mut termios) };
    set_termios(slave, &termios)
}

/// Mirrors the host's line coding in the slave's termios, so programs on the
/// server can see it (`stty -F /dev/pts/N`). A pty ignores speed and framing,
/// and Linux resets its character size to 8 bits without parity whatever we
/// set, so only the speed and stop bits show; GET_LINE_CODING still returns
/// exactly what the host set.
fn apply_line_coding(slave: &File, coding: LineCoding) -> io::Result<()> {
    let mut termios = termios_of(slave)?;
    termios.c_cflag &= !(libc::CSIZE | libc::PARENB | libc::PARODD | libc::CMSPAR | libc::CSTOPB);
    termios.c_cflag |= match coding.data_bits {
        5 => libc::CS5,
        6 => libc::CS6,
        7 => libc::CS7,
        _ => libc::CS8,
    };
    termios.c_cflag |= match coding.parity {
        1 => libc::PARENB | libc::PARODD,
        2 => libc::PARENB,
        3 => libc::PARENB | libc::CMSPAR | libc::PARODD,
        4 => libc::PARENB | libc::CMSPAR,
        _ => 0,
    };
    if coding.stop_bits != 0 {
        termios.c_cflag |= libc::CSTOPB;
    }
    if let Some(speed) = speed_constant(coding.baud) {
        // SAFETY: `termios` is a valid, initialised struct.
        unsafe {
            libc::cfsetispeed(&mut termios, speed);
            libc::cfsetospeed(&mut termios, speed);
        }
    }
    set_termios(slave, &termios)
}

/// The termios constant for a standard rate (others keep the current speed).
fn speed_constant(baud: u32) -> Option<libc::speed_t> {
    const SPEEDS: &[(u32, libc::speed_t)] = &[
        (50, libc::B50),
        (75, libc::B75),
        (110, libc::B110),
        (134, libc::B134),
        (150, libc::B150),
        (200, libc::B200),
        (300, libc::B300),
        (600, libc::B600),
        (1200, libc::B1200),
        (1800, libc::B1800),
        (2400, libc::B2400),
        (4800, libc::B4800),
        (9600, libc::B9600),
        (19200, libc::B19200),
        (38400, libc::B38400),
        (57600, libc::B57600),
        (115_200, libc::B115200),
        (230_400, libc::B230400),
        (460_800, libc::B460800),
        (500_000, libc::B500000),
        (576_000, libc::B576000),
        (921_600, libc::B921600),
        (1_000_000, libc::B1000000),
        (1_152_000, libc::B1152000),
        (1_500_000, libc::B1500000),
        (2_000_000, libc::B2000000),
        (2_500_000, libc::B2500000),
        (3_000_000, libc::B3000000),
        (3_500_000, libc::B3500000),
        (4_000_000, libc::B4000000),
    ];
    SPEEDS.iter().find(|(rate, _)| *rate == baud).map(|(_, speed)| *speed)
}

/// A symlink to the slave that is removed with the device.
#[derive(Debug)]
struct Link {
    path: PathBuf,
    target: PathBuf,
}

impl Link {
    fn create(path: &Path, target: &Path) -> Result<Self, SerialError> {
        let failed = |source| SerialError::Link { path: path.to_owned(), source };
        match fs::symlink_metadata(path) {
            Ok(meta) if meta.file_type().is_symlink() => fs::remove_file(path).map_err(failed)?,
            Ok(_) => return Err(SerialError::LinkOccupied(path.to_owned())),
            Err(error) if error.kind() == io::ErrorKind::NotFound => {}
            Err(error) => return Err(failed(error)),
        }
        std::os::unix::fs::symlink(target, path).map_err(failed)?;
        debug!(link = %path.display(), target = %target.display(), "serial link created");
        Ok(Self { path: path.to_owned(), target: target.to_owned() })
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        // Only our own link: someone may have pointed it elsewhere since.
        if fs::read_link(&self.path).is_ok_and(|target| target == self.target) {
            if let Err(error) = fs::remove_file(&self.path) {
                warn!(link = %self.path.display(), %error, "cannot remove the serial link");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{configure, control, data_in, data_out, next, next_within, request};
    use std::time::Duration;
    use usbwire_device::descriptor::ConfigurationInfo;
    use usbwire_device::Device;

    fn configured() -> (VirtualDevice<CdcAcm>, PathBuf) {
        let (mut dev, path) = serial(None).unwrap();
        configure(&mut dev);
        (dev, path)
    }

    fn open_slave(path: &Path) -> File {
        OpenOptions::new().read(true).write(true).custom_flags(libc::O_NOCTTY).open(path).unwrap()
    }

    /// An empty directory for one test, removed when the guard is dropped.
    fn scratch_dir() -> tempfile::TempDir {
        tempfile::Builder::new().prefix("usbwire-serial-").tempdir().unwrap()
    }

    #[tokio::test]
    async fn descriptors_describe_an_acm_function() {
        let (mut dev, path) = serial(None).unwrap();
        assert!(path.starts_with("/dev/pts"), "{}", path.display());
        assert_eq!(dev.function().slave_path(), path);
        let summary = dev.summary();
        assert_eq!((summary.vendor_id, summary.product_id, summary.class), (0x1209, 0x0004, 0xef));
        assert_eq!(summary.interfaces, vec![(2, 2, 1), (0x0a, 0, 0)]);
        assert_eq!(summary.product, "usbwire serial");
        let config = request(&mut dev, [0x80, 6, 0, 2, 0, 0, 0xff, 0], &[]);
        let info = ConfigurationInfo::parse(&config).unwrap();
        let eps: Vec<_> = info.active_endpoints(|_| 0).map(|e| (e.address, e.max_packet_size)).collect();
        assert_eq!(eps, vec![(0x83, 16), (0x81, 512), (0x02, 512)]);
        assert_eq!(&config[9..11], &[8, 0x0b], "the IAD comes first");
    }

    #[tokio::test]
    async fn line_coding_round_trips_and_reaches_the_termios() {
        let (mut dev, path) = configured();
        let default = request(&mut dev, [0xa1, 0x21, 0, 0, 0, 0, 7, 0], &[]);
        assert_eq!(LineCoding::parse(&default), Some(LineCoding::default()));
        let coding = LineCoding { baud: 115_200, stop_bits: 2, parity: 2, data_bits: 7 };
        request(&mut dev, [0x21, 0x20, 0, 0, 0, 0, 7, 0], &coding.to_bytes());
        assert_eq!(&request(&mut dev, [0xa1, 0x21, 0, 0, 0, 0, 7, 0], &[])[..], &coding.to_bytes());
        assert_eq!(dev.function().line_coding(), coding);
        let termios = termios_of(&open_slave(&path)).unwrap();
        // Linux forces CS8 without parity on ptys; the stop bits stay.
        assert_ne!(termios.c_cflag & libc::CSTOPB, 0);
        assert_eq!(termios.c_lflag & libc::ECHO, 0, "still raw");
        // A short data stage stalls; the stored coding is kept.
        dev.submit(control(1, [0x21, 0x20, 0, 0, 0, 0, 3, 0], &[1, 2, 3]));
        assert_eq!(next(&mut dev).unwrap().status, Status::EPIPE);
        assert_eq!(dev.function().line_coding(), coding);
    }

    #[tokio::test]
    async fn control_lines_and_break_are_accepted() {
        let (mut dev, _path) = configured();
        request(&mut dev, [0x21, 0x22, 0x03, 0, 0, 0, 0, 0], &[]);
        assert!(dev.function().dtr() && dev.function().rts());
        request(&mut dev, [0x21, 0x23, 0xe8, 0x03, 0, 0, 0, 0], &[]);
        dev.submit(control(1, [0x21, 0x22, 0x01, 0, 1, 0, 0, 0], &[]));
        assert_eq!(next(&mut dev).unwrap().status, Status::EPIPE, "the data interface has no class requests");
        dev.reset();
        assert!(!dev.function().dtr());
    }

    #[tokio::test]
    async fn out_data_is_readable_from_the_slave() {
        let (mut dev, path) = configured();
        dev.submit(data_out(1, 0x02, Bytes::from_static(b"hello\n")));
        let done = next_within(&mut dev).await.unwrap();
        assert_eq!((done.seqnum, done.status, done.actual_length), (1, Status::OK, 6));
        let mut slave = open_slave(&path);
        let read = tokio::task::spawn_blocking(move || {
            let mut got = Vec::new();
            let mut buffer = [0; 64];
            while got.len() < 6 {
                let n = slave.read(&mut buffer).unwrap();
                got.extend_from_slice(&buffer[..n]);
            }
            got
        });
        let got = tokio::time::timeout(Duration::from_secs(2), read).await.unwrap().unwrap();
        assert_eq!(got, b"hello\n", "raw: no newline translation");
    }

    #[tokio::test]
    async fn bytes_written_to_the_slave_complete_a_pending_in_urb() {
        let (mut dev, path) = configured();
        dev.submit(data_in(1, 0x81, 512));
        assert!(next(&mut dev).is_none(), "nothing to read yet");
        open_slave(&path).write_all(b"ping\n").unwrap();
        let mut got = Vec::new();
        let mut seqnum = 1;
        while got.len() < 5 {
            let done = next_within(&mut dev).await.expect("IN completes once data is there");
            assert_eq!((done.seqnum, done.status), (seqnum, Status::OK));
            got.extend_from_slice(&done.data);
            seqnum += 1;
            dev.submit(data_in(seqnum, 0x81, 512));
        }
        assert_eq!(got, b"ping\n");
        // Data beyond one URB waits in the pty for the next one.
        dev.cancel(seqnum);
        next_within(&mut dev).await.unwrap();
        open_slave(&path).write_all(b"abcdef").unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        dev.submit(data_in(20, 0x81, 4));
        assert_eq!(&next_within(&mut dev).await.unwrap().data[..], b"abcd");
        dev.submit(data_in(21, 0x81, 4));
        assert_eq!(&next_within(&mut dev).await.unwrap().data[..], b"ef");
    }

    #[tokio::test]
    async fn a_full_pty_keeps_the_out_urb_pending_until_read() {
        let (mut dev, path) = configured();
        // Far more than the pty buffers hold with nobody reading.
        let data = Bytes::from(vec![b'x'; 256 * 1024]);
        dev.submit(data_out(1, 0x02, data.clone()));
        assert!(
            tokio::time::timeout(Duration::from_millis(200), std::future::poll_fn(|cx| dev.poll_complete(cx)))
                .await
                .is_err(),
            "the write waits for a reader"
        );
        let mut slave = open_slave(&path);
        let reader = tokio::task::spawn_blocking(move || {
            let mut total = 0;
            let mut buffer = vec![0; 64 * 1024];
            while total < 256 * 1024 {
                total += slave.read(&mut buffer).unwrap();
            }
            total
        });
        let done = tokio::time::timeout(Duration::from_secs(5), std::future::poll_fn(|cx| dev.poll_complete(cx)))
            .await
            .unwrap();
        assert_eq!((done.status, done.actual_length), (Status::OK, 256 * 1024));
        assert_eq!(reader.await.unwrap(), 256 * 1024);
    }

    #[tokio::test]
    async fn cancel_ends_pending_urbs() {
        let (mut dev, _path) = configured();
        dev.submit(data_in(1, 0x81, 512));
        dev.submit(data_in(2, 0x83, 16));
        assert!(next(&mut dev).is_none());
        dev.cancel(2);
        dev.cancel(1);
        let first = next(&mut dev).unwrap();
        let second = next(&mut dev).unwrap();
        assert_eq!((first.seqnum, first.status), (2, Status::ECONNRESET));
        assert_eq!((second.seqnum, second.status), (1, Status::ECONNRESET));
    }

    #[tokio::test]
    async fn link_is_created_replaced_and_removed() {
        let dir = scratch_dir();
        let dir = dir.path();
        let link = dir.join("ttyUSBWIRE");
        std::os::unix::fs::symlink("/nonexistent", &link).unwrap();
        let (dev, path) = serial(Some(&link)).unwrap();
        assert_eq!(fs::read_link(&link).unwrap(), path, "an old symlink is replaced");
        drop(dev);
        assert!(fs::symlink_metadata(&link).is_err(), "removed with the device");
    }

    #[tokio::test]
    async fn link_refuses_to_replace_a_regular_file() {
        let dir = scratch_dir();
        let dir = dir.path();
        let file = dir.join("precious");
        fs::write(&file, b"keep me").unwrap();
        let error = serial(Some(&file)).err().unwrap();
        assert!(matches!(error, SerialError::LinkOccupied(ref p) if p == &file), "{error}");
        assert_eq!(fs::read(&file).unwrap(), b"keep me");
    }

    #[test]
    fn outside_a_runtime_is_an_error_not_a_panic() {
        assert!(matches!(serial(None), Err(SerialError::NoRuntime)));
    }
}
