//! The protocol's named numbers: which [`Side`] sends, the capability bits
//! of a hello ([`Caps`]), the packet types with the size of each one's type
//! header and who may send it ([`PacketType`]), a transfer's [`Status`], and
//! the largest packet the reference parser takes.
//!
//! It sits below the packets, the codec and the usb-host core. It is not for
//! parsing or writing packets (`packet`, `codec`).

/// Which end of a usbredir connection a packet comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The side with the device (usbredirhost, `usbredirect`, our bridge).
    Host,
    /// The side with the virtual machine (QEMU's `usb-redir`).
    Guest,
}

impl Side {
    pub fn other(self) -> Self {
        match self {
            Self::Host => Self::Guest,
            Self::Guest => Self::Host,
        }
    }
}

/// The capability bits of a hello (`caps[0]`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Caps(pub u32);

impl Caps {
    pub const BULK_STREAMS: u32 = 0;
    pub const CONNECT_DEVICE_VERSION: u32 = 1;
    pub const FILTER: u32 = 2;
    pub const DEVICE_DISCONNECT_ACK: u32 = 3;
    pub const EP_INFO_MAX_PACKET_SIZE: u32 = 4;
    pub const IDS_64: u32 = 5;
    pub const BULK_LENGTH_32: u32 = 6;
    pub const BULK_RECEIVING: u32 = 7;

    pub fn with(self, bit: u32) -> Self {
        Self(self.0 | 1 << bit)
    }

    pub fn has(self, bit: u32) -> bool {
        self.0 & (1 << bit) != 0
    }

    /// What is in effect: a capability counts only when both sides announce it.
    pub fn both(self, other: Self) -> Self {
        Self(self.0 & other.0)
    }
}

/// A packet type (`usb_redir_*`), kept as a number so unknown ones can be named in errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PacketType(pub u32);

impl PacketType {
    pub const HELLO: Self = Self(0);
    pub const DEVICE_CONNECT: Self = Self(1);
    pub const DEVICE_DISCONNECT: Self = Self(2);
    pub const RESET: Self = Self(3);
    pub const INTERFACE_INFO: Self = Self(4);
    pub const EP_INFO: Self = Self(5);
    pub const SET_CONFIGURATION: Self = Self(6);
    pub const GET_CONFIGURATION: Self = Self(7);
    pub const CONFIGURATION_STATUS: Self = Self(8);
    pub const SET_ALT_SETTING: Self = Self(9);
    pub const GET_ALT_SETTING: Self = Self(10);
    pub const ALT_SETTING_STATUS: Self = Self(11);
    pub const START_ISO_STREAM: Self = Self(12);
    pub const STOP_ISO_STREAM: Self = Self(13);
    pub const ISO_STREAM_STATUS: Self = Self(14);
    pub const START_INTERRUPT_RECEIVING: Self = Self(15);
    pub const STOP_INTERRUPT_RECEIVING: Self = Self(16);
    pub const INTERRUPT_RECEIVING_STATUS: Self = Self(17);
    pub const ALLOC_BULK_STREAMS: Self = Self(18);
    pub const FREE_BULK_STREAMS: Self = Self(19);
    pub const BULK_STREAMS_STATUS: Self = Self(20);
    pub const CANCEL_DATA_PACKET: Self = Self(21);
    pub const FILTER_REJECT: Self = Self(22);
    pub const FILTER_FILTER: Self = Self(23);
    pub const DEVICE_DISCONNECT_ACK: Self = Self(24);
    pub const START_BULK_RECEIVING: Self = Self(25);
    pub const STOP_BULK_RECEIVING: Self = Self(26);
    pub const BULK_RECEIVING_STATUS: Self = Self(27);
    pub const CONTROL_PACKET: Self = Self(100);
    pub const BULK_PACKET: Self = Self(101);
    pub const ISO_PACKET: Self = Self(102);
    pub const INTERRUPT_PACKET: Self = Self(103);
    pub const BUFFERED_BULK_PACKET: Self = Self(104);

    /// The size of this type's header when `sender` sends it with `caps` in
    /// effect; `None` when `sender` may not send it at all.
    pub fn header_len(self, sender: Side, caps: Caps) -> Option<usize> {
        use Side::{Guest, Host};
        let (from, len) = match self {
            Self::HELLO => (None, 64),
            Self::DEVICE_CONNECT => (Some(Host), if caps.has(Caps::CONNECT_DEVICE_VERSION) { 10 } else { 8 }),
            Self::DEVICE_DISCONNECT => (Some(Host), 0),
            Self::RESET => (Some(Guest), 0),
            Self::INTERFACE_INFO => (Some(Host), 132),
            Self::EP_INFO => (
                Some(Host),
                if caps.has(Caps::BULK_STREAMS) {
                    288
                } else if caps.has(Caps::EP_INFO_MAX_PACKET_SIZE) {
                    160
                } else {
                    96
                },
            ),
            Self::SET_CONFIGURATION => (Some(Guest), 1),
            Self::GET_CONFIGURATION => (Some(Guest), 0),
            Self::CONFIGURATION_STATUS => (Some(Host), 2),
            Self::SET_ALT_SETTING => (Some(Guest), 2),
            Self::GET_ALT_SETTING => (Some(Guest), 1),
            Self::ALT_SETTING_STATUS => (Some(Host), 3),
            Self::START_ISO_STREAM => (Some(Guest), 3),
            Self::STOP_ISO_STREAM => (Some(Guest), 1),
            Self::ISO_STREAM_STATUS => (Some(Host), 2),
            Self::START_INTERRUPT_RECEIVING => (Some(Guest), 1),
            Self::STOP_INTERRUPT_RECEIVING => (Some(Guest), 1),
            Self::INTERRUPT_RECEIVING_STATUS => (Some(Host), 2),
            Self::ALLOC_BULK_STREAMS => (Some(Guest), 8),
            Self::FREE_BULK_STREAMS => (Some(Guest), 4),
            Self::BULK_STREAMS_STATUS => (Some(Host), 9),
            Self::CANCEL_DATA_PACKET => (Some(Guest), 0),
            Self::FILTER_REJECT => (Some(Guest), 0),
            Self::FILTER_FILTER => (None, 0),
            Self::DEVICE_DISCONNECT_ACK => (Some(Guest), 0),
            Self::START_BULK_RECEIVING => (Some(Guest), 10),
            Self::STOP_BULK_RECEIVING => (Some(Guest), 5),
            Self::BULK_RECEIVING_STATUS => (Some(Host), 6),
            Self::CONTROL_PACKET => (None, 10),
            Self::BULK_PACKET => (None, if caps.has(Caps::BULK_LENGTH_32) { 10 } else { 8 }),
            Self::ISO_PACKET | Self::INTERRUPT_PACKET => (None, 4),
            Self::BUFFERED_BULK_PACKET => (Some(Host), 10),
            _ => return None,
        };
        from.is_none_or(|from| from == sender).then_some(len)
    }
}

/// A transfer's outcome (`usb_redir_success` …); unknown values are kept.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Status(pub u8);

impl Status {
    pub const SUCCESS: Self = Self(0);
    pub const CANCELLED: Self = Self(1);
    pub const INVAL: Self = Self(2);
    pub const IOERROR: Self = Self(3);
    pub const STALL: Self = Self(4);
    pub const TIMEOUT: Self = Self(5);
    pub const BABBLE: Self = Self(6);
}

/// The largest packet the reference parser takes (`MAX_PACKET_SIZE`, 128 MiB of data plus headers).
pub const MAX_PACKET_LEN: u32 = 1024 + 128 * 1024 * 1024;
