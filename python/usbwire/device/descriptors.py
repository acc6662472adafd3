"""USB descriptors from Python objects: device, configuration, interface, endpoint, string.

For low-, full- and high-speed devices. A SuperSpeed device needs endpoint
companion and BOS descriptors this module does not build: give ``Device`` its
descriptors as bytes instead.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Sequence, Union

DEVICE, CONFIGURATION, STRING, INTERFACE, ENDPOINT = 1, 2, 3, 4, 5

#: USB/IP's speed numbers, which the hello carries.
SPEEDS = {"low": 1, "full": 2, "high": 3, "super": 5, "super-plus": 6}

_TRANSFER_TYPES = {"control": 0, "isochronous": 1, "bulk": 2, "interrupt": 3}


def speed_number(speed: Union[str, int]) -> int:
    """USB/IP's number for ``speed`` (a name of :data:`SPEEDS`, or the number itself)."""
    if isinstance(speed, int):
        if speed not in SPEEDS.values():
            raise ValueError(f"speed {speed} is not one of USB/IP's numbers {sorted(SPEEDS.values())}")
        return speed
    try:
        return SPEEDS[speed]
    except KeyError:
        raise ValueError(f"unknown speed {speed!r}: use one of {', '.join(SPEEDS)}") from None


@dataclass
class Endpoint:
    """One endpoint: ``address`` with bit 7 set for IN (0x81), ``kind`` "bulk" or "interrupt"."""

    address: int
    kind: str = "bulk"
    max_packet: int = 0
    """0: the largest the speed allows for the kind (bulk 512 at high speed, 64 at full)."""
    interval: int = 0
    """bInterval: frames (full speed) or 2^(n-1) microframes (high speed); interrupt only."""

    def descriptor(self, speed: int) -> bytes:
        if self.kind not in _TRANSFER_TYPES or self.kind == "control":
            raise ValueError(f"endpoint {self.address:#04x}: kind {self.kind!r} is not bulk, interrupt or isochronous")
        if not 1 <= self.address & 0x0F <= 15 or self.address & 0x70:
            raise ValueError(f"endpoint address {self.address:#04x} is not 0x01..0x0f or 0x81..0x8f")
        max_packet = self.max_packet or _default_max_packet(self.kind, speed)
        interval = self.interval or (1 if self.kind == "interrupt" else 0)
        return struct.pack("<BBBBHB", 7, ENDPOINT, self.address, _TRANSFER_TYPES[self.kind], max_packet, interval)


@dataclass
class Interface:
    """One interface (alternate setting 0) with its endpoints; ``extra`` (a HID descriptor, say) goes before them."""

    class_: int = 0xFF
    subclass: int = 0
    protocol: int = 0
    endpoints: Sequence[Endpoint] = field(default_factory=list)
    extra: bytes = b""
    name: str = ""
    """An interface string; ``Device`` gives it an index."""


def _default_max_packet(kind: str, speed: int) -> int:
    if speed == SPEEDS["low"]:
        return 8
    if speed == SPEEDS["high"] and kind in ("bulk", "isochronous"):
        return 512
    if speed >= SPEEDS["super"]:
        raise ValueError("SuperSpeed descriptors need endpoint companions: give the descriptors as bytes")
    return 64


def device_descriptor(
    *,
    vendor_id: int,
    product_id: int,
    speed: int,
    ep0_max_packet: int,
    device_class: int = 0,
    subclass: int = 0,
    protocol: int = 0,
    bcd_device: int = 0x0100,
    strings: Sequence[int] = (0, 0, 0),
    num_configurations: int = 1,
) -> bytes:
    """The 18-byte device descriptor; ``strings`` are the manufacturer, product and serial indexes."""
    bcd_usb = 0x0110 if speed <= SPEEDS["full"] else 0x0200
    return struct.pack(
        "<BBHBBBBHHHBBBB",
        18,
        DEVICE,
        bcd_usb,
        device_class,
        subclass,
        protocol,
        ep0_max_packet,
        vendor_id,
        product_id,
        bcd_device,
        *strings,
        num_configurations,
    )


def configuration_descriptor(
    interfaces: Sequence[Interface],
    *,
    speed: int,
    value: int = 1,
    max_power_ma: int = 100,
    interface_strings: Sequence[int] = (),
) -> bytes:
    """The configuration descriptor with its interfaces and endpoints, numbered 0, 1, … in order."""
    body = b""
    for number, interface in enumerate(interfaces):
        string = interface_strings[number] if number < len(interface_strings) else 0
        head = (9, INTERFACE, number, 0, len(interface.endpoints), interface.class_, interface.subclass)
        body += struct.pack("<BBBBBBBBB", *head, interface.protocol, string)
        body += interface.extra + b"".join(endpoint.descriptor(speed) for endpoint in interface.endpoints)
    total = 9 + len(body)
    if total > 0xFFFF:
        raise ValueError(f"a configuration of {total} bytes is over wTotalLength's 65535")
    power = min(max_power_ma // 2, 250)
    return struct.pack("<BBHBBBBB", 9, CONFIGURATION, total, len(interfaces), value, 0, 0x80, power) + body


def string_descriptor(text: str) -> bytes:
    """A string descriptor (UTF-16LE), cut at 126 characters, the most one can hold."""
    encoded = text.encode("utf-16-le")[: 2 * 126]
    return bytes([2 + len(encoded), STRING]) + encoded


#: String descriptor 0: the one language, US English.
LANGUAGES = bytes([4, STRING, 0x09, 0x04])
