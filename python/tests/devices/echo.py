"""The README's ten-line device: what is written to bulk OUT 0x02 comes back on bulk IN 0x81."""

import sys

from usbwire.device import NAK, Device, Endpoint, Interface

echo = Device(vendor_id=0x1209, product_id=0x0008, manufacturer="usbwire", product="Python echo",
              serial=sys.argv[1] if len(sys.argv) > 1 else "PY-1",
              interfaces=[Interface(endpoints=[Endpoint(0x81, "bulk"), Endpoint(0x02, "bulk")])])
written = []

@echo.on_out(0x02)
def take(data): written.append(data)

@echo.on_in(0x81)
def give(length): return written.pop(0) if written else NAK

echo.run()
