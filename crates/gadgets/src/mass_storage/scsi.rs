//! The SCSI commands a USB disk answers (SPC-4 / SBC-3 subset), over an
//! image file, with fixed-format sense data for every failure.

use std::fs::File;
use std::io;
use std::ops::RangeInclusive;
use std::os::unix::fs::FileExt;

use bytes::{Bytes, BytesMut};
use tracing::debug;

/// Bytes per logical block.
pub const BLOCK_SIZE: u64 = 512;

/// Sense key, additional sense code and qualifier of the last failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Sense {
    key: u8,
    asc: u8,
    ascq: u8,
}

impl Sense {
    pub(super) const NONE: Self = Self { key: 0, asc: 0, ascq: 0 };
    pub(super) const INVALID_OPCODE: Self = Self { key: 0x05, asc: 0x20, ascq: 0 };
    pub(super) const LBA_OUT_OF_RANGE: Self = Self { key: 0x05, asc: 0x21, ascq: 0 };
    pub(super) const INVALID_FIELD_IN_CDB: Self = Self { key: 0x05, asc: 0x24, ascq: 0 };
    pub(super) const LUN_NOT_SUPPORTED: Self = Self { key: 0x05, asc: 0x25, ascq: 0 };
    pub(super) const WRITE_PROTECTED: Self = Self { key: 0x07, asc: 0x27, ascq: 0 };
    pub(super) const READ_ERROR: Self = Self { key: 0x03, asc: 0x11, ascq: 0 };
    pub(super) const WRITE_ERROR: Self = Self { key: 0x03, asc: 0x0c, ascq: 0 };
}

/// What a command asks of the transport.
#[derive(Debug)]
pub(super) enum Outcome {
    /// Send these bytes to the host.
    DataIn(Bytes),
    /// Take `len` bytes from the host and write them at `offset`.
    Write { offset: u64, len: u64 },
    /// Nothing to transfer (success or failure is in the sense data).
    Done,
}

pub(super) mod opcode {
    pub(crate) const TEST_UNIT_READY: u8 = 0x00;
    pub(crate) const REQUEST_SENSE: u8 = 0x03;
    pub(crate) const INQUIRY: u8 = 0x12;
    pub(crate) const MODE_SENSE_6: u8 = 0x1a;
    pub(crate) const START_STOP_UNIT: u8 = 0x1b;
    pub(crate) const PREVENT_ALLOW_MEDIUM_REMOVAL: u8 = 0x1e;
    pub(crate) const READ_CAPACITY_10: u8 = 0x25;
    pub(crate) const READ_10: u8 = 0x28;
    pub(crate) const WRITE_10: u8 = 0x2a;
    pub(crate) const VERIFY_10: u8 = 0x2f;
    pub(crate) const SYNCHRONIZE_CACHE_10: u8 = 0x35;
    pub(crate) const MODE_SENSE_10: u8 = 0x5a;
    pub(crate) const READ_16: u8 = 0x88;
    pub(crate) const WRITE_16: u8 = 0x8a;
    pub(crate) const SYNCHRONIZE_CACHE_16: u8 = 0x91;
    pub(crate) const SERVICE_ACTION_IN_16: u8 = 0x9e;
    pub(crate) const READ_CAPACITY_16: u8 = 0x10;
}

/// The logical unit: an image file and its sense state.
#[derive(Debug)]
pub(super) struct Disk {
    file: File,
    blocks: u64,
    read_only: bool,
    serial: String,
    sense: Sense,
    /// Blocks whose READ fails with MEDIUM ERROR.
    bad: Option<RangeInclusive<u64>>,
}

impl Disk {
    pub(super) fn new(
        file: File,
        blocks: u64,
        read_only: bool,
        serial: String,
        bad: Option<RangeInclusive<u64>>,
    ) -> Self {
        Self { file, blocks, read_only, serial, sense: Sense::NONE, bad }
    }

    pub(super) fn blocks(&self) -> u64 {
        self.blocks
    }

    /// CSW status for the last command: 0 passed, 1 failed.
    pub(super) fn status(&self) -> u8 {
        u8::from(self.sense != Sense::NONE)
    }

    pub(super) fn set_sense(&mut self, sense: Sense) {
        self.sense = sense;
    }

    pub(super) fn no_such_lun(&mut self) -> Outcome {
        self.sense = Sense::LUN_NOT_SUPPORTED;
        Outcome::Done
    }

    pub(super) fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.file.write_all_at(data, offset)
    }

    /// Runs one command. Failures set the sense data and return [`Outcome::Done`].
    pub(super) fn execute(&mut self, cdb: &[u8]) -> Outcome {
        let op = cdb[0];
        if op != opcode::REQUEST_SENSE {
            self.sense = Sense::NONE;
        }
        let result = match op {
            opcode::TEST_UNIT_READY
            | opcode::PREVENT_ALLOW_MEDIUM_REMOVAL
            | opcode::START_STOP_UNIT
            | opcode::VERIFY_10 => Ok(Outcome::Done),
            opcode::REQUEST_SENSE => Ok(self.request_sense(cdb)),
            opcode::INQUIRY => self.inquiry(cdb),
            opcode::READ_CAPACITY_10 => Ok(self.read_capacity_10()),
            opcode::SERVICE_ACTION_IN_16 if field(cdb, 1, 1) & 0x1f == u64::from(opcode::READ_CAPACITY_16) => {
                Ok(self.read_capacity_16(cdb))
            }
            opcode::READ_10 => self.read(field(cdb, 2, 4), field(cdb, 7, 2)),
            opcode::READ_16 => self.read(field(cdb, 2, 8), field(cdb, 10, 4)),
            opcode::WRITE_10 => self.write(field(cdb, 2, 4), field(cdb, 7, 2)),
            opcode::WRITE_16 => self.write(field(cdb, 2, 8), field(cdb, 10, 4)),
            opcode::MODE_SENSE_6 => self.mode_sense(cdb, false),
            opcode::MODE_SENSE_10 => self.mode_sense(cdb, true),
            opcode::SYNCHRONIZE_CACHE_10 | opcode::SYNCHRONIZE_CACHE_16 => match self.file.sync_data() {
                Ok(()) => Ok(Outcome::Done),
                Err(error) => {
                    debug!(%error, "fdatasync failed");
                    Err(Sense::WRITE_ERROR)
                }
            },
            _ => {
                debug!(opcode = format_args!("{op:#04x}"), "unsupported SCSI command");
                Err(Sense::INVALID_OPCODE)
            }
        };
        result.unwrap_or_else(|sense| {
            self.sense = sense;
            Outcome::Done
        })
    }

    fn request_sense(&mut self, cdb: &[u8]) -> Outcome {
        let sense = std::mem::replace(&mut self.sense, Sense::NONE);
        let mut data = vec![0u8; 18];
        data[0] = 0x70; // current error, fixed format
        data[2] = sense.key;
        data[7] = 10; // additional sense length
        data[12] = sense.asc;
        data[13] = sense.ascq;
        data.truncate(usize::from(cdb.get(4).copied().unwrap_or(18)));
        Outcome::DataIn(data.into())
    }

    fn inquiry(&self, cdb: &[u8]) -> Result<Outcome, Sense> {
        let allocation = field(cdb, 3, 2) as usize;
        let evpd = field(cdb, 1, 1) & 1 != 0;
        let page = field(cdb, 2, 1) as u8;
        let mut data = if !evpd {
            if page != 0 {
                return Err(Sense::INVALID_FIELD_IN_CDB);
            }
            let mut d = vec![0x00, 0x80, 0x06, 0x02, 31, 0, 0, 0];
            d.extend_from_slice(b"usbwire ");
            d.extend_from_slice(b"virtual disk    ");
            d.extend_from_slice(b"0.1 ");
            d
        } else {
            match page {
                // Supported VPD pages.
                0x00 => vec![0x00, 0x00, 0x00, 3, 0x00, 0x80, 0x83],
                // Unit serial number.
                0x80 => {
                    let mut d = vec![0x00, 0x80, 0x00, self.serial.len() as u8];
                    d.extend_from_slice(self.serial.as_bytes());
                    d
                }
                // Device identification: one T10 vendor id designator.
                0x83 => {
                    let mut designator = b"usbwire ".to_vec();
                    designator.extend_from_slice(self.serial.as_bytes());
                    let mut d =
                        vec![0x00, 0x83, 0x00, (4 + designator.len()) as u8, 0x02, 0x01, 0x00, designator.len() as u8];
                    d.extend_from_slice(&designator);
                    d
                }
                _ => return Err(Sense::INVALID_FIELD_IN_CDB),
            }
        };
        data.truncate(allocation);
        Ok(Outcome::DataIn(data.into()))
    }

    fn read_capacity_10(&self) -> Outcome {
        let last = u32::try_from(self.blocks - 1).unwrap_or(u32::MAX);
        let mut data = last.to_be_bytes().to_vec();
        data.extend_from_slice(&(BLOCK_SIZE as u32).to_be_bytes());
        Outcome::DataIn(data.into())
    }

    fn read_capacity_16(&self, cdb: &[u8]) -> Outcome {
        let mut data = vec![0u8; 32];
        data[0..8].copy_from_slice(&(self.blocks - 1).to_be_bytes());
        data[8..12].copy_from_slice(&(BLOCK_SIZE as u32).to_be_bytes());
        data.truncate(field(cdb, 10, 4) as usize);
        Outcome::DataIn(data.into())
    }

    fn range(&self, lba: u64, count: u64) -> Result<(u64, u64), Sense> {
        match lba.checked_add(count) {
            Some(end) if end <= self.blocks => Ok((lba * BLOCK_SIZE, count * BLOCK_SIZE)),
            _ => Err(Sense::LBA_OUT_OF_RANGE),
        }
    }

    fn read(&self, lba: u64, count: u64) -> Result<Outcome, Sense> {
        let (offset, len) = self.range(lba, count)?;
        if let Some(bad) = &self.bad {
            if count > 0 && lba <= *bad.end() && lba + count > *bad.start() {
                debug!(lba, count, first_bad = bad.start(), "read of a bad block");
                return Err(Sense::READ_ERROR);
            }
        }
        // The transport caps what it sends at the CBW's length; never read more
        // than the transfer limit into memory.
        let len = usize::try_from(len).map_err(|_| Sense::INVALID_FIELD_IN_CDB)?;
        if len > usbwire_proto::Limits::default().max_transfer_length as usize {
            return Err(Sense::INVALID_FIELD_IN_CDB);
        }
        read_block_range(&self.file, offset, len).map(Outcome::DataIn).map_err(|error| {
            debug!(%error, "image read failed");
            Sense::READ_ERROR
        })
    }

    fn write(&self, lba: u64, count: u64) -> Result<Outcome, Sense> {
        if self.read_only {
            return Err(Sense::WRITE_PROTECTED);
        }
        let (offset, len) = self.range(lba, count)?;
        Ok(Outcome::Write { offset, len })
    }

    fn mode_sense(&self, cdb: &[u8], ten: bool) -> Result<Outcome, Sense> {
        let page = field(cdb, 2, 1) as u8 & 0x3f;
        let subpage = field(cdb, 3, 1);
        // Caching page: write cache enabled (WCE), so hosts send SYNCHRONIZE CACHE.
        let caching = [0x08, 0x12, 0x04, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        let pages: &[u8] = match (page, subpage) {
            (0x08 | 0x3f, 0) | (0x3f, 0xff) => &caching,
            _ => return Err(Sense::INVALID_FIELD_IN_CDB),
        };
        let device_specific = if self.read_only { 0x80 } else { 0x00 };
        let (mut data, allocation) = if ten {
            let len = (6 + pages.len()) as u16;
            let mut d = len.to_be_bytes().to_vec();
            d.extend_from_slice(&[0, device_specific, 0, 0, 0, 0]);
            (d, field(cdb, 7, 2) as usize)
        } else {
            (vec![(3 + pages.len()) as u8, 0, device_specific, 0], field(cdb, 4, 1) as usize)
        };
        data.extend_from_slice(pages);
        data.truncate(allocation);
        Ok(Outcome::DataIn(data.into()))
    }
}

/// A big-endian field of `len` bytes at `at` (missing bytes read as zero).
fn field(cdb: &[u8], at: usize, len: usize) -> u64 {
    (at..at + len).fold(0u64, |v, i| (v << 8) | u64::from(cdb.get(i).copied().unwrap_or(0)))
}

/// Reads `len` bytes at `offset` into a fresh buffer.
fn read_block_range(file: &File, offset: u64, len: usize) -> io::Result<Bytes> {
    let mut buf = BytesMut::zeroed(len);
    file.read_exact_at(&mut buf, offset)?;
    Ok(buf.freeze())
}
