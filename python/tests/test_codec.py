"""The codec against the golden vectors the Rust codec reads too, and its bounds."""

from __future__ import annotations

from pathlib import Path

import pytest

from usbwire.device import codec

VECTORS = Path(__file__).resolve().parents[2] / "tests" / "vectors" / "device_protocol.txt"

MESSAGES = {
    "hello": codec.Hello(1, 3, 64),
    "data": codec.Data(7, b"\x12\x01"),
    "ack": codec.Ack(0x01020304),
    "nak": codec.Nak(2),
    "stall": codec.Stall(3),
    "welcome": codec.Welcome(1, codec.MAX_FRAME_LEN),
    "refuse": codec.Refuse("busy"),
    "setup": codec.Setup(1, bytes([0x80, 0x06, 0x00, 0x01, 0x00, 0x00, 0x12, 0x00])),
    "out": codec.Out(9, 2, b"hi"),
    "in": codec.In(10, 1, 512),
    "cancel": codec.Cancel(10),
    "reset": codec.Reset(),
}


def vectors() -> dict:
    found = {}
    for line in VECTORS.read_text().splitlines():
        tokens = line.split("#")[0].split()
        if tokens:
            found[tokens[0]] = bytes.fromhex("".join(tokens[1:]))
    return found


def test_every_message_type_has_a_vector_and_every_vector_a_message():
    assert set(vectors()) == set(MESSAGES)


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_golden_bytes_decode_and_encode(name):
    wire = vectors()[name]
    assert codec.encode(MESSAGES[name]) == wire
    buffer = bytearray(wire)
    decoded = codec.decode(buffer)
    assert decoded == MESSAGES[name] and type(decoded) is type(MESSAGES[name])
    assert buffer == b"", "consumed whole"


def test_every_split_of_the_stream_decodes_the_same():
    stream = b"".join(vectors()[name] for name in sorted(MESSAGES))
    for cut in range(len(stream) + 1):
        buffer, decoded = bytearray(), []
        for part in (stream[:cut], stream[cut:]):
            buffer += part
            while (message := codec.decode(buffer)) is not None:
                decoded.append(message)
        assert decoded == [MESSAGES[name] for name in sorted(MESSAGES)], cut


def test_a_partial_frame_consumes_nothing():
    buffer = bytearray(b"\x05\x00\x00\x00\x12\x04\x03")
    assert codec.decode(buffer) is None
    assert len(buffer) == 7


def test_an_oversized_length_is_refused_from_its_prefix_alone():
    with pytest.raises(codec.CodecError, match="outside"):
        codec.decode(bytearray(b"\x41\x00\x00\x01"))  # MAX_FRAME_LEN + 1, nothing after it
    with pytest.raises(codec.CodecError, match="outside"):
        codec.decode(bytearray(b"\x00\x00\x00\x00"))
    assert codec.frame_len(b"\x40\x00\x00\x01") == 4 + codec.MAX_FRAME_LEN


@pytest.mark.parametrize(
    "wire, complaint",
    [
        (b"\x04\x00\x00\x00\x12\x01\x02\x03", "body of 3 bytes"),
        (b"\x09\x00\x00\x00\x01UWDX\x01\x00\x03\x40", "magic"),
        (b"\x01\x00\x00\x00\x7f", "unknown message type 0x7f"),
        (b"\x03\x00\x00\x00\x82\xff\xfe", "UTF-8"),
        (b"\x02\x00\x00\x00\x95\x00", "body of 1 bytes"),
    ],
)
def test_malformed_bodies_are_named(wire, complaint):
    with pytest.raises(codec.CodecError, match=complaint):
        codec.decode(bytearray(wire))


def test_a_long_refusal_is_cut_at_a_character():
    wire = codec.encode(codec.Refuse("é" * codec.MAX_REASON_LEN))
    message = codec.decode(bytearray(wire))
    assert message == codec.Refuse("é" * (codec.MAX_REASON_LEN // 2))


def test_data_over_the_maximum_frame_is_refused_before_sending():
    with pytest.raises(ValueError, match="over the maximum"):
        codec.encode(codec.Data(1, bytes(codec.MAX_FRAME_LEN)))
