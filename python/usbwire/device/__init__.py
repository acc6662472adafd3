"""A USB device in Python, served by ``usbwire serve --virtual external=unix:PATH``.

Standard library only. A device is its descriptors and handlers::

    from usbwire.device import Device, Endpoint, Interface, NAK

    echo = Device(vendor_id=0x1209, product_id=0x0008, product="Python echo",
                  interfaces=[Interface(endpoints=[Endpoint(0x81), Endpoint(0x02)])])
    written = []

    @echo.on_out(0x02)
    def take(data): written.append(data)

    @echo.on_in(0x81)
    def give(length): return written.pop(0) if written else NAK

    echo.run()  # the socket: USBWIRE_DEVICE_SOCKET, or run(path)

The protocol itself (``docs/protocol.md`` §9) is :mod:`usbwire.device.codec`;
the socket :mod:`usbwire.device.connection`.
"""

from .connection import DeviceProtocolError, Refused, ServerClosed, default_socket_path, socket_path
from .core import Device
from .handlers import NAK, STALL, SetupPacket
from .descriptors import Endpoint, Interface

__all__ = [
    "NAK",
    "STALL",
    "Device",
    "DeviceProtocolError",
    "Endpoint",
    "Interface",
    "Refused",
    "ServerClosed",
    "SetupPacket",
    "default_socket_path",
    "socket_path",
]
