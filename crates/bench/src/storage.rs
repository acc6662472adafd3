//! A Bulk-Only mass-storage host that runs URBs the way vhci-hcd and
//! usb-storage do: [`Host`] enumerates the device as the kernel does and runs
//! SCSI commands as usb-storage runs them, one stage at a time (command
//! block, data, status), each stage's URB waiting for the one before to
//! complete. Its URBs go over a [`UrbLink`]: plain USB/IP on the kernel's end
//! of a socket pair or any byte stream ([`Wire`], what the kernel relay's
//! storage accelerator sees of a real kernel), or a userspace
//! `Connection` (what a usbredir guest's driver sees). For `usbwire bench
//! --storage` and for tests.
//!
//! Not a SCSI initiator for real use (no command timeouts, no queueing, no
//! retries beyond usb-storage's stall recovery), and not the accelerator
//! itself (`usbwire_client::storage`).

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite};
use usbwire_device::descriptor::{ConfigurationInfo, DeviceDescriptor};
use usbwire_proto::{Direction, Status};

pub use crate::urb_link::{LinkError, Transfer, Urb, UrbLink, Wire};

/// Command Block Wrapper signature, "USBC" little-endian.
pub const CBW_SIGNATURE: u32 = 0x4342_5355;
/// Command Status Wrapper signature, "USBS" little-endian.
pub const CSW_SIGNATURE: u32 = 0x5342_5355;
/// A CBW's length on the wire.
pub const CBW_LEN: usize = 31;
/// A CSW's length on the wire.
pub const CSW_LEN: usize = 13;
/// The block length [`Host::read10`] and [`Host::write10`] assume until
/// [`Host::read_capacity`] says otherwise.
pub const DEFAULT_BLOCK_LEN: u32 = 512;

/// SCSI operation codes the helpers send.
pub mod opcode {
    pub const TEST_UNIT_READY: u8 = 0x00;
    pub const REQUEST_SENSE: u8 = 0x03;
    pub const INQUIRY: u8 = 0x12;
    pub const READ_CAPACITY_10: u8 = 0x25;
    pub const READ_10: u8 = 0x28;
    pub const WRITE_10: u8 = 0x2a;
}

/// A command's data stage, as the CBW announces it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Data {
    /// No data stage.
    None,
    /// Device to host, at most this many bytes.
    In(u32),
    /// Host to device, these bytes.
    Out(Bytes),
}

impl Data {
    fn len(&self) -> u32 {
        match self {
            Self::None => 0,
            Self::In(len) => *len,
            Self::Out(bytes) => bytes.len() as u32,
        }
    }
}

/// The three stages of a Bulk-Only command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// The Command Block Wrapper (bulk OUT).
    Command,
    /// The data (bulk IN or OUT).
    Data,
    /// The Command Status Wrapper (bulk IN).
    Status,
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Command => "command block",
            Self::Data => "data",
            Self::Status => "status",
        })
    }
}

/// How one URB ended: its USB status (0, or a negative errno such as
/// `-EPIPE` for a stall) and how many bytes it moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageResult {
    pub status: i32,
    pub actual_length: u32,
}

/// A parsed Command Status Wrapper.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Csw {
    pub tag: u32,
    /// What the device did not move of what the CBW announced.
    pub residue: u32,
    /// 0 passed, 1 failed (ask REQUEST SENSE why), 2 phase error (reset recovery).
    pub status: u8,
}

/// What a command did, stage by stage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// The CBW's URB.
    pub command: StageResult,
    /// The data stage's URB (`None` without a data stage). A stall here was
    /// cleared before the status was read, as usb-storage does.
    pub data: Option<StageResult>,
    /// The URB that brought the CSW (the last one, when a stall made it read again).
    pub status_stage: StageResult,
    /// The bytes read in the data stage (empty for OUT or no data).
    pub data_in: Bytes,
    pub csw: Csw,
}

/// The sense data of REQUEST SENSE: what went wrong with the last command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sense {
    /// 0x05 ILLEGAL REQUEST, 0x02 NOT READY, 0x06 UNIT ATTENTION, …
    pub key: u8,
    /// Additional sense code (0x21: logical block address out of range).
    pub asc: u8,
    pub ascq: u8,
}

/// The standard INQUIRY data's identifying fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inquiry {
    /// 0x00 for a direct-access block device.
    pub device_type: u8,
    pub removable: bool,
    pub vendor: String,
    pub product: String,
    pub revision: String,
}

/// What [`Host::enumerate`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Enumerated {
    pub device: DeviceDescriptor,
    /// The configuration set (`bConfigurationValue`).
    pub configuration: u8,
    /// The Bulk-Only interface's number.
    pub interface: u8,
    /// Its bulk IN endpoint's address (with the direction bit).
    pub bulk_in: u8,
    /// Its bulk OUT endpoint's address.
    pub bulk_out: u8,
    /// GET_MAX_LUN's answer (0 when the device stalled it).
    pub max_lun: u8,
}

/// Why the host could not do what it was asked.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HostError {
    /// A URB got no completion.
    #[error(transparent)]
    Link(#[from] LinkError),
    /// A control request on endpoint 0 failed.
    #[error("{request} failed with status {status}")]
    Control { request: &'static str, status: i32 },
    /// The device's descriptors are not what a Bulk-Only disk has.
    #[error("descriptors: {0}")]
    Descriptor(String),
    /// A command was asked for before [`Host::enumerate`] found the endpoints.
    #[error("the device is not enumerated yet")]
    NotEnumerated,
    /// The caller's request cannot be sent as asked (a write that is not whole blocks, a LUN above max).
    #[error("{0}")]
    BadRequest(String),
    /// A stage failed in a way usb-storage answers with a reset: the CBW
    /// not taken, a data stage failing other than by a stall, the status
    /// stage failing twice.
    #[error("the {stage} stage failed with status {status}")]
    Stage { stage: Stage, status: i32 },
    /// The CSW is malformed: wrong length, signature or tag (the device and host disagree on where they are).
    #[error("bad CSW: {0}")]
    BadCsw(String),
    /// The command ran and the device reported it failed (1) or a phase error (2).
    #[error("SCSI command {opcode:#04x} failed: CSW status {status}{}", if *.status == 2 { " (phase error)" } else { "" })]
    CommandFailed { opcode: u8, status: u8, residue: u32 },
    /// A command returned less data than its answer needs.
    #[error("SCSI command {opcode:#04x} returned {got} bytes, {needed} needed")]
    ShortData { opcode: u8, got: usize, needed: usize },
}

/// SET_CONFIGURATION, GET_DESCRIPTOR and friends: the raw SETUP packet.
fn setup(request_type: u8, request: u8, value: u16, index: u16, length: u16) -> [u8; 8] {
    let [v0, v1] = value.to_le_bytes();
    let [i0, i1] = index.to_le_bytes();
    let [l0, l1] = length.to_le_bytes();
    [request_type, request, v0, v1, i0, i1, l0, l1]
}

const GET_DESCRIPTOR: u8 = 0x06;
const SET_CONFIGURATION: u8 = 0x09;
const CLEAR_FEATURE: u8 = 0x01;
const ENDPOINT_HALT: u16 = 0;
const GET_MAX_LUN: u8 = 0xfe;
const BULK_ONLY_RESET: u8 = 0xff;
const DESCRIPTOR_DEVICE: u16 = 0x0100;
const DESCRIPTOR_CONFIGURATION: u16 = 0x0200;

/// A Bulk-Only host over a [`UrbLink`] (see the module docs).
#[derive(Debug)]
pub struct Host<L> {
    link: L,
    /// The last CBW tag used.
    tag: u32,
    block_len: u32,
    found: Option<Enumerated>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Host<Wire<S>> {
    /// A host for the device `devid` (what the import's record says) on `io`.
    pub fn new(io: S, devid: u32) -> Self {
        Self::over(Wire::new(io, devid))
    }

    /// The stream back (to close it: dropping it detaches, as vhci's socket does).
    pub fn into_inner(self) -> S {
        self.link.into_inner()
    }
}

impl<L: UrbLink> Host<L> {
    /// A host whose URBs go over `link`.
    pub fn over(link: L) -> Self {
        Self { link, tag: 0, block_len: DEFAULT_BLOCK_LEN, found: None }
    }

    /// The link back.
    pub fn into_link(self) -> L {
        self.link
    }

    /// What [`enumerate`](Self::enumerate) found, once it has.
    pub fn enumerated(&self) -> Option<&Enumerated> {
        self.found.as_ref()
    }

    /// The block length [`read10`](Self::read10) and [`write10`](Self::write10) use.
    pub fn block_len(&self) -> u32 {
        self.block_len
    }

    /// Enumerates as the kernel does: the device descriptor, the
    /// configuration descriptor's first 9 bytes and then all of it,
    /// SET_CONFIGURATION, then GET_MAX_LUN on the Bulk-Only interface
    /// (class 08, subclass 06 SCSI, protocol 0x50).
    pub async fn enumerate(&mut self) -> Result<&Enumerated, HostError> {
        let raw = self
            .control_in("GET_DESCRIPTOR(DEVICE)", setup(0x80, GET_DESCRIPTOR, DESCRIPTOR_DEVICE, 0, 18), 18)
            .await?;
        let device = DeviceDescriptor::parse(&raw).ok_or_else(|| {
            HostError::Descriptor(format!("a device descriptor of {} bytes that does not parse", raw.len()))
        })?;
        let head = self
            .control_in("GET_DESCRIPTOR(CONFIGURATION)", setup(0x80, GET_DESCRIPTOR, DESCRIPTOR_CONFIGURATION, 0, 9), 9)
            .await?;
        if head.len() < 9 {
            return Err(HostError::Descriptor(format!("a configuration descriptor of {} bytes", head.len())));
        }
        let total = u16::from_le_bytes([head[2], head[3]]);
        let raw = self
            .control_in(
                "GET_DESCRIPTOR(CONFIGURATION)",
                setup(0x80, GET_DESCRIPTOR, DESCRIPTOR_CONFIGURATION, 0, total),
                u32::from(total),
            )
            .await?;
        let configuration = ConfigurationInfo::parse(&raw)
            .ok_or_else(|| HostError::Descriptor("the configuration descriptor does not parse".into()))?;
        self.control_out("SET_CONFIGURATION", setup(0x00, SET_CONFIGURATION, configuration.value.into(), 0, 0)).await?;
        let interface = configuration
            .interfaces
            .iter()
            .find(|i| i.is_bulk_only_storage())
            .ok_or_else(|| HostError::Descriptor("no Bulk-Only SCSI interface (08/06/50)".into()))?;
        let (Some(bulk_in), Some(bulk_out)) = (interface.bulk_endpoint(true), interface.bulk_endpoint(false)) else {
            return Err(HostError::Descriptor(format!(
                "interface {} lacks a bulk IN or OUT endpoint",
                interface.number
            )));
        };
        let number = interface.number;
        // usb-storage takes a stalled GET_MAX_LUN as "one LUN".
        let lun =
            self.transfer(Direction::In, 0, 1, setup(0xa1, GET_MAX_LUN, 0, number.into(), 1), Bytes::new()).await?;
        let max_lun = match Status(lun.status) {
            Status::OK => lun.data.first().copied().unwrap_or(0),
            Status::EPIPE => 0,
            _ => return Err(HostError::Control { request: "GET_MAX_LUN", status: lun.status }),
        };
        let found =
            Enumerated { device, configuration: configuration.value, interface: number, bulk_in, bulk_out, max_lun };
        Ok(self.found.insert(found))
    }

    /// Runs one command: CBW, the data stage if any, CSW, each after the
    /// previous completed. A stalled data or status stage is cleared
    /// (CLEAR_FEATURE(ENDPOINT_HALT)) and the CSW read (again), as
    /// usb-storage does. `Ok` whenever a well-formed CSW with this
    /// command's tag came back, whatever its status says.
    pub async fn command(&mut self, lun: u8, cdb: &[u8], data: Data) -> Result<Outcome, HostError> {
        let found = self.found.as_ref().ok_or(HostError::NotEnumerated)?;
        let (bulk_in, bulk_out) = (found.bulk_in, found.bulk_out);
        if lun > found.max_lun {
            return Err(HostError::BadRequest(format!("LUN {lun} (the device has up to {})", found.max_lun)));
        }
        if cdb.is_empty() || cdb.len() > 16 {
            return Err(HostError::BadRequest(format!("a command block of {} bytes (1..=16)", cdb.len())));
        }
        self.tag = self.tag.wrapping_add(1);
        let tag = self.tag;
        let cbw = cbw(tag, &data, lun, cdb);
        let command = self.transfer(Direction::Out, bulk_out & 0x0f, CBW_LEN as u32, [0; 8], cbw).await?;
        if command.status != 0 {
            return Err(HostError::Stage { stage: Stage::Command, status: command.status });
        }
        let (data_stage, data_in) = match data {
            Data::None => (None, Bytes::new()),
            Data::In(len) => {
                let t = self.transfer(Direction::In, bulk_in & 0x0f, len, [0; 8], Bytes::new()).await?;
                self.after_data(bulk_in, t.status).await?;
                (Some(t.result()), t.data)
            }
            Data::Out(bytes) => {
                let len = bytes.len() as u32;
                let t = self.transfer(Direction::Out, bulk_out & 0x0f, len, [0; 8], bytes).await?;
                self.after_data(bulk_out, t.status).await?;
                (Some(t.result()), Bytes::new())
            }
        };
        let mut status = self.transfer(Direction::In, bulk_in & 0x0f, CSW_LEN as u32, [0; 8], Bytes::new()).await?;
        // usb-storage reads the CSW once more after a stall (cleared) or a
        // zero-length packet where the CSW should be.
        if status.status == Status::EPIPE.0 {
            self.clear_halt(bulk_in).await?;
            status = self.transfer(Direction::In, bulk_in & 0x0f, CSW_LEN as u32, [0; 8], Bytes::new()).await?;
        } else if status.status == 0 && status.actual_length == 0 {
            status = self.transfer(Direction::In, bulk_in & 0x0f, CSW_LEN as u32, [0; 8], Bytes::new()).await?;
        }
        if status.status != 0 {
            if status.status == Status::EPIPE.0 {
                self.clear_halt(bulk_in).await?;
            }
            return Err(HostError::Stage { stage: Stage::Status, status: status.status });
        }
        let csw = parse_csw(&status.data, tag)?;
        Ok(Outcome { command: command.result(), data: data_stage, status_stage: status.result(), data_in, csw })
    }

    /// Bulk-Only reset recovery (what usb-storage does after a phase error
    /// or a transport failure): the class reset, then the halt cleared on both endpoints.
    pub async fn reset_recovery(&mut self) -> Result<(), HostError> {
        let found = self.found.as_ref().ok_or(HostError::NotEnumerated)?;
        let (interface, bulk_in, bulk_out) = (found.interface, found.bulk_in, found.bulk_out);
        self.control_out("Bulk-Only reset", setup(0x21, BULK_ONLY_RESET, 0, interface.into(), 0)).await?;
        self.clear_halt(bulk_in).await?;
        self.clear_halt(bulk_out).await
    }

    /// READ(10) of `blocks` blocks from `lba` on LUN 0: the data read.
    pub async fn read10(&mut self, lba: u32, blocks: u16) -> Result<Bytes, HostError> {
        let len = u32::from(blocks) * self.block_len;
        let outcome = self.command(0, &rw10(opcode::READ_10, lba, blocks), Data::In(len)).await?;
        passed(opcode::READ_10, &outcome)?;
        if outcome.data_in.len() != len as usize {
            return Err(HostError::ShortData {
                opcode: opcode::READ_10,
                got: outcome.data_in.len(),
                needed: len as usize,
            });
        }
        Ok(outcome.data_in)
    }

    /// WRITE(10) of `data` (whole blocks) at `lba` on LUN 0.
    pub async fn write10(&mut self, lba: u32, data: &[u8]) -> Result<(), HostError> {
        let block_len = self.block_len as usize;
        let blocks = data.len() / block_len;
        if !data.len().is_multiple_of(block_len) || blocks == 0 || blocks > usize::from(u16::MAX) {
            return Err(HostError::BadRequest(format!(
                "a WRITE(10) of {} bytes: it takes 1..=65535 whole blocks of {block_len}",
                data.len()
            )));
        }
        let cdb = rw10(opcode::WRITE_10, lba, blocks as u16);
        let outcome = self.command(0, &cdb, Data::Out(Bytes::copy_from_slice(data))).await?;
        passed(opcode::WRITE_10, &outcome)
    }

    /// INQUIRY (36 bytes of standard data).
    pub async fn inquiry(&mut self) -> Result<Inquiry, HostError> {
        let cdb = [opcode::INQUIRY, 0, 0, 0, 36, 0];
        let outcome = self.command(0, &cdb, Data::In(36)).await?;
        passed(opcode::INQUIRY, &outcome)?;
        let d = &outcome.data_in;
        if d.len() < 36 {
            return Err(HostError::ShortData { opcode: opcode::INQUIRY, got: d.len(), needed: 36 });
        }
        let text = |range: std::ops::Range<usize>| String::from_utf8_lossy(&d[range]).trim_end().to_owned();
        Ok(Inquiry {
            device_type: d[0] & 0x1f,
            removable: d[1] & 0x80 != 0,
            vendor: text(8..16),
            product: text(16..32),
            revision: text(32..36),
        })
    }

    /// READ CAPACITY(10): the last LBA and the block length. The block
    /// length is then what [`read10`](Self::read10) and [`write10`](Self::write10) use.
    pub async fn read_capacity(&mut self) -> Result<(u32, u32), HostError> {
        let cdb = [opcode::READ_CAPACITY_10, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        let outcome = self.command(0, &cdb, Data::In(8)).await?;
        passed(opcode::READ_CAPACITY_10, &outcome)?;
        let d = &outcome.data_in;
        if d.len() < 8 {
            return Err(HostError::ShortData { opcode: opcode::READ_CAPACITY_10, got: d.len(), needed: 8 });
        }
        let last_lba = u32::from_be_bytes([d[0], d[1], d[2], d[3]]);
        let block_len = u32::from_be_bytes([d[4], d[5], d[6], d[7]]);
        if block_len == 0 {
            return Err(HostError::BadRequest("READ CAPACITY says blocks of 0 bytes".into()));
        }
        self.block_len = block_len;
        Ok((last_lba, block_len))
    }

    /// TEST UNIT READY: `Ok` when the unit is ready.
    pub async fn test_unit_ready(&mut self) -> Result<(), HostError> {
        let outcome = self.command(0, &[opcode::TEST_UNIT_READY, 0, 0, 0, 0, 0], Data::None).await?;
        passed(opcode::TEST_UNIT_READY, &outcome)
    }

    /// REQUEST SENSE (fixed format, 18 bytes): why the last command failed.
    pub async fn request_sense(&mut self) -> Result<Sense, HostError> {
        let outcome = self.command(0, &[opcode::REQUEST_SENSE, 0, 0, 0, 18, 0], Data::In(18)).await?;
        passed(opcode::REQUEST_SENSE, &outcome)?;
        let d = &outcome.data_in;
        if d.len() < 14 {
            return Err(HostError::ShortData { opcode: opcode::REQUEST_SENSE, got: d.len(), needed: 14 });
        }
        Ok(Sense { key: d[2] & 0x0f, asc: d[12], ascq: d[13] })
    }

    /// After a data stage: a stall is cleared and the status read next
    /// (usb-storage's `USB_STOR_XFER_STALLED`); any other failure ends the command.
    async fn after_data(&mut self, endpoint: u8, status: i32) -> Result<(), HostError> {
        match Status(status) {
            Status::OK => Ok(()),
            Status::EPIPE => self.clear_halt(endpoint).await,
            _ => Err(HostError::Stage { stage: Stage::Data, status }),
        }
    }

    /// CLEAR_FEATURE(ENDPOINT_HALT) on `endpoint` (an address with its direction bit).
    async fn clear_halt(&mut self, endpoint: u8) -> Result<(), HostError> {
        self.control_out("CLEAR_FEATURE(ENDPOINT_HALT)", setup(0x02, CLEAR_FEATURE, ENDPOINT_HALT, endpoint.into(), 0))
            .await
    }

    async fn control_in(&mut self, request: &'static str, setup: [u8; 8], len: u32) -> Result<Bytes, HostError> {
        let done = self.transfer(Direction::In, 0, len, setup, Bytes::new()).await?;
        if done.status != 0 {
            return Err(HostError::Control { request, status: done.status });
        }
        Ok(done.data)
    }

    async fn control_out(&mut self, request: &'static str, setup: [u8; 8]) -> Result<(), HostError> {
        let done = self.transfer(Direction::Out, 0, 0, setup, Bytes::new()).await?;
        if done.status != 0 {
            return Err(HostError::Control { request, status: done.status });
        }
        Ok(())
    }

    async fn transfer(
        &mut self,
        direction: Direction,
        ep: u8,
        length: u32,
        setup: [u8; 8],
        data: Bytes,
    ) -> Result<Transfer, HostError> {
        Ok(self.link.transfer(Urb { direction, ep, length, setup, data }).await?)
    }
}

impl Transfer {
    fn result(&self) -> StageResult {
        StageResult { status: self.status, actual_length: self.actual_length }
    }
}

/// The 31-byte CBW.
fn cbw(tag: u32, data: &Data, lun: u8, cdb: &[u8]) -> Bytes {
    let mut raw = [0u8; CBW_LEN];
    raw[0..4].copy_from_slice(&CBW_SIGNATURE.to_le_bytes());
    raw[4..8].copy_from_slice(&tag.to_le_bytes());
    raw[8..12].copy_from_slice(&data.len().to_le_bytes());
    raw[12] = if matches!(data, Data::In(_)) { 0x80 } else { 0 };
    raw[13] = lun & 0x0f;
    raw[14] = cdb.len() as u8;
    raw[15..15 + cdb.len()].copy_from_slice(cdb);
    Bytes::copy_from_slice(&raw)
}

/// A CSW, checked against the tag of the CBW it answers.
fn parse_csw(raw: &[u8], tag: u32) -> Result<Csw, HostError> {
    if raw.len() != CSW_LEN {
        return Err(HostError::BadCsw(format!("{} bytes, not {CSW_LEN}", raw.len())));
    }
    let le = |at: usize| u32::from_le_bytes([raw[at], raw[at + 1], raw[at + 2], raw[at + 3]]);
    if le(0) != CSW_SIGNATURE {
        return Err(HostError::BadCsw(format!("signature {:#010x}, not {CSW_SIGNATURE:#010x}", le(0))));
    }
    if le(4) != tag {
        return Err(HostError::BadCsw(format!("tag {} answers no command (the CBW's was {tag})", le(4))));
    }
    Ok(Csw { tag, residue: le(8), status: raw[12] })
}

/// A READ(10) or WRITE(10) command block.
fn rw10(opcode: u8, lba: u32, blocks: u16) -> [u8; 10] {
    let [l0, l1, l2, l3] = lba.to_be_bytes();
    let [b0, b1] = blocks.to_be_bytes();
    [opcode, 0, l0, l1, l2, l3, 0, b0, b1, 0]
}

/// `Ok` when the CSW says the command passed.
fn passed(opcode: u8, outcome: &Outcome) -> Result<(), HostError> {
    match outcome.csw.status {
        0 => Ok(()),
        status => Err(HostError::CommandFailed { opcode, status, residue: outcome.csw.residue }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BytesMut;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
    use usbwire_proto::urb::{self, ClientMessage, RetSubmit};
    use usbwire_proto::Limits;

    /// One URB the scripted device expects, and its answer.
    struct Step {
        direction: Direction,
        ep: u8,
        setup: [u8; 8],
        status: Status,
        /// IN: the data returned. OUT: ignored (the whole URB is taken).
        data: Bytes,
    }

    fn step(direction: Direction, ep: u8, status: Status, data: Bytes) -> Step {
        Step { direction, ep, setup: [0; 8], status, data }
    }

    const CLEAR_HALT_IN: [u8; 8] = [0x02, 0x01, 0x00, 0x00, 0x81, 0x00, 0x00, 0x00];

    fn clear_halt_in() -> Step {
        Step { direction: Direction::Out, ep: 0, setup: CLEAR_HALT_IN, status: Status::OK, data: Bytes::new() }
    }

    /// Plays the device behind the relay: each URB must be the next step's, and one at a time.
    async fn scripted(mut io: DuplexStream, script: Vec<Step>) {
        let mut input = BytesMut::new();
        let mut seqnum = 0;
        for (at, step) in script.into_iter().enumerate() {
            let submit = loop {
                if let Some(ClientMessage::Submit(submit)) =
                    urb::decode_command(&mut input, &Limits::default(), |_, _| false).unwrap()
                {
                    break submit;
                }
                assert!(io.read_buf(&mut input).await.unwrap() > 0, "the host left before step {at}");
            };
            seqnum += 1;
            assert_eq!(submit.seqnum, seqnum, "seqnums count up by one");
            assert_eq!((submit.direction, submit.ep, submit.setup), (step.direction, step.ep, step.setup), "step {at}");
            let (actual_length, data) = match step.direction {
                Direction::In => (step.data.len() as u32, step.data),
                Direction::Out => (submit.transfer_buffer_length, Bytes::new()),
            };
            let actual_length = if step.status == Status::EPIPE { 0 } else { actual_length };
            let data = if step.status == Status::EPIPE { Bytes::new() } else { data };
            let reply = RetSubmit {
                seqnum: submit.seqnum,
                status: step.status,
                actual_length,
                start_frame: 0,
                number_of_packets: 0,
                error_count: 0,
                data,
                iso_packets: Vec::new(),
            };
            let mut wire = BytesMut::new();
            reply.encode(&mut wire);
            io.write_all(&wire).await.unwrap();
        }
    }

    /// A host whose enumeration found the disk's endpoints (0x81, 0x02).
    fn enumerated(io: DuplexStream) -> Host<Wire<DuplexStream>> {
        let mut host = Host::new(io, 0x0001_0002);
        host.found = Some(Enumerated {
            device: DeviceDescriptor::for_speed(usbwire_device::Speed::HIGH, 0x1209, 0x0003),
            configuration: 1,
            interface: 0,
            bulk_in: 0x81,
            bulk_out: 0x02,
            max_lun: 0,
        });
        host
    }

    fn csw_bytes(tag: u8, status: u8) -> Bytes {
        Bytes::from(vec![b'U', b'S', b'B', b'S', tag, 0, 0, 0, 0, 2, 0, 0, status])
    }

    #[tokio::test]
    async fn a_stalled_data_stage_and_csw_are_cleared_and_the_csw_read_again_as_usb_storage_does() {
        let (ours, theirs) = tokio::io::duplex(1 << 16);
        let script = vec![
            step(Direction::Out, 2, Status::OK, Bytes::new()),
            step(Direction::In, 1, Status::EPIPE, Bytes::new()),
            clear_halt_in(),
            step(Direction::In, 1, Status::EPIPE, Bytes::new()),
            clear_halt_in(),
            step(Direction::In, 1, Status::OK, csw_bytes(1, 1)),
            // The next command: a CSW with another command's tag.
            step(Direction::Out, 2, Status::OK, Bytes::new()),
            step(Direction::In, 1, Status::OK, csw_bytes(7, 0)),
        ];
        let device = tokio::spawn(scripted(theirs, script));
        let mut host = enumerated(ours);
        let outcome = host.command(0, &rw10(opcode::READ_10, 0, 1), Data::In(512)).await.unwrap();
        assert_eq!(outcome.data, Some(StageResult { status: Status::EPIPE.0, actual_length: 0 }));
        assert_eq!(outcome.csw, Csw { tag: 1, residue: 512, status: 1 });
        let bad = host.test_unit_ready().await;
        assert!(matches!(&bad, Err(HostError::BadCsw(why)) if why.contains("tag 7")), "{bad:?}");
        device.await.unwrap();
    }

    #[test]
    fn a_cbw_is_laid_out_as_bulk_only_says() {
        let raw = cbw(7, &Data::In(0x1e000), 0, &rw10(opcode::READ_10, 0x0102_0304, 240));
        assert_eq!(raw.len(), CBW_LEN);
        assert_eq!(&raw[0..4], b"USBC");
        assert_eq!(&raw[4..8], &7u32.to_le_bytes());
        assert_eq!(&raw[8..12], &0x1e000u32.to_le_bytes());
        assert_eq!(raw[12], 0x80);
        assert_eq!(raw[14], 10);
        assert_eq!(&raw[15..25], &[0x28, 0, 1, 2, 3, 4, 0, 0, 240, 0]);
        assert!(raw[25..].iter().all(|&b| b == 0));
        let out = cbw(8, &Data::Out(Bytes::from_static(&[0; 512])), 0, &[0x2a; 10]);
        assert_eq!(out[12], 0, "OUT has bit 7 clear");
    }

    #[test]
    fn a_csw_is_checked_for_length_signature_and_tag() {
        let mut raw = Vec::from(*b"USBS");
        raw.extend_from_slice(&9u32.to_le_bytes());
        raw.extend_from_slice(&512u32.to_le_bytes());
        raw.push(1);
        assert_eq!(parse_csw(&raw, 9).ok(), Some(Csw { tag: 9, residue: 512, status: 1 }));
        assert!(matches!(parse_csw(&raw, 10), Err(HostError::BadCsw(why)) if why.contains("tag")));
        assert!(matches!(parse_csw(&raw[..12], 9), Err(HostError::BadCsw(why)) if why.contains("12 bytes")));
        raw[0] = b'X';
        assert!(matches!(parse_csw(&raw, 9), Err(HostError::BadCsw(why)) if why.contains("signature")));
    }
}
