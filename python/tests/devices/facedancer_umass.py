"""Facedancer's shipped mass-storage device on a raw disk image (argv[1]), as Facedancer's
mass-storage example runs it."""

import sys

from facedancer.devices.umass import RawDiskImage, USBMassStorageDevice
from facedancer.logging import configure_default_logging

configure_default_logging(level=30)
device = USBMassStorageDevice(RawDiskImage(sys.argv[1], 512))
device.emulate()
