//! Golden vectors: the hand-built messages in `tests/vectors/*.hex` (each with its
//! provenance in the file) must decode to the message written here, and that message must
//! encode to exactly those bytes.

use bytes::{Bytes, BytesMut};
use usbwire_proto::op::{self, BusId, DeviceRecord, InterfaceRecord, OpRequest, OpStatus};
use usbwire_proto::urb::{
    self, ClientMessage, CmdSubmit, CmdUnlink, IsoPacketDescriptor, RetSubmit, RetUnlink, ServerMessage,
    SubmittedShape, TransferFlags,
};
use usbwire_proto::{Direction, Limits, Speed, Status};

macro_rules! vector {
    ($name:literal) => {
        parse_hex(include_str!(concat!("../../../tests/vectors/", $name, ".hex")))
    };
}

/// Parses the vector format described in `tests/vectors/README.md`.
fn parse_hex(text: &str) -> Vec<u8> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or_default();
        for token in line.split_whitespace() {
            if let Some((byte, count)) = token.split_once('*') {
                let byte = u8::from_str_radix(byte, 16).expect("run byte");
                out.extend(std::iter::repeat_n(byte, count.parse().expect("run length")));
            } else {
                assert!(token.len() % 2 == 0, "odd hex token {token:?}");
                for pair in token.as_bytes().chunks(2) {
                    out.push(u8::from_str_radix(std::str::from_utf8(pair).unwrap(), 16).expect("hex digit"));
                }
            }
        }
    }
    out
}

fn encode_client(message: &ClientMessage) -> Vec<u8> {
    let mut out = BytesMut::new();
    match message {
        ClientMessage::Submit(submit) => submit.encode(&mut out),
        ClientMessage::Unlink(unlink) => out.extend_from_slice(&unlink.header()),
    }
    out.to_vec()
}

fn encode_server(message: &ServerMessage) -> Vec<u8> {
    let mut out = BytesMut::new();
    match message {
        ServerMessage::Submit(ret) => ret.encode(&mut out),
        ServerMessage::Unlink(ret) => out.extend_from_slice(&ret.header()),
    }
    out.to_vec()
}

/// Asserts both directions for a client message on an endpoint that is (or is not) isochronous.
fn check_command(bytes: &[u8], iso: bool, expected: ClientMessage) {
    assert_eq!(encode_client(&expected), bytes, "encode");
    let mut buf = BytesMut::from(bytes);
    let limits = Limits::default();
    assert_eq!(urb::command_frame_len(&buf, &limits, |_, _| iso), Ok(Some(bytes.len())));
    let decoded = urb::decode_command(&mut buf, &limits, |_, _| iso).expect("decode").expect("complete");
    assert_eq!(decoded, expected, "decode");
    assert!(buf.is_empty(), "decode consumed {} of {} bytes", bytes.len() - buf.len(), bytes.len());
}

fn check_return(bytes: &[u8], shape: SubmittedShape, expected: ServerMessage) {
    assert_eq!(encode_server(&expected), bytes, "encode");
    let mut buf = BytesMut::from(bytes);
    let decoded = urb::decode_return(&mut buf, &Limits::default(), |_| Some(shape)).expect("decode").expect("complete");
    assert_eq!(decoded, expected, "decode");
    assert!(buf.is_empty());
}

/// Device 0 of `op_rep_devlist.hex` (and the device of `op_rep_import_ok.hex`).
fn logitech_receiver() -> DeviceRecord {
    DeviceRecord {
        path: "/sys/devices/pci0000:00/0000:00:1d.1/usb3/3-2".into(),
        busid: BusId::new("3-2").unwrap(),
        busnum: 3,
        devnum: 2,
        speed: Speed::FULL,
        id_vendor: 0x046d,
        id_product: 0xc52b,
        bcd_device: 0x1211,
        b_device_class: 0,
        b_device_sub_class: 0,
        b_device_protocol: 0,
        b_configuration_value: 1,
        b_num_configurations: 1,
        interfaces: vec![
            InterfaceRecord { b_interface_class: 3, b_interface_sub_class: 1, b_interface_protocol: 1 },
            InterfaceRecord { b_interface_class: 3, b_interface_sub_class: 1, b_interface_protocol: 2 },
            InterfaceRecord { b_interface_class: 3, b_interface_sub_class: 0, b_interface_protocol: 0 },
        ],
        b_num_interfaces: 3,
    }
}

fn virtual_device() -> DeviceRecord {
    DeviceRecord {
        path: "/usbwire".into(),
        busid: BusId::new("1-1").unwrap(),
        busnum: 1,
        devnum: 1,
        speed: Speed::HIGH,
        id_vendor: 0x1209,
        id_product: 0x0001,
        bcd_device: 0x0100,
        b_device_class: 0xef,
        b_device_sub_class: 0x02,
        b_device_protocol: 0x01,
        b_configuration_value: 0,
        b_num_configurations: 1,
        interfaces: vec![],
        b_num_interfaces: 0,
    }
}

#[test]
fn op_req_devlist() {
    let bytes = vector!("op_req_devlist");
    let mut out = BytesMut::new();
    OpRequest::DevList.encode(&mut out);
    assert_eq!(&out[..], &bytes[..]);
    let mut buf = BytesMut::from(&bytes[..]);
    assert_eq!(op::decode_request(&mut buf, &Limits::default()), Ok(Some(OpRequest::DevList)));
    assert!(buf.is_empty());
}

#[test]
fn op_req_import() {
    let bytes = vector!("op_req_import");
    assert_eq!(bytes.len(), 40);
    let request = OpRequest::Import { busid: BusId::new("1-1").unwrap() };
    let mut out = BytesMut::new();
    request.encode(&mut out);
    assert_eq!(&out[..], &bytes[..]);
    let mut buf = BytesMut::from(&bytes[..]);
    assert_eq!(op::decode_request(&mut buf, &Limits::default()), Ok(Some(request)));
    assert!(buf.is_empty());
}

#[test]
fn op_rep_devlist_empty() {
    let bytes = vector!("op_rep_devlist_empty");
    let mut out = BytesMut::new();
    op::encode_devlist_reply(&[], &mut out);
    assert_eq!(&out[..], &bytes[..]);
    let mut buf = BytesMut::from(&bytes[..]);
    assert_eq!(op::decode_devlist_reply(&mut buf, &Limits::default()), Ok(Some(vec![])));
    assert!(buf.is_empty());
}

#[test]
fn op_rep_devlist() {
    let bytes = vector!("op_rep_devlist");
    let devices = [logitech_receiver(), virtual_device()];
    // The absolute offsets of `docs/protocol.md` §2.2 / usbip_protocol.rst, device 0.
    assert_eq!(&bytes[0x0C..0x0C + 4], b"/sys");
    assert_eq!(&bytes[0x10C..0x10F], b"3-2");
    assert_eq!(&bytes[0x12C..0x130], &3u32.to_be_bytes()); // busnum
    assert_eq!(&bytes[0x130..0x134], &2u32.to_be_bytes()); // devnum
    assert_eq!(&bytes[0x134..0x138], &2u32.to_be_bytes()); // speed
    assert_eq!(&bytes[0x138..0x13E], &[0x04, 0x6d, 0xc5, 0x2b, 0x12, 0x11]); // idVendor, idProduct, bcdDevice
    assert_eq!(bytes[0x141], 1); // bConfigurationValue
    assert_eq!(bytes[0x142], 1); // bNumConfigurations
    assert_eq!(bytes[0x143], 3); // bNumInterfaces
    assert_eq!(&bytes[0x144..0x150], &[3, 1, 1, 0, 3, 1, 2, 0, 3, 0, 0, 0]);
    // Device 1 starts right after device 0's interfaces: records have variable size.
    assert_eq!(0x150, 12 + op::DEVICE_RECORD_LEN + 3 * op::INTERFACE_RECORD_LEN);
    assert_eq!(&bytes[0x150..0x158], b"/usbwire");
    assert_eq!(bytes.len(), 0x150 + op::DEVICE_RECORD_LEN);

    let mut out = BytesMut::new();
    op::encode_devlist_reply(&devices, &mut out);
    assert_eq!(&out[..], &bytes[..]);
    let mut buf = BytesMut::from(&bytes[..]);
    assert_eq!(op::decode_devlist_reply(&mut buf, &Limits::default()), Ok(Some(devices.to_vec())));
    assert!(buf.is_empty());
}

#[test]
fn op_rep_import_ok() {
    let bytes = vector!("op_rep_import_ok");
    assert_eq!(bytes.len(), 320);
    // IMPORT carries bNumInterfaces but no interface records.
    let device = DeviceRecord { interfaces: vec![], ..logitech_receiver() };
    let mut out = BytesMut::new();
    op::encode_import_reply(Ok(&device), &mut out);
    assert_eq!(&out[..], &bytes[..]);
    let mut buf = BytesMut::from(&bytes[..]);
    assert_eq!(op::decode_import_reply(&mut buf), Ok(Some(Ok(device))));
    assert!(buf.is_empty());
}

#[test]
fn op_rep_import_nodev() {
    let bytes = vector!("op_rep_import_nodev");
    let mut out = BytesMut::new();
    op::encode_import_reply(Err(OpStatus::NODEV), &mut out);
    assert_eq!(&out[..], &bytes[..]);
    let mut buf = BytesMut::from(&bytes[..]);
    assert_eq!(op::decode_import_reply(&mut buf), Ok(Some(Err(OpStatus::NODEV))));
    assert!(buf.is_empty());
}

#[test]
fn cmd_submit_intr_in_kernel_doc() {
    check_command(
        &vector!("cmd_submit_intr_in_kernel_doc"),
        false,
        ClientMessage::Submit(CmdSubmit {
            seqnum: 0xd05,
            devid: 0x0001_000f,
            direction: Direction::In,
            ep: 1,
            transfer_flags: TransferFlags(TransferFlags::DIR_IN),
            transfer_buffer_length: 64,
            start_frame: -1,
            number_of_packets: 0,
            interval: 4,
            setup: [0; 8],
            data: Bytes::new(),
            iso_packets: vec![],
        }),
    );
}

fn get_descriptor() -> CmdSubmit {
    CmdSubmit {
        seqnum: 1,
        devid: 0x0003_0002,
        direction: Direction::In,
        ep: 0,
        transfer_flags: TransferFlags(TransferFlags::DIR_IN),
        transfer_buffer_length: 18,
        start_frame: 0,
        number_of_packets: 0,
        interval: 0,
        setup: [0x80, 0x06, 0x00, 0x01, 0x00, 0x00, 0x12, 0x00],
        data: Bytes::new(),
        iso_packets: vec![],
    }
}

#[test]
fn cmd_submit_get_descriptor() {
    let bytes = vector!("cmd_submit_get_descriptor");
    assert_eq!(bytes.len(), urb::HEADER_LEN);
    assert_eq!(&bytes[0x28..0x30], &[0x80, 0x06, 0x00, 0x01, 0x00, 0x00, 0x12, 0x00]);
    check_command(&bytes, false, ClientMessage::Submit(get_descriptor()));
}

#[test]
fn ret_submit_get_descriptor() {
    let descriptor =
        [0x12, 0x01, 0x00, 0x02, 0x00, 0x00, 0x00, 0x08, 0x6d, 0x04, 0x2b, 0xc5, 0x11, 0x12, 0x01, 0x02, 0x00, 0x01];
    check_return(
        &vector!("ret_submit_get_descriptor"),
        SubmittedShape { direction: Direction::In, transfer_buffer_length: 18, iso_packets: None },
        ServerMessage::Submit(RetSubmit {
            seqnum: 1,
            status: Status::OK,
            actual_length: 18,
            start_frame: 0,
            number_of_packets: 0,
            error_count: 0,
            data: Bytes::copy_from_slice(&descriptor),
            iso_packets: vec![],
        }),
    );
}

#[test]
fn cmd_submit_bulk_out() {
    let mut cbw = b"USBC\x01\0\0\0\0\0\0\0\0\0\x06".to_vec();
    cbw.resize(31, 0);
    check_command(
        &vector!("cmd_submit_bulk_out"),
        false,
        ClientMessage::Submit(CmdSubmit {
            seqnum: 5,
            devid: 0x0001_0001,
            direction: Direction::Out,
            ep: 2,
            transfer_flags: TransferFlags(0),
            transfer_buffer_length: 31,
            start_frame: 0,
            number_of_packets: 0,
            interval: 0,
            setup: [0; 8],
            data: Bytes::from(cbw),
            iso_packets: vec![],
        }),
    );
}

#[test]
fn ret_submit_bulk_out() {
    check_return(
        &vector!("ret_submit_bulk_out"),
        SubmittedShape { direction: Direction::Out, transfer_buffer_length: 31, iso_packets: None },
        ServerMessage::Submit(RetSubmit {
            seqnum: 5,
            status: Status::OK,
            actual_length: 31,
            start_frame: 0,
            number_of_packets: 0,
            error_count: 0,
            data: Bytes::new(),
            iso_packets: vec![],
        }),
    );
}

#[test]
fn cmd_unlink() {
    check_command(
        &vector!("cmd_unlink"),
        false,
        ClientMessage::Unlink(CmdUnlink { seqnum: 6, devid: 0x0001_0001, unlink_seqnum: 5 }),
    );
}

#[test]
fn ret_unlink_econnreset() {
    let bytes = vector!("ret_unlink_econnreset");
    assert_eq!(&bytes[0x14..0x18], &(-104i32).to_be_bytes());
    // RET_UNLINK needs no submitted shape: an empty table must not matter.
    let expected = ServerMessage::Unlink(RetUnlink { seqnum: 6, status: Status::ECONNRESET });
    assert_eq!(encode_server(&expected), bytes);
    let mut buf = BytesMut::from(&bytes[..]);
    assert_eq!(urb::decode_return(&mut buf, &Limits::default(), |_| None), Ok(Some(expected)));
    assert!(buf.is_empty());
}

#[test]
fn ret_unlink_ok() {
    let bytes = vector!("ret_unlink_ok");
    let expected = ServerMessage::Unlink(RetUnlink { seqnum: 6, status: Status::OK });
    assert_eq!(encode_server(&expected), bytes);
    let mut buf = BytesMut::from(&bytes[..]);
    assert_eq!(urb::decode_return(&mut buf, &Limits::default(), |_| None), Ok(Some(expected)));
}

fn iso_in_packets() -> Vec<IsoPacketDescriptor> {
    (0..3).map(|i| IsoPacketDescriptor { offset: i * 192, length: 192, actual_length: 0, status: Status::OK }).collect()
}

#[test]
fn cmd_submit_iso_in() {
    let bytes = vector!("cmd_submit_iso_in");
    assert_eq!(bytes.len(), urb::HEADER_LEN + 3 * urb::ISO_DESCRIPTOR_LEN);
    check_command(
        &bytes,
        true,
        ClientMessage::Submit(CmdSubmit {
            seqnum: 7,
            devid: 0x0001_0001,
            direction: Direction::In,
            ep: 1,
            transfer_flags: TransferFlags(TransferFlags::DIR_IN | TransferFlags::ISO_ASAP),
            transfer_buffer_length: 576,
            start_frame: 0,
            number_of_packets: 3,
            interval: 1,
            setup: [0; 8],
            data: Bytes::new(),
            iso_packets: iso_in_packets(),
        }),
    );
}

#[test]
fn ret_submit_iso_in_compacted() {
    let bytes = vector!("ret_submit_iso_in");
    assert_eq!(bytes.len(), urb::HEADER_LEN + 292 + 3 * urb::ISO_DESCRIPTOR_LEN);
    let mut data = vec![0xa5; 192];
    data.extend_from_slice(&[0x5a; 100]);
    let mut packets = iso_in_packets();
    packets[0].actual_length = 192;
    packets[1].actual_length = 100;
    packets[2].status = Status::EXDEV;
    check_return(
        &bytes,
        SubmittedShape { direction: Direction::In, transfer_buffer_length: 576, iso_packets: Some(3) },
        ServerMessage::Submit(RetSubmit {
            seqnum: 7,
            status: Status::OK,
            actual_length: 292,
            start_frame: 0,
            number_of_packets: 3,
            error_count: 1,
            data: Bytes::from(data),
            iso_packets: packets,
        }),
    );
}

#[test]
fn cmd_submit_iso_out() {
    check_command(
        &vector!("cmd_submit_iso_out"),
        true,
        ClientMessage::Submit(CmdSubmit {
            seqnum: 8,
            devid: 0x0001_0001,
            direction: Direction::Out,
            ep: 2,
            transfer_flags: TransferFlags(TransferFlags::ISO_ASAP),
            transfer_buffer_length: 8,
            start_frame: 0,
            number_of_packets: 2,
            interval: 1,
            setup: [0; 8],
            data: Bytes::from_static(&[1, 2, 3, 4, 5, 6, 7, 8]),
            iso_packets: vec![
                IsoPacketDescriptor { offset: 0, length: 4, actual_length: 0, status: Status::OK },
                IsoPacketDescriptor { offset: 4, length: 4, actual_length: 0, status: Status::OK },
            ],
        }),
    );
}

#[test]
fn ret_submit_iso_out() {
    check_return(
        &vector!("ret_submit_iso_out"),
        SubmittedShape { direction: Direction::Out, transfer_buffer_length: 8, iso_packets: Some(2) },
        ServerMessage::Submit(RetSubmit {
            seqnum: 8,
            status: Status::OK,
            actual_length: 8,
            start_frame: 0,
            number_of_packets: 2,
            error_count: 0,
            data: Bytes::new(),
            iso_packets: vec![
                IsoPacketDescriptor { offset: 0, length: 4, actual_length: 4, status: Status::OK },
                IsoPacketDescriptor { offset: 4, length: 4, actual_length: 4, status: Status::OK },
            ],
        }),
    );
}

/// Each vector is exactly one message: back to back they decode one after another, and
/// nothing is left over.
#[test]
fn vectors_are_whole_messages_back_to_back() {
    let mut stream = BytesMut::new();
    for bytes in [vector!("cmd_submit_get_descriptor"), vector!("cmd_submit_bulk_out"), vector!("cmd_unlink")] {
        stream.extend_from_slice(&bytes);
    }
    let limits = Limits::default();
    let mut seen = Vec::new();
    while let Some(message) = urb::decode_command(&mut stream, &limits, |_, _| false).unwrap() {
        seen.push(message);
    }
    assert!(stream.is_empty());
    assert_eq!(seen.len(), 3);
    assert_eq!(seen[0], ClientMessage::Submit(get_descriptor()));
}
