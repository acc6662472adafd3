//! Small wire-level value types shared by the OP and URB phases.

use std::fmt;

/// Transfer direction as the URB header carries it (`USBIP_DIR_OUT` / `USBIP_DIR_IN`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Host to device (`USBIP_DIR_OUT`, 0).
    Out,
    /// Device to host (`USBIP_DIR_IN`, 1).
    In,
}

impl Direction {
    /// The wire value.
    pub fn to_u32(self) -> u32 {
        match self {
            Self::Out => 0,
            Self::In => 1,
        }
    }

    /// Parses the wire value; anything but 0 or 1 is rejected.
    pub fn from_u32(value: u32) -> Option<Self> {
        match value {
            0 => Some(Self::Out),
            1 => Some(Self::In),
            _ => None,
        }
    }

    /// The direction bit of an endpoint address (`0x80` for IN).
    pub fn from_endpoint_address(address: u8) -> Self {
        if address & 0x80 != 0 {
            Self::In
        } else {
            Self::Out
        }
    }
}

/// `enum usb_device_speed` as carried in `usbip_usb_device.speed` and the vhci `attach` file.
///
/// A newtype so that values we do not know survive a round trip.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Speed(pub u32);

impl Speed {
    pub const UNKNOWN: Self = Self(0);
    pub const LOW: Self = Self(1);
    pub const FULL: Self = Self(2);
    pub const HIGH: Self = Self(3);
    pub const WIRELESS: Self = Self(4);
    pub const SUPER: Self = Self(5);
    pub const SUPER_PLUS: Self = Self(6);

    /// The name `usbip list` and sysfs use.
    pub fn name(self) -> &'static str {
        match self {
            Self::LOW => "low",
            Self::FULL => "full",
            Self::HIGH => "high",
            Self::WIRELESS => "wireless",
            Self::SUPER => "super",
            Self::SUPER_PLUS => "super-plus",
            _ => "unknown",
        }
    }

    /// Whether vhci puts a device of this speed on its SuperSpeed root hub.
    pub fn is_superspeed(self) -> bool {
        self.0 >= Self::SUPER.0 && self.0 <= Self::SUPER_PLUS.0
    }

    /// The speed to report to a client: vhci before Linux 6.12 rejects SUPER_PLUS,
    /// so (like usbipd-win) anything SuperSpeed or faster is reported as SUPER.
    pub fn for_vhci(self) -> Self {
        if self == Self::SUPER_PLUS {
            Self::SUPER
        } else {
            self
        }
    }
}

impl fmt::Debug for Speed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            "unknown" => write!(f, "Speed({})", self.0),
            name => f.write_str(name),
        }
    }
}

/// A URB status: 0 or a negative Linux errno, as `RET_SUBMIT`, `RET_UNLINK`
/// and isochronous descriptors carry it (even from Windows peers).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Status(pub i32);

impl Status {
    pub const OK: Self = Self(0);
    /// URB killed synchronously (never sent by the kernel stub).
    pub const ENOENT: Self = Self(-2);
    /// Partial isochronous transfer.
    pub const EXDEV: Self = Self(-18);
    /// Device gone.
    pub const ENODEV: Self = Self(-19);
    /// Bad parameters.
    pub const EINVAL: Self = Self(-22);
    /// Endpoint stalled.
    pub const EPIPE: Self = Self(-32);
    /// No response.
    pub const ETIME: Self = Self(-62);
    /// Bit-stuffing or protocol error.
    pub const EPROTO: Self = Self(-71);
    /// Babble: the device sent more than the buffer holds.
    pub const EOVERFLOW: Self = Self(-75);
    /// CRC error.
    pub const EILSEQ: Self = Self(-84);
    /// URB unlinked asynchronously.
    pub const ECONNRESET: Self = Self(-104);
    /// Host controller or device shut down.
    pub const ESHUTDOWN: Self = Self(-108);
    /// Timeout.
    pub const ETIMEDOUT: Self = Self(-110);
    /// Short packet while `URB_SHORT_NOT_OK` was set.
    pub const EREMOTEIO: Self = Self(-121);

    pub fn is_ok(self) -> bool {
        self.0 == 0
    }

    fn name(self) -> Option<&'static str> {
        Some(match self {
            Self::OK => "ok",
            Self::ENOENT => "ENOENT",
            Self::EXDEV => "EXDEV",
            Self::ENODEV => "ENODEV",
            Self::EINVAL => "EINVAL",
            Self::EPIPE => "EPIPE (stall)",
            Self::ETIME => "ETIME",
            Self::EPROTO => "EPROTO",
            Self::EOVERFLOW => "EOVERFLOW (babble)",
            Self::EILSEQ => "EILSEQ",
            Self::ECONNRESET => "ECONNRESET (unlinked)",
            Self::ESHUTDOWN => "ESHUTDOWN",
            Self::ETIMEDOUT => "ETIMEDOUT",
            Self::EREMOTEIO => "EREMOTEIO (short)",
            _ => return None,
        })
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => f.write_str(name),
            None => write!(f, "Status({})", self.0),
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[inline]
pub(crate) fn be_u16(bytes: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([bytes[at], bytes[at + 1]])
}

#[inline]
pub(crate) fn be_u32(bytes: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

#[inline]
pub(crate) fn be_i32(bytes: &[u8], at: usize) -> i32 {
    be_u32(bytes, at) as i32
}

#[inline]
pub(crate) fn put_u32(out: &mut [u8], at: usize, value: u32) {
    out[at..at + 4].copy_from_slice(&value.to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn superspeed_plus_is_reported_as_super() {
        assert_eq!(Speed::SUPER_PLUS.for_vhci(), Speed::SUPER);
        assert_eq!(Speed::HIGH.for_vhci(), Speed::HIGH);
        assert!(Speed::SUPER_PLUS.is_superspeed());
        assert!(!Speed::HIGH.is_superspeed());
    }

    #[test]
    fn unknown_values_survive() {
        assert_eq!(format!("{:?}", Speed(9)), "Speed(9)");
        assert_eq!(format!("{:?}", Status(-999)), "Status(-999)");
        assert_eq!(Direction::from_u32(2), None);
    }
}
