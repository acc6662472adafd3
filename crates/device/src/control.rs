//! SETUP packets and the standard request constants of USB 2.0 chapter 9.

/// A parsed SETUP packet (the wire form is 8 bytes, fields little-endian).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SetupPacket {
    pub request_type: u8,
    pub request: u8,
    pub value: u16,
    pub index: u16,
    pub length: u16,
}

impl SetupPacket {
    pub fn parse(raw: &[u8; 8]) -> Self {
        Self {
            request_type: raw[0],
            request: raw[1],
            value: u16::from_le_bytes([raw[2], raw[3]]),
            index: u16::from_le_bytes([raw[4], raw[5]]),
            length: u16::from_le_bytes([raw[6], raw[7]]),
        }
    }

    pub fn to_bytes(self) -> [u8; 8] {
        let [v0, v1] = self.value.to_le_bytes();
        let [i0, i1] = self.index.to_le_bytes();
        let [l0, l1] = self.length.to_le_bytes();
        [self.request_type, self.request, v0, v1, i0, i1, l0, l1]
    }

    /// Device-to-host data stage.
    pub fn is_in(self) -> bool {
        self.request_type & 0x80 != 0
    }

    pub fn kind(self) -> RequestKind {
        match (self.request_type >> 5) & 0x03 {
            0 => RequestKind::Standard,
            1 => RequestKind::Class,
            2 => RequestKind::Vendor,
            _ => RequestKind::Reserved,
        }
    }

    pub fn recipient(self) -> Recipient {
        match self.request_type & 0x1f {
            0 => Recipient::Device,
            1 => Recipient::Interface,
            2 => Recipient::Endpoint,
            _ => Recipient::Other,
        }
    }

    /// The descriptor type of a GET_DESCRIPTOR (high byte of wValue).
    pub fn descriptor_type(self) -> u8 {
        (self.value >> 8) as u8
    }

    /// The descriptor index of a GET_DESCRIPTOR (low byte of wValue).
    pub fn descriptor_index(self) -> u8 {
        (self.value & 0xff) as u8
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestKind {
    Standard,
    Class,
    Vendor,
    Reserved,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recipient {
    Device,
    Interface,
    Endpoint,
    Other,
}

pub mod request {
    pub const GET_STATUS: u8 = 0x00;
    pub const CLEAR_FEATURE: u8 = 0x01;
    pub const SET_FEATURE: u8 = 0x03;
    pub const SET_ADDRESS: u8 = 0x05;
    pub const GET_DESCRIPTOR: u8 = 0x06;
    pub const SET_DESCRIPTOR: u8 = 0x07;
    pub const GET_CONFIGURATION: u8 = 0x08;
    pub const SET_CONFIGURATION: u8 = 0x09;
    pub const GET_INTERFACE: u8 = 0x0a;
    pub const SET_INTERFACE: u8 = 0x0b;
    pub const SYNCH_FRAME: u8 = 0x0c;
    /// USB 3: set system exit latency.
    pub const SET_SEL: u8 = 0x30;
    /// USB 3: set isochronous delay.
    pub const SET_ISOCH_DELAY: u8 = 0x31;
}

pub mod feature {
    pub const ENDPOINT_HALT: u16 = 0;
    /// Hub class port feature; `SET_FEATURE(PORT_RESET)` to a hub port is how
    /// Windows USB/IP clients ask the server to reset the device.
    pub const PORT_RESET: u16 = 4;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_get_device_descriptor() {
        let setup = SetupPacket::parse(&[0x80, 0x06, 0x00, 0x01, 0x00, 0x00, 0x12, 0x00]);
        assert!(setup.is_in());
        assert_eq!(setup.kind(), RequestKind::Standard);
        assert_eq!(setup.recipient(), Recipient::Device);
        assert_eq!(setup.descriptor_type(), 1);
        assert_eq!(setup.length, 18);
        assert_eq!(setup.to_bytes(), [0x80, 0x06, 0x00, 0x01, 0x00, 0x00, 0x12, 0x00]);
    }
}
