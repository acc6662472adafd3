"""A vendor device for the tests: control requests in and out, a STALL, and an interrupt IN
endpoint (0x83) that NAKs until its report is due, 0.5 s after the host first asks."""

import time

from usbwire.device import NAK, STALL, Device, Endpoint, Interface

device = Device(vendor_id=0x1209, product_id=0x0009, speed="full", manufacturer="usbwire",
                product="Python vendor", serial="V-1",
                interfaces=[Interface(endpoints=[Endpoint(0x83, "interrupt", max_packet=8, interval=1)])])
stored = bytearray(b"nothing yet")
due = []


@device.on_control(request_type=0x40, request=0x02)
def store(setup, data):
    stored[:] = data


@device.on_control(request_type=0xC0, request=0x01)
def load(setup, data):
    return bytes(stored)


@device.on_control(request_type=0xC0, request=0x03)
def refuse(setup, data):
    return STALL


@device.on_in(0x83)
def report(length):
    if not due:
        due.append(time.monotonic() + 0.5)
    if time.monotonic() < due[0]:
        return NAK
    due.clear()
    return b"\x01\x02\x03\x04"


device.run()
