//! The stage gate of a session that agreed to the storage extension
//! ([`crate::storage`], `docs/protocol.md` §5.7): URBs flagged
//! [`STAGE`](crate::storage::STAGE) reach the device one at a time, in the
//! order they arrived, each only once the one before it completed — the
//! discipline a Bulk-Only host keeps (command block, data, status) — while the
//! client sends them without waiting. One flagged
//! [`AFTER_SUCCESS`](crate::storage::AFTER_SUCCESS) whose predecessor failed
//! never reaches the device. It is not for what a stage means (the session
//! does not read command blocks) nor for URBs without the flag, which pass as
//! before.

use std::collections::VecDeque;

use bytes::Bytes;

use crate::storage;
use crate::urb::{CmdSubmit, RetSubmit};

/// What the gate decides for the next held stage.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Next {
    /// Hand it to the device (its flags are the device's already).
    Run(CmdSubmit),
    /// Complete it at once with [`storage::SKIPPED`]: the stage before it failed.
    Skip(u32),
}

#[derive(Debug)]
enum Held {
    Stage(CmdSubmit),
    /// Unlinked before it ran: answered already, it still stands in line as a failed stage.
    Withdrawn,
}

#[derive(Debug)]
pub(super) struct Stages {
    /// Stages not yet handed to the device, in arrival order.
    held: VecDeque<Held>,
    /// The stage at the device, if one is.
    running: Option<u32>,
    /// Whether the last stage to finish completed with status 0.
    last_succeeded: bool,
}

impl Default for Stages {
    fn default() -> Self {
        Self { held: VecDeque::new(), running: None, last_succeeded: true }
    }
}

impl Stages {
    pub(super) fn hold(&mut self, submit: CmdSubmit) {
        self.held.push_back(Held::Stage(submit));
    }

    /// The next stage to run or skip, if the device has none now.
    pub(super) fn next(&mut self) -> Option<Next> {
        if self.running.is_some() {
            return None;
        }
        let mut submit = loop {
            match self.held.pop_front()? {
                Held::Stage(submit) => break submit,
                Held::Withdrawn => self.last_succeeded = false,
            }
        };
        if storage::after_success(submit.transfer_flags) && !self.last_succeeded {
            return Some(Next::Skip(submit.seqnum));
        }
        submit.transfer_flags = storage::device_flags(submit.transfer_flags);
        self.running = Some(submit.seqnum);
        Some(Next::Run(submit))
    }

    /// A URB completed (any URB: only the running stage's counts).
    pub(super) fn completed(&mut self, seqnum: u32, succeeded: bool) {
        if self.running == Some(seqnum) {
            self.running = None;
            self.last_succeeded = succeeded;
        }
    }

    /// A skipped stage counts as a failed one: what is chained to it is skipped too.
    pub(super) fn skipped(&mut self) {
        self.last_succeeded = false;
    }

    /// Takes back a stage that has not reached the device (it was unlinked):
    /// `true` if it was held. It keeps its place in line as a failed stage,
    /// like a cancelled URB, so what is chained to it is skipped.
    pub(super) fn withdraw(&mut self, seqnum: u32) -> bool {
        let Some(held) = self.held.iter_mut().find(|held| matches!(held, Held::Stage(s) if s.seqnum == seqnum)) else {
            return false;
        };
        *held = Held::Withdrawn;
        true
    }
}

/// Whether a stage succeeded: status 0, and, when it read a command status
/// wrapper (13 bytes, "USBS"), one that reports the command passed — after a
/// failed command nothing chained may run before the host asks for its sense.
pub(super) fn succeeded(done: &RetSubmit) -> bool {
    let failed_command = done.data.len() == 13 && done.data.starts_with(b"USBS") && done.data[12] != 0;
    done.status == crate::Status::OK && !failed_command
}

/// The reply of a stage that was skipped: nothing moved, [`storage::SKIPPED`].
pub(super) fn skipped(seqnum: u32) -> RetSubmit {
    RetSubmit::new(seqnum, storage::SKIPPED, Bytes::new())
}
