"""usbwire in Python: USB devices served by ``usbwire serve --virtual external=unix:PATH``.

* :mod:`usbwire.device`: a device from descriptors and handlers (standard library only);
* :mod:`usbwire.facedancer`: a Facedancer backend, so Facedancer's device scripts run on usbwire.
"""
