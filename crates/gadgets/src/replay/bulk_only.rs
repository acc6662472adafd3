//! Bulk-Only mass storage in a replay: what a replay must know of the
//! command blocks (CBW) and statuses (CSW) on an interface of class 08,
//! subclass 06, protocol 50 so that a disk replays to a host that is not
//! the recorded one byte for byte.
//!
//! * A CBW matches the recorded one in everything but its tag (a host numbers
//!   its commands as it likes: usb-storage from 1 per device, another host
//!   otherwise); the recorded CSW that answers it gets the host's tag.
//! * A TEST UNIT READY the recording does not have at that place (the block
//!   layer's media polling, at its own pace) is answered as the device
//!   answered the last recorded TEST UNIT READY of that LUN — good — without
//!   moving the recording on. Only when that one passed: a failed one (no
//!   medium, a unit attention) carries sense data the replay cannot know to
//!   be current, so such a command is a divergence as before.
//! * Recorded TEST UNIT READYs the host does not send at that place (the
//!   recorded host's polling) are passed over, with their CSWs, when the
//!   host's command is the one recorded after them.
//!
//! It owns the pipes' state between a CBW and its CSW; matching the rest
//! and the report are the replay's.

use bytes::Bytes;
use usbwire_device::descriptor::ConfigurationInfo;

const CBW_LEN: usize = 31;
const CSW_LEN: usize = 13;
const TEST_UNIT_READY: u8 = 0x00;
/// The LUNs a CBW can name (four bits).
const LUNS: usize = 16;

/// The Bulk-Only pipes of the recorded configuration.
#[derive(Debug, Default)]
pub(super) struct BulkOnly {
    pipes: Vec<Pipe>,
}

#[derive(Debug)]
struct Pipe {
    bulk_out: u8,
    bulk_in: u8,
    /// The command matched last: the host's tag, the recorded tag, and
    /// whether it was a TEST UNIT READY (its LUN).
    command: Option<Command>,
    /// A CSW made here for a TEST UNIT READY answered off the recording:
    /// the next IN on the pipe gets it.
    made_status: Option<Bytes>,
    /// Whether the last recorded TEST UNIT READY of each LUN passed.
    ready: [bool; LUNS],
    /// Recorded CSWs of passed-over TEST UNIT READYs still to pass over on the IN pipe.
    skip_in: usize,
}

#[derive(Clone, Copy, Debug)]
struct Command {
    host_tag: [u8; 4],
    recorded_tag: [u8; 4],
    ready_check_of: Option<u8>,
}

/// What the replay does with an OUT on a Bulk-Only pipe that does not
/// match the recording.
pub(super) enum Unplaced {
    /// A TEST UNIT READY answered here: the CBW taken, its CSW made.
    ReadyAnswered,
    /// Not one this module answers.
    Diverges,
}

impl BulkOnly {
    pub(super) fn of(configuration: &ConfigurationInfo) -> Self {
        let pipes = configuration
            .interfaces
            .iter()
            .filter(|interface| interface.is_bulk_only_storage())
            .filter_map(|interface| {
                Some(Pipe {
                    bulk_out: interface.bulk_endpoint(false)?,
                    bulk_in: interface.bulk_endpoint(true)?,
                    command: None,
                    made_status: None,
                    ready: [false; LUNS],
                    skip_in: 0,
                })
            })
            .collect();
        Self { pipes }
    }

    /// Whether OUT data `received` on endpoint `address` is what was
    /// `recorded`: equal, or both CBWs on a Bulk-Only pipe equal but for the tag.
    pub(super) fn same_out(&self, address: u8, recorded: &[u8], received: &[u8]) -> bool {
        if recorded == received {
            return true;
        }
        self.pipes.iter().any(|pipe| pipe.bulk_out == address)
            && is_cbw(recorded)
            && is_cbw(received)
            && recorded[..4] == received[..4]
            && recorded[8..] == received[8..]
    }

    /// An OUT on `address` answered from the recording (`recorded`): a CBW's
    /// tags are kept for its CSW.
    pub(super) fn matched_out(&mut self, address: u8, recorded: &[u8], received: &[u8]) {
        let Some(pipe) = self.pipes.iter_mut().find(|pipe| pipe.bulk_out == address) else { return };
        pipe.command = (is_cbw(recorded) && is_cbw(received)).then(|| Command {
            host_tag: tag(received),
            recorded_tag: tag(recorded),
            ready_check_of: (received[15] == TEST_UNIT_READY && received[8..12] == [0; 4])
                .then_some(received[13] & 0x0f),
        });
    }

    /// An OUT on `address` the recording has not at this place.
    pub(super) fn unplaced_out(&mut self, address: u8, received: &[u8]) -> Unplaced {
        let Some(pipe) = self.pipes.iter_mut().find(|pipe| pipe.bulk_out == address) else { return Unplaced::Diverges };
        let is_ready_check = is_cbw(received) && received[15] == TEST_UNIT_READY && received[8..12] == [0; 4];
        let lun = usize::from(received.get(13).copied().unwrap_or(0) & 0x0f);
        if !is_ready_check || !pipe.ready[lun] || pipe.made_status.is_some() {
            return Unplaced::Diverges;
        }
        let mut csw = [0u8; CSW_LEN];
        csw[..4].copy_from_slice(b"USBS");
        csw[4..8].copy_from_slice(&tag(received));
        pipe.made_status = Some(Bytes::copy_from_slice(&csw));
        pipe.command = None;
        Unplaced::ReadyAnswered
    }

    /// How many recorded OUTs on `address` from the recording's place on
    /// (`recorded`, in order) to pass over before the host's `received`: the
    /// TEST UNIT READYs the host never sent (the recorded host's polling), when
    /// the command recorded after them is the host's. Their CSWs are passed over
    /// on the IN pipe as it comes to them.
    pub(super) fn passes_over<'a>(
        &mut self,
        address: u8,
        recorded: impl Iterator<Item = &'a [u8]>,
        received: &[u8],
    ) -> usize {
        if !is_cbw(received) {
            return 0;
        }
        let mut checks = 0;
        let mut found = false;
        for out in recorded {
            if self.same_out(address, out, received) {
                found = true;
                break;
            }
            if !is_cbw(out) || out[15] != TEST_UNIT_READY || out[8..12] != [0; 4] {
                return 0;
            }
            checks += 1;
        }
        if !found {
            return 0;
        }
        if let Some(pipe) = self.pipes.iter_mut().find(|pipe| pipe.bulk_out == address) {
            pipe.skip_in += checks;
        }
        checks
    }

    /// How many recorded INs on `address` to pass over before the next (CSWs of passed-over checks), taken.
    pub(super) fn skips_in(&mut self, address: u8) -> usize {
        self.pipes.iter_mut().find(|pipe| pipe.bulk_in == address).map_or(0, |pipe| std::mem::take(&mut pipe.skip_in))
    }

    /// The CSW made here that an IN on `address` gets, taken.
    pub(super) fn made_status(&mut self, address: u8) -> Option<Bytes> {
        self.pipes.iter_mut().find(|pipe| pipe.bulk_in == address)?.made_status.take()
    }

    /// The recorded IN data `data` on `address` as the host gets it: the
    /// CSW of the command matched last with the host's tag. Notes whether a
    /// TEST UNIT READY passed.
    pub(super) fn answered_in(&mut self, address: u8, data: Bytes) -> Bytes {
        let Some(pipe) = self.pipes.iter_mut().find(|pipe| pipe.bulk_in == address) else { return data };
        let Some(command) = pipe.command else { return data };
        if data.len() != CSW_LEN || !data.starts_with(b"USBS") || data[4..8] != command.recorded_tag {
            return data;
        }
        pipe.command = None;
        if let Some(lun) = command.ready_check_of {
            pipe.ready[usize::from(lun)] = data[12] == 0;
        }
        let mut csw = data.to_vec();
        csw[4..8].copy_from_slice(&command.host_tag);
        Bytes::from(csw)
    }
}

fn is_cbw(data: &[u8]) -> bool {
    data.len() == CBW_LEN && data.starts_with(b"USBC")
}

fn tag(cbw: &[u8]) -> [u8; 4] {
    [cbw[4], cbw[5], cbw[6], cbw[7]]
}

#[cfg(test)]
mod tests;
