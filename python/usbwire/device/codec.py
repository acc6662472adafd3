"""The device protocol's frames (docs/protocol.md §9): bytes in, messages out, and back.

No socket and no clock here. A frame is ``u32 length`` (little-endian, counting
the type byte and the body), ``u8 type``, then the body. :func:`decode` takes
whole frames from the front of a buffer, leaves a partial one in place, and
refuses a length over :data:`MAX_FRAME_LEN` as soon as its prefix is there,
before the rest is buffered.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional, Union

#: What a device process sends first.
MAGIC = b"UWDP"
#: The protocol revision this codec speaks.
VERSION = 1
#: The length prefix and the type byte.
HEADER_LEN = 5
#: The largest ``length`` a frame may carry (16 MiB of data plus the largest fixed body).
MAX_FRAME_LEN = (16 << 20) + 64
#: The longest reason a ``Refuse`` carries.
MAX_REASON_LEN = 1024

# Device process -> server.
HELLO, DATA, ACK, NAK, STALL = 0x01, 0x11, 0x12, 0x13, 0x14
# Server -> device process.
WELCOME, REFUSE, SETUP, OUT, IN, CANCEL, RESET = 0x81, 0x82, 0x91, 0x92, 0x93, 0x94, 0x95


class CodecError(ValueError):
    """Bytes that are not a frame of this protocol; the connection cannot go on."""


@dataclass(frozen=True)
class Hello:
    """Device -> server, first: the revision, the speed (USB/IP numbers) and bMaxPacketSize0."""

    version: int
    speed: int
    ep0_max_packet: int


@dataclass(frozen=True)
class Data:
    """Device -> server: IN data answering request ``id``."""

    id: int
    data: bytes


@dataclass(frozen=True)
class _IdOnly:
    """The messages that carry a request id alone."""

    id: int


class Ack(_IdOnly):
    """Device -> server: request ``id`` is done."""


class Nak(_IdOnly):
    """Device -> server: request ``id`` is taken but not ready; its answer follows."""


class Stall(_IdOnly):
    """Device -> server: request ``id`` is refused (the endpoint stalls)."""


@dataclass(frozen=True)
class Welcome:
    """Server -> device: the hello is accepted."""

    version: int
    max_frame_len: int


@dataclass(frozen=True)
class Refuse:
    """Server -> device: why the server closes the connection."""

    reason: str


@dataclass(frozen=True)
class Setup:
    """Server -> device: a control request on ep0, with its OUT data stage."""

    id: int
    setup: bytes
    data: bytes = b""


@dataclass(frozen=True)
class Out:
    """Server -> device: OUT data for ``endpoint`` (1..=15)."""

    id: int
    endpoint: int
    data: bytes


@dataclass(frozen=True)
class In:
    """Server -> device: the host asks for up to ``length`` bytes from ``endpoint`` (1..=15)."""

    id: int
    endpoint: int
    length: int


class Cancel(_IdOnly):
    """Server -> device: request ``id`` was unlinked; send nothing for it."""


@dataclass(frozen=True)
class Reset:
    """Server -> device: a USB reset; every request is abandoned."""


Message = Union[Hello, Data, Ack, Nak, Stall, Welcome, Refuse, Setup, Out, In, Cancel, Reset]

_ID_ONLY = {Ack: ACK, Nak: NAK, Stall: STALL, Cancel: CANCEL}
_ID_ONLY_BY_TYPE = {kind: cls for cls, kind in _ID_ONLY.items()}


def encode(message: Message) -> bytes:
    """The whole frame of ``message``."""
    if isinstance(message, Hello):
        kind, body = HELLO, MAGIC + struct.pack("<HBB", message.version, message.speed, message.ep0_max_packet)
    elif isinstance(message, Data):
        kind, body = DATA, struct.pack("<I", message.id) + bytes(message.data)
    elif type(message) in _ID_ONLY:
        kind, body = _ID_ONLY[type(message)], struct.pack("<I", message.id)
    elif isinstance(message, Welcome):
        kind, body = WELCOME, struct.pack("<HI", message.version, message.max_frame_len)
    elif isinstance(message, Refuse):
        kind, body = REFUSE, message.reason.encode()[:MAX_REASON_LEN].decode(errors="ignore").encode()
    elif isinstance(message, Setup):
        if len(message.setup) != 8:
            raise ValueError(f"a SETUP packet is 8 bytes, not {len(message.setup)}")
        kind, body = SETUP, struct.pack("<I", message.id) + bytes(message.setup) + bytes(message.data)
    elif isinstance(message, Out):
        kind, body = OUT, struct.pack("<IB", message.id, message.endpoint) + bytes(message.data)
    elif isinstance(message, In):
        kind, body = IN, struct.pack("<IBI", message.id, message.endpoint, message.length)
    elif isinstance(message, Reset):
        kind, body = RESET, b""
    else:
        raise TypeError(f"not a device protocol message: {message!r}")
    if len(body) + 1 > MAX_FRAME_LEN:
        raise ValueError(f"a frame of {len(body) + 1} bytes is over the maximum {MAX_FRAME_LEN}: send less data")
    return struct.pack("<IB", len(body) + 1, kind) + body


def frame_len(buf: Union[bytes, bytearray]) -> Optional[int]:
    """The byte length of the frame at the front of ``buf`` once its prefix is there, else None."""
    if len(buf) < 4:
        return None
    (length,) = struct.unpack_from("<I", buf)
    if length == 0 or length > MAX_FRAME_LEN:
        raise CodecError(f"frame length {length} is outside 1..={MAX_FRAME_LEN}: not a usbwire device protocol peer")
    return 4 + length


def decode(buf: bytearray) -> Optional[Message]:
    """Takes one whole frame from the front of ``buf``; None (nothing taken) until all of it is there."""
    length = frame_len(buf)
    if length is None or len(buf) < length:
        return None
    kind, body = buf[4], bytes(buf[5:length])
    del buf[:length]
    return _parse_body(kind, body)


def _parse_body(kind: int, body: bytes) -> Message:
    def need(fixed: int, exact: bool) -> None:
        if len(body) < fixed or (exact and len(body) != fixed):
            raise CodecError(f"message type {kind:#04x} with a body of {len(body)} bytes: malformed frame")

    if kind == HELLO:
        need(8, True)
        if body[:4] != MAGIC:
            raise CodecError("hello without the UWDP magic: not a usbwire device process")
        version, speed, ep0 = struct.unpack_from("<HBB", body, 4)
        return Hello(version, speed, ep0)
    if kind == DATA:
        need(4, False)
        return Data(struct.unpack_from("<I", body)[0], body[4:])
    if kind in _ID_ONLY_BY_TYPE:
        need(4, True)
        return _ID_ONLY_BY_TYPE[kind](struct.unpack_from("<I", body)[0])
    if kind == WELCOME:
        need(6, True)
        return Welcome(*struct.unpack_from("<HI", body))
    if kind == REFUSE:
        if len(body) > MAX_REASON_LEN:
            raise CodecError(f"message type {kind:#04x} with a body of {len(body)} bytes: malformed frame")
        try:
            return Refuse(body.decode())
        except UnicodeDecodeError as error:
            raise CodecError("refusal reason is not UTF-8") from error
    if kind == SETUP:
        need(12, False)
        return Setup(struct.unpack_from("<I", body)[0], body[4:12], body[12:])
    if kind == OUT:
        need(5, False)
        id_, endpoint = struct.unpack_from("<IB", body)
        return Out(id_, endpoint, body[5:])
    if kind == IN:
        need(9, True)
        return In(*struct.unpack_from("<IBI", body))
    if kind == RESET:
        need(0, True)
        return Reset()
    raise CodecError(f"unknown message type {kind:#04x}; upgrade usbwire (the server or this library)")
