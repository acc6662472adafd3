"""Facedancer's shipped keyboard typing "usbwire" again and again, as Facedancer's
rubber-ducky example drives it."""

import asyncio

from facedancer import main
from facedancer.devices.keyboard import USBKeyboardDevice

device = USBKeyboardDevice()


async def type_letters():
    await asyncio.sleep(0.5)
    while True:
        await device.type_string("usbwire\n", duration=0.05)
        await asyncio.sleep(0.2)


main(device, type_letters())
