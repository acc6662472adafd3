//! Which `GET_DESCRIPTOR` requests fill a [`Snapshot`], one after the other,
//! each decided by the answers before it: the device descriptor; each
//! configuration's first 9 bytes, then all of it; the BOS when the device is
//! USB 2.01 or later; string 0, then every string the device and its
//! configurations name, in the first language (the one Linux reads); the
//! report descriptor of every HID interface. Sans I/O: the server sends each
//! request to the device and hands back what it returned.
//!
//! Not for answering from a snapshot (`descriptors`), nor for the requests'
//! timing and the device's failures (the server's import gives up on a
//! device that does not answer and keeps what it has).

use std::collections::{BTreeSet, VecDeque};

use super::{
    Entry, Snapshot, BOS, CONFIGURATION, DEVICE, GET_DESCRIPTOR, HID, HID_REPORT, INTERFACE, STRING, TO_HOST_DEVICE,
    TO_HOST_INTERFACE,
};

/// The most requests one plan makes, whatever the device says.
pub const MAX_REQUESTS: usize = 96;

/// The configurations asked for, at most (`bNumConfigurations` may say more).
const MAX_CONFIGURATIONS: u8 = 8;

/// What the device descriptor's `bcdUSB` must reach for a BOS to be asked.
const BOS_FROM: u16 = 0x0201;

/// The requests to make and the snapshot they fill.
#[derive(Debug)]
pub struct Plan {
    queue: VecDeque<[u8; 8]>,
    /// String indexes named so far (device, configurations, interfaces).
    strings: BTreeSet<u8>,
    /// String 0 asked for (after everything else).
    strings_asked: bool,
    /// Interfaces whose report descriptor was asked for.
    reports: BTreeSet<u8>,
    made: usize,
    snapshot: Snapshot,
}

impl Default for Plan {
    fn default() -> Self {
        Self::new()
    }
}

impl Plan {
    /// A plan that starts with the device descriptor.
    pub fn new() -> Self {
        Self {
            queue: VecDeque::from([setup(TO_HOST_DEVICE, DEVICE, 0, 0, 18)]),
            strings: BTreeSet::new(),
            strings_asked: false,
            reports: BTreeSet::new(),
            made: 0,
            snapshot: Snapshot::default(),
        }
    }

    /// The SETUP packet of the next request, or `None` when the plan is done.
    pub fn next_request(&mut self) -> Option<[u8; 8]> {
        if self.made >= MAX_REQUESTS {
            return None;
        }
        if self.queue.is_empty() && !self.strings_asked && !self.snapshot.is_empty() {
            self.strings_asked = true;
            if !self.strings.is_empty() {
                self.queue.push_back(setup(TO_HOST_DEVICE, STRING, 0, 0, 255));
            }
        }
        let next = self.queue.pop_front()?;
        self.made += 1;
        Some(next)
    }

    /// What the device returned to `request` (`None`: it failed, stalled or
    /// gave nothing). A device descriptor that fails ends the plan.
    pub fn answered(&mut self, request: [u8; 8], data: Option<&[u8]>) {
        let request_type = request[0];
        let [index, kind] = [request[2], request[3]];
        let w_index = u16::from_le_bytes([request[4], request[5]]);
        let asked = usize::from(u16::from_le_bytes([request[6], request[7]]));
        let data = match data {
            Some(data) if !data.is_empty() && data.len() <= asked => data,
            _ => {
                if kind == DEVICE {
                    self.queue.clear();
                }
                return;
            }
        };
        let complete = data.len() < asked || declared_length(kind, data, asked) == Some(data.len());
        self.snapshot.insert(Entry {
            request_type,
            value: u16::from(kind) << 8 | u16::from(index),
            index: w_index,
            complete,
            data: bytes::Bytes::copy_from_slice(data),
        });
        match kind {
            DEVICE => self.device(data),
            CONFIGURATION if !complete => self.ask_whole(CONFIGURATION, index, data, asked),
            CONFIGURATION => self.configuration(data),
            BOS if !complete => self.ask_whole(BOS, 0, data, asked),
            STRING if index == 0 => self.languages(data),
            _ => {}
        }
    }

    /// The snapshot as far as the device answered.
    pub fn finish(self) -> Snapshot {
        self.snapshot
    }

    fn device(&mut self, data: &[u8]) {
        if data.len() < 18 {
            return;
        }
        let bcd_usb = u16::from_le_bytes([data[2], data[3]]);
        self.strings.extend([data[14], data[15], data[16]].into_iter().filter(|&i| i != 0));
        for configuration in 0..data[17].min(MAX_CONFIGURATIONS) {
            self.queue.push_back(setup(TO_HOST_DEVICE, CONFIGURATION, configuration, 0, 9));
        }
        if bcd_usb >= BOS_FROM {
            self.queue.push_back(setup(TO_HOST_DEVICE, BOS, 0, 0, 5));
        }
    }

    /// A configuration's or BOS's header: the whole of it next.
    fn ask_whole(&mut self, kind: u8, index: u8, data: &[u8], asked: usize) {
        if let Some(total) = declared_length(kind, data, asked) {
            if total > data.len() {
                self.queue.push_back(setup(TO_HOST_DEVICE, kind, index, 0, total as u16));
            }
        }
    }

    /// A whole configuration: the strings it names, its HID report descriptors.
    fn configuration(&mut self, data: &[u8]) {
        let mut interface = None;
        for descriptor in walk(data) {
            match descriptor[1] {
                CONFIGURATION if descriptor.len() >= 9 => self.name(descriptor[6]),
                INTERFACE if descriptor.len() >= 9 => {
                    self.name(descriptor[8]);
                    interface = Some((descriptor[2], descriptor[5]));
                }
                HID if descriptor.len() >= 9 => {
                    let Some((number, 3)) = interface else { continue };
                    let reports = descriptor[6..].chunks_exact(3).take(usize::from(descriptor[5]));
                    for report in reports.filter(|report| report[0] == HID_REPORT) {
                        let length = u16::from_le_bytes([report[1], report[2]]);
                        if length > 0 && self.reports.insert(number) {
                            self.queue.push_back(setup(TO_HOST_INTERFACE, HID_REPORT, 0, u16::from(number), length));
                        }
                    }
                }
                _ => {}
            }
        }
    }

    fn name(&mut self, index: u8) {
        if index != 0 {
            self.strings.insert(index);
        }
    }

    /// String 0: each named string in the first language.
    fn languages(&mut self, data: &[u8]) {
        if data.len() < 4 {
            return;
        }
        let language = u16::from_le_bytes([data[2], data[3]]);
        for &index in &self.strings {
            self.queue.push_back(setup(TO_HOST_DEVICE, STRING, index, language, 255));
        }
    }
}

/// How long the descriptor says it is, in all: `bLength` for a device or a
/// string, `wTotalLength` for a configuration or a BOS; a HID report
/// descriptor is as long as its HID descriptor said (`asked`).
fn declared_length(kind: u8, data: &[u8], asked: usize) -> Option<usize> {
    match kind {
        DEVICE | STRING => data.first().map(|&len| usize::from(len)),
        CONFIGURATION | BOS if data.len() >= 4 => Some(usize::from(u16::from_le_bytes([data[2], data[3]]))),
        HID_REPORT => Some(asked),
        _ => None,
    }
}

/// The descriptors one after the other, each at least 2 bytes and within `data`.
fn walk(data: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = data;
    std::iter::from_fn(move || {
        let len = usize::from(*rest.first()?);
        if len < 2 || len > rest.len() {
            return None;
        }
        let (descriptor, after) = rest.split_at(len);
        rest = after;
        Some(descriptor)
    })
}

fn setup(request_type: u8, kind: u8, index: u8, w_index: u16, length: u16) -> [u8; 8] {
    let [i0, i1] = w_index.to_le_bytes();
    let [l0, l1] = length.to_le_bytes();
    [request_type, GET_DESCRIPTOR, index, kind, i0, i1, l0, l1]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A keyboard-like device: one configuration with a HID interface, three strings.
    fn device(bcd_usb: u16) -> Vec<u8> {
        let [b0, b1] = bcd_usb.to_le_bytes();
        vec![18, 1, b0, b1, 0, 0, 0, 64, 0x09, 0x12, 0x01, 0, 0, 1, 1, 2, 3, 1]
    }

    fn configuration() -> Vec<u8> {
        let mut c = vec![9, 2, 0, 0, 1, 1, 4, 0xa0, 50];
        c.extend([9, 4, 0, 0, 1, 3, 1, 1, 5]);
        c.extend([9, HID, 0x11, 1, 0, 1, HID_REPORT, 63, 0]);
        c.extend([7, 5, 0x81, 3, 8, 0, 10]);
        let total = c.len() as u16;
        c[2..4].copy_from_slice(&total.to_le_bytes());
        c
    }

    fn string(text: &str) -> Vec<u8> {
        let mut s = vec![0, STRING];
        s.extend(text.encode_utf16().flat_map(u16::to_le_bytes));
        s[0] = s.len() as u8;
        s
    }

    /// Runs a plan against a device that answers each request from `answer`,
    /// giving no more than asked, as a device does.
    fn run(answer: impl Fn(u8, u8, u16) -> Option<Vec<u8>>) -> (Vec<[u8; 8]>, Snapshot) {
        let mut plan = Plan::new();
        let mut asked = Vec::new();
        while let Some(request) = plan.next_request() {
            asked.push(request);
            let length = usize::from(u16::from_le_bytes([request[6], request[7]]));
            let reply = answer(request[3], request[2], u16::from_le_bytes([request[4], request[5]])).map(|mut data| {
                data.truncate(length);
                data
            });
            plan.answered(request, reply.as_deref());
        }
        (asked, plan.finish())
    }

    fn keyboard(kind: u8, index: u8, w_index: u16) -> Option<Vec<u8>> {
        match (kind, index, w_index) {
            (DEVICE, 0, 0) => Some(device(0x0200)),
            (CONFIGURATION, 0, 0) => Some(configuration()),
            (STRING, 0, 0) => Some(vec![4, STRING, 0x09, 0x04]),
            (STRING, 1, 0x0409) => Some(string("usbwire")),
            (STRING, 2, 0x0409) => Some(string("keyboard")),
            (STRING, 3, 0x0409) => Some(string("0001")),
            (STRING, 4, 0x0409) => Some(string("boot")),
            (STRING, 5, 0x0409) => Some(string("keys")),
            (HID_REPORT, 0, 0) => Some((0..63).collect()),
            _ => None,
        }
    }

    #[test]
    fn a_hid_device_is_taken_whole_in_the_order_linux_reads_it() {
        let (asked, snapshot) = run(keyboard);
        let asked: Vec<(u8, u8, u8, u16, u16)> = asked
            .iter()
            .map(|s| (s[0], s[3], s[2], u16::from_le_bytes([s[4], s[5]]), u16::from_le_bytes([s[6], s[7]])))
            .collect();
        let total = configuration().len() as u16;
        assert_eq!(
            asked,
            vec![
                (0x80, DEVICE, 0, 0, 18),
                (0x80, CONFIGURATION, 0, 0, 9),
                (0x80, CONFIGURATION, 0, 0, total),
                (0x81, HID_REPORT, 0, 0, 63),
                (0x80, STRING, 0, 0, 255),
                (0x80, STRING, 1, 0x0409, 255),
                (0x80, STRING, 2, 0x0409, 255),
                (0x80, STRING, 3, 0x0409, 255),
                (0x80, STRING, 4, 0x0409, 255),
                (0x80, STRING, 5, 0x0409, 255),
            ]
        );
        // The configuration's header gave way to the whole of it: one entry each.
        assert_eq!(snapshot.entries().len(), 9);
        assert!(snapshot.entries().iter().all(|e| e.complete), "{snapshot:?}");
        let whole = snapshot.answer(&setup(0x80, CONFIGURATION, 0, 0, 0xffff)).unwrap();
        assert_eq!(&whole[..], &configuration()[..]);
        let report = snapshot.answer(&setup(0x81, HID_REPORT, 0, 0, 63)).unwrap();
        assert_eq!(report.len(), 63);
    }

    #[test]
    fn a_usb_3_device_has_its_bos_taken_and_missing_parts_are_left_to_the_device() {
        let bos = [5u8, BOS, 12, 0, 1, 7, 0x10, 2, 2, 0, 0, 0];
        let (asked, snapshot) = run(|kind, index, w_index| match (kind, index) {
            (DEVICE, 0) => Some(device(0x0320)),
            (BOS, 0) => Some(bos.to_vec()),
            // Strings stall: none is kept, the rest still is.
            (STRING, _) => None,
            _ => keyboard(kind, index, w_index),
        });
        assert!(asked.contains(&setup(0x80, BOS, 0, 0, 12)));
        assert_eq!(snapshot.answer(&setup(0x80, BOS, 0, 0, 255)).unwrap(), &bos[..]);
        assert!(snapshot.answer(&setup(0x80, STRING, 0, 0, 255)).is_none());
        assert!(snapshot.answer(&setup(0x80, DEVICE, 0, 0, 18)).is_some());
    }

    #[test]
    fn a_device_that_does_not_answer_leaves_an_empty_snapshot() {
        let (asked, snapshot) = run(|_, _, _| None);
        assert_eq!(asked.len(), 1);
        assert!(snapshot.is_empty());
    }

    #[test]
    fn a_lying_device_cannot_make_the_plan_run_on() {
        // 255 configurations, each claiming 65535 bytes and naming strings it never gives.
        let (asked, snapshot) = run(|kind, _, _| match kind {
            DEVICE => Some(vec![18, 1, 0x10, 0x03, 0, 0, 0, 9, 1, 2, 3, 4, 0, 1, 7, 8, 9, 255]),
            CONFIGURATION => Some([vec![9, 2, 0xff, 0xff, 1, 1, 6, 0x80, 50], vec![0; 65_526]].concat()),
            BOS => Some([vec![5, BOS, 0xff, 0xff, 1], vec![0; 65_530]].concat()),
            _ => None,
        });
        assert!(asked.len() <= MAX_REQUESTS);
        let mut out = bytes::BytesMut::new();
        snapshot.encode(&mut out);
        assert!(out.len() <= super::super::HEADER_LEN + super::super::MAX_LEN);
    }

    #[test]
    fn walking_stops_at_a_descriptor_that_does_not_fit() {
        let data = [9u8, 2, 0, 0, 0, 0, 0, 0, 0, 9, 4, 0, 0, 0, 1];
        assert_eq!(walk(&data).count(), 1);
        assert_eq!(walk(&[0u8, 2, 3]).count(), 0);
    }
}
