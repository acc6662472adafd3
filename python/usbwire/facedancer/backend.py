"""Facedancer's backend interface on the device protocol: the server plays the USB host.

What a Facedancer board does in hardware is done here on the socket:

* SETUP requests go to ``USBDevice.handle_request`` one at a time (ep0 is one
  queue); the reply, acknowledgement or stall the handler makes answers it.
* OUT data is cut into the endpoint's packets and given to
  ``handle_data_available`` packet by packet, then acknowledged.
* An IN request is offered to the device with ``handle_nak`` (the board's "host
  asked, nothing primed" event) — for an interrupt endpoint at most once per
  ``bInterval``, as a host controller polls it — and answered from the packets
  the device sends: a short packet, or the length asked for, ends the transfer.
  Until then the request is NAKed.

``send_on_endpoint(..., blocking=True)`` does not wait for the host to read the
data: packets are queued per endpoint, in order, and the host takes them as it
asks; a device that queues more than :data:`MAX_QUEUED` bytes nobody reads is stopped.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Deque, Dict, List, Optional

from facedancer.backends.base import FacedancerBackend
from facedancer.core import FacedancerApp
from facedancer.errors import EndEmulation
from facedancer.logging import log
from facedancer.types import DeviceSpeed, USBDirection

from usbwire.device import codec
from usbwire.device.connection import Connection, ServerClosed
from usbwire.device.handlers import SetupPacket

#: Bytes a device may send on one IN endpoint ahead of the host's reads.
MAX_QUEUED = 16 << 20
#: How long one ``service_irqs`` waits for the server: short, so Facedancer's coroutines run.
POLL = 0.002

# Facedancer numbers speeds its own way; the hello carries USB/IP's numbers.
_SPEEDS = {DeviceSpeed.LOW: 1, DeviceSpeed.FULL: 2, DeviceSpeed.HIGH: 3, DeviceSpeed.SUPER: 5, DeviceSpeed.SUPER_PLUS: 6}


class _InRequest:
    def __init__(self, message: codec.In) -> None:
        self.id = message.id
        self.length = message.length
        self.data = bytearray()


class UsbwireApp(FacedancerApp, FacedancerBackend):
    """The ``usbwire`` backend: ``BACKEND=usbwire``, the socket from ``USBWIRE_DEVICE_SOCKET``."""

    app_name = "usbwire"

    def __init__(self, device=None, verbose: int = 0, quirks: Optional[List[str]] = None) -> None:  # type: ignore[no-untyped-def]
        FacedancerApp.__init__(self, device, verbose)
        self.connected_device = None
        self.connection: Optional[Connection] = None
        self.control: Deque[codec.Setup] = deque()
        self.current: Optional[codec.Setup] = None
        self.waiting: Dict[int, Deque[_InRequest]] = {}
        self.packets: Dict[int, Deque[bytes]] = {}
        self.naked: set = set()
        self.halted: set = set()
        self.last_offer: Dict[int, float] = {}
        self.queued: Dict[int, int] = {}
        self.speed = DeviceSpeed.FULL

    @classmethod
    def appropriate_for_environment(cls, backend_name: Optional[str]) -> bool:
        return backend_name == "usbwire"

    def get_version(self) -> str:
        return f"usbwire device protocol {codec.VERSION}"

    def connect(self, usb_device, max_packet_size_ep0: int = 64, device_speed=DeviceSpeed.FULL) -> None:  # type: ignore[no-untyped-def]
        self.connected_device = usb_device
        self.speed = device_speed
        self.connection = Connection(None, speed=_SPEEDS.get(device_speed, 2), ep0_max_packet=max_packet_size_ep0)
        log.info(f"usbwire: {usb_device.name} connected to {self.connection.path}")

    def disconnect(self) -> None:
        if self.connection:
            self.connection.close()
            self.connection = None

    def reset(self) -> None:
        self.control.clear()
        self.current = None
        self.waiting.clear()
        self.packets.clear()
        self.queued.clear()
        self.naked.clear()
        self.halted.clear()

    def set_address(self, address: int, defer: bool = False) -> None:
        """Nothing to do: the importing host's controller owns the address."""

    def configured(self, configuration) -> None:  # type: ignore[no-untyped-def]
        self.validate_configuration(configuration)
        self.halted.clear()

    def read_from_endpoint(self, endpoint_number: int) -> bytes:
        """Nothing is held back: OUT data goes to ``handle_data_available`` as it arrives."""
        return b""

    def send_on_control_endpoint(self, endpoint_number, in_request, data, blocking=True) -> None:  # type: ignore[no-untyped-def]
        self._answer_control(bytes(data))

    def send_on_endpoint(self, endpoint_number: int, data: bytes, blocking: bool = True) -> None:
        if endpoint_number == 0:
            self._answer_control(bytes(data))
            return
        queued = self.queued.get(endpoint_number, 0) + len(data)
        if queued > MAX_QUEUED:
            raise EndEmulation(
                f"EP{endpoint_number} IN: over {MAX_QUEUED} bytes sent that the host has not asked for; "
                "send from handle_data_requested, when the host asks"
            )
        self.queued[endpoint_number] = queued
        self.packets.setdefault(endpoint_number, deque()).append(bytes(data))
        self._fill(endpoint_number)

    def ack_status_stage(self, direction=USBDirection.OUT, endpoint_number: int = 0, blocking: bool = False) -> None:  # type: ignore[no-untyped-def]
        if endpoint_number == 0 and self.current is not None:
            self._answer_control(b"")

    def stall_endpoint(self, endpoint_number: int, direction=USBDirection.OUT) -> None:  # type: ignore[no-untyped-def]
        if endpoint_number == 0:
            if self.current is not None:
                self._send(codec.Stall(self.current.id))
                self.current = None
            return
        self.halted.add(endpoint_number | (0x80 if direction == USBDirection.IN else 0))
        self._fill(endpoint_number)

    def clear_halt(self, endpoint_number: int, direction) -> None:  # type: ignore[no-untyped-def]
        self.halted.discard(endpoint_number | (0x80 if direction == USBDirection.IN else 0))

    def service_irqs(self) -> None:
        if self.connection is None:
            raise EndEmulation("usbwire: not connected")
        try:
            for message in self.connection.receive(POLL):
                self._take(message)
            while self.current is None and self.control:
                self.current = self.control.popleft()
                raw = bytes(self.current.setup) + bytes(self.current.data)
                self.connected_device.handle_request(self.connected_device.create_request(raw))
            self._offer()
        except ServerClosed as closed:
            raise EndEmulation(f"usbwire: {closed}") from closed

    # The protocol side.

    def _send(self, message: codec.Message) -> None:
        if self.connection is not None:
            self.connection.send(message)

    def _take(self, message: codec.Message) -> None:
        if isinstance(message, codec.Setup):
            self.control.append(message)
        elif isinstance(message, codec.Out):
            self._out(message)
        elif isinstance(message, codec.In):
            self.waiting.setdefault(message.endpoint, deque()).append(_InRequest(message))
            self._fill(message.endpoint)
        elif isinstance(message, codec.Cancel):
            self._cancel(message.id)
        elif isinstance(message, codec.Reset):
            self.connected_device.handle_bus_reset()

    def _cancel(self, id_: int) -> None:
        if self.current is not None and self.current.id == id_:
            self.current = None
        self.control = deque(setup for setup in self.control if setup.id != id_)
        for endpoint, queue in self.waiting.items():
            self.waiting[endpoint] = deque(request for request in queue if request.id != id_)
        self.naked.discard(id_)

    def _answer_control(self, data: bytes) -> None:
        if self.current is None:
            log.warning(f"usbwire: ep0 data ({len(data)} bytes) with no control request waiting; dropped")
            return
        request, self.current = self.current, None
        setup = SetupPacket.parse(request.setup)
        if setup.is_in and setup.length > 0:
            self._send(codec.Data(request.id, data[: setup.length]))
        else:
            self._send(codec.Ack(request.id))

    def _endpoint(self, number: int, direction):  # type: ignore[no-untyped-def]
        configuration = getattr(self.connected_device, "configuration", None)
        return configuration.get_endpoint(number, direction) if configuration else None

    def _out(self, message: codec.Out) -> None:
        if message.endpoint in self.halted:
            self._send(codec.Stall(message.id))
            return
        endpoint = self._endpoint(message.endpoint, USBDirection.OUT)
        size = endpoint.max_packet_size if endpoint else 64
        data = message.data
        for start in range(0, max(len(data), 1), size):
            self.connected_device.handle_data_available(message.endpoint, data[start : start + size])
        self._send(codec.Ack(message.id))

    def _fill(self, number: int) -> None:
        """Answers the endpoint's waiting IN requests from its packets, oldest first."""
        waiting = self.waiting.get(number)
        packets = self.packets.get(number)
        if not waiting:
            return
        if number | 0x80 in self.halted:
            for request in waiting:
                self._send(codec.Stall(request.id))
            waiting.clear()
            return
        endpoint = self._endpoint(number, USBDirection.IN)
        size = endpoint.max_packet_size if endpoint else 64
        while waiting and packets:
            request, packet = waiting[0], packets.popleft()
            self.queued[number] -= len(packet)
            # A packet past the length asked for is babble: the server cuts it and fails the URB.
            request.data += packet
            if len(packet) < size or len(request.data) >= request.length:
                waiting.popleft()
                self.naked.discard(request.id)
                self._send(codec.Data(request.id, bytes(request.data)))

    def _offer(self) -> None:
        """Tells the device the host is asking (``handle_nak``), as often as the endpoint is polled."""
        now = time.monotonic()
        for number, waiting in list(self.waiting.items()):
            if not waiting or self.packets.get(number):
                continue
            endpoint = self._endpoint(number, USBDirection.IN)
            if now - self.last_offer.get(number, 0.0) >= _poll_interval(endpoint, self.speed):
                self.last_offer[number] = now
                self.connected_device.handle_nak(number)
            for request in self.waiting.get(number, ()):
                if request.id not in self.naked:
                    self.naked.add(request.id)
                    self._send(codec.Nak(request.id))


def _poll_interval(endpoint, speed) -> float:  # type: ignore[no-untyped-def]
    """Seconds between a host's polls of an interrupt endpoint; 0 for the others."""
    if endpoint is None or int(endpoint.transfer_type) != 3 or not endpoint.interval:
        return 0.0
    if speed == DeviceSpeed.HIGH:
        return (1 << (min(endpoint.interval, 16) - 1)) * 125e-6
    return endpoint.interval / 1000
