//! HID boot keyboard and boot mouse: their descriptors, the HID class
//! requests, and the handles other tasks use to queue input reports.
//!
//! A handle and its device share one small queue of reports behind a mutex
//! (touched a few times per keystroke, never on a bulk data path). The host
//! keeps an interrupt IN URB in flight; the device completes it with the
//! next queued report and leaves it pending while the queue is empty, which
//! is what a real HID device does between key presses. Reports are sent only
//! when something changes: the idle rate is stored and reported but never
//! repeats a report (Linux sets it to 0 for keyboards anyway).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use tracing::{debug, trace};
use usbwire_device::control::{request, Recipient, RequestKind, SetupPacket};
use usbwire_device::descriptor::{self, ConfigurationBuilder, DeviceDescriptor, EndpointSpec};
use usbwire_device::{
    Completion, CompletionQueue, ControlReply, DescriptorSet, Function, Speed, Status, Urb, VirtualDevice,
};

use crate::identity::{MANUFACTURER, VENDOR_ID};

/// The keyboard's product id.
pub const KEYBOARD_PRODUCT_ID: u16 = 0x0001;
/// The mouse's product id.
pub const MOUSE_PRODUCT_ID: u16 = 0x0002;

/// The only endpoint: interrupt IN 1.
const REPORT_ENDPOINT: u8 = 0x81;
/// The HID interface.
const INTERFACE: u16 = 0;
/// At most this many reports wait for the host (a keyboard handle refuses
/// text beyond it; a mouse handle drops movements).
const MAX_QUEUED_REPORTS: usize = 64 * 1024;

/// HID class requests (HID 1.11 §7.2).
mod class {
    pub(super) const GET_REPORT: u8 = 0x01;
    pub(super) const GET_IDLE: u8 = 0x02;
    pub(super) const GET_PROTOCOL: u8 = 0x03;
    pub(super) const SET_REPORT: u8 = 0x09;
    pub(super) const SET_IDLE: u8 = 0x0a;
    pub(super) const SET_PROTOCOL: u8 = 0x0b;
}

/// Report types in the high byte of GET/SET_REPORT's wValue.
const REPORT_TYPE_INPUT: u8 = 1;
const REPORT_TYPE_OUTPUT: u8 = 2;

/// SET_PROTOCOL values.
const PROTOCOL_BOOT: u8 = 0;
const PROTOCOL_REPORT: u8 = 1;

/// The boot keyboard report descriptor of HID 1.11 appendix B.1: an 8-byte
/// input report (modifiers, reserved, six key codes) and a 1-byte output
/// report (five LEDs, three bits padding).
const KEYBOARD_REPORT_DESCRIPTOR: &[u8] = &[
    0x05, 0x01, // Usage Page (Generic Desktop)
    0x09, 0x06, // Usage (Keyboard)
    0xa1, 0x01, // Collection (Application)
    0x05, 0x07, //   Usage Page (Keyboard/Keypad)
    0x19, 0xe0, //   Usage Minimum (Left Control)
    0x29, 0xe7, //   Usage Maximum (Right GUI)
    0x15, 0x00, //   Logical Minimum (0)
    0x25, 0x01, //   Logical Maximum (1)
    0x75, 0x01, //   Report Size (1)
    0x95, 0x08, //   Report Count (8)
    0x81, 0x02, //   Input (Data, Variable, Absolute): modifier bits
    0x95, 0x01, //   Report Count (1)
    0x75, 0x08, //   Report Size (8)
    0x81, 0x01, //   Input (Constant): reserved byte
    0x95, 0x05, //   Report Count (5)
    0x75, 0x01, //   Report Size (1)
    0x05, 0x08, //   Usage Page (LEDs)
    0x19, 0x01, //   Usage Minimum (Num Lock)
    0x29, 0x05, //   Usage Maximum (Kana)
    0x91, 0x02, //   Output (Data, Variable, Absolute): LED bits
    0x95, 0x01, //   Report Count (1)
    0x75, 0x03, //   Report Size (3)
    0x91, 0x01, //   Output (Constant): padding
    0x95, 0x06, //   Report Count (6)
    0x75, 0x08, //   Report Size (8)
    0x15, 0x00, //   Logical Minimum (0)
    0x25, 0x65, //   Logical Maximum (101)
    0x05, 0x07, //   Usage Page (Keyboard/Keypad)
    0x19, 0x00, //   Usage Minimum (0)
    0x29, 0x65, //   Usage Maximum (101)
    0x81, 0x00, //   Input (Data, Array): key codes
    0xc0, // End Collection
];

/// A boot mouse with a wheel: three buttons, X, Y and wheel relative, a
/// 4-byte report whose first three bytes are the boot report.
const MOUSE_REPORT_DESCRIPTOR: &[u8] = &[
    0x05, 0x01, // Usage Page (Generic Desktop)
    0x09, 0x02, // Usage (Mouse)
    0xa1, 0x01, // Collection (Application)
    0x09, 0x01, //   Usage (Pointer)
    0xa1, 0x00, //   Collection (Physical)
    0x05, 0x09, //     Usage Page (Buttons)
    0x19, 0x01, //     Usage Minimum (1)
    0x29, 0x03, //     Usage Maximum (3)
    0x15, 0x00, //     Logical Minimum (0)
    0x25, 0x01, //     Logical Maximum (1)
    0x95, 0x03, //     Report Count (3)
    0x75, 0x01, //     Report Size (1)
    0x81, 0x02, //     Input (Data, Variable, Absolute): buttons
    0x95, 0x01, //     Report Count (1)
    0x75, 0x05, //     Report Size (5)
    0x81, 0x01, //     Input (Constant): padding
    0x05, 0x01, //     Usage Page (Generic Desktop)
    0x09, 0x30, //     Usage (X)
    0x09, 0x31, //     Usage (Y)
    0x09, 0x38, //     Usage (Wheel)
    0x15, 0x81, //     Logical Minimum (-127)
    0x25, 0x7f, //     Logical Maximum (127)
    0x75, 0x08, //     Report Size (8)
    0x95, 0x03, //     Report Count (3)
    0x81, 0x06, //     Input (Data, Variable, Relative): X, Y, wheel
    0xc0, //   End Collection
    0xc0, // End Collection
];

/// One input report (the keyboard uses all 8 bytes, the mouse the first 4).
type Report = [u8; 8];

/// Why text could not be typed. Nothing was queued in any case.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TypeError {
    /// The text holds a character with no key on a US keyboard (only
    /// printable ASCII, `\n`, `\r`, `\t`, backspace and escape are typed).
    #[error("cannot type {0:?}: no such key on a US keyboard")]
    Unsupported(char),
    /// No host has the keyboard configured, so nobody would receive the keys;
    /// attach the device first.
    #[error("no host has the keyboard attached")]
    NotAttached,
    /// The text and what is still waiting to be typed come to more than
    /// 32768 keystrokes; retry shortly, or type the text in parts.
    #[error("too much text is waiting to be typed; retry shortly or type less at once")]
    QueueFull,
}

/// What a handle and its device share.
#[derive(Debug, Default)]
struct Shared {
    state: Mutex<SharedState>,
}

#[derive(Debug, Default)]
struct SharedState {
    reports: VecDeque<Report>,
    /// The device task, when it has an interrupt URB waiting for a report.
    waker: Option<Waker>,
    /// A host has selected a configuration.
    attached: bool,
    /// The keyboard LED bits the host last set.
    leds: u8,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, SharedState> {
        // The state is plain data and stays consistent even if a holder panicked.
        usbwire_device::sync::lock(&self.state)
    }

    /// Queues reports and wakes the device task.
    fn push(&self, reports: impl IntoIterator<Item = Report>) {
        let waker = {
            let mut state = self.lock();
            state.reports.extend(reports);
            state.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

/// What differs between the keyboard and the mouse.
#[derive(Debug)]
struct Kind {
    product_id: u16,
    product: &'static str,
    /// bInterfaceProtocol: 1 keyboard, 2 mouse.
    interface_protocol: u8,
    report_descriptor: &'static [u8],
    /// Input report length under the report protocol.
    report_len: usize,
    /// Input report length under the boot protocol.
    boot_len: usize,
    /// Has the keyboard's LED output report.
    has_leds: bool,
}

const KEYBOARD: Kind = Kind {
    product_id: KEYBOARD_PRODUCT_ID,
    product: "usbwire keyboard",
    interface_protocol: 1,
    report_descriptor: KEYBOARD_REPORT_DESCRIPTOR,
    report_len: 8,
    boot_len: 8,
    has_leds: true,
};

const MOUSE: Kind = Kind {
    product_id: MOUSE_PRODUCT_ID,
    product: "usbwire mouse",
    interface_protocol: 2,
    report_descriptor: MOUSE_REPORT_DESCRIPTOR,
    report_len: 4,
    boot_len: 3,
    has_leds: false,
};

/// The HID behaviour both devices share.
#[derive(Debug)]
struct HidCore {
    kind: &'static Kind,
    descriptors: DescriptorSet,
    shared: Arc<Shared>,
    /// Interrupt IN URBs waiting for a report, oldest first.
    waiting: VecDeque<Urb>,
    done: CompletionQueue,
    /// The last report sent (what GET_REPORT(input) returns).
    last_report: Report,
    idle: u8,
    protocol: u8,
}

impl HidCore {
    fn new(kind: &'static Kind) -> Self {
        let speed = Speed::HIGH;
        let [len_lo, len_hi] = (kind.report_descriptor.len() as u16).to_le_bytes();
        // HID 1.11 §6.2.1: bcdHID 1.11, no country, one report descriptor of this length.
        let hid_descriptor = [9, descriptor::HID, 0x11, 0x01, 0, 1, descriptor::HID_REPORT, len_lo, len_hi];
        let configuration = ConfigurationBuilder::new(speed, 100)
            .interface(INTERFACE as u8, 1, 3, 1, kind.interface_protocol, 0)
            .raw(&hid_descriptor)
            .endpoint(EndpointSpec::interrupt(REPORT_ENDPOINT, 8, 10, speed))
            .build();
        let serial = format!("{:04x}0001", kind.product_id);
        let descriptors = DescriptorSet::new(
            speed,
            DeviceDescriptor::for_speed(speed, VENDOR_ID, kind.product_id),
            configuration,
            vec![MANUFACTURER.into(), kind.product.into(), serial],
        );
        Self {
            kind,
            descriptors,
            shared: Arc::default(),
            waiting: VecDeque::new(),
            done: CompletionQueue::new(),
            last_report: [0; 8],
            idle: 0,
            protocol: PROTOCOL_REPORT,
        }
    }

    fn hid_descriptor(&self) -> Option<Vec<u8>> {
        let config = &self.descriptors.configuration;
        let mut at = 0;
        while at + 2 <= config.len() {
            let len = usize::from(config[at]);
            if len < 2 {
                return None;
            }
            if config[at + 1] == descriptor::HID {
                return config.get(at..at + len).map(<[u8]>::to_vec);
            }
            at += len;
        }
        None
    }

    fn input_len(&self) -> usize {
        if self.protocol == PROTOCOL_BOOT {
            self.kind.boot_len
        } else {
            self.kind.report_len
        }
    }

    fn control(&mut self, setup: &SetupPacket, data: &[u8]) -> ControlReply {
        if setup.recipient() != Recipient::Interface || setup.index != INTERFACE {
            return ControlReply::Stall;
        }
        let reply = match (setup.kind(), setup.request) {
            (RequestKind::Standard, request::GET_DESCRIPTOR) => match setup.descriptor_type() {
                descriptor::HID => self.hid_descriptor(),
                descriptor::HID_REPORT => Some(self.kind.report_descriptor.to_vec()),
                _ => None,
            },
            (RequestKind::Class, class::GET_REPORT) => match setup.descriptor_type() {
                REPORT_TYPE_INPUT => Some(self.last_report[..self.input_len()].to_vec()),
                REPORT_TYPE_OUTPUT if self.kind.has_leds => Some(vec![self.shared.lock().leds]),
                _ => None,
            },
            (RequestKind::Class, class::SET_REPORT) => match setup.descriptor_type() {
                REPORT_TYPE_OUTPUT if self.kind.has_leds => {
                    if let Some(&leds) = data.first() {
                        debug!(leds, "keyboard LEDs set");
                        self.shared.lock().leds = leds & 0x1f;
                    }
                    Some(Vec::new())
                }
                _ => None,
            },
            (RequestKind::Class, class::GET_IDLE) => Some(vec![self.idle]),
            (RequestKind::Class, class::SET_IDLE) => {
                self.idle = setup.descriptor_type();
                Some(Vec::new())
            }
            (RequestKind::Class, class::GET_PROTOCOL) => Some(vec![self.protocol]),
            (RequestKind::Class, class::SET_PROTOCOL) if setup.value <= u16::from(PROTOCOL_REPORT) => {
                self.protocol = setup.value as u8;
                Some(Vec::new())
            }
            _ => None,
        };
        reply.map_or(ControlReply::Stall, ControlReply::Data)
    }

    fn set_configuration(&mut self, value: u8) {
        self.shared.lock().attached = value != 0;
    }

    fn submit(&mut self, urb: Urb) {
        if !urb.is_in() {
            self.done.push(urb.complete_with(Status::EPIPE));
            return;
        }
        self.waiting.push_back(urb);
    }

    fn poll_complete(&mut self, cx: &mut Context<'_>) -> Poll<Completion> {
        if let Poll::Ready(done) = self.done.poll_pop(cx) {
            return Poll::Ready(done);
        }
        if self.waiting.is_empty() {
            return Poll::Pending;
        }
        let report = {
            let mut state = self.shared.lock();
            match state.reports.pop_front() {
                Some(report) => report,
                None => {
                    if !state.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                        state.waker = Some(cx.waker().clone());
                    }
                    return Poll::Pending;
                }
            }
        };
        let Some(urb) = self.waiting.pop_front() else { return Poll::Pending };
        self.last_report = report;
        trace!(report = ?&report[..self.input_len()], "input report");
        Poll::Ready(urb.complete_in(Bytes::copy_from_slice(&report[..self.input_len()])))
    }

    fn cancel(&mut self, seqnum: u32) {
        if let Some(i) = self.waiting.iter().position(|u| u.seqnum == seqnum) {
            if let Some(urb) = self.waiting.remove(i) {
                self.done.push(urb.complete_with(Status::ECONNRESET));
            }
        }
    }

    fn reset(&mut self) {
        self.waiting.clear();
        self.done.clear();
        self.last_report = [0; 8];
        self.idle = 0;
        self.protocol = PROTOCOL_REPORT;
        let mut state = self.shared.lock();
        state.reports.clear();
        state.waker = None;
        state.attached = false;
        state.leds = 0;
    }
}

/// Forwards a [`Function`] to the [`HidCore`] in field `core`.
macro_rules! hid_function {
    ($device:ty) => {
        impl Function for $device {
            fn descriptors(&self) -> &DescriptorSet {
                &self.core.descriptors
            }
            fn control(&mut self, setup: &SetupPacket, data: &[u8]) -> ControlReply {
                self.core.control(setup, data)
            }
            fn set_configuration(&mut self, value: u8) {
                self.core.set_configuration(value);
            }
            fn submit(&mut self, urb: Urb) {
                self.core.submit(urb);
            }
            fn poll_complete(&mut self, cx: &mut Context<'_>) -> Poll<Completion> {
                self.core.poll_complete(cx)
            }
            fn cancel(&mut self, seqnum: u32) {
                self.core.cancel(seqnum);
            }
            fn reset(&mut self) {
                self.core.reset();
            }
        }
    };
}

/// The boot keyboard function (see [`keyboard`]).
#[derive(Debug)]
pub struct Keyboard {
    core: HidCore,
}

hid_function!(Keyboard);

/// Types on a [`Keyboard`] from any thread; cheap to clone.
#[derive(Clone, Debug)]
pub struct KeyboardHandle {
    shared: Arc<Shared>,
}

/// A boot keyboard (VID 0x1209, PID 0x0001) and the handle that types on it.
pub fn keyboard() -> (VirtualDevice<Keyboard>, KeyboardHandle) {
    let core = HidCore::new(&KEYBOARD);
    let handle = KeyboardHandle { shared: Arc::clone(&core.shared) };
    (VirtualDevice::new(Keyboard { core }), handle)
}

impl KeyboardHandle {
    /// Queues a press and a release report for every character of `text`
    /// (US layout, shift added where needed) and returns how many reports
    /// were queued. `\n` and `\r` press Enter (`\r\n` presses it once),
    /// `\t` Tab, `\x08` Backspace, `\x1b` Escape.
    ///
    /// All or nothing: an unsupported character, a detached keyboard or a
    /// full queue is reported before anything is queued.
    pub fn type_text(&self, text: &str) -> Result<usize, TypeError> {
        let mut reports = Vec::with_capacity(text.len() * 2);
        let mut chars = text.chars().peekable();
        while let Some(c) = chars.next() {
            if c == '\r' && chars.peek() == Some(&'\n') {
                continue;
            }
            let (modifiers, usage) = key_for(c).ok_or(TypeError::Unsupported(c))?;
            reports.push([modifiers, 0, usage, 0, 0, 0, 0, 0]);
            reports.push([0; 8]);
        }
        let count = reports.len();
        let waker = {
            let mut state = self.shared.lock();
            if !state.attached {
                return Err(TypeError::NotAttached);
            }
            if state.reports.len() + count > MAX_QUEUED_REPORTS {
                return Err(TypeError::QueueFull);
            }
            state.reports.extend(reports);
            state.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
        Ok(count)
    }

    /// Whether a host has the keyboard attached and configured.
    pub fn is_attached(&self) -> bool {
        self.shared.lock().attached
    }

    /// The LED bits the host last set (bit 0 Num Lock, 1 Caps Lock, 2 Scroll Lock, 3 Compose, 4 Kana).
    pub fn leds(&self) -> u8 {
        self.shared.lock().leds
    }

    /// Reports still waiting to be sent.
    pub fn queued_reports(&self) -> usize {
        self.shared.lock().reports.len()
    }
}

/// The boot mouse function (see [`mouse`]).
#[derive(Debug)]
pub struct Mouse {
    core: HidCore,
}

hid_function!(Mouse);

/// Moves a [`Mouse`] from any thread; cheap to clone.
#[derive(Clone, Debug)]
pub struct MouseHandle {
    shared: Arc<Shared>,
}

/// A boot mouse with a wheel (VID 0x1209, PID 0x0002) and the handle that moves it.
pub fn mouse() -> (VirtualDevice<Mouse>, MouseHandle) {
    let core = HidCore::new(&MOUSE);
    let handle = MouseHandle { shared: Arc::clone(&core.shared) };
    (VirtualDevice::new(Mouse { core }), handle)
}

impl MouseHandle {
    /// Queues one report: relative motion, the buttons held (bit 0 left,
    /// 1 right, 2 middle) and wheel clicks. Returns false, queuing nothing,
    /// when no host has the mouse attached or too many reports are waiting.
    pub fn move_by(&self, dx: i8, dy: i8, buttons: u8, wheel: i8) -> bool {
        let report = [buttons & 0x07, dx as u8, dy as u8, wheel as u8, 0, 0, 0, 0];
        {
            let state = self.shared.lock();
            if !state.attached || state.reports.len() >= MAX_QUEUED_REPORTS {
                return false;
            }
        }
        self.shared.push([report]);
        true
    }

    /// Whether a host has the mouse attached and configured.
    pub fn is_attached(&self) -> bool {
        self.shared.lock().attached
    }
}

/// Modifier bit of the left shift key.
const SHIFT: u8 = 0x02;

/// The (modifiers, usage) that types `c` on a US keyboard (HID usage tables §10).
fn key_for(c: char) -> Option<(u8, u8)> {
    let key = |usage: u8| Some((0, usage));
    let shifted = |usage: u8| Some((SHIFT, usage));
    match c {
        'a'..='z' => key(0x04 + (c as u8 - b'a')),
        'A'..='Z' => shifted(0x04 + (c as u8 - b'A')),
        '1'..='9' => key(0x1e + (c as u8 - b'1')),
        '0' => key(0x27),
        '\n' | '\r' => key(0x28),
        '\x1b' => key(0x29),
        '\x08' => key(0x2a),
        '\t' => key(0x2b),
        ' ' => key(0x2c),
        '-' => key(0x2d),
        '=' => key(0x2e),
        '[' => key(0x2f),
        ']' => key(0x30),
        '\\' => key(0x31),
        ';' => key(0x33),
        '\'' => key(0x34),
        '`' => key(0x35),
        ',' => key(0x36),
        '.' => key(0x37),
        '/' => key(0x38),
        '!' => shifted(0x1e),
        '@' => shifted(0x1f),
        '#' => shifted(0x20),
        '$' => shifted(0x21),
        '%' => shifted(0x22),
        '^' => shifted(0x23),
        '&' => shifted(0x24),
        '*' => shifted(0x25),
        '(' => shifted(0x26),
        ')' => shifted(0x27),
        '_' => shifted(0x2d),
        '+' => shifted(0x2e),
        '{' => shifted(0x2f),
        '}' => shifted(0x30),
        '|' => shifted(0x31),
        ':' => shifted(0x33),
        '"' => shifted(0x34),
        '~' => shifted(0x35),
        '<' => shifted(0x36),
        '>' => shifted(0x37),
        '?' => shifted(0x38),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{configure, control, data_in, next, request};
    use usbwire_device::descriptor::ConfigurationInfo;
    use usbwire_device::Device;

    /// Input and output report sizes in bits, from a report descriptor
    /// without report ids (short items only, as ours are).
    fn report_bits(descriptor: &[u8]) -> (u32, u32) {
        let (mut size, mut count, mut input, mut output) = (0, 0, 0, 0);
        let mut at = 0;
        while at < descriptor.len() {
            let prefix = descriptor[at];
            let len = [0, 1, 2, 4][usize::from(prefix & 0x03)];
            let value = descriptor[at + 1..at + 1 + len].iter().rev().fold(0u32, |v, b| (v << 8) | u32::from(*b));
            match prefix & 0xfc {
                0x74 => size = value,
                0x94 => count = value,
                0x80 => input += size * count,
                0x90 => output += size * count,
                0x84 => panic!("report ids are not expected"),
                _ => {}
            }
            at += 1 + len;
        }
        assert_eq!(at, descriptor.len(), "items end with the descriptor");
        (input, output)
    }

    fn attached_keyboard() -> (VirtualDevice<Keyboard>, KeyboardHandle) {
        let (mut dev, handle) = keyboard();
        configure(&mut dev);
        (dev, handle)
    }

    /// Collects every queued report by feeding interrupt URBs.
    fn drain_reports(dev: &mut VirtualDevice<Keyboard>) -> Vec<Vec<u8>> {
        let mut reports = Vec::new();
        for seqnum in 100.. {
            dev.submit(data_in(seqnum, 0x81, 8));
            let Some(done) = next(dev) else {
                dev.cancel(seqnum);
                next(dev);
                break;
            };
            reports.push(done.data.to_vec());
        }
        reports
    }

    #[test]
    fn report_descriptor_is_an_8_byte_boot_report_and_its_length_is_announced() {
        let (input, output) = report_bits(KEYBOARD_REPORT_DESCRIPTOR);
        assert_eq!((input, output), (64, 8));
        let (mut dev, _handle) = keyboard();
        let config = request(&mut dev, [0x80, 6, 0, 2, 0, 0, 0xff, 0], &[]);
        let info = ConfigurationInfo::parse(&config).unwrap();
        assert_eq!((info.interfaces[0].class, info.interfaces[0].subclass, info.interfaces[0].protocol), (3, 1, 1));
        assert_eq!(info.interfaces[0].endpoints[0].address, 0x81);
        let hid = request(&mut dev, [0x81, 6, 0, 0x21, 0, 0, 9, 0], &[]);
        assert_eq!(&hid[..2], &[9, 0x21]);
        assert_eq!(
            config.windows(9).filter(|w| *w == &hid[..]).count(),
            1,
            "same HID descriptor as in the configuration"
        );
        let announced = usize::from(u16::from_le_bytes([hid[7], hid[8]]));
        assert_eq!(hid[6], 0x22);
        // The kernel asks with exactly the announced length; ask with more to see the true size.
        let report = request(&mut dev, [0x81, 6, 0, 0x22, 0, 0, 0xff, 0], &[]);
        assert_eq!(report.len(), announced);
        assert_eq!(&report[..], KEYBOARD_REPORT_DESCRIPTOR);
    }

    #[test]
    fn typing_hi_bang_enter_sends_press_release_pairs() {
        let (mut dev, handle) = attached_keyboard();
        assert_eq!(handle.type_text("Hi!\n"), Ok(8));
        let expected: Vec<Vec<u8>> = vec![
            vec![0x02, 0, 0x0b, 0, 0, 0, 0, 0],
            vec![0; 8],
            vec![0x00, 0, 0x0c, 0, 0, 0, 0, 0],
            vec![0; 8],
            vec![0x02, 0, 0x1e, 0, 0, 0, 0, 0],
            vec![0; 8],
            vec![0x00, 0, 0x28, 0, 0, 0, 0, 0],
            vec![0; 8],
        ];
        assert_eq!(drain_reports(&mut dev), expected);
        assert_eq!(handle.queued_reports(), 0);
    }

    #[test]
    fn repeated_letters_are_separated_by_releases() {
        let (mut dev, handle) = attached_keyboard();
        handle.type_text("ll").unwrap();
        let reports = drain_reports(&mut dev);
        assert_eq!(reports.len(), 4);
        assert_eq!(reports[0], reports[2]);
        assert_eq!(reports[1], vec![0; 8]);
    }

    #[test]
    fn unsupported_characters_are_rejected_before_anything_is_queued() {
        let (_dev, handle) = attached_keyboard();
        assert_eq!(handle.type_text("abc é"), Err(TypeError::Unsupported('é')));
        assert_eq!(handle.type_text("\x07"), Err(TypeError::Unsupported('\x07')));
        assert_eq!(handle.queued_reports(), 0);
        assert_eq!(handle.type_text("a\r\nb"), Ok(6), "CRLF is one Enter");
    }

    #[test]
    fn typing_needs_an_attached_host() {
        let (mut dev, handle) = keyboard();
        assert_eq!(handle.type_text("a"), Err(TypeError::NotAttached));
        configure(&mut dev);
        assert!(handle.is_attached());
        request(&mut dev, [0x00, 9, 0, 0, 0, 0, 0, 0], &[]);
        assert!(!handle.is_attached(), "SET_CONFIGURATION(0) detaches");
    }

    #[test]
    fn interrupt_urb_pends_until_text_is_typed() {
        let (mut dev, handle) = attached_keyboard();
        dev.submit(data_in(7, 0x81, 8));
        assert!(next(&mut dev).is_none());
        assert!(next(&mut dev).is_none(), "still pending when polled again");
        handle.type_text("a").unwrap();
        let done = next(&mut dev).unwrap();
        assert_eq!((done.seqnum, done.status), (7, Status::OK));
        assert_eq!(&done.data[..], &[0, 0, 0x04, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn a_waiting_device_task_is_woken_by_typing() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::task::Wake;
        struct Count(AtomicUsize);
        impl Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let (mut dev, handle) = attached_keyboard();
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&count));
        dev.submit(data_in(1, 0x81, 8));
        assert!(dev.poll_complete(&mut Context::from_waker(&waker)).is_pending());
        handle.type_text("x").unwrap();
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn cancel_completes_the_pending_urb_with_econnreset() {
        let (mut dev, handle) = attached_keyboard();
        dev.submit(data_in(9, 0x81, 8));
        assert!(next(&mut dev).is_none());
        dev.cancel(9);
        let done = next(&mut dev).unwrap();
        assert_eq!((done.seqnum, done.status, done.actual_length), (9, Status::ECONNRESET, 0));
        dev.cancel(9);
        assert!(next(&mut dev).is_none(), "a second cancel finds nothing");
        handle.type_text("a").unwrap();
        assert!(next(&mut dev).is_none(), "the cancelled URB took no report");
        assert_eq!(handle.queued_reports(), 2);
    }

    #[test]
    fn reset_drops_queued_text_and_detaches() {
        let (mut dev, handle) = attached_keyboard();
        handle.type_text("hello").unwrap();
        dev.submit(data_in(3, 0x81, 8));
        dev.reset();
        assert!(next(&mut dev).is_none(), "abandoned URBs do not complete");
        assert_eq!(handle.queued_reports(), 0);
        assert!(!handle.is_attached());
    }

    #[test]
    fn class_requests() {
        let (mut dev, handle) = attached_keyboard();
        // SET_IDLE(0) / GET_IDLE.
        request(&mut dev, [0x21, 0x0a, 0, 0x7d, 0, 0, 0, 0], &[]);
        assert_eq!(&request(&mut dev, [0xa1, 0x02, 0, 0, 0, 0, 1, 0], &[])[..], &[0x7d]);
        // SET_PROTOCOL(boot) / GET_PROTOCOL.
        assert_eq!(&request(&mut dev, [0xa1, 0x03, 0, 0, 0, 0, 1, 0], &[])[..], &[1]);
        request(&mut dev, [0x21, 0x0b, 0, 0, 0, 0, 0, 0], &[]);
        assert_eq!(&request(&mut dev, [0xa1, 0x03, 0, 0, 0, 0, 1, 0], &[])[..], &[0]);
        // SET_REPORT(output): Caps Lock on.
        request(&mut dev, [0x21, 0x09, 0, 0x02, 0, 0, 1, 0], &[0x02]);
        assert_eq!(handle.leds(), 0x02);
        assert_eq!(&request(&mut dev, [0xa1, 0x01, 0, 0x02, 0, 0, 1, 0], &[])[..], &[0x02]);
        // GET_REPORT(input) is the last report sent.
        handle.type_text("A").unwrap();
        dev.submit(data_in(1, 0x81, 8));
        assert_eq!(next(&mut dev).unwrap().actual_length, 8, "the boot keyboard report is the whole report");
        assert_eq!(&request(&mut dev, [0xa1, 0x01, 0, 0x01, 0, 0, 8, 0], &[])[..], &[2, 0, 4, 0, 0, 0, 0, 0]);
        // Feature reports and other interfaces stall.
        dev.submit(control(1, [0xa1, 0x01, 0, 0x03, 0, 0, 8, 0], &[]));
        assert_eq!(next(&mut dev).unwrap().status, Status::EPIPE);
        dev.submit(control(2, [0xa1, 0x02, 0, 0, 1, 0, 1, 0], &[]));
        assert_eq!(next(&mut dev).unwrap().status, Status::EPIPE);
    }

    #[test]
    fn mouse_reports_are_four_bytes_or_three_under_boot_protocol() {
        assert_eq!(report_bits(MOUSE_REPORT_DESCRIPTOR), (32, 0));
        let (mut dev, handle) = mouse();
        assert!(!handle.move_by(1, 1, 0, 0), "not attached");
        assert_eq!(dev.summary().interfaces, vec![(3, 1, 2)]);
        assert_eq!(dev.summary().product_id, 0x0002);
        configure(&mut dev);
        let hid = request(&mut dev, [0x81, 6, 0, 0x21, 0, 0, 9, 0], &[]);
        assert_eq!(usize::from(u16::from_le_bytes([hid[7], hid[8]])), MOUSE_REPORT_DESCRIPTOR.len());
        assert!(handle.move_by(5, -3, 0x09, -1));
        dev.submit(data_in(1, 0x81, 8));
        assert_eq!(&next(&mut dev).unwrap().data[..], &[0x01, 5, 0xfd, 0xff]);
        request(&mut dev, [0x21, 0x0b, 0, 0, 0, 0, 0, 0], &[]);
        assert!(handle.move_by(-128, 127, 0x04, 0));
        dev.submit(data_in(2, 0x81, 8));
        assert_eq!(&next(&mut dev).unwrap().data[..], &[0x04, 0x80, 0x7f]);
        // SET_REPORT(output) has nothing to set on a mouse.
        dev.submit(control(3, [0x21, 0x09, 0, 0x02, 0, 0, 1, 0], &[1]));
        assert_eq!(next(&mut dev).unwrap().status, Status::EPIPE);
    }

    #[test]
    fn handles_can_be_shared_between_tasks() {
        fn shareable<T: Clone + Send + Sync + 'static>() {}
        shareable::<KeyboardHandle>();
        shareable::<MouseHandle>();
    }

    #[test]
    fn every_printable_ascii_character_has_a_key() {
        for c in (0x20u8..0x7f).map(char::from) {
            assert!(key_for(c).is_some(), "{c:?}");
        }
        assert_eq!(key_for('\u{7f}'), None);
    }
}
