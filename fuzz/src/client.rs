//! The `client_session` harness: a resumable [`ClientSession`] with URBs of every
//! shape outstanding, fed whatever a hostile server sends, cut and resumed at a
//! point the input picks, with a command count the input claims.
//!
//! Input: `[chunking, cut, claim] ++ stream`. Eight submits (bulk IN and OUT,
//! control, isochronous IN with 3 packets) and one unlink are outstanding; the
//! stream arrives in pieces (`chunking`, as in the decoder harnesses); after piece
//! number `cut % 8` the connection drops and the session resumes with `claim % 16`
//! commands received. With `claim`'s top bit set the session has keep-alive,
//! and a virtual clock moves on by a quarter second times `piece.len() % 7`
//! after each piece, running its timer (pings queued, silence declared).
//!
//! Invariants: no panic; a reply is delivered at most once per seqnum; an error
//! ends the session (the driver closes the connection) and nothing is delivered
//! after it; a claim beyond the commands sent is refused; the commands queued
//! again are exactly those from the claim on, and the outstanding table never
//! grows from what the server sends; a timer never changes what is
//! outstanding, and silence is only declared after the bounds of
//! `usbwire_proto::liveness`.

use std::collections::HashSet;

use bytes::Bytes;
use usbwire_proto::client_session::{ClientSession, Event, READ_CHUNK};
use usbwire_proto::urb::{CmdSubmit, CmdUnlink, IsoPacketDescriptor, TransferFlags};
use usbwire_proto::{Budget, Direction, Limits, RecvBuffer, Status};

const DEVID: u32 = 0x0001_0002;

fn submit(seqnum: u32, direction: Direction, ep: u8, length: u32, iso: usize) -> CmdSubmit {
    let iso_packets: Vec<IsoPacketDescriptor> = (0..iso)
        .map(|i| IsoPacketDescriptor { offset: (i * 64) as u32, length: 64, actual_length: 0, status: Status::OK })
        .collect();
    CmdSubmit {
        seqnum,
        devid: DEVID,
        direction,
        ep,
        transfer_flags: TransferFlags::default(),
        transfer_buffer_length: length,
        start_frame: 0,
        number_of_packets: iso as i32,
        interval: 0,
        setup: [0; 8],
        data: if direction == Direction::Out { Bytes::from(vec![0x5a; length as usize]) } else { Bytes::new() },
        iso_packets,
    }
}

pub fn client_session(data: &[u8]) {
    let Some((&[chunking, cut, claim], stream)) = crate::split_control::<3>(data) else { return };
    let mut session: ClientSession<u32> = ClientSession::new(DEVID, Limits::default(), Budget::default()).resumable();
    let mut input = RecvBuffer::with_capacity(READ_CHUNK);
    let start = std::time::Instant::now();
    let mut now = start;
    let keepalive = claim & 0x80 != 0;
    if keepalive {
        session = session.keepalive(now);
    }
    let shapes = [
        (Direction::In, 1, 512, 0),
        (Direction::Out, 2, 512, 0),
        (Direction::In, 0, 18, 0),
        (Direction::Out, 0, 0, 0),
        (Direction::In, 3, 192, 3),
        (Direction::In, 1, 4096, 0),
        (Direction::Out, 2, 4096, 0),
        (Direction::In, 1, 0, 0),
    ];
    for (i, (direction, ep, length, iso)) in shapes.into_iter().enumerate() {
        let seqnum = i as u32 + 1;
        session.submit(submit(seqnum, direction, ep, length, iso), seqnum).expect("fresh seqnums");
    }
    session.unlink(CmdUnlink { seqnum: 9, devid: DEVID, unlink_seqnum: 2 }).expect("fresh seqnum");
    const SENT: u64 = 9;
    let mut answered = HashSet::new();
    for (index, piece) in crate::chunks(stream, chunking).into_iter().enumerate() {
        let before = session.outstanding();
        input.extend_from_slice(piece);
        let mut events = Vec::new();
        let result = session.handle_input(&mut input, |event| events.push(event));
        for event in events {
            let seqnum = match event {
                Event::Completed { reply, tag } => {
                    assert_eq!(reply.seqnum, tag, "a reply is handed to its own submit");
                    reply.seqnum
                }
                Event::Unlinked { reply, cancelled, .. } => {
                    if let Some((target, _)) = cancelled {
                        assert!(answered.insert(target), "seqnum {target} answered twice");
                    }
                    reply.seqnum
                }
            };
            assert!(answered.insert(seqnum), "seqnum {seqnum} answered twice");
        }
        assert!(session.outstanding() <= before, "the server's bytes made the table grow");
        if result.is_err() {
            return;
        }
        if keepalive {
            now += std::time::Duration::from_millis(250 * (piece.len() % 7) as u64);
            let outstanding = session.outstanding();
            match session.handle_timeout(now, true) {
                Ok(()) => {}
                Err(usbwire_proto::client_session::ClientSessionError::Silent(silent)) => {
                    assert!(silent >= usbwire_proto::liveness::BUSY_SILENCE, "called silent after {silent:?}");
                    return;
                }
                Err(error) => panic!("a timer failed with {error}"),
            }
            assert_eq!(session.outstanding(), outstanding, "a timer changed what is outstanding");
        }
        if index == usize::from(cut % 8) {
            session.disconnected();
            input.clear();
            let claimed = u64::from(claim % 16);
            match session.resumed(claimed) {
                Ok(again) => {
                    assert!(claimed <= SENT, "a claim beyond the commands sent was accepted");
                    assert!(again <= (SENT - claimed) as usize, "queued again more than the server lacks");
                    assert!(again <= session.outstanding());
                }
                Err(_) => {
                    assert!(claimed > SENT, "a possible claim was refused");
                    return;
                }
            }
        }
    }
}
