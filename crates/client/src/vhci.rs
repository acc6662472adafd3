//! Kernel attach through vhci-hcd's sysfs interface: the same job as
//! `usbip attach / port / detach`.
//!
//! The socket of an imported device is handed to the kernel by writing
//! `"PORT SOCKFD DEVID SPEED"` to `/sys/devices/platform/vhci_hcd.0/attach`;
//! from then on the kernel speaks the URB phase itself. The port must be free
//! and on the hub matching the speed (SuperSpeed hub for speed >= 5). Like the
//! `usbip` tool, we record `HOST PORT BUSID` in `/var/run/vhci_hcd/portN` so
//! `port` can say what is attached where (and `usbip port` reads ours).

use std::fs;
use std::io::{self, Write as _};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use usbwire_proto::Speed;

/// Where vhci_hcd's controller 0 keeps its attributes.
pub const VHCI_SYSFS: &str = "/sys/devices/platform/vhci_hcd.0";
/// Where attach records live (shared with the `usbip` tool).
pub const RECORD_DIR: &str = "/var/run/vhci_hcd";

/// vhci failures, each saying what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VhciError {
    /// The module is not loaded.
    #[error("vhci-hcd is not loaded: run `sudo modprobe vhci-hcd` (the kernel's USB/IP client driver)")]
    NotLoaded,
    /// sysfs refused us, usually for lack of root.
    #[error("cannot write {path}: {source} (attaching needs root)")]
    Permission { path: PathBuf, source: io::Error },
    /// Every port of the needed hub is taken.
    #[error("no free {hub} port on vhci-hcd (detach something with `usbwire detach -p PORT`)")]
    NoFreePort { hub: &'static str },
    /// The port is not attached.
    #[error("port {0} is not in use")]
    PortNotInUse(u32),
    /// Anything else from sysfs.
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

/// One vhci port, as the `status` files show it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortStatus {
    /// `hs` or `ss`.
    pub hub: String,
    pub port: u32,
    /// `enum usbip_device_status`: 4 = free, 5 = not assigned, 6 = used, 7 = error.
    pub status: u32,
    pub speed: Speed,
    pub devid: u32,
    pub local_busid: String,
}

impl PortStatus {
    pub const FREE: u32 = 4;

    pub fn is_free(&self) -> bool {
        self.status == Self::FREE
    }
}

/// What we recorded when attaching a port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub host: String,
    pub service: String,
    pub busid: String,
}

/// Parses one `status` file (header line, then one line per port).
pub fn parse_status(text: &str) -> Vec<PortStatus> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let hub = f.next()?.to_owned();
            let port = f.next()?.parse().ok()?;
            let status = f.next()?.parse().ok()?;
            let speed = Speed(f.next()?.parse().ok()?);
            let devid = u32::from_str_radix(f.next()?, 16).ok()?;
            let _sockfd = f.next()?;
            let local_busid = f.next().unwrap_or("0-0").to_owned();
            Some(PortStatus { hub, port, status, speed, devid, local_busid })
        })
        .collect()
}

fn sysfs_root() -> Result<&'static Path, VhciError> {
    let root = Path::new(VHCI_SYSFS);
    if root.join("attach").exists() {
        Ok(root)
    } else {
        Err(VhciError::NotLoaded)
    }
}

/// Every port of every vhci controller.
pub fn ports() -> Result<Vec<PortStatus>, VhciError> {
    let root = sysfs_root()?;
    let mut ports = Vec::new();
    for index in 0.. {
        let name = if index == 0 { "status".to_owned() } else { format!("status.{index}") };
        let path = root.join(&name);
        match fs::read_to_string(&path) {
            Ok(text) => ports.extend(parse_status(&text)),
            Err(error) if error.kind() == io::ErrorKind::NotFound => break,
            Err(source) => return Err(VhciError::Io { path, source }),
        }
    }
    Ok(ports)
}

/// The first free port on the hub that matches `speed`.
pub fn free_port(ports: &[PortStatus], speed: Speed) -> Option<u32> {
    let hub = if speed.is_superspeed() { "ss" } else { "hs" };
    ports.iter().find(|p| p.hub == hub && p.is_free()).map(|p| p.port)
}

/// Hands `socket` (an imported device's URB channel) to the kernel on a free
/// port and records who it came from. Returns the port. The caller may close
/// its copy of the socket afterwards: the kernel holds its own reference.
pub fn attach(socket: &impl AsRawFd, devid: u32, speed: Speed, record: &Record) -> Result<u32, VhciError> {
    attach_preferring(socket, devid, speed, record, None)
}

/// [`attach`], on `preferred` if it is free and on the hub `speed` needs
/// (a device followed through re-enumeration goes back where it was).
pub fn attach_preferring(
    socket: &impl AsRawFd,
    devid: u32,
    speed: Speed,
    record: &Record,
    preferred: Option<u32>,
) -> Result<u32, VhciError> {
    let root = sysfs_root()?;
    let speed = speed.for_vhci();
    let hub = if speed.is_superspeed() { "ss" } else { "hs" };
    let mut preferred = preferred;
    // Another attach may race us for a port; the kernel answers EBUSY then, so try the next.
    for _ in 0..16 {
        let ports = ports()?;
        let wanted =
            preferred.take().filter(|want| ports.iter().any(|p| p.port == *want && p.hub == hub && p.is_free()));
        let port = wanted.or_else(|| free_port(&ports, speed)).ok_or(VhciError::NoFreePort { hub })?;
        let line = format!("{port} {} {devid} {}", socket.as_raw_fd(), speed.0);
        let path = root.join("attach");
        match fs::OpenOptions::new().write(true).open(&path).and_then(|mut f| f.write_all(line.as_bytes())) {
            Ok(()) => {
                write_record(port, record)?;
                return Ok(port);
            }
            Err(error) if error.raw_os_error() == Some(libc::EBUSY) => continue,
            Err(source) if source.kind() == io::ErrorKind::PermissionDenied => {
                return Err(VhciError::Permission { path, source })
            }
            Err(source) => return Err(VhciError::Io { path, source }),
        }
    }
    Err(VhciError::NoFreePort { hub })
}

/// Hands the kernel one end of a new socket pair for `device` (on `preferred`
/// if free) and returns the port and the other end, for a relay to carry.
pub fn attach_relayed(
    device: &usbwire_proto::op::DeviceRecord,
    record: &Record,
    preferred: Option<u32>,
) -> Result<(u32, tokio::net::UnixStream), VhciError> {
    let io = |source| VhciError::Io { path: PathBuf::from("socketpair"), source };
    let (kernel_end, our_end) = std::os::unix::net::UnixStream::pair().map_err(io)?;
    let port = attach_preferring(&kernel_end, device.devid(), device.speed, record, preferred)?;
    drop(kernel_end);
    our_end.set_nonblocking(true).map_err(io)?;
    let ours = tokio::net::UnixStream::from_std(our_end).map_err(io)?;
    Ok((port, ours))
}

/// Detaches a port (the kernel closes the connection) and removes its record.
pub fn detach(port: u32) -> Result<(), VhciError> {
    let root = sysfs_root()?;
    let in_use = ports()?.iter().any(|p| p.port == port && !p.is_free());
    if !in_use {
        return Err(VhciError::PortNotInUse(port));
    }
    let path = root.join("detach");
    fs::OpenOptions::new().write(true).open(&path).and_then(|mut f| f.write_all(port.to_string().as_bytes())).map_err(
        |source| match source.kind() {
            io::ErrorKind::PermissionDenied => VhciError::Permission { path: path.clone(), source },
            _ => VhciError::Io { path: path.clone(), source },
        },
    )?;
    let _ = fs::remove_file(record_path(port));
    Ok(())
}

pub fn record_path(port: u32) -> PathBuf {
    Path::new(RECORD_DIR).join(format!("port{port}"))
}

/// The record of a port, if one was written.
pub fn read_record(port: u32) -> Option<Record> {
    let text = fs::read_to_string(record_path(port)).ok()?;
    let mut f = text.split_whitespace();
    Some(Record { host: f.next()?.to_owned(), service: f.next()?.to_owned(), busid: f.next()?.to_owned() })
}

fn write_record(port: u32, record: &Record) -> Result<(), VhciError> {
    let dir = Path::new(RECORD_DIR);
    let io_error = |source| VhciError::Io { path: dir.to_path_buf(), source };
    if !dir.exists() {
        fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(io_error)?;
    }
    let path = record_path(port);
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o700)
        .open(&path)
        .map_err(|source| VhciError::Io { path: path.clone(), source })?;
    writeln!(file, "{} {} {}", record.host, record.service, record.busid)
        .map_err(|source| VhciError::Io { path, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_lines_parse() {
        let text = "hub port sta spd dev      sockfd local_busid\n\
                    hs  0000 004 000 00000000 000000 0-0\n\
                    hs  0001 006 003 00010002 000005 3-2\n\
                    ss  0008 004 000 00000000 000000 0-0\n";
        let ports = parse_status(text);
        assert_eq!(ports.len(), 3);
        assert_eq!(
            ports[1],
            PortStatus {
                hub: "hs".into(),
                port: 1,
                status: 6,
                speed: Speed::HIGH,
                devid: 0x10002,
                local_busid: "3-2".into()
            }
        );
        assert_eq!(free_port(&ports, Speed::HIGH), Some(0));
        assert_eq!(free_port(&ports, Speed::SUPER), Some(8));
        assert_eq!(free_port(&ports, Speed::SUPER_PLUS), Some(8));
        assert_eq!(free_port(&ports[1..2], Speed::HIGH), None);
    }
}
