"""A USB device in Python: descriptors and handlers, served over the device protocol.

A handler answers with bytes (IN data), None (done: ACK, or no IN data), :data:`NAK`
(not ready: asked again later, oldest request of an endpoint first) or :data:`STALL`.
Standard requests the handlers leave alone (GET_DESCRIPTOR, SET_CONFIGURATION, …)
are answered from the descriptors.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from . import descriptors as d
from .connection import Connection, ServerClosed
from .handlers import STALL, ControlHandler, InHandler, OutHandler, Reply, SetupPacket
from .serve import Server


GET_STATUS, CLEAR_FEATURE, SET_FEATURE, SET_ADDRESS, GET_DESCRIPTOR = 0, 1, 3, 5, 6
GET_CONFIGURATION, SET_CONFIGURATION, GET_INTERFACE, SET_INTERFACE = 8, 9, 10, 11


class Device:
    """A USB device: its descriptors (built from arguments, or given as bytes) and its handlers.

    ``descriptors`` adds descriptors GET_DESCRIPTOR may ask for by ``(type, index)``
    (a HID report descriptor: ``{(0x22, 0): report}``); ``device_descriptor`` and
    ``configuration`` replace the built ones.
    """

    def __init__(
        self,
        *,
        vendor_id: int,
        product_id: int,
        interfaces: Sequence[d.Interface] = (),
        speed: Union[str, int] = "high",
        ep0_max_packet: int = 64,
        device_class: int = 0,
        subclass: int = 0,
        protocol: int = 0,
        bcd_device: int = 0x0100,
        manufacturer: str = "",
        product: str = "",
        serial: str = "",
        max_power_ma: int = 100,
        descriptors: Optional[Dict[Tuple[int, int], bytes]] = None,
        device_descriptor: Optional[bytes] = None,
        configuration: Optional[bytes] = None,
    ) -> None:
        self.speed = d.speed_number(speed)
        self.ep0_max_packet = ep0_max_packet
        self.strings: List[str] = []
        index = self._string
        names = (index(manufacturer), index(product), index(serial))
        interface_strings = [index(interface.name) for interface in interfaces]
        self.descriptors: Dict[Tuple[int, int], bytes] = {
            (d.DEVICE, 0): device_descriptor
            or d.device_descriptor(
                vendor_id=vendor_id,
                product_id=product_id,
                speed=self.speed,
                ep0_max_packet=ep0_max_packet,
                device_class=device_class,
                subclass=subclass,
                protocol=protocol,
                bcd_device=bcd_device,
                strings=names,
            ),
            (d.CONFIGURATION, 0): configuration
            or d.configuration_descriptor(
                interfaces, speed=self.speed, max_power_ma=max_power_ma, interface_strings=interface_strings
            ),
            (d.STRING, 0): d.LANGUAGES,
        }
        for number, text in enumerate(self.strings, start=1):
            self.descriptors[(d.STRING, number)] = d.string_descriptor(text)
        self.descriptors.update(descriptors or {})
        self.configuration_value = self.descriptors[(d.CONFIGURATION, 0)][5]
        self.configured = 0
        self.control_handlers: List[Tuple[Optional[int], Optional[int], ControlHandler]] = []
        self.out_handlers: Dict[int, OutHandler] = {}
        self.in_handlers: Dict[int, InHandler] = {}
        self.reset_handlers: List[Callable[[], None]] = []
        self.halted: set = set()
        self.stopping = False

    def _string(self, text: str) -> int:
        if not text:
            return 0
        self.strings.append(text)
        return len(self.strings)

    # Handlers, as decorators.

    def on_control(self, request_type: Optional[int] = None, request: Optional[int] = None):
        """Handles control requests matching ``request_type`` and ``request`` (None: any), before the standard ones."""

        def register(handler: ControlHandler) -> ControlHandler:
            self.control_handlers.append((request_type, request, handler))
            return handler

        return register

    def on_out(self, endpoint: int):
        """Handles OUT data for ``endpoint`` (0x01..0x0f): ``handler(data)``."""

        def register(handler: OutHandler) -> OutHandler:
            self.out_handlers[endpoint & 0x0F] = handler
            return handler

        return register

    def on_in(self, endpoint: int):
        """Answers IN requests of ``endpoint`` (0x81..0x8f): ``handler(length)`` returns bytes, NAK or STALL."""

        def register(handler: InHandler) -> InHandler:
            self.in_handlers[endpoint & 0x0F] = handler
            return handler

        return register

    def on_reset(self, handler: Callable[[], None]) -> Callable[[], None]:
        """Called on a USB reset (the device is unconfigured, waiting requests dropped)."""
        self.reset_handlers.append(handler)
        return handler

    def stop(self) -> None:
        """Makes :meth:`run` return (from a handler or ``tick``); the device is unplugged."""
        self.stopping = True

    # Serving.

    def run(self, path: Optional[str] = None, *, tick: Optional[Callable[[], None]] = None, poll: float = 0.01) -> None:
        """Connects to the server and serves until it closes the connection or :meth:`stop`.

        ``tick`` is called at least every ``poll`` seconds; waiting requests are asked again as often.
        """
        self.stopping = False
        connection = Connection(path, speed=self.speed, ep0_max_packet=self.ep0_max_packet)
        try:
            Server(self, connection).run(tick, poll)
        except ServerClosed:
            pass
        finally:
            connection.close()

    def control(self, setup: SetupPacket, data: bytes) -> Reply:
        """The answer to a control request: the first matching handler's, else the standard one."""
        for request_type, request, handler in self.control_handlers:
            if request_type in (None, setup.request_type) and request in (None, setup.request):
                return handler(setup, data)
        return self.standard(setup)

    def standard(self, setup: SetupPacket) -> Reply:
        """Chapter 9's requests, answered from the descriptors; anything else stalls."""
        kind, request, value = setup.request_type, setup.request, setup.value
        if request == GET_DESCRIPTOR and kind in (0x80, 0x81):
            return self.descriptors.get((value >> 8, value & 0xFF), STALL)
        if request == GET_STATUS and kind in (0x80, 0x81, 0x82):
            halted = kind == 0x82 and setup.index & 0x8F in self.halted
            return bytes([1 if halted else 0, 0])
        if (kind, request) == (0x00, SET_CONFIGURATION) and value in (0, self.configuration_value):
            self.configured = value
            self.halted.clear()
            return None
        if (kind, request) == (0x80, GET_CONFIGURATION):
            return bytes([self.configured])
        if (kind, request) == (0x01, SET_INTERFACE) and value == 0:
            return None
        if (kind, request) == (0x81, GET_INTERFACE):
            return b"\x00"
        if kind == 0x02 and request in (CLEAR_FEATURE, SET_FEATURE) and value == 0:
            (self.halted.discard if request == CLEAR_FEATURE else self.halted.add)(setup.index & 0x8F)
            return None
        if (kind, request) == (0x00, SET_ADDRESS):
            return None
        return STALL

    def reset(self) -> None:
        self.configured = 0
        self.halted.clear()
        for handler in self.reset_handlers:
            handler()

