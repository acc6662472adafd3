"""What a handler is asked and what it answers: a control request's
:class:`SetupPacket`, the answers (bytes, None, :data:`NAK`, :data:`STALL`) and
the handlers' signatures.

Below both the device (:mod:`usbwire.device.core`, which registers handlers)
and its serving loop (:mod:`usbwire.device.serve`, which calls them). Not for
the protocol's messages (:mod:`usbwire.device.codec`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable, Union


class _Answer:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


#: "Not ready yet": the request waits and its handler is asked again.
NAK = _Answer("NAK")
#: "Refused": the endpoint (or ep0, for this request) stalls.
STALL = _Answer("STALL")

Reply = Union[bytes, bytearray, None, _Answer]


@dataclass(frozen=True)
class SetupPacket:
    """A control request's 8-byte SETUP packet, parsed."""

    request_type: int
    request: int
    value: int
    index: int
    length: int

    @classmethod
    def parse(cls, raw: bytes) -> "SetupPacket":
        return cls(*struct.unpack("<BBHHH", raw))

    @property
    def is_in(self) -> bool:
        return bool(self.request_type & 0x80)


ControlHandler = Callable[[SetupPacket, bytes], Reply]
OutHandler = Callable[[bytes], Reply]
InHandler = Callable[[int], Reply]
