//! What the server reads from a device process before exporting it: its
//! device, configuration and string descriptors, read with ordinary
//! GET_DESCRIPTOR requests as a host enumerating it would (the device process
//! answers them like any other control request; there is no separate
//! descriptor message).
//!
//! Not for what the importer reads later: its requests pass through as they come.

use std::future::poll_fn;

use bytes::Bytes;
use usbwire_device::control::{request, SetupPacket};
use usbwire_device::descriptor::{self, ConfigurationInfo, DeviceDescriptor};
use usbwire_device::{Device, DeviceSummary, Direction, Speed, Status, TransferFlags, Urb};

/// Configurations read at most (a device may claim up to 255).
pub const MAX_CONFIGURATIONS: u8 = 8;

/// The descriptors of a device process, as read when it connected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Descriptors {
    pub speed: Speed,
    pub device: DeviceDescriptor,
    pub configurations: Vec<ConfigurationInfo>,
    pub manufacturer: String,
    pub product: String,
    pub serial: String,
}

impl Descriptors {
    /// What the server lists: listed as configured with the first
    /// configuration, so `usbip list -r` shows its interfaces.
    pub fn summary(&self) -> DeviceSummary {
        let first = self.configurations.first();
        DeviceSummary {
            speed: self.speed,
            vendor_id: self.device.vendor_id,
            product_id: self.device.product_id,
            bcd_device: self.device.bcd_device,
            class: self.device.class,
            subclass: self.device.subclass,
            protocol: self.device.protocol,
            configuration_value: first.map_or(0, |c| c.value),
            num_configurations: self.device.num_configurations,
            interfaces: first.map(ConfigurationInfo::interface_classes).unwrap_or_default(),
            product: self.product.clone(),
            manufacturer: self.manufacturer.clone(),
            serial: self.serial.clone(),
        }
    }
}

/// Why a device process's descriptors could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EnumerationError {
    /// A GET_DESCRIPTOR the device must answer ended with an error status
    /// (`-32` a stall, `-110` unanswered, `-108` the process went away).
    #[error("GET_DESCRIPTOR({what}) failed with status {status}: the device process must answer it")]
    Failed { what: &'static str, status: i32 },
    /// The answer is not a descriptor of that type.
    #[error("the {what} descriptor the device process sent is malformed ({len} bytes)")]
    Malformed { what: &'static str, len: usize },
}

/// Reads the descriptors through `device` (nothing else may be in flight on it).
pub async fn enumerate<D: Device>(device: &mut D, speed: Speed) -> Result<Descriptors, EnumerationError> {
    let mut reader = Reader { device, seqnum: 0 };
    let raw = reader.get(descriptor::DEVICE, 0, 0, 18, "device").await?;
    let device_descriptor =
        DeviceDescriptor::parse(&raw).ok_or(EnumerationError::Malformed { what: "device", len: raw.len() })?;
    let mut configurations = Vec::new();
    for index in 0..device_descriptor.num_configurations.min(MAX_CONFIGURATIONS) {
        let head = reader.get(descriptor::CONFIGURATION, index, 0, 9, "configuration").await?;
        let malformed = |len| EnumerationError::Malformed { what: "configuration", len };
        if head.len() < 4 {
            return Err(malformed(head.len()));
        }
        let total = u16::from_le_bytes([head[2], head[3]]);
        let whole = reader.get(descriptor::CONFIGURATION, index, 0, total, "configuration").await?;
        configurations.push(ConfigurationInfo::parse(&whole).ok_or_else(|| malformed(whole.len()))?);
    }
    // Strings are optional: a device without them stalls (or answers nothing useful).
    let mut strings = [String::new(), String::new(), String::new()];
    let languages = reader.get(descriptor::STRING, 0, 0, 255, "string languages").await.unwrap_or_default();
    if let Some(pair) = languages.get(2..4) {
        let language = u16::from_le_bytes([pair[0], pair[1]]);
        let indexes =
            [device_descriptor.manufacturer_index, device_descriptor.product_index, device_descriptor.serial_index];
        for (text, index) in strings.iter_mut().zip(indexes) {
            if index != 0 {
                let raw = reader.get(descriptor::STRING, index, language, 255, "string").await.unwrap_or_default();
                *text = descriptor::parse_string(&raw).unwrap_or_default();
            }
        }
    }
    let [manufacturer, product, serial] = strings;
    Ok(Descriptors { speed, device: device_descriptor, configurations, manufacturer, product, serial })
}

/// Control requests, one at a time, through the device.
struct Reader<'a, D> {
    device: &'a mut D,
    seqnum: u32,
}

impl<D: Device> Reader<'_, D> {
    /// GET_DESCRIPTOR(`kind`, `index`) in `language`, up to `length` bytes.
    async fn get(
        &mut self,
        kind: u8,
        index: u8,
        language: u16,
        length: u16,
        what: &'static str,
    ) -> Result<Bytes, EnumerationError> {
        self.seqnum += 1;
        let setup = SetupPacket {
            request_type: 0x80,
            request: request::GET_DESCRIPTOR,
            value: u16::from(kind) << 8 | u16::from(index),
            index: language,
            length,
        };
        let (device, seqnum) = (&mut *self.device, self.seqnum);
        device.submit(Urb {
            seqnum,
            endpoint: 0,
            direction: Direction::In,
            setup: setup.to_bytes(),
            flags: TransferFlags(0),
            length: u32::from(setup.length),
            data: Bytes::new(),
            start_frame: 0,
            interval: 0,
            number_of_packets: 0,
            iso_packets: Vec::new(),
        });
        let done = poll_fn(|cx| device.poll_complete(cx)).await;
        if done.status != Status::OK {
            return Err(EnumerationError::Failed { what, status: done.status.0 });
        }
        Ok(done.data)
    }
}
