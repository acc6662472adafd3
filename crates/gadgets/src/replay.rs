//! A recorded device served back (`--virtual replay=FILE`): a [`Device`]
//! that enumerates with the descriptors of a [`Recording`] and answers each
//! request with what the recorded device answered to the same request.
//!
//! * `GET_DESCRIPTOR` is answered from the recorded descriptors, in any
//!   order and any number of times (a client with the descriptor snapshot
//!   asks none of them, the kernel asks them in its own order);
//! * other control requests are matched by their SETUP packet, equal ones
//!   in recorded order, and OUT data stages compared;
//! * each data endpoint's URBs are answered in recorded order: IN gets the
//!   recorded data and status, OUT data is compared with the recorded bytes;
//! * a URB the recorded device never completed (still in flight, or
//!   cancelled) is held until cancelled, as is an IN past the recording's end.
//!
//! On a Bulk-Only mass-storage interface a command block matches in all but
//! its tag, and a TEST UNIT READY the recording lacks is answered as the
//! last recorded one when that passed ([`bulk_only`]).
//!
//! A request that differs is a divergence: in [`Mode::Strict`] it is
//! stalled and the recording's place is kept; in [`Mode::Lenient`] it gets
//! what the recording has. Each import's [`Report`] is logged in one line
//! when the import ends (the server resets the device) and given to
//! [`ReplayOptions::on_report`].
//!
//! It owns the matching and the report; the file's format is
//! [`recording`]'s. It is not an emulator: a workload other than the
//! recorded one gets stalls (or stale data), never new behaviour.
//! Isochronous transfers are answered in order like bulk, each packet with
//! its recorded status and length; the recording keeps one configuration.

mod bulk_only;
mod options;
pub mod recording;
mod report;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::{Instant, Sleep};
use tracing::{debug, info, warn};
use usbwire_device::descriptor::{parse_string, ConfigurationInfo};
use usbwire_device::{Completion, Device, DeviceSummary, Direction, IsoPacketDescriptor, Status, TransferType, Urb};

pub use options::{Mode, ReplayOptions, ReportSink, Timing};
pub use recording::{Recording, RecordingError};
pub use report::{Divergence, Report, Side, Unasked, MAX_LISTED};

use bulk_only::{BulkOnly, Unplaced};
use recording::{Exchange, Recorded};
use report::describe;

/// The longest a recorded completion is waited for with [`Timing::Recorded`].
pub const MAX_DELAY: Duration = Duration::from_secs(60);

/// A recording served as a device.
pub struct ReplayDevice {
    recording: Arc<Recording>,
    name: String,
    mode: Mode,
    timing: Timing,
    on_report: Option<ReportSink>,
    configuration: ConfigurationInfo,
    session: Session,
}

impl ReplayDevice {
    /// Replays the recording at `path`.
    pub fn open(path: &Path, options: ReplayOptions) -> Result<Self, RecordingError> {
        let recording = Recording::open(path)?;
        Ok(Self::new(recording, path.display().to_string(), options))
    }

    /// Replays `recording`, called `name` in logs.
    pub fn new(recording: Recording, name: String, options: ReplayOptions) -> Self {
        // The reader checked that the configuration parses; an empty one has no endpoints.
        let configuration = ConfigurationInfo::parse(&recording.configuration).unwrap_or(ConfigurationInfo {
            value: 1,
            attributes: 0x80,
            max_power: 0,
            interfaces: Vec::new(),
        });
        let session = Session::new(&recording, options.mode, &configuration);
        Self {
            recording: Arc::new(recording),
            name,
            mode: options.mode,
            timing: options.timing,
            on_report: options.on_report,
            configuration,
            session,
        }
    }

    /// The report of the import so far.
    pub fn report(&self) -> &Report {
        &self.session.report
    }

    /// Ends the import's account: lists what was never asked, logs it and
    /// hands it on; the next import starts from the recording's beginning.
    fn finish(&mut self) {
        let fresh = Session::new(&self.recording, self.mode, &self.configuration);
        let mut ended = std::mem::replace(&mut self.session, fresh);
        if ended.report.requests == 0 {
            return;
        }
        ended.list_unasked(&self.recording);
        let report = &ended.report;
        let first = report.first_divergences.first();
        let line = first.map(|d| format!("#{} on {}: {} ({})", d.position, d.endpoint, d.reason, d.request));
        if report.is_clean() {
            info!(target: "usbwire::replay", recording = %self.name, mode = %report.mode, requests = report.requests, matched = report.matched, never_asked = report.never_asked, "replay ended as recorded");
        } else {
            warn!(target: "usbwire::replay", recording = %self.name, mode = %report.mode, requests = report.requests, matched = report.matched, divergences = report.divergences, never_asked = report.never_asked, first = line.unwrap_or_default(), "replay diverged");
        }
        if let Some(sink) = self.on_report.as_mut() {
            sink(report);
        }
    }

    fn string(&self, index: u8) -> String {
        let ask = |value: u16, language: u16| {
            let [lo, hi] = value.to_le_bytes();
            let [lang_lo, lang_hi] = language.to_le_bytes();
            self.recording.descriptors.answer(&[0x80, 6, lo, hi, lang_lo, lang_hi, 0xff, 0])
        };
        if index == 0 {
            return String::new();
        }
        let language = ask(0x0300, 0).filter(|l| l.len() >= 4).map_or(0x0409, |l| u16::from_le_bytes([l[2], l[3]]));
        ask(0x0300 | u16::from(index), language).and_then(|bytes| parse_string(&bytes)).unwrap_or_default()
    }

    /// What a request on a data endpoint gets.
    fn answer_data(&mut self, urb: &Urb, position: u64) -> Answer {
        let address = urb.endpoint_address();
        if let Some(status) = urb.is_in().then(|| self.session.bulk_only.made_status(address)).flatten() {
            return Answer::Now(urb.complete_in(status));
        }
        let recording = Arc::clone(&self.recording);
        let Some((_, list)) = recording.endpoints.iter().find(|(a, _)| *a == address) else {
            return self.session.diverge(
                self.mode,
                urb,
                position,
                None,
                "the recording has no request on this endpoint",
            );
        };
        let mut index = self.session.next.get(&address).copied().unwrap_or(0);
        if urb.is_in() {
            index += self.session.bulk_only.skips_in(address);
            self.session.next.insert(address, index);
        }
        if !urb.is_in() {
            let recorded = list.iter().skip(index).map(|exchange| &exchange.out[..]);
            let checks = self.session.bulk_only.passes_over(address, recorded, &urb.data);
            if checks > 0 {
                self.session.report.ready_checks_passed_over += checks as u64;
                index += checks;
                self.session.next.insert(address, index);
            }
        }
        let Some(exchange) = list.get(index) else {
            if urb.is_in() {
                self.session.report.held_past_end += 1;
                return Answer::Held;
            }
            if let Unplaced::ReadyAnswered = self.session.bulk_only.unplaced_out(address, &urb.data) {
                self.session.report.ready_checks_answered += 1;
                return Answer::Now(urb.complete_out());
            }
            return self.session.diverge(self.mode, urb, position, None, "past the end of the recording");
        };
        let recorded_packets = exchange.completion.as_ref().map_or(0, |done| done.iso_packets.len());
        let reason = if urb.iso_packets.len() != recorded_packets && exchange.completion.is_some() {
            Some(format!("{} isochronous packets, the recording has {recorded_packets}", urb.iso_packets.len()))
        } else if urb.is_in() {
            let fits = exchange.completion.as_ref().is_none_or(|done| done.data.len() <= urb.length as usize);
            (!fits).then(|| format!("asks {} bytes, the recorded answer has more", urb.length))
        } else {
            let same = self.session.bulk_only.same_out(address, &exchange.out, &urb.data);
            (!same).then(|| differs(&exchange.out, &urb.data))
        };
        if reason.is_some() && !urb.is_in() {
            if let Unplaced::ReadyAnswered = self.session.bulk_only.unplaced_out(address, &urb.data) {
                self.session.report.ready_checks_answered += 1;
                return Answer::Now(urb.complete_out());
            }
        }
        if !urb.is_in() && (reason.is_none() || self.mode == Mode::Lenient) {
            self.session.bulk_only.matched_out(address, &exchange.out, &urb.data);
        }
        let answer = self.answer_data_from(urb, position, (exchange, index), reason);
        match answer {
            Answer::Now(done) => Answer::Now(self.bulk_only_in(address, done)),
            Answer::At(due, done) => Answer::At(due, self.bulk_only_in(address, done)),
            Answer::Held => Answer::Held,
        }
    }

    /// An IN completion as the host gets it: a CSW with the host's tag.
    fn bulk_only_in(&mut self, address: u8, mut done: Completion) -> Completion {
        if address & 0x80 != 0 && done.status == Status::OK {
            done.data = self.session.bulk_only.answered_in(address, std::mem::take(&mut done.data));
        }
        done
    }

    /// What a data request gets from the recorded `exchange` it was
    /// compared with, `reason` saying how it differs.
    fn answer_data_from(
        &mut self,
        urb: &Urb,
        position: u64,
        (exchange, index): (&Exchange, usize),
        reason: Option<String>,
    ) -> Answer {
        let next = self.session.next.entry(urb.endpoint_address()).or_default();
        match reason {
            Some(reason) if self.mode == Mode::Strict => {
                self.session.diverge(self.mode, urb, position, Some((exchange, index)), &reason)
            }
            Some(reason) => {
                *next += 1;
                let answer = replayed(urb, exchange, self.timing);
                self.session.diverge_answered(urb, position, (exchange, index), &reason, &answer);
                answer
            }
            None => {
                *next += 1;
                self.session.report.matched += 1;
                replayed(urb, exchange, self.timing)
            }
        }
    }

    /// What a control request gets.
    fn answer_control(&mut self, urb: &Urb, position: u64) -> Answer {
        if let Some(data) = self.recording.descriptors.answer(&urb.setup) {
            self.session.report.descriptors += 1;
            return Answer::Now(urb.complete_in(data));
        }
        let queue = self.session.control_left.get_mut(&urb.setup);
        let Some(index) = queue.as_ref().and_then(|q| q.front().copied()) else {
            if is_port_reset(&urb.setup) {
                self.session.report.resets += 1;
                self.session.configuration_value = 0;
                return Answer::Now(urb.complete_out());
            }
            if urb.setup == GET_CONFIGURATION {
                self.session.report.configuration_answered += 1;
                return Answer::Now(urb.complete_in(Bytes::from(vec![self.session.configuration_value])));
            }
            let seen = self.recording.control.iter().any(|e| e.setup == urb.setup);
            let reason = if seen { "asked more often than recorded" } else { "not in the recording" };
            return self.session.diverge(self.mode, urb, position, None, reason);
        };
        let exchange = &self.recording.control[index];
        let differ = (!urb.is_in() && exchange.out != urb.data).then(|| differs(&exchange.out, &urb.data));
        if differ.is_some() && self.mode == Mode::Strict {
            let reason = differ.unwrap_or_default();
            return self.session.diverge(self.mode, urb, position, Some((exchange, index)), &reason);
        }
        if let Some(queue) = queue {
            queue.pop_front();
        }
        let answer = replayed(urb, exchange, Timing::Asap);
        if is_set_configuration(&urb.setup) && matches!(&answer, Answer::Now(done) if done.status == Status::OK) {
            self.session.configuration_value = urb.setup[2];
        }
        match differ {
            Some(reason) => self.session.diverge_answered(urb, position, (exchange, index), &reason, &answer),
            None => self.session.report.matched += 1,
        }
        answer
    }
}

impl Device for ReplayDevice {
    fn summary(&self) -> DeviceSummary {
        let device = &self.recording.device;
        DeviceSummary {
            speed: self.recording.speed,
            vendor_id: device.vendor_id,
            product_id: device.product_id,
            bcd_device: device.bcd_device,
            class: device.class,
            subclass: device.subclass,
            protocol: device.protocol,
            configuration_value: self.configuration.value,
            num_configurations: device.num_configurations,
            interfaces: self.configuration.interface_classes(),
            product: self.string(device.product_index),
            manufacturer: self.string(device.manufacturer_index),
            serial: self.string(device.serial_index),
        }
    }

    fn endpoint_type(&self, direction: Direction, number: u8) -> Option<TransferType> {
        if number == 0 {
            return Some(TransferType::Control);
        }
        let address = number | if direction == Direction::In { 0x80 } else { 0 };
        self.configuration
            .interfaces
            .iter()
            .flat_map(|i| i.endpoints.iter())
            .find(|e| e.address == address)
            .map(|e| e.transfer_type)
    }

    fn submit(&mut self, urb: Urb) {
        self.session.report.requests += 1;
        let position = self.session.report.requests;
        let answer =
            if urb.endpoint == 0 { self.answer_control(&urb, position) } else { self.answer_data(&urb, position) };
        let key = if urb.endpoint == 0 { 0 } else { urb.endpoint_address() };
        self.session.queues.entry(key).or_default().push_back((urb, answer));
        if let Some(waker) = self.session.waker.take() {
            waker.wake();
        }
    }

    fn poll_complete(&mut self, cx: &mut Context<'_>) -> Poll<Completion> {
        self.session.waker = Some(cx.waker().clone());
        self.session.poll(cx)
    }

    fn cancel(&mut self, seqnum: u32) {
        for queue in self.session.queues.values_mut() {
            if let Some(at) = queue.iter().position(|(urb, _)| urb.seqnum == seqnum) {
                if let Some((urb, _)) = queue.remove(at) {
                    self.session.cancelled.push_back(urb.complete_with(Status::ECONNRESET));
                }
                break;
            }
        }
        if let Some(waker) = self.session.waker.take() {
            waker.wake();
        }
    }

    fn reset(&mut self) {
        self.finish();
    }
}

impl Drop for ReplayDevice {
    fn drop(&mut self) {
        self.finish();
    }
}

/// The standard `GET_CONFIGURATION` request (one byte).
const GET_CONFIGURATION: [u8; 8] = [0x80, 0x08, 0, 0, 0, 0, 1, 0];

/// A standard `SET_CONFIGURATION` to the device.
fn is_set_configuration(setup: &[u8; 8]) -> bool {
    setup[0] == 0x00 && setup[1] == 0x09
}

/// The hub class's `SET_FEATURE(PORT_RESET)`: on the wire to a device, the
/// host's request to reset it (Linux's usbip-host resets the device on it;
/// it never reaches one).
fn is_port_reset(setup: &[u8; 8]) -> bool {
    setup[..4] == [0x23, 0x03, 0x04, 0x00]
}

/// What a submitted URB gets.
enum Answer {
    Now(Completion),
    /// The completion, due at this time ([`Timing::Recorded`]).
    At(Instant, Completion),
    /// Nothing until it is cancelled.
    Held,
}

/// One import's progress through the recording.
struct Session {
    /// Unused recorded control requests, by SETUP packet, in recorded order.
    control_left: HashMap<[u8; 8], VecDeque<usize>>,
    /// The next recorded request of each data endpoint.
    next: HashMap<u8, usize>,
    /// URBs waiting for their answer, by endpoint (ep0 is 0): each completes in order.
    queues: BTreeMap<u8, VecDeque<(Urb, Answer)>>,
    bulk_only: BulkOnly,
    cancelled: VecDeque<Completion>,
    timer: Option<Pin<Box<Sleep>>>,
    waker: Option<Waker>,
    report: Report,
    /// The configuration the host set (by a recorded `SET_CONFIGURATION`
    /// answered good), 0 at first and after a port reset.
    configuration_value: u8,
}

impl Session {
    fn new(recording: &Recording, mode: Mode, configuration: &ConfigurationInfo) -> Self {
        let mut control_left: HashMap<[u8; 8], VecDeque<usize>> = HashMap::new();
        for (index, exchange) in recording.control.iter().enumerate() {
            control_left.entry(exchange.setup).or_default().push_back(index);
        }
        Self {
            control_left,
            next: HashMap::new(),
            queues: BTreeMap::new(),
            bulk_only: BulkOnly::of(configuration),
            cancelled: VecDeque::new(),
            timer: None,
            waker: None,
            report: Report { mode: mode.name().to_owned(), ..Report::default() },
            configuration_value: 0,
        }
    }

    /// Counts a divergence the device answers with a STALL (strict, or
    /// nothing recorded to answer with): the recording's place is kept.
    fn diverge(
        &mut self,
        mode: Mode,
        urb: &Urb,
        position: u64,
        recorded: Option<(&Exchange, usize)>,
        reason: &str,
    ) -> Answer {
        let lenient_sink = mode == Mode::Lenient && !urb.is_in() && urb.endpoint != 0 && recorded.is_none();
        // Lenient: OUT data past the recording is taken, as a sink would.
        let answer =
            if lenient_sink { Answer::Now(urb.complete_out()) } else { Answer::Now(urb.complete_with(Status::EPIPE)) };
        self.record(urb, position, recorded, reason, if lenient_sink { "accepted" } else { "stall" });
        debug!(position, endpoint = urb.endpoint_address(), reason, "replay: divergent request");
        answer
    }

    /// Counts a divergence answered from the recording anyway (lenient).
    fn diverge_answered(
        &mut self,
        urb: &Urb,
        position: u64,
        recorded: (&Exchange, usize),
        reason: &str,
        answer: &Answer,
    ) {
        let answered = if matches!(answer, Answer::Held) { "held" } else { "recorded" };
        self.record(urb, position, Some(recorded), reason, answered);
    }

    fn record(&mut self, urb: &Urb, position: u64, recorded: Option<(&Exchange, usize)>, reason: &str, answered: &str) {
        let data: &[u8] = if urb.is_in() { &[] } else { &urb.data };
        self.report.diverged(Divergence {
            position,
            endpoint: format!("{:#04x}", if urb.endpoint == 0 { urb.setup[0] & 0x80 } else { urb.endpoint_address() }),
            request: describe(urb.endpoint_address(), urb.setup, urb.length),
            reason: reason.to_owned(),
            recorded: recorded.map(|(exchange, index)| Side::recorded(exchange, index)),
            received: Side::received(urb.length, data),
            answered: answered.to_owned(),
        });
    }

    /// Adds every recorded request this import did not reach to the report.
    fn list_unasked(&mut self, recording: &Recording) {
        let mut left: Vec<usize> = self.control_left.values().flatten().copied().collect();
        left.sort_unstable();
        for index in left {
            self.report.unasked(&recording.control[index]);
        }
        for (address, list) in &recording.endpoints {
            let next = self.next.get(address).copied().unwrap_or(0);
            for exchange in list.iter().skip(next) {
                self.report.unasked(exchange);
            }
        }
    }

    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Completion> {
        if let Some(done) = self.cancelled.pop_front() {
            return Poll::Ready(done);
        }
        loop {
            let now = Instant::now();
            let mut earliest: Option<Instant> = None;
            for queue in self.queues.values_mut() {
                let ready = match queue.front() {
                    Some((_, Answer::Now(_))) => true,
                    Some((_, Answer::At(due, _))) if *due <= now => true,
                    Some((_, Answer::At(due, _))) => {
                        earliest = Some(earliest.map_or(*due, |e| e.min(*due)));
                        false
                    }
                    Some((_, Answer::Held)) | None => false,
                };
                if ready {
                    if let Some((_, Answer::Now(done) | Answer::At(_, done))) = queue.pop_front() {
                        return Poll::Ready(done);
                    }
                }
            }
            let Some(due) = earliest else { return Poll::Pending };
            if tokio::runtime::Handle::try_current().is_err() {
                // No clock to wait on: answered at once.
                self.release_timed();
                continue;
            }
            let timer = self.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(due)));
            if timer.deadline() != due {
                timer.as_mut().reset(due);
            }
            if std::future::Future::poll(timer.as_mut(), cx).is_pending() {
                return Poll::Pending;
            }
        }
    }

    /// Makes every timed answer due now.
    fn release_timed(&mut self) {
        for queue in self.queues.values_mut() {
            for (_, answer) in queue.iter_mut() {
                if let Answer::At(_, done) = answer {
                    *answer = Answer::Now(std::mem::replace(done, empty()));
                }
            }
        }
    }
}

/// What the recorded device answered, given to `urb`.
fn replayed(urb: &Urb, exchange: &Exchange, timing: Timing) -> Answer {
    let Some(done) = exchange.completion.as_ref() else { return Answer::Held };
    // A recorded URB that ended by being cancelled waited until then: so does this one.
    if matches!(done.status, Status::ECONNRESET | Status::ENOENT | Status::ESHUTDOWN) {
        return Answer::Held;
    }
    let completion = completion(urb, done);
    let delay = done.completed_at.saturating_sub(exchange.submitted_at).min(MAX_DELAY);
    match timing {
        Timing::Recorded if urb.is_in() && urb.endpoint != 0 && !delay.is_zero() => {
            Answer::At(Instant::now() + delay, completion)
        }
        _ => Answer::Now(completion),
    }
}

fn completion(urb: &Urb, done: &Recorded) -> Completion {
    let mut completion = urb.complete_with(done.status);
    if urb.is_in() {
        let data = done.data.slice(..done.data.len().min(urb.length as usize));
        completion.actual_length = data.len() as u32;
        completion.data = data;
    } else {
        completion.actual_length = done.actual_length.min(urb.data.len() as u32);
    }
    // An isochronous URB's packets: where and how long the host asked them, what moved and how.
    completion.iso_packets = urb
        .iso_packets
        .iter()
        .zip(&done.iso_packets)
        .map(|(asked, recorded)| IsoPacketDescriptor {
            offset: asked.offset,
            length: asked.length,
            actual_length: recorded.actual_length.min(asked.length),
            status: recorded.status,
        })
        .collect();
    completion.error_count = if completion.iso_packets.is_empty() { 0 } else { done.error_count };
    completion
}

/// Where OUT data first differs from the recorded bytes, in words.
fn differs(recorded: &Bytes, received: &Bytes) -> String {
    match recorded.iter().zip(received.iter()).position(|(a, b)| a != b) {
        Some(at) => format!("OUT data differs from byte {at} on"),
        None => format!("OUT data is {} bytes, the recorded {}", received.len(), recorded.len()),
    }
}

fn empty() -> Completion {
    Completion {
        seqnum: 0,
        status: Status::OK,
        actual_length: 0,
        data: Bytes::new(),
        start_frame: 0,
        number_of_packets: 0,
        error_count: 0,
        iso_packets: Vec::new(),
    }
}

#[cfg(test)]
mod tests;
