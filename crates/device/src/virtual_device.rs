//! `VirtualDevice`: the standard half of every emulated device.
//!
//! It answers chapter-9 requests on ep0 from a [`DescriptorSet`], keeps the
//! configuration and alt-setting state, checks that data URBs name an endpoint
//! of the current configuration, and hands everything class-specific to a
//! [`Function`]. Requests the Linux stub traps (SET_CONFIGURATION,
//! SET_INTERFACE, CLEAR_FEATURE(ENDPOINT_HALT), the hub-class port reset) are
//! handled here the same way, so a virtual device behaves like a real one
//! behind usbip-host.

use std::task::{Context, Poll};

use bytes::Bytes;
use tracing::{debug, trace};

use crate::control::{feature, request, Recipient, RequestKind, SetupPacket};
use crate::descriptor::{self, ConfigurationInfo, DeviceDescriptor};
use crate::device::{Device, DeviceSummary};
use crate::{Completion, CompletionQueue, Direction, Speed, Status, TransferType, Urb};

/// Everything a device says about itself through GET_DESCRIPTOR.
#[derive(Clone, Debug)]
pub struct DescriptorSet {
    pub speed: Speed,
    pub device: DeviceDescriptor,
    /// The whole configuration 1 (configuration, interfaces, class descriptors, endpoints).
    pub configuration: Vec<u8>,
    /// String descriptors 1.. (index 0, the language list, is implied).
    pub strings: Vec<String>,
    /// Present for SuperSpeed devices.
    pub bos: Option<Vec<u8>>,
}

impl DescriptorSet {
    /// A set with the BOS a SuperSpeed device needs added automatically.
    pub fn new(speed: Speed, device: DeviceDescriptor, configuration: Vec<u8>, strings: Vec<String>) -> Self {
        let bos = speed.is_superspeed().then(descriptor::superspeed_bos);
        Self { speed, device, configuration, strings, bos }
    }
}

/// What a function answers to a class or vendor control request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ControlReply {
    /// IN: the data (cut to wLength by the caller). OUT: an empty vector acknowledges.
    Data(Vec<u8>),
    /// Protocol stall: the request is not supported.
    Stall,
}

/// The class-specific part of a virtual device.
///
/// Data-endpoint URBs reach [`submit`](Self::submit) only after the endpoint
/// was checked to exist in the configuration.
pub trait Function: Send + 'static {
    fn descriptors(&self) -> &DescriptorSet;

    /// A class or vendor request on ep0 (and GET_DESCRIPTOR addressed to an
    /// interface, such as the HID report descriptor). `data` is the OUT data stage.
    fn control(&mut self, setup: &SetupPacket, data: &[u8]) -> ControlReply {
        let _ = (setup, data);
        ControlReply::Stall
    }

    /// The host selected configuration `value` (0 = unconfigured).
    fn set_configuration(&mut self, value: u8) {
        let _ = value;
    }

    /// SET_INTERFACE; return false to stall an alt setting the function lacks.
    fn set_interface(&mut self, interface: u8, alt_setting: u8) -> bool {
        let _ = interface;
        alt_setting == 0
    }

    /// CLEAR_FEATURE(ENDPOINT_HALT) on `endpoint_address`.
    fn clear_halt(&mut self, endpoint_address: u8) {
        let _ = endpoint_address;
    }

    /// Whether `endpoint_address` is halted (GET_STATUS).
    fn is_halted(&self, endpoint_address: u8) -> bool {
        let _ = endpoint_address;
        false
    }

    /// A URB for a data endpoint of the current configuration.
    fn submit(&mut self, urb: Urb);

    fn poll_complete(&mut self, cx: &mut Context<'_>) -> Poll<Completion>;

    fn cancel(&mut self, seqnum: u32);

    /// Abandon all URBs and return to power-on state.
    fn reset(&mut self);
}

/// Slot of an endpoint address in per-endpoint tables: OUT 1..=15 at 1..=15,
/// IN at 17..=31 (`None` for addresses with reserved bits set).
fn endpoint_index(address: u8) -> Option<usize> {
    (address & 0x70 == 0).then(|| usize::from(address & 0x0f) | if address & 0x80 != 0 { 16 } else { 0 })
}

/// A set of endpoint addresses, one bit each: the URB path checks it on every submit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct EndpointSet(u32);

impl EndpointSet {
    fn insert(&mut self, address: u8) {
        if let Some(index) = endpoint_index(address) {
            self.0 |= 1 << index;
        }
    }

    fn contains(self, address: u8) -> bool {
        endpoint_index(address).is_some_and(|index| self.0 & (1 << index) != 0)
    }

    fn clear(&mut self) {
        self.0 = 0;
    }
}

/// A [`Device`] made of a [`Function`] plus standard chapter-9 behaviour.
pub struct VirtualDevice<F> {
    function: F,
    configuration_value: u8,
    configuration: ConfigurationInfo,
    /// (interface, alt) pairs currently selected, alt 0 if absent.
    alt_settings: Vec<(u8, u8)>,
    /// Endpoint addresses of the current configuration and alt settings.
    active_endpoints: EndpointSet,
    /// The transfer type of every endpoint of the configuration, by [`endpoint_index`].
    endpoint_types: [Option<TransferType>; 32],
    control_done: CompletionQueue,
    device_remote_wakeup: bool,
}

impl<F: Function> VirtualDevice<F> {
    pub fn new(function: F) -> Self {
        let configuration = ConfigurationInfo::parse(&function.descriptors().configuration)
            .expect("a function's own configuration descriptor parses");
        let mut endpoint_types = [None; 32];
        for endpoint in configuration.interfaces.iter().flat_map(|i| i.endpoints.iter()) {
            if let Some(index) = endpoint_index(endpoint.address) {
                endpoint_types[index].get_or_insert(endpoint.transfer_type);
            }
        }
        Self {
            function,
            configuration_value: 0,
            configuration,
            alt_settings: Vec::new(),
            active_endpoints: EndpointSet::default(),
            endpoint_types,
            control_done: CompletionQueue::new(),
            device_remote_wakeup: false,
        }
    }

    pub fn function(&self) -> &F {
        &self.function
    }

    pub fn function_mut(&mut self) -> &mut F {
        &mut self.function
    }

    fn alt_of(&self, interface: u8) -> u8 {
        self.alt_settings.iter().find(|(i, _)| *i == interface).map_or(0, |(_, alt)| *alt)
    }

    fn refresh_endpoints(&mut self) {
        self.active_endpoints.clear();
        if self.configuration_value == 0 {
            return;
        }
        let alts = self.alt_settings.clone();
        let alt_of = |i: u8| alts.iter().find(|(n, _)| *n == i).map_or(0, |(_, a)| *a);
        for endpoint in self.configuration.active_endpoints(alt_of) {
            self.active_endpoints.insert(endpoint.address);
        }
    }

    fn handle_control(&mut self, urb: &Urb) -> Completion {
        let setup = SetupPacket::parse(&urb.setup);
        trace!(?setup, "control request");
        // The data stage direction follows the URB (bmRequestType IN with wLength 0 is OUT).
        let reply = match setup.kind() {
            RequestKind::Standard => self.standard_request(&setup, &urb.data),
            RequestKind::Class
                if setup.request_type == 0x23
                    && setup.request == request::SET_FEATURE
                    && setup.value == feature::PORT_RESET =>
            {
                // What usbip-win clients send to reset the device (the Linux stub resets it).
                debug!("port reset requested by client");
                self.reset_state();
                ControlReply::Data(Vec::new())
            }
            _ => self.function.control(&setup, &urb.data),
        };
        match reply {
            ControlReply::Stall => {
                debug!(?setup, "control request stalled");
                urb.complete_with(Status::EPIPE)
            }
            ControlReply::Data(data) if urb.is_in() => {
                let mut data = Bytes::from(data);
                data.truncate(usize::from(setup.length));
                urb.complete_in(data)
            }
            ControlReply::Data(_) => urb.complete_out(),
        }
    }

    fn standard_request(&mut self, setup: &SetupPacket, data: &[u8]) -> ControlReply {
        let descriptors = self.function.descriptors();
        match (setup.recipient(), setup.request) {
            (Recipient::Device, request::GET_DESCRIPTOR) => {
                let bytes = match setup.descriptor_type() {
                    descriptor::DEVICE => Some(descriptors.device.to_bytes()),
                    descriptor::CONFIGURATION if setup.descriptor_index() == 0 => {
                        Some(descriptors.configuration.clone())
                    }
                    descriptor::STRING => descriptor::string_descriptor(&descriptors.strings, setup.descriptor_index()),
                    descriptor::BOS => descriptors.bos.clone(),
                    descriptor::DEVICE_QUALIFIER if descriptors.speed == Speed::HIGH => {
                        Some(descriptor::device_qualifier(&descriptors.device))
                    }
                    _ => None,
                };
                bytes.map_or(ControlReply::Stall, ControlReply::Data)
            }
            (Recipient::Device, request::SET_ADDRESS) => ControlReply::Data(Vec::new()),
            (Recipient::Device, request::GET_CONFIGURATION) => ControlReply::Data(vec![self.configuration_value]),
            (Recipient::Device, request::SET_CONFIGURATION) => {
                let value = (setup.value & 0xff) as u8;
                if value > 1 {
                    return ControlReply::Stall;
                }
                self.configuration_value = value;
                self.alt_settings.clear();
                self.refresh_endpoints();
                self.function.set_configuration(value);
                ControlReply::Data(Vec::new())
            }
            (Recipient::Device, request::GET_STATUS) => {
                // Bit 0 self powered (no), bit 1 remote wakeup.
                ControlReply::Data(vec![u8::from(self.device_remote_wakeup) << 1, 0])
            }
            (Recipient::Device, request::SET_FEATURE | request::CLEAR_FEATURE) => {
                // Remote wakeup, test mode, and USB 3 U1/U2/LTM enables: accepted.
                if setup.value == 1 {
                    self.device_remote_wakeup = setup.request == request::SET_FEATURE;
                }
                ControlReply::Data(Vec::new())
            }
            (Recipient::Device, request::SET_SEL | request::SET_ISOCH_DELAY) => ControlReply::Data(Vec::new()),
            (Recipient::Interface, request::GET_INTERFACE) => {
                let interface = (setup.index & 0xff) as u8;
                if self.configuration_value == 0 || !self.has_interface(interface) {
                    return ControlReply::Stall;
                }
                ControlReply::Data(vec![self.alt_of(interface)])
            }
            (Recipient::Interface, request::SET_INTERFACE) => {
                let interface = (setup.index & 0xff) as u8;
                let alt = (setup.value & 0xff) as u8;
                let exists =
                    self.configuration.interfaces.iter().any(|i| i.number == interface && i.alt_setting == alt);
                if self.configuration_value == 0 || !exists || !self.function.set_interface(interface, alt) {
                    return ControlReply::Stall;
                }
                self.alt_settings.retain(|(i, _)| *i != interface);
                self.alt_settings.push((interface, alt));
                self.refresh_endpoints();
                ControlReply::Data(Vec::new())
            }
            (Recipient::Interface, request::GET_STATUS) => ControlReply::Data(vec![0, 0]),
            (Recipient::Interface, request::SET_FEATURE | request::CLEAR_FEATURE) => ControlReply::Data(Vec::new()),
            (Recipient::Endpoint, request::GET_STATUS) => {
                let address = (setup.index & 0xff) as u8;
                if address & 0x0f != 0 && !self.active_endpoints.contains(address) {
                    return ControlReply::Stall;
                }
                ControlReply::Data(vec![u8::from(self.function.is_halted(address)), 0])
            }
            (Recipient::Endpoint, request::CLEAR_FEATURE) if setup.value == feature::ENDPOINT_HALT => {
                let address = (setup.index & 0xff) as u8;
                if address & 0x0f != 0 && !self.active_endpoints.contains(address) {
                    return ControlReply::Stall;
                }
                self.function.clear_halt(address);
                ControlReply::Data(Vec::new())
            }
            (Recipient::Interface, request::GET_DESCRIPTOR) => self.function.control(setup, data),
            _ => ControlReply::Stall,
        }
    }

    fn has_interface(&self, interface: u8) -> bool {
        self.configuration.interfaces.iter().any(|i| i.number == interface)
    }

    fn reset_state(&mut self) {
        self.control_done.clear();
        self.configuration_value = 0;
        self.alt_settings.clear();
        self.device_remote_wakeup = false;
        self.refresh_endpoints();
        self.function.reset();
    }
}

impl<F: Function> Device for VirtualDevice<F> {
    fn summary(&self) -> DeviceSummary {
        let d = self.function.descriptors();
        let string =
            |index: u8| usize::from(index).checked_sub(1).and_then(|i| d.strings.get(i)).cloned().unwrap_or_default();
        DeviceSummary {
            speed: d.speed,
            vendor_id: d.device.vendor_id,
            product_id: d.device.product_id,
            bcd_device: d.device.bcd_device,
            class: d.device.class,
            subclass: d.device.subclass,
            protocol: d.device.protocol,
            // Listed as configured with configuration 1, so `usbip list -r` shows the interfaces.
            configuration_value: self.configuration.value,
            num_configurations: d.device.num_configurations,
            interfaces: self
                .configuration
                .interfaces
                .iter()
                .filter(|i| i.alt_setting == 0)
                .map(|i| (i.class, i.subclass, i.protocol))
                .collect(),
            product: string(d.device.product_index),
            manufacturer: string(d.device.manufacturer_index),
            serial: string(d.device.serial_index),
        }
    }

    fn endpoint_type(&self, direction: Direction, number: u8) -> Option<TransferType> {
        if number == 0 {
            return Some(TransferType::Control);
        }
        let address = match direction {
            Direction::In => number | 0x80,
            Direction::Out => number,
        };
        // Answer from the whole configuration: an endpoint's type does not change
        // with the alt setting in any of our functions, and decoding must not
        // depend on state the client may not have caught up with. The server
        // asks for every CMD_SUBMIT, hence the table.
        endpoint_index(address).and_then(|index| self.endpoint_types[index])
    }

    fn submit(&mut self, urb: Urb) {
        if urb.endpoint == 0 {
            let done = self.handle_control(&urb);
            self.control_done.push(done);
            return;
        }
        if !self.active_endpoints.contains(urb.endpoint_address()) {
            debug!(endpoint = urb.endpoint_address(), "urb for an endpoint not in the current configuration");
            self.control_done.push(urb.complete_with(Status::EPIPE));
            return;
        }
        self.function.submit(urb);
    }

    fn poll_complete(&mut self, cx: &mut Context<'_>) -> Poll<Completion> {
        if let Poll::Ready(done) = self.control_done.poll_pop(cx) {
            return Poll::Ready(done);
        }
        self.function.poll_complete(cx)
    }

    fn cancel(&mut self, seqnum: u32) {
        // Control URBs complete at once, so only the function can hold it.
        self.function.cancel(seqnum);
    }

    fn reset(&mut self) {
        self.reset_state();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::descriptor::{ConfigurationBuilder, EndpointSpec};
    use crate::TransferFlags;
    use std::task::Waker;

    /// A bulk-IN function that completes nothing until told, to test the wrapper.
    struct Probe {
        descriptors: DescriptorSet,
        pending: Vec<Urb>,
        done: CompletionQueue,
        halted: bool,
    }

    impl Function for Probe {
        fn descriptors(&self) -> &DescriptorSet {
            &self.descriptors
        }
        fn control(&mut self, setup: &SetupPacket, _data: &[u8]) -> ControlReply {
            if setup.request == 0x42 {
                ControlReply::Data(vec![1, 2, 3, 4])
            } else {
                ControlReply::Stall
            }
        }
        fn clear_halt(&mut self, _endpoint_address: u8) {
            self.halted = false;
        }
        fn is_halted(&self, _endpoint_address: u8) -> bool {
            self.halted
        }
        fn submit(&mut self, urb: Urb) {
            self.pending.push(urb);
        }
        fn poll_complete(&mut self, cx: &mut Context<'_>) -> Poll<Completion> {
            self.done.poll_pop(cx)
        }
        fn cancel(&mut self, seqnum: u32) {
            if let Some(i) = self.pending.iter().position(|u| u.seqnum == seqnum) {
                let urb = self.pending.remove(i);
                self.done.push(urb.complete_with(Status::ECONNRESET));
            }
        }
        fn reset(&mut self) {
            self.pending.clear();
            self.done.clear();
        }
    }

    fn device() -> VirtualDevice<Probe> {
        let speed = Speed::HIGH;
        let configuration = ConfigurationBuilder::new(speed, 100)
            .interface(0, 1, 0xff, 0, 0, 0)
            .endpoint(EndpointSpec::bulk(0x81, speed))
            .build();
        let descriptors = DescriptorSet::new(
            speed,
            DeviceDescriptor::for_speed(speed, 0x1209, 0x0005),
            configuration,
            vec!["maker".into(), "probe".into(), "0001".into()],
        );
        VirtualDevice::new(Probe { descriptors, pending: vec![], done: CompletionQueue::new(), halted: true })
    }

    fn control(seqnum: u32, setup: [u8; 8]) -> Urb {
        let parsed = SetupPacket::parse(&setup);
        Urb {
            seqnum,
            endpoint: 0,
            direction: if parsed.is_in() && parsed.length > 0 { Direction::In } else { Direction::Out },
            setup,
            flags: TransferFlags(0),
            length: u32::from(parsed.length),
            data: Bytes::new(),
            start_frame: 0,
            interval: 0,
            number_of_packets: 0,
            iso_packets: vec![],
        }
    }

    fn next(device: &mut VirtualDevice<Probe>) -> Option<Completion> {
        let mut cx = Context::from_waker(Waker::noop());
        match device.poll_complete(&mut cx) {
            Poll::Ready(done) => Some(done),
            Poll::Pending => None,
        }
    }

    #[test]
    fn enumeration_sequence() {
        let mut dev = device();
        dev.submit(control(1, [0x80, 6, 0, 1, 0, 0, 8, 0]));
        let done = next(&mut dev).unwrap();
        assert_eq!(done.actual_length, 8);
        assert_eq!(&done.data[..4], &[18, 1, 0x00, 0x02]);
        dev.submit(control(2, [0x80, 6, 0, 2, 0, 0, 0xff, 0]));
        let done = next(&mut dev).unwrap();
        assert_eq!(done.actual_length as usize, 9 + 9 + 7);
        dev.submit(control(3, [0x80, 6, 2, 3, 0x09, 0x04, 0xff, 0]));
        assert_eq!(descriptor::parse_string(&next(&mut dev).unwrap().data).unwrap(), "probe");
        dev.submit(control(4, [0x80, 6, 0, 6, 0, 0, 10, 0]));
        assert_eq!(next(&mut dev).unwrap().actual_length, 10);
        dev.submit(control(5, [0x80, 6, 0, 0x0f, 0, 0, 5, 0]));
        assert_eq!(next(&mut dev).unwrap().status, Status::EPIPE, "high speed has no BOS");
    }

    #[test]
    fn data_endpoints_exist_only_when_configured() {
        let mut dev = device();
        let mut bulk = control(10, [0; 8]);
        bulk.endpoint = 1;
        bulk.direction = Direction::In;
        bulk.length = 512;
        dev.submit(bulk.clone());
        assert_eq!(next(&mut dev).unwrap().status, Status::EPIPE);
        dev.submit(control(11, [0x00, 9, 1, 0, 0, 0, 0, 0]));
        assert_eq!(next(&mut dev).unwrap().status, Status::OK);
        dev.submit(bulk.clone());
        assert!(next(&mut dev).is_none(), "pending in the function");
        dev.cancel(10);
        let done = next(&mut dev).unwrap();
        assert_eq!((done.seqnum, done.status), (10, Status::ECONNRESET));
        let mut missing = bulk;
        missing.endpoint = 2;
        dev.submit(missing);
        assert_eq!(next(&mut dev).unwrap().status, Status::EPIPE);
    }

    #[test]
    fn halt_status_and_clear() {
        let mut dev = device();
        dev.submit(control(1, [0x00, 9, 1, 0, 0, 0, 0, 0]));
        next(&mut dev);
        dev.submit(control(2, [0x82, 0, 0, 0, 0x81, 0, 2, 0]));
        assert_eq!(&next(&mut dev).unwrap().data[..], &[1, 0]);
        dev.submit(control(3, [0x02, 1, 0, 0, 0x81, 0, 0, 0]));
        assert_eq!(next(&mut dev).unwrap().status, Status::OK);
        dev.submit(control(4, [0x82, 0, 0, 0, 0x81, 0, 2, 0]));
        assert_eq!(&next(&mut dev).unwrap().data[..], &[0, 0]);
    }

    #[test]
    fn class_requests_reach_the_function_and_unknown_ones_stall() {
        let mut dev = device();
        dev.submit(control(1, [0xc0, 0x42, 0, 0, 0, 0, 2, 0]));
        assert_eq!(&next(&mut dev).unwrap().data[..], &[1, 2]);
        dev.submit(control(2, [0xc0, 0x43, 0, 0, 0, 0, 2, 0]));
        assert_eq!(next(&mut dev).unwrap().status, Status::EPIPE);
    }

    #[test]
    fn reset_unconfigures() {
        let mut dev = device();
        dev.submit(control(1, [0x00, 9, 1, 0, 0, 0, 0, 0]));
        next(&mut dev);
        dev.reset();
        dev.submit(control(2, [0x80, 8, 0, 0, 0, 0, 1, 0]));
        assert_eq!(&next(&mut dev).unwrap().data[..], &[0]);
        assert_eq!(dev.summary().interfaces, vec![(0xff, 0, 0)]);
        assert_eq!(dev.summary().product, "probe");
    }

    #[test]
    fn endpoint_set_tells_directions_apart_and_ignores_reserved_bits() {
        let mut set = EndpointSet::default();
        set.insert(0x81);
        set.insert(0x0f);
        assert!(set.contains(0x81) && set.contains(0x0f));
        assert!(!set.contains(0x01) && !set.contains(0x8f) && !set.contains(0x02));
        assert!(!set.contains(0x91), "reserved bits set: not the same endpoint as 0x81");
        set.insert(0x92);
        assert!(!set.contains(0x82));
        set.clear();
        assert!(!set.contains(0x81));
    }

    #[test]
    fn endpoint_types_come_from_the_configuration() {
        let dev = device();
        assert_eq!(dev.endpoint_type(Direction::In, 1), Some(TransferType::Bulk));
        assert_eq!(dev.endpoint_type(Direction::Out, 1), None);
        assert_eq!(dev.endpoint_type(Direction::In, 2), None);
        assert_eq!(dev.endpoint_type(Direction::Out, 0), Some(TransferType::Control));
        assert_eq!(dev.endpoint_type(Direction::In, 17), None, "no such endpoint number");
    }
}
