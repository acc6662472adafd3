"""A Facedancer backend on usbwire: Facedancer's device scripts served by ``usbwire serve``.

``BACKEND=usbwire python3 script.py`` (with ``usbwire-facedancer.pth`` installed by pip,
which registers the backend when facedancer is imported), or
``python3 -m usbwire.facedancer script.py`` / ``python3 -m usbwire.facedancer -m module``.
The socket is ``USBWIRE_DEVICE_SOCKET`` (see :func:`usbwire.device.socket_path`).
Importing this module registers the backend class with Facedancer.
"""

from .backend import UsbwireApp

__all__ = ["UsbwireApp"]
